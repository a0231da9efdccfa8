"""The scripts every rank of notebook 09 runs, shipped with gpukit so that they run wherever it is installed:

    python -m torch.distributed.run --nproc-per-node=2 -m gpukit.lessons.ranks.ddp ddp ddp-bucket-view zero1
    gpukit.distributed.launch("gpukit.lessons.ranks.fsdp", "fsdp", nproc=2).frame()

Each is a plain script (it parses its arguments when run): importing this package runs neither.
"""

from __future__ import annotations

from pathlib import Path


def path(name: str) -> Path:
    """The file of the rank script ``name`` ('ddp' or 'fsdp'), to read or to copy."""
    scripts = sorted(p.stem for p in Path(__file__).parent.glob("*.py") if not p.stem.startswith("_"))
    if name not in scripts:
        raise ValueError(f"no rank script {name!r}; there are: {', '.join(scripts)}")
    return Path(__file__).with_name(f"{name}.py")


__all__ = ["path"]
