"""Run code on several ranks with ``torchrun`` and bring each rank's measurements back.

In a notebook::

    from gpukit.distributed import launch
    results = launch("ranks/ddp.py", "ddp", nproc=2)   # torchrun --nproc-per-node=2 ranks/ddp.py ddp
    results.frame()                                       # one row per record a rank published

In the rank's code (a module or a script run by ``launch``)::

    from gpukit.distributed import publish, run_rank

    def main(ctx):                      # ctx.rank, ctx.world_size, ctx.device, ctx.backend
        ...
        publish({"experiment": "ddp", "peak": report.peak})

    if __name__ == "__main__":
        run_rank(main)

The same code uses NCCL on GPUs (when there is one GPU per rank) and gloo on CPU
(``MASTER_ADDR=127.0.0.1``) everywhere else. When a rank raises, the whole run stops
and ``launch`` raises ``RankFailed`` with that rank's traceback; when the run passes
its time limit, every rank is stopped and ``launch`` raises ``TimeoutError``. Either
way no rank process is left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

RESULTS_ENV = "GPUKIT_RANK_RESULTS"
STOP_GRACE_S = 15.0  # after SIGTERM, how long torchrun may take to stop its ranks before everything is killed


class RankFailed(RuntimeError):
    """A rank raised; ``rank`` is the first rank that failed, ``details`` its traceback."""

    def __init__(self, rank: int, details: str) -> None:
        super().__init__(f"rank {rank} failed; its traceback:\n{details}")
        self.rank, self.details = rank, details


@dataclass
class RankContext:
    """What a rank knows about itself once the process group is up."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


@dataclass
class RankResults:
    """What the ranks of one ``launch`` published: ``records`` (dicts, each with its ``rank``), ``tensors``
    (``{(rank, name): {key: tensor}}``), the launcher's output ``log`` and the run's ``seconds``."""

    records: list[dict] = field(default_factory=list)
    tensors: dict[tuple[int, str], dict[str, torch.Tensor]] = field(default_factory=dict)
    log: str = ""
    seconds: float = 0.0

    def frame(self, **where):
        """The records as a pandas DataFrame, sorted by experiment and rank; ``where`` filters columns by value."""
        import pandas as pd

        rows = [r for r in self.records if all(r.get(k) == v for k, v in where.items())]
        frame = pd.DataFrame(rows)
        keys = [k for k in ("experiment", "rank") if k in frame.columns]
        return frame.sort_values(keys).reset_index(drop=True) if keys else frame


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(target: str | os.PathLike, args=(), nproc: int = 2, port: int | None = None) -> list[str]:
    """The ``torchrun`` command line ``launch`` runs: one node, ``nproc`` ranks, rendezvous on 127.0.0.1.

    ``target`` is the path of a ``.py`` script (``'ranks/ddp.py'``) or a module name (``'mypkg.ranks'``).
    """
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
           "--node-rank=0", "--master-addr=127.0.0.1", f"--master-port={port or _free_port()}",
           "--max-restarts=0"]
    target = str(target)
    cmd += [target] if target.endswith(".py") else ["-m", target]
    return cmd + [str(a) for a in args]


def _importable(module: str) -> bool:
    """Whether ``module`` can be found (its parent packages are imported to look, the module is not)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or an empty or relative name
        return False


def launch(target: str | os.PathLike, *args: Any, nproc: int = 2, timeout: float = 120.0,
           env: dict[str, str] | None = None) -> RankResults:
    """Run ``target`` on ``nproc`` ranks with torchrun and gather what the ranks published.

    Args:
        target: a script path (``'ranks/ddp.py'``) or a module (``'mypkg.ranks'``); it should call ``run_rank``.
        args: command-line arguments for the target.
        nproc: number of ranks (processes) on this machine.
        timeout: seconds the whole run may take; then every rank is stopped.
        env: extra environment variables for the ranks.

    Raises:
        RankFailed: a rank raised (the first one's traceback is in the message).
        TimeoutError: the run took longer than ``timeout``.
        RuntimeError: torchrun failed without a rank saying why (its output is in the message).
        FileNotFoundError: ``target`` names a script that is not there.
        ModuleNotFoundError: ``target`` names a module that cannot be imported.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc is the number of ranks to start: a whole number, at least 1; got {nproc!r}")
    if str(target).endswith(".py"):
        if not Path(target).is_file():
            raise FileNotFoundError(f"no script {str(target)!r} from {os.getcwd()} (a relative path starts from "
                                    "the current directory: the notebook's folder in Jupyter)")
    elif not _importable(str(target)):
        raise ModuleNotFoundError(f"no module {str(target)!r} to run on the ranks: a target is a script path "
                                  "ending in .py or the name of a module this Python can import")
    out = Path(tempfile.mkdtemp(prefix="gpukit-ranks-"))
    run_env = {**rank_environment(nproc), RESULTS_ENV: str(out), **(env or {})}
    log_path = out / "torchrun.log"
    start = time.monotonic()
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(torchrun_command(target, args, nproc), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=run_env, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _stop(proc, out)
                raise TimeoutError(f"the ranks of {target} ran past {timeout:g} s and were stopped; "
                                   f"last output:\n{_tail(log_path)}") from None
            except BaseException:  # an interrupted kernel, say: stop the run too
                _stop(proc, out)
                raise
            finally:
                _kill_ranks(out)  # ranks run in sessions of their own: make sure none outlives the run
        if code != 0:
            failed = _first_failure(out)
            if failed is not None:
                raise RankFailed(*failed)
            raise RuntimeError(f"torchrun exited with code {code}; last output:\n{_tail(log_path)}")
        results = _collect(out)
        results.log, results.seconds = log_path.read_text(), time.monotonic() - start
        return results
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:]


def _stop(proc: subprocess.Popen, out: Path) -> None:
    """SIGTERM torchrun (its agent then stops the ranks), SIGKILL what remains after a grace period."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=STOP_GRACE_S)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    _kill_ranks(out)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def rank_pids(out: Path) -> list[int]:
    """The process ids the ranks wrote into the results folder ``out`` when they started."""
    return [int(p.read_text()) for p in sorted(Path(out).glob("rank*.pid")) if p.read_text().strip()]


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def launched_processes(out: Path) -> list[int]:
    """Every process started for the run whose results folder is ``out``: torchrun, its ranks and
    whatever they started, found by the ``GPUKIT_RANK_RESULTS`` entry they all inherit in their
    environment (``/proc/PID/environ``), even after their parent died and they were handed to init."""
    marker = f"{RESULTS_ENV}={out}".encode()
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:  # no /proc: only what the ranks recorded
        return [pid for pid in rank_pids(out) if alive(pid)]
    for name in entries:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:  # gone, or not ours to read
            pass
    return found


def _kill_ranks(out: Path) -> None:
    """SIGKILL every process of the run (recorded pids, and every process carrying the run's marker),
    again until none is left: a rank may start another process while the first ones die."""
    deadline = time.monotonic() + 10
    while True:
        pids = sorted({pid for pid in rank_pids(out) + launched_processes(out) if alive(pid)})
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)  # the rank and anything it started in its session
            except (ProcessLookupError, PermissionError):
                pass
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _first_failure(out: Path) -> tuple[int, str] | None:
    """The rank whose error came first (the others usually fail because it left), and its traceback."""
    failures = []
    for path in out.glob("rank*.error"):
        info = json.loads(path.read_text())
        failures.append((info["time"], info["rank"], info["traceback"]))
    if not failures:
        return None
    _, rank, details = min(failures)
    return rank, details


def _collect(out: Path) -> RankResults:
    results = RankResults()
    for path in sorted(out.glob("rank*.jsonl")):
        results.records += [json.loads(line) for line in path.read_text().splitlines() if line]
    for path in sorted(out.glob("rank*.*.pt")):
        rank, name = path.name[len("rank"):-len(".pt")].split(".", 1)
        results.tensors[int(rank), name] = torch.load(path, weights_only=True)
    return results


# ---------------------------------------------------------------- inside a rank


def _results_dir() -> Path:
    value = os.environ.get(RESULTS_ENV)
    if not value:
        raise RuntimeError(f"{RESULTS_ENV} is not set: start ranks with gpukit.distributed.launch(), "
                           f"or set it to a folder where each rank may write its results")
    return Path(value)


def choose_backend(world_size: int, local_world_size: int | None = None) -> tuple[str, torch.device | None]:
    """NCCL with one GPU per local rank when there are enough GPUs, else gloo on the CPU."""
    local = local_world_size or world_size
    if torch.cuda.is_available() and torch.cuda.device_count() >= local:
        return "nccl", None
    return "gloo", torch.device("cpu")


def rank_environment(nproc: int) -> dict[str, str]:
    """The environment ``launch`` gives its ranks: this process's, with one thread share per rank, and, when
    the run falls back to gloo (fewer GPUs than ranks), no visible GPU (``CUDA_VISIBLE_DEVICES=''``).

    Gloo ranks must be CPU ranks through and through: with a GPU visible, FSDP2's default mesh is built on
    the accelerator and each rank sets ``cuda:LOCAL_RANK`` (an invalid ordinal for rank 1 on a one-GPU
    machine) and moves its parameters there, while the process group is gloo on the CPU
    (torch/distributed/fsdp/_fully_shard/_fsdp_init.py, torch/distributed/device_mesh.py).
    """
    threads = str(max(1, (os.cpu_count() or 1) // max(nproc, 1)))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads), "MASTER_ADDR": "127.0.0.1"}
    if choose_backend(nproc)[0] == "gloo":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def init() -> RankContext:
    """Start this rank's process group from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK...)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    backend, device = choose_backend(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group(backend, device_id=device)
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group(backend)
    return RankContext(rank, world, local_rank, device, backend)


def publish(record: dict) -> None:
    """Send one record (a dict of JSON values) from this rank back to ``launch``; its ``rank`` is added."""
    rank = int(os.environ["RANK"])
    with open(_results_dir() / f"rank{rank}.jsonl", "a") as f:
        f.write(json.dumps({"rank": rank, **record}) + "\n")


def publish_tensors(name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Send named tensors (moved to the CPU) from this rank back to ``launch``, as ``results.tensors[rank, name]``."""
    if not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"a tensor set's name is letters, digits, '_' and '-', got {name!r}")
    rank = int(os.environ["RANK"])
    torch.save({k: v.detach().cpu() for k, v in tensors.items()}, _results_dir() / f"rank{rank}.{name}.pt")


def run_rank(main: Callable[[RankContext], None]) -> None:
    """The body of a rank started by ``launch``: records its pid, starts the process group, runs
    ``main(ctx)``, and on an exception writes the traceback for ``launch`` to report (and prints it).

    Then it ends the process itself: the process group is destroyed (gloo's worker threads are
    joined), stdout and stderr are flushed, and the process exits with ``os._exit``, 0 when ``main``
    returned, 1 when it raised. A normal interpreter exit would run C++ static destructors and
    finalization while threads the process group started may still be running; a thread destroyed
    that way aborts the rank ("terminate called without an active exception", SIGABRT) after its
    work is done, and fails the run at random.
    """
    out, rank = _results_dir(), int(os.environ["RANK"])
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    code = 1
    try:
        main(init())
        code = 0
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    except BaseException:
        info = {"rank": rank, "time": time.time(), "traceback": traceback.format_exc()}
        (out / f"rank{rank}.error").write_text(json.dumps(info))
        traceback.print_exc()
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
            import gc

            gc.collect()  # what still refers to the process group goes while the interpreter is whole
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001 - a closed stream: nothing left to flush
                    pass
            os._exit(code)
