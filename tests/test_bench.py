"""``verispec bench``: a tiny end-to-end run, input errors, interruption safety, HF acceptance."""
from __future__ import annotations

import argparse
import json

import pytest

from verispec.bench import BenchError, GenResult
from verispec.bench import report as report_mod
from verispec.bench import runner as runner_mod
from verispec.bench.peers import stats_from_forwards
from verispec.bench.report import PLOTS, write_report
from verispec.bench.runner import BenchConfig, Group, Turn, make_groups, resolve_methods, run_benchmark
from verispec.core.metrics import SpecStats
from helpers import dense_module_fixtures  # noqa: E402

target, llm = dense_module_fixtures()   # the suite's configs name dense weights


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FILES = ("results.json", "report.md") + PLOTS


def tiny_config(**kw) -> BenchConfig:
    base = dict(methods=("vanilla", "ngram", "hf"), categories=("qa", "translation"), per_category=1,
                max_tokens=16, batch_sizes=(1, 2), warmup_tokens=4, hf_weights="shared", name="tiny")
    return BenchConfig(**dict(base, **kw))


@pytest.fixture(scope="module")
def tiny(target, tmp_path_factory):
    """One tiny run (2 questions, 16 tokens, vanilla + ngram + hf, batch 1 and 2) and its files."""
    result = run_benchmark(tiny_config(), loaded=target, progress=False)
    out = tmp_path_factory.mktemp("bench")
    write_report(out, [result])
    return result, out


def test_tiny_run_writes_wellformed_files(tiny):
    result, out = tiny
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
    doc = json.loads((out / "results.json").read_text())
    suite = doc["suites"][0]
    assert [m["name"] for m in suite["methods"]] == ["vanilla", "ngram", "hf"]
    for key in ("cpu_model", "logical_cores", "torch", "dtype", "threads", "memory_source"):
        assert suite["machine"][key] not in (None, ""), key
    overall = {(s["method"], s["batch_size"]): s for s in suite["summary"] if s["category"] == "overall"}
    for method in ("vanilla", "ngram", "hf"):
        for b in (1, 2):
            s = overall[(method, b)]
            assert s["tokens"] > 0 and s["tokens_per_s"] > 0 and s["peak_rss_mib"] > 0
            assert s["speedup_vs_vanilla"] > 0 and s["speedup_vs_hf"] > 0
    assert overall[("vanilla", 1)]["speedup_vs_vanilla"] == pytest.approx(1.0)
    assert overall[("ngram", 1)]["draft_frac"] is not None and overall[("hf", 1)]["draft_frac"] is None
    # the estimator's model beside the measured decode speed-up (prefill left out)
    ngram, vanilla = overall[("ngram", 1)], overall[("vanilla", 1)]
    assert ngram["modelled_speedup"] > 0 and ngram["decode_speedup"] > 0 and ngram["modelled_tokens_per_step"] >= 1
    assert vanilla["modelled_speedup"] is None and vanilla["decode_speedup"] == pytest.approx(1.0)
    assert {r["category"] for r in suite["records"]} == {"qa", "translation"}
    # greedy: every method's output equals vanilla's up to numerical ties
    assert suite["fidelity"] and all(f["status"] in ("identical", "tie") for f in suite["fidelity"])
    md = (out / "report.md").read_text()
    assert "| Method | translation | qa | **Overall** |" in md
    assert "Where speculation stops paying" in md and "![speedup_per_category]" in md
    assert "### Modelled vs measured, decoding steps (batch 1)" in md


def test_report_rerenders_from_results_json(tiny, tmp_path):
    result, out = tiny
    again = report_mod.load_results(out / "results.json")
    write_report(tmp_path, again)
    first = json.loads((out / "results.json").read_text())["suites"][0]
    second = json.loads((tmp_path / "results.json").read_text())["suites"][0]
    assert second["summary"] == first["summary"] and second["records"] == first["records"]


def test_sampling_run_skips_fidelity_and_single_sequence_peers_at_larger_batches(target):
    result = run_benchmark(tiny_config(methods=("vanilla", "hf-pld"), categories=("qa",), temperature=0.8,
                                       max_tokens=8), loaded=target, progress=False)
    assert result.fidelity == []                    # only greedy runs are compared token by token
    assert [(s["method"], s["batch_size"]) for s in result.skipped] == [("hf-pld", 2)]
    assert {(r.method, r.batch_size) for r in result.records} == {("vanilla", 1), ("vanilla", 2), ("hf-pld", 1)}
    assert all(r.num_tokens > 0 for r in result.records)


def test_multi_turn_asks_turn_two_after_own_answer(target):
    seen = []

    class Echo:
        max_batch = 8

        def generate(self, prompts, params):
            seen.extend(prompts)
            return GenResult([[42] * 3 for _ in prompts], ["MY-ANSWER" for _ in prompts], 0.01, SpecStats())
    q = {"question_id": 1, "category": "c", "turns": ["first question", "second question"]}
    group = Group(0, "c", (q,))
    records, transcripts = runner_mod.run_group(Echo(), Turn("echo", 1, group, 0), tiny_config(),
                                                target.tokenizer, runner_mod.RssMeter())
    assert [r.turn for r in records] == [0, 1] and len(transcripts[0]) == 2
    second = target.tokenizer.decode(seen[1])
    assert second.index("first question") < second.index("MY-ANSWER") < second.index("second question")


def test_dataset_line_without_turns_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "qa", "turns": ["hi"]}\n'
                   '{"question_id": 2, "category": "qa"}\n')
    with pytest.raises(BenchError, match=r"bad\.jsonl:2.*turns"):
        runner_mod.load_questions(bad)
    assert _cli(["--dataset", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "turns" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_unknown_category_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(BenchError, match=r"unknown category \['poetry'\].*translation"):
        runner_mod.select_questions(runner_mod.load_questions(None), ("poetry",), 1)
    assert _cli(["--categories", "qa,poetry", "--out", str(tmp_path / "o")]) == 2
    assert "poetry" in capsys.readouterr().err


def _cli(argv: list[str]) -> int:
    from verispec.cli import bench as cli_bench
    parser = argparse.ArgumentParser()
    cli_bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--no-progress"] + argv)
    return args.func(args)


def test_interrupted_run_leaves_no_result_files(target, tmp_path, monkeypatch):
    calls = []
    real = runner_mod.run_group

    def flaky(*a, **kw):
        if calls:
            raise KeyboardInterrupt("simulated interrupt mid-run")
        calls.append(1)
        return real(*a, **kw)
    monkeypatch.setattr(runner_mod, "run_group", flaky)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        write_report(out, run_benchmark(tiny_config(methods=("vanilla", "ngram"), batch_sizes=(1,)),
                                        loaded=target, progress=False))
    assert calls and not out.exists()


def test_failed_write_keeps_previous_files_whole(tiny, tmp_path, monkeypatch):
    result, src = tiny
    out = tmp_path / "out"
    out.mkdir()
    for name in FILES:
        (out / name).write_bytes((src / name).read_bytes())
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(report_mod, "render_plots", lambda *a: 1 / 0)     # fails while rendering
    with pytest.raises(ZeroDivisionError):
        write_report(out, [result])
    monkeypatch.undo()
    real_replace, n = report_mod.os.replace, []

    def dying_replace(a, b):                                               # dies on the 2nd rename
        n.append(1)
        if len(n) == 2:
            raise OSError("disk full (simulated)")
        return real_replace(a, b)
    monkeypatch.setattr(report_mod.os, "replace", dying_replace)
    with pytest.raises(OSError):
        write_report(out, [result])
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(after) == set(before)                    # no temporary files left behind
    json.loads(after["results.json"])                   # rewritten whole
    assert after["report.md"] == before["report.md"]    # the failed one is untouched


def test_methods_resolve_with_defaults_and_unavailable_reasons(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                        # no checkpoints/ here
    cfg = BenchConfig(methods=("ngram", "draft_model", "eagle3", "hf-pld", "hf-assisted"),
                      preset="eagle2-ablation")
    specs = {m.name: m for m in resolve_methods(cfg, "smollm2-135m", 30)}
    assert list(specs)[0] == "vanilla"
    assert specs["ngram"].config == {"method": "ngram", "num_speculative_tokens": 5}
    assert specs["draft_model"].config["model"] == "self"
    assert specs["hf-pld"].config["prompt_lookup_num_tokens"] == 5
    assert specs["hf-assisted"].config["assistant_model"] == "self"
    if runner_mod._checkpoint("smollm2-135m", "eagle3") is None:
        assert "checkpoints/smollm2-135m-eagle3" in specs["eagle3"].unavailable
        assert all(specs[n].unavailable for n in runner_mod.EAGLE2_ABLATION)
    qwen = {m.name: m for m in resolve_methods(BenchConfig(methods=("draft_model",)), "qwen2.5-coder-1.5b", 28)}
    assert qwen["draft_model"].config["model"] == "qwen2.5-coder-0.5b"
    with pytest.raises(BenchError, match="unknown method 'warp'"):
        resolve_methods(BenchConfig(methods=("warp",)), "smollm2-135m", 30)
    with pytest.raises(BenchError, match="vanilla"):
        resolve_methods(BenchConfig(method_configs={"vanilla": {"method": "ngram"}}), "smollm2-135m", 30)
    custom = resolve_methods(BenchConfig(methods=("pld10",), method_configs={
        "pld10": {"peer": "hf-pld", "prompt_lookup_num_tokens": 10}}), "smollm2-135m", 30)[1]
    assert (custom.kind, custom.config) == ("hf-pld", {"prompt_lookup_num_tokens": 10})


def test_batches_are_category_pure_and_full():
    qs = [{"question_id": i, "category": c, "turns": ["x"]} for i, c in enumerate("aaab")]
    groups = make_groups(qs, 2)
    assert [(g.category, [q["question_id"] for q in g.questions]) for g in groups] == \
        [("a", [0, 1]), ("a", [2, 0]), ("b", [3, 3])]


def test_hf_acceptance_from_forward_positions():
    # prompt of 10; prefill+verify 3 drafts (2 kept), verify 3 (0 kept), plain step, verify 3 (3 kept)
    events = [(0, 13), (12, 16), (13, 14), (14, 18)]
    st = stats_from_forwards(events, prompt_len=10, num_new=3 + 1 + 1 + 4)
    assert (st.num_steps, st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (4, 3, 9, 5)
    assert st.accepted_per_pos == [2, 2, 1]
    plain = stats_from_forwards([(0, 10), (10, 11), (11, 12)], prompt_len=10, num_new=3)
    assert (plain.num_steps, plain.num_drafts, plain.num_emitted_tokens) == (2, 0, 2)


def test_rerunning_one_suite_keeps_the_others(tiny, tmp_path):
    """``--suites NAME`` replaces that suite in results.json and keeps the rest, in order."""
    import dataclasses

    from verispec.bench.report import load_results
    from verispec.bench.suite_main import merge_suites
    result, _ = tiny
    other = dataclasses.replace(result, name="other")
    write_report(tmp_path, [result, other])
    rerun = dataclasses.replace(result, wall_s=result.wall_s + 1.0)
    merged = merge_suites(tmp_path / "results.json", [rerun, dataclasses.replace(result, name="new")])
    assert [r.name for r in merged] == ["tiny", "other", "new"]
    assert merged[0].wall_s == rerun.wall_s and merged[1].wall_s == result.wall_s
    assert merge_suites(tmp_path / "absent.json", [rerun]) == [rerun]
    assert [r.name for r in load_results(tmp_path / "results.json")] == ["tiny", "other"]


def test_base_model_without_template_gets_plain_question_answer_text(target, monkeypatch):
    tok = target.tokenizer
    monkeypatch.setattr(tok, "chat_template", None)
    msgs = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another?"}]
    ids = runner_mod.chat_ids(tok, msgs)
    assert tok.decode(ids).endswith("Question: Name a color.\n\nAnswer: Blue.\n\nQuestion: Another?\n\nAnswer:")
