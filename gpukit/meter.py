"""measure(): how much memory a block of code allocates, on a GPU or on a CPU.

    with gpukit.measure() as report:
        loss = model(x).sum()
        loss.backward()
    report.peak   # bytes, exact

On CUDA the figures are the caching allocator's own statistics. On CPU they come
from gpukit's exact live-tensor counter (gpukit.counter), which keeps the same
accounting where the allocator's rules make it exact: bytes as requested, and
allocated bytes rounded up to 512 (exact for requests up to 1 MiB, a lower bound
above; see gpukit.counter), frees of tensors that existed before the block included.
"""

from __future__ import annotations

import time

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ._torch import TorchDispatchMode, active_fake_mode, in_backward
from .allocator import cpu_device
from .counter import FAKE_LEDGER, INTERRUPTS, LEDGER
from .report import MemoryReport, record
from .roles import RoleTracker

CPU_BACKEND = "exact live-tensor counter"
CUDA_BACKEND = "CUDA caching allocator"
SIMULATED_BACKEND = "fake-tensor counter (a simulated device: nothing is allocated)"
_BACKENDS = {"cpu": CPU_BACKEND, "meta": SIMULATED_BACKEND, "cuda": CUDA_BACKEND}


def default_device() -> torch.device:
    """The device gpukit measures when none is named: the current GPU if there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_device(device: str | torch.device | int | None) -> torch.device:
    """Turn ``None``, ``'cpu'``, ``'cuda'``, ``'cuda:1'``, ``1`` or a torch.device into a concrete device.

    Raises:
        ValueError: for a device gpukit cannot measure, or a GPU that is not there.
    """
    if device is None:
        return default_device()
    if type(device) is torch.device and device.index is None and device.type in ("cpu", "meta"):
        return device  # already what the lines below would make of it (a measure() per step asks this)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"not a device: {device!r} (use 'cpu', 'cuda' or 'cuda:N')") from err
    if dev.type in ("cpu", "meta"):
        return torch.device(dev.type)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but this machine has no CUDA GPU; "
                             "measure on 'cpu' (the default here) instead")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"no GPU cuda:{index}: this machine has {torch.cuda.device_count()}")
        return torch.device("cuda", index)
    raise ValueError(f"gpukit measures 'cpu', 'cuda' and 'meta' (a simulated device) devices, not {dev.type!r}")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "meta":
        return "meta (simulated GPU)"
    return "cpu"


class Phases:
    """Which part of a training step is running: 'forward', 'backward' (autograd's engine is
    running a graph) or 'optimizer' (inside any ``optimizer.step()``, through PyTorch's global
    optimizer hooks)."""

    def __init__(self) -> None:
        self.in_optimizer = 0
        self._handles = []

    def start(self) -> None:
        def pre(*_):
            self.in_optimizer += 1

        def post(*_):
            self.in_optimizer -= 1

        self._handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __call__(self) -> str:
        if self.in_optimizer:
            return "optimizer"
        return "backward" if in_backward() else "forward"


class _LedgerMeter:
    """Memory from a gpukit counter: real CPU memory (``LEDGER``), or a simulated device (``FAKE_LEDGER``
    counting tensors on 'meta', plain or fake under FakeTensorMode, which hold no memory, as a GPU would
    allocate them)."""

    def __init__(self, ledger, label: str | None, phases: Phases | None = None) -> None:
        self.ledger, self.label, self.phases = ledger, label, phases
        self.tally = self.sim = None

    def start(self, report: MemoryReport) -> None:
        sim = cpu_device() if self.ledger is LEDGER else None  # reserved memory, simulated (gpukit.allocator)
        # A timeline tags each change with the phase it happened in: booked as it happens.
        self.tally = tally = self.ledger.start(label=self.label, eager=self.phases is not None)
        if self.phases is not None:
            tally.events, tally.phase = [], self.phases
        ledger = self.ledger
        with ledger._lock:  # the level where this tally reads zero
            ledger.settle()
            report.live_start = (ledger._live_rounded if self.label is None
                                 else ledger.live_by_label.get(self.label, 0)) - tally.level
        self.sim = sim if sim is not None and ledger.listener is sim else None
        if self.sim is not None:
            report.reserved_simulated = True
            self.watch = sim.watch()  # reserved memory at the start: known when the device next runs

    def stop(self, report: MemoryReport) -> None:
        if self.tally is None:
            return
        self.ledger.stop(self.tally)
        _fill(report, self.tally)
        if self.sim is not None:
            report.reserved_peak = self.sim.unwatch(self.watch)
            report.reserved_start = self.watch[1]
            report.reserved_end = self.sim.reserved()


def _fill(report: MemoryReport, tally) -> None:
    report.peak, report.peak_unrounded = tally.peak, tally.peak_unrounded
    report.delta, report.delta_unrounded = tally.level, tally.level_unrounded
    report.live_end = report.live_start + tally.level
    if tally.events is not None:
        report.timeline = tally.events


class _AllocatedAfterEachOp(TorchDispatchMode):
    """The CUDA timeline: the allocator's allocated bytes after every op (a transient peak inside one
    op shows in ``report.peak``, which comes from the allocator's own peak counter, not here)."""

    def __init__(self, device: torch.device, start: int, phases: Phases) -> None:
        super().__init__()
        self.device, self.start, self.phases, self.events = device, start, phases, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.events.append((torch.cuda.memory_allocated(self.device) - self.start, self.phases()))
        return out


class _CudaMeter:
    """Reads the caching allocator's statistics.

    PyTorch keeps one resettable peak counter per device. To give nested blocks
    each their own peak, a block folds the counter's value into every enclosing
    block before it resets it, and folds it again when it ends.
    """

    _active: dict[int, list["_CudaMeter"]] = {}

    def __init__(self, device: torch.device, phases: Phases | None = None) -> None:
        self.device = device
        self.index = device.index
        self.max = {}
        self.phases = phases
        self.recorder = None

    _KEYS = {"allocated": "allocated_bytes.all", "requested": "requested_bytes.all",
             "reserved": "reserved_bytes.all"}

    def _fold(self, stats: dict) -> None:
        for key, stat in self._KEYS.items():
            self.max[key] = max(self.max.get(key, 0), stats.get(f"{stat}.peak", 0))

    def start(self, report: MemoryReport) -> None:
        stats = torch.cuda.memory_stats(self.index)
        active = self._active.setdefault(self.index, [])
        for outer in active:
            outer._fold(stats)
        torch.cuda.reset_peak_memory_stats(self.index)
        self.start_stats = {k: stats.get(f"{s}.current", 0) for k, s in self._KEYS.items()}
        self.max = dict(self.start_stats)
        active.append(self)
        report.live_start = self.start_stats["allocated"]
        report.reserved_start = self.start_stats["reserved"]
        if self.phases is not None:
            self.recorder = _AllocatedAfterEachOp(self.device, report.live_start, self.phases)
            self.recorder.__enter__()

    def stop(self, report: MemoryReport) -> None:
        if self.recorder is not None:
            self.recorder.__exit__(None, None, None)
            report.timeline = self.recorder.events
        stats = torch.cuda.memory_stats(self.index)
        active = self._active[self.index]
        for meter in active:
            meter._fold(stats)
        active.remove(self)
        now = {k: stats.get(f"{s}.current", 0) for k, s in self._KEYS.items()}
        start = self.start_stats
        report.peak = self.max["allocated"] - start["allocated"]
        report.peak_unrounded = self.max["requested"] - start["requested"]
        report.delta = now["allocated"] - start["allocated"]
        report.delta_unrounded = now["requested"] - start["requested"]
        report.live_end = now["allocated"]
        report.reserved_end = now["reserved"]
        report.reserved_peak = self.max["reserved"]


class measure:
    """Measure the memory a block of code allocates; use as ``with measure() as report:``.

    Args:
        device: what to measure: ``'cpu'``, ``'cuda'``, ``'cuda:N'``; default the
            current GPU if there is one, else the CPU. ``'meta'`` measures a simulated
            device: what tensors on ``meta`` (fake tensors under ``FakeTensorMode``
            among them) would allocate, for lessons that need a GPU beside the CPU.
            ``'cpu'`` inside ``FakeTensorMode``: what its fake CPU tensors would hold.
        label: a name for the report and its row in ``gpukit.history()``.
        model: with it (and ``optimizer``), the report breaks memory down by role
            (parameters, gradients, optimizer state, activations, temporaries).
        optimizer: the optimizer the block steps, for the role breakdown.
        record: append the report to the session history (``gpukit.history()``)
            when the block ends without an exception.
        timeline: also record the level after every allocation and free (on CUDA:
            after every op), with the phase of training it happened in, as
            ``report.timeline`` (plot it with ``gpukit.plots.timeline``).

    Returns (from ``__enter__``):
        A ``MemoryReport`` that is filled in when the block ends. Blocks can nest;
        each reports its own peak. A block that raises still restores everything
        and re-raises; its report is filled in but not recorded.

    On CUDA a block resets the device's peak counters (``torch.cuda.reset_peak_memory_stats``:
    PyTorch keeps one per device and offers no way to set it back), so after a block
    ``torch.cuda.max_memory_allocated()`` reports the peak since that block began, not since
    your own reset. Read your own peak before a measured block, or nest ``measure`` blocks,
    each of which keeps its own peak.

    Raises:
        ValueError: for a device gpukit cannot measure.
    """

    def __init__(self, device: str | torch.device | int | None = None, *, label: str | None = None,
                 model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 record: bool = True, timeline: bool = False) -> None:
        self.device = resolve_device(device)
        self.label = label
        self.record = record
        self._phases = Phases() if timeline else None
        self._roles = RoleTracker(self.device, model, optimizer) if (model or optimizer) else None
        self.report: MemoryReport | None = None

    def __enter__(self) -> MemoryReport:
        if self.report is not None:
            raise RuntimeError("a measure() object is used once; make a new one for each block")
        INTERRUPTS.hold()  # from here on, Ctrl-C waits until the block is fully open, or fully undone
        started = []
        try:
            kind = self.device.type
            backend = _BACKENDS[kind]
            self.report = MemoryReport(label=self.label, device=device_name(self.device), backend=backend)
            if kind == "cuda":
                self._meter = _CudaMeter(self.device, self._phases)
            else:
                if kind == "cpu" and active_fake_mode() is not None:
                    ledger, label = FAKE_LEDGER, "cpu"  # fake CPU tensors: what they would hold, counted
                else:
                    ledger, label = (LEDGER, None) if kind == "cpu" else (FAKE_LEDGER, "meta")
                self._meter = _LedgerMeter(ledger, label, self._phases)
            if self._phases is not None:
                self._phases.start()
                started.append(self._phases.stop)
            self._meter.start(self.report)
            started.append(lambda: self._meter.stop(self.report))
            if self._roles is not None:
                self._roles.start()
                started.append(lambda: self._roles.stop((None, None, None)))
            self._t0 = time.perf_counter()
            INTERRUPTS.deliver()  # one that came while opening: undo, then raise it
        except BaseException:
            try:
                for undo in reversed(started):
                    undo()
            finally:
                INTERRUPTS.release()
            raise
        return self.report

    def __exit__(self, exc_type, exc, tb) -> bool:
        report = self.report
        try:
            if self.device.type == "cuda" and exc_type is None:
                torch.cuda.synchronize(self.device)  # the block's kernels have finished: time is real
            report.seconds = time.perf_counter() - self._t0
            try:
                if self._roles is not None:
                    self._roles.stop((exc_type, exc, tb))
                    report.roles_peak, report.roles_end = self._roles.peak, self._roles.end
            finally:
                try:
                    self._meter.stop(report)
                finally:
                    if self._phases is not None:
                        self._phases.stop()
        finally:
            INTERRUPTS.release()  # an interrupt held back while closing is raised here
        if exc_type is None and self.record:
            record(report)
        return False


INTERRUPTS.protect(measure.__enter__, measure.__exit__, _LedgerMeter.start, _LedgerMeter.stop, _fill,
                   Phases.start, Phases.stop)
