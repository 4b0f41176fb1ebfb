"""Training pipeline: data formats, loss masks, draft vocabulary, EAGLE-3 TTT, the loop (resume,
DDP), regeneration. Tiny random targets unless a real tokenizer / model is the point."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from train_tiny import VOCAB, tiny_examples, tiny_target, tiny_task
from verispec.bench.harness import free_port
from verispec.formats import load_eagle_head
from verispec.drafting.eagle_head import HeadKind
from verispec.train.data import (Conversation, load_conversations, split_ids, tokenize_conversation)
from verispec.train.eagle3 import Eagle3TTT
from verispec.train.loop import TrainConfig, Trainer, collate
from verispec.train.vocab import build_draft_vocab, token_counts

HERE = Path(__file__).parent


def _sharegpt(i: int, role2: str = "gpt") -> dict:
    return {"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                             {"from": role2, "value": f"answer {i}"}]}


def test_sharegpt_truncated_file_keeps_complete_records(tmp_path):
    recs = [_sharegpt(0), _sharegpt(1, role2="robot"), _sharegpt(2), {"id": "x", "conversations": "no"},
            {"id": "lead", "conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "q"},
                                             {"from": "gpt", "value": "a"}]}, _sharegpt(3)]
    text = json.dumps(recs, indent=2)
    cut = text.rindex('"answer 3"')                         # the file ends inside the last record
    p = tmp_path / "sg.json"
    p.write_text(text[:cut])
    convs, rep = load_conversations(p)
    assert [c.id for c in convs] == ["c0", "c2", "lead"]
    assert rep.truncated_tail and rep.read == 5
    assert sum(rep.skipped.values()) == 2
    assert convs[2].messages[0]["role"] == "user"          # leading bot turn dropped


def test_jsonl_malformed_lines_are_skipped_and_counted(tmp_path):
    good = {"id": "a", "conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]}
    lines = [json.dumps(good), "{not json", json.dumps({"id": "b", "skipped": "prompt too long"}),
             json.dumps({"id": "c", "conversations": [{"role": "user", "content": 3}]}), "",
             json.dumps(dict(good, id="d"))]
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(lines) + "\n")
    convs, rep = load_conversations(p)
    assert [c.id for c in convs] == ["a", "d"]
    assert rep.skipped == {"malformed JSON line": 1, "skipped by regeneration": 1,
                           "unknown role or non-text content": 1}


def test_split_is_deterministic_and_order_free():
    convs = [Conversation(f"id{i}", ({"role": "user", "content": "q"},)) for i in range(400)]
    tr, he = split_ids(convs, 0.1)
    tr2, he2 = split_ids(list(reversed(convs)), 0.1)
    assert {c.id for c in he} == {c.id for c in he2} and 20 < len(he) < 65
    assert not {c.id for c in tr} & {c.id for c in he}


def test_loss_mask_covers_exactly_the_assistant_turns(target):
    tok = target.tokenizer
    conv = Conversation("m", ({"role": "user", "content": "Name a colour."},
                              {"role": "assistant", "content": "Blue is a colour."},
                              {"role": "user", "content": "Another?"},
                              {"role": "assistant", "content": "Green."}))
    ex = tokenize_conversation(tok, conv, 512)
    masked = tok.decode([i for i, m in zip(ex.input_ids, ex.loss_mask) if m])
    assert "Blue is a colour." in masked and "Green." in masked
    assert "Name a colour" not in masked and "Another?" not in masked and "user" not in masked
    cut = tokenize_conversation(tok, conv, 8)
    assert cut is None or len(cut.input_ids) == 8


def test_draft_vocab_round_trip(tmp_path, single_thread):
    counts = torch.zeros(VOCAB, dtype=torch.long)
    counts[[5, 9, 1, 40]] = torch.tensor([10, 7, 7, 1])
    v = build_draft_vocab(counts, 4, always=[47])
    assert v.draft_ids.tolist() == [1, 5, 9, 47]             # top-3 by count (tie: lower id) + always
    t2d = v.target_to_draft()
    assert torch.equal(t2d[v.draft_ids], torch.arange(4)) and int((t2d >= 0).sum()) == 4
    assert v.t2d.sum() == 4 and abs(v.coverage(counts) - 24 / 25) < 1e-9
    task = tiny_task(tiny_target(), tiny_examples(4), draft_vocab=20)
    task.save(tmp_path / "h")
    head = load_eagle_head(tmp_path / "h", tiny_target(), HeadKind.EAGLE3)
    assert torch.equal(head.d2t, task.module.head.d2t) and torch.equal(head.t2d, task.module.head.t2d)
    ids = torch.arange(20)
    assert torch.equal(head.draft_to_target(ids), task.draft_ids)


def test_ttt_length_one_equals_plain_next_token_training(single_thread):
    target = tiny_target()
    data = tiny_examples(3)
    task = tiny_task(target, data, ttt_length=1)
    inp = task.prepare(collate(data))
    out = task.module(inp)
    head = task.module.head
    plain = head(inp.tokens, inp.positions, task.module._fuse(inp.hidden)).logits      # causal, no cache
    ce = -(inp.target_p * F.log_softmax(plain, -1)).sum(-1)
    assert torch.allclose(out.loss_sum, ce[inp.valid].sum(), rtol=1e-5)


@torch.no_grad()
def test_ttt_steps_see_what_the_drafter_sees_at_each_depth(single_thread):
    """TTT step i at column c == the head run with its KV cache on the committed pairs 0..c and a
    chain of i draft nodes (tokens c+2..c+1+i), as the EAGLE drafter runs it."""
    target = tiny_target()
    data = tiny_examples(1, length=16)
    task = tiny_task(target, data, ttt_length=4)
    head = task.module.head
    inp = task.prepare(collate(data))
    steps = task.module.unroll(inp)
    fused = task.module._fuse(inp.hidden)
    for c in (3, 7):
        cache = head.new_cache(1, 64)
        out = head(inp.tokens[:, :c + 1], inp.positions[:, :c + 1], fused[:, :c + 1], cache)
        cache.advance(torch.tensor([0]), c + 1)
        state, logits = out.hidden[:, c:c + 1], out.logits[:, c]
        for i in range(1, 4):
            assert torch.allclose(logits, steps[i - 1][:, c], atol=1e-4), (c, i - 1)
            tok = inp.tokens[:, c + i:c + i + 1]
            pos = torch.tensor([[c + i]])
            local = torch.ones(1, 1, i, dtype=torch.bool)
            o = head(tok, pos, state, cache, rows=torch.tensor([0]), scratch=i - 1, local_mask=local)
            state, logits = o.hidden, o.logits[:, 0]
        assert torch.allclose(logits, steps[3][:, c], atol=1e-4)


def _cfg(out: Path, steps: int, **kw) -> TrainConfig:
    return TrainConfig(out_dir=out, max_steps=steps, batch_size=4, micro_batch_size=2, lr=3e-3, log_every=1,
                       progress=False, **kw)


def test_short_training_lowers_loss_and_raises_acc0(tmp_path, single_thread):
    data = tiny_examples(24)
    task = tiny_task(tiny_target(), data)
    tr = Trainer(task, data, data[:8], _cfg(tmp_path, 40))
    before = tr.evaluate()
    res = tr.fit()
    assert res.eval["loss"] < 0.8 * before["loss"], (before, res.eval)
    assert res.eval["acc0"] > before["acc0"] + 0.15, (before, res.eval)
    logs = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert logs[-1]["final"] and "acc2" in logs[-1]["eval"]
    assert (tmp_path / "checkpoint" / "model.safetensors").exists()


def test_head_init_takes_what_it_says_from_the_target(single_thread):
    """``HeadInit``: random copies nothing; target the LM-head rows and the final norm; target-layer
    also the last decoder layer (q/k/v on the hidden-state half of the input, o, MLP, norms)."""
    target = tiny_target()
    with torch.no_grad():                                    # norms of 1 would not tell a copy from the init
        for n in (target.norm, target.layers[-1].attn_norm, target.layers[-1].mlp_norm):
            n.weight.uniform_(0.5, 1.5)
    data = tiny_examples(8)
    heads = {init: tiny_task(target, data, init=init).module.head for init in ("random", "target", "target-layer")}
    rows = target.lm_head.weight[heads["target"].d2t + torch.arange(heads["target"].d2t.numel())]
    last, h = target.layers[-1], target.cfg.hidden_size
    assert not torch.equal(heads["random"].lm_head.weight, rows)
    assert not torch.equal(heads["random"].norm.weight, target.norm.weight)
    for init in ("target", "target-layer"):
        assert torch.equal(heads[init].lm_head.weight, rows)
        assert torch.equal(heads[init].norm.weight, target.norm.weight)
    layer = heads["target-layer"]
    assert torch.equal(layer.attn.wq.weight[:, h:], last.attn.wq.weight)
    assert torch.equal(layer.attn.wk.weight[:, h:], last.attn.wk.weight)
    assert torch.equal(layer.attn.wo.weight, last.attn.wo.weight)
    assert torch.equal(layer.mlp.w_down.weight, last.mlp.w_down.weight)
    assert torch.equal(layer.hidden_norm.weight, last.attn_norm.weight)
    assert torch.equal(layer.post_attention_layernorm.weight, last.mlp_norm.weight)
    assert torch.equal(layer.attn.wq.weight[:, :h], heads["target"].attn.wq.weight[:, :h])   # embedding half: seeded random
    assert not torch.equal(heads["target"].attn.wo.weight, last.attn.wo.weight)
    with pytest.raises(ValueError):
        tiny_task(target, data, init="layers")


def test_a_narrower_head_mlp(single_thread):
    """``--intermediate-size``: a new head's MLP can be narrower than the target's (a smaller, cheaper
    head); copying the target's last layer into it is refused."""
    from verispec.train.eagle3 import init_eagle3_head, new_head_config
    from verispec.train.vocab import build_draft_vocab
    target = tiny_target()
    vocab = build_draft_vocab(torch.ones(target.cfg.vocab_size), 32)
    cfg = new_head_config(target.cfg, vocab.size, intermediate_size=24)
    head = init_eagle3_head(cfg, target, vocab)
    assert tuple(head.mlp.w_up.weight.shape) == (24, target.cfg.hidden_size)
    assert new_head_config(target.cfg, vocab.size).intermediate_size == target.cfg.intermediate_size
    with pytest.raises(ValueError, match="target-layer"):
        init_eagle3_head(cfg, target, vocab, init="target-layer")
    with pytest.raises(ValueError, match="intermediate_size"):
        new_head_config(target.cfg, vocab.size, intermediate_size=0)


@pytest.mark.parametrize("eagle31,dtype", [(True, "fp32"), (False, "bf16")])
def test_eagle31_switches_and_bf16_train_and_reload(tmp_path, single_thread, eagle31, dtype):
    data = tiny_examples(16)
    task = tiny_task(tiny_target(), data, eagle31=eagle31)
    tr = Trainer(task, data, data[:4], _cfg(tmp_path, 12, dtype=dtype))
    before = tr.evaluate()["loss"]
    res = tr.fit()
    assert res.eval["loss"] < before
    head = load_eagle_head(tmp_path / "checkpoint", tiny_target(), HeadKind.EAGLE3)
    assert head.cfg.fc_norm == head.cfg.norm_output == eagle31
    from safetensors.torch import load_file
    stored = load_file(str(tmp_path / "checkpoint" / "model.safetensors"))
    assert stored["fc.weight"].dtype == torch.bfloat16          # heads are saved in bf16 by default
    assert torch.equal(head.fc.weight, task.module.head.fc.weight.bfloat16().float())


def test_resume_continues_the_same_curve(tmp_path, single_thread):
    data = tiny_examples(16)
    straight = Trainer(tiny_task(tiny_target(), data), data, data[:4], _cfg(tmp_path / "a", 6)).fit()
    half = Trainer(tiny_task(tiny_target(), data), data, data[:4], _cfg(tmp_path / "b", 6, stop_after=3)).fit()
    assert half.steps == 3 and not (tmp_path / "b" / "checkpoint").exists()
    assert (tmp_path / "b" / "checkpoint-last" / "config.json").exists()      # the head so far
    # a differently initialised head: everything must come from the saved state
    second = Trainer(tiny_task(tiny_target(), data, seed=5), data, data[:4], _cfg(tmp_path / "b", 6))
    assert second.step == 3
    resumed = second.fit()
    assert resumed.steps == 6
    assert abs(resumed.last["loss"] - straight.last["loss"]) < 1e-5
    assert abs(resumed.eval["loss"] - straight.eval["loss"]) < 1e-5


def test_a_nan_step_fails_loudly_and_keeps_the_saved_state(tmp_path, single_thread):
    """A non-finite loss stops the run before the optimizer applies it (issue 37: a run that ends
    NaN must fail loudly); the state saved before it is finite and resumes."""
    from verispec.train.loop import NonFiniteLoss
    data = tiny_examples(16)
    task = tiny_task(tiny_target(), data)
    tr = Trainer(task, data, data[:4], _cfg(tmp_path, 6, save_every=2))
    for _ in range(2):
        tr.train_step()
    tr._save_state()
    before = {k: v.clone() for k, v in task.module.state_dict().items()}
    with torch.no_grad():
        next(p for p in task.module.parameters() if p.requires_grad and p.dim() >= 2).fill_(float("nan"))
    with pytest.raises(NonFiniteLoss, match="step 3"):
        tr.train_step()
    assert tr.step == 2
    resumed = Trainer(tiny_task(tiny_target(), data), data, data[:4], _cfg(tmp_path, 6))
    assert resumed.step == 2
    for k, v in resumed.task.module.state_dict().items():
        assert torch.equal(v, before[k]), k
        if v.is_floating_point():
            assert bool(torch.isfinite(v).all()), k


def test_a_sitting_at_the_final_step_reports_the_last_logged_loss(tmp_path, single_thread):
    """Resuming a finished run (to write its checkpoint) runs no step: its result carries the
    last logged training record, not an empty one (the card once printed "loss nan")."""
    data = tiny_examples(16)
    first = Trainer(tiny_task(tiny_target(), data), data, data[:4], _cfg(tmp_path, 3)).fit()
    again = Trainer(tiny_task(tiny_target(), data), data, data[:4], _cfg(tmp_path, 3)).fit()
    assert again.last["step"] == 3 and again.last["loss"] == pytest.approx(first.last["loss"])


@pytest.mark.parametrize("method", ["eagle3", "medusa", "eagle"])
def test_ddp_two_processes_match_one(tmp_path, method):
    """Every trainer, unchanged, under torchrun: 2 processes follow the 1-process curve."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE))
    losses = {}
    for n in (1, 2):
        out = tmp_path / f"n{n}"
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}",
                              "--master_port", str(free_port()), str(HERE / "ddp_train_worker.py"), str(out), method],
                             env=env, capture_output=True, text=True, timeout=200)
        assert run.returncode == 0, f"torchrun with {n} process(es) exited {run.returncode}:\n{run.stderr[-4000:]}"
        logs = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
        losses[n] = [r["loss"] for r in logs if "eval" not in r] + [logs[-1]["eval"]["loss"]]
    assert len(losses[1]) == len(losses[2]) == 5
    for a, b in zip(losses[1], losses[2]):          # tolerance: float summation order only
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), losses


def test_regenerate_is_resumable(llm, tmp_path):
    from verispec.train.regenerate import load_stats, regenerate
    convs = [Conversation(f"r{i}", ({"role": "user", "content": f"Say the number {i}."},)) for i in range(3)]
    convs.append(Conversation("long", ({"role": "user", "content": "word " * 300},)))
    out = tmp_path / "regen.jsonl"
    regenerate(llm, convs[:2], out, max_tokens=4, batch_size=1, progress=False)
    with out.open("a") as f:
        f.write('{"id": "r2", "conversa')                   # a crash in the middle of a line
    run = regenerate(llm, convs, out, max_tokens=4, batch_size=2, max_prompt_tokens=64, progress=False)
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    # completion order: "long" is skipped at admission, before r2's answer ends
    assert [r["id"] for r in recs] == ["r0", "r1", "long", "r2"]
    assert recs[2] == {"id": "long", "skipped": "prompt over 64 tokens"}
    assert run.conversations == 1 and run.skipped == 1
    assert recs[0]["conversations"][-1]["role"] == "assistant" and recs[0]["meta"]["finish_reasons"]
    assert load_stats(out).conversations == 3
    loaded, rep = load_conversations(out)
    assert len(loaded) == 3 and rep.skipped == {"skipped by regeneration": 1}


def test_offline_feature_cache_gives_the_online_inputs(tmp_path, single_thread, capsys):
    from verispec.train.features import FeatureStore, write_features
    target = tiny_target()
    data = tiny_examples(5)
    task = tiny_task(target, data)
    layers = task.module.head.aux_layers
    write_features(target, data, tmp_path / "f", layers, dtype="fp32", shard_sequences=2, progress=False)
    assert "feature cache: 5 sequences" in capsys.readouterr().err
    assert len(list((tmp_path / "f").glob("shard-*.safetensors"))) == 3
    online = task.prepare(collate(data[:3]))
    task.features = FeatureStore(tmp_path / "f", layers, target.cfg.hidden_size)
    cached = task.prepare(collate(data[:3]))
    real = torch.arange(online.hidden.shape[1])[None] < (collate(data[:3]).lengths[:, None] - 1)   # padding differs
    assert torch.allclose(online.hidden[real], cached.hidden[real], atol=1e-5)
    assert torch.allclose(online.target_p[real], cached.target_p[real], atol=1e-5)
    assert torch.equal(online.valid, cached.valid) and online.valid.any()
    with pytest.raises(ValueError, match="needs"):
        FeatureStore(tmp_path / "f", layers[:2], target.cfg.hidden_size)
    with pytest.raises(FileExistsError, match="made with"):           # other settings: refused
        write_features(target, data, tmp_path / "f", layers, progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(FileExistsError, match="no feature-cache index"):
        write_features(target, data, tmp_path / "other", layers, progress=False)


def test_an_interrupted_feature_pass_resumes(tmp_path, single_thread):
    """The index is written after every shard: a pass stopped midway is refused by the trainer
    until a rerun with the same arguments computes the missing sequences only."""
    from verispec.train.features import FeatureStore, write_features
    target = tiny_target()
    data = tiny_examples(5)
    layers = tiny_task(target, data).module.head.aux_layers
    calls, real = [], target.forward

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)
    target.forward = failing
    with pytest.raises(KeyboardInterrupt):
        write_features(target, data, tmp_path / "f", layers, dtype="fp32", shard_sequences=2, progress=False)
    with pytest.raises(ValueError, match="interrupted"):
        FeatureStore(tmp_path / "f", layers, target.cfg.hidden_size)
    calls.clear()
    target.forward = lambda *a, **k: calls.append(1) or real(*a, **k)
    write_features(target, data, tmp_path / "f", layers, dtype="fp32", shard_sequences=2, progress=False)
    assert len(calls) == 3                                   # the first shard's 2 sequences were kept
    store = FeatureStore(tmp_path / "f", layers, target.cfg.hidden_size)
    fresh = tmp_path / "g"
    target.forward = real
    write_features(target, data, fresh, layers, dtype="fp32", shard_sequences=2, progress=False)
    again = FeatureStore(fresh, layers, target.cfg.hidden_size)
    for ex in data:
        a, b = store.get(ex.id, len(ex.input_ids)), again.get(ex.id, len(ex.input_ids))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_cli_trains_an_eagle3_head_that_decodes_losslessly(llm, tmp_path):
    """verispec train eagle3 on a real target and 4 conversations, then greedy decoding with the
    head equals vanilla greedy decoding."""
    from verispec import LLM, SamplingParams
    from verispec.cli import main
    convs = [{"id": f"t{i}", "conversations": [{"role": "user", "content": f"Count from {i} to {i + 5}."},
                                              {"role": "assistant", "content": ", ".join(str(k) for k in range(i, i + 6))}]}
             for i in range(4)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in convs))
    out = tmp_path / "run"
    assert main(["train", "eagle3", "--data", str(data), "--out", str(out), "--max-steps", "2", "--batch-size", "2",
                 "--heldout-fraction", "0", "--max-length", "64", "--draft-vocab-size", "512", "--quiet",
                 "--ttt-length", "2"]) == 0
    meta = json.loads((out / "train_meta.json").read_text())
    assert meta["steps"] == 2 and meta["draft_vocab_size"] == 512 and meta["command"].startswith("verispec")
    spec = LLM(loaded=llm.target, speculative_config={"method": "eagle3", "model": str(out / "checkpoint")})
    prompt = [{"role": "user", "content": "Count from 3 to 9."}]
    params = SamplingParams(temperature=0, max_tokens=24)
    assert spec.chat(prompt, params)[0].token_ids == llm.chat(prompt, params)[0].token_ids
    # warm start: the head's weights and draft vocabulary carry over; a conflicting flag is refused
    warm = tmp_path / "warm"
    assert main(["train", "eagle3", "--data", str(data), "--out", str(warm), "--max-steps", "1", "--batch-size", "2",
                 "--heldout-fraction", "0", "--max-length", "64", "--quiet", "--ttt-length", "2", "--lr", "0",
                 "--init-from", str(out / "checkpoint")]) == 0
    a, b = (load_file(str(d / "checkpoint" / "model.safetensors")) for d in (out, warm))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)     # lr 0: unchanged
    ev_dir = tmp_path / "eval"
    assert main(["train", "eagle3", "--data", str(data), "--out", str(ev_dir), "--heldout-fraction", "0.5",
                 "--batch-size", "1", "--max-length", "64", "--quiet", "--ttt-length", "3", "--eval-only",
                 "--init-from", str(out / "checkpoint")]) == 0
    ev = json.loads((ev_dir / "eval.json").read_text())
    assert ev["heldout_sequences"] == 2 and {"acc0", "acc1", "acc2"} <= ev.keys() and 0 <= ev["acc0"] <= 1
    assert not (ev_dir / "checkpoint").exists()                                  # nothing trained
    with pytest.raises(SystemExit, match="aux-layer-ids"):
        main(["train", "eagle3", "--data", str(data), "--out", str(tmp_path / "bad"), "--max-steps", "1",
              "--heldout-fraction", "0", "--quiet", "--aux-layer-ids", "1", "2", "3", "--init-from", str(out / "checkpoint")])


def test_ship_copies_the_checkpoint_and_writes_the_card(tmp_path, single_thread):
    from verispec.train.card import ship
    run = tmp_path / "run"
    tiny_task(tiny_target(), tiny_examples(4)).save(run / "checkpoint")
    meta = {"data": "d.jsonl: 4 conversations", "train_sequences": 4, "train_tokens": 80, "heldout_sequences": 1,
            "steps": 6, "batch_size": 2, "wall_time_s": 12.0, "threads": 1, "torch": "x",
            "final_train": {"loss": 1.5}, "heldout": {"acc0": 0.5, "acc1": 0.25, "loss": 2.0},
            "draft_vocab_size": 32, "command": "verispec train eagle3 ..."}
    (run / "train_meta.json").write_text(json.dumps(meta))
    with pytest.raises(FileNotFoundError, match="no finished checkpoint"):
        ship(tmp_path / "nothing", tmp_path / "dest", "eagle3")
    card = ship(run, tmp_path / "dest", "eagle3", regen={"conversations": 3, "output_tokens": 90, "seconds": 60,
                                                           "tokens_per_second": 1.5}, notes=["shared machine"])
    (tmp_path / "dest" / "draft_vocab.safetensors").write_bytes(b"cut")
    with pytest.raises(FileNotFoundError, match="extra files not found"):
        ship(run, tmp_path / "dest", "eagle3", extra=[tmp_path / "none.json"])
    card = ship(run, tmp_path / "dest", "eagle3", extra=[tmp_path / "dest" / "draft_vocab.safetensors"],
                regen={"conversations": 3, "output_tokens": 90, "seconds": 60, "tokens_per_second": 1.5},
                notes=["shared machine"])
    assert (tmp_path / "dest" / "draft_vocab.safetensors").read_bytes() == b"cut"   # kept from the old folder
    text = card.read_text()
    assert (tmp_path / "dest" / "model.safetensors").exists()
    assert "| acc | 0.500 | 0.250 |" in text and "12 sequences seen (3.00 epochs)" in text
    assert "3 conversations, 90 answer tokens" in text and "- shared machine" in text
    assert "verispec train eagle3 ..." in text and "(not measured)" in text
    assert "for `smollm2-135m` (SmolLM2-135M-Instruct)" in text               # no --model: the default
    meta["command"] = "verispec train eagle3 --model qwen2.5-coder-1.5b --out runs/q"
    (run / "train_meta.json").write_text(json.dumps(meta))
    text = ship(run, tmp_path / "dest", "eagle3").read_text()
    assert "for `qwen2.5-coder-1.5b` (Qwen2.5-Coder-1.5B-Instruct)" in text
    assert 'LLM(model="qwen2.5-coder-1.5b"' in text


def test_draft_losses_rank_the_target_argmax_and_match_the_cli():
    """Every ``DraftLoss`` is lowest when the head's distribution is the target's; ``lk`` is
    -log of the acceptance rate sum min(p, q); the CLI offers exactly the enum's values."""
    from verispec.cli.train import DRAFT_LOSSES
    from verispec.train.eagle3 import DraftLoss
    assert DRAFT_LOSSES == tuple(x.value for x in DraftLoss)
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(16, 32, generator=g) * 2, -1)
    tid = p.argmax(-1)
    matched, other = p.log(), torch.randn(16, 32, generator=g)
    for loss in DraftLoss:
        assert loss.per_position(p, matched, tid).mean() < loss.per_position(p, other, tid).mean(), loss
    q = torch.softmax(other, -1)
    assert torch.allclose(DraftLoss.LK.per_position(p, other, tid), -torch.minimum(p, q).sum(-1).log(), atol=1e-5)
    assert torch.allclose(DraftLoss.HARD.per_position(p, other, tid), -q.log()[torch.arange(16), tid], atol=1e-5)
