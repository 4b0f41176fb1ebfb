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
agreement, not held to be token-identical. Threads: the run's torch thread count. Steps (for the
acceptance columns) are counted as the target's ``eval`` calls after the prompt. llama-cpp-python
is installed by ``make bench-llamacpp`` (an sdist: a cmake build), never by ``make test``; where it
is missing the methods are reported unavailable with that reason.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..metrics import SpecStats
from ..models.loading import LoadedModel
from ..models.sources import resolve_model
from ..sampling import SamplingParams
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


def open_llama(path: Path, threads: int, n_ctx: int, draft=None):
    llama_cpp = _llama_cpp()
    return llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                           verbose=False, draft_model=draft, logits_all=False)


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
        gen = self.llm.generate([int(t) for t in input_ids], temp=0.0, top_k=1, reset=False)
        for tok in gen:
            out.append(int(tok))
            if len(out) >= self.k:
                break
        gen.close()
        return np.array(out, dtype=np.intc)


@dataclass
class LlamaCppRunner:
    """Runs one llama.cpp peer: ``generate(prompts, params) -> GenResult`` (one prompt at a time)."""
    kind: str
    path: Path
    eos_token_ids: tuple[int, ...]
    tokenizer: Any
    options: dict = field(default_factory=dict)
    n_ctx: int = 4096
    max_batch: int = 1
    _llm: Any = None

    def __post_init__(self):
        if self.kind not in LLAMACPP_KINDS:
            raise BenchError(f"unknown llama.cpp peer {self.kind!r}; use one of {LLAMACPP_KINDS}")
        llama_cpp = _llama_cpp()
        threads = torch.get_num_threads()
        draft = None
        k = int(self.options.get("num_pred_tokens", 5))
        if self.kind == "llamacpp-pld":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            draft = LlamaPromptLookupDecoding(num_pred_tokens=k,
                                              max_ngram_size=int(self.options.get("max_ngram_size", 2)))
        elif self.kind == "llamacpp-draft":
            name = self.options.get("draft_model")
            if not name:
                raise BenchError("llamacpp-draft needs 'draft_model' (a GGUF model name or path)")
            draft = GgufDraft(gguf_path(name), threads, self.n_ctx, k)
        self.version = llama_cpp.__version__
        self._llm = open_llama(self.path, threads, self.n_ctx, draft)
        self._evals = 0
        inner = self._llm.eval

        def counted(tokens):
            self._evals += 1
            return inner(tokens)
        self._llm.eval = counted

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> GenResult:
        if len(prompts) != 1:
            raise BenchError("the llama.cpp peer runs one sequence at a time")
        prompt = prompts[0]
        if len(prompt) + params.max_tokens > self.n_ctx:
            raise BenchError(f"prompt of {len(prompt)} tokens + {params.max_tokens} new exceeds n_ctx {self.n_ctx}")
        kw = dict(temp=0.0, top_k=1) if params.greedy else dict(
            temp=params.temperature, top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else 0)
        if params.seed is not None:
            self._llm.set_seed(params.seed)
        self._llm.reset()
        self._evals = 0
        out: list[int] = []
        t0 = time.perf_counter()
        if params.max_tokens > 0:
            gen = self._llm.generate(prompt, reset=True, **kw)
            for tok in gen:
                if int(tok) in self.eos_token_ids:
                    break
                out.append(int(tok))
                if len(out) >= params.max_tokens:
                    break
            gen.close()
        wall = time.perf_counter() - t0
        steps = max(0, self._evals - 1)              # the first eval is the prompt
        stats = SpecStats(num_steps=steps, num_emitted_tokens=len(out))
        return GenResult([out], [self.tokenizer.decode(out, skip_special_tokens=True)], wall, stats)


def build_llamacpp(kind: str, loaded: LoadedModel, options: dict | None) -> LlamaCppRunner:
    """The peer for ``loaded`` (its GGUF file): ``BenchError`` when llama.cpp cannot run it."""
    if loaded.format != "gguf":
        raise BenchError(f"llama.cpp reads GGUF files; the target {loaded.name} was loaded from {loaded.format}")
    eos = tuple(loaded.config.eos_token_ids) or (loaded.tokenizer.eos_token_id,)
    return LlamaCppRunner(kind, Path(loaded.path), eos, loaded.tokenizer, dict(options or {}))
