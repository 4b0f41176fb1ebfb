"""EAGLE-1, Medusa-1 (tied, untied) and Medusa-2 trainers on a tiny random target: a short run
lowers the loss and raises acc0, the checkpoint loads back with our loaders and computes what the
trained module computes, Medusa-2's backbone stays close to the teacher, resume follows the
uninterrupted curve, and the ``verispec train eagle|medusa`` commands run end to end."""
from __future__ import annotations

import argparse
import math

import pytest
import torch

from verispec.formats import load_eagle_head, load_medusa_heads
from verispec.drafting.eagle_head import HeadKind
from verispec.models.config import ModelConfig
from verispec.models.loading import load_model
from verispec.models.transformer import Transformer
from verispec.train.data import TokenizedExample
from verispec.train.eagle1 import Eagle1Task, init_eagle1_head, new_eagle1_config
from verispec.train.loop import Trainer, TrainConfig, collate
from verispec.train.medusa import (MEDUSA_DIR, Medusa1Task, Medusa2Task, head_logits, init_medusa_heads,
                                   new_medusa_config)

V, H = 64, 32


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    yield


def tiny_target(tie: bool = False) -> Transformer:
    """Random 2-layer target. Untied: lm_head scaled x8 so its next-token distributions are peaked
    like a trained model's (max prob about 0.6) rather than near uniform; its greedy continuations
    are varied cycles. Tied (N(0,1) embeddings): degenerate, it repeats the last token; used for
    the checkpoint layout only."""
    cfg = ModelConfig(arch="llama", vocab_size=V, hidden_size=H, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=tie, eos_token_ids=(1,))
    torch.manual_seed(0)
    model = Transformer(cfg).eval().requires_grad_(False)
    if not tie:
        model.lm_head.weight.mul_(8)
    return model


@torch.no_grad()
def make_data(model: Transformer, n: int = 8, prompt: int = 6, answer: int = 14) -> list[TokenizedExample]:
    """Random prompts (mask 0) answered by the target's greedy continuation (mask 1): what
    regenerated data looks like."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(2, V, (prompt + i % 3,), generator=g).tolist()
        start = len(ids)
        for _ in range(answer):
            logits = model(torch.tensor([ids]), torch.arange(len(ids))[None]).logits[0, -1]
            ids.append(int(logits.argmax()))
        out.append(TokenizedExample(f"c{i}", tuple(ids), tuple([0] * start + [1] * answer)))
    return out


def config(tmp_path, steps: int = 25, lr: float = 3e-3, **kw) -> TrainConfig:
    return TrainConfig(out_dir=tmp_path, max_steps=steps, batch_size=4, micro_batch_size=2, lr=lr,
                       warmup_ratio=0.0, min_lr_ratio=0.5, max_grad_norm=1.0, log_every=1, progress=False,
                       save_every=None, **kw)


def fit(task, data, cfg):
    trainer = Trainer(task, data, data, cfg)
    before = trainer.evaluate()
    result = trainer.fit()
    return before, result


# -- EAGLE-1 -------------------------------------------------------------------------------------
def eagle1_task(target, seed: int = 0) -> Eagle1Task:
    head = init_eagle1_head(new_eagle1_config(target.cfg), target, seed=seed)
    task = Eagle1Task(target, head)
    task.save_dtype = torch.float32
    return task


def test_eagle1_learns_and_round_trips(tmp_path):
    target = tiny_target()
    data = make_data(target)
    task = eagle1_task(target)
    before, res = fit(task, data, config(tmp_path / "run", steps=30))
    after = res.eval
    assert after["loss"] < 0.7 * before["loss"], (before, after)
    assert after["acc0"] > before["acc0"] + 0.2, (before, after)
    assert after["vloss"] < before["vloss"] and after["ploss"] < before["ploss"]
    assert int(task.module.noise_calls) == 30 * 2            # two noisy micro-batches per step

    loaded = load_eagle_head(tmp_path / "run" / "checkpoint", target, HeadKind.EAGLE1)
    inp = task.prepare(collate(data[:3]))
    head = task.module.head.eval()
    with torch.no_grad():
        want = head(inp.tokens, inp.positions, inp.hidden)
        got = loaded(inp.tokens, inp.positions, inp.hidden)
    torch.testing.assert_close(got.hidden, want.hidden)
    torch.testing.assert_close(got.logits, want.logits)


def test_eagle1_alignment_and_noise():
    """Column t: feature f_t, token t+1, regression target f_{t+1}, valid iff x_{t+2} is assistant.
    Noise only in training, reproducible from the call counter, absent in eval."""
    target = tiny_target()
    ex = make_data(target, n=1)[0]
    task = eagle1_task(target)
    b = collate([ex])
    inp = task.prepare(b)
    ids = torch.tensor(ex.input_ids)
    t = len(ids)
    pos = torch.arange(t)[None]
    f = target(ids[None], pos).last_hidden[0]
    torch.testing.assert_close(inp.hidden[0], f[:-1])
    assert torch.equal(inp.tokens[0], ids[1:])
    want_valid = torch.tensor(ex.loss_mask[2:] + (0,), dtype=torch.bool)
    assert torch.equal(inp.valid[0], want_valid)
    torch.testing.assert_close(inp.target_feat, f[1:][want_valid])
    assert torch.equal(inp.target_ids, target.lm_head(f[1:][want_valid]).argmax(-1))
    mod = task.module
    mod.eval()
    assert torch.equal(mod._noisy(inp.hidden), inp.hidden)
    mod.train()
    a = mod._noisy(inp.hidden)
    mod.noise_calls.fill_(0)
    assert torch.equal(mod._noisy(inp.hidden), a)
    assert 0 < float((a - inp.hidden).abs().max()) <= mod.noise / 2
    assert not torch.equal(mod._noisy(inp.hidden), a)          # the next call draws new noise


def test_resume_matches_straight_run(tmp_path):
    """6 steps straight == 3 steps, a new process-like Trainer resuming from train_state.pt, 3 more."""
    target = tiny_target()
    data = make_data(target)
    straight = Trainer(eagle1_task(target), data, [], config(tmp_path / "a", steps=6)).fit()
    first = Trainer(eagle1_task(target), data, [], config(tmp_path / "b", steps=6))
    for _ in range(3):
        first.train_step()
    first._save_state()
    second = Trainer(eagle1_task(target), data, [], config(tmp_path / "b", steps=6))
    assert second.step == 3
    resumed = second.fit()
    assert resumed.steps == straight.steps == 6
    assert abs(resumed.last["loss"] - straight.last["loss"]) < 1e-5, (resumed.last, straight.last)


# -- Medusa-1 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_medusa1_learns_and_round_trips(tmp_path, tied):
    target = tiny_target()
    data = make_data(target)
    heads = init_medusa_heads(new_medusa_config(target.cfg, num_heads=3, num_layers=1, tied_lm_head=tied), target)
    task = Medusa1Task(target, heads)
    task.save_dtype = torch.float32
    before, res = fit(task, data, config(tmp_path / "run", steps=25, lr=1e-2))
    after = res.eval
    assert after["loss"] < 0.7 * before["loss"], (before, after)
    assert after["acc0"] > before["acc0"] + 0.2, (before, after)
    assert after["acc1"] > before["acc1"], (before, after)
    if tied:
        assert torch.equal(task.module.heads.target_lm_head, target.lm_head.weight)   # frozen

    loaded = load_medusa_heads(tmp_path / "run" / "checkpoint", target)
    assert loaded.cfg == heads.cfg
    f = task.prepare(collate(data[:2])).hidden
    with torch.no_grad():
        torch.testing.assert_close(loaded(f), task.module.heads(f))
        for k in range(3):          # the trainer's per-head path is MedusaHeads.forward's
            torch.testing.assert_close(head_logits(heads, k, f), heads(f)[..., k, :])


def test_medusa_alignment():
    """Head k at position t reads f_t and learns x_{t+2+k} where that token is an assistant token."""
    target = tiny_target()
    ex = make_data(target, n=1)[0]
    heads = init_medusa_heads(new_medusa_config(target.cfg, num_heads=2), target)
    inp = Medusa1Task(target, heads).prepare(collate([ex]))
    ids, mask, t = ex.input_ids, ex.loss_mask, len(ex.input_ids)
    for k in range(2):
        for pos in range(t):
            j = pos + 2 + k
            assert bool(inp.valid[k, 0, pos]) == (j < t and mask[j] == 1)
            if j < t:
                assert int(inp.labels[k, 0, pos]) == ids[j]
    assert inp.count == sum(mask[2:])
    with torch.no_grad():     # zero blocks + the target's lm_head: each head starts at x_{t+1}
        torch.testing.assert_close(heads(inp.hidden)[0, :, 1], target(torch.tensor([ids]),
                                   torch.arange(t)[None]).logits[0])


# -- Medusa-2 --------------------------------------------------------------------------------------
def test_medusa2_learns_stays_close_and_round_trips(tmp_path):
    target = tiny_target()
    teacher_state = {k: v.clone() for k, v in target.state_dict().items()}
    data = make_data(target)
    heads = init_medusa_heads(new_medusa_config(target.cfg, num_heads=2, tied_lm_head=True), target)
    task = Medusa2Task(target, heads)
    task.save_dtype = torch.float32
    before, res = fit(task, data, config(tmp_path / "run", steps=25, lr=3e-3))
    after = res.eval
    assert before["kl"] < 1e-6 and before["lm_acc"] == 1.0          # the backbone starts as the teacher
    assert after["loss"] < 0.5 * before["loss"], (before, after)
    assert after["acc0"] > before["acc0"] + 0.3 and after["acc1"] > before["acc1"] + 0.2, (before, after)
    assert after["kl"] < 0.3 and after["lm_acc"] >= 0.9, after       # distillation keeps the backbone close
    for k, v in target.state_dict().items():                          # the teacher is untouched
        assert torch.equal(v, teacher_state[k]), k
    backbone = task.module.backbone
    assert not torch.equal(backbone.layers[0].attn.wq.weight, target.layers[0].attn.wq.weight)
    assert not torch.equal(backbone.lm_head.weight, target.lm_head.weight)
    assert torch.equal(task.module.heads.target_lm_head, backbone.lm_head.weight)   # tied to the new lm_head
    check_medusa2_checkpoint(tmp_path / "run" / "checkpoint", task, data)


def test_medusa2_tied_embeddings_checkpoint(tmp_path):
    """A target with tied embeddings, fused as ``load_model`` returns it: the trainable copy is
    unfused and separate; the backbone folder has no lm_head.weight and loads back tied."""
    from safetensors.torch import load_file
    from verispec.train.medusa import trainable_copy
    target = tiny_target(tie=True).fuse_()
    copy = trainable_copy(target)
    assert copy.layers[0].attn.fused is None and copy.layers[0].attn.wq.weight.requires_grad
    assert copy.embed.weight.data_ptr() != target.embed.weight.data_ptr()
    ids = torch.arange(2, 12)[None]
    with torch.no_grad():
        torch.testing.assert_close(copy(ids, torch.arange(10)[None]).logits, target(ids, torch.arange(10)[None]).logits)
    data = make_data(target, n=4, answer=6)
    heads = init_medusa_heads(new_medusa_config(target.cfg, num_heads=2, tied_lm_head=False), target)
    task = Medusa2Task(target, heads)
    task.save_dtype = torch.float32
    Trainer(task, data, [], config(tmp_path / "run", steps=3)).fit()
    ckpt = tmp_path / "run" / "checkpoint"
    names = set(load_file(str(ckpt / "model.safetensors")))
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert task.module.backbone.lm_head.weight is task.module.backbone.embed.weight
    new = check_medusa2_checkpoint(ckpt, task, data)
    assert new.lm_head.weight is new.embed.weight


def check_medusa2_checkpoint(ckpt, task, data):
    backbone = task.module.backbone.eval()
    new = load_model(ckpt, with_tokenizer=False).model
    assert new.cfg == task.target.cfg
    ids = torch.tensor([data[0].input_ids])
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        want = backbone(ids, pos)
        got = new(ids, pos)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
        loaded = load_medusa_heads(ckpt / MEDUSA_DIR, new)
        torch.testing.assert_close(loaded(got.last_hidden), task.module.heads(want.last_hidden),
                                   atol=1e-5, rtol=1e-5)
    return new


def test_medusa2_distillation_limits_drift(tmp_path):
    """The same run without the distillation term drifts far from the teacher; with it the KL
    stays bounded and falls back after its peak."""
    import json
    target = tiny_target()
    data = make_data(target)
    ev, kl_curve = {}, {}
    for w in (1.0, 0.0):
        heads = init_medusa_heads(new_medusa_config(target.cfg, num_heads=2, tied_lm_head=True), target)
        task = Medusa2Task(target, heads, kl_weight=w)
        out = tmp_path / f"w{w}"
        ev[w] = Trainer(task, data, data, config(out, steps=25, lr=3e-3)).fit().eval
        kl_curve[w] = [r["kl"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())
                       if "kl" in r]
    assert ev[1.0]["kl"] < 0.2 * ev[0.0]["kl"], ev
    assert ev[1.0]["lm_acc"] > ev[0.0]["lm_acc"] + 0.3, ev
    assert kl_curve[1.0][-1] < 0.9 * max(kl_curve[1.0]), kl_curve[1.0]


# -- CLI ---------------------------------------------------------------------------------------------
class _Loaded:
    def __init__(self, model):
        self.model, self.tokenizer, self.config = model, None, model.cfg


@pytest.mark.parametrize("argv,check", [
    (["eagle", "--noise", "0.1"], lambda ck, t: load_eagle_head(ck, t, HeadKind.EAGLE1)),
    (["medusa", "--num-heads", "2", "--no-tied-lm-head"], lambda ck, t: load_medusa_heads(ck, t)),
    (["medusa", "--num-heads", "2", "--medusa2"],
     lambda ck, t: load_medusa_heads(ck / MEDUSA_DIR, load_model(ck, with_tokenizer=False).model)),
], ids=["eagle", "medusa1", "medusa2"])
def test_cli(tmp_path, monkeypatch, argv, check):
    import json

    import verispec.train.common as common
    from verispec.cli import train as train_cli
    target = tiny_target()
    data = make_data(target)

    def fake_prepare(model, data_path, **kw):
        return common.Prepared(_Loaded(target), data, data[:2], "tiny")
    monkeypatch.setattr(common, "prepare_data", fake_prepare)
    parser = argparse.ArgumentParser()
    train_cli.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "run"
    args = parser.parse_args(["train", *argv, "--data", "x.json", "--out", str(out), "--max-steps", "2",
                              "--batch-size", "4", "--quiet", "--save-dtype", "fp32"])
    assert args.func(args) == 0
    meta = json.loads((out / "train_meta.json").read_text())
    assert meta["steps"] == 2 and meta["method"] in ("eagle", "medusa1", "medusa2")
    assert math.isfinite(meta["final_train"]["loss"])
    check(out / "checkpoint", target)


def test_medusa_target_labels_are_the_targets_greedy_tokens():
    """labels="target": head k at position t learns argmax p_target(. | x_<=t+1+k)."""
    import torch
    from verispec.train.loop import collate
    from verispec.train.medusa import Medusa1Task, init_medusa_heads, new_medusa_config
    from train_tiny import tiny_examples, tiny_target
    target = tiny_target()
    data = tiny_examples(2)
    task = Medusa1Task(target, init_medusa_heads(new_medusa_config(target.cfg, 3, 1, True), target), labels="target")
    batch = collate(data)
    inp = task.prepare(batch)
    t = batch.input_ids.shape[1]
    greedy = target(batch.input_ids, torch.arange(t).expand(2, t)).logits.argmax(-1)
    for k in range(3):
        assert torch.equal(inp.labels[k, :, :t - 2 - k], greedy[:, 1 + k:t - 1])
    assert inp.valid[0].any()
