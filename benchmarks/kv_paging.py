"""Paged KV cache against static rows in ``verispec serve``: memory, speed, and a repeated prefix.

Four servers of the same model and flags, differing in the KV cache alone:
- ``paged``: the default (blocks of 16 slots in one pool, the prefix cache on and sharing blocks,
  exact reuse: whole 512-token chunks of prefilled prompts);
- ``paged-1GiB``: ``--kv-cache-mb 1024`` (a pool of that size, committed at start);
- ``paged-any``: ``--prefix-cache-reuse any`` (every cached block, chat answers too);
- ``static``: ``--no-paged-kv --prefix-cache-mb 0`` (one row of max-model-len slots per sequence,
  no prefix cache: the server's previous default).

All run side by side (an idle server uses no CPU) and every phase is measured on one, then the
other, so drift on a shared machine hits both alike:
1. Repeated prefix: a chat prompt of about 1.6k tokens (a long system prompt and a question) sent
   twice, then the same system prompt with another question. TTFT of each, client side.
2. Load: ``U`` users (``--levels``) stream Spec-Bench first turns back to back (``serve_load``'s
   closed loop): tokens/s, TTFT and ITL, the KV blocks in use (``/metrics``, sampled every 0.2 s).
Then each process's peak RSS. Greedy: every text must be the same on both servers.

    python benchmarks/kv_paging.py [--levels 1,8,32] [--max-model-len 2048]
Writes benchmarks/results/kv_paging.{json,md}.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time

import httpx

from verispec.bench import harness
from verispec.models.paged_kv import BLOCK_SIZE
from serve_load import Server, run_level, one_request  # noqa: E402

from prefix_cache import SYSTEM  # noqa: E402

CONFIGS = {"paged": [], "paged-1GiB": ["--kv-cache-mb", "1024"], "paged-any": ["--prefix-cache-reuse", "any"],
           "static": ["--no-paged-kv", "--prefix-cache-mb", "0"]}
CATALOGUE = "\n".join(f"- Item {i}: the Northwind {w} model {i}, {10 + i % 7} colours, "
                      f"{100 + 13 * i} g, {20 + (7 * i) % 90} euros." for i, w in
                      zip(range(28), ["tent", "pack", "boot", "stove", "lamp", "rope"] * 5))
QUESTIONS = ["Which tent is the lightest, and what does it cost?",
             "I need a stove for two people. What do you recommend?"]


def long_prompt(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM + "\n\nCatalogue:\n" + CATALOGUE},
            {"role": "user", "content": question}]


async def chat_once(url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"status {r.status_code}: {(await r.aread()).decode()[:300]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                text += [c["delta"].get("content") or "" for c in chunk.get("choices", [])]
    return {"ttft_s": round(ttft, 3), "prompt_tokens": usage["prompt_tokens"], "text": "".join(text)}


def repeated_prefix(server: Server, max_tokens: int) -> list[dict]:
    asks = [QUESTIONS[0], QUESTIONS[0], QUESTIONS[1]]
    return [asyncio.run(chat_once(server.url, long_prompt(q), max_tokens)) for q in asks]


class BlockSampler:
    """The most KV blocks in use while a level runs (``verispec:kv_cache_blocks_used``)."""

    def __init__(self, server: Server):
        self.server, self.peak, self._stop = server, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.server.metrics().get("verispec:kv_cache_blocks_used", 0.0))
            except httpx.HTTPError:
                pass
            self._stop.wait(0.2)

    def __enter__(self) -> "BlockSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run(args: argparse.Namespace, questions: list[dict]) -> dict:
    servers = {name: Server(args, extra) for name, extra in CONFIGS.items()}
    out = {name: {"server_args": extra, "levels": {}, "texts": {}} for name, extra in CONFIGS.items()}
    try:
        for name, server in servers.items():
            server.wait_ready()
            out[name]["rss_ready_mb"] = server.peak_rss_mb()
            m = server.metrics()
            out[name]["kv_blocks_total"] = int(m.get("verispec:kv_cache_blocks_total", 0))
        for name, server in servers.items():
            out[name]["repeated_prefix"] = repeated_prefix(server, args.prefix_max_tokens)
            print(name, [(r["prompt_tokens"], r["ttft_s"]) for r in out[name]["repeated_prefix"]], flush=True)
        for users in args.levels:
            for name, server in servers.items():
                before = server.metrics().get("verispec:compiled_graphs", 0)
                with BlockSampler(server) as sampler:
                    summary, texts = asyncio.run(run_level(server.url, users, questions, args))
                summary["kv_blocks_peak"] = int(sampler.peak)
                summary["graphs_compiled"] = int(server.metrics().get("verispec:compiled_graphs", 0) - before)
                summary["load_average_after"] = round(os.getloadavg()[0], 2)
                out[name]["levels"][str(users)] = summary
                out[name]["texts"][str(users)] = {str(k): v for k, v in texts.items()}
                print(f"{name:>7} {users:>3} users: {summary['tokens_per_s']:7.2f} tok/s, ttft p50 "
                      f"{summary['ttft_s']['p50']}, blocks {summary['kv_blocks_peak']}", flush=True)
    finally:
        for name, server in servers.items():
            out[name]["peak_rss_mb"] = server.peak_rss_mb()
            server.stop()
    return out


def differing(a: dict, b: dict) -> list[str]:
    """Answers of server ``a`` that differ from ``b``'s: "prefix i" and "<users>:<question id>"."""
    out = [f"prefix {i}" for i, (x, y) in enumerate(zip(a["repeated_prefix"], b["repeated_prefix"]))
           if x["text"] != y["text"]]
    return out + [f"{lv}:{q}" for lv in a["texts"] for q, t in a["texts"][lv].items() if b["texts"][lv].get(q) != t]


def load_dependent(server: dict) -> list[str]:
    """Questions whose answer at a higher load differs from the same server's answer to one user."""
    t = server["texts"]
    return [f"{lv}:{q}" for q in t["1"] for lv in t if lv != "1" and q in t[lv] and t[lv][q] != t["1"][q]]


def markdown(report: dict) -> str:
    s, cfg = report["settings"], report["configs"]
    names = list(cfg)
    row = lambda label, f: f"| {label} | " + " | ".join(str(f(cfg[n])) for n in names) + " |"   # noqa: E731
    lines = [f"SmolLM2-135M, `--weights {s['weights']}`, compiled, {s['num_threads']} threads, "
             f"`--max-num-seqs {max(s['levels'])} --max-model-len {s['max_model_len']}`, greedy chat, "
             f"{s['max_tokens']} tokens per answer, Spec-Bench first turns (users cycle through "
             f"{report['num_questions']} questions, so later requests repeat earlier prompts). `paged`: the "
             f"server's default ({BLOCK_SIZE}-slot blocks, {cfg['paged']['kv_blocks_total']} in the pool, prefix cache on with "
             "exact reuse, memory committed as blocks are used); `paged-1GiB`: `--kv-cache-mb 1024` (committed at "
             "start); `paged-any`: `--prefix-cache-reuse any`; `static`: `--no-paged-kv --prefix-cache-mb 0` "
             "(the old default). The servers run side by side, each phase measured on one after the other. "
             f"Total {report['total_s']} s.\n",
             (f"Answers: both exact paged servers' equal the static rows' on all {report['answers']}. "
              if not report["default_differs"] else
              f"Answers: exact paged servers' differ from static rows' on {', '.join(sorted(set(report['default_differs'])))}"
              " (on questions where static rows' own answer changed with the load, below: not a paging effect"
              " unless that list is empty). ") +
             f"With any reuse {len(report['any_reuse_differs'])} differ "
             f"({', '.join(report['any_reuse_differs']) or 'none'}): a hit's rest is prefilled from the hit on, "
             "so its sums run in another order than a cold prefill's, and a near-tie token can flip (as with "
             "vLLM's prefix caching). Users cycle through the questions, so with any reuse later requests "
             "find their whole prompt cached: its speed at 8 and 32 users counts those hits. The row \"answers that "
             "change with the load\" lists questions a server answered differently at 8 or 32 users than to one "
             "user: static rows run a batch with holes that ghost rows cannot cover through the eager forward, "
             "which rounds unlike the compiled graph; the paged cache's graph takes any rows.\n",
             "| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names),
             row("answers that change with the load", lambda c: ", ".join(load_dependent(c)) or "none"),
             row("peak RSS, MiB", lambda c: c["peak_rss_mb"]),
             row("RSS after warm-up, MiB", lambda c: c["rss_ready_mb"])]
    asks = ["first", "again", "same system prompt, new question"]
    for i, ask in enumerate(asks):
        n = cfg["paged"]["repeated_prefix"][i]["prompt_tokens"]
        lines.append(row(f"TTFT, {n}-token prompt, {ask}, s", lambda c: c["repeated_prefix"][i]["ttft_s"]))
    for lv in cfg["paged"]["levels"]:
        lines += [row(f"{lv} users: tokens/s", lambda c: c["levels"][lv]["tokens_per_s"]),
                  row(f"{lv} users: TTFT p50 / p95, s",
                      lambda c: f"{c['levels'][lv]['ttft_s']['p50']} / {c['levels'][lv]['ttft_s']['p95']}"),
                  row(f"{lv} users: ITL p50 / p95, ms",
                      lambda c: f"{c['levels'][lv]['itl_ms']['p50']} / {c['levels'][lv]['itl_ms']['p95']}"),
                  row(f"{lv} users: KV blocks in use, peak", lambda c: c["levels"][lv]["kv_blocks_peak"] or "-"),
                  row(f"{lv} users: graphs compiled under load", lambda c: c["levels"][lv]["graphs_compiled"])]
    return "\n".join(lines) + "\n"


OUTPUT = harness.Output("kv_paging", "paged KV cache vs static rows in the server", markdown,
                        model="smollm2-135m", per_model=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--levels", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prefix-max-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--requests-per-level", type=int, default=32)
    p.add_argument("--level-budget-s", type=float, default=30.0)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--weights", default="auto")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--questions-per-category", type=int, default=4)
    args = OUTPUT.parse(p, argv)
    if args is None:
        return 0
    from verispec.data import per_category, spec_bench_questions
    questions = [q for q in per_category(spec_bench_questions(), args.questions_per_category)
                 if len(q["turns"][0]) <= 3 * (args.max_model_len - args.max_tokens - 64)]
    report = {"machine": harness.machine_record(), "settings": harness.settings(args),
              "num_questions": len(questions)}
    t0 = time.perf_counter()
    report["configs"] = run(args, questions)
    report["total_s"] = round(time.perf_counter() - t0, 1)
    cfg = report["configs"]
    report["default_differs"] = differing(cfg["paged"], cfg["static"]) + differing(cfg["paged-1GiB"], cfg["static"])
    report["any_reuse_differs"] = differing(cfg["paged-any"], cfg["static"])
    report["answers"] = sum(len(t) for t in cfg["static"]["texts"].values()) + len(cfg["static"]["repeated_prefix"])
    print(OUTPUT.write(report, args.out).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
