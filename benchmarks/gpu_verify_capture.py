"""The verify forward on a GPU: eager vs a CUDA graph vs ``torch.compile(mode="reduce-overhead")``.

SmolLM2-135M in bf16 on CUDA. For batch B in (1, 8) and T in (1, 4, 8, 16, 32) new tokens (a
chain: causal tree mask given, as the engine passes one), with rows at ragged lengths around
``--context`` committed tokens, times one target forward (wall clock, synchronised, median of
``--reps``):
- ``eager_exact``: today's call, no ``kv_len`` (the attended length is read from the device: a sync);
- ``eager``: bucketed ``kv_len = cache.kv_len(rows, T)`` (multiples of 64), no sync;
- ``cuda_graph``: that forward captured once by ``models.graphs.GraphedForward`` (a CUDA graph
  over preallocated tokens, positions and mask; the cache's K/V and lengths are static already)
  and replayed after copying the step's inputs in;
- ``compiled``: ``torch.compile(fullgraph=True, dynamic=False, mode="reduce-overhead")`` of the
  same forward (inductor kernels replayed by CUDA-graph trees), compile time reported apart.
Each captured variant's logits are compared with eager's (max abs difference, reported), and a
second step with other row lengths inside the same bucket is replayed to show the graph is reused.

Without CUDA (``--device cpu``, or no GPU) it says so, skips the CUDA-only variants and times the
eager ones; ``--cpu-standins`` runs them through CPU stand-ins instead (``eager_capture``,
``backend="eager"``) so the tests exercise the whole script (``--tiny``: a random 2-layer model).

    python benchmarks/gpu_verify_capture.py                  # on a CUDA machine
    python benchmarks/gpu_verify_capture.py --tiny --device cpu --reps 3 --out /tmp/x
Writes benchmarks/results/gpu_verify_capture.{json,md} (``--out``).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec.bench import harness

BATCHES = (1, 8)
TREE_TOKENS = (1, 4, 8, 16, 32)
SKIP_MSG = "CUDA is not available: skipping the CUDA-graph and torch.compile(reduce-overhead) variants"
STANDIN_MSG = ("CUDA is not available: CUDA graphs replaced by GraphedForward's eager_capture and "
               "reduce-overhead by backend='eager' (checks of this script and of the logits, not a measurement)")


def load(args):
    from verispec.models.loading import load_model
    if args.tiny:
        from verispec.models.config import ModelConfig
        from verispec.models.transformer import Transformer
        cfg = ModelConfig(arch="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16)
        torch.manual_seed(0)
        model = Transformer(cfg).fuse_().to(args.dtype)
    else:
        model = load_model(args.model, dtype=args.dtype, with_tokenizer=False).model
    return model.to(args.device).eval().requires_grad_(False)


class Step:
    """One (B, T) verify step: a cache at ragged lengths and the step's inputs."""

    def __init__(self, model, b: int, t: int, args):
        from verispec.models.kv_cache import KVCache
        self.model, self.b, self.t = model, b, t
        dev = args.device
        self.cache = KVCache.for_model(model.cfg, b, args.context + 2 * t + 64, args.dtype, dev)
        if dev == "cuda":
            self.cache.mark_static_addresses()
        lengths = [args.context - 3 * i for i in range(b)]
        g = torch.Generator().manual_seed(b * 100 + t)
        with torch.no_grad():
            for row, n in enumerate(lengths):
                toks = torch.randint(0, model.cfg.vocab_size, (1, n), generator=g).to(dev)
                model(toks, torch.arange(n, device=dev)[None], self.cache, rows=[row])
        self.cache.advance(range(b), lengths)
        self.tokens = torch.randint(0, model.cfg.vocab_size, (b, t), generator=g).to(dev)
        self.mask = torch.ones(t, t, dtype=torch.bool, device=dev).tril().expand(b, t, t).contiguous()
        self.kv_len = self.cache.kv_len(range(b), t)

    def positions(self) -> torch.Tensor:
        """[B, T]: each row's length + depth (host mirror: no sync)."""
        starts = torch.tensor(self.cache.lengths_of(range(self.b)))
        return (starts[:, None] + torch.arange(self.t)).to(self.tokens.device)

    def eager(self, tokens, positions, mask, kv_len=None):
        return self.model(tokens, positions, self.cache, attn_mask=mask, kv_len=kv_len).logits


def timed(fn, reps: int, wait) -> float:
    """Median wall-clock ms of ``fn`` over ``reps`` calls, each followed by ``wait()`` (a sync)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        wait()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def graphed(step: Step, positions: torch.Tensor, cuda: bool):
    """(fn(tokens, positions, mask) -> logits, capture seconds, graphs held ()): ``GraphedForward``
    (a CUDA graph over preallocated inputs; on the CPU its ``eager_capture`` stand-in)."""
    from verispec.models.graphs import GraphedForward, cuda_capture, eager_capture
    graphs = GraphedForward(step.model, step.cache, capture=cuda_capture if cuda else eager_capture)
    t0 = time.perf_counter()
    graphs(step.tokens, positions, step.kv_len, attn_mask=step.mask)         # capture, first replay
    sync(cuda)
    return (lambda tok, pos, mask: graphs(tok, pos, step.kv_len, attn_mask=mask).logits,
            time.perf_counter() - t0, lambda: len(graphs))


def compiled(step: Step, positions: torch.Tensor, cuda: bool):
    """(fn(tokens, positions, mask) -> logits, compile seconds, graphs compiled ()): ``torch.compile``
    with mode="reduce-overhead" (inductor + CUDA-graph trees; on the CPU backend="eager")."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.config.recompile_limit = 64               # one compile per (B, T): more than 8
    before = counters["stats"]["unique_graphs"]
    opts = {"mode": "reduce-overhead"} if cuda else {"backend": "eager"}
    fn = torch.compile(lambda tok, pos, mask, kv: step.eager(tok, pos, mask, kv),
                       fullgraph=True, dynamic=False, **opts)
    t0 = time.perf_counter()
    for _ in range(3):                                       # compile, warm up, record the graph
        fn(step.tokens, positions, step.mask, step.kv_len)
    sync(cuda)
    return (lambda tok, pos, mask: fn(tok, pos, mask, step.kv_len), time.perf_counter() - t0,
            lambda: counters["stats"]["unique_graphs"] - before)


def cudagraph_skips() -> int:
    """How many times inductor ran a compiled graph without CUDA graphs (e.g. mutated inputs)."""
    from torch._dynamo.utils import counters
    return counters["inductor"]["cudagraph_skips"]


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def measure_one(model, b: int, t: int, args) -> dict:
    step = Step(model, b, t, args)
    pos = step.positions()
    cuda = args.device == "cuda"
    row = {"B": b, "T": t, "kv_len": step.kv_len}
    wait = lambda: sync(cuda)                                # noqa: E731
    with torch.no_grad():
        ref = step.eager(step.tokens, pos, step.mask).float()
        row["eager_exact_ms"] = timed(lambda: step.eager(step.tokens, pos, step.mask), args.reps, wait)
        row["eager_ms"] = timed(lambda: step.eager(step.tokens, pos, step.mask, step.kv_len), args.reps, wait)
        row["eager_max_abs_diff"] = (step.eager(step.tokens, pos, step.mask, step.kv_len).float() - ref).abs().max().item()
        if not (cuda or args.cpu_standins):
            return row
        for name, make in (("cuda_graph", graphed), ("compiled", compiled)):
            if name not in args.variants.split(","):
                continue
            try:
                fn, setup_s, graphs = make(step, pos, cuda)
            except Exception as e:                          # report, go on with the other variant
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
                continue
            row[f"{name}_setup_s"] = setup_s
            row[f"{name}_max_abs_diff"] = (fn(step.tokens, pos, step.mask).float() - ref).abs().max().item()
            row[f"{name}_ms"] = timed(lambda: fn(step.tokens, pos, step.mask), args.reps, wait)
            row[f"{name}_reused"] = reuse_check(step, fn)
            row[f"{name}_graphs"] = graphs()                 # 1: the second step reused the graph
        if cuda and "compiled" in args.variants.split(","):
            row["compiled_cudagraph_skips_so_far"] = cudagraph_skips()
    return row


def reuse_check(step: Step, fn) -> float | None:
    """Advance every row by one token (same bucket) and replay: max |logits - eager| there."""
    if step.cache.kv_len(range(step.b), step.t + 1) != step.kv_len:
        return None
    step.cache.advance(range(step.b), 1)
    pos = step.positions()
    want = step.eager(step.tokens, pos, step.mask).float()
    got = fn(step.tokens, pos, step.mask).float()
    step.cache.rollback(range(step.b), [n - 1 for n in step.cache.lengths_of(range(step.b))])
    return (got - want).abs().max().item()


def render(results: dict) -> str:
    cols = ["eager_exact_ms", "eager_ms", "cuda_graph_ms", "compiled_ms"]
    lines = [f"{results['model']} in {results['dtype']} on {results['device_name']}, {results['context']} "
             f"committed tokens (rows 3 apart), median of {results['reps']} synchronised calls.", ""]
    if results.get("note"):
        lines += [f"**{results['note']}**", ""]
    lines += ["| B | T | kv_len | " + " | ".join(c[:-3] + " ms" for c in cols) + " | graph x | compile x |",
              "|---|---|---|" + "---|" * (len(cols) + 2)]
    for r in results["rows"]:
        cells = [f"{r[c]:.3f}" if c in r else "-" for c in cols]
        ratio = [f"{r['eager_exact_ms'] / r[c]:.2f}" if c in r else "-" for c in ("cuda_graph_ms", "compiled_ms")]
        lines.append(f"| {r['B']} | {r['T']} | {r['kv_len']} | " + " | ".join(cells + ratio) + " |")
    errs = [f"- B={r['B']} T={r['T']} {k}: {v}" for r in results["rows"] for k, v in r.items() if k.endswith("_error")]
    rows = results["rows"]
    kinds = sorted({k for r in rows for k in r if k.endswith(("_diff", "_reused"))})
    diffs = [f"{k} {max(r[k] for r in rows if r.get(k) is not None):.2e}" for k in kinds]
    graphs = sorted({f"{k[:-7]} {r[k]}" for r in rows for k in r if k.endswith("_graphs")})
    lines += ["", "Speed-ups (x) are over `eager_exact` (today's call). Largest |logits - eager_exact| "
              "(`_reused`: a second step, rows one token longer, same bucket): " + (", ".join(diffs) or "-")
              + ". Graphs per (B, T) after that second step: " + (", ".join(graphs) or "-") + "."]
    if errs:
        lines += ["", "Errors:", *errs]
    return "\n".join(lines)


OUT = harness.Output("gpu_verify_capture", "Verify forward: eager vs CUDA graph vs torch.compile(reduce-overhead)",
                     render, model="smollm2-135m", per_model=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a random 2-layer model (tests)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--tree-tokens", default=",".join(map(str, TREE_TOKENS)))
    ap.add_argument("--variants", default="cuda_graph,compiled", help="captured variants to run")
    ap.add_argument("--cpu-standins", action="store_true",
                    help="without CUDA, run the captured variants' CPU stand-ins (tests)")
    args = OUT.parse(ap)
    if args is None:
        return
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    note = None if args.device == "cuda" else (STANDIN_MSG if args.cpu_standins else SKIP_MSG)
    if note:
        print(note)
    model = load(args)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    results = {"machine": harness.machine_record(), "model": "tiny random" if args.tiny else args.model,
               "dtype": str(args.dtype).removeprefix("torch."), "device_name": name, "context": args.context,
               "reps": args.reps, "note": note, "rows": []}
    for b in map(int, args.batches.split(",")):
        for t in map(int, args.tree_tokens.split(",")):
            results["rows"].append(measure_one(model, b, t, args))
            print(results["rows"][-1], flush=True)
            md = OUT.write(results, args.out)         # after every row: a timeout keeps them
    print(md.read_text())


if __name__ == "__main__":
    main()
