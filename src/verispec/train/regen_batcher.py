"""Continuous batching of conversation turns for ``verispec data regenerate``.

One ``Engine`` stays alive for the whole run; a scheduler keeps its rows full, as a server would:

    pending turns ──► [ admit while a row is free ──► step ──► retire finished turns ] ──► records
                ▲                                                   │
                └──── the conversation's next user turn ◄───────────┘

A conversation's turns run one after another (turn t + 1 is rendered from the text of answer t);
different conversations run side by side. The next turn of a conversation goes to the *front* of
the queue, so few conversations are in flight at once and a kill loses little.

Content contract (the same as answering each turn alone with ``LLM.chat``): the prompt of a turn is
the chat template over the system messages, the turns answered so far and the user turn; its ids
are ``tokenizer(text, add_special_tokens=False)``; the answer ends on EOS or ``max_tokens`` (no stop
strings) and its text is ``tokenizer.decode(ids, skip_special_tokens=True)``. A turn whose prompt
has more than ``max_prompt_tokens`` tokens is not answered: on the first turn the conversation is
skipped, on a later one that user turn is left out and the next one is tried. Each sequence has its
own generator seeded from ``params.seed`` and is prefilled alone, so what a conversation gets does
not depend on which others share its batch (up to floating-point summation order).

This module uses only the engine's public surface (``LLM.make_engine``, ``Engine.add``,
``Engine.step``, ``Engine.can_admit``, ``Engine.num_running``, ``Sequence``); it knows nothing about files.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from ..core.engine import Engine, Sequence
from ..core.sampling import SamplingParams
from .data import Conversation


@dataclass
class ConversationJob:
    """One conversation being regenerated: its user turns (up to ``max_turns``), the messages
    kept so far (system messages, then user/assistant pairs) and one finish reason per answer."""
    conv: Conversation
    users: list[str]
    history: list[dict]
    finish_reasons: list[str] = field(default_factory=list)
    next_turn: int = 0
    output_tokens: int = 0
    skipped: str | None = None

    @classmethod
    def start(cls, conv: Conversation, max_turns: int) -> "ConversationJob":
        return cls(conv, conv.user_turns()[:max_turns], [m for m in conv.messages if m["role"] == "system"])

    def record(self, temperature: float) -> dict:
        """The JSONL record: SpecForge format, or ``{"id", "skipped"}``."""
        if self.skipped is not None:
            return {"id": self.conv.id, "skipped": self.skipped}
        return {"id": self.conv.id, "conversations": self.history,
                "meta": {"finish_reasons": self.finish_reasons, "temperature": temperature}}


@dataclass
class _Turn:
    job: ConversationJob
    messages: list[dict]          # history + this user turn


class TurnBatcher:
    """Answers the turns of ``ConversationJob``s through one engine of ``max_batch`` rows;
    ``run`` yields each job once it is complete (or skipped)."""

    def __init__(self, llm, params: SamplingParams, *, max_batch: int, max_prompt_tokens: int):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens must be >= 1")
        self.llm, self.params, self.max_prompt_tokens = llm, params, max_prompt_tokens
        max_len = min(max_prompt_tokens + params.max_tokens, llm.max_model_len)
        self.engine: Engine = llm.make_engine(max_batch, max_len)
        self.turns: deque[_Turn] = deque()
        self.done: deque[ConversationJob] = deque()
        self.output_tokens = 0            # emitted so far, answers in flight included

    def _prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.llm.tokenizer(self.llm.apply_chat_template(messages), add_special_tokens=False).input_ids

    def _queue_next_turn(self, job: ConversationJob, front: bool) -> None:
        """Queue the job's next user turn, or mark it done when it has none left."""
        if job.next_turn >= len(job.users):
            self.done.append(job)
            return
        msgs = job.history + [{"role": "user", "content": job.users[job.next_turn]}]
        (self.turns.appendleft if front else self.turns.append)(_Turn(job, msgs))

    def _admit(self, turn: _Turn) -> None:
        """Prefill one turn into a free row, or pass over it when its prompt does not fit."""
        job = turn.job
        ids = self._prompt_ids(turn.messages)
        job.next_turn += 1
        if len(ids) > self.max_prompt_tokens or len(ids) >= self.llm.max_model_len:
            if job.next_turn == 1:
                job.skipped = f"prompt over {self.max_prompt_tokens} tokens"
                self.done.append(job)
            else:
                self._queue_next_turn(job, front=True)
            return
        self.engine.add(Sequence(prompt_ids=ids, params=self.params,
                                 on_tokens=lambda seq, new, t=turn: self._on_tokens(t, seq, new)))

    def _on_tokens(self, turn: _Turn, seq: Sequence, new: list[int]) -> None:
        self.output_tokens += len(new)
        if not seq.finished:
            return
        job = turn.job
        text = self.llm.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        job.history = turn.messages + [{"role": "assistant", "content": text}]
        job.finish_reasons.append(seq.finish_reason or "length")
        job.output_tokens += len(seq.output_ids)
        self._queue_next_turn(job, front=True)

    def _fill(self, jobs: Iterator[ConversationJob]) -> None:
        """Admit turns while a row is free: continuing conversations first, then new ones."""
        while self.engine.can_admit():
            if not self.turns:
                job = next(jobs, None)
                if job is None:
                    return
                self._queue_next_turn(job, front=False)
                continue
            self._admit(self.turns.popleft())

    def run(self, convs: Iterable[Conversation], max_turns: int) -> Iterator[ConversationJob]:
        """Regenerate ``convs``; yields each ``ConversationJob`` as soon as it is complete or
        skipped (completion order, not input order)."""
        jobs = (ConversationJob.start(c, max_turns) for c in convs)
        while True:
            # 1) admit turns into free rows  2) one step for every row  3) hand out finished jobs
            self._fill(jobs)
            yield from self._drain()
            if not self.engine.num_running:
                return                       # nothing in flight and nothing left to admit
            self.engine.step()

    def _drain(self) -> Iterator[ConversationJob]:
        while self.done:
            yield self.done.popleft()
