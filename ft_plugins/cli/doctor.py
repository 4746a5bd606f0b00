"""``ft-plugins doctor [--json] [--save DIR]``: one table of checks (OK / WARN / FAIL, each with its fix); exit 1
on any FAIL."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("doctor", help="check this node for what would break fault tolerance")
    parser.add_argument("--json", action="store_true", help="a JSON list instead of the table")
    parser.add_argument("--save", metavar="DIR", help="the job's save directory: is its dump's time within the grace?")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ft_plugins.cli import EXIT_FAILURE, EXIT_OK
    from ft_plugins.launch import doctor

    checks = doctor.run_checks(save_dir=args.save)
    if args.json:
        print(json.dumps(doctor.as_json(checks), indent=2))
    else:
        width = max((len(check.name) for check in checks), default=0)
        for check in checks:
            print(f"{check.status:4}  {check.name:{width}}  {check.detail}")
            if check.fix:
                print(f"{'':4}  {'':{width}}  fix: {check.fix}")
    return EXIT_FAILURE if any(check.status == doctor.FAIL for check in checks) else EXIT_OK
