"""The report as text for a terminal: the job's time, its badput by cause, one row per fault, the reader's notes."""

from __future__ import annotations

from ft_plugins.report.goodput import BADPUT, Report
from ft_plugins.report.interval import Interval


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def render(report: Report) -> str:
    """The report's text."""
    lines = [f"job {report.job}",
             f"  wall time            {_seconds(report.wall)}",
             f"  productive training  {_seconds(report.productive)}",
             f"  goodput              {report.goodput:.1f} %",
             "  badput by cause:"]
    lines += [f"    {label:<20} {_seconds(report.badput[label])}" for label in BADPUT]
    lines.append(f"    {'other':<20} {_seconds(report.other)}")
    if report.faults:
        header = ("at", "rank", "kind", "how met", "to training", "steps lost", "recomputed")
        rows = [(f"{fault.at:.2f} s", "?" if fault.rank is None else str(fault.rank), fault.kind, fault.how,
                 _seconds(fault.to_training), str(fault.steps_lost), str(fault.steps_recomputed))
                for fault in report.faults]
        widths = [max(len(row[index]) for row in [header, *rows]) for index in range(len(header))]
        lines.append(f"faults ({len(rows)}):")
        lines += ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                  for row in [header, *rows]]
    else:
        lines.append("faults: none")
    if report.sizes:
        lines.append("data-parallel sizes (elastic):")
        lines += [f"  {size.data_parallel:>4} from {size.since:.2f} s: {size.steps} steps"
                  + (f", {size.per_second:.2f} steps/s" if size.per_second else "") for size in report.sizes]
    if report.interval is not None:
        lines += _interval(report.interval)
    lines += [f"note: {note}" for note in report.notes]
    return "\n".join(lines)


def _steps(count: int | None) -> str:
    return "" if count is None else f" ({count} steps)"


def _interval(advice: Interval) -> list[str]:
    """The save interval's lines: the figures it comes from, the optimum, and the current interval against it."""
    if advice.at_least:
        rate = f"no fault sent the job back to a periodic save in {advice.between_faults:.2f} s"
        optimum = f"at least {advice.optimum:.2f} s{_steps(advice.optimum_steps)} while faults stay that rare"
    else:
        rate = f"one fault recomputing steps every {advice.between_faults:.2f} s ({advice.faults})"
        optimum = f"{advice.optimum:.2f} s{_steps(advice.optimum_steps)}"
    current = "-" if advice.current is None else f"{advice.current:.2f} s{_steps(advice.current_steps)}"
    if advice.lost is not None:
        current += f", {advice.lost:.2f} s lost to it against the optimum in this job"
    return ["save interval (Young/Daly: the square root of 2 x save cost x time between faults):",
            f"  each save cost {advice.save_cost:.2f} s ({advice.saves} saves); {rate}",
            f"  optimum {optimum}; current {current}"]
