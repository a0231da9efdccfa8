"""What ``plan()`` returns: the plan's table (text, HTML, a DataFrame, a plot) and recipe, and any of its rows'
candidates built or run for real (``Plan.build``, ``Plan.run``)."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Callable

from ..report import format_bytes, parse_bytes
from .candidates import HOW, NEEDS, Row, Verification
from .verify import build_candidate, run_candidate


@dataclass
class Plan:
    """What ``plan()`` found: ``rows`` (the fitting ones first, in the order to choose them:
    ``PlanSearch.rank_fitting``), ``choice`` (the first fitting row or None), ``code`` (the chosen recipe in plain
    PyTorch), ``verification`` and the search's own figures."""

    budget: int
    device: str
    gpus: int
    allowance: int
    rows: list[Row]
    choice: Row | None
    code: str
    verification: Verification
    predictions: int
    seconds: float
    assumptions: str
    model_note: str
    optimizers: dict[str, Callable] = field(default_factory=dict, repr=False)  # label -> make_optimizer
    _make_model: Callable | None = field(default=None, repr=False)  # what Plan.run builds and steps
    _make_batch: Callable | None = field(default=None, repr=False)
    _loss: Callable | None = field(default=None, repr=False)

    def run(self, row: Row, limit: int | str | None = None, device: str = "cpu"):
        """One real step of a row's candidate (``run_candidate``), under ``limit`` if given."""
        return run_candidate(self._make_model, self.optimizers[row.candidate.optimizer], self._make_batch,
                             row.candidate, limit=None if limit is None else parse_bytes(limit), device=device,
                             loss=self._loss)

    def build(self, row: Row, device: str = "cpu"):
        """A row's candidate as a real run starts it: ``(model, optimizer, step)`` on ``device``, the model in the
        candidate's precision (with LoRA adapters where it has them) and ``step(model, optimizer, batch)`` its
        training step (``gpukit.step.train_step`` with its techniques and loss). What ``Plan.run`` steps. On a
        CPU, an optimizer with its state on the host (torchao's) is built and stepped under
        ``gpukit.offload.cuda_stand_ins()``."""
        return build_candidate(self._make_model, self.optimizers[row.candidate.optimizer], row.candidate,
                               device=device, loss=self._loss)

    def frame(self):
        """The table as a pandas DataFrame."""
        import pandas as pd

        return pd.DataFrame([r.cells(self.budget, self.device) for r in self.rows])

    def _head(self) -> list[str]:
        what = (f"budget {format_bytes(self.budget)} ({self.budget / 1e9:g} GB) on {self.device}"
                + (f", {self.gpus} GPUs: per-rank figures" if self.gpus > 1 else "")
                + (f"; {NEEDS['cuda']} = reserved at the peak (simulated caching allocator) + context allowance "
                   f"{format_bytes(self.allowance)}" if self.device == "cuda" else
                   f"; {NEEDS['cpu']} = allocated at the peak (gpukit's counter)"))
        found = (f"cheapest that fits: {self.choice.candidate.label} (optimizer: {self.choice.candidate.optimizer})"
                 if self.choice else "nothing fits: see the smallest needs below")
        return [what, self.model_note, found,
                f"{self.predictions} predictions in {self.seconds:.1f} s; {self.assumptions}",
                f"verification: {self.verification.message}"]

    def __repr__(self) -> str:
        import pandas as pd

        shown = [r.cells(self.budget, self.device) for r in self.rows if r.need is not None]
        with pd.option_context("display.max_colwidth", 70, "display.width", 250, "display.max_columns", 20):
            table = pd.DataFrame(shown).drop(columns=[HOW, "verdict"]).to_string(index=False) if shown else ""
        code = "\n".join("    " + line for line in self.code.splitlines())
        return "\n".join(self._head() + ["predicted:", table, self._pruned_line(), "recipe:", code])

    def _pruned_line(self) -> str:
        reasons: dict[str, int] = {}
        for r in self.rows:
            if r.need is None:
                why = r.verdict.removeprefix("pruned: ").split(":")[0].split(" need ")[0]
                reasons[why] = reasons.get(why, 0) + 1
        if not reasons:
            return "nothing pruned"
        return (f"{sum(reasons.values())} candidates not predicted (frame() lists them): "
                + "; ".join(f"{n} {why}" for why, n in reasons.items()))

    def _repr_html_(self) -> str:
        import pandas as pd

        head = "".join(f"<div>{html.escape(line)}</div>" for line in self._head())
        shown = [r.cells(self.budget, self.device) for r in self.rows if r.need is not None]
        table = pd.DataFrame(shown).to_html(index=False, escape=True) if shown else ""
        table += f"<div>{html.escape(self._pruned_line())}</div>"
        return f"<b>make it fit</b>{head}{table}<b>recipe</b><pre>{html.escape(self.code)}</pre>"

    def plot(self, ax=None, max_rows: int = 14):
        """The predicted candidates' needs as horizontal bars against the budget line; returns the axes."""
        import matplotlib.pyplot as plt

        rows = [r for r in self.rows if r.need is not None][:max_rows][::-1]
        if ax is None:
            _, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
        gib = [r.need / 2**30 for r in rows]
        colours = ["tab:green" if r.fits else "tab:red" for r in rows]
        ax.barh(range(len(rows)), gib, color=colours)
        ax.set_yticks(range(len(rows)), [f"{r.candidate.label} [{r.candidate.optimizer}]" for r in rows],
                     fontsize=8)
        ax.axvline(self.budget / 2**30, color="black", linestyle="--", label=f"budget {self.budget / 1e9:g} GB")
        ax.set_xlabel(f"{NEEDS[self.device]} (GiB)")
        ax.legend(loc="lower right")
        ax.set_title("candidates: green fits, red does not")
        return ax
