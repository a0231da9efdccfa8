"""The DDP and FSDP variants on the same ranks, in one torchrun. Notebook 09 runs it:

    python -m torch.distributed.run --nproc-per-node=2 -m gpukit.lessons.ranks.ddp_and_fsdp ddp zero1 fsdp fsdp-bf16

Each start of a torchrun imports torch in every process, which takes longer than the lesson's steps: here the ranks
start once, and each script's ``run`` (gpukit.lessons.ranks.ddp, gpukit.lessons.ranks.fsdp) does what it does when it
runs alone, DDP's variants first.
"""

import argparse
import gc

import torch.distributed as dist

import gpukit
from gpukit.distributed import run_rank
from gpukit.lessons.ranks import ddp, fsdp, parse_run


def parse(argv=None) -> argparse.Namespace:
    return parse_run(__doc__.split("\n\n")[0], ddp.VARIANTS + fsdp.VARIANTS, argv)


def main(ctx):  # ctx: this rank's rank, world_size, device and backend; the process group is up
    x, y = ddp.rank_share(ctx, ARGS.batch)
    gpukit.warm_up(ctx.device)  # on a GPU: cuBLAS's one-time workspaces are not the model's memory
    sizes = ARGS.width, ARGS.depth, ARGS.seed
    ddp.run(ctx, [v for v in ARGS.variants if v in ddp.VARIANTS], x, y, *sizes)
    gc.collect()  # what DDP left to the collector goes now, not inside FSDP's measured blocks
    dist.barrier()
    fsdp.run(ctx, [v for v in ARGS.variants if v in fsdp.VARIANTS], x, y, *sizes)


if __name__ == "__main__":
    ARGS = parse()  # before the process group: --help needs no torchrun
    run_rank(main)
