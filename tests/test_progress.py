"""gpukit.progress: the line a long call (plan()) shows while it runs, in a terminal and in Jupyter, and nothing where
no one watches. Device: none (a clock, a stream and a shell stand in); plan()'s own line on the CPU."""

from __future__ import annotations

import io
import re
import sys

import pytest
import torch

import gpukit
from gpukit.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_in_a_terminal_the_line_shows_after_the_delay_is_rewritten_in_place_and_ends_with_the_summary():
    clock, out = Clock(), io.StringIO()
    with Progress("plan(): candidates decided", total=96, delay=1.0, interval=0.2, clock=clock, stream=out) as p:
        p.update(3, "plain [AdamW]")
        assert out.getvalue() == ""  # a quick call prints nothing
        clock.now += 1.5
        p.update(12, "accumulate 4 [AdamW]")
        assert out.getvalue() == "\rplan(): candidates decided: 12 of 96, 2 s: accumulate 4 [AdamW]"
        clock.now += 0.1
        p.update(13, "x")
        assert out.getvalue().count("\r") == 1  # at most one line each interval
        clock.now += 0.5
        p.update(40, "AMP")
        p.summary = "plan(): 96 candidates decided, 26 predictions, 59 s"
    lines = out.getvalue().split("\r")[1:]
    first = "plan(): candidates decided: 12 of 96, 2 s: accumulate 4 [AdamW]"
    assert lines[1] == "plan(): candidates decided: 40 of 96, 2 s: AMP".ljust(len(first))  # the longer line blanked
    assert lines[2] == "plan(): 96 candidates decided, 26 predictions, 59 s".ljust(len(lines[1].rstrip())) + "\n"


@pytest.mark.parametrize("error, total, delay, last", [
    (KeyboardInterrupt, 5, 0.0, "plan(): 2 of 5, 0 s: prefix (interrupted)\n"),
    (ValueError, None, 0.0, "plan(): 2, 0 s: prefix (stopped by ValueError)\n"),
    (ValueError, None, 1.0, ""),  # stopped before its delay: nothing was shown, nothing is
])
def test_a_call_stopped_says_so_on_its_line_and_a_quick_one_leaves_nothing(error, total, delay, last):
    out = io.StringIO()
    with pytest.raises(error):
        with Progress("plan()", total=total, delay=delay, clock=Clock(), stream=out) as p:
            p.update(2, "prefix")
            raise error()
    assert out.getvalue().endswith(last) and (last or out.getvalue() == "")


def test_in_jupyter_one_output_is_updated_in_place(monkeypatch):
    import IPython.display

    shown = []

    class Handle:
        def update(self, obj, raw=False):
            shown.append(("update", obj["text/plain"], raw))

    def display(obj, raw=False, display_id=False):
        shown.append(("display", obj["text/plain"], raw, display_id))
        return Handle()

    monkeypatch.setattr(IPython.display, "display", display)
    shell = type("Shell", (), {"kernel": object()})()
    monkeypatch.setattr(sys.modules["gpukit.progress"], "_notebook_shell", lambda: shell)
    clock = Clock()
    with Progress("plan()", total=4, delay=0.0, interval=0.0, clock=clock) as p:
        assert p.stream is None and p.shell is shell
        p.update(1, "a")
        p.update(2, "b")
        p.summary = "done"
    assert shown == [("display", "plan(): 1 of 4, 0 s: a", True, True), ("update", "plan(): 2 of 4, 0 s: b", True),
                     ("update", "done", True)]


def test_where_no_one_watches_nothing_is_written(monkeypatch, capsys):
    assert not sys.stderr.isatty()
    with Progress("plan()", delay=0.0) as p:
        assert p.stream is None and p.shell is None
        p.update(1, "a")
    assert capsys.readouterr() == ("", "")


def test_plan_tells_its_line_each_candidate_and_ends_with_what_it_did(monkeypatch):
    """Device: cpu."""
    out = io.StringIO()
    base = sys.modules["gpukit.progress"].Progress

    class Watched(base):
        def __init__(self, what, **kwargs):
            super().__init__(what, **dict(kwargs, delay=0.0, interval=0.0, stream=out))

    monkeypatch.setattr(sys.modules["gpukit.plan"], "Progress", Watched)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    p = gpukit.plan(lambda: torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)),
                    lambda params: torch.optim.SGD(params, lr=0.1), lambda: (x.clone(), y.clone()), "1MB",
                    device="cpu", verify=False, techniques=gpukit.plan.Techniques(precisions=["float32", "bf16"]))
    lines = out.getvalue().split("\r")[1:]
    assert lines[0].startswith("plan(): candidates decided: 0, ")  # the model's facts, before the candidates
    total = len(p.rows)
    told = [line for line in lines if f" of {total}, " in line]
    assert told and all("predictions; " in line and "[yours: SGD" in line for line in told[:-1])
    assert re.fullmatch(rf"plan\(\): {total} candidates decided, {p.predictions} predictions, \d+ s", lines[-1].rstrip())
