"""The device option (issue #18 items 1, 4, 5a): ``resolve_device``, fp16 packing refused off the
CPU, ``--device`` on every command, and the CPU-provable check that decoding makes no tensor
without naming its device (``device_guard``), shown to fail when one ``device=`` is removed.

Runs on the session's device (``VERISPEC_TEST_DEVICE``, default cpu); no GPU is needed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from device_guard import FactoryDeviceGuard
from verispec import LLM, SamplingParams
from verispec.models.device import device_type, resolve_device, same_device
from verispec.models.loading import check_weights, load_model

HERE = Path(__file__).parent


# -- resolve_device ------------------------------------------------------------------------------
def test_plain_devices_resolve():
    assert resolve_device("cpu") == resolve_device(None) == resolve_device(" cpu ") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert resolve_device("meta") == torch.device("meta")


def test_auto_follows_cuda_availability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert device_type("auto") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("AUTO") == torch.device("cpu")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "", "CPU", "cuda:0:1", "banana"])
def test_unknown_devices_are_a_clear_error(bad):
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device(bad)
    with pytest.raises(ValueError, match="unknown device"):
        device_type(bad)


def test_cuda_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for spec in ("cuda", "cuda:1", torch.device("cuda", 0)):
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device(spec)
    assert device_type("cuda:1") == "cuda"           # argument checks do not need the GPU


def test_cuda_index_past_the_visible_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="only 2 CUDA device"):
        resolve_device("cuda:2")


def test_same_device():
    assert same_device(torch.device("cuda"), torch.device("cuda", 1))
    assert not same_device(torch.device("cuda", 0), torch.device("cuda", 1))
    assert not same_device(torch.device("cpu"), torch.device("cuda"))


# -- fp16 packing is CPU only ----------------------------------------------------------------------
def test_fp16_weights_refused_off_the_cpu_before_anything_loads(monkeypatch):
    import verispec.models.sources as sources

    def never(*a, **k):
        raise AssertionError("the model was resolved: the device check must come first")
    monkeypatch.setattr(sources, "resolve_model", never)
    for dev in ("cuda", "cuda:1", "meta"):
        with pytest.raises(ValueError, match="CPU only.*bfloat16 or float16"):
            load_model("smollm2-135m", weights="fp16", device=dev)
        with pytest.raises(ValueError, match="CPU only.*bfloat16 or float16"):
            LLM("smollm2-135m", weights="fp16", device=dev)
    with pytest.raises(ValueError, match="use dtype float32"):
        check_weights("fp16", "bfloat16", "cpu")
    assert check_weights("fp16", "float32", "cpu").value == "fp16"
    assert check_weights("dense", "bfloat16", "cuda").value == "dense"


# -- where things live ---------------------------------------------------------------------------
def test_engine_cache_generators_and_drafter_live_on_the_models_device(target, device):
    assert LLM(loaded=target).device == device
    assert next(target.model.parameters()).device.type == device.type
    assert target.model.inv_freq.device.type == device.type
    llm = LLM(loaded=target, speculative_config={"method": "eagle3", "model": "checkpoints/smollm2-135m-eagle3"})
    engine = llm.make_engine(2, 64)
    assert same_device(engine.device, device) and engine.cache.k[0].device == engine.device
    assert engine.drafter.cache.k[0].device == engine.device and engine.drafter.device == engine.device
    seq, _ = llm.new_sequence(llm.encode_prompt("Hello there")[1], SamplingParams(temperature=0.5, max_tokens=2))
    engine.add(seq)
    assert seq.generator.device == engine.device
    with pytest.raises(ValueError, match="loaded model lives on"):
        LLM(loaded=target, device="meta")
    from verispec.core.engine import Engine
    with pytest.raises(ValueError, match="differs from the model's"):
        Engine(target.model, max_batch=1, max_len=8, device="meta")


# -- --device on every command -----------------------------------------------------------------------
COMMANDS = {
    "generate": ["generate", "--prompt", "hi"],
    "chat": ["chat"],
    "serve": ["serve"],
    "bench": ["bench"],
    "audit": ["audit"],
    "train eagle3": ["train", "eagle3", "--data", "d.json", "--out", "o"],
    "train eagle": ["train", "eagle", "--data", "d.json", "--out", "o"],
    "train medusa": ["train", "medusa", "--data", "d.json", "--out", "o"],
    "data regenerate": ["data", "regenerate", "--output", "o.jsonl"],
    "data features": ["data", "features", "--data", "d.json", "--out", "o"],
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_device_flag_parses_on_every_command(name, capsys):
    from verispec.cli import build_parser
    parser = build_parser()
    assert parser.parse_args(COMMANDS[name]).device == "cpu"
    for spec in ("cuda:1", "auto", "cuda"):
        assert parser.parse_args(COMMANDS[name] + ["--device", spec]).device == spec
    with pytest.raises(SystemExit) as e:
        parser.parse_args(COMMANDS[name] + ["--device", "gpu"])
    assert e.value.code == 2 and "unknown device 'gpu'" in capsys.readouterr().err


class _Stop(Exception):
    pass


def _recorder(calls: list):
    def record(*args, **kwargs):
        calls.append(kwargs)
        raise _Stop
    return record


def _conversations(tmp_path) -> str:
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"id": "a", "conversations": [{"from": "human", "value": "hi"},
                                                               {"from": "gpt", "value": "hello"}]}]))
    return str(path)


@pytest.mark.parametrize("name", ["generate", "chat", "serve", "audit"])
def test_device_reaches_the_llm(name, monkeypatch):
    import verispec
    from verispec.cli import main
    calls: list = []
    monkeypatch.setattr(verispec, "LLM", _recorder(calls))
    argv = COMMANDS[name] + ["--device", "cuda:1"]
    if name == "audit":
        argv += ["--speculative-config", '{"method": "ngram"}']
    try:
        main(argv)
    except _Stop:
        pass
    assert calls and calls[0]["device"] == "cuda:1"


@pytest.mark.parametrize("name", ["train eagle3", "train eagle", "train medusa", "data features"])
def test_device_reaches_the_training_target(name, monkeypatch, tmp_path):
    import verispec.train.common as common
    from verispec.cli import build_parser, main
    from verispec.cli.train import train_config
    calls: list = []
    monkeypatch.setattr(common, "prepare_data", _recorder(calls))
    argv = [a if a != "o" else str(tmp_path / "o") for a in COMMANDS[name]] + ["--device", "cuda:1"]
    with pytest.raises(_Stop):
        main(argv)
    assert calls[0]["device"] == "cuda:1"
    if name.startswith("train"):
        assert train_config(build_parser().parse_args(argv)).device == "cuda:1"


def test_regenerate_device_dtype_and_weights(monkeypatch, tmp_path):
    import verispec.llm
    from verispec.cli import main
    calls: list = []
    monkeypatch.setattr(verispec.llm, "LLM", _recorder(calls))
    base = ["data", "regenerate", "--input", _conversations(tmp_path), "--output", str(tmp_path / "o.jsonl")]
    for extra, want in (([], ("cpu", "fp16", "float32")),                      # fp16 packing: CPU fp32 default
                        (["--device", "cuda:1"], ("cuda:1", "dense", "float32")),
                        (["--device", "cuda", "--dtype", "bfloat16"], ("cuda", "dense", "bfloat16")),
                        (["--dtype", "bfloat16"], ("cpu", "dense", "bfloat16"))):
        with pytest.raises(_Stop):
            main(base + extra)
        assert (calls[-1]["device"], calls[-1]["weights"], calls[-1]["dtype"]) == want, extra


def test_bench_device(monkeypatch):
    import verispec.bench.runner as runner
    from verispec.bench import BenchError
    from verispec.cli import build_parser
    from verispec.cli.bench import config_from_args
    config = config_from_args(build_parser().parse_args(["bench", "--device", "cuda:1"]))
    assert config.device == "cuda:1" and config.as_dict()["device"] == "cuda:1"
    calls: list = []
    monkeypatch.setattr(runner, "load_model", _recorder(calls))
    with pytest.raises(_Stop):
        runner.run_benchmark(config, progress=False)
    assert calls[0]["device"] == "cuda:1"
    with pytest.raises(BenchError, match="CPU only"):
        runner.BenchConfig(weights="fp16", device="cuda").check()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_asked_without_cuda_fails_cleanly(capsys):
    from verispec.cli import main
    assert main(["generate", "--prompt", "hi", "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


# -- the guard: nothing silently made on the CPU ------------------------------------------------------
def test_guard_flags_device_less_factories_and_only_those():
    with FactoryDeviceGuard(roots=(str(HERE),)) as guard:
        torch.zeros(2)                                  # flagged
        x = torch.ones(2, device="cpu")                 # explicit host tensor
        torch.as_tensor(x)                              # a tensor stays where it is
        torch.nn.Linear(2, 2)                           # flagged: its parameters are made on the CPU
        with torch.device("meta"):
            torch.zeros(3)                              # an explicit default device
    found = {(f.factory, f.file, f.function) for f in guard.findings}
    name = "test_guard_flags_device_less_factories_and_only_those"
    assert found == {("zeros", "test_device.py", name), ("empty", "test_device.py", name)}, guard.report()


# Device-less factory calls allowed in decoding: (file, function). None: host staging (tree
# packing, choices trees) names device="cpu" explicitly and moves what it needs.
OUTSIDE_REGION: set[tuple[str, str]] = set()

SPECS = {
    "vanilla": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "num_matches": 2},
    "eagle3": {"method": "eagle3", "model": "checkpoints/smollm2-135m-eagle3"},
    "eagle": {"method": "eagle", "model": "checkpoints/smollm2-135m-eagle"},
    "medusa": {"method": "medusa", "model": "checkpoints/smollm2-135m-medusa"},
    "draft-chain": {"method": "draft_model", "model": "self", "self_draft_layers": 2, "num_speculative_tokens": 3},
    "draft-tree": {"method": "draft_model", "model": "self", "self_draft_layers": 2, "tree": [[0], [1], [0, 0]]},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
}


def _requests(llm) -> tuple[list, list[SamplingParams]]:
    """Prompts and params that reach every part of decoding: greedy with logprobs, sampled with
    every processor and warper (n = 2), allowed ids, prompt logprobs."""
    chat = {"prompt_token_ids": llm.tokenizer(llm.apply_chat_template(
        [{"role": "user", "content": "Name three colours of the rainbow, then repeat them."}]),
        add_special_tokens=False).input_ids}
    ids = chat["prompt_token_ids"]
    params = [SamplingParams(temperature=0, max_tokens=6, logprobs=2),
              SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, seed=1, max_tokens=6, n=2,
                             repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1,
                             logit_bias={ids[-1]: 1.5}, min_tokens=3),
              SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=sorted(set(ids)), prompt_logprobs=1)]
    return [chat, chat, "Once upon a time"], params


def _unexpected(guard: FactoryDeviceGuard) -> list:
    return [f for f in guard.findings if (f.file, f.function) not in OUTSIDE_REGION]


@pytest.mark.parametrize("method", list(SPECS))
def test_decoding_makes_no_tensor_without_its_device(target, method):
    if method == "suffix":
        pytest.importorskip("arctic_inference.suffix_decoding")
    llm = LLM(loaded=target, speculative_config=SPECS[method], max_num_seqs=4, prefix_cache_mb=16)
    prompts, params = _requests(llm)
    with FactoryDeviceGuard() as guard:
        llm.generate(prompts, params)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))     # a prefix-cache hit
    assert llm.prefix_cache.stats().hits > 0
    print(f"{method}: outside this change's region:\n{guard.report()}")
    assert not _unexpected(guard), guard.report()


def test_structured_output_makes_no_tensor_without_its_device(target):
    llm = LLM(loaded=target, speculative_config=SPECS["ngram"])
    so = {"choice": ["red, orange, yellow", "blue"]}
    with FactoryDeviceGuard() as guard:
        out = llm.generate(["Name three colours:", "The sky is"],
                           [SamplingParams(temperature=0, max_tokens=12, structured_outputs=so),
                            SamplingParams(temperature=0.7, seed=3, max_tokens=12, structured_outputs=so)])
    assert all(o.text in so["choice"] for o in out)
    assert not _unexpected(guard), guard.report()


def _broken(module, old: str, new: str) -> dict:
    """The namespace of ``module``'s source with ``old`` (one ``device=``) replaced by ``new``,
    compiled under the module's own file name (so the guard sees verispec code)."""
    path = Path(module.__file__)
    src = path.read_text()
    assert src.count(old) == 1, old
    ns = {"__name__": module.__name__, "__package__": module.__package__, "__file__": str(path)}
    exec(compile(src.replace(old, new), str(path), "exec"), ns)   # noqa: S102 - our own source, one edit
    return ns


def test_guard_fails_when_one_device_argument_is_removed(target, monkeypatch):
    """Two deliberate regressions: the logits pipeline's row depths (min_tokens) and the n-gram
    drafter's tree made without ``device=``; each is caught at its line, the intact code is not."""
    import verispec.drafting.ngram as ngram
    import verispec.core.logits as logits
    llm = LLM(loaded=target, speculative_config=SPECS["ngram"])
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=4)
    prompt = "one two three one two three one two"
    with FactoryDeviceGuard() as guard:
        llm.generate(prompt, params)
    assert not _unexpected(guard), guard.report()
    broken_logits = _broken(logits, "depth = torch.zeros(self.rows, dtype=torch.long, device=self.device)",
                            "depth = torch.zeros(self.rows, dtype=torch.long)")
    broken_ngram = _broken(ngram, "    return tree_from_lists(toks, pars, device)",
                           "    return DraftTree(torch.tensor(toks, dtype=torch.long), torch.tensor(pars, dtype=torch.long))")
    monkeypatch.setattr(logits, "RowContext", broken_logits["RowContext"])
    monkeypatch.setattr(ngram, "_trie", broken_ngram["_trie"])
    with FactoryDeviceGuard() as guard:
        llm.generate(prompt, params)
    caught = {(f.file, f.function, f.factory) for f in _unexpected(guard)}
    assert caught == {("core/logits.py", "depth", "zeros"), ("drafting/ngram.py", "_trie", "tensor")}, guard.report()
