"""The rehearsal (bench/rehearse.py, gpukit.lessons.rehearsal): a notebook run in a fresh kernel for a card, every
assertion counted.

Device: cpu; the card is simulated (the CPU meter's allocator given its memory)."""

import csv
import importlib.util
from pathlib import Path

import nbformat
import pytest

from gpukit.lessons.sizes import REHEARSE_VAR

_spec = importlib.util.spec_from_file_location("rehearse",
                                               Path(__file__).resolve().parent.parent / "bench" / "rehearse.py")
rehearsal = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rehearsal)

LIMIT = 120


def notebook(tmp_path, *cells, name="99_lesson"):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# a lesson")] + [nbformat.v4.new_code_cell(c) for c in cells]
    path = tmp_path / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


def test_every_assertion_is_counted_and_a_failing_one_does_not_stop_the_rest(tmp_path):
    path = notebook(
        tmp_path,
        "import os\nCARD = os.environ.get('GPUKIT_REHEARSE')\nassert True",
        "def check(x):\n    assert x > 0, f'{x} is not positive'\n\nfor x in (1, 2, -3):\n    check(x)",
        "assert 1 == 2, undefined_name  # its message cannot be made\nafter = 'ran'",
        "assert after == 'ran'",
    )
    row = rehearsal.rehearse(path, "cpu", LIMIT)
    assert (row["status"], row["assertions"], row["failed"], row["errors"]) == ("complete", 6, 2, 0)
    assert row["first_failure"] == "line 2: assert x > 0: -3 is not positive"
    assert row["fits"] and row["card_bytes"] is None and row["host_peak_bytes"] > 0


def test_a_card_is_rehearsed_on_its_memory_and_a_step_too_big_for_it_does_not_fit(tmp_path):
    path = notebook(
        tmp_path,
        "import os, torch, gpukit\nfrom gpukit.allocator import cpu_device\n"
        "assert os.environ['GPUKIT_REHEARSE'] == 't4'\n"
        "assert cpu_device().allocator.total_memory == 14_930 * 2**20",
        "with gpukit.measure('cpu', record=False):\n    x = torch.empty(2**28)   # 1 GiB",
    )
    row = rehearsal.rehearse(path, "t4", LIMIT)
    assert (row["status"], row["assertions"], row["failed"]) == ("complete", 2, 0)
    assert row["peak_allocated_bytes"] >= 2**30 and row["peak_reserved_bytes"] >= 2**30
    assert row["fits"] and row["host_bytes"] == rehearsal.HOST_BYTES["t4"]
    # The same notebook with 14 GiB: the simulated T4 cannot hold it beside its context.
    path = notebook(tmp_path, "import torch, gpukit\nwith gpukit.measure('cpu', record=False):\n"
                              "    x = torch.empty(14 * 2**28)   # 14 GiB, never written: no host RAM",
                    name="98_big")
    row = rehearsal.rehearse(path, "t4", LIMIT)
    assert row["status"] == "complete" and row["fits"] is False
    assert row["peak_reserved_bytes"] + row["context_bytes"] > row["card_bytes"]


def test_a_cell_listed_runs_on_fake_tensors_on_the_card_and_the_next_one_is_real_again(tmp_path, monkeypatch):
    """Device: cpu; a T4 simulated. A 16 GiB tensor in a cell on fake tensors takes no RAM, is measured, counts
    against the card (the real allocator's bytes at the cell's start beside it) and does not fit; the value read
    from it is made up and counted; the cells after it are real."""
    from gpukit.lessons.sizes import REHEARSAL_ON_FAKE_TENSORS

    path = notebook(
        tmp_path,
        "import torch, gpukit\nfrom gpukit._torch import FakeTensor\nsmall = torch.ones(2**20)   # real, 4 MiB",
        "with gpukit.measure('cpu', record=False) as m:\n    big = torch.ones(4 * 2**30)   # 16 GiB\n"
        "    total = big.sum().item()\n"
        "assert isinstance(big, FakeTensor) and m.peak == 16 * 2**30 + 512   # and its sum\ndel big",
        "assert not isinstance(torch.ones(1), FakeTensor) and small.sum().item() == 2**20",
        name="97_fake")
    cell = nbformat.read(path, as_version=4).cells[2]
    monkeypatch.setitem(REHEARSAL_ON_FAKE_TENSORS, "97_fake", {cell.id: "the big one"})
    row = rehearsal.rehearse(path, "t4", LIMIT)
    found = (row["status"], row["assertions"], row["failed"], row["errors"])
    assert found == ("complete", 2, 0, 0), row["first_failure"]
    assert row["peak_reserved_bytes"] >= 16 * 2**30 + 2**22 and row["fits"] is False
    assert row["host_peak_bytes"] < 4 * 2**30 and row["made_up_values"] == 1 and row["fake_cells"] == "the big one"
    assert row["host_need_bytes"] >= row["host_peak_bytes"] - 2**23  # only the real tensors live in host RAM
    monkeypatch.setitem(REHEARSAL_ON_FAKE_TENSORS, "97_fake", {"renamed": "the big one"})
    with pytest.raises(ValueError, match="has no cell renamed"):
        rehearsal.rehearse(path, "t4", LIMIT)


def test_a_cell_on_fake_tensors_is_placed_on_the_lessons_own_simulated_card(tmp_path, monkeypatch):
    """Device: cpu; a T4 simulated by the lesson itself (``cuda = gpukit.SimulatedCuda()``). The fake cell's tensors
    count in the card's memory calls, as a GPU's would, a del at once; when the cell ends they leave the card and
    the peak they reached stays, and they took no host RAM."""
    from gpukit.lessons.sizes import REHEARSAL_ON_FAKE_TENSORS

    path = notebook(
        tmp_path,
        "import torch, gpukit\ncuda = gpukit.SimulatedCuda()\nsmall = torch.ones(2**20)   # real, 4 MiB",
        "cuda.reset_peak_memory_stats()\nbig = torch.ones(2**30)   # 4 GiB\nkept = torch.ones(2**20)\n"
        "assert cuda.memory_allocated() == 4 * 2**30 + 8 * 2**20\ndel big\n"
        "assert cuda.memory_allocated() == 8 * 2**20",
        "assert cuda.memory_allocated() == 4 * 2**20 and cuda.max_memory_allocated() == 4 * 2**30 + 8 * 2**20",
        name="96_card")
    cell = nbformat.read(path, as_version=4).cells[2]
    monkeypatch.setitem(REHEARSAL_ON_FAKE_TENSORS, "96_card", {cell.id: "the big one"})
    row = rehearsal.rehearse(path, "t4", LIMIT)
    found = (row["status"], row["assertions"], row["failed"], row["errors"])
    assert found == ("complete", 3, 0, 0), row["first_failure"]
    assert row["peak_allocated_bytes"] >= 4 * 2**30 and row["fits"] and row["host_peak_bytes"] < 2 * 2**30


def test_a_peak_the_lesson_resets_within_a_cell_still_counts(tmp_path):
    """Device: cpu; a T4 simulated by the lesson itself. A cell that measures two steps, each after
    cuda.reset_peak_memory_stats(), is rehearsed with the larger peak, not the last one's."""
    path = notebook(
        tmp_path,
        "import torch, gpukit\ncuda = gpukit.SimulatedCuda()",
        "cuda.reset_peak_memory_stats()\nx = torch.empty(2**28)   # 1 GiB, never written\ndel x\n"
        "cuda.reset_peak_memory_stats()\ny = torch.empty(2**20)\nassert cuda.max_memory_allocated() == 4 * 2**20",
        name="95_resets")
    row = rehearsal.rehearse(path, "t4", LIMIT)
    assert (row["status"], row["assertions"], row["failed"], row["errors"]) == ("complete", 1, 0, 0)
    assert row["peak_allocated_bytes"] >= 2**30 and row["peak_reserved_bytes"] >= 2**30


def test_a_cell_on_fake_tensors_measures_the_bytes_of_the_real_one():
    """Device: cpu. Notebook 10's technique matrix (a model of it: one setup, the techniques whose steps differ most,
    GradScaler's check for inf included) measured on fake tensors as a rehearsal runs it, then for real: the same
    bytes on every row; the data loaded first inside the fake cell stays real for the real run."""
    from gpukit.lessons import data
    from gpukit.lessons.rehearsal import _Counter
    from gpukit.lessons.techniques import TECHNIQUES, reference_setups, run_matrix

    setups = reference_setups("small")[2:]  # the tiny GPT
    techniques = [t for t in TECHNIQUES if t.name in ("baseline", "AMP fp16", "accumulation k=4", "checkpointing",
                                                      "offload saved activations")]
    data._CACHE.clear()
    counter = _Counter()
    counter.fake_begin()
    try:
        fake = run_matrix("cpu", setups, techniques, steps=0, echo=None)
    finally:
        counter.fake_end()
    real = run_matrix("cpu", setups, techniques, steps=0, echo=None)
    assert [r["peak_bytes"] for r in fake] == [r["peak_bytes"] for r in real]
    assert all(r["peak_bytes"] for r in real) and counter.made_up > 0  # the GradScaler's reads
    assert counter.peak_reserved >= max(r["peak_bytes"] for r in fake if r["status"] == "ok")


def test_a_notebook_over_the_limit_is_stopped_and_not_counted_as_rehearsed(tmp_path, monkeypatch):
    monkeypatch.setenv(REHEARSE_VAR, "h100")  # the runner's own setting wins, and is put back
    path = notebook(tmp_path, "assert True", "import time\ntime.sleep(60)", "assert False")
    row = rehearsal.rehearse(path, "cpu", 3)
    assert row["status"].startswith("not rehearsed to its end: over 3 s") and row["fits"] is False
    assert row["assertions"] == 1  # the report still comes, after the interrupt
    import os

    assert os.environ[REHEARSE_VAR] == "h100"
    # A kernel that ignores the interrupt is killed once the grace time is over; the row says so. The limit counts
    # the notebook's cells, not the rehearsal's own import of gpukit before them (seconds on a loaded machine).
    stubborn = notebook(tmp_path, "assert 0 < 1",
                        "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)",
                        name="97_stubborn")
    # With a progress file the killed kernel's findings up to its last cell stay in the row.
    row = rehearsal.rehearse(stubborn, "cpu", 3, grace=2, progress=tmp_path / "progress.json")
    assert row["status"] == "not rehearsed to its end: over 3 s, and killed 2 s after"
    assert (row["assertions"], row["failed"], row["fits"]) == (1, 0, False)


def test_the_table_is_written_and_a_failure_makes_the_command_fail(tmp_path, monkeypatch):
    monkeypatch.setattr(rehearsal, "OUT", tmp_path / "rehearsals")
    good = notebook(tmp_path, "assert 2 + 2 == 4")
    assert rehearsal.main(["--card", "T4", str(good)]) == 0
    bad = notebook(tmp_path, "assert 2 + 2 == 5", name="98_bad")
    assert rehearsal.main(["--card", "t4", str(bad)]) == 1
    with (tmp_path / "rehearsals" / "t4.csv").open() as f:
        rows = {r["notebook"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"99_lesson", "98_bad"}  # a notebook run earlier keeps its row
    assert rows["98_bad"]["failed"] == "1" and rows["99_lesson"]["fits"] == "True"
    assert set(rehearsal.COLUMNS) <= set(rows["98_bad"])
    with pytest.raises(ValueError, match="no GPU card 'v100'"):
        rehearsal.main(["--card", "v100", str(good)])
    with pytest.raises(SystemExit):
        rehearsal.main(["--card", "t4", str(tmp_path / "missing.ipynb")])


def test_the_rehearsals_page_sums_up_the_recorded_tables():
    """Device: none. docs/rehearsals.md's section is what the committed tables say (kit.py rehearse writes it)."""
    text = rehearsal.PAGE.read_text()
    section = text.split(rehearsal.START)[1].split(rehearsal.END)[0].strip()
    assert section == rehearsal.rehearsals_section() and "**t4**" in section and "**cpu**" in section


def test_the_rehearsals_page_is_rewritten_between_its_markers_only(tmp_path):
    """Device: none. Text around the markers stays; a page without them, or no page, is left as it is."""
    page = tmp_path / "rehearsals.md"
    page.write_text(f"# title\nbefore\n{rehearsal.START}\nold\n{rehearsal.END}\nafter\n")
    rehearsal.write_rehearsals_page(page)
    assert page.read_text() == (f"# title\nbefore\n{rehearsal.START}\n{rehearsal.rehearsals_section()}\n"
                                f"{rehearsal.END}\nafter\n")
    page.write_text("no markers\n")
    rehearsal.write_rehearsals_page(page)
    assert page.read_text() == "no markers\n"
    rehearsal.write_rehearsals_page(tmp_path / "missing.md")
    assert not (tmp_path / "missing.md").exists()


def test_each_notebook_runs_in_a_runner_of_its_own_and_a_hung_one_is_killed_with_its_children(tmp_path):
    """Device: cpu. The row comes back from the runner's process; a process tree (a runner and the kernel under it)
    is killed whole."""
    import subprocess
    import time

    path = notebook(tmp_path, "assert 1 + 1 == 2")
    row = rehearsal.isolated(path, "cpu", 60)
    assert row["status"] == "complete" and row["assertions"] == 1
    tree = subprocess.Popen(["bash", "-c", "sleep 300 & sleep 300 & wait"])
    time.sleep(0.5)
    below = [int(p) for p in subprocess.run(["pgrep", "-P", str(tree.pid)], capture_output=True,
                                            text=True).stdout.split()]
    assert len(below) == 2
    rehearsal.kill_tree(tree.pid)
    tree.wait(timeout=10)
    time.sleep(0.5)
    alive = [p for p in below if subprocess.run(["kill", "-0", str(p)], capture_output=True).returncode == 0
             and "Z" not in open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0]]
    assert alive == []


def test_a_runner_still_waiting_past_its_time_is_killed_and_its_row_says_so(tmp_path, monkeypatch):
    """Device: cpu. The runner would interrupt this kernel after 30 s and kill it 100 s later (it ignores the
    interrupt); the parent gives it 5 s in all (a negative slack stands for a runner that waits past its
    watchdog) and kills it and the kernel under it. What the kernel had found by then (one assertion, held) is in
    the row. The parent's 5 s start here once the kernel has reported its first cell: how long a loaded machine
    takes to start two Pythons and import gpukit twice is not what is tested."""
    import subprocess
    import time

    started = []

    class Runner(subprocess.Popen):
        def wait(self, timeout=None):
            if timeout is not None:  # the parent's wait for the runner: from the kernel's first report on
                progress = Path(self.args[self.args.index("--one") + 1]).with_name("progress.json")
                deadline = time.perf_counter() + 600
                while not progress.is_file() and time.perf_counter() < deadline and self.poll() is None:
                    time.sleep(0.2)
                started.append(time.perf_counter())
            return super().wait(timeout)

    monkeypatch.setattr(rehearsal.subprocess, "Popen", Runner)
    stubborn = notebook(tmp_path, "assert 1 + 1 == 2",
                        "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(120)",
                        name="96_deaf")
    row = rehearsal.isolated(stubborn, "cpu", 30, grace=100, slack=-125)
    assert row["status"].startswith("not rehearsed to its end: its runner still waited 5 s on, and was killed")
    assert row["fits"] is False and time.perf_counter() - started[0] < 25
    assert row["assertions"] == 1 and row["failed"] == 0  # what the kernel had found, from its last cell
