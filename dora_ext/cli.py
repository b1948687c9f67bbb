"""`dora-ext` command line. Subcommands live beside the code they run and are imported lazily,
so that `dora-ext simulate` never imports torch and `dora-ext slime-args` never imports the engine.

Each subcommand module exposes `register(subparsers)`, which adds its parser and sets
`func=callable(args) -> int` as a default.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand name -> module that registers it
SUBCOMMANDS = {
    "simulate": "dora_ext.sim.cli",
    "train": "dora_ext.runtime.cli",
    "compare": "dora_ext.runtime.cli",
    "slime-args": "dora_ext.slime.cli",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dora-ext",
        description="Multi-version streaming rollout for verl and slime: simulate, train, compare.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    seen: set[str] = set()
    for name, module in SUBCOMMANDS.items():
        if module in seen:
            continue
        if wanted is not None and name != wanted and SUBCOMMANDS[wanted] != module:
            # Only import what the user asked for; list the rest by name.
            sub.add_parser(name, help=f"(see `dora-ext {name} --help`)")
            continue
        seen.add(module)
        try:
            importlib.import_module(module).register(sub)
        except ModuleNotFoundError as exc:
            missing = exc.name or "?"
            p = sub.add_parser(name, help=f"unavailable: missing module {missing}")
            p.set_defaults(func=_missing(name, missing))
    return parser


def _missing(name: str, missing: str):
    def run(_args: argparse.Namespace) -> int:
        print(
            f"dora-ext {name}: needs the module {missing!r}, which is not installed "
            f"(try `pip install 'dora-ext[torch]'`).",
            file=sys.stderr,
        )
        return 2

    return run


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
