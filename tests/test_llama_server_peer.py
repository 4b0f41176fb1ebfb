"""llama.cpp's server as a benchmark peer (``bench.llama_server``): methods resolve with their
defaults, each kind adds its speculation flags, a missing binary is reported as the method's
unavailable reason (the default test run never builds it), and, where ``make llama-server`` built
it, the peer decodes the same GGUF greedily over HTTP, with and without ngram-mod drafting."""
from __future__ import annotations

import pytest

from verispec import SamplingParams
from verispec.bench import BenchError
from verispec.bench.llama_server import SERVER_KINDS, build_llama_server, server_args, server_binary
from verispec.bench.runner import BenchConfig, build_runners, resolve_methods


def test_llama_server_methods_resolve_with_their_defaults():
    specs = {m.name: m for m in resolve_methods(BenchConfig(methods=SERVER_KINDS), "smollm2-135m", 30)}
    assert all(specs[k].kind == k for k in SERVER_KINDS)
    assert specs["llama-server"].config is None and specs["llama-server-ngram"].config is None
    assert "draft GGUF" in specs["llama-server-draft"].unavailable
    qwen = {m.name: m for m in resolve_methods(BenchConfig(methods=("llama-server-draft",)), "qwen2.5-coder-1.5b", 28)}
    assert qwen["llama-server-draft"].config == {"draft_model": "qwen2.5-coder-0.5b"}


def test_each_kind_adds_its_flags():
    assert server_args("llama-server", {}) == []
    assert server_args("llama-server-ngram", {"args": ["--spec-ngram-mod-n-max", 16]}) == [
        "--spec-type", "ngram-mod", "--spec-ngram-mod-n-max", "16"]
    with pytest.raises(BenchError, match="draft_model"):
        server_args("llama-server-draft", {})
    with pytest.raises(BenchError, match="unknown"):
        server_args("llama-serve", {})


def test_a_missing_binary_makes_the_method_unavailable_with_the_build_hint(target, monkeypatch, tmp_path):
    monkeypatch.setenv("VERISPEC_LLAMA_SERVER", str(tmp_path / "no-such-server"))
    with pytest.raises(BenchError, match="make llama-server"):
        server_binary()
    cfg = BenchConfig(methods=("llama-server",))
    specs, runners = build_runners(resolve_methods(cfg, "smollm2-135m", 30), target, cfg)
    assert "make llama-server" in {s.name: s for s in specs}["llama-server"].unavailable
    assert set(runners) == {"vanilla"}


def test_llama_server_needs_a_gguf(target, monkeypatch):
    monkeypatch.setattr(target, "format", "hf")
    with pytest.raises(BenchError, match="GGUF"):
        build_llama_server("llama-server", target, None)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama-server", "llama-server-ngram"])
def test_llama_server_peer_decodes_the_same_gguf(target, chat_prompts, kind):
    try:
        server_binary()
    except BenchError as e:
        pytest.skip(str(e))
    runner = build_llama_server(kind, target, None)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=12)
        first = runner.generate([chat_prompts[0]], greedy)
        again = runner.generate([chat_prompts[0]], greedy)
        assert len(first.token_ids[0]) == 12 and first.token_ids == again.token_ids    # greedy, repeatable
        assert first.texts[0] and 1 <= first.stats.num_steps <= 12
        with pytest.raises(BenchError, match="one sequence"):
            runner.generate([chat_prompts[0], chat_prompts[1]], greedy)
    finally:
        runner.close()
