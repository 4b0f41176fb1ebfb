"""Typed ``speculative_config`` (keys as vLLM names them): one frozen dataclass per method.

``SpeculativeConfig.from_dict(d)`` reads ``d["method"]``, picks that method's config class and
fails on any key the method does not use (naming the method that does use it, and listing the
method's own keys). Values are checked once, at construction. A method's config says which
acceptance rule it asks for (``acceptance()``): lossless unless the user named a lossy one.

Methods registered by ``verispec.drafting.register`` bring their own config class (a subclass
of ``SpeculativeConfig``); ``CustomSpecConfig`` is the default for them.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from ..core.acceptance import LOSSLESS, AcceptanceRule, LossyTypicalAcceptance
from ..core.tree import validate_choices


class SpecMethod(str, enum.Enum):
    NGRAM = "ngram"
    DRAFT_MODEL = "draft_model"
    EAGLE = "eagle"
    EAGLE3 = "eagle3"
    MEDUSA = "medusa"
    SUFFIX = "suffix"
    HYBRID = "hybrid"


class SpecConfigError(ValueError):
    """A speculative_config that cannot work; the message says which key and why."""


_POSITIVE = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "num_matches",
             "self_draft_layers", "topk", "depth", "num_draft_tokens", "suffix_decoding_max_tree_depth")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Base of every method's config: the keys all methods share."""
    method: ClassVar[str] = ""
    num_speculative_tokens: int | None = None      # draft length (chain) / tree depth

    @classmethod
    def keys(cls) -> list[str]:
        return ["method"] + [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, d: dict[str, Any] | str | "SpeculativeConfig" | None) -> "SpeculativeConfig | None":
        """The typed config of ``d`` (a dict, a JSON string, a config, or None)."""
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        if isinstance(d, str):
            try:
                d = json.loads(d)
            except json.JSONDecodeError as e:
                raise SpecConfigError(f"speculative_config is not valid JSON: {e}") from e
        if not isinstance(d, dict):
            raise SpecConfigError(f"speculative_config must be a dict, got {type(d).__name__}")
        if "method" not in d:
            raise SpecConfigError(f"speculative_config needs 'method', one of {sorted(METHOD_CONFIGS)}")
        config_cls = METHOD_CONFIGS.get(str(d["method"]))
        if config_cls is None:
            raise SpecConfigError(f"unknown speculative method {d['method']!r}; choose one of {sorted(METHOD_CONFIGS)}")
        args = {k: v for k, v in d.items() if k != "method"}
        _check_keys(config_cls, args)
        if args.get("tree") is not None:
            try:
                args["tree"] = tuple(validate_choices(args["tree"]))
            except ValueError as e:
                raise SpecConfigError(f"speculative_config 'tree': {e}") from e
        if isinstance(args.get("eagle_aux_hidden_state_layer_ids"), list):
            args["eagle_aux_hidden_state_layer_ids"] = tuple(args["eagle_aux_hidden_state_layer_ids"])
        cfg = config_cls(**args)
        cfg.check()
        return cfg

    def check(self) -> None:
        """Raise ``SpecConfigError`` for a value that cannot work (subclasses add their rules)."""
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in _POSITIVE and v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise SpecConfigError(f"speculative_config '{f.name}' must be a positive integer, got {v!r}")

    def acceptance(self) -> AcceptanceRule:
        """The acceptance rule this config asks for (lossless unless a lossy one is named)."""
        return LOSSLESS

    def as_dict(self) -> dict:
        out = {"method": self.method}
        out.update({f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None})
        if getattr(self, "tree", None) is not None:
            out["tree"] = [list(c) for c in self.tree]
        return out


def _check_bool(config: SpeculativeConfig, key: str) -> None:
    v = getattr(config, key)
    if v is not None and not isinstance(v, bool):
        raise SpecConfigError(f"speculative_config '{key}' must be true or false, got {v!r}")


def _check_count(config: SpeculativeConfig, key: str) -> None:
    """``key`` is None or an integer >= 0."""
    v = getattr(config, key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
        raise SpecConfigError(f"speculative_config '{key}' must be an integer >= 0, got {v!r}")


def _check_keys(config_cls: type[SpeculativeConfig], args: dict) -> None:
    own = set(config_cls.keys())
    extra = sorted(set(args) - own)
    if not extra:
        return
    where = []
    for key in extra:
        users = sorted(m for m, c in METHOD_CONFIGS.items() if key in c.keys())
        where.append(f"'{key}' applies to method {' / '.join(repr(u) for u in users)}" if users
                     else f"'{key}' is not a speculative_config key")
    raise SpecConfigError(f"unknown speculative_config keys {extra} for method '{config_cls.method}' "
                          f"({'; '.join(where)}); method '{config_cls.method}' takes {config_cls.keys()}")


@dataclass(frozen=True)
class NgramConfig(SpeculativeConfig):
    """Prompt lookup (n-gram): propose what followed the last n tokens earlier in the context."""
    method: ClassVar[str] = SpecMethod.NGRAM.value
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    num_matches: int = 1                     # continuations merged into a tree
    prompt_lookup_extra: int | None = None   # after an n-token match propose <= n + this
    adaptive_drafting: bool | None = None    # the draft-budget estimator (draft_gate) gives each request
                                             # and step its budget, down to none (default: on)

    def check(self) -> None:
        super().check()
        _check_bool(self, "adaptive_drafting")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SpecConfigError("prompt_lookup_min must be <= prompt_lookup_max")
        _check_count(self, "prompt_lookup_extra")


@dataclass(frozen=True)
class DraftModelConfig(SpeculativeConfig):
    """An independent draft model with the target's tokenizer, or ``model: "self"``."""
    method: ClassVar[str] = SpecMethod.DRAFT_MODEL.value
    model: str | None = None                 # model name or path; "self" = self-draft
    self_draft_layers: int | None = None     # with model "self": the target's first L layers
    tree: tuple[tuple[int, ...], ...] | None = None   # static tree, choices format
    draft_dtype: str | None = None           # the draft's dtype (default: the target's)
    draft_vocab: str | None = None           # reduced draft vocabulary file (d2t / t2d)
    draft_confidence_threshold: float | None = None   # chains: stop below this draft probability
    draft_compile: bool | None = None        # the draft's forwards through torch.compile (default: as the target)
    adaptive_drafting: bool | None = None    # the draft-budget estimator (draft_gate) gives each request
                                             # and step its budget, down to none (default: on)

    def check(self) -> None:
        super().check()
        _check_bool(self, "adaptive_drafting")
        if not self.model:
            raise SpecConfigError("method 'draft_model' needs 'model' (a model name or path, or 'self')")
        _check_bool(self, "draft_compile")
        if self.model == "self" and self.self_draft_layers is None:
            raise SpecConfigError("model 'self' (self-draft) needs 'self_draft_layers'")
        c = self.draft_confidence_threshold
        if c is None:
            return
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 < c < 1.0:
            raise SpecConfigError(f"speculative_config 'draft_confidence_threshold' must be a number in (0, 1), got {c!r}")
        if self.tree is not None:
            raise SpecConfigError("'draft_confidence_threshold' applies to a draft_model chain (no static 'tree')")


@dataclass(frozen=True)
class TreeHeadConfig(SpeculativeConfig):
    """Keys shared by EAGLE heads: a static ``tree``, or an EAGLE-2 dynamic tree (``topk``,
    ``depth``, ``num_draft_tokens``, ``rank_by``, ``rerank``), or a chain."""
    model: str | None = None                 # head checkpoint folder (default: the shipped head)
    tree: tuple[tuple[int, ...], ...] | None = None
    topk: int | None = None
    depth: int | None = None
    num_draft_tokens: int | None = None
    rank_by: str | None = None               # "path" (EAGLE-2) | "confidence" (ablation)
    rerank: bool | None = None               # global rerank (default true)
    draft_vocab: str | None = None           # runtime cut of the head's draft vocabulary (file); "full":
                                             # none (default: the head folder's draft_vocab.safetensors)
    adaptive_drafting: bool | None = None    # a draft budget per request and step (draft_gate);
                                             # default: on for a shape chosen from measured costs
    head_context: int | None = None          # a prompt's last pairs the head catches up on at the start
                                             # (default: HEAD_CONTEXT); 0: the whole prompt

    def check(self) -> None:
        super().check()
        _check_bool(self, "adaptive_drafting")
        _check_count(self, "head_context")
        dynamic = [k for k in ("topk", "depth", "num_draft_tokens") if getattr(self, k) is not None]
        if dynamic and self.tree is not None:
            raise SpecConfigError(f"give either a static 'tree' or dynamic-tree keys {dynamic}, not both")


@dataclass(frozen=True)
class EagleConfig(TreeHeadConfig):
    """EAGLE-1 head (the target's last hidden state)."""
    method: ClassVar[str] = SpecMethod.EAGLE.value


@dataclass(frozen=True)
class Eagle3Config(TreeHeadConfig):
    """EAGLE-3 / 3.1 head (three fused target layers)."""
    method: ClassVar[str] = SpecMethod.EAGLE3.value
    eagle_aux_hidden_state_layer_ids: tuple[int, ...] | None = None   # vLLM's override of the layers


@dataclass(frozen=True)
class MedusaSpecConfig(SpeculativeConfig):
    """Medusa heads on a static tree; ``typical_acceptance`` asks for the LOSSY rule."""
    method: ClassVar[str] = SpecMethod.MEDUSA.value
    model: str | None = None
    tree: tuple[tuple[int, ...], ...] | None = None
    typical_acceptance: bool | None = None   # Medusa typical acceptance: LOSSY, opt-in
    posterior_threshold: float | None = None # typical acceptance epsilon (default 0.09)
    posterior_alpha: float | None = None     # typical acceptance delta (default 0.3)
    draft_vocab: str | None = None           # reduced draft vocabulary file; "full": none (default:
                                             # the checkpoint folder's draft_vocab.safetensors, if any)
    adaptive_drafting: bool | None = None    # as for EAGLE heads (draft_gate)

    def check(self) -> None:
        super().check()
        _check_bool(self, "adaptive_drafting")
        if self.tree is not None and self.num_speculative_tokens is not None:
            raise SpecConfigError("give a static 'tree' or 'num_speculative_tokens' (a chain), not both")
        self.acceptance()

    def acceptance(self) -> AcceptanceRule:
        if not self.typical_acceptance:
            for k in ("posterior_threshold", "posterior_alpha"):
                if getattr(self, k) is not None:
                    raise SpecConfigError(f"'{k}' only applies with 'typical_acceptance': true (lossy)")
            return LOSSLESS
        d = LossyTypicalAcceptance()
        try:
            return LossyTypicalAcceptance(
                posterior_threshold=d.posterior_threshold if self.posterior_threshold is None else self.posterior_threshold,
                posterior_alpha=d.posterior_alpha if self.posterior_alpha is None else self.posterior_alpha)
        except (ValueError, TypeError) as e:
            raise SpecConfigError(f"speculative_config typical acceptance: {e}") from e


@dataclass(frozen=True)
class SuffixConfig(SpeculativeConfig):
    """SuffixDecoding (arXiv 2411.04975): suffix trees over this request's prompt and output and
    over earlier requests' outputs; defaults are vLLM's. ``num_speculative_tokens`` (default: the
    tree depth, as vLLM) caps the nodes of a proposed tree."""
    method: ClassVar[str] = SpecMethod.SUFFIX.value
    suffix_decoding_max_tree_depth: int = 24         # bounds match length + speculation depth
    suffix_decoding_max_cached_requests: int = 10000 # outputs kept in the global tree (FIFO); 0 = off
    suffix_decoding_max_spec_factor: float = 1.0     # nodes <= this x the matched suffix length
    suffix_decoding_min_token_prob: float = 0.1      # keep nodes whose estimated path probability >= this
    suffix_decoding_corpus: str | None = None        # answers preloaded into the global tree: None = none,
                                                     # "auto" = the model's shipped corpus if any, else a path
    adaptive_drafting: bool | None = None    # the draft-budget estimator (draft_gate) gives each request
                                             # and step its budget, down to none (default: on)

    def check(self) -> None:
        super().check()
        _check_bool(self, "adaptive_drafting")
        n = self.suffix_decoding_max_cached_requests
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < 2 ** 31:
            raise SpecConfigError("speculative_config 'suffix_decoding_max_cached_requests' must be an integer "
                                  f">= 0 (0 turns the global tree off), got {n!r}")
        f = self.suffix_decoding_max_spec_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < float("inf"):
            raise SpecConfigError(f"speculative_config 'suffix_decoding_max_spec_factor' must be a number >= 0, got {f!r}")
        p = self.suffix_decoding_min_token_prob
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
            raise SpecConfigError(f"speculative_config 'suffix_decoding_min_token_prob' must be a number in [0, 1], got {p!r}")
        c = self.suffix_decoding_corpus
        if c is not None and (not isinstance(c, str) or not c):
            raise SpecConfigError("speculative_config 'suffix_decoding_corpus' must be \"auto\", null or a corpus "
                                  f"path (`verispec data suffix-corpus` writes one), got {c!r}")

    @property
    def max_nodes(self) -> int:
        """The most nodes a proposed tree has: ``num_speculative_tokens``, else the tree depth."""
        return self.num_speculative_tokens or self.suffix_decoding_max_tree_depth


@dataclass(frozen=True)
class HybridConfig(SpeculativeConfig):
    """An EAGLE-3 head and suffix decoding, one source per request and step (``drafting.hybrid``).
    The head's tree is the shape chosen from its profile and this machine's measured costs;
    ``num_speculative_tokens`` and the ``suffix_*`` keys are the suffix half's, as for ``suffix``."""
    method: ClassVar[str] = SpecMethod.HYBRID.value
    model: str | None = None                 # EAGLE-3 head folder (default: the shipped head)
    draft_vocab: str | None = None           # the head's runtime vocabulary cut, as for eagle3
    head_context: int | None = None          # the head's prompt window, as for eagle3
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_corpus: str | None = None

    def check(self) -> None:
        super().check()
        self.suffix_config()
        self.head_config().check()

    def suffix_config(self) -> SuffixConfig:
        """The suffix half (checked as method 'suffix' checks it)."""
        cfg = SuffixConfig(num_speculative_tokens=self.num_speculative_tokens,
                           suffix_decoding_max_tree_depth=self.suffix_decoding_max_tree_depth,
                           suffix_decoding_max_cached_requests=self.suffix_decoding_max_cached_requests,
                           suffix_decoding_max_spec_factor=self.suffix_decoding_max_spec_factor,
                           suffix_decoding_min_token_prob=self.suffix_decoding_min_token_prob,
                           suffix_decoding_corpus=self.suffix_decoding_corpus)
        cfg.check()
        return cfg

    def head_config(self) -> Eagle3Config:
        """The head half: an ``eagle3`` config, its shape chosen from costs, adaptive drafting off."""
        return Eagle3Config(model=self.model, draft_vocab=self.draft_vocab, adaptive_drafting=False,
                            head_context=self.head_context)


@dataclass(frozen=True)
class CustomSpecConfig(SpeculativeConfig):
    """Default config of a method registered with ``verispec.drafting.register``."""
    model: str | None = None
    adaptive_drafting: bool | None = None    # the draft-budget estimator cuts its trees (default: on)

    def check(self) -> None:
        super().check()
        _check_bool(self, "adaptive_drafting")


METHOD_CONFIGS: dict[str, type[SpeculativeConfig]] = {
    c.method: c for c in (NgramConfig, DraftModelConfig, EagleConfig, Eagle3Config, MedusaSpecConfig, SuffixConfig,
                          HybridConfig)}


def register_config(name: str, config_cls: type[SpeculativeConfig]) -> None:
    """Make ``from_dict`` build ``config_cls`` for ``method: name`` (``drafters.register`` calls it)."""
    if not (isinstance(config_cls, type) and issubclass(config_cls, SpeculativeConfig)):
        raise TypeError(f"a method's config must subclass SpeculativeConfig, got {config_cls!r}")
    if config_cls.method != name:
        raise ValueError(f"config class {config_cls.__name__} says method {config_cls.method!r}, registered as {name!r}")
    METHOD_CONFIGS[name] = config_cls
