"""verispec vanilla greedy vs HF transformers ``generate`` greedy: tokens/s, fp32 and bf16.

Same model (SmolLM2-135M from its GGUF), same dtype, same prompts (2 Spec-Bench prompts per
category, chat template), 128 new tokens, batch 1, interleaved per prompt so drift cancels.
Also reports the fraction of the memory-bandwidth floor reached: bytes of weights read per token
divided by the measured copy bandwidth, over the measured time per token.

    python benchmarks/vanilla.py [--per-category 2] [--max-tokens 128] [--dtypes float32,bfloat16]
"""
from __future__ import annotations

import argparse
import time

import torch

from verispec import LLM, SamplingParams
from verispec.bench import harness
from verispec.data import per_category, spec_bench_questions
from verispec.models.loading import load_model


def copy_bandwidth_gbs() -> float:
    """Read+write bytes per second of a large tensor copy (best of 5)."""
    a = torch.empty(64 << 20, dtype=torch.float32).fill_(1.0)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * 4 / best / 1e9


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def run_dtype(dtype: str, prompts: list[list[int]], max_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM
    target = load_model("smollm2-135m", dtype=dtype)
    llm = LLM(loaded=target, max_num_seqs=1)
    hf = AutoModelForCausalLM.from_pretrained(str(target.path.parent), gguf_file=target.path.name,
                                              dtype=getattr(torch, dtype)).eval()
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rows = []
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=8))   # warm-up
    for ids in prompts:
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], sp)[0]
        ours = time.perf_counter() - t
        x = torch.tensor([ids])
        t = time.perf_counter()
        with torch.no_grad():
            ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                              do_sample=False)
        theirs = time.perf_counter() - t
        n_hf = ref.shape[1] - len(ids)
        rows.append({"prompt_tokens": len(ids), "verispec_tokens": len(out.token_ids), "verispec_s": ours,
                     "hf_tokens": n_hf, "hf_s": theirs,
                     "same_tokens": out.token_ids == ref[0, len(ids):].tolist()})
    v_tps = sum(r["verispec_tokens"] for r in rows) / sum(r["verispec_s"] for r in rows)
    h_tps = sum(r["hf_tokens"] for r in rows) / sum(r["hf_s"] for r in rows)
    wb = weight_bytes(target.model)
    return {"dtype": dtype, "verispec_tokens_per_s": v_tps, "hf_tokens_per_s": h_tps, "speedup_vs_hf": v_tps / h_tps,
            "weight_bytes": wb, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = OUT.parse(ap)
    if args is None:
        return
    qs = per_category(spec_bench_questions(), args.per_category)
    tok = load_model("smollm2-135m").tokenizer
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False).input_ids for q in qs]
    bw = copy_bandwidth_gbs()
    results = {"machine": harness.machine_record(), "copy_bandwidth_GBps": bw, "max_tokens": args.max_tokens,
               "per_category": args.per_category,
               "num_prompts": len(prompts), "dtypes": []}
    for dtype in args.dtypes.split(","):
        r = run_dtype(dtype, prompts, args.max_tokens)
        floor_s = r["weight_bytes"] / (bw * 1e9 / 2)          # weights read once per token at read bandwidth
        r["bandwidth_floor_tokens_per_s"] = 1 / floor_s
        r["fraction_of_bandwidth_floor"] = r["verispec_tokens_per_s"] * floor_s
        results["dtypes"].append(r)
        print(f"{dtype}: verispec {r['verispec_tokens_per_s']:.2f} tok/s, HF {r['hf_tokens_per_s']:.2f} tok/s, "
              f"x{r['speedup_vs_hf']:.2f}; {100 * r['fraction_of_bandwidth_floor']:.0f}% of the bandwidth floor")
        OUT.write(results, args.out)       # after each dtype: a stopped run keeps what it measured


def render(results: dict) -> str:
    lines = [f"Copy bandwidth {results['copy_bandwidth_GBps']:.1f} GB/s (read+write). "
             f"{results['num_prompts']} Spec-Bench prompts ({results.get('per_category', '?')} per category), "
             f"{results['max_tokens']} new tokens, "
             "interleaved per prompt.", "",
             "| dtype | verispec tok/s | HF tok/s | speedup | bandwidth floor tok/s | fraction of floor |",
             "|---|---|---|---|---|---|"]
    for r in results["dtypes"]:
        lines.append(f"| {r['dtype']} | {r['verispec_tokens_per_s']:.2f} | {r['hf_tokens_per_s']:.2f} | "
                     f"{r['speedup_vs_hf']:.2f}x | {r['bandwidth_floor_tokens_per_s']:.1f} | "
                     f"{100 * r['fraction_of_bandwidth_floor']:.0f}% |")
    if results.get("notes"):                    # hand-written, added to the JSON after the run
        lines += ["", results["notes"]]
    return "\n".join(lines)


OUT = harness.Output("vanilla", "verispec vanilla vs HF generate (greedy, batch 1)", render)


if __name__ == "__main__":
    main()
