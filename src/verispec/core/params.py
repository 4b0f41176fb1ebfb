"""``SamplingParams``: a request's decoding parameters, named as vLLM names them.

Validated once at construction. Every other layer derives what it needs from the dataclass's
fields (the logits pipeline in ``logits``, the server's request mapping and its response-cache
key), so a new field is written here and nowhere else by hand. Knows nothing about models.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .logprobs import MAX_LOGPROBS
from .structured import StructuredOutputsParams


@dataclass
class SamplingParams:
    """Per-request decoding parameters (vLLM names and defaults where they make sense).

    temperature 0 means greedy. ``top_k`` <= 0 and ``top_p`` == 1 disable those filters.
    ``stop``: strings that end generation (not included in the text). ``seed``: per-request RNG.
    ``logprobs``: None (default) reports nothing; ``k`` in 0..20 reports each output token's
    log-probability under the target and the ``k`` most likely alternatives (see ``logprobs``).
    ``min_tokens``: no end token (EOS, ``stop_token_ids``) before this many output tokens (their
    target probability is set to 0; stop strings still apply).
    ``allowed_token_ids``: only these tokens can be emitted (vLLM's; the others get -inf).
    ``logit_bias``: token id -> value in [-100, 100] added to the target logits (OpenAI's).
    ``include_stop_str_in_output``: keep the stop string that ended the text (see ``cut_at_stop``).
    ``n``: outputs per prompt in ``LLM.generate`` (with a seed, output j uses seed + j).
    ``prompt_logprobs``: the same for prompt tokens 1..n-1 (the first token has no distribution).
    ``min_p``: drop tokens below ``min_p`` x the top token's probability (after temperature and
    top-k, before top-p). ``presence_penalty`` / ``frequency_penalty`` (-2..2, generated tokens)
    and ``repetition_penalty`` (> 0, prompt and generated tokens) change the target logits
    (see ``logits``); speculation stays lossless with respect to the penalised target.
    ``structured_outputs``: what the output must match (a JSON schema, any JSON object, a regex,
    one of some strings, a Lark grammar: ``StructuredOutputsParams``, or its dict as vLLM's);
    speculation stays lossless with respect to the grammar-constrained target (``grammar``).
    """
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams (or its dict), got "
                             f"{type(self.structured_outputs).__name__}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (self.temperature >= 0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        for tok, bias in (self.logit_bias or {}).items():
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias maps token ids >= 0 to values in [-100, 100], got {tok!r}: {bias!r}")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise ValueError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {k!r}")

    def for_choice(self, j: int) -> "SamplingParams":
        """The params of output j of ``n``: with a seed, seed + j (output 0 is these params)."""
        return self if j == 0 or self.seed is None else dataclasses.replace(self, seed=self.seed + j)

    def check_vocab(self, vocab: int) -> None:
        """Raise ValueError when ``logit_bias`` or ``allowed_token_ids`` names a token id >= vocab."""
        for what, ids in (("logit_bias", self.logit_bias or {}), ("allowed_token_ids", self.allowed_token_ids or [])):
            if any(t >= vocab for t in ids):
                raise ValueError(f"{what} names a token id outside the vocabulary of {vocab}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def cache_key(self) -> tuple:
        """A hashable key over every field (lists and dicts as sorted tuples): two params with
        equal keys decode identically."""
        def frozen(v):
            if isinstance(v, StructuredOutputsParams):
                return v.cache_key()
            if isinstance(v, dict):
                return tuple(sorted(v.items()))
            return tuple(v) if isinstance(v, list) else v
        return tuple((f.name, frozen(getattr(self, f.name))) for f in dataclasses.fields(self))
