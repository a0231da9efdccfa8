"""matplotlib plots of measurements: a step's memory timeline, and memory by role side by side.

    with gpukit.measure(timeline=True) as report:
        train_step()
    gpukit.plots.timeline(report)

    gpukit.plots.role_bars()          # every run of gpukit.history() that has a role breakdown

Each function draws on ``ax`` (a new figure when None) and returns the Axes; the
data drawn is the report's own (tests check that the line's maximum is the peak
and that the bars are the roles' bytes).
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from .report import ROLES, MemoryReport, history

PHASE_COLOURS = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green"}
_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def _unit(largest: float) -> tuple[str, int]:
    return next((name, size) for name, size in _UNITS if abs(largest) >= size or size == 1)


def timeline(report: MemoryReport, ax=None):
    """Bytes allocated above the block's start after every allocation and free, phases shaded, peak marked.

    Raises:
        ValueError: if the report was measured without ``timeline=True``.
    """
    if not report.timeline:
        raise ValueError("this report has no timeline: measure with gpukit.measure(timeline=True)")
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3))
    levels = [level for level, _ in report.timeline]
    unit, size = _unit(max(abs(v) for v in levels + [report.peak]) or 1)
    xs = range(1, len(levels) + 1)
    ax.step(xs, [v / size for v in levels], where="post", color="black", linewidth=1, label="allocated above start")
    start, phase = 0, report.timeline[0][1]
    seen = set()
    for i, (_, p) in enumerate(report.timeline + [(None, None)]):
        if p != phase:
            ax.axvspan(start + 0.5, i + 0.5, color=PHASE_COLOURS.get(phase, "tab:gray"), alpha=0.15,
                       label=phase if phase not in seen else None)
            seen.add(phase)
            start, phase = i, p
    peak_at = levels.index(max(levels)) + 1
    ax.plot([peak_at], [max(levels) / size], "v", color="tab:red", label=f"peak {max(levels) / size:.2f} {unit}")
    ax.set_xlabel("allocation or free, in order" if report.backend != "CUDA caching allocator" else "op, in order")
    ax.set_ylabel(f"{unit} above the start")
    ax.set_title(f"{report.label + ': ' if report.label else ''}memory during the block on {report.device}")
    ax.legend(loc="upper left", fontsize=8)
    return ax


def role_bars(reports=None, at: str = "end", ax=None):
    """Stacked bars of memory by role, one bar per run (default: the runs in ``gpukit.history()`` with roles).

    Args:
        reports: a list of MemoryReports, or a DataFrame like ``gpukit.history()``.
        at: ``"end"`` or ``"peak"``: the roles at the end of each run or at its peak.

    Raises:
        ValueError: if no run has a role breakdown, or ``at`` is neither.
    """
    if at not in ("end", "peak"):
        raise ValueError(f"at must be 'end' or 'peak', not {at!r}")
    table = history() if reports is None else reports
    if isinstance(table, list):
        rows = [(r.label or f"run {i}", getattr(r, f"roles_{at}") or {}) for i, r in enumerate(table)]
    else:
        rows = [(row["label"] or f"run {i}", {role: row.get(f"{role} ({at})", 0) or 0 for role in ROLES})
                for i, row in enumerate(table.to_dict("records"))]
    rows = [(label, roles) for label, roles in rows if any(roles.values())]
    if not rows:
        raise ValueError("no run with a role breakdown: measure with model= (or %%gpumem --roles MODEL,OPT)")
    if ax is None:
        _, ax = plt.subplots(figsize=(1.5 + 1.2 * len(rows), 3.5))
    unit, size = _unit(max(sum(r.values()) for _, r in rows))
    labels = [label for label, _ in rows]
    bottom = [0.0] * len(rows)
    for role in ROLES:
        heights = [roles.get(role, 0) / size for _, roles in rows]
        if any(heights):
            ax.bar(labels, heights, bottom=bottom, label=role)
            bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel(unit)
    ax.set_title(f"Memory by role, at the {at} of each run")
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelrotation=15)
    return ax
