"""Vanilla decoding speed of each CPU weights option, eager and compiled, beside llama.cpp on the
same GGUF (#20): every variant in a worker process of its own (so each has its own OpenMP
settings), the variants run on each prompt in turn (order rotated per prompt), one at a time.

Variants (``--variants``): ``WEIGHTS[+compile][@legacy]`` with WEIGHTS ``fp16`` (fp16-packed),
``int4``, ``int8`` or ``dense``; ``+compile`` compiles the step; ``@legacy`` is the path shipped before the
threaded fp16 kernel: torch's single-threaded FBGEMM op and ``OMP_WAIT_POLICY=PASSIVE`` (the
issue's "today"). Without ``@legacy`` a variant runs with the threaded fp16 op and OpenMP's default
wait policy (spin a while, then sleep). ``llamacpp`` is llama-cpp-python in its worker
(``bench.llamacpp``; ``make bench-llamacpp`` installs it). Prompts: Spec-Bench first turns,
``--per-category`` per category, chat template; ``--max-tokens`` new tokens, greedy, EOS ignored
so every variant writes the same number of tokens. Tokens/s: new tokens over the wall time of the
whole generate call inside the worker (prompt included, for every variant alike). Each variant
decodes one prompt untimed first (allocations, and compilation, whose time is reported).

    python benchmarks/decode_speed.py --model smollm2-135m --per-category 2

Writes benchmarks/results/decode_speed_<model>.{json,md}.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

from verispec.bench import harness


LEGACY_ENV = {"VERISPEC_FP16_KERNEL": "torch", "OMP_WAIT_POLICY": "PASSIVE"}


class _VariantWorker:
    """One verispec variant in its own process: ``__call__(ids, n) -> (token ids, wall s)``."""

    def __init__(self, model: str, name: str, threads: int):
        import json
        import os
        import subprocess
        self._json = json
        spec, _, mode = name.partition("@")
        if mode not in ("", "legacy"):
            raise ValueError(f"unknown variant mode {mode!r} in {name!r}; use @legacy or nothing")
        env = {k: v for k, v in os.environ.items() if k not in LEGACY_ENV}
        env.update(LEGACY_ENV if mode else {})
        self._proc = subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=env)
        hello = self._call({"model": model, "spec": spec, "threads": threads})
        self.compile_s, self.graphs, self.kernel = hello["compile_s"], hello["graphs"], hello["kernel"]

    def _call(self, obj: dict) -> dict:
        self._proc.stdin.write(self._json.dumps(obj) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"variant worker exited with code {self._proc.wait()}")
        return self._json.loads(line)

    def __call__(self, ids, n):
        r = self._call({"ids": [int(t) for t in ids], "n": n})
        self.compile_s, self.graphs = r["compile_s"], r["graphs"]
        return r["tokens"], r["wall_s"]

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=60)


def worker_main() -> None:
    """``--worker``: load one variant, then answer prompts (JSON lines on stdin/stdout)."""
    import json
    from verispec import LLM, SamplingParams
    from verispec.models import fp16_kernel
    from verispec.models.loading import load_model
    out = sys.stdout
    sys.stdout = sys.stderr                               # library prints must not corrupt the pipe
    hello = json.loads(sys.stdin.readline())
    torch.set_num_threads(hello["threads"])
    weights, _, flag = hello["spec"].partition("+")
    llm = LLM(loaded=load_model(hello["model"], weights=weights), max_num_seqs=1, compile=flag == "compile")

    def reply(obj):
        c = llm.compiled
        obj.update(compile_s=c.compile_s if c else 0.0, graphs=c.graphs if c else 0)
        out.write(json.dumps(obj) + "\n")
        out.flush()
    reply({"kernel": "torch" if fp16_kernel.kernel() is None else "threaded"})
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.perf_counter()
        o = llm.generate([{"prompt_token_ids": req["ids"]}],
                         SamplingParams(temperature=0, max_tokens=req["n"], ignore_eos=True))[0]
        reply({"tokens": list(o.token_ids), "wall_s": time.perf_counter() - t0})


def make_variants(model: str, names: list[str], threads: int, tok) -> dict:
    """name -> (generate(prompt_ids, max_tokens) -> (token ids, wall seconds), closable)."""
    out = {}
    for name in names:
        if name == "llamacpp":
            from verispec import SamplingParams
            from verispec.bench.llamacpp import LlamaCppRunner, gguf_path
            runner = LlamaCppRunner("llamacpp", gguf_path(model), (), tok)       # no EOS: fixed lengths

            def gen(ids, n, runner=runner):
                r = runner.generate([ids], SamplingParams(temperature=0, max_tokens=n))
                return r.token_ids[0], r.wall_s
            out[name] = (gen, runner)
            continue
        w = _VariantWorker(model, name, threads)
        out[name] = (w, w)
    return out


def run(args) -> dict:
    from verispec.data import per_category, spec_bench_questions
    torch.set_num_threads(args.threads)
    from verispec.models.loading import load_tokenizer
    from verispec.models.sources import resolve_model
    names = args.variants.split(",")
    src = resolve_model(args.model)
    tok = load_tokenizer(src.path, src.format)
    variants = make_variants(args.model, names, args.threads, tok)
    qs = per_category(spec_bench_questions(), args.per_category)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False).input_ids for q in qs]
    res = {"machine": harness.machine_record(), "model": args.model, "settings": harness.settings(args),
           "variants": {}}
    for name, (gen, obj) in variants.items():
        t0 = time.perf_counter()
        gen(prompts[0], args.max_tokens)
        res["variants"][name] = {"warmup_s": time.perf_counter() - t0, "tokens": 0, "wall_s": 0.0,
                                 "compile_s": getattr(obj, "compile_s", 0.0), "graphs": getattr(obj, "graphs", 0),
                                 "fp16_kernel": getattr(obj, "kernel", None), "per_prompt": []}
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
    for obj in variants.values():
        if hasattr(obj[1], "close"):
            obj[1].close()
    del variants
    gc.collect()
    return res


def render(res: dict) -> str:
    s, names = res["settings"], list(res["variants"])
    base = names[0]
    lines = [f"{s['threads']} threads. {res['prompts']} Spec-Bench prompts ({s['per_category']} per category), {s['max_tokens']} new tokens, "
             "greedy, EOS ignored; every variant in its own worker process, run on each prompt in turn.", "",
             f"| variant | tok/s | vs {base} | vs llamacpp | outputs = {base} | warm-up s (compile s, graphs) |",
             "|---|---|---|---|---|---|"]
    llama = res["variants"].get("llamacpp")
    for n, v in res["variants"].items():
        vs_llama = f"{v['tokens_per_s'] / llama['tokens_per_s']:.2f}x" if llama else "–"
        comp = f" ({v['compile_s']:.0f} s, {v['graphs']})" if v["graphs"] else ""
        lines.append(f"| {n} | {v['tokens_per_s']:.1f} | {v['vs_' + base]:.2f}x | {vs_llama} | "
                     f"{v['same_as_' + base]:.0%} | {v['warmup_s']:.0f}{comp} |")
    return "\n".join(lines)


def legacy_command(res: dict) -> str:
    s = res["settings"]
    return (f"python benchmarks/decode_speed.py --model {res['model']} --variants {s['variants']} "
            f"--per-category {s['per_category']} --max-tokens {s['max_tokens']}")


OUT = harness.Output("decode_speed", lambda res: f"Vanilla decoding speed by weights option: {res['model']}", render,
                     model="smollm2-135m", legacy_command=legacy_command)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="fp16@legacy,fp16,fp16+compile,int4+compile,int8,int8+compile,llamacpp")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    if "--worker" in sys.argv:
        worker_main()
        return
    OUT.main(ap, run)


if __name__ == "__main__":
    main()
