"""The scripts every rank of notebook 09 runs, shipped with gpukit so that they run wherever it is installed:

    python -m torch.distributed.run --nproc-per-node=2 -m gpukit.lessons.ranks.ddp ddp ddp-bucket-view zero1
    gpukit.distributed.launch("gpukit.lessons.ranks.fsdp", "fsdp", nproc=2).frame()

Each is a plain script (it parses its arguments when run): importing this package runs neither.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def parse_run(description: str, variants: tuple[str, ...], argv=None) -> argparse.Namespace:
    """The arguments every rank script takes: the variants to run (of ``variants``), the global batch shared out
    among the ranks, the MLP's width and depth, and the seed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("variants", nargs="+", choices=variants)
    parser.add_argument("--batch", type=int, default=1024, help="the global batch, shared out among the ranks")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def path(name: str) -> Path:
    """The file of the rank script ``name`` ('ddp' or 'fsdp'), to read or to copy."""
    scripts = sorted(p.stem for p in Path(__file__).parent.glob("*.py") if not p.stem.startswith("_"))
    if name not in scripts:
        raise ValueError(f"no rank script {name!r}; there are: {', '.join(scripts)}")
    return Path(__file__).with_name(f"{name}.py")


__all__ = ["path"]
