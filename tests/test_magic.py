"""%gpumem and %%gpumem, run through a real IPython shell."""

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
    result = run(shell, "%%gpumem --label 'one alloc'\nx = torch.empty(1_000_000)")
    assert result.success
    out = capsys.readouterr().out
    assert "one alloc: memory on cpu" in out and "4,000,256" in out and "4,000,000 B unrounded" in out
    assert shell.user_ns["x"].numel() == 1_000_000
    h = gpukit.history()
    assert list(h["label"]) == ["one alloc"] and list(h["peak"]) == [4_000_256]
    assert gpukit.last().delta == 4_000_256


def test_rebinding_a_variable_in_the_cell_frees_its_old_value_inside_the_block(shell):
    run(shell, "big = torch.empty(1_000_000)")
    run(shell, "%%gpumem -q\nbig = torch.empty(1_000_000)")
    assert (gpukit.last().peak, gpukit.last().delta) == (4_000_256, 0)
    run(shell, "model = torch.nn.Linear(2, 2)")
    run(shell, "%%gpumem -q --roles model\nbig = torch.empty(1_000_000)")
    assert gpukit.last().delta == 0


def test_line_magic_measures_one_statement(shell, capsys):
    run(shell, "%gpumem y = torch.empty(256)")
    assert gpukit.last().delta == 1024
    assert gpukit.last().label == "y = torch.empty(256)"
    assert "y" in shell.user_ns


def test_line_magic_takes_quoted_options_before_the_statement(shell):
    run(shell, '%gpumem -l "two blocks" -q z = torch.empty(128) + 1')
    assert gpukit.last().label == "two blocks"
    assert gpukit.last().peak == 1024  # the empty tensor and the sum, 512 B each


def test_cell_value_is_returned_like_a_normal_cell(shell):
    result = run(shell, "%%gpumem -q\na = 40\na + 2")
    assert result.result == 42


def test_quiet_records_but_displays_nothing(shell, capsys):
    run(shell, "%%gpumem -q -l silent\nw = torch.empty(10)")
    assert capsys.readouterr().out == ""
    assert gpukit.last().label == "silent"


@pytest.mark.parametrize("line", [
    "%%gpumem --bogus",
    "%%gpumem --device tpu",
    "%%gpumem --roles nosuchmodel",
    "%%gpumem --roles torch",
    "%%gpumem stray words",
    "%%gpumem -l",
    "%%gpumem -l 'unclosed",
    "%%gpumem --budget lots",
])
def test_bad_flags_print_usage_and_run_nothing(shell, capsys, line):
    result = run(shell, f"{line}\nran = True")
    err = capsys.readouterr().err
    assert result.success
    assert err.startswith("usage: %gpumem") and "error:" in err and "nothing was run" in err
    assert "ran" not in shell.user_ns
    assert len(gpukit.history()) == 0


def test_line_magic_without_a_statement_prints_usage(shell, capsys):
    run(shell, "%gpumem -l lonely")
    assert "no statement to measure" in capsys.readouterr().err
    assert len(gpukit.history()) == 0


def test_roles_flag_breaks_memory_down(shell, capsys):
    run(shell, "model = torch.nn.Linear(10, 10)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)")
    run(shell, "%%gpumem --roles model,opt\nmodel(torch.ones(4, 10)).sum().backward()\nopt.step()")
    report = gpukit.last()
    assert report.roles_end["parameters"] == report.roles_end["gradients"] == 440
    assert "by role" in capsys.readouterr().out


def test_an_exception_in_the_cell_propagates_and_records_nothing(shell):
    result = run(shell, "%%gpumem\nt = torch.empty(100)\nraise ValueError('boom')")
    assert isinstance(result.error_in_exec, ValueError)
    assert not LEDGER.active
    assert len(gpukit.history()) == 0
    assert run(shell, "%%gpumem -q\nu = torch.empty(1)").success  # and the next one works


def test_magics_inside_the_cell_still_work(shell):
    run(shell, "%%gpumem -q\n%time v = torch.empty(64)")
    assert gpukit.last().delta == 512


def test_report_offers_html_to_jupyter(shell):
    run(shell, "%%gpumem -q\nq = torch.empty(10)")
    formats, _ = shell.display_formatter.format(gpukit.last())
    assert "text/html" in formats and "<table>" in formats["text/html"]
    assert "text/plain" in formats


def test_no_leak_over_200_magic_runs(shell):
    run(shell, "w = torch.nn.Linear(50, 50)\nxs = torch.ones(8, 50)")
    run(shell, "%%gpumem -q\nw(xs).sum().backward()")  # the grads exist from here on
    start = (LEDGER.live, len(LEDGER.sizes))
    for _ in range(200):
        run(shell, "%%gpumem -q\nw.zero_grad(set_to_none=True)\nw(xs).sum().backward()")
    import gc

    gc.collect()
    assert (LEDGER.live, len(LEDGER.sizes)) == start
    assert gpukit.last().delta == 0 and len(gpukit.history()) == 201


def test_budget_flag_runs_the_cell_as_if_on_a_smaller_device(shell):
    import gc

    gc.collect()
    with gpukit.measure(record=False) as now:
        pass
    limit = now.live_end + 1_000_000        # 1 MB more than the process holds (a CPU budget counts all of it)
    result = run(shell, f"%%gpumem --budget {limit}\nfits = torch.empty(1000)\ntoo_big = torch.empty(1_000_000)")
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    assert f"budget {gpukit.format_bytes(limit)} ({limit:,} B)" in str(result.error_in_exec)
    assert "fits" in shell.user_ns and "too_big" not in shell.user_ns
    assert LEDGER.limits == [] and not LEDGER.active
    assert run(shell, "%%gpumem -q --budget 1GB\nok = torch.empty(1_000_000)").success
