"""Regenerate assistant turns with the target itself (``verispec data regenerate``).

A draft head should learn the *target's* distribution, not the one of whoever wrote the dataset's
answers (EAGLE / SpecForge / Medusa-2 practice). Every user turn, up to ``max_turns``, is answered
by the target through verispec's own batched engine (speculation allowed: it is lossless), and the
conversation is appended to a SpecForge-format JSONL file (``{"id", "conversations": [{"role",
"content"}], "meta": {...}}``).

Continuous batching (``regen_batcher``): one engine stays alive and a batch row is refilled with
the next pending turn as soon as its answer ends, so a run never waits for its slowest conversation.

Resumable: the output is append-only, one complete line per conversation, written and flushed as
soon as the conversation is complete (so a kill loses only the conversations in flight); a restart
skips ids already present and drops a half-written last line. Conversations whose prompt
does not fit ``max_prompt_tokens`` are recorded as ``{"id", "skipped": reason}`` so a restart
skips them too. A ``<out>.stats.json`` file accumulates conversations, tokens and seconds over all
runs (the model cards quote it).

Sharding: ``select_shard`` keeps every n-th conversation of the input and ``shard_output`` names a
file per shard, so n processes (``--shard i/n``) partition the work.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..core.sampling import SamplingParams
from .data import Conversation
from .regen_batcher import TurnBatcher


@dataclass
class RegenStats:
    conversations: int = 0
    skipped: int = 0
    output_tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


def _repair_and_read_ids(path: Path) -> set[str]:
    """Ids already written; a half-written last line (crash) is cut off first."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        path.write_bytes(data)
    done = set()
    for line in data.decode("utf-8", errors="replace").split("\n"):     # U+2028 may sit in a string
        try:
            done.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return done


def _stats_path(out: Path) -> Path:
    return out.with_name(out.name + ".stats.json")


def load_stats(out: Path) -> RegenStats:
    p = _stats_path(Path(out))
    if not p.exists():
        return RegenStats()
    d = json.loads(p.read_text())
    return RegenStats(**{k: d[k] for k in ("conversations", "skipped", "output_tokens", "seconds")})


def parse_shard(spec: str) -> tuple[int, int]:
    """``"i/n"`` -> ``(i, n)`` with ``0 <= i < n``; a clear ValueError otherwise."""
    head, sep, tail = spec.partition("/")
    try:
        i, n = int(head), int(tail)
    except ValueError:
        i = n = None
    if not sep or i is None or n < 1 or not 0 <= i < n:
        raise ValueError(f"--shard wants i/n with 0 <= i < n (e.g. 0/2), got {spec!r}")
    return i, n


def select_shard(convs: list[Conversation], index: int, count: int) -> list[Conversation]:
    """The conversations whose position in ``convs`` is ``index`` mod ``count``."""
    return convs[index::count]


def shard_output(out: str | Path, index: int, count: int) -> Path:
    """Where shard ``index`` of ``count`` writes: ``out`` itself for one shard, else ``out`` with
    ``.shard<i>of<n>`` before its suffix (``regen.jsonl`` -> ``regen.shard0of2.jsonl``)."""
    out = Path(out)
    return out if count == 1 else out.with_name(f"{out.stem}.shard{index}of{count}{out.suffix}")


def _write_stats(out: Path, total: RegenStats) -> None:
    """Replace the stats file atomically (it is rewritten after every conversation)."""
    path = _stats_path(out)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(total) | {"tokens_per_second": total.tokens_per_second}))
    os.replace(tmp, path)


def regenerate(llm, convs: list[Conversation], out: str | Path, *, temperature: float = 0.0,
               max_tokens: int = 256, max_turns: int = 1, max_prompt_tokens: int = 512,
               batch_size: int | None = None, seed: int = 0, progress: bool = True) -> RegenStats:
    """Answer ``convs`` with ``llm`` (a ``verispec.LLM``) by continuous batching over
    ``batch_size`` rows (default ``llm.max_num_seqs``; see ``regen_batcher``), appending each
    conversation to ``out`` as it completes (completion order); returns the totals of this run
    (``load_stats(out)`` has the totals of all runs)."""
    from tqdm.auto import tqdm
    if max_turns < 1:
        raise ValueError("max_turns must be >= 1")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = _repair_and_read_ids(out)
    todo = [c for c in convs if c.id not in done]
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed if temperature > 0 else None)
    batcher = TurnBatcher(llm, params, max_batch=batch_size or llm.max_num_seqs, max_prompt_tokens=max_prompt_tokens)
    run, total = RegenStats(), load_stats(out)
    t_start = last = time.perf_counter()
    with out.open("a", encoding="utf-8") as f, \
            tqdm(total=len(todo), desc="regenerate", unit="conv", disable=not progress) as bar:
        for job in batcher.run(todo, max_turns):
            f.write(json.dumps(job.record(temperature), ensure_ascii=False) + "\n")
            f.flush()
            now = time.perf_counter()
            for s in (run, total):
                s.conversations += job.skipped is None
                s.skipped += job.skipped is not None
                s.output_tokens += job.output_tokens
                s.seconds += now - last
            last = now
            _write_stats(out, total)
            bar.update(1)
            bar.set_postfix(tok_s=f"{batcher.output_tokens / max(now - t_start, 1e-9):.1f}",
                            tokens=run.output_tokens, refresh=False)
    return run
