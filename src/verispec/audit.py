"""``verispec audit``: losslessness checked on the user's own model, drafter and sampling settings.

Two checks, each with a pass/fail verdict:

1. **Greedy identity**: every prompt decoded greedily with and without speculation (same loaded
   model and weights) gives the same tokens. A difference passes only as a *numerical tie*: the
   target's top-2 margin (processed logits) at the first differing position is below
   ``tie_margin``; ties are reported.
2. **Sampled distribution**: ``samples`` outputs are drawn with speculation at the user's
   temperature, top-k, top-p, min-p and penalties (long enough for the drafter's whole tree in
   the first step; ``ignore_eos`` set, stop strings and stop tokens dropped), and their first
   ``depth`` tokens (the prefill's token, then the first speculative step's) are compared with
   the target's exact distribution of those tokens under the same logits pipeline.
   Cells are token prefixes whose exact expected count is at least ``min_expected``; the rest of
   each prefix's mass is one "other" cell. Pearson's chi-square gives a p-value; the check fails
   below ``alpha``.
The report is printable (``render``) and JSON-serialisable (``as_dict``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .llm import LLM
from .core.logits import LogitsPipeline
from .core.params import SamplingParams

OTHER = -1          # a cell: any token outside the expanded ones at this position (and anything after)


@dataclass
class GreedyCase:
    prompt: int                      # index into the audited prompts
    identical: bool
    first_difference: int | None = None
    top2_margin: float | None = None
    tie: bool = False

    @property
    def passed(self) -> bool:
        return self.identical or self.tie


@dataclass
class SampledCheck:
    prompt: int
    samples: int
    cells: int
    chi2: float
    dof: int
    p_value: float
    passed: bool
    worst_cells: list = field(default_factory=list)   # (cell, observed, expected), largest deviation first

    @property
    def informative(self) -> bool:
        """False when the target is (nearly) deterministic over these tokens: one cell, no test."""
        return self.cells >= 2


@dataclass
class AuditReport:
    speculative_config: dict
    params: dict
    greedy: list[GreedyCase]
    sampled: list[SampledCheck]
    alpha: float
    tie_margin: float

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.greedy) and all(s.passed for s in self.sampled)

    def as_dict(self) -> dict:
        return {"passed": self.passed, "speculative_config": self.speculative_config, "params": self.params,
                "alpha": self.alpha, "tie_margin": self.tie_margin,
                "greedy": [dict(dataclasses.asdict(c), passed=c.passed) for c in self.greedy],
                "sampled": [dict(dataclasses.asdict(s), informative=s.informative) for s in self.sampled]}

    def render(self) -> str:
        lines = [f"verispec audit: {'PASS' if self.passed else 'FAIL'}",
                 f"  speculative_config: {self.speculative_config}", f"  sampling: {self.params}"]
        same = sum(c.identical for c in self.greedy)
        ties = [c for c in self.greedy if c.tie]
        lines.append(f"  greedy identity: {same}/{len(self.greedy)} identical, {len(ties)} numerical ties"
                     f" (top-2 margin < {self.tie_margin:g})")
        for c in self.greedy:
            if not c.identical:
                lines.append(f"    prompt {c.prompt}: first difference at token {c.first_difference}, top-2 margin "
                             f"{c.top2_margin:.2e}: {'tie' if c.tie else 'NOT A TIE'}")
        for s in self.sampled:
            lines.append(f"  sampled, prompt {s.prompt}: {s.samples} samples over {s.cells} cells, chi2 {s.chi2:.1f} "
                         f"(dof {s.dof}), p = {s.p_value:.3g}: {'pass' if s.passed else 'FAIL'} (alpha {self.alpha:g})")
            if not s.informative:
                lines.append("    uninformative: the target is nearly deterministic here (raise the temperature "
                             "or give prompts with more varied continuations)")
        return "\n".join(lines)


def audit(llm: LLM, prompts: list[list[int]], params: SamplingParams, *, max_tokens: int = 64,
          samples: int = 2000, depth: int = 3, sampled_prompts: int = 1, alpha: float = 1e-3,
          tie_margin: float = 1e-4, min_expected: float = 5.0, seed: int = 0) -> AuditReport:
    """Audit ``llm`` (a speculative ``LLM``) on ``prompts`` (token ids) at ``params``."""
    if llm.spec is None:
        raise ValueError("audit needs an LLM with a speculative_config (nothing to compare otherwise)")
    if not prompts:
        raise ValueError("audit needs at least one prompt")
    if depth < 2 or samples < 50:
        raise ValueError("audit needs depth >= 2 (a speculative step) and samples >= 50")
    vanilla = LLM(loaded=llm.target, max_num_seqs=1)
    greedy = [_greedy_case(llm, vanilla, i, p, params, max_tokens, tie_margin) for i, p in enumerate(prompts)]
    sampled = []
    if not params.greedy:
        for i in _most_uncertain(llm, prompts, params, sampled_prompts):
            sampled.append(_sampled_check(llm, i, prompts[i], params, samples, depth, alpha, min_expected, seed))
    shown = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
             if getattr(params, f.name) != getattr(SamplingParams(), f.name) and f.name != "max_tokens"}
    return AuditReport(llm.spec.as_dict(), shown, greedy, sampled, alpha, tie_margin)


# -- greedy identity ---------------------------------------------------------------------------
def _greedy_case(llm: LLM, vanilla: LLM, index: int, prompt: list[int], params: SamplingParams, max_tokens: int,
                 tie_margin: float) -> GreedyCase:
    """``prompt`` decoded greedily by ``llm`` and by ``vanilla`` (the same target, no speculation)."""
    gp = dataclasses.replace(params, temperature=0.0, max_tokens=max_tokens, seed=None, n=1)
    want = vanilla.generate({"prompt_token_ids": prompt}, gp)[0].token_ids
    got = llm.generate({"prompt_token_ids": prompt}, gp)[0].token_ids
    n = min(len(got), len(want))
    diff = next((i for i in range(n) if got[i] != want[i]), None if len(got) == len(want) else n)
    if diff is None:
        return GreedyCase(index, True)
    margin = _top2_margin(llm, prompt, want[:diff], gp)
    return GreedyCase(index, False, diff, margin, margin < tie_margin)


def _processed_logits(llm: LLM, prompt: list[int], prefix: list[int], pipe: LogitsPipeline) -> torch.Tensor:
    """The target's processed logits [V] for the token after ``prompt + prefix`` (output so far
    ``prefix``), as the engine's pipeline gives them."""
    ids, dev = prompt + prefix, llm.device
    with torch.no_grad():
        tokens, positions = torch.tensor([ids], device=dev), torch.arange(len(ids), device=dev)[None]
        logits = llm.target.model(tokens, positions).logits[0, -1:]
    return pipe.process(logits, prompt, prefix)[0].float()


def _top2_margin(llm: LLM, prompt: list[int], prefix: list[int], params: SamplingParams) -> float:
    top = torch.topk(_processed_logits(llm, prompt, prefix, LogitsPipeline.build(params, llm.eos_token_ids)), 2).values
    return float(top[0] - top[1])


# -- sampled distribution ----------------------------------------------------------------------
def _most_uncertain(llm: LLM, prompts: list[list[int]], params: SamplingParams, k: int) -> list[int]:
    """Indices of the ``k`` prompts whose first token has the most entropy under ``params``: a
    nearly deterministic target leaves the chi-square test nothing to see."""
    pipe = LogitsPipeline.build(params, llm.eos_token_ids)
    ent = []
    for p in prompts:
        probs = pipe.probs(_processed_logits(llm, p, [], pipe)[None])[0].double()
        ent.append(float(-(probs * probs.clamp_min(1e-300).log()).sum()))
    return sorted(range(len(prompts)), key=lambda i: -ent[i])[:k]


def _sampled_check(llm: LLM, index: int, prompt: list[int], params: SamplingParams, samples: int, depth: int,
                   alpha: float, min_expected: float, seed: int) -> SampledCheck:
    outs = _sample_outputs(llm, prompt, params, samples, depth, seed)
    exact, kept = _exact_cells(llm, prompt, _sampled_params(params, depth), depth, min_expected / samples)
    observed: dict[tuple, int] = {}
    for o in outs:
        cell = _cell_of(tuple(o[:depth]), kept, depth)
        observed[cell] = observed.get(cell, 0) + 1
    chi2, dof, worst = _chi_square(exact, observed, samples, min_expected)
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64, device="cpu"),
                                            torch.tensor(chi2 / 2.0, dtype=torch.float64, device="cpu")))
    return SampledCheck(index, samples, len(exact), chi2, dof, p_value, p_value > alpha, worst)


def _sampled_params(params: SamplingParams, max_tokens: int) -> SamplingParams:
    return dataclasses.replace(params, max_tokens=max_tokens, ignore_eos=True, n=1, stop=[], stop_token_ids=[],
                               logprobs=None, prompt_logprobs=None)


class _StopAfter:
    """A stop hook ending an output after ``depth`` tokens, whatever ``max_tokens`` says."""

    def __init__(self, depth: int):
        self.depth, self.n = depth, 0

    def __call__(self, new: list[int]) -> int | None:
        if self.n + len(new) >= self.depth:
            return self.depth - self.n
        self.n += len(new)
        return None


def _sample_outputs(llm: LLM, prompt: list[int], params: SamplingParams, samples: int, depth: int,
                    seed: int) -> list[list[int]]:
    """``samples`` outputs (output j seeded ``seed + j``) decoded by ``llm``'s engine with room for
    the drafter's whole tree in the first step, each ended after ``depth`` tokens."""
    from .core.engine import Sequence
    room = llm.make_engine(1, len(prompt) + 2).max_tree_nodes
    sp = _sampled_params(params, depth + room)
    engine = llm.make_engine(min(samples, llm.max_num_seqs), len(prompt) + depth + room)
    seqs = [Sequence(list(prompt), dataclasses.replace(sp, seed=seed + j), stop_hook=_StopAfter(depth))
            for j in range(samples)]
    engine.run(seqs)
    return [s.output_ids for s in seqs]


def _chi_square(exact: dict[tuple, float], observed: dict[tuple, int], samples: int,
                min_expected: float) -> tuple[float, int, list]:
    """Pearson's statistic over the cells; cells expected below ``min_expected`` are pooled (and
    the pool joins the smallest cell if it is still below). An observed cell of probability 0
    makes the statistic infinite. Returns (chi2, degrees of freedom, five worst cells)."""
    impossible = [c for c in observed if exact.get(c, 0.0) == 0.0]
    if impossible:
        return float("inf"), max(1, len(exact) - 1), [(list(c), observed[c], 0.0) for c in impossible[:5]]
    big = {c: p for c, p in exact.items() if p * samples >= min_expected}
    small = [c for c in exact if c not in big]
    groups = [([c], p) for c, p in big.items()]
    if small:
        pool = ([*small], sum(exact[c] for c in small))
        if pool[1] * samples >= min_expected or not groups:
            groups.append(pool)
        else:
            k = min(range(len(groups)), key=lambda g: groups[g][1])
            groups[k] = (groups[k][0] + pool[0], groups[k][1] + pool[1])
    chi2, dev = 0.0, []
    for members, p in groups:
        e, o = p * samples, sum(observed.get(c, 0) for c in members)
        chi2 += (o - e) ** 2 / e
        dev.append((abs(o - e) / e ** 0.5, [list(c) for c in members[:3]], o, round(e, 2)))
    return chi2, max(1, len(groups) - 1), [d[1:] for d in sorted(dev, key=lambda d: -d[0])[:5]]


def _exact_cells(llm: LLM, prompt: list[int], params: SamplingParams, depth: int, min_p: float,
                 max_forwards: int = 256) -> tuple[dict[tuple, float], dict[tuple, set[int]]]:
    """Exact probability of each cell, and the tokens kept below each expanded prefix. Cells are
    the ``depth``-token outputs whose probability is at least ``min_p`` and, per prefix, one
    ``OTHER`` cell with the rest of its mass (a prefix left unexpanded after ``max_forwards``
    target forwards is all ``OTHER``)."""
    pipe = LogitsPipeline.build(params, llm.eos_token_ids)
    cells: dict[tuple, float] = {}
    kept: dict[tuple, set[int]] = {}
    frontier = [((), 1.0)]
    for level in range(depth):
        nxt = []
        for prefix, mass in frontier:
            if len(kept) >= max_forwards:
                cells[prefix + (OTHER,) * (depth - level)] = mass
                continue
            probs = pipe.probs(_processed_logits(llm, prompt, list(prefix), pipe)[None])[0].double()
            joint = probs * mass
            keep = torch.nonzero(joint >= min_p).flatten().tolist()
            kept[prefix] = set(keep)
            rest = mass - float(joint[keep].sum()) if keep else mass
            if rest > 1e-12:
                cells[prefix + (OTHER,) * (depth - level)] = rest
            for t in keep:
                if level == depth - 1:
                    cells[prefix + (t,)] = float(joint[t])
                else:
                    nxt.append((prefix + (t,), float(joint[t])))
        frontier = nxt
    return cells, kept


def _cell_of(tokens: tuple, kept: dict[tuple, set[int]], depth: int) -> tuple:
    """The cell an output falls in: its longest kept prefix, then ``OTHER``."""
    prefix: tuple = ()
    for level in range(depth):
        if prefix not in kept or tokens[level] not in kept[prefix]:
            return prefix + (OTHER,) * (depth - level)
        prefix = prefix + (tokens[level],)
    return prefix
