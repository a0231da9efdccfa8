"""Data parallelism and sharding, measured on every rank: the code notebook 08 runs with torchrun.

    python -m torch.distributed.run --nproc-per-node=2 -m gpukit.lessons.parallel ddp fsdp     # or, in Python:
    gpukit.distributed.launch("gpukit.lessons.parallel", "ddp", "fsdp", nproc=2).frame()

Each experiment builds the same MLP on every rank (same seed), trains two steps on the
rank's share of one global batch of digits (``DistributedSampler``), measures it all and
the second step (the steady state: the optimizer state exists) with ``gpukit.measure``
in that rank's process, and publishes one record per rank:
bytes of parameters, gradients and optimizer state held by the rank on its device (its
local shards for FSDP), what else the wrapper keeps there, the state it holds in all,
what it keeps in host memory instead (CPU offload on a GPU), and the step's peak.

Experiments:
    ddp              DistributedDataParallel (gradients in buckets of their own: the default)
    ddp-bucket-view  DistributedDataParallel(gradient_as_bucket_view=True)
    zero1            DDP with ZeroRedundancyOptimizer: optimizer state sharded
    fsdp             FSDP2 fully_shard on each layer and the model: everything sharded
    fsdp-bf16        fsdp with MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)
    fsdp-offload     fsdp with CPUOffloadPolicy: sharded state kept in host memory

``ddp`` and ``fsdp`` also send rank 0's gradients of the first step back (as tensors
``'grads-ddp'`` / ``'grads-fsdp'``) so they
can be checked against one process training on the whole batch.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gpukit
from gpukit.counter import round_up
from gpukit.lessons.data import digits_batch
from gpukit.distributed import RankContext, publish, publish_tensors, run_rank
from gpukit.lessons.models import MLP

EXPERIMENTS = ("ddp", "ddp-bucket-view", "zero1", "fsdp", "fsdp-bf16", "fsdp-offload")


def make_model(width: int = 512, depth: int = 4, seed: int = 0, device: torch.device | str = "cpu") -> nn.Module:
    """The lesson's model: ``gpukit.lessons.models.MLP`` on the 8x8 digits, the same weights for a given seed."""
    torch.manual_seed(seed)
    with torch.device(device):
        return MLP(width=width, depth=depth)


def rank_batch(batch: int, rank: int, world_size: int, device: torch.device | str = "cpu"):
    """This rank's share of the first global batch of ``batch`` digits, as ``DistributedSampler`` deals it."""
    if batch % world_size:
        raise ValueError(f"the global batch ({batch}) must divide evenly among {world_size} ranks")
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    data = TensorDataset(*digits_batch(batch))
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False)
    x, y = next(iter(DataLoader(data, batch_size=batch // world_size, sampler=sampler)))
    return x.to(device), y.to(device)


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


def _wrap(name: str, model: nn.Module, ctx: RankContext, lr: float):
    """Wrap ``model`` for experiment ``name``; returns (model, optimizer)."""
    if name.startswith("ddp") or name == "zero1":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        model = DDP(model, device_ids=ids, gradient_as_bucket_view=(name == "ddp-bucket-view"))
        if name == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=lr)
        return model, torch.optim.Adam(model.parameters(), lr=lr)
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    policy = {}
    if ctx.device.type == "cpu":  # gloo ranks: FSDP's default mesh would be built on the accelerator
        from torch.distributed.device_mesh import init_device_mesh

        policy["mesh"] = init_device_mesh("cpu", (ctx.world_size,))
    if name == "fsdp-bf16":
        policy["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if name == "fsdp-offload":
        policy["offload_policy"] = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **policy)
    fully_shard(model, **policy)
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def run_experiment(name: str, ctx: RankContext, batch: int = 1024, width: int = 512, depth: int = 4,
                   seed: int = 0, lr: float = 1e-3) -> dict:
    """Build, wrap and train one step of experiment ``name`` on this rank; publish and return its record."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose from {', '.join(EXPERIMENTS)}")
    x, y = rank_batch(batch, ctx.rank, ctx.world_size, ctx.device)

    def train_step() -> float:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.item()

    gpukit.warm_up(ctx.device)  # on a GPU: cuBLAS's one-time workspaces are not the model's memory
    with gpukit.measure(ctx.device, record=False) as whole:
        model, optimizer = _wrap(name, make_model(width, depth, seed, ctx.device), ctx, lr)
        first_loss = train_step()  # the first step also creates the optimizer state
        grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                 for n, p in model.named_parameters()}  # a collective for FSDP: every rank takes part
        if ctx.rank == 0 and name in ("ddp", "fsdp"):
            publish_tensors(f"grads-{name}", {n.removeprefix("module."): g for n, g in grads.items()})
        del grads
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        with gpukit.measure(ctx.device, record=False) as step:  # a step in the steady state
            train_step()
        seconds = time.perf_counter() - start
    held = state_bytes(model, optimizer, ctx.device)  # what the measured device holds
    elsewhere = sum(state_bytes(model, optimizer).values()) - sum(held.values())  # offloaded to the host
    checksum = sum(float((p.full_tensor() if hasattr(p, "full_tensor") else p).double().sum())
                   for p in model.parameters())
    where = _local(next(model.parameters())).device
    record = {"experiment": name, "world_size": ctx.world_size, "backend": ctx.backend,
              "device": str(ctx.device), "state_device": str(where), "samples": len(x),
              **held, "other": whole.delta - sum(held.values()), "state": whole.delta, "offloaded": elsewhere, "step_peak": step.peak,
              "peak": whole.peak, "loss": first_loss, "checksum": checksum, "seconds": seconds}
    publish(record)
    del model, optimizer
    dist.barrier()
    return record


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gpukit.lessons.parallel", description=__doc__.split("\n\n")[0])
    parser.add_argument("experiments", nargs="+", choices=EXPERIMENTS, metavar="EXPERIMENT",
                        help=f"one or more of: {', '.join(EXPERIMENTS)}")
    parser.add_argument("--batch", type=int, default=1024, help="global batch size (default 1024)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    def body(ctx: RankContext) -> None:
        for name in args.experiments:
            run_experiment(name, ctx, batch=args.batch, width=args.width, depth=args.depth, seed=args.seed)

    run_rank(body)


if __name__ == "__main__":
    main(sys.argv[1:])
