"""Prefix caching on a multi-turn chat: TTFT and tokens/s with and without the cache, same run.

A support-assistant conversation with the real chat template: a long system prompt (~700 tokens)
and several user turns, each turn's prompt holding the whole history (earlier answers included,
as a chat client sends it), then a second user's first turn (same system prompt). Every turn is
decoded greedily by two LLMs on one loaded target, interleaved: ``prefix_cache_mb=0`` and
``prefix_cache_mb=--cache-mb``. Outputs must be identical (the cache is lossless).

Store vs rebuild: for each drafter (ngram, EAGLE-1 and EAGLE-3 shipped heads, self-draft draft
model) a ~740-token prompt is admitted into one engine with a prefix cache, once (a miss) and
three more times (hits). Timed: the target prefill, the drafter's ``start`` (given the
full prompt's features) and its first ``propose`` (which catches up over the prompt: the rebuild
of its prefix state), against a steady-state ``propose``.

    python benchmarks/prefix_cache.py [--turns 4] [--max-tokens 48] [--threads 2]
Writes benchmarks/results/prefix_cache.{json,md}.
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # no spinning threads on shared cores
import statistics
import time

import torch

from verispec import LLM, SamplingParams  # noqa: E402
from verispec.bench import harness  # noqa: E402
from verispec.core.engine import Sequence  # noqa: E402
from verispec.models.loading import load_model  # noqa: E402

SYSTEM = """You are Verity, the customer support assistant of Northwind Outfitters, an online shop \
for hiking, climbing and camping gear based in Freiburg, Germany. You help customers with orders, \
returns, repairs, shipping and product advice. Always be friendly, precise and brief: answer the \
question first, then give the one or two details the customer needs next. Never invent order \
numbers, prices or delivery dates; when you do not know something, say so and offer to hand the \
conversation to a human colleague.

Returns. Unused items in their original packaging can be returned within 30 days of delivery for \
a full refund. The customer starts a return in their account under "My orders" or by writing to \
returns@northwind.example with the order number. We send a prepaid return label for orders inside \
Germany and Austria; customers in other countries pay the return shipping themselves unless the \
item is faulty. Refunds go back to the original payment method within five working days after the \
parcel arrives at our warehouse. Sale items marked "final sale" cannot be returned.

Warranty and repairs. Every item has a two-year legal warranty. Tents, backpacks and sleeping bags \
of our own brand, Northwind Trail, carry a lifetime repair promise: we repair seams, zips, buckles \
and poles for free for as long as the product exists, and we replace it when a repair is not \
possible. A proof of purchase is needed: the receipt, the order confirmation email or the order \
number is enough. Damage from accidents, fire or misuse is repaired at cost; we send a quote first. \
Replacement poles for Northwind Trail tents ship within two working days from stock.

Shipping. Orders placed before 2 pm on a working day leave the warehouse the same day. Delivery \
inside Germany takes one to two working days, to Austria, the Netherlands, Belgium, Luxembourg and \
Denmark two to three, to France, Italy, Spain and the other EU countries three to five. Shipping is \
free for orders over 50 euros; below that it costs 4.90 euros in Germany and 8.90 euros elsewhere \
in the EU. We do not ship outside the European Union. Every parcel has a tracking number, sent by \
email when it leaves the warehouse.

Product advice. When customers ask for recommendations, ask at most one clarifying question, then \
suggest at most two products from our range and say why they fit. Sleeping bags: the Trail 700 \
(comfort temperature 5 degrees, 950 grams, 189 euros) for summer and mild autumn nights, and the \
Trail 1000 (comfort minus 4 degrees, 1,350 grams, 279 euros) for autumn and spring in the mountains. \
Tents: the Trail Duo (two people, 2.1 kilograms, 349 euros) and the Trail Solo (one person, 1.3 \
kilograms, 259 euros). Stoves: the Ember gas stove (39 euros). Always mention that sizes and \
temperatures are guidance, and that a sleeping mat with a good insulation value matters as much \
as the bag.

Privacy. Never ask for full payment card numbers or passwords. You may ask for the order number, \
the name on the order and the delivery postcode to find an order."""

TURNS = ["Hi! I bought a Trail Duo tent last month and one of the poles cracked on the second night. "
         "What can I do?",
         "I don't have the paper receipt any more, only the order confirmation email. Is that enough?",
         "Good. How long would a replacement pole take to reach me in Lyon?",
         "Great, thanks. Can you also recommend a sleeping bag for camping in the Alps in October?",
         "Which sleeping mat would you pair with it?",
         "Last question: can I return the bag if it turns out too warm?"]
OTHER_USER = "Do you ship to Switzerland?"
DRAFTERS = {"ngram": {"method": "ngram", "num_speculative_tokens": 4},
            "eagle (EAGLE-1 head)": {"method": "eagle"},
            "eagle3 (EAGLE-3 head)": {"method": "eagle3"},
            "draft_model (self-draft, 8 layers)": {"method": "draft_model", "model": "self",
                                                   "self_draft_layers": 8, "num_speculative_tokens": 3}}


def chat_ids(llm: LLM, messages: list[dict]) -> list[int]:
    return llm.tokenizer(llm.apply_chat_template(messages), add_special_tokens=False).input_ids


def one_request(llm: LLM, ids: list[int], max_tokens: int) -> dict:
    hits0 = llm.prefix_cache.stats().hits if llm.prefix_cache else 0
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
    m = out.metrics
    decode_s = m.time_s - m.time_to_first_token_s
    return {"prompt_tokens": len(ids), "output_tokens": m.num_output_tokens, "ttft_s": m.time_to_first_token_s,
            "time_s": m.time_s, "tokens_per_s": m.tokens_per_second,
            "decode_tokens_per_s": (m.num_output_tokens - 1) / decode_s if decode_s > 0 else 0.0,
            "hit_tokens": (llm.prefix_cache.stats().hits - hits0) if llm.prefix_cache else 0,
            "token_ids": out.token_ids, "text": out.text}


def conversation(target, turns: int, max_tokens: int, cache_mb: float) -> list[dict]:
    """Each turn decoded by the plain and the cached LLM back to back; the history grows with the
    (identical) answers."""
    plain, cached = LLM(loaded=target), LLM(loaded=target, prefix_cache_mb=cache_mb)
    history = [{"role": "system", "content": SYSTEM}]
    rows = []
    asks = [("user A", q) for q in TURNS[:turns]] + [("user B", OTHER_USER)]
    for i, (who, question) in enumerate(asks):
        msgs = (history if who == "user A" else [history[0]]) + [{"role": "user", "content": question}]
        ids = chat_ids(plain, msgs)
        off = one_request(plain, ids, max_tokens)
        on = one_request(cached, ids, max_tokens)
        if on["token_ids"] != off["token_ids"]:
            raise AssertionError(f"turn {i + 1}: output with the cache differs from output without it")
        rows.append({"turn": i + 1, "who": who, "off": _strip(off), "on": _strip(on)})
        print(f"{who} turn {i + 1}: {len(ids)} prompt tokens, TTFT {off['ttft_s']:.2f} s -> {on['ttft_s']:.2f} s "
              f"({on['hit_tokens']} cached), {off['tokens_per_s']:.1f} -> {on['tokens_per_s']:.1f} tok/s", flush=True)
        if who == "user A":
            history = msgs + [{"role": "assistant", "content": off["text"]}]
    st = cached.prefix_cache.stats()
    rows.append({"cache": {"queries": st.queries, "hits": st.hits, "blocks": st.num_blocks,
                           "bytes_used": st.bytes_used, "evicted_blocks": st.evicted_blocks}})
    return rows


def _strip(r: dict) -> dict:
    return {k: v for k, v in r.items() if k not in ("token_ids", "text")}


class _Timed:
    """Wraps a callable; records each call's seconds."""

    def __init__(self, fn):
        self.fn, self.times = fn, []

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.times.append(time.perf_counter() - t0)


def store_vs_rebuild(target, name: str, spec: dict, ids: list[int], hits: int = 3, steps: int = 5) -> dict:
    """A miss then ``hits`` hits of ``ids`` in one engine: target prefill, copy-in, insert,
    drafter start, first propose and the median of the next ``steps - 1`` (seconds; hit values
    are medians over the hits)."""
    llm = LLM(loaded=target, speculative_config=spec, prefix_cache_mb=256)
    pc = llm.prefix_cache
    eng = llm.make_engine(1, len(ids) + 64)
    prefill, start = _Timed(eng._prefill), _Timed(eng.drafter.start)
    propose, load, insert = _Timed(eng.drafter.propose), _Timed(eng._load_prefix), _Timed(pc.insert)
    eng._prefill, eng.drafter.start, eng.drafter.propose = prefill, start, propose
    eng._load_prefix, pc.insert = load, insert
    runs = []
    for _ in range(1 + hits):
        n0, i0, hits0 = len(propose.times), len(insert.times), pc.stats().hits
        seq = Sequence(list(ids), SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
        eng.add(seq)
        for _ in range(steps):
            eng.step()
        eng.abort(seq)
        runs.append({"prefill_s": prefill.times[-1], "start_s": start.times[-1], "copy_in_s": load.times[-1],
                     "insert_prompt_s": insert.times[i0], "insert_at_retirement_s": insert.times[i0 + 1],
                     "first_propose_s": propose.times[n0],
                     "steady_propose_s": statistics.median(propose.times[n0 + 1:]),
                     "hit_tokens": pc.stats().hits - hits0})
    out = {"miss": runs[0], "hit": {k: statistics.median(r[k] for r in runs[1:]) for k in runs[1]}}
    h = out["hit"]
    print(f"{name}: prefill {out['miss']['prefill_s']:.2f} s (miss) vs {h['prefill_s']:.2f} s (hit, "
          f"{h['hit_tokens']:.0f} cached, copy-in {h['copy_in_s'] * 1e3:.0f} ms, prompt insert "
          f"{out['miss']['insert_prompt_s'] * 1e3:.0f} ms); start {h['start_s'] * 1e3:.1f} ms, first propose "
          f"{h['first_propose_s'] * 1e3:.0f} ms, steady propose {h['steady_propose_s'] * 1e3:.0f} ms", flush=True)
    return out


def summary(rows: list[dict]) -> dict:
    turns = [r for r in rows if "turn" in r]
    repeat = [r for r in turns if r["on"]["hit_tokens"] > 0]
    med = lambda key, side, rs: statistics.median(r[side][key] for r in rs)  # noqa: E731
    return {"turns": len(turns), "turns_with_hits": len(repeat),
            "ttft_off_median_s": med("ttft_s", "off", repeat), "ttft_on_median_s": med("ttft_s", "on", repeat),
            "tokens_per_s_off_median": med("tokens_per_s", "off", repeat),
            "tokens_per_s_on_median": med("tokens_per_s", "on", repeat),
            "decode_tokens_per_s_off_median": med("decode_tokens_per_s", "off", repeat),
            "decode_tokens_per_s_on_median": med("decode_tokens_per_s", "on", repeat)}


def render(res: dict) -> str:
    s = res["summary"]
    lines = ["The machine is shared with other jobs: absolute times are noisy, with/without pairs run back to "
             f"back. SmolLM2-135M fp32, "
             f"greedy, {res['max_tokens']} new tokens per turn, block size 16, cache {res['cache_mb']:g} MiB. "
             f"Outputs with and without the cache identical on every turn: {res['identical']}. "
             f"Total run {res['total_s']:.0f} s.", "",
             f"Median over the {s['turns_with_hits']} turns that hit: TTFT **{s['ttft_off_median_s']:.2f} s -> "
             f"{s['ttft_on_median_s']:.2f} s**, request tokens/s {s['tokens_per_s_off_median']:.1f} -> "
             f"{s['tokens_per_s_on_median']:.1f} (decode only: {s['decode_tokens_per_s_off_median']:.1f} -> "
             f"{s['decode_tokens_per_s_on_median']:.1f}).", "",
             "| turn | who | prompt tokens | cached tokens | TTFT off (s) | TTFT on (s) | tok/s off | tok/s on |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["conversation"]:
        if "turn" in r:
            off, on = r["off"], r["on"]
            lines.append(f"| {r['turn']} | {r['who']} | {off['prompt_tokens']} | {on['hit_tokens']} | "
                         f"{off['ttft_s']:.2f} | {on['ttft_s']:.2f} | {off['tokens_per_s']:.1f} | {on['tokens_per_s']:.1f} |")
    c = res["conversation"][-1]["cache"]
    lines += ["", f"Cache after the run: {c['blocks']} blocks, {c['bytes_used'] / 2**20:.1f} MiB, {c['hits']} of "
              f"{c['queries']} prompt tokens served from it (tok/s counts output tokens over the whole request, "
              "TTFT included).", "",
              "## Store vs rebuild: drafter state after a hit", "",
              f"A {res['rebuild_prompt_tokens']}-token prompt admitted into one engine with a prefix cache: once "
              "(a miss), then three times (hits; medians shown). "
              "Drafter state is not stored: each drafter is rebuilt by its own `start` with the full prompt's "
              "target features, and its first `propose` catches up over the prompt. Copy-in: lookup and "
              "copying the cached blocks into the row; insert: copying the prompt's new blocks out after the "
              "miss's prefill.", "",
              "| drafter | target prefill, miss (s) | target prefill, hit (s) | cached tokens | copy-in (ms) | "
              "insert, miss (ms) | start (ms) | first propose (ms) | steady propose (ms) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in res["store_vs_rebuild"].items():
        h = r["hit"]
        lines.append(f"| {name} | {r['miss']['prefill_s']:.2f} | {h['prefill_s']:.2f} | {h['hit_tokens']:.0f} | "
                     f"{h['copy_in_s'] * 1e3:.0f} | {r['miss']['insert_prompt_s'] * 1e3:.0f} | {h['start_s'] * 1e3:.1f} | {h['first_propose_s'] * 1e3:.0f} | {h['steady_propose_s'] * 1e3:.0f} |")
    lines += ["", "Reading: the first propose minus a steady one is the rebuild a stored drafter state would save; "
              "it is small next to the target prefill the cache saves for n-gram and the one-layer EAGLE heads, "
              "and largest for the 8-layer self-draft model."]
    return "\n".join(lines)


OUT = harness.Output("prefix_cache", "Prefix cache: multi-turn chat TTFT and tokens/s, with and without the cache",
                     render)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--cache-mb", type=float, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = OUT.parse(ap)
    if args is None:
        return
    torch.set_num_threads(args.threads)
    machine = harness.machine_record()
    t0 = time.perf_counter()
    target = load_model("smollm2-135m", dtype="float32")
    rows = conversation(target, args.turns, args.max_tokens, args.cache_mb)
    helper = LLM(loaded=target)
    ids = chat_ids(helper, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}])
    rebuild = {name: store_vs_rebuild(target, name, spec, ids) for name, spec in DRAFTERS.items()}
    res = {"machine": machine, "max_tokens": args.max_tokens, "cache_mb": args.cache_mb,
           "identical": True, "conversation": rows, "summary": summary(rows),
           "rebuild_prompt_tokens": len(ids), "store_vs_rebuild": rebuild,
           "total_s": time.perf_counter() - t0}
    print(OUT.write(res, args.out).read_text())


if __name__ == "__main__":
    main()
