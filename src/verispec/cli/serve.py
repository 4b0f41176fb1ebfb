"""``verispec serve``: an OpenAI-compatible HTTP server with continuous batching and speculation.

``add_parser(subparsers)`` registers the subcommand (``func`` = ``cmd_serve``, returning an exit
code); ``main(argv)`` parses the same arguments standalone (``python -m verispec.serve``).
Exit codes: 0 after a clean shutdown, 2 for a bad argument or speculative config, 1 when the
model cannot be loaded or the server cannot start (e.g. the port is taken).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from typing import Callable, TypeVar

from ..models.device import add_device_argument, add_weights_argument
from ..core.kv_budget import PagedKV, pool_blocks
from ..models.paged_kv import BLOCK_SIZE
from ..serve.scheduler import DEFAULT_PREFILL_CHUNK, MIN_PREFILL_CHUNK

T = TypeVar("T")

DEFAULT_PREFIX_MB = 256.0     # the prefix cache is on by default
KV_SLACK = 64                 # slots a pool holds past max-model-len: a verify step's draft tree

POLICY_KEY = "num_speculative_tokens_per_batch_size"


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _non_negative_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _non_negative_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return v


def _prefill_chunk(text: str) -> int:
    v = _non_negative_int(text)
    if 0 < v < MIN_PREFILL_CHUNK:
        raise argparse.ArgumentTypeError(f"must be 0 (off) or at least {MIN_PREFILL_CHUNK}, got {v}")
    return v


def _positive_float(text: str) -> float:
    v = float(text)
    if not v > 0 or v != v or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="known model name, .gguf file or Hugging Face folder (default: smollm2-135m)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative_config as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; '
                        f'it may also hold "{POLICY_KEY}"')
    p.add_argument("--num-speculative-tokens-per-batch-size", default=None, metavar="POLICY",
                   help="a cap on the draft budget by batch size: 'auto' (none: the engine's draft-budget "
                        "estimator decides each request's budget from its acceptance and the batch's "
                        "measured costs; the default), 'static' (the same) or a JSON table "
                        "{batch_size: num_speculative_tokens}, e.g. '{\"1\": 4, \"8\": 2, \"16\": 0}'")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--max-num-seqs", type=_positive_int, default=8,
                   help="sequences decoded together in one batch (default: 8)")
    p.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="context per sequence, prompt plus output (default: the model's)")
    p.add_argument("--kv-cache-mb", type=_positive_float, default=None, metavar="MIB",
                   help="K/V memory of the paged KV cache, all sequences and the prefix cache together; a "
                        "request waits until its prompt plus max_tokens fit (default: room for max-num-seqs x "
                        "max-model-len tokens, host memory committed only as blocks are used)")
    p.add_argument("--paged-kv", action=argparse.BooleanOptionalAction, default=True,
                   help="KV cache in blocks of 16 tokens shared through block tables (default: on); "
                        "--no-paged-kv: one static row of max-model-len tokens per sequence")
    p.add_argument("--max-prompt-tokens", type=_positive_int, default=8192,
                   help="longest prompt accepted (default: 8192)")
    p.add_argument("--api-key", default=os.environ.get("VERISPEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $VERISPEC_API_KEY, unset = no auth)")
    p.add_argument("--max-queue", type=_non_negative_int, default=1024,
                   help="requests allowed to wait for a batch row; more get 429 (default: 1024)")
    p.add_argument("--request-timeout", type=_positive_float, default=None, metavar="SECONDS",
                   help="abort requests running longer than this (408); default: no limit")
    p.add_argument("--response-cache", type=_non_negative_int, default=0, metavar="N",
                   help="answer repeated temperature-0 requests from an LRU of N entries (default: 0, off)")
    p.add_argument("--prefix-cache-mb", type=_non_negative_float, default=None, metavar="MIB",
                   help="reuse the K/V of prompt and output token blocks for later prompts that start with "
                        "the same tokens (system prompts, chat history): only the rest is prefilled; counted "
                        "in /metrics. With the paged KV cache (default) the blocks are shared in the pool "
                        "and freed when it runs short, and this bounds the drafter features stored beside "
                        "them; with --no-paged-kv it bounds copied K/V and features. 0: off (default: "
                        f"{DEFAULT_PREFIX_MB:g})")
    p.add_argument("--prefix-cache-reuse", choices=("exact", "any"), default="exact",
                   help="exact (default): reuse whole 512-token chunks of prefilled prompts only (long shared "
                        "system prompts, documents), every answer bit-identical to a cold prefill's; any: every "
                        "cached block, a chat's earlier answers too, where a near-tie token may differ")
    p.add_argument("--prefix-cache-block-size", type=_positive_int, default=None, metavar="TOKENS",
                   help="tokens per prefix-cache block; only whole blocks are reused (default: the paged KV "
                        f"cache's {BLOCK_SIZE}-slot blocks, which it shares; 16 with --no-paged-kv)")
    p.add_argument("--dtype", default="float32", help="weights dtype: float32, bfloat16, float16")
    add_weights_argument(p)
    add_device_argument(p)
    p.add_argument("--num-threads", type=_positive_int, default=None, help="torch CPU threads")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="run the decode and verify forwards through torch.compile (default: on; the graphs "
                        "are compiled by a warm-up before /ready turns true, once per process, and inductor "
                        "keeps its kernels on disk for the next start)")
    p.add_argument("--prefill-chunk", type=_prefill_chunk, default=DEFAULT_PREFILL_CHUNK, metavar="TOKENS",
                   help="chunked prefill: prompt tokens prefilled per scheduling round while other requests "
                        f"decode, at least {MIN_PREFILL_CHUNK}; 0: each prompt whole at admission, stalling "
                        f"the running streams (default: {DEFAULT_PREFILL_CHUNK})")
    p.add_argument("--shutdown-grace", type=_positive_float, default=10.0, metavar="SECONDS",
                   help="on shutdown, time given to running requests to finish (default: 10)")
    p.add_argument("--prompt-denylist", default=None, metavar="FILE",
                   help="regular expressions, one per line (# comments): a prompt or chat message matching "
                        "one is refused with 400 prompt_denied (counted in /metrics)")
    p.add_argument("--audit-log", default=None, metavar="FILE",
                   help="append one JSON line per request: id, path, API-key hash, status, token counts, latency")
    p.add_argument("--audit-log-prompts", action="store_true", help="also write the prompt text to the audit log")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def add_parser(subparsers) -> None:
    """Register ``serve`` on an argparse ``subparsers`` object."""
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible server (continuous batching, speculation, metrics)",
        description="Serve /v1/completions, /v1/chat/completions (streaming too), /v1/models, "
                    "/health and Prometheus /metrics. Requests join the running batch between "
                    "decoding steps; speculation shrinks as the batch grows.")
    add_arguments(p)
    p.set_defaults(func=cmd_serve)


def split_spec_config(text: str | None, policy_flag: str | None) -> tuple[dict | None, str | dict | None]:
    """(speculative_config without the policy key, policy value); the flag wins over the key."""
    if text is None:
        return None, policy_flag
    spec = json.loads(text)
    if not isinstance(spec, dict):
        raise ValueError("--speculative-config must be a JSON object")
    policy = spec.pop(POLICY_KEY, None)
    return spec, policy_flag if policy_flag is not None else policy


class _BadSetting(ValueError):
    """A setting that only shows itself wrong once the model is loaded (exit status 2)."""


def off_main_thread(build: Callable[[], T]) -> T:
    """``build()`` run in a thread that ends when it returns; its result, or its exception re-raised.

    Why: libgomp keeps a pool of worker threads for each thread that starts a parallel region,
    for that thread's whole life. Loading a model, packing its weights and sizing its caches run
    parallel regions. Run on the main thread, which then serves uvicorn's event loop, they would
    leave a second pool beside the scheduler thread's. With more OpenMP threads than cores,
    libgomp cuts its workers' spin-wait short, and each parallel region of a decoding step then
    pays a sleeping worker's wake-up. One SmolLM2 stream (int4, compiled, 2 cores) ran at 80
    tokens/s with the model built on the main thread and at 189-192 with it built here, against
    191-203 in-process (``LLM.chat``). A thread's pool goes when the thread ends, so the
    scheduler thread owns the only one.

    With that one pool, OpenMP's default spin-wait beats ``OMP_WAIT_POLICY=PASSIVE``, which the
    server used to set: closed-loop tokens/s at 1 / 8 / 32 users were 143-177 / 447-481 / 495-552
    spinning against 133-138 / 322-332 / 331-349 passive (two fresh servers each, interleaved)."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = build()
        except BaseException as e:   # noqa: BLE001 - handed to the caller
            box["error"] = e

    thread = threading.Thread(target=run, name="verispec-load")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the model and build the app (``off_main_thread``), then run uvicorn until interrupted.
    OpenMP keeps its default spin-wait policy unless ``OMP_WAIT_POLICY`` says otherwise."""
    try:
        import uvicorn

        from ..serve import app as _app  # noqa: F401 - the server extras are installed
    except ImportError as e:
        print(f"verispec serve: {e}; install the server extras: pip install 'verispec[serve]'", file=sys.stderr)
        return 1
    from ..serve.policy import parse_policy
    from ..drafting.spec_config import SpecConfigError, SpeculativeConfig
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        spec, policy_value = split_spec_config(args.speculative_config, args.num_speculative_tokens_per_batch_size)
        SpeculativeConfig.from_dict(spec)
        policy = parse_policy(policy_value) if spec is not None else None
        if spec is None and policy_value is not None:
            print("verispec serve: --num-speculative-tokens-per-batch-size ignored without "
                  "--speculative-config", file=sys.stderr)
    except (ValueError, SpecConfigError) as e:
        print(f"verispec serve: bad speculation settings: {e}", file=sys.stderr)
        return 2
    try:
        from ..serve.security import PromptDenylist
        denylist = PromptDenylist.from_file(args.prompt_denylist) if args.prompt_denylist else None
    except ValueError as e:
        print(f"verispec serve: {e}", file=sys.stderr)
        return 2
    prefix_mb = DEFAULT_PREFIX_MB if args.prefix_cache_mb is None else args.prefix_cache_mb
    prefix_block = args.prefix_cache_block_size or (BLOCK_SIZE if args.paged_kv else 16)
    if args.paged_kv and prefix_block != BLOCK_SIZE and prefix_mb:
        print(f"verispec serve: the prefix cache shares the paged KV cache's {BLOCK_SIZE}-slot blocks; "
              "drop --prefix-cache-block-size or use --no-paged-kv", file=sys.stderr)
        return 2
    try:
        llm, kv, app = off_main_thread(lambda: _build(args, spec, policy, denylist, prefix_mb, prefix_block))
    except _BadSetting as e:
        print(f"verispec serve: {e}", file=sys.stderr)
        return 2
    except Exception as e:          # noqa: BLE001 - any loading failure ends the command
        print(f"verispec serve: cannot load {args.model!r}: {e}", file=sys.stderr)
        return 1
    from ..serve.drain import DrainingServer
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=int(args.shutdown_grace) + 1,
                                           access_log=args.log_level == "debug"), app.state.server, args.shutdown_grace)
    logging.getLogger("verispec.serve").info(
        "serving %s on http://%s:%d (device=%s, weights=%s, compile=%s, max_num_seqs=%d, max_model_len=%d, "
        "speculation=%s, policy=%s, prefix_cache_mb=%g, kv=%s); /ready after the warm-up", args.model, args.host,
        args.port, llm.device, llm.target.weights.value, args.compile, args.max_num_seqs, llm.max_model_len,
        llm.spec.as_dict() if llm.spec else None, type(policy).__name__ if policy else "estimator", prefix_mb,
        f"paged, {kv.blocks} blocks of {kv.block_size}" if kv else "static rows")
    server.run()
    return 0 if server.started else 1


def _build(args, spec, policy, denylist, prefix_mb: float, prefix_block: int):
    """The model, its paged KV setting and the app, as ``cmd_serve`` runs them (``off_main_thread``)."""
    from .. import LLM
    from ..serve.app import ServeConfig, create_app
    llm = LLM(args.model, dtype=args.dtype, weights=args.weights, speculative_config=spec,
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, num_threads=args.num_threads,
              prefix_cache_mb=prefix_mb, prefix_cache_block_size=prefix_block,
              prefix_cache_exact=args.prefix_cache_reuse == "exact", device=args.device, compile=args.compile)
    try:
        kv = _paged_kv(args, llm)
    except ValueError as e:
        raise _BadSetting(str(e)) from e
    cfg = ServeConfig(model_name=args.model, max_num_seqs=args.max_num_seqs, max_model_len=llm.max_model_len,
                      max_prompt_tokens=args.max_prompt_tokens, api_key=args.api_key or None,
                      max_queue=args.max_queue, request_timeout=args.request_timeout,
                      response_cache=args.response_cache, policy=policy, shutdown_grace_s=args.shutdown_grace,
                      prompt_denylist=denylist, audit_log=args.audit_log, audit_log_prompts=args.audit_log_prompts,
                      warmup=True, prefill_chunk=args.prefill_chunk or None, kv=kv)
    return llm, kv, create_app(llm, cfg)


def _paged_kv(args, llm) -> PagedKV | None:
    """The paged pool (None: static rows), sized by ``--kv-cache-mb`` and then committed at start,
    else sized for max-num-seqs x max-model-len and committed as used; it must hold one sequence of
    max-model-len tokens plus the drafter's slack."""
    if not args.paged_kv:
        if args.kv_cache_mb is not None:
            raise ValueError("--kv-cache-mb sizes the paged KV cache: drop it or --no-paged-kv")
        return None
    model = llm.target.model
    blocks = pool_blocks(model.cfg, next(model.parameters()).dtype, args.kv_cache_mb, args.max_num_seqs,
                         llm.max_model_len + KV_SLACK)
    return PagedKV(blocks, BLOCK_SIZE, preallocate=args.kv_cache_mb is not None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verispec serve", description="OpenAI-compatible verispec server")
    add_arguments(parser)
    return cmd_serve(parser.parse_args(argv))
