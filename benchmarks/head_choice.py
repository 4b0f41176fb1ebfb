"""Which EAGLE-3 head shape to train and ship: draft cost against held-out acceptance, per candidate.

Each candidate is a training run folder of the same target and data (``verispec train eagle3
--draft-vocab-size V --intermediate-size I``), evaluated after the same number of steps. For each:
- its size (parameters, bf16 MiB of the head checkpoint);
- its draft costs on the deployed fast path: the head packed beside the target's weights
  (``--weights``), 2 threads, batch 1, timed by ``drafting.eagle.draft_costs`` after a target
  forward, as the shape chooser times them: the one-node chain (fixed) and each further node of
  a chain, through the chain program compiled when ``--compile``;
- the held-out acceptance acc@0..2 that its run logged at ``--step`` (the trainer's eval:
  teacher-forced, top-1 within the draft vocabulary, every held-out token);
- the modelled tokens per step of a 3-node chain and the modelled speed-up over a plain step:
  ``(1 + a0 + a0 a1 + a0 a1 a2) x T_plain / (draft(3) + T_verify(4))``, with a_d = acc@d and
  the measured target forwards.

    python benchmarks/head_choice.py --model qwen2.5-coder-1.5b --weights int4-a8 \\
        --runs runs/qwen/e3-16k runs/qwen/e3-8k --step 60

Writes ``benchmarks/results/head_choice_<model>.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from verispec.bench import harness


def logged_eval(run: Path, step: int) -> dict:
    """The held-out eval the run logged at ``step`` (the end of a sitting, or ``--eval-every``)."""
    for line in (run / "log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("step") == step and "eval" in rec:
            return rec["eval"]
    raise SystemExit(f"{run}/log.jsonl has no held-out eval at step {step}")


def head_folder(run: Path) -> Path:
    for name in ("checkpoint", "checkpoint-last"):
        if (run / name / "config.json").exists():
            return run / name
    raise SystemExit(f"{run} has no checkpoint (checkpoint/ or checkpoint-last/)")


def measure(args: argparse.Namespace) -> dict:
    from verispec.drafting.draft_shape import measure_verify, target_step
    from verispec.drafting.eagle import draft_costs
    from verispec.drafting.eagle_head import HeadKind
    from verispec.formats import load_eagle_head
    from verispec.models.compiled import CompiledForward
    from verispec.models.draft_packing import draft_packing
    from verispec.models.loading import load_model
    torch.set_num_threads(args.threads)
    machine = harness.machine_record()
    target = load_model(args.model, dtype="float32", weights=args.weights)
    forward = CompiledForward.shared(target.model) if args.compile else None
    verify = dict(measure_verify(target.model, points=(1, 4), forward=forward))
    rows = []
    for run in map(Path, args.runs):
        folder = head_folder(run)
        head = load_eagle_head(folder, target.model, HeadKind.EAGLE3)
        params = sum(p.numel() for n, p in head.named_parameters() if not n.startswith("embed"))
        packing = draft_packing(target, head)
        if packing is not None:
            head.pack_(packing, target.model.lm_head)
        fixed, levels, chain = draft_costs(head, between=target_step(target.model, forward), compile=args.compile)
        ev = logged_eval(run, args.step)
        acc = [ev.get(f"acc{d}", 0.0) for d in range(3)]
        tokens = 1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2]
        step_ms = chain[0] + 2 * chain[1] + verify[4]
        cfg = json.loads((folder / "config.json").read_text())
        rows.append({"run": str(run), "draft_vocab": cfg.get("draft_vocab_size"),
                     "intermediate_size": cfg.get("intermediate_size"), "parameters_m": round(params / 1e6, 1),
                     "bf16_mib": round(params * 2 / 2 ** 20, 1), "draft_fixed_ms": round(chain[0], 3),
                     "draft_level_ms": round(chain[1], 3), "tree_fixed_ms": round(fixed, 3),
                     "acc": [round(a, 4) for a in acc], "eval_loss": ev.get("loss"),
                     "modelled_tokens_per_step": round(tokens, 3),
                     "modelled_speedup": round(tokens * verify[1] / step_ms, 3)})
        print(rows[-1], flush=True)
    return {"machine": machine, "settings": harness.settings(args),
            "verify_ms": {str(k): round(v, 3) for k, v in verify.items()}, "heads": rows}


def render(res: dict) -> str:
    s = res["settings"]
    v = res["verify_ms"]
    lines = [f"Target `{s['model']}`, weights `{s['weights']}`, compiled {s['compile']}, {s['threads']} threads, "
             f"batch 1: a plain step {v['1']} ms, a verify over 4 tokens {v['4']} ms. Acceptance: each run's "
             f"held-out eval after {s['step']} steps (same data, batch, lr and seed).", "",
             "| run | draft vocab | MLP width | params (M) | bf16 MiB | chain fixed ms | each further node ms "
             "| acc@0 | acc@1 | acc@2 | modelled tokens/step (chain of 3) | modelled speed-up |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["heads"]:
        a = r["acc"]
        lines.append(f"| {r['run']} | {r['draft_vocab']} | {r['intermediate_size']} | {r['parameters_m']} "
                     f"| {r['bf16_mib']} | {r['draft_fixed_ms']} | {r['draft_level_ms']} | {a[0]} | {a[1]} | {a[2]} "
                     f"| {r['modelled_tokens_per_step']} | {r['modelled_speedup']}x |")
    return "\n".join(lines) + "\n"


OUT = harness.Output("head_choice", "EAGLE-3 head shape: draft cost against held-out acceptance", render,
                     model="qwen2.5-coder-1.5b")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", nargs="+", required=True, help="training run folders to compare")
    ap.add_argument("--step", type=int, required=True, help="the step whose held-out eval is compared")
    ap.add_argument("--weights", default="int4-a8")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--threads", type=int, default=2)
    OUT.main(ap, measure)


if __name__ == "__main__":
    main()
