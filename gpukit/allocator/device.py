"""The simulated device fed by gpukit's counter: a ``CachingAllocator`` that follows every storage the counter
sees made and freed (``SimulatedDevice``), the one behind ``measure()`` on a CPU (``cpu_device``), and the replay of
its recorded events on another capacity (``replay_events``). What ``torch.cuda``'s calls would read from one, each
block whole (the predictions' CUDA figures): ``gpukit.allocator.reads``."""

from __future__ import annotations

import threading

import torch

from .caching import POOL_NAMES, CachingAllocator, format_size
from .config import CONTEXT_ALLOWANCE, AllocatorConfig


class SimulatedDevice:
    """A simulated GPU fed by a gpukit counter: every storage it sees allocated is ``malloc``-ed here,
    every storage it sees die is freed, so reserved memory follows the program as on CUDA.

    Attach it to a ``gpukit.counter.Ledger`` (``attach``); storages the ledger already knows are
    placed first, in the order it learnt of them. ``measure()`` on a CPU uses one per process
    (``cpu_device()``); ``predict()`` one per prediction.

    The counter's events are queued and run through the allocator in order, as one *unit*, whenever the
    device is read (``allocator``, ``reserved()``, ``watch``/``unwatch``: each ``measure()`` block reads it
    at its start and end). A unit that comes again, from the state it left the allocator in before (the
    steady state of a training loop: each step makes and frees the same sizes, in the same order, and ends
    where it began), is not run again: the allocator is deterministic, so the outcome recorded the first
    time (every address, every statistic, the peak of reserved memory) is applied instead. A unit is
    recorded only after its signature was seen before, and only where the state before and after it compare
    equal (``CachingAllocator.state_key``); any other call on the allocator (``generation``) or a change of
    its settings voids the record. ``lazy=False`` runs each event when it happens, and so does a device
    under a cap (``budget(..., reserved=True)``), whose out-of-memory error must come from the allocation
    that causes it.

    Like a real GPU, it holds a CUDA context besides the allocator's memory: ``context_bytes``, by default
    ``CONTEXT_ALLOWANCE`` (1 GiB, the allowance ``plan()`` and ``predict()`` use), which counts against the
    capacity and shows in ``mem_get_info()``, ``nvidia_smi_bytes()`` and the OOM message, never in reserved
    memory.
    """

    _MAX_QUEUE = 1 << 16  # events queued before the device runs them unasked
    _MAX_UNITS = 8  # signatures kept, of units seen and of units recorded (a long step's is long)
    _MAX_WAIT = 64  # a unit that repeats without leaving the state unchanged is checked again after 1, 2, 4...
    # Whether an allocation the device cannot hold raises CUDA's out-of-memory error (a run on a simulated card,
    # gpukit.oncard.on_card) rather than stopping the simulation (a real CPU program bigger than the device).
    raise_oom = False

    def __init__(self, total_memory: int | str = 80 * 1024**3, config: str | AllocatorConfig | None = None, *,
                 context_bytes: int | str = CONTEXT_ALLOWANCE, record_events: bool = False,
                 lazy: bool = True, only: str | None = None, allocator: CachingAllocator | None = None) -> None:
        # ``allocator``: one this device shares with another (a card followed by two counters: its real tensors'
        # and a block's fake ones, gpukit.simulated); its capacity and settings are its own, the others ignored.
        self._alloc = allocator if allocator is not None else CachingAllocator(total_memory, config,
                                                                               context_bytes=context_bytes)
        # Only the storages a fake counter sees on this device (its tensors' device type, as the counter labels
        # them: gpukit.offload's simulated GPU beside its host); None: every storage the counter sees.
        self.only = only
        self.addr: dict[int, int] = {}  # the ledger's storage key -> simulated address
        self.peaks: list[list[int]] = []  # [peak reserved] of each block watching
        self.events: list | None = [] if record_events else None  # ("a", key, nbytes) / ("f", key)
        self.ledger = None
        self.failed = False  # interrupted mid-update (Ctrl-C): detached, its state no longer trusted
        self.lazy = lazy and not record_events
        self._queue: list[tuple[int, int]] = []  # (key, nbytes) of an allocation, (key, 0) of a free
        self._lock = threading.RLock()  # the ledger's lock while attached: the one its events come under
        self._state = None  # the allocator's state_key(), when known: valid at generation _state_gen
        self._state_gen = -1  # ... and while the settings and sizes _settings() gives are those it was taken with
        self._state_settings: tuple = ()
        self._memo_state = None  # the state that every recorded unit starts and ends in
        self._memo: dict[tuple, tuple] = {}  # a unit's signature -> its outcome
        self._seen: dict[tuple, list[int]] = {}  # signature of a unit run -> [runs to wait, next wait]
        self.units_run = 0  # units the allocator ran
        self.units_reused = 0  # units whose recorded outcome was applied
        # The allocator's peaks serve two readers (gpukit.allocator.reads): a prediction's step peak, from the step's
        # start, and the step's own torch.cuda.max_memory_*() calls, from the process's start or their own reset.
        # Each reset for one keeps what the peaks had reached for the other: allocated, and (reads) reserved.
        self.step_floor = 0
        self.read_floors = (0, 0)

    @property
    def allocator(self) -> CachingAllocator:
        """The simulated allocator, up to date: every storage that died is freed, every event applied."""
        self._catch_up()
        return self._alloc

    def memory_summary(self, abbreviated: bool = False) -> str:
        """``torch.cuda.memory_summary()`` of the simulated GPU, up to date (``CachingAllocator.memory_summary``)."""
        return self.allocator.memory_summary(abbreviated)

    def reserved(self) -> int:
        """Reserved memory now (``torch.cuda.memory_reserved()``)."""
        self._catch_up()
        return self._alloc.memory_reserved()

    def _catch_up(self) -> None:
        if self.ledger is not None:
            self.ledger.settle()  # frees of storages that died since the counter last did its books
        self.flush()

    def attach(self, ledger, place: bool = True) -> "SimulatedDevice":
        """Follow ``ledger`` from now on; ``place``: the storages it already knows are placed first (else they are
        left out, and so are their frees)."""
        if ledger.listener is not None and ledger.listener is not self:
            raise RuntimeError("this counter already drives another simulated device; detach it first")
        self.flush()
        ledger.settle()  # storages that died since the counter last did its books are not adopted
        ledger.listener = self
        self.ledger = ledger
        self._lock = ledger._lock
        for key, nbytes in list(ledger.sizes.items()) if place else ():
            if key not in self.addr and self.only in (None, ledger.labels.get(key)):
                self.on_alloc(key, nbytes, False)
        return self

    def detach(self) -> None:
        if self.ledger is not None and self.ledger.listener is self:
            self.flush()
            self.ledger.listener = None
        self.ledger = None

    def _fail(self) -> None:
        self.failed = True
        queue, self._queue = self._queue, []
        self._mark([key for key, nbytes in queue if nbytes < 0], None)
        self.detach()

    def _mark(self, cells: list, marks: tuple | None) -> None:
        """Fill the cells of blocks that began inside a unit (``watch``): their reserved memory at the start and
        its peak since (``marks``, or where the device stopped simulating, its reserved memory now), and
        follow their peaks from here on."""
        for i, cell in enumerate(cells):
            if marks is None:
                cell[0] = cell[1] = self._alloc.memory_reserved()
            else:
                cell[1], cell[0] = marks[i]
            self.peaks.append(cell)

    # -- the counter's events ------------------------------------------------------------------------------

    def on_alloc(self, key: int, nbytes: int, counted: bool = True) -> None:
        """A storage of ``nbytes`` was made (``counted``) or found (an existing one, adopted).

        Raises:
            SimulatedOutOfMemoryError: when the simulated device cannot hold a new storage under a cap.
        """
        if nbytes <= 0:  # CUDA hands out no block for an empty storage
            return
        if self.lazy and self._alloc.allowed_memory_maximum is None:
            self._enqueue(key, nbytes)  # made in a block, or found (adopted): the same malloc, in its turn
            return
        self.flush()
        self._alloc_now(key, nbytes, counted)

    def event_queue(self) -> list | None:
        """The list a counter may append its events to directly, ``(key, nbytes)`` of an allocation (of more than
        0 bytes) and ``(key, 0)`` of a free, calling ``event_queued`` after: as ``on_alloc`` and ``on_free``
        would, without a call per event. None where each event must go through them (no queue: not lazy, a
        cap, or no longer simulating)."""
        if self.lazy and self._alloc.allowed_memory_maximum is None and not self.failed:
            return self._queue
        return None

    def event_queued(self) -> None:
        """Events were appended to ``event_queue()``: run them if the queue is long."""
        if len(self._queue) >= self._MAX_QUEUE:
            self.flush()

    def _enqueue(self, key: int, nbytes: int) -> None:
        queue = self._queue
        queue.append((key, nbytes))
        if len(queue) >= self._MAX_QUEUE:
            self.flush()

    def _alloc_now(self, key: int, nbytes: int, counted: bool) -> None:
        if self.failed:
            return
        alloc = self._alloc
        try:
            a = alloc.malloc(nbytes)
        except torch.OutOfMemoryError:
            if counted and (alloc.allowed_memory_maximum is not None or self.raise_oom):
                raise  # a cap the user set (budget(..., reserved=True)), or a card a block runs on: the lesson's OOM
            self._too_small()
            return
        except BaseException:  # interrupted half-way (KeyboardInterrupt): stop following rather than drift
            self._fail()
            raise
        old = self.addr.get(key)
        self.addr[key] = a
        if old is not None:  # the key of a storage that died unseen
            alloc.free(old)
        if self.events is not None:
            self.events.append(("a", key, nbytes))
        self._raise_peaks(alloc.stats[5][0][0])  # reserved_bytes.all.current

    def on_resize(self, key: int, nbytes: int) -> None:
        """A storage changed size: like the allocator, the new block exists before the old is freed."""
        self.flush()
        old = self.addr.pop(key, None)
        try:
            if nbytes > 0:
                self._alloc_now(key, nbytes, True)
        except BaseException:
            if old is not None:
                self.addr[key] = old
            raise
        if old is not None:
            self._alloc.free(old)
            if self.events is not None:
                self.events.append(("f", key))

    def on_free(self, key: int) -> None:
        if self.lazy:
            self._enqueue(key, 0)
            return
        a = self.addr.pop(key, None)
        if a is not None:
            try:
                self._alloc.free(a)
            except BaseException:  # called from a weakref callback: never let a broken state repeat
                self._fail()
                raise
            if self.events is not None:
                self.events.append(("f", key))

    def _too_small(self) -> None:
        # The simulated GPU is smaller than what the program really holds: never fail a real run for that;
        # stop simulating, and say so.
        import warnings

        warnings.warn(f"the simulated GPU ({format_size(self._alloc.total_memory)}) cannot hold this process's "
                      "tensors: reserved memory is no longer simulated (a bigger one: "
                      "gpukit.allocator.reset_cpu_device(total_memory=...))", RuntimeWarning, stacklevel=3)
        self._fail()

    # -- running the queue ---------------------------------------------------------------------------------

    def flush(self) -> None:
        """Run the queued events through the allocator (or apply the recorded outcome of the same unit)."""
        if not self._queue:
            return
        with self._lock:
            queue = self._queue
            if not queue or self.failed:
                return
            self._queue = []
            try:
                self._run(queue)
            except BaseException:  # interrupted half-way (KeyboardInterrupt): stop following rather than drift
                self._fail()
                raise

    def _settings(self) -> tuple:
        """What a caller can change by assignment, without a call that bumps ``generation``."""
        a = self._alloc
        return a.config, a.total_memory, a.context_bytes  # configs compare by their fields

    def _state_known(self) -> bool:
        """Whether ``_state`` is the allocator's state now: nothing called on it, nothing assigned, since."""
        return (self._state is not None and self._alloc.generation == self._state_gen
                and self._settings() == self._state_settings)

    def _plain(self) -> bool:
        """Whether the allocator is in a state a recorded unit can stand for: no cap (and so no garbage
        collection), no trace to write, no blocks waiting for other streams, addresses of its own."""
        a = self._alloc
        return (a.allowed_memory_maximum is None and a.trace is None and not a.pending
                and a.address_source is None)

    def _run(self, queue: list[tuple[int, int]]) -> None:
        alloc, addr = self._alloc, self.addr
        # The unit's signature: each allocation's size (an int above 0; with the block it replaces, a storage
        # that died unseen, a pair), each free's block: one the unit made by its number in the unit (-1 - i),
        # an older one by its address (a 1-tuple). Keys (storage ids) differ from step to step; this does not.
        # Plain ints for the common events: the signature is built, hashed and compared every unit.
        sig: list = []
        mine: dict[int, int] = {}  # key -> number of the unit's allocation that still holds it
        gone: set[int] = set()  # keys of older storages the unit freed
        cells: list = []  # the cells of blocks that began in the unit (watch), in order: None in the signature
        n = 0
        for key, nbytes in queue:
            if nbytes < 0:
                sig.append(None)
                cells.append(key)
            elif nbytes:
                i = mine.get(key)
                if i is not None:
                    sig.append((nbytes, -1 - i))
                elif key not in gone and key in addr:
                    gone.add(key)
                    sig.append((nbytes, addr[key]))
                else:
                    sig.append(nbytes)
                mine[key] = n
                n += 1
            else:
                i = mine.pop(key, None)
                if i is not None:
                    sig.append(-1 - i)
                elif key not in gone:
                    a = addr.get(key)
                    if a is not None:
                        gone.add(key)
                        sig.append((a,))
        if not sig:
            return
        sig = tuple(sig)
        outcome = None
        if self._state is self._memo_state and self._state_known() and self._plain():
            outcome = self._memo.get(sig)
        if outcome is not None:
            self._apply(outcome)
            self.units_reused += 1
        else:
            seen = self._seen.get(sig)
            candidate = seen is not None and seen[0] == 0 and self._plain()
            if seen is not None and seen[0] > 0:
                seen[0] -= 1
            if candidate:
                before = self._state if self._state_known() else alloc.state_key()
            outcome = self._replay(sig)
            if outcome is None:  # the simulated GPU is too small: no longer simulating
                self._mark(cells, None)
                return
            self.units_run += 1
            if candidate:
                after = alloc.state_key()
                if after == self._memo_state:
                    after = self._memo_state
                self._state, self._state_gen, self._state_settings = after, alloc.generation, self._settings()
                if after == before:  # the unit left the allocator as it found it: record it
                    if after is not self._memo_state or len(self._memo) >= self._MAX_UNITS:
                        self._memo, self._memo_state = {}, after
                    self._memo[sig] = outcome
                    self._seen.clear()
                else:  # the same events, a state that moves (a leak): comparing states costs, so less often
                    seen[0], seen[1] = seen[1], min(2 * seen[1], self._MAX_WAIT)
            else:
                self._state = None
                if seen is None:
                    if len(self._seen) >= self._MAX_UNITS:
                        self._seen.clear()
                    self._seen[sig] = [0, 1]
        addrs = outcome[0]
        for key in gone:
            del addr[key]
        for key, i in mine.items():
            addr[key] = addrs[i]
        self._raise_peaks(outcome[3])  # blocks open before the unit
        if cells:
            self._mark(cells, outcome[4])

    def _cells(self) -> list[list[int]]:
        a = self._alloc
        return [s for stat in a.stats for s in stat] + [a.oversize_allocations, a.oversize_segments]

    def _replay(self, sig: tuple) -> tuple | None:
        """Run one unit through the allocator; its outcome: (addresses, per statistic (its peak in the unit,
        what it added to allocated and freed), counters' changes, reserved memory's peak in the unit, and for
        each block that began in it (None) reserved memory there and its peak from there on)."""
        alloc = self._alloc
        malloc, free = alloc.malloc, alloc.free
        reserved = alloc.stats[5][0]  # reserved_bytes.all: [current, peak, allocated, freed]
        marks: list[list[int]] = []
        cells = self._cells()
        saved = [(s[1], s[2], s[3]) for s in cells]
        for s in cells:
            s[1] = s[0]  # each statistic's peak, from here on: the unit's own
        counters = dict(alloc.counters)
        addrs: list[int] = []
        too_small = False
        try:
            for e in sig:
                if e.__class__ is int:
                    if e < 0:
                        free(addrs[-1 - e])
                        continue
                    addrs.append(malloc(e))
                elif e is None:
                    marks.append([reserved[0], reserved[0]])
                    continue
                elif len(e) == 1:
                    free(e[0])
                    continue
                else:
                    addrs.append(malloc(e[0]))
                    old = e[1]
                    free(addrs[-1 - old] if old < 0 else old)
                for m in marks:  # only a malloc raises reserved memory
                    if reserved[0] > m[1]:
                        m[1] = reserved[0]
        except torch.OutOfMemoryError:
            too_small = True
        finally:
            in_unit = [s[1] for s in cells]
            for s, (peak, _, _) in zip(cells, saved):
                if peak > s[1]:
                    s[1] = peak
        if too_small:
            self._too_small()
            return None
        stats = tuple((p, s[2] - a, s[3] - f) for s, p, (_, a, f) in zip(cells, in_unit, saved))
        changed = tuple((k, v - counters[k]) for k, v in alloc.counters.items() if v != counters[k])
        return (tuple(addrs), stats, changed, in_unit[5 * len(POOL_NAMES)],  # reserved_bytes.all
                tuple((start, peak) for start, peak in marks))

    def _apply(self, outcome: tuple) -> None:
        """What replaying a recorded unit from the state it starts and ends in would do to the statistics."""
        stats, changed = outcome[1], outcome[2]
        for s, (peak, allocated, freed) in zip(self._cells(), stats):
            if peak > s[1]:
                s[1] = peak
            s[2] += allocated
            s[3] += freed
        counters = self._alloc.counters
        for k, v in changed:
            counters[k] += v

    # -- peaks of blocks -----------------------------------------------------------------------------------

    def _raise_peaks(self, reserved: int) -> None:
        for p in self.peaks:
            if reserved > p[0]:
                p[0] = reserved

    def reset_peaks(self, for_reads: bool) -> None:
        """Reset the allocator's peaks for one of their readers, keeping what they had reached for the other:
        ``for_reads`` (the step's ``torch.cuda.reset_peak_memory_stats()``) keeps the allocated peak for the
        prediction's step peak (``step_floor``); else (a prediction's step starts: ``reads.WholeBlocks``) both peaks
        are kept for the step's own reads (``read_floors``), which run from the process's start."""
        alloc = self.allocator
        if for_reads:
            self.step_floor = max(self.step_floor, alloc.max_memory_allocated())
            self.read_floors = (0, 0)
        else:
            self.read_floors = (max(self.read_floors[0], alloc.max_memory_allocated()),
                                max(self.read_floors[1], alloc.max_memory_reserved()))
            self.step_floor = 0
        alloc.reset_peak_stats()

    def watch(self) -> list[int]:
        """Start following the peak of reserved memory; returns the [peak, reserved at the start] cell to read
        and ``unwatch``. Where events are queued, the start is a mark in the queue, filled when the queue runs:
        the events before and after it then run as one unit (a block and what happened since the last one:
        the same each step of a loop, and so reused)."""
        cell = [0, 0]
        if self.ledger is not None:
            self.ledger.settle()  # frees of storages that died since the counter last did its books
        if self._queue and self.lazy and self._alloc.allowed_memory_maximum is None and not self.failed:
            self._queue.append((cell, -1))
        else:
            self.flush()
            cell[0] = cell[1] = self._alloc.memory_reserved()
            self.peaks.append(cell)
        return cell

    def unwatch(self, cell: list[int]) -> int:
        """Stop following a block's peak; returns it (and fills the cell's start)."""
        self._catch_up()
        for i, c in enumerate(self.peaks):
            if c is cell:  # this block's cell: another block's may hold the same number
                del self.peaks[i]
                break
        return cell[0]


_CPU_DEVICE: SimulatedDevice | None = None
_CPU_SIMULATION = True


def set_cpu_simulation(enabled: bool) -> None:
    """Turn the simulated GPU behind ``measure()`` on CPU on or off (off: allocated bytes only)."""
    global _CPU_SIMULATION, _CPU_DEVICE
    _CPU_SIMULATION = bool(enabled)
    if not enabled and _CPU_DEVICE is not None:
        _CPU_DEVICE.detach()
        _CPU_DEVICE = None


def cpu_device() -> SimulatedDevice | None:
    """The simulated GPU that follows this process's CPU tensors (what ``measure()`` on CPU reports);
    None when ``set_cpu_simulation(False)`` turned it off."""
    global _CPU_DEVICE
    if not _CPU_SIMULATION:
        return None
    if _CPU_DEVICE is None or _CPU_DEVICE.failed:  # a device whose update was interrupted starts afresh
        from ..counter import LEDGER

        _CPU_DEVICE = SimulatedDevice().attach(LEDGER)
    else:
        from ..counter import LEDGER

        LEDGER.settle()  # frees of storages that died since the counter last counted: read an up-to-date device
    return _CPU_DEVICE


def reset_cpu_device(total_memory: int | str = 80 * 1024**3, config: str | AllocatorConfig | None = None, *,
                     context_bytes: int | str = CONTEXT_ALLOWANCE, lazy: bool = True) -> SimulatedDevice:
    """Start the CPU's simulated GPU afresh, with a capacity and ``PYTORCH_CUDA_ALLOC_CONF`` settings
    (``lazy=False``: every event run when it happens, and no unit reused; see ``SimulatedDevice``), holding
    a CUDA context of ``context_bytes`` (1 GiB unless told otherwise, as ``SimulatedDevice``).

    Raises:
        ValueError: for a size or setting that is not allowed.
    """
    fresh = SimulatedDevice(total_memory, config, context_bytes=context_bytes, lazy=lazy)
    return use_cpu_device(fresh)


def use_cpu_device(device: SimulatedDevice, place: bool = True) -> SimulatedDevice:
    """Make ``device`` the simulated GPU behind ``measure()`` on CPU, in place of the one there was; ``place``:
    every CPU storage the process holds is placed on it first (False: only what is made from now on). Those made
    outside any measured block are found first, as a block's start finds them: else the next block's start would
    place them on the device inside that block, as if the block had allocated them."""
    global _CPU_DEVICE
    from ..counter import LEDGER

    if _CPU_DEVICE is not None:
        _CPU_DEVICE.detach()
    _CPU_DEVICE = None
    if place:
        with LEDGER._lock:
            LEDGER.settle()
            LEDGER.adopt_existing()
    _CPU_DEVICE = device.attach(LEDGER, place=place)
    return device


class follow:
    """``with follow(ledger) as device:``: a simulated GPU that follows every allocation and free the
    ledger sees during the block (its counting is on throughout), recording them in ``device.events``.
    ``predict()`` runs under ``follow(FAKE_LEDGER, fresh=True)`` to give reserved memory at the peak; ``only="meta"``:
    the storages of the fake tensors on ``meta`` alone (``predict_offload``'s simulated GPU, beside its host).
    ``fresh``: the storages that exist when the block begins are left out (a prediction's GPU runs its step alone).
    """

    def __init__(self, ledger, total_memory: int | str = 2**60,
                 config: str | AllocatorConfig | None = None, *, only: str | None = None,
                 fresh: bool = False) -> None:
        # no capacity by default: what a run would reserve, whatever its size (will_it_fit replays it per GPU)
        self.ledger = ledger
        self.device = SimulatedDevice(total_memory, config, record_events=True, only=only)
        self.fresh = fresh

    def __enter__(self) -> SimulatedDevice:
        if self.fresh:
            # A device of its own run alone: what exists when the block begins (fake tensors of other work, garbage
            # held by a reference cycle until the collector runs) is found before the device listens, never placed.
            self._tally = self.ledger.start()
            try:
                self.device.attach(self.ledger, place=False)
            except BaseException:
                self.ledger.stop(self._tally)
                raise
            return self.device
        self.device.attach(self.ledger)
        try:
            self._tally = self.ledger.start()
        except BaseException:
            self.device.detach()
            raise
        return self.device

    def __exit__(self, *exc) -> bool:
        try:
            self.ledger.stop(self._tally)
        finally:
            self.device.detach()
        return False


def apply_events(allocator: CachingAllocator, events, addr: dict[int, int]) -> None:
    """Run recorded ``SimulatedDevice`` events on ``allocator``: ``addr`` maps each live key to its address, and
    holds what is still allocated after them (a key allocated again frees its earlier block, as
    ``SimulatedDevice`` frees the storage of a key that died unseen)."""
    malloc, free = allocator.malloc, allocator.free
    for e in events:
        if e[0] == "a":
            a = malloc(e[2])
            old = addr.get(e[1])
            addr[e[1]] = a
            if old is not None:
                free(old)
        else:
            a = addr.pop(e[1], None)
            if a is not None:
                free(a)


def replay_events(events, total_memory: int, *, context_bytes: int = CONTEXT_ALLOWANCE,
                  config: str | AllocatorConfig | None = None) -> tuple[bool, int, CachingAllocator]:
    """Run recorded ``SimulatedDevice`` events on a device of ``total_memory`` bytes.

    Returns:
        (whether every allocation succeeded, the peak of reserved memory, the allocator).
    """
    sim = CachingAllocator(total_memory, config, context_bytes=context_bytes)
    try:
        apply_events(sim, events, {})
    except torch.OutOfMemoryError:
        return False, sim.max_memory_reserved(), sim
    return True, sim.max_memory_reserved(), sim
