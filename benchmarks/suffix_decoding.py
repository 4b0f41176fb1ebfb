"""Suffix decoding vs ngram vs vanilla on SmolLM2-135M (fp16-packed weights), greedy, batch 1.

Two workloads, each a sequence of requests through one ``LLM`` per method (made fresh for the
workload, so suffix decoding's global tree holds only that workload's earlier outputs):

* ``repetitive`` (written for this benchmark, not from Spec-Bench): 15 requests in 5 rounds of
  (an agent's JSON tool call with one fixed tool list, a code edit that rewrites a given function,
  a profile card in one fixed template), 128 new tokens.
* ``spec_bench``: Spec-Bench first turns, 2 per category (26), 64 new tokens.

Methods run interleaved per request on one loaded target; the warm-up runs vanilla and ngram only
(on an unrelated prompt) so no suffix tree sees it. Speedup = tokens/s over vanilla's in the same
workload. ``tau`` = mean acceptance length per drafted step (bonus included, the project's
convention); ``tokens/step`` = output tokens per decode step over all steps (comparable across
methods: suffix decoding drafts only where a suffix matched; the first token comes from the prefill).
Vanilla's output texts are kept in the JSON (``rows[].text``) to show what the workload is.

    python benchmarks/suffix_decoding.py [--workloads repetitive,spec_bench] [--threads 2] [--limit N]
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch loads: shared cores

import torch  # noqa: E402

from verispec import LLM, SamplingParams  # noqa: E402
from verispec.bench import harness  # noqa: E402
from verispec.data import per_category, spec_bench_questions  # noqa: E402
from verispec.models.loading import load_model  # noqa: E402

CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_extra": 1},
    "suffix": {"method": "suffix"},                                   # vLLM's defaults (trees up to 24 nodes)
    "suffix_k8": {"method": "suffix", "num_speculative_tokens": 8},   # cheaper verification on a CPU
}

TOOLS = ("You are a function-calling agent. Tools:\n"
         "- get_weather(city: string, unit: \"celsius\" | \"fahrenheit\")\n"
         "- search_flights(origin: string, destination: string, date: string, passengers: integer)\n"
         "- send_email(to: string, subject: string, body: string)\n"
         "Reply with exactly one JSON object {\"tool\": \"<name>\", \"arguments\": {...}} and nothing else.")
TOOL_ASKS = ["What is the weather in Paris, in celsius?",
             "Find flights from Boston to Denver on 2025-03-14 for 2 passengers.",
             "Email alice@example.com with the subject 'Lunch' and tell her I will be 10 minutes late.",
             "What is the weather in Tokyo, in fahrenheit?",
             "Find flights from Madrid to Rome on 2025-06-02 for 1 passenger."]
FUNCTIONS = [
    "def average(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n        counts[word] = counts.get(word, 0) + 1\n"
    "    return counts",
    "def largest(numbers):\n    best = numbers[0]\n    for n in numbers:\n        if n > best:\n            best = n\n"
    "    return best",
    "def celsius_to_fahrenheit(c):\n    f = c * 9 / 5 + 32\n    return f",
    "def is_palindrome(s):\n    s = s.lower()\n    return s == s[::-1]",
]
EDIT = ("Rewrite this Python function with type hints and a one-line docstring, keeping its logic. "
        "Return the whole function in one code block.\n\n```python\n{}\n```")
CITIES = ["Lisbon", "Oslo", "Cairo", "Lima", "Seoul"]
CARD = ("Fill in this profile card for {}. Use exactly this format:\nCity: <name>\nCountry: <country>\n"
        "Population: <approximate population>\nLanguage: <main language>\nKnown for: <one sentence>\n"
        "Best time to visit: <months>")


def chat_ids(tok, user: str, system: str | None = None) -> list[int]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False).input_ids


def repetitive_prompts(tok) -> list[tuple[str, list[int]]]:
    """5 rounds of (tool call, code edit, profile card): each kind repeats across rounds."""
    out = []
    for ask, fn, city in zip(TOOL_ASKS, FUNCTIONS, CITIES):
        out += [("tool_call", chat_ids(tok, ask, TOOLS)), ("code_edit", chat_ids(tok, EDIT.format(fn))),
                ("template", chat_ids(tok, CARD.format(city)))]
    return out


def spec_bench_prompts(tok) -> list[tuple[str, list[int]]]:
    return [(q["category"], chat_ids(tok, q["turns"][0])) for q in per_category(spec_bench_questions(), 2)]


def run(target, prompts: list[tuple[str, list[int]]], max_tokens: int, methods: list[str]) -> dict:
    """One fresh LLM per method; requests in order, methods interleaved per request."""
    llms = {"vanilla": LLM(loaded=target, max_num_seqs=1)}
    llms.update({m: LLM(loaded=target, max_num_seqs=1, speculative_config=CONFIGS[m]) for m in methods})
    warm = [{"prompt_token_ids": chat_ids(target.tokenizer, "Say hello.")}]
    for name in ("vanilla", "ngram"):
        if name in llms:
            llms[name].generate(warm, SamplingParams(temperature=0, max_tokens=8))
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    rows = []
    for g in harness.generate_interleaved(llms, prompts, sp):
        out, m = g.output, g.output.metrics
        rows.append({"request": g.index, "method": g.method, "category": g.category, "prompt_tokens": len(g.prompt_ids),
                     "tokens": len(out.token_ids), "seconds": g.seconds, "steps": m.num_steps, "drafts": m.num_drafts,
                     "draft_tokens": m.num_draft_tokens, "accepted": m.num_accepted_tokens,
                     "draft_s": m.draft_time_s, "same_as_vanilla": g.same_as_first,
                     **({"text": out.text} if g.method == "vanilla" else {})})
        print(f"{g.index:2d} {g.category:15s} {g.method:10s} {len(out.token_ids) / g.seconds:6.2f} tok/s  tau "
              f"{m.mean_acceptance_length:.2f}  tokens/step {len(out.token_ids) / max(1, m.num_steps):.2f}",
              flush=True)
    return summarize(rows, list(llms))


def _agg(sel: list[dict]) -> dict:
    tok, sec = sum(r["tokens"] for r in sel), sum(r["seconds"] for r in sel) or float("nan")
    drafts, acc, steps = sum(r["drafts"] for r in sel), sum(r["accepted"] for r in sel), sum(r["steps"] for r in sel)
    return {"tokens_per_s": tok / sec, "tau": 1 + acc / drafts if drafts else 1.0,
            "tokens_per_step": tok / steps if steps else 0.0,
            "draft_tokens_per_draft": sum(r["draft_tokens"] for r in sel) / drafts if drafts else 0.0,
            "drafted_steps": drafts / steps if steps else 0.0, "draft_ms_per_step":
            1e3 * sum(r["draft_s"] for r in sel) / steps if steps else 0.0,
            "identical_to_vanilla": all(r["same_as_vanilla"] for r in sel), "seconds": sec, "tokens": tok}


def summarize(rows: list[dict], names: list[str]) -> dict:
    cats = list(dict.fromkeys(r["category"] for r in rows))
    out: dict = {"rows": rows, "overall": {}, "per_category": {}, "first_vs_later": {}}
    for n in names:
        mine = [r for r in rows if r["method"] == n]
        out["overall"][n] = _agg(mine)
        out["per_category"][n] = {c: _agg([r for r in mine if r["category"] == c]) for c in cats}
        first = {c: min(r["request"] for r in mine if r["category"] == c) for c in cats}
        out["first_vs_later"][n] = {"first": _agg([r for r in mine if r["request"] == first[r["category"]]]),
                                    "later": _agg([r for r in mine if r["request"] != first[r["category"]]])}
    base = out["overall"]["vanilla"]["tokens_per_s"]
    for n in names:
        out["overall"][n]["speedup"] = out["overall"][n]["tokens_per_s"] / base
        for c in cats:
            out["per_category"][n][c]["speedup"] = (out["per_category"][n][c]["tokens_per_s"]
                                                    / out["per_category"]["vanilla"][c]["tokens_per_s"])
        for k in ("first", "later"):
            out["first_vs_later"][n][k]["speedup"] = (out["first_vs_later"][n][k]["tokens_per_s"]
                                                      / out["first_vs_later"]["vanilla"][k]["tokens_per_s"])
    return out


WORKLOADS = {"repetitive": (repetitive_prompts, 128), "spec_bench": (spec_bench_prompts, 64)}


def render(res: dict) -> str:
    lines = [f"Load average {res.get('load_avg_at_end', float('nan')):.1f} at the end (a shared machine; not niced). "
             f"{res['model']}, {res['weights']} weights, {res['total_minutes']:.1f} min in all.", "",
             "tau = mean acceptance length per drafted step (bonus included); tokens/step = output tokens per "
             "decode step, all steps (the first token comes from the prefill); nodes/draft = mean tree size of drafted steps; drafted = share of "
             "steps with a draft; draft ms = drafter time per step.", "",
             "Configs: " + ", ".join(f"{k} `{json.dumps(v)}`" for k, v in res["configs"].items()), ""]
    for w, part in res["workloads"].items():
        cats = list(next(iter(part["per_category"].values())))
        lines += [f"## {w} ({len(part['rows']) // len(part['overall'])} requests, {part['max_tokens']} new tokens)", "",
                  "| method | tok/s | speedup | tau | tokens/step | nodes/draft | drafted | draft ms | identical | "
                  + " | ".join(cats) + " |", "|---|---:|---:|---:|---:|---:|---:|---:|---|" + "---:|" * len(cats)]
        for n, o in part["overall"].items():
            per = " | ".join(f"{part['per_category'][n][c]['speedup']:.2f}x" for c in cats)
            lines.append(f"| {n} | {o['tokens_per_s']:.2f} | {o['speedup']:.2f}x | {o['tau']:.2f} | "
                         f"{o['tokens_per_step']:.2f} | {o['draft_tokens_per_draft']:.1f} | {o['drafted_steps']:.0%} | "
                         f"{o['draft_ms_per_step']:.2f} | {o['identical_to_vanilla']} | {per} |")
        lines += ["", "First request of each category vs the later ones (what the global tree learnt):", "",
                  "| method | first: speedup | first: tau | first: tokens/step | later: speedup | later: tau | "
                  "later: tokens/step |", "|---|---:|---:|---:|---:|---:|---:|"]
        for n, fl in part["first_vs_later"].items():
            f, la = fl["first"], fl["later"]
            lines.append(f"| {n} | {f['speedup']:.2f}x | {f['tau']:.2f} | {f['tokens_per_step']:.2f} | "
                         f"{la['speedup']:.2f}x | {la['tau']:.2f} | {la['tokens_per_step']:.2f} |")
        lines.append("")
    return "\n".join(lines)


OUT = harness.Output("suffix_decoding", "Suffix decoding vs ngram vs vanilla (greedy, batch 1)", render,
                     analysis=True, legacy_command=lambda res: "python benchmarks/suffix_decoding.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="repetitive,spec_bench")
    ap.add_argument("--methods", default="ngram,suffix,suffix_k8")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--limit", type=int, help="first N requests of each workload (a smoke run, not committed)")
    args = OUT.parse(ap)
    if args is None:
        return
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    res = {"machine": harness.machine_record(), "model": "smollm2-135m", "weights": "fp16", "configs": CONFIGS,
           "workloads": {}}
    target = load_model("smollm2-135m", weights="fp16")
    for w in args.workloads.split(","):
        make, max_tokens = WORKLOADS[w]
        res["workloads"][w] = {"max_tokens": max_tokens,
                               **run(target, make(target.tokenizer)[:args.limit], max_tokens, args.methods.split(","))}
        res["load_avg_at_end"] = os.getloadavg()[0]
        res["total_minutes"] = (time.perf_counter() - t0) / 60
        OUT.write(res, args.out)                   # after every workload: an interrupted run keeps what it did


if __name__ == "__main__":
    main()
