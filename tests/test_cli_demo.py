"""``verispec generate --compare-vanilla`` (what ``make demo`` runs): the speculative run is shown
beside the same prompt decoded without speculation, with the speed-up and the identity check."""
from __future__ import annotations

import re


def test_generate_compare_vanilla_prints_speedup_and_identity(capsys):
    from verispec.cli import main
    argv = ["generate", "--prompt", "Say: one two three one two three one two three", "--max-tokens", "12",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--compare-vanilla"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    spec = re.search(r"\[12 tokens in [\d.]+s: ([\d.]+) tokens/s", err)
    van = re.search(r"\[vanilla \(no speculation, same weights\): ([\d.]+) tokens/s \(mean of a run before and one "
                    r"after\); speed-up ([\d.]+)x; "
                    r"outputs identical: (yes|no)\]", err)
    assert spec and van, err
    assert van.group(3) == "yes"
    assert abs(float(van.group(2)) - float(spec.group(1)) / float(van.group(1))) < 0.02
    model = re.search(r"\[the draft-budget estimator expected ([\d.]+)x over plain decoding steps", err)
    assert model and float(model.group(1)) > 0, err     # ngram drafts under the estimator by default
