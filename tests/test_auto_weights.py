"""``weights="auto"``: int4 for a 4-bit GGUF, fp16 packing for other checkpoints on the CPU, dense
off the CPU or for a dtype other than float32; explicit options still win."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec.models.auto_weights import auto_weights, four_bit_share
from verispec.models.int4 import kernel
from verispec.models.packed import WeightFormat, fp16_packing_available
from verispec.models.sources import resolve_model


def _gguf(path, kinds):
    """A GGUF holding one 2-D decoder weight per entry of ``kinds`` (quantised as named)."""
    import gguf
    from gguf.quants import quantize
    w = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    for i, kind in enumerate(kinds):
        data = rng.standard_normal((4, 64)).astype(np.float32)
        qtype = gguf.GGMLQuantizationType[kind]
        w.add_tensor(f"blk.{i}.ffn_down.weight", quantize(data, qtype) if kind != "F32" else data,
                     raw_dtype=qtype if kind != "F32" else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_four_bit_share_reads_tensor_types(tmp_path):
    assert four_bit_share(_gguf(tmp_path / "a.gguf", ["Q4_0", "Q4_1", "Q8_0", "F32"])) == 0.5
    assert four_bit_share(_gguf(tmp_path / "b.gguf", ["Q8_0", "F32"])) == 0.0
    assert four_bit_share(resolve_model("smollm2-135m").path) == 1.0       # the default model: Q4_1


def test_the_rule(tmp_path):
    q4 = _gguf(tmp_path / "q4.gguf", ["Q4_0", "Q4_0"])
    q8 = _gguf(tmp_path / "q8.gguf", ["Q8_0", "Q8_0"])
    fp16 = WeightFormat.FP16 if fp16_packing_available() else WeightFormat.DENSE
    assert auto_weights(q4, "gguf", torch.float32, "cpu") is (WeightFormat.INT4 if kernel() else fp16)
    assert auto_weights(q8, "gguf", torch.float32, "cpu") is fp16
    assert auto_weights(tmp_path, "hf", torch.float32, "cpu") is fp16
    assert auto_weights(q4, "gguf", torch.bfloat16, "cpu") is WeightFormat.DENSE
    assert auto_weights(q4, "gguf", torch.float32, "cuda") is WeightFormat.DENSE


def test_llm_default_is_auto_and_explicit_wins():
    from verispec.models.loading import load_model
    if kernel() is None:
        pytest.skip("int4 kernel unavailable here")
    assert load_model("smollm2-135m", with_tokenizer=False, weights="auto").weights is WeightFormat.INT4
    assert load_model("smollm2-135m", with_tokenizer=False, weights="dense").weights is WeightFormat.DENSE
    import inspect

    from verispec import LLM
    assert inspect.signature(LLM).parameters["weights"].default == "auto"
