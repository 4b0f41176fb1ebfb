"""The quality cost of each CPU weights option against the fp32 model (#20): perplexity on
held-out ShareGPT text and greedy agreement over 128 tokens on Spec-Bench.

For each option (``dense`` fp32 is the reference, then e.g. ``fp16`` and ``int4``), one model at a
time in this process:
- **Perplexity**: the held-out split of the ShareGPT wheel (the heads' split: ``split_ids`` with
  fraction 0.03, seed 0; never trained on), first ``--conversations`` conversations, chat template,
  cut at ``--max-length`` tokens, loss on assistant tokens only. The text is fed through the KV
  cache in chunks of ``--chunk`` tokens (below ``DENSE_MIN_ROWS``), so the decode/verify kernels
  are what is measured, not the prefill path. Also the share of positions whose argmax equals the
  fp32 model's (teacher forced).
- ``llamacpp``: llama.cpp (llama-cpp-python, ``make llamacpp``) on the model's own GGUF, as a
  peer: its perplexity from the logits of each whole example, and its greedy outputs (EOS ends a
  row), against the same fp32 reference.
- **Greedy agreement**: Spec-Bench first turns, ``--per-category`` per category, chat template,
  ``--max-tokens`` new tokens (EOS ends a row): the share of prompts whose output equals the fp32
  output, and the mean length of the common prefix as a share of the fp32 output.

    python benchmarks/weights_quality.py --model smollm2-135m --weights fp16,int4

Writes benchmarks/results/weights_quality_<model>.{json,md} and the fp32 reference (argmaxes,
greedy outputs) to ``.reference.json``; ``--merge`` keeps an earlier run's rows and reference
(same settings) and measures only the options named.
"""
from __future__ import annotations

import argparse
import gc
import math
import time
from pathlib import Path

import torch

from verispec.bench import harness


def heldout_examples(tokenizer, conversations: int, max_length: int):
    from verispec.train.data import load_conversations, sharegpt_wheel_file, split_ids, tokenize_all
    convs, _ = load_conversations(sharegpt_wheel_file())
    _, held = split_ids(convs, 0.03, 0)
    return tokenize_all(tokenizer, held[:conversations * 2], max_length)[:conversations]


@torch.inference_mode()
def chunked_logits(model, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits [T, V] of ``ids`` computed through the KV cache, ``chunk`` tokens per forward."""
    from verispec.models.kv_cache import KVCache
    cache = KVCache.for_model(model.cfg, 1, len(ids) + 1)
    out = []
    for s in range(0, len(ids), chunk):
        piece = torch.tensor([ids[s:s + chunk]])
        pos = torch.arange(s, s + piece.shape[1])[None]
        out.append(model(piece, pos, cache).logits[0])
        cache.advance([0], piece.shape[1])
    return torch.cat(out)


def perplexity(logits_of, examples, ref_argmax: list | None):
    """Perplexity on the examples' loss-masked tokens and argmax agreement with ``ref_argmax``
    (per example, the reference's argmax at those positions); ``logits_of(ids) -> [T, V]``."""
    nll, count, agree, argmaxes = 0.0, 0, 0, []
    for i, ex in enumerate(examples):
        logits = logits_of(list(ex.input_ids))[:-1].float()
        target = torch.tensor(ex.input_ids[1:])
        mask = torch.tensor(ex.loss_mask[1:], dtype=torch.bool)
        lp = torch.log_softmax(logits, -1).gather(1, target[:, None])[:, 0]
        nll -= float(lp[mask].sum())
        count += int(mask.sum())
        top = logits.argmax(-1)[mask]
        argmaxes.append(top)
        if ref_argmax is not None:
            agree += int((top == ref_argmax[i]).sum())
    return {"perplexity": math.exp(nll / count), "tokens": count,
            "argmax_agreement": agree / count if ref_argmax is not None else 1.0}, argmaxes


def llamacpp_quality(model: str, examples, prompts, max_tokens: int, threads: int, ref_argmax,
                     eos: tuple[int, ...], tokenizer) -> tuple[dict, list]:
    """The same two measures for llama.cpp on the model's own GGUF (``llamacpp``: its quantised
    weights as the file holds them): perplexity from its logits over each whole example, and its
    greedy outputs from the benchmarks' llama.cpp peer (``bench.llamacpp.LlamaCppRunner``,
    stopping at ``eos``)."""
    import numpy as np
    from verispec import SamplingParams
    from verispec.bench.llamacpp import LlamaCppRunner, _llama_cpp, gguf_path
    path = gguf_path(model)
    llm = _llama_cpp().Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads,
                             n_ctx=max(len(e.input_ids) for e in examples) + 8, logits_all=True, verbose=False)

    def logits_of(ids: list[int]) -> torch.Tensor:
        llm.reset()
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))
    res, _ = perplexity(logits_of, examples, ref_argmax)
    del llm
    runner = LlamaCppRunner("llamacpp", path, eos, tokenizer)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
        outs = [runner.generate([p], greedy).token_ids[0] for p in prompts]
    finally:
        runner.close()
    return dict(res, version=runner.version), outs


def greedy_outputs(loaded, prompts, max_tokens: int) -> list[list[int]]:
    from verispec import LLM, SamplingParams
    llm = LLM(loaded=loaded, max_num_seqs=len(prompts))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=max_tokens))
    return [list(o.token_ids) for o in outs]


def agreement(outs: list[list[int]], ref: list[list[int]]) -> dict:
    same, prefix = 0, []
    for o, r in zip(outs, ref):
        same += o == r
        n = next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r)))
        prefix.append(n / max(1, len(r)))
    return {"identical_share": same / len(ref), "mean_common_prefix": sum(prefix) / len(prefix),
            "prompts": len(ref)}


MEASURE = ("conversations", "max_length", "chunk", "per_category", "max_tokens")   # settings a merge must share


def earlier_run(args) -> tuple[dict, dict | None] | None:
    """With ``--merge``: the earlier run's results, when it measured with the same settings, and
    its fp32 reference (argmaxes, greedy outputs, EOS ids; ``<out>.reference.json``) where saved;
    else None."""
    import json
    out, ref = Path(args.out + ".json"), Path(args.out + ".reference.json")
    if not (args.merge and out.exists()):
        return None
    prior = json.loads(out.read_text())
    if any(prior["settings"].get(k) != getattr(args, k) for k in MEASURE) or "dense" not in prior["options"]:
        print("--merge: the earlier run measured with other settings; its rows are dropped", flush=True)
        return None
    return prior, (json.loads(ref.read_text()) if ref.exists() else None)


def write_reference(args, argmaxes, outs, eos) -> None:
    ref = {"settings": {k: getattr(args, k) for k in MEASURE}, "argmax": [a.tolist() for a in argmaxes],
           "outputs": outs, "eos": list(eos)}
    harness.write_json(args.out + ".reference.json", ref, indent=None)


def checkpoint_blocks(src) -> dict:
    """What the checkpoint holds and what ``weights="auto"`` makes of it: for a GGUF, its decoder
    matrices (``blk.*``) counted by block type, and auto's pick."""
    from collections import Counter
    from verispec.models.auto_weights import auto_weights, decoder_block_types
    out = {"auto": auto_weights(src.path, src.format, torch.float32, "cpu").value}
    if src.format == "gguf":
        out["decoder_blocks"] = dict(Counter(decoder_block_types(src.path)).most_common())
    return out


def run(args) -> dict:
    from verispec.data import per_category, spec_bench_questions
    from verispec.models.loading import load_model, load_tokenizer
    from verispec.models.sources import resolve_model
    torch.set_num_threads(args.threads)
    res = {"machine": harness.machine_record(), "model": args.model, "options": {},
           "settings": harness.settings(args)}
    src = resolve_model(args.model)
    res["checkpoint"] = checkpoint_blocks(src)
    tok = load_tokenizer(src.path, src.format)
    if getattr(tok, "chat_template", None) is None:      # a base model (gemma3-270m): plain Q/A text
        from verispec.bench.runner import PLAIN_CHAT_TEMPLATE
        tok.chat_template = PLAIN_CHAT_TEMPLATE
        res["plain_text"] = True
    examples = heldout_examples(tok, args.conversations, args.max_length)
    from verispec.bench.runner import chat_ids
    prompts = [chat_ids(tok, [{"role": "user", "content": q["turns"][0]}])
               for q in per_category(spec_bench_questions(), args.per_category)]
    ref_argmax = ref_out = eos = None
    wanted = [w for w in args.weights.split(",") if w not in ("dense", "llamacpp")]
    order = ["dense"] + wanted + (["llamacpp"] if "llamacpp" in args.weights.split(",") else [])
    earlier = earlier_run(args)
    if earlier is not None:                     # the other options' rows, as measured
        prior, ref = earlier
        res["options"] = {w: o for w, o in prior["options"].items() if w not in order or w == "dense"}
        res["merged"] = sorted(set(res["options"]) - {"dense"})
        if ref is not None:                     # and the fp32 reference they were measured against
            ref_argmax, ref_out, eos = [torch.tensor(a) for a in ref["argmax"]], ref["outputs"], tuple(ref["eos"])
            order = [w for w in order if w != "dense"]
    for weights in order:
        t0 = time.perf_counter()
        if weights == "llamacpp":
            ppl, outs = llamacpp_quality(args.model, examples, prompts, args.max_tokens, args.threads, ref_argmax,
                                         eos, tok)
        else:
            loaded = load_model(args.model, weights=weights)
            ppl, argmaxes = perplexity(lambda ids: chunked_logits(loaded.model, ids, args.chunk), examples,
                                       ref_argmax)
            outs = greedy_outputs(loaded, prompts, args.max_tokens)
            if weights == "dense":
                ref_argmax, ref_out, eos = argmaxes, outs, tuple(loaded.config.eos_token_ids)
                write_reference(args, argmaxes, outs, eos)
                kept = res["options"].get("dense")
                if kept is not None and (abs(kept["perplexity"] / ppl["perplexity"] - 1) > 1e-5 or
                                         kept["tokens"] != ppl["tokens"]):
                    print("--merge: the fp32 reference measured differently from the earlier run's; "
                          "its rows are dropped", flush=True)
                    res["options"], res["merged"] = {}, []
            del loaded
            gc.collect()
        res["options"][weights] = dict(ppl, **agreement(outs, ref_out), seconds=time.perf_counter() - t0)
        print(weights, res["options"][weights], flush=True)
    return res


def render(res: dict) -> str:
    s = res["settings"]
    lines = [f"{s['threads']} threads. Reference: the fp32 model as loaded (`dense`).", "",
             f"- Perplexity: {s['conversations']} held-out ShareGPT conversations (the heads' held-out split), "
             + ("rendered as plain \"Question: ... / Answer: ...\" text (a base model: no chat template), "
                if res.get("plain_text") else "") +
             f"at most {s['max_length']} tokens each, loss on assistant tokens, fed in chunks of {s['chunk']} "
             "tokens through the KV cache (the decode/verify kernels).",
             f"- Greedy: Spec-Bench first turns, {s['per_category']} per category, {s['max_tokens']} new tokens.", "",
             "| weights | perplexity | vs fp32 | argmax = fp32 (teacher forced) | greedy outputs = fp32 | mean common prefix |",
             "|---|---|---|---|---|---|"]
    base = res["options"]["dense"]["perplexity"]
    for w, o in res["options"].items():
        lines.append(f"| {w} | {o['perplexity']:.3f} | {o['perplexity'] / base - 1:+.2%} | {o['argmax_agreement']:.2%} | "
                     f"{o['identical_share']:.0%} of {o['prompts']} | {o['mean_common_prefix']:.0%} |")
    if "llamacpp" in res["options"]:
        lines += ["", f"`llamacpp`: llama.cpp {res['options']['llamacpp'].get('version', '')} on the same GGUF file "
                  "(its own quantised weights and kernels), perplexity from its logits over each whole "
                  "example, greedy outputs from its generate; the peer verispec is measured against."]
    ck = res.get("checkpoint")
    if ck:
        blocks = ", ".join(f"{k} {n}" for k, n in ck.get("decoder_blocks", {}).items())
        lines += ["", (f"The checkpoint's decoder matrices by GGUF block type: {blocks}. " if blocks else "") +
                  f"`weights=\"auto\"` loads it as `{ck['auto']}` (int4 only where most decoder matrices are "
                  "4-bit blocks, whose codes it keeps; other blocks are quantised to 4 bits a second time)."]
    if res.get("merged"):
        lines += ["", f"Rows kept from the earlier run against the same fp32 reference (`--merge`): "
                  f"{', '.join(res['merged'])}."]
    return "\n".join(lines)


def legacy_command(res: dict) -> str:
    s = res["settings"]
    return (f"python benchmarks/weights_quality.py --model {res['model']} --weights {s['weights']}"
            f"{' --merge' if s.get('merge') else ''}")


OUT = harness.Output("weights_quality", lambda res: f"Quality cost of the CPU weights options: {res['model']}",
                     render, model="smollm2-135m", legacy_command=legacy_command)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", default="fp16,int4,int8")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--merge", action="store_true",
                    help="keep the earlier run's rows and fp32 reference (same settings); measure only --weights")
    OUT.main(ap, run)


if __name__ == "__main__":
    main()
