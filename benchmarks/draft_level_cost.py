"""What one draft step of each shipped head costs, by the path it drafts through (issue 37 item 1).

The shipped SmolLM2-135M heads beside the int4 target (the fast path, ``weights="auto"``), packed
int4 as they run there, 2 threads, batch 1, 256-token context. EAGLE heads draft a chain of k
nodes (k = 1..4) through each path:

- ``tree``: the general tree path (``EagleDrafter._grow``: ranked candidates on the host, Python
  builders, host-packed masks), what every EAGLE draft ran before;
- ``chain``: the static-shape chain program (``drafting.eagle_chain``), eager;
- ``chain+compile``: the same program compiled, what runs beside a compiled target.

Each step is timed as the shape chooser times it (accept one token, then propose): ``cold`` after
a target forward (the target's weights have just streamed through the caches, as in an engine
step), ``warm`` back to back. Fixed = the one-node chain; level = the mean extra cost of each
further node. Medusa drafts every depth in one forward (its ``draft_cost``). Each figure is the
fastest of ``--reps`` steps, the median of ``--rounds`` rounds; paths are timed in turns.

    python benchmarks/draft_level_cost.py [--rounds 3] [--reps 15]

Writes benchmarks/results/draft_level_cost.{json,md}.
"""
from __future__ import annotations

import argparse
import statistics

from verispec.bench import harness

PATHS = ("tree", "chain", "chain+compile")
EAGLE_HEADS = ("eagle3", "eagle")
DEPTHS = (1, 2, 3, 4)


def load_head(target, name: str, model: str = "smollm2-135m"):
    """``model``'s shipped head for method ``name`` (eagle3, eagle, medusa) with its draft
    vocabulary cut, packed int4 as it runs beside the int4 target."""
    from verispec.drafting.draft_vocab import head_vocab
    from verispec.drafting.eagle_head import HeadKind
    from verispec.drafting.shipped import shipped_head
    from verispec.formats import load_eagle_head, load_medusa_heads
    folder = shipped_head(model, name)
    if folder is None:
        raise SystemExit(f"no {name} head is shipped for {model}")
    path = str(folder)
    if name == "medusa":
        head = load_medusa_heads(path, target.model)
    else:
        head = load_eagle_head(path, target.model, HeadKind.EAGLE3 if name == "eagle3" else HeadKind.EAGLE1)
    vocab = head_vocab(None, path, head.cfg.vocab_size)
    if vocab is not None:
        head.restrict_vocab_(vocab.draft_ids)
    head.pack_("int4", target.model.lm_head)
    return head


def chain_step_ms(head, path: str, depth: int, reps: int, between) -> float:
    """Fastest ms of one chain step of ``depth`` nodes through ``path`` (see the docstring)."""
    import torch
    from verispec.drafting.eagle import _time_steps
    with torch.no_grad():
        return _time_steps(head, tuple((0,) * d for d in range(1, depth + 1)), 256, reps, between,
                           compile=path == "chain+compile", tree_path=path == "tree")


def measure(target, reps: int, between) -> dict:
    """{"head/path/cold|warm": {"fixed": ms, "level": ms, "chain": {k: ms}}} for one round."""
    from verispec.drafting.medusa import draft_cost
    out = {}
    for name in EAGLE_HEADS:
        head = load_head(target, name)
        for path in PATHS:
            for temp, btw in (("cold", between), ("warm", None)):
                chain = {k: chain_step_ms(head, path, k, reps, btw) for k in DEPTHS}
                level = statistics.mean(chain[k + 1] - chain[k] for k in DEPTHS[:-1])
                out[f"{name}/{path}/{temp}"] = {"fixed": chain[1], "level": level, "chain": chain}
    medusa = load_head(target, "medusa")
    for temp, btw in (("cold", between), ("warm", None)):
        out[f"medusa/all depths/{temp}"] = {"fixed": draft_cost(medusa, reps=reps, between=btw), "level": None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    a = OUT.parse(ap)
    if a is None:
        return
    import torch

    from verispec.drafting.draft_shape import target_step
    from verispec.models.compiled import CompiledForward
    from verispec.models.loading import load_model
    torch.set_num_threads(2)
    machine = harness.machine_record()
    target = load_model("smollm2-135m", weights="int4")
    between = target_step(target.model, CompiledForward.shared(target.model))
    runs = [measure(target, a.reps, between) for _ in range(a.rounds)]
    med = {k: {m: (statistics.median(r[k][m] for r in runs) if runs[0][k][m] is not None else None)
               for m in ("fixed", "level")} for k in runs[0]}
    res = {"machine": machine, "rounds": a.rounds, "reps": a.reps, "runs": runs, "median": med}
    print(OUT.write(res, a.out).read_text())


def render(res: dict) -> str:
    med, rounds, reps = res["median"], res["rounds"], res["reps"]
    lines = ["SmolLM2-135M with int4 weights (compiled target forward between "
             f"steps), the shipped heads packed int4, 2 threads, batch 1, 256-token context; fastest of {reps} "
             f"steps, median of {rounds} rounds. Fixed: a one-node chain (EAGLE: the catch-up, which ranks "
             "depth 1; Medusa: every depth at once). Level: each further chain node. Cold: after a target "
             "forward, as in an engine; warm: back to back. All in ms.", "",
             "| head | path | fixed, cold | level, cold | fixed, warm | level, warm |", "|---|---|---|---|---|---|"]
    heads = dict.fromkeys(k.rsplit("/", 1)[0] for k in med)
    fmt = lambda v: "-" if v is None else f"{v:.2f}"      # noqa: E731
    for hp in heads:
        name, path = hp.split("/", 1)
        c, w = med[f"{hp}/cold"], med[f"{hp}/warm"]
        lines.append(f"| {name} | {path} | {fmt(c['fixed'])} | {fmt(c['level'])} | {fmt(w['fixed'])} | "
                     f"{fmt(w['level'])} |")
    lines += ["", "Goal (issue 37): EAGLE-3 fixed <= 0.5 ms, each level <= 0.3 ms; Medusa <= 0.3 ms. Cold costs "
              "include fetching the head's weights again after the target's have streamed through the caches "
              "(about 5 MB int4 for EAGLE-3, half of it the 8,192-row LM head): the part no op count removes."]
    return "\n".join(lines)


OUT = harness.Output("draft_level_cost", "Draft step cost by drafting path", render)


if __name__ == "__main__":
    main()
