"""Optimizer state on the host as a candidate of ``plan()``: torchao's ``CPUOffloadOptimizer``, its bounds, its
prediction (``gpukit.offload.predict_offload``) and what it costs a step.

What torchao does (torchao/optim/cpu_offload.py, torchao 0.18): each trainable parameter of at least
``minimal_size`` elements (4,096) gets a copy of itself and of its gradient in pinned host memory and an optimizer of
its own over them there (AdamW: ``fused=True`` unless told otherwise); a post-accumulate-grad hook copies the
gradient to the host after each backward (each micro-batch's, with accumulation), and frees the GPU's with
``offload_gradients=True`` ("not compatible with gradient accumulation"); ``step()`` steps each host optimizer and
copies the parameter back. Smaller parameters keep one optimizer on the GPU (``d_opt``). It asks for CUDA or XPU in
its constructor ("single-GPU training"), and ``zero_grad`` accepts only ``set_to_none=True``.
"""

from __future__ import annotations

import importlib.util
from typing import Callable

import torch

from ..counter import round_up
from ..report import format_bytes
from .candidates import Candidate, Row
from ..factories import quiet_import
from .facts import probe_optimizer
from .steps import model_maker, slice_batch, step_for

MINIMAL_SIZE = 4096  # torchao's default minimal_size: smaller parameters keep their optimizer on the GPU
# The precisions a host-offload candidate is tried in: autocast's kernels are chosen by the CUDA dispatch key, which
# the simulated GPU ('meta') does not have (torch.autocast refuses device_type 'meta'), and fp16's GradScaler and
# half()'s float16 AdamW are not what torchao documents; float32 and bfloat16 weights are predicted as they run.
HOST_PRECISIONS = ("float32", "bf16 weights")
# A fused CPU AdamW (aten/src/ATen/native/cpu/FusedAdamKernel.cpp) reads the weight, the gradient and the two
# moments of each element and writes the weight and the moments back: 7 values an element.
HOST_STEP_VALUES = 7


def torchao_optim():
    """``torchao.optim``, or None where torchao is not installed or does not import (a torchao built for another
    torch: no candidate, as if it were not installed; what it said then is shown). Imported quietly
    (``gpukit.plan.facts.quiet_import``): the libraries of CUDA kernels it could not load, and torch's warning about
    how torchao registers its enums, stay out of the user's output."""
    if importlib.util.find_spec("torchao") is None:
        return None
    try:
        with quiet_import():
            import torchao.optim
    except Exception:
        return None
    return torchao.optim


def host_variants(make_optimizer, device: str, gpus: int) -> list[tuple[str, Callable, str, bool]]:
    """Your Adam or AdamW with its state and step on the host (torchao's ``CPUOffloadOptimizer``), with the same
    hyperparameters, and the same with ``offload_gradients=True``: ``(label, make_optimizer, note, offload_gradients)``.
    None for a CPU plan (the host is the device), several GPUs, another optimizer, an option a fused CPU step lacks
    (``differentiable``, a tensor lr), parameter groups of their own lr, or where torchao does not import."""
    if device != "cuda" or gpus != 1 or importlib.util.find_spec("torchao") is None:
        return []
    probe = probe_optimizer(make_optimizer)
    cls = type(probe)
    if cls not in (torch.optim.Adam, torch.optim.AdamW):
        return []
    d = probe.defaults
    if d.get("differentiable") or isinstance(d.get("lr"), torch.Tensor) or \
            any(len(g["params"]) and g.get("lr") != d.get("lr") for g in probe.param_groups[1:]):
        return []
    if torchao_optim() is None:
        return []
    kwargs = {"lr": d["lr"], "betas": tuple(d["betas"]), "eps": d["eps"], "weight_decay": d["weight_decay"]}
    kwargs.update({k: True for k in ("amsgrad", "maximize") if d.get(k)})
    if cls is torch.optim.Adam:
        kwargs["fused"] = True  # torchao makes only AdamW fused by default; Adam's CPU default is the for-loop step
    name = cls.__name__
    found = []
    for gradients in (False, True):
        label = f"{name} on the host{', gradients too' if gradients else ''} (torchao CPUOffloadOptimizer)"
        note = (f"{name}'s state and step on the host (torchao CPUOffloadOptimizer: fused {name} on the CPU, as "
                "fused=True)" + ("; each gradient freed on the GPU once copied: no accumulation" if gradients else ""))
        found.append((label, _make(cls, gradients, kwargs), note, gradients))
    return found


def _make(cls, gradients: bool, kwargs: dict) -> Callable:
    def make(params):
        return torchao_optim().CPUOffloadOptimizer(params, cls, offload_gradients=gradients, **kwargs)

    make.recipe = ("from torchao.optim import CPUOffloadOptimizer",
                   f"CPUOffloadOptimizer(model.parameters(), torch.optim.{cls.__name__}"
                   + (", offload_gradients=True" if gradients else "")
                   + "".join(f", {k}={v!r}" for k, v in kwargs.items()) + ")")
    make.host_offload = True  # a real step of it without CUDA runs under gpukit.offload.cuda_stand_ins()
    return make


def state_info(search, c: Candidate) -> dict:
    """What the GPU holds of the model state when a host-offload candidate's step starts, as the floor's figures
    (``Bounds.state_info``), from the model's shapes (``ModelFacts``; the optimizer is not built: torchao asks
    for CUDA): the parameters and buffers, and the gradients (with ``offload_gradients``, only those of the
    parameters kept on the GPU). The optimizer's state on the GPU (the small parameters') is taken as 0, so every
    figure is at most what the GPU holds; "peak" is the same as "before" (no optimizer step is predicted). Also the
    bytes of the parameters offloaded ("offloaded", unrounded: what a copy moves), their elements and count, and
    what the host holds at least ("host": each offloaded parameter, its gradient and two moments). ``bf16 weights``
    is ``model.to(torch.bfloat16)``: every floating-point parameter and buffer in 2 bytes."""
    facts = search.facts

    def size(itemsize: int, floating: bool) -> int:
        return 2 if c.precision == "bf16 weights" and floating else itemsize

    params = [(n * size(s, f), n, trained) for n, s, f, trained in facts.parameter_shapes]
    big = [(nbytes, n) for nbytes, n, trained in params if trained and n >= MINIMAL_SIZE]
    grads = sum(round_up(nbytes) for nbytes, n, trained in params
                if trained and not (search.host[c.optimizer] and n >= MINIMAL_SIZE))
    model = facts.model_bytes if c.precision != "bf16 weights" else \
        sum(round_up(nbytes) for nbytes, _, _ in params) + sum(round_up(n * size(s, f))
                                                                for n, s, f in facts.buffer_shapes)
    before = model + grads
    return {"params": sum(round_up(nbytes) for nbytes, _, _ in params), "grads": grads, "optimizer_state": 0,
            "state": 0, "before": before, "peak": before, "offloaded": sum(nbytes for nbytes, _ in big),
            "offloaded_elements": sum(n for _, n in big), "offloaded_count": len(big),
            "host": 4 * sum(round_up(nbytes) for nbytes, _ in big)}


def copy_bytes(search, c: Candidate) -> int:
    """Bytes one step copies between GPU and host for the optimizer: each offloaded gradient to the host after each
    micro-batch's backward (the hook runs once per accumulation), each offloaded parameter back after the step."""
    info = search.state_info(c)
    return (c.accumulate + 1) * info["offloaded"]


def step_seconds(search, c: Candidate) -> float:
    """The host's optimizer step, at the host's memory bandwidth: ``HOST_STEP_VALUES`` values an offloaded element."""
    info = search.state_info(c)
    size = 2 if c.precision == "bf16 weights" else 4  # AdamW keeps its moments in the parameter's dtype
    return HOST_STEP_VALUES * size * info["offloaded_elements"] / search.host_memory_bw


def evaluate(search, c: Candidate) -> Row:
    """Predict a host-offload candidate with ``gpukit.offload.predict_offload``: its need is the simulated GPU's
    peak (the batch held in full, as for every candidate) plus the context allowance; the host's peak goes into the
    row and is compared with the host's memory (``Host.memory``); the copies of both kinds (saved tensors, the
    optimizer's) into ``copy_bytes``."""
    from ..offload import predict_offload

    rank, note, tol = search.numerics(c)
    micro = search.rank_batch // c.accumulate
    proxy_k = 1 if c.accumulate == 1 else 2
    saved = [0]
    p = predict_offload(model_maker(search.make_model, c.precision, lora=c.lora), search.optimizers[c.optimizer][0],
                        slice_batch(search.make_batch, micro * proxy_k, search.facts.batch_size),
                        step=step_for(c, proxy_k, saved, search.loss), card=search.card)
    search.predictions += 1
    held = search.held(c)
    how = ["predicted on a simulated GPU beside the host (gpukit.offload.predict_offload)"]
    if proxy_k != c.accumulate:
        how.append(f"as 2 micro-batches of {micro} with the batch of {search.facts.batch_size} held")
    peak = p.device_peak + held
    reserved = None if p.reserved_peak is None else p.reserved_peak + held
    if search.device == "cuda" and reserved is not None:
        base = reserved
        how.append("reserved at the peak: the simulated allocator fed the GPU's allocations only")
    else:
        base = peak
        how.append("allocated at the peak (no simulated allocator for the GPU of two memories)")
    need = base + search.allowance
    scale = c.accumulate // proxy_k
    copies = saved[0] * scale + p.copies.device_to_host * scale + p.copies.host_to_device
    host_peak = p.host_peak
    how.append(f"host peak {format_bytes(host_peak)}; {format_bytes(copies)} copied per step")
    fits = need <= search.limit
    verdict = "fits" if fits else "does not fit"
    if search.host_memory is not None and host_peak > search.host_memory:
        verdict = (f"does not fit: the host needs {format_bytes(host_peak)}, more than the host's memory "
                   f"{format_bytes(search.host_memory)}")
        fits = False
    row = Row(c, verdict, fits, peak=peak, reserved=reserved, need=need, how="; ".join(how),
              slowdown=search.slowdown(c, copies), numerics=rank, numerics_note=note, tolerance=tol,
              copy_bytes=copies, host_peak=host_peak, prediction=p, libraries=search.libraries(c),
              lower_bound=p.lower_bound)  # (what the card runs that it could not follow: cuDNN's workspaces)
    search.rows[c] = row
    return row


def host_bound(search, c: Candidate) -> int:
    """A lower bound of a host-offload candidate's host peak: each offloaded parameter's copy, gradient and two
    moments (0 for any other candidate)."""
    return search.state_info(c)["host"] if c.optimizer in search.host else 0
