"""An EAGLE-1 head's acceptance profile (``acceptance.json``), measured in the engine for heads whose
trainer has no held-out evaluation (EAGLE-1: no training-time test, no ``--eval-only``).

On the first user turns of held-out on-policy conversations (the trainers' 5% split of the
regeneration data), greedy, 64 tokens, fp16-packed SmolLM2-135M, the head as shipped (its
folder's vocabulary cut): depth 1 = cumulative hit rates of sibling trees of 1-4 nodes (the share
of drafted steps that accepted one of them), depths 2-4 = conditional top-1 rates of a chain of 4
(steps reaching depth d over steps reaching depth d - 1). The deeper rows have rank 0 only, so the
shape model may branch at depth 1 only.

    python benchmarks/engine_profile.py --data <regenerated shards> --folder checkpoints/smollm2-135m-eagle

Its result is the head's ``acceptance.json`` (``AcceptanceProfile.save``), not a file in
benchmarks/results; the profile's source line ends with the harness's machine line.
"""
from __future__ import annotations

import argparse

import torch

from verispec.bench import harness


def main() -> None:
    from verispec import LLM, SamplingParams
    from verispec.drafting.draft_shape import AcceptanceProfile
    from verispec.models.loading import load_model
    from verispec.train.data import load_conversations, split_ids
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", nargs="+", required=True)
    ap.add_argument("--folder", required=True, help="the EAGLE-1 head folder (acceptance.json is written there)")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--limit", type=int, default=1200)
    a = ap.parse_args()
    torch.set_num_threads(2)
    machine = harness.machine_line(harness.machine_record())
    target = load_model("smollm2-135m", weights="fp16")
    tok = target.tokenizer
    convs = []
    for p in a.data:
        convs += load_conversations(p, a.limit)[0]
    _, held = split_ids(convs, 0.05)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": c.messages[0]["content"]}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False).input_ids[:256]
               for c in held[:a.prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=64)

    def reached(spec: dict) -> list[float]:
        llm = LLM(loaded=target, speculative_config={"method": "eagle", "model": a.folder, **spec})
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        drafts = sum(o.metrics.num_drafts for o in outs)
        per = [0.0] * 8
        for o in outs:
            for i, r in enumerate(o.metrics.acceptance_rate_per_pos):
                per[i] += r * o.metrics.num_drafts
        return [x / drafts for x in per]

    hits1 = [reached({"tree": [[i] for i in range(k)]})[0] for k in (1, 2, 3, 4)]
    chain = reached({"num_speculative_tokens": 4})
    cond = [chain[d] / chain[d - 1] if chain[d - 1] else 0.0 for d in range(1, 4)]
    prof = AcceptanceProfile.from_hits([hits1] + [[c] for c in cond], "engine, held-out on-policy prompts")
    path = prof.save(a.folder, source=f"measured in the engine (benchmarks/engine_profile.py: fp16-packed, greedy, "
                     f"64 tokens, {len(prompts)} held-out on-policy prompts): depth 1 cumulative hits of 1-4 "
                     f"siblings {[round(h, 4) for h in hits1]}, depths 2-4 conditional top-1 of a chain of 4 "
                     f"{[round(c, 4) for c in cond]}; {machine}")
    print(path.read_text())


if __name__ == "__main__":
    main()
