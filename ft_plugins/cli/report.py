"""``ft-plugins report DIR [--job ID] [--json] [--plot FILE]``: a job's goodput, badput by cause and each fault's
cost, from the events its processes wrote (DIR: the events folder or the save directory holding ``ft_events``).

Exit codes: 0 reported, 3 refused (no events, several jobs), 2 ``--plot`` without matplotlib."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("report", help="a job's goodput and what each fault cost, from its events")
    parser.add_argument("directory", metavar="DIR", help="the events folder, or the save directory holding ft_events")
    parser.add_argument("--job", help="the job to report when DIR holds several")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    parser.add_argument("--plot", metavar="FILE", help="draw the timeline into FILE (.png or .svg; needs matplotlib)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ft_plugins.cli import EXIT_NOTHING, EXIT_OK, EXIT_USAGE
    from ft_plugins.report.goodput import analyse
    from ft_plugins.report.plot import PlotUnavailable, draw
    from ft_plugins.report.reading import Refused, read
    from ft_plugins.report.table import render

    try:
        report = analyse(read(args.directory, args.job))
    except Refused as exc:
        print(f"ft-plugins report: {exc}", file=sys.stderr)
        return EXIT_NOTHING
    print(json.dumps(report.as_dict(), indent=2) if args.json else render(report))
    if args.plot:
        try:
            draw(report, args.plot)
        except PlotUnavailable as exc:
            print(f"ft-plugins report: {exc}", file=sys.stderr)
            return EXIT_USAGE
    return EXIT_OK
