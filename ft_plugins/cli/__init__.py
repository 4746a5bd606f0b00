"""``ft-plugins`` console script. Exit codes: 0 success, 1 failure, 2 usage error, 3 nothing suitable / refused.

Each subcommand lives in its own module with ``register(subparsers)``; the parser calls the
``handler`` it sets, which returns the exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_NOTHING = 0, 1, 2, 3

COMMANDS = ("features", "ckpt", "patch", "run", "report", "manager", "doctor", "env", "k8s")


class _Version(argparse.Action):
    """``--version``: the version, and where this ft_plugins is installed (looked up only when asked)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="show which ft-plugins this is, and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        from ft_plugins.launch.installation import installation

        print(installation().describe())
        parser.exit(EXIT_OK)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 already; keep its message, add the hint
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ft-plugins", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action=_Version)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(f"ft_plugins.cli.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
