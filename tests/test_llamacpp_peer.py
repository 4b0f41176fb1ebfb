"""llama.cpp as a benchmark peer (``bench.llamacpp``): methods resolve with their defaults, a
missing llama-cpp-python is reported as the method's unavailable reason (the default test run
never installs it), and, where it is installed, the peer decodes the same GGUF greedily."""
from __future__ import annotations

import sys

import pytest

from verispec import SamplingParams
from verispec.bench import BenchError
from verispec.bench.runner import BenchConfig, build_runners, resolve_methods, run_benchmark
from helpers import dense_module_fixtures  # noqa: E402


target, llm = dense_module_fixtures()   # compared with llama.cpp on the same GGUF


def test_llamacpp_methods_resolve_with_their_defaults():
    specs = {m.name: m for m in resolve_methods(
        BenchConfig(methods=("llamacpp", "llamacpp-pld", "llamacpp-draft")), "smollm2-135m", 30)}
    assert specs["llamacpp"].kind == "llamacpp" and specs["llamacpp"].config is None
    assert specs["llamacpp-pld"].config == {"num_pred_tokens": 5}
    assert "draft GGUF" in specs["llamacpp-draft"].unavailable
    qwen = {m.name: m for m in resolve_methods(BenchConfig(methods=("llamacpp-draft",)), "qwen2.5-coder-1.5b", 28)}
    assert qwen["llamacpp-draft"].config == {"draft_model": "qwen2.5-coder-0.5b", "num_pred_tokens": 4}


def test_missing_llama_cpp_makes_the_method_unavailable_with_the_install_hint(target, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)          # import llama_cpp -> ImportError
    cfg = BenchConfig(methods=("llamacpp",))
    specs, runners = build_runners(resolve_methods(cfg, "smollm2-135m", 30), target, cfg)
    by_name = {s.name: s for s in specs}
    assert "make bench-llamacpp" in by_name["llamacpp"].unavailable
    assert set(runners) == {"vanilla"}


def test_llamacpp_needs_a_gguf(target, monkeypatch):
    from verispec.bench.llamacpp import build_llamacpp
    monkeypatch.setattr(target, "format", "hf")
    with pytest.raises(BenchError, match="GGUF"):
        build_llamacpp("llamacpp", target, None)


def test_llamacpp_peer_decodes_the_same_gguf(target, chat_prompts):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by `make bench-llamacpp` only")
    from verispec.bench.llamacpp import build_llamacpp
    runner = build_llamacpp("llamacpp", target, None)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    first = runner.generate([chat_prompts[0]], greedy)
    again = runner.generate([chat_prompts[0]], greedy)
    assert len(first.token_ids[0]) == 12 and first.token_ids == again.token_ids       # greedy, repeatable
    assert first.stats.num_emitted_tokens == 12 and first.stats.num_steps >= 11       # one eval per token
    ours = run_benchmark(BenchConfig(methods=("llamacpp",), categories=("qa",), per_category=1, max_tokens=8,
                                     warmup_tokens=2, hf_weights="shared"), loaded=target, progress=False)
    assert {r.method for r in ours.records} == {"vanilla", "llamacpp"}
    with pytest.raises(BenchError, match="one sequence"):
        runner.generate([chat_prompts[0], chat_prompts[1]], greedy)
