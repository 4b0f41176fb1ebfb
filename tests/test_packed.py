"""fp16-packed weights (``models.packed``): the kernel computes the fp16-rounded model, tree
verification still matches a causal forward, greedy speculation on the packed target equals
vanilla greedy on it (n-gram, the shipped EAGLE-3, Medusa and EAGLE-1 heads, packed too), bad input errors."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import assert_same_or_tie, tiny_llama
from verispec import LLM, SamplingParams
from verispec.models.loading import load_model
from verispec.models import fp16_kernel
from verispec.models.packed import PackedFP16Linear, WeightFormat, fp16_packing_available, shared_reader
from verispec.core.tree import DraftTree

pytestmark = pytest.mark.skipif(not fp16_packing_available(), reason="no FBGEMM fp16 kernels here")


def test_packed_linear_computes_the_fp16_rounded_weight(single_thread):
    torch.manual_seed(0)
    lin = nn.Linear(96, 80)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    packed = PackedFP16Linear(lin)
    rounded = w.half().float()
    assert torch.equal(lin.weight, rounded) and packed.weight is lin.weight   # rounded in place, shared
    assert not torch.equal(rounded, w)
    for m in (1, 2, 5, 16):
        x = torch.randn(m, 96)
        torch.testing.assert_close(packed(x), F.linear(x, rounded, b), rtol=1e-5, atol=1e-5)
    assert packed(torch.randn(2, 3, 96)).shape == (2, 3, 80)


def test_packed_model_matches_its_dense_twin_and_tree_forward(single_thread):
    dense = tiny_llama(64, 32, 3).fuse_()
    packed = copy.deepcopy(dense).pack_fp16_()
    with torch.no_grad():
        for name, m in packed.named_modules():        # the dense twin of the packed model
            if isinstance(m, PackedFP16Linear):
                w = dense.get_submodule(name).weight
                w.copy_(w.half().float())
        ids = torch.randint(0, 64, (2, 12))
        pos = torch.arange(12).expand(2, 12)
        torch.testing.assert_close(packed(ids, pos).logits, dense(ids, pos).logits, rtol=1e-4, atol=1e-4)
        tree = DraftTree(torch.tensor([5, 9, 7, 3]), torch.tensor([-1, -1, 0, 2]))
        prefix = [1, 2, 3]                            # the last one is the tree's root
        n = len(prefix) - 1                           # committed tokens before the root
        toks = torch.tensor([prefix + tree.tokens.tolist()])
        mask = torch.ones(n + 5, n + 5, dtype=torch.bool).tril()
        mask[n:, n:] = tree.ancestor_mask()
        tpos = torch.cat([torch.arange(n), tree.positions(n)])[None]
        out = packed(toks, tpos, attn_mask=mask[None]).logits[0]
        for node, path in ((2, [0, 2]), (3, [0, 2, 3]), (1, [1])):
            seq = torch.tensor([prefix + tree.tokens[path].tolist()])
            plain = packed(seq, torch.arange(seq.shape[1])[None]).logits[0, -1]
            torch.testing.assert_close(out[n + 1 + node], plain, rtol=1e-4, atol=1e-4)


def test_bad_weight_formats_are_rejected():
    with pytest.raises(ValueError, match="unknown weight format 'int3'"):
        WeightFormat.parse("int3")
    with pytest.raises(ValueError, match="fp32"):
        load_model("smollm2-135m", dtype="bfloat16", weights="fp16")
    with pytest.raises(ValueError, match="fp32 weights"):
        PackedFP16Linear(nn.Linear(8, 8).to(torch.bfloat16))
    with pytest.raises(ValueError, match="pack the target first"):
        shared_reader(torch.zeros(8, 8), PackedFP16Linear(nn.Linear(8, 8)))
    with pytest.raises(TypeError, match="fp32 activations"):
        PackedFP16Linear(nn.Linear(8, 8))(torch.randn(2, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "eagle3"},
    {"method": "medusa"},
    {"method": "eagle"},
], ids=["ngram", "eagle3", "medusa", "eagle"])
def test_greedy_on_packed_target_equals_its_vanilla(packed_target, head_prompts, spec):
    greedy = SamplingParams(temperature=0, max_tokens=32)
    batch = [{"prompt_token_ids": p} for p in head_prompts]
    want = LLM(loaded=packed_target, max_num_seqs=4).generate(batch, greedy)
    # whole trees every step: at batch 4 the draft-budget estimator may find drafting too dear here
    llm = LLM(loaded=packed_target, max_num_seqs=4, speculative_config={**spec, "adaptive_drafting": False})
    got = llm.generate(batch, greedy)
    for p, g, w in zip(head_prompts, got, want):
        assert_same_or_tie(packed_target.model, p, g.token_ids, w.token_ids, f"packed {spec['method']}")
    assert sum(o.metrics.num_drafts for o in got) > 0
    drafter = llm.make_engine(1, 64).drafter
    head = getattr(drafter, "head", None) or getattr(drafter, "heads", None)
    if head is not None:                                   # the heads draft with packed kernels too
        assert any(isinstance(m, PackedFP16Linear) for m in head.modules())
        reader = head.__dict__.get("_lm_reader")           # tokens read through the target's LM head:
        assert reader is None or reader is packed_target.model.lm_head   # its packing, not a copy


def test_split_matrix_is_bit_identical_on_one_and_two_threads(monkeypatch):
    """torch backend: a matrix over ``SPLIT_MIN_BYTES`` is packed as two column halves computed on
    two threads: every output element comes from the same kernel over the same inputs, so the
    product is bit-identical to the unsplit one, with and without the helper thread."""
    from verispec.models import packed as packed_mod
    torch.manual_seed(0)
    lin = nn.Linear(64, 300)
    whole = PackedFP16Linear(copy.deepcopy(lin), backend="torch")
    monkeypatch.setattr(packed_mod, "SPLIT_MIN_BYTES", 1)
    split = PackedFP16Linear(copy.deepcopy(lin), backend="torch")
    assert len(whole._parts) == 1 and len(split._parts) == 2
    assert split._parts[0][0] is not None and split.out_features == 300
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (1, 5, 33):
                x = torch.randn(m, 64)
                assert torch.equal(split(x), whole(x))
            assert split(torch.randn(2, 3, 64)).shape == (2, 3, 300)
    finally:
        torch.set_num_threads(before)


threaded = pytest.mark.skipif(fp16_kernel.kernel() is None,
                              reason=f"threaded fp16 kernel unavailable: {fp16_kernel.unavailable_reason()}")


@threaded
@pytest.mark.parametrize("shape", [(64, 300), (576, 960), (96, 33)], ids=str)
def test_threaded_kernel_is_bit_identical_to_torch_op_on_any_thread_count(shape):
    """The threaded op splits the output's column blocks over threads (fringe columns included,
    as in 33 outputs): bit-identical to torch's single-threaded op and to itself on one thread,
    with and without bias, at decode and verify sizes."""
    k, n = shape
    torch.manual_seed(0)
    for bias in (True, False):
        lin = nn.Linear(k, n, bias=bias)
        mt = PackedFP16Linear(copy.deepcopy(lin), backend="threaded")
        ref = PackedFP16Linear(copy.deepcopy(lin), backend="torch")
        assert mt.backend == "threaded" and ref.backend == "torch" and torch.equal(mt.weight, ref.weight)
        before = torch.get_num_threads()
        try:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for m in (1, 2, 4, 8, 17):
                    x = torch.randn(1, m, k)
                    want = ref(x)
                    assert torch.equal(mt(x), want), (threads, m)
                    for most in (1, 2, 3):     # the op's own cap (the module's depends on OMP's policy)
                        got = fp16_kernel.kernel().linear(x, mt._buf, mt._meta, mt._bias, most)
                        assert torch.equal(got, want), (threads, m, most)
        finally:
            torch.set_num_threads(before)


@threaded
def test_threaded_kernel_rejects_bad_input():
    ext = fp16_kernel.kernel()
    mt = PackedFP16Linear(nn.Linear(32, 48), backend="threaded")
    with pytest.raises(RuntimeError, match="input has 31 features, the weight takes 32"):
        mt(torch.randn(2, 31))
    with pytest.raises(RuntimeError, match="bias has 47 elements"):
        ext.linear(torch.randn(2, 32), mt._buf, mt._meta, torch.zeros(47), 2)
    with pytest.raises(RuntimeError, match="bad meta"):
        ext.linear(torch.randn(2, 32), mt._buf, mt._meta[:5], None, 2)
    with pytest.raises(RuntimeError, match="too small"):
        ext.linear(torch.randn(2, 32), mt._buf[:100], mt._meta, None, 2)
    with pytest.raises(RuntimeError, match="2-D"):
        ext.pack(torch.randn(4, 4, 4))
    with pytest.raises(ValueError, match="unknown fp16 backend"):
        PackedFP16Linear(nn.Linear(8, 8), backend="cuda")
    assert mt(torch.randn(0, 32)).shape == (0, 48)


def test_torch_op_only_context_and_env_fall_back():
    """Benchmarks' baseline: matrices packed inside ``torch_op_only()`` use torch's op."""
    with fp16_kernel.torch_op_only():
        assert PackedFP16Linear(nn.Linear(8, 8)).backend == "torch"
        with pytest.raises(RuntimeError, match="unavailable: inside torch_op_only"):
            PackedFP16Linear(nn.Linear(8, 8), backend="threaded")


def test_long_inputs_use_the_dense_kernel_with_the_same_rounded_weights(single_thread):
    """Prefill-length inputs (T >= DENSE_MIN_ROWS) go to the fp32 BLAS over the rounded weights;
    short ones (decode, verification) to FBGEMM, whatever the batch size."""
    from verispec.models import packed as packed_mod
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    packed = PackedFP16Linear(lin, backend="torch")
    t = packed_mod.DENSE_MIN_ROWS
    long_x = torch.randn(2, t, 64)
    assert torch.equal(packed(long_x), F.linear(long_x, lin.weight, lin.bias))
    short_x = torch.randn(t, 3, 64)                 # many rows, short sequences: FBGEMM
    fb = torch.fbgemm_linear_fp16_weight(short_x.reshape(-1, 64).contiguous(), packed._parts[0][0],
                                         packed._parts[0][1]).reshape(t, 3, 48)
    assert torch.equal(packed(short_x), fb)
    torch.testing.assert_close(packed(long_x[:, :5]), packed(long_x)[:, :5], rtol=1e-5, atol=1e-5)


def _packer(kind: str):
    """(pack method name, packed class) of a weights option, skipped where its kernel is missing."""
    if kind == "int4":
        from verispec.models.int4 import PackedInt4Linear, int4_available
        if not int4_available():
            pytest.skip("no int4pack kernel here")
        return "pack_int4_", PackedInt4Linear
    if kind == "int8":
        from verispec.models.int8 import PackedInt8Linear, int8_available
        if not int8_available():
            pytest.skip("no int8 kernel here")
        return "pack_int8_", PackedInt8Linear
    return "pack_fp16_", PackedFP16Linear


@pytest.mark.parametrize("kind", ["fp16", "int4", "int8"])
def test_packed_layers_release_their_fp32_weights_and_rebuild_them_bit_for_bit(kind, single_thread):
    """A packed model keeps no fp32 matrix in its decoder layers (the 1.5B Qwen: 8.3 GB with fp16
    weights instead of 11); each layer rebuilds the very weight a kept parameter would hold, and
    prefill computes with it. The LM head keeps its parameter, still tied to the embedding."""
    pack, kind_cls = _packer(kind)
    dense = tiny_llama(64, 32, 2).fuse_()
    dense.lm_head.weight = dense.embed.weight                   # tied, as SmolLM2 and Qwen are
    packed = getattr(copy.deepcopy(dense), pack)()
    layer_params = [n for n, p in packed.named_parameters() if n.startswith("layers.") and p.dim() == 2]
    assert layer_params == []                                   # nothing fp32 left but norms
    assert packed.layers[0].attn.wq is None and packed.layers[0].mlp.w_up is None
    assert packed.lm_head.weight is packed.embed.weight
    x = torch.randn(1, 128, 32)
    for name, m in packed.named_modules():
        if not isinstance(m, kind_cls) or name == "lm_head":
            continue
        kept = kind_cls(copy.deepcopy(dense.get_submodule(name)))   # the same matrix, parameter kept
        assert torch.equal(m.dense_weight(), kept.weight) and torch.equal(m.weight, kept.weight)
        assert "weight" not in dict(m.named_parameters())
        if m.in_features == 32:
            assert torch.equal(m(x), kept(x))                   # prefill: the fp32 BLAS, same weight
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        assert torch.isfinite(packed(ids, torch.arange(6)[None]).logits).all()
