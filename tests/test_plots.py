"""Plots and widgets draw the measurement's own numbers."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gpukit  # noqa: E402
from gpukit import plots  # noqa: E402
from gpukit.lessons.models import MLP  # noqa: E402
from gpukit.widgets import MemoryGauge  # noqa: E402


@pytest.fixture
def trained():
    torch.manual_seed(0)
    model = MLP(width=128)
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(128, 64), torch.randint(0, 10, (128,))

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    step()
    return model, opt, step


def test_the_timeline_goes_through_forward_backward_and_optimizer_and_peaks_at_the_peak(trained):
    model, opt, step = trained
    with gpukit.measure("cpu", timeline=True, label="step") as r:
        step()
    levels = [level for level, _ in r.timeline]
    assert max(levels) == r.peak and levels[-1] == r.delta
    phases = [p for _, p in r.timeline]
    assert phases.index("backward") < phases.index("optimizer")
    assert set(phases) == {"forward", "backward", "optimizer"}
    ax = plots.timeline(r)
    line = ax.get_lines()[0]
    unit = ax.get_ylabel().split()[0]
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    assert max(line.get_ydata()) * scale == pytest.approx(r.peak)
    assert ax.get_title() and ax.get_xlabel() and ax.get_legend() is not None


def test_a_report_without_a_timeline_says_how_to_get_one():
    with gpukit.measure("cpu") as r:
        torch.empty(10)
    with pytest.raises(ValueError, match="timeline=True"):
        plots.timeline(r)


def test_role_bars_are_the_roles_bytes(trained):
    model, opt, step = trained
    with gpukit.measure("cpu", model=model, optimizer=opt, label="adam step"):
        step()
    with gpukit.measure("cpu", model=model, label="forward only"):
        out = model(torch.randn(32, 64))
    ax = plots.role_bars()
    unit = ax.get_ylabel()
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    h = gpukit.history()
    drawn = {}
    for container, role in zip(ax.containers, [t.get_text() for t in ax.get_legend().get_texts()]):
        for bar, label in zip(container, h["label"]):
            drawn[(label, role)] = bar.get_height() * scale
    for _, row in h.iterrows():
        for role in gpukit.report.ROLES:
            expected = row.get(f"{role} (end)", 0) or 0
            assert drawn.get((row["label"], role), 0) == pytest.approx(expected)
    del out


def test_role_bars_without_roles_say_what_to_do():
    with gpukit.measure("cpu"):
        torch.empty(10)
    with pytest.raises(ValueError, match="--roles"):
        plots.role_bars()


def test_gauge_follows_current_and_peak_against_the_budget():
    gauge = MemoryGauge(budget=10_000)
    for live_start, peak, delta in ((1000, 3000, 500), (1500, 9000, 0), (1500, 500, -200)):
        gauge.update(gpukit.MemoryReport(live_start=live_start, peak=peak, delta=delta, live_end=live_start + delta))
    assert gauge.steps == 3 and gauge.current == 1300 and gauge.highest_peak == 10_500
    assert gauge._peak_bar.max == 10_000 and gauge._peak_bar.value == 10_000
    assert gauge._peak_bar.bar_style == "danger"          # the budget was crossed
    assert "step 3" in repr(gauge) and "budget" in gauge.text()


def test_on_cuda_the_gauge_holds_reserved_bytes_against_the_budget_as_a_cuda_budget_caps_them():
    # A CUDA report: allocated well under the budget, reserved (live + cache) over it.
    gauge = MemoryGauge(budget=10_000)
    gauge.update(gpukit.MemoryReport(device="cuda:0", live_start=1000, peak=4000, delta=0, live_end=1000,
                                     reserved_start=8000, reserved_peak=12_000, reserved_end=12_000))
    assert gauge.highest_peak == 5000 and gauge.capped == 12_000
    assert gauge._peak_bar.bar_style == "danger" and gauge._peak_bar.description == "reserved"
    assert "reserved 11.72 KiB" in gauge.text()


def test_the_explorer_measures_each_technique_and_shows_it():
    from gpukit.lessons.data import digits_batch
    from gpukit.widgets import TechniqueExplorer

    explorer = TechniqueExplorer(lambda: MLP(width=256, depth=4), digits_batch, device="cpu", batch_sizes=(256, 1024))
    base = explorer.run(batch=1024)
    accumulated = explorer.run(accumulation=4)
    checkpointed = explorer.run(accumulation=1, checkpointing=True)
    explorer.button.click()                      # the button runs the current settings again
    bf16 = explorer.run(checkpointing=False, amp=True)
    assert len(explorer.reports) == 5
    assert bf16.peak < base.peak and bf16.label == "batch 1024, bf16"
    assert accumulated.peak < base.peak and checkpointed.peak < base.peak
    assert accumulated.label == "batch 1024, accumulate 4"
    assert "batch 1024, checkpointing" in explorer.table.value and "TechniqueExplorer(" in repr(explorer)
    # The same step gives the same memory: the fourth run repeats the third.
    assert explorer.reports[3].peak == checkpointed.peak
