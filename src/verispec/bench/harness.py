"""The one harness of the benchmark scripts in ``benchmarks/`` (and the machine record of
``verispec bench``): what a result says about its machine, the standard options and output files,
and the two timing loops.

    from verispec.bench import harness
    OUT = harness.Output("name", "Title of the result", render)   # render(results) -> Markdown body
    args = OUT.parse(ap)                   # adds --out (and --model), --rerender; None after a rerender
    if args is None:
        return
    results = {"machine": harness.machine_record(), ...}              # taken before measuring
    OUT.write(results, args.out)           # <out>.json (atomically), then <out>.md

A result's Markdown is the standard header (title; machine line, date and command from the
machine record) followed by ``render(results)``: ``--rerender`` rebuilds it from the saved JSON
without measuring. Timing: ``interleave`` runs methods in turn round by round in this process;
``run_trees`` runs one script's worker over several source trees (before/after) in subprocesses.
Standard library only at import time (torch is read if installed, when a record is taken).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "benchmarks" / "results"


def proc_status_mb(key: str, pid: int | str = "self") -> float | None:
    """A memory field of /proc/<pid>/status in MiB (``VmRSS``, ``VmHWM``, ...); None where it
    cannot be read (another OS, a process gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def free_port() -> int:
    """A TCP port free on loopback now (for a server the caller starts next)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------- machine record
def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def vector_isa(flags: str | None = None) -> str:
    """The widest vector ISA the CPU offers for our kernels, from the ``flags`` line of
    /proc/cpuinfo (or ``flags`` given): "AVX-512 with bf16/VNNI", "AVX-512", "AVX2" or "unknown"
    (no flags line: not Linux, or not x86)."""
    if flags is None:
        try:
            flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
        except OSError:
            flags = ""
    words = set(flags.split(":", 1)[-1].split())
    if "avx512_bf16" in words:
        return "AVX-512 with bf16/VNNI"
    if "avx512f" in words:
        return "AVX-512"
    return "AVX2" if "avx2" in words else "unknown"


def command_line(argv: list[str] | None = None) -> str:
    """The command that produced a result: ``python <script> <args>`` (the script's path relative
    to the repository root when inside it), ``python -m <module> <args>`` for a module of the
    package, ``<name> <args>`` for an installed command such as ``verispec``."""
    argv = list(sys.argv if argv is None else argv)
    if not argv or not argv[0]:
        return shlex.join(["python", *argv[1:]])
    path = Path(argv[0]).resolve()
    if path.is_relative_to(ROOT / "src") and path.suffix == ".py":
        module = ".".join(path.relative_to(ROOT / "src").with_suffix("").parts).removesuffix(".__main__")
        return shlex.join(["python", "-m", module, *argv[1:]])
    if path.suffix != ".py":
        return shlex.join([path.name, *argv[1:]])
    return shlex.join(["python", str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else argv[0], *argv[1:]])


def machine_record(argv: list[str] | None = None) -> dict:
    """Where and how a result was measured, taken when called (before measuring): ``cpu`` model,
    vector ``isa``, logical ``cores``, ``torch`` version and ``threads`` (None without torch),
    ``python``, 1-minute ``load_avg``, UTC ``date`` and the ``command`` (``argv``, default
    ``sys.argv``). Plain JSON values only."""
    try:
        import torch
        tv, threads = torch.__version__, torch.get_num_threads()
    except ImportError:
        tv = threads = None
    return {"cpu": cpu_model(), "isa": vector_isa(), "cores": os.cpu_count(), "torch": tv, "threads": threads,
            "python": platform.python_version(),
            "load_avg": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": command_line(argv)}


def machine_line(record: dict | str) -> str:
    """One line for a Markdown header: "CPU (ISA), N cores, torch V, T threads, load L at the
    start". Also reads the records of older results and of ``verispec bench`` (``cpu_model``,
    ``logical_cores``, other names of the load; a plain string is returned as it is)."""
    if isinstance(record, str):
        return record
    cpu = record.get("cpu") or record.get("cpu_model") or "unknown CPU"
    parts = [f"{cpu} ({record['isa']})" if record.get("isa") else cpu]
    cores = record.get("cores") or record.get("logical_cores")
    if cores:
        parts.append(f"{cores} cores")
    if record.get("torch"):
        parts.append(f"torch {record['torch']}")
    if record.get("threads"):
        parts.append(f"{record['threads']} thread{'s' if record['threads'] != 1 else ''}")
    load = next((record[k] for k in ("load_avg", "load_avg_at_start", "load_average_at_start", "loadavg_start")
                 if record.get(k) is not None), None)
    if isinstance(load, list):
        load = load[0]
    if load is not None:
        parts.append(f"load {load:.1f} at the start")
    return ", ".join(parts)


def header(title: str, results: dict, legacy_command: str | None = None) -> str:
    """The standard header of a result's Markdown: the title, then one line with the machine, the
    date and the command (each from ``results["machine"]``; ``date``/``command`` also from the
    top level of older results, the command else ``legacy_command``; a missing one is left out)."""
    rec = results.get("machine", {})
    rec_d = rec if isinstance(rec, dict) else {}
    line = results.get("machine_line") or machine_line(rec)     # older results saved their line apart
    if rec_d.get("torch") and "torch" not in line:
        line += f", torch {rec_d['torch']}"
    line = f"Machine: {line}."
    date = rec_d.get("date") or results.get("date") or results.get("measured_at") or results.get("when")
    if date:
        line += f" Measured {date}."
    command = rec_d.get("command") or results.get("command") or legacy_command
    if command:
        line += f" Command: `{command}`."
    return f"# {title}\n\n{line}\n"


# ---------------------------------------------------------------------------------- options, files
class Output:
    """A script's result files ``<out>.json`` and ``<out>.md``. ``title``: the Markdown title (or a
    function of the results giving it); ``render(results) -> str``: the Markdown body under the
    standard header; ``model``: the script takes ``--model`` (this default), and its default
    ``--out`` is ``results/<name>_<model>`` (``results/<name>`` if not ``per_model``);
    ``legacy_command(results)``: the command of results saved before the harness (their record
    has none), for the header; ``analysis``: a hand-written ``<out>.analysis.md``, if present, goes
    at the end of the Markdown under "## Analysis"."""

    def __init__(self, name: str, title: str | Callable[[dict], str], render: Callable[[dict], str],
                 model: str | None = None, per_model: bool = True,
                 legacy_command: Callable[[dict], str] | None = None, analysis: bool = False):
        self.name, self.title, self.render, self.model, self.per_model = name, title, render, model, per_model
        self.legacy_command, self.analysis = legacy_command, analysis

    def add_options(self, ap: argparse.ArgumentParser, argv: list[str] | None = None) -> None:
        """Add ``--out`` (default benchmarks/results/<name>[_<model>]), ``--rerender`` and, for a
        script with a model, ``--model``."""
        default = RESULTS / self.name
        if self.model is not None:
            ap.add_argument("--model", default=self.model)
            pre = argparse.ArgumentParser(add_help=False)
            pre.add_argument("--model", default=self.model)
            model = pre.parse_known_args(argv)[0].model
            if self.per_model:
                default = RESULTS / f"{self.name}_{model.replace('/', '_')}"
        ap.add_argument("--out", default=str(default), help=f"results path without extension (default {default})")
        ap.add_argument("--rerender", action="store_true",
                        help="rewrite the Markdown from the saved JSON (no measuring)")

    def parse(self, ap: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace | None:
        """Add the standard options to ``ap`` and parse ``argv`` (an ``--out`` naming a folder
        means ``<folder>/<name>``). With ``--rerender`` rewrite ``<out>.md`` from ``<out>.json``
        and return None; else return the parsed options."""
        self.add_options(ap, argv)
        args = ap.parse_args(argv)
        if Path(args.out).is_dir():
            args.out = str(Path(args.out) / self.name)
        if not args.rerender:
            return args
        print("wrote", self.rerender(args.out))
        return None

    def main(self, ap: argparse.ArgumentParser, measure: Callable[[argparse.Namespace], dict],
             argv: list[str] | None = None) -> None:
        """A script's whole ``main``: ``parse``, then (unless ``--rerender``) ``measure(args)``
        and ``write`` what it returns."""
        args = self.parse(ap, argv)
        if args is not None:
            print("wrote", self.write(measure(args), args.out))

    def markdown(self, results: dict, out: str | Path | None = None) -> str:
        """The result's Markdown: the standard header, the script's body, then (``analysis``) the
        hand-written ``<out>.analysis.md``."""
        title = self.title(results) if callable(self.title) else self.title
        legacy = self.legacy_command(results) if self.legacy_command else None
        text = header(title, results, legacy) + "\n" + self.render(results).strip("\n") + "\n"
        notes = Path(f"{out}.analysis.md")
        if self.analysis and out is not None and notes.is_file():
            text += "\n## Analysis\n\n" + notes.read_text().strip("\n") + "\n"
        return text

    def write(self, results: dict, out: str | Path) -> Path:
        """Write ``<out>.json`` atomically (a ``machine`` record is added if missing), then
        ``<out>.md``; returns the Markdown's path. Call it again after each part of a long run:
        a stopped run keeps what it measured."""
        results.setdefault("machine", machine_record())
        write_json(f"{out}.json", results)
        md = Path(f"{out}.md")
        atomic_write(md, self.markdown(results, out))
        return md

    def rerender(self, out: str | Path) -> Path:
        """Rewrite ``<out>.md`` from ``<out>.json`` (nothing is measured)."""
        md = Path(f"{out}.md")
        atomic_write(md, self.markdown(json.loads(Path(f"{out}.json").read_text()), out))
        return md


def settings(args: argparse.Namespace) -> dict:
    """A script's options as saved with its result: all but ``--out``, ``--rerender`` and
    ``--child`` (``main_with_children``)."""
    return {k: v for k, v in vars(args).items() if k not in ("out", "rerender", "child")}


# ---------------------------------------------------------------------------------- fresh processes
def in_fresh_process(script: str, child: str, env: dict | None = None) -> dict:
    """Run ``script`` again, with this process's arguments and ``--child CHILD``, in a fresh Python
    process (its own memory, caches and compiled graphs; ``env``: its environment, default this
    one's) and return the JSON object of its last stdout line. Raises with its stderr's tail when
    it fails. The script's ``main`` is ``main_with_children``."""
    done = subprocess.run([sys.executable, script, "--child", child, *sys.argv[1:]], capture_output=True,
                          text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{child} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main_with_children(output: Output, ap: argparse.ArgumentParser, measure: Callable[[argparse.Namespace], dict],
                       child: Callable[[argparse.Namespace, str], dict], argv: list[str] | None = None) -> int:
    """The whole ``main`` of a script whose measurements each run in a fresh process of itself
    (``in_fresh_process``): with ``--child NAME`` print ``child(args, NAME)`` as one JSON line;
    else ``Output.main`` with ``measure``."""
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = output.parse(ap, argv)
    if args is not None and args.child:
        print(json.dumps(child(args, args.child)))
    elif args is not None:
        print("wrote", output.write(measure(args), args.out))
    return 0


def write_json(path: str | Path, obj: Any, indent: int | None = 1) -> None:
    """Write ``obj`` as JSON to ``path`` atomically: the writer of a script's side files (e.g. a
    reference beside its result)."""
    atomic_write(Path(path), json.dumps(obj, indent=indent) + "\n")


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write ``data`` (text or bytes) to a temporary file beside ``path`` (folders made as
    needed), flush it to disk, then rename it over ``path``: a reader never sees half a file.
    Every result file goes through here (``verispec bench``'s report too)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------- timing
def interleave(methods: dict[str, Callable[[], Any]], rounds: int, *, rotate: bool = False,
               alternate: bool = False, timed: bool = True) -> dict[str, list]:
    """Methods interleaved per round: each round runs every method once, in turn, so that a burst
    of other work on the machine falls on all of them alike. ``rotate``: round r starts at method
    r (mod n); ``alternate``: every other round (the first included) runs them in reverse order. Returns per method
    its wall seconds per round (``timed``) or what each call returned."""
    names = list(methods)
    out: dict[str, list] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)] if rotate else names
        if alternate and r % 2 == 0:
            order = order[::-1]
        for n in order:
            t0 = time.perf_counter()
            value = methods[n]()
            out[n].append(time.perf_counter() - t0 if timed else value)
    return out


class Generated(NamedTuple):
    """One prompt's output from one method (``generate_interleaved``)."""
    index: int                 # the prompt's place in the list
    category: str
    prompt_ids: list[int]
    method: str
    output: Any                # the method's ``RequestOutput``
    seconds: float             # wall time of its ``generate`` call
    same_as_first: bool        # its tokens equal the first method's on this prompt


def generate_interleaved(llms: dict[str, Any], prompts: list[tuple[str, list[int]]], params) -> Iterator[Generated]:
    """Each ``(category, prompt ids)`` through every ``LLM`` in turn (methods interleaved per
    prompt, so drift on the machine falls on all alike), one request at a time, timed; each
    output is compared with the first method's (vanilla, where it comes first)."""
    for i, (cat, ids) in enumerate(prompts):
        first = None
        for name, llm in llms.items():
            t0 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": ids}], params)[0]
            dt = time.perf_counter() - t0
            first = out.token_ids if first is None else first
            yield Generated(i, cat, ids, name, out, dt, out.token_ids == first)


def medians(samples: dict[str, list[float]], scale: float = 1.0) -> dict[str, float]:
    """The median of each method's samples, times ``scale`` (1e3: seconds to ms)."""
    return {n: scale * statistics.median(v) for n, v in samples.items()}


def add_tree_options(ap: argparse.ArgumentParser, rounds: int) -> None:
    """A before/after driver's options: ``--src``/``--label`` (repeat, in pairs), ``--rounds``,
    and the hidden ``--worker`` switch that makes the script one tree's worker."""
    ap.add_argument("--src", action="append", default=[], help="a verispec src folder (repeat)")
    ap.add_argument("--label", action="append", default=[], help="a name for each --src")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def run_trees(script: str, srcs: list[str], labels: list[str], rounds: int, args: list[str],
              env: dict | None = None) -> dict[str, list[dict]]:
    """Before/after runs of one benchmark over several verispec source trees: per round, one
    worker subprocess per tree in turn (``PYTHONPATH`` = the tree's ``src``), each
    ``script --worker *args`` printing its result as JSON on its last line. Returns
    ``{label: [worker JSON per round]}``. The worker runs on the tree's own verispec, which may
    predate this module: its code path must not import the harness."""
    if len(srcs) != len(labels):
        raise SystemExit(f"{len(srcs)} --src but {len(labels)} --label")
    runs: dict[str, list[dict]] = {lab: [] for lab in labels}
    for r in range(rounds):
        for src, lab in zip(srcs, labels):
            e = dict(os.environ, PYTHONPATH=str(Path(src).resolve()), **(env or {}))
            res = subprocess.run([sys.executable, script, "--worker", *args], env=e, capture_output=True,
                                 text=True, check=True)
            runs[lab].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {lab}: done", flush=True)
    return runs
