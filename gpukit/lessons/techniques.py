"""The technique matrix: a training step of each reference model, plain and with each memory technique.

    from gpukit.lessons.techniques import run_matrix
    rows = run_matrix()      # on the GPU if there is one, else the CPU: one dict per (model, technique)

Each technique is PyTorch's own mechanism, written out in ``gpukit.step.train_step`` (notebooks 03-07
teach them one at a time): autocast to float16 with a GradScaler, autocast to bfloat16,
gradient accumulation over k micro-batches, ``torch.utils.checkpoint``, ``model.half()``
with BatchNorm put back to float32, and saved activations sent to the host with
``save_on_cpu``. Each row has the peak memory of a steady-state step with the model's
state included, the step time (median of several steps) and samples per second: the
columns of the well-known single-GPU technique tables.

On a CPU the host and the device are one memory, so offloading to the host saves nothing
there: that row is measured on a simulated GPU instead (fake tensors on ``meta``, counted
as the CUDA allocator would count them), against a baseline simulated the same way, and
has no time.
"""

from __future__ import annotations

import contextlib
import re
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .._torch import FakeTensorMode
from ..counter import gc_paused
from ..meter import device_name, measure, resolve_device
from ..step import BASELINE, Technique, half_with_float_batchnorm, train_step
from ..warmup import warm_up
from .data import digit_tokens_batch, digits_batch
from .models import MLP, ConvNet, GPTConfig, TinyGPT


TECHNIQUES = [
    BASELINE,
    Technique("AMP fp16", amp=torch.float16),
    Technique("AMP bf16", amp=torch.bfloat16),
    Technique("accumulation k=4", accumulate=4),
    Technique("checkpointing", checkpointed=True),
    Technique("half, BatchNorm float32", half=True),
    Technique("offload saved activations", offload=True),
    Technique("AMP bf16 + checkpointing", amp=torch.bfloat16, checkpointed=True),
    Technique("accumulation k=4 + checkpointing", accumulate=4, checkpointed=True),
    Technique("AMP fp16 + accumulation k=4 + checkpointing", amp=torch.float16, accumulate=4, checkpointed=True),
]


@dataclass(frozen=True)
class Setup:
    """A reference model with its batch: ``make_batch(batch)`` gives ``(inputs, targets)``."""

    name: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    batch: int


# (MLP width, depth, batch), (ConvNet channels, batch), (TinyGPT layers, heads, embedding, batch)
SIZES = {
    # big enough that the effects show in GiB; the baseline fits a 16 GB GPU
    "cuda": ((4096, 8, 8192), (128, 4096), (12, 12, 768, 64)),
    # float16 arithmetic is emulated on most CPUs (tens of times slower than float32): a float16 step
    # of these takes under a second on two cores. Batch > width: activations outweigh the weights.
    "cpu": ((256, 8, 1024), (16, 256), (4, 4, 64, 32)),
    "small": ((64, 8, 256), (4, 64), (2, 2, 32, 8)),   # for notebooks and tests: a few ms a step
}


def reference_setups(size: str = "cpu") -> list[Setup]:
    """The three reference models on the digits data: a deep MLP, a ConvNet with BatchNorm, a tiny GPT.

    Args:
        size: ``'cuda'``, ``'cpu'`` or ``'small'`` (``SIZES``).
    """
    (width, depth, mlp_batch), (channels, conv_batch), (layers, heads, embd, gpt_batch) = SIZES[size]
    gpt = GPTConfig(n_layer=layers, n_head=heads, n_embd=embd)
    return [Setup(f"deep mlp {width}x{depth}", lambda: MLP(width=width, depth=depth), digits_batch, mlp_batch),
            Setup(f"convnet {channels} (BatchNorm)", lambda: ConvNet(channels), digits_batch, conv_batch),
            Setup(f"tinygpt {layers}x{embd}", lambda: TinyGPT(gpt), digit_tokens_batch, gpt_batch)]


def build(setup: Setup, technique: Technique, device: torch.device):
    """The model, AdamW, a GradScaler and the batch on ``device``, as the technique wants them."""
    torch.manual_seed(0)
    with device:  # made where it runs, not made on the CPU and moved
        model = setup.make_model()
    if technique.half:
        half_with_float_batchnorm(model)  # BatchNorm's running statistics overflow float16 (notebook 06)
    optimizer = torch.optim.AdamW(model.parameters())
    x, y = (t.to(device) for t in setup.make_batch(setup.batch))
    scaler = torch.amp.GradScaler(device.type, enabled=technique.amp is torch.float16)
    return model, optimizer, scaler, x, y


def unsupported(technique: Technique, device: torch.device) -> str | None:
    """Why the technique cannot run on this device, or None."""
    if technique.amp is torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return f"not run: {torch.cuda.get_device_name(device)} has no bfloat16"
    if technique.amp is not None and device.type == "meta":
        return "not run: autocast has no meta device"
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_step_seconds(step: Callable[[], None], device: torch.device, steps: int = 5,
                        max_seconds: float = 2.0) -> tuple[float, int]:
    """The median time of ``steps`` calls of ``step`` (at least two, fewer than ``steps`` when they take
    longer than ``max_seconds`` in all); returns ``(seconds, steps timed)``."""
    times: list[float] = []
    deadline = time.perf_counter() + max_seconds
    while len(times) < steps and (len(times) < 2 or time.perf_counter() < deadline):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), len(times)


def trace_name(model: str, technique: str) -> str:
    """The file a row's allocator trace is kept in: ``'tinygpt-12x768--checkpointing.json.gz'``."""
    def part(text: str) -> str:
        return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return f"{part(model)}--{part(technique)}.json.gz"


@contextlib.contextmanager
def recorded_trace(device: torch.device, path: str | Path | None):
    """The caching allocator's events inside the block (its allocations and frees, their sizes and addresses, no
    stack frames: ``torch.cuda.memory._record_memory_history(context=None)``), kept at ``path`` as the compact
    snapshot ``gpukit.allocator.replay.save_compact`` writes, when the block ends without an error (a file that
    cannot be written is a ``RuntimeWarning``, not the row's failure). On a CPU a
    simulated card (``gpukit.SimulatedCuda``, replacing one the process had) follows the block, and is closed after
    it; on ``'meta'`` nothing is recorded. ``path`` None: nothing either."""
    if path is None or device.type not in ("cuda", "cpu"):
        yield
        return
    from ..allocator.replay import save_compact

    card = None
    if device.type == "cuda":
        memory = torch.cuda.memory
    else:
        from ..simulated import SimulatedCuda

        card = SimulatedCuda()
        memory = card.memory
    memory._record_memory_history("all", context=None, stacks="python", clear_history=True)
    try:
        yield
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            save_compact(memory._snapshot(), path)
        except OSError as err:  # the row's figures stand without it: say so, and go on
            warnings.warn(f"the allocator trace could not be kept at {path}: {err}", RuntimeWarning, stacklevel=3)
    finally:
        memory._record_memory_history(None)
        if card is not None:
            card.close()


def measure_technique(setup: Setup, technique: Technique, device: str | torch.device | None = None, *,
                      steps: int = 5, max_seconds: float = 2.0, trace: str | Path | None = None) -> dict:
    """One row of the matrix: peak bytes of a steady-state step (the model's state included), step time
    and samples per second; on a GPU also the caching allocator's reserved bytes by the end of that step
    (``reserved_bytes``: from an emptied cache, cuBLAS's workspaces of the warm-up included, as a prediction
    places them). ``steps=0`` measures memory only. On ``'meta'`` (a simulated GPU) the whole
    run is on fake tensors: memory is counted, nothing is computed, and there is no time.

    ``trace``: a file to keep the allocator's events of the build, the warm-up step and the measured step in
    (``recorded_trace``; on a CPU the simulated card's), to compare with a prediction's event by event.

    A technique the device cannot run gives a row whose ``status`` says why (and no figures).
    """
    dev = resolve_device(device)
    simulated = dev.type == "meta"
    row = {"model": setup.name, "technique": technique.name, "batch": setup.batch,
           "micro_batch": setup.batch // technique.accumulate, "measured_on": device_name(dev),
           "peak_bytes": None, "state_bytes": None, "reserved_bytes": None, "step_ms": None, "samples_per_s": None,
           "timed_steps": 0,
           "status": unsupported(technique, dev)}
    if row["status"]:
        return row
    setup.make_batch(1)  # the first call loads the data set: not inside the measured block, nor fake
    warm_up(dev)  # on a GPU: cuBLAS's one-time workspaces are not the first technique's memory
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # what earlier rows left cached is not this row's reserved memory
    # The collector keeps still throughout (no garbage of before is freed inside a measured block); what the
    # run leaves is all young, and goes before the next technique's run.
    with gc_paused(full=False) as collect_young:
        row = _measure(setup, technique, dev, row, simulated, steps, max_seconds, trace)
        collect_young()
    return row


def _measure(setup, technique, dev, row, simulated, steps, max_seconds, trace) -> dict:
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) if simulated else contextlib.nullcontext():
            with recorded_trace(dev, trace):
                with measure(dev, record=False) as state:
                    model, optimizer, scaler, x, y = build(setup, technique, dev)
                    train_step(model, optimizer, (x, y), technique, scaler)  # warm-up: gradients and optimizer state
                with measure(dev, record=False) as step:
                    train_step(model, optimizer, (x, y), technique, scaler)
            if steps and not simulated:
                seconds, row["timed_steps"] = median_step_seconds(
                    lambda: train_step(model, optimizer, (x, y), technique, scaler), dev, steps, max_seconds)
                row["step_ms"] = round(seconds * 1e3, 3)
                row["samples_per_s"] = round(setup.batch / seconds, 1)
    except (RuntimeError, NotImplementedError) as err:
        return {**row, "status": f"failed on {dev.type}: {str(err).splitlines()[0][:120]}"}
    row.update(peak_bytes=state.delta + step.peak, state_bytes=state.delta,
               reserved_bytes=step.reserved_peak if dev.type == "cuda" else None,
               status="simulated GPU (meta): memory only, no time" if simulated else "ok")
    return row


def run_matrix(device: str | torch.device | None = None, setups: list[Setup] | None = None,
               techniques: list[Technique] | None = None, *, steps: int = 5, max_seconds: float = 2.0,
               echo: Callable[[str], None] | None = print, traces: str | Path | None = None) -> list[dict]:
    """Every technique on every setup; each row also gets ``peak_vs_baseline`` (its peak over the baseline's,
    measured on the same device).

    Args:
        device: where to run (default: the GPU if there is one, else the CPU). On a CPU, offloading
            runs on a simulated GPU (``'meta'``), beside a baseline simulated the same way.
        setups: default ``reference_setups`` sized for the device.
        techniques: default ``TECHNIQUES``.
        steps, max_seconds: how many steps to time for the median, and the time after which to stop early.
        echo: where to print one line per row (None: silent).
        traces: a folder to keep each row's allocator trace in (``measure_technique``'s ``trace``, named by
            ``trace_name``); None: none kept.
    """
    dev = resolve_device(device)
    rows = []
    for setup in setups or reference_setups("cuda" if dev.type == "cuda" else "cpu"):
        baseline: dict[str, dict] = {}
        for technique in techniques or TECHNIQUES:
            where = torch.device("meta") if technique.offload and dev.type == "cpu" else dev
            trace = Path(traces) / trace_name(setup.name, technique.name) if traces is not None else None
            row = measure_technique(setup, technique, where, steps=steps, max_seconds=max_seconds, trace=trace)
            if where.type not in baseline:
                baseline[where.type] = row if technique == BASELINE else measure_technique(setup, BASELINE, where,
                                                                                           steps=0)
            base = baseline[where.type]["peak_bytes"]
            row["peak_vs_baseline"] = round(row["peak_bytes"] / base, 3) if row["peak_bytes"] and base else None
            rows.append(row)
            if echo:
                echo(format_row(row))
    return rows


def format_row(row: dict) -> str:
    """One line of text for a row of the matrix."""
    mib = f"{row['peak_bytes'] / 2**20:9.2f} MiB" if row["peak_bytes"] is not None else f"{'-':>13}"
    ms = f"{row['step_ms']:9.1f} ms {row['samples_per_s']:9.0f}/s" if row["step_ms"] is not None else f"{'-':>23}"
    ratio = f"{row['peak_vs_baseline']:6.2f}x" if row.get("peak_vs_baseline") is not None else f"{'-':>7}"
    status = "" if row["status"] == "ok" else f"  ({row['status']})"
    return f"{row['model']:<24}{row['technique']:<45}{mib} {ratio} {ms}{status}"


__all__ = ["Technique", "TECHNIQUES", "BASELINE", "Setup", "SIZES", "reference_setups", "train_step",
           "build", "measure_technique", "run_matrix", "median_step_seconds", "format_row", "recorded_trace",
           "trace_name"]
