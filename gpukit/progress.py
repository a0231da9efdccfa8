"""A progress line for a long call (``plan()``): in Jupyter one output updated in place, in a terminal one line of
stderr rewritten; nothing where no one watches (a script's output to a file, a test run). It shows once the call has
run for ``delay`` seconds, so a quick call prints nothing, and it ends with one line that says what was done."""

from __future__ import annotations

import sys
import time
from typing import Any, Callable


def _notebook_shell() -> Any:
    """The IPython shell of a Jupyter kernel running this, or None (a terminal IPython has no kernel)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell if shell is not None and getattr(shell, "kernel", None) is not None else None


class Progress:
    """``with Progress("plan()", total=96) as progress: ... progress.update(done, "predicting ...")``.

    ``update`` is cheap (it draws at most every ``interval`` seconds, and never before ``delay``); ``close``
    (or the block's end) replaces the line with ``summary`` where one was drawn, or with what stopped the call.
    ``clock``, ``stream`` and ``shell`` are for tests (default: ``time.monotonic``, stderr where it is a terminal,
    the Jupyter kernel's shell where there is one)."""

    def __init__(self, what: str, total: int | None = None, delay: float = 1.0, interval: float = 0.2,
                 clock: Callable[[], float] = time.monotonic, stream: Any = None, shell: Any = None) -> None:
        self.what, self.total, self.delay, self.interval, self.clock = what, total, delay, interval, clock
        self.started = clock()
        self.drawn_at: float | None = None
        self.done, self.text = 0, ""
        self.summary = ""
        self.handle = None  # Jupyter: the display updated in place
        self.width = 0  # terminal: the last line's length, blanked when rewritten
        self.shell = shell if shell is not None else _notebook_shell()
        if stream is None and self.shell is None:
            stream = sys.stderr if getattr(sys.stderr, "isatty", lambda: False)() else None
        self.stream = stream

    @property
    def shown(self) -> bool:
        return self.drawn_at is not None

    def line(self) -> str:
        counted = f"{self.done} of {self.total}" if self.total is not None else f"{self.done}"
        return f"{self.what}: {counted}, {self.clock() - self.started:.0f} s" + (f": {self.text}" if self.text else "")

    def update(self, done: int | None = None, text: str | None = None) -> None:
        if done is not None:
            self.done = done
        if text is not None:
            self.text = text
        if self.shell is None and self.stream is None:
            return
        now = self.clock()
        if now - self.started < self.delay or (self.drawn_at is not None and now - self.drawn_at < self.interval):
            return
        self._draw(self.line())
        self.drawn_at = now

    def _draw(self, text: str) -> None:
        if self.shell is not None:
            from IPython.display import display

            if self.handle is None:
                self.handle = display({"text/plain": text}, raw=True, display_id=True)
            else:
                self.handle.update({"text/plain": text}, raw=True)
        else:
            self.stream.write("\r" + text.ljust(self.width))
            self.stream.flush()
            self.width = len(text)

    def close(self, summary: str = "") -> None:
        """End the line where one was drawn: ``summary`` (default: the last line) in its place."""
        if self.shown:
            self._draw(summary or self.line())
            if self.shell is None:
                self.stream.write("\n")
                self.stream.flush()
            self.drawn_at = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, kind, error, tb) -> bool:
        if kind is None:
            self.close(self.summary)
        else:
            stopped = "interrupted" if issubclass(kind, KeyboardInterrupt) else f"stopped by {kind.__name__}"
            self.close(f"{self.line()} ({stopped})")
        return False
