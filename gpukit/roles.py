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

from functools import partial
from typing import Any, Callable

import torch

from ._torch import _TOTAL_KEY, MemTracker, _MemRefType, _ModState, tree_map_only

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


class _StepTracker(MemTracker):
    """MemTracker that accepts the model being run several times in one block.

    MemTracker refuses a second forward of the root module (it keeps per-module
    statistics for one iteration); gradient accumulation does exactly that. gpukit
    reads only the totals by role, so the per-module statistics are reset instead.
    """

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:
                self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)
        stats = self.memory_tracking.get(module)
        if stats is not None:
            by_fqn = self.__dict__.setdefault("_stats_by_fqn", {})
            entries = by_fqn.setdefault(stats.mod_fqn, [])
            if all(s is not stats for s in entries):
                entries.append(stats)

    # Set by predictions, whose steps hold no DTensor and no nested fake mode: after every op MemTracker
    # then needs neither its search for the active fake mode nor a pytree walk of the outputs (a third of
    # a 6.7-billion-parameter GPT's prediction went there).
    plain_tensors_only = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.plain_tensors_only or not hasattr(self, "_fake_mode_on_entry"):
            return super().__torch_dispatch__(func, types, args, kwargs)
        res = func(*args, **(kwargs or {}))
        if self._in_opt:
            reftype = _MemRefType.OPT
        elif self._mod_tracker.is_bw and not self._in_ac:
            reftype = _MemRefType.TEMP
        else:
            reftype = _MemRefType.ACT
        if isinstance(res, torch.Tensor):
            self._track(reftype, res)
        elif isinstance(res, (tuple, list)):
            for r in res:
                if isinstance(r, torch.Tensor):
                    self._track(reftype, r)
                elif isinstance(r, (tuple, list)):
                    tree_map_only(torch.Tensor, partial(self._track, reftype), r)
        self._update_peak_stats(_ModState.PEAK_BW if self._mod_tracker.is_bw else _ModState.PEAK_FW)
        return res

    def reset_mod_stats(self) -> None:
        super().reset_mod_stats()
        self._stats_by_fqn = {}

    def _update_peak_stats(self, peak_state) -> None:
        """MemTracker's own update, visiting only the modules now running.

        MemTracker walks the statistics of every module it has seen after every op, which
        made a 6.7-billion-parameter GPT's prediction spend 28 of its 42 s here; only the
        modules in ``parents`` can change, so the result is the same. A snapshot maps names
        to integers, so a dict copy is the deep copy MemTracker makes.
        """
        curr_snap = self._curr_mem_snap
        by_fqn = self.__dict__.get("_stats_by_fqn", {})
        for fqn in self._mod_tracker.parents:
            for mod_stats in by_fqn.get(fqn, ()):
                if peak_state in mod_stats.snapshots:
                    for dev, dev_snap in curr_snap.items():
                        if mod_stats.local_peak.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                            mod_stats.local_peak[dev] = dev_snap[_TOTAL_KEY]
                            mod_stats.snapshots[peak_state][-1][dev] = dict(dev_snap)
        for dev, dev_snap in curr_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(dev_snap)


class RoleTracker:
    """Tracks memory by role inside a block; ``start`` / ``stop`` around it."""

    def __init__(self, device: torch.device, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        if model is None and optimizer is None:
            raise ValueError("a role breakdown needs the model (and optimizer) the block trains")
        self.device = device
        self._tracked = [obj for obj in (model, optimizer) if obj is not None]
        self._tracker: _StepTracker | None = None
        self._end: dict[str, int] | None = None

    def start(self, plain_tensors_only: bool = False) -> None:
        self._tracker = _StepTracker()
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
    tracker = MemTracker()
    tracker.track_external(*existing)
    dev = torch.device(device)
    start = tracker.get_tracker_snapshot()[dev]["Total"]
    with tracker:
        run()
    return tracker.get_tracker_snapshot("peak")[dev]["Total"] - start
