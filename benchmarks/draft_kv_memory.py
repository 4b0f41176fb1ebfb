"""A draft model's KV cache in a paged engine: memory held against static rows, same outputs.

A server-sized engine (``--max-num-seqs`` rows of ``--max-model-len`` tokens) of the target with a
draft model (``draft_model``; by default the target's own first ``--draft-layers`` layers, so no
second checkpoint is needed) decodes ``--users`` Spec-Bench first turns at once, greedy. Each
kind runs in a fresh process, so its resident memory is its own:

- ``static``: static target rows and static draft rows (``--no-paged-kv``);
- ``paged-target``: the target's paged pool (the server's default) beside static draft rows (the
  server before the draft model's cache was paged);
- ``paged``: the target's paged pool and the draft model's own paged cache.

Reported per kind: the resident memory (RSS) added by building the engine and then by decoding,
the peak, the draft cache's K/V bytes held (static: every row at full length; paged: its blocks in
use at the end of the busiest step) and the outputs, which must be identical.

    python benchmarks/draft_kv_memory.py [--max-num-seqs 32] [--max-model-len 2048] [--users 8]
Writes benchmarks/results/draft_kv_memory.{json,md}.
"""
from __future__ import annotations

import argparse

from verispec.bench import harness

KINDS = ("static", "paged-target", "paged")


def _rss_mb(field: str = "VmRSS") -> float:
    value = harness.proc_status_mb(field)
    if value is None:
        raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")
    return round(value, 1)


def _cache_mb(cache, peak_blocks: int | None = None) -> float:
    """K/V bytes the cache holds: a static cache all of it, a paged one its blocks in use."""
    if getattr(cache, "paged", False):
        return round((peak_blocks if peak_blocks is not None else cache.num_used_blocks)
                     * cache.bytes_per_block / 2**20, 1)
    return round(sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v)) / 2**20, 1)


def measure_kind(args: argparse.Namespace, kind: str) -> dict:
    """One kind in this process (the child of ``measure``)."""
    import torch

    from verispec import LLM, SamplingParams
    from verispec.core.engine import Sequence
    from verispec.core.kv_budget import PagedKV, pool_blocks
    from verispec.data import per_category, spec_bench_questions
    from verispec.models.paged_kv import BLOCK_SIZE
    torch.set_num_threads(args.num_threads)
    spec = {"method": "draft_model", "model": "self", "self_draft_layers": args.draft_layers,
            "num_speculative_tokens": 3, "adaptive_drafting": False}     # drafting every step: a cache in use
    llm = LLM(model=args.model, weights=args.weights, speculative_config=spec)
    tok, model = llm.tokenizer, llm.target.model
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False).input_ids
               for q in per_category(spec_bench_questions(), 1)][:args.users]
    kv = None if kind == "static" else PagedKV(
        pool_blocks(model.cfg, next(model.parameters()).dtype, None, args.max_num_seqs, args.max_model_len + 64),
        BLOCK_SIZE)
    if kind == "paged-target":
        llm._make_drafter.takes_kv = False          # the draft model's cache as it was: static rows
    before = _rss_mb()
    engine = llm.make_engine(args.max_num_seqs, args.max_model_len, kv=kv)
    built = _rss_mb()
    seqs = [Sequence(prompt_ids=p, params=SamplingParams(temperature=0.0, max_tokens=args.max_tokens)) for p in prompts]
    waiting, peak = list(seqs), 0
    with torch.inference_mode():
        while waiting or engine.running:
            if waiting and engine.free_rows:
                batch, waiting = waiting[:len(engine.free_rows)], waiting[len(engine.free_rows):]
                engine.add_many(batch)
            engine.step()
            if getattr(engine.drafter.cache, "paged", False):
                peak = max(peak, engine.drafter.cache.num_used_blocks)
    return {"kind": kind, "rss_before_engine_mb": before, "engine_mb": round(built - before, 1),
            "decoding_mb": round(_rss_mb() - built, 1), "peak_rss_mb": _rss_mb("VmHWM"),
            "draft_cache_mb": _cache_mb(engine.drafter.cache, peak if kv is not None else None),
            "draft_cache_paged": bool(getattr(engine.drafter.cache, "paged", False)),
            "draft_tokens": engine.stats.num_draft_tokens, "accepted_tokens": engine.stats.num_accepted_tokens,
            "output_tokens": sum(len(s.output_ids) for s in seqs), "outputs": [s.output_ids for s in seqs]}


def measure(args: argparse.Namespace) -> dict:
    """Each kind in a fresh process of this script (``harness.in_fresh_process``)."""
    out = {"settings": harness.settings(args), "kinds": {}}
    for kind in KINDS:
        out["kinds"][kind] = harness.in_fresh_process(__file__, kind)
    outputs = [k.pop("outputs") for k in out["kinds"].values()]
    out["outputs_identical"] = all(o == outputs[0] for o in outputs)
    return out


def markdown(r: dict) -> str:
    s = r["settings"]
    lines = [f"Engine of {s['max_num_seqs']} rows x {s['max_model_len']} tokens, `{s['model']}` ({s['weights']} "
             f"weights, eager) with a draft model of its first {s['draft_layers']} layers (3-token chains every step); "
             f"{s['users']} Spec-Bench first turns at once, {s['max_tokens']} tokens, greedy, "
             f"{s['num_threads']} threads. Each kind ran in a fresh process.", "",
             "| KV caches | RSS added by the engine MiB | by decoding MiB | peak RSS MiB | draft cache K/V held MiB "
             "| draft tokens | accepted |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, k in r["kinds"].items():
        lines.append(f"| {name} | {k['engine_mb']} | {k['decoding_mb']} | {k['peak_rss_mb']} | {k['draft_cache_mb']} "
                     f"| {k['draft_tokens']} | {k['accepted_tokens']} |")
    lines += ["", f"Outputs identical between the kinds: {r['outputs_identical']}.", "",
              "The static draft cache holds every row at full length from the start; the paged one holds "
              "the blocks of the tokens in use (the peak over the run), and gives a row's blocks back "
              "when its request ends."]
    return "\n".join(lines)


OUTPUT = harness.Output("draft_kv_memory", "A draft model's KV cache: paged against static rows", markdown,
                        model="smollm2-135m", per_model=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--draft-layers", type=int, default=24, help="the self-draft's layers (below the target's 30)")
    p.add_argument("--weights", default="auto")
    p.add_argument("--num-threads", type=int, default=2)
    return harness.main_with_children(OUTPUT, p, measure, measure_kind, argv)


if __name__ == "__main__":
    raise SystemExit(main())
