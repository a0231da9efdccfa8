"""The batch-size finder: the true maximum within its margin, with fewer real steps than the classics."""

import gc

import pytest
import torch

import gpukit
from gpukit.batchsize import Trainer, double_then_bisect, predict_then_confirm
from gpukit.lessons.data import digits_batch
from gpukit.lessons.models import MLP

# Budgets are above what the process already holds on the CPU (a CPU budget counts every live tensor).
# One setup proves the search (a few dozen predictions, three real steps); bench/batch_size.py runs it on
# every reference model, and tests/test_estimate.py checks the predictions themselves on each of them.
SETUPS = {
    "mlp + adam": (lambda: MLP(width=256, depth=2), lambda p: torch.optim.Adam(p), digits_batch, 6_000_000),
}
MARGIN = 0.05


def above_now(nbytes):
    """A budget of ``nbytes`` more than the CPU tensors alive now."""
    gc.collect()
    with gpukit.measure("cpu", record=False) as r:
        pass
    return r.live_end + nbytes


@pytest.mark.parametrize("name", SETUPS)
def test_prediction_finds_the_true_maximum_within_its_margin_with_one_real_step(name):
    make_model, make_opt, make_batch, room = SETUPS[name]
    # The finder keeps its margin off the whole budget, the bytes the process holds included: a budget whose
    # margin leaves `room` above them, however much earlier work left alive (240 MB left none of 6 MB above).
    limit = int(above_now(room) / (1 - MARGIN))
    trainer = Trainer(make_model, make_opt, make_batch, limit, device="cpu")
    ours = predict_then_confirm(trainer, margin=MARGIN)
    assert ours.real_steps == 1 and ours.trials[-1].fits
    # The true maximum within the margin, checked with real steps: the batch found fits (1 - margin) of the
    # budget and one more sample does not (a step's memory grows with the batch, as every bisection assumes;
    # bench/batch_size.py finds the truth by bisection and compares the classic strategies).
    at_margin = int(limit * (1 - MARGIN))
    assert ours.batch > 1
    assert trainer.fits(ours.batch, at_margin)
    assert not trainer.fits(ours.batch + 1, at_margin)


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
    with pytest.warns(gpukit.BudgetWarning, match="already exceeded as it opens"):  # the model alone is over it
        assert double_then_bisect(trainer).batch == 0


@pytest.mark.parametrize("wrong, message", [
    ("model", r"make_model is a model \(MLP\), not a function that builds one: pass lambda: MLP\(\.\.\.\)$"),
    ("optimizer", r"make_optimizer is an optimizer \(Adam\), not a function that builds one"),
    ("batch", r"make_batch is a tuple, not a function that builds the batch: pass lambda b: \(x\[:b\], y\[:b\]\)"),
])
def test_an_object_passed_where_its_factory_is_expected_is_refused_before_any_step_on_the_cpu(wrong, message):
    """A Trainer runs real steps on what the factories build: an object passed itself is refused, untouched."""
    model = MLP(width=16, depth=1)
    optimizer = torch.optim.Adam(model.parameters())
    args = {"model": (model, lambda p: torch.optim.Adam(p), digits_batch),
            "optimizer": (MLP, optimizer, digits_batch),
            "batch": (MLP, lambda p: torch.optim.Adam(p), digits_batch(4))}[wrong]
    with pytest.raises(TypeError, match=message):
        Trainer(*args, "1GB", device="cpu")
    assert not optimizer.state and all(w.grad is None for w in model.parameters())
