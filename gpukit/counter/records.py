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
# (counted live), freed; or adopted: found by a scan (made before a block, or outside every block) and booked in
# the live totals only, not in any block's tally. The same record goes through the ledger's queue twice: once
# when the storage is made, once when it dies (its weak reference's callback), so the queue keeps allocations
# and frees in their order.
QUEUED, LIVE, FREED, ADOPTED = 0, 1, 2, 3

# What the ledger does with a queued record (``claim``): drop it, book it, or book its storage in the blocks'
# tallies only (the live totals have it already).
DROP, BOOK, COUNT = 0, 1, 2


class StorageRef(weakref.ref):
    """A weak reference to a storage (or a tensor object) that knows the key it is filed under, and for a
    storage its size when made and its state."""

    __slots__ = ("key", "nbytes", "state")


def claim(refs: dict, ref: StorageRef) -> int:
    """File a queued record under its key and book it (``BOOK``), unless its storage is booked already.

    A record filed under the key, booked, whose death has not come through the queue yet, is of the same
    storage, alive or not by now: another storage under this key died before this one was made, and its death
    was queued then, before this record. So this record is dropped. If the other one was booked by the counting
    mode (this one queued again after an interrupted record): ``DROP``. If it was adopted by a scan on another
    thread while the thread that made the storage, inside a block, held it before queueing it: the storage was
    made in a block after all, and is counted now in the tallies (``COUNT``; the live totals have it already).
    """
    current = refs.get(ref.key)
    if current is not None and current is not ref and current.state in (LIVE, ADOPTED):
        ref.state = FREED
        if current.state == ADOPTED:
            current.state = LIVE
            return COUNT
        return DROP
    refs[ref.key] = ref
    return BOOK
