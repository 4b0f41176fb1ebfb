"""Medusa drafter: greedy output equal to vanilla (random and briefly trained heads, batch 1 and
4, trees and chains, both checkpoint layouts), candidate alignment, typical acceptance (lossy,
opt-in) against its definition, configuration errors."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import HEAD_TOKENS, assert_same_or_tie
from verispec import LLM, SamplingParams
from verispec.formats import MedusaLayout, save_medusa_heads
from verispec.core.features import TargetFeatures
from verispec.drafting.base import DraftRequest
from verispec.drafting.dynamic_tree import DEFAULT_NUM_DRAFT_TOKENS, StaticTreeConfig
from verispec.core.acceptance import LOSSLESS, LossyTypicalAcceptance
from verispec.drafting.medusa import DEFAULT_MEDUSA_CHOICES, MedusaDrafter
from verispec.drafting.medusa_head import MedusaConfig, MedusaHeads
from verispec.core.sampling import target_probs
from verispec.drafting.spec_config import SpecConfigError
from verispec.core.tree import DraftTree, validate_choices
from verispec.core.verify import accept_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=HEAD_TOKENS)
SMALL_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def new_heads(target_model, num_heads=3, num_layers=1, tied=True, seed=0, std=0.0) -> MedusaHeads:
    cfg = MedusaConfig(num_heads, num_layers, target_model.cfg.hidden_size, target_model.cfg.vocab_size,
                       tied_lm_head=tied)
    heads = MedusaHeads(cfg, target_model.lm_head.weight.detach())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return heads.eval()


def train_heads(heads, model, texts: list[tuple[list[int], int]], steps: int = 40, lr: float = 1e-2) -> None:
    """Head k on f_t learns the target's choice at t+1+k (= x_{t+2+k}), over the ids the target
    ranks in its top 64 somewhere (a cheap sampled softmax through the tied lm_head)."""
    data, plausible = [], set()
    with torch.no_grad():
        for ids, start in texts:
            o = model(torch.tensor([ids]), torch.arange(len(ids))[None])
            data.append((o.last_hidden[0], o.logits[0].argmax(-1), start))
            plausible |= set(torch.topk(o.logits[0], 64, dim=-1).indices.flatten().tolist())
    vocab = torch.tensor(sorted(plausible))
    index = torch.full((model.cfg.vocab_size,), -100, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    w = model.lm_head.weight.detach()[vocab]
    params = list(heads.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss = 0.0
        for feats, labels, start in data:
            states = heads.head_states(feats[start:])                    # [n, K, h]
            for k in range(heads.cfg.num_heads):
                n = len(labels) - (start + 1 + k)
                y = index[labels[start + 1 + k:]]
                loss = loss + F.cross_entropy(F.linear(states[:n, k], w), y, ignore_index=-100)
        loss.backward()
        opt.step()
    heads.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def prompts(head_prompts):
    return head_prompts


@pytest.fixture(scope="module")
def vanilla(head_vanilla):
    return head_vanilla


@pytest.fixture(scope="module")
def folders(target, prompts, vanilla, tmp_path_factory):
    root = tmp_path_factory.mktemp("medusa")
    m = target.model
    trained = new_heads(m, seed=1)
    train_heads(trained, m, [(p + v, max(len(p) - 16, 1)) for p, v in zip(prompts, vanilla)])
    return {"random_fd": save_medusa_heads(new_heads(m, std=0.02), root / "random_fd"),
            "random_vllm": save_medusa_heads(new_heads(m, std=0.02, num_layers=2), root / "random_vllm",
                                             MedusaLayout.VLLM),
            "trained": save_medusa_heads(trained, root / "trained")}


CASES = [  # (heads, tree keys, batch, prompts used)
    ("random_fd", {"tree": [[0], [1], [0, 0]]}, 4, 4),
    ("random_vllm", {"num_speculative_tokens": 2}, 1, 1),
    ("trained", {"tree": SMALL_TREE}, 1, 2),
    ("trained", {}, 4, 4),                                  # default tree
]


@pytest.mark.parametrize("folder,tree,batch,n", CASES, ids=[f"{c[0]}-{next(iter(c[1]), 'default')}-b{c[2]}"
                                                          for c in CASES])
def test_greedy_equals_vanilla(target, prompts, vanilla, folders, folder, tree, batch, n):
    llm = LLM(loaded=target, speculative_config={"method": "medusa", "model": str(folders[folder]), **tree},
              max_num_seqs=batch)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:n]], GREEDY)
    for p, o, want in zip(prompts, outs, vanilla):
        assert_same_or_tie(target.model, p, o.token_ids, want, f"medusa {folder} {tree} b{batch}")
    if folder == "trained":
        acc = sum(o.metrics.num_accepted_tokens for o in outs) / sum(o.metrics.num_steps for o in outs)
        assert acc > 0.5, f"trained Medusa heads accepted only {acc:.2f} tokens per step"
        assert max(len(o.metrics.acceptance_rate_per_pos) for o in outs) >= 2


def test_candidates_come_from_head_by_depth(target):
    """Depth d nodes are head d-1's top ranks on f_t; the same ranks under every parent."""
    heads = new_heads(target.model, std=0.05, seed=3)
    choices = [[0], [1], [0, 0], [1, 0], [1, 1], [0, 0, 0]]
    drafter = MedusaDrafter(heads, StaticTreeConfig.from_choices(choices))
    f = torch.randn(5, target.config.hidden_size)
    drafter.start(0, [1, 2, 3, 4, 5], TargetFeatures({}, f))
    tree, = drafter.propose([DraftRequest(0, [1, 2, 3, 4, 5, 6], GREEDY, torch.Generator())])
    top = torch.topk(heads(f[-1]), 2, dim=-1).indices.tolist()            # [K, 2]
    assert tree.tokens.tolist() == [top[0][0], top[0][1], top[1][0], top[1][0], top[1][1], top[2][0]]
    assert tree.parents.tolist() == [-1, -1, 0, 1, 1, 2]
    f2 = torch.randn(2, target.config.hidden_size)
    drafter.accept(0, [6, 7], TargetFeatures({}, f2))
    assert torch.equal(drafter.last[0], f2[-1])                         # f at the last committed position


def test_default_tree():
    assert validate_choices(DEFAULT_MEDUSA_CHOICES) == sorted(DEFAULT_MEDUSA_CHOICES, key=lambda c: (len(c), c))
    assert len(DEFAULT_MEDUSA_CHOICES) == DEFAULT_NUM_DRAFT_TOKENS


# -- typical acceptance (lossy, opt-in) -------------------------------------------------------------
def _logits(rows: list[dict[int, float]], vocab: int = 8) -> torch.Tensor:
    out = torch.full((len(rows), vocab), -1e4)
    for i, r in enumerate(rows):
        rest = 1 - sum(r.values())
        out[i] = math.log(max(rest, 1e-9) / (vocab - len(r)))
        for t, p in r.items():
            out[i, t] = math.log(p)
    return out


def test_typical_acceptance_rule():
    rule = LossyTypicalAcceptance(posterior_threshold=0.09, posterior_alpha=0.3)
    params = SamplingParams(temperature=1.0)
    # root: flat over 8 tokens -> threshold min(0.09, 0.3/8) = 0.0375; p(token) = 0.125 each
    # node 0 (token 1) below root; node 1 (token 2) below node 0: peaked row p(2)=0.02 fails
    tree = DraftTree(torch.tensor([1, 5, 2, 3]), torch.tensor([-1, -1, 0, 1]))
    rows = [{}, {2: 0.02, 4: 0.9}, {3: 0.5}, {}, {}]            # (root, node0, node1, node2, node3)
    logits = _logits(rows)
    res = rule(tree, logits, params, torch.Generator().manual_seed(0))
    # path via node 1 (token 5) then node 3 (token 3, p=0.5 passes) is the longest
    assert res.nodes == [1, 3] and res.tokens[:2] == [5, 3]
    probs = target_probs(logits, params)
    ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    thr = torch.clamp(0.3 * torch.exp(-ent), max=0.09)
    assert float(probs[1, 2]) <= float(thr[1])                  # the rejected token really fails
    greedy = SamplingParams(temperature=0.0)
    assert rule(tree, logits, greedy, None) == accept_greedy(tree, logits)


def test_typical_acceptance_is_lossy_and_opt_in(target, folders):
    """A token the target gives 0.1 (above the threshold) is always accepted: lossy. The
    engine keeps its lossless rule unless the config names the lossy one; metrics say which."""
    rule = LossyTypicalAcceptance()
    tree = DraftTree(torch.tensor([4]), torch.tensor([-1]))
    logits = _logits([{4: 0.1, 0: 0.9}, {}])
    hits = sum(rule(tree, logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(s)).nodes == [0]
               for s in range(200))
    assert hits == 200                                          # lossless would accept ~10%
    plain = LLM(loaded=target, speculative_config={"method": "medusa", "model": str(folders["random_fd"])})
    assert plain.make_engine(1, 64).acceptance is LOSSLESS and not LOSSLESS.lossy
    lossy = LLM(loaded=target, speculative_config={"method": "medusa", "model": str(folders["random_fd"]),
                                                   "typical_acceptance": True, "posterior_threshold": 0.2})
    engine = lossy.make_engine(1, 64)
    assert engine.acceptance == LossyTypicalAcceptance(posterior_threshold=0.2) and engine.acceptance.lossy
    out = lossy.generate("Hi", SamplingParams(temperature=0.8, max_tokens=4, seed=0))[0]
    assert out.metrics.lossy and out.metrics.acceptance == "lossy_typical"
    assert not plain.generate("Hi", SamplingParams(temperature=0.8, max_tokens=4, seed=0))[0].metrics.lossy


def test_config_errors(target, folders, monkeypatch):
    monkeypatch.setattr("verispec.drafting.shipped.shipped_head", lambda *a: None)     # as if no head were shipped
    fd = str(folders["random_fd"])
    bad = [({"method": "medusa"}, "needs 'model'"),
           ({"method": "medusa", "model": fd, "topk": 4}, "'topk' applies to method 'eagle' / 'eagle3'"),
           ({"method": "medusa", "model": fd, "num_speculative_tokens": 4}, "3 Medusa heads"),
           ({"method": "medusa", "model": fd, "tree": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]}, "3 Medusa heads"),
           ({"method": "medusa", "model": fd, "posterior_alpha": 0.2}, "typical_acceptance"),
           ({"method": "medusa", "model": fd, "typical_acceptance": True, "posterior_threshold": 2.0}, r"\(0, 1\]")]
    for spec, match in bad:
        with pytest.raises(SpecConfigError, match=match):
            LLM(loaded=target, speculative_config=spec)


def _vocab_file(path, ids, vocab_size):
    from verispec.drafting.draft_vocab import DraftVocab, save_draft_vocab
    return save_draft_vocab(DraftVocab.from_ids(torch.tensor(ids), vocab_size), path)


@pytest.mark.parametrize("tied", [True, False])
def test_restricted_vocab_logits_are_the_full_ones_columns(target, tied):
    """Over a reduced vocabulary the heads' logits are exactly the full logits' columns at the
    kept ids, for tied and own projections, and only the heads the tree reaches are run."""
    heads = new_heads(target.model, num_heads=3, tied=tied, std=0.05, seed=4)
    f = torch.randn(2, target.config.hidden_size)
    full = heads(f)                                                   # [2, 3, V]
    ids = torch.tensor(sorted(torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(0))[:300].tolist()))
    heads.restrict_vocab_(ids)
    cut = heads(f)
    assert cut.shape == (2, 3, 300)
    torch.testing.assert_close(cut, full[..., ids])
    torch.testing.assert_close(heads(f, 2), full[:, :2][..., ids])
    assert target.model.lm_head.weight.shape[0] == target.config.vocab_size     # the target's head untouched
    with pytest.raises(ValueError, match="already restricted"):
        heads.restrict_vocab_(ids)


def test_restricted_vocab_drafts_only_its_tokens(target):
    """Each depth's candidates are the head's top ranks among the kept ids, as target ids."""
    heads = new_heads(target.model, std=0.05, seed=3)
    f = torch.randn(5, target.config.hidden_size)
    full = heads(f[-1])                                               # [K, V]
    ids = torch.arange(0, target.config.vocab_size, 7)
    heads.restrict_vocab_(ids)
    choices = [[0], [1], [0, 0], [0, 0, 0]]
    drafter = MedusaDrafter(heads, StaticTreeConfig.from_choices(choices))
    drafter.start(0, [1, 2, 3, 4, 5], TargetFeatures({}, f))
    tree, = drafter.propose([DraftRequest(0, [1, 2, 3, 4, 5, 6], GREEDY, torch.Generator())])
    top = ids[torch.topk(full[:, ids], 2, dim=-1).indices].tolist()
    assert tree.tokens.tolist() == [top[0][0], top[0][1], top[1][0], top[2][0]]
    assert all(t % 7 == 0 for t in tree.tokens.tolist())


def test_reduced_vocab_greedy_equals_vanilla(target, prompts, vanilla, folders, tmp_path):
    """A folder's draft_vocab.safetensors is used by default ('full' turns it off); greedy output
    stays vanilla's, and acceptance drops only where the target's tokens are not in the subset."""
    import shutil
    folder = tmp_path / "trained_vocab"
    shutil.copytree(folders["trained"], folder)
    seen = sorted({t for p, v in zip(prompts, vanilla) for t in p + v})
    _vocab_file(folder / "draft_vocab.safetensors", seen, target.config.vocab_size)
    spec = {"method": "medusa", "model": str(folder), "tree": SMALL_TREE}
    llm = LLM(loaded=target, speculative_config=spec)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], GREEDY)
    for p, o, want in zip(prompts, outs, vanilla):
        assert_same_or_tie(target.model, p, o.token_ids, want, "medusa reduced vocabulary")
    acc = sum(o.metrics.num_accepted_tokens for o in outs) / sum(o.metrics.num_steps for o in outs)
    assert acc > 0.5, f"trained heads over the tokens they need accepted only {acc:.2f} per step"
    drafter = llm.make_engine(1, 64).drafter
    assert drafter.heads.vocab_ids.tolist() == seen
    full = LLM(loaded=target, speculative_config=dict(spec, draft_vocab="full")).make_engine(1, 64).drafter
    assert full.heads.vocab_ids is None


def test_bad_draft_vocab_is_a_config_error(target, folders, tmp_path):
    fd = str(folders["random_fd"])
    with pytest.raises(SpecConfigError, match="does not exist"):
        LLM(loaded=target, speculative_config={"method": "medusa", "model": fd, "draft_vocab": str(tmp_path / "no")})
    other = _vocab_file(tmp_path / "other.safetensors", [1, 2, 3], 1000)
    with pytest.raises(SpecConfigError, match="vocabulary of 1000"):
        LLM(loaded=target, speculative_config={"method": "medusa", "model": fd, "draft_vocab": str(other)})
    tiny = _vocab_file(tmp_path / "tiny.safetensors", [5], target.config.vocab_size)
    with pytest.raises((SpecConfigError, ValueError), match="rank 1"):
        LLM(loaded=target, speculative_config={"method": "medusa", "model": fd, "draft_vocab": str(tiny),
                                               "tree": [[0], [1]]}).make_engine(1, 64)
