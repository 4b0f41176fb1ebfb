"""Drafters behind one protocol, built from a typed ``speculative_config`` through one public
registry that the built-in methods use too.

``register(name, builder, config=None)`` makes ``{"method": name, ...}`` a valid
``speculative_config``: ``config`` is the method's ``SpeculativeConfig`` subclass (its fields are
the method's keys; default: ``CustomSpecConfig``, keys ``model``, ``num_speculative_tokens`` and
``adaptive_drafting``),
and ``builder(config, target) -> make(max_batch, max_len) -> Drafter`` loads weights once
(``target`` is the ``LoadedModel`` being served) and makes per-engine state on each call.
``build_drafter_factory(config, target, forward)`` runs the registered builder of ``config.method``;
a builder that declares a ``forward`` keyword also gets the target forward the engines will run
(a ``models.compiled.CompiledForward``, or ``None``: the model itself), so that the step costs a
head's shape is chosen from are those of that forward.
"""
from __future__ import annotations

import inspect
from typing import Callable

from .spec_config import (CustomSpecConfig, DraftModelConfig, Eagle3Config, EagleConfig, HybridConfig,
                           MedusaSpecConfig, NgramConfig, SpecConfigError, SpeculativeConfig, SuffixConfig,
                           register_config)
from ..core.features import TargetFeatures
from .base import DraftRequest, Drafter, StatelessDrafter
from .draft_shape import ShapedFactory

DrafterFactory = Callable[[int, int], Drafter]
DrafterBuilder = Callable[[SpeculativeConfig, object], DrafterFactory]
_BUILDERS: dict[str, DrafterBuilder] = {}


def register(name: str, builder: DrafterBuilder | None = None,
             config: type[SpeculativeConfig] | None = None):
    """Register a drafter method under ``name`` (a built-in's name replaces it). Usable as a
    call, ``register("mine", builder, MyConfig)``, or as a decorator, ``@register("mine")``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a drafter method needs a non-empty name, got {name!r}")
    if config is None:
        config = type(f"{name.title().replace('_', '')}SpecConfig", (CustomSpecConfig,), {"method": name})

    def deco(fn: DrafterBuilder) -> DrafterBuilder:
        if not callable(fn):
            raise TypeError(f"the builder of method {name!r} must be callable, got {fn!r}")
        register_config(name, config)
        _BUILDERS[name] = fn
        return fn
    return deco if builder is None else deco(builder)


def registered() -> list[str]:
    """Names of every registered method."""
    return sorted(_BUILDERS)


def build_drafter_factory(config: SpeculativeConfig, target, forward=None) -> ShapedFactory:
    """The registered builder of ``config.method`` applied to ``config`` and ``target`` (and
    ``forward``, where the builder takes it), as a ``ShapedFactory``: a builder's plain factory is
    wrapped (no chosen shape), gated by the draft-budget estimator with a prior profile and the
    target's measured verify costs unless the config's ``adaptive_drafting`` is false, so callers
    read ``shape`` and ``make_gate`` of any method."""
    if config.method not in _BUILDERS:
        raise SpecConfigError(f"method {config.method!r} is not registered; registered: {registered()}")
    builder = _BUILDERS[config.method]
    if "forward" in inspect.signature(builder).parameters:
        made = builder(config, target, forward=forward)
    else:
        made = builder(config, target)
    if isinstance(made, ShapedFactory):
        return made
    if getattr(config, "adaptive_drafting", None) is False or target is None:
        return ShapedFactory(made, None)
    from .draft_shape import verify_costs
    from .draft_shape import StepCosts
    return ShapedFactory(made, None, costs=StepCosts(verify_costs(target, forward), 0.0), generic=True)


@register("ngram", config=NgramConfig)
def _ngram(config: NgramConfig, target) -> DrafterFactory:
    from .ngram import NgramDrafter
    drafter = NgramDrafter(config.num_speculative_tokens or 5, config.prompt_lookup_min,
                           config.prompt_lookup_max, config.num_matches, config.prompt_lookup_extra,
                           device=target_device(target))
    return lambda max_batch, max_len: drafter


@register("suffix", config=SuffixConfig)
def _suffix(config: SuffixConfig, target) -> DrafterFactory:
    """SuffixDecoding: the global tree is made here, once per LLM / server, and shared by every
    engine the factory makes (a later generate call drafts from earlier outputs)."""
    from .suffix import build_suffix_factory
    return build_suffix_factory(config, target_device(target), target)


@register("draft_model", config=DraftModelConfig)
def _draft_model(config: DraftModelConfig, target) -> DrafterFactory:
    from .draft_model import DraftModelDrafter, with_vocab_head
    vocab = None
    if config.draft_vocab is not None:          # a bad file fails before the draft model loads
        from .draft_vocab import load_draft_vocab
        from .shipped import in_checkpoints
        try:
            vocab = load_draft_vocab(in_checkpoints(config.draft_vocab), target.config.vocab_size)
        except ValueError as e:
            raise SpecConfigError(f"speculative_config 'draft_vocab': {e}") from None
    model = _load_draft_model(config, target)
    if vocab is not None:
        model = with_vocab_head(model, vocab)   # once: every engine's drafter shares the cut head
    k = config.num_speculative_tokens or 4
    tree = [list(c) for c in config.tree] if config.tree else None
    stop = config.draft_confidence_threshold
    forward = None
    if config.draft_compile:
        from ..models.compiled import CompiledForward
        forward = CompiledForward.shared(model)     # compiled once per process, shared by every engine
    return lambda max_batch, max_len, kv=None: DraftModelDrafter(model, max_batch=max_batch, max_len=max_len,
                                                                 num_speculative_tokens=k, tree=tree, vocab=vocab,
                                                                 confidence_threshold=stop, forward=forward, kv=kv)


def _load_draft_model(config: DraftModelConfig, target):
    from ..models.loading import load_model
    if config.model == "self":
        n = config.self_draft_layers
        if n >= target.config.num_layers:
            raise SpecConfigError(f"self_draft_layers={n} must be below the target's "
                                  f"{target.config.num_layers} layers")
        return self_draft(target.model, n)
    import torch
    from ..models.loading import parse_dtype
    dtype = parse_dtype(config.draft_dtype or next(target.model.parameters()).dtype)
    weights = target.weights if dtype == torch.float32 else "dense"   # the draft follows the target
    draft = load_model(config.model, dtype=dtype, weights=weights, device=target_device(target))
    check_same_vocab(target, draft)
    return draft.model


def target_device(target):
    """The device of a loaded target (``LoadedModel``; None: the CPU): its drafter's device."""
    from ..models.device import module_device
    import torch
    return module_device(target.model) if target is not None else torch.device("cpu")


def self_draft(model, num_layers: int):
    """A draft model made of the target's first ``num_layers`` layers and its head (shared weights)."""
    import torch
    from ..models.transformer import Transformer
    cfg = model.cfg.replace(num_layers=num_layers,
                            sliding_layers=tuple(i for i in model.cfg.sliding_layers if i < num_layers))
    with torch.device("meta"):
        small = Transformer(cfg)
    small.embed, small.norm, small.lm_head = model.embed, model.norm, model.lm_head
    small.layers = torch.nn.ModuleList(list(model.layers[:num_layers]))
    small.register_buffer("inv_freq", model.inv_freq, persistent=False)
    small.register_buffer("inv_freq_local", model.inv_freq_local, persistent=False)
    return small.eval()


def check_same_vocab(target, draft) -> None:
    """A draft model must share the target's vocabulary and tokenizer."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise SpecConfigError(f"draft model vocab size {draft.config.vocab_size} differs from the "
                              f"target's {target.config.vocab_size}; speculation needs one tokenizer")
    tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if tv != dv:
        raise SpecConfigError("draft model tokenizer differs from the target's "
                              f"({len(set(tv.items()) ^ set(dv.items()))} differing entries)")


__all__ = ["DraftRequest", "Drafter", "StatelessDrafter", "TargetFeatures", "build_drafter_factory",
           "register", "registered", "self_draft", "check_same_vocab"]


@register("eagle", config=EagleConfig)
def _eagle(config: EagleConfig, target, forward=None) -> DrafterFactory:
    """EAGLE-1 head (target last hidden state); EAGLE-2 when the tree is dynamic."""
    from .eagle import build_eagle_factory
    from .eagle_head import HeadKind
    return build_eagle_factory(config, target, HeadKind.EAGLE1, forward=forward)


@register("eagle3", config=Eagle3Config)
def _eagle3(config: Eagle3Config, target, forward=None) -> DrafterFactory:
    """EAGLE-3 / 3.1 head (three fused target layers), dynamic tree by default."""
    from .eagle import build_eagle_factory
    from .eagle_head import HeadKind
    return build_eagle_factory(config, target, HeadKind.EAGLE3, forward=forward)


@register("medusa", config=MedusaSpecConfig)
def _medusa(config: MedusaSpecConfig, target, forward=None) -> DrafterFactory:
    from .medusa import build_medusa_factory
    return build_medusa_factory(config, target, forward=forward)


@register("hybrid", config=HybridConfig)
def _hybrid(config: HybridConfig, target, forward=None) -> DrafterFactory:
    """EAGLE-3 head and suffix trees, one source per request and step (``hybrid``)."""
    from .hybrid import build_hybrid_factory
    return build_hybrid_factory(config, target, target_device(target), forward=forward)
