"""The segment map of a snapshot (a real GPU's or the simulation's), drawn like ``torch.cuda._memory_viz``."""

from __future__ import annotations

from .config import kMB


def plot_segments(segments: list[dict], ax=None, title: str | None = None, max_segments: int = 40):
    """Draw a segment map, one bar per segment with its blocks in place, like ``torch.cuda._memory_viz``'s
    segment view: allocated blocks coloured, cached free blocks grey.

    Args:
        segments: ``torch.cuda.memory._snapshot()["segments"]`` of a real GPU, or ``CachingAllocator.segments()``.
        max_segments: draw at most this many (the largest), in address order.

    Returns:
        The matplotlib Axes.
    """
    import matplotlib.pyplot as plt

    from ..report import format_bytes

    segs = list(segments)
    if len(segs) > max_segments:
        segs = sorted(segs, key=lambda s: -s["total_size"])[:max_segments]
    segs.sort(key=lambda s: s["address"])
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.9 + 0.32 * max(len(segs), 1)))
    widest = max((s["total_size"] for s in segs), default=1) / kMB
    palette = plt.get_cmap("tab20").colors
    allocated = reserved = 0
    for row, s in enumerate(segs):
        y = len(segs) - 1 - row
        reserved += s["total_size"]
        for b in s["blocks"]:
            x = (b["address"] - s["address"]) / kMB
            if b["state"] == "active_allocated":
                allocated += b["size"]
                color = palette[(b["address"] // 512) % len(palette)]
            else:
                color = "#dddddd"
            ax.barh(y, b["size"] / kMB, left=x, height=0.8, color=color, edgecolor="white", linewidth=0.4)
        kind = ("expandable " if s.get("is_expandable") else "") + s.get("segment_type", "")
        stream = f", stream {s['stream']}" if s.get("stream") else ""
        ax.text(widest * 1.01, y, f"{format_bytes(s['total_size'])} {kind}{stream}", va="center", fontsize=8)
    ax.set_yticks([])
    ax.set_xlim(0, widest * 1.3)
    ax.set_xlabel("offset in segment (MiB); coloured: allocated blocks, grey: cached free blocks "
                  "(reserved but unallocated)", fontsize=8)
    ax.set_title(title or f"segments: {format_bytes(reserved)} reserved, {format_bytes(allocated)} allocated")
    return ax
