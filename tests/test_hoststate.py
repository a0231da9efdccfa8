"""The optimizer state a CUDA run keeps on the host (gpukit.hoststate): torch.optim's step counters, made on the CPU
unless the group is capturable or fused (torch/optim/adam.py, _init_group). Device: cpu, predicting for CUDA
(fake tensors under gpukit's CUDA rules) and for the CPU, where every tensor is the machine's memory."""

from __future__ import annotations

import pytest
import torch

from gpukit.counter import FAKE_LEDGER, round_up
from gpukit.estimate import predict
from gpukit.hoststate import cuda_rules_apply, host_state_tensors

MODEL = lambda: torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
BATCH = lambda: (torch.randn(32, 64), torch.randint(0, 10, (32,)))
COUNTER = round_up(4)  # a float32 scalar: one 512-B block


@pytest.mark.parametrize("make_optimizer, counters", [
    (lambda p: torch.optim.AdamW(p), 4),                   # one step counter a parameter tensor
    (lambda p: torch.optim.NAdam(p), 8),                   # and NAdam's mu_product
    (lambda p: torch.optim.SGD(p, momentum=0.9), 0),       # no counter
], ids=["adamw", "nadam", "sgd"])
def test_a_cuda_prediction_keeps_the_step_counters_off_the_gpu(make_optimizer, counters):
    on_cpu = predict(MODEL, make_optimizer, BATCH, device="cpu", breakdown=False)
    on_cuda = predict(MODEL, make_optimizer, BATCH, card="h100", breakdown=False)
    assert on_cpu.before_step - (on_cuda.before_step - on_cuda.workspaces) == counters * COUNTER


def test_only_the_step_counters_of_groups_neither_capturable_nor_fused_are_the_hosts():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.Adam([{"params": [a]}, {"params": [b], "capturable": True}])
    for p in (a, b):  # the state _init_group makes (a capturable group's on the parameter's device: a GPU's)
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    assert [t is opt.state[a]["step"] for t in host_state_tensors(opt)] == [True]
    assert host_state_tensors(torch.optim.SGD([a])) == []
    assert not cuda_rules_apply()  # outside a prediction


def test_a_storage_handed_to_the_host_leaves_the_books_and_is_not_counted_again():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        tally = FAKE_LEDGER.start()
        try:
            t = torch.zeros(())
            level = tally.level
            FAKE_LEDGER.to_host(t.untyped_storage())
            assert tally.level == level - COUNTER
            t += 1                      # an op that returns it
            FAKE_LEDGER.settle()
            assert tally.level == level - COUNTER and FAKE_LEDGER.hosted(t.untyped_storage())
            del t
        finally:
            FAKE_LEDGER.stop(tally)
    assert (tally.peak, tally.level) == (COUNTER, 0)  # made in the block, then the host's


def test_a_capturable_optimizer_is_predicted_for_cuda_with_its_counters_on_the_gpu_and_says_what_it_left_out():
    # capturable runs only with its tensors on a GPU (torch asserts it); the fake CPU tensors stand for one.
    capturable = predict(MODEL, lambda p: torch.optim.Adam(p, capturable=True), BATCH, card="h100", breakdown=False)
    plain_on_cpu = predict(MODEL, lambda p: torch.optim.Adam(p), BATCH, device="cpu", breakdown=False)
    assert capturable.before_step - capturable.workspaces == plain_on_cpu.before_step  # counters and all on the GPU
    assert "capturable=True" in capturable.unverified_ops
    assert "capturable=True" not in predict(MODEL, lambda p: torch.optim.Adam(p), BATCH, card="h100").unverified_ops
