"""A training step measured by gpukit.measure() agrees with PyTorch's MemTracker, measured independently."""

import pytest
import torch

import gpukit
from gpukit.lessons.models import MLP, ConvNet
from gpukit.roles import memtracker_peak
from gpukit.step import Technique, train_step

MODELS = {"mlp": lambda: MLP(width=256, depth=2), "deep-mlp": lambda: MLP(width=128, depth=6),
          "convnet": lambda: ConvNet(channels=16)}
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p),
    "adam-foreach": lambda p: torch.optim.Adam(p, foreach=True),
}


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("model_name", MODELS)
def test_step_peak_agrees_with_memtracker_within_0_1_percent(digits, model_name, opt_name, checkpoint):
    x, y = digits
    torch.manual_seed(0)
    model = MODELS[model_name]()
    optimizer = OPTIMIZERS[opt_name](model.parameters())
    technique = Technique(checkpointed=checkpoint)
    for _ in range(2):  # reach the steady state: gradients and optimizer state exist
        train_step(model, optimizer, (x, y), technique)

    with gpukit.measure("cpu", record=False) as report:
        train_step(model, optimizer, (x, y), technique)
    reference = memtracker_peak(lambda: train_step(model, optimizer, (x, y), technique), model, optimizer, x, y)

    assert reference > 0
    assert abs(report.peak_unrounded - reference) <= 0.001 * reference
