"""int4 weight-only packing (``models.int4``): the kernel computes the dequantised model, a row
never depends on the other rows, 4-bit blocks survive a second quantisation, a verify forward
computes what decodes compute, greedy speculation on the int4 target equals vanilla greedy on it,
bad input errors."""
from __future__ import annotations


import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import assert_cpu_fp32_only, assert_packed_twin, assert_speculation_equals_vanilla, verify_and_decode_logits
from verispec import LLM, SamplingParams
from verispec.models.int4 import PackedInt4Linear, int4_available, quantize_int4
from verispec.models.loading import load_model
from verispec.models.packed import WeightFormat

pytestmark = pytest.mark.skipif(not int4_available(), reason="no int4pack CPU kernel here")


def test_int4_linear_computes_the_dequantised_weight_on_bf16_activations(single_thread):
    torch.manual_seed(0)
    lin = nn.Linear(96, 80)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    packed = PackedInt4Linear(lin)
    _, _, deq = quantize_int4(w)
    assert torch.equal(lin.weight, deq) and packed.weight is lin.weight      # overwritten in place, shared
    rel = ((deq - w).norm() / w.norm()).item()
    assert 0.01 < rel < 0.15                                                 # really 4 bits, not a copy
    for m in (1, 2, 5, 16):
        x = torch.randn(m, 96)
        want = F.linear(x.bfloat16().float(), deq, b)
        torch.testing.assert_close(packed(x), want, rtol=2e-3, atol=2e-3)
    assert packed(torch.randn(2, 3, 96)).shape == (2, 3, 80)
    long = torch.randn(1, 130, 96)                                          # prefill: the same kernel
    torch.testing.assert_close(packed(long), F.linear(long.bfloat16().float(), deq, b), rtol=2e-3, atol=2e-3)
    assert torch.equal(packed(long)[0, 7:9], packed(long[:, 7:9])[0])        # a row as alone


def test_a_row_never_depends_on_the_other_rows(single_thread):
    """Verification over T tokens and a batch of rows must compute, per row, what one row alone
    computes: bit-equal, for every T the verifier uses."""
    torch.manual_seed(1)
    packed = PackedInt4Linear(nn.Linear(576, 1536, bias=False))
    x = torch.randn(12, 576)
    alone = torch.cat([packed(x[i:i + 1]) for i in range(12)])
    for t in (2, 3, 5, 8, 12):
        assert torch.equal(packed(x[:t]), alone[:t]), t
    assert torch.equal(packed(x.view(3, 4, 576)).view(12, 1536), alone)


def test_a_4bit_grid_is_kept_as_it_is():
    """Weights already on 16 levels per block of 32 (as a GGUF Q4_1 / Q4_K block dequantises to)
    keep their codes; the values move only by the bf16 rounding of the kernel's zero point."""
    torch.manual_seed(2)
    codes = torch.randint(0, 16, (64, 128)).float()
    codes[:, ::32], codes[:, 1::32] = 0, 15                                 # every block spans the grid
    scale = torch.rand(64, 4).add(0.01).bfloat16().float().repeat_interleave(32, 1)
    low = torch.randn(64, 4).bfloat16().float().repeat_interleave(32, 1)
    w = codes * scale + low
    q, _, deq = quantize_int4(w)
    assert torch.equal(q.float(), codes)
    zero = (low + 8 * scale).abs()
    assert bool(((deq - w).abs() <= zero * 2 ** -8).all())
    assert (deq - w).abs().max() > 0                                       # the rounding is real: say so


@pytest.mark.parametrize("top", [15, 13, 9, 5, 2])
def test_a_4bit_grid_whose_end_codes_are_unused_is_kept_too(top):
    """GGUF Q4_K fits each block's scale and minimum, so a block's codes often span fewer than
    16 levels (here 1..top). Such a block is kept on its own grid (or one twice as fine): every
    value moves only by the bf16 rounding of scale and zero, not by a second quantisation, which
    min/max rescaling to 15 steps was (relative RMS error 4.4% on Qwen's Q4_K matrices, 0.45% now)."""
    torch.manual_seed(3)
    codes = torch.randint(1, top + 1, (64, 128)).float()
    codes[:, ::32], codes[:, 1::32] = 1, top                                # the block spans 1..top
    step = torch.rand(64, 4).add(0.01).bfloat16().float().repeat_interleave(32, 1)
    low = torch.randn(64, 4).mul(0.1).bfloat16().float().repeat_interleave(32, 1)
    w = codes * step + low
    _, _, deq = quantize_int4(w)
    bound = (low.abs() + 16 * step) * 2 ** -8                               # bf16 rounding of zero and scale
    assert bool(((deq - w).abs() <= bound).all()), float(((deq - w).abs() / bound).max())
    noise = w + torch.randn_like(w) * step * 0.3                             # off any grid: plain min/max codes
    q, _, _ = quantize_int4(noise)
    assert q.view(64, 4, 32).amax(-1).eq(15).all() and q.view(64, 4, 32).amin(-1).eq(0).all()


def test_int4_model_matches_its_dense_twin(single_thread):
    assert_packed_twin("pack_int4_", PackedInt4Linear, 0.02)


def test_bad_int4_input_is_rejected():
    with pytest.raises(ValueError, match="multiple of 32"):
        PackedInt4Linear(nn.Linear(40, 16))
    with pytest.raises(ValueError, match="multiple of 16"):
        PackedInt4Linear(nn.Linear(64, 8))
    with pytest.raises(ValueError, match="fp32 weights"):
        PackedInt4Linear(nn.Linear(64, 16).to(torch.bfloat16))
    with pytest.raises(TypeError, match="fp32 activations"):
        PackedInt4Linear(nn.Linear(64, 16))(torch.randn(2, 64, dtype=torch.bfloat16))
    assert_cpu_fp32_only("int4")


@pytest.fixture(scope="module")
def int4_target():
    return load_model("smollm2-135m", dtype="float32", weights="int4")


def test_our_kernel_is_the_bf16_product_in_fp32_on_both_paths(single_thread):
    """The C++ kernel (AVX-512 BF16, or AVX2 in a subprocess) computes bf16(x) @ W.T with fp32
    sums, far closer than torch's kernel (which rounds its output to bf16), row by row."""
    from verispec.models.int4 import kernel
    if kernel() is None:
        pytest.skip("our int4 kernel is unavailable here")
    code = ("import torch\n"
            "from torch import nn\n"
            "from verispec.models.int4 import PackedInt4Linear, quantize_int4, kernel\n"
            "torch.manual_seed(4)\n"
            "lin = nn.Linear(192, 48)\n"
            "_, _, deq = quantize_int4(lin.weight.detach())\n"
            "p = PackedInt4Linear(lin)\n"
            "assert p.backend == 'verispec', p.backend\n"
            "x = torch.randn(11, 192)\n"
            "y = p(x)\n"
            "ref = x.bfloat16().double() @ deq.double().T + lin.bias.detach().double()\n"
            "torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)\n"
            "for t in range(1, 12):\n"
            "    assert torch.equal(p(x[:t]), y[:t]) and torch.equal(p(x[t - 1:t]), y[t - 1:t])\n"
            "print(kernel().isa())\n")
    for isa in ("", "avx2"):
        env = dict(os.environ, VERISPEC_INT4_ISA=isa)
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        assert (run.stdout.strip() == "avx2") == (isa == "avx2"), run.stdout


def test_int4_verify_and_decode_logits_are_equal(int4_target, head_prompts, single_thread):
    """Row-invariant matmuls and attention: a verify forward computes each token as a decode does."""
    from verispec.models.int4 import kernel
    if kernel() is None:
        pytest.skip("torch's int4 kernel rounds its output to bf16 and is not row-invariant")
    verify, decode = verify_and_decode_logits(int4_target.model, head_prompts[0])
    assert torch.equal(verify, decode)


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "eagle3"},
], ids=["ngram", "eagle3"])
def test_greedy_on_int4_target_equals_its_vanilla(int4_target, head_prompts, spec):
    """Token for token: the verify forward is the decode forward, row by row (no tie allowance)."""
    from verispec.models.int4 import kernel
    if kernel() is None:
        pytest.skip("torch's int4 kernel is not row-invariant: speculation matches vanilla up to bf16 ties")
    greedy = SamplingParams(temperature=0, max_tokens=32)
    batch = [{"prompt_token_ids": p} for p in head_prompts]
    want = LLM(loaded=int4_target, max_num_seqs=4).generate(batch, greedy)
    # whole trees every step: at batch 4 the draft-budget estimator may find drafting too dear here
    llm = LLM(loaded=int4_target, max_num_seqs=4, speculative_config={**spec, "adaptive_drafting": False})
    got = llm.generate(batch, greedy)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.metrics.num_drafts for o in got) > 0
    assert int4_target.weights is WeightFormat.INT4
    if spec["method"] == "eagle3":              # the head drafts on the int4 kernel too
        head = llm.make_engine(1, 64)._drafter.head
        assert isinstance(head.lm_head, PackedInt4Linear) and isinstance(head.attn.fused, PackedInt4Linear)


def test_draft_heads_take_the_targets_packing(int4_target):
    """int4 beside int4 decoder layers, int8 beside int8, fp16 beside fp16, nothing beside dense
    weights; a matrix the quantised kernel does not take (rows not a multiple of 16) is fp16."""
    from verispec.models.loading import LoadedModel
    from verispec.models.draft_packing import DraftPacking, draft_packing, pack_linears_
    from verispec.models.packed import PackedFP16Linear
    head = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 24))
    as_loaded = lambda w: LoadedModel(name="t", path=None, format="hf", config=None, model=None,  # noqa: E731
                                      tokenizer=None, weights=w)
    assert draft_packing(int4_target, head) is DraftPacking.INT4
    assert draft_packing(as_loaded(WeightFormat.INT8), head) is DraftPacking.INT8
    assert draft_packing(as_loaded(WeightFormat.FP16), head) is DraftPacking.FP16
    assert draft_packing(as_loaded(WeightFormat.DENSE), head) is None
    assert pack_linears_(head, DraftPacking.INT4) == 2
    assert isinstance(head[0], PackedInt4Linear) and isinstance(head[1], PackedFP16Linear)


@pytest.fixture(scope="module")
def int4_all_target():
    return load_model("smollm2-135m", dtype="float32", weights="int4-all")


def test_int4_all_packs_the_tied_head_too(int4_all_target, head_prompts, single_thread):
    """``int4-all``: the LM head runs the int4 kernel, the tied embedding reads the same
    dequantised rows, and the forward stays row-invariant (verify == decodes, bit for bit)."""
    from verispec.models.int4 import kernel
    m = int4_all_target.model
    assert isinstance(m.lm_head, PackedInt4Linear) and int4_all_target.weights is WeightFormat.INT4_ALL
    assert m.embed.weight is m.lm_head.weight                                 # tied, dequantised in place
    _, _, deq = quantize_int4(m.embed.weight)
    assert torch.equal(deq, m.embed.weight)                                   # already on the 4-bit grid
    if kernel() is not None:
        verify, decode = verify_and_decode_logits(m, head_prompts[0])
        assert torch.equal(verify, decode)


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "eagle", "num_speculative_tokens": 2},
], ids=["ngram", "eagle1-reads-the-int4-head"])
def test_greedy_on_int4_all_equals_its_vanilla(int4_all_target, head_prompts, spec):
    from verispec.models.int4 import kernel
    if kernel() is None:
        pytest.skip("torch's int4 kernel is not row-invariant")
    assert_speculation_equals_vanilla(int4_all_target, head_prompts[:2], spec, 24)
