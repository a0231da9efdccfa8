"""FSDP2 (``fully_shard``), measured on every rank: parameters, gradients and optimizer state all sharded.
Run it with torchrun (notebook 09 runs its ``run`` after DDP's, in gpukit.lessons.ranks.ddp_and_fsdp):

    python -m torch.distributed.run --nproc-per-node=2 -m gpukit.lessons.ranks.fsdp fsdp fsdp-bf16 fsdp-offload

Variants: ``fsdp``; ``fsdp-bf16`` (``MixedPrecisionPolicy``: gathered parameters and compute in bfloat16,
gradients reduced in float32); ``fsdp-offload`` (``CPUOffloadPolicy``: the shards live in host memory).
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import gpukit
from gpukit.distributed import publish, publish_tensors, run_rank
from gpukit.lessons.data import digits_batch
from gpukit.lessons.ranks import parse_run
from gpukit.lessons.parallel import make_model, rank_record

VARIANTS = ("fsdp", "fsdp-bf16", "fsdp-offload")


def parse(argv=None) -> argparse.Namespace:
    return parse_run(__doc__.split("\n\n")[0], VARIANTS, argv)


def main(ctx):  # ctx: this rank's rank, world_size, device and backend; the process group is up
    if ARGS.batch % ctx.world_size:
        raise ValueError(f"the global batch ({ARGS.batch}) must divide evenly among {ctx.world_size} ranks")
    data = TensorDataset(*digits_batch(ARGS.batch))
    sampler = DistributedSampler(data, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=False)
    x, y = next(iter(DataLoader(data, batch_size=ARGS.batch // ctx.world_size, sampler=sampler)))
    x, y = x.to(ctx.device), y.to(ctx.device)
    gpukit.warm_up(ctx.device)
    run(ctx, ARGS.variants, x, y, ARGS.width, ARGS.depth, ARGS.seed)


def run(ctx, variants, x, y, width: int, depth: int, seed: int) -> None:
    """Each variant on this rank's share ``x, y``: one step, then a measured one; its record published."""
    for variant in variants:
        with gpukit.measure(ctx.device, record=False) as whole:
            model = make_model(width, depth, seed, ctx.device)
            policy = {}
            if ctx.device.type == "cpu":  # gloo ranks: fully_shard's default mesh would be on the accelerator
                policy["mesh"] = init_device_mesh("cpu", (ctx.world_size,))
            if variant == "fsdp-bf16":
                policy["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if variant == "fsdp-offload":
                policy["offload_policy"] = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")
            for layer in model.modules():  # each layer is a unit: gathered just before it runs
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, **policy)
            fully_shard(model, **policy)  # the rest (none here) and the root
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)  # steps this rank's shards only

            def train_step():
                loss = F.cross_entropy(model(x), y)
                loss.backward()  # gradients reduce-scattered: each rank keeps its shard's
                optimizer.step()
                return loss.item()

            first_loss = train_step()
            if variant == "fsdp":  # the whole gradients, gathered (a collective: every rank takes part)
                grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
                if ctx.rank == 0:  # checked in the notebook against one process
                    publish_tensors("grads-fsdp", grads)
                del grads
            optimizer.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            with gpukit.measure(ctx.device, record=False) as step:
                train_step()
            seconds = time.perf_counter() - start
        publish(rank_record(variant, ctx, model, optimizer, whole, step, first_loss, seconds, len(x)))
        del model, optimizer
        dist.barrier()


if __name__ == "__main__":
    ARGS = parse()  # before the process group: --help needs no torchrun
    run_rank(main)
