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
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, never over them
    ax.tick_params(axis="x", labelrotation=15)
    return ax


def technique_bars(matrix, value: str = "peak_bytes", ax=None, title: str | None = None):
    """Grouped horizontal bars of a technique matrix (``gpukit.lessons.techniques.run_matrix``, or one machine's rows
    of ``gpukit.lessons.runs.load_runs()``): one group per technique, one bar per model.

    Args:
        matrix: a list of row dicts or a DataFrame with ``model``, ``technique`` and ``value`` columns.
        value: ``'peak_bytes'`` (drawn in MiB or GiB) or ``'peak_vs_baseline'`` (a ratio, 1 marked).

    Raises:
        ValueError: for another ``value``, or a matrix without a single figure to draw.
    """
    if value not in ("peak_bytes", "peak_vs_baseline"):
        raise ValueError(f"value must be 'peak_bytes' or 'peak_vs_baseline', not {value!r}")
    rows = matrix if isinstance(matrix, list) else matrix.to_dict("records")
    rows = [r for r in rows if r.get(value) not in (None, "") and r[value] == r[value]]  # drop empty and NaN
    if not rows:
        raise ValueError(f"no row has a {value}: nothing to draw")
    techniques = list(dict.fromkeys(r["technique"] for r in rows))
    models = list(dict.fromkeys(r["model"] for r in rows))
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.3 + 0.22 * len(techniques) * len(models)))
    unit, size = _unit(max(float(r[value]) for r in rows)) if value == "peak_bytes" else ("x baseline", 1)
    height = 0.8 / len(models)
    for m, model in enumerate(models):
        found = {r["technique"]: float(r[value]) / size for r in rows if r["model"] == model}
        ys = [t + m * height for t, name in enumerate(techniques) if name in found]
        ax.barh(ys, [found[name] for name in techniques if name in found], height=height, label=model)
    if value == "peak_vs_baseline":
        ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks([t + 0.4 - height / 2 for t in range(len(techniques))], techniques, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"peak of a training step ({unit})" if value == "peak_bytes"
                  else "peak of a training step / the baseline's (same model and device)")
    ax.set_title(title or "Peak memory by technique")
    ax.legend(fontsize=7)
    return ax


def technique_panels(matrices: dict):
    """One row of two panels per machine: its peaks in MiB/GiB, and its peaks over the baseline's
    (comparable across machines whose models are sized differently). ``matrices``: {title: matrix}.

    Returns:
        The Figure.
    """
    fig, axes = plt.subplots(len(matrices), 2, figsize=(13, 0.8 + 4.4 * len(matrices)), squeeze=False)
    for (name, matrix), (left, right) in zip(matrices.items(), axes):
        # (the machine's name on a line of its own: a GPU's and its run's file are longer than half the width)
        technique_bars(matrix, "peak_bytes", ax=left, title=f"{name}\npeak of a training step")
        technique_bars(matrix, "peak_vs_baseline", ax=right, title=f"{name}\nrelative to the baseline")
        right.set_yticklabels([])
    fig.tight_layout()
    return fig


def snapshot_timeline(snapshot: dict, ax=None, max_elements: int = 200, title: str | None = None, device: int = 0):
    """A memory snapshot's events drawn as PyTorch's memory_viz draws its "Active Memory Timeline": every allocation
    a band, stacked in the order made; when one is freed, the bands above it come down. The largest
    ``max_elements`` allocations get a band each and the rest one grey band on top ("summarized", as memory_viz).

    Args:
        snapshot: ``torch.cuda.memory._snapshot()`` (a GPU's), a ``SimulatedCuda``'s, or one loaded from the pickle
            ``_dump_snapshot`` writes.

    Returns:
        The Axes. Its peak (the highest point of the bands) is the largest sum of live allocations' requested
        bytes along the trace.

    Raises:
        ValueError: a snapshot without recorded events (``_record_memory_history()`` was not on).
    """
    traces = snapshot.get("device_traces") or []
    events = traces[device] if device < len(traces) else []
    if not any(e.get("action") == "alloc" for e in events):
        raise ValueError("the snapshot holds no recorded allocation: call _record_memory_history() before the code "
                         "you want to see, then _snapshot() or _dump_snapshot()")
    # Elements: each allocation of the trace; a free whose allocation came before the recording began stands for
    # a block that was there from the start, as are live blocks the trace never allocated.
    elements, starts, actions, open_by_addr = [], [], [], {}
    for e in events:
        action = e.get("action")
        if action == "alloc":
            elements.append(e["size"])
            open_by_addr[e["addr"]] = len(elements) - 1
            actions.append(len(elements) - 1)
        elif action == "free_completed" or action == "free":
            i = open_by_addr.pop(e["addr"], None)
            if i is None:
                elements.append(e["size"])
                starts.append(len(elements) - 1)
                i = len(elements) - 1
            actions.append(i)
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        for b in seg.get("blocks", []):
            if b.get("state") == "active_allocated" and b.get("address") not in open_by_addr:
                elements.append(b.get("requested_size") or b["size"])
                starts.append(len(elements) - 1)
    shown = set(sorted(range(len(elements)), key=lambda i: -elements[i])[:max_elements])
    bands: dict[int, tuple[list, list]] = {}  # element -> (times, offsets of its bottom)
    stack: list[int] = []  # shown elements live now, bottom first
    summarized = 0
    t = 0
    top_at: list[tuple[int, int]] = []  # (time, total live) after each step
    grey: list[tuple[int, int, int]] = []  # (time, shown bands' top, summarized bytes) after each step

    def total() -> int:
        return sum(elements[j] for j in stack) + summarized

    for i in starts[::-1]:
        if i in shown:
            bands[i] = ([t], [sum(elements[j] for j in stack)])
            stack.append(i)
        else:
            summarized += elements[i]
    grey.append((t, sum(elements[j] for j in stack), summarized))
    live = set(starts)
    for i in actions:
        if i not in live:  # an allocation
            live.add(i)
            if i in shown:
                bands.setdefault(i, ([], []))
                bands[i][0].append(t)
                bands[i][1].append(sum(elements[j] for j in stack))
                stack.append(i)
            else:
                summarized += elements[i]
        else:  # a free
            live.discard(i)
            if i in shown and i in stack:
                k = stack.index(i)
                bands[i][0].append(t + 1)
                bands[i][1].append(bands[i][1][-1])
                for j in stack[k + 1:]:  # the bands above come down
                    times, offsets = bands[j]
                    times += [t + 1, t + 2]
                    offsets += [offsets[-1], offsets[-1] - elements[i]]
                stack.pop(k)
            elif i not in shown:
                summarized -= elements[i]
        t += 2
        top_at.append((t, total()))
        grey.append((t, sum(elements[j] for j in stack), summarized))
    for j in stack:
        times, offsets = bands[j]
        times.append(t)
        offsets.append(offsets[-1])
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.2))
    peak = max((v for _, v in top_at), default=0)
    unit, size = _unit(peak or 1)
    colours = plt.get_cmap("tab10").colors
    for n, (i, (times, offsets)) in enumerate(bands.items()):
        if len(times) < 2:
            continue
        xs = times
        low = [o / size for o in offsets]
        high = [(o + elements[i]) / size for o in offsets]
        ax.fill_between(xs, low, high, step=None, color=colours[i % len(colours)], linewidth=0)
    if any(g[2] for g in grey):  # the smaller allocations, one grey band on top of the shown ones
        ax.fill_between([g[0] for g in grey], [g[1] / size for g in grey], [(g[1] + g[2]) / size for g in grey],
                        step="pre", color="lightgrey", linewidth=0)
    if top_at:
        ax.axhline(peak / size, color="black", linestyle="--", linewidth=0.8,
                   label=f"peak of live allocations: {peak / size:.2f} {unit}")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xlabel("allocation or free, in order")
    ax.set_ylabel(unit)
    ax.set_title(title or "Active memory timeline (as PyTorch's memory_viz draws it)")
    ax.set_xlim(0, max(t, 1))
    ax.set_ylim(0, peak / size * 1.05 if peak else 1)
    return ax
