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

from .report import MemoryReport, format_bytes, html_table, parse_bytes


class MemoryGauge(w.VBox):
    """Current and peak allocated memory, updated each step, against a budget when one is given.

    The budget line is checked against what ``gpukit.budget`` caps on the measured device: on a GPU the
    allocator's reserved memory (``set_per_process_memory_fraction`` caps it: live tensors, the cache and its
    fragmentation), so the peak bar shows the highest reserved bytes; on a CPU the live tensor bytes, so it
    shows the highest allocated peak.

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
        self.highest_reserved: int | None = None  # CUDA reports only: what a CUDA budget caps
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
        if report.reserved_peak is not None:
            self.highest_reserved = max(self.highest_reserved or 0, report.reserved_peak)
        self._render()

    @property
    def capped(self) -> int:
        """The highest value of what a budget caps on this device: reserved bytes on CUDA, else allocated."""
        return self.highest_peak if self.highest_reserved is None else self.highest_reserved

    def _render(self) -> None:
        scale = self.budget or max(self.capped, 1)
        for bar, value in ((self._current_bar, self.current), (self._peak_bar, self.capped)):
            bar.max = scale
            bar.value = min(value, scale)
        self._peak_bar.description = "peak" if self.highest_reserved is None else "reserved"
        over = self.budget is not None and self.capped > self.budget
        self._peak_bar.bar_style = "danger" if over else "warning"
        self._text.value = self.text()

    def text(self) -> str:
        budget = f" of {format_bytes(self.budget)} budget" if self.budget else ""
        reserved = "" if self.highest_reserved is None else f", reserved {format_bytes(self.highest_reserved)}"
        return (f"step {self.steps}: current {format_bytes(self.current)}, "
                f"peak {format_bytes(self.highest_peak)}{reserved}{budget}")

    def __repr__(self) -> str:
        return f"MemoryGauge({self.text()})"


class TechniqueExplorer(w.VBox):
    """Toggle autocast, checkpointing, gradient accumulation and the batch size; each run measures one real
    training step and adds it to the role bars and the table.

    Args:
        make_model: builds the model (a fresh one for every run, from the same seed).
        make_batch: ``make_batch(batch_size)`` builds ``(x, y)``, or with ``loss`` a batch of any structure (a
            dict, a transformers ``BatchEncoding``...).
        make_optimizer: builds the optimizer from the parameters (default Adam).
        device: where to run (default the GPU if there is one, else the CPU).
        batch_sizes: the choices offered.
        loss: as for ``gpukit.step.train_step``: None (cross-entropy of ``model(x)`` against ``y``), ``"model"``
            (``model(**batch).loss``) or ``loss(model, batch)``.
    """

    def __init__(self, make_model, make_batch, make_optimizer=None, device=None,
                 batch_sizes=(64, 128, 256, 512, 1024, 2048), loss=None) -> None:
        from .step import resolve_loss

        import torch

        from .meter import resolve_device

        self.make_model, self.make_batch, self.loss = make_model, make_batch, resolve_loss(loss)
        self.make_optimizer = make_optimizer or (lambda p: torch.optim.Adam(p))
        self.device = resolve_device(device)
        self.reports: list[MemoryReport] = []
        self.amp = w.ToggleButton(description="autocast (bf16)", value=False)
        self.checkpointing = w.ToggleButton(description="checkpointing", value=False)
        self.accumulation = w.IntSlider(description="accumulate", min=1, max=8, value=1)
        self.batch = w.Dropdown(description="batch", options=list(batch_sizes), value=batch_sizes[len(batch_sizes) // 2])
        self.button = w.Button(description="run one step", button_style="primary")
        self.button.on_click(lambda _: self.run())
        self.plot = w.Output()
        self.table = w.HTML()
        super().__init__([w.HBox([self.amp, self.checkpointing]), w.HBox([self.accumulation, self.batch]),
                          self.button, self.plot, self.table])

    def settings(self) -> str:
        parts = [f"batch {self.batch.value}"]
        if self.accumulation.value > 1:
            parts.append(f"accumulate {self.accumulation.value}")
        if self.amp.value:
            parts.append("bf16")
        if self.checkpointing.value:
            parts.append("checkpointing")
        return ", ".join(parts)

    def run(self, **settings) -> MemoryReport:
        """Measure one steady-state step with the current settings (or these: amp=, checkpointing=,
        accumulation=, batch=), and show it beside the earlier runs."""
        import torch

        from .meter import measure
        from .plots import role_bars
        from .step import Technique, map_tensors, train_step

        for name, value in settings.items():
            getattr(self, name).value = value
        torch.manual_seed(0)
        model = self.make_model().to(self.device)
        opt = self.make_optimizer(model.parameters())
        batch = map_tensors(lambda t: t.to(self.device), self.make_batch(self.batch.value))
        technique = Technique(self.settings(), amp=torch.bfloat16 if self.amp.value else None,
                              accumulate=self.accumulation.value, checkpointed=self.checkpointing.value)

        def step():
            train_step(model, opt, batch, technique, loss=self.loss)

        step()  # warm-up: gradients and optimizer state exist
        with measure(self.device, label=self.settings(), model=model, optimizer=opt, record=False) as report:
            step()
        self.reports.append(report)
        self.plot.clear_output(wait=True)
        with self.plot:
            import matplotlib.pyplot as plt
            from IPython.display import display

            figure = role_bars(self.reports, at="peak").figure
            display(figure)
            plt.close(figure)
        self.table.value = html_table([(r.label, format_bytes(r.peak), format_bytes(r.peak_abs),
                                        f"{r.seconds * 1e3:.1f} ms") for r in self.reports],
                                       columns=("settings", "peak above start", "peak", "time"))
        return report

    def __repr__(self) -> str:
        runs = "; ".join(f"{r.label}: peak {format_bytes(r.peak_abs)}" for r in self.reports) or "no run yet"
        return f"TechniqueExplorer({runs})"
