"""``ft-plugins run [--features LIST] [--inject-fault SPEC] [--manager] [--dry-run] [--grace S] -- CMD...``:
run a launcher (torchrun, msrun, python ...) with ft_plugins active in every Python process it starts."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("run", help="run a command with ft_plugins in every Python process it starts")
    parser.add_argument("--features", help="auto, all, none or a comma list (sets FT_PLUGINS)")
    parser.add_argument("--inject-fault", metavar="SPEC",
                        help="fire drill in the workers, e.g. rank=1,step=3,kind=kill (sets FT_PLUGINS_INJECT_FAULT)")
    parser.add_argument("--manager", action="store_true", help="start TaskD's manager beside the command (master only)")
    parser.add_argument("--dry-run", action="store_true", help="print the environment changes and the command")
    parser.add_argument("--grace", type=float, default=None, metavar="SECONDS",
                        help="seconds the workers get after SIGTERM before SIGKILL (default: what their dump needs, "
                             "estimated from this job's saves, at least torchrun's 30 or, for msrun, 20)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD...")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ft_plugins.cli import EXIT_OK, EXIT_USAGE
    from ft_plugins.config import GRACE_FOLLOWS_VAR, ConfigError
    from ft_plugins.launch import environment, process, shutdown

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("ft-plugins run: no command given; e.g. ft-plugins run -- torchrun --nproc-per-node 8 train.py",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        plan = environment.plan(command, args.features, args.inject_fault)
        manager = _manager_command(command, plan.env) if args.manager else None
    except ConfigError as exc:
        print(f"ft-plugins run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    msrun = environment.is_msrun(command)
    launched = msrun or environment.is_torchrun(command)  # the launchers that SIGKILL their workers
    if args.grace is not None and (args.grace < 0 or not launched):
        print(f"ft-plugins run: --grace {args.grace:g}: give seconds >= 0, for torchrun or msrun (the launchers "
              "that SIGKILL their workers)", file=sys.stderr)
        return EXIT_USAGE
    reports = _reports() if msrun and args.grace is None and not args.dry_run else None
    grace = shutdown.plan(command, plan.env, args.grace, msrun, reports)
    if launched:
        plan.env.update(grace.changes)
        plan.changes.update(grace.changes)
        plan.notes.append(grace.line)
        plan.warnings += [grace.warning] if grace.warning else []
    for warning in plan.warnings:
        print(f"ft-plugins run: warning: {warning}", file=sys.stderr)
    for note in plan.notes:
        print(f"ft-plugins run: {note}", file=sys.stderr)
    if args.dry_run:
        for name, value in plan.changes.items():
            print(f"export {name}={shlex.quote(value)}")
        if manager:
            print(f"{shlex.join(manager)} &")
        print(shlex.join(command))
        return EXIT_OK
    # msrun leaves its workers running when stopped: supervised; torchrun stops its own (SIGTERM, the grace, SIGKILL)
    follows = grace.changes.get(GRACE_FOLLOWS_VAR)
    supervised = shutdown.Planned(grace.seconds, follows).seconds if msrun else None
    if manager is None:
        if supervised is not None:
            return process.supervise(command, plan.env, supervised)
        return process.exec_command(command, plan.env)
    manager_env = environment.helper_env(plan.env)
    return process.run_beside(command, plan.env, manager, manager_env, supervised)


def _reports() -> str:
    """A directory msrun's workers report what their dump needs to (their grace follows it); removed at exit."""
    from ft_plugins.launch.scratch import owned_directory

    return owned_directory("ft_plugins-grace-")


# what `run` cannot take as flags: the job id and the counts come from the environment or the launcher's own flags
RUN_FIXES = {"job_id": "set MINDX_TASK_ID (the Ascend operator sets it)",
             "node_nums": "give the launcher a whole node count (torchrun --nnodes N; msrun --worker_num and "
                          "--local_worker_num), or set WORLD_SIZE and LOCAL_WORLD_SIZE",
             "proc_per_node": "give the launcher a whole count of processes per node (torchrun --nproc-per-node N; "
                              "msrun --local_worker_num), or set LOCAL_WORLD_SIZE"}


def _manager_command(command: list[str], env: dict[str, str]) -> list[str] | None:
    """``ft-plugins manager`` for this pod with its config in flags (counts from the operator's variables,
    else the launcher's flags), checked now so a bad config stops before the job starts; None on a pod
    that is not the master."""
    from ft_plugins.launch import environment
    from ft_plugins.vendors import taskd

    master, why = taskd.is_master(env)
    if not master:
        print(f"ft-plugins run: no TaskD manager on this pod: {why}", file=sys.stderr)
        return None
    config = taskd.manager_config(env, launched=environment.launcher_counts(command, env), fixes=RUN_FIXES)
    return [sys.executable, "-m", "ft_plugins.cli", "manager", "--job-id", config["job_id"],
            "--nodes", str(config["node_nums"]), "--procs-per-node", str(config["proc_per_node"])]
