"""What the rank scripts of notebook 09 share: the model, and the record each rank publishes.

The rank code itself (the process group, ``DistributedSampler``, the wrapper, the training step,
``gpukit.measure`` around it) is in plain scripts in ``gpukit.lessons.ranks``, each run by torchrun on
every rank:

    gpukit.lessons.ranks.ddp     DistributedDataParallel, with and without gradient_as_bucket_view, and with
                                 ZeroRedundancyOptimizer (ZeRO-1)
    gpukit.lessons.ranks.fsdp    FSDP2 fully_shard: plain, MixedPrecisionPolicy (bf16), CPUOffloadPolicy

    gpukit.distributed.launch("gpukit.lessons.ranks.ddp", "ddp", nproc=2).frame()

Here: the lesson's model (the same weights on every rank), the bytes a rank holds for parameters,
gradients and optimizer state (its local shards under FSDP), the record a rank publishes, the gradients
one process gets from the whole batch (what DDP and FSDP must match), and the ZeRO paper's formulas.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from gpukit.counter import round_up
from gpukit.distributed import RankContext
from gpukit.lessons.data import digits_batch
from gpukit.lessons.models import MLP


def make_model(width: int = 512, depth: int = 4, seed: int = 0, device: torch.device | str = "cpu") -> nn.Module:
    """The lesson's model: ``gpukit.lessons.models.MLP`` on the 8x8 digits, the same weights for a given seed."""
    torch.manual_seed(seed)
    with torch.device(device):
        return MLP(width=width, depth=depth)


def full_batch_gradients(batch: int, width: int = 512, depth: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """The gradients one process gets from the whole global batch (mean loss): what DDP and FSDP must match."""
    model = make_model(width, depth, seed)
    x, y = digits_batch(batch)
    F.cross_entropy(model(x), y).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set, device: torch.device | None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (local shards for DTensors) on ``device``
    (any device when None), rounded like the allocator."""
    total = 0
    for t in tensors:
        local = _local(t)
        if device is not None and local.device != device:
            continue
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += round_up(storage.nbytes())
    return total


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer,
                device: torch.device | None = None) -> dict[str, int]:
    """Bytes this rank holds on ``device`` (default: anywhere) for parameters, gradients and optimizer
    state; storages shared by several tensors (gradient buckets...) are counted once."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps the rank's shard in .optim
    seen: set = set()
    params = list(model.parameters())
    return {
        "parameters": _storage_bytes(params, seen, device),
        "gradients": _storage_bytes([p.grad for p in params if p.grad is not None], seen, device),
        "optimizer_state": _storage_bytes([v for s in inner.state.values() for v in s.values()
                                           if torch.is_tensor(v)], seen, device),
    }


def rank_record(name: str, ctx: RankContext, model: nn.Module, optimizer: torch.optim.Optimizer, whole, step, loss: float,
                seconds: float, samples: int) -> dict:
    """The record a rank publishes for one variant: what it holds on its device by role, what else the
    wrapper keeps there (``other``), all of it (``state``: the ``whole`` block's growth), what it keeps in host
    memory instead (``offloaded``), the steady-state ``step``'s peak and the ``whole`` block's, the first
    step's loss, and a checksum of the weights (the same on every rank after a step)."""
    held = state_bytes(model, optimizer, ctx.device)  # what the measured device holds
    elsewhere = sum(state_bytes(model, optimizer).values()) - sum(held.values())  # offloaded to the host
    checksum = sum(float((p.full_tensor() if hasattr(p, "full_tensor") else p).double().sum())
                   for p in model.parameters())  # a collective under FSDP: every rank takes part
    return {"experiment": name, "world_size": ctx.world_size, "backend": ctx.backend, "device": str(ctx.device),
            "state_device": str(_local(next(model.parameters())).device), "samples": samples, **held,
            "other": whole.delta - sum(held.values()), "state": whole.delta, "offloaded": elsewhere,
            "step_peak": step.peak, "peak": whole.peak, "loss": loss, "checksum": checksum, "seconds": seconds}


def model_state_formulas(n_params: int, world_size: int, param_bytes: int = 4, grad_bytes: int = 4,
                         optimizer_bytes: int = 8) -> list[dict]:
    """Model-state bytes per rank for the four ways of data parallelism (the stages of the ZeRO paper).

    Each of ``n_params`` parameters takes ``param_bytes``, its gradient ``grad_bytes`` and its optimizer
    state ``optimizer_bytes`` (float32 Adam: 4, 4, 8; mixed-precision Adam with float32 master
    weights: 2, 2, 12). Plain data parallelism keeps all of it on every rank; ZeRO-1 shards the
    optimizer state, ZeRO-2 the gradients too, ZeRO-3 (FSDP) the parameters too: each sharded part
    is divided by ``world_size``.
    """
    p, g, o, n = n_params * param_bytes, n_params * grad_bytes, n_params * optimizer_bytes, world_size
    stages = [("data parallel (DDP)", p, g, o), ("ZeRO-1: optimizer state sharded", p, g, o / n),
              ("ZeRO-2: + gradients sharded", p, g / n, o / n),
              ("ZeRO-3 / FSDP: + parameters sharded", p / n, g / n, o / n)]
    return [{"strategy": s, "parameters": a, "gradients": b, "optimizer_state": c, "total": a + b + c}
            for s, a, b, c in stages]


def fsdp_shard_bytes(model: nn.Module, world_size: int) -> tuple[int, int]:
    """The least and the most parameter bytes one FSDP2 rank can hold for ``model``.

    FSDP2 cuts each parameter along dim 0 into ``world_size`` chunks of ``ceil(rows / world_size)``
    rows, padding the last; each rank's chunk is its own allocation (rounded up to 512 bytes).
    So a rank holds at least ``total bytes // world_size`` and at most ``sum(round_up(ceil(rows/N) * row_bytes))``.
    """
    total = most = 0
    for p in model.parameters():
        row_bytes = p[0].numel() * p.element_size() if p.dim() else p.element_size()
        rows = p.shape[0] if p.dim() else 1
        total += p.numel() * p.element_size()
        most += round_up(math.ceil(rows / world_size) * row_bytes)
    return total // world_size, most
