"""Structured output with speculation: the request surface, the grammar walk over draft trees, and
the claims of ``grammar``: every output validates, greedy speculation equals greedy decoding
under the same grammar, sampled speculation follows the constrained target (chi-square on a tiny
model), and the real ``openai`` client gets schema-valid JSON, streamed and not."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from scipy.stats import chisquare

from verispec import LLM, SamplingParams
from verispec.drafting.base import StatelessDrafter
from verispec.core.engine import Engine, Sequence
from verispec.core.grammar import GrammarCompiler
from verispec.core.logits import LogitsPipeline
from verispec.core.structured import StructuredOutputError, StructuredOutputsParams as SO
from verispec.core.tree import DraftTree

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]}}, "required": ["name", "age", "city"],
    "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
    "status": {"enum": ["open", "shipped", "closed"]},
    "items": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}},
    "required": ["id", "status", "items"], "additionalProperties": False}
CHAT = [[{"role": "user", "content": "Describe a fictional person as JSON: name, age and city."}],
        [{"role": "user", "content": "Write a JSON order record with an id, a status and two items."}],
        [{"role": "user", "content": "Return a JSON object describing the weather in Oslo: temperature and sky."}]]


@pytest.fixture(scope="module")
def compiler(target):
    return GrammarCompiler(target.tokenizer, target.config.vocab_size, (target.tokenizer.eos_token_id,))


# ---------------------------------------------------------------------------- the request surface
def test_params_need_exactly_one_constraint_and_clear_errors():
    assert SO(json='{"type": "object"}').json == {"type": "object"}
    assert SO(choice=["a", "b"]).choice == ("a", "b") and SO(regex="x+").kind == "regex"
    for bad, msg in [({}, "exactly one"), ({"regex": "a", "choice": ["b"]}, "exactly one"),
                     ({"json": "{not json"}, "not valid JSON"), ({"choice": []}, "non-empty"),
                     ({"choice": ["a", ""]}, "non-empty"), ({"json": [1]}, "JSON object")]:
        with pytest.raises(StructuredOutputError, match=msg):
            SO(**bad)
    assert SO.from_response_format({"type": "text"}) is None
    assert SO.from_response_format({"type": "json_object"}) == SO(json_object=True)
    assert SO.from_response_format({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}).json == PERSON
    for bad in [{"type": "xml"}, {"no": "type"}, {"type": "json_schema", "json_schema": 3}]:
        with pytest.raises(StructuredOutputError):
            SO.from_response_format(bad)
    with pytest.raises(StructuredOutputError, match="unknown field"):
        SO.from_dict({"json_schema": {}})
    assert SO.from_dict({"regex": "a", "disable_any_whitespace": False}).whitespace_flexible
    assert SamplingParams(structured_outputs={"choice": ["x"]}).structured_outputs == SO(choice=("x",))
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")
    # equal constraints share a cache key whatever the key order of the schema
    assert SO(json={"a": 1, "b": 2}).cache_key() == SO(json='{"b": 2, "a": 1}').cache_key()


def test_bad_grammars_are_refused_before_decoding(compiler, llm):
    with pytest.raises(StructuredOutputError, match="regex"):
        compiler.grammar(SO(regex="(unclosed"))
    with pytest.raises(StructuredOutputError, match="grammar"):
        compiler.grammar(SO(grammar="start: undefined_rule"))
    with pytest.raises(ValueError):
        llm.generate("x", SamplingParams(structured_outputs=SO(regex="[z-a]")))


def test_request_fields_map_to_one_constraint():
    pytest.importorskip("fastapi")
    from verispec.serve.protocol import ChatCompletionRequest, CompletionRequest, sampling_params
    msgs = [{"role": "user", "content": "x"}]
    for body, want in [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}, SO(json=PERSON)),
        ({"response_format": {"type": "json_object"}}, SO(json_object=True)),
        ({"guided_json": PERSON}, SO(json=PERSON)), ({"guided_regex": "[0-9]+"}, SO(regex="[0-9]+")),
        ({"guided_choice": ["a", "b"]}, SO(choice=("a", "b"))), ({"guided_grammar": 'start: "x"'}, SO(grammar='start: "x"')),
        ({"structured_outputs": {"choice": ["a"]}}, SO(choice=("a",))), ({"response_format": {"type": "text"}}, None)]:
        got = sampling_params(ChatCompletionRequest.model_validate({"messages": msgs, **body}), 8)
        assert got.structured_outputs == want, body
    assert sampling_params(CompletionRequest.model_validate({"prompt": "x", "guided_regex": "a"}), 4).structured_outputs == SO(regex="a")
    with pytest.raises(StructuredOutputError, match="one structured-output"):
        sampling_params(ChatCompletionRequest.model_validate(
            {"messages": msgs, "guided_regex": "a", "response_format": {"type": "json_object"}}), 8)


# ---------------------------------------------------------------------------- the tree walk
def _ids(tok, *texts):
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


def test_prune_drops_forbidden_drafts_and_masks_follow_each_path(compiler, target):
    tok, v = target.tokenizer, target.config.vocab_size
    c = compiler.constraint(SO(choice=["cat", "dog"]))
    (cat,), (dog,), (x,) = _ids(tok, "cat", "dog", "xyz")[0][:1], _ids(tok, "dog")[0][:1], _ids(tok, "xyz")[0][:1]
    eos = tok.eos_token_id
    # root children: x (forbidden), cat, dog; cat's children: eos (allowed: "cat" is complete), x
    tree = DraftTree(torch.tensor([x, cat, dog, eos, x]), torch.tensor([-1, -1, -1, 1, 1]))
    pruned = c.prune(tree)
    assert pruned.tokens.tolist() == [cat, eos, dog] and pruned.parents.tolist() == [-1, 0, -1]
    masks = c.masks(pruned)
    assert masks.shape == (4, v)
    assert masks[0, cat] and masks[0, dog] and not masks[0, x] and not masks[0, eos]
    assert masks[1].nonzero().flatten().tolist() == [eos]      # after "cat" only the end token
    assert masks[3].nonzero().flatten().tolist() == [eos]      # after "dog" too
    # the walk leaves the matcher where it was: the same masks again, then commit moves it
    torch.testing.assert_close(compiler.constraint(SO(choice=["cat", "dog"])).masks(None)[0], masks[0])
    c.commit([dog])
    assert c.masks(None)[0].nonzero().flatten().tolist() == [eos]
    with pytest.raises(RuntimeError, match="refused"):
        c.commit([cat])


def test_prune_with_draft_distributions_cuts_later_siblings_and_restricts_q(compiler, target):
    tok, v = target.tokenizer, target.config.vocab_size
    c = compiler.constraint(SO(choice=["cat", "dog"]))
    cat, dog, x = (i[0] for i in _ids(tok, "cat", "dog", "xyz"))
    q = torch.zeros(3, v)
    q[:, [cat, dog, x]] = torch.tensor([0.2, 0.3, 0.5])
    kept = c.prune(DraftTree(torch.tensor([cat, x, dog]), torch.tensor([-1, -1, -1]), q))
    assert kept.tokens.tolist() == [cat]                    # dog was drawn after the forbidden x: cut
    torch.testing.assert_close(kept.q[0, [cat, dog, x]], torch.tensor([0.4, 0.6, 0.0]))
    assert float(kept.q.sum()) == pytest.approx(1.0)
    nothing = c.prune(DraftTree(torch.tensor([x, cat]), torch.tensor([-1, -1]), q[:2]))
    assert len(nothing) == 0 and c.prune(DraftTree.empty()) is not None


def test_pipeline_masks_rows_and_the_grammar_wins_over_min_tokens(compiler, target):
    tok, v = target.tokenizer, target.config.vocab_size
    eos = tok.eos_token_id
    c = compiler.constraint(SO(choice=["dog"]))
    dog = _ids(tok, "dog")[0][0]
    p = SamplingParams(temperature=0.0, min_tokens=4, max_tokens=8)
    pipe = LogitsPipeline.build(p, (eos,), c)
    tree = pipe.restrict(DraftTree(torch.tensor([dog, eos]), torch.tensor([-1, 0])))
    logits = torch.randn(len(tree) + 1, v)
    out = pipe.process(logits, [1, 2], [], tree)
    assert torch.isfinite(out[0]).sum() >= 1 and torch.isfinite(out[0, dog])
    # after "dog" only eos is allowed, and min_tokens would forbid it: the grammar wins
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [eos]


# ---------------------------------------------------------------------------- real model, greedy
SPECS = [SO(json=PERSON), SO(json=ORDER), SO(json_object=True), SO(regex=r"[0-9]{3}-[0-9]{4}"),
         SO(choice=["positive", "negative", "neutral"]), SO(grammar='start: "Answer: " ("yes" | "no")')]


def _valid(spec: SO, text: str) -> bool:
    import re
    if spec.kind in ("json", "json_object"):
        doc = json.loads(text)
        jsonschema.validate(doc, spec.json if spec.kind == "json" else {"type": "object"})
        return True
    if spec.kind == "regex":
        return re.fullmatch(spec.regex, text) is not None
    if spec.kind == "choice":
        return text in spec.choice
    return text in ("Answer: yes", "Answer: no")


@pytest.fixture(scope="module")
def greedy_refs(llm):
    outs = {}
    for i, spec in enumerate(SPECS):
        sp = SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=spec)
        outs[i] = llm.chat(CHAT, sp)
    return outs


def test_every_greedy_output_validates(greedy_refs):
    for i, outs in greedy_refs.items():
        for o in outs:
            assert o.finish_reason == "stop", (SPECS[i].kind, o.text)
            assert _valid(SPECS[i], o.text), (SPECS[i].kind, o.text)


@pytest.mark.parametrize("method", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
    {"method": "eagle3"},                       # the shipped head
    {"method": "draft_model", "model": "self", "self_draft_layers": 12, "num_speculative_tokens": 3},
])
def test_greedy_speculation_equals_greedy_decoding_under_the_grammar(target, greedy_refs, method):
    spec_llm = LLM(loaded=target, speculative_config=method)
    drafted = 0
    for i, spec in enumerate(SPECS[:4]):
        sp = SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=spec)
        for got, want in zip(spec_llm.chat(CHAT, sp), greedy_refs[i]):
            assert got.token_ids == want.token_ids, (method["method"], spec.kind, got.text, want.text)
            drafted += got.metrics.num_draft_tokens
    assert drafted > 0


def test_sampled_outputs_validate_and_repeat_with_their_seed(target):
    spec_llm = LLM(loaded=target, speculative_config={"method": "draft_model", "model": "self", "self_draft_layers": 12,
                                                     "num_speculative_tokens": 3})
    sp = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=96, seed=11, structured_outputs=SO(json=PERSON))
    a, b = spec_llm.chat(CHAT[:2], sp), spec_llm.chat(CHAT[:2], sp)
    assert any(x.metrics.num_accepted_tokens for x in a)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert x.finish_reason == "stop" and _valid(SO(json=PERSON), x.text), x.text


# ---------------------------------------------------------------------------- lossless, statistically
class _RandomTreeDrafter(StatelessDrafter):
    """Sampled trees over a small token set, some of it forbidden by the grammar: three siblings
    drawn i.i.d. from ``q``, each with one child from ``q`` (q None: the same tokens, deterministic)."""

    def __init__(self, tokens: list[int], probs: list[float], vocab: int, with_q: bool):
        self.q = torch.zeros(vocab)
        self.q[torch.tensor(tokens)] = torch.tensor(probs) / sum(probs)
        self.with_q = with_q
        self.max_tree_nodes = 6

    def propose(self, requests):
        out = []
        for r in requests:
            toks = torch.multinomial(self.q, 6, replacement=True, generator=r.generator)
            q = self.q.expand(6, -1).clone() if self.with_q else None
            out.append(DraftTree(toks, torch.tensor([-1, -1, -1, 0, 1, 2]), q))
        return out


def _exact(model, compiler, spec, prompt) -> dict:
    """Every output the constrained target can give (ending with the end token) and its probability."""
    c, eos, out = compiler.constraint(spec), compiler.eos_ids[0], {}

    def walk(path, pr):
        ids = prompt + path
        with torch.no_grad():
            logits = model(torch.tensor([ids]), torch.arange(len(ids))[None]).logits[0, -1]
        probs = torch.softmax(logits.masked_fill(~c.masks(None)[0], float("-inf")), -1)
        for t in probs.nonzero().flatten().tolist():
            if t == eos:
                out[tuple(path)] = pr * float(probs[t])
                continue
            c.matcher.consume_token(t)
            walk(path + [t], pr * float(probs[t]))
            c.matcher.rollback(1)
    walk([], 1.0)
    return out


def _constrained_pvalue(compiler, target, with_q: bool, acceptance=None, n: int = 2000) -> float:
    """p-value of the outputs of sampled speculation on a tiny model under ``[ab]{1,3}`` against
    the exact constrained target."""
    from helpers import tiny_llama
    from verispec.core.acceptance import LOSSLESS
    tok, v = target.tokenizer, target.config.vocab_size
    model = tiny_llama(v, 32, 2, seed=5)       # 30 outputs above 5 expected counts in 2000, none above 0.2
    spec = SO(regex="[ab]{1,3}")
    prompt = _ids(tok, "Say a or b:")[0]
    exact = _exact(model, compiler, spec, prompt)
    assert abs(sum(exact.values()) - 1.0) < 1e-4 and len(exact) > 10
    pool = [i[0] for i in _ids(tok, "a", "b", "ab", "ba", "aa", "c", "x")] + [compiler.eos_ids[0]]
    drafter = _RandomTreeDrafter(pool, [2, 2, 1, 1, 6, 1, 1, 1], v, with_q)   # "aa" favoured
    engine = Engine(model, drafter, max_batch=64, max_len=32, eos_token_ids=compiler.eos_ids,
                    acceptance=acceptance or LOSSLESS)
    seqs = [Sequence(prompt_ids=prompt, params=SamplingParams(temperature=1.0, max_tokens=8, seed=i),
                     constraint=compiler.constraint(spec)) for i in range(n)]
    with torch.no_grad():
        engine.run(seqs)
    assert engine.stats.num_accepted_tokens > 0.2 * engine.stats.num_drafts      # speculation is exercised
    counts: dict = {}
    for s in seqs:
        assert s.finish_reason == "stop"
        counts[tuple(s.output_ids)] = counts.get(tuple(s.output_ids), 0) + 1
    assert set(counts) <= set(exact), "an output the constrained target cannot give"
    keys = sorted(exact, key=lambda k: -exact[k])
    big = [k for k in keys if exact[k] * n >= 5]
    assert len(big) >= 5
    obs = [counts.get(k, 0) for k in big] + [sum(counts.get(k, 0) for k in keys if k not in big)]
    exp = [exact[k] * n for k in big] + [n - sum(exact[k] * n for k in big)]
    return float(chisquare(obs, exp).pvalue)


@pytest.mark.parametrize("with_q", [True, False])
def test_sampled_speculation_follows_the_constrained_target(compiler, target, with_q, single_thread):
    """Sampled drafts with q (pruned: later siblings cut, q restricted) and deterministic ones."""
    assert _constrained_pvalue(compiler, target, with_q) > 1e-3


def test_the_constrained_test_detects_a_biased_engine(compiler, target, single_thread):
    """Power check: the same test rejects a broken verifier (accepts every first child)."""
    from helpers import BrokenAcceptance
    assert _constrained_pvalue(compiler, target, True, BrokenAcceptance()) < 1e-6


# ---------------------------------------------------------------------------- HTTP, the openai client
def test_openai_client_response_format_json_schema_streamed_and_not(dense_llm):
    llm = dense_llm                                       # the server process loads dense weights
    from test_serve import ServerProcess
    srv = ServerProcess("--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4}),
                        "--max-num-seqs", "4", "--max-model-len", "1024")
    try:
        srv.wait_ready()
        client = srv.client()
        rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
        want = llm.chat(CHAT[0], SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=SO(json=PERSON)))[0]
        whole = client.chat.completions.create(model="smollm2-135m", messages=CHAT[0], temperature=0,
                                               max_tokens=96, response_format=rf)
        assert whole.choices[0].message.content == want.text
        jsonschema.validate(json.loads(whole.choices[0].message.content), PERSON)
        chunks = client.chat.completions.create(model="smollm2-135m", messages=CHAT[0], temperature=0,
                                                max_tokens=96, response_format=rf, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == want.text
        obj = client.chat.completions.create(model="smollm2-135m", messages=CHAT[2], temperature=0.7, seed=3,
                                             max_tokens=160, response_format={"type": "json_object"})
        if obj.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(obj.choices[0].message.content), dict)
        extra = client.chat.completions.create(model="smollm2-135m", messages=CHAT[0], temperature=0, max_tokens=8,
                                               extra_body={"guided_choice": ["yes", "no"]})
        assert extra.choices[0].message.content in ("yes", "no")
        comp = client.completions.create(model="smollm2-135m", prompt="Phone: ", max_tokens=12, temperature=0,
                                         extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"})
        assert len(comp.choices[0].text) == 8 and comp.choices[0].text[3] == "-"
        import openai
        with pytest.raises(openai.BadRequestError, match="regex"):
            client.completions.create(model="smollm2-135m", prompt="x", max_tokens=4,
                                      extra_body={"guided_regex": "(unclosed"})
        with pytest.raises(openai.BadRequestError, match="one structured-output"):
            client.chat.completions.create(model="smollm2-135m", messages=CHAT[0], max_tokens=4,
                                           response_format={"type": "json_object"}, extra_body={"guided_regex": "a"})
    finally:
        srv.stop()
