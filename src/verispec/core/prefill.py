"""Prompt prefill in chunks that can be spread over decoding steps (chunked prefill).

A prompt is prefilled into its KV cache row chunk by chunk: each chunk is one target forward over
its tokens, attending to the row's earlier slots. ``chunked_prefill`` is a generator so a caller
decides when each chunk runs and how long it is: the engine runs every chunk at once for
``LLM.generate``, and the server runs one token budget of chunks between two decoding steps
(``Engine.begin`` / ``Engine.prefill_step``), so a long prompt never stalls the running streams
for its whole forward (vLLM's chunked prefill, llama.cpp's ``-b``/``-ub`` batches).

Chunks lie on a fixed grid: positions ``[k * grid, (k + 1) * grid)`` of the prompt, whatever
budget a caller sends, so a prompt's chunks, and with them its numbers, depend on the prompt and
the grid alone, never on the load. (A chunk of many rows runs torch's SDPA, whose blocking
depends on the chunk's length and attended slots, and a prompt's K/V feed every later token: a
402-token prompt chunked 256 + 146 instead of whole changed SmolLM2's first token on a near-tie.)
A budget smaller than the next chunk still runs that whole chunk. So every engine with the same
grid (``Engine.prefill_chunk``; ``LLM.generate`` and the server's default are both 512) prefills
a prompt identically, and greedy outputs match across batch compositions and servers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generator

import torch

from .features import TargetFeatures
from .logprobs import token_logprobs
from .prefix_cache import PrefixHit

Prefill = Generator[int, int, "tuple[torch.Tensor, TargetFeatures | None]"]


def chunked_prefill(model, cache, row: int, ids: list[int], start: int, layers: tuple[int, ...],
                    want_last: bool, prompt_logprobs: int | None = None,
                    sink: list | None = None, grid: int = 512) -> Prefill:
    """Prefill cache row ``row`` with ``ids[start:]`` (slots before ``start`` are already there).

    Protocol: prime with ``next(gen)`` (yields 0), then each ``gen.send(n)`` (a budget, ``n >= 1``)
    runs the next chunk of the ``grid`` (up to the next multiple of ``grid`` positions, however
    small ``n``: see the module docstring) and yields how many it ran; after the last chunk the generator
    returns ``(logits of the last position, features of positions start..)`` through
    ``StopIteration.value``. ``prompt_logprobs``: k, to append the entries of prompt tokens 1..n-1
    to ``sink`` (logits at every position; only from ``start`` 0)."""
    if prompt_logprobs is not None and start:
        raise ValueError("prompt_logprobs need the whole prompt prefilled (start 0)")
    if start >= len(ids):
        raise ValueError(f"nothing to prefill: start {start} of a {len(ids)}-token prompt")
    if grid < 1:
        raise ValueError(f"the prefill grid needs at least 1 token a chunk, got {grid}")
    dev = cache.device
    rows = torch.tensor([row], device=dev)
    hid_parts: dict[int, list] = {i: [] for i in layers}
    last_parts, logits, s = [], None, start
    n = yield 0
    while True:
        if n < 1:
            raise ValueError(f"a prefill chunk needs at least 1 token, got {n}")
        chunk = torch.tensor([ids[s:(s // grid + 1) * grid]], device=dev)
        width = int(chunk.shape[1])
        is_last = s + width >= len(ids)
        out = model(chunk, torch.arange(s, s + width, device=dev)[None], cache, rows=rows,
                    hidden_layers=layers,
                    logits_index=None if prompt_logprobs is not None else torch.tensor([[width - 1]], device=dev),
                    compute_logits=is_last or prompt_logprobs is not None)
        cache.advance(rows, width)
        if prompt_logprobs is not None:
            nxt = ids[s + 1:s + 1 + width]                  # the token each position predicts
            sink += token_logprobs(out.logits[0, :len(nxt)], nxt, prompt_logprobs)
        for i in layers:
            hid_parts[i].append(out.hidden[i][0])
        if want_last:
            last_parts.append(out.last_hidden[0])
        s += width
        if is_last:
            logits = out.logits[0, -1]
            break
        n = yield width
    feats = None
    if layers or want_last:
        feats = TargetFeatures({i: torch.cat(v) for i, v in hid_parts.items()},
                               torch.cat(last_parts) if want_last else None)
    return logits, feats


def run_all(gen: Prefill) -> tuple[torch.Tensor, TargetFeatures | None]:
    """Drive ``gen`` to its end, chunk by chunk."""
    next(gen)
    try:
        while True:
            gen.send(1)
    except StopIteration as done:
        return done.value


@dataclass(eq=False)
class PrefillJob:
    """A sequence admitted to a row whose prompt is still being prefilled (``Engine.begin``)."""
    seq: object                  # core.engine.Sequence
    hit: PrefixHit               # the prefix-cache blocks it started from
    gen: Prefill
    left: int                    # prompt tokens still to prefill
    result: tuple | None = field(default=None)   # (logits, features) once the prompt is done

    def run(self, max_tokens: int) -> int:
        """Run the next chunk (``max_tokens`` is the caller's budget; a grid chunk may pass it);
        returns the tokens run."""
        try:
            done = self.gen.send(max_tokens)
        except StopIteration as end:
            self.result, done = end.value, self.left
        self.left -= done
        return done
