"""How fast speculation *can* be on this machine: measured forward costs and the speed-up bounds
they put on the two ``spec_core`` targets that are missed.

Part Q (Qwen2.5-Coder 1.5B target, 0.5B draft with the shipped 64k draft vocabulary, fp16-packed,
greedy, the first ``--prompts`` coding questions): one real ``draft_model`` generation per prompt
with every ``Transformer.forward`` timed (which model, how many tokens), a vanilla generation of
the same prompt, and the target's forward over T = 1..9 chain tokens at the prompt's context.
From them, per chain length k:

    decode speed-up(k) = tau(k) * V(1) / (D_catch_up + (k - 1) * D(1) + V(k + 1))

with V(T) the target forward over T tokens, D the draft forward (the first of a step also feeds the
bonus token: T = 2) and tau(k) = 1 + the sum of the first k measured acceptance rates (for k above
the run's chain length: the last rate repeated, an optimistic guess). The *perfect-draft* bound
puts tau = k + 1 (every draft token accepted). The end-to-end figure adds both prefills.

Part S (SmolLM2-135M, ``ngram`` as in ``spec_core``, the 2 summarization questions): the same
instrumented vanilla and ngram runs; reports prefill's share, the verify cost per T at the
prompt's context, and the mean acceptance length a 1.3x end-to-end speed-up would need given the
measured step costs.

Part K (kernels, random weights of the real shapes, cycled so nothing stays in cache): the packed
fp16 matmuls of the 1.5B's 28 layers at T = 1, 2, 5, 8 rows, and the 0.5B's matmuls (64k head)
at T = 1, 2 with packed fp16 against torch's weight-only int8 and int4 CPU kernels (would a
quantized draft be cheaper?).

Writes benchmarks/results/spec_bound.{json,md}.

    python benchmarks/spec_bound.py [--part qsk] [--prompts 2] [--max-tokens 128]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch loads: shared cores

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from spec_core import NGRAM, QWEN_DRAFT_VOCAB, chat_ids  # noqa: E402

from verispec import LLM, SamplingParams  # noqa: E402
from verispec.bench import harness  # noqa: E402
from verispec.data import spec_bench_questions  # noqa: E402
from verispec.models.kv_cache import KVCache  # noqa: E402
from verispec.models.loading import load_model  # noqa: E402
from verispec.models.transformer import Transformer  # noqa: E402


class ForwardTimer:
    """Times every ``Transformer.forward`` while active, keyed by (model layers, tokens T)."""

    def __init__(self):
        self.times: dict[tuple[int, int], list[float]] = defaultdict(list)
        self._orig = Transformer.forward

    def __enter__(self):
        orig, times = self._orig, self.times

        def timed(model, tokens, *a, **k):
            t = time.perf_counter()
            out = orig(model, tokens, *a, **k)
            times[(model.cfg.num_layers, tokens.shape[-1])].append(time.perf_counter() - t)
            return out
        Transformer.forward = timed
        return self

    def __exit__(self, *exc):
        Transformer.forward = self._orig

    def total(self, layers: int, pred=lambda t: True) -> float:
        return sum(sum(v) for (n, t), v in self.times.items() if n == layers and pred(t))


def verify_costs(model: Transformer, context: int, max_t: int, repeats: int = 9) -> dict[int, float]:
    """Median seconds of a target forward over T = 1..max_t chain tokens after ``context`` cached ones."""
    cache = KVCache.for_model(model.cfg, 1, context + max_t + 1)
    out = {}
    with torch.no_grad():
        for t in range(1, max_t + 1):
            runs = []
            for _ in range(repeats + 1):
                cache.lengths[0] = context
                tok = torch.randint(0, model.cfg.vocab_size, (1, t))
                pos = torch.arange(context, context + t)[None]
                s = time.perf_counter()
                model(tok, pos, cache)
                runs.append(time.perf_counter() - s)
            out[t] = statistics.median(runs[1:])
    return out


def timed_generate(llm: LLM, ids: list[int], max_tokens: int):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    with ForwardTimer() as ft:
        s = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], sp)[0]
        wall = time.perf_counter() - s
    return out, wall, ft


def part_q(n_prompts: int, max_tokens: int) -> dict:
    target = load_model("qwen2.5-coder-1.5b", weights="fp16")
    cfg = {"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4,
           "draft_vocab": QWEN_DRAFT_VOCAB}
    vanilla = LLM(loaded=target, max_num_seqs=1)
    spec = LLM(loaded=target, max_num_seqs=1, speculative_config=cfg)
    tl = target.config.num_layers
    qs = [q for q in spec_bench_questions() if q["category"] == "coding"][:n_prompts]
    rows = []
    for q in qs:
        ids = chat_ids(target.tokenizer, q["turns"][0])
        for llm in (vanilla, spec):                                   # warm-up
            llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=4))
        v_out, v_wall, v_ft = timed_generate(vanilla, ids, max_tokens)
        s_out, s_wall, s_ft = timed_generate(spec, ids, max_tokens)
        draft_layers = next(n for (n, _t) in s_ft.times if n != tl)
        d = {t: statistics.median(v) for (n, t), v in s_ft.times.items() if n == draft_layers and t < 16}
        v = verify_costs(target.model, len(ids) + max_tokens // 2, 9)
        m = s_out.metrics
        rows.append({"prompt_tokens": len(ids), "tokens": len(s_out.token_ids), "same": s_out.token_ids == v_out.token_ids,
                     "vanilla_s": v_wall, "spec_s": s_wall, "speedup": v_wall / s_wall,
                     "tau": m.mean_acceptance_length, "rates": m.acceptance_rate_per_pos,
                     "target_prefill_s": v_ft.total(tl, lambda t: t >= 16),
                     "draft_prefill_s": s_ft.total(draft_layers, lambda t: t >= 16),
                     "draft_forward_s": {str(t): x for t, x in sorted(d.items())},
                     "verify_s": {str(t): x for t, x in v.items()}})
        print(f"prompt {len(ids)} tokens: {rows[-1]['speedup']:.2f}x tau {m.mean_acceptance_length:.2f} "
              f"V(1) {v[1] * 1e3:.0f} ms V(5) {v[5] * 1e3:.0f} ms D(1) {d.get(1, 0) * 1e3:.0f} ms", flush=True)
    return {"config": cfg, "max_tokens": max_tokens, "rows": rows, "bounds": q_bounds(rows, max_tokens)}


def q_bounds(rows: list[dict], n: int) -> list[dict]:
    """Modelled decode and end-to-end speed-up per chain length k, measured vs perfect draft."""
    def avg(key, t):
        return statistics.mean(r[key][str(t)] for r in rows)
    rates = [statistics.mean(r["rates"][i] for r in rows) for i in range(len(rows[0]["rates"]))]
    v1, d1, d2 = avg("verify_s", 1), avg("draft_forward_s", 1), avg("draft_forward_s", 2)
    pt = statistics.mean(r["target_prefill_s"] for r in rows)
    pd = statistics.mean(r["draft_prefill_s"] for r in rows)
    out = []
    for k in range(1, 9):
        step = d2 + (k - 1) * d1 + avg("verify_s", k + 1)
        tau = 1 + sum(rates[i] if i < len(rates) else rates[-1] for i in range(k))
        row = {"k": k, "step_s": step, "tau_measured_rates": tau}
        for name, t in (("measured", tau), ("perfect", k + 1.0)):
            dec = t * v1 / step
            row[f"decode_{name}"] = dec
            row[f"e2e_{name}"] = (pt + n * v1) / (pt + pd + n * v1 / dec)
        out.append(row)
    return out


def part_s(max_tokens: int) -> dict:
    target = load_model("smollm2-135m", weights="fp16")
    vanilla = LLM(loaded=target, max_num_seqs=1)
    spec = LLM(loaded=target, max_num_seqs=1, speculative_config=NGRAM)
    nl = target.config.num_layers
    qs = [q for q in spec_bench_questions() if q["category"] == "summarization"][:2]
    rows = []
    for q in qs:
        ids = chat_ids(target.tokenizer, q["turns"][0])
        for llm in (vanilla, spec):
            llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=4))
        v_out, v_wall, v_ft = timed_generate(vanilla, ids, max_tokens)
        s_out, s_wall, s_ft = timed_generate(spec, ids, max_tokens)
        v = verify_costs(target.model, len(ids) + max_tokens // 2, 6)
        m = s_out.metrics
        prefill = v_ft.total(nl, lambda t: t >= 16)
        steps = sum(len(x) for (n_, t), x in s_ft.times.items() if n_ == nl and t < 16)
        decode_s = s_ft.total(nl, lambda t: t < 16)
        # tokens per target step that 1.3x end to end needs, at the measured step cost and overhead
        other = s_wall - prefill - decode_s
        need = len(s_out.token_ids) * (decode_s / steps) / (v_wall / 1.3 - prefill - other)
        rows.append({"prompt_tokens": len(ids), "tokens": len(s_out.token_ids), "same": s_out.token_ids == v_out.token_ids,
                     "vanilla_s": v_wall, "spec_s": s_wall, "speedup": v_wall / s_wall, "prefill_s": prefill,
                     "prefill_share_of_vanilla": prefill / v_wall, "target_steps": steps,
                     "tokens_per_step": len(s_out.token_ids) / steps, "mean_step_s": decode_s / steps,
                     "tokens_per_step_for_1.3x": need, "tau": m.mean_acceptance_length,
                     "verify_s": {str(t): x for t, x in v.items()}})
        print(f"summarization {len(ids)} tokens: {rows[-1]['speedup']:.2f}x, {rows[-1]['tokens_per_step']:.2f} "
              f"tokens/step (1.3x needs {need:.2f}), prefill {prefill / v_wall:.0%} of vanilla", flush=True)
    return {"config": NGRAM, "max_tokens": max_tokens, "rows": rows}


QWEN15_MATS = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)] * 28       # (out, in) per layer
QWEN05_MATS = [(1152, 896), (896, 896), (9728, 896), (896, 4864)] * 24 + [(65536, 896)]


def _matmul_ms(mats: list[tuple[int, int]], make, rows: tuple[int, ...], repeats: int = 3) -> dict[str, float]:
    torch.manual_seed(0)
    mods = [(make(torch.randn(n, k) * 0.02), k) for n, k in mats]
    out = {}
    with torch.no_grad():
        for t in rows:
            xs = {k: torch.randn(t, k) for _, k in mats}
            for m, k in mods:
                m(xs[k])
            s = time.perf_counter()
            for _ in range(repeats):
                for m, k in mods:
                    m(xs[k])
            out[str(t)] = (time.perf_counter() - s) / repeats * 1e3
    return out


def part_k() -> dict:
    from weight_kernels import Int4WeightOnly, Int8WeightOnly, fp16_packed   # benchmarks/ (this script's folder)
    res = {"qwen1.5b_fp16": _matmul_ms(QWEN15_MATS, fp16_packed, (1, 2, 5, 8))}
    for name, make in (("fp16", fp16_packed), ("int8", Int8WeightOnly), ("int4", Int4WeightOnly)):
        res[f"qwen0.5b_{name}"] = _matmul_ms(QWEN05_MATS, make, (1, 2))
    print("kernels (ms):", json.dumps({k: {t: round(v, 1) for t, v in d.items()} for k, d in res.items()}), flush=True)
    return res


def render(res: dict) -> str:
    lines = ["The machine line is the last start's. Parts measured at (UTC): "
             + ", ".join(f"{k} {v[:16]}" for k, v in res.get("part_measured_at", {}).items()) + ". "
             "Greedy, batch 1, fp16-packed weights.", ""]
    if "qwen" in res:
        q = res["qwen"]
        lines += ["## Qwen2.5-Coder 1.5B target, 0.5B draft (64k draft vocabulary), coding prompts", "",
                  "| prompt tokens | new tokens | identical | measured speed-up | tau | rates per position |",
                  "|---:|---:|---|---:|---:|---|"]
        for r in q["rows"]:
            lines.append(f"| {r['prompt_tokens']} | {r['tokens']} | {r['same']} | {r['speedup']:.2f}x | "
                         f"{r['tau']:.2f} | {', '.join(f'{x:.2f}' for x in r['rates'])} |")
        r0 = q["rows"]
        ts = sorted(int(t) for t in r0[0]["verify_s"])
        lines += ["", "Target forward over T chain tokens (ms, mean over prompts) and its ratio to T = 1:", "",
                  "| T | " + " | ".join(map(str, ts)) + " |", "|---|" + "---:|" * len(ts)]
        vs = {t: statistics.mean(r["verify_s"][str(t)] for r in r0) for t in ts}
        lines.append("| ms | " + " | ".join(f"{vs[t] * 1e3:.0f}" for t in ts) + " |")
        lines.append("| x T=1 | " + " | ".join(f"{vs[t] / vs[1]:.2f}" for t in ts) + " |")
        d = {t: statistics.mean(r["draft_forward_s"][t] for r in r0) for t in ("1", "2")}
        lines += ["", f"Draft forward: {d['1'] * 1e3:.0f} ms (1 token), {d['2'] * 1e3:.0f} ms (2 tokens) = "
                  f"{d['1'] / vs[1]:.2f} of a target forward. Prefill: target "
                  f"{statistics.mean(r['target_prefill_s'] for r in r0):.2f} s, draft "
                  f"{statistics.mean(r['draft_prefill_s'] for r in r0):.2f} s.", "",
                  "Modelled speed-up per chain length k (decode only / end to end with both prefills, "
                  f"{q['max_tokens']} tokens):", "",
                  "| k | step (ms) | tau from measured rates | decode | end to end | perfect draft: decode | end to end |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for b in q["bounds"]:
            lines.append(f"| {b['k']} | {b['step_s'] * 1e3:.0f} | {b['tau_measured_rates']:.2f} | "
                         f"{b['decode_measured']:.2f}x | {b['e2e_measured']:.2f}x | {b['decode_perfect']:.2f}x | "
                         f"{b['e2e_perfect']:.2f}x |")
        lines.append("")
    if "smollm2" in res:
        s = res["smollm2"]
        lines += ["## SmolLM2-135M, ngram, summarization prompts", "",
                  "| prompt tokens | identical | speed-up | prefill share of vanilla | tokens per target step | "
                  "needed for 1.3x | mean step (ms) | V(5)/V(1) |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
        for r in s["rows"]:
            lines.append(f"| {r['prompt_tokens']} | {r['same']} | {r['speedup']:.2f}x | "
                         f"{r['prefill_share_of_vanilla']:.0%} | {r['tokens_per_step']:.2f} | "
                         f"{r['tokens_per_step_for_1.3x']:.2f} | {r['mean_step_s'] * 1e3:.0f} | "
                         f"{r['verify_s']['5'] / r['verify_s']['1']:.2f} |")
        lines.append("")
    if "kernels" in res:
        lines += ["## Kernels: matmul time over a model's matrices (ms, random weights of the real shapes)", "",
                  "| matrices, kernel | " + " | ".join(f"T={t}" for t in (1, 2, 5, 8)) + " |", "|---|---:|---:|---:|---:|"]
        for name, d in res["kernels"].items():
            lines.append(f"| {name} | " + " | ".join(f"{d[t]:.1f}" if t in d else "" for t in ("1", "2", "5", "8")) + " |")
        lines.append("")
    return "\n".join(lines)


OUT = harness.Output("spec_bound", "Speed-up bounds from measured forward costs", render, analysis=True,
                     legacy_command=lambda res: "python benchmarks/spec_bound.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="qsk", help="q: Qwen pair, s: SmolLM2 ngram summarization, k: kernels")
    ap.add_argument("--prompts", type=int, default=2, help="coding prompts for part q")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = OUT.parse(ap)
    if args is None:
        return
    torch.set_num_threads(os.cpu_count() or 1)
    res = {"machine": harness.machine_record()}
    if os.path.exists(args.out + ".json"):           # parts not rerun now are kept
        with open(args.out + ".json") as f:
            res = dict(json.load(f), machine=res["machine"])
    res.setdefault("part_measured_at", {})
    for key, letter, fn in (("qwen", "q", lambda: part_q(args.prompts, args.max_tokens)),
                            ("smollm2", "s", lambda: part_s(args.max_tokens)), ("kernels", "k", part_k)):
        if letter in args.part:
            res["part_measured_at"][key] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            res[key] = fn()
    OUT.write(res, args.out)


if __name__ == "__main__":
    main()
