"""Running candidates for real: timing the fitting ones on this machine, and one real step of the choice under
``gpukit.budget``."""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch

from ..cudadevice import CudaDevices
from ..report import format_bytes
from ..step import map_tensors, train_step
from .candidates import Candidate, Row, Verification
from .search import PlanSearch
from .facts import quantization_state_of
from .steps import candidate_loss, model_maker

# -- running candidates for real ---------------------------------------------------------------------------------


def _verify_on(search: PlanSearch) -> str:
    """Where the plan's steps run for real: the planned device if this machine has it, else the CPU."""
    return search.device if search.device == "cpu" or torch.cuda.is_available() else "cpu"


def _small_enough(search: PlanSearch, row: Row) -> bool:
    """Whether a real step of this candidate can run here: on the GPU, within its free memory; on the CPU, at
    most a quarter of the free memory (a step the size of the machine is not a cheap check)."""
    if _verify_on(search) == "cuda":
        free = torch.cuda.mem_get_info()[0]
    else:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
        except (ValueError, OSError, AttributeError):
            free = 2**30
    # Optimizer state on the host: on a CPU the host is the device, and holds both.
    here = row.peak + (row.host_peak or 0) if _verify_on(search) == "cpu" and row.peak is not None else row.peak
    return here is not None and here <= free and row.candidate.strategy == "single GPU"


def _stand_ins(make_optimizer, device: torch.device):
    """``gpukit.offload.cuda_stand_ins()`` for a real step of a host-offload optimizer (``plan.host``) on a CPU:
    torchao asks for CUDA in its constructor (torchao/optim/cpu_offload.py) and uses CUDA streams and pinned
    memory, which the stand-ins answer without a GPU. Elsewhere (on CUDA itself, other optimizers): nothing."""
    if getattr(make_optimizer, "host_offload", False) and device.type == "cpu":
        from ..offload import cuda_stand_ins

        return cuda_stand_ins()
    return contextlib.nullcontext()


class _Held:
    """What ``gpukit.estimate.state_bytes`` reads of an optimizer (its ``state``), for torchao's
    ``CPUOffloadOptimizer``, which keeps none of its own (it never calls ``Optimizer.__init__``): its on-device
    optimizer's state, and where the host is the device (a run on the CPU) each host copy, its gradient and its
    optimizer's state."""

    def __init__(self, optimizer, device: torch.device) -> None:
        self.state = dict(optimizer.d_opt.state) if optimizer.d_opt is not None else {}
        if device.type == "cpu":
            for i, p_host in enumerate(optimizer.param_d2h_map.values()):
                self.state[("host copy", i)] = {"copy": p_host, "grad": p_host.grad}
            for opt in optimizer.optim_dict.values():
                self.state.update(opt.state)


def build_candidate(make_model, make_optimizer, candidate: Candidate, *, device="cpu", loss=None):
    """``(model, optimizer, step)``: the candidate's model built on ``device`` in its precision (LoRA adapters
    where it has them), its optimizer, and ``step(model, optimizer, batch)``, its training step (its techniques,
    a GradScaler kept across steps for float16, saved tensors to the host for offload, its loss). An optimizer
    with its state on the host (torchao's) is built, and ``step`` runs, under ``gpukit.offload.cuda_stand_ins()``
    where ``device`` is the CPU: torchao asks for CUDA (its own ``optimizer.step()`` called outside ``step``
    needs the stand-ins too)."""
    dev = torch.device(device)
    with dev:
        model = model_maker(make_model, candidate.precision, fake=False, lora=candidate.lora,
                            qlora=candidate.qlora)()
    model.to(dev)
    with _stand_ins(make_optimizer, dev):
        optimizer = make_optimizer(model.parameters())
    technique = candidate.technique()
    scaler = torch.amp.GradScaler(dev.type) if technique.amp is torch.float16 else None
    loss = candidate_loss(candidate, loss)

    def step(model, optimizer, batch):
        offload = torch.autograd.graph.save_on_cpu(pin_memory=dev.type == "cuda") if candidate.offload \
            else contextlib.nullcontext()
        with _stand_ins(make_optimizer, dev), offload:
            train_step(model, optimizer, batch, technique, scaler, loss=loss)

    return model, optimizer, step


def run_candidate(make_model, make_optimizer, make_batch, candidate: Candidate, *, limit: int | None = None,
                  device: str = "cpu", seed: int = 0, timed_steps: int = 0, loss=None):
    """Build the candidate's model, optimizer and batch on ``device``, run a warm-up step, then one step under
    ``gpukit.budget(limit)`` (counting what the process held before as outside the budget). ``loss``: as for
    ``gpukit.step.train_step``.

    Returns:
        ``(model, measured peak: state plus the step's peak, median seconds of ``timed_steps`` more steps or None)``;
        the state counts a QLoRA model's quantization state (``facts.quantization_state_of``), held beside its
        parameters.

    Raises:
        torch.OutOfMemoryError: the step did not fit ``limit``.
    """
    from ..meter import resolve_device

    dev = resolve_device(device)
    if candidate.strategy != "single GPU":
        raise ValueError(f"{candidate.strategy} needs several processes: run it with torchrun")
    # On a machine without CUDA the step runs on the CPU, the CUDA devices its code names too (gpukit.cudadevice)
    on_cpu = CudaDevices("cpu") if dev.type == "cpu" and not torch.cuda.is_available() else contextlib.nullcontext()
    with _stand_ins(make_optimizer, dev), on_cpu:
        return _run_candidate(make_model, make_optimizer, make_batch, candidate, limit, dev, seed, timed_steps, loss)


def _run_candidate(make_model, make_optimizer, make_batch, candidate, limit, dev, seed, timed_steps, loss):
    from ..budget import budget as memory_budget
    from ..counter import gc_paused
    from ..estimate import state_bytes
    from ..meter import measure

    with gc_paused() as collect_young:  # one full collection; what the build and warm-up leave goes before the step
        other = 0
        if dev.type == "cpu":
            with measure(dev, record=False) as r:
                pass
            other = r.live_end
        torch.manual_seed(seed)
        model, optimizer, train = build_candidate(make_model, make_optimizer, candidate, device=dev, loss=loss)
        batch = map_tensors(lambda t: t.to(dev), make_batch())

        def step():
            train(model, optimizer, batch)

        step()  # warm-up: gradients and optimizer state exist
        cap = contextlib.nullcontext() if limit is None else memory_budget(limit + other, dev)
        collect_young()
        with measure(dev, record=False) as report, cap:
            step()
    held = _Held(optimizer, dev) if hasattr(optimizer, "param_d2h_map") else optimizer
    # (QLoRA: the quantization state bitsandbytes keeps beside the 4-bit weights is no parameter or buffer)
    peak = state_bytes(model, held, batch)[0] + report.peak + (quantization_state_of(model) if candidate.qlora else 0)
    seconds = None
    if timed_steps:
        times: list[float] = []
        deadline = time.perf_counter() + 2.0  # at least one step; no more once two seconds have passed
        while len(times) < timed_steps and (not times or time.perf_counter() < deadline):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t = time.perf_counter()
            step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t)
        seconds = statistics.median(times)
    return model, peak, seconds


def time_fitting(search: PlanSearch) -> str | None:
    """Time the step of each fitting candidate small enough for this machine, beside the plain step's (their
    ``measured_slowdown``); returns why they could not run here, or None."""
    fitting = [r for r in search.rows.values() if r.fits and r.need is not None and _small_enough(search, r)]
    if not fitting:
        return None
    here = _verify_on(search)  # a plan for the CPU runs on the CPU, also on a machine with a GPU
    make_opt = search.optimizers
    plain = Candidate(next(iter(make_opt)))
    try:
        _, _, base = run_candidate(search.make_real_model, make_opt[plain.optimizer][0], search.make_batch, plain,
                                   device=here, timed_steps=3, loss=search.loss)
        for r in fitting:
            _, _, s = run_candidate(search.make_real_model, make_opt[r.candidate.optimizer][0], search.make_batch,
                                    r.candidate, device=here, timed_steps=3, loss=search.loss)
            r.measured_slowdown, r.measured_on = s / base, here
    except (RuntimeError, NotImplementedError) as err:  # a kernel this machine lacks (float16 on some CPUs)
        return str(err).splitlines()[0][:120]
    return None


def verify_choice(search: PlanSearch, choice: Row | None, timing_error: str | None) -> Verification:
    """One real step of the chosen row under ``gpukit.budget``, where this machine can run it, or why there was
    none (``timing_error``: why ``time_fitting`` could not run the fitting candidates here)."""
    if choice is None:
        return Verification(False, "nothing to verify: no candidate fits")
    if not _small_enough(search, choice):
        why = ("per-rank figures need several GPUs" if choice.candidate.strategy != "single GPU"
               else f"its predicted peak ({format_bytes(choice.peak)}) is too big for this machine")
        return Verification(False, f"not run here: {why}; the prediction stands alone", predicted_peak=choice.peak)
    if timing_error is not None:
        return Verification(False, f"could not run here: {timing_error}")
    here = _verify_on(search)
    make_opt = search.optimizers
    c = choice.candidate
    limit = search.limit - search.allowance if here == search.device else None
    try:
        _, measured, _ = run_candidate(search.make_real_model, make_opt[c.optimizer][0], search.make_batch, c,
                                       device=here, limit=limit, loss=search.loss)
        fitted = True
    except torch.OutOfMemoryError:
        measured, fitted = None, False
    predicted = choice.peak
    if here == search.device:
        # On CUDA the warm-up step made the cuBLAS workspaces before the measured one, so the measured peak holds
        # none of them: it is set beside the prediction without them.
        workspaces = choice.prediction.workspaces if choice.prediction is not None else 0
        predicted -= workspaces
        without = (f" without the cuBLAS workspaces ({format_bytes(workspaces)}), which the warm-up step made before "
                   "the measured one" if workspaces else "")
        msg = (f"one real step on {here} under gpukit.budget({format_bytes(limit)}): "
               + (f"fitted; measured peak {format_bytes(measured)} ({measured:,} B), predicted {format_bytes(predicted)}"
                  f" ({predicted:,} B){without}" if fitted else "OUT OF MEMORY: the prediction was wrong"))
    else:
        extra = "; offload saves nothing on a CPU (the host is the device)" if c.offload else ""
        p = choice.prediction
        if choice.host_peak is not None and p is not None:
            both = p.device_state - p.workspaces + p.host_state + p.combined_step_peak + search.held(c)
            extra += (f"; the optimizer's host side ran here too, with CUDA's streams and pinned memory stood in "
                      f"(gpukit.offload.cuda_stand_ins): GPU and host as one memory, predicted {format_bytes(both)} "
                      f"({both:,} B) without CUDA's workspaces")
        msg = (f"one real step on {here} (this machine has no GPU: the budget is the GPU's, so it was run without "
               f"one): measured peak {format_bytes(measured)} on {here}'s code paths, predicted "
               f"{format_bytes(predicted)} allocated on CUDA's{extra}")
    return Verification(True, msg, fitted, measured, predicted)
