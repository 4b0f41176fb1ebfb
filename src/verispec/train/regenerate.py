"""Regenerate assistant turns with the target itself (``verispec data regenerate``).

A draft head should learn the *target's* distribution, not the one of whoever wrote the dataset's
answers (EAGLE / SpecForge / Medusa-2 practice). Every user turn, up to ``max_turns``, is answered
by the target through verispec's own batched engine (speculation allowed: it is lossless), and the
conversation is appended to a SpecForge-format JSONL file (``{"id", "conversations": [{"role",
"content"}], "meta": {...}}``).

Resumable: the output is append-only, one complete line per conversation, flushed per chunk; a
restart skips ids already present and drops a half-written last line. Conversations whose prompt
does not fit ``max_prompt_tokens`` are recorded as ``{"id", "skipped": reason}`` so a restart
skips them too. A ``<out>.stats.json`` file accumulates conversations, tokens and seconds over all
runs (the model cards quote it).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..sampling import SamplingParams
from .data import Conversation


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
    for line in data.decode("utf-8", errors="replace").splitlines():
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


def _prompt_fits(llm, messages: list[dict], max_prompt_tokens: int) -> bool:
    ids = llm.tokenizer(llm.apply_chat_template(messages), add_special_tokens=False).input_ids
    return len(ids) <= max_prompt_tokens


def _answer_chunk(llm, chunk: list[Conversation], params: SamplingParams, max_turns: int,
                  max_prompt_tokens: int) -> tuple[list[dict], int]:
    """Records for ``chunk`` (turn by turn, batched across conversations) and tokens generated."""
    histories = {c.id: [m for m in c.messages if m["role"] == "system"] for c in chunk}
    users = {c.id: c.user_turns()[:max_turns] for c in chunk}
    meta = {c.id: [] for c in chunk}
    skipped: dict[str, str] = {}
    tokens = 0
    for turn in range(max_turns):
        live = [c.id for c in chunk if c.id not in skipped and turn < len(users[c.id])]
        batch = []
        for cid in live:
            msgs = histories[cid] + [{"role": "user", "content": users[cid][turn]}]
            if _prompt_fits(llm, msgs, max_prompt_tokens):
                batch.append((cid, msgs))
            elif turn == 0:
                skipped[cid] = f"prompt over {max_prompt_tokens} tokens"
        if not batch:
            break
        outs = llm.chat([m for _, m in batch], params)
        for (cid, msgs), o in zip(batch, outs):
            histories[cid] = msgs + [{"role": "assistant", "content": o.text}]
            meta[cid].append(o.finish_reason)
            tokens += len(o.token_ids)
    recs = []
    for c in chunk:
        if c.id in skipped:
            recs.append({"id": c.id, "skipped": skipped[c.id]})
        else:
            recs.append({"id": c.id, "conversations": histories[c.id],
                         "meta": {"finish_reasons": meta[c.id], "temperature": params.temperature}})
    return recs, tokens


def regenerate(llm, convs: list[Conversation], out: str | Path, *, temperature: float = 0.0,
               max_tokens: int = 256, max_turns: int = 1, max_prompt_tokens: int = 512,
               chunk_size: int = 16, seed: int = 0, progress: bool = True) -> RegenStats:
    """Answer ``convs`` with ``llm`` (a ``verispec.LLM``), appending to ``out``; returns the totals of
    this run (``load_stats(out)`` has the totals of all runs)."""
    from tqdm.auto import tqdm
    if max_turns < 1:
        raise ValueError("max_turns must be >= 1")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = _repair_and_read_ids(out)
    todo = [c for c in convs if c.id not in done]
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed if temperature > 0 else None)
    run, total = RegenStats(), load_stats(out)
    with out.open("a", encoding="utf-8") as f, \
            tqdm(total=len(todo), desc="regenerate", unit="conv", disable=not progress) as bar:
        for i in range(0, len(todo), chunk_size):
            t0 = time.perf_counter()
            recs, tokens = _answer_chunk(llm, todo[i:i + chunk_size], params, max_turns, max_prompt_tokens)
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
            f.flush()
            dt = time.perf_counter() - t0
            n_skip = sum("skipped" in r for r in recs)
            for s in (run, total):
                s.conversations += len(recs) - n_skip
                s.skipped += n_skip
                s.output_tokens += tokens
                s.seconds += dt
            _stats_path(out).write_text(json.dumps(asdict(total) | {"tokens_per_second": total.tokens_per_second}))
            bar.update(len(recs))
            bar.set_postfix(tok_s=f"{run.tokens_per_second:.1f}", tokens=run.output_tokens)
    return run
