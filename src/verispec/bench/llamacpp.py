"""llama.cpp (through llama-cpp-python) as a benchmark peer: the same GGUF file, the same prompt
token ids, one sequence at a time, interleaved per prompt with verispec's methods by the runner.

Three kinds (``LLAMACPP_KINDS``):

* ``llamacpp``: plain decoding.
* ``llamacpp-pld``: llama-cpp-python's prompt lookup decoding (``LlamaPromptLookupDecoding``,
  options ``num_pred_tokens`` and ``max_ngram_size``).
* ``llamacpp-draft``: a second GGUF as draft model (option ``draft_model``: a model name or
  path, e.g. the Qwen2.5-Coder 0.5B for the 1.5B target; ``num_pred_tokens`` drafts per step),
  through llama-cpp-python's ``LlamaDraftModel`` hook with a greedy draft ``Llama``.

The peer reads the GGUF as llama.cpp stores it (its own quantised kernels): it is the engine a CPU
user would pick, not a re-implementation of our weights, so its outputs are compared as text
agreement, not held to be token-identical. It runs in a worker process (``LlamaCppRunner``).
Threads: the run's torch thread count. Steps (for the acceptance columns) are counted as the
target's ``eval`` calls after the prompt. llama-cpp-python is installed by ``make bench-llamacpp``
(an sdist: a cmake build), never by ``make test``; where it is missing the methods are reported
unavailable with that reason.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core.metrics import SpecStats
from ..models.loading import LoadedModel
from ..models.sources import resolve_model
from ..core.sampling import SamplingParams
from .records import BenchError, GenResult

LLAMACPP_KINDS = ("llamacpp", "llamacpp-pld", "llamacpp-draft")
INSTALL_HINT = "llama-cpp-python is not installed: `make bench-llamacpp` builds it (cmake, a C++ compiler)"


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise BenchError(INSTALL_HINT) from None
    return llama_cpp


def gguf_path(name_or_path: str | Path) -> Path:
    """The GGUF file of a model argument; ``BenchError`` for an HF folder (llama.cpp reads GGUF)."""
    src = resolve_model(str(name_or_path))
    if src.format != "gguf":
        raise BenchError(f"llama.cpp reads GGUF files; {name_or_path} is a {src.format} model")
    return Path(src.path)


def gguf_target(loaded: LoadedModel, peer: str) -> tuple[Path, tuple[int, ...]]:
    """The GGUF file and the stop ids of the target ``loaded`` for a llama.cpp peer; ``BenchError``
    for a target not loaded from a GGUF."""
    if loaded.format != "gguf":
        raise BenchError(f"{peer} reads GGUF files; the target {loaded.name} was loaded from {loaded.format}")
    return Path(loaded.path), tuple(loaded.config.eos_token_ids) or (loaded.tokenizer.eos_token_id,)


class ClosedWhenCollected:
    """A peer that owns a process: ``close()`` runs when it is collected (quietly at shutdown)."""

    def close(self) -> None:
        raise NotImplementedError

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


@dataclass
class GgufPeer(ClosedWhenCollected):
    """What every llama.cpp peer is given: its kind, the target's GGUF file and stop ids, the
    tokenizer (for texts), the kind's options and the context size; it runs one prompt at a time."""
    kind: str
    path: Path
    eos_token_ids: tuple[int, ...]
    tokenizer: Any
    options: dict = field(default_factory=dict)
    n_ctx: int = 4096
    max_batch: int = 1

    def __post_init__(self) -> None:
        """Each peer starts its process here (the dataclass ``__init__`` calls it)."""


def open_llama(path: Path, threads: int, n_ctx: int, draft=None):
    llama_cpp = _llama_cpp()
    return llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                           verbose=False, draft_model=draft, logits_all=draft is not None)


class GgufDraft:
    """A ``LlamaDraftModel``: greedy drafts from a second GGUF. Each call continues the draft
    model's own cache from the longest common prefix (llama-cpp-python's ``generate`` rewinds it),
    so a step evaluates only the newly accepted tokens and the drafts."""

    def __init__(self, path: Path, threads: int, n_ctx: int, num_pred_tokens: int):
        self.llm = open_llama(path, threads, n_ctx)
        self.k = num_pred_tokens

    def __call__(self, input_ids, /, **kwargs):
        import numpy as np
        out: list[int] = []
        gen = self.llm.generate([int(t) for t in input_ids], temp=0.0, top_k=1)   # reset: reuse the longest prefix
        for tok in gen:
            out.append(int(tok))
            if len(out) >= self.k:
                break
        gen.close()
        return np.array(out, dtype=np.intc)


class _Worker:
    """The peer's llama.cpp instance in this (worker) process: one ``Llama`` (with its draft
    hook), greedy or sampled generation of one prompt, steps counted from ``eval`` calls."""

    def __init__(self, path: str, kind: str, options: dict, threads: int, n_ctx: int):
        llama_cpp = _llama_cpp()
        k = int(options.get("num_pred_tokens", 5))
        draft = None
        if kind == "llamacpp-pld":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            draft = LlamaPromptLookupDecoding(num_pred_tokens=k, max_ngram_size=int(options.get("max_ngram_size", 2)))
        elif kind == "llamacpp-draft":
            draft = GgufDraft(Path(options["draft_path"]), threads, n_ctx, k)
        self.version = llama_cpp.__version__
        self.llm = open_llama(Path(path), threads, n_ctx, draft)
        self.evals = 0
        inner = self.llm.eval

        def counted(tokens):
            self.evals += 1
            return inner(tokens)
        self.llm.eval = counted

    def generate(self, prompt: list[int], max_tokens: int, eos: list[int], sampling: dict, seed) -> dict:
        if seed is not None:
            self.llm.set_seed(int(seed))
        self.llm.reset()
        self.evals, out = 0, []
        t0 = time.perf_counter()
        if max_tokens > 0:
            gen = self.llm.generate(prompt, reset=True, **sampling)
            for tok in gen:
                if int(tok) in eos:
                    break
                out.append(int(tok))
                if len(out) >= max_tokens:
                    break
            gen.close()
        return {"tokens": out, "wall_s": time.perf_counter() - t0, "evals": self.evals}


def worker_main() -> None:
    """``python -m verispec.bench.llamacpp``: serve one peer over JSON lines on stdin/stdout (first
    line: its settings; then one request per prompt)."""
    import json
    import sys
    reply = lambda obj: (sys.stdout.write(json.dumps(obj) + "\n"), sys.stdout.flush())  # noqa: E731
    try:
        worker = _Worker(**json.loads(sys.stdin.readline()))
    except Exception as e:  # noqa: BLE001 - reported to the parent as the method's reason
        reply({"error": f"{type(e).__name__}: {e}"})
        return
    reply({"version": worker.version})
    for line in sys.stdin:
        reply(worker.generate(**json.loads(line)))


class LlamaCppRunner(GgufPeer):
    """Runs one llama.cpp peer: ``generate(prompts, params) -> GenResult`` (one prompt at a time).

    llama.cpp runs in a worker process of its own: its OpenMP threads then wait the way llama.cpp
    expects (actively) while this process keeps ``OMP_WAIT_POLICY=PASSIVE`` for torch; in one
    process the two runtimes' settings collide and llama.cpp ran 2.5x slower. ``wall_s`` is timed
    in the worker around llama.cpp's generation (the pipe's round trip is not charged to it)."""

    def __post_init__(self):
        import os
        import subprocess
        import sys
        if self.kind not in LLAMACPP_KINDS:
            raise BenchError(f"unknown llama.cpp peer {self.kind!r}; use one of {LLAMACPP_KINDS}")
        _llama_cpp()                                         # missing: BenchError with the hint, here
        opts = dict(self.options)
        if self.kind == "llamacpp-draft":
            if not opts.get("draft_model"):
                raise BenchError("llamacpp-draft needs 'draft_model' (a GGUF model name or path)")
            opts["draft_path"] = str(gguf_path(opts["draft_model"]))
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        self._proc = subprocess.Popen([sys.executable, "-m", "verispec.bench.llamacpp"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=env)
        hello = self._call(dict(path=str(self.path), kind=self.kind, options=opts,
                                threads=torch.get_num_threads(), n_ctx=self.n_ctx))
        if "error" in hello:
            self.close()
            raise BenchError(f"llama.cpp could not load {self.path.name}: {hello['error']}")
        self.version = hello["version"]

    def _call(self, obj: dict) -> dict:
        import json
        self._proc.stdin.write(json.dumps(obj) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise BenchError(f"the llama.cpp worker exited (code {self._proc.wait()}): it crashed")
        return json.loads(line)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> GenResult:
        if len(prompts) != 1:
            raise BenchError("the llama.cpp peer runs one sequence at a time")
        prompt = [int(t) for t in prompts[0]]
        if len(prompt) + params.max_tokens > self.n_ctx:
            raise BenchError(f"prompt of {len(prompt)} tokens + {params.max_tokens} new exceeds n_ctx {self.n_ctx}")
        sampling = dict(temp=0.0, top_k=1) if params.greedy else dict(
            temp=params.temperature, top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else 0)
        r = self._call(dict(prompt=prompt, max_tokens=params.max_tokens, eos=list(self.eos_token_ids),
                            sampling=sampling, seed=params.seed))
        out = r["tokens"]
        stats = SpecStats(num_steps=max(0, r["evals"] - 1), num_emitted_tokens=len(out))   # eval 1: the prompt
        return GenResult([out], [self.tokenizer.decode(out, skip_special_tokens=True)], r["wall_s"], stats)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)


def build_llamacpp(kind: str, loaded: LoadedModel, options: dict | None) -> LlamaCppRunner:
    """The peer for ``loaded`` (its GGUF file): ``BenchError`` when llama.cpp cannot run it."""
    path, eos = gguf_target(loaded, "llama.cpp")
    return LlamaCppRunner(kind, path, eos, loaded.tokenizer, dict(options or {}))


if __name__ == "__main__":
    worker_main()
