"""EAGLE-1/2/3/3.1 drafters: pair alignment and tree attention against plain forwards, greedy
output equal to vanilla (random and briefly trained heads, batch 1 and 4, static and dynamic
trees), losslessness at temperature > 0, configuration errors."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import HEAD_TOKENS, assert_same_or_tie
from verispec import LLM, SamplingParams
from verispec.formats import new_eagle_head, save_eagle_head
from verispec.core.features import TargetFeatures
from verispec.drafting.base import DraftRequest
from verispec.drafting.dynamic_tree import DynamicTreeConfig, StaticTreeConfig
from verispec.drafting.eagle import EagleDrafter
from verispec.drafting.eagle_head import EagleHeadConfig, HeadKind, init_head_weights
from verispec.core.engine import Engine, Sequence
from verispec.models.config import ModelConfig
from verispec.models.transformer import Transformer
from verispec.core.sampling import target_probs
from verispec.drafting.spec_config import SpecConfigError

GREEDY = SamplingParams(temperature=0.0, max_tokens=HEAD_TOKENS)
SMALL_DYNAMIC = {"topk": 3, "depth": 4, "num_draft_tokens": 8}
TINY_DYNAMIC = {"topk": 2, "depth": 2, "num_draft_tokens": 3}
TINY_STATIC = [[0], [1], [0, 0]]
# accepted draft tokens per step and deepest accepted position the briefly trained heads reach
# (measured: EAGLE-3 about 2 and 3, EAGLE-1 about 0.4 and 1; the bounds leave margin)
MIN_ACCEPTANCE = {"e3_trained": (1.0, 3), "e1_trained": (0.15, 1)}


# -- heads ---------------------------------------------------------------------------------------
def head_config(target_cfg: ModelConfig, kind: HeadKind, draft_vocab: int | None = None, **kw) -> EagleHeadConfig:
    c = target_cfg
    return EagleHeadConfig(kind=kind, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                           num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                           vocab_size=c.vocab_size, draft_vocab_size=draft_vocab or c.vocab_size,
                           target_hidden_size=c.hidden_size, target_num_layers=c.num_layers,
                           aux_layer_ids=EagleHeadConfig.default_aux_layer_ids(c.num_layers)
                           if kind is HeadKind.EAGLE3 else (),
                           rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps, **kw)


def random_head(model, kind: HeadKind, vocab_ids: torch.Tensor | None = None, seed: int = 0,
                std: float = 0.02, **kw):
    """A random head; EAGLE-3 with ``vocab_ids`` gets that reduced draft vocabulary (d2t/t2d)."""
    n = None if vocab_ids is None else len(vocab_ids)
    head = init_head_weights(new_eagle_head(head_config(model.cfg, kind, n, **kw), model), seed, std)
    if vocab_ids is not None:
        set_draft_vocab(head, vocab_ids)
    return head


def set_draft_vocab(head, vocab_ids: torch.Tensor) -> None:
    ids = vocab_ids.sort().values
    head.d2t.copy_(ids - torch.arange(len(ids)))
    head.t2d.zero_()
    head.t2d[ids] = True


@torch.no_grad()
def target_features(model, seqs: list[list[int]], head):
    """Per sequence: target features (all positions), the target's next-token argmax, and the
    ids the target ranks in its top 64 anywhere (negatives for a cheap sampled softmax)."""
    out, plausible = [], set()
    for ids in seqs:
        o = model(torch.tensor([ids]), torch.arange(len(ids))[None], hidden_layers=head.hidden_layers)
        feats = TargetFeatures({i: o.hidden[i][0] for i in head.hidden_layers}, o.last_hidden[0])
        out.append((ids, feats, o.logits[0].argmax(-1)))
        plausible |= set(torch.topk(o.logits[0], 64, dim=-1).indices.flatten().tolist())
    return out, torch.tensor(sorted(plausible))


def train_head(head, model, texts: list[tuple[list[int], int]], steps: int = 30, lr: float = 3e-3) -> None:
    """Fit a head to the target's own next tokens on ``texts`` ((ids, first position to learn)).
    Pairs (f_t, x_{t+1}) predict the target's choice at t+1; a second unrolled step feeds the
    head's own state (pair (h_{t-1}, x_{t+1})). EAGLE-3 learns over its draft vocabulary; EAGLE-1
    over the ids the target finds plausible there, plus the next-feature regression."""
    data, plausible = target_features(model, [ids for ids, _ in texts], head)
    eagle3 = head.cfg.kind is HeadKind.EAGLE3
    vocab = torch.nonzero(head.t2d).flatten() if eagle3 else plausible
    index = torch.full((model.cfg.vocab_size,), -100, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    params = list(head.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(_pair_loss(head, ids, start, feats, labels, index, vocab)
                   for (ids, feats, labels), (_, start) in zip(data, texts))
        loss.backward()
        opt.step()
    head.eval().requires_grad_(False)


def _pair_loss(head, ids, start, feats, labels, index, vocab):
    """Pairs t = start-1 .. n-2 (a window ending the text)."""
    eagle3 = head.cfg.kind is HeadKind.EAGLE3
    a = max(start - 1, 0)
    toks, pos = torch.tensor(ids[a + 1:])[None], torch.arange(a, len(ids) - 1)[None]
    lab = index[labels[a + 1:]]
    fused = head.fuse(TargetFeatures({i: h[a:-1] for i, h in feats.hidden.items()}, feats.last_hidden[a:-1]))
    first = head(toks, pos, fused[None], compute_logits=eagle3)
    second = head(toks[:, 1:], pos[:, 1:], first.hidden[:, :-1], compute_logits=eagle3)
    loss = 0.0
    for out, y in ((first, lab), (second, lab[1:])):
        logits = out.logits[0] if eagle3 else F.linear(out.hidden[0], head.target_lm_head[vocab])
        loss = loss + F.cross_entropy(logits, y, ignore_index=-100)
    if not eagle3:
        loss = loss + F.mse_loss(first.hidden[0], feats.last_hidden[a + 1:])
    return loss


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts(head_prompts):
    return head_prompts


@pytest.fixture(scope="module")
def vanilla(head_vanilla):
    return head_vanilla


@pytest.fixture(scope="module")
def draft_vocab(target, prompts, vanilla):
    """A 1024-id draft vocabulary holding every token of the test texts."""
    used = torch.tensor(sorted({t for p, v in zip(prompts, vanilla) for t in p + v}))
    rest = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(0))
    rest = rest[~torch.isin(rest, used)][:1024 - len(used)]
    return torch.cat([used, rest])


@pytest.fixture(scope="module")
def heads(target, prompts, vanilla, draft_vocab, tmp_path_factory):
    """Checkpoint folders: random and trained EAGLE-3, EAGLE-3.1 and EAGLE-1 heads."""
    m = target.model
    texts = [(p + v, max(len(p) - 16, 1)) for p, v in zip(prompts, vanilla)]
    root = tmp_path_factory.mktemp("eagle_heads")
    made = {"e3_random": random_head(m, HeadKind.EAGLE3, draft_vocab),
            "e31_random": random_head(m, HeadKind.EAGLE3, draft_vocab, seed=1, fc_norm=True, norm_output=True),
            "e1_random": random_head(m, HeadKind.EAGLE1, fc_bias=True)}
    e3 = random_head(m, HeadKind.EAGLE3, draft_vocab, seed=2)
    train_head(e3, m, texts)
    e1 = random_head(m, HeadKind.EAGLE1, seed=3, fc_bias=True)
    train_head(e1, m, texts)
    made.update({"e3_trained": e3, "e1_trained": e1})
    return {name: save_eagle_head(h, root / name) for name, h in made.items()}


def run_spec(target, prompts, spec: dict, batch: int):
    llm = LLM(loaded=target, speculative_config=spec, max_num_seqs=batch)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)


# -- greedy equals vanilla ----------------------------------------------------------------------------
CASES = [  # (head, method, tree keys, batch, prompts used): each method sees a static and a
    # dynamic tree, batch 1 and 4; random heads draft junk (rejected), trained ones get accepted
    ("e3_random", "eagle3", TINY_DYNAMIC, 4, 4),
    ("e31_random", "eagle3", {"tree": TINY_STATIC}, 4, 4),
    ("e1_random", "eagle", {"tree": TINY_STATIC}, 1, 1),
    ("e3_trained", "eagle3", SMALL_DYNAMIC, 1, 2),
    ("e3_trained", "eagle3", {"num_speculative_tokens": 3}, 4, 4),
    ("e3_trained", "eagle3", {"head_context": 4, "num_speculative_tokens": 3}, 1, 2),
    ("e1_trained", "eagle", SMALL_DYNAMIC, 4, 4),
]


@pytest.mark.parametrize("head,method,tree,batch,n", CASES, ids=[f"{c[0]}-{c[1]}-{next(iter(c[2]))}-b{c[3]}"
                                                               for c in CASES])
def test_greedy_equals_vanilla(target, prompts, vanilla, heads, head, method, tree, batch, n):
    outs = run_spec(target, prompts[:n], {"method": method, "model": str(heads[head]), **tree}, batch)
    for p, o, want in zip(prompts, outs, vanilla):
        assert_same_or_tie(target.model, p, o.token_ids, want, f"{head} {method} {tree} b{batch}")
    if "trained" in head:    # trained heads must really be accepted (multi-token commits)
        acc = sum(o.metrics.num_accepted_tokens for o in outs) / sum(o.metrics.num_steps for o in outs)
        want_acc, want_depth = MIN_ACCEPTANCE[head]
        assert acc > want_acc, f"trained {head} accepted only {acc:.2f} tokens per step"
        assert max(len(o.metrics.acceptance_rate_per_pos) for o in outs) >= want_depth


# -- alignment and tree attention on a tiny model ----------------------------------------------
@pytest.fixture
def one_thread():
    """Tiny models: thread hand-offs cost more than the arithmetic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_target(vocab: int = 16, seed: int = 0) -> Transformer:
    cfg = ModelConfig(arch="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    torch.manual_seed(seed)
    return Transformer(cfg).eval().requires_grad_(False)


@torch.no_grad()
def rollout(head, feats_fused, seq: list[int], m: int, path: list[int]):
    """Plain no-cache forwards: committed pairs (f_t, x_{t+1}), t < m, then the draft path fed
    back with the head's own states. Returns the logits after the last pair."""
    toks, hid = list(seq[1:m + 1]), feats_fused[:m]
    out = None
    for step in range(len(path) + 1):
        pos = torch.arange(len(toks))[None]
        out = head(torch.tensor([toks]), pos, hid[None])
        if step < len(path):
            toks = toks + [path[step]]
            hid = torch.cat([hid, out.hidden[0, -1:]])
    return out.logits[0, -1]


HEAD_VARIANTS = [(HeadKind.EAGLE3, {}), (HeadKind.EAGLE3, {"fc_norm": True, "norm_output": True}),
                 (HeadKind.EAGLE1, {"fc_bias": True})]


@pytest.mark.parametrize("kind,kw", HEAD_VARIANTS, ids=["eagle3", "eagle3.1", "eagle1"])
def test_pairs_and_tree_match_plain_forwards(kind, kw, one_thread):
    """Two rows, ragged accepts: every root distribution equals a full forward over the pairs,
    and every tree node's children are the top ranks of a plain forward along its path."""
    head, seqs, full, fused, g = _two_rows(kind, kw, 40)
    tree = StaticTreeConfig.from_choices([[0], [1], [0, 0], [1, 0], [1, 1], [0, 0, 0], [0, 0, 1]])
    drafter = EagleDrafter(head, tree, max_batch=3, max_len=64)
    m = {1: 5, 2: 9}
    for row in seqs:
        drafter.start(row, seqs[row][:m[row]], _slice(full[row], 0, m[row]))
    accepts = {1: [0, 2, 1, 3, 0], 2: [3, 0, 0, 2, 1]}
    for step in range(5):
        reqs = [DraftRequest(row, seqs[row][:m[row] + 1], SamplingParams(temperature=0), g) for row in seqs]
        for r, t in zip(reqs, drafter.propose(reqs)):
            _check_tree(head, fused[r.row], seqs[r.row], m[r.row], t, tree.width)
        for row in seqs:
            a = accepts[row][step]
            drafter.accept(row, seqs[row][m[row]:m[row] + a + 1], _slice(full[row], m[row], m[row] + a + 1))
            m[row] += a + 1


@pytest.mark.parametrize("kind,kw,compile", [*[(k, w, False) for k, w in HEAD_VARIANTS],
                                              (HeadKind.EAGLE3, {}, True)],
                         ids=["eagle3", "eagle3.1", "eagle1", "eagle3-compiled"])
def test_chains_match_plain_forwards(kind, kw, compile, one_thread):
    """The chain program (``eagle_chain``): two rows, ragged accepts, budgets that cut a chain
    short or skip a step (pending pairs wait, then the general path catches up): every chain
    is the argmax path of plain forwards, and the program drafted every chain after the first.
    Rows 1 and 2 read the head's cache through the row index; compiled, rows 0 and 1 (views)
    too, on the same head."""
    head, seqs, full, fused, g = _two_rows(kind, kw, 48, (0, 1, 2))
    for rows in ((1, 2), (0, 1)) if compile else ((1, 2),):
        _check_chains(head, {r: seqs[r] for r in rows}, full, fused, g, compile)


def _check_chains(head, seqs, full, fused, g, compile: bool) -> None:
    tree = StaticTreeConfig.chain(3)
    drafter = EagleDrafter(head, tree, max_batch=3, max_len=64, compile=compile)
    calls = {"chain": 0}
    chain = drafter._propose_chain
    def counted(reqs):
        out = chain(reqs)
        calls["chain"] += out is not None
        return out
    drafter._propose_chain = counted
    m = dict(zip(seqs, (5, 9)))
    for row in seqs:
        drafter.start(row, seqs[row][:m[row]], _slice(full[row], 0, m[row]))
    accepts = dict(zip(seqs, ([0, 2, 1, 3, 0, 0, 1], [3, 0, 0, 2, 1, 2, 0])))
    budgets = [None, None, 2, None, 0, None, 1]
    for step in range(7):
        reqs = [DraftRequest(row, seqs[row][:m[row] + 1], SamplingParams(temperature=0), g,
                             max_nodes=budgets[step]) for row in seqs]
        for r, t in zip(reqs, drafter.propose(reqs)):
            want = 3 if budgets[step] is None else budgets[step]
            assert len(t) == want and t.parents.tolist() == list(range(-1, want - 1))
            if want:
                _check_tree(head, fused[r.row], seqs[r.row], m[r.row], t, 1)
        for row in seqs:
            a = accepts[row][step]
            drafter.accept(row, seqs[row][m[row]:m[row] + a + 1], _slice(full[row], m[row], m[row] + a + 1))
            m[row] += a + 1
    # all but step 0 (the prompt) and step 5 (pending pairs of two steps, after the skipped one)
    assert calls["chain"] == 5


@pytest.mark.parametrize("tree", [StaticTreeConfig.chain(3),
                                  StaticTreeConfig.from_choices([[0], [1], [0, 0], [1, 0]])], ids=["chain", "tree"])
def test_a_windowed_prompt_drafts_as_its_tail_alone(tree, one_thread):
    """``context_window``: a row started on a 20-token prompt with a window of 6 drafts exactly
    what a row started on the prompt's last 6 tokens drafts (the head's positions count from its
    first pair), step after step; a window as long as the prompt changes nothing."""
    head, seqs, full, _, g = _two_rows(HeadKind.EAGLE3, {}, 40, (0, 1))
    seq, f, m, w = seqs[0], full[0], 20, 6
    lo = m - w
    windowed = EagleDrafter(head, tree, max_batch=2, max_len=64, context_window=w)
    tail = EagleDrafter(head, tree, max_batch=2, max_len=64)
    whole = EagleDrafter(head, tree, max_batch=2, max_len=64, context_window=m)
    plain = EagleDrafter(head, tree, max_batch=2, max_len=64)
    windowed.start(1, seq[:m], _slice(f, 0, m))
    tail.start(1, seq[m - w:m], _slice(f, m - w, m))
    whole.start(0, seq[:m], _slice(f, 0, m))
    plain.start(0, seq[:m], _slice(f, 0, m))
    for step, a in enumerate([1, 0, 2, 1]):
        req = lambda row, lo: [DraftRequest(row, seq[lo:m + 1], SamplingParams(temperature=0), g)]
        got, want = windowed.propose(req(1, 0))[0], tail.propose(req(1, lo))[0]
        assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()
        assert whole.propose(req(0, 0))[0].tokens.tolist() == plain.propose(req(0, 0))[0].tokens.tolist()
        for d, row in ((windowed, 1), (tail, 1), (whole, 0), (plain, 0)):
            d.accept(row, seq[m:m + a + 1], _slice(f, m, m + a + 1))
        m += a + 1
    assert windowed.cache.lengths_of([1]) == tail.cache.lengths_of([1])
    with pytest.raises(ValueError, match="context_window"):
        EagleDrafter(head, tree, max_batch=1, max_len=8, context_window=0)


def _two_rows(kind, kw, n: int, rows: tuple[int, ...] = (1, 2)):
    """A random head (std 0.3) on the tiny target and random sequences of ``n`` tokens (one per
    row of ``rows``) with their target features and fused head inputs; the generator that drew them."""
    model = tiny_target()
    vocab_ids = torch.tensor([0, 1, 2, 3, 5, 6, 8, 9, 11, 12, 14, 15]) if kind is HeadKind.EAGLE3 else None
    head = random_head(model, kind, vocab_ids, std=0.3, **kw)
    g = torch.Generator().manual_seed(0)
    seqs = {r: torch.randint(0, 16, (n,), generator=g).tolist() for r in rows}
    full = {}
    for row, seq in seqs.items():
        o = model(torch.tensor([seq]), torch.arange(n)[None], hidden_layers=head.hidden_layers)
        full[row] = TargetFeatures({i: o.hidden[i][0] for i in head.hidden_layers}, o.last_hidden[0])
    return head, seqs, full, {row: head.fuse(f) for row, f in full.items()}, g


def _slice(f: TargetFeatures, a: int, b: int) -> TargetFeatures:
    return TargetFeatures({i: h[a:b] for i, h in f.hidden.items()}, f.last_hidden[a:b])


def _check_tree(head, fused, seq, m, tree, width):
    kids = tree.children()
    toks = tree.tokens.tolist()
    par = tree.parents.tolist()
    path_of = {-1: []}
    for n in range(len(tree)):
        path_of[n] = path_of[par[n]] + [toks[n]]
    for node in [-1] + list(range(len(tree))):
        if not kids[node + 1]:
            continue
        logits = rollout(head, fused, seq, m, path_of[node])
        ranked = head.draft_to_target(torch.topk(logits, width).indices).tolist()
        got = [toks[c] for c in kids[node + 1]]
        assert got == ranked[:len(got)], (m, node, got, ranked)


# -- losslessness at temperature > 0 ----------------------------------------------------------------
def l1_bound(n: int, cells: int, delta: float = 1e-3) -> float:
    """With probability >= 1 - delta, ||p_hat - p||_1 < this (Weissman et al. 2003)."""
    return math.sqrt(2 * (cells * math.log(2) + math.log(1 / delta)) / n)


@torch.no_grad()
def exact_joint(model, prompt: list[int], params: SamplingParams, k: int) -> dict[tuple, float]:
    """Target distribution of the first k generated tokens (small support via top_k)."""
    dist = {(): 1.0}
    for _ in range(k):
        nxt = {}
        for pre, pr in dist.items():
            ids = prompt + list(pre)
            p = target_probs(model(torch.tensor([ids]), torch.arange(len(ids))[None]).logits[0, -1], params)
            for t in torch.nonzero(p).flatten().tolist():
                nxt[pre + (t,)] = pr * float(p[t])
        dist = nxt
    return dist


def sample_first_tokens(model, drafter, prompt, params_of, n, k, batch=64):
    engine = Engine(model, drafter, max_batch=batch, max_len=len(prompt) + 16)
    seqs = [Sequence(prompt_ids=list(prompt), params=params_of(i)) for i in range(n)]
    engine.run(seqs)
    counts: dict[tuple, int] = {}
    for s in seqs:
        key = tuple(s.output_ids[:k])
        counts[key] = counts.get(key, 0) + 1
    return counts, engine.stats


def assert_follows(counts, exact, n, label):
    from scipy.stats import chisquare
    cells = sorted(exact)
    assert set(counts) <= set(cells), f"{label}: tokens outside the target's support"
    l1 = sum(abs(counts.get(c, 0) / n - exact[c]) for c in cells)
    bound = l1_bound(n, len(cells))
    assert l1 < bound, f"{label}: L1 {l1:.3f} >= bound {bound:.3f}"
    total = sum(exact.values())
    chi = chisquare([counts.get(c, 0) for c in cells], [exact[c] / total * n for c in cells])
    assert chi.pvalue > 1e-4, f"{label}: chi-square p = {chi.pvalue:.2e} (L1 {l1:.3f})"


@pytest.mark.parametrize("tree", [DynamicTreeConfig(topk=3, depth=3, num_draft_tokens=6),
                                  StaticTreeConfig.from_choices([[0], [1], [0, 0], [0, 1], [0, 0, 0]])],
                         ids=["dynamic", "static"])
def test_sampling_is_lossless_tiny_model(tree, one_thread):
    """First three tokens at temperature 1, top-k 3 (27 outcomes) vs the exact target joint."""
    model = tiny_target(seed=1)
    head = random_head(model, HeadKind.EAGLE3, std=0.3, seed=4)
    prompt, n = [1, 2, 3, 4], 2500
    params_of = lambda i: SamplingParams(temperature=1.0, top_k=3, max_tokens=6, seed=1000 + i)  # noqa: E731
    drafter = EagleDrafter(head, tree, max_batch=64, max_len=32)
    counts, stats = sample_first_tokens(model, drafter, prompt, params_of, n, 3)
    assert stats.num_accepted_tokens > n // 4 and len(stats.accepted_per_pos) >= 2, "drafts were not exercised"
    assert_follows(counts, exact_joint(model, prompt, params_of(0), 3), n, f"eagle3 {type(tree).__name__}")


@pytest.mark.slow
def test_sampling_is_lossless_real_model(target, prompts, heads):
    """SmolLM2 with the trained EAGLE-3 head: first three tokens at temperature 0.8, top-k 3."""
    from verispec.formats import load_eagle_head
    head = load_eagle_head(heads["e3_trained"], target.model, HeadKind.EAGLE3)
    prompt, n = prompts[2], 1200
    params_of = lambda i: SamplingParams(temperature=0.8, top_k=3, max_tokens=5, seed=i)  # noqa: E731
    drafter = EagleDrafter(head, DynamicTreeConfig(topk=3, depth=3, num_draft_tokens=6), max_batch=48,
                           max_len=len(prompt) + 16)
    counts, stats = sample_first_tokens(target.model, drafter, prompt, params_of, n, 3, batch=48)
    assert stats.num_accepted_tokens > 0
    assert_follows(counts, exact_joint(target.model, prompt, params_of(0), 3), n, "smollm2 eagle3")


# -- configuration ------------------------------------------------------------------------------
def test_config_errors(target, heads, monkeypatch):
    monkeypatch.setattr("verispec.drafting.shipped.shipped_head", lambda *a: None)     # as if no head were shipped
    with pytest.raises(SpecConfigError, match="needs 'model'.*no eagle3 head is shipped"):
        LLM(loaded=target, speculative_config={"method": "eagle3"})
    with pytest.raises(SpecConfigError, match="no config.json|not a folder"):
        LLM(loaded=target, speculative_config={"method": "eagle3", "model": "/nonexistent/head"})
    e3 = str(heads["e3_random"])
    with pytest.raises(SpecConfigError, match="rank_by"):
        LLM(loaded=target, speculative_config={"method": "eagle3", "model": e3, "rank_by": "best"})
    with pytest.raises(SpecConfigError, match="static 'tree'"):
        LLM(loaded=target, speculative_config={"method": "eagle3", "model": e3, "tree": [[0]], "rerank": False})
    with pytest.raises(SpecConfigError, match="medusa"):
        LLM(loaded=target, speculative_config={"method": "eagle3", "model": e3, "typical_acceptance": True})
    with pytest.raises(SpecConfigError, match="eagle3"):
        LLM(loaded=target, speculative_config={"method": "eagle", "model": str(heads["e1_random"]),
                                               "eagle_aux_hidden_state_layer_ids": [2, 15, 27]})
    with pytest.raises(SpecConfigError, match="'head_context' must be an integer >= 0"):
        LLM(loaded=target, speculative_config={"method": "eagle3", "model": e3, "head_context": -1})
    with pytest.raises(SpecConfigError, match="'head_context' must be an integer >= 0"):
        LLM(loaded=target, speculative_config={"method": "hybrid", "model": e3, "head_context": "all"})
    with pytest.raises(SpecConfigError, match="EAGLE-3 checkpoint"):
        LLM(loaded=target, speculative_config={"method": "eagle", "model": e3})
    llm = LLM(loaded=target, speculative_config={"method": "eagle3", "model": e3, "rank_by": "confidence",
                                                 "rerank": False, "eagle_aux_hidden_state_layer_ids": [3, 10, 20]})
    drafter = llm.make_engine(1, 64).drafter
    assert drafter.hidden_layers == (2, 9, 19)
    assert drafter.tree.rank_by.value == "confidence" and drafter.tree.rerank is False


# -- runtime cut of an EAGLE-3 head's draft vocabulary --------------------------------------------
def test_restricted_vocab_logits_are_the_full_ones_columns(target, draft_vocab):
    """After ``restrict_vocab_`` the head's logits are the full head's columns of the kept ids, and
    its maps send the new columns to those target ids; ids outside its vocabulary are ignored."""
    m = target.model
    head = random_head(m, HeadKind.EAGLE3, draft_vocab, seed=5)
    tokens = torch.tensor([[5, 9, 11]])
    pos = torch.arange(3)[None]
    hidden = torch.randn(1, 3, m.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    full = head(tokens, pos, hidden).logits
    columns = head.draft_to_target(torch.arange(head.lm_head.out_features))     # target id of each column
    outside = torch.tensor([i for i in range(m.cfg.vocab_size) if i not in set(draft_vocab.tolist())][:5])
    keep = torch.cat([columns[::3], outside])
    head.restrict_vocab_(keep)
    cut = head(tokens, pos, hidden).logits
    assert cut.shape[-1] == columns[::3].numel()
    torch.testing.assert_close(cut, full[..., ::3])
    assert head.draft_to_target(torch.arange(cut.shape[-1])).tolist() == sorted(columns[::3].tolist())
    assert int(head.t2d.sum()) == cut.shape[-1] and bool(head.t2d[columns[::3]].all())
    with pytest.raises(ValueError, match="no id"):
        random_head(m, HeadKind.EAGLE3, draft_vocab).restrict_vocab_(outside)


def test_reduced_vocab_greedy_equals_vanilla(target, prompts, vanilla, heads, tmp_path):
    """A head folder's draft_vocab.safetensors is used by default ('full' turns it off); greedy
    output stays vanilla's and, holding the texts' tokens, acceptance stays high."""
    import shutil
    from verispec.drafting.draft_vocab import DraftVocab, save_draft_vocab
    folder = tmp_path / "e3_cut"
    shutil.copytree(heads["e3_trained"], folder)
    seen = sorted({t for p, v in zip(prompts, vanilla) for t in p + v})
    save_draft_vocab(DraftVocab.from_ids(torch.tensor(seen), target.config.vocab_size), folder / "draft_vocab.safetensors")
    spec = {"method": "eagle3", "model": str(folder), "num_speculative_tokens": 3}
    outs = run_spec(target, prompts[:4], spec, 4)
    for p, o, want in zip(prompts, outs, vanilla):
        assert_same_or_tie(target.model, p, o.token_ids, want, "eagle3 reduced vocabulary")
    acc = sum(o.metrics.num_accepted_tokens for o in outs) / sum(o.metrics.num_steps for o in outs)
    assert acc > MIN_ACCEPTANCE["e3_trained"][0], f"accepted only {acc:.2f} tokens per step"
    cut = LLM(loaded=target, speculative_config=spec).make_engine(1, 64).drafter.head
    assert cut.lm_head.out_features == len(seen)
    full = LLM(loaded=target, speculative_config=dict(spec, draft_vocab="full")).make_engine(1, 64).drafter.head
    assert full.lm_head.out_features == 1024
    with pytest.raises(SpecConfigError, match="does not exist"):
        LLM(loaded=target, speculative_config=dict(spec, draft_vocab=str(tmp_path / "none")))


def test_eagle1_vocab_cut_reads_the_target_rows(target, prompts, vanilla, heads, tmp_path):
    """An EAGLE-1 head's cut reads a copy of those rows of the target's LM head: its logits are the
    full read's columns, its draft ids map to those target ids, the target's head is untouched, and
    greedy output stays vanilla's."""
    import shutil
    from verispec.drafting.draft_vocab import DraftVocab, save_draft_vocab
    m = target.model
    head = random_head(m, HeadKind.EAGLE1, seed=6, fc_bias=True)
    tokens, pos = torch.tensor([[5, 9, 11]]), torch.arange(3)[None]
    hidden = torch.randn(1, 3, m.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    full = head(tokens, pos, hidden).logits
    ids = torch.arange(3, m.cfg.vocab_size, 5)
    head.restrict_vocab_(ids)
    torch.testing.assert_close(head(tokens, pos, hidden).logits, full[..., ids])
    assert head.draft_to_target(torch.tensor([0, 1, 2])).tolist() == ids[:3].tolist()
    assert m.lm_head.weight.shape[0] == m.cfg.vocab_size
    folder = tmp_path / "e1_cut"
    shutil.copytree(heads["e1_trained"], folder)
    seen = sorted({t for p, v in zip(prompts, vanilla) for t in p + v})
    save_draft_vocab(DraftVocab.from_ids(torch.tensor(seen), m.cfg.vocab_size), folder / "draft_vocab.safetensors")
    outs = run_spec(target, prompts[:2], {"method": "eagle", "model": str(folder), "num_speculative_tokens": 2}, 1)
    for p, o, want in zip(prompts, outs, vanilla):
        assert_same_or_tie(target.model, p, o.token_ids, want, "eagle-1 reduced vocabulary")
    drafter = LLM(loaded=target, speculative_config={"method": "eagle", "model": str(folder)}).make_engine(1, 64).drafter
    assert drafter.head.vocab_ids.tolist() == seen
