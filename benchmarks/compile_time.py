"""What a compiled start costs: graphs and seconds of ``torch.compile``, on a fresh machine and after.

Each method runs twice, each time in a fresh process of this script: first with an empty inductor
cache folder (``TORCHINDUCTOR_CACHE_DIR``: what a new machine or a new user meets), then again
with the cache the first run left (the next process on the same machine). A run builds
``LLM(model, compile=True, speculative_config=...)`` and answers one chat prompt, greedy. Reported
per run: the compiled forward's graphs and compile seconds (``CompiledForward.compile_s``), the
seconds to build the LLM (load, and for a head its measured draft costs, whose chain programs
compile there) and to the first answer, and the process's wall time from start to that answer.

    python benchmarks/compile_time.py [--model smollm2-135m] [--methods vanilla,eagle3]
Writes benchmarks/results/compile_time.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

from verispec.bench import harness

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def measure_run(args: argparse.Namespace, method: str) -> dict:
    """One run of ``method`` in this process (a child of ``measure``)."""
    t0 = time.perf_counter()
    import torch

    from verispec import LLM, SamplingParams
    torch.set_num_threads(args.num_threads)
    spec = None if method == "vanilla" else {"method": method}
    t1 = time.perf_counter()
    llm = LLM(model=args.model, weights=args.weights, compile=True, max_num_seqs=1, speculative_config=spec)
    t2 = time.perf_counter()
    out = llm.chat([[{"role": "user", "content": PROMPT}]], SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    t3 = time.perf_counter()
    return {"graphs": llm.compiled.graphs, "compile_s": round(llm.compiled.compile_s, 1),
            "build_s": round(t2 - t1, 1), "first_answer_s": round(t3 - t2, 1),
            "import_s": round(t1 - t0, 1), "tokens": len(out[0].token_ids), "token_ids": out[0].token_ids}


def _child(method: str, cache: str) -> dict:
    start = time.perf_counter()
    run = harness.in_fresh_process(__file__, method, {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
    run["process_s"] = round(time.perf_counter() - start, 1)
    return run


def measure(args: argparse.Namespace) -> dict:
    """Per method, a cold run on an empty cache folder, then a warm run on what it left."""
    out = {"settings": harness.settings(args), "methods": {}}
    for method in args.methods.split(","):
        with tempfile.TemporaryDirectory(prefix="verispec-inductor-") as cache:
            cold, warm = _child(method, cache), _child(method, cache)
        same = cold.pop("token_ids") == warm.pop("token_ids")
        out["methods"][method] = {"cold": cold, "warm": warm, "same_answer": same}
    return out


def markdown(r: dict) -> str:
    s = r["settings"]
    lines = [f"`{s['model']}`, {s['weights']} weights, `compile=True`, one chat prompt, {s['max_tokens']} tokens, "
             f"greedy, {s['num_threads']} threads. Each run is a fresh process: *cold* on an empty inductor cache "
             "folder, *warm* on the folder the cold run left.", "",
             "| method | run | graphs | compile s | build LLM s | first answer s | process s |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, m in r["methods"].items():
        for kind in ("cold", "warm"):
            k = m[kind]
            lines.append(f"| {name} | {kind} | {k['graphs']} | {k['compile_s']} | {k['build_s']} "
                         f"| {k['first_answer_s']} | {k['process_s']} |")
    same = all(m["same_answer"] for m in r["methods"].values())
    lines += ["", f"Cold and warm answers identical: {same}. *compile s* is the compiled forward's own "
              "(the target's graphs); a head's chain programs compile while the LLM is built (*build LLM s*)."]
    return "\n".join(lines)


OUTPUT = harness.Output("compile_time", "Compiled start: graphs and seconds, cold and warm", markdown,
                        model="smollm2-135m", per_model=False)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="vanilla,eagle3", help="comma-separated: vanilla or a speculative method")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--weights", default="auto")
    p.add_argument("--num-threads", type=int, default=2)
    return p


def main(argv: list[str] | None = None) -> int:
    return harness.main_with_children(OUTPUT, parser(), measure, measure_run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
