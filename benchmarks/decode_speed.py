"""Vanilla decoding speed of each CPU weights option, eager and compiled, beside llama.cpp on the
same GGUF (#20): one process, every variant run on each prompt in turn (order rotated per prompt).

Variants (``--variants``): ``fp16`` (fp16-packed, eager: the baseline, "today's" path),
``fp16+compile``, ``int4``, ``int4+compile``, ``dense`` and ``llamacpp`` (llama-cpp-python in its
worker process, ``bench.llamacpp``; installed by ``make bench-llamacpp``). Prompts: Spec-Bench
first turns, ``--per-category`` per category, chat template; ``--max-tokens`` new tokens, greedy,
EOS ignored so every variant writes the same number of tokens. Tokens/s: new tokens over the wall
time of the whole generate call (prompt included, for every variant alike). Each variant decodes
one prompt untimed first (allocations, and compilation, whose time is reported).

    python benchmarks/decode_speed.py --model smollm2-135m --per-category 2

Writes benchmarks/results/decode_speed_<model>.{json,md}.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info, machine_line, run_per_model  # noqa: E402


def make_variants(model: str, names: list[str]) -> dict:
    """name -> generate(prompt_ids, max_tokens) -> (token ids, wall seconds)."""
    from verispec import LLM, SamplingParams
    from verispec.models.loading import load_model
    loaded, out = {}, {}
    for name in names:
        if name == "llamacpp":
            from verispec.bench.llamacpp import LlamaCppRunner, gguf_path
            tok = next(iter(loaded.values())).tokenizer if loaded else load_model(model).tokenizer
            runner = LlamaCppRunner("llamacpp", gguf_path(model), (), tok)       # no EOS: fixed lengths

            def gen(ids, n, runner=runner):
                r = runner.generate([ids], SamplingParams(temperature=0, max_tokens=n))
                return r.token_ids[0], r.wall_s
            out[name] = (gen, runner)
            continue
        weights, _, flag = name.partition("+")
        if weights not in loaded:
            loaded[weights] = load_model(model, weights=weights)
        llm = LLM(loaded=loaded[weights], max_num_seqs=1, compile=flag == "compile")

        def gen(ids, n, llm=llm):
            t0 = time.perf_counter()
            o = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
            return o.token_ids, time.perf_counter() - t0
        out[name] = (gen, llm)
    return out, loaded


def run(args) -> dict:
    from verispec.data import per_category, spec_bench_questions
    torch.set_num_threads(args.threads)
    names = args.variants.split(",")
    variants, loaded = make_variants(args.model, names)
    tok = next(iter(loaded.values())).tokenizer
    qs = per_category(spec_bench_questions(), args.per_category)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False).input_ids for q in qs]
    res = {"machine": machine_info(), "model": args.model, "settings": vars(args).copy(), "variants": {}}
    for name, (gen, obj) in variants.items():
        t0 = time.perf_counter()
        gen(prompts[0], args.max_tokens)
        compiled = getattr(obj, "compiled", None)
        res["variants"][name] = {"warmup_s": time.perf_counter() - t0, "tokens": 0, "wall_s": 0.0,
                                 "compile_s": compiled.compile_s if compiled else 0.0,
                                 "graphs": compiled.graphs if compiled else 0, "per_prompt": []}
        print(f"{name}: warm-up {res['variants'][name]['warmup_s']:.1f} s", flush=True)
    outputs = {}
    for i, ids in enumerate(prompts):
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            toks, wall = variants[name][0](ids, args.max_tokens)
            v = res["variants"][name]
            v["tokens"] += len(toks)
            v["wall_s"] += wall
            v["per_prompt"].append(len(toks) / wall)
            outputs.setdefault(name, []).append(list(toks))
        print(f"prompt {i + 1}/{len(prompts)}", {n: round(res['variants'][n]['per_prompt'][-1], 1) for n in names},
              flush=True)
    base = names[0]
    for name, v in res["variants"].items():
        v["tokens_per_s"] = v["tokens"] / v["wall_s"]
        v["vs_" + base] = v["tokens_per_s"] / (res["variants"][base]["tokens"] / res["variants"][base]["wall_s"])
        v["same_as_" + base] = sum(a == b for a, b in zip(outputs[name], outputs[base])) / len(prompts)
    res["prompts"] = len(prompts)
    res["machine_line"] = machine_line(with_isa=True)
    for obj in variants.values():
        if hasattr(obj[1], "close"):
            obj[1].close()
    del variants, loaded
    gc.collect()
    return res


def write_md(res: dict, path: str) -> None:
    s, names = res["settings"], list(res["variants"])
    base = names[0]
    lines = [f"# Vanilla decoding speed by weights option: {res['model']}", "",
             f"Machine: {res['machine_line']}; torch {res['machine']['torch']}, {s['threads']} threads. "
             f"{res['prompts']} Spec-Bench prompts ({s['per_category']} per category), {s['max_tokens']} new tokens, "
             "greedy, EOS ignored; every variant on each prompt in turn, one process.", "",
             f"| variant | tok/s | vs {base} | vs llamacpp | outputs = {base} | warm-up s (compile s, graphs) |",
             "|---|---|---|---|---|---|"]
    llama = res["variants"].get("llamacpp")
    for n, v in res["variants"].items():
        vs_llama = f"{v['tokens_per_s'] / llama['tokens_per_s']:.2f}x" if llama else "–"
        comp = f" ({v['compile_s']:.0f} s, {v['graphs']})" if v["graphs"] else ""
        lines.append(f"| {n} | {v['tokens_per_s']:.1f} | {v['vs_' + base]:.2f}x | {vs_llama} | "
                     f"{v['same_as_' + base]:.0%} | {v['warmup_s']:.0f}{comp} |")
    lines += ["", f"Command: `python benchmarks/decode_speed.py --model {res['model']} --variants {s['variants']} "
                  f"--per-category {s['per_category']} --max-tokens {s['max_tokens']}`", ""]
    Path(path).write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="fp16,fp16+compile,int4,int4+compile,llamacpp")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    run_per_model(ap, "decode_speed", run, write_md)


if __name__ == "__main__":
    main()
