"""Find the largest batch whose training step fits a memory budget.

Three strategies, each counted by the real training steps it runs:

* ``double_then_bisect``: double the batch until a step fails, then bisect between
  the last success and the first failure (PyTorch Lightning's "binsearch" mode).
* ``shrink_on_failure``: start high and multiply by 0.9 after each failure (the
  approach of Hugging Face Accelerate's ``find_executable_batch_size``).
* ``predict_then_confirm``: search with exact predictions under fake tensors,
  which allocate nothing and cost no real step, then confirm the answer with one
  real step (and step down only if the confirmation fails).

Every real trial runs a steady-state step (gradients and optimizer state already
exist, made by a warm-up step of batch 1) inside ``gpukit.budget``; a trial that
raises ``torch.OutOfMemoryError`` is a failure and leaves nothing behind.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .budget import budget
from .counter import gc_paused
from .estimate import default_step, predict, state_bytes
from .step import map_tensors
from .factories import check_factories
from .meter import measure, resolve_device
from .report import parse_bytes


@dataclass
class Trial:
    batch: int
    fits: bool
    real: bool  # a real step (False: a prediction)


@dataclass
class Search:
    """The outcome of one strategy: the batch it found and every trial it made."""

    strategy: str
    batch: int
    trials: list[Trial] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def real_steps(self) -> int:
        return sum(t.real for t in self.trials)

    @property
    def predictions(self) -> int:
        return sum(not t.real for t in self.trials)

    def row(self) -> dict:
        return {"strategy": self.strategy, "batch found": self.batch, "real steps": self.real_steps,
                "predictions": self.predictions, "seconds": round(self.seconds, 2),
                "trials": " ".join(f"{t.batch}{'' if t.real else 'p'}{'+' if t.fits else 'x'}" for t in self.trials)}


class Trainer:
    """A real model and optimizer on which trial steps of any batch size are run under a budget.

    Args:
        make_model, make_optimizer: as for ``gpukit.estimate.predict``.
        make_batch: ``make_batch(batch_size)`` builds a batch of that size.
        limit: the budget (bytes, or ``"4GB"``...).
        step: ``step(model, optimizer, batch)``.
        device: where the model lives and the budget applies.
    """

    def __init__(self, make_model: Callable[[], torch.nn.Module],
                 make_optimizer: Callable[[Any], torch.optim.Optimizer],
                 make_batch: Callable[[int], Any], limit: int | str, step: Callable = default_step,
                 device: str | torch.device | None = None, seed: int = 0) -> None:
        check_factories(make_model, make_optimizer, make_batch, batch="lambda b: (x[:b], y[:b])", copied=False)
        self.make_model, self.make_optimizer, self.make_batch, self.step = make_model, make_optimizer, make_batch, step
        self.limit = parse_bytes(limit)
        self.device = resolve_device(device)
        torch.manual_seed(seed)
        self.model = make_model().to(self.device)
        self.optimizer = make_optimizer(self.model.parameters())
        self.step(self.model, self.optimizer, self._batch(1))  # warm-up: gradients and optimizer state exist

    def _batch(self, b: int) -> Any:
        return map_tensors(lambda t: t.to(self.device), self.make_batch(b))

    def fits(self, b: int, limit: int | None = None) -> bool:
        """Run one real step of batch ``b`` under the budget: did it fit?"""
        ok = True
        # The collector keeps still during the trial (no garbage of before is freed inside the step), and what
        # the trial leaves (a failed step's tensors, held in cycles by its traceback) is all young after it.
        with gc_paused(full=False) as collect_young:
            try:
                with budget(self.limit if limit is None else limit, self.device):
                    self.step(self.model, self.optimizer, self._batch(b))
            except torch.OutOfMemoryError:
                ok = False
            # Outside the except block: the failed step's tensors went with its traceback.
            # Every trial starts from the same steady state: all gradients allocated.
            for p in self.model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            collect_young()
        return ok

    def other_bytes(self) -> int:
        """Bytes live on the device that are not the training state (a dataset on the CPU, say)."""
        with measure(self.device, record=False) as r:
            pass
        state, _ = state_bytes(self.model, self.optimizer, ())
        return r.live_end - state


def double_then_bisect(trainer: Trainer, start: int = 1, limit: int | None = None) -> Search:
    """Double until a step fails, then bisect between the last success and the first failure."""
    t0, trials = time.perf_counter(), []

    def fits(b):
        trials.append(Trial(b, trainer.fits(b, limit), True))
        return trials[-1].fits

    low, high = 0, start
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return Search("double, then bisect", low, trials, time.perf_counter() - t0)


def shrink_on_failure(trainer: Trainer, start: int = 4096, factor: float = 0.9) -> Search:
    """Start at ``start``; after each failure try ``int(batch * factor)``, until a step fits."""
    t0, trials, b = time.perf_counter(), [], start
    while b >= 1:
        trials.append(Trial(b, trainer.fits(b), True))
        if trials[-1].fits:
            break
        b = int(b * factor)
    return Search(f"shrink x{factor} on failure", max(b, 0), trials, time.perf_counter() - t0)


def predict_then_confirm(trainer: Trainer, margin: float = 0.05, max_batch: int = 1 << 20) -> Search:
    """Find the largest batch predicted to need at most ``(1 - margin)`` of the budget; confirm it for real.

    The predictions run under fake tensors: no memory, no real step. If the real
    confirmation fails (the prediction followed other code paths than the device's),
    the target shrinks by another ``margin`` and the search repeats.
    """
    t0, trials = time.perf_counter(), []
    other = trainer.other_bytes()

    def predicted_fit(b, target):
        need = predict(trainer.make_model, trainer.make_optimizer, lambda: trainer.make_batch(b), trainer.step).peak
        trials.append(Trial(b, need + other <= target, False))
        return trials[-1].fits

    target = trainer.limit * (1 - margin)
    while target > 0:
        if not predicted_fit(1, target):
            return Search("predict, then confirm", 0, trials, time.perf_counter() - t0)
        low, high = 1, 2
        while high <= max_batch and predicted_fit(high, target):
            low, high = high, high * 2
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if predicted_fit(mid, target) else (low, mid)
        trials.append(Trial(low, trainer.fits(low), True))
        if trials[-1].fits:
            return Search("predict, then confirm", low, trials, time.perf_counter() - t0)
        target -= trainer.limit * margin
    return Search("predict, then confirm", 0, trials, time.perf_counter() - t0)
