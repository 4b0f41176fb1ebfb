"""The declared benchmark suites: one per question, each with its workload, its methods (and their
configs) and the result file that holds the current figure.

    python -m verispec.bench.suites list            # every suite and its result file
    python -m verispec.bench.suites run NAME        # run one (what ``make bench SUITE=NAME`` does)
    python -m verispec.bench.suites run NAME --dry-run
    python -m verispec.bench.suites needs NAME      # the make targets it needs (llamacpp, qwen, ...)
    python -m verispec.bench.suites table [--write] # the README's results table, from the result files

A suite runs either ``verispec bench`` (the Spec-Bench runner, ``verispec.bench.runner``) or one of
the scripts in ``benchmarks/``. Its configuration lives here, not in the Makefile. The result
paths are relative to the repository root; ``benchmarks/RESULTS.md`` indexes them. Standard
library only: ``tests/test_results_index.py`` loads this file without importing torch.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RESULTS = "benchmarks/results"

# Method configs shared by the Spec-Bench suites (``--method-config NAME=JSON``).
METHOD_CONFIGS: dict[str, dict] = {
    # prompt lookup proposing one token past the match (k <= 5): the best CPU method here
    "ngram-x1": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_extra": 1},
    # the Qwen2.5-Coder-0.5B draft over the shipped 64k reduced vocabulary
    "draft-v64k": {"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4,
                   "draft_vocab": "qwen2.5-coder-draft-vocab-64k/draft_vocab.safetensors"},
    "draft-v64k-k3": {"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 3,
                      "draft_vocab": "qwen2.5-coder-draft-vocab-64k/draft_vocab.safetensors"},
    # suffix decoding with the shipped corpus of the target's own answers (off by default)
    "suffix-corpus": {"method": "suffix", "suffix_decoding_corpus": "auto"},
    "hybrid-corpus": {"method": "hybrid", "suffix_decoding_corpus": "auto"},
}
REGEN = "runs/smollm2-sharegpt-regen.jsonl"      # the Makefile's `regen` output


@dataclass(frozen=True)
class Suite:
    name: str
    question: str                   # what the suite answers, one line
    workload: str                   # prompts, tokens, weights, batch
    command: tuple[str, ...]        # argv after the Python interpreter
    result: str | None              # the current result file (repo-relative); None: not yet run
    methods: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()     # make targets to build first
    group: str = "speed"
    note: str = ""

    def argv(self) -> list[str]:
        return [sys.executable, *self.command]


def spec_bench(name: str, model: str, weights: str, methods: tuple[str, ...], per_category: int, out: str,
               question: str, needs: tuple[str, ...] = ("llamacpp",), compile: bool = True, max_tokens: int = 128,
               threads: int = 2) -> Suite:
    """A ``verispec bench`` suite: Spec-Bench questions, greedy, batch 1, methods interleaved per prompt."""
    cmd = ["-m", "verispec.cli", "bench", "--model", model, "--weights", weights, "--threads", str(threads),
           "--per-category", str(per_category), "--max-tokens", str(max_tokens), "--methods", ",".join(methods)]
    if compile:
        cmd.append("--compile")
    for m in methods:
        if m in METHOD_CONFIGS:
            cmd += ["--method-config", f"{m}={json.dumps(METHOD_CONFIGS[m], separators=(',', ':'))}"]
    cmd += ["--name", run_name(out), "--out", f"{RESULTS}/{out}"]
    workload = (f"{model}, {weights} weights{', compiled' if compile else ''}, Spec-Bench {13 * per_category} "
                f"questions, {max_tokens} tokens, greedy, batch 1, {threads} threads")
    return Suite(name, question, workload, tuple(cmd), f"{RESULTS}/{out}/report.md", methods, needs)


def run_name(out: str) -> str:
    """The run's name inside its results.json: the output folder's, with dashes (as committed)."""
    return Path(out).name.replace("_", "-")


def script(name: str, path: str, args: str, result: str | None, question: str, workload: str,
           needs: tuple[str, ...] = (), group: str = "speed", methods: tuple[str, ...] = (), note: str = "") -> Suite:
    return Suite(name, question, workload, (f"benchmarks/{path}", *shlex.split(args)),
                 f"{RESULTS}/{result}" if result else None, methods, needs, group, note)


SMOL, QWEN = "smollm2-135m", "qwen2.5-coder-1.5b"
QWEN_NEEDS = ("llamacpp", "qwen")

SUITES: tuple[Suite, ...] = (
    # --- speed: Spec-Bench by method, beside llama.cpp on the same GGUF
    spec_bench("specbench-smollm2-int4", SMOL, "int4", ("vanilla", "ngram", "ngram-x1", "eagle3", "llamacpp",
                                                        "llamacpp-pld"), 2, "spec_bench/exact_int4_smollm2",
               "Spec-Bench by method on SmolLM2 int4, against llama.cpp (vanilla and prompt lookup)"),
    spec_bench("specbench-smollm2-heads-int4", SMOL, "int4", ("vanilla", "eagle3", "medusa", "eagle", "suffix",
                                                              "hybrid", "ngram-x1"), 4,
               "spec_bench/heads_int4_smollm2",
               "the learned heads, suffix and hybrid on SmolLM2's fast path (int4 + compile), modelled vs measured",
               needs=()),
    spec_bench("specbench-smollm2-suffix-corpus", SMOL, "int4", ("vanilla", "suffix", "suffix-corpus",
                                                                 "hybrid", "hybrid-corpus"), 4,
               "spec_bench/suffix_corpus_smollm2",
               "suffix and hybrid with and without the shipped corpus of SmolLM2's own answers", needs=()),
    spec_bench("specbench-smollm2-int8", SMOL, "int8", ("vanilla", "ngram-x1", "eagle3", "llamacpp"), 2,
               "spec_bench/exact_int8_smollm2", "Spec-Bench by method on SmolLM2 int8, against llama.cpp"),
    spec_bench("specbench-smollm2-int4-a8", SMOL, "int4-a8", ("vanilla", "ngram-x1", "llamacpp"), 2,
               "spec_bench/exact_int4_a8_smollm2", "Spec-Bench on SmolLM2 int4-a8 (W4A8), against llama.cpp"),
    spec_bench("specbench-qwen-heads", QWEN, "int4-a8", ("vanilla", "eagle3", "hybrid", "suffix", "ngram-x1",
                                                        "draft-v64k-k3", "llamacpp", "llamacpp-draft", "llamacpp-pld",
                                                        "llama-server", "llama-server-ngram", "llama-server-draft"),
               2, "spec_bench/heads_int4_a8_qwen",
               "the shipped Qwen2.5-Coder-1.5B EAGLE-3 head on the fast path, against the 0.5B draft, suffix, "
               "ngram and llama.cpp (llama-cpp-python: vanilla, draft model, prompt lookup; llama-server: vanilla, "
               "ngram-mod, draft-simple)", (*QWEN_NEEDS, "llama-server")),
    spec_bench("specbench-qwen-int4", QWEN, "int4", ("vanilla", "ngram", "ngram-x1", "draft-v64k", "llamacpp",
                                                     "llamacpp-draft"), 1, "spec_bench/exact_int4_qwen",
               "Spec-Bench on Qwen int4, against llama.cpp's vanilla and draft mode", QWEN_NEEDS),
    spec_bench("specbench-qwen-int4-all", QWEN, "int4-all", ("vanilla", "ngram-x1", "draft-v64k", "draft-v64k-k3",
                                                             "llamacpp"), 1, "spec_bench/exact_int4_all_qwen",
               "Spec-Bench on Qwen int4-all (int4 LM head), against llama.cpp", QWEN_NEEDS),
    spec_bench("specbench-qwen-int4-head8", QWEN, "int4-head8", ("vanilla", "ngram-x1", "draft-v64k-k3", "llamacpp"),
               1, "spec_bench/exact_int4_head8_qwen", "Spec-Bench on Qwen int4-head8 (int8 LM head), against llama.cpp",
               QWEN_NEEDS),
    spec_bench("specbench-gemma3", "gemma3-270m", "fp16", ("vanilla", "ngram"), 1, "gemma3_ngram",
               "ngram on a second architecture (Gemma 3)", needs=(), compile=False, max_tokens=64),
    script("specbench-hf-peers", "spec_bench.py", "", "spec_bench/report.md",
           "our methods against HF transformers' assisted generation and prompt lookup (fp32 weights)",
           "smollm2-135m fp32, Spec-Bench, 4 suites (main, batch sweep, EAGLE vs HF assisted, fp16 sweep)",
           methods=("vanilla", "ngram", "draft_model", "eagle", "hf", "hf-pld", "hf-assisted")),
    script("spec-core", "spec_core.py", "--part ab --weights fp16,dense --qwen-prompts 4", "spec_core.md",
           "ngram and draft_model (with the 64k draft vocabulary) on fp16-packed weights, eager",
           "SmolLM2 26 Spec-Bench prompts, Qwen 4 coding prompts, 128 tokens, greedy, batch 1", needs=("qwen",),
           methods=("vanilla", "ngram", "ngram_extra", "draft_model", "draft_vocab")),
    script("decode-smollm2", "decode_speed.py",
           "--model smollm2-135m --variants fp16@legacy,fp16,fp16+compile,int4+compile,int8,int8+compile,llamacpp "
           "--per-category 2 --max-tokens 128", "decode_speed_smollm2-135m.md",
           "vanilla decode speed by weights option, beside llama.cpp (SmolLM2)",
           "26 Spec-Bench prompts, 128 tokens, each variant in its own process", needs=("llamacpp",)),
    script("decode-qwen", "decode_speed.py",
           "--model qwen2.5-coder-1.5b --variants fp16@legacy,int4+compile,int4-a8+compile,llamacpp "
           "--per-category 1 --max-tokens 128", "decode_speed_qwen2.5-coder-1.5b.md",
           "vanilla decode speed by weights option, beside llama.cpp (Qwen-1.5B)",
           "13 Spec-Bench prompts, 128 tokens, each variant in its own process", needs=QWEN_NEEDS),
    script("compile-time", "compile_time.py", "", "compile_time.md",
           "what a compiled start costs: graphs and seconds, on a fresh inductor cache and the next process",
           "SmolLM2 (auto weights), vanilla and EAGLE-3, one chat prompt, 64 tokens"),
    script("vanilla-vs-hf", "vanilla.py", "--per-category 2 --max-tokens 128", "vanilla.md",
           "our vanilla decoding against HF generate (fp32, bf16)", "SmolLM2, 26 Spec-Bench prompts, 128 tokens, 1 thread"),
    script("suffix-decoding", "suffix_decoding.py", "", "suffix_decoding.md",
           "suffix decoding against ngram on agentic / repetitive requests and on Spec-Bench",
           "SmolLM2 fp16, 15 tool-call/code-edit requests and 26 Spec-Bench questions", methods=("vanilla", "ngram", "suffix")),
    script("spec-bound", "spec_bound.py", "", "spec_bound.md",
           "what bounds speculation on this CPU: forward costs and the speed-up a perfect draft could reach",
           "Qwen pair on 2 coding prompts, SmolLM2 on 2 summarization prompts", needs=("qwen",)),
    # --- draft heads
    script("heads", "trained_heads.py", "--suites cpu-adaptive", "trained_heads/report.md",
           "the shipped heads (EAGLE-1/3, Medusa) on Spec-Bench, adaptive drafting on and off",
           "SmolLM2 fp16 compiled, 26 Spec-Bench questions, 128 tokens (other suites of the file: --suites NAME)",
           group="heads", methods=("vanilla", "eagle3", "eagle", "medusa")),
    script("heads-bound", "heads_bound.py", "", "heads_bound.md",
           "the acceptance a head would need for a given speed-up, from measured step costs",
           "SmolLM2 fp16, batch 1", group="heads"),
    script("heads-bound-qwen", "heads_bound.py",
           "--model qwen2.5-coder-1.5b --weights int4-a8 --heads eagle3 --out benchmarks/results/heads_bound_qwen2.5-coder-1.5b",
           "heads_bound_qwen2.5-coder-1.5b.md",
           "what bounds the shipped Qwen2.5-Coder-1.5B EAGLE-3 head: verify and draft costs, the acceptance 1.6x needs",
           "Qwen2.5-Coder-1.5B int4-a8, compiled, batch 1", needs=("qwen",), group="heads"),
    script("head-choice-qwen", "head_choice.py",
           "--model qwen2.5-coder-1.5b --weights int4-a8 --runs runs/qwen/e3-16k runs/qwen/e3-8k --step 60",
           "head_choice_qwen2.5-coder-1.5b.md",
           "the Qwen head's draft vocabulary: draft cost against held-out acceptance after equal steps",
           "Qwen2.5-Coder-1.5B int4-a8, compiled, batch 1; the training runs of docs/qwen_head.md",
           needs=("qwen",), group="heads"),
    script("draft-level-cost", "draft_level_cost.py", "", "draft_level_cost.md",
           "one draft step of each shipped head by how its matmuls are packed (fp16, int8, int4)",
           "SmolLM2 int4 target, shipped heads, 2 threads, batch 1, 256-token context", group="heads"),
    script("head-context", "head_context.py", "", "head_context_smollm2-135m.md",
           "how much of a prompt an EAGLE head must read: acceptance and first-step cost by head_context",
           "SmolLM2 int4, shipped EAGLE-3 head, 16 long Spec-Bench prompts (questions 3-6), 2 threads", group="heads"),
    script("head-context-qwen", "head_context.py", "--model qwen2.5-coder-1.5b --per-category 2 --windows 0,512,128 "
           "--reps 3", "head_context_qwen2.5-coder-1.5b.md",
           "the same for the Qwen2.5-Coder-1.5B head", "Qwen int4, shipped EAGLE-3 head, 8 long Spec-Bench prompts "
           "(questions 3-4), 2 threads", needs=("qwen",), group="heads"),
    script("loss-ablation", "loss_ablation.py", "--data runs/smollm2-int4/regen.jsonl", "loss_ablation.md",
           "which EAGLE-3 training loss raises on-policy acceptance most for equal steps",
           "SmolLM2 int4 target, its own answers to ShareGPT prompts, warm start from the shipped head, "
           "40 steps per loss", group="heads"),
    script("head-vocab", "head_vocab.py", f"--data {REGEN}", "head_vocab.md",
           "a proposal's cost and held-out acceptance with a cut draft vocabulary",
           "shipped heads, fp16 target, 2 threads", needs=("regen",), group="heads"),
    script("tree-cost", "tree_cost.py", "", "tree_cost.md",
           "verify cost against tree size, and an EAGLE-3 level's cost (behind the default trees)",
           "SmolLM2 fp32, cache 512, 1 thread", group="heads"),
    # --- weights
    script("weights-quality-smollm2", "weights_quality.py",
           "--model smollm2-135m --weights fp16,int4,int4-all,int4-head8,int4-a8,int8,llamacpp",
           "weights_quality_smollm2-135m.md", "quality cost of each weights option against fp32 (SmolLM2)",
           "32 held-out ShareGPT conversations (perplexity), 26 Spec-Bench prompts (greedy agreement)",
           needs=("sharegpt", "llamacpp"), group="weights"),
    script("weights-quality-qwen", "weights_quality.py",
           "--model qwen2.5-coder-1.5b --weights fp16,int4,int4-head8,int4-a8,int4-all,int8,llamacpp "
           "--conversations 16 --per-category 1", "weights_quality_qwen2.5-coder-1.5b.md",
           "quality cost of each weights option against fp32 (Qwen-1.5B)",
           "16 held-out conversations, 13 Spec-Bench prompts", needs=("sharegpt", "qwen", "llamacpp"), group="weights"),
    script("weights-quality-qwen0.5b", "weights_quality.py",
           "--model qwen2.5-coder-0.5b --weights fp16,int4,int4-a8,int8 --conversations 16 --per-category 1",
           "weights_quality_qwen2.5-coder-0.5b.md", "quality cost of each weights option against fp32 (Qwen-0.5B)",
           "16 held-out conversations, 13 Spec-Bench prompts", needs=("sharegpt", "qwen"), group="weights"),
    script("weights-quality-gemma3", "weights_quality.py",
           "--model gemma3-270m --weights fp16,int4,int4-a8,int8 --conversations 16 --per-category 1",
           "weights_quality_gemma3-270m.md", "quality cost of each weights option against fp32 (Gemma 3 270M)",
           "16 held-out conversations as plain Q/A text (a base model), 13 Spec-Bench prompts",
           needs=("sharegpt",), group="weights"),
    script("weight-kernels", "weight_kernels.py", "--model both", "weight_kernels.md",
           "the matmul kernels this CPU offers, over a forward's real shapes", "random weights, T=1..8, 2 threads",
           group="weights"),
    script("weight-kernels-a8", "weight_kernels.py",
           "--model qwen1.5b --kernels fp16-packed,int4-verispec,int4-a8-verispec --rows 1,2,4,8,64,177 "
           "--out benchmarks/results/weight_kernels_a8", "weight_kernels_a8.md",
           "our int4 kernel with bf16 against int8 (W4A8) activations, decode to prefill sizes",
           "Qwen-1.5B shapes, T=1..177, 2 threads", group="weights"),
    # --- serving
    script("serve-load", "serve_load.py",
           "--levels 1,8,32 --max-tokens 128 --rounds 3 --requests-per-level 16 --level-budget-s 30 "
           "--configs baseline,speculative+policy,llama-server,llama-server+spec "
           "--speculative-config '{\"method\": \"suffix\"}'", "serve_load.md",
           "`verispec serve` beside llama-server: throughput, TTFT, ITL and RSS, with and without speculation",
           "SmolLM2 (auto weights, compiled), Spec-Bench chat turns, 128 tokens, closed loop, 1/8/32 users, "
           "3 rounds of fresh servers", needs=("llama-server",), group="serve"),
    script("soak", "soak.py", "--duration 600 --users 32 --max-num-seqs 16 --out benchmarks/results/soak", "soak.md",
           "a 10-minute soak with faults: 5xx, latency, memory",
           "32 users, SmolLM2 (auto weights, compiled), speculation on", group="serve"),
    script("kv-paging", "kv_paging.py", "", "kv_paging.md",
           "the paged KV cache against static rows in the server: memory, speed, a repeated 1.6k-token prefix",
           "32 users, SmolLM2 (auto weights, compiled), max-model-len 2048, 128 tokens", group="serve"),
    script("draft-kv-memory", "draft_kv_memory.py", "", "draft_kv_memory.md",
           "a draft model's KV cache in a paged engine: memory held against static rows",
           "SmolLM2 with a 24-layer self-draft, 32 rows x 2048 tokens, 8 requests", group="serve"),
    script("prefix-cache", "prefix_cache.py", "--turns 4 --max-tokens 48 --threads 2", "prefix_cache.md",
           "TTFT with and without the prefix cache on a multi-turn chat", "~700-token system prompt, 4 turns",
           group="serve"),
    script("grammar-backends", "grammar_backends.py", "", "grammar_backends.md",
           "which grammar library for structured output (mask cost, correctness)", "SmolLM2 tokenizer", group="serve"),
    script("suffix-step-cost", "suffix_step_cost.py", "", "suffix_step_cost.md",
           "the suffix drafter's cost per step outside the model", "2000-token prompt, 200 steps", group="serve"),
    script("step-overhead", "step_overhead.py", "--configs compiled --weights int4 --prompts 8 --max-tokens 64 "
           "--out benchmarks/results/step_overhead_compiled",
           "step_overhead_compiled.md", "what a drafted step costs over a plain one, and the time outside the forwards",
           "SmolLM2 int4 compiled, 8 Spec-Bench prompts, 64 tokens, batch 1", group="serve",
           note="a before/after run: pass --src/--label for the trees to compare (harness.run_trees)"),
    # --- training
    script("train-throughput", "train_throughput.py", f"--data {REGEN} --limit 48", "train_throughput.md",
           "EAGLE-3 training throughput, online features against the feature cache", "SmolLM2, 4 x 512 tokens a step",
           needs=("regen",), group="train"),
    script("train-throughput-qwen", "train_throughput.py",
           "--model qwen2.5-coder-1.5b --target-weights int4-a8 --head none --draft-vocab-size 32768 "
           "--ttt-length 3 --data runs/qwen/regen.jsonl --limit 32 --out benchmarks/results/train_throughput_qwen",
           "train_throughput_qwen.md", "feature capture and EAGLE-3 training throughput for the Qwen-1.5B head",
           "Qwen2.5-Coder-1.5B int4-a8 target, its own answers, a new head from the target, 4 x 512 tokens a step",
           needs=("qwen",), group="train"),
    script("regen-throughput", "regen_throughput.py", "--max-tokens 128", "regen_throughput.md",
           "regeneration (`verispec data regenerate`) tokens/s against batch size", "SmolLM2, ShareGPT first turns",
           needs=("sharegpt",), group="train"),
    script("head-init", "head_init.py", "--run runs/e3-target --run runs/e3-random --run runs/e3-target-layer",
           "head_init.md", "a new EAGLE-3 head's initialisation and TTT length, same wall time",
           "5 arms of about 15 minutes; the training commands are in the result file", needs=("regen",),
           group="train", note="reads finished `verispec train eagle3` runs (--run DIR): train the arms first"),
    # --- not yet run
    script("gpu-verify", "gpu_verify_capture.py", "", None,
           "the verify forward on a GPU: eager, CUDA graph, torch.compile reduce-overhead",
           "SmolLM2 bf16 on CUDA, batch 1 and 8, T = 1..32", group="serve", note="needs a CUDA GPU"),
)

BY_NAME = {s.name: s for s in SUITES}


def get(name: str) -> Suite:
    if name not in BY_NAME:
        raise SystemExit(f"unknown suite {name!r}; known: {', '.join(BY_NAME)}")
    return BY_NAME[name]


# ---------------------------------------------------------------------------------------------
# The README's results table: rendered from the committed result files, never written by hand.

# (suite, [methods]) rows of the table, in order: the current figure per model.
TABLE_ROWS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("specbench-smollm2-int4", "exact-int4-smollm2", ("vanilla", "ngram-x1", "llamacpp")),
    ("specbench-smollm2-heads-int4", "heads-int4-smollm2", ("vanilla", "eagle3", "medusa", "eagle", "suffix",
                                                            "hybrid")),
    ("specbench-qwen-heads", "heads-int4-a8-qwen", ("vanilla", "eagle3", "suffix", "hybrid", "ngram-x1",
                                                    "draft-v64k-k3", "llamacpp", "llama-server", "llama-server-ngram",
                                                    "llama-server-draft")),
)
TABLE_BEGIN = "<!-- results table: python -m verispec.bench.suites table --write -->"
TABLE_END = "<!-- end of results table -->"
METHOD_LABELS = {"vanilla": "vanilla (no speculation)", "ngram-x1": "ngram, `prompt_lookup_extra: 1`",
                 "eagle3": "eagle3 (shipped head)", "eagle": "eagle (EAGLE-1, shipped head)",
                 "medusa": "medusa (shipped head)", "llamacpp": "llama.cpp vanilla, same GGUF",
                 "draft-v64k-k3": "draft_model 0.5B, k=3, 64k draft vocab", "suffix": "suffix (SuffixDecoding)",
                 "hybrid": "hybrid (suffix or the EAGLE-3 head, per step)",
                 "llamacpp-draft": "llama.cpp, 0.5B draft model (llama-cpp-python)",
                 "llamacpp-pld": "llama.cpp, prompt lookup (llama-cpp-python)",
                 "llama-server": "llama-server vanilla, same GGUF", "llama-server-ngram": "llama-server, ngram-mod",
                 "llama-server-draft": "llama-server, 0.5B draft (draft-simple)"}


def _suite_result(suite: Suite, name: str) -> tuple[dict, Path]:
    path = ROOT / Path(suite.result).parent / "results.json"
    doc = json.loads(path.read_text())
    return next(s for s in doc["suites"] if s["name"] == name), path


def render_table() -> str:
    """The README's results table (markdown), with its sources, dates and machine."""
    lines = ["| model, weights | method | tok/s | x vanilla | x llama.cpp | tau | = vanilla |",
             "|---|---|---:|---:|---:|---:|---|"]
    sources, machines = [], set()
    for suite_name, name, methods in TABLE_ROWS:
        suite = get(suite_name)
        run, path = _suite_result(suite, name)
        cfg, m = run["config"], run["machine"]
        machines.add(f"{m['cpu_model']}, {m['usable_cores']} cores, torch {m['torch']}")
        overall = {r["method"]: r for r in run["summary"] if r["category"] == "overall" and r["batch_size"] == 1}
        model = f"{cfg['model']}, {cfg['weights']}" + (", compiled" if cfg.get("compile") else "")
        for meth in methods:
            r = overall[meth]
            x_ll = r.get("speedup_vs_llamacpp")
            same = r.get("identical_share")
            lines.append(f"| {model} | {METHOD_LABELS.get(meth, meth)} | {r['tokens_per_s']:.1f} | "
                         f"{r['speedup_vs_vanilla']:.2f}x | {'%.2fx' % x_ll if x_ll else '-'} | "
                         f"{r['mean_acceptance_length']:.2f} | "
                         f"{'-' if same is None else ('yes' if same == 1 else f'{same:.0%}')} |")
        sources.append(f"[`{suite.result.removeprefix('benchmarks/results/')}`]({suite.result}) (`{name}`, "
                       f"{13 * cfg['per_category']} questions, {cfg['max_tokens']} tokens, {_run_date(path)})")
    head = (f"Spec-Bench, greedy, batch 1, methods interleaved per prompt; machine: {'; '.join(sorted(machines))}. "
            "`x llama.cpp` is against llama.cpp's vanilla decoding on the same GGUF in the same run; `= vanilla`: "
            "outputs identical to our vanilla's (llama.cpp's own numerics differ); tau: mean acceptance length, bonus "
            "token included. Sources: " + "; ".join(sources) + ".")
    return head + "\n\n" + "\n".join(lines)


def _run_date(results_json: Path) -> str:
    """The run's date: its report's 'Generated' line, else the results.json's creation time."""
    report = results_json.with_name("report.md")
    if report.is_file():
        for line in report.read_text().splitlines():
            if line.startswith("Generated "):
                return line.removeprefix("Generated ").rstrip(".")
    return json.loads(results_json.read_text()).get("created_utc", "?")


def readme_block(text: str) -> str:
    """The table block currently in README text (between the markers)."""
    start = text.index(TABLE_BEGIN) + len(TABLE_BEGIN)
    return text[start:text.index(TABLE_END)].strip()


def write_readme(readme: Path = ROOT / "README.md") -> bool:
    text = readme.read_text()
    start = text.index(TABLE_BEGIN) + len(TABLE_BEGIN)
    new = text[:start] + "\n" + render_table() + "\n" + text[text.index(TABLE_END):]
    if new != text:
        readme.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m verispec.bench.suites", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="every suite, its question and its result file")
    r = sub.add_parser("run", help="run one suite")
    r.add_argument("name")
    r.add_argument("--dry-run", action="store_true", help="print the command only")
    n = sub.add_parser("needs", help="the make targets a suite needs")
    n.add_argument("name")
    t = sub.add_parser("table", help="render the README's results table")
    t.add_argument("--write", action="store_true", help="rewrite the table in README.md")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        width = max(len(s.name) for s in SUITES)
        for s in SUITES:
            print(f"{s.name:<{width}}  {s.result or '(not yet run)'}\n{'':<{width}}  {s.question}")
    elif args.cmd == "needs":
        print(" ".join(get(args.name).needs))
    elif args.cmd == "table":
        if args.write:
            print("README.md " + ("updated" if write_readme() else "unchanged"))
        else:
            print(render_table())
    else:
        suite = get(args.name)
        print("$ " + shlex.join(["python", *suite.command]) + (f"\n# {suite.note}" if suite.note else ""), flush=True)
        if not args.dry_run:
            return subprocess.call(suite.argv(), cwd=ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
