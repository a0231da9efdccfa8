"""ipywidgets for Jupyter: a live memory gauge for training loops.

    gauge = gpukit.widgets.MemoryGauge(budget="64MB")
    display(gauge)
    for step in tqdm(range(100)):
        with gpukit.measure(record=False) as report:
            train_step()
        gauge.update(report)

Outside Jupyter it renders as one line of text.
"""

from __future__ import annotations

import ipywidgets as w

from .report import MemoryReport, format_bytes, parse_bytes


class MemoryGauge(w.VBox):
    """Current and peak allocated memory, updated each step, against a budget when one is given.

    Args:
        budget: the bar's full scale (and the line it must not cross), bytes or ``"4GB"``; without one the
            scale grows with the highest peak seen.
        label: the title shown above the bars.
    """

    def __init__(self, budget: int | str | None = None, label: str = "memory") -> None:
        self.budget = parse_bytes(budget) if budget is not None else None
        self.steps = 0
        self.current = 0
        self.highest_peak = 0
        style = {"description_width": "70px"}
        self._current_bar = w.FloatProgress(value=0, min=0, max=1, description="current", style=style)
        self._peak_bar = w.FloatProgress(value=0, min=0, max=1, description="peak", style=style,
                                         bar_style="warning")
        self._text = w.HTML()
        self._title = w.HTML(f"<b>{label}</b>")
        super().__init__([self._title, self._current_bar, self._peak_bar, self._text])
        self._render()

    def update(self, report: MemoryReport) -> None:
        """Show one measured step: live bytes at its end, and the highest absolute peak so far."""
        self.steps += 1
        self.current = report.live_end
        self.highest_peak = max(self.highest_peak, report.peak_abs)
        self._render()

    def _render(self) -> None:
        scale = self.budget or max(self.highest_peak, 1)
        for bar, value in ((self._current_bar, self.current), (self._peak_bar, self.highest_peak)):
            bar.max = scale
            bar.value = min(value, scale)
        over = self.budget is not None and self.highest_peak > self.budget
        self._peak_bar.bar_style = "danger" if over else "warning"
        self._text.value = self.text()

    def text(self) -> str:
        budget = f" of {format_bytes(self.budget)} budget" if self.budget else ""
        return (f"step {self.steps}: current {format_bytes(self.current)}, "
                f"peak {format_bytes(self.highest_peak)}{budget}")

    def __repr__(self) -> str:
        return f"MemoryGauge({self.text()})"
