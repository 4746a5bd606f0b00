"""``ft-plugins k8s JOB.yaml [--recover-strategy LIST] [...]``: the job file with what MindCluster needs
(port 9601, labels, annotations, TTP settings), printed on stdout; everything else byte for byte.
Exit 2 for input that cannot be read as YAML text, 3 for a file this command refuses to edit (one line
each, naming why), never a traceback."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("k8s", help="add what MindCluster needs to a job YAML (printed on stdout)")
    parser.add_argument("job", metavar="JOB.yaml")
    parser.add_argument("--recover-strategy", metavar="LIST",
                        help="comma list of retry, recover, recover-in-place, dump, exit, elastic-training")
    parser.add_argument("--fault-scheduling", choices=("grace", "force"),
                        help="label value (default: grace where the label is missing)")
    parser.add_argument("--no-pod-rescheduling", action="store_true", help='do not add pod-rescheduling: "on"')
    parser.add_argument("--fault-retry-times", type=int, metavar="N")
    parser.add_argument("--wait-reschedule-timeout", type=int, metavar="SECONDS",
                        help="30 to 270; with elastic-training also the survivors' wait (FT_PLUGINS_ELASTIC_WAIT)")
    parser.add_argument("--mindio-wait-mindx-time", type=int, metavar="SECONDS",
                        help="1 to 3600: MINDIO_WAIT_MINDX_TIME of every training container, with elastic-training")
    parser.add_argument("--save", metavar="DIR", help="the job's save directory: terminationGracePeriodSeconds covers "
                                                      "the dump time its saves measured (raised, never lowered)")
    parser.add_argument("--termination-grace", type=int, metavar="SECONDS",
                        help="terminationGracePeriodSeconds of every pod (replaces the file's and the estimate)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ft_plugins.cli import EXIT_FAILURE, EXIT_NOTHING, EXIT_OK, EXIT_USAGE
    from ft_plugins.launch import k8s

    try:
        options = k8s.Options(
            recover_strategy=k8s.parse_strategies(args.recover_strategy) if args.recover_strategy else (),
            fault_scheduling=args.fault_scheduling, pod_rescheduling=not args.no_pod_rescheduling,
            fault_retry_times=args.fault_retry_times,
            wait_reschedule_timeout=(k8s.validate_timeout(args.wait_reschedule_timeout)
                                     if args.wait_reschedule_timeout is not None else None),
            mindio_wait=(k8s.validate_mindio_wait(args.mindio_wait_mindx_time)
                         if args.mindio_wait_mindx_time is not None else None),
            termination_grace=_termination_grace(args))
    except ValueError as exc:
        print(f"ft-plugins k8s: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        with open(args.job, encoding="utf-8", newline="") as handle:
            text = handle.read()
    except OSError as exc:
        print(f"ft-plugins k8s: cannot read {args.job}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    except UnicodeDecodeError as exc:
        print(f"ft-plugins k8s: {args.job} is not UTF-8 text (byte {exc.start}); give the job's YAML file",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        result, notes = k8s.edit(text, options)
    except ImportError:
        print("ft-plugins k8s: needs ruamel.yaml: pip install 'ft-plugins[k8s]'", file=sys.stderr)
        return EXIT_FAILURE
    except k8s.JobFileRefused as exc:
        print(f"ft-plugins k8s: {args.job}: {exc}", file=sys.stderr)
        return EXIT_NOTHING
    except k8s.JobFileInvalid as exc:
        print(f"ft-plugins k8s: {args.job}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for note in notes:
        print(f"ft-plugins k8s: note: {note}", file=sys.stderr)
    sys.stdout.buffer.write(result.encode("utf-8"))
    sys.stdout.flush()
    return EXIT_OK


def _termination_grace(args: argparse.Namespace) -> tuple[int, bool] | None:
    """The pods' grace: given (replaces), else what the save directory's measured write needs (raises only)."""
    from ft_plugins import grace

    if args.termination_grace is not None:
        if args.termination_grace < 0:
            raise ValueError(f"--termination-grace {args.termination_grace}: give seconds >= 0")
        return args.termination_grace, True
    if args.save is None:
        return None
    found = grace.measured(args.save)
    if found is None:
        print(f"ft-plugins k8s: note: no write measured in {args.save} yet (the job's first save or dump records "
              "one): terminationGracePeriodSeconds left as the file has it", file=sys.stderr)
        return None
    seconds = int(grace.grace_for(found, grace.TORCHRUN_GRACE))
    print(f"ft-plugins k8s: note: {grace.describe(found)}: terminationGracePeriodSeconds {seconds}", file=sys.stderr)
    return seconds, False
