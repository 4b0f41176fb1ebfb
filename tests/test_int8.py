"""int8 W8A8 packing (``models.int8``, ``csrc/int8_gemm.cpp``): the kernel's integer sums are
exact (equal to an int64 reference over the same per-row codes), a row never depends on the other
rows nor on the thread count, on the AVX-512 VNNI path and on the AVX2 one; with the row-invariant
attention a vanilla batch equals each prompt alone and greedy speculation equals vanilla (refused
without the op: why, measured in test_attention); bad input errors."""
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
from verispec.models import int8
from verispec.models.int8 import PackedInt8Linear, int8_available, quantize_int8
from verispec.models.loading import load_model
from verispec.models.packed import WeightFormat

pytestmark = pytest.mark.skipif(not int8_available(), reason="no int8 kernel here (needs a C++ compiler and AVX2)")


def reference(x: torch.Tensor, lin: PackedInt8Linear) -> torch.Tensor:
    """What the kernel must compute, from the contract: per-row uint8 codes of ``x`` (scale
    (hi - lo) / qmax over a range holding 0, zero point round(-lo / scale), codes round(x / scale)
    + zero point), exact integer sums (int64 here), then ``sa * ws * (sum - za * colsum) + b``."""
    qmax = lin._qmax
    x = x.reshape(-1, lin.in_features)
    lo, hi = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
    sa = (hi - lo) / qmax
    sa = torch.where(sa > 0, sa, torch.ones_like(sa))
    za = torch.round(-lo / sa).clamp(0, qmax)
    qa = (torch.round(x * (1 / sa)[:, None]) + za[:, None]).clamp(0, qmax)
    n = lin.out_features
    codes = torch.round(lin.weight / lin._scale[:n, None]).to(torch.int64)
    acc = qa.to(torch.int64) @ codes.T - za.to(torch.int64)[:, None] * codes.sum(1)[None, :]
    out = (sa[:, None] * lin._scale[None, :n]) * acc.float()
    return out + lin.bias if lin.bias is not None else out


@pytest.mark.parametrize("shape", [(80, 96), (37, 70), (1536, 576)], ids=["even", "fringe", "mlp"])
def test_int8_kernel_is_the_exact_integer_product(shape, single_thread):
    torch.manual_seed(0)
    n, k = shape
    lin = nn.Linear(k, n, bias=n != 1536)
    w = lin.weight.detach().clone()
    packed = PackedInt8Linear(lin)
    _, scale, deq = quantize_int8(w)
    assert torch.equal(lin.weight, deq) and packed.weight is lin.weight      # overwritten in place, shared
    assert 0 < ((deq - w).norm() / w.norm()).item() < 0.02                   # really 8 bits, not a copy
    for m in (1, 2, 5, 8, 9, 17):
        x = torch.randn(m, k) * 3
        x[0, 0] = 40.0                                                     # an outlier column
        assert torch.equal(packed(x), reference(x, packed)), m
    assert packed(torch.randn(2, 3, k)).shape == (2, 3, n)
    long = torch.randn(1, 130, k)                                         # prefill: fp32 BLAS, same weights
    torch.testing.assert_close(packed(long), F.linear(long, deq, lin.bias))


def test_a_row_never_depends_on_other_rows_or_threads():
    torch.manual_seed(1)
    packed = PackedInt8Linear(nn.Linear(576, 3072, bias=False))
    x = torch.randn(12, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([packed(x[i:i + 1]) for i in range(12)])
        torch.set_num_threads(2)
        for t in (1, 2, 3, 5, 8, 12):
            assert torch.equal(packed(x[:t]), alone[:t]), t
        assert torch.equal(packed(x.view(3, 4, 576)).view(12, 3072), alone)
    finally:
        torch.set_num_threads(before)


def test_the_avx2_path_is_exact_too():
    """``VERISPEC_INT8_ISA=avx2`` runs the AVX2 kernel (activation codes below 128, so its int16
    pair sums never saturate): the same checks in a fresh process."""
    code = (
        "import torch, sys; sys.path.insert(0, %r)\n"
        "from torch import nn\n"
        "from test_int8 import reference\n"
        "from verispec.models.int8 import PackedInt8Linear, kernel\n"
        "assert kernel().isa() == 'avx2' and kernel().qmax() == 127\n"
        "torch.manual_seed(3)\n"
        "p = PackedInt8Linear(nn.Linear(70, 37))\n"
        "x = torch.randn(9, 70) * 5\n"
        "alone = torch.cat([p(x[i:i + 1]) for i in range(9)])\n"
        "assert torch.equal(p(x), reference(x, p)) and torch.equal(p(x), alone)\n"
        "print('avx2 ok')\n" % os.path.dirname(__file__))
    env = dict(os.environ, VERISPEC_INT8_ISA="avx2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "avx2 ok" in out.stdout, out.stderr[-2000:]


def test_int8_model_matches_its_dense_twin(single_thread):
    assert_packed_twin("pack_int8_", PackedInt8Linear, 0.05)


def test_bad_int8_input_is_rejected():
    with pytest.raises(ValueError, match="fp32 weights"):
        PackedInt8Linear(nn.Linear(64, 16).to(torch.bfloat16))
    lin = PackedInt8Linear(nn.Linear(64, 16))
    with pytest.raises(TypeError, match="fp32 activations"):
        lin(torch.randn(2, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="features"):
        lin(torch.randn(2, 65))
    ext = int8.kernel()
    with pytest.raises(RuntimeError, match="qmax"):
        ext.linear(torch.randn(1, 64), lin._buf, lin._meta, lin._colsum, lin._scale, lin._bias,
                   383 - lin._qmax, 1)
    with pytest.raises(RuntimeError, match="int8 CPU tensor"):
        ext.pack(torch.zeros(4, 4))
    assert_cpu_fp32_only("int8")


@pytest.fixture(scope="module")
def int8_target():
    return load_model("smollm2-135m", dtype="float32", weights="int8")


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "eagle3"},
], ids=["ngram", "eagle3"])
def test_greedy_speculation_on_int8_equals_its_vanilla(int8_target, head_prompts, spec):
    """With the row-invariant attention a verify forward computes each token exactly as a decode
    does (tests/test_attention.py), so speculation on int8 weights reproduces int8 vanilla token for
    token; batched rows equal each prompt alone."""
    assert_speculation_equals_vanilla(int8_target, head_prompts, spec, 32)


@pytest.mark.parametrize("weights", ["int8", "int4-head8", "int4-a8"])
def test_without_the_attention_op_speculation_is_refused(weights, request, monkeypatch):
    """SDPA's last-bit differences between a decode and a verify move per-token int8 codes (logits
    by up to ~2): without the op an LLM refuses to speculate on any weights with int8 activations."""
    from verispec.models import attention
    if weights == "int4-a8":
        from verispec.models.int4 import kernel
        if kernel() is None:
            pytest.skip("int4-a8 needs verispec's int4 kernel")
        target = load_model("smollm2-135m", dtype="float32", weights=weights)
    else:
        target = request.getfixturevalue({"int8": "int8_target", "int4-head8": "int4_head8_target"}[weights])
    attention.kernel()
    monkeypatch.setattr(attention._OP, "_module", None)
    monkeypatch.setattr(attention._OP, "_reason", "test")
    with pytest.raises(ValueError, match=f"{weights}.*row-invariant attention"):
        LLM(loaded=target, speculative_config={"method": "ngram"})


def test_int8_vanilla_is_repeatable_and_follows_the_model(int8_target, head_prompts):
    """Vanilla int8 decoding gives the same tokens run after run, and they are what the int8
    forward ranks first (the engine adds nothing)."""
    greedy = SamplingParams(temperature=0, max_tokens=24)
    batch = [{"prompt_token_ids": p} for p in head_prompts[:2]]
    first = LLM(loaded=int8_target, max_num_seqs=1).generate(batch, greedy)
    again = LLM(loaded=int8_target, max_num_seqs=1).generate(batch, greedy)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    m = int8_target.model
    with torch.inference_mode():                       # the first generated token, from the forward alone
        for prompt, out in zip(head_prompts[:2], first):
            logits = m(torch.tensor([prompt]), torch.arange(len(prompt))[None]).logits[0, -1]
            assert int(logits.argmax()) == out.token_ids[0]
    assert int8_target.weights is WeightFormat.INT8


@pytest.fixture(scope="module")
def int4_head8_target():
    from verispec.models.int4 import kernel
    if kernel() is None:
        pytest.skip("torch's int4 kernel is not row-invariant")
    return load_model("smollm2-135m", dtype="float32", weights="int4-head8")


def test_int4_head8_packs_the_tied_head_in_int8(int4_head8_target, head_prompts, single_thread):
    """``int4-head8``: int4 decoder layers, the LM head on the int8 kernel, the tied embedding
    reading the same dequantised rows (already on the int8 grid), and the whole forward
    row-invariant (verify == decodes, bit for bit)."""
    from verispec.models.int4 import PackedInt4Linear
    m = int4_head8_target.model
    assert int4_head8_target.weights is WeightFormat.INT4_HEAD8
    assert isinstance(m.lm_head, PackedInt8Linear) and isinstance(m.layers[0].mlp.w_down, PackedInt4Linear)
    assert m.embed.weight is m.lm_head.weight
    _, _, deq = quantize_int8(m.embed.weight)
    assert torch.equal(deq, m.embed.weight)
    verify, decode = verify_and_decode_logits(m, head_prompts[0])
    assert torch.equal(verify, decode)


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "eagle", "num_speculative_tokens": 2},
    {"method": "draft_model", "model": "self", "self_draft_layers": 4, "num_speculative_tokens": 2,
     "draft_vocab": "smollm2-135m-eagle3/draft_vocab.safetensors"},
], ids=["ngram", "eagle1-reads-the-int8-head", "self-draft-cut-int8-head"])
def test_greedy_on_int4_head8_equals_its_vanilla(int4_head8_target, head_prompts, spec):
    assert_speculation_equals_vanilla(int4_head8_target, head_prompts[:2], spec, 24)
