"""Deployment artefacts (deploy/): every Kubernetes manifest validates against the Kubernetes
schemas offline; the dashboard and the compose stack parse and every metric they query is one the
server exports; the image's entry command, run outside a container in this environment, answers
/health and drains on SIGTERM."""
from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

yaml = pytest.importorskip("yaml")
kv = pytest.importorskip("kubernetes_validate")
pytest.importorskip("fastapi")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.30.0"


def _exported_names() -> set[str]:
    """Every sample name the server can export (labelled families included before first use)."""
    from verispec.serve.metrics import ServerMetrics
    names = set()
    for fam in ServerMetrics().registry.collect():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
                    "gauge": [""]}.get(fam.type, [""])
        names |= {fam.name + s for s in suffixes}
    return names


def _queried(expr: str) -> set[str]:
    return set(re.findall(r"verispec:[a-z0-9_:]+", expr))


@pytest.mark.parametrize("manifest", sorted((DEPLOY / "k8s").glob("*.yaml")), ids=lambda p: p.name)
def test_kubernetes_manifests_validate(manifest):
    docs = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
    assert docs
    for doc in docs:
        kv.validate(doc, K8S_VERSION, strict=True)


def test_manifests_wire_probes_scaling_and_metrics():
    dep = yaml.safe_load((DEPLOY / "k8s" / "deployment.yaml").read_text())
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["livenessProbe"]["httpGet"]["path"] == "/health" and c["readinessProbe"]["httpGet"]["path"] == "/ready"
    grace = float(c["args"][c["args"].index("--shutdown-grace") + 1])
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace
    hpa = yaml.safe_load((DEPLOY / "k8s" / "hpa.yaml").read_text())
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    rules = yaml.safe_load(yaml.safe_load((DEPLOY / "k8s" / "prometheus-adapter-rules.yaml").read_text())
                           ["data"]["config.yaml"])["rules"]
    assert any(r["name"]["as"] == metric and _queried(r["seriesQuery"]) <= _exported_names() for r in rules)
    with pytest.raises(Exception):                          # the validator does reject a bad manifest
        kv.validate(dict(dep, spec=dict(dep["spec"], replicas="two")), K8S_VERSION, strict=True)


def test_dashboard_queries_only_exported_metrics():
    dash = json.loads((DEPLOY / "grafana" / "verispec-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    queried = set().union(*map(_queried, exprs))
    missing = queried - _exported_names()
    assert not missing, missing
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for what in ("acceptance rate per draft position", "mean acceptance length", "drafts", "time to first token",
                 "inter-token", "end-to-end", "queue depth"):
        assert what in titles, what


def test_compose_stack_parses_and_points_at_its_files():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert {"verispec", "prometheus", "grafana"} <= set(compose["services"])
    for svc in compose["services"].values():
        for vol in svc.get("volumes", []):
            assert (DEPLOY / vol.split(":")[0]).exists(), vol
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert prom["scrape_configs"][0]["metrics_path"] == "/metrics"


def _entry_command(dockerfile: Path) -> list[str]:
    text = dockerfile.read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    assert entry[:2] == ["verispec", "serve"] and re.search(r"^USER (?!root)", text, re.M)
    return entry + cmd


def test_image_entry_command_serves_health_and_drains(tmp_path):
    from verispec.bench.harness import free_port
    argv = _entry_command(DEPLOY / "Dockerfile")
    port = free_port()
    argv = [sys.executable, "-m", "verispec.cli"] + argv[1:]
    argv[argv.index("--host") + 1], argv[argv.index("--port") + 1] = "127.0.0.1", str(port)  # loopback only
    log = open(tmp_path / "serve.log", "w")
    # --no-compile: the image compiles at start-up (minutes of the suite's 2 cores); /ready waits for that
    proc = subprocess.Popen(argv + ["--num-threads", "1", "--no-compile"], stdout=log, stderr=subprocess.STDOUT,
                            cwd=tmp_path,
                            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"),
                                 "VERISPEC_CHECKPOINTS": str(ROOT / "checkpoints")})
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200 and \
                        httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.25)
        else:
            pytest.fail("the entry command never turned /health and /ready true: " + shlex.join(argv))
        assert httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
