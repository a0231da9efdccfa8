"""DistributedDataParallel, measured on every rank. Run it with torchrun (notebook 09 runs its ``run`` beside FSDP's,
in gpukit.lessons.ranks.ddp_and_fsdp):

    python -m torch.distributed.run --nproc-per-node=2 -m gpukit.lessons.ranks.ddp ddp ddp-bucket-view zero1

Variants: ``ddp`` (the gradients and DDP's buckets are two copies), ``ddp-bucket-view``
(``gradient_as_bucket_view=True``: the gradients are views into the buckets), ``zero1`` (ZeRO-1:
``ZeroRedundancyOptimizer`` keeps on each rank the Adam state of its share of the parameters).
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import gpukit
from gpukit.distributed import publish, publish_tensors, run_rank
from gpukit.lessons.data import digits_batch
from gpukit.lessons.ranks import parse_run
from gpukit.lessons.parallel import make_model, rank_record

VARIANTS = ("ddp", "ddp-bucket-view", "zero1")


def parse(argv=None) -> argparse.Namespace:
    return parse_run(__doc__.split("\n\n")[0], VARIANTS, argv)


def rank_share(ctx, batch: int):
    """This rank's share of one global batch: DistributedSampler deals the samples out among the ranks."""
    if batch % ctx.world_size:
        raise ValueError(f"the global batch ({batch}) must divide evenly among {ctx.world_size} ranks")
    data = TensorDataset(*digits_batch(batch))
    sampler = DistributedSampler(data, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=False)
    x, y = next(iter(DataLoader(data, batch_size=batch // ctx.world_size, sampler=sampler)))
    return x.to(ctx.device), y.to(ctx.device)


def main(ctx):  # ctx: this rank's rank, world_size, device and backend; the process group is up
    x, y = rank_share(ctx, ARGS.batch)
    gpukit.warm_up(ctx.device)  # on a GPU: cuBLAS's one-time workspaces are not the model's memory
    run(ctx, ARGS.variants, x, y, ARGS.width, ARGS.depth, ARGS.seed)


def run(ctx, variants, x, y, width: int, depth: int, seed: int) -> None:
    """Each variant on this rank's share ``x, y``: one step, then a measured one; its record published."""
    for variant in variants:
        with gpukit.measure(ctx.device, record=False) as whole:
            model = make_model(width, depth, seed, ctx.device)  # the same weights on every rank
            model = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                        gradient_as_bucket_view=variant == "ddp-bucket-view")
            if variant == "zero1":  # each rank keeps Adam's state for some whole tensors, steps and broadcasts them
                optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
            else:
                optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

            def train_step():
                loss = F.cross_entropy(model(x), y)
                loss.backward()  # DDP all-reduces the gradients bucket by bucket, and averages them
                optimizer.step()
                return loss.item()

            first_loss = train_step()  # the first step also makes Adam's state
            if variant == "ddp" and ctx.rank == 0:  # checked in the notebook against one process
                publish_tensors("grads-ddp", {n.removeprefix("module."): p.grad for n, p in model.named_parameters()})
            optimizer.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            with gpukit.measure(ctx.device, record=False) as step:  # a step in the steady state
                train_step()
            seconds = time.perf_counter() - start
        publish(rank_record(variant, ctx, model, optimizer, whole, step, first_loss, seconds, len(x)))
        del model, optimizer
        dist.barrier()


if __name__ == "__main__":
    ARGS = parse()  # before the process group: --help needs no torchrun
    run_rank(main)
