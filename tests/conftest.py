import gc

import pytest
import torch

import gpukit
from gpukit.counter import LEDGER


@pytest.fixture(autouse=True)
def clean_state():
    """Each test starts with an empty history and leaves the counter switched off."""
    gpukit.clear_history()
    yield
    gpukit.clear_history()
    assert not LEDGER.active, "a test left the CPU counter running"
    assert not LEDGER.tallies
    gc.collect()


@pytest.fixture
def digits():
    from gpukit.data import load_digits

    images, labels = load_digits()
    return images[:256], labels[:256]


def train_step(model, optimizer, x, y, checkpoint=False):
    """One ordinary training step (the thing the meter is asked to measure)."""
    optimizer.zero_grad(set_to_none=True)
    if checkpoint:
        out = model.head(torch.utils.checkpoint.checkpoint(model.features, x, use_reentrant=False).flatten(1)) \
            if hasattr(model, "features") else torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    else:
        out = model(x)
    loss = torch.nn.functional.cross_entropy(out, y)
    loss.backward()
    optimizer.step()
    return loss.item()
