"""``StructuredOutputsParams``: what a request's output must match, named as vLLM names it.

Exactly one of:
- ``json``: a JSON schema (a dict, or its JSON text);
- ``json_object``: True for any JSON object (OpenAI's ``response_format: {"type": "json_object"}``);
- ``regex``: a regular expression the whole output matches;
- ``choice``: the output is one of these strings;
- ``grammar``: a Lark grammar (llguidance's dialect; ``start`` is the top rule).

JSON is written in one layout: items separated by ", ", keys by ": ", no other whitespace
between tokens (``whitespace_flexible`` True allows any JSON whitespace, which a small model may
fill without end). The server maps ``response_format``, vLLM's ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and its newer ``structured_outputs``
onto this (``serve.protocol``); ``grammar.GrammarCompiler`` turns it into a matcher. Knows
nothing about tokenizers or models.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputError(ValueError):
    """A structured-output request that cannot work; the message says which field and why."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except json.JSONDecodeError as e:
                raise StructuredOutputError(f"json: the schema is not valid JSON: {e}") from e
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputError(
                f"give exactly one of {', '.join(KINDS)}; got {', '.join(given) if given else 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise StructuredOutputError(f"json: a schema is a JSON object, got {type(self.json).__name__}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise StructuredOutputError("choice: a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise StructuredOutputError(f"{name}: a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple:
        """Hashable and equal for equal constraints (the schema as canonical JSON text)."""
        spec = getattr(self, self.kind)
        if self.kind == "json":
            spec = json.dumps(spec, sort_keys=True)
        return (self.kind, spec, self.whitespace_flexible)

    @classmethod
    def from_dict(cls, d: Any) -> "StructuredOutputsParams":
        """vLLM's ``structured_outputs`` request object ({"json": ...} / {"regex": ...} / ...)."""
        if not isinstance(d, dict):
            raise StructuredOutputError(f"structured_outputs must be an object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(KINDS) - {"whitespace_flexible", "disable_any_whitespace"})
        if unknown:
            raise StructuredOutputError(f"structured_outputs: unknown field(s) {unknown}; known: {list(KINDS)}")
        kw = {k: d[k] for k in KINDS if d.get(k) is not None}
        if "disable_any_whitespace" in d:
            kw["whitespace_flexible"] = not d["disable_any_whitespace"]
        if "whitespace_flexible" in d:
            kw["whitespace_flexible"] = bool(d["whitespace_flexible"])
        return cls(**kw)

    @classmethod
    def from_response_format(cls, rf: Any) -> "StructuredOutputsParams | None":
        """OpenAI's ``response_format``: text (None), json_object, or json_schema."""
        if not isinstance(rf, dict) or "type" not in rf:
            raise StructuredOutputError("response_format must be an object with a 'type'")
        kind = rf["type"]
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                raise StructuredOutputError("response_format json_schema needs 'json_schema': {'name': ..., "
                                            "'schema': {...}}")
            return cls(json=js.get("schema", {}))     # OpenAI: a missing schema means any JSON value
        raise StructuredOutputError(f"response_format type {kind!r} is not one of text, json_object, json_schema")
