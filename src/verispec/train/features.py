"""Offline cache of target features (``verispec data features``), in safetensors shards.

Online capture (the target forward inside the training loop) is the default and needs no disk.
The cache trades disk for compute when the same data is seen for several epochs or by several
trainers: per sequence it stores the chosen layers' hidden states (concatenated, [T, n*h]) and the
final-normed last hidden state ([T, h]), from which the trainer recomputes the target's logits
with its ``lm_head``. Layout: ``index.json`` (``{"layers", "dtype", "model", "hidden_size",
"shards": {id: file}}``) and ``shard-00000.safetensors``, ... with tensors ``<id>.hidden`` and
``<id>.last``. Sequences are looked up by example id; a missing id or a length mismatch is an
error (the cache was made from other data). The cache lives on the host whatever device made it;
``FeatureStore.batch`` reads it there and hands batches over on the trainer's device.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..models.device import module_device
from .data import TokenizedExample

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def estimate_bytes(examples: list[TokenizedExample], hidden: int, n_layers: int, dtype: str) -> int:
    per = torch.empty(0, dtype=DTYPES[dtype], device="cpu").element_size()
    return sum(len(e.input_ids) for e in examples) * hidden * (n_layers + 1) * per


def _index(out: Path, meta: dict, shards: dict[str, str], complete: bool) -> None:
    """Rewrite ``index.json`` atomically: the settings, the shard of each sequence written so far
    and whether the pass is over."""
    tmp = out / "index.json.tmp"
    tmp.write_text(json.dumps({**meta, "shards": shards, "complete": complete}))
    tmp.replace(out / "index.json")


def _resume(out: Path, meta: dict) -> dict[str, str]:
    """The shards already written to ``out`` by an interrupted pass with the same settings
    (``{}`` for a new or empty folder); anything else in the way is an error."""
    if not out.exists() or not any(out.iterdir()):
        return {}
    try:
        index = json.loads((out / "index.json").read_text())
    except (OSError, json.JSONDecodeError):
        raise FileExistsError(f"{out} is not empty and holds no feature-cache index; pick a new folder") from None
    theirs = {k: index.get(k) for k in meta}
    if theirs != meta:
        raise FileExistsError(f"{out} holds a feature cache made with {theirs}, not {meta}; pick a new folder")
    return dict(index["shards"])


@torch.no_grad()
def write_features(target, examples: list[TokenizedExample], out_dir: str | Path, layers: tuple[int, ...],
                   *, dtype: str = "bf16", shard_sequences: int = 256, model_name: str = "",
                   progress: bool = True) -> Path:
    """Run ``target`` over ``examples`` and write the cache; prints its size before writing.
    Resumable: ``index.json`` is rewritten after every shard (``complete`` false until the end),
    and a rerun into the same folder with the same settings computes only the sequences whose
    shard is not written yet (a folder holding anything else is refused)."""
    from tqdm.auto import tqdm
    out = Path(out_dir)
    meta = {"layers": list(layers), "dtype": dtype, "model": model_name, "hidden_size": target.cfg.hidden_size}
    shards = _resume(out, meta)
    todo = [ex for ex in examples if ex.id not in shards]
    size = estimate_bytes(todo, target.cfg.hidden_size, len(layers), dtype)
    print(f"feature cache: {len(examples)} sequences, {len(examples) - len(todo)} already written; "
          f"{size / 2**30:.2f} GiB ({dtype}) to write -> {out}", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    buf: dict[str, torch.Tensor] = {}
    pending: dict[str, str] = {}
    n_shard = 1 + max((int(f[len("shard-"):-len(".safetensors")]) for f in shards.values()), default=-1)
    dev = module_device(target)
    for k, ex in enumerate(tqdm(todo, desc="features", unit="seq", disable=not progress)):
        ids = torch.tensor([ex.input_ids], device=dev)
        o = target(ids, torch.arange(ids.shape[1], device=dev)[None], hidden_layers=tuple(set(layers)),
                   compute_logits=False)
        buf[f"{ex.id}.hidden"] = torch.cat([o.hidden[i][0] for i in layers], -1).to(DTYPES[dtype]).cpu().contiguous()
        buf[f"{ex.id}.last"] = o.last_hidden[0].to(DTYPES[dtype]).cpu().contiguous()
        pending[ex.id] = f"shard-{n_shard:05d}.safetensors"
        if len(buf) // 2 >= shard_sequences or k == len(todo) - 1:
            save_file(buf, str(out / pending[ex.id]))
            shards.update(pending)
            _index(out, meta, shards, complete=False)
            buf, pending, n_shard = {}, {}, n_shard + 1
    _index(out, meta, shards, complete=True)
    return out


class FeatureStore:
    """Read side of the cache: ``get(example) -> (hidden [T, n*h], last [T, h])`` in fp32."""

    def __init__(self, folder: str | Path, layers: tuple[int, ...], hidden_size: int):
        self.folder = Path(folder)
        try:
            self.index = json.loads((self.folder / "index.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{self.folder} is not a feature cache (index.json: {e})") from e
        if not self.index.get("complete", True):
            raise ValueError(f"{self.folder}: the feature pass that writes this cache was interrupted; rerun "
                             "`verispec data features` with the same arguments to finish it")
        if tuple(self.index["layers"]) != tuple(layers) or self.index["hidden_size"] != hidden_size:
            raise ValueError(f"feature cache has layers {self.index['layers']} / hidden {self.index['hidden_size']}, "
                             f"the trainer needs {list(layers)} / {hidden_size}")
        self._open: dict[str, object] = {}

    def get(self, ex_id: str, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard = self.index["shards"].get(ex_id)
        if shard is None:
            raise KeyError(f"example {ex_id!r} is not in the feature cache {self.folder}")
        f = self._open.get(shard) or self._open.setdefault(shard, safe_open(str(self.folder / shard), "pt",
                                                                               device="cpu"))
        hidden, last = f.get_tensor(f"{ex_id}.hidden").float(), f.get_tensor(f"{ex_id}.last").float()
        if hidden.shape[0] != length:
            raise ValueError(f"example {ex_id!r}: cache has {hidden.shape[0]} positions, data {length}")
        return hidden, last

    def batch(self, ids: list[str], lengths: list[int], t: int,
              device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded [B, t, n*h] and [B, t, h] on ``device`` (read on the host, copied once)."""
        pairs = [self.get(i, n) for i, n in zip(ids, lengths)]
        hidden = torch.zeros(len(pairs), t, pairs[0][0].shape[-1], device="cpu")
        last = torch.zeros(len(pairs), t, pairs[0][1].shape[-1], device="cpu")
        for i, (h, l) in enumerate(pairs):
            hidden[i, :h.shape[0]], last[i, :l.shape[0]] = h, l
        return hidden.to(device), last.to(device)
