"""The technique explorer: identical runs measure identical steps, from the same level."""

import pytest
import torch

from gpukit.lessons.data import digits_batch
from gpukit.lessons.models import MLP
from gpukit.widgets import TechniqueExplorer


def test_repeated_identical_runs_start_from_the_same_level():
    explorer = TechniqueExplorer(lambda: MLP(n_in=64, width=128, depth=3), digits_batch, device="cpu",
                                 batch_sizes=(256, 512))
    reports = [explorer.run(batch=256) for _ in range(3)]
    assert len({r.live_start for r in reports}) == 1, [r.live_start for r in reports]
    assert len({(r.peak, r.delta) for r in reports}) == 1
    assert reports[0].live_start > 0 and reports[0].device == "cpu"
    explorer.close()
    torch.manual_seed(0)
