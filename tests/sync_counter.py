"""Counting host syncs on the CPU: every tensor operation that reads values back to Python or
needs them to know an output's shape (on an accelerator each one waits for the device).

``HostSyncCounter`` is a ``TorchFunctionMode``: inside ``with HostSyncCounter() as c:`` each such
call adds one to ``c.count`` and its name and caller to ``c.calls``. On a GPU
``torch.cuda.set_sync_debug_mode("error")`` is the device's own check of the same thing.
"""
from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode

# value reads (Python scalars, lists, arrays) and ops whose output shape depends on values
SYNC_FUNCS = {"__bool__", "__int__", "__float__", "__index__", "__complex__", "item", "tolist", "numpy",
              "cpu", "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount",
              "repeat_interleave", "equal", "allclose"}


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostSyncCounter(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count = 0
        self.calls: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in SYNC_FUNCS or (name in ("__getitem__", "__setitem__") and len(args) > 1
                                  and _has_bool_index(args[1])):
            self.count += 1
            frame = traceback.extract_stack(limit=3)[0]
            self.calls.append((name, f"{frame.filename}:{frame.lineno}"))
        return func(*args, **(kwargs or {}))
