"""Chunked prefill (``Engine.begin`` / ``Engine.prefill_step``, the server's ``prefill_chunk``):
the same tokens as a whole-prompt prefill, running streams keep decoding between the chunks of a
long prompt, and aborts or failures in the middle of a prompt free its row and lose nothing else."""
from __future__ import annotations

import pytest
import torch

from helpers import tiny_llama
from verispec.core.engine import Engine, Sequence
from verispec.core.params import SamplingParams

pytestmark = pytest.mark.usefixtures("module_single_thread")
PROMPTS = [[(7 * i + 3) % 61 + 1 for i in range(n)] for n in (45, 9, 30)]


def _engine(max_batch: int = 3, seed: int = 0, grid: int = 10) -> Engine:
    """An engine whose prompts are prefilled on a grid of ``grid`` positions (``prefill_chunk``)."""
    return Engine(tiny_llama(64, 32, 2, seed=seed), None, max_batch=max_batch, max_len=128, prefill_chunk=grid)


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, **kw})


def _whole(prompt, params) -> Sequence:
    seq = Sequence(list(prompt), params)
    _engine().run([seq])
    return seq


def _drain(eng: Engine, chunk: int) -> list[int]:
    """Prefill everything admitted in chunks of ``chunk``, decoding the running sequences between
    chunks (as the server's rounds do); returns the tokens each call prefilled."""
    done = []
    while eng.num_prefilling or eng.num_running:
        if eng.num_running:
            eng.step()
        if eng.num_prefilling:
            done.append(eng.prefill_step(chunk))
    return done


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_gives_the_whole_prompt_tokens(chunk):
    params = [_params(), _params(temperature=0.8, seed=5), _params(temperature=1.0, top_k=8, seed=11)]
    want = [_whole(p, sp).output_ids for p, sp in zip(PROMPTS, params)]
    eng = _engine(grid=chunk)
    seqs = [Sequence(list(p), sp) for p, sp in zip(PROMPTS, params)]
    eng.begin(seqs[0])
    eng.prefill_step(min(chunk, 10))
    eng.begin(seqs[1])                        # admitted while the first is half prefilled
    calls = _drain(eng, chunk)
    eng.begin(seqs[2])
    _drain(eng, chunk)
    assert [s.output_ids for s in seqs] == want
    assert all(c < 2 * chunk for c in calls) and sorted(eng.free_rows) == [0, 1, 2]   # one chunk may pass the budget


def test_streams_decode_between_the_chunks_of_a_long_prompt():
    eng = _engine(max_batch=2, grid=16)
    short = Sequence(list(PROMPTS[1]), _params(max_tokens=40))
    eng.add(short)
    long = Sequence(list(PROMPTS[0]) * 2, _params())
    eng.begin(long)
    assert eng.num_running == 1 and eng.num_prefilling == 1 and long.output_ids == []
    before = len(short.output_ids)
    rounds = 0
    while eng.num_prefilling:
        eng.step()
        eng.prefill_step(16)
        rounds += 1
    assert rounds == 6 and len(short.output_ids) == before + rounds     # 90 tokens in chunks of 16
    assert len(long.output_ids) == 1                                     # its first token, at once
    while eng.num_running:
        eng.step()
    assert long.output_ids == _whole(long.prompt_ids, _params()).output_ids
    assert short.output_ids == _whole(short.prompt_ids, _params(max_tokens=40)).output_ids


def test_prompt_logprobs_through_chunks_match_the_whole_prompt():
    sp = _params(max_tokens=3, prompt_logprobs=2, logprobs=1)
    want = _whole(PROMPTS[2], sp)
    eng = _engine(grid=8)
    seq = Sequence(list(PROMPTS[2]), sp)
    eng.begin(seq)
    _drain(eng, 8)
    assert len(seq.prompt_logprobs) == len(PROMPTS[2]) - 1
    for got, ref in zip(seq.prompt_logprobs + seq.logprobs, want.prompt_logprobs + want.logprobs):
        assert got.token_id == ref.token_id and got.logprob == pytest.approx(ref.logprob, abs=1e-4)


def test_abort_mid_prefill_frees_the_row_and_keeps_the_others():
    eng = _engine(max_batch=2)
    keep = Sequence(list(PROMPTS[1]), _params())
    eng.add(keep)
    gone = Sequence(list(PROMPTS[0]), _params())
    eng.begin(gone)
    eng.prefill_step(10)
    assert not eng.can_admit()
    eng.abort(gone)
    assert gone.finished and gone.finish_reason == "abort" and eng.num_prefilling == 0 and eng.can_admit()
    nxt = Sequence(list(PROMPTS[2]), _params())
    eng.begin(nxt)                             # the freed row, with a clean cache
    _drain(eng, 10)
    assert nxt.output_ids == _whole(PROMPTS[2], _params()).output_ids
    assert keep.output_ids == _whole(PROMPTS[1], _params()).output_ids


class _FailOnce(torch.nn.Module):
    """The model, failing its ``n``-th call (a kernel failure in the middle of a prompt)."""

    def __init__(self, model, n: int):
        super().__init__()
        self.inner, self.n = model, n
        self.cfg = model.cfg

    def forward(self, *args, **kw):
        self.n -= 1
        if self.n == 0:
            raise RuntimeError("simulated chunk failure")
        return self.inner(*args, **kw)


def test_a_failing_chunk_aborts_that_prompt_only():
    eng = _engine(max_batch=2)
    keep = Sequence(list(PROMPTS[1]), _params())
    eng.add(keep)
    eng.model = _FailOnce(eng.model, 3)        # begin hands the prefill this model
    bad = Sequence(list(PROMPTS[0]), _params())
    eng.begin(bad)
    eng.model = eng.model.inner
    eng.prefill_step(10)
    eng.prefill_step(10)
    with pytest.raises(RuntimeError, match="simulated chunk failure"):
        eng.prefill_step(10)
    assert bad.finished and bad.finish_reason == "abort" and bad.output_ids == []
    assert eng.num_prefilling == 0 and eng.can_admit() and eng.num_running == 1
    while eng.num_running:
        eng.step()
    assert keep.output_ids == _whole(PROMPTS[1], _params()).output_ids


def test_bad_calls_are_refused_and_take_no_row():
    eng = _engine(max_batch=1)
    with pytest.raises(ValueError, match="empty"):
        eng.begin(Sequence([], _params()))
    with pytest.raises(ValueError, match="context holds"):
        eng.begin(Sequence([1] * 200, _params()))
    assert eng.can_admit()
    eng.begin(Sequence([1, 2, 3], _params()))
    with pytest.raises(RuntimeError, match="no free batch row"):
        eng.begin(Sequence([1, 2], _params()))
    with pytest.raises(ValueError, match="max_tokens"):
        eng.prefill_step(0)
    assert eng.prefill_step(100) == 3 and eng.num_running == 1


def test_a_short_prompt_is_not_queued_behind_a_long_one():
    eng = _engine(max_batch=2)
    long = Sequence(list(PROMPTS[0]) * 2, _params())            # 90 tokens
    short = Sequence(list(PROMPTS[1]), _params())               # 9 tokens
    eng.begin(long)
    eng.prefill_step(20)
    eng.begin(short)
    assert 20 <= eng.prefill_step(20) < 30                     # the short prompt first, the long one the rest
    assert short.output_ids and not long.output_ids and eng.num_running == 1
    _drain(eng, 20)
    assert long.output_ids == _whole(long.prompt_ids, _params()).output_ids
    assert short.output_ids == _whole(PROMPTS[1], _params()).output_ids


@pytest.mark.parametrize("budgets", [[1], [3, 50], [40], [100]])
def test_chunks_lie_on_the_grid_whatever_the_budget(budgets):
    """A prompt's chunks are its grid's, however the budget of each round falls (so its numbers
    never depend on the load): a 45-token prompt on a grid of 16 runs 16 + 16 + 13 tokens."""
    eng = _engine(max_batch=1, grid=16)
    widths = []
    model = eng.model

    class Spy(torch.nn.Module):
        cfg = model.cfg

        def forward(self, tokens, *args, **kw):
            widths.append(int(tokens.shape[1]))
            return model(tokens, *args, **kw)
    eng.model = Spy()
    seq = Sequence(list(PROMPTS[0]), _params())
    eng.begin(seq)
    i = 0
    while eng.num_prefilling:
        eng.prefill_step(budgets[min(i, len(budgets) - 1)])
        i += 1
    assert widths == [16, 16, 13]
    eng.model = model
    while eng.num_running:
        eng.step()
    assert seq.output_ids == _whole(PROMPTS[0], _params()).output_ids
