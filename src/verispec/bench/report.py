"""Turn ``BenchResult`` suites into summaries, ``results.json``, ``report.md`` and PNG plots.

* ``summarize(result)``: one ``Summary`` per method x category x batch size, plus "overall" per
  method x batch size. Tokens/s is total output tokens over total wall time of the generate calls
  (as Spec-Bench does); speedups divide by vanilla's (and plain HF's) tokens/s on the same
  questions, batch size and run.
* ``write_report(out_dir, results)``: renders every file in memory first, then writes each one
  atomically (``harness.atomic_write``: a temporary file beside it, then a rename): an interrupted run or a
  failing render leaves the previous files (or none), never a half-written one.

Plots (matplotlib, Agg canvas, no display needed): ``speedup_per_category.png``,
``acceptance_per_position.png``, ``speedup_vs_batch.png``, ``tokens_per_s_vs_batch.png``.
"""
from __future__ import annotations

import io
import json
import math
import os  # noqa: F401  (tests patch report.os.replace: the rename harness.atomic_write makes)
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..core.metrics import SpecStats
from .harness import atomic_write
from .records import BenchResult, RunRecord

OVERALL = "overall"
PLOTS = ("speedup_per_category.png", "acceptance_per_position.png", "speedup_vs_batch.png",
         "tokens_per_s_vs_batch.png")
_STATS_KEYS = ("num_steps", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens",
               "accepted_per_pos", "draft_time_s", "verify_time_s", "overhead_time_s", "modelled_tokens",
               "modelled_cost")


@dataclass
class Summary:
    """Aggregated numbers of one method on one category (or "overall") at one batch size.
    Time fractions are of the wall time of the generate calls (None when not exposed);
    ``identical``/``ties``/``mismatches`` count greedy conversations compared with vanilla."""
    method: str
    category: str
    batch_size: int
    num_calls: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    mean_acceptance_length: float
    tokens_per_step: float | None
    acceptance_rate_per_pos: list[float] = field(default_factory=list)
    speedup_vs_vanilla: float | None = None
    speedup_vs_hf: float | None = None
    speedup_vs_llamacpp: float | None = None
    draft_frac: float | None = None
    verify_frac: float | None = None
    other_frac: float | None = None
    peak_rss_mib: float | None = None
    rss_increase_mib: float | None = None
    drafted_share: float | None = None     # steps that verified a draft, of all steps
    decode_tokens_per_s: float | None = None   # tokens over the decoding steps' time (prefill left out)
    decode_speedup: float | None = None        # that rate over vanilla's: the measured decode speed-up
    modelled_speedup: float | None = None      # the draft-budget estimator's expected decode speed-up
    modelled_tokens_per_step: float | None = None   # and the tokens per step it expected
    compared: int = 0
    identical: int = 0
    ties: int = 0
    mismatches: int = 0

    @property
    def identical_share(self) -> float | None:
        """Share of compared conversations identical to vanilla, numerical ties counted as equal."""
        return (self.identical + self.ties) / self.compared if self.compared else None


# ---------------------------------------------------------------------------- summaries
def _merged_stats(records: list[RunRecord]) -> SpecStats:
    total = SpecStats()
    for r in records:
        total.merge(SpecStats(**{k: (list(v) if isinstance(v, list) else v)
                                 for k, v in r.stats.items() if k in _STATS_KEYS}))
    return total


def _aggregate(method: str, category: str, batch: int, records: list[RunRecord]) -> Summary:
    tokens = sum(r.num_tokens for r in records)
    wall = sum(r.wall_s for r in records)
    st = _merged_stats(records)
    s = Summary(method, category, batch, len(records), tokens, wall, tokens / wall if wall > 0 else 0.0,
                st.mean_acceptance_length,
                st.num_emitted_tokens / st.num_steps if st.num_steps else None, st.acceptance_rate_per_pos)
    s.drafted_share = st.num_drafts / st.num_steps if st.num_steps else None
    step_s = st.draft_time_s + st.verify_time_s + st.overhead_time_s
    s.decode_tokens_per_s = st.num_emitted_tokens / step_s if step_s > 0 else None
    s.modelled_speedup = st.modelled_speedup
    if st.modelled_cost > 0 and st.num_steps:
        s.modelled_tokens_per_step = st.modelled_tokens / st.num_steps
    if wall > 0 and all(r.draft_s is not None and r.verify_s is not None for r in records):
        draft, verify = sum(r.draft_s for r in records), sum(r.verify_s for r in records)
        s.draft_frac, s.verify_frac = draft / wall, verify / wall
        s.other_frac = max(0.0, 1.0 - s.draft_frac - s.verify_frac)
    peaks = [r.peak_rss_mib for r in records if r.peak_rss_mib is not None]
    rises = [r.rss_increase_mib for r in records if r.rss_increase_mib is not None]
    s.peak_rss_mib = max(peaks) if peaks else None
    s.rss_increase_mib = max(rises) if rises else None
    return s


def summarize(result: BenchResult) -> list[Summary]:
    """Per method x category x batch size and per method x batch size ("overall")."""
    groups: dict[tuple[str, str, int], list[RunRecord]] = {}
    for r in result.records:
        groups.setdefault((r.method, r.category, r.batch_size), []).append(r)
        groups.setdefault((r.method, OVERALL, r.batch_size), []).append(r)
    out = {key: _aggregate(*key, recs) for key, recs in groups.items()}
    for f in result.fidelity:
        for key in ((f.method, f.category, f.batch_size), (f.method, OVERALL, f.batch_size)):
            if key in out:
                s = out[key]
                s.compared += 1
                s.identical += f.status == "identical"
                s.ties += f.status == "tie"
                s.mismatches += f.status == "mismatch"
    for (method, cat, b), s in out.items():
        for base, attr in (("vanilla", "speedup_vs_vanilla"), ("hf", "speedup_vs_hf"),
                           ("llamacpp", "speedup_vs_llamacpp")):
            ref = out.get((base, cat, b))
            if ref is not None and ref.tokens_per_s > 0:
                setattr(s, attr, s.tokens_per_s / ref.tokens_per_s)
        ref = out.get(("vanilla", cat, b))
        if ref is not None and ref.decode_tokens_per_s and s.decode_tokens_per_s:
            s.decode_speedup = s.decode_tokens_per_s / ref.decode_tokens_per_s
    order = {m.name: i for i, m in enumerate(result.methods)}
    cats = _categories(result)
    return sorted(out.values(), key=lambda s: (s.batch_size, order.get(s.method, 99),
                                               cats.index(s.category) if s.category in cats else len(cats)))


def _categories(result: BenchResult) -> list[str]:
    return list(dict.fromkeys(r.category for r in result.records))


def _index(summaries: list[Summary]) -> dict[tuple[str, str, int], Summary]:
    return {(s.method, s.category, s.batch_size): s for s in summaries}


def stops_paying(result: BenchResult, summaries: list[Summary]) -> dict[str, str]:
    """Per speculative method: the batch size at which its overall speedup over vanilla drops
    below 1, with every measured point."""
    idx, batches = _index(summaries), sorted({s.batch_size for s in summaries})
    out = {}
    for m in result.available():
        if m.name in ("vanilla", "hf"):
            continue
        pts = [(b, idx[(m.name, OVERALL, b)].speedup_vs_vanilla) for b in batches
               if (m.name, OVERALL, b) in idx and idx[(m.name, OVERALL, b)].speedup_vs_vanilla is not None]
        if not pts:
            continue
        points = ", ".join(f"batch {b}: {x:.2f}x" for b, x in pts)
        below = [b for b, x in pts if x < 1.0]
        if not below:
            out[m.name] = f"pays at every measured batch size ({points})"
        elif below[0] == pts[0][0]:
            out[m.name] = f"does not pay at any measured batch size, already below 1x at batch {below[0]} ({points})"
        else:
            out[m.name] = f"stops paying at batch {below[0]} ({points})"
    return out


# ---------------------------------------------------------------------------- formatting
def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}x"


def _f(v: float | None, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.0f}%"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def category_table(result: BenchResult, summaries: list[Summary], batch: int, value) -> list[str]:
    """Rows methods, columns categories then Overall (EAGLE-2 / Spec-Bench leaderboard layout)."""
    idx, cats = _index(summaries), _categories(result)
    rows = []
    for m in result.available():
        if any((m.name, c, batch) in idx for c in cats):
            rows.append([m.name] + [value(idx.get((m.name, c, batch))) for c in cats + [OVERALL]])
    return _table(["Method"] + cats + ["**Overall**"], rows)


def headline(result: BenchResult, summaries: list[Summary]) -> str:
    """The speedup-over-vanilla table at the smallest batch size (printed by the CLI)."""
    b = min(result.config["batch_sizes"])
    return "\n".join(category_table(result, summaries, b, lambda s: _x(s and s.speedup_vs_vanilla)))


def _detail_table(result: BenchResult, summaries: list[Summary], batch: int) -> list[str]:
    idx, rows = _index(summaries), []
    llama = any(m.name == "llamacpp" for m in result.available())
    for m in result.available():
        s = idx.get((m.name, OVERALL, batch))
        if s is None:
            continue
        acc = ", ".join(f"{a:.2f}" for a in s.acceptance_rate_per_pos[:6]) or "–"
        split = "–" if s.draft_frac is None else \
            f"{_pct(s.draft_frac)} / {_pct(s.verify_frac)} / {_pct(s.other_frac)}"
        same = "–" if s.compared == 0 else \
            f"{_pct(s.identical_share)} ({s.identical}+{s.ties} ties of {s.compared}; {s.mismatches} mismatches)"
        rows.append([m.name, _f(s.tokens_per_s, 1), _x(s.speedup_vs_vanilla), _x(s.speedup_vs_hf)]
                    + ([_x(s.speedup_vs_llamacpp)] if llama else [])
                    + [_f(s.mean_acceptance_length), _f(s.tokens_per_step), _pct(s.drafted_share), acc, split,
                       _f(s.peak_rss_mib, 0), _f(s.rss_increase_mib, 0), same])
    return _table(["Method", "tok/s", "vs vanilla", "vs hf"] + (["vs llama.cpp"] if llama else [])
                  + ["τ (bonus incl.)", "tokens/step", "drafted steps", "acceptance per position", "draft / verify / other",
                     "peak RSS MiB", "RSS increase MiB", "identical to vanilla"], rows)


MODEL_NOTE = ("Modelled: what the draft-budget estimator expected of the steps it chose, each step's "
              "expected tokens and cost over a plain step's (`DraftGate.modelled`), summed per method. "
              "Measured: tokens per step, and tokens per second of decoding-step time (prefill left out) "
              "over vanilla's. Gap: modelled over measured speed-up, minus 1.")


def _model_gap(s: Summary | None) -> float | None:
    """Modelled over measured decode speed-up, minus 1 (None where either is missing)."""
    if s is None or not s.modelled_speedup or not s.decode_speedup:
        return None
    return s.modelled_speedup / s.decode_speedup - 1.0


def _model_table(result: BenchResult, summaries: list[Summary], batch: int) -> list[str]:
    """Per method with an estimator: modelled and measured tokens per step and decode speed-up,
    the gap between the two speed-ups, and the category where that gap is largest."""
    idx, rows = _index(summaries), []
    for m in result.available():
        s = idx.get((m.name, OVERALL, batch))
        if s is None or s.modelled_speedup is None:
            continue
        gaps = {c: g for c in _categories(result) if (g := _model_gap(idx.get((m.name, c, batch)))) is not None}
        worst = max(gaps, key=lambda c: abs(gaps[c]), default=None)
        gap = _model_gap(s)
        rows.append([m.name, _f(s.modelled_tokens_per_step), _f(s.tokens_per_step), _x(s.modelled_speedup),
                     _x(s.decode_speedup), "–" if gap is None else f"{gap:+.0%}",
                     "–" if worst is None else f"{worst} {gaps[worst]:+.0%}"])
    return _table(["Method", "tokens/step, modelled", "measured", "decode speed-up, modelled", "measured", "gap",
                   "largest gap of a category"], rows) if rows else []


def _batch_table(result: BenchResult, summaries: list[Summary]) -> list[str]:
    idx, batches = _index(summaries), sorted(result.config["batch_sizes"])
    rows = []
    for m in result.available():
        cells = []
        for b in batches:
            s = idx.get((m.name, OVERALL, b))
            cells.append("skipped" if s is None else f"{s.tokens_per_s:.1f} ({_x(s.speedup_vs_vanilla)})")
        rows.append([m.name] + cells)
    return _table(["Method"] + [f"batch {b}: tok/s (speedup)" for b in batches], rows)


def _settings(result: BenchResult) -> list[str]:
    c = result.config
    qids = list(dict.fromkeys(q for r in result.records if r.method == "vanilla" for q in r.question_ids))
    cats = _categories(result)
    weights = c.get("weights", "dense")
    weights = "" if weights == "dense" else f" with {weights}-packed matmul weights (HF peers: dense fp32)"
    lines = [f"- Model `{c['model']}`, dtype {result.machine['dtype']}{weights}, threads {result.machine['threads']}; "
             f"dataset `{Path(c['dataset']).name}`",
             f"- {len(qids)} questions ({c['per_category'] or 'all'} per category) in {len(cats)} categories: "
             f"{', '.join(cats)}; question ids {qids}",
             f"- max {c['max_tokens']} new tokens per turn, temperature {c['temperature']}, "
             f"{c['repeats']} repeat(s), batch sizes {list(c['batch_sizes'])}, warm-up "
             f"{c['warmup_tokens']} tokens per method, HF weights: {c['hf_weights']}",
             f"- Run wall time {result.wall_s:.0f} s (warm-up and fidelity checks included; loading "
             f"the models took {result.load_s:.0f} s more); "
             f"1-minute load average of the machine at start → end: {_load(result.machine)}"]
    if c.get("notes"):
        lines.append(f"- Note: {c['notes']}")
    return lines


def _load(machine: dict) -> str:
    return " → ".join(_f(x[0]) if x else "–" for x in (machine.get("loadavg_start"), machine.get("loadavg_end")))


def _methods_table(result: BenchResult) -> list[str]:
    rows = [[m.name, m.kind, f"`{json.dumps(m.config)}`" if m.config else "–",
             "ok" if m.unavailable is None else f"unavailable: {m.unavailable}"] for m in result.methods]
    return _table(["Method", "Kind", "Config", "Status"], rows)


def _shape_line(shape: dict) -> str:
    kind = "chain" if shape["topk"] == 1 else f"tree, topk {shape['topk']}"
    nodes = "node" if shape["num_nodes"] == 1 else "nodes"
    return (f"{kind}, {shape['num_nodes']} {nodes}, depth {shape['depth']}, choices `{shape['choices']}`; "
            f"modelled {shape['expected_tokens']:.2f} tokens per {shape['step_ms']:.1f} ms step against "
            f"{shape['vanilla_ms']:.1f} ms per decoding step ({shape['modelled_speedup']:.2f}x)")


def suite_markdown(result: BenchResult, summaries: list[Summary]) -> list[str]:
    """The report section of one suite: settings, category tables, details, batch sweep."""
    b = min(result.config["batch_sizes"])
    out = [f"## Suite `{result.name}`", ""] + _settings(result) + ["", "### Methods", ""]
    out += _methods_table(result)
    if result.draft_shapes:
        out += ["", "### Draft shapes chosen from measured costs", ""]
        out += [f"- `{name}`: {_shape_line(shape)}" for name, shape in sorted(result.draft_shapes.items())]
    out += ["", f"### Speedup over vanilla (batch {b})", ""]
    out += category_table(result, summaries, b, lambda s: _x(s and s.speedup_vs_vanilla))
    out += ["", f"### Mean acceptance length τ, bonus token included (batch {b})", ""]
    out += category_table(result, summaries, b, lambda s: _f(s and s.mean_acceptance_length))
    out += ["", f"### Tokens/s (batch {b})", ""]
    out += category_table(result, summaries, b, lambda s: _f(s and s.tokens_per_s, 1))
    for batch in sorted(result.config["batch_sizes"]):
        out += ["", f"### Overall per method (batch {batch})", ""] + _detail_table(result, summaries, batch)
    model = _model_table(result, summaries, b)
    if model:
        out += ["", f"### Modelled vs measured, decoding steps (batch {b})", "", MODEL_NOTE, ""] + model
    if len(result.config["batch_sizes"]) > 1:
        out += ["", "### Batch sweep (overall)", ""] + _batch_table(result, summaries)
        out += ["", "Where speculation stops paying:", ""]
        out += [f"- **{m}**: {text}" for m, text in stops_paying(result, summaries).items()]
    diffs = [f for f in result.fidelity if f.status != "identical"]
    if diffs:
        out += ["", "### Outputs that differ from vanilla", ""]
        out += _table(["Method", "batch", "question", "turn", "position", "top-2 margin", "status"],
                      [[f.method, str(f.batch_size), str(f.question_id), str(f.turn), str(f.position),
                        _f(f.margin, 6), f.status] for f in diffs])
    if result.skipped:
        out += ["", "Skipped: " + "; ".join(f"{s['method']} at batch {s['batch_size']} ({s['reason']})"
                                          for s in result.skipped)]
    return out + [""]


def _machine_lines(machine: dict) -> list[str]:
    """The machine table; the vector ISA and the command when the record has them (the harness's
    ``machine_record``; results.json files from before it lack both)."""
    cpu = machine["cpu_model"] + (f" ({machine['isa']})" if machine.get("isa") else "")
    out = _table(["CPU", "cores (usable)", "memory", "torch", "transformers", "dtype", "threads",
                  "OMP_WAIT_POLICY"],
                 [[cpu, f"{machine['logical_cores']} ({machine['usable_cores']})",
                   f"{machine['memory_gib']} GiB", machine["torch"], machine["transformers"], machine["dtype"],
                   str(machine["threads"]), machine.get("omp_wait_policy") or "unset"]])
    return out + (["", f"Command: `{machine['command']}`"] if machine.get("command") else [])


DEFINITIONS = """## Definitions

- **tok/s**: output tokens (end-of-sequence excluded) over wall time of the generate calls, summed
  over the questions; conversation turns of multi-turn questions each count. Loading is untimed.
- **Speedup**: tok/s of the method over tok/s of `vanilla` (verispec without drafter) on the same
  questions, batch size and run, all methods interleaved per batch; **vs hf**: over plain HF `generate`.
- **τ**: mean acceptance length, tokens emitted per verification step that verified a draft,
  bonus/recovered token included (1.00 = never anything accepted). **tokens/step**: tokens per
  target verification forward, drafted or not. **drafted steps**: share of steps that verified a
  draft (below 100% when a drafter found nothing to propose, or adaptive drafting kept a request
  plain). **acceptance per position**: share of drafted steps whose accepted path reached draft
  depth 1, 2, ...
- **draft / verify / other**: shares of wall time in drafting, in the target's verification
  forward, and the rest (prefill, acceptance, cache compaction, bookkeeping). Not exposed by HF.
- **Peak RSS**: {memory}. It includes every model loaded in the process (shared by all methods);
  **RSS increase** is the peak minus the RSS just before the call (the method's working memory).
- **Identical to vanilla** (greedy only): conversations whose tokens equal vanilla's; where they
  differ, a plain forward of the target at the first difference gives the top-2 logit margin, below
  {tie} counted as a numerical tie, otherwise as a mismatch (a bug).
"""


def _summary_lines(results: list[BenchResult], summaries: list[list[Summary]]) -> list[str]:
    """The headline: overall speedup and τ per method at each suite's smallest batch size."""
    out = ["## Summary", ""]
    for res, summ in zip(results, summaries):
        b = min(res.config["batch_sizes"])
        idx = _index(summ)
        cells = [f"{m.name} {_x(idx[(m.name, OVERALL, b)].speedup_vs_vanilla)} (τ "
                 f"{idx[(m.name, OVERALL, b)].mean_acceptance_length:.2f})"
                 for m in res.available() if m.name != "vanilla" and (m.name, OVERALL, b) in idx]
        out.append(f"- `{res.name}`, batch {b}, overall speedup over vanilla: " + ", ".join(cells))
        wins = {m.name: [f"{s.category} {s.speedup_vs_vanilla:.2f}x" for s in summ
                         if s.method == m.name and s.batch_size == b and s.category != OVERALL
                         and (s.speedup_vs_vanilla or 0) >= 1.0]
                for m in res.available() if m.name not in ("vanilla", "hf")}
        for name, cats in wins.items():
            out.append(f"- `{res.name}`: **{name}** is at least as fast as vanilla on "
                       + (", ".join(cats) if cats else "no category"))
        if len(res.config["batch_sizes"]) > 1:
            out += [f"- `{res.name}`: **{m}** {text}" for m, text in stops_paying(res, summ).items()]
        off = [m.name for m in res.methods if m.unavailable]
        if off:
            out.append(f"- `{res.name}`: not run (see Methods): {', '.join(off)}")
    return out + [""]


def render_markdown(results: list[BenchResult], summaries: list[list[Summary]], analysis: str = "",
                    created: time.struct_time | None = None) -> str:
    """report.md; ``analysis``: hand-written Markdown placed under the generated summary;
    ``created``: when the run was written (default now; a rerender keeps the run's date)."""
    machine = results[0].machine
    title = f"# Spec-Bench-style benchmark: `{results[0].config['model']}`"
    out = [title, "", f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', created or time.gmtime())}.", ""]
    out += _summary_lines(results, summaries)
    if analysis.strip():
        out += ["## Analysis", "", analysis.strip(), ""]
    out += ["## Machine", ""] + _machine_lines(machine) + [""]
    for res, summ in zip(results, summaries):
        out += suite_markdown(res, summ)
    out += ["## Plots", ""] + [f"![{p[:-4]}]({p})" for p in PLOTS] + [""]
    out.append(DEFINITIONS.format(memory=machine["memory_source"], tie=results[0].config["tie_threshold"]))
    return "\n".join(out)


# ---------------------------------------------------------------------------- plots
def _figure(title: str):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(9, 4.8), dpi=110)
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=10)
    return fig, ax


def _png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _no_data(ax, text: str = "no data") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)


def plot_speedup_per_category(result: BenchResult, summaries: list[Summary]) -> bytes:
    b = min(result.config["batch_sizes"])
    idx, cats = _index(summaries), _categories(result) + [OVERALL]
    methods = [m.name for m in result.available() if m.name != "vanilla"]
    fig, ax = _figure(f"Speedup over vanilla per category ({result.name}, batch {b})")
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        ys = [getattr(idx.get((m, c, b)), "speedup_vs_vanilla", None) or 0.0 for c in cats]
        bars = ax.bar([j + (i - (len(methods) - 1) / 2) * width for j in range(len(cats))], ys, width, label=m)
        if len(methods) * len(cats) <= 80:
            ax.bar_label(bars, fmt="%.2f", fontsize=6, rotation=90, padding=2)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speedup (x)")
    if methods:
        ax.legend(fontsize=8)
    else:
        _no_data(ax, "only vanilla was run")
    return _png(fig)


def plot_acceptance(result: BenchResult, summaries: list[Summary]) -> bytes:
    b = min(result.config["batch_sizes"])
    idx = _index(summaries)
    fig, ax = _figure(f"Acceptance rate per draft position ({result.name}, batch {b}, overall)")
    drawn = 0
    for m in result.available():
        s = idx.get((m.name, OVERALL, b))
        if s is not None and s.acceptance_rate_per_pos:
            pos = list(range(1, len(s.acceptance_rate_per_pos) + 1))
            ax.plot(pos, s.acceptance_rate_per_pos, marker="o", label=f"{m.name} (τ={s.mean_acceptance_length:.2f})")
            drawn += 1
    longest = max((len(s.acceptance_rate_per_pos) for s in summaries if s.batch_size == b), default=0)
    if longest:
        ax.set_xticks(range(1, longest + 1))
    ax.set_xlabel("draft position (depth)")
    ax.set_ylabel("share of drafted steps accepted to this depth")
    ax.set_ylim(0, 1.05)
    if drawn:
        ax.legend(fontsize=8)
    else:
        _no_data(ax, "no method drafted tokens")
    return _png(fig)


def plot_vs_batch(result: BenchResult, summaries: list[Summary], speedup: bool) -> bytes:
    idx, batches = _index(summaries), sorted(result.config["batch_sizes"])
    what = "Speedup over vanilla" if speedup else "Tokens/s"
    fig, ax = _figure(f"{what} vs batch size ({result.name}, {result.config['max_tokens']} tokens)")
    for m in result.available():
        if speedup and m.name == "vanilla":
            continue
        pts = [(b, idx[(m.name, OVERALL, b)]) for b in batches if (m.name, OVERALL, b) in idx]
        ys = [(s.speedup_vs_vanilla if speedup else s.tokens_per_s) for _, s in pts]
        if pts and all(y is not None for y in ys):
            ax.plot([b for b, _ in pts], ys, marker="o", label=m.name)
    if speedup:
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup (x)" if speedup else "output tokens/s (all sequences)")
    if ax.lines:
        ax.legend(fontsize=8)
    return _png(fig)


def render_plots(results: list[BenchResult], summaries: list[list[Summary]]) -> dict[str, bytes]:
    """Per-category plots from the suite with the most categories, batch plots from the suite
    with the most batch sizes."""
    pairs = list(zip(results, summaries))
    cat = max(pairs, key=lambda p: len(_categories(p[0])))
    sweep = max(pairs, key=lambda p: len(p[0].config["batch_sizes"]))
    return {PLOTS[0]: plot_speedup_per_category(*cat), PLOTS[1]: plot_acceptance(*cat),
            PLOTS[2]: plot_vs_batch(*sweep, speedup=True), PLOTS[3]: plot_vs_batch(*sweep, speedup=False)}


# ---------------------------------------------------------------------------- files
def _clean(v):
    """JSON-safe copy: non-finite floats become None (results.json stays strict JSON)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def results_json(results: list[BenchResult], summaries: list[list[Summary]],
                 created: time.struct_time | None = None) -> bytes:
    doc = {"schema": "verispec.bench/1", "created_utc": time.strftime(CREATED, created or time.gmtime()),
           "suites": [dict(r.as_dict(), summary=[dict(asdict(s), identical_share=s.identical_share) for s in ss],
                           stops_paying=stops_paying(r, ss))
                      for r, ss in zip(results, summaries)]}
    return json.dumps(_clean(doc), indent=1, allow_nan=False).encode()


CREATED = "%Y-%m-%dT%H:%M:%SZ"          # results.json's created_utc


def created_utc(path: str | Path) -> time.struct_time | None:
    """When a saved results.json was written (its ``created_utc``), for a rerender to keep."""
    stamp = json.loads(Path(path).read_text()).get("created_utc")
    return time.strptime(stamp, CREATED) if stamp else None


def load_results(path: str | Path) -> list[BenchResult]:
    """The suites of a ``results.json`` as ``BenchResult`` objects (to re-render a report)."""
    from .records import FidelityRecord, MethodSpec
    doc = json.loads(Path(path).read_text())
    out = []
    for s in doc["suites"]:
        config = dict(s["config"], batch_sizes=tuple(s["config"]["batch_sizes"]))
        out.append(BenchResult(s["name"], config, s["machine"], [MethodSpec(**m) for m in s["methods"]],
                               [RunRecord(**r) for r in s["records"]],
                               [FidelityRecord(**f) for f in s["fidelity"]],
                               list(s["skipped"]), s["wall_s"], s["load_s"], dict(s.get("draft_shapes", {}))))
    return out


def write_report(out_dir: str | Path, results: list[BenchResult] | BenchResult, analysis: str = "",
                 created: time.struct_time | None = None) -> list[Path]:
    """Write results.json, report.md and the plots of ``results`` (suites) into ``out_dir``.
    ``analysis``: optional hand-written Markdown for report.md (see ``render_markdown``);
    ``created``: the run's time (default now; ``created_utc(results.json)`` for a rerender)."""
    results = [results] if isinstance(results, BenchResult) else list(results)
    if not results:
        raise ValueError("no benchmark results to write")
    summaries = [summarize(r) for r in results]
    files = {"results.json": results_json(results, summaries, created),
             "report.md": render_markdown(results, summaries, analysis, created).encode()}
    files.update(render_plots(results, summaries))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, data in files.items():
        atomic_write(out / name, data)
        written.append(out / name)
    return written
