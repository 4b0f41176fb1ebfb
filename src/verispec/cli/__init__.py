"""The ``verispec`` command: generate, chat, models, serve, bench, train, data, export, audit.

Each sub-command lives in its own module exposing ``add_parser(subparsers)``; a module whose
dependencies are missing is left out with a note in ``--help`` instead of breaking the CLI.
"""
from __future__ import annotations

import argparse
import importlib
import sys

_COMMANDS = ("generate", "models", "serve", "bench", "train", "data", "export", "audit")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verispec", description=(
        "Lossless speculative decoding: draft cheaply, verify in one target forward, accept by "
        "rejection sampling. Output distribution is exactly the target model's."))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        try:
            mod = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith(f"{__name__}.{name}"):
                continue            # sub-command not part of this build
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
