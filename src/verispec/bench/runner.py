"""Run every benchmarked method on the same Spec-Bench conversations, interleaved, in one process.

Contract of ``run_benchmark(config) -> BenchResult``:

* Questions: a Spec-Bench-format JSONL (``question_id``, ``category``, ``turns``), filtered by
  category and cut to the first ``per_category`` questions of each category.
* Conversations run like Spec-Bench: turn k+1 is asked after the method's own answer to turn k,
  the chat template applied at every turn. A batch of size b holds b conversations of one
  category (a category with fewer selected questions repeats them to fill the batch).
* Fairness: one loaded target shared by all verispec methods, the same dtype and threads for
  everybody, one warm-up call per method, and methods interleaved per batch (their order rotated
  from batch to batch) so that machine drift hits all methods alike. Model loading is not timed.
* Unavailable methods (no checkpoint, a config the current build rejects) are reported with the
  reason instead of stopping the run. HF peers that run one sequence at a time are skipped at
  larger batch sizes (listed in ``BenchResult.skipped``).
* Greedy runs compare every conversation with vanilla's; where they differ, a plain forward of the
  target at the first difference decides between a numerical tie (top-2 logit margin below
  ``tie_threshold``) and a mismatch.
* Nothing is written here; ``report.write_report`` writes the files.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import platform
import resource
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol

import torch

from ..data import per_category, spec_bench_path, spec_bench_questions
from ..llm import LLM
from ..core.metrics import SpecStats
from ..models.device import module_device, resolve_device, same_device
from ..models.auto_weights import AUTO
from ..models.loading import LoadedModel, check_weights, load_model, parse_dtype
from ..models.sources import ModelSourceError
from ..core.sampling import SamplingParams
from ..drafting.shipped import model_stem, shipped_head
from ..drafting.spec_config import SpecConfigError
from .harness import machine_record, proc_status_mb
from .records import PEER_KINDS, BenchError, BenchResult, FidelityRecord, GenResult, MethodSpec, RunRecord, stats_dict

METHOD_NAMES = ("vanilla", "ngram", "draft_model", "eagle", "eagle3", "medusa", "suffix", "hybrid", "hf", "hf-pld",
                "hf-assisted", "llamacpp", "llamacpp-pld", "llamacpp-draft", "llama-server", "llama-server-ngram",
                "llama-server-draft")
DEFAULT_METHODS = ("vanilla", "ngram", "draft_model", "hf", "hf-pld")
#: EAGLE-2 ablation (paper, Table 5): ranking draft nodes by path value vs. the draft's own
#: confidence, with and without reranking the expanded tree.
EAGLE2_ABLATION = {"eagle2-full": {"rank_by": "path", "rerank": True},
                   "eagle2-no-rerank": {"rank_by": "path", "rerank": False},
                   "eagle2-confidence-only": {"rank_by": "confidence", "rerank": True},
                   "eagle2-neither": {"rank_by": "confidence", "rerank": False}}
PRESETS = ("eagle2-ablation",)
QWEN_PAIR = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
SETUP_ERRORS = (SpecConfigError, BenchError, ModelSourceError, OSError)


@dataclass
class BenchConfig:
    """Settings of one benchmark suite (see the module docstring).

    ``methods``: names from ``METHOD_NAMES`` or any name given a config in ``method_configs``
    (a verispec ``speculative_config``; add ``"peer": "hf-pld"`` etc. to make it an HF peer).
    ``vanilla`` is always run (speedups are relative to it). ``per_category`` None keeps all
    questions. ``hf_weights``: "loader" (HF's own loader) or "shared" (see ``peers``)."""
    model: str = "smollm2-135m"
    methods: tuple[str, ...] = DEFAULT_METHODS
    method_configs: dict[str, dict] = field(default_factory=dict)
    preset: str | None = None
    dataset: str | None = None
    categories: tuple[str, ...] | None = None
    per_category: int | None = None
    max_tokens: int = 128
    temperature: float = 0.0
    batch_sizes: tuple[int, ...] = (1,)
    repeats: int = 1
    dtype: str = "float32"
    weights: str = "dense"
    device: str = "cpu"                   # where the target and every method run (``verispec.models.device``)
    threads: int | None = None
    compile: bool = False                 # verispec's forwards through torch.compile (``models.compiled``)
    hf_weights: str = "loader"
    warmup_tokens: int = 16
    tie_threshold: float = 1e-4
    seed: int = 0
    name: str = "spec-bench"
    notes: str = ""

    def check(self) -> None:
        def positive(name: str, v) -> None:
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise BenchError(f"{name} must be a positive integer, got {v!r}")
        for name in ("max_tokens", "repeats", "warmup_tokens"):
            positive(name, getattr(self, name))
        if self.per_category is not None:
            positive("per_category", self.per_category)
        if self.threads is not None:
            positive("threads", self.threads)
        if not self.batch_sizes:
            raise BenchError("batch_sizes is empty")
        for b in self.batch_sizes:
            positive("each batch size", b)
        if not self.temperature >= 0:
            raise BenchError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.preset is not None and self.preset not in PRESETS:
            raise BenchError(f"unknown preset {self.preset!r}; presets: {', '.join(PRESETS)}")
        if self.hf_weights not in ("loader", "shared"):
            raise BenchError(f"hf_weights must be 'loader' or 'shared', got {self.hf_weights!r}")
        parse_dtype(self.dtype)
        try:
            if self.weights != AUTO:
                check_weights(self.weights, self.dtype, self.device)
        except ValueError as e:
            raise BenchError(str(e)) from None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["dataset"] = str(self.dataset or spec_bench_path())
        return d


# ---------------------------------------------------------------------------- questions
def load_questions(path: str | Path | None) -> list[dict]:
    """All questions of a Spec-Bench-format JSONL; ``BenchError`` names the file and the problem."""
    where = Path(path) if path else spec_bench_path()
    if not where.is_file():
        raise BenchError(f"dataset {where} does not exist")
    try:
        questions = spec_bench_questions(where)
    except json.JSONDecodeError as e:
        raise BenchError(f"dataset {where}: a line is not valid JSON ({e})") from None
    except ValueError as e:
        raise BenchError(f"dataset {e}") from None
    for n, q in enumerate(questions, 1):
        if "question_id" not in q:
            raise BenchError(f"dataset {where}: question {n} has no 'question_id'")
        if not all(isinstance(t, str) and t for t in q["turns"]):
            raise BenchError(f"dataset {where}: question {q['question_id']!r} has a turn that is "
                             "not a non-empty string")
    if not questions:
        raise BenchError(f"dataset {where} holds no questions")
    return questions


def select_questions(questions: list[dict], categories: tuple[str, ...] | None,
                     n_per_category: int | None) -> list[dict]:
    """Keep ``categories`` (all if None; an unknown one is an error), then the first
    ``n_per_category`` of each."""
    present = list(dict.fromkeys(q["category"] for q in questions))
    if categories:
        unknown = [c for c in categories if c not in present]
        if unknown:
            raise BenchError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {unknown}; "
                             f"the dataset has: {', '.join(present)}")
        questions = [q for q in questions if q["category"] in categories]
    return per_category(questions, n_per_category) if n_per_category else list(questions)


@dataclass(frozen=True)
class Group:
    """One batch: ``questions`` (all of ``category``) decoded together."""
    index: int
    category: str
    questions: tuple[dict, ...]


def make_groups(questions: list[dict], batch_size: int) -> list[Group]:
    """Category-pure batches of exactly ``batch_size`` conversations (questions repeated to fill)."""
    groups: list[Group] = []
    for category in dict.fromkeys(q["category"] for q in questions):
        qs = [q for q in questions if q["category"] == category]
        n = math.ceil(len(qs) / batch_size) * batch_size
        filled = list(itertools.islice(itertools.cycle(qs), n))
        for s in range(0, n, batch_size):
            groups.append(Group(len(groups), category, tuple(filled[s:s + batch_size])))
    return groups


# ---------------------------------------------------------------------------- methods
def _checkpoint(model_name: str, method: str) -> Path | None:
    return shipped_head(model_name, method)


def default_method_config(name: str, model_name: str, num_layers: int, overrides: dict) -> tuple[dict | None, str | None]:
    """(config, unavailable reason) of a built-in method name for this target."""
    if name in ("vanilla", "hf", "llamacpp", "llama-server", "llama-server-ngram"):
        return None, None
    if name == "llamacpp-pld":
        ngram = overrides.get("ngram") or default_method_config("ngram", model_name, num_layers, {})[0]
        return {"num_pred_tokens": ngram.get("num_speculative_tokens", 5)}, None
    if name in ("llamacpp-draft", "llama-server-draft"):
        if model_name != QWEN_PAIR[0]:
            return None, f"{name} needs a draft GGUF: known for {QWEN_PAIR[0]} (give a config otherwise)"
        return {"draft_model": QWEN_PAIR[1], **({"num_pred_tokens": 4} if name == "llamacpp-draft" else {})}, None
    if name == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 5}, None
    if name == "draft_model":
        if model_name == QWEN_PAIR[0]:
            return {"method": "draft_model", "model": QWEN_PAIR[1], "num_speculative_tokens": 4}, None
        return {"method": "draft_model", "model": "self", "self_draft_layers": max(1, num_layers // 4),
                "num_speculative_tokens": 4}, None
    if name == "suffix":
        return {"method": "suffix"}, None
    if name in ("eagle", "eagle3", "medusa", "hybrid"):
        path = _checkpoint(model_name, "eagle3" if name == "hybrid" else name)
        if path is None:
            return None, f"no checkpoint: checkpoints/{model_stem(model_name)}-{name} does not exist"
        return {"method": name, "model": str(path)}, None
    if name == "hf-pld":
        ngram = overrides.get("ngram") or default_method_config("ngram", model_name, num_layers, {})[0]
        return {"prompt_lookup_num_tokens": ngram.get("num_speculative_tokens", 5),
                "max_matching_ngram_size": ngram.get("prompt_lookup_max", 4)}, None
    if name == "hf-assisted":
        draft = overrides.get("draft_model") or default_method_config("draft_model", model_name, num_layers, {})[0]
        out = {"assistant_model": draft.get("model"), "num_assistant_tokens": draft.get("num_speculative_tokens", 4)}
        if draft.get("model") == "self":
            out["self_draft_layers"] = draft.get("self_draft_layers")
        return out, None
    raise BenchError(f"unknown method {name!r}: use one of {', '.join(METHOD_NAMES)} or give it a "
                     "config with --method-config NAME=JSON")


def resolve_methods(config: BenchConfig, model_name: str, num_layers: int) -> list[MethodSpec]:
    """The ``MethodSpec`` of every requested method (vanilla first, preset methods appended)."""
    names = list(dict.fromkeys(("vanilla",) + tuple(config.methods)))
    overrides = dict(config.method_configs)
    if "vanilla" in overrides:
        raise BenchError("vanilla is the baseline and takes no config")
    unavailable: dict[str, str] = {}
    if config.preset == "eagle2-ablation":
        base, reason = default_method_config("eagle3", model_name, num_layers, overrides)
        base = overrides.get("eagle3", base)
        for name, keys in EAGLE2_ABLATION.items():
            names.append(name)
            if name in overrides:
                continue
            if base is None:
                unavailable[name] = reason or "eagle3 is not available"
            else:
                overrides[name] = dict(base, **keys)
    return [MethodSpec(name, "engine", None, unavailable[name]) if name in unavailable
            else _method_spec(name, overrides, model_name, num_layers) for name in dict.fromkeys(names)]


def _method_spec(name: str, overrides: dict, model_name: str, num_layers: int) -> MethodSpec:
    cfg, reason = overrides.get(name), None
    if cfg is None:
        cfg, reason = default_method_config(name, model_name, num_layers, overrides)
    cfg = dict(cfg) if cfg is not None else None
    kind = "vanilla" if name == "vanilla" else name if name in PEER_KINDS else "engine"
    if cfg is not None and "peer" in cfg:
        kind = cfg.pop("peer")
        if kind not in PEER_KINDS:
            raise BenchError(f"method {name!r}: 'peer' must be one of {PEER_KINDS}")
    return MethodSpec(name, kind, cfg, reason)


class MethodRunner(Protocol):
    max_batch: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> GenResult: ...


class EngineRunner:
    """verispec's engine (vanilla when ``spec_config`` is None) on the shared target."""
    max_batch = 1 << 30

    def __init__(self, loaded: LoadedModel, spec_config: dict | None, max_batch: int, compile: bool = False):
        self.llm = LLM(loaded=loaded, speculative_config=spec_config, max_num_seqs=max_batch, compile=compile)
        self._engine = None
        make_engine = self.llm.make_engine

        def capture(batch: int, max_len: int):
            self._engine = make_engine(batch, max_len)
            return self._engine
        self.llm.make_engine = capture   # keep the engine of each call to read its timing split

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> GenResult:
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        wall = time.perf_counter() - t0
        st: SpecStats = self._engine.stats
        return GenResult([o.token_ids for o in outs], [o.text for o in outs], wall, st,
                         draft_s=st.draft_time_s, verify_s=st.verify_time_s)


def build_runners(specs: list[MethodSpec], loaded: LoadedModel, config: BenchConfig) -> tuple[list[MethodSpec], dict]:
    """Runners of the available methods (by name); methods failing to build become unavailable."""
    from .llama_server import SERVER_KINDS, build_llama_server
    from .llamacpp import LLAMACPP_KINDS, build_llamacpp
    from .peers import PeerFactory
    peers = PeerFactory(loaded, config.hf_weights)
    out, runners = [], {}
    for spec in specs:
        if spec.unavailable is None:
            try:
                if spec.kind in LLAMACPP_KINDS:
                    runners[spec.name] = build_llamacpp(spec.kind, loaded, spec.config)
                elif spec.kind in SERVER_KINDS:
                    runners[spec.name] = build_llama_server(spec.kind, loaded, spec.config)
                elif spec.kind in PEER_KINDS:
                    runners[spec.name] = peers.build(spec.kind, spec.config)
                else:   # LLM validates the config and builds the drafter (SpecConfigError)
                    runners[spec.name] = EngineRunner(loaded, spec.config, max(config.batch_sizes), config.compile)
            except SETUP_ERRORS as e:
                spec = MethodSpec(spec.name, spec.kind, spec.config, f"{type(e).__name__}: {e}")
        out.append(spec)
    if "vanilla" not in runners:
        raise BenchError("vanilla could not be set up; it is the baseline of every speedup")
    return out, runners


# ---------------------------------------------------------------------------- machine, memory
class RssMeter:
    """Peak resident set size of this process during a call, in MiB.

    Preferred: ``VmHWM`` of /proc/self/status, reset to the current RSS before each call by
    writing 5 to /proc/self/clear_refs (Linux). Fallback: ``resource.getrusage().ru_maxrss``, the
    process-lifetime peak, which cannot be reset (then the per-call increase is not reported)."""

    def __init__(self) -> None:
        self.resettable = self._try_reset() and self._status("VmHWM") is not None
        self.source = ("VmHWM from /proc/self/status, reset before each call via /proc/self/clear_refs"
                       if self.resettable else
                       "resource.getrusage(RUSAGE_SELF).ru_maxrss (process-lifetime peak, not reset)")

    @staticmethod
    def _status(key: str) -> float | None:
        return proc_status_mb(key)

    @staticmethod
    def _try_reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def start(self) -> float | None:
        """Reset the peak; return the current RSS (None with the fallback)."""
        if not self.resettable:
            return None
        self._try_reset()
        return self._status("VmRSS")

    def peak(self) -> float:
        if self.resettable:
            return self._status("VmHWM") or 0.0
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def machine_info(dtype: torch.dtype, meter: RssMeter, device: torch.device = torch.device("cpu")) -> dict:
    """The harness's machine record (``harness.machine_record``: CPU, ISA, cores, torch, threads,
    python, load, date, command) plus what a Spec-Bench run adds: memory, library versions, dtype,
    device (and GPU name), OpenMP settings. ``cpu_model``, ``logical_cores`` and ``loadavg_start``
    keep the names report.md and the committed results.json files use."""
    import transformers
    from .. import __version__ as verispec_version
    record = machine_record()
    try:
        mem_kib = next(int(x.split()[1]) for x in Path("/proc/meminfo").read_text().splitlines()
                       if x.startswith("MemTotal:"))
    except (OSError, StopIteration):
        mem_kib = 0
    return {**record, "cpu_model": record["cpu"], "logical_cores": record["cores"],
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "memory_gib": round(mem_kib / 2**20, 1), "platform": platform.platform(),
            "transformers": transformers.__version__, "verispec": verispec_version,
            "dtype": str(dtype).replace("torch.", ""), "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "interop_threads": torch.get_num_interop_threads(), "memory_source": meter.source,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


# ---------------------------------------------------------------------------- conversations
# The same plain rendering as a chat template, for code that renders conversations through
# ``apply_chat_template`` (held-out perplexity with assistant-only loss): BOS, the turns as
# "Question: ..." / "Answer: ..." separated by blank lines, "\n\nAnswer:" as the generation prompt.
PLAIN_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if not loop.first %}{{ '\\n\\n' }}{% endif %}"
    "{{ {'user': 'Question', 'assistant': 'Answer', 'system': 'Instructions'}.get(m['role'], m['role']) }}: "
    "{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}{{ '\\n\\nAnswer:' }}{% endif %}")


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` with the chat template and the generation prompt applied. A base
    model without a template (gemma3-270m) gets ``PLAIN_CHAT_TEMPLATE``'s plain "Question: ... /
    Answer:" text instead, after BOS."""
    template = None if getattr(tokenizer, "chat_template", None) is not None else PLAIN_CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


Transcript = list[tuple[list[int], list[int]]]     # per turn: (prompt ids, output ids)


@dataclass
class Turn:
    """Where one generate call sits in the run (for its ``RunRecord``)."""
    method: str
    batch_size: int
    group: Group
    repeat: int


def run_group(runner: MethodRunner, where: Turn, config: BenchConfig, tokenizer,
              meter: RssMeter) -> tuple[list[RunRecord], list[Transcript]]:
    """All turns of the batch ``where.group`` with one method; each turn is one generate call."""
    qs = where.group.questions
    messages: list[list[dict]] = [[] for _ in qs]
    transcripts: list[Transcript] = [[] for _ in qs]
    records = []
    for turn in range(max(len(q["turns"]) for q in qs)):
        slots = [i for i, q in enumerate(qs) if len(q["turns"]) > turn]
        prompts = []
        for i in slots:
            messages[i].append({"role": "user", "content": qs[i]["turns"][turn]})
            prompts.append(chat_ids(tokenizer, messages[i]))
        params = SamplingParams(temperature=config.temperature, max_tokens=config.max_tokens,
                                seed=config.seed + 1000 * where.repeat + turn)
        before = meter.start()
        res = runner.generate(prompts, params)
        peak = meter.peak()
        for i, prompt, ids, text in zip(slots, prompts, res.token_ids, res.texts):
            messages[i].append({"role": "assistant", "content": text})
            transcripts[i].append((prompt, ids))
        records.append(RunRecord(
            method=where.method, batch_size=where.batch_size, group=where.group.index, repeat=where.repeat,
            turn=turn, category=where.group.category, question_ids=[qs[i]["question_id"] for i in slots],
            prompt_tokens=[len(p) for p in prompts], output_tokens=[len(t) for t in res.token_ids],
            wall_s=res.wall_s, draft_s=res.draft_s, verify_s=res.verify_s, stats=stats_dict(res.stats),
            peak_rss_mib=peak, rss_increase_mib=None if before is None else peak - before))
    return records, transcripts


# ---------------------------------------------------------------------------- fidelity
@torch.inference_mode()
def top2_margin(model, ids: list[int]) -> float:
    """Gap between the target's two largest logits after ``ids`` (a plain, cache-free forward)."""
    dev = module_device(model)
    tokens = torch.tensor([ids], device=dev)
    last = torch.tensor([[len(ids) - 1]], device=dev)
    out = model(tokens, torch.arange(len(ids), device=dev)[None], logits_index=last)
    top = out.logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def compare(model, vanilla: Transcript, other: Transcript, threshold: float) -> dict:
    """Status of ``other`` against ``vanilla``: identical, tie or mismatch at the first difference."""
    for turn, ((v_prompt, v_out), (o_prompt, o_out)) in enumerate(zip(vanilla, other)):
        if v_prompt != o_prompt:
            return {"status": "mismatch", "turn": turn}
        if v_out == o_out:
            continue
        pos = next((i for i, (a, b) in enumerate(zip(v_out, o_out)) if a != b), min(len(v_out), len(o_out)))
        margin = top2_margin(model, v_prompt + v_out[:pos])
        return {"status": "tie" if margin < threshold else "mismatch", "turn": turn, "position": pos,
                "margin": margin, "vanilla_token": v_out[pos] if pos < len(v_out) else None,
                "method_token": o_out[pos] if pos < len(o_out) else None}
    return {"status": "identical"}


def fidelity_records(model, where: Turn, vanilla: list[Transcript], other: list[Transcript],
                     threshold: float) -> list[FidelityRecord]:
    return [FidelityRecord(method=where.method, batch_size=where.batch_size, group=where.group.index,
                           repeat=where.repeat, slot=slot, category=where.group.category,
                           question_id=q["question_id"], **compare(model, v, o, threshold))
            for slot, (q, v, o) in enumerate(zip(where.group.questions, vanilla, other))]


# ---------------------------------------------------------------------------- the run
def warm_up(runners: dict, tokenizer, question: dict, config: BenchConfig) -> None:
    """One short untimed call per method (first-call allocations, lazy imports, caches)."""
    prompt = chat_ids(tokenizer, [{"role": "user", "content": question["turns"][0]}])
    params = SamplingParams(temperature=config.temperature, max_tokens=config.warmup_tokens, seed=config.seed)
    for runner in runners.values():
        runner.generate([prompt], params)


def run_benchmark(config: BenchConfig, loaded: LoadedModel | None = None, progress: bool = True) -> BenchResult:
    """Run one suite (see the module docstring). ``loaded``: a target already in memory."""
    config.check()
    if config.threads:
        torch.set_num_threads(config.threads)
    questions = select_questions(load_questions(config.dataset), config.categories, config.per_category)
    t0 = time.perf_counter()
    try:
        loaded = loaded or load_model(config.model, dtype=config.dtype, weights=config.weights, device=config.device)
        on_device = same_device(module_device(loaded.model), resolve_device(config.device))
    except ValueError as e:               # e.g. a CUDA device asked for on a machine without one
        raise BenchError(str(e)) from None
    if config.weights == AUTO:                      # results name the weights that ran
        config = replace(config, weights=loaded.weights.value)
    if next(loaded.model.parameters()).dtype != parse_dtype(config.dtype) or loaded.weights != config.weights \
            or not on_device:
        raise BenchError(f"the loaded target is {next(loaded.model.parameters()).dtype} with "
                         f"{loaded.weights.value} weights on {module_device(loaded.model)}, the config says "
                         f"{config.dtype} with {config.weights} on {config.device}; every method must run on one target")
    specs = resolve_methods(config, loaded.name, loaded.config.num_layers)
    specs, runners = build_runners(specs, loaded, config)
    meter = RssMeter()
    dtype = next(loaded.model.parameters()).dtype
    machine = machine_info(dtype, meter, module_device(loaded.model))
    result = BenchResult(config.name, config.as_dict(), machine, specs,
                         load_s=time.perf_counter() - t0)
    result.draft_shapes = {name: r.llm.draft_shape.as_dict() for name, r in runners.items()
                           if isinstance(r, EngineRunner) and r.llm.draft_shape is not None}
    t1 = time.perf_counter()
    warm_up(runners, loaded.tokenizer, questions[0], config)
    plan = [(b, g, r) for b in config.batch_sizes for g in make_groups(questions, b) for r in range(config.repeats)]
    names = list(runners)
    from tqdm.auto import tqdm
    with tqdm(total=len(plan) * len(names), desc=f"bench {config.name}", unit="run", disable=not progress) as bar:
        for b, group, r in plan:
            rot = (group.index + r) % len(names)
            transcripts = {}
            for name in names[rot:] + names[:rot]:
                bar.set_postfix_str(f"b={b} {group.category} {name}", refresh=False)
                if b > runners[name].max_batch:
                    _skip(result, name, b, f"{name} runs one sequence at a time")
                else:
                    recs, transcripts[name] = run_group(runners[name], Turn(name, b, group, r), config,
                                                        loaded.tokenizer, meter)
                    result.records.extend(recs)
                bar.update()
            if config.temperature == 0.0:
                for name, tr in transcripts.items():
                    if name != "vanilla":
                        result.fidelity.extend(fidelity_records(loaded.model, Turn(name, b, group, r),
                                                                transcripts["vanilla"], tr, config.tie_threshold))
    result.wall_s = time.perf_counter() - t1
    result.machine["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return result


def _skip(result: BenchResult, method: str, batch_size: int, reason: str) -> None:
    entry = {"method": method, "batch_size": batch_size, "reason": reason}
    if entry not in result.skipped:
        result.skipped.append(entry)
