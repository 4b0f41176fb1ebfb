"""Public API shaped like vLLM's: ``LLM(model, speculative_config=...)``, ``generate``, ``chat``.

This is the only layer that knows the tokenizer: it turns prompts into token ids, runs the
``Engine`` and turns ids back into text (stop strings cut the text, as in vLLM).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence as Seq

import torch

from .core.acceptance import LOSSLESS
from .core.detokenizer import IncrementalDetokenizer
from .models.device import module_device, resolve_device, same_device
from .drafting import build_drafter_factory
from .core.engine import Engine, Sequence
from .core.grammar import GrammarCompiler
from .core.logprobs import TokenLogprob
from .core.metrics import SpecStats
from .models.loading import LoadedModel, load_model
from .models.packed import WeightFormat
from .core.params import SamplingParams
from .core.prefix_cache import PrefixCache
from .drafting.spec_config import DraftModelConfig, SpeculativeConfig

PromptType = str | dict


@dataclass
class RequestMetrics:
    tokens_per_second: float
    num_output_tokens: int
    time_s: float
    time_to_first_token_s: float
    num_steps: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    mean_acceptance_length: float          # bonus token included
    acceptance_rate_per_pos: list[float] = field(default_factory=list)
    draft_budgets: dict[int, int] = field(default_factory=dict)   # the estimator's budget -> steps (0: plain)
    draft_time_s: float = 0.0              # in the drafter's propose
    verify_time_s: float = 0.0             # target forward + acceptance + cache compaction
    modelled_speedup: float | None = None  # the draft-budget estimator's expected decode speed-up
                                           # over plain steps, from its choices (None: no estimator)
    acceptance: str = "lossless"           # the acceptance rule's name
    lossy: bool = False                    # True: a lossy rule (opt-in) decided what was kept


@dataclass
class CompletionOutput:
    """One of the ``n`` outputs of a prompt (vLLM's name and fields)."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    """A prompt's result. ``text``, ``token_ids``, ``finish_reason``, ``metrics`` and ``logprobs``
    are those of output 0; ``outputs`` lists all ``SamplingParams.n`` of them (as vLLM's)."""
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: RequestMetrics
    logprobs: list[TokenLogprob] | None = None     # per output token, when SamplingParams.logprobs is set
    prompt_logprobs: list[TokenLogprob] | None = None   # prompt tokens 1.., when SamplingParams.prompt_logprobs is set
    outputs: list[CompletionOutput] = field(default_factory=list)


class LLM:
    def __init__(self, model: str = "smollm2-135m", dtype: str | torch.dtype = "float32",
                 speculative_config: dict | str | SpeculativeConfig | None = None,
                 max_num_seqs: int = 8, max_model_len: int | None = None, num_threads: int | None = None,
                 loaded: LoadedModel | None = None, weights: str = "auto",
                 prefix_cache_mb: float = 0, prefix_cache_block_size: int = 16, prefix_cache_exact: bool = False,
                 device: str | torch.device | None = None, compile: bool = False):
        """``loaded`` lets several LLMs share one loaded target (tests, benchmarks).
        ``device``: where the target, its drafter, the KV caches and every tensor of decoding live:
        "cpu", "auto" (cuda when available), "cuda", "cuda:1"... (``verispec.models.device``); None (the
        default) means the ``loaded`` model's device, else "cpu". On CUDA use dtype bfloat16 or
        float16 (the fast path there).
        ``weights="auto"`` (default): the fastest weights faithful to the checkpoint
        (``models.auto_weights``: int4 for a 4-bit GGUF such as the default SmolLM2 file, else fp16
        packing; dense on CUDA or with a dtype other than float32); ``weights="dense"``: as loaded.
        ``weights="fp16"``: fp16-packed matmul weights on the CPU (``models.packed``): faster, and a
        few-token verification forward costs about a one-token decode; not bit-equal to fp32; CPU only.
        ``weights="int8"``, ``"int4"``, ``"int4-head8"``, ``"int4-a8"``, ``"int4-all"``: quantised
        packed weights (``models.packed.WeightFormat``); the formats with int8 activations speculate
        only with the row-invariant attention op (refused without it, see below).
        ``prefix_cache_mb`` > 0: one ``PrefixCache`` of that many MiB (blocks of
        ``prefix_cache_block_size`` tokens) shared by every engine this LLM makes, so a prompt
        repeating an earlier prompt or conversation (system prompt, chat history) prefills only
        what is new; 0 (default) turns it off. Its counters: ``self.prefix_cache.stats()``.
        ``prefix_cache_exact``: reuse only whole chunks of prefilled prompt blocks, so answers are
        bit-identical to a cold prefill's (``PrefixCache``, "Exact reuse"); default False: any
        cached block, chat answers included, where a near-tie token may flip.
        ``compile=True``: decode and verify forwards (and a draft model's, unless its config sets
        ``draft_compile``) through ``torch.compile`` (``models.compiled``:
        fused small ops; compiled once per process, the first steps pay it; ``self.compiled``
        reports graphs and compile seconds)."""
        if isinstance(prefix_cache_mb, bool) or not isinstance(prefix_cache_mb, (int, float)) or \
                not 0 <= prefix_cache_mb < float("inf"):
            raise ValueError(f"prefix_cache_mb must be a number >= 0 (0 = off), got {prefix_cache_mb!r}")
        if isinstance(prefix_cache_block_size, bool) or not isinstance(prefix_cache_block_size, int) or \
                prefix_cache_block_size < 1:
            raise ValueError(f"prefix_cache_block_size must be an int >= 1, got {prefix_cache_block_size!r}")
        self.prefix_cache = PrefixCache.from_mib(prefix_cache_mb, prefix_cache_block_size, prefix_cache_exact) \
            if prefix_cache_mb > 0 else None
        if num_threads:
            torch.set_num_threads(num_threads)
        self.target = loaded or load_model(model, dtype=dtype, weights=weights,
                                           device="cpu" if device is None else device)
        self.device = module_device(self.target.model)
        if loaded is not None and device is not None and not same_device(resolve_device(device), self.device):
            raise ValueError(f"device {str(device)!r} asked for, but the loaded model lives on {self.device}")
        self.tokenizer = self.target.tokenizer
        if not isinstance(compile, bool):
            raise ValueError(f"compile must be True or False, got {compile!r}")
        self.compiled = None
        if compile:
            from .models.compiled import CompiledForward
            self.compiled = CompiledForward.shared(self.target.model)
        self.spec = SpeculativeConfig.from_dict(speculative_config)
        if self.spec is not None and self.target.weights.int8_activations:
            from .models import attention
            if not attention.row_invariant(self.target.model.cfg):
                raise ValueError(
                    f"weights={self.target.weights.value!r} speculates only with the row-invariant attention op, unavailable here "
                    f"({attention.unavailable_reason() or 'head size not a multiple of 16 up to 256'}): "
                    "per-token int8 activations turn SDPA's last-bit differences between a one-token decode "
                    "and a verify forward into logit differences of up to ~2, so speculation would not "
                    "reproduce its vanilla decoding; speculate on weights='fp16' (or 'int4', 'dense')")
        if self.compiled is not None and self.spec is not None:
            self.compiled.speculative = True
            if isinstance(self.spec, DraftModelConfig) and self.spec.draft_compile is None:
                self.spec = replace(self.spec, draft_compile=True)    # the draft follows the target
        self.acceptance = self.spec.acceptance() if self.spec else LOSSLESS
        self._make_drafter = build_drafter_factory(self.spec, self.target, forward=self.compiled) \
            if self.spec else None
        # the tree a head's default config chose from measured costs (draft_shape.ShapeChoice)
        self.draft_shape = self._make_drafter.shape if self._make_drafter else None
        ctx = self.target.config.max_position_embeddings
        self.max_model_len = min(max_model_len or ctx, ctx)
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = tuple(self.target.config.eos_token_ids) or \
            ((self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()

    # -- prompts ---------------------------------------------------------------------------
    def encode_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            ids = prompt.get("prompt_token_ids")
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ValueError("a dict prompt needs 'prompt_token_ids': a list of ints")
            bad = [i for i in ids if not 0 <= i < self.target.config.vocab_size]
            if bad:
                raise ValueError(f"prompt_token_ids out of vocabulary range: {bad[:5]}")
            text = None
        elif isinstance(prompt, str):
            text, ids = prompt, self.tokenizer(prompt).input_ids
        else:
            raise TypeError(f"a prompt is a str or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len} "
                             "tokens (prompt plus at least one generated token)")
        return text, ids

    def apply_chat_template(self, messages: list[dict]) -> str:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"model {self.target.name!r} has no chat template (a base model?): send a plain "
                             "prompt (generate / --prompt without --chat / /v1/completions) instead")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    # -- generation ------------------------------------------------------------------------
    def make_engine(self, max_batch: int, max_len: int, **engine_options) -> Engine:
        """An engine of ``max_batch`` rows of ``max_len`` tokens over this LLM's target, drafter,
        gate and prefix cache; ``engine_options``: more ``Engine`` keywords (``prefill_chunk``)."""
        kv = engine_options.get("kv")     # a paged target cache: a drafter with a cache of its own pages it too
        drafter = self._make_drafter(max_batch, max_len, kv=kv) if self._make_drafter else None
        slack = (drafter.max_tree_nodes if drafter else 0) + 2
        return Engine(self.target.model, drafter, max_batch=max_batch, max_len=max_len + slack,
                      eos_token_ids=self.eos_token_ids, max_context=self.max_model_len,
                      acceptance=self.acceptance, prefix_cache=self.prefix_cache, device=self.device,
                      forward=self.compiled, gate=self._make_gate(drafter.max_tree_nodes if drafter else 0),
                      **engine_options)

    def _make_gate(self, max_nodes: int = 0):
        """A per-engine ``DraftGate`` (the draft-budget estimator) for a drafter of at most
        ``max_nodes`` nodes, when the drafter factory makes one (adaptive drafting)."""
        return self._make_drafter.make_gate(max_nodes) if self._make_drafter else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def detokenizer(self, params: SamplingParams, decode=None) -> IncrementalDetokenizer:
        """The output layer of one output: incremental text and ``params``' stop strings."""
        return IncrementalDetokenizer(decode or self._decode, params.stop, params.include_stop_str_in_output)

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler of this model's tokenizer (built on first use)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.target.config.vocab_size, self.eos_token_ids)
            return self._grammars

    def check_params(self, params: SamplingParams) -> None:
        """Raise ValueError for params this model cannot honour (token ids outside the vocabulary,
        a structured-output constraint that does not compile)."""
        params.check_vocab(self.target.config.vocab_size)
        if params.structured_outputs is not None:
            self.grammars.grammar(params.structured_outputs)

    def new_sequence(self, prompt_ids: list[int], params: SamplingParams, on_tokens=None,
                     decode=None) -> tuple[Sequence, IncrementalDetokenizer]:
        """An engine ``Sequence`` whose stop strings are checked by its own detokenizer (and,
        with ``structured_outputs``, whose tokens a fresh grammar matcher constrains)."""
        detok = self.detokenizer(params, decode)
        so = params.structured_outputs
        return Sequence(prompt_ids=prompt_ids, params=params, on_tokens=on_tokens, stop_hook=detok.push,
                        constraint=self.grammars.constraint(so) if so is not None else None), detok

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 on_tokens: Callable[[int, list[int]], Any] | None = None) -> list[RequestOutput]:
        """Generate ``SamplingParams.n`` outputs for each prompt (with a seed, output j uses seed +
        j). ``on_tokens(index, new_ids)`` streams each step's tokens; ``index`` counts outputs over
        all prompts in order (the prompt's index when every n is 1)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            return []
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        for sp in params:
            self.check_params(sp)
        encoded = [self.encode_prompt(p) for p in prompts]
        seqs, owner, detoks = [], [], {}
        for i, ((_, ids), sp) in enumerate(zip(encoded, params)):
            for j in range(sp.n):
                cb = (lambda s, new, k=len(seqs): on_tokens(k, new)) if on_tokens else None
                seq, detoks[len(seqs)] = self.new_sequence(ids, sp.for_choice(j), cb)
                seqs.append(seq)
                owner.append(i)
        need = max(min(len(s.prompt_ids) + s.params.max_tokens, self.max_model_len) for s in seqs)
        engine = self.make_engine(min(len(seqs), self.max_num_seqs), need)
        t0 = time.perf_counter()
        for s in seqs:
            s.start_time = t0
        engine.run(seqs)
        texts = [detoks[k].finish() for k in range(len(seqs))]
        outs = []
        for i, (text, _) in enumerate(encoded):
            mine = [k for k, o in enumerate(owner) if o == i]
            out = self._output(seqs[mine[0]], text, texts[mine[0]])
            out.outputs = [CompletionOutput(j, texts[k], list(seqs[k].output_ids), seqs[k].finish_reason or "length",
                                            list(seqs[k].logprobs) if seqs[k].logprobs is not None else None)
                           for j, k in enumerate(mine)]
            outs.append(out)
        return outs

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, **kw) -> list[RequestOutput]:
        """Apply the chat template to each conversation and generate."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        prompts = [{"prompt_token_ids": self.tokenizer(self.apply_chat_template(m), add_special_tokens=False).input_ids}
                   for m in messages]
        return self.generate(prompts, sampling_params, **kw)

    def _output(self, seq: Sequence, prompt_text: str | None, text: str) -> RequestOutput:
        elapsed = (seq.end_time or time.perf_counter()) - seq.start_time
        st: SpecStats = seq.stats
        m = RequestMetrics(
            tokens_per_second=len(seq.output_ids) / elapsed if elapsed > 0 else 0.0,
            num_output_tokens=len(seq.output_ids), time_s=elapsed,
            time_to_first_token_s=(seq.first_token_time or seq.start_time) - seq.start_time,
            num_steps=st.num_steps, num_drafts=st.num_drafts, num_draft_tokens=st.num_draft_tokens,
            num_accepted_tokens=st.num_accepted_tokens, mean_acceptance_length=st.mean_acceptance_length,
            acceptance_rate_per_pos=st.acceptance_rate_per_pos, draft_budgets=dict(sorted(st.budgets.items())),
            draft_time_s=st.draft_time_s,
            verify_time_s=st.verify_time_s, modelled_speedup=st.modelled_speedup, acceptance=st.acceptance,
            lossy=st.lossy)
        return RequestOutput(seq.seq_id, prompt_text, list(seq.prompt_ids), text, list(seq.output_ids),
                             seq.finish_reason or "length", m,
                             list(seq.logprobs) if seq.logprobs is not None else None,
                             list(seq.prompt_logprobs) if seq.prompt_logprobs is not None else None)
