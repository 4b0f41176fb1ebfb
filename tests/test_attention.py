"""Row-invariant attention (``models.attention``, ``csrc/attention.cpp``): softmax attention as
SDPA computes it, a query row's output independent of the other rows, the threads and the gaps
between its visible slots; on a real model a verify forward's logits equal the one-token decodes'
bit for bit with fp16, int4 and int8 weights, so speculation on them reproduces vanilla."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from helpers import verify_and_decode_logits
from verispec.models import attention

pytestmark = pytest.mark.skipif(not attention.available(), reason=f"no attention op: {attention.unavailable_reason()}")


def _inputs(b=2, h=6, kvh=2, t=5, s=37, d=64, seed=0, p=0.7):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, m, d, generator=g) for n, m in ((h, t), (kvh, s), (kvh, s)))
    mask = torch.rand(b, 1, t, s, generator=g) < p
    mask[..., 0] = True                                   # every row sees a key
    return q, k, v, mask


def _op(q, k, v, mask, threads=1 << 16, scale=None):
    s = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.verispec_attn.attention(q, k, v, mask, s, threads)


@pytest.mark.parametrize("d,h,kvh", [(64, 6, 2), (128, 4, 4), (16, 3, 1), (256, 2, 1)])
def test_the_op_is_softmax_attention(d, h, kvh):
    q, k, v, mask = _inputs(h=h, kvh=kvh, d=d)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
    got = _op(q, k, v, mask)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6)
    per_head = mask.expand(-1, h, -1, -1).clone()
    per_head[:, 0, :, 1:] = False                         # head 0 sees slot 0 only: it returns v[0]
    out = _op(q, k, v, per_head)
    assert torch.equal(out[:, 0], v[:, 0, :1].expand(-1, q.shape[2], -1))
    torch.testing.assert_close(out[:, 1:].double(), F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=per_head, enable_gqa=True)[:, 1:], rtol=1e-5, atol=2e-6)
    assert torch.equal(_op(q, k, v, mask, scale=0.5), _op(q * 1, k, v, mask, scale=0.5))


def test_a_row_never_depends_on_other_rows_threads_or_gaps():
    """What makes a verify row equal to its decode: same bits alone, in a batch, on any thread
    count, and when its visible keys sit between masked slots instead of side by side."""
    q, k, v, mask = _inputs(t=7, s=50)
    full = _op(q, k, v, mask)
    for t in range(7):
        assert torch.equal(_op(q[:, :, t:t + 1], k, v, mask[:, :, t:t + 1], threads=1), full[:, :, t:t + 1])
    for b in range(2):
        assert torch.equal(_op(q[b:b + 1], k[b:b + 1], v[b:b + 1], mask[b:b + 1]), full[b:b + 1])
    seen = torch.nonzero(mask[0, 0, 3]).flatten()
    packed = _op(q[:1, :, 3:4], k[:1, :, seen], v[:1, :, seen], torch.ones(1, 1, 1, len(seen), dtype=torch.bool))
    assert torch.equal(packed, full[:1, :, 3:4])
    strided = _op(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, mask.expand(-1, 6, -1, -1))
    assert torch.equal(strided, full)


@pytest.mark.parametrize("h,kvh,d", [(12, 1, 32), (9, 3, 64), (12, 2, 128)])
def test_heads_run_together_over_their_keys_with_the_bits_of_one_head(h, kvh, d):
    """Query heads of one kv head share its key blocks (in groups of up to 8, halved to feed the
    threads): each head's output is the one it gets alone (a per-head mask runs heads one by one)."""
    q, k, v, mask = _inputs(b=1, h=h, kvh=kvh, t=3, s=300, d=d)
    together = _op(q, k, v, mask, threads=2)
    alone = _op(q, k, v, mask.expand(-1, h, -1, -1), threads=1)
    assert torch.equal(together, alone)
    for t in range(3):
        assert torch.equal(_op(q[:, :, t:t + 1], k, v, mask[:, :, t:t + 1], threads=2), together[:, :, t:t + 1])
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(together.double(), want, rtol=1e-5, atol=2e-6)


def test_the_output_is_a_free_view_and_a_blind_row_is_zero():
    q, k, v, mask = _inputs()
    mask[1, 0, 2] = False
    out = _op(q, k, v, mask)
    assert out.transpose(1, 2).is_contiguous()            # [B,T,H,D] storage: the reshape is free
    assert torch.equal(out[1, :, 2], torch.zeros_like(out[1, :, 2]))


def test_attend_picks_the_op_only_where_it_applies():
    q, k, v, mask = _inputs()
    assert attention.uses_op(q, mask)
    assert not attention.uses_op(q.double(), mask)
    assert not attention.uses_op(q, None)
    assert not attention.uses_op(q[..., :40], mask)                          # head size not a multiple of 16
    long = torch.randn(1, 6, 130, 64)
    assert not attention.uses_op(long, torch.ones(1, 1, 130, 130, dtype=torch.bool))   # prefill: SDPA
    with torch.enable_grad():
        assert not attention.uses_op(q.requires_grad_(), mask)
    q40, k40, v40 = q[..., :48][..., :40], k[..., :40], v[..., :40]
    torch.testing.assert_close(attention.attend(q40, k40, v40, mask, None),
                               F.scaled_dot_product_attention(q40, k40, v40, attn_mask=mask, enable_gqa=True))


def test_bad_input_is_rejected():
    q, k, v, mask = _inputs()
    with pytest.raises(RuntimeError, match="multiple of 16"):
        _op(q[..., :40].contiguous(), k[..., :40].contiguous(), v[..., :40].contiguous(), mask)
    with pytest.raises(RuntimeError, match="not a multiple"):
        _op(q[:, :5], k.expand(-1, 2, -1, -1), v, mask)
    with pytest.raises(RuntimeError, match="mask"):
        _op(q, k, v, mask[..., :-1])
    with pytest.raises(RuntimeError, match="bool"):
        _op(q, k, v, mask.float())
    with pytest.raises(RuntimeError, match="float32"):
        _op(q.double(), k, v, mask)


def test_the_avx2_path_agrees_too():
    code = ("import torch, torch.nn.functional as F\n"
            "from verispec.models import attention\n"
            "assert attention.kernel().isa() == 'avx2', attention.kernel().isa()\n"
            "g = torch.Generator().manual_seed(3)\n"
            "q, k, v = torch.randn(1, 4, 6, 64, generator=g), torch.randn(1, 2, 30, 64, generator=g), "
            "torch.randn(1, 2, 30, 64, generator=g)\n"
            "m = torch.rand(1, 1, 6, 30, generator=g) < 0.6; m[..., 0] = True\n"
            "out = attention.attend(q, k, v, m, None)\n"
            "ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m, enable_gqa=True)\n"
            "torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=2e-6)\n"
            "for t in range(6):\n"
            "    assert torch.equal(attention.attend(q[:, :, t:t+1], k, v, m[:, :, t:t+1], None), out[:, :, t:t+1])\n")
    env = dict(os.environ, VERISPEC_ATTN_ISA="avx2")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def _paged(k, v, block=8, seed=5):
    """k, v [B, KVH, S, D] scattered into pools [blocks, KVH, block, D] through a shuffled table."""
    b, kvh, s, d = k.shape
    per = -(-s // block)
    order = torch.randperm(b * per, generator=torch.Generator().manual_seed(seed)) + 1      # block 0: null
    table = order.reshape(b, per)
    pool_k, pool_v = (torch.full((b * per + 1, kvh, block, d), float("nan")) for _ in range(2))
    slot = torch.arange(s)
    for r in range(b):
        pool_k[table[r, slot // block], :, slot % block] = k[r].transpose(0, 1)
        pool_v[table[r, slot // block], :, slot % block] = v[r].transpose(0, 1)
    return pool_k, pool_v, table, block.bit_length() - 1


PAGED_CHECK = """
q, k, v, mask = _inputs()
pk, pv, table, shift = _paged(k, v)
want = _op(q, k, v, mask)
got = torch.ops.verispec_attn.paged_attention(q, pk, pv, table, mask, q.shape[-1] ** -0.5, shift, 1 << 16)
assert torch.equal(got, want)
"""


def test_the_paged_op_equals_the_op_bit_for_bit_on_both_paths():
    """The same keys through a shuffled block table, the unused pool slots NaN (never read): the
    same bits as over contiguous K/V, on the AVX-512 (where present) and the AVX2 path."""
    exec(PAGED_CHECK, {"_inputs": _inputs, "_paged": _paged, "_op": _op, "torch": torch})
    with pytest.raises(RuntimeError, match="table"):
        q, k, v, mask = _inputs()
        pk, pv, table, shift = _paged(k, v)
        torch.ops.verispec_attn.paged_attention(q, pk, pv, table[:, :1], mask, 0.1, shift, 1)
    code = ("import sys, torch\nsys.path.insert(0, 'tests')\nfrom test_attention import _inputs, _paged, _op\n"
            "from verispec.models import attention\nassert attention.kernel().isa() == 'avx2'\n" + PAGED_CHECK)
    env = dict(os.environ, VERISPEC_ATTN_ISA="avx2")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("weights", ["fp16", "int4", "int8"])
def test_verify_logits_equal_the_decodes_bit_for_bit(weights, head_prompts, single_thread):
    """Every op of a packed model's small-T forward is row-invariant, so the logits of 8 tokens
    verified in one forward are exactly those of 8 one-token decodes (with SDPA they differed by
    up to ~0.1 with int4 and ~1 with int8)."""
    from verispec.models.loading import load_model
    if weights == "int4":
        from verispec.models.int4 import kernel
        if kernel() is None:
            pytest.skip("torch's int4 kernel rounds its output to bf16 and is not row-invariant")
    if weights == "int8":
        from verispec.models.int8 import int8_available
        if not int8_available():
            pytest.skip("no int8 kernel here")
    model = load_model("smollm2-135m", dtype="float32", weights=weights).model
    for prompt in head_prompts[:2]:
        verify, decode = verify_and_decode_logits(model, prompt)
        assert torch.equal(verify, decode)
