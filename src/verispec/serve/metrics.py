"""Prometheus metrics of one server, in their own ``CollectorRegistry`` (never the global one).

Names follow vLLM's with a ``verispec:`` prefix. Counters get prometheus-client's ``_total``
suffix in the exposition. Conventions:
- ``spec_decode_*`` count verification steps that drafted at least one token, the draft tokens
  proposed and the draft tokens accepted (the bonus/recovered token is not an accepted token);
  ``spec_decode_num_accepted_tokens_per_pos{position="i"}`` counts drafted steps whose accepted
  path reached depth i (1-based), as ``SpecStats.accepted_per_pos``.
- ``generation_tokens`` counts tokens emitted to requests (``completion_tokens``), also those of
  requests aborted later; ``prompt_tokens`` counts the prompt tokens of admitted requests (those
  served by the prefix cache too). Responses answered from the response cache do no engine work
  and count in ``response_cache_hits`` only.
- ``inter_token_latency_seconds`` is observed once per emitted token: the time since the
  request's previous emission divided by the tokens emitted together (speculation emits several).
- ``request_finished{finished_reason}``: stop, length, abort (client went away), timeout, error.
- ``prefix_cache_queries`` / ``prefix_cache_hits`` (as vLLM's): prompt tokens looked up in the
  prefix cache and, of those, tokens served from it (their prefill skipped); ``prefix_cache_bytes``
  the bytes of K/V and features it holds (all 0 without ``--prefix-cache-mb``).
Every method is thread-safe (prometheus-client metrics are).
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..core.metrics import SpecStats

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "timeout", "error")
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """All metrics of one server process; ``render()`` gives the text exposition."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.num_drafts = Counter("verispec:spec_decode_num_drafts",
                                  "Verification steps that checked at least one draft token.", registry=r)
        self.num_draft_tokens = Counter("verispec:spec_decode_num_draft_tokens",
                                        "Draft tokens proposed.", registry=r)
        self.num_accepted_tokens = Counter("verispec:spec_decode_num_accepted_tokens",
                                           "Draft tokens accepted (bonus tokens excluded).", registry=r)
        self.accepted_per_pos = Counter("verispec:spec_decode_num_accepted_tokens_per_pos",
                                        "Drafted steps whose accepted path reached this depth.",
                                        ["position"], registry=r)
        self.mean_acceptance_length = Gauge(
            "verispec:spec_decode_mean_acceptance_length",
            "Tokens emitted per drafted verification step since the server started, bonus token "
            "included (1 when nothing was drafted).", registry=r)
        self.draft_budget = Gauge("verispec:spec_decode_draft_budget",
                                  "Draft tree nodes allowed per sequence by the speculation policy "
                                  "in the last step (0: speculation off).", registry=r)
        self.running = Gauge("verispec:num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("verispec:num_requests_waiting", "Requests queued for a batch row.", registry=r)
        self.prompt_tokens = Counter("verispec:prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter("verispec:generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("verispec:time_to_first_token_seconds",
                              "Time from arrival to the first generated token.", buckets=_TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("verispec:inter_token_latency_seconds",
                             "Time between generated tokens (a step's interval shared by its tokens).",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("verispec:e2e_request_latency_seconds",
                             "Time from arrival to the end of a request.", buckets=_E2E_BUCKETS, registry=r)
        self.finished = Counter("verispec:request_finished", "Requests that ended, by finish reason.",
                                ["finished_reason"], registry=r)
        self.http_errors = Counter("verispec:http_errors", "Error responses sent, by HTTP status.",
                                   ["status"], registry=r)
        self.cache_hits = Counter("verispec:response_cache_hits",
                                  "Requests answered from the response cache.", registry=r)
        self.prompt_denied = Counter("verispec:prompt_denied", "Requests refused by the prompt denylist.",
                                     registry=r)
        self.lossy_acceptance = Gauge("verispec:spec_decode_lossy_acceptance",
                                      "1 when the acceptance rule is lossy (outputs do not follow the "
                                      "target distribution), else 0; the rule's name is the label.",
                                      ["rule"], registry=r)
        self.prefix_cache_queries = Counter("verispec:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.", registry=r)
        self.prefix_cache_hits = Counter("verispec:prefix_cache_hits",
                                         "Prompt tokens served from the prefix cache (not prefilled).", registry=r)
        self.prefix_cache_bytes = Gauge("verispec:prefix_cache_bytes",
                                        "Bytes of K/V and target features held by the prefix cache.", registry=r)
        self._prefix_seen = (0, 0)
        self.kv_blocks_total = Gauge("verispec:kv_cache_blocks_total",
                                     "Blocks of the paged KV pool (0: static rows).", registry=r)
        self.kv_blocks_used = Gauge("verispec:kv_cache_blocks_used",
                                    "Blocks of the paged KV pool holding K/V (rows and prefix cache).", registry=r)
        self.kv_usage = Gauge("verispec:kv_cache_usage_perc",
                              "Share of the paged KV pool in use, 0..1.", registry=r)
        self.compiled_graphs = Gauge("verispec:compiled_graphs",
                                     "Graphs torch.compile made in this process (warm-up included); a rise "
                                     "under load is a recompile a request waited for.", registry=r)
        self.compile_seconds = Gauge("verispec:compile_seconds",
                                     "Seconds spent in forwards that compiled, in this process.", registry=r)
        self.eager_forwards = Gauge("verispec:eager_forwards",
                                    "Decode/verify forwards run eagerly by a compiled server (batch rows "
                                    "other than 0..B-1).", registry=r)
        for reason in FINISH_REASONS:
            self.finished.labels(finished_reason=reason)
        self._lock = threading.Lock()
        self._seen = SpecStats()
        self._drafts = self._accepted = 0          # since the server started, over every engine
        self.mean_acceptance_length.set(1.0)

    def observe_spec(self, stats: SpecStats) -> None:
        """Add what ``stats`` (cumulative engine counters) gained since the previous call."""
        with self._lock:
            seen = self._seen
            if stats.num_steps < seen.num_steps:       # a new engine: counting restarts
                seen = self._seen = SpecStats()
            self.num_drafts.inc(stats.num_drafts - seen.num_drafts)
            self.num_draft_tokens.inc(stats.num_draft_tokens - seen.num_draft_tokens)
            self.num_accepted_tokens.inc(stats.num_accepted_tokens - seen.num_accepted_tokens)
            for i, n in enumerate(stats.accepted_per_pos):
                old = seen.accepted_per_pos[i] if i < len(seen.accepted_per_pos) else 0
                if n > old:
                    self.accepted_per_pos.labels(position=str(i + 1)).inc(n - old)
            self._drafts += stats.num_drafts - seen.num_drafts
            self._accepted += stats.num_accepted_tokens - seen.num_accepted_tokens
            self.mean_acceptance_length.set(1.0 + self._accepted / self._drafts if self._drafts else 1.0)
            self._seen = SpecStats(num_steps=stats.num_steps, num_drafts=stats.num_drafts,
                                   num_draft_tokens=stats.num_draft_tokens,
                                   num_accepted_tokens=stats.num_accepted_tokens,
                                   accepted_per_pos=list(stats.accepted_per_pos))

    def observe_prefix_cache(self, stats) -> None:
        """Add what ``stats`` (a ``PrefixCacheStats``, cumulative) gained since the previous call;
        set the bytes gauge."""
        with self._lock:
            q0, h0 = self._prefix_seen
            if stats.queries < q0:                     # another cache: counting restarts
                q0 = h0 = 0
            self.prefix_cache_queries.inc(stats.queries - q0)
            self.prefix_cache_hits.inc(stats.hits - h0)
            self._prefix_seen = (stats.queries, stats.hits)
            self.prefix_cache_bytes.set(stats.bytes_used)

    def observe_kv(self, used: int, total: int) -> None:
        """The paged pool's occupancy (``Engine.kv_usage``; static rows report 0 blocks)."""
        self.kv_blocks_total.set(total)
        self.kv_blocks_used.set(used)
        self.kv_usage.set(used / total if total else 0.0)

    def observe_compiled(self, forward) -> None:
        """Set the compile gauges from a ``models.compiled.CompiledForward`` (its process-wide counts)."""
        self.compiled_graphs.set(forward.graphs)
        self.compile_seconds.set(forward.compile_s)
        self.eager_forwards.set(forward.eager_calls)

    def set_acceptance(self, rule) -> None:
        """Report the engine's acceptance rule (an ``acceptance.AcceptanceRule``)."""
        self.lossy_acceptance.clear()
        self.lossy_acceptance.labels(rule=rule.name).set(1.0 if rule.lossy else 0.0)

    def reset_spec_baseline(self) -> None:
        """Call when the engine (and so its cumulative stats) is replaced."""
        with self._lock:
            self._seen = SpecStats()

    def observe_tokens(self, num_tokens: int, since_last_s: float | None, since_arrival_s: float) -> None:
        """One emission of ``num_tokens`` tokens to a request: TTFT on its first, ITL after."""
        if num_tokens <= 0:
            return
        self.generation_tokens.inc(num_tokens)
        if since_last_s is None:
            self.ttft.observe(since_arrival_s)
            num_tokens -= 1
            if num_tokens == 0:
                return
            since_last_s = 0.0
        per_token = since_last_s / num_tokens
        for _ in range(num_tokens):
            self.itl.observe(per_token)

    def observe_finished(self, reason: str, since_arrival_s: float) -> None:
        self.finished.labels(finished_reason=reason).inc()
        self.e2e.observe(since_arrival_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
