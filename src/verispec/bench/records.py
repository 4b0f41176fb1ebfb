"""The benchmark's shared vocabulary (typed records), so that ``runner``, ``peers`` and ``report``
agree on one shape:

* ``MethodSpec``: what to run under a name (vanilla, a verispec speculative config, or a Hugging
  Face peer) and, if it cannot run here, why.
* ``GenResult``: what one batched generate call of any method returns.
* ``RunRecord``: one measured generate call (one turn of one batch of conversations).
* ``FidelityRecord``: for greedy runs, how one conversation compares with vanilla's.
* ``BenchResult``: one benchmark suite: its settings, methods, raw records and skips.

Units: times in seconds of wall clock (``time.perf_counter``); memory in MiB; token counts
exclude the end-of-sequence token. Acceptance numbers follow ``verispec.core.metrics``: mean acceptance
length includes the bonus token.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..core.metrics import SpecStats

#: method kinds: our engine without drafter, our engine with a speculative config, HF peers
KINDS = ("vanilla", "engine", "hf", "hf-pld", "hf-assisted")
PEER_KINDS = ("hf", "hf-pld", "hf-assisted", "llamacpp", "llamacpp-pld", "llamacpp-draft", "llama-server",
              "llama-server-ngram", "llama-server-draft")


class BenchError(ValueError):
    """Bad benchmark input (dataset, categories, methods, batch sizes); the message says what."""


@dataclass(frozen=True)
class MethodSpec:
    """One benchmarked method. ``config``: the ``speculative_config`` dict for kind "engine";
    generate options for the HF peers (see ``peers``); None for vanilla and plain ``hf``.
    ``unavailable``: the reason the method cannot run here (it is reported, not run)."""
    name: str
    kind: str
    config: dict | None = None
    unavailable: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class GenResult:
    """One generate call over a batch of prompts (token ids, chat template already applied).
    ``draft_s`` / ``verify_s``: time in drafting and in the target's verification forwards,
    None where the method does not expose it (HF peers). ``stats``: acceptance counters."""
    token_ids: list[list[int]]
    texts: list[str]
    wall_s: float
    stats: SpecStats
    draft_s: float | None = None
    verify_s: float | None = None


@dataclass
class RunRecord:
    """One measured generate call: turn ``turn`` of batch ``group`` (one category) at
    ``batch_size``, repeat ``repeat``. ``wall_s`` is the wall time of the generate call. ``stats`` is ``SpecStats.as_dict()`` plus
    ``num_emitted_tokens``. ``peak_rss_mib``: the process's resident-set peak during the call;
    ``rss_increase_mib``: that peak minus the RSS just before the call (see ``memory_source``
    in the machine info for how it was measured)."""
    method: str
    batch_size: int
    group: int
    repeat: int
    turn: int
    category: str
    question_ids: list[Any]
    prompt_tokens: list[int]
    output_tokens: list[int]
    wall_s: float
    draft_s: float | None
    verify_s: float | None
    stats: dict
    peak_rss_mib: float | None
    rss_increase_mib: float | None

    @property
    def num_tokens(self) -> int:
        return sum(self.output_tokens)


@dataclass
class FidelityRecord:
    """A greedy conversation of ``method`` compared with vanilla's on the same batch slot.
    ``status``: "identical", "tie" (first difference where the target's top-2 logit margin is
    below the tie threshold: a numerical tie, not a bug) or "mismatch". ``turn``/``position``/
    ``margin`` locate the first difference (None when identical)."""
    method: str
    batch_size: int
    group: int
    repeat: int
    slot: int
    category: str
    question_id: Any
    status: str
    turn: int | None = None
    position: int | None = None
    margin: float | None = None
    vanilla_token: int | None = None
    method_token: int | None = None


@dataclass
class BenchResult:
    """One suite of a benchmark: ``config`` is the ``BenchConfig`` as a dict, ``machine`` the
    machine description, ``skipped`` lists (method, batch size, reason) combinations not run.
    ``wall_s``: the run after loading (warm-up, generate calls, fidelity checks); ``load_s``:
    loading the target and building the methods (HF models, draft models)."""
    name: str
    config: dict
    machine: dict
    methods: list[MethodSpec]
    records: list[RunRecord] = field(default_factory=list)
    fidelity: list[FidelityRecord] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    wall_s: float = 0.0
    load_s: float = 0.0
    draft_shapes: dict = field(default_factory=dict)    # method -> draft_shape.ShapeChoice.as_dict()

    def available(self) -> list[MethodSpec]:
        return [m for m in self.methods if m.unavailable is None]

    def as_dict(self) -> dict:
        return {"name": self.name, "config": self.config, "machine": self.machine,
                "methods": [m.as_dict() for m in self.methods],
                "records": [asdict(r) for r in self.records],
                "fidelity": [asdict(f) for f in self.fidelity],
                "skipped": list(self.skipped), "wall_s": self.wall_s, "load_s": self.load_s,
                "draft_shapes": dict(self.draft_shapes)}


def stats_dict(stats: SpecStats) -> dict:
    """``SpecStats.as_dict()`` plus the emitted-token count (kept in raw records)."""
    return dict(stats.as_dict(), num_emitted_tokens=stats.num_emitted_tokens)
