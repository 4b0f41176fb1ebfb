"""Property-based requests (hypothesis) over every endpoint of a real server: never a 5xx, never a
hang, and every error in OpenAI's shape. Bodies start from a valid request and get any field
(the request models' own and unknown ones) replaced by arbitrary JSON, or are arbitrary JSON
altogether. ``make test`` runs a short version; ``make test-slow`` a long one."""
from __future__ import annotations

import json
import os
from urllib.parse import quote

import httpx
import pytest

pytest.importorskip("fastapi")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from verispec.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest  # noqa: E402

FAST = int(os.environ.get("VERISPEC_FUZZ_EXAMPLES", "40"))
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) |
                    st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
VALID = {
    "/v1/completions": ({"prompt": "Hi", "max_tokens": 2, "temperature": 0}, CompletionRequest),
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, ChatCompletionRequest),
    "/tokenize": ({"prompt": "Hi"}, TokenizeRequest),
    "/detokenize": ({"tokens": [1, 2]}, DetokenizeRequest),
}


def _mutated(path: str):
    base, model = VALID[path]
    keys = sorted(model.model_fields) + ["unknown_field"]
    edits = st.dictionaries(st.sampled_from(keys), JSON, min_size=1, max_size=3)
    drops = st.sets(st.sampled_from(sorted(base)), max_size=1)
    return st.one_of(st.builds(lambda e, d: {**{k: v for k, v in base.items() if k not in d}, **e}, edits, drops),
                     JSON)


@pytest.fixture(scope="module")
def server(llm):
    from test_serve import InProcessServer
    with InProcessServer(llm, max_num_seqs=2, max_queue=8, request_timeout=30) as srv:
        srv.app.state.server.cfg.max_model_len = 24          # keeps every accepted request short
        yield srv


def _check(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), r.text[:300]


def _run(server, path: str, body) -> None:
    raw = json.dumps(body).encode() if not isinstance(body, bytes) else body
    r = httpx.post(server.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    _check(r)


def _fuzz(examples: int):
    return settings(max_examples=examples, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.parametrize("path", sorted(VALID))
def test_post_endpoints_never_fail_badly(server, path):
    @_fuzz(FAST)
    @given(body=_mutated(path))
    def run(body):
        _run(server, path, body)
    run()


def test_raw_bodies_and_get_endpoints(server):
    @_fuzz(FAST)
    @given(raw=st.binary(max_size=64), model_id=st.text(max_size=20))
    def run(raw, model_id):
        _run(server, "/v1/completions", raw)
        for path in ("/v1/models", f"/v1/models/{quote(model_id, safe='')}", "/health", "/ready", "/metrics"):
            _check(httpx.get(server.url + path, timeout=30))
    run()
    assert httpx.post(server.url + "/v1/completions", json=VALID["/v1/completions"][0]).status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(VALID))
def test_post_endpoints_long_fuzz(server, path):
    @_fuzz(600)
    @given(body=_mutated(path))
    def run(body):
        _run(server, path, body)
    run()
