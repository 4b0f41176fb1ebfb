"""Replay of the target's bucketed forward from captured graphs (CUDA graphs): the verify step
without a kernel launch per op.

A forward given ``kv_len`` (see ``transformer``) has shapes fixed by (B, T, kv_len, rows) and
makes no device sync, so it can be captured once per such key and replayed. ``GraphedForward``
keeps, per key, preallocated input buffers (tokens, positions, tree mask) that each call copies
into, the graph, and its output tensors. The cache's K/V and lengths are read and written in place
by every replay (``KVCache`` never reallocates them), so commits between steps (``advance``,
``compact_batch``, ...) are seen by the next replay: the mask, slots and RoPE are recomputed on
the device from ``cache.lengths`` inside the graph.

Contract
- ``__call__(tokens, positions, kv_len, attn_mask=None, rows=None, hidden_layers=())`` returns
  the ``ModelOutput`` of ``model(tokens, positions, cache, attn_mask=..., rows=..., kv_len=...,
  hidden_layers=...)``. Its tensors are the graph's own: valid until the next call with the same
  key (clone what must outlive it). ``rows``: host ints or None (0..B-1).
- ``kv_len`` is checked against the host mirror of the lengths at every call (no sync).
- A key is captured on first use; ``len(self)`` counts the graphs held (bucket ``kv_len`` with
  ``KVCache.kv_len`` to keep it small).
- ``capture(forward) -> (replay, output)`` makes a graph: ``cuda_capture`` (default), or
  ``eager_capture`` (runs the forward at each replay and copies into the first output: the same
  contract with no CUDA, for tests and CPUs).
Knows nothing about drafters, trees or sampling.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .kv_cache import KVCache
from .transformer import ModelOutput, Transformer

Capture = Callable[[Callable[[], ModelOutput]], tuple[Callable[[], None], ModelOutput]]


def cuda_capture(forward: Callable[[], ModelOutput], warmup: int = 3) -> tuple[Callable[[], None], ModelOutput]:
    """A CUDA graph of ``forward`` (warmed up on a side stream first, as PyTorch asks): (replay, output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    return graph.replay, out


def eager_capture(forward: Callable[[], ModelOutput]) -> tuple[Callable[[], None], ModelOutput]:
    """No graph: every replay runs ``forward`` and copies its result into the first output."""
    out = forward()

    def replay() -> None:
        new = forward()
        for dst, src in zip(_tensors(out), _tensors(new)):
            dst.copy_(src)
    return replay, out


def _tensors(out: ModelOutput) -> list[torch.Tensor]:
    return [t for t in (out.logits, out.last_hidden, *(out.hidden[i] for i in sorted(out.hidden)))
            if t is not None]


@dataclass
class _Graph:
    inputs: tuple[torch.Tensor | None, ...]   # preallocated tokens [B,T], positions [B,T], mask [B,T,T]
    replay: Callable[[], None]
    output: ModelOutput
    rows: torch.Tensor | None                 # [B] device index of non-consecutive rows (kept alive)


class GraphedForward:
    def __init__(self, model: Transformer, cache: KVCache, capture: Capture | None = None):
        self.model, self.cache = model, cache
        self.capture = capture or cuda_capture
        self._graphs: dict[tuple, _Graph] = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int,
                 attn_mask: torch.Tensor | None = None, rows: Sequence[int] | None = None,
                 hidden_layers: tuple[int, ...] = ()) -> ModelOutput:
        b, t = tokens.shape
        rows = None if rows is None else tuple(int(r) for r in rows)
        need = max(self.cache.lengths_of(range(b) if rows is None else rows)) + t     # host mirror
        if need > kv_len:
            raise ValueError(f"kv_len {kv_len} is below the {need} slots this forward attends")
        key = (tuple(tokens.shape), kv_len, rows, tuple(hidden_layers), attn_mask is None)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(tokens, positions, attn_mask, kv_len, rows, hidden_layers)
        for buf, x in zip(graph.inputs, (tokens, positions, attn_mask)):
            if buf is not None:
                buf.copy_(x, non_blocking=True)
        graph.replay()
        return graph.output

    def _capture(self, tokens, positions, mask, kv_len, rows, hidden_layers) -> _Graph:
        dev = self.cache.device
        inputs = tuple(None if x is None else x.to(dev, copy=True) for x in (tokens, positions, mask))
        index = None
        if rows is not None and list(rows) != list(range(rows[0], rows[0] + len(rows))):
            index = torch.tensor(rows, device=dev)            # a gather index made before capture

        def forward() -> ModelOutput:
            return self.model(inputs[0], inputs[1], self.cache, attn_mask=inputs[2],
                              rows=rows if index is None else index, kv_len=kv_len, hidden_layers=hidden_layers)
        replay, output = self.capture(forward)
        return _Graph(inputs, replay, output, index)
