"""MemoryReport: what one measured block used, and the session history of reports."""

from __future__ import annotations

import collections
import dataclasses
import html
import math
import re
from dataclasses import dataclass, field
from typing import Any

ROLES = ("parameters", "buffers", "gradients", "optimizer state", "activations", "temporaries", "other")


def format_bytes(n: int | None) -> str:
    """Bytes for humans, in binary units: ``format_bytes(4_000_256) == '3.81 MiB'``."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n} B"


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(size: int | float | str) -> int:
    """``'4GB'`` -> 4,000,000,000; ``'512 MiB'`` -> 536,870,912; ``'1e9'`` and plain numbers are bytes.

    Raises:
        ValueError: for anything else, saying what is accepted.
    """
    if isinstance(size, (int, float)) and not isinstance(size, bool):
        value, unit = float(size), ""
    else:
        match = re.fullmatch(r"\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(size))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"not a size: {size!r} (use bytes, or a number with B, KB, MB, GB, KiB, MiB, GiB)")
        value, unit = float(match.group(1)), match.group(2).lower()
    if not math.isfinite(value * _UNITS[unit]):
        raise ValueError(f"not a size: {size!r} is not a finite number of bytes")
    nbytes = int(value * _UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"a size must be positive, got {size!r}")
    return nbytes


@dataclass
class MemoryReport:
    """Memory used by one measured block, in integer bytes.

    ``peak`` is the most bytes allocated at any moment inside the block minus the
    bytes allocated when it began (never negative); ``delta`` is allocated at exit
    minus allocated at entry. Both follow the CUDA caching allocator's accounting,
    where every allocation is rounded up to a multiple of 512 bytes; the
    ``*_unrounded`` fields hold the sizes as requested.

    ``roles_peak`` / ``roles_end`` break memory down by role (parameters,
    gradients, optimizer state, activations, ...) when a model was given; they are
    absolute (state that existed before the block included), from PyTorch's
    ``MemTracker``, at its peak and at the end of the block.
    """

    label: str | None = None
    device: str = "cpu"
    backend: str = ""
    peak: int = 0
    delta: int = 0
    live_start: int = 0
    live_end: int = 0
    peak_unrounded: int = 0
    delta_unrounded: int = 0
    reserved_start: int | None = None  # CUDA only: bytes the caching allocator holds
    reserved_end: int | None = None
    reserved_peak: int | None = None
    reserved_simulated: bool = False  # on CPU: reserved by a simulated CUDA caching allocator (gpukit.allocator)
    seconds: float = 0.0
    roles_peak: dict[str, int] | None = None
    roles_end: dict[str, int] | None = None
    notes: list[str] = field(default_factory=list)
    timeline: list[tuple[int, str]] | None = None  # (bytes above the start, phase) after each change

    @property
    def peak_abs(self) -> int:
        """The most bytes allocated at any moment in the block (``live_start + peak``)."""
        return self.live_start + self.peak

    def to_dict(self) -> dict[str, Any]:
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("roles_peak", "roles_end", "notes", "timeline")}
        for prefix, roles in (("peak", self.roles_peak), ("end", self.roles_end)):
            for role, nbytes in (roles or {}).items():
                row[f"{role} ({prefix})"] = nbytes
        return row

    # -- rendering: one object, two renderings (text in a terminal, HTML in Jupyter)

    def _rows(self) -> list[tuple[str, str]]:
        def both(n: int, unrounded: int) -> str:
            return f"{format_bytes(n)}  ({n:,} B; {unrounded:,} B unrounded)"

        rows = [
            ("peak", both(self.peak, self.peak_unrounded)),
            ("delta", both(self.delta, self.delta_unrounded)),
            ("live at start", f"{format_bytes(self.live_start)}  ({self.live_start:,} B)"),
            ("live at end", f"{format_bytes(self.live_end)}  ({self.live_end:,} B)"),
        ]
        if self.reserved_end is not None:
            rows.append(("reserved, simulated (start / peak / end)" if self.reserved_simulated else
                         "reserved (start / peak / end)",
                         " / ".join(format_bytes(v) for v in
                                    (self.reserved_start, self.reserved_peak, self.reserved_end))))
        rows.append(("time", f"{self.seconds * 1e3:.1f} ms"))
        return rows

    def _role_rows(self) -> list[tuple[str, str, str]]:
        if self.roles_end is None:
            return []
        roles = [r for r in ROLES if (self.roles_peak or {}).get(r) or self.roles_end.get(r)]
        return [(r, format_bytes((self.roles_peak or {}).get(r, 0)), format_bytes(self.roles_end.get(r, 0)))
                for r in roles]

    def _title(self) -> str:
        name = f"{self.label}: " if self.label else ""
        return f"{name}memory on {self.device} (measured by {self.backend})"

    def __repr__(self) -> str:
        width = max(len(k) for k, _ in self._rows())
        lines = [self._title()]
        lines += [f"  {k:<{width}}  {v}" for k, v in self._rows()]
        role_rows = self._role_rows()
        if role_rows:
            lines.append("  by role (absolute)        at peak       at end")
            lines += [f"    {r:<22}{p:>12}  {e:>12}" for r, p, e in role_rows]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        esc = html.escape
        out = [f"<div class='gpukit-report'><b>{esc(self._title())}</b>", html_table(self._rows())]
        role_rows = self._role_rows()
        if role_rows:
            out.append(html_table(role_rows, columns=("by role (absolute)", "at peak", "at end")))
        out += [f"<p><i>note: {esc(n)}</i></p>" for n in self.notes]
        out.append("</div>")
        return "".join(out)


def html_table(rows, columns: tuple[str, ...] | None = None) -> str:
    """An HTML table of ``rows`` (tuples of cells), every cell escaped, made by pandas.

    Without ``columns`` the rows are ``(name, value)`` pairs shown as a two-column key/value table; with
    them, a table with that header.
    """
    import pandas as pd

    rows = list(rows)
    if columns is None:
        frame = pd.DataFrame([v for _, v in rows], index=[k for k, _ in rows])
        return frame.to_html(header=False, border=0, justify="left")
    return pd.DataFrame(rows, columns=list(columns)).to_html(index=False, border=0, justify="left")


HISTORY_LIMIT = 1000  # reports kept by default: a long loop that records every step stays bounded

_HISTORY: collections.deque[MemoryReport] = collections.deque(maxlen=HISTORY_LIMIT)


def record(report: MemoryReport) -> None:
    _HISTORY.append(report)


def keep_history(limit: int | None = HISTORY_LIMIT) -> None:
    """Keep the ``limit`` most recent reports in the session history (``None``: keep them all).

    Each report is about half a kilobyte, ten with a timeline; the default keeps the last 1000.

    Raises:
        ValueError: for a limit that is not a positive whole number or None.
    """
    global _HISTORY
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"keep_history takes a positive number of reports, or None for all; got {limit!r}")
    _HISTORY = collections.deque(_HISTORY, maxlen=limit)


def history():
    """The reports recorded this session (the most recent ``keep_history`` of them, 1000 by default),
    oldest first, as a pandas DataFrame (one row each)."""
    import pandas as pd

    columns = [f.name for f in dataclasses.fields(MemoryReport)
               if f.name not in ("roles_peak", "roles_end", "notes", "timeline")]
    return pd.DataFrame([r.to_dict() for r in _HISTORY], columns=None if _HISTORY else columns)


def last(label: str | None = None) -> MemoryReport:
    """The most recent recorded report, or the most recent one with this ``label``.

    Raises:
        LookupError: if nothing (with that label) was measured yet.
    """
    if label is None:
        if not _HISTORY:
            raise LookupError("no measurement yet: run a cell with %%gpumem or a `with gpukit.measure():` "
                              "block first")
        return _HISTORY[-1]
    for report in reversed(_HISTORY):
        if report.label == label:
            return report
    known = sorted({r.label for r in _HISTORY if r.label})
    raise LookupError(f"no measurement labelled {label!r} yet: run the cell that measures it first "
                      f"(labels so far: {', '.join(map(repr, known)) or 'none'})")


def clear_history() -> None:
    """Forget every recorded report."""
    _HISTORY.clear()
