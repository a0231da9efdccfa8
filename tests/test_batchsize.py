"""The batch-size finder: the true maximum within its margin, with fewer real steps than the classics."""

import gc

import pytest
import torch

import gpukit
from gpukit.batchsize import Trainer, double_then_bisect, predict_then_confirm, shrink_on_failure
from gpukit.data import digit_tokens_batch, digits_batch
from gpukit.models import MLP, ConvNet, GPTConfig, TinyGPT

# Budgets are above what the process already holds on the CPU (a CPU budget counts every live tensor).
SETUPS = {
    "mlp + adam": (lambda: MLP(width=256, depth=2), lambda p: torch.optim.Adam(p), digits_batch, 6_000_000),
    "convnet + momentum": (lambda: ConvNet(8), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), digits_batch,
                           8_000_000),
    "tinygpt + adamw": (lambda: TinyGPT(GPTConfig(n_layer=1, n_embd=32)), lambda p: torch.optim.AdamW(p),
                        digit_tokens_batch, 12_000_000),
}
MARGIN = 0.05


def above_now(nbytes):
    """A budget of ``nbytes`` more than the CPU tensors alive now."""
    gc.collect()
    with gpukit.measure("cpu", record=False) as r:
        pass
    return r.live_end + nbytes


@pytest.mark.parametrize("name", SETUPS)
def test_prediction_finds_the_true_maximum_within_its_margin_with_fewer_real_steps(name):
    make_model, make_opt, make_batch, room = SETUPS[name]
    limit = above_now(room)
    ours = predict_then_confirm(Trainer(make_model, make_opt, make_batch, limit, device="cpu"), margin=MARGIN)
    doubling = double_then_bisect(Trainer(make_model, make_opt, make_batch, limit, device="cpu"))
    shrinking = shrink_on_failure(Trainer(make_model, make_opt, make_batch, limit, device="cpu"), start=1024)

    # The truth, by bisection with real steps: the largest batch that fits (1 - margin) of the budget...
    at_margin = double_then_bisect(Trainer(make_model, make_opt, make_batch, limit, device="cpu"),
                                   limit=int(limit * (1 - MARGIN))).batch
    assert ours.batch == at_margin > 0
    # ...which is at most the largest that fits the whole budget.
    assert ours.batch <= doubling.batch
    assert ours.real_steps < min(doubling.real_steps, shrinking.real_steps)
    assert ours.real_steps == 1 and ours.trials[-1].fits


def test_a_failed_trial_leaves_the_trainer_as_it_was():
    trainer = Trainer(lambda: MLP(width=64), lambda p: torch.optim.SGD(p, lr=0.1), digits_batch, above_now(2_000_000),
                      device="cpu")
    gc.collect()  # garbage of earlier tests would otherwise be freed by the trial's own collection
    with gpukit.measure("cpu", record=False) as before:
        pass
    assert not trainer.fits(100_000)
    with gpukit.measure("cpu", record=False) as after:
        pass
    assert after.live_end == before.live_end
    assert trainer.fits(1)


def test_a_budget_too_small_for_one_sample_finds_nothing():
    trainer = Trainer(lambda: MLP(width=64), lambda p: torch.optim.SGD(p, lr=0.1), digits_batch, above_now(1024),
                      device="cpu")
    assert predict_then_confirm(trainer).batch == 0
    assert double_then_bisect(trainer).batch == 0
