"""W4A8 (``weights="int4-a8"``, ``PackedInt4Linear(int8_activations=True)``): the kernel computes
the int4 weights against activations quantised to int8 per group of 32 columns, exactly as a
reference quantisation says, with the same bits on the AVX-512 VNNI and AVX2 paths; a row never
depends on the other rows, so a verify forward computes what decodes compute and greedy
speculation on an int4-a8 target equals its vanilla decoding token for token."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from helpers import assert_speculation_equals_vanilla, verify_and_decode_logits
from verispec.models.int4 import PackedInt4Linear, kernel, quantize_int4
from verispec.models.int8 import PackedInt8Linear
from verispec.models.loading import load_model
from verispec.models.packed import WeightFormat

pytestmark = pytest.mark.skipif(kernel() is None, reason="verispec's int4 kernel is unavailable here")


# Run in a subprocess per instruction set; prints the path taken and a digest of the outputs.
_KERNEL_CHECK = """
import hashlib, torch
from torch import nn
from verispec.models.int4 import PackedInt4Linear, quantize_int4, kernel
from helpers import int8_group_quantised
torch.manual_seed(4)
lin = nn.Linear(192, 48)
_, _, deq = quantize_int4(lin.weight.detach())
p = PackedInt4Linear(lin, int8_activations=True)
x = torch.randn(11, 192)
x[3, 32:64] = 0                                             # an all-zero group
x[5, :32] *= 1000                                           # an outlier group beside ordinary ones
y = p(x)
ref = int8_group_quantised(x) @ deq.double().T + lin.bias.detach().double()
torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)
for t in range(1, 12):
    assert torch.equal(p(x[:t]), y[:t]) and torch.equal(p(x[t - 1:t]), y[t - 1:t])
long = torch.randn(40, 192)                                 # prefill sizes quantise rows in parallel
assert torch.equal(p(long)[17:19], p(long[17:19]))
print(kernel().isa_a8(), hashlib.sha256(y.numpy().tobytes()).hexdigest())
"""


def test_the_kernel_is_the_int8_quantised_product_with_the_same_bits_on_both_paths():
    here = os.path.dirname(os.path.abspath(__file__))               # for helpers
    seen = {}
    for isa in ("", "avx2"):
        env = dict(os.environ, VERISPEC_INT4_ISA=isa, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
        run = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], env=env, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        path, digest = run.stdout.split()
        assert (path == "avx2") == (isa == "avx2"), path
        seen[path] = digest
    assert len(set(seen.values())) == 1, seen                  # exact integer sums, one epilogue order


def test_int8_activations_cost_little_against_bf16_ones(single_thread):
    """The a8 path is a different product (int8 inputs), close to the weight-only one."""
    torch.manual_seed(5)
    lin = nn.Linear(1024, 256, bias=False)
    _, _, deq = quantize_int4(lin.weight.detach())
    a8 = PackedInt4Linear(lin, int8_activations=True)
    x = torch.randn(6, 1024)
    exact = x.double() @ deq.double().T
    err = ((a8(x).double() - exact).norm() / exact.norm()).item()
    assert 1e-4 < err < 0.02                                   # really int8 inputs, and close
    assert "int8 activations" in repr(a8)


def test_bad_a8_input_is_rejected():
    with pytest.raises(RuntimeError, match="groups of 32"):
        PackedInt4Linear(nn.Linear(128, 16), group=64, int8_activations=True)
    with pytest.raises(TypeError, match="fp32 activations"):
        PackedInt4Linear(nn.Linear(64, 16), int8_activations=True)(torch.randn(2, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="input has 32 features"):
        PackedInt4Linear(nn.Linear(64, 16), int8_activations=True)(torch.randn(2, 32))


@pytest.fixture(scope="module")
def int4_a8_target():
    return load_model("smollm2-135m", dtype="float32", weights="int4-a8")


def test_int4_a8_packs_layers_w4a8_and_the_head_in_int8(int4_a8_target, head_prompts, single_thread):
    m = int4_a8_target.model
    assert int4_a8_target.weights is WeightFormat.INT4_A8
    assert WeightFormat.INT4_A8.int8_activations and WeightFormat.INT4_A8.int4_layers
    down = m.layers[0].mlp.w_down
    assert isinstance(down, PackedInt4Linear) and down.int8_activations
    assert isinstance(m.lm_head, PackedInt8Linear) and m.embed.weight is m.lm_head.weight
    verify, decode = verify_and_decode_logits(m, head_prompts[0])
    assert torch.equal(verify, decode)


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "eagle", "num_speculative_tokens": 2},
], ids=["ngram", "eagle1"])
def test_greedy_on_int4_a8_equals_its_vanilla(int4_a8_target, head_prompts, spec):
    assert_speculation_equals_vanilla(int4_a8_target, head_prompts[:2], spec, 24)
