"""llama.cpp's own server as a Spec-Bench peer: ``llama-server`` (built from the vendored source
by ``make llama-server``) on the same GGUF, one request at a time over loopback HTTP, interleaved
per prompt with verispec's methods by the runner.

llama-cpp-python exposes llama.cpp's decoding loop but not its newer speculative modes; the
server does. Three kinds (``SERVER_KINDS``):

* ``llama-server``: plain decoding.
* ``llama-server-ngram``: ``--spec-type ngram-mod``, llama.cpp's n-gram drafting from the context.
* ``llama-server-draft``: ``--spec-type draft-simple`` with a draft GGUF (option ``draft_model``:
  a model name or path, e.g. the Qwen2.5-Coder 0.5B for the 1.5B target).

Option ``args``: extra server flags (a list), appended last. Each request posts the prompt's token
ids to ``/completion`` (no chat template: the ids are the prompt), greedy, without the prompt
cache (``cache_prompt`` false: every method prefills every prompt), and reads the generated ids
back. ``wall_s`` is the HTTP round trip on loopback, which includes the server's own request
handling (about a millisecond). Steps, for the acceptance columns, come from the server's
``timings`` (predicted tokens minus accepted draft tokens) where it reports drafts.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from ..core.metrics import SpecStats
from ..core.sampling import SamplingParams
from ..models.loading import LoadedModel
from .harness import ROOT, free_port
from .llamacpp import GgufPeer, gguf_path, gguf_target
from .records import BenchError, GenResult

SERVER_KINDS = ("llama-server", "llama-server-ngram", "llama-server-draft")
BUILD_HINT = "llama-server is not built: `make llama-server` builds it from llama.cpp's source (cmake)"


def server_binary() -> Path:
    """``VERISPEC_LLAMA_SERVER``, else the checkout's ``build/llama.cpp/bin/llama-server``."""
    path = Path(os.environ.get("VERISPEC_LLAMA_SERVER") or ROOT / "build" / "llama.cpp" / "bin" / "llama-server")
    if not path.is_file():
        raise BenchError(f"{BUILD_HINT} (looked for {path})")
    return path


def server_args(kind: str, options: dict) -> list[str]:
    """The flags a kind adds to the plain server's."""
    if kind not in SERVER_KINDS:
        raise BenchError(f"unknown llama-server peer {kind!r}; use one of {SERVER_KINDS}")
    extra = [str(a) for a in options.get("args", [])]
    if kind == "llama-server-ngram":
        return ["--spec-type", "ngram-mod", *extra]
    if kind == "llama-server-draft":
        if not options.get("draft_model"):
            raise BenchError("llama-server-draft needs 'draft_model' (a GGUF model name or path)")
        return ["--spec-type", "draft-simple", "-md", str(gguf_path(options["draft_model"])), *extra]
    return extra


class LlamaServerRunner(GgufPeer):
    """Runs one llama-server peer: ``generate(prompts, params) -> GenResult``, one prompt at a time."""

    def __post_init__(self):
        import httpx
        binary, extra = server_binary(), server_args(self.kind, self.options)
        port = free_port()
        threads = str(torch.get_num_threads())
        self._log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [str(binary), "-m", str(self.path), "--host", "127.0.0.1", "--port", str(port), "-t", threads,
               "-tb", threads, "-np", "1", "-c", str(self.n_ctx), *extra]
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600.0)
        self._wait_ready()
        self.version = self._client.get("/props").json().get("build_info", "llama-server")

    def _wait_ready(self, timeout: float = 300.0) -> None:
        import httpx
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise BenchError(f"llama-server exited (code {self._proc.returncode}): {self._tail()}")
            try:
                if self._client.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.close()
        raise BenchError(f"llama-server was not ready after {timeout:.0f} s: {self._tail()}")

    def _tail(self) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")[-600:]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> GenResult:
        if len(prompts) != 1:
            raise BenchError("the llama-server peer runs one sequence at a time")
        prompt = [int(t) for t in prompts[0]]
        if len(prompt) + params.max_tokens > self.n_ctx:
            raise BenchError(f"prompt of {len(prompt)} tokens + {params.max_tokens} new exceeds n_ctx {self.n_ctx}")
        body = {"prompt": prompt, "n_predict": params.max_tokens, "cache_prompt": False, "return_tokens": True,
                "stream": False, "temperature": 0.0, "top_k": 1}
        if not params.greedy:
            body.update(temperature=params.temperature, top_p=params.top_p, top_k=max(0, params.top_k))
        if params.seed is not None:
            body["seed"] = int(params.seed)
        t0 = time.perf_counter()
        r = self._client.post("/completion", json=body)
        wall = time.perf_counter() - t0
        if r.status_code != 200:
            raise BenchError(f"llama-server answered {r.status_code}: {r.text[:300]}")
        doc = r.json()
        out = [int(t) for t in doc.get("tokens", [])]
        while out and out[-1] in self.eos_token_ids:
            out.pop()
        timings = doc.get("timings", {})
        accepted = int(timings.get("draft_n_accepted", 0) or 0)
        stats = SpecStats(num_steps=max(1, len(out) - accepted), num_emitted_tokens=len(out))
        return GenResult([out], [self.tokenizer.decode(out, skip_special_tokens=True)], wall, stats)

    def close(self) -> None:
        self._client.close()
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()


def build_llama_server(kind: str, loaded: LoadedModel, options: dict | None) -> LlamaServerRunner:
    """The peer for ``loaded`` (its GGUF file): ``BenchError`` when llama-server cannot run it."""
    path, eos = gguf_target(loaded, "llama-server")
    return LlamaServerRunner(kind, path, eos, loaded.tokenizer, dict(options or {}))
