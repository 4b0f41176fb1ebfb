"""One training loop for every trainer (EAGLE-1, EAGLE-3, Medusa-1/2), single process or DDP.

A trainer is a ``Task``:
- ``module``: the trainable ``nn.Module``; ``module(inputs) -> StepOut`` (the loss *sum* and how
  many units it sums over, plus summed statistics);
- ``prepare(batch) -> inputs``: the no-grad work on the frozen target (features, target
  distributions); ``inputs.count`` is the number of loss units (known before the forward, so the
  loss can be normalised by the global count);
- ``save(folder)``: write the trained weights in their checkpoint format.

Device (``TrainConfig.device``, ``training_device``): the module, every batch and the loss live on
one device per process: "cpu", or under torchrun with "cuda" each rank's ``cuda:LOCAL_RANK``
(``torch.cuda.set_device`` is called). ``dtype="bf16"`` autocasts the forward to bfloat16 on that
device's type (CPU or CUDA autocast). The frozen target of a task is loaded on the same device.

Distributed: under ``torchrun --nproc_per_node N`` the module is wrapped in
``DistributedDataParallel`` (gloo on CPU, nccl on CUDA: the backend follows the device). Every
step takes ``batch_size`` sequences from one seeded permutation per epoch (the same on every
rank); rank r takes every N-th of them, in micro-batches of ``micro_batch_size``. Each rank
back-propagates ``loss_sum * N / global_count`` and DDP averages, so the gradient is that of
(global loss sum / global count): N processes and 1 process with the same global batch follow the
same curve up to float summation order.

The data order is a pure function of (seed, step), so ``resume`` (rank 0 writes
``train_state.pt``: module, optimizer, scheduler, step) continues the very same curve. Logs go to
``log.jsonl`` (rank 0), one line per ``log_every`` steps and per evaluation.
"""
from __future__ import annotations

import atexit
import json
import math
import os
import random
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..models.device import resolve_device
from .data import TokenizedExample


@dataclass
class TrainConfig:
    out_dir: Path
    epochs: float = 1.0
    max_steps: int | None = None          # overrides epochs when set
    batch_size: int = 8                   # global sequences per optimizer step
    micro_batch_size: int = 1             # sequences per forward on one rank
    lr: float = 3e-4
    warmup_ratio: float = 0.03
    min_lr_ratio: float = 0.1             # cosine decay to lr * min_lr_ratio
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 0.5
    dtype: str = "fp32"                   # "bf16": autocast the forward to bfloat16 (on the device's type)
    device: str = "cpu"                   # "cpu", "auto", "cuda" (under torchrun: cuda:LOCAL_RANK), "cuda:N"
    seed: int = 0
    log_every: int = 10
    eval_every: int | None = None         # steps; None: at the end only
    save_every: int | None = None         # steps; None: at the end only
    resume: bool = True
    progress: bool = True
    stop_after: int | None = None         # end this run after N steps (time box); resume later

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        if self.batch_size < 1 or self.micro_batch_size < 1:
            raise ValueError("batch_size and micro_batch_size must be >= 1")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype must be 'fp32' or 'bf16', got {self.dtype!r}")


@dataclass
class Batch:
    """Right-padded sequences (causal attention: real tokens never see the padding)."""
    input_ids: torch.Tensor       # [B, T] int64, 0 on padding
    loss_mask: torch.Tensor       # [B, T] float, 0 on padding
    lengths: torch.Tensor         # [B]
    ids: list[str]

    def to(self, device: torch.device) -> "Batch":
        """The batch with its tensors on ``device``."""
        return Batch(self.input_ids.to(device), self.loss_mask.to(device), self.lengths.to(device), self.ids)


@dataclass
class StepOut:
    loss_sum: torch.Tensor                              # scalar with grad
    stats: dict[str, torch.Tensor] = field(default_factory=dict)   # name -> [sum, count]


class Task(Protocol):
    module: nn.Module

    def prepare(self, batch: Batch) -> Any: ...

    def save(self, folder: Path) -> None: ...


def collate(examples: Sequence[TokenizedExample], device: str | torch.device = "cpu") -> Batch:
    """Right-padded batch of ``examples`` on ``device``."""
    t = max(len(e.input_ids) for e in examples)
    ids = torch.tensor([list(e.input_ids) + [0] * (t - len(e.input_ids)) for e in examples],
                       dtype=torch.long, device=device)
    mask = torch.tensor([[float(m) for m in e.loss_mask] + [0.0] * (t - len(e.loss_mask)) for e in examples],
                        dtype=torch.float, device=device)
    return Batch(ids, mask, torch.tensor([len(e.input_ids) for e in examples], device=device), [e.id for e in examples])


# -- distributed ---------------------------------------------------------------------------------
def training_device(spec: str | torch.device | None = "cpu") -> torch.device:
    """This process's device for ``spec`` (``device.resolve_device``): a CUDA device without an
    index becomes ``cuda:LOCAL_RANK`` under torchrun (``cuda:0`` alone), and is made the current one."""
    dev = resolve_device(spec)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    return dev


def init_distributed(device: torch.device | None = None) -> tuple[int, int]:
    """(rank, world); starts the process group when launched by torchrun: nccl for a CUDA
    ``device``, gloo otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device is not None and device.type == "cuda" else "gloo")
        atexit.register(shutdown_distributed)
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def shutdown_distributed() -> None:
    """Destroy the process group ``init_distributed`` started (registered at exit). Left to the
    interpreter's teardown, gloo's worker threads can be destroyed while joinable, and a rank dies
    with SIGABRT ("terminate called without an active exception") after its work is done."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _all_sum(x: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(x)
    return x


# -- data order ----------------------------------------------------------------------------------
def step_examples(n: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Indices of the global batch of ``step``: epoch-wise seeded permutations, wrapping around."""
    per_epoch = max(1, n // batch_size)
    epoch, k = divmod(step, per_epoch)
    perm = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(perm)
    return perm[k * batch_size:(k + 1) * batch_size]


def total_steps(n: int, cfg: TrainConfig) -> int:
    if cfg.max_steps is not None:
        return cfg.max_steps
    return max(1, math.ceil(cfg.epochs * max(1, n // cfg.batch_size)))


def lr_factor(step: int, total: int, cfg: TrainConfig) -> float:
    warm = max(1, int(cfg.warmup_ratio * total))
    if step < warm:
        return (step + 1) / warm
    frac = min(1.0, (step - warm) / max(1, total - warm))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))


# -- the loop ------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    steps: int
    seconds: float
    last: dict
    eval: dict
    log_path: Path
    batch_size: int = 0


class Trainer:
    def __init__(self, task: Task, train: Sequence[TokenizedExample], heldout: Sequence[TokenizedExample],
                 cfg: TrainConfig):
        if len(train) < cfg.batch_size:
            raise ValueError(f"{len(train)} training sequences for a global batch of {cfg.batch_size}")
        self.task, self.train_set, self.heldout, self.cfg = task, list(train), list(heldout), cfg
        self.device = training_device(cfg.device)
        self.rank, self.world = init_distributed(self.device)
        if cfg.batch_size % self.world:
            raise ValueError(f"batch_size {cfg.batch_size} is not divisible by {self.world} processes")
        torch.manual_seed(cfg.seed)
        self.model = task.module.to(self.device)
        if self.world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = nn.parallel.DistributedDataParallel(task.module, device_ids=ids)
        params = [p for p in task.module.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas)
        self.total = total_steps(len(self.train_set), cfg)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, self.total, cfg))
        self.step = 0
        self.state_path = cfg.out_dir / "train_state.pt"
        self.log_path = cfg.out_dir / "log.jsonl"
        if cfg.resume and self.state_path.exists():
            self._load_state()

    # -- state --
    def _load_state(self) -> None:
        st = torch.load(self.state_path, map_location="cpu", weights_only=False)
        self.task.module.load_state_dict(st["module"])
        self.opt.load_state_dict(st["optimizer"])
        self.sched.load_state_dict(st["scheduler"])
        self.step = int(st["step"])

    def _save_state(self) -> None:
        if self.rank != 0:
            return
        self.cfg.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        torch.save({"module": self.task.module.state_dict(), "optimizer": self.opt.state_dict(),
                    "scheduler": self.sched.state_dict(), "step": self.step,
                    "config": {k: str(v) for k, v in asdict(self.cfg).items()}}, tmp)
        tmp.replace(self.state_path)

    def _log(self, rec: dict) -> None:
        if self.rank == 0:
            self.cfg.out_dir.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")

    # -- steps --
    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.dtype == "bf16")

    def _local_micro_batches(self, step: int) -> list[Batch]:
        idx = step_examples(len(self.train_set), self.cfg.batch_size, step, self.cfg.seed)[self.rank::self.world]
        mb = self.cfg.micro_batch_size
        return [collate([self.train_set[i] for i in idx[j:j + mb]], self.device) for j in range(0, len(idx), mb)]

    def train_step(self) -> dict:
        dev = self.device
        prepared = [self.task.prepare(b) for b in self._local_micro_batches(self.step)]
        count = _all_sum(torch.tensor(float(sum(p.count for p in prepared)), device=dev))
        scale = self.world / max(float(count), 1.0)
        self.model.train()
        stats: dict[str, torch.Tensor] = {}
        loss_sum = torch.zeros((), device=dev)
        for j, inputs in enumerate(prepared):
            sync = j == len(prepared) - 1 or self.world == 1
            ctx = self.model.no_sync() if not sync and self.world > 1 else nullcontext()
            with ctx, self._autocast():
                out = self.model(inputs)
                (out.loss_sum * scale).backward()
            loss_sum += out.loss_sum.detach().float()
            for k, v in out.stats.items():
                stats[k] = stats.get(k, torch.zeros(2, device=dev)) + v.detach().float()
        params = [p for p in self.task.module.parameters() if p.requires_grad]
        gnorm = torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm) if self.cfg.max_grad_norm > 0 \
            else torch.tensor(0.0, device=dev)
        loss = float(_all_sum(loss_sum)) / max(float(count), 1.0)
        _check_finite(self.step + 1, loss, float(gnorm), params)
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        self.step += 1
        rec = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": float(gnorm), "count": float(count)}
        rec.update(_ratios({k: _all_sum(v) for k, v in sorted(stats.items())}))
        return rec

    @torch.no_grad()
    def evaluate(self, max_sequences: int | None = None) -> dict:
        """Held-out statistics (each rank a shard, summed)."""
        data = self.heldout[:max_sequences] if max_sequences else self.heldout
        if not data:
            return {}
        self.model.eval()
        stats: dict[str, torch.Tensor] = {}
        dev = self.device
        loss_sum, count = torch.zeros((), device=dev), torch.zeros((), device=dev)
        mb = self.cfg.micro_batch_size
        mine = data[self.rank::self.world]
        for j in range(0, len(mine), mb):
            inputs = self.task.prepare(collate(mine[j:j + mb], dev))
            with self._autocast():
                out = self.task.module(inputs)
            loss_sum += out.loss_sum.float()
            count += float(inputs.count)
            for k, v in out.stats.items():
                stats[k] = stats.get(k, torch.zeros(2, device=dev)) + v.float()
        rec = {"loss": float(_all_sum(loss_sum)) / max(float(_all_sum(count)), 1.0)}
        rec.update(_ratios({k: _all_sum(v) for k, v in sorted(stats.items())}))
        return rec

    def _last_logged(self) -> dict:
        """The last training record of ``log.jsonl`` (a sitting that resumes at its final step
        runs no step: its result reports the step that ran last, not an empty record)."""
        if not self.log_path.exists():
            return {}
        last = {}
        for line in self.log_path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "loss" in rec and "eval" not in rec:
                last = rec
        return last

    def fit(self) -> TrainResult:
        from tqdm.auto import tqdm
        cfg = self.cfg
        t0, last, ev = time.perf_counter(), self._last_logged(), {}
        bar = tqdm(total=self.total, initial=self.step, desc="train", unit="step",
                   disable=not cfg.progress or self.rank != 0)
        stop = self.total if cfg.stop_after is None else min(self.total, self.step + cfg.stop_after)
        while self.step < stop:
            last = self.train_step()
            last["elapsed_s"] = round(time.perf_counter() - t0, 2)
            if self.step % cfg.log_every == 0 or self.step == self.total:
                self._log(last)
            bar.update(1)
            bar.set_postfix(loss=f"{last['loss']:.3f}", **{k: f"{v:.2f}" for k, v in last.items()
                                                           if k.startswith("acc0")})
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < stop:
                self._log({"step": self.step, "eval": self.evaluate()})
            if cfg.save_every and self.step % cfg.save_every == 0:
                self._save_state()
        bar.close()
        ev = self.evaluate()
        done = self.step >= self.total
        self._log({"step": self.step, "eval": ev, "final": done})
        self._save_state()
        if self.rank == 0:                 # a sitting stopped early leaves its head to evaluate or measure
            self.task.save(cfg.out_dir / ("checkpoint" if done else "checkpoint-last"))
        if dist.is_initialized():
            dist.barrier()
        return TrainResult(self.step, time.perf_counter() - t0, last, ev, self.log_path, cfg.batch_size)


class NonFiniteLoss(FloatingPointError):
    """A training step produced a NaN/inf loss or gradient: the run stops before the optimizer
    applies it, so the last saved state (``train_state.pt``) is still finite."""


def _check_finite(step: int, loss: float, grad_norm: float, params: list[torch.Tensor]) -> None:
    """Raise ``NonFiniteLoss`` when ``loss`` or ``grad_norm`` is not finite, naming the step and
    the parameters whose gradients are not."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    bad = sum(1 for p in params if p.grad is not None and not bool(torch.isfinite(p.grad).all()))
    raise NonFiniteLoss(f"step {step}: loss {loss}, gradient norm {grad_norm} ({bad} parameter(s) with "
                        "non-finite gradients); the optimizer step was not taken and the run stops. "
                        "Resume from the last saved state with a lower --lr, or --dtype fp32")


def _ratios(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float(v[0] / v[1]) if float(v[1]) > 0 else float("nan") for k, v in stats.items()}
