"""Reduced draft vocabulary for draft models: file format and its errors, the cut LM head, greedy
equality with vanilla decoding, no proposal outside the vocabulary, config errors, and the
``verispec data draft-vocab`` command. (Sampled losslessness: ``test_lossless_engine``.)"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from helpers import tiny_llama
from verispec.drafting.draft_vocab import DraftVocab, load_draft_vocab, save_draft_vocab
from verispec.drafting.base import DraftRequest
from verispec.drafting.draft_model import DraftModelDrafter, with_vocab_head
from verispec.core.engine import Engine, Sequence
from verispec.core.sampling import SamplingParams
from verispec.drafting.spec_config import SpecConfigError

pytestmark = pytest.mark.usefixtures("module_single_thread")
IDS = [0, 3, 4, 7, 10, 11, 20, 31]


def test_file_round_trip(tmp_path):
    vocab = DraftVocab.from_ids(torch.tensor(IDS[::-1]), 32)
    path = save_draft_vocab(vocab, tmp_path / "v.safetensors", {"note": "x"})
    back = load_draft_vocab(path, 32)
    assert back.draft_ids.tolist() == IDS and torch.equal(back.t2d, vocab.t2d)
    assert back.target_to_draft()[IDS].tolist() == list(range(len(IDS)))


@pytest.mark.parametrize("tensors,needle", [
    ({"t2d": torch.ones(32, dtype=torch.bool)}, "no 'd2t'"),
    ({"d2t": torch.tensor([0.0, 1.0])}, "integer"),
    ({"d2t": torch.tensor([0, 40])}, "0..31"),
    ({"d2t": torch.tensor([3, 2])}, "repeat"),                 # ids 3, 3
    ({"d2t": torch.tensor([5, -1])}, "increasing"),            # ids 5, 0
    ({"d2t": torch.tensor([0, 0]), "t2d": torch.ones(16, dtype=torch.bool)}, "16 tokens"),
    ({"d2t": torch.tensor([0, 0]), "t2d": torch.ones(32, dtype=torch.bool)}, "t2d does not mark"),
])
def test_bad_files_are_refused(tmp_path, tensors, needle):
    from safetensors.torch import save_file
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=needle):
        load_draft_vocab(path, 32)


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_draft_vocab(tmp_path / "nope.safetensors", 32)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00\x01not safetensors")
    with pytest.raises(ValueError, match="not a readable safetensors"):
        load_draft_vocab(junk, 32)


def test_cut_head_equals_full_head_rows():
    model = tiny_llama(32, 32, 2)
    vocab = DraftVocab.from_ids(torch.tensor(IDS), 32)
    cut = with_vocab_head(model, vocab)
    x, pos = torch.tensor([[1, 5, 9, 2]]), torch.arange(4)[None]
    assert torch.allclose(cut(x, pos).logits, model(x, pos).logits[..., IDS], atol=1e-6)
    assert model.lm_head.weight.shape[0] == 32          # the original model is untouched
    with pytest.raises(ValueError, match="must have that many rows"):
        DraftModelDrafter(model, max_batch=1, max_len=16, vocab=vocab)    # an uncut head is refused
    with pytest.raises(ValueError, match="made for 16 tokens"):
        with_vocab_head(model, DraftVocab.from_ids(torch.tensor([1, 2]), 16))


def test_proposals_stay_in_the_vocabulary_and_q_is_zero_outside():
    draft = tiny_llama(32, 32, 2, seed=1)
    vocab = DraftVocab.from_ids(torch.tensor(IDS), 32)
    for tree in (None, [[0], [1], [0, 0], [1, 0], [0, 0, 0]]):
        d = DraftModelDrafter(with_vocab_head(draft, vocab), max_batch=2, max_len=32, num_speculative_tokens=4,
                              tree=tree, vocab=vocab)
        for greedy in (True, False):
            params = SamplingParams(temperature=0.0 if greedy else 1.0, max_tokens=8)
            g = torch.Generator().manual_seed(0)
            d.start(0, [1, 2, 3], None)
            req = DraftRequest(row=0, context=[1, 2, 3], params=params, generator=g, max_nodes=None)
            t = d.propose([req])[0]
            assert len(t) > 0 and set(t.tokens.tolist()) <= set(IDS)
            if not greedy:
                outside = torch.ones(32, dtype=torch.bool)
                outside[IDS] = False
                assert float(t.q[:, outside].sum()) == 0.0 and torch.allclose(t.q.sum(-1), torch.ones(len(t)))
            d.release(0)


def test_greedy_with_reduced_vocab_equals_vanilla():
    target, draft = tiny_llama(32, 32, 2, seed=0), tiny_llama(32, 32, 2, seed=0)
    vocab = DraftVocab.from_ids(torch.tensor(IDS + [1, 2, 5]), 32)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [9, 9, 1, 2, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    def run(drafter):
        engine = Engine(target, drafter, max_batch=3, max_len=64)
        seqs = [Sequence(prompt_ids=p, params=params) for p in prompts]
        engine.run(seqs)
        return [s.output_ids for s in seqs], engine.stats
    vanilla, _ = run(None)
    spec, stats = run(DraftModelDrafter(with_vocab_head(draft, vocab), max_batch=3, max_len=64,
                                        num_speculative_tokens=3, vocab=vocab))
    assert spec == vanilla
    assert stats.num_accepted_tokens > 0           # the cut head still drafts the target's tokens


def test_config_errors(tmp_path, target):
    from verispec import LLM
    with pytest.raises(SpecConfigError, match="'draft_vocab' applies to method 'draft_model'"):
        LLM(loaded=target, speculative_config={"method": "ngram", "draft_vocab": "x.safetensors"})
    small = save_draft_vocab(DraftVocab.from_ids(torch.tensor([1, 2, 3]), 1000), tmp_path / "v.safetensors")
    with pytest.raises(SpecConfigError, match="1000 tokens, the target has 49152"):
        LLM(loaded=target, speculative_config={"method": "draft_model", "model": "self", "self_draft_layers": 4,
                                               "draft_vocab": str(small)})
    with pytest.raises(SpecConfigError, match="does not exist"):
        LLM(loaded=target, speculative_config={"method": "draft_model", "model": "self", "self_draft_layers": 4,
                                               "draft_vocab": str(tmp_path / "missing.safetensors")})


def test_cli_builds_a_vocabulary_from_conversations(tmp_path):
    data = tmp_path / "convs.jsonl"
    lines = [json.dumps({"id": f"c{i}", "conversations": [
        {"role": "user", "content": f"Count to {i}."},
        {"role": "assistant", "content": " ".join(str(j) for j in range(i + 3))}]}) for i in range(40)]
    data.write_text("\n".join(lines + ["{not json"]) + "\n")
    out = tmp_path / "vocab.safetensors"
    proc = subprocess.run([sys.executable, "-m", "verispec.cli", "data", "draft-vocab", "--model", "smollm2-135m",
                           "--data", str(data), "--size", "300", "--heldout-fraction", "0.2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["draft_vocab_size"] == 300 and info["vocab_size"] == 49152
    assert 0.9 <= info["heldout_coverage"] <= 1.0
    vocab = load_draft_vocab(out, 49152)
    assert vocab.size == 300
