"""Ctrl-C held back while gpukit changes its own state, and delivered right after (``INTERRUPTS``)."""

from __future__ import annotations

import signal
import _signal  # signal's own C module: the same handlers, without the enum conversions a block paid 4 times
import sys
import threading


class _DeferredInterrupts:
    """Holds back Ctrl-C while gpukit changes its own state, and delivers it right after.

    Python runs a SIGINT handler between any two bytecodes of the main thread. While a
    block is open on the main thread, gpukit's handler looks at the frames that were
    running: inside one of gpukit's enter/exit or bookkeeping functions it only notes the
    interrupt, which those functions then raise once their state is whole again (an
    interrupted ``__enter__`` first undoes what it did, so the block never starts).
    Anywhere else (the user's code in the block) it calls the handler that was there
    before, so Ctrl-C stops the user's code at once, as always. Other threads never
    receive SIGINT in Python, so only the main thread needs this.
    """

    def __init__(self) -> None:
        self.codes: set = set()
        self.pending = False
        self.depth = 0  # open holds on the main thread
        self.previous = None
        self._installed = self._handler  # one bound method, so that the handler is recognised

    def protect(self, *functions) -> None:
        """Mark functions whose frames hold interrupts back."""
        for fn in functions:
            self.codes.add(getattr(fn, "__func__", fn).__code__)

    def hold(self) -> None:
        """Start holding back interrupts in protected code (call first thing on an enter path)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if self.depth == 0:
            current = _signal.getsignal(signal.SIGINT)
            if current is not self._installed:
                self.previous = current
                _signal.signal(signal.SIGINT, self._installed)
        self.depth += 1

    def release(self) -> None:
        """End a hold (last thing on an exit path); the last one puts the previous handler back.
        Then raise an interrupt that was held back."""
        if threading.current_thread() is not threading.main_thread():
            return
        self.depth = max(self.depth - 1, 0)
        if self.depth == 0 and _signal.getsignal(signal.SIGINT) is self._installed:
            _signal.signal(signal.SIGINT, self.previous)
        self.deliver()

    def deliver(self) -> None:
        """Raise an interrupt that was held back, if there is one."""
        if self.pending:
            self.pending = False
            self._call_previous(signal.SIGINT, sys._getframe(1))

    def _handler(self, signum, frame) -> None:
        codes, f = self.codes, frame
        while f is not None:
            if f.f_code in codes:
                self.pending = True
                return
            f = f.f_back
        self._call_previous(signum, frame)

    def _call_previous(self, signum, frame) -> None:
        previous = self.previous
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt


INTERRUPTS = _DeferredInterrupts()
