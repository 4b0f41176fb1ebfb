"""Hugging Face transformers peers, run on the same prompts, weights, dtype, device and threads.

Three peer kinds, each a ``GenerationConfig`` for ``model.generate``:

* ``hf``: plain generation (greedy or sampling), any batch size (prompts left-padded).
* ``hf-pld``: prompt lookup decoding, ``prompt_lookup_num_tokens`` (+ ``max_matching_ngram_size``).
* ``hf-assisted``: assisted generation with ``assistant_model``: a named draft model, or ``"self"``
  (the target's first ``self_draft_layers`` layers, sharing its weights, like verispec's
  self-draft). ``num_assistant_tokens`` is kept constant (no HF heuristic schedule) so it compares
  with a fixed ``num_speculative_tokens``.

HF runs assisted generation and prompt lookup for one sequence at a time, so those two peers
have ``max_batch == 1`` (the runner reports larger batch sizes as skipped).

Weights (``weights=``): ``"loader"`` loads the checkpoint with HF's own loader
(``from_pretrained(folder, gguf_file=...)`` for GGUF), an implementation independent of ours;
``"shared"`` builds the HF architecture around the tensors verispec already loaded (no copy,
instant; used by tests). Either way the numbers are the same dequantized weights.

Acceptance of the HF peers is read from the target's forward calls (a forward pre-hook on the
position ids): a forward that starts at cache position p and ends at e after the sequence had
length n verified ``e - n`` draft tokens, and the next forward's start tells how many were kept.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..models.device import module_device
from ..core.metrics import SpecStats
from ..models.config import LLAMA_FAMILY, ModelConfig
from ..models.loading import LoadedModel, load_model
from ..core.sampling import SamplingParams
from .records import BenchError, GenResult

WEIGHTS = ("loader", "shared")

# our per-layer parameter names -> HF Llama/Qwen2/Mistral names (same tensors and layout)
_LAYER_RENAMES = ((".attn_norm.", ".input_layernorm."), (".mlp_norm.", ".post_attention_layernorm."),
                  (".attn.wq.", ".self_attn.q_proj."), (".attn.wk.", ".self_attn.k_proj."),
                  (".attn.wv.", ".self_attn.v_proj."), (".attn.wo.", ".self_attn.o_proj."),
                  (".mlp.w_gate.", ".mlp.gate_proj."), (".mlp.w_up.", ".mlp.up_proj."),
                  (".mlp.w_down.", ".mlp.down_proj."))


def hf_param_name(name: str) -> str:
    """The HF name of one of our ``Transformer`` parameters."""
    if name.startswith("embed."):
        return "model.embed_tokens." + name[len("embed."):]
    if name.startswith("norm."):
        return "model." + name
    if name.startswith("layers."):
        name = "model." + name
        for ours, theirs in _LAYER_RENAMES:
            name = name.replace(ours, theirs)
    return name


def quiet_transformers() -> None:
    """Silence HF's info logs and conversion progress bars (the benchmark has its own)."""
    import transformers.utils.logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# ---------------------------------------------------------------------------- loading models
def hf_config(cfg: ModelConfig):
    """The HF config of the architecture our ``ModelConfig`` describes."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    if cfg.arch not in LLAMA_FAMILY:
        raise ValueError(f"the HF peer shares weights with Llama-family targets only, not {cfg.arch!r}")
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                  intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                  head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                  rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
                  tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id,
                  eos_token_id=list(cfg.eos_token_ids) or None)
    if cfg.rope_scaling:
        common["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.arch == "qwen2":
        return Qwen2Config(**common)
    if cfg.arch == "mistral":
        return MistralConfig(**common)
    return LlamaConfig(attention_bias=cfg.attention_bias, **common)


def hf_from_loaded(loaded: LoadedModel):
    """An HF ``*ForCausalLM`` whose parameters are the tensors of ``loaded.model`` (shared).
    Every HF parameter must be covered; our extra tensors (e.g. fused q/k/v views) are ignored."""
    from transformers import AutoModelForCausalLM
    from ..models.packed import WeightFormat
    if loaded.weights is not WeightFormat.DENSE:
        raise BenchError(f"HF weights 'shared' need dense target weights; this target is packed "
                         f"(weights={loaded.weights.value!r}: its decoder layers hold no fp32 parameters "
                         "to share); use HF weights 'loader'")
    cfg = hf_config(loaded.config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    wanted = set(model.state_dict())
    if loaded.config.tie_word_embeddings:
        wanted.discard("lm_head.weight")
    state = {}
    for name, tensor in loaded.model.state_dict().items():
        hf_name = hf_param_name(name)
        if hf_name in wanted:
            state[hf_name] = tensor
    missing = sorted(wanted - set(state))
    if missing:
        raise RuntimeError(f"HF weight mapping failed: no tensor for {missing[:4]}")
    model.load_state_dict(state, strict=False, assign=True)
    if loaded.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg).to(module_device(loaded.model))
    _check_materialized(model)
    return model.eval()


def hf_from_checkpoint(loaded: LoadedModel, dtype: torch.dtype):
    """Load ``loaded``'s checkpoint file with HF's own loader."""
    from transformers import AutoModelForCausalLM
    path = loaded.path
    if loaded.format == "gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(module_device(loaded.model)).eval()          # on the verispec target's device


def load_hf_model(loaded: LoadedModel, weights: str = "loader"):
    """The HF model of ``loaded`` (see the module docstring for ``weights``)."""
    if weights not in WEIGHTS:
        raise BenchError(f"unknown HF weights mode {weights!r}; use one of {WEIGHTS}")
    quiet_transformers()
    if weights == "shared":
        return hf_from_loaded(loaded)
    return hf_from_checkpoint(loaded, next(loaded.model.parameters()).dtype)


def hf_self_draft(model, num_layers: int):
    """An HF model made of ``model``'s first ``num_layers`` layers, its final norm and head."""
    total = model.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise BenchError(f"self_draft_layers={num_layers} must be in 1..{total - 1}")
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = num_layers
    with torch.device("meta"):
        small = type(model)(cfg)
    base, small_base = model.model, small.model
    small_base.embed_tokens, small_base.norm = base.embed_tokens, base.norm
    small_base.rotary_emb = base.rotary_emb
    small_base.layers = torch.nn.ModuleList(list(base.layers[:num_layers]))
    small.lm_head = model.lm_head
    small.generation_config = copy.deepcopy(model.generation_config)
    _check_materialized(small)
    return small.eval()


def _check_materialized(model) -> None:
    meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if meta:
        raise RuntimeError(f"HF model has tensors without data: {meta[:4]}")


# ---------------------------------------------------------------------------- acceptance
@dataclass
class ForwardTracker:
    """Records (start, end) cache positions of each forward of the model it is attached to."""
    events: list[tuple[int, int] | None] = field(default_factory=list)

    def attach(self, model) -> None:
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:
        pos = kwargs.get("position_ids")
        if pos is None:
            pos = kwargs.get("cache_position")
        if pos is None:
            self.events.append(None)
            return
        row = pos[0] if pos.dim() > 1 else pos
        self.events.append((int(row[0]), int(row[-1]) + 1))


def stats_from_forwards(events: list[tuple[int, int] | None], prompt_len: int, num_new: int) -> SpecStats:
    """Acceptance counters of one batch-1 HF generation from its target forwards.

    ``num_new``: tokens HF generated (the end-of-sequence token included). A first forward that
    verifies no draft is the prefill (it emits the first token) and is not a step."""
    st = SpecStats()
    if any(e is None for e in events):
        st.num_steps = max(0, len(events) - 1)
        st.num_emitted_tokens = max(0, num_new - 1)
        return st
    length = prompt_len
    for i, (start, end) in enumerate(events):
        if i > 0:
            length = start + 1
        drafted = max(0, end - length)
        following = events[i + 1][0] + 1 if i + 1 < len(events) else prompt_len + num_new
        accepted = max(0, min(drafted, following - length - 1))
        if i == 0 and drafted == 0:
            continue
        st.observe(drafted, drafted, accepted)
    return st


# ---------------------------------------------------------------------------- the runner
@dataclass
class HFRunner:
    """Runs one HF peer: ``generate(prompts, params) -> GenResult`` (prompts are token ids)."""
    kind: str
    model: Any
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    tracker: ForwardTracker          # attached to ``model`` (one tracker per model, shared)
    options: dict = field(default_factory=dict)
    assistant: Any = None

    @property
    def max_batch(self) -> int:
        return 1 if self.kind in ("hf-pld", "hf-assisted") else 1 << 30

    def generation_config(self, params: SamplingParams, pad_id: int):
        from transformers import GenerationConfig
        kw: dict = dict(max_new_tokens=params.max_tokens, do_sample=not params.greedy,
                        eos_token_id=list(self.eos_token_ids), pad_token_id=pad_id)
        if not params.greedy:
            kw.update(temperature=params.temperature, top_p=params.top_p,
                      top_k=params.top_k if params.top_k > 0 else 0)
        kw.update({k: v for k, v in self.options.items() if k not in ("assistant_model", "self_draft_layers")})
        return GenerationConfig(**kw)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> GenResult:
        if len(prompts) > self.max_batch:
            raise BenchError(f"{self.kind} runs one sequence at a time in HF transformers")
        pad = self.eos_token_ids[0] if self.eos_token_ids else 0
        width = max(len(p) for p in prompts)
        dev = self.model.device
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long, device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long, device=dev)
        extra = {"assistant_model": self.assistant} if self.assistant is not None else {}
        if params.seed is not None:
            torch.manual_seed(params.seed)
        self.tracker.events.clear()
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=mask, generation_config=self.generation_config(params, pad),
                                  **extra)
        wall = time.perf_counter() - t0
        new = out[:, width:].tolist()
        token_ids = [self._cut(row) for row in new]
        if len(prompts) == 1:
            stats = stats_from_forwards(self.tracker.events, len(prompts[0]), len(new[0]))
        else:   # plain batched generate: every token after a row's first is one 1-token step
            emitted = sum(max(0, min(len(t) + 1, len(row)) - 1) for t, row in zip(token_ids, new))
            stats = SpecStats(num_steps=emitted, num_emitted_tokens=emitted)
        texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in token_ids]
        return GenResult(token_ids=token_ids, texts=texts, wall_s=wall, stats=stats)

    def _cut(self, row: list[int]) -> list[int]:
        for i, tok in enumerate(row):
            if tok in self.eos_token_ids:
                return row[:i]
        return row


class PeerFactory:
    """Builds HF peers for one loaded target; the HF target model is loaded once, lazily."""

    def __init__(self, loaded: LoadedModel, weights: str = "loader"):
        self.loaded = loaded
        self.weights = weights
        self._model = None
        self.tracker = ForwardTracker()
        self.load_s = 0.0

    @property
    def model(self):
        if self._model is None:
            t0 = time.perf_counter()
            self._model = load_hf_model(self.loaded, self.weights)
            self.tracker.attach(self._model)
            self.load_s += time.perf_counter() - t0
        return self._model

    def build(self, kind: str, options: dict | None) -> HFRunner:
        options = dict(options or {})
        eos = tuple(self.loaded.config.eos_token_ids) or (self.loaded.tokenizer.eos_token_id,)
        assistant = self._assistant(options) if kind == "hf-assisted" else None
        if kind == "hf-pld" and "prompt_lookup_num_tokens" not in options:
            raise BenchError("hf-pld needs 'prompt_lookup_num_tokens'")
        return HFRunner(kind, self.model, self.loaded.tokenizer, eos, self.tracker, options, assistant)

    def _assistant(self, options: dict):
        name = options.get("assistant_model")
        if not name:
            raise BenchError("hf-assisted needs 'assistant_model' (a model name or path, or 'self')")
        if name == "self":
            layers = options.get("self_draft_layers")
            if not isinstance(layers, int):
                raise BenchError("hf-assisted with assistant_model 'self' needs 'self_draft_layers'")
            small = hf_self_draft(self.model, layers)
        else:
            t0 = time.perf_counter()
            draft = load_model(name, dtype=next(self.loaded.model.parameters()).dtype,
                               device=module_device(self.loaded.model))
            if draft.config.vocab_size != self.loaded.config.vocab_size:
                raise BenchError(f"assistant {name!r} has another vocabulary than the target")
            small = load_hf_model(draft, self.weights)
            self.load_s += time.perf_counter() - t0
        gc = small.generation_config
        gc.num_assistant_tokens = int(options.get("num_assistant_tokens", 4))
        gc.num_assistant_tokens_schedule = options.get("num_assistant_tokens_schedule", "constant")
        gc.assistant_confidence_threshold = options.get("assistant_confidence_threshold", 0.0)
        return small
