"""``ft-plugins features [--framework pt|ms] [--json]``: which features would be on here, and why."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ft_plugins.config import ConfigError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("features", help="show which features are enabled here and why")
    parser.add_argument("--framework", choices=("pt", "ms"), default="pt")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ft_plugins.cli import EXIT_OK, EXIT_USAGE
    from ft_plugins.runtime import activate

    try:
        runtime = activate(args.framework, announce=False)  # the table below says it, once
    except ConfigError as exc:
        print(f"ft-plugins: {exc}", file=sys.stderr)
        return EXIT_USAGE
    report = runtime.report()
    runtime.stop()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for name, entry in report.items():
            print(f"{name:8} {'on ' if entry['enabled'] else 'off'}  {entry['reason']}")
    return EXIT_OK
