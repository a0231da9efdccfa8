"""%gpumem and %%gpumem, run through a real IPython shell."""

import os
import re

import IPython
import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell

import gpukit
from gpukit.counter import LEDGER


@pytest.fixture(scope="module")
def shell():
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "gpukit")
    return ip


@pytest.fixture(autouse=True)
def fresh_namespace(shell):
    shell.reset()
    shell.run_cell("import torch")
    yield


def run(shell, code):
    result = shell.run_cell(code)
    return result


def test_cell_magic_measures_the_cell_and_records_it(shell, capsys):
    result = run(shell, "%%gpumem --device cpu --label 'one alloc'\nx = torch.empty(1_000_000)")
    assert result.success
    out = capsys.readouterr().out
    assert "one alloc: memory on cpu" in out and "4,000,256" in out and "4,000,000 B unrounded" in out
    assert shell.user_ns["x"].numel() == 1_000_000
    h = gpukit.history()
    assert list(h["label"]) == ["one alloc"] and list(h["peak"]) == [4_000_256]
    assert gpukit.last().delta == 4_000_256


def test_rebinding_a_variable_in_the_cell_frees_its_old_value_inside_the_block(shell):
    run(shell, "big = torch.empty(1_000_000)")
    run(shell, "%%gpumem --device cpu -q\nbig = torch.empty(1_000_000)")
    assert (gpukit.last().peak, gpukit.last().delta) == (4_000_256, 0)
    run(shell, "model = torch.nn.Linear(2, 2)")
    run(shell, "%%gpumem --device cpu -q --roles model\nbig = torch.empty(1_000_000)")
    assert gpukit.last().delta == 0


def test_line_magic_measures_one_statement(shell, capsys):
    run(shell, "%gpumem --device cpu y = torch.empty(256)")
    assert gpukit.last().delta == 1024
    assert gpukit.last().label == "y = torch.empty(256)"
    assert "y" in shell.user_ns


def test_line_magic_takes_quoted_options_before_the_statement(shell):
    run(shell, '%gpumem --device cpu -l "two blocks" -q z = torch.empty(128) + 1')
    assert gpukit.last().label == "two blocks"
    assert gpukit.last().peak == 1024  # the empty tensor and the sum, 512 B each


def test_cell_value_is_returned_like_a_normal_cell(shell):
    result = run(shell, "%%gpumem --device cpu -q\na = 40\na + 2")
    assert result.result == 42


def test_quiet_records_but_displays_nothing(shell, capsys):
    run(shell, "%%gpumem --device cpu -q -l silent\nw = torch.empty(10)")
    assert capsys.readouterr().out == ""
    assert gpukit.last().label == "silent"


@pytest.mark.parametrize("line", [
    "%%gpumem --device cpu --bogus",
    "%%gpumem --device tpu",
    "%%gpumem --device cpu --roles nosuchmodel",
    "%%gpumem --device cpu --roles torch",
    "%%gpumem --device cpu stray words",
    "%%gpumem --device cpu -l",
    "%%gpumem --device cpu -l 'unclosed",
    "%%gpumem --device cpu --budget lots",
    "%%gpumem --device cpu --budget 1e400",
    "%%gpumem --device cpu --budget ''",
    "%%gpumem --device cpu --budget -1GB",
    "%%gpumem --device cpu -b -1GB",
    "%%gpumem --device meta --budget 1MB",
])
def test_bad_flags_print_usage_and_run_nothing(shell, capsys, line):
    result = run(shell, f"{line}\nran = True")
    err = capsys.readouterr().err
    assert result.success
    assert err.startswith("usage: %gpumem") and "error:" in err and "nothing was run" in err
    assert "ran" not in shell.user_ns
    assert len(gpukit.history()) == 0


def test_line_magic_without_a_statement_prints_usage(shell, capsys):
    run(shell, "%gpumem --device cpu -l lonely")
    assert "no statement to measure" in capsys.readouterr().err
    assert len(gpukit.history()) == 0


def test_roles_flag_breaks_memory_down(shell, capsys):
    run(shell, "model = torch.nn.Linear(10, 10)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)")
    run(shell, "%%gpumem --device cpu --roles model,opt\nmodel(torch.ones(4, 10)).sum().backward()\nopt.step()")
    report = gpukit.last()
    assert report.roles_end["parameters"] == report.roles_end["gradients"] == 440
    assert "by role" in capsys.readouterr().out


def test_an_exception_in_the_cell_propagates_and_records_nothing(shell):
    result = run(shell, "%%gpumem --device cpu\nt = torch.empty(100)\nraise ValueError('boom')")
    assert isinstance(result.error_in_exec, ValueError)
    assert not LEDGER.active
    assert len(gpukit.history()) == 0
    assert run(shell, "%%gpumem --device cpu -q\nu = torch.empty(1)").success  # and the next one works


def test_magics_inside_the_cell_still_work(shell):
    run(shell, "%%gpumem --device cpu -q\n%time v = torch.empty(64)")
    assert gpukit.last().delta == 512


def test_report_offers_html_to_jupyter(shell):
    run(shell, "%%gpumem --device cpu -q\nq = torch.empty(10)")
    formats, _ = shell.display_formatter.format(gpukit.last())
    assert "text/html" in formats and "<table" in formats["text/html"]
    assert "text/plain" in formats


def test_no_leak_over_200_magic_runs(shell):
    run(shell, "w = torch.nn.Linear(50, 50)\nxs = torch.ones(8, 50)")
    run(shell, "%%gpumem --device cpu -q\nw(xs).sum().backward()")  # the grads exist from here on
    start = (LEDGER.live, len(LEDGER.sizes))
    for _ in range(200):
        run(shell, "%%gpumem --device cpu -q\nw.zero_grad(set_to_none=True)\nw(xs).sum().backward()")
    import gc

    gc.collect()
    assert (LEDGER.live, len(LEDGER.sizes)) == start
    assert gpukit.last().delta == 0 and len(gpukit.history()) == 201


def test_budget_flag_runs_the_cell_as_if_on_a_smaller_device(shell):
    import gc

    gc.collect()
    with gpukit.measure("cpu", record=False) as now:
        pass
    limit = now.live_end + 1_000_000        # 1 MB more than the process holds (a CPU budget counts all of it)
    result = run(shell, f"%%gpumem --device cpu --budget {limit}\nfits = torch.empty(1000)\n"
                        "too_big = torch.empty(1_000_000)")
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    assert f"budget {gpukit.format_bytes(limit)} ({limit:,} B)" in str(result.error_in_exec)
    assert "fits" in shell.user_ns and "too_big" not in shell.user_ns
    assert LEDGER.limits == [] and not LEDGER.active
    assert run(shell, "%%gpumem --device cpu -q --budget 1GB\nok = torch.empty(1_000_000)").success


@pytest.mark.parametrize("line, says", [
    ("%%gpumem --device cpu --budget -1GB", "a size must be positive, got '-1GB'"),
    ("%%gpumem --device cpu --budget 1e400", "not a finite number of bytes"),
    ("%%gpumem --device cpu --budget ''", "not a size: ''"),
    ("%%gpumem --device meta --budget 1MB", "a budget caps 'cpu' or 'cuda' memory"),
])
def test_bad_budgets_say_what_is_wrong(shell, capsys, line, says):
    run(shell, f"{line}\nran = True")
    assert says in capsys.readouterr().err
    assert "ran" not in shell.user_ns


def test_a_traceback_from_a_measured_cell_shows_the_failing_line(shell, capsys):
    result = run(shell, "%%gpumem --device cpu\nx = 1\ny = x / 0  # the failing line\n")
    out = capsys.readouterr()
    assert isinstance(result.error_in_exec, ZeroDivisionError)
    text = out.out + out.err
    assert "y = x / 0  # the failing line" in text and "Could not get source" not in text


def test_a_trailing_semicolon_hides_the_value_as_in_a_plain_cell(shell):
    assert run(shell, "%%gpumem --device cpu --quiet\n1 + 1;").result is None
    assert run(shell, "%%gpumem --device cpu --quiet\n1 + 1").result == 2
    assert run(shell, "%%gpumem --device cpu --quiet\n1 + 1;  # a comment after it").result is None


def test_the_options_are_declared_once_and_both_parsers_follow_the_declaration(shell, capsys):
    from gpukit.magic import OPTIONS, GpuMemMagics, split_line

    parser = GpuMemMagics.gpumem.parser
    usage = parser.format_help()
    for flags, spec in OPTIONS:
        assert all(flag in usage for flag in flags)
        if "action" not in spec:  # a value option: the line magic finds the statement after its value
            assert split_line(f"{flags[0]} 'a b' y = 1") == ([flags[0], "a b"], "y = 1")
        else:
            assert split_line(f"{flags[0]} y = 1") == ([flags[0]], "y = 1")


def test_host_flag_leaves_the_named_variables_out_of_the_budget(shell):
    import gc

    run(shell, "data = torch.ones(8_000_000)")                # 32 MB, in memory before the cell
    gc.collect()
    with gpukit.measure("cpu", record=False) as now:
        pass
    limit = now.live_end - 32_000_000 + 1_000_000               # 1 MB besides the rest of the process
    cell = "%%gpumem --device cpu -q --budget {} {}\nbatch = data[:1000].clone()"
    assert run(shell, cell.format(limit, "--host data")).success
    with pytest.warns(gpukit.BudgetWarning, match="--host data") as warned:
        assert isinstance(run(shell, cell.format(limit, "")).error_in_exec, torch.OutOfMemoryError)
    assert warned[0].filename.startswith("<ipython-input")  # the cell, not IPython's or gpukit's code
    assert LEDGER.limits == [] and not LEDGER.active


@pytest.mark.parametrize("line, says", [
    ("%%gpumem --device cpu --host data", "--host names what a --budget leaves out"),
    ("%%gpumem --device cpu --budget 1GB --host nothing_here", "--host: no variable named 'nothing_here'"),
])
def test_host_flag_misuse_says_what_is_wrong(shell, capsys, line, says):
    run(shell, f"data = torch.ones(10)\n")
    run(shell, f"{line}\nran = True")
    assert says in capsys.readouterr().err
    assert "ran" not in shell.user_ns


@pytest.mark.parametrize("cell", [
    "with gpukit.budget(1, 'cpu'):\n    y = torch.ones(1000)  # the user's op\n",
    "%%gpumem --device cpu --budget 1\ny = torch.ones(1000)  # the user's op\n",
], ids=["budget", "%%gpumem --budget"])
@pytest.mark.filterwarnings("ignore::gpukit.BudgetWarning")  # a 1-byte budget is full as it opens (test_budget)
def test_an_out_of_memory_traceback_in_ipython_shows_the_users_op_and_one_frame_of_gpukit(shell, capsys, cell):
    """IPython hides frames with ``__tracebackhide__`` but always shows the one that raised (ultratb's last
    record): the user's op, then gpukit's single raising line; no frame of torch, dynamo or the magic."""
    run(shell, "import gpukit")
    result = run(shell, cell)
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    text = capsys.readouterr()
    text = re.sub(r"\x1b\[[0-9;]*m", "", text.out + text.err)
    assert "----> 2     y = torch.ones(1000)  # the user's op" in text or "----> 1 y = torch.ones(1000)" in text
    # A frame outside the cell: "File PATH:LINE, in f" (IPython 8, 9), "PATH in f(...)" (IPython 7, Colab's).
    files = re.findall(r"^(?:File (\S+):\d+|(\S+\.py) in \w+\()", text, re.M)
    files = [a or b for a, b in files]
    if IPython.version_info < (8,):
        # IPython 7 shows its own frames that run a cell magic (8 hides them); gpukit's are hidden all the same.
        files = [f for f in files if os.sep + "IPython" + os.sep not in f]
    assert len(files) == 1 and os.path.join("gpukit", "counter", "") in files[0]  # the counter's raising line
    assert "a gpukit budget refused the op on your last line above" in text
    assert "_dynamo" not in text and os.path.join("gpukit", "magic.py") not in text
