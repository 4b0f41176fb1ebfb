"""Chunked prefill under load: the inter-token latency of running streams while 4k-token prompts arrive.

One ``verispec serve`` process per configuration (``--prefill-chunk 0``: every prompt prefilled
whole at admission; ``--prefill-chunk N``: N prompt tokens per round between decoding steps), all
with the server's defaults otherwise (auto weights, compiled forwards, 2 threads). In each window
``--streams`` users stream greedy completions back to back while a long prompt of about
``--long-tokens`` tokens (a new one each time, so nothing is served from a cache) arrives every
``--long-every`` seconds, asking for one token. The configurations take turns, window by window,
so a busy shared machine hits them alike.

Measured per configuration, over all windows: the gaps between consecutive token-carrying chunks
of a stream (ITL p50/p95/p99/max, client side; a request's wait for its first token is not a gap),
the streams' tokens per second, the long prompts' time to first token, and from each server's
/metrics the seconds it spent compiling and the forwards it ran eagerly during the windows. Writes ``benchmarks/results/chunked_prefill.json`` and ``.md``.

    python benchmarks/chunked_prefill.py                  # chunks 0 (off), 512, 256 and 128
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from serve_load import Server, _pct  # noqa: E402
from verispec.bench import harness  # noqa: E402

STREAM_PROMPTS = ["Write a long story about a lighthouse keeper and a storm.",
                  "Explain in detail how a compiler turns source code into machine code.",
                  "Describe the history of the bicycle, decade by decade.",
                  "Give a step-by-step guide to planting a vegetable garden."]
FILLER = ("The committee reviewed the quarterly report, which covered shipping delays, supplier "
          "contracts, warehouse staffing, energy costs and the plan for the new distribution centre. ")


STALL_S = 0.25      # a gap this long is a stall


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    return {f"p{p}": None if not values else round(_pct(values, p) * scale, 1) for p in (50, 95, 99)} | \
        {"max": round(max(values) * scale, 1) if values else None, "n": len(values)}


def stalled_share(gaps: list[float]) -> float | None:
    """The share of the streams' waiting time spent in gaps of ``STALL_S`` or more."""
    total = sum(gaps)
    return round(sum(g for g in gaps if g >= STALL_S) / total, 3) if total else None


def long_prompt(url: str, i: int, tokens: int) -> str:
    """A new prompt of about ``tokens`` tokens (counted by the server's /tokenize)."""
    base = f"Document {i}. " + FILLER * 8
    n = len(httpx.post(url + "/tokenize", json={"prompt": base}, timeout=60).json()["tokens"])
    text = f"Document {i}. " + FILLER * max(1, round(8 * (tokens - 40) / n)) + "\nSummarise the document in one line."
    return text


async def stream(client: httpx.AsyncClient, prompt: str, max_tokens: int, gaps: list[float]) -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    last, tokens = None, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if not json.loads(line[6:])["choices"][0]["text"]:
                continue                        # no token (the final chunk): not an inter-token gap
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            tokens += 1
    return tokens


async def window(url: str, prompts: list[str], args: argparse.Namespace) -> dict:
    """``--streams`` users stream back to back for ``--window-s`` while the long prompts arrive."""
    gaps, ttfts, counts = [], [], []
    deadline = time.perf_counter() + args.window_s
    limits = httpx.Limits(max_connections=args.streams + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def user(u: int) -> None:
            while time.perf_counter() < deadline:
                counts.append(await stream(client, STREAM_PROMPTS[u % len(STREAM_PROMPTS)], args.max_tokens, gaps))

        async def long(prompt: str) -> None:
            t0 = time.perf_counter()
            r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
            r.raise_for_status()
            ttfts.append(time.perf_counter() - t0)

        async def injector() -> None:
            await asyncio.sleep(args.long_every / 2)
            tasks = []
            while time.perf_counter() < deadline - args.long_every / 2 and prompts:
                tasks.append(asyncio.create_task(long(prompts.pop())))
                await asyncio.sleep(args.long_every)
            await asyncio.gather(*tasks)
        t0 = time.perf_counter()
        await asyncio.gather(injector(), *(user(u) for u in range(args.streams)))
        wall = time.perf_counter() - t0
    return {"gaps": gaps, "ttfts": ttfts, "tokens": sum(counts), "wall_s": wall}


def measure(args: argparse.Namespace) -> dict:
    machine = harness.machine_record()
    configs = {f"chunk {c}" if c else "whole prompts": ["--prefill-chunk", str(c)] for c in args.chunks}
    srv_args = argparse.Namespace(model=args.model, levels=[args.streams + 4], max_model_len=args.long_tokens + 512,
                                  num_threads=args.threads, weights=args.weights, compile=args.compile)
    servers = {name: Server(srv_args, extra) for name, extra in configs.items()}
    acc = {name: {"gaps": [], "ttfts": [], "tokens": 0, "wall_s": 0.0, "compile_s": 0.0, "eager": 0.0}
           for name in configs}
    try:
        for s in servers.values():
            s.wait_ready()
        url0 = next(iter(servers.values())).url
        per_window = int(args.window_s / args.long_every) + 1
        prompts = [long_prompt(url0, i, args.long_tokens) for i in range(per_window * args.rounds * len(configs))]
        n_long = len(httpx.post(url0 + "/tokenize", json={"prompt": prompts[0]}, timeout=60).json()["tokens"])
        names = list(configs)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                m0 = servers[name].metrics()
                got = asyncio.run(window(servers[name].url, [prompts.pop() for _ in range(per_window)], args))
                m1 = servers[name].metrics()
                acc[name]["compile_s"] += m1["verispec:compile_seconds"] - m0["verispec:compile_seconds"]
                acc[name]["eager"] += m1["verispec:eager_forwards"] - m0["verispec:eager_forwards"]
                for k in ("gaps", "ttfts"):
                    acc[name][k] += got[k]
                acc[name]["tokens"] += got["tokens"]
                acc[name]["wall_s"] += got["wall_s"]
                acc[name].setdefault("windows", []).append({
                    "round": r, "itl_ms": _stats(got["gaps"]), "stalled_share": stalled_share(got["gaps"]),
                    "compile_s": round(m1["verispec:compile_seconds"] - m0["verispec:compile_seconds"], 1)})
                print(f"round {r} {name:>14}: ITL p95 {_stats(got['gaps'])['p95']} ms, max {_stats(got['gaps'])['max']} ms, "
                      f"stalled {stalled_share(got['gaps'])}, long TTFT p50 "
                      f"{_stats(got['ttfts'])['p50']} ms, {got['tokens'] / got['wall_s']:.1f} stream tok/s", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    rows = {name: {"server_args": configs[name], "itl_ms": _stats(a["gaps"]), "long_ttft_ms": _stats(a["ttfts"]),
                   "stalled_share": stalled_share(a["gaps"]), "compile_s_in_windows": round(a["compile_s"], 1),
                   "eager_forwards_in_windows": int(a["eager"]), "windows": a.get("windows", []),
                   "stream_tokens_per_s": round(a["tokens"] / a["wall_s"], 2)} for name, a in acc.items()}
    return {"machine": machine, "settings": harness.settings(args), "long_prompt_tokens": n_long, "configs": rows}


def render(res: dict) -> str:
    s = res["settings"]
    lines = [f"{s['streams']} streams of {s['max_tokens']}-token greedy completions, back to back; a new "
             f"{res['long_prompt_tokens']}-token prompt (1 output token) every {s['long_every']} s; "
             f"{s['rounds']} windows of {s['window_s']} s per configuration, configurations in turn. "
             f"Server defaults otherwise (weights {s['weights']}, compile {s['compile']}, {s['threads']} threads). "
             "ITL: gaps between a stream's consecutive SSE chunks, client side. Stalled: the share of "
             f"the streams' time spent in gaps of {STALL_S * 1000:.0f} ms or more.", "",
             "| configuration | ITL p50 ms | ITL p95 ms | ITL p99 ms | ITL max ms | stalled | stream tok/s | long-prompt TTFT p50 ms | p95 ms | compiling in windows s | eager forwards |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in res["configs"].items():
        i, t = r["itl_ms"], r["long_ttft_ms"]
        lines.append(f"| {name} | {i['p50']} | {i['p95']} | {i['p99']} | {i['max']} | {r['stalled_share']:.0%} | {r['stream_tokens_per_s']} "
                     f"| {t['p50']} | {t['p95']} | {r.get('compile_s_in_windows', '-')} | {r.get('eager_forwards_in_windows', '-')} |")
    per_window = [(name, w) for name, r in res["configs"].items() for w in r.get("windows", [])]
    if per_window:
        lines += ["", "Per window (a window that compiled shows it):", "",
                  "| configuration | round | ITL max ms | stalled | compiling s |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {name} | {w['round']} | {w['itl_ms']['max']} | {w['stalled_share']:.0%} | {w['compile_s']} |"
                  for name, w in per_window]
    return "\n".join(lines) + "\n"


OUT = harness.Output("chunked_prefill", "Chunked prefill: stream ITL while 4k-token prompts arrive", render,
                     model="smollm2-135m", per_model=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 512, 256, 128])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--long-tokens", type=int, default=4096)
    ap.add_argument("--long-every", type=float, default=16.0)
    ap.add_argument("--window-s", type=float, default=32.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    OUT.main(ap, measure)


if __name__ == "__main__":
    main()
