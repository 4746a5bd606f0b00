"""The report as text for a terminal: the job's time, its badput by cause, one row per fault, the reader's notes."""

from __future__ import annotations

from ft_plugins.report.goodput import BADPUT, Report


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
    lines += [f"note: {note}" for note in report.notes]
    return "\n".join(lines)
