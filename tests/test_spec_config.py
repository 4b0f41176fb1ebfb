"""Typed per-method speculative configs: a key the method does not use is a clear error listing
the method's keys; the README's table lists every key with the methods that take it; the public
drafter registry (used by the built-ins) takes a custom drafter, as the README shows."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from verispec import LLM, SamplingParams
from verispec.drafting import registered
from verispec.drafting.spec_config import METHOD_CONFIGS, SpecConfigError, SpeculativeConfig

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.parametrize("method,key", [("ngram", "tree"), ("draft_model", "topk"), ("draft_model", "depth"),
                                        ("eagle", "draft_dtype"), ("medusa", "draft_dtype"), ("ngram", "model"),
                                        ("eagle", "eagle_aux_hidden_state_layer_ids"), ("medusa", "rank_by")])
def test_keys_a_method_ignores_are_errors(method, key):
    """Keys vLLM users send to the wrong method were accepted and ignored before; now each fails,
    and the message lists the method's own keys."""
    with pytest.raises(SpecConfigError) as e:
        SpeculativeConfig.from_dict({"method": method, key: 1})
    msg = str(e.value)
    assert f"'{key}'" in msg and f"method '{method}' takes" in msg
    for own in METHOD_CONFIGS[method].keys():
        assert f"'{own}'" in msg


def test_each_method_gets_its_own_config():
    for name, cls in METHOD_CONFIGS.items():
        if name.startswith("test_"):
            continue
        cfg = SpeculativeConfig.from_dict({"method": name, "model": "x"} if "model" in cls.keys() else {"method": name})
        assert type(cfg) is cls and cfg.as_dict()["method"] == name
    assert set(registered()) >= {"ngram", "draft_model", "eagle", "eagle3", "medusa"}


def _readme_table() -> dict[str, set[str]]:
    text = README.read_text()
    section = text[text.index("### `speculative_config`"):]
    section = section[:section.index("\n\n", section.index("| key"))]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| ((?:`\w+`(?:, )?)+) \| ([^|]+) \|", line)
        if m:
            for key in re.findall(r"`(\w+)`", m.group(1)):
                rows[key] = {x.strip(" `") for x in m.group(2).split(",")}
    return rows


def test_readme_table_lists_every_key_of_every_method():
    table = _readme_table()
    builtin = {n: c for n, c in METHOD_CONFIGS.items() if not n.startswith("test_") and n != "oracle_doc"}
    want: dict[str, set[str]] = {}
    for name, cls in builtin.items():
        for key in cls.keys():
            want.setdefault(key, set()).add(name)
    assert set(table) == set(want), (set(want) - set(table), set(table) - set(want))
    for key, methods in want.items():
        listed = set(builtin) if table[key] == {"all"} else table[key]
        assert listed == methods, key


def test_readme_custom_drafter_runs(target):
    """The README's custom-drafter example, run as written: registered by name, used by LLM."""
    text = README.read_text()
    block = text[text.index("```python", text.index("### Custom drafters")) + len("```python"):]
    code = block[:block.index("```")]
    assert len(code.strip().splitlines()) <= 30
    env = {"__name__": "readme_example"}
    exec(compile(code, "README.md", "exec"), env)     # defines and registers the drafter, builds `llm`-free parts
    llm = LLM(loaded=target, speculative_config={"method": "repeat_last", "num_speculative_tokens": 3})
    plain = LLM(loaded=target)
    sp = SamplingParams(temperature=0, max_tokens=24)
    got, want = llm.generate("Say la la la la la", sp)[0], plain.generate("Say la la la la la", sp)[0]
    assert got.token_ids == want.token_ids and got.metrics.num_drafts > 0
    with pytest.raises(SpecConfigError, match="takes"):
        LLM(loaded=target, speculative_config={"method": "repeat_last", "topk": 2})
