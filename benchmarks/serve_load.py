"""Load test of ``verispec serve`` on loopback: throughput and latency with and without speculation.

For each configuration (plain decoding; speculation drafting whole trees, ``adaptive_drafting``
false; speculation with the draft-budget estimator and an optional batch-size cap) one server process is started, then ``U`` users (for each level in
``--levels``) stream chat completions back to back: user ``u`` sends Spec-Bench first turns
``u, u + U, u + 2U, ...`` until ``--requests-per-level`` requests (at least one per user) were
sent or ``--level-budget-s`` passed (requests in flight then still finish). All servers run side by
side and each level is measured for every configuration in turn, so background load on a shared
machine hits the configurations alike. Greedy decoding, so every
configuration must produce the same text for the same question (checked: ``outputs_identical``).

The peer: ``llama-server`` (``make llama-server``: llama.cpp's server built from the source the
llama-cpp-python sdist carries) on the same model's GGUF, with the same threads, one slot per user
of the largest level, plain (``llama-server``) and with its own speculation (``llama-server+spec``,
``--peer-spec``), under the same client.

Measured per level: output tokens per second (all completion tokens / wall time of the level),
time to first token (client side: until the first SSE chunk, which the server sends once the first
token exists), inter-token latency (gaps between a stream's token-carrying chunks) and end-to-end
latency P50/P95/P99, errors, each server's peak RSS, plus the server's speculation counters.
Writes ``benchmarks/results/serve_load.json`` and ``.md``.

    python benchmarks/serve_load.py                       # defaults: ngram k=4, levels 1,4,16,32
    python benchmarks/serve_load.py --speculative-config '{"method": "eagle3", ...}' --policy auto
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from verispec.bench import harness  # noqa: E402

TARGETS = {1: 1.3, 8: 1.0, 32: 1.0}     # speculation over its own vanilla, every round


# ---------------------------------------------------------------------------- server process
class Server:
    def __init__(self, args: argparse.Namespace, extra: list[str]):
        self.port = harness.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "verispec.serve", "--model", args.model, "--port", str(self.port),
               "--max-num-seqs", str(max(args.levels)), "--max-model-len", str(args.max_model_len),
               "--max-prompt-tokens", str(args.max_model_len), "--num-threads", str(args.num_threads),
               "--weights", args.weights, "--log-level", "warning", "--compile" if args.compile else "--no-compile",
               *extra]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.num_threads), PYTHONPATH=str(ROOT / "src"))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    name, ready_path = "server", "/ready"       # verispec's /ready: after the warm-up

    def wait_ready(self, timeout: float = 900.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {Path(self.log.name).read_text()[-3000:]}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not become ready")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
                                if s.labels else "")
                out[key] = s.value
        return out

    def peak_rss_mb(self) -> float | None:
        """The server process's peak resident memory (VmHWM), read before it stops."""
        return peak_rss_mb(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def peak_rss_mb(pid: int) -> float | None:
    peak = harness.proc_status_mb("VmHWM", pid)
    return None if peak is None else round(peak, 1)
    return None


LLAMA_SERVER = ROOT / "build" / "llama.cpp" / "bin" / "llama-server"


class LlamaServer(Server):
    """llama.cpp's ``llama-server`` (``make llama-server``) on the same GGUF, threads and context per
    slot, with one slot per user of the largest level (``-np``) and continuous batching; ``extra``:
    its own speculation flags (``--spec-type ngram-mod``, ``-md draft.gguf``). Its /metrics are
    not read: it has no speculation counters of ours."""
    name, ready_path = "llama-server", "/health"    # 200 once the model is loaded

    def __init__(self, args: argparse.Namespace, extra: list[str]):
        from verispec.models.sources import resolve_model
        if not LLAMA_SERVER.exists():
            raise RuntimeError(f"{LLAMA_SERVER} is missing: run 'make llama-server' first")
        gguf = resolve_model(args.model).path
        if gguf.suffix != ".gguf":
            raise RuntimeError(f"the llama-server peer needs a GGUF model, {args.model} is {gguf}")
        self.port = harness.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        slots = max(args.levels)
        cmd = [str(LLAMA_SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
               "-t", str(args.num_threads), "-tb", str(args.num_threads), "-np", str(slots),
               "-c", str(slots * args.max_model_len), "--jinja", *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def metrics(self) -> dict[str, float]:
        return {}


# ---------------------------------------------------------------------------- load generation
async def one_request(client: httpx.AsyncClient, question: str, max_tokens: int) -> dict:
    """One streamed chat completion; a keep-alive connection the server closed before answering
    (llama-server does) is retried once on a fresh one, as HTTP clients do (``retried``)."""
    try:
        return await _one_request(client, question, max_tokens)
    except httpx.RemoteProtocolError:
        return {**await _one_request(client, question, max_tokens), "retried": True}


async def _one_request(client: httpx.AsyncClient, question: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage, gaps, last = None, [], None, [], None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": r.status_code, "detail": (await r.aread()).decode()[:200]}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"].get("code"), "detail": chunk["error"]["message"]}
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices", []):
                piece = c["delta"].get("content") or ""
                text.append(piece)
                if piece:                                   # inter-token latency: token-carrying chunks
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
    return {"ttft": ttft, "e2e": time.perf_counter() - t0, "text": "".join(text), "gaps": gaps,
            "tokens": usage["completion_tokens"] if usage else 0}


async def run_level(url: str, users: int, questions: list[dict], args: argparse.Namespace) -> tuple[dict, dict]:
    """Closed loop: each user sends its next question as soon as the previous one finished."""
    total = max(args.requests_per_level, users)
    deadline = time.perf_counter() + args.level_budget_s
    results: list[dict] = []
    texts: dict[int, str] = {}
    limits = httpx.Limits(max_connections=users + 4, max_keepalive_connections=users + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def user(u: int) -> None:
            for i in range(u, total, users):
                if time.perf_counter() > deadline and i != u:
                    return
                q = questions[i % len(questions)]
                res = await one_request(client, q["turns"][0], args.max_tokens)
                results.append(res)
                if "text" in res:
                    texts[q["question_id"]] = res["text"]
        t0 = time.perf_counter()
        await asyncio.gather(*(user(u) for u in range(users)))
        wall = time.perf_counter() - t0
    return summarize(results, wall), texts


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return round(values[lo] + (values[hi] - values[lo]) * (k - lo), 4)


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if "error" not in r]
    ttft, e2e = [r["ttft"] for r in ok if r["ttft"] is not None], [r["e2e"] for r in ok]
    itl = [g for r in ok for g in r.get("gaps", ())]
    tokens = sum(r["tokens"] for r in ok)
    return {"requests": len(ok), "errors": len(results) - len(ok), "output_tokens": tokens,
            "retried": sum(bool(r.get("retried")) for r in results),
            "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 3) if wall > 0 else 0.0,
            "ttft_s": {f"p{p}": _pct(ttft, p) for p in (50, 95, 99)},
            "e2e_s": {f"p{p}": _pct(e2e, p) for p in (50, 95, 99)},
            "itl_ms": {f"p{p}": None if not itl else round(_pct(itl, p) * 1e3, 1) for p in (50, 95, 99)},
            "error_details": sorted({str(r.get("detail"))[:120] for r in results if "error" in r})[:3]}


def spec_delta(before: dict, after: dict) -> dict:
    def d(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)
    drafts = d("verispec:spec_decode_num_drafts_total")
    accepted = d("verispec:spec_decode_num_accepted_tokens_total")
    return {"num_drafts": int(drafts), "num_draft_tokens": int(d("verispec:spec_decode_num_draft_tokens_total")),
            "num_accepted_tokens": int(accepted),
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
            "last_draft_budget": after.get("verispec:spec_decode_draft_budget")}


def run_configs(configs: dict[str, list[str]], questions: list[dict], args: argparse.Namespace,
                tag: str = "") -> tuple[dict, dict | None]:
    """One round: fresh servers, all side by side (idle ones use no CPU); levels are the outer
    loop so that every configuration of a level is measured within minutes of the others (fair
    on a shared, noisy machine). Returns the configurations' results and, with
    ``--engine-reference``, the in-process engine's, measured right after the 1-user level."""
    engine = None
    servers = {name: (LlamaServer if name.startswith("llama-server") else Server)(args, extra)
               for name, extra in configs.items()}
    out = {name: {"server_args": extra, "levels": {}, "texts": {}} for name, extra in configs.items()}
    try:
        for name, server in servers.items():
            server.wait_ready()
            asyncio.run(run_level(server.url, 1, questions[:1], argparse.Namespace(**{
                **vars(args), "requests_per_level": 1, "max_tokens": 4})))        # warm-up
        for users in args.levels:
            for name, server in servers.items():
                before = server.metrics()
                summary, texts = asyncio.run(run_level(server.url, users, questions, args))
                after = server.metrics()
                summary["speculation"] = spec_delta(before, after)
                summary["graphs_compiled"] = int(after.get("verispec:compiled_graphs", 0)     # under load: 0
                                                 - before.get("verispec:compiled_graphs", 0))
                summary["eager_forwards"] = int(after.get("verispec:eager_forwards", 0)
                                                - before.get("verispec:eager_forwards", 0))
                summary["load_average_after"] = round(os.getloadavg()[0], 2)
                out[name]["levels"][str(users)] = summary
                out[name]["texts"][str(users)] = {str(k): v for k, v in texts.items()}
                print(f"{tag}{name:>20} {users:>3} users: {summary['tokens_per_s']:7.2f} tok/s  "
                      f"ttft p50 {summary['ttft_s']['p50']}  e2e p50 {summary['e2e_s']['p50']}  "
                      f"req {summary['requests']} err {summary['errors']}  {summary['speculation']}", flush=True)
            if users == 1 and args.engine_reference:
                try:
                    engine = engine_reference(questions, args)
                except Exception as e:        # noqa: BLE001 - keep the rounds measured so far
                    engine = {"error": repr(e)}
                print(f"{tag}{'engine in-process':>20}   1 user : {engine.get('tokens_per_s')} tok/s", flush=True)
    finally:
        for name, server in servers.items():
            out[name]["peak_rss_mb"] = server.peak_rss_mb()
            server.stop()
    return out, engine


# ---------------------------------------------------------------------------- engine reference
@functools.cache
def _reference_llm(model: str, weights: str, compile: bool):
    from verispec import LLM
    return LLM(model=model, weights=weights, compile=compile)


def engine_reference(questions: list[dict], args: argparse.Namespace) -> dict:
    """The 1-user workload decoded in-process (``LLM.generate``, one request at a time, the same
    model, weights, compile and threads as the servers, no speculation): what the server's
    1-user rate is compared against, in each round right after the servers' 1-user level (the
    machine's speed drifts between rounds). The model is loaded once; the first request of each
    call warms it and is not timed."""
    import torch

    from verispec import SamplingParams
    torch.set_num_threads(args.num_threads)
    llm = _reference_llm(args.model, args.weights, args.compile)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    tok = llm.tokenizer
    chat = [{"prompt_token_ids": tok(tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}],
                                                             tokenize=False, add_generation_prompt=True),
                                     add_special_tokens=False).input_ids}
            for q in questions[:max(args.requests_per_level, 1) + 1]]
    llm.generate(chat[:1], params)
    tokens, t0 = 0, time.perf_counter()
    for prompt in chat[1:]:
        tokens += len(llm.generate([prompt], params)[0].token_ids)
    wall = time.perf_counter() - t0
    return {"requests": len(chat) - 1, "output_tokens": tokens, "wall_s": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 3)}


# ---------------------------------------------------------------------------- report
def compare(report: dict) -> None:
    """Per round and level: each configuration's tokens/s over the same round's verispec vanilla
    (``speedup_vs_baseline[name][level]``, one ratio per round); the outputs of every verispec
    configuration in every round against round 1's vanilla (``outputs_identical``)."""
    rounds = report["rounds"]
    report["speedup_vs_baseline"] = {}
    ref = rounds[0].get("baseline", {}).get("texts")
    if ref is not None:
        for name in rounds[0]:
            if name != "baseline":
                report["speedup_vs_baseline"][name] = {
                    lvl: [round(r[name]["levels"][lvl]["tokens_per_s"] / r["baseline"]["levels"][lvl]["tokens_per_s"], 3)
                          if r["baseline"]["levels"][lvl]["tokens_per_s"] else None for r in rounds]
                    for lvl in rounds[0][name]["levels"]}
    if ref is not None:                   # round 1's vanilla text of each question, at its first level
        ref = {q: t for lvl in reversed(list(ref)) for q, t in ref[lvl].items()}
    report["mismatches"] = [] if ref is None else [     # a peer's numerics differ: verispec only
        {"round": i + 1, "config": name, "users": lvl, "question_id": q, "text": t[:300], "vanilla": ref[q][:300]}
        for i, r in enumerate(rounds) for name, cfg in r.items() if not name.startswith("llama-server")
        for lvl, texts in cfg["texts"].items() for q, t in texts.items() if q in ref and t != ref[q]]
    report["outputs_identical"] = None if ref is None else not report["mismatches"]
    for r in rounds:
        for cfg in r.values():
            cfg["num_texts"] = sum(len(t) for t in cfg.pop("texts").values())


def _median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None)
    return None if not values else values[len(values) // 2] if len(values) % 2 else \
        round((values[len(values) // 2 - 1] + values[len(values) // 2]) / 2, 3)


def _summary_rows(report: dict) -> list[str]:
    rounds = report["rounds"]
    rows = ["| config | users | tok/s (median of rounds) | per round | speed-up per round | TTFT p95 s "
            "| ITL p95 ms | errors | peak RSS MiB |", "|---|---|---:|---|---|---:|---:|---:|---:|"]
    for name in rounds[0]:
        for lvl in rounds[0][name]["levels"]:
            per = [r[name]["levels"][lvl] for r in rounds]
            sp = report["speedup_vs_baseline"].get(name, {}).get(lvl)
            rows.append(f"| {name} | {lvl} | {_median([x['tokens_per_s'] for x in per])} "
                        f"| {' / '.join(str(x['tokens_per_s']) for x in per)} "
                        f"| {'' if not sp else ' / '.join(f'{v:.2f}x' for v in sp if v is not None)} "
                        f"| {_median([x['ttft_s']['p95'] for x in per])} "
                        f"| {_median([x.get('itl_ms', {}).get('p95') for x in per])} "
                        f"| {sum(x['errors'] for x in per)} "
                        f"| {max((r[name].get('peak_rss_mb') or 0) for r in rounds) or '-'} |")
    return rows


def _engine_lines(report: dict) -> list[str]:
    """The server's vanilla at 1 user over the engine in-process, per round (an older report
    holds one engine figure, measured after every round)."""
    ref, rounds = report.get("engine_reference"), report["rounds"]
    refs = ref if isinstance(ref, list) else [ref] * len(rounds) if ref else []
    one = [r.get("baseline", {}).get("levels", {}).get("1", {}).get("tokens_per_s") for r in rounds]
    pairs = [(s, e["tokens_per_s"]) for s, e in zip(one, refs) if s and e and e.get("tokens_per_s")]
    if not pairs:
        return []
    head = ("per round, measured right after the servers' 1-user level" if isinstance(ref, list)
            else "once, after every round")
    return [f"Engine in-process (`LLM.generate`, one request at a time, same path, {head}): "
            f"{' / '.join(str(e) for _, e in pairs)} tok/s; the server's vanilla at 1 user: "
            f"{' / '.join(str(s) for s, _ in pairs)} tok/s ("
            f"{' / '.join(f'{s / e:.2f}x' for s, e in pairs)}).", ""]


def markdown(report: dict) -> str:
    s = report["settings"]
    rounds = report["rounds"]
    lines = [f"Servers: {s['num_threads']} thread(s) each, {s.get('weights', 'auto')} weights, "
             f"compile {s.get('compile', True)}, max_num_seqs / slots {max(s['levels'])}, "
             f"max_model_len {s['max_model_len']}.",
             f"Workload: Spec-Bench first turns (chat), greedy, max_tokens {s['max_tokens']}, closed loop, "
             f"up to {s['requests_per_level']} requests (>= 1 per user) or {s['level_budget_s']} s per level; "
             f"{len(rounds)} round(s), each with fresh servers; configurations measured in turn for each level.",
             f"Speculation: `{s['speculative_config']}` (`speculative`: whole trees every step; "
             f"`speculative+policy`: the draft-budget estimator, policy `{s['policy']}`). "
             f"Peer speculation: `{s.get('peer_spec')}`.", "", *_summary_rows(report), ""]
    lines += _engine_lines(report)
    compiled = sum(x.get("graphs_compiled", 0) for r in rounds for cfg in r.values() for x in cfg["levels"].values())
    lines += [f"Outputs identical across verispec configurations and rounds (lossless): {report['outputs_identical']}.",
              f"Graphs compiled under load, after `/ready` (all servers, levels and rounds): {compiled}.", ""]
    if report.get("mismatches"):
        lines += ["Outputs that differ from round 1's vanilla (round, config, users, question): " + "; ".join(
            f"{m['round']}, {m['config']}, {m['users']}, {m['question_id']}" for m in report["mismatches"]) + ".", ""]
    for name, speedups in report["speedup_vs_baseline"].items():
        if name.startswith("llama-server"):
            continue
        met = {lvl: all((v or 0) >= t for v in speedups[str(lvl)]) for lvl, t in TARGETS.items() if str(lvl) in speedups}
        lines.append(f"Speculation targets (every round: >= {TARGETS[1]}x at 1 user, >= {TARGETS[8]}x at 8 "
                     f"and 32) for `{name}`: {met}.")
    lines += ["", "## Rounds", "",
              "| round | config | users | tok/s | TTFT p50 / p95 / p99 (s) | ITL p50 / p95 / p99 (ms) "
              "| e2e p50 / p95 / p99 (s) | requests | mean acc. len | peak RSS MiB |",
              "|---|---|---|---:|---|---|---|---|---|---:|"]
    for i, r in enumerate(rounds, 1):
        for name, cfg in r.items():
            for lvl, x in cfg["levels"].items():
                t, e, itl = x["ttft_s"], x["e2e_s"], x.get("itl_ms", {})
                lines.append(f"| {i} | {name} | {lvl} | {x['tokens_per_s']:.2f} | {t['p50']} / {t['p95']} / {t['p99']} "
                             f"| {itl.get('p50')} / {itl.get('p95')} / {itl.get('p99')} "
                             f"| {e['p50']} / {e['p95']} / {e['p99']} | {x['requests']} ({x['errors']} err) "
                             f"| {x['speculation'].get('mean_acceptance_length') or '-'} | {cfg.get('peak_rss_mb') or '-'} |")
    lines += ["", "Ratios compare configurations of the same round and level, measured within minutes of "
              "each other on a shared machine (the load average after each level is in the JSON). Mean "
              "acceptance length counts the bonus token."]
    return "\n".join(lines)


OUTPUT = harness.Output("serve_load", "`verispec serve` under load", markdown, model="smollm2-135m", per_model=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}')
    p.add_argument("--policy", default="auto", help="num_speculative_tokens_per_batch_size of the "
                   "'speculative+policy' config ('auto': the engine's draft-budget estimator alone)")
    p.add_argument("--levels", default="1,4,16,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1088)
    p.add_argument("--requests-per-level", type=int, default=8)
    p.add_argument("--level-budget-s", type=float, default=30.0)
    p.add_argument("--num-threads", type=int, default=2, help="threads of every server (default: 2)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="the server's compiled forwards (its default)")
    p.add_argument("--weights", choices=("auto", "dense", "fp16", "int4", "int4-a8", "int8"), default="auto",
                   help="server --weights (auto: the server's default, the fastest faithful weights)")
    p.add_argument("--questions-per-category", type=int, default=4)
    p.add_argument("--configs", default="baseline,speculative,speculative+policy",
                   help="comma-separated: baseline, speculative, speculative+policy, llama-server, llama-server+spec")
    p.add_argument("--peer-spec", default="--spec-type ngram-mod",
                   help="llama-server's speculation flags for 'llama-server+spec' (e.g. '-md draft.gguf')")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each with fresh servers (default: 3)")
    p.add_argument("--engine-reference", action=argparse.BooleanOptionalAction, default=True,
                   help="also decode the 1-user workload in-process with LLM.generate on the same path")
    p.add_argument("--render", metavar="JSON", help="rewrite the Markdown of this saved JSON result "
                   "(as --rerender --out JSON without .json)")
    args = OUTPUT.parse(p, argv)
    if args is None:
        return 0
    if args.render:
        print("wrote", OUTPUT.rerender(args.render.removesuffix(".json")))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))     # still stop the servers
    from verispec.data import per_category, spec_bench_questions
    questions = [q for q in per_category(spec_bench_questions(), args.questions_per_category)
                 if len(q["turns"][0]) <= 3 * (args.max_model_len - args.max_tokens - 64)]
    whole = json.dumps({**json.loads(args.speculative_config), "adaptive_drafting": False})
    configs = {"baseline": [], "speculative": ["--speculative-config", whole],      # whole trees every step
               "speculative+policy": ["--speculative-config", args.speculative_config,
                                      "--num-speculative-tokens-per-batch-size", args.policy],
               "llama-server": [], "llama-server+spec": args.peer_spec.split()}
    wanted = args.configs.split(",")
    settings = {k: v for k, v in harness.settings(args).items() if k != "render"}
    report = {"machine": harness.machine_record(), "settings": settings,
              "num_questions": len(questions), "configs": {}}
    t0 = time.perf_counter()
    measured = [run_configs({name: configs[name] for name in wanted}, questions, args, tag=f"round {r + 1}: ")
                for r in range(args.rounds)]
    report["rounds"] = [cfgs for cfgs, _ in measured]
    if args.engine_reference:
        report["engine_reference"] = [engine for _, engine in measured]       # one per round
    report["total_s"] = round(time.perf_counter() - t0, 1)
    compare(report)
    print(OUTPUT.write(report, args.out).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
