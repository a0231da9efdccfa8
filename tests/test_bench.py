"""The benchmarks' machinery: the technique matrix, recorded GPU runs in data/runs/, and docs/results.md."""

import importlib
import importlib.util
import os
import shutil
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from gpukit import plots  # noqa: E402
from gpukit.lessons.data import digits_batch  # noqa: E402
from gpukit.lessons.models import MLP  # noqa: E402
from gpukit.lessons.runs import MACHINE_COLUMNS, RUNS_DIR, load_runs, machine, read_run  # noqa: E402
from gpukit.lessons.techniques import (BASELINE, TECHNIQUES, Setup, Technique, measure_technique,  # noqa: E402
                               run_matrix)

ROOT = Path(__file__).resolve().parent.parent
TINY = Setup("tiny mlp 32x6", lambda: MLP(width=32, depth=6), digits_batch, 128)
BY_NAME = {t.name: t for t in TECHNIQUES}
ROW_KEYS = {"model", "technique", "batch", "micro_batch", "measured_on", "peak_bytes", "state_bytes", "reserved_bytes",
            "step_ms", "samples_per_s", "timed_steps", "status", "peak_vs_baseline"}


def load_bench(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


write_run, slug = load_bench("results").write_run, load_bench("results").slug


@pytest.fixture(scope="module")
def matrix():
    """The whole matrix on the tiny setup, memory only (no timing)."""
    rows = run_matrix("cpu", [TINY], steps=0, echo=None)
    return {r["technique"]: r for r in rows}


def test_every_technique_gives_a_row_with_every_column(matrix):
    assert list(matrix) == [t.name for t in TECHNIQUES]
    for row in matrix.values():
        assert set(row) == ROW_KEYS
        assert row["peak_bytes"] > row["state_bytes"] > 0
        assert row["reserved_bytes"] is None  # a GPU's caching allocator only: none on the CPU
        assert row["status"] in ("ok", "simulated GPU (meta): memory only, no time")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_each_row_has_its_reserved_memory_from_an_emptied_cache():
    """Device: cuda. A row's reserved memory is whole segments (2 MiB multiples: CUDACachingAllocator.cpp's
    kSmallBuffer, kRoundLarge) holding at least its peak, and what an earlier row cached is not in it: a small step
    after a big one reserves what it does after a small one."""
    big = Setup("wide mlp 2048x6", lambda: MLP(width=2048, depth=6), digits_batch, 4096)
    first = measure_technique(TINY, BASELINE, "cuda", steps=0)
    measure_technique(big, BASELINE, "cuda", steps=0)
    again = measure_technique(TINY, BASELINE, "cuda", steps=0)
    for row in (first, again):
        assert row["reserved_bytes"] % 2**21 == 0 and row["reserved_bytes"] >= row["peak_bytes"]
    assert again["reserved_bytes"] == first["reserved_bytes"]


@pytest.mark.parametrize("technique", ["accumulation k=4", "checkpointing", "AMP bf16", "half, BatchNorm float32",
                                       "accumulation k=4 + checkpointing"])
def test_each_technique_lowers_the_peak_of_an_activation_heavy_step(matrix, technique):
    # batch 128 > width 32: the activations a step saves outweigh the weights
    assert matrix[technique]["peak_bytes"] < matrix["baseline"]["peak_bytes"]
    assert matrix[technique]["peak_vs_baseline"] == round(matrix[technique]["peak_bytes"]
                                                          / matrix["baseline"]["peak_bytes"], 3)


def test_accumulation_keeps_the_state_and_splits_the_batch(matrix):
    row = matrix["accumulation k=4"]
    assert row["micro_batch"] == TINY.batch // 4
    assert row["state_bytes"] == matrix["baseline"]["state_bytes"]


def test_half_halves_the_parameters_in_the_state(matrix):
    model = MLP(width=32, depth=6)
    params = sum(p.numel() for p in model.parameters())
    # parameters, gradients and AdamW's two moments: four float32 copies become four float16 ones
    saved = matrix["baseline"]["state_bytes"] - matrix["half, BatchNorm float32"]["state_bytes"]
    assert saved >= 4 * params * 2 - 4 * len(list(model.parameters())) * 512  # less what rounding to 512 B keeps
    assert saved <= 4 * params * 2 + TINY.batch * 64 * 2 + 512  # and the float16 copy of the images


def test_offload_on_a_cpu_is_measured_on_the_simulated_gpu_against_a_simulated_baseline(matrix):
    row = matrix["offload saved activations"]
    assert row["measured_on"].startswith("meta")
    assert row["step_ms"] is None and row["samples_per_s"] is None
    simulated_baseline = measure_technique(TINY, BASELINE, "meta", steps=0)
    assert row["peak_vs_baseline"] == round(row["peak_bytes"] / simulated_baseline["peak_bytes"], 3)
    assert row["peak_vs_baseline"] < 1


def test_a_timed_row_reports_the_median_and_samples_per_second():
    row = measure_technique(TINY, BASELINE, "cpu", steps=3, max_seconds=30)
    assert row["timed_steps"] == 3
    assert row["samples_per_s"] == pytest.approx(TINY.batch / (row["step_ms"] / 1e3), rel=1e-3)


def test_a_technique_the_device_cannot_run_gives_a_row_that_says_so():
    row = measure_technique(TINY, BY_NAME["AMP bf16"], "meta", steps=0)
    assert row["peak_bytes"] is None and row["status"].startswith("not run")


def test_a_failing_technique_gives_a_row_with_the_error():
    broken = Setup("broken", lambda: MLP(n_in=3), digits_batch, 8)  # the digits have 64 features, not 3
    row = measure_technique(broken, BASELINE, "cpu", steps=0)
    assert row["peak_bytes"] is None and row["status"].startswith("failed on cpu")


# -- recorded runs -------------------------------------------------------------------------------


def test_a_recorded_run_reads_back_with_its_machine(tmp_path, matrix):
    info = {**machine("cpu"), "device_type": "cuda", "device_name": "Example GPU 80GB", "driver": "999.1"}
    path = write_run(list(matrix.values()), info, folder=tmp_path)
    assert path.name == "example-gpu-80gb.csv"
    df = read_run(path)
    assert set(MACHINE_COLUMNS) <= set(df.columns)
    assert (df["device_name"] == "Example GPU 80GB").all() and (df["torch"] == torch.__version__).all()
    assert df["peak_bytes"].tolist() == [r["peak_bytes"] for r in matrix.values()]
    assert load_runs(tmp_path)["file"].unique().tolist() == ["example-gpu-80gb.csv"]


def test_a_cpu_run_is_named_as_one():
    assert slug(machine("cpu")).startswith("cpu-")


@pytest.mark.parametrize("column", ["device_name", "torch"])
def test_a_run_without_its_gpu_name_or_torch_version_is_refused(tmp_path, matrix, column):
    path = write_run(list(matrix.values()), machine("cpu"), folder=tmp_path)
    df = pd.read_csv(path)
    df.drop(columns=[column]).to_csv(tmp_path / "missing.csv", index=False)
    with pytest.raises(ValueError, match=column):
        read_run(tmp_path / "missing.csv")
    df.assign(**{column: ""}).to_csv(tmp_path / "empty.csv", index=False)
    with pytest.raises(ValueError, match=column):
        read_run(tmp_path / "empty.csv")
    with pytest.raises(ValueError):
        load_runs(tmp_path)


def test_no_recorded_runs_is_an_empty_table(tmp_path):
    runs = load_runs(tmp_path)
    assert runs.empty and "device_name" in runs.columns
    with pytest.raises(FileNotFoundError, match="no folder .* of recorded runs"):
        load_runs(tmp_path / "not-there")      # a misspelt folder is not 'no runs'


def test_every_committed_run_names_its_machine(tmp_path, matrix):
    # The committed files beside a made-up GPU run, so that the check is tested while data/runs/ is empty too.
    committed = sorted(RUNS_DIR.glob("*.csv"))
    for path in committed:
        shutil.copy(path, tmp_path)
    info = {**machine("cpu"), "device_type": "cuda", "device_name": "Made-up GPU 80GB", "driver": "999.1"}
    made_up = write_run(list(matrix.values()), info, folder=tmp_path)
    runs = load_runs(tmp_path)  # raises on a file that does not name its machine
    assert sorted(runs["file"].unique()) == sorted([p.name for p in committed] + [made_up.name])
    assert not (runs["device_type"] == "cpu").any(), "a CPU run is no GPU run: keep it out of data/runs/"
    # ...and the same check refuses a file without its GPU's name, among the others
    pd.read_csv(made_up).drop(columns=["device_name"]).to_csv(tmp_path / "unnamed.csv", index=False)
    with pytest.raises(ValueError, match="device_name"):
        load_runs(tmp_path)


# -- plots and the results page ------------------------------------------------------------------


def test_the_bars_are_the_matrix_figures(matrix):
    rows = [matrix[t] for t in ("baseline", "checkpointing", "AMP bf16")]
    ax = plots.technique_bars(rows, "peak_vs_baseline")
    assert sorted(round(p.get_width(), 3) for p in ax.patches) == sorted(r["peak_vs_baseline"] for r in rows)
    ax = plots.technique_bars(rows, "peak_bytes")
    assert "KiB" in ax.get_xlabel() or "MiB" in ax.get_xlabel()
    with pytest.raises(ValueError):
        plots.technique_bars([{**rows[0], "peak_bytes": None}], "peak_bytes")


def test_the_results_page_generator_replaces_only_its_section():
    page = load_bench("results_page")
    text = f"# title\nbefore\n{page.START}\nold table\n{page.END}\nafter\n"
    new = page.replace_section(text, "new table")
    assert new == f"# title\nbefore\n{page.START}\nnew table\n{page.END}\nafter\n"
    assert page.replace_section(new, "new table") == new
    for broken in ("no markers", f"{page.END}\n{page.START}", f"{page.START}{page.START}{page.END}"):
        with pytest.raises(ValueError):
            page.replace_section(broken, "x")


def test_the_results_page_has_its_results_section_and_its_plot_beside_it():
    page = load_bench("results_page")
    assert page.PAGE == ROOT / "docs" / "results.md"
    text = page.PAGE.read_text()
    assert text.count(page.START) == 1 and text.count(page.END) == 1
    section = text.split(page.START)[1].split(page.END)[0]
    assert "](results.png)" in section and (page.PAGE.parent / "results.png").is_file()
    assert page.START not in (ROOT / "README.md").read_text()


def test_recording_needs_the_technique_matrix():
    run = load_bench("run")
    with pytest.raises(SystemExit) as exit_:
        run.main(["exactness", "--record"])
    assert exit_.value.code == 2


def test_the_cuda_exactness_reference_replays_the_allocators_trace(monkeypatch):
    # A stand-in for the allocator's event log: requested sizes, a free that completes later (its memory is no
    # longer allocated once requested), and the events that were there before the measured run.
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    exactness = load_bench("exactness")
    before = [{"action": "alloc", "size": 10**9}]
    during = [{"action": "alloc", "size": 1000}, {"action": "segment_alloc", "size": 2**21},
              {"action": "alloc", "size": 3000}, {"action": "free_requested", "size": 1000},
              {"action": "free_completed", "size": 1000}, {"action": "alloc", "size": 2000},
              {"action": "free_requested", "size": 3000}]
    log = list(before)

    def run():
        log.extend(during)

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"device_traces": [list(log)]})
    assert exactness.allocator_trace_peak(run, torch.device("cuda", 0)) == 5000  # 3000 + 2000 after the free


@pytest.fixture
def published(monkeypatch):
    """bench/published.py, imported as the benchmark runner imports it (beside its sibling ``results``, and by name:
    its dataclass looks its module up in sys.modules)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    return importlib.import_module("published")


def test_every_published_configuration_names_its_source_metric_and_run(published):
    from gpukit.cards import CARDS

    assert len(published.CONFIGS) >= 8
    assert len({c.name for c in published.CONFIGS}) == len(published.CONFIGS)
    for c in published.CONFIGS:
        assert "commit" in c.source and c.metric and c.configuration and c.assumed, c.name
        assert c.card in CARDS and c.counts in ("allocated", "reserved")
        # the figure is the one the quote prints: MB as nvidia-smi's MiB, or GB as max_memory_allocated / 1e9
        figure = f"{c.published_mib:.0f}" if c.counts == "reserved" else f"{c.published_mib * 2**20 / 1e9:.2f}"
        assert figure in c.quote, (c.name, figure, c.quote)
        assert c.context_mib == 0 or c.counts == "reserved"


def test_a_small_published_style_run_is_predicted_end_to_end(published):
    """A 1-layer BERT through the same Trainer step (accumulation, checkpointing, fp16 and its GradScaler) as the
    published rows, on the CPU, predicting for a card: the row's predicted figure is the context plus the simulated
    reserved bytes, and its error is measured against the published figure."""
    from transformers import BertConfig

    small = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                       intermediate_size=128, max_position_embeddings=512, num_labels=2)
    config = published.Config(
        name="small", source="commit x", quote="1000 MB", configuration="batch 1 x 2", metric="nvidia-smi",
        published_mib=1000, card="t4", counts="reserved", context_mib=500, assumed="-",
        make_model=published.bert_classifier(small, checkpointing=True), make_optimizer=published.adamw_hf,
        make_batch=published.dummy_batch(2), make_step=lambda: published.trainer_step(accumulation=2, fp16=True))
    row = published.run(config)
    assert row["predicted_reserved_mib"] >= row["predicted_allocated_mib"] > 0
    assert row["predicted_mib"] == pytest.approx(500 + row["predicted_reserved_mib"], abs=0.1)
    assert row["error_pct"] == pytest.approx(100 * (row["predicted_mib"] - 1000) / 1000, abs=0.01)
    assert not any(flag.startswith("not as on the card") for flag in row["flags"].split("; "))


def test_a_table_whose_first_row_failed_before_its_figures_is_written_with_every_rows_columns(tmp_path):
    """Device: none. A benchmark's first case can fail before its figures (bench/recorded_runs.py: a row not
    predicted): the table still has every column, the machine's last, and that row's figures are empty cells."""
    write_rows = load_bench("results").write_rows
    path = write_rows(tmp_path / "t.csv", [{"case": "a", "status": "failed: x"},
                                           {"case": "b", "peak": 5, "status": "ok"}], {"torch": "2.13"})
    table = pd.read_csv(path, keep_default_na=False, dtype=str)
    assert list(table.columns) == ["case", "status", "peak", "torch"]
    assert table.to_dict("records") == [{"case": "a", "status": "failed: x", "peak": "", "torch": "2.13"},
                                        {"case": "b", "status": "ok", "peak": "5", "torch": "2.13"}]


def test_a_new_run_keeps_the_earlier_run_of_its_machine_from_another_day_with_its_report_and_traces(tmp_path, matrix):
    """Device: none. A recorded run is evidence that tests and the replay read: a run of the same machine on another
    day moves it, with its gpu-check report and its traces, to earlier/ beside it, dated; one of the same day is
    replaced."""
    results = load_bench("results")
    info = {**machine("cpu"), "device_type": "cuda", "device_name": "Example GPU 80GB", "driver": "999.1"}
    first = write_run(list(matrix.values()), {**info, "date": "2026-11-25"}, folder=tmp_path)
    report = tmp_path / "example-gpu-80gb-gpu-check.txt"
    report.write_text("the first run's report\n")
    traces = tmp_path / "traces"
    (traces / "example-gpu-80gb").mkdir(parents=True)
    (traces / "example-gpu-80gb" / "row.json.gz").write_bytes(b"x")
    assert results.keep_earlier(first, "2026-11-25", traces) is None  # the same day: replaced in its place
    for p in (first, report, traces / "example-gpu-80gb" / "row.json.gz"):
        os.utime(p, (time.time() - 86400,) * 2)  # (written the day before)
    moved = results.keep_earlier(first, "2026-12-07", traces)
    assert moved == tmp_path / "earlier" / "example-gpu-80gb-2026-11-25.csv" and not first.exists()
    kept_report = tmp_path / "earlier" / "example-gpu-80gb-2026-11-25-gpu-check.txt"
    assert kept_report.read_text() == "the first run's report\n"
    assert (traces / "earlier" / "example-gpu-80gb-2026-11-25" / "row.json.gz").read_bytes() == b"x"
    # written now, as far as kit.py gpu-check can tell: it brings back the files its run wrote, by modification time
    assert all(p.stat().st_mtime > time.time() - 60 for p in (moved, kept_report))
    second = write_run(list(matrix.values()), {**info, "date": "2026-12-07"}, folder=tmp_path)
    assert second == first and load_runs(tmp_path)["date"].unique().tolist() == ["2026-12-07"]  # the lessons: latest
    assert read_run(moved)["date"].unique().tolist() == ["2026-11-25"]
    write_run(list(matrix.values()), {**info, "date": "2026-12-08"}, folder=tmp_path)  # (no traces, no report now)
    assert sorted(p.name for p in (tmp_path / "earlier").glob("*.csv")) == [
        "example-gpu-80gb-2026-11-25.csv", "example-gpu-80gb-2026-12-07.csv"]
