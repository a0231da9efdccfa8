"""Notebook 08's fragmentation experiment, each run in a caching allocator that starts empty with its settings.

    from gpukit.lessons.fragmentation import in_fresh_allocator
    row = in_fresh_allocator("max_split_size_mb:40", device="cuda")

On a GPU each run is a new Python process started with ``PYTORCH_CUDA_ALLOC_CONF`` set, as a user sets it: the
notebook's process holds memory from earlier cells, whose free blocks would serve the experiment's requests, and
changing the settings of an allocator that already split big blocks is not the same as starting with them
(PyTorch 2.11's ``release_available_cached_blocks`` frees cached blocks of ``max_split_size_mb`` or more without
checking that each is a whole segment, and ``cudaFree`` of a split block's address fails with "invalid argument":
c10/cuda/CUDACachingAllocator.cpp). On a CPU it is a simulated allocator started afresh, of the simulated card's
size and name; afterwards the notebook's simulated card (its ``SimulatedCuda``) follows the process's tensors again.

    python -m gpukit.lessons.fragmentation '{"settings": "", ...}'   # one run, its row pickled to stdout
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys

import torch

MiB = 2**20


def fragmentation_run(device: torch.device, empty_cache_after_del: bool = False, *, big: int = 60, small: int = 8,
                      n: int = 5, cap: int = 110) -> dict:
    """One big tensor, freed; ``n`` small ones, every other one freed; the big one again, all under a cap of
    ``cap`` MiB above what the allocator held at the start (sizes in MiB). Returns what happened."""
    import gpukit
    from gpukit.allocator import cpu_device

    cuda = device.type == "cuda"

    def sim():  # the simulated GPU behind the CPU counter, brought up to date with the frees so far
        return cpu_device().allocator

    def reserved() -> int:
        return torch.cuda.memory_reserved(device) if cuda else sim().memory_reserved()

    def empty_cache() -> None:
        torch.cuda.empty_cache() if cuda else sim().empty_cache()

    def mib(size: int) -> torch.Tensor:
        return torch.empty(size * MiB, dtype=torch.uint8, device=device)

    base = reserved()
    again = f"{big} MiB again"
    row: dict = {"empty_cache() after del": empty_cache_after_del}
    try:
        # on CUDA budget() always caps reserved memory; on a CPU, reserved=True caps the simulated allocator's
        with gpukit.budget(base + cap * MiB, device, **({} if cuda else {"reserved": True})):
            tensor = mib(big)
            del tensor                                # freed: its block stays cached
            if empty_cache_after_del:
                empty_cache()
            smalls = [mib(small) for _ in range(n)]
            del smalls[0::2]                          # keep every other one
            row["in use (MiB)"] = small * len(smalls)
            row["reserved before (MiB)"] = (reserved() - base) / MiB
            row["segments"] = torch.cuda.memory_snapshot() if cuda else sim().segments()
            tensor = mib(big)                         # the same size again
            row[again] = "fits"
            del tensor, smalls
    except torch.OutOfMemoryError as err:
        row[again] = "out of memory"
        row["message"] = str(err)
    row["reserved at the end (MiB)"] = (reserved() - base) / MiB
    return row


def in_fresh_allocator(settings: str = "", device: str | torch.device = "cpu", empty_cache_after_del: bool = False,
                       **sizes: int) -> dict:
    """``fragmentation_run`` in an allocator that starts empty with these ``PYTORCH_CUDA_ALLOC_CONF`` settings:
    a new process on a GPU, on a CPU a simulated allocator started afresh, of the simulated card's size (then the card
    again, as it was)."""
    device = torch.device(device)
    if device.type == "cuda":
        args = json.dumps({"settings": settings, "empty_cache_after_del": empty_cache_after_del, "sizes": sizes,
                           "index": device.index})
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=settings)
        done = subprocess.run([sys.executable, "-m", __name__, args], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the run with PYTORCH_CUDA_ALLOC_CONF={settings!r} failed:\n{done.stderr[-3000:]}")
        row = pickle.loads(base64.b64decode(done.stdout.strip().splitlines()[-1]))
    else:
        import gc

        from gpukit.allocator import cpu_device, reset_cpu_device, use_cpu_device

        # The card simulated here (a lesson's SimulatedCuda, a rehearsal's): the run's allocator is its size and says
        # its name, and the card itself follows this process's tensors again afterwards. What it holds dies first
        # (gc), so that no free of its tensors happens while it is not listening.
        before = cpu_device()
        gc.collect()
        fresh = reset_cpu_device(before.allocator.total_memory, config=settings,
                                 context_bytes=before.allocator.context_bytes)
        fresh.allocator.name = before.allocator.name
        try:
            row = fragmentation_run(device, empty_cache_after_del, **sizes)
        finally:
            use_cpu_device(before, place=False)
    return {"settings": settings or "(defaults)", **row}


def _main(argv: list[str]) -> None:
    args = json.loads(argv[0])
    index = args["index"]
    device = torch.device("cuda", 0 if index is None else index)
    torch.empty(0, device=device)  # CUDA's context first: the run measures the allocator alone
    row = fragmentation_run(device, args["empty_cache_after_del"], **args["sizes"])
    print(base64.b64encode(pickle.dumps(row)).decode())


if __name__ == "__main__":
    _main(sys.argv[1:])
