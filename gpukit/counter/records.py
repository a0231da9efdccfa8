"""What the ledger keeps: a measured block's running level and peak (``Tally``), and for each storage a weak
reference that knows its key, its size and its state (queued, live, freed)."""

from __future__ import annotations

import weakref


class Tally:
    """Running level and peak of one measured block, relative to its start.

    ``label`` limits it to the storages of one device type (a fake ledger tells
    fake tensors apart by the device they pretend to be on); None counts all.
    """

    __slots__ = ("level", "level_unrounded", "peak", "peak_unrounded", "label", "events", "phase", "mode", "eager")

    def __init__(self, label: str | None = None) -> None:
        self.level = self.level_unrounded = self.peak = self.peak_unrounded = 0
        self.label = label
        self.events: list | None = None  # (level, phase) after every change, when a timeline is wanted
        self.phase = None  # a callable naming the phase of training (forward, backward, optimizer)
        self.mode = None  # the counting mode of the thread that opened the block
        self.eager = False  # every allocation booked as it happens (a timeline's phases, a simulated cap)


# A storage's record moves through these states: queued by the counting mode (made, not yet booked), booked
# (counted live), freed. The same record goes through the ledger's queue twice: once when the storage is made,
# once when it dies (its weak reference's callback), so the queue keeps allocations and frees in their order.
QUEUED, LIVE, FREED = 0, 1, 2


class StorageRef(weakref.ref):
    """A weak reference to a storage (or a tensor object) that knows the key it is filed under, and for a
    storage its size when made and its state."""

    __slots__ = ("key", "nbytes", "state")


def claim(refs: dict, ref: StorageRef) -> bool:
    """File a queued record under its key, unless the storage is already booked under another record (queued
    again after an interrupted record): then this one is dropped (False)."""
    current = refs.get(ref.key)
    if current is not None and current.state == LIVE and current() is not None and current() is ref():
        ref.state = FREED
        return False
    refs[ref.key] = ref
    return True

