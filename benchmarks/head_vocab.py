"""Heads over a cut draft vocabulary: what a proposal costs and what acceptance it keeps.

For the shipped SmolLM2 heads (fp16-packed target, 2 threads) this measures, with and without
their folder's ``draft_vocab.safetensors``:
- the drafting cost: EAGLE-3's fixed work per step and one level over w nodes
  (``drafters.eagle.draft_costs``), Medusa's one proposal (``drafters.medusa.draft_cost``);
  fastest of several timings, the variants interleaved;
- acceptance on held-out on-policy conversations (the 5% split the trainers hold out):
  Medusa's top-1 / top-2 hit rate per depth against the data's next tokens (teacher-forced), and
  EAGLE-3's accepted tokens per engine step as a chain of 3 (greedy, 64 tokens per prompt),
  whose outputs must equal the full head's (lossless either way).

    python benchmarks/head_vocab.py --data /work/runs/regen/sharegpt-regen.shard{0,1}of2.jsonl

Results: ``benchmarks/results/head_vocab.{json,md}``.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from verispec.bench import harness

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent / "checkpoints"


def heldout(tok, data: list[str], limit: int, max_length: int):
    from verispec.train.data import load_conversations, split_ids, tokenize_all
    convs = []
    for p in data:
        convs += load_conversations(p, limit)[0]
    _, held = split_ids(convs, 0.05)
    return held, tokenize_all(tok, held, max_length)


def medusa_hits(target, examples, cut: bool) -> dict:
    """Top-1 / top-2 hit rate per head on held-out sequences (labels: the data's tokens)."""
    from verispec.drafting.draft_vocab import load_draft_vocab
    from verispec.formats import load_medusa_heads
    folder = ROOT / "smollm2-135m-medusa"
    heads = load_medusa_heads(folder, target.model)
    keep = load_draft_vocab(folder / "draft_vocab.safetensors", heads.cfg.vocab_size).t2d if cut else None
    k_heads = heads.cfg.num_heads
    hits, count = torch.zeros(k_heads, 2), torch.zeros(k_heads)
    with torch.no_grad():
        for e in examples:
            ids = torch.tensor([e.input_ids])
            t = ids.shape[1]
            f = target.model(ids, torch.arange(t)[None], compute_logits=False).last_hidden[0]
            logits = heads(f.float())                                   # [T, K, V]
            if keep is not None:
                logits = logits.masked_fill(~keep, float("-inf"))
            mask = torch.tensor(e.loss_mask).bool()
            for k in range(k_heads):
                src = torch.arange(max(0, t - 2 - k))                  # head k at t predicts x_{t+2+k}
                lab, m = ids[0, src + 2 + k], mask[src + 2 + k]
                top = logits[src, k][m].topk(2, -1).indices
                count[k] += int(m.sum())
                hits[k, 0] += (top[:, 0] == lab[m]).sum()
                hits[k, 1] += (top == lab[m][:, None]).any(-1).sum()
    return {"top1": [round(x, 4) for x in (hits[:, 0] / count).tolist()],
            "top2": [round(x, 4) for x in (hits[:, 1] / count).tolist()], "positions": int(count[0])}


def eagle3_acceptance(target, prompts: list[list[int]], vocab: str) -> dict:
    from verispec import LLM, SamplingParams
    llm = LLM(loaded=target, speculative_config={"method": "eagle3", "num_speculative_tokens": 3,
                                                 "draft_vocab": vocab})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=64))
    acc = sum(o.metrics.num_accepted_tokens for o in outs) / sum(o.metrics.num_steps for o in outs)
    return {"accepted_per_step": round(acc, 4), "outputs": [o.token_ids for o in outs]}


def costs(target, reps: int, rounds: int) -> dict:
    from verispec.drafting.draft_vocab import load_draft_vocab
    from verispec.drafting.eagle import draft_costs
    from verispec.drafting.eagle_head import HeadKind
    from verispec.drafting.medusa import draft_cost
    from verispec.formats import load_eagle_head, load_medusa_heads
    e3_folder, md_folder = ROOT / "smollm2-135m-eagle3", ROOT / "smollm2-135m-medusa"
    made = {}
    for cut in (False, True):
        e3 = load_eagle_head(e3_folder, target.model, HeadKind.EAGLE3)
        md = load_medusa_heads(md_folder, target.model)
        if cut:
            e3.restrict_vocab_(load_draft_vocab(e3_folder / "draft_vocab.safetensors", e3.cfg.vocab_size).draft_ids)
            md.restrict_vocab_(load_draft_vocab(md_folder / "draft_vocab.safetensors", md.cfg.vocab_size).draft_ids)
        e3.pack_("fp16", target.model.lm_head)
        md.pack_("fp16", target.model.lm_head)
        made["cut" if cut else "full"] = (e3, md)
    def both(e3, md):
        return lambda: (draft_costs(e3, reps=reps), draft_cost(md, reps=reps))
    runs = harness.interleave({k: both(e3, md) for k, (e3, md) in made.items()}, rounds, timed=False)
    out = {}
    for k, (e3, md) in made.items():
        levels = [dict(e3_costs[1]) for e3_costs, _ in runs[k]]
        out[k] = {"eagle3_vocab": e3.lm_head.out_features,
                  "medusa_vocab": md.vocab_ids.numel() if md.vocab_ids is not None else md.cfg.vocab_size,
                  "eagle3_fixed_ms": round(min(e3_costs[0] for e3_costs, _ in runs[k]), 3),
                  "eagle3_level_ms": {w: round(min(d[w] for d in levels), 3) for w in levels[0]},
                  "medusa_ms": round(min(ms for _, ms in runs[k]), 3)}
    return out


def render(res: dict) -> str:
    c, a = res["costs"], res["acceptance"]
    lines = [
        f"SmolLM2-135M fp16-packed, {res['threads']} threads, batch 1; load average (1, 5, 15 min) {res['load']} "
        f"at the start, {res.get('load_end', '?')} at the end.", "",
        "## Drafting cost (fastest of the interleaved timings, ms)", "",
        "| projection | EAGLE-3 ids | EAGLE-3 fixed | EAGLE-3 level w=1 | w=2 | w=4 | w=8 | Medusa ids | Medusa proposal |",
        "|---|---|---|---|---|---|---|---|---|"]
    for k, r in c.items():
        lv = {int(w): ms for w, ms in r["eagle3_level_ms"].items()}      # JSON made the keys strings
        lines.append(f"| {k} | {r['eagle3_vocab']} | {r['eagle3_fixed_ms']} | {lv[1]} | {lv[2]} | {lv[4]} | {lv[8]} | "
                     f"{r['medusa_vocab']} | {r['medusa_ms']} |")
    lines += ["", f"## Held-out acceptance ({a['conversations']} held-out on-policy conversations)", "",
              "| head | full | cut |", "|---|---|---|",
              f"| Medusa top-1 per depth | {a['medusa']['full']['top1']} | {a['medusa']['cut']['top1']} |",
              f"| Medusa top-2 per depth | {a['medusa']['full']['top2']} | {a['medusa']['cut']['top2']} |",
              f"| EAGLE-3 chain of 3, accepted tokens per step ({a['eagle3_prompts']} prompts x 64 tokens) | "
              f"{a['eagle3']['full']} | {a['eagle3']['cut']} |", "",
              f"EAGLE-3 greedy outputs identical with and without the cut: {a['eagle3_same_outputs']}."]
    return "\n".join(lines)


OUT = harness.Output("head_vocab", "Heads over a cut draft vocabulary", render)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", nargs="+", help="on-policy JSONL files (verispec data regenerate; required to measure)")
    ap.add_argument("--limit", type=int, default=1200)
    ap.add_argument("--medusa-sequences", type=int, default=80)
    ap.add_argument("--eagle3-prompts", type=int, default=24)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    a = OUT.parse(ap)
    if a is None:
        return
    if not a.data:
        ap.error("--data is required")
    from verispec.models.loading import load_model
    torch.set_num_threads(2)
    machine = harness.machine_record()
    target = load_model("smollm2-135m", weights="fp16")
    tok = target.tokenizer
    held, examples = heldout(tok, a.data, a.limit, 512)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": c.messages[0]["content"]}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False).input_ids[:256]
               for c in held[:a.eagle3_prompts]]
    res = {"machine": machine, "threads": torch.get_num_threads(),
           "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
           "costs": costs(target, a.reps, a.rounds)}
    md_ex = examples[:a.medusa_sequences]
    e3_full = eagle3_acceptance(target, prompts, "full")
    e3_cut = eagle3_acceptance(target, prompts, str(ROOT / "smollm2-135m-eagle3" / "draft_vocab.safetensors"))
    res["acceptance"] = {
        "conversations": len(md_ex), "eagle3_prompts": len(prompts),
        "medusa": {"full": medusa_hits(target, md_ex, False), "cut": medusa_hits(target, md_ex, True)},
        "eagle3": {"full": e3_full["accepted_per_step"], "cut": e3_cut["accepted_per_step"]},
        "eagle3_same_outputs": e3_full["outputs"] == e3_cut["outputs"]}
    res["load_end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(OUT.write(res, a.out).read_text())


if __name__ == "__main__":
    main()
