"""``verispec serve``: OpenAI compatibility, continuous batching, limits, auth, metrics, policy.

Two real servers run in subprocesses (``python -m verispec.serve``) for the whole module:
``plain`` (no speculation, no key) and ``guarded`` (ngram speculation with a batch-size table,
an API key, small prompt limit, response cache). In-process servers (uvicorn in a thread) cover
what needs a hook into the engine: engine failures, timeouts, a full queue.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from verispec import LLM, SamplingParams  # noqa: E402
from verispec.bench.harness import free_port  # noqa: E402
from verispec.drafting.ngram import NgramDrafter  # noqa: E402
from verispec.core.engine import Engine, Sequence  # noqa: E402
from verispec.serve.app import ServeConfig, create_app  # noqa: E402
from verispec.serve.policy import TablePolicy  # noqa: E402  (the estimator's tests: test_draft_budget.py)
from verispec.core.tree import DraftTree  # noqa: E402
from helpers import dense_module_fixtures  # noqa: E402

target, llm = dense_module_fixtures()   # references for server processes, which load dense weights

MODEL = "smollm2-135m"
KEY = "sk-test-7f3a"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
TABLE = {"1": 4, "3": 2, "4": 0}
ROOT = Path(__file__).resolve().parents[1]
GREEDY16 = SamplingParams(temperature=0.0, max_tokens=16)


# ---------------------------------------------------------------------------- server processes
@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Two server processes and this one share the cores: one intra-op thread each (more
    threads than free cores make every OpenMP barrier spin)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class ServerProcess:
    """A ``python -m verispec.serve`` subprocess on a free loopback port."""

    def __init__(self, *args: str, api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "verispec.serve", "--model", MODEL, "--port", str(self.port),
               "--num-threads", "1", "--log-level", "warning", *args]
        if "--weights" not in args:         # references are dense fp32 decodes (the server's default is auto)
            cmd += ["--weights", "dense"]
        if "--compile" not in args:         # compiling costs minutes of the suite's 2 cores (default: on)
            cmd += ["--no-compile"]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
        env.pop("VERISPEC_API_KEY", None)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.http = httpx.Client(base_url=self.url, timeout=120)      # one client: no per-call setup

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, timeout: float = 150.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if self.http.get("/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        pytest.fail(f"server not ready after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        return Path(self.log.name).read_text()[-4000:]

    def client(self) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0,
                             timeout=120)

    def post(self, path: str, body: dict, **kw) -> httpx.Response:
        return self.http.post(path, json=body, headers=self.headers, **kw)

    def metrics(self) -> dict[str, float]:
        """Sample name (with sorted labels) -> value."""
        text = self.http.get("/metrics", headers=self.headers).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def servers():
    plain = ServerProcess("--max-num-seqs", "8", "--max-model-len", "512", "--shutdown-grace", "60")
    guarded = ServerProcess("--speculative-config", json.dumps(NGRAM), "--num-speculative-tokens-per-batch-size",
                            json.dumps(TABLE), "--max-num-seqs", "4", "--max-model-len", "512",
                            "--max-prompt-tokens", "256", "--max-queue", "64", "--request-timeout", "60",
                            "--response-cache", "16", api_key=KEY)
    try:
        plain.wait_ready()
        guarded.wait_ready()
        yield {"plain": plain, "guarded": guarded}
    finally:
        plain.stop()
        guarded.stop()


@pytest.fixture(scope="module")
def plain(servers) -> ServerProcess:
    return servers["plain"]


@pytest.fixture(scope="module")
def guarded(servers) -> ServerProcess:
    return servers["guarded"]


def _ref(llm: LLM, prompt: str, max_tokens: int = 16, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw))[0]


def _stream_text(chunks, chat: bool = False) -> tuple[str, str | None, object]:
    text, reason, usage = [], None, None
    for ch in chunks:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            text.append((c.delta.content or "") if chat else c.text)
            reason = c.finish_reason or reason
    return "".join(text), reason, usage


# ---------------------------------------------------------------------------- OpenAI client
PROMPTS = ["The capital of France is", 'Translate "thank you" into Japanese:',
           "Here is a list of emoji: 😀 😃"]


@pytest.fixture(scope="module")
def refs(llm) -> dict:
    """Greedy 16-token ``LLM.generate`` outputs of ``PROMPTS``."""
    return {p: _ref(llm, p, 16) for p in PROMPTS}


@pytest.mark.parametrize("which", ["plain", "guarded"])
def test_openai_client_completions_match_llm_generate(servers, refs, which):
    srv = servers[which]
    client = srv.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    for prompt in PROMPTS if which == "plain" else PROMPTS[1:2]:
        ref = refs[prompt]
        full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        streamed, reason, usage = _stream_text(client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert full.choices[0].text == streamed == ref.text, prompt
        assert full.choices[0].finish_reason == reason == ref.finish_reason
        assert full.usage.completion_tokens == usage.completion_tokens == len(ref.token_ids)
        assert full.usage.prompt_tokens == usage.prompt_tokens == len(ref.prompt_token_ids)
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert full.id.startswith("cmpl-") and full.object == "text_completion" and full.model == MODEL


def test_openai_client_chat_and_stop_strings(plain, llm):
    client = plain.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three fruits."}]
    ref = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=16))[0]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True))
    streamed, reason, _ = _stream_text(chunks, chat=True)
    assert full.choices[0].message.content == streamed == ref.text
    assert full.choices[0].message.role == "assistant" and chunks[0].choices[0].delta.role == "assistant"
    assert full.choices[0].finish_reason == reason == ref.finish_reason
    assert full.object == "chat.completion" and chunks[0].object == "chat.completion.chunk"
    # a stop string from the middle of the reference text: cut there, never streamed past it
    words = ref.text.split()
    stop = [words[len(words) // 2], "\n\n\n\n"]
    ref_stop = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=16, stop=stop))[0]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stop=stop)
    streamed, reason, _ = _stream_text(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stop=stop, stream=True), chat=True)
    assert full.choices[0].message.content == streamed == ref_stop.text
    assert stop[0] not in streamed and reason == "stop" == full.choices[0].finish_reason
    # vLLM's include_stop_str_in_output: the text runs to the end of the stop string
    ref_in = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=16, stop=stop, include_stop_str_in_output=True))[0]
    assert ref_in.text == ref_stop.text + stop[0]
    extra = {"include_stop_str_in_output": True}
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stop=stop,
                                          extra_body=extra)
    streamed, reason, _ = _stream_text(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stop=stop, stream=True, extra_body=extra),
        chat=True)
    assert full.choices[0].message.content == streamed == ref_in.text


@pytest.mark.parametrize("which", ["plain", "guarded"])
def test_openai_client_logprobs_match_llm_generate(servers, llm, which):
    """Completions (``logprobs: k``) and chat (``logprobs`` + ``top_logprobs``), whole and streamed,
    report the target's logprobs of every output token, as ``LLM.generate`` does; the guarded server
    speculates (ngram), so its numbers come from verification forwards."""
    client = servers[which].client()
    prompt = PROMPTS[2]                            # emoji: byte-level tokens that hold partial characters
    ref = _ref(llm, prompt, 16, logprobs=2)
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=2)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ref.token_ids)
    assert lp.token_logprobs == pytest.approx([e.logprob for e in ref.logprobs], abs=2e-3)
    assert all(len(top) in (2, 3) and max(top.values()) == pytest.approx(lp_, abs=2e-3)
               for top, lp_ in zip(lp.top_logprobs, lp.token_logprobs))        # greedy: the best one
    text = full.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(text)
    assert any(t.startswith("bytes:\\x") for t in lp.tokens)          # partial characters are named by bytes
    for tok, off in zip(lp.tokens, lp.text_offset):
        assert tok.startswith("bytes:") or text[off:off + len(tok)] == tok
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                              logprobs=2, stream=True))
    assert [x for ch in streamed if ch.choices and ch.choices[0].logprobs
            for x in ch.choices[0].logprobs.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-6)
    messages = [{"role": "user", "content": "Name three fruits."}]
    cref = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=12, logprobs=3))[0]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in cref.logprobs], abs=2e-3)
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token for c in content)
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8") == chat.choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    got = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.token for c in got] == [c.token for c in content]
    plain_chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert plain_chat.choices[0].logprobs is None


@pytest.mark.parametrize("which", ["plain", "guarded"])
def test_penalties_and_min_p_match_llm_generate(servers, llm, which):
    client = servers[which].client()
    kw = dict(presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.2, min_tokens=16)
    ref = _ref(llm, PROMPTS[1], 16, **kw)
    assert ref.token_ids != _ref(llm, PROMPTS[1], 16).token_ids          # the penalties matter here
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                    presence_penalty=0.5, frequency_penalty=0.4,
                                    extra_body={"repetition_penalty": 1.2, "min_p": 0.05, "min_tokens": 16})
    assert out.choices[0].text == ref.text
    tok = llm.encode_prompt(" banana")[1][-1]
    biased = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0,
                                       logit_bias={str(tok): 100})
    assert biased.choices[0].text == _ref(llm, PROMPTS[1], 4, logit_bias={tok: 100.0}).text == " banana" * 4
    allowed = llm.encode_prompt(" yes no")[1][-2:]
    only = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0,
                                     extra_body={"allowed_token_ids": allowed})
    assert only.choices[0].text == _ref(llm, PROMPTS[1], 4, allowed_token_ids=allowed).text


def test_echo_prompt_logprobs_and_prompt_batches_as_lm_eval_sends_them(guarded, llm):
    """lm-eval-harness scores text through /v1/completions with a batch of token prompts,
    ``echo``, ``logprobs: 1`` and ``max_tokens`` 1 (or 0): every prompt token but the first gets
    the target's logprob, the first gets null; one choice per prompt, in order."""
    client = guarded.client()
    prompts = [llm.encode_prompt(t)[1] for t in ("The capital of France is Paris.", "Two plus two is four")]
    want = [llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
            for ids in prompts]
    for max_tokens in (1, 0):
        out = client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=max_tokens,
                                        temperature=0)
        assert [c.index for c in out.choices] == [0, 1]
        assert out.usage.prompt_tokens == sum(map(len, prompts))
        assert out.usage.completion_tokens == 2 * max_tokens
        for c, ids, w in zip(out.choices, prompts, want):
            lp = c.logprobs
            assert len(lp.tokens) == len(ids) + max_tokens
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            assert lp.token_logprobs[1:len(ids)] == pytest.approx([e.logprob for e in w.prompt_logprobs], abs=2e-3)
            prompt_text = llm.tokenizer.decode(ids, skip_special_tokens=True)
            assert c.text == prompt_text + (w.text if max_tokens else "")
            if max_tokens == 0:
                assert c.finish_reason == "length"
    chunks = list(client.completions.create(model=MODEL, prompt=prompts[0], echo=True, max_tokens=4,
                                            temperature=0, stream=True))
    assert chunks[0].choices[0].text == llm.tokenizer.decode(prompts[0], skip_special_tokens=True)
    assert "".join(ch.choices[0].text for ch in chunks) == chunks[0].choices[0].text + _ref(llm, {"prompt_token_ids": prompts[0]}, 4).text


def test_tokenize_and_detokenize(guarded, llm):
    ids = llm.encode_prompt(PROMPTS[0])[1]
    r = guarded.post("/tokenize", {"model": MODEL, "prompt": PROMPTS[0]})
    assert r.status_code == 200 and r.json()["tokens"] == ids and r.json()["count"] == len(ids)
    chat = guarded.post("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == llm.tokenizer(llm.apply_chat_template([{"role": "user", "content": "Hi"}]),
                                           add_special_tokens=False).input_ids
    assert guarded.post("/detokenize", {"tokens": ids}).json() == {"prompt": llm.tokenizer.decode(ids, skip_special_tokens=True)}
    for path, body in (("/tokenize", {}), ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}),
                       ("/detokenize", {"tokens": [10**9]}), ("/detokenize", {"tokens": "x"})):
        r = guarded.post(path, body)
        assert r.status_code == 400 and "error" in r.json(), (path, body, r.text)
    assert guarded.http.post("/tokenize", json={"prompt": "a"}).status_code == 401          # the key is needed


def test_n_choices_whole_and_streamed(plain, llm):
    """``n`` choices: greedy ones all equal ``LLM.generate``; seeded sampled ones are reproducible
    (choice i uses seed + i), differ from each other, and stream per index to the same texts."""
    client = plain.client()
    prompt = PROMPTS[0]
    ref = _ref(llm, prompt, 12)
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert all(c.text == ref.text for c in greedy.choices)
    assert greedy.usage.completion_tokens == 3 * len(ref.token_ids)
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    kw = dict(model=MODEL, messages=messages, max_tokens=16, temperature=1.0, seed=11, n=3)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    texts = [c.message.content for c in sorted(a.choices, key=lambda c: c.index)]
    assert texts == [c.message.content for c in sorted(b.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 3, texts
    solo = llm.chat(messages, SamplingParams(temperature=1.0, max_tokens=16, seed=12))[0]
    assert texts[1] == solo.text                                   # choice 1 = seed 12
    per, reasons, roles = {}, {}, set()
    for ch in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        for c in ch.choices:
            roles.update([c.index] if c.delta.role == "assistant" else [])
            per[c.index] = per.get(c.index, "") + (c.delta.content or "")
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
        if ch.usage is not None:
            assert ch.usage.completion_tokens == a.usage.completion_tokens
    assert [per[i] for i in range(3)] == texts and roles == {0, 1, 2}
    assert all(reasons[i] == a.choices[i].finish_reason for i in range(3))


# ---------------------------------------------------------------------------- continuous batching
def test_16_concurrent_streams_match_their_solo_outputs(plain, llm, spec_bench):
    """16 streams at once (8 rows: half of them queue) against each prompt decoded alone (batch 1,
    in this process, in parallel with the server; the server alone equals ``LLM.generate``)."""
    prompts = [q["turns"][0][:120] for q in spec_bench[:16]]
    body = {"model": MODEL, "max_tokens": 16, "temperature": 0}
    alone = LLM(loaded=llm.target, max_num_seqs=1)
    client = plain.client()
    barrier = threading.Barrier(len(prompts))

    def stream(p: str) -> str:
        barrier.wait()
        return _stream_text(client.completions.create(prompt=p, stream=True, **body))[0]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream, p) for p in prompts]
        solo = [o.text for o in alone.generate(prompts, GREEDY16)]
        together = [f.result() for f in futures]
    assert together == solo


@pytest.mark.parametrize("n", [1, 3])
def test_client_disconnect_mid_stream_frees_its_row(plain, n):
    before = plain.metrics()
    body = {"model": MODEL, "prompt": "Count from one to one hundred:", "max_tokens": 400, "temperature": 0,
            "stream": True, "n": n}
    with httpx.stream("POST", plain.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        got = []
        for line in r.iter_lines():
            if line.startswith("data:"):
                got.append(line)
            if len(got) == 3:
                break
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        after = plain.metrics()
        aborted = after['verispec:request_finished_total{finished_reason=abort}'] - \
            before['verispec:request_finished_total{finished_reason=abort}']
        if aborted >= n and after["verispec:num_requests_running"] == 0:
            break
        time.sleep(0.2)
    assert aborted == n and after["verispec:num_requests_running"] == 0      # every choice cancelled
    generated = after["verispec:generation_tokens_total"] - before["verispec:generation_tokens_total"]
    assert 3 <= generated < 400 * n


def test_compile_gauges_follow_the_compiled_forward():
    """A compiled server's /metrics shows the graphs compiled, the seconds it took and the eager
    forwards (a rise under load is a recompile or a batch off the compiled path)."""
    from types import SimpleNamespace
    from prometheus_client import generate_latest
    from verispec.serve.metrics import ServerMetrics
    m = ServerMetrics()
    m.observe_compiled(SimpleNamespace(graphs=3, compile_s=12.5, eager_calls=7))
    got = {s.name: s.value for fam in text_string_to_metric_families(generate_latest(m.registry).decode())
           for s in fam.samples}
    assert (got["verispec:compiled_graphs"], got["verispec:compile_seconds"], got["verispec:eager_forwards"]) == (3, 12.5, 7)


def test_metrics_parse_and_match_the_work_done(plain):
    before = plain.metrics()
    client = plain.client()
    outs = [client.completions.create(model=MODEL, prompt="One, two,", max_tokens=5, temperature=0),
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=9, temperature=0.8, seed=3,
                                      extra_body={"ignore_eos": True}),
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=7, temperature=0)]
    after = plain.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)
    assert delta("verispec:generation_tokens_total") == sum(o.usage.completion_tokens for o in outs)
    assert delta("verispec:prompt_tokens_total") == sum(o.usage.prompt_tokens for o in outs)
    finished = sum(delta(f"verispec:request_finished_total{{finished_reason={r}}}") for r in ("stop", "length"))
    assert finished == 3
    assert delta("verispec:time_to_first_token_seconds_count") == 3
    assert delta("verispec:e2e_request_latency_seconds_count") == 3
    assert delta("verispec:inter_token_latency_seconds_count") == sum(o.usage.completion_tokens - 1 for o in outs)
    assert after["verispec:num_requests_running"] == 0 and after["verispec:num_requests_waiting"] == 0
    assert after["verispec:spec_decode_num_drafts_total"] == 0          # no speculation on this server


def test_speculative_server_counts_drafts(guarded, llm):
    before = guarded.metrics()
    prompt = "Repeat after me: the cat sat on the mat. the cat sat on the mat. the cat"
    out = guarded.client().completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert out.choices[0].text == _ref(llm, prompt, 16).text
    after = guarded.metrics()
    drafts = after["verispec:spec_decode_num_drafts_total"] - before["verispec:spec_decode_num_drafts_total"]
    draft_toks = after["verispec:spec_decode_num_draft_tokens_total"] - \
        before["verispec:spec_decode_num_draft_tokens_total"]
    accepted = after["verispec:spec_decode_num_accepted_tokens_total"] - \
        before["verispec:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and 0 < accepted <= draft_toks <= 4 * drafts
    per_pos = [after.get(f"verispec:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}", 0.0)
               for i in range(1, 5)]
    assert per_pos == sorted(per_pos, reverse=True) and per_pos[0] >= 1
    assert after["verispec:spec_decode_draft_budget"] == 4      # batch size 1 -> table entry 4
    # the second identical greedy request is answered by the response cache, without engine work
    again = guarded.client().completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    final = guarded.metrics()
    assert again.choices[0].text == out.choices[0].text
    assert final["verispec:response_cache_hits_total"] == after["verispec:response_cache_hits_total"] + 1
    assert final["verispec:generation_tokens_total"] == after["verispec:generation_tokens_total"]


def test_per_request_speculative_stats_and_mean_acceptance_gauge(guarded):
    """``speculative_stats: true`` adds each choice's drafts, accepted tokens per position and mean
    acceptance length (whole: in the choice; streamed: in its finishing chunk); /metrics has the
    server-wide mean acceptance length, consistent with the counters."""
    body = {"model": MODEL, "prompt": "Say it twice: red green blue. red green blue. red green", "max_tokens": 12,
            "temperature": 0, "speculative_stats": True}
    st = guarded.post("/v1/completions", body).json()["choices"][0]["speculative_stats"]
    assert st["num_drafts"] > 0 and 0 < st["num_accepted_tokens"] <= st["num_draft_tokens"]
    assert st["mean_acceptance_length"] == pytest.approx(1 + st["num_accepted_tokens"] / st["num_drafts"], abs=1e-3)
    assert st["accepted_per_pos"] == sorted(st["accepted_per_pos"], reverse=True)
    assert sum(st["accepted_per_pos"]) == st["num_accepted_tokens"] and st["lossy"] is False
    budgets = {int(k): v for k, v in st["draft_budgets"].items()}     # what the estimator chose per step
    assert sum(budgets.values()) == st["num_steps"] and max(budgets) <= 4
    assert sum(v for k, v in budgets.items() if k > 0) >= st["num_drafts"]
    plain = guarded.post("/v1/completions", dict(body, speculative_stats=False, max_tokens=3)).json()
    assert "speculative_stats" not in plain["choices"][0]
    with guarded.http.stream("POST", "/v1/completions", json=dict(body, stream=True, max_tokens=10,
                                                                  prompt="a b c a b c a b c a"),
                             headers=guarded.headers) as r:
        chunks = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data: {")]
    with_stats = [c for c in chunks if "speculative_stats" in c["choices"][0]]
    assert len(with_stats) == 1 and with_stats[0]["choices"][0]["finish_reason"] is not None
    m = guarded.metrics()
    drafts, accepted = m["verispec:spec_decode_num_drafts_total"], m["verispec:spec_decode_num_accepted_tokens_total"]
    assert m["verispec:spec_decode_mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)


# ---------------------------------------------------------------------------- hostile requests
_C, _CH = "/v1/completions", "/v1/chat/completions"
_OK_C = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
_OK_CH = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


def _hostile_field_cases() -> list[tuple[str, str, object, dict | None, set[int]]]:
    """(method, path, body (dict | bytes | None), headers override, allowed statuses), for the
    fields both endpoints share, raw bodies, auth headers and wrong methods."""
    cases: list = []
    bad_common = {
        "max_tokens": ["16", 1.5, -1, 0, 10**20, True, 2**63, [], {}],
        "temperature": [-1, 3, "hot", float("nan"), float("inf"), [0], 1e308],
        "top_p": [0, 1.5, -0.1, "x", float("-inf")],
        "top_k": [-5, "x", 1.5],
        "seed": [2**65, -2**64, "x", 1.5, [1]],
        "stop": [5, [1, 2], [""], ["x"] * 100, "a" * 10000, {"a": 1}],
        "n": [17, 0, -1, "1", 10**9, 1.5],
        "stream": ["yes", 2, None, [True]],
        "stream_options": ["x", {"include_usage": "yes"}, 5],
        "model": ["gpt-4", 123, ["x"]],
        "stop_token_ids": ["x", [1.5], list(range(1000))],
        "ignore_eos": ["no", 3],
        "logit_bias": [{"x": 5}, "x", {"1": 101}, {"99999999": 1}, {"-1": 1}],
        "allowed_token_ids": [[], [-1], [10**9], "x"],
        "presence_penalty": [2.5, "x", float("nan")],
        "frequency_penalty": [-2.1],
        "repetition_penalty": [0, -1, "x", 1000],
        "min_p": [1.5, -0.1, "x"],
        "min_tokens": [5],
        "use_beam_search": [True],
        "guided_json": [3, "{not json", ["x"], {"type": "object", "properties": 5}],
        "guided_regex": ["(unclosed", 5], "guided_choice": [[], [""], "x"],
        "structured_outputs": [{}, {"regex": "a", "choice": ["b"]}, {"json_schema": {}}, "x"],
        "response_format": [{"type": "xml"}, {"type": "json_schema"}, "json", {"type": "json_schema", "json_schema": 3}],
        "include_stop_str_in_output": ["yes", 3],
    }
    for base, path in ((_OK_C, _C), (_OK_CH, _CH)):
        for field, values in bad_common.items():
            for v in values:
                cases.append(("POST", path, dict(base, **{field: v}), None, {400, 404}))
        for field in base:
            if field in ("prompt", "messages"):
                cases.append(("POST", path, {k: v for k, v in base.items() if k != field}, None, {400}))
        for raw in (b"", b"{", b"null", b"[]", b"123", b'"str"', b'{"prompt": }', b"[" * 100000,
                    b"\xff\xfe\x00", b'{"max_tokens": 1e999999}', b'{"a": ' + b"9" * 5000 + b"}",
                    b"{" * 50000 + b"}" * 50000, b"\x00" * 100):
            cases.append(("POST", path, raw, None, {400}))
        for hdr in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic " + KEY},
                    {"Authorization": "Bearer"}, {"Authorization": KEY}, {"Authorization": "Bearer " + KEY + "x"},
                    {"Authorization": "Bearer \u00e9".encode()}):
            cases.append(("POST", path, base, hdr, {401}))
        cases.append(("POST", path, dict(base, unknown_field=1, metadata={"x": [1]}), None, {200}))
        cases.append(("POST", path, dict(base, max_tokens=1, stream=True), None, {200}))
        cases.append(("POST", path, dict(base, presence_penalty=1.0, frequency_penalty=-0.5, repetition_penalty=1.2,
                                         min_p=0.1, min_tokens=0, use_beam_search=False), None, {200}))
        cases.append(("POST", path, dict(base, max_tokens=600), None, {400}))
        cases.append(("GET", path, None, None, {405}))
    return cases


def _hostile_cases(long_prompt: str) -> list[tuple[str, str, object, dict | None, set[int]]]:
    """All hostile requests: the shared-field ones plus endpoint-specific ones."""
    cases = _hostile_field_cases()
    c, ch, ok_c, ok_ch = _C, _CH, _OK_C, _OK_CH
    for v in (123, None, {}, [1.5], [[]], [-1], [10**12], True, [], "", [[1, "x"]], ["a"] * 65, ["a", ""]):
        cases.append(("POST", c, dict(ok_c, prompt=v), None, {400}))
    cases.append(("POST", c, dict(ok_c, prompt=long_prompt), None, {400}))
    cases.append(("POST", c, dict(ok_c, prompt=[5] * 300), None, {400}))
    cases.append(("POST", c, dict(ok_c, prompt=[5] * 200, max_tokens=400), None, {400}))
    cases.append(("POST", c, dict(ok_c, prompt="x" * (3 << 20)), None, {413}))
    for v in (dict(ok_c, logprobs=21), dict(ok_c, logprobs=-1), dict(ok_c, logprobs="2"),
              dict(ok_c, best_of=3), dict(ok_c, suffix="x")):
        cases.append(("POST", c, v, None, {400}))
    for v in ([], "hi", [{}], [{"role": "alien", "content": "x"}], [{"role": "user", "content": 5}],
              [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
              [{"role": "user"}] * 3, [{"content": "x"}], [None], [{"role": "user", "content": long_prompt}]):
        cases.append(("POST", ch, dict(ok_ch, messages=v), None, {200, 400}))
    cases.append(("POST", c, dict(ok_c, logprobs=3), None, {200}))
    cases.append(("POST", c, dict(ok_c, prompt=["a", "b"], echo=True, max_tokens=0, logprobs=1), None, {200}))
    cases.append(("POST", ch, dict(ok_ch, logprobs=True, top_logprobs=2, stream=True), None, {200}))
    for v in (dict(ok_ch, top_logprobs=3), dict(ok_ch, logprobs=True, top_logprobs=21), dict(ok_ch, logprobs="yes"),
              dict(ok_ch, tools=[{"type": "function"}]),
              dict(ok_ch, response_format={"type": "json_object"}, guided_regex="a"), dict(ok_ch, max_completion_tokens=-3)):
        cases.append(("POST", ch, v, None, {400}))
    for path in ("/v1/models", "/metrics"):
        cases.append(("GET", path, None, {}, {401}))
        cases.append(("GET", path, None, {"Authorization": "Bearer nope"}, {401}))
    cases += [("GET", "/nope", None, None, {404}), ("DELETE", "/v1/models", None, None, {405}),
              ("GET", "/health", None, {}, {200})]
    return cases


def _send(srv: ServerProcess, case) -> tuple[int, object]:
    method, path, body, headers, _ = case
    h = dict(srv.headers) if headers is None else dict(headers)
    if body is None:
        r = srv.http.request(method, path, headers=h)
    else:
        content = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
        r = srv.http.request(method, path, content=content, headers=dict(h, **{"Content-Type": "application/json"}))
    return r.status_code, r


def test_hostile_requests_never_5xx_and_server_keeps_serving(guarded, llm):
    long_prompt = "word " * 400
    cases = _hostile_cases(long_prompt)
    assert len(cases) >= 200
    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda cs: _send(guarded, cs), cases))
    bad = [(cs[:2], str(cs[2])[:80], status, r.text[:200]) for cs, (status, r) in zip(cases, results)
           if status not in cs[4]]
    assert not bad, bad[:10]
    assert all(status < 500 for status, _ in results)
    for cs, (status, r) in zip(cases, results):
        if 400 <= status < 500 and cs[0] == "POST":
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
    msg = guarded.post("/v1/completions", {"prompt": [5] * 200, "max_tokens": 400}).json()["error"]["message"]
    assert "maximum context length is 512 tokens" in msg and "(200 in the prompt, 400 in the completion)" in msg
    msg = guarded.post("/v1/completions", {"prompt": [5] * 300}).json()["error"]["message"]
    assert "300 tokens" in msg and "256" in msg
    # still serving, with the same answer as the library
    out = guarded.client().completions.create(model=MODEL, prompt="The sky is", max_tokens=12, temperature=0)
    assert out.choices[0].text == _ref(llm, "The sky is", 12).text
    m = guarded.metrics()
    assert m["verispec:num_requests_running"] == 0 and m["verispec:http_errors_total{status=401}"] >= 14


# ---------------------------------------------------------------------------- in-process: engine hooks
class InProcessServer:
    """uvicorn in a thread of the test process, serving the session's ``LLM``."""

    def __init__(self, llm: LLM, **cfg):
        import uvicorn
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(llm, ServeConfig(**{"model_name": MODEL, "max_model_len": 256, **cfg}))
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "InProcessServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.server.started
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    @property
    def scheduler(self):
        return self.app.state.server.scheduler

    def post(self, body: dict) -> httpx.Response:
        return httpx.post(self.url + "/v1/completions", json=body, timeout=60)


@pytest.mark.parametrize("prefill_chunk", [None, 128])
def test_engine_errors_fail_requests_but_not_the_server(llm, prefill_chunk):
    """A failed step fails the running requests, a failed prefill (whole, or one chunk) fails that
    request: 500 with the reason, rows given back, and the next request is served."""
    body = {"model": MODEL, "prompt": "The sky is", "max_tokens": 8, "temperature": 0}
    with InProcessServer(llm, max_num_seqs=2, prefill_chunk=prefill_chunk) as srv:
        eng = srv.scheduler.engine
        real_step, real_model = eng.step, eng.model
        calls = {"step": 0, "prefill": 0}

        def bad_step(*args):
            calls["step"] += 1
            eng.step = real_step
            raise RuntimeError("simulated kernel failure")

        class BadModel(torch.nn.Module):      # the prefill forward, after admission took a row
            cfg = real_model.cfg

            def forward(self, *args, **kw):
                calls["prefill"] += 1
                eng.model = real_model
                raise RuntimeError("simulated prefill failure")
        eng.step = bad_step
        r = srv.post(body)
        assert r.status_code == 500 and "simulated kernel failure" in r.json()["error"]["message"]
        eng.model = BadModel()
        r = srv.post(body)
        assert r.status_code == 500 and "simulated prefill failure" in r.json()["error"]["message"]
        assert calls == {"step": 1, "prefill": 1}
        assert sorted(eng.free_rows) == [0, 1] and not eng.running and not eng.num_prefilling
        ok = srv.post(body)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == _ref(llm, "The sky is", 8).text
        assert srv.scheduler._thread.is_alive() and httpx.get(srv.url + "/health").status_code == 200


def test_a_long_prompt_is_prefilled_between_the_steps_of_running_streams(llm):
    """With chunked prefill a long prompt that arrives while a stream decodes is prefilled one
    chunk per round, the stream stepping between its chunks; both answers are ``LLM.generate``'s."""
    long_prompt = "Summarise: " + " ".join(f"item {i} is {i * i}." for i in range(64))
    n_long = len(llm.tokenizer(long_prompt).input_ids)
    with InProcessServer(llm, max_num_seqs=2, max_model_len=1024, prefill_chunk=128) as srv:
        eng = srv.scheduler.engine
        calls, real_step, real_prefill = [], eng.step, eng.prefill_step

        def step(*a):
            calls.append("step")
            return real_step(*a)

        def prefill_step(n):
            calls.append(("prefill", n))
            return real_prefill(n)
        eng.step, eng.prefill_step = step, prefill_step
        stream_body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0,
                       "ignore_eos": True, "stream": True}
        got = {}
        with httpx.stream("POST", srv.url + "/v1/completions", json=stream_body, timeout=120) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: {"))
            text = json.loads(next(lines)[6:])["choices"][0]["text"]
            sender = threading.Thread(target=lambda: got.update(long=srv.post(
                {"model": MODEL, "prompt": long_prompt, "max_tokens": 8, "temperature": 0})))
            sender.start()
            text += "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines)
        sender.join(120)
    chunked = [i for i, c in enumerate(calls) if c == ("prefill", 128)]     # rounds with a stream running
    assert 500 < n_long < 1024 - 8 and len(chunked) >= 2 and "step" in calls[chunked[0]:chunked[-1]]
    assert got["long"].json()["choices"][0]["text"] == _ref(llm, long_prompt, 8).text
    assert text == _ref(llm, "Once upon a time", 300, ignore_eos=True).text


def test_ready_only_after_the_warm_up(llm, monkeypatch):
    """With ``warmup`` the scheduler decodes before serving: /ready is 503 "warming up" until that
    is over (/health is 200 all along), a request sent meanwhile waits and is answered after it."""
    from verispec.serve.scheduler import Scheduler
    gate, entered = threading.Event(), threading.Event()
    real = Scheduler.warm_up

    def held(self):
        entered.set()
        gate.wait(30)
        return real(self)
    monkeypatch.setattr(Scheduler, "warm_up", held)
    body = {"model": MODEL, "prompt": "The sky is", "max_tokens": 8, "temperature": 0}
    with InProcessServer(llm, max_num_seqs=2, warmup=True) as srv:
        assert entered.wait(30)
        ready = httpx.get(srv.url + "/ready")
        assert ready.status_code == 503 and "warming up" in ready.json()["error"]["message"]
        assert httpx.get(srv.url + "/health").status_code == 200
        early = []
        sender = threading.Thread(target=lambda: early.append(srv.post(body)))
        sender.start()
        time.sleep(0.3)
        assert not early                                    # queued behind the warm-up
        gate.set()
        sender.join(60)
        assert early[0].status_code == 200 and early[0].json()["choices"][0]["text"] == _ref(llm, "The sky is", 8).text
        assert httpx.get(srv.url + "/ready").status_code == 200 and srv.scheduler.warmed.is_set()


def test_the_warm_ups_compiling_is_on_metrics_before_any_request(llm, monkeypatch):
    """/metrics shows the warm-up's compile seconds once /ready is true, not at the first request
    (a benchmark that diffs /metrics around its windows once counted the warm-up in them)."""
    from types import SimpleNamespace

    from verispec.serve.scheduler import Scheduler
    monkeypatch.setattr(llm, "compiled", llm.compiled)

    def fake_warm_up(self):
        self.llm.compiled = SimpleNamespace(graphs=2, compile_s=1.5, eager_calls=0)
        return 0.0
    monkeypatch.setattr(Scheduler, "warm_up", fake_warm_up)
    with InProcessServer(llm, max_num_seqs=2, warmup=True) as srv:
        deadline = time.monotonic() + 30
        while httpx.get(srv.url + "/ready").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        text = httpx.get(srv.url + "/metrics").text
        got = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
        assert got["verispec:compile_seconds"] == 1.5 and got["verispec:compiled_graphs"] == 2


def test_medusa_typical_acceptance_through_http_is_applied_and_reported(llm):
    """The lossy rule reaches the server's engine (the same seeded output as ``LLM.generate``
    with it, not the lossless one) and is reported in the body, every stream chunk and /metrics."""
    prompt = "Write a short story about a robot."
    sp = SamplingParams(temperature=0.9, max_tokens=24, seed=7, ignore_eos=True)
    # every step drafts the whole tree (adaptive drafting off): the rule, not the budgets, is tested
    lossy = LLM(loaded=llm.target, speculative_config={"method": "medusa", "typical_acceptance": True,
                                                      "adaptive_drafting": False})
    want = lossy.generate(prompt, sp)[0]
    lossless = LLM(loaded=llm.target, speculative_config={"method": "medusa", "adaptive_drafting": False}) \
        .generate(prompt, sp)[0]
    assert want.metrics.lossy and not lossless.metrics.lossy and want.token_ids != lossless.token_ids
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0.9, "seed": 7, "ignore_eos": True}
    with InProcessServer(lossy, max_num_seqs=2) as srv:
        r = srv.post(body).json()
        assert r["choices"][0]["text"] == want.text
        assert r["verispec"] == {"acceptance": "lossy_typical", "lossy": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=dict(body, stream=True), timeout=60) as s:
            chunks = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert chunks and all(c["verispec"]["lossy"] for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'verispec:spec_decode_lossy_acceptance{rule="lossy_typical"} 1.0' in metrics
    with InProcessServer(llm, max_num_seqs=1) as srv:
        r = srv.post(dict(body, max_tokens=2)).json()
        assert r["verispec"] == {"acceptance": "lossless", "lossy": False}
        assert 'verispec:spec_decode_lossy_acceptance{rule="lossless"} 0.0' in httpx.get(srv.url + "/metrics").text


def test_life_of_a_head_trained_exported_served_decoded(llm, tmp_path):
    """A tiny EAGLE-3 head is trained (verispec train), exported in vLLM's layout (verispec
    export), served over HTTP from the exported folder, and decodes through the real openai
    client with the same greedy output as vanilla decoding."""
    from verispec.cli import main
    convs = [{"id": f"t{i}", "conversations": [{"role": "user", "content": f"Count from {i} to {i + 5}."},
                                              {"role": "assistant", "content": ", ".join(str(k) for k in range(i, i + 6))}]}
             for i in range(4)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in convs))
    assert main(["train", "eagle3", "--data", str(data), "--out", str(tmp_path / "run"), "--max-steps", "2",
                 "--batch-size", "2", "--heldout-fraction", "0", "--max-length", "64", "--draft-vocab-size", "512",
                 "--quiet", "--ttt-length", "2"]) == 0
    exported = tmp_path / "vllm-head"
    assert main(["export", str(tmp_path / "run" / "checkpoint"), str(exported), "--format", "vllm"]) == 0
    cfg = json.loads((exported / "config.json").read_text())
    assert "eagle_aux_hidden_state_layer_ids" in cfg                      # vLLM's layout, not ours
    served = LLM(loaded=llm.target, speculative_config={"method": "eagle3", "model": str(exported)})
    messages = [{"role": "user", "content": "Count from 3 to 9."}]
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=20))[0]
    with InProcessServer(served, max_num_seqs=2) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                           extra_body={"speculative_stats": True})
        assert r.choices[0].message.content == want.text
        assert r.model_extra["verispec"]["acceptance"] == "lossless"
        assert r.choices[0].model_extra["speculative_stats"]["num_drafts"] > 0     # the head really drafted


def test_prompt_denylist_and_audit_log(llm, tmp_path):
    """Denied prompts and chat messages get 400 prompt_denied (counted); every API request, the
    guard's rejections too, leaves one JSON audit line with a key hash and token counts, and the
    prompt text only when asked."""
    import hashlib
    from verispec.serve.security import PromptDenylist
    deny = PromptDenylist(["# no secrets", r"(?i)password\s*=", "", "forbidden"])
    log = tmp_path / "audit.jsonl"
    auth = {"Authorization": f"Bearer {KEY}"}
    with InProcessServer(llm, max_num_seqs=1, api_key=KEY, prompt_denylist=deny, audit_log=str(log)) as srv:
        ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "The sky is", "max_tokens": 3}, headers=auth).json()
        bad = httpx.post(srv.url + "/v1/completions", json={"prompt": "my Password = 123", "max_tokens": 3},
                         headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "prompt_denied"
        assert "pattern 2" in bad.json()["error"]["message"]
        chat = httpx.post(srv.url + "/v1/chat/completions", headers=auth, json={
            "messages": [{"role": "system", "content": "fine"}, {"role": "user", "content": "say forbidden"}]})
        assert chat.status_code == 400 and "pattern 4" in chat.json()["error"]["message"]
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "x"}).status_code == 401
        with httpx.stream("POST", srv.url + "/v1/completions", headers=auth,
                          json={"prompt": "Hello", "max_tokens": 4, "stream": True, "ignore_eos": True}) as r:
            assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
        httpx.get(srv.url + "/health")
        metrics = httpx.get(srv.url + "/metrics", headers=auth).text
        assert "verispec:prompt_denied_total 2.0" in metrics
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["path"], r["status"]) for r in recs] == [("/v1/completions", 200), ("/v1/completions", 400),
                                                         ("/v1/chat/completions", 400), ("/v1/completions", 401),
                                                         ("/v1/completions", 200)]
    h = hashlib.sha256(KEY.encode()).hexdigest()[:16]
    assert [r["api_key_sha256"] for r in recs] == [h, h, h, None, h]
    assert recs[0]["completion_tokens"] == ok["usage"]["completion_tokens"] and recs[0]["prompt_tokens"] == 3
    assert recs[4]["completion_tokens"] == 4 and all(r["latency_s"] >= 0 for r in recs)
    assert all("prompt" not in r for r in recs) and KEY not in log.read_text()
    log2 = tmp_path / "audit2.jsonl"
    with InProcessServer(llm, max_num_seqs=1, audit_log=str(log2), audit_log_prompts=True) as srv:
        srv.post({"prompt": "The sky is", "max_tokens": 2})
    assert json.loads(log2.read_text().splitlines()[0])["prompt"] == "The sky is"
    with pytest.raises(ValueError, match="line 1: not a regular expression"):
        PromptDenylist(["(unclosed"])


def test_request_timeout_and_queue_full(llm):
    with InProcessServer(llm, max_num_seqs=1, max_queue=1, request_timeout=0.5) as srv:
        r = srv.post({"prompt": "Once upon a time", "max_tokens": 200})
        assert r.status_code == 408 and "timed out" in r.json()["error"]["message"]
        srv.scheduler.request_timeout = None
        body = {"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0}
        with httpx.stream("POST", srv.url + "/v1/completions", json=dict(body, stream=True), timeout=60) as s1:
            assert s1.status_code == 200                        # admitted: the only row is busy
            with cf.ThreadPoolExecutor(1) as pool:
                queued = pool.submit(srv.post, body)
                deadline = time.monotonic() + 10
                while srv.scheduler.num_waiting < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                full = srv.post(body)
                assert full.status_code == 429 and full.json()["error"]["type"] == "rate_limit_error"
                assert [line for line in s1.iter_lines() if line][-1] == "data: [DONE]"
                assert queued.result().status_code == 200


def test_paged_kv_pool_queues_requests_until_blocks_free(llm):
    """A pool of one block of 64 slots holds one request of 45 slots at a time: four concurrent
    requests on four rows run one after another, each answers as ``LLM.generate``, the gauges
    show the pool, and every block comes back."""
    body = {"model": MODEL, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    prompts = ["The sky is", "Once upon a time", "My favourite food is", "Water boils at"]
    from verispec.core.kv_budget import PagedKV
    with InProcessServer(llm, max_num_seqs=4, kv=PagedKV(1)) as srv:
        eng = srv.scheduler.engine
        assert eng.cache.paged and eng.cache.num_blocks == 1
        peak = []
        real_step = eng.step

        def step(*a):
            peak.append((eng.num_running, eng.cache.num_used_blocks))
            return real_step(*a)
        eng.step = step
        with cf.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: srv.post(dict(body, prompt=p)), prompts))
        assert [a.json()["choices"][0]["text"] for a in answers] == \
            [_ref(llm, p, 40, ignore_eos=True).text for p in prompts]
        assert max(n for n, _ in peak) == 1 and max(b for _, b in peak) == 1
        assert eng.cache.num_used_blocks == 0 and eng.kv.committed_blocks == 0
        m = httpx.get(srv.url + "/metrics").text
        assert "verispec:kv_cache_blocks_total 1.0" in m and "verispec:kv_cache_usage_perc 0.0" in m
        too_big = srv.post(dict(body, prompt="The sky is", max_tokens=200))
        assert too_big.status_code == 400 and "KV" in too_big.json()["error"]["message"]


# ---------------------------------------------------------------------------- speculation policy
class _Recorder:
    """A drafter that proposes a fixed 6-node tree and records the calls it gets."""
    hidden_layers, needs_last_hidden, max_tree_nodes = (), False, 6

    def __init__(self):
        self.calls: list[str] = []

    def start(self, row, prompt_ids, features):
        self.calls.append("start")

    def accept(self, row, committed_ids, features):
        self.calls.append("accept")

    def release(self, row):
        self.calls.append("release")

    def propose(self, requests):
        self.calls.append(f"propose{len(requests)}")
        q = torch.softmax(torch.randn(6, 10), -1)
        return [DraftTree(torch.arange(6), torch.tensor([-1, -1, 0, 0, 2, 4]), q) for _ in requests]


def test_engine_budget_caps_trees_and_skips_proposals(single_thread):
    """``Engine.step(budget=k)`` cuts every tree to its first k nodes (a connected prefix, q rows
    alike), proposes nothing at 0, and reports the verified rows; the drafter keeps its state."""
    from helpers import tiny_llama
    inner = _Recorder()
    eng = Engine(tiny_llama(10, 16, 2), inner, max_batch=3, max_len=64)
    seqs = [Sequence([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)) for _ in range(3)]
    eng.add(seqs[0])
    r = eng.step(6)
    assert (r.budget, r.rows, eng.stats.num_draft_tokens) == (6, 1 * (1 + 6), 6)
    eng.add_many(seqs[1:])
    r = eng.step(3)
    assert (r.budget, r.rows, eng.stats.num_draft_tokens) == (3, 3 * (1 + 3), 6 + 3 * 3)
    r = eng.step(0)
    assert (r.budget, r.rows, eng.stats.num_draft_tokens) == (0, 3, 15) and r.emitted == 3
    assert eng.step(99).budget == 6 and eng.step().budget == 6          # never above the drafter's size
    assert inner.calls[:9] == ["start", "propose1", "accept", "start", "start", "propose3"] + ["accept"] * 3
    assert inner.calls[9:12] == ["accept"] * 3                           # budget 0: not asked to propose
    for s in seqs:
        eng.abort(s)
    assert inner.calls[-3:] == ["release"] * 3 and eng.can_admit() and eng.num_running == 0


def test_policy_engine_output_equals_plain_decoding(llm):
    """Budgets change per step as the batch shrinks; greedy outputs stay those of plain decoding."""
    target = llm.target
    prompts = [llm.tokenizer(p).input_ids for p in ("a b c a b c a b", "1, 2, 3, 1, 2, 3,", "The cat sat")]

    def run(drafter, policy=None):
        eng = Engine(target.model, drafter, max_batch=3, max_len=400, eos_token_ids=llm.eos_token_ids)
        seqs = [Sequence(list(p), SamplingParams(temperature=0.0, max_tokens=6 + 5 * i))
                for i, p in enumerate(prompts)]
        eng.add_many(seqs)
        if policy is not None:
            policy.bind(eng.max_tree_nodes)
        while eng.num_running:
            eng.step(policy.budget(eng.num_running) if policy is not None else None)
        return [s.output_ids for s in seqs], eng.stats
    plain, _ = run(None)
    spec, stats = run(NgramDrafter(4), TablePolicy({1: 4, 2: 2, 3: 0}))
    assert spec == plain
    assert 0 < stats.num_drafts < stats.num_steps          # drafted only once the batch shrank


# ---------------------------------------------------------------------------- shutdown (last)
def test_graceful_drain_on_sigterm(plain):
    """SIGTERM (a real signal to the real process) mid-stream: readiness turns false at once, a
    new request gets 503 with Retry-After, the running stream finishes, the process exits 0."""
    body = {"model": MODEL, "prompt": "List the days of the week:", "max_tokens": 48, "temperature": 0,
            "stream": True, "ignore_eos": True}
    assert plain.http.get("/ready").status_code == 200
    with httpx.stream("POST", plain.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert json.loads(first[5:])["choices"][0]["finish_reason"] is None
        plain.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while plain.http.get("/ready").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        ready = plain.http.get("/ready")
        assert ready.status_code == 503 and "draining" in ready.json()["error"]["message"]
        assert plain.http.get("/health").json() == {"status": "draining"}          # alive all the same
        late = plain.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert late.status_code == 503 and int(late.headers["retry-after"]) >= 1
        assert late.json()["error"]["type"] == "service_unavailable"
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][5:])["choices"][0]["finish_reason"] == "length"
    assert plain.proc.wait(40) == 0
    log = plain.output()
    assert "Traceback" not in log


def test_the_server_builds_its_model_off_the_main_thread(monkeypatch):
    """libgomp keeps a worker pool per thread that ran a parallel region: a model built on the main
    thread (uvicorn's event loop) leaves a second pool beside the scheduler thread's, and with more
    OpenMP threads than cores every region of a step pays a wake-up (one stream: 80 against 190
    tokens/s). ``verispec serve`` builds the model and app in a thread that ends; its errors still
    reach the command (exit 1 for a model that cannot load, 2 for a bad setting)."""
    import threading

    import verispec
    import verispec.cli.serve as cli_serve
    seen = []

    def fake_llm(*args, **kwargs):
        seen.append(threading.current_thread())
        raise RuntimeError("no such model")
    monkeypatch.setattr(verispec, "LLM", fake_llm)
    assert cli_serve.main(["--model", "nowhere", "--port", "9"]) == 1
    assert len(seen) == 1 and seen[0] is not threading.main_thread() and not seen[0].is_alive()
    assert seen[0].name == "verispec-load"
    assert cli_serve.off_main_thread(lambda: threading.current_thread().name) == "verispec-load"
    with pytest.raises(KeyError, match="boom"):
        cli_serve.off_main_thread(lambda: {}["boom"])
