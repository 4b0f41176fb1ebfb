"""Soak with faults: a real ``verispec serve`` process under concurrent users with speculation on.

    python benchmarks/soak.py --duration 600 --users 32 --out benchmarks/results/soak

Phase 1 (``--duration`` s, loopback only, bounded in time and count): ``--users`` threads send a
seeded mix of greedy completions (their outputs are compared with solo runs afterwards), streamed
chats, sampled completions, streams the client drops after the first chunk, malformed JSON and
over-long prompts; halfway, a burst of ``--burst`` simultaneous requests goes above the queue
limit. The server's RSS is sampled every 2 s. At the end every batch row and queue slot must be
free (``/metrics``) and no response may be a 5xx.
Phase 2: load for a few seconds, ``kill -9`` of the server: every client gets a clean connection
error and none hangs; a restarted server serves again.
Writes ``OUT.json`` and ``OUT.md`` with the machine noted.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from verispec.bench import harness  # noqa: E402

GREEDY_PROMPTS = ["The capital of France is", "List three colours:", "Once upon a time", "def add(a, b):",
                  "The recipe needs flour, eggs and", "Translate to French: good morning"]


class Server:
    def __init__(self, port: int, args: argparse.Namespace):
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "verispec.serve", "--model", args.model, "--port", str(port),
               "--weights", args.weights, "--max-num-seqs", str(args.max_num_seqs), "--max-queue", str(args.max_queue),
               "--max-model-len", "512", "--max-prompt-tokens", "256", "--request-timeout", "120",
               "--speculative-config", args.speculative_config, "--log-level", "warning",
               "--compile" if args.compile else "--no-compile"]
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {Path(self.log.name).read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.25)
        raise RuntimeError("server not ready")

    def rss_mib(self) -> float | None:
        return harness.proc_status_mb("VmRSS", self.proc.pid)

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out


class Recorder:
    """Outcomes, latencies and greedy outputs of every request (thread-safe)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.outcomes: Counter = Counter()
        self.statuses: Counter = Counter()
        self.ttft: list[float] = []
        self.e2e: list[float] = []
        self.greedy: dict[str, set[str]] = {}

    def add(self, kind: str, status: int | str, e2e: float | None = None, ttft: float | None = None) -> None:
        with self.lock:
            self.outcomes[f"{kind}:{status}"] += 1
            self.statuses[str(status)] += 1
            if e2e is not None:
                self.e2e.append(e2e)
            if ttft is not None:
                self.ttft.append(ttft)


def _stream(client: httpx.Client, path: str, body: dict, drop_after_first: bool) -> tuple[int, float | None, str]:
    t0 = time.perf_counter()
    ttft, text = None, []
    with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, None, ""
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            if drop_after_first:
                return 499, ttft, ""                     # the client goes away mid-stream
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                text.append((c.get("delta") or {}).get("content") or c.get("text") or "")
    return 200, ttft, "".join(text)


def one_request(client: httpx.Client, rng: random.Random, rec: Recorder) -> None:
    kind = rng.choices(["greedy", "chat_stream", "sampled", "drop", "malformed", "oversized"],
                       [4, 3, 2, 1, 1, 1])[0]
    t0 = time.perf_counter()
    try:
        if kind == "greedy":
            p = rng.choice(GREEDY_PROMPTS)
            r = client.post("/v1/completions", json={"prompt": p, "max_tokens": 24, "temperature": 0})
            if r.status_code == 200:
                with rec.lock:
                    rec.greedy.setdefault(p, set()).add(r.json()["choices"][0]["text"])
            rec.add(kind, r.status_code, time.perf_counter() - t0)
        elif kind in ("chat_stream", "drop"):
            body = {"messages": [{"role": "user", "content": rng.choice(GREEDY_PROMPTS)}], "max_tokens": 32,
                    "temperature": 0.7, "seed": rng.randrange(10**6), "stream": True}
            status, ttft, _ = _stream(client, "/v1/chat/completions", body, kind == "drop")
            rec.add(kind, status, time.perf_counter() - t0 if status == 200 else None, ttft)
        elif kind == "sampled":
            r = client.post("/v1/completions", json={"prompt": rng.choice(GREEDY_PROMPTS), "max_tokens": 16,
                                                     "temperature": 1.0, "top_p": 0.9, "n": 2})
            rec.add(kind, r.status_code, time.perf_counter() - t0)
        elif kind == "malformed":
            r = client.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": ', headers={"Content-Type": "application/json"})
            rec.add(kind, r.status_code)
        else:
            r = client.post("/v1/completions", json={"prompt": "word " * 400, "max_tokens": 4})
            rec.add(kind, r.status_code)
    except httpx.HTTPError as e:
        rec.add(kind, type(e).__name__)


def _pct(xs: list[float], q: float) -> float | None:
    return round(statistics.quantiles(xs, n=100)[q - 1], 3) if len(xs) >= 2 else None


def phase_load(server: Server, args: argparse.Namespace) -> dict:
    rec, stop_at = Recorder(), time.monotonic() + args.duration
    rss: list[tuple[float, float]] = []
    t_start = time.monotonic()

    def user(i: int) -> None:
        rng = random.Random(args.seed * 1000 + i)
        with httpx.Client(base_url=server.url, timeout=120) as client:
            for _ in range(args.max_requests_per_user):
                if time.monotonic() > stop_at:
                    return
                one_request(client, rng, rec)

    def burst() -> None:
        time.sleep(args.duration / 2)
        with httpx.Client(base_url=server.url, timeout=120) as client:
            def hit(_):
                try:
                    r = client.post("/v1/completions", json={"prompt": "Burst", "max_tokens": 8, "temperature": 0})
                    rec.add("burst", r.status_code)
                except httpx.HTTPError as e:
                    rec.add("burst", type(e).__name__)
            ts = [threading.Thread(target=hit, args=(k,)) for k in range(args.burst)]
            [t.start() for t in ts]
            [t.join() for t in ts]

    threads = [threading.Thread(target=user, args=(i,)) for i in range(args.users)] + [threading.Thread(target=burst)]
    [t.start() for t in threads]
    while any(t.is_alive() for t in threads):
        rss.append((round(time.monotonic() - t_start, 1), server.rss_mib()))
        time.sleep(2)
    [t.join() for t in threads]
    time.sleep(1)
    m = server.metrics()
    solo = {}
    with httpx.Client(base_url=server.url, timeout=120) as client:         # the greedy prompts alone
        for p in rec.greedy:
            solo[p] = client.post("/v1/completions", json={"prompt": p, "max_tokens": 24, "temperature": 0}).json()["choices"][0]["text"]
    mismatched = [p for p, outs in rec.greedy.items() if outs != {solo[p]}]
    five_xx = sum(n for s, n in rec.statuses.items() if s.isdigit() and int(s) >= 500)
    return {"duration_s": args.duration, "users": args.users, "requests": sum(rec.outcomes.values()),
            "by_outcome": dict(sorted(rec.outcomes.items())), "status_5xx": five_xx,
            "ttft_p50_s": _pct(rec.ttft, 50), "ttft_p99_s": _pct(rec.ttft, 99),
            "e2e_p50_s": _pct(rec.e2e, 50), "e2e_p99_s": _pct(rec.e2e, 99),
            "rss_mib": rss, "running_at_end": m.get("verispec:num_requests_running"),
            "waiting_at_end": m.get("verispec:num_requests_waiting"),
            "greedy_prompts": len(rec.greedy), "greedy_outputs_differing_from_solo": mismatched,
            "mean_acceptance_length": m.get("verispec:spec_decode_mean_acceptance_length")}


def phase_kill(server: Server, args: argparse.Namespace, port: int) -> tuple[dict, Server]:
    """kill -9 mid-load: clients end with connection errors (none hangs); a restart serves."""
    results: list[str] = []

    def client_loop() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for _ in range(50):
                t0 = time.perf_counter()
                try:
                    client.post("/v1/completions", json={"prompt": "Tell me a story", "max_tokens": 64})
                    results.append("ok")
                except httpx.HTTPError as e:
                    results.append(f"{type(e).__name__} after {time.perf_counter() - t0:.1f}s")
                    return
    ts = [threading.Thread(target=client_loop) for _ in range(8)]
    [t.start() for t in ts]
    time.sleep(args.kill_after)
    server.proc.send_signal(signal.SIGKILL)
    t_kill = time.monotonic()
    [t.join(60) for t in ts]
    hung, done_s = sum(t.is_alive() for t in ts), round(time.monotonic() - t_kill, 1)
    restarted = Server(port, args)
    restarted.wait_ready()
    ok = httpx.post(restarted.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60).status_code
    errors = [r for r in results if r != "ok"]
    return ({"killed_after_s": args.kill_after, "clients": len(ts), "clients_hung": hung,
             "client_errors": errors, "clients_done_within_s": done_s,
             "restarted_status": ok}, restarted)


def markdown(rep: dict) -> str:
    load, kill = rep["load"], rep["kill"]
    rss = [r for _, r in load["rss_mib"] if r is not None]
    lines = [f"- {load['users']} users for {load['duration_s']} s, {load['requests']} requests; 5xx responses: "
             f"**{load['status_5xx']}**.",
             f"- TTFT p50 / p99: {load['ttft_p50_s']} / {load['ttft_p99_s']} s; end-to-end p50 / p99: "
             f"{load['e2e_p50_s']} / {load['e2e_p99_s']} s.",
             f"- RSS: {min(rss):.0f} MiB at least, {max(rss):.0f} MiB at most, {rss[-1]:.0f} MiB at the end "
             f"({len(rss)} samples)." if rss else "- RSS: not sampled.",
             f"- At the end: {load['running_at_end']:.0f} requests running, {load['waiting_at_end']:.0f} waiting "
             "(every row and queue slot free).",
             f"- Greedy outputs equal to their solo runs: {load['greedy_prompts'] - len(load['greedy_outputs_differing_from_solo'])}"
             f"/{load['greedy_prompts']} prompts.", f"- Mean acceptance length: {load['mean_acceptance_length']}.",
             f"- kill -9 after {kill['killed_after_s']} s of load: {kill['clients']} clients, {kill['clients_hung']} hung, "
             f"all done {kill['clients_done_within_s']} s after the kill with {kill['client_errors'][:3]}; "
             f"restarted server answered {kill['restarted_status']}.", "", "| outcome | requests |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in load["by_outcome"].items()]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict:
    machine = harness.machine_record()
    port = harness.free_port()
    server = Server(port, args)
    try:
        server.wait_ready()
        load = phase_load(server, args)
        kill, server = phase_kill(server, args, port)
    finally:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)
            server.proc.wait(60)
    return {"machine": machine, "load": load, "kill": kill}


OUT = harness.Output("soak", "Soak with faults", markdown, model="smollm2-135m", per_model=False)


def parse_args(argv=None) -> argparse.Namespace | None:
    """The soak's options (with the harness's --out, --rerender, --model); None after a --rerender."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=600)
    p.add_argument("--users", type=int, default=32)
    p.add_argument("--max-requests-per-user", type=int, default=400)
    p.add_argument("--burst", type=int, default=48)
    p.add_argument("--kill-after", type=float, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights", default="auto", help="server --weights (default: auto, the server's own default)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="the server's compiled forwards (its default)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=32)
    p.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}')
    return OUT.parse(p, argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args is None:
        return 0
    rep = run(args)
    print(OUT.write(rep, args.out).read_text())
    load, kill = rep["load"], rep["kill"]
    good = (load["status_5xx"] == 0 and not load["greedy_outputs_differing_from_solo"] and kill["clients_hung"] == 0
            and load["running_at_end"] == 0 and load["waiting_at_end"] == 0 and kill["restarted_status"] == 200)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
