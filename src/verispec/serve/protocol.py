"""Request bodies of the OpenAI-compatible API (pydantic): what a client may send.

Unknown fields are kept and ignored (as OpenAI does); wrong types and out-of-range values fail
validation (the app answers 400). ``unsupported()`` names a valid field value this server cannot
honour (suffix, tools, vLLM extras, ...), or returns None. ``structured()``: the one structured-output
constraint a request may carry (``response_format`` json_object / json_schema, ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` or ``structured_outputs``). ``n`` (1..16) choices are separate
engine requests. ``logprob_count()``: how many top
logprobs the request asks for (None: no logprobs).

``sampling_params(request, max_tokens)`` maps a request onto ``SamplingParams`` field by field:
a field the request has under the same name is taken (None keeps the dataclass default), the few
in ``CONVERTED`` are computed, the ones in ``NOT_FROM_REQUEST`` are set elsewhere. A new
``SamplingParams`` field that is none of these fails every request (and a test), so it cannot be
forgotten here.
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from ..core.logprobs import MAX_LOGPROBS
from ..core.params import SamplingParams
from ..core.structured import StructuredOutputError, StructuredOutputsParams

Float = Annotated[float, Field(allow_inf_nan=False)]
Seed = Annotated[StrictInt, Field(ge=-2**63, le=2**64 - 1)]
# vLLM request extras this server does not implement: a request that sets one to anything but its
# default is refused rather than silently answered without it.
UNSUPPORTED_EXTRAS: dict[str, Any] = {
    "use_beam_search": False, "length_penalty": 1.0,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "bad_words": [],
    "prompt_logprobs": None, "truncate_prompt_tokens": None,
    "add_generation_prompt": True, "continue_final_message": False, "echo": False,
}
MAX_PROMPTS = 64            # prompts in one completions request (each gets n choices)
MAX_N = 16                  # choices per request (each is one engine request)
TopLogprobs = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]
StopList = Annotated[list[Annotated[str, Field(max_length=512)]], Field(max_length=16)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    seed: Seed | None = None
    stop: Annotated[str, Field(max_length=512)] | StopList | None = None
    stop_token_ids: Annotated[list[StrictInt], Field(max_length=64)] | None = None
    ignore_eos: StrictBool = False
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[Float, Field(gt=0.0, le=100.0)] | None = None     # vLLM's extra
    min_p: Annotated[Float, Field(ge=0.0, le=1.0)] | None = None                    # vLLM's extra
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None                     # vLLM's extra
    include_stop_str_in_output: StrictBool = False                                   # vLLM's extra
    allowed_token_ids: Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)] | None = None
    logit_bias: dict[str, Annotated[Float, Field(ge=-100.0, le=100.0)]] | None = None
    speculative_stats: StrictBool = False      # each choice reports its speculative-decoding stats
    # Structured output (at most one of these): OpenAI's response_format, vLLM's guided_* fields and
    # its newer structured_outputs object ({"json" | "json_object" | "regex" | "choice" | "grammar": ...}).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def bias(self) -> dict[int, float] | None:
        """``logit_bias`` with integer token ids (the vocabulary is checked by
        ``SamplingParams.check_vocab``); raises ValueError for a key that is not an id."""
        if not self.logit_bias:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            out[int(key)] = value
        return out

    def structured(self) -> StructuredOutputsParams | None:
        """The request's structured-output constraint, or None; raises StructuredOutputError
        (400) for a malformed one or for more than one way of asking."""
        given = {}
        if self.response_format is not None:
            spec = StructuredOutputsParams.from_response_format(self.response_format)
            if spec is not None:
                given["response_format"] = spec
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                given[name] = StructuredOutputsParams(**{kind: getattr(self, name)})
        if self.structured_outputs is not None:
            given["structured_outputs"] = StructuredOutputsParams.from_dict(self.structured_outputs)
        if len(given) > 1:
            raise StructuredOutputError(f"give one structured-output constraint, got {', '.join(given)}")
        return next(iter(given.values()), None)

    def unsupported(self) -> str | None:
        """Why this request asks for something this server cannot do, or None."""
        extra = self.model_extra or {}
        for name, default in UNSUPPORTED_EXTRAS.items():
            if name in extra and extra[name] is not None and extra[name] != default:
                return f"{name} is not supported by this server (only its default {default!r} is accepted)"
        return None

    def logprob_count(self) -> int | None:
        return None


class CompletionRequest(_Common):
    prompt: str | list[StrictInt] | Annotated[list[str], Field(max_length=MAX_PROMPTS)] | \
        Annotated[list[list[StrictInt]], Field(max_length=MAX_PROMPTS)]
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = None     # 0 only with echo (scoring a prompt)
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None
    logprobs: TopLogprobs | None = None

    def unsupported(self) -> str | None:
        if self.suffix or self.best_of not in (None, 1):
            return "suffix and best_of are not supported"
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens must be at least 1 (0 is allowed only with echo)"
        return super().unsupported()

    def logprob_count(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: TopLogprobs | None = None
    tools: list[Any] | None = None

    def unsupported(self) -> str | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs needs logprobs: true"
        if self.tools:
            return "tools are not supported"
        return super().unsupported()

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a ``prompt`` (completions) or ``messages`` (chat template applied)."""
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[StrictInt]


# SamplingParams fields a request does not carry under their own name, and what sets them.
NOT_FROM_REQUEST = {
    "max_tokens": "max_tokens / max_completion_tokens, checked against the context by the pipeline",
    "n": "each of the n choices is its own engine request (SamplingParams.for_choice)",
    "prompt_logprobs": "completions: echo with logprobs asks for the prompt's logprobs",
}
CONVERTED: dict[str, Callable[[_Common], Any]] = {
    "logit_bias": _Common.bias,                 # string keys -> token ids
    "logprobs": lambda r: r.logprob_count(),    # completions: a count; chat: logprobs + top_logprobs
    "structured_outputs": _Common.structured,   # response_format / guided_* / structured_outputs
}


def sampling_params(req: _Common, max_tokens: int) -> SamplingParams:
    """The ``SamplingParams`` of ``req`` (raises ValueError for values they refuse)."""
    kw: dict[str, Any] = {"max_tokens": max_tokens}
    for f in dataclasses.fields(SamplingParams):
        if f.name in NOT_FROM_REQUEST:
            continue
        value = CONVERTED[f.name](req) if f.name in CONVERTED else getattr(req, f.name)
        if value is not None:
            kw[f.name] = value
    return SamplingParams(**kw)
