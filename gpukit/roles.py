"""Memory by role (parameters, gradients, optimizer state, activations...).

A thin wrapper over PyTorch's own ``MemTracker``
(``torch.distributed._tools.mem_tracker``), which tags each storage by how it
arose: module parameters and buffers, gradients (through hooks on the
parameters), optimizer state (through optimizer step hooks), activations (made
in forward) and temporaries (made in backward). It is a private module, so
tests/test_roles.py pins the behaviour gpukit relies on.

At the peak, "optimizer state" includes the temporaries of ``optimizer.step()``:
MemTracker tags everything allocated inside the step that way. At the end of the
block it is the state alone (Adam: two tensors the size of the parameters, plus a
step count per tensor).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import _torch  # its trackers load on first use (they import torch.distributed._tools)

# MemTracker's names -> gpukit's names (report.ROLES)
_NAMES = {
    "Parameter": "parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Optstate": "optimizer state",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "other",
}


class RoleTracker:
    """Tracks memory by role inside a block; ``start`` / ``stop`` around it."""

    def __init__(self, device: torch.device, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        if model is None and optimizer is None:
            raise ValueError("a role breakdown needs the model (and optimizer) the block trains")
        self.device = device
        self._tracked = [obj for obj in (model, optimizer) if obj is not None]
        self._tracker = None
        self._end: dict[str, int] | None = None

    def start(self, plain_tensors_only: bool = False) -> None:
        self._tracker = _torch.StepTracker()
        self._tracker.plain_tensors_only = plain_tensors_only
        self._tracker.track_external(*self._tracked)
        self._tracker.__enter__()

    def stop(self, exc_info=(None, None, None)) -> None:
        tracker = self._tracker
        # Re-tag by what the storages are now: gradients made by a backward whose
        # forward ran before the block are otherwise tagged as temporaries.
        tracker.track_external(*self._tracked)
        tracker.__exit__(*exc_info)
        self._end = self._by_role(tracker.get_tracker_snapshot("current"))
        self._peak = self._by_role(tracker.get_tracker_snapshot("peak"))

    def _by_role(self, snapshot: dict) -> dict[str, int]:
        dev_snap = {}
        for dev, values in snapshot.items():
            if torch.device(dev).type == self.device.type:
                dev_snap = values
        return {_NAMES[str(k.value)]: int(v) for k, v in dev_snap.items()
                if hasattr(k, "value") and str(k.value) in _NAMES}

    def module_stats(self):
        """MemTracker's per-module statistics (parameter_mem, output_mem, ...) of the last block."""
        return self._tracker.memory_tracking

    @property
    def peak(self) -> dict[str, int]:
        return self._peak

    @property
    def end(self) -> dict[str, int]:
        return self._end


def memtracker_peak(run: Callable[[], Any], *existing: Any, device: str | torch.device = "cpu") -> int:
    """The peak bytes of ``run()`` above its start, measured by PyTorch's ``MemTracker`` alone.

    An independent check of gpukit's counter: MemTracker is PyTorch's own tool, with its own
    dispatch mode and its own bookkeeping of storages. Sizes are as requested (not rounded).

    Args:
        run: the code to measure (one training step, say).
        existing: modules, optimizers and tensors that exist before ``run``, so that their
            frees inside it count (the model, its optimizer, the batch).
        device: whose memory to read.
    """
    tracker = _torch.MemTrackerThatLetsGo()
    tracker.track_external(*existing)
    dev = torch.device(device)
    start = tracker.get_tracker_snapshot()[dev]["Total"]
    with tracker:
        run()
    return tracker.get_tracker_snapshot("peak")[dev]["Total"] - start
