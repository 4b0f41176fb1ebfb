"""Shared fixtures: the default target model is loaded once per test session, on the device named
by ``VERISPEC_TEST_DEVICE`` (default "cpu"; e.g. "cuda" to run the suite on a GPU; CI stays CPU).
On a CPU it runs the engine's int4 fast path (``VERISPEC_TEST_WEIGHTS``; "dense" for fp32
everywhere); modules compared with HF, server processes or llama.cpp bind dense fp32 ones."""
from __future__ import annotations

import json
import os
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # no busy-waiting threads on shared cores
if "VERISPEC_COST_CACHE" not in os.environ:           # measured draft costs: per test process, not ~/.cache
    os.environ["VERISPEC_COST_CACHE"] = os.path.join(tempfile.mkdtemp(prefix="verispec-costs-"), "costs.json")
if "VERISPEC_STEP_COSTS" not in os.environ:
    # Pinned step costs (``draft_shape.pinned_costs``): every draft shape and drafting decision is
    # the same on any machine, AVX2 or AVX-512, cold cache or warm. The curve is CPU-like: a
    # verify over a few tokens costs about one forward, then grows linearly. Tests of the
    # measurement itself unset the variable (``measured_costs``).
    _pinned = os.path.join(tempfile.mkdtemp(prefix="verispec-pinned-"), "step_costs.json")
    with open(_pinned, "w") as f:
        json.dump({"verify": [[1, 20.0], [2, 20.5], [3, 21.0], [4, 21.5], [6, 23.0], [8, 25.0], [12, 30.0],
                              [16, 35.0], [24, 45.0], [32, 55.0], [64, 95.0]],
                   "draft_fixed": 2.0, "level": [[1, 1.0], [2, 1.1], [4, 1.3], [8, 1.6]]}, f)
    os.environ["VERISPEC_STEP_COSTS"] = _pinned
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("VERISPEC_TEST_THREADS", "2")))
TEST_DEVICE = os.environ.get("VERISPEC_TEST_DEVICE", "cpu")


@pytest.fixture
def measured_costs(monkeypatch):
    """For tests of the cost measurement itself: this machine's measured step costs, not the
    suite's pinned ones."""
    monkeypatch.delenv("VERISPEC_STEP_COSTS", raising=False)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device the session's models run on (``VERISPEC_TEST_DEVICE``, default cpu)."""
    from verispec.models.device import resolve_device
    return resolve_device(TEST_DEVICE)


TEST_WEIGHTS = os.environ.get("VERISPEC_TEST_WEIGHTS", "int4")


@pytest.fixture(scope="session")
def dense_target(device):
    """SmolLM2-135M-Instruct with its dense fp32 weights, as a ``LoadedModel``: for the tests that
    compare against HF transformers or read the checkpoint's own weights."""
    from verispec.models.loading import load_model
    return load_model("smollm2-135m", dtype="float32", device=device)


@pytest.fixture(scope="session")
def session_target(device, request):
    """SmolLM2-135M-Instruct as a ``LoadedModel`` (.model, .tokenizer, .config), with the suite's
    weights: int4-packed on a CPU (``VERISPEC_TEST_WEIGHTS``, default int4: the engine's fast path,
    whose few-token forwards give a one-token forward's bits; about 4x faster than dense fp32 on
    one thread), dense fp32 on another device."""
    if device.type != "cpu" or TEST_WEIGHTS == "dense":
        return request.getfixturevalue("dense_target")
    from verispec.models.loading import load_model
    return load_model("smollm2-135m", dtype="float32", weights=TEST_WEIGHTS)


@pytest.fixture(scope="session")
def target(session_target):
    """``session_target``, under the name the tests use; a module may bind its own (dense) one
    (``helpers.dense_module_fixtures``), which the session fixtures below never see."""
    return session_target


@pytest.fixture(scope="session")
def packed_target(device):
    """The same model with fp16-packed matmul weights (``models.packed``): a slightly different
    target (weights rounded to fp16) whose few-token forwards cost about a one-token forward.
    CPU only: skipped when the session runs on another device."""
    if device.type != "cpu":
        pytest.skip(f"fp16-packed weights are CPU only (session device {device})")
    from verispec.models.loading import load_model
    return load_model("smollm2-135m", dtype="float32", weights="fp16")


@pytest.fixture(scope="session")
def llm(target):
    from verispec import LLM
    return LLM(loaded=target)


@pytest.fixture(scope="session")
def dense_llm(dense_target):
    """An ``LLM`` on the dense fp32 target: the reference of tests that compare against a server
    or CLI process, which load their own (dense) weights."""
    from verispec import LLM
    return LLM(loaded=dense_target)



@pytest.fixture(scope="session")
def spec_bench():
    from verispec.data import spec_bench_questions
    return spec_bench_questions()


@pytest.fixture(scope="session")
def chat_prompts(session_target, spec_bench):
    """Token ids of Spec-Bench first turns with the chat template applied, one per category first."""
    from verispec.data import per_category
    qs = per_category(spec_bench, 2)
    tok = session_target.tokenizer
    out = []
    for q in qs:
        text = tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                       add_generation_prompt=True)
        out.append(tok(text, add_special_tokens=False).input_ids)
    return out


@pytest.fixture(scope="session")
def head_prompts(chat_prompts):
    """The four short prompts the draft-head tests (EAGLE, Medusa) decode."""
    from helpers import HEAD_PROMPTS
    return [chat_prompts[i] for i in HEAD_PROMPTS]


@pytest.fixture(scope="session")
def head_vanilla(session_target, head_prompts):
    """Vanilla greedy continuations (``HEAD_TOKENS``) of ``head_prompts``: the heads' reference."""
    from helpers import HEAD_TOKENS
    from verispec import LLM, SamplingParams
    outs = LLM(loaded=session_target, max_num_seqs=4).generate(
        [{"prompt_token_ids": p} for p in head_prompts], SamplingParams(temperature=0.0, max_tokens=HEAD_TOKENS))
    return [o.token_ids for o in outs]


def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def single_thread():
    """Tiny-tensor tests run far faster on one thread (no OpenMP barriers per op)."""
    yield from _one_thread()


@pytest.fixture(scope="module")
def module_single_thread():
    """``single_thread`` for a whole module of tiny-model tests (``pytestmark`` with usefixtures)."""
    yield from _one_thread()
