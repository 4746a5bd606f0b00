"""The job's timeline as a picture: one lane per rank (its steps and saves; each fault's phases across every
lane), the job's own lane for start-up; PNG or SVG by the file's name. matplotlib is the ``report`` extra:
:class:`PlotUnavailable` says how to install it when it is missing."""

from __future__ import annotations

from ft_plugins.report.goodput import (DETECTION, DUMP, IN_PLACE, RECOMPUTED, RESTART, SAVES, STARTUP, TRAINING,
                                       Report)

COLOURS = {TRAINING: "#4caf50", RECOMPUTED: "#ffb74d", SAVES: "#42a5f5", STARTUP: "#bdbdbd", DETECTION: "#e53935",
           DUMP: "#8e24aa", RESTART: "#6d4c41", IN_PLACE: "#fdd835"}
INSTALL = "pip install 'ft-plugins[report]'"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def draw(report: Report, path: str) -> None:
    """Write the timeline to ``path`` (its suffix picks PNG or SVG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
        from matplotlib.patches import Patch
    except ImportError:
        raise PlotUnavailable(f"--plot needs matplotlib: {INSTALL}") from None
    ranks = sorted({rank for _, _, _, rank in report.spans if rank is not None})
    lanes = {rank: index for index, rank in enumerate(["job", *ranks])}
    figure, axes = pyplot.subplots(figsize=(12, 1 + 0.5 * len(lanes)))
    whole_job = (DETECTION, DUMP, RESTART, IN_PLACE)  # what a fault costs, it costs every rank
    for start, stop, label, rank in sorted(report.spans, key=lambda span: span[2] in whole_job):
        own = [lanes["job" if rank is None else rank]]
        for lane in [lanes[each] for each in ranks] if label in whole_job else own:
            axes.broken_barh([(start, max(stop - start, 1e-3))], (lane - 0.4, 0.8), color=COLOURS[label])
    for fault in report.faults:
        axes.axvline(fault.at, color=COLOURS[DETECTION], linewidth=0.8, linestyle="--")
    axes.set_yticks(list(lanes.values()), [f"rank {rank}" if rank != "job" else "job" for rank in lanes])
    axes.invert_yaxis()
    axes.set_xlabel("seconds from the job's start")
    axes.set_title(f"job {report.job}: goodput {report.goodput:.1f} %, {len(report.faults)} faults")
    axes.legend(handles=[Patch(color=colour, label=label) for label, colour in COLOURS.items()], loc="upper center",
                bbox_to_anchor=(0.5, -0.25), ncol=4, fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)
