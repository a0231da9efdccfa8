"""torch.cuda's memory calls on a machine without a GPU: ``SimulatedCuda``, a simulated card that follows this
process's tensors (``gpukit.oncard`` runs a block at the card's own sizes on fake tensors).

    import torch, gpukit
    cuda = torch.cuda if torch.cuda.is_available() else gpukit.SimulatedCuda("t4")

    cuda.reset_peak_memory_stats()
    loss = model(x).sum(); loss.backward(); opt.step()
    print(cuda.max_memory_allocated() / 2**20, "MiB")   # the GPU's own figure, or the simulated T4's
    print(cuda.memory_summary(abbreviated=True))
    cuda.memory._record_memory_history()                 # a snapshot that PyTorch's memory_viz opens
    ...
    cuda.memory._dump_snapshot("step.pickle")

On a GPU ``cuda`` is ``torch.cuda`` itself, so the same lines are what a student pastes into their own loop. Without
one, ``SimulatedCuda`` answers them from gpukit's simulation of the CUDA caching allocator (``gpukit.allocator``),
sized as the card (a T4's 14.58 GiB unless told otherwise) and fed by gpukit's exact live-tensor counter: every
tensor made on this CPU from the moment the card is made is placed on it, as if it had been made on the GPU. The
figures are then a real GPU's for the same program, to the byte where the allocator's rules are knowable (the
counter's sizes: gpukit.counter); what a GPU adds that a CPU never runs (cuBLAS workspaces, cuDNN's) is not there.

``with gpukit.on_card(cuda):`` runs a block at the card's own sizes on it: gpukit.oncard.
"""

from __future__ import annotations

import collections
import os
import pickle
import sys
import threading
import time
import types

import torch

from .allocator import CachingAllocator, SimulatedDevice, use_cpu_device
from .allocator.device import reset_cpu_device
from .cards import Card, card as card_named, rehearsed_card
from .counter import FAKE_LEDGER, INTERRUPTS, LEDGER

__all__ = ["CardDevice", "SimulatedCuda", "simulated_cuda"]

DEFAULT_CARD = "t4"  # Colab's: the card the course is written for
_PROCESS = threading.RLock()  # one change of the process's simulated card at a time


# -- a history of events, with the Python frames of each allocation -----------------------------------------------

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
# Frames a snapshot leaves out: gpukit's own machinery between the op and the allocator, torch's dispatch and
# fake-tensor internals, and the notebook kernel's own stack below the cell.
_SKIP_IN = tuple(_PACKAGE + name for name in ("counter" + os.sep, "allocator" + os.sep, "simulated.py", "oncard.py",
                                              "fakecheck.py", "factories.py", "cudarules.py", "_torch.py"))
_SKIP_PARTS = (os.sep + os.path.join("torch", "_subclasses") + os.sep,
               os.sep + os.path.join("torch", "utils", "_python_dispatch.py"),
               os.sep + os.path.join("torch", "_ops.py"),
               os.sep + os.path.join("torch", "_prims_common") + os.sep,
               os.sep + "IPython" + os.sep, os.sep + "ipykernel" + os.sep, os.sep + "tornado" + os.sep,
               os.sep + "asyncio" + os.sep, os.sep + "traitlets" + os.sep, os.sep + "zmq" + os.sep,
               os.sep + "runpy.py", os.sep + "threading.py", "<frozen ")
_MAX_FRAMES = 48


def python_frames(skip: int = 1) -> list[dict]:
    """The Python stack here, innermost first, as a snapshot's frames (``{"filename", "line", "name"}``), without
    gpukit's and torch's dispatch machinery."""
    frames = []
    f = sys._getframe(skip)
    while f is not None and len(frames) < _MAX_FRAMES:
        name = f.f_code.co_filename
        if not name.startswith(_SKIP_IN) and not any(part in name for part in _SKIP_PARTS):
            frames.append({"filename": name, "line": f.f_lineno, "name": f.f_code.co_name})
        f = f.f_back
    return frames


class _History(collections.deque):
    """The allocator's trace while history is recorded (``CachingAllocator.trace``): its events, at most
    ``max_entries`` (the oldest dropped, as PyTorch's ring buffer does), each with the frames of the allocation
    that caused it (``frames``, kept beside it) and its time; and the frames of every live block (``by_addr``)."""

    def __init__(self, max_entries: int, keep_events: bool, context: str | None) -> None:
        super().__init__(maxlen=max_entries)
        self.keep_events = keep_events
        self.context = context  # None: no frames; "state": live blocks'; "alloc": and allocations'; "all": and frees'
        self.frames = collections.deque(maxlen=max_entries)
        self.times = collections.deque(maxlen=max_entries)
        self.by_addr: dict[int, list] = {}
        self.frames_now: list = []  # set by the device around an allocation it runs: the allocation's frames

    def append(self, entry: tuple) -> None:
        action, addr = entry[0], entry[1]
        frames = self.frames_now if self.context is not None else []
        if action == "alloc":
            self.by_addr[addr] = frames
        elif action == "free_completed":
            self.by_addr.pop(addr, None)
        if not self.keep_events:
            return
        if action.startswith("free") and self.context != "all":
            frames = []
        elif self.context == "state":
            frames = []
        super().append(entry)
        self.frames.append(frames)
        self.times.append(int(time.time() * 1e6))

    def events(self) -> list[dict]:
        out = []
        for (action, a, size, stream), frames, t in zip(self, self.frames, self.times):
            first = "device_free" if action == "oom" else "addr"
            out.append({"action": action, first: a, "size": size, "stream": stream, "frames": list(frames),
                        "time_us": t})
        return out


class CardDevice(SimulatedDevice):
    """A device of the card: follows one counter (the real tensors', or a block's fake ones) into the allocator it
    shares with the card's other device; while history is recorded it runs each allocation as it happens, so that
    the allocation's frames are those of the code that made it."""

    # The device of an on_card() block open on the same allocator: what its fake tensors freed is booked before the
    # card is read (cuda.memory_allocated() right after a `del` inside the block).
    also: "SimulatedDevice | None" = None

    def _catch_up(self) -> None:
        if self.also is not None and self.also.ledger is not None:
            self.also._catch_up()
        super()._catch_up()

    def on_alloc(self, key: int, nbytes: int, counted: bool = True) -> None:
        trace = self._alloc.trace
        if nbytes > 0 and isinstance(trace, _History) and trace.context is not None:
            trace.frames_now = python_frames(2)
            try:
                super().on_alloc(key, nbytes, counted)
            finally:
                trace.frames_now = []
        else:
            super().on_alloc(key, nbytes, counted)


# -- the card ----------------------------------------------------------------------------------------------------

def _resolve_card(card) -> Card:
    if card is None:
        return rehearsed_card() or card_named(DEFAULT_CARD)
    if isinstance(card, Card):
        return card
    if isinstance(card, str):
        return card_named(card)  # ValueError naming the cards known
    raise TypeError(f"card={card!r}: a gpukit.cards.Card or a card's name ('t4', 'a100-80gb', 'h100'...)")


_ACTIVE: "SimulatedCuda | None" = None


class _Memory:
    """``torch.cuda.memory``'s snapshot calls, on the simulated card: ``_record_memory_history``, ``_snapshot`` and
    ``_dump_snapshot``, with PyTorch's arguments; the pickle they write opens in PyTorch's memory_viz."""

    def __init__(self, cuda: "SimulatedCuda") -> None:
        self._cuda = cuda

    def _record_memory_history(self, enabled: str | bool | None = "all", context: str | None = "all",
                               stacks: str = "all", max_entries: int = sys.maxsize, device=None,
                               clear_history: bool = False, **ignored) -> None:
        """``torch.cuda.memory._record_memory_history``: record the allocator's events from now on (``enabled="all"``),
        or only what is live (``"state"``), or stop (``None``). ``context``: which events keep the Python frames
        of the code that caused them ("all", "alloc", "state", None). ``stacks``: Python frames only here ("all"
        adds C++ ones on a GPU; a CPU run has none to give). ``max_entries``: the most events kept, the oldest
        dropped first.

        Raises:
            ValueError: for a value PyTorch does not take.
        """
        if isinstance(enabled, bool):  # the legacy form: _record_memory_history(True, ...)
            enabled = "all" if enabled else None
        if enabled not in ("all", "state", None):
            raise ValueError(f"enabled={enabled!r}: 'all', 'state' or None, as torch.cuda.memory takes")
        if context not in ("all", "alloc", "state", None):
            raise ValueError(f"context={context!r}: 'all', 'alloc', 'state' or None, as torch.cuda.memory takes")
        if stacks not in ("all", "python"):
            raise ValueError(f"stacks={stacks!r}: 'all' or 'python', as torch.cuda.memory takes")
        if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries < 1:
            raise ValueError(f"max_entries={max_entries!r}: a positive number of events")
        self._cuda._check_device(device)
        self._cuda._record(enabled, context, max_entries, clear_history)

    def _snapshot(self, device=None, augment_with_fx_traces: bool = False) -> dict:
        """``torch.cuda.memory._snapshot``: the segments, their blocks and the recorded events, as a dict."""
        self._cuda._check_device(device)
        return self._cuda._snapshot()

    def _dump_snapshot(self, filename: str = "dump_snapshot.pickle", augment_with_fx_traces: bool = False) -> None:
        """``torch.cuda.memory._dump_snapshot``: the snapshot, pickled into ``filename`` (open it at
        https://pytorch.org/memory_viz, or with ``torch.cuda._memory_viz``)."""
        snapshot = self._snapshot()
        with open(filename, "wb") as f:
            pickle.dump(snapshot, f)


class SimulatedCuda:
    """torch.cuda's memory calls, answered by a simulated CUDA card on a machine without a GPU.

    ``cuda = torch.cuda if torch.cuda.is_available() else SimulatedCuda("t4")``: on a GPU the calls are torch's
    own; here they read gpukit's simulation of the CUDA caching allocator, sized as the card, which every tensor
    this thread makes on this CPU from now on is placed on (tensors that existed before are the host's, as data
    loaded before a training run is, and so are those other threads make, as a DataLoader's pin-memory thread's).
    One card at a time per process: making another replaces this one, which then refuses calls.

    Args:
        card: the card simulated, a ``gpukit.cards.Card`` or its name; by default the card a rehearsal runs for
            (``GPUKIT_REHEARSE``), else a T4 (Colab's). Its memory is what torch reports for it where known.
        config: ``PYTORCH_CUDA_ALLOC_CONF`` settings of its allocator ("expandable_segments:True"...).

    Raises:
        ValueError: an unknown card, or settings PyTorch would refuse.
    """

    OutOfMemoryError = torch.OutOfMemoryError

    def __init__(self, card: Card | str | None = None, *, config: str | None = None) -> None:
        global _ACTIVE
        self.card = _resolve_card(card)
        self.memory = _Memory(self)
        allocator = CachingAllocator(self.card.device_bytes, config)
        allocator.name = f"{self.card.name} (on this CPU)"
        self._allocator = allocator
        self._device = CardDevice(allocator=allocator)
        self._closed = False
        self._eager = None  # the eager block open while history is recorded
        self._tally = None
        with _PROCESS:
            if _ACTIVE is not None:
                _ACTIVE.close()
            INTERRUPTS.hold()
            try:
                self._activate()
            finally:
                INTERRUPTS.release()

    def _activate(self) -> None:
        global _ACTIVE
        # A block open from now on: the counter sees every op this thread runs. What exists now is found first
        # (the block's start), before the card listens: it is the host's, and never placed.
        tally = LEDGER.start()
        try:
            use_cpu_device(self._device, place=False)
        except BaseException:
            LEDGER.stop(tally)
            raise
        self._tally = tally
        _ACTIVE = self

    # -- the card -----------------------------------------------------------------------------------------------

    def __repr__(self) -> str:
        state = "replaced by a newer one" if self._closed else (
            f"{self._allocator.total_memory / 2**30:.2f} GiB; "
            f"{self.memory_allocated() / 2**20:.2f} MiB allocated, {self.memory_reserved() / 2**20:.2f} MiB reserved")
        return f"SimulatedCuda({self.card.name}, simulated on this CPU: {state})"

    def _check_device(self, device) -> None:
        if self._closed:
            raise RuntimeError(f"this simulated {self.card.name} was replaced by a newer SimulatedCuda (or closed): "
                               "use the newest one")
        if device is None or device == 0:
            return
        try:
            d = torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"device={device!r}: the simulated card is device 0 ('cuda', 'cuda:0', 0 or None)") from err
        if d.type != "cuda" or d.index not in (None, 0):
            raise ValueError(f"device={device!r}: the simulated card is device 0 ('cuda', 'cuda:0', 0 or None)")

    @property
    def allocator(self) -> CachingAllocator:
        """The simulated allocator, up to date (every tensor that died freed)."""
        self._check_device(None)
        return self._device.allocator

    def close(self) -> None:
        """Stop following this process's tensors; the CPU meter gets a fresh default simulated GPU."""
        with _PROCESS:
            if self._closed:
                return
            INTERRUPTS.hold()
            try:
                self._deactivate()
            finally:
                INTERRUPTS.release()

    def _deactivate(self) -> None:
        global _ACTIVE
        self._closed = True
        if self._eager is not None:
            LEDGER.stop(self._eager)
            self._eager = None
        if self._tally is not None:
            LEDGER.stop(self._tally)
            self._tally = None
        if _ACTIVE is self:
            _ACTIVE = None
            reset_cpu_device()

    # -- torch.cuda's names -------------------------------------------------------------------------------------

    def is_available(self) -> bool:
        """False: this is a simulation, not a GPU (``torch.cuda.is_available()`` says so on a GPU)."""
        return False

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def synchronize(self, device=None) -> None:
        """Nothing to wait for: the simulated card has no queue of work."""
        self._check_device(device)

    def get_device_name(self, device=None) -> str:
        self._check_device(device)
        return f"{self.card.name} (simulated on this CPU)"

    def get_device_properties(self, device=None):
        self._check_device(device)
        major, minor = self.card.compute_capability
        return types.SimpleNamespace(name=self.get_device_name(), total_memory=self._allocator.total_memory,
                                     major=major, minor=minor)

    def memory_allocated(self, device=None) -> int:
        """Bytes of live tensors on the card, as the allocator counts them (each rounded to its block)."""
        self._check_device(device)
        return self._device.allocator.memory_allocated()

    def max_memory_allocated(self, device=None) -> int:
        """The peak of ``memory_allocated()`` since the start or the last ``reset_peak_memory_stats()``."""
        self._check_device(device)
        return self._device.allocator.max_memory_allocated()

    def memory_reserved(self, device=None) -> int:
        """Bytes the caching allocator holds from the (simulated) driver: live tensors plus its cache."""
        self._check_device(device)
        return self._device.allocator.memory_reserved()

    def max_memory_reserved(self, device=None) -> int:
        self._check_device(device)
        return self._device.allocator.max_memory_reserved()

    def reset_peak_memory_stats(self, device=None) -> None:
        """Start every peak afresh from the current figures."""
        self._check_device(device)
        self._device.allocator.reset_peak_stats()

    def reset_max_memory_allocated(self, device=None) -> None:
        self.reset_peak_memory_stats(device)

    def reset_accumulated_memory_stats(self, device=None) -> None:
        self._check_device(device)
        self._device.allocator.reset_accumulated_stats()

    def memory_stats(self, device=None) -> dict[str, int]:
        """Every figure of ``torch.cuda.memory_stats()``."""
        self._check_device(device)
        return self._device.allocator.memory_stats()

    def memory_summary(self, device=None, abbreviated: bool = False) -> str:
        """``torch.cuda.memory_summary()``'s table, its title naming the simulated card."""
        self._check_device(device)
        text = self._device.allocator.memory_summary(abbreviated)
        lines = text.split("\n")
        title = f"PyTorch CUDA memory summary, device ID 0, simulated {self.card.key.upper()}"
        width = len(lines[1]) - 2 if len(lines) > 1 else 75
        if len(lines) > 1 and len(title) <= width:
            lines[1] = "|" + title.center(width) + "|"
        return "\n".join(lines)

    def mem_get_info(self, device=None) -> tuple[int, int]:
        """(free, total) bytes of the card, a CUDA context's allowance counted as used."""
        self._check_device(device)
        return self._device.allocator.mem_get_info()

    def empty_cache(self) -> None:
        """Give every cached block that holds no tensor back to the (simulated) driver."""
        self._check_device(None)
        self._device.allocator.empty_cache()

    def set_per_process_memory_fraction(self, fraction: float, device=None) -> None:
        """Cap the allocator's reserved memory at ``fraction`` of the card (1.0: no cap)."""
        self._check_device(device)
        self._device.allocator.set_memory_fraction(fraction)

    # -- history and snapshots -----------------------------------------------------------------------------------

    def _record(self, enabled, context, max_entries, clear_history) -> None:
        with _PROCESS:
            INTERRUPTS.hold()
            try:
                self._set_history(enabled, context, max_entries, clear_history)
            finally:
                INTERRUPTS.release()

    def _set_history(self, enabled, context, max_entries, clear_history) -> None:
        alloc = self._device.allocator  # every event so far run, before the trace changes
        old = alloc.trace if isinstance(alloc.trace, _History) else None
        if enabled is None:
            alloc.trace = None
            self._device.lazy = True
            if self._eager is not None:
                LEDGER.stop(self._eager)
                self._eager = None
            return
        history = _History(max_entries, enabled == "all", context)
        if old is not None:
            history.by_addr = old.by_addr
            if not clear_history and history.keep_events:
                for entry, frames, t in zip(old, old.frames, old.times):
                    collections.deque.append(history, entry)
                    history.frames.append(frames)
                    history.times.append(t)
        alloc.trace = history
        # Each allocation is run when it happens (its frames are then the code's that made it): the counter
        # books every op at once, and the device runs each event as it comes.
        self._device.lazy = False
        if self._eager is None:
            self._eager = LEDGER.start(eager=True)

    def _snapshot(self) -> dict:
        alloc = self._device.allocator
        events = alloc.trace.events() if isinstance(alloc.trace, _History) else []
        snap = {"segments": alloc.segments(), "device_traces": [events], "allocator_settings": _settings(alloc)}
        by_addr = alloc.trace.by_addr if isinstance(alloc.trace, _History) else {}
        for seg in snap["segments"]:
            for block in seg["blocks"]:
                if block["state"] != "inactive":
                    block["frames"] = list(by_addr.get(block["address"], []))
        snap["gpukit"] = {"simulated": True, "card": self.card.name,
                          "note": "recorded on a CPU by gpukit's simulation of the CUDA caching allocator"}
        return snap

    # -- a block at the card's sizes (gpukit.oncard) -------------------------------------------------------------

    def follow_block(self, device: "SimulatedDevice | None") -> None:
        """While an ``on_card`` block runs, its device (None once it ends): what the block's fake tensors freed is
        booked before the card is read (``cuda.memory_allocated()`` right after a ``del`` inside the block)."""
        self._device.also = device


def _settings(alloc: CachingAllocator) -> dict:
    from .allocator.config import SIZE_MAX

    c = alloc.config
    return {"PYTORCH_CUDA_ALLOC_CONF": c.text, "max_split_size": -1 if c.max_split_size == SIZE_MAX else c.max_split_size,
            "garbage_collection_threshold": c.garbage_collection_threshold,
            "expandable_segments": c.expandable_segments}


def simulated_cuda() -> SimulatedCuda | None:
    """The process's simulated card, if one was made (and not replaced or closed)."""
    return _ACTIVE


INTERRUPTS.protect(SimulatedCuda._activate, SimulatedCuda._deactivate, SimulatedCuda._set_history)
