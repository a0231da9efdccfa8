"""Several ranks under torchrun: results come back, a failing rank or a hung run ends cleanly."""

import os
import textwrap
import time
from pathlib import Path

import pytest
import torch

import gpukit.distributed

from gpukit.lessons import dataparallel
from gpukit.distributed import (RankFailed, alive, choose_backend, launch, publish, rank_environment,
                                torchrun_command)
from gpukit.lessons.parallel import fsdp_shard_bytes, make_model, model_state_formulas

ROOT = Path(__file__).resolve().parent.parent


def rank_script(tmp_path: Path, body: str) -> Path:
    """A script whose ranks write their pid into tmp_path (so the test can look for leftovers), then run ``body``."""
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        from pathlib import Path
        import torch, torch.distributed as dist
        from gpukit.distributed import publish, publish_tensors, run_rank

        def main(ctx):
            Path(sys.argv[1], f"pid{ctx.rank}").write_text(str(os.getpid()))
        """) + textwrap.indent(textwrap.dedent(body), "    ") + "\nrun_rank(main)\n")
    return script


def processes_running(script: Path) -> list[int]:
    """Live processes whose command line mentions ``script``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(script).encode() in (entry / "cmdline").read_bytes() and alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_each_rank_publishes_records_and_tensors_and_ends_without_interpreter_teardown(tmp_path):
    # Interpreter teardown (atexit handlers, finalization, C++ static destructors) racing the threads a
    # process group started is what aborted ranks at exit ("terminate called without an active exception").
    # A rank started by run_rank exits once its work is done and its process group destroyed: teardown never
    # runs, so the abort planted there cannot fire.
    script = rank_script(tmp_path, """
        import atexit
        atexit.register(os.abort)
        total = torch.tensor([float(ctx.rank + 1)])
        dist.all_reduce(total)
        publish({"sum": total.item(), "backend": ctx.backend, "world": ctx.world_size,
                 "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "cuda": torch.cuda.is_available()})
        publish({"second": True})
        publish_tensors("mine", {"r": torch.full((2,), float(ctx.rank))})
        """)
    results = launch(script, tmp_path, nproc=2, timeout=120)
    frame = results.frame()
    assert sorted(frame["rank"]) == [0, 0, 1, 1]
    sums = frame.dropna(subset=["sum"])
    backend = choose_backend(2)[0]   # gloo here; NCCL on a machine with two GPUs
    assert list(sums["sum"]) == [3.0, 3.0] and set(sums["backend"]) == {backend} and set(sums["world"]) == {2}
    if backend == "gloo":            # gloo ranks are CPU ranks: no GPU visible to them
        assert set(sums["visible"]) == {""} and not sums["cuda"].any()
    assert len(results.frame(second=True)) == 2
    assert torch.equal(results.tensors[1, "mine"]["r"], torch.ones(2))
    assert torch.equal(results.tensors[0, "mine"]["r"], torch.zeros(2))
    assert results.seconds > 0
    assert "Signal 6" not in results.log and "SIGABRT" not in results.log
    assert processes_running(script) == []


def test_a_rank_that_raises_ends_the_run_with_its_traceback_and_leaves_no_process(tmp_path):
    script = rank_script(tmp_path, """
        if ctx.rank == 1:
            time.sleep(1)
            raise ValueError("rank one broke on purpose")
        dist.barrier()          # rank 0 would wait here for ever
        time.sleep(600)
        """)
    start = time.monotonic()
    with pytest.raises(RankFailed) as failure:
        launch(script, tmp_path, nproc=2, timeout=120)
    assert failure.value.rank == 1
    assert "ValueError: rank one broke on purpose" in str(failure.value)
    assert time.monotonic() - start < 100
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
    assert not any(alive(pid) for pid in pids)
    assert processes_running(script) == []


def test_a_run_past_its_time_limit_is_stopped_and_leaves_no_process(tmp_path):
    script = rank_script(tmp_path, """
        time.sleep(600)
        """)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="ran past 10 s"):
        launch(script, tmp_path, nproc=2, timeout=10)
    assert time.monotonic() - start < 10 + 45
    # On a loaded machine (a fresh environment compiling every module it imports, say) a rank may not be up
    # within the 10 s: then torchrun and the half-started rank are what must be stopped.
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    assert not any(alive(pid) for pid in pids)
    assert processes_running(script) == []


def test_the_command_is_torchrun_on_127_0_0_1():
    cmd = torchrun_command("gpukit.lessons.parallel", ["ddp", 3], nproc=4, port=12345)
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert "--nproc-per-node=4" in cmd and "--master-addr=127.0.0.1" in cmd and "--master-port=12345" in cmd
    assert cmd[-4:] == ["-m", "gpukit.lessons.parallel", "ddp", "3"]
    assert torchrun_command("/x/ranks.py", nproc=1)[-1] == "/x/ranks.py"
    with pytest.raises(ValueError, match="at least 1"):
        torchrun_command("gpukit.lessons.parallel", nproc=0)


def test_cpu_uses_gloo():
    if torch.cuda.is_available():
        assert choose_backend(torch.cuda.device_count())[0] == "nccl"
        assert choose_backend(torch.cuda.device_count() + 1)[0] == "gloo"
    else:
        assert choose_backend(2) == ("gloo", torch.device("cpu"))


@pytest.mark.parametrize("gpus, nproc, hidden", [(0, 2, True), (1, 2, True), (2, 2, False), (1, 1, False)])
def test_ranks_that_fall_back_to_gloo_see_no_gpu(monkeypatch, gpus, nproc, hidden):
    # One GPU, two ranks: gloo. A visible GPU would pull FSDP2's default mesh onto cuda:LOCAL_RANK.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    env = rank_environment(nproc)
    assert choose_backend(nproc)[0] == ("gloo" if hidden else "nccl")
    assert env["CUDA_VISIBLE_DEVICES"] == ("" if hidden else "0,1")
    assert env["MASTER_ADDR"] == "127.0.0.1"


def test_publishing_outside_a_launch_says_what_to_do(monkeypatch):
    monkeypatch.delenv("GPUKIT_RANK_RESULTS", raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="launch"):
        publish({"x": 1})


def test_formulas_give_the_zero_papers_figure_1():
    # Rajbhandari et al., "ZeRO" (2020), Figure 1: 7.5B parameters, 64 GPUs, mixed-precision Adam
    # (2 + 2 + 12 bytes per parameter): 120 GB, 31.4 GB, 16.6 GB and 1.9 GB per GPU.
    rows = model_state_formulas(7_500_000_000, 64, param_bytes=2, grad_bytes=2, optimizer_bytes=12)
    assert [round(r["total"] / 1e9, 1) for r in rows] == [120.0, 31.4, 16.6, 1.9]
    one = model_state_formulas(1000, 1)
    assert len({r["total"] for r in one}) == 1  # one rank: sharding changes nothing


def test_fsdp_shard_bounds_bracket_an_even_split():
    model = make_model(width=100, depth=2)  # 100 rows per layer: 3 ranks cannot split them evenly
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    least, most = fsdp_shard_bytes(model, 3)
    assert least == total // 3
    assert least < most <= least + sum(p[0].numel() * 4 + 512 for p in model.parameters())


def test_even_shares_are_torch_chunk_sizes():
    for batch, n in [(1024, 2), (10, 3), (7, 4), (3, 4)]:
        chunks = [len(c) for c in torch.arange(batch).chunk(n)]
        assert dataparallel.even_shares(batch, n)[:len(chunks)] == chunks
        assert sum(dataparallel.even_shares(batch, n)) == batch


def test_the_articles_balanced_split_gives_device_0_its_share_and_falls_back_to_the_even_split_silently():
    # No tensors: BalancedDataParallel.scatter's arithmetic, as the source article writes it.
    chunks = dataparallel.article_chunk_sizes
    assert chunks(1024, 400, 2) == [400, 624]
    assert chunks(10, 1, 4) == [1, 3, 3, 3]
    assert chunks(11, 1, 4) == [1, 4, 3, 3]              # the remainder, one sample each from device 1 on
    assert chunks(10, 0, 3) == [0, 5, 5]                 # device 0 left out
    for asked in (512, 600, 1024):                       # not below the others' share: DataParallel's split
        assert chunks(1024, asked, 2) == dataparallel.even_shares(1024, 2)
    assert chunks(7, 2, 3) == dataparallel.even_shares(7, 3) == [3, 3, 1]
    for batch, asked, devices in [(10, 11, 2), (10, -1, 2), (10, 1, 1)]:
        with pytest.raises(ValueError):
            chunks(batch, asked, devices)


def test_dataparallel_device_0_holds_more_and_balancing_evens_it_out():
    from gpukit.lessons.data import digits_batch

    x, y = digits_batch(256)
    make = lambda: make_model(width=128, depth=2)  # noqa: E731
    even = dataparallel.accounting(make, x, y, [128, 128])
    for row in even:
        assert row["total"] == sum(row[r] for r in dataparallel.ROLES)
    zero, one = even
    assert zero["parameters"] == one["parameters"] > 0
    n_tensors = len(list(make().parameters()))
    # Adam: two values per parameter, and a one-number step count per tensor (512 bytes each)
    assert zero["optimizer_state"] == 2 * zero["parameters"] + 512 * n_tensors
    assert one["optimizer_state"] == one["gathered_outputs"] == 0
    assert zero["total"] - one["total"] >= zero["optimizer_state"]
    shares, balanced = dataparallel.balanced_shares(make, x, y, 2)
    assert shares[0] < 128 and sum(shares) == 256
    assert max(r["total"] for r in balanced) < zero["total"]
    with pytest.raises(ValueError, match="add up"):
        dataparallel.accounting(make, x, y, [100, 100])


def test_an_interrupted_launch_stops_its_ranks(tmp_path, monkeypatch):
    import subprocess

    script = rank_script(tmp_path, """
        time.sleep(600)
        """)
    real_wait = subprocess.Popen.wait

    def interrupted_wait(self, timeout=None):
        if timeout is not None and timeout > 100:  # launch's own wait: interrupt it once the ranks are up
            deadline = time.monotonic() + 60
            while not all((tmp_path / f"pid{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
                time.sleep(0.2)
            raise KeyboardInterrupt
        return real_wait(self, timeout)

    monkeypatch.setattr(subprocess.Popen, "wait", interrupted_wait)
    with pytest.raises(KeyboardInterrupt):
        launch(script, tmp_path, nproc=2, timeout=300)
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
    assert not any(alive(pid) for pid in pids)
    assert processes_running(script) == []


def test_ranks_that_ignore_sigterm_and_never_record_a_pid_do_not_outlive_launch(tmp_path, monkeypatch):
    monkeypatch.setattr(gpukit.distributed, "STOP_GRACE_S", 2.0)  # the ranks ignore SIGTERM: no need to wait long
    # Each rank (in a session of its own, as torchrun starts them) ignores SIGTERM, starts a child in yet
    # another session that does the same, and hangs without ever calling run_rank: launch knows no pid
    # of theirs, and torchrun cannot stop them.
    script = tmp_path / "stubborn.py"
    script.write_text(textwrap.dedent("""
        import os, signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if len(sys.argv) < 2:
            subprocess.Popen([sys.executable, __file__, "child"], start_new_session=True)
        time.sleep(600)
        """))
    with pytest.raises(TimeoutError):
        launch(script, nproc=2, timeout=10)
    assert processes_running(script) == []


def test_a_script_that_is_not_there_is_named_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no script 'ranks/ddp.py' from .*the notebook's folder"):
        launch("ranks/ddp.py", "ddp", nproc=2)


@pytest.mark.parametrize("module", ["gpukit.lessons.ranks.no_such_script", "no_such_package.ddp", ""])
def test_a_module_that_is_not_there_is_named_before_anything_starts(module):
    """On the CPU: no torchrun is started for a module this Python cannot import."""
    with pytest.raises(ModuleNotFoundError, match=f"no module '{module}' to run on the ranks"):
        launch(module, "ddp", nproc=2)


def test_the_rank_scripts_are_found_as_modules_of_the_package_without_running_them():
    """Notebook 09 runs its rank scripts by module name, so that they run wherever gpukit is installed."""
    import importlib.util

    for name in ("ddp", "fsdp", "ddp_and_fsdp"):
        spec = importlib.util.find_spec(f"gpukit.lessons.ranks.{name}")
        assert spec is not None and Path(spec.origin).is_file()
    assert torchrun_command("gpukit.lessons.ranks.ddp", ["ddp"], nproc=2)[-3:] == ["-m", "gpukit.lessons.ranks.ddp",
                                                                                   "ddp"]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_launch_of_no_ranks_is_refused(bad):
    with pytest.raises(ValueError, match="nproc is the number of ranks"):
        launch("gpukit.lessons.ranks.ddp", "ddp", nproc=bad)


@pytest.mark.parametrize("name", ["nope", "__init__", "../runs", ""])
def test_a_rank_script_that_is_not_there_is_refused_with_the_ones_that_are(name):
    """On the CPU: ranks.path names only the shipped scripts, and says which there are."""
    from gpukit.lessons import ranks

    assert ranks.path("fsdp").name == "fsdp.py"
    with pytest.raises(ValueError, match=r"no rank script .*; there are: ddp, ddp_and_fsdp, fsdp$"):
        ranks.path(name)


def test_the_combined_rank_script_takes_both_scripts_variants_and_importing_them_parses_nothing(monkeypatch):
    """On the CPU: notebook 09 runs DDP's and FSDP's variants on the same ranks, in one torchrun
    (gpukit.lessons.ranks.ddp_and_fsdp); importing the two scripts it runs parses no command line and starts nothing."""
    import sys

    monkeypatch.setattr(sys, "argv", ["python", "--not-an-option-of-any-script"])
    from gpukit.lessons.ranks import ddp, ddp_and_fsdp, fsdp

    args = ddp_and_fsdp.parse(["ddp", "zero1", "fsdp-bf16", "--batch=64"])
    assert args.variants == ["ddp", "zero1", "fsdp-bf16"] and args.batch == 64
    assert ddp_and_fsdp.parse(list(ddp.VARIANTS + fsdp.VARIANTS)).variants == [*ddp.VARIANTS, *fsdp.VARIANTS]
    with pytest.raises(SystemExit):
        ddp_and_fsdp.parse(["fsdp-everything"])
