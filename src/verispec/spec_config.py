"""Typed ``speculative_config`` (keys as vLLM names them), validated once at construction."""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, fields
from typing import Any

from .tree import validate_choices


class SpecMethod(str, enum.Enum):
    NGRAM = "ngram"
    DRAFT_MODEL = "draft_model"
    EAGLE = "eagle"
    EAGLE3 = "eagle3"
    MEDUSA = "medusa"


class SpecConfigError(ValueError):
    """A speculative_config that cannot work; the message says which key and why."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpecMethod
    model: str | None = None                 # draft model / head checkpoint; "self" = self-draft
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    num_matches: int = 1                     # ngram: continuations merged into a tree
    prompt_lookup_extra: int | None = None   # ngram: after an n-token match propose <= n + this
    self_draft_layers: int | None = None     # draft_model with model="self": first L target layers
    tree: tuple[tuple[int, ...], ...] | None = None   # static tree, choices format
    topk: int | None = None                  # dynamic tree (EAGLE-2)
    depth: int | None = None
    num_draft_tokens: int | None = None
    draft_dtype: str | None = None
    draft_vocab: str | None = None           # draft_model: reduced draft vocabulary file (d2t / t2d)
    draft_confidence_threshold: float | None = None   # draft_model chain: stop below this draft prob
    # EAGLE / Medusa keys (validated by their drafter builders, see drafters/eagle.py, medusa.py)
    eagle_aux_hidden_state_layer_ids: tuple[int, ...] | None = None   # EAGLE-3 override, vLLM ids
    rank_by: str | None = None               # dynamic tree: "path" (EAGLE-2) | "confidence" (ablation)
    rerank: bool | None = None               # dynamic tree: global rerank (default true)
    typical_acceptance: bool | None = None   # Medusa typical acceptance: LOSSY, opt-in
    posterior_threshold: float | None = None # typical acceptance epsilon (default 0.09)
    posterior_alpha: float | None = None     # typical acceptance delta (default 0.3)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | str | "SpeculativeConfig" | None) -> "SpeculativeConfig | None":
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        if isinstance(d, str):
            try:
                d = json.loads(d)
            except json.JSONDecodeError as e:
                raise SpecConfigError(f"speculative_config is not valid JSON: {e}") from e
        if not isinstance(d, dict):
            raise SpecConfigError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise SpecConfigError(f"unknown speculative_config keys {unknown}; known keys: {sorted(known)}")
        if "method" not in d:
            raise SpecConfigError(f"speculative_config needs 'method', one of {[m.value for m in SpecMethod]}")
        try:
            method = SpecMethod(d["method"])
        except ValueError:
            raise SpecConfigError(f"unknown speculative method {d['method']!r}; "
                                  f"choose one of {[m.value for m in SpecMethod]}") from None
        args = dict(d, method=method)
        if args.get("tree") is not None:
            try:
                args["tree"] = tuple(validate_choices(args["tree"]))
            except ValueError as e:
                raise SpecConfigError(f"speculative_config 'tree': {e}") from e
        cfg = cls(**args)
        cfg.check()
        return cfg

    def check(self) -> None:
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "num_matches",
                    "self_draft_layers", "topk", "depth", "num_draft_tokens"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise SpecConfigError(f"speculative_config '{key}' must be a positive integer, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SpecConfigError("prompt_lookup_min must be <= prompt_lookup_max")
        extra = self.prompt_lookup_extra
        if extra is not None and (not isinstance(extra, int) or isinstance(extra, bool) or extra < 0):
            raise SpecConfigError(f"speculative_config 'prompt_lookup_extra' must be an integer >= 0, got {extra!r}")
        if extra is not None and self.method is not SpecMethod.NGRAM:
            raise SpecConfigError("'prompt_lookup_extra' applies to method 'ngram'")
        if self.method is SpecMethod.DRAFT_MODEL and not self.model:
            raise SpecConfigError("method 'draft_model' needs 'model' (a model name or path, or 'self')")
        if self.model == "self" and self.self_draft_layers is None:
            raise SpecConfigError("model 'self' (self-draft) needs 'self_draft_layers'")
        if self.draft_vocab is not None and self.method is not SpecMethod.DRAFT_MODEL:
            raise SpecConfigError("'draft_vocab' applies to method 'draft_model' (EAGLE-3 heads carry "
                                  "their own d2t)")
        self._check_confidence()
        dynamic = [k for k in ("topk", "depth", "num_draft_tokens") if getattr(self, k) is not None]
        if dynamic and self.tree is not None:
            raise SpecConfigError(f"give either a static 'tree' or dynamic-tree keys {dynamic}, not both")

    def _check_confidence(self) -> None:
        c = self.draft_confidence_threshold
        if c is None:
            return
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 < c < 1.0:
            raise SpecConfigError(f"speculative_config 'draft_confidence_threshold' must be a number in (0, 1), got {c!r}")
        if self.method is not SpecMethod.DRAFT_MODEL or self.tree is not None:
            raise SpecConfigError("'draft_confidence_threshold' applies to method 'draft_model' with a chain "
                                  "(no static 'tree')")

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        out["method"] = self.method.value
        if self.tree is not None:
            out["tree"] = [list(c) for c in self.tree]
        return out
