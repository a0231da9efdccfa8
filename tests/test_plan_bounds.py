"""plan()'s bound from another optimizer's prediction of the same configuration: exact before the optimizer step
(the same model, batch and techniques allocate the same whatever the optimizer, but for its state), below every
pruned candidate's own prediction, and never the reason the true cheapest recipe is missed. Small models."""

from __future__ import annotations

import pytest
import torch

from gpukit.estimate import predict
from gpukit.lessons.data import digit_tokens_batch
from gpukit.lessons.models import GPTConfig, TinyGPT
from gpukit.plan import plan
from gpukit.plan.search import _Search
from gpukit.plan.steps import _model_maker, _step_for

SGD = {"SGD momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)}


def gpt_case(batch: int = 32):
    x, y = digit_tokens_batch(batch)
    return (lambda: TinyGPT(GPTConfig(n_layer=2, n_embd=32, n_head=2))), (lambda p: torch.optim.AdamW(p)), \
        (lambda: (x.clone(), y.clone()))


def search_for(case, device: str, limit: int = 10**12, **kwargs) -> _Search:
    options = dict(gpus=1, optimizers=None, implementations=True, precisions=("float32", "bf16 weights"),
                   accumulate=[1, 2], checkpointing=True, offload=False, strategies=("single GPU",), allowance=0,
                   tflops=100e12, memory_bandwidth=2e12, host_bandwidth=16e9, alternatives=0, device=device,
                   lora=False)
    options.update(kwargs)
    return _Search(*case, limit, **options)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_before_the_optimizer_step_every_optimizer_allocates_the_same_but_for_its_state(device):
    """Device: none (fake tensors, CUDA's rules for "cuda"). For each configuration, the peak before the optimizer
    step less the optimizer's state is one number for SGD, AdamW (foreach, for-loop and fused): the bound's premise,
    checked exactly; and the state a floor counts is the one the step starts with."""
    search = search_for(gpt_case(), device, optimizers=SGD, precisions=("float32", "bf16", "bf16 weights"),
                        checkpointing=False)
    seen: dict[tuple, dict[str, int]] = {}
    for c in search.candidates():
        if c.optimizer.endswith(", in backward"):
            continue
        phases: dict = {}
        p = predict(_model_maker(search.make_model, c.precision), search.optimizers[c.optimizer][0],
                    search.make_batch, step=_step_for(c, c.accumulate, None, None, phases), device=device)
        assert phases["every_grad"] and phases["state"] == search.floor(c)["state"] > 0
        seen.setdefault(search.configuration(c), {})[c.optimizer] = p.before_step + phases["backward"] - phases["state"]
    assert len(seen) == 3 * 2
    for config, by_optimizer in seen.items():
        assert len(by_optimizer) >= 4 and len(set(by_optimizer.values())) == 1, (config, by_optimizer)


def test_every_bound_from_another_optimizer_is_below_the_candidates_own_prediction():
    """Device: none (CUDA's rules). Every candidate predicted; then each one's bound from the others' phases
    (stepped in backward too: bounded by the forward alone) is at most its need, on reserved memory."""
    search = search_for(gpt_case(), "cuda")
    rows = [search.evaluate(c) for c in search.candidates()]
    checked = 0
    for r in rows:
        for floor in (False, True):
            bound = search.phase_bound(r.candidate, floor=floor)
            assert bound is not None
            assert bound <= r.need, (r.candidate, floor, bound, r.need)
            checked += 1
    in_backward = [r for r in rows if r.candidate.optimizer.endswith(", in backward")]
    assert in_backward and checked == 2 * len(rows)
    # Close where the forward and backward dominate: within the optimizer step's own temporaries.
    plain = next(r for r in rows if r.candidate.optimizer == "yours: AdamW" and r.candidate.label == "plain")
    assert search.phase_bound(plain.candidate) > 0.9 * plain.peak


def test_candidates_pruned_by_the_bound_do_not_fit_and_the_cheapest_is_still_found():
    """Device: none. A budget the plain step misses: the plan prunes candidates by the bound, each of them predicted
    here does not fit, and the choice is the exhaustive search's cheapest."""
    case = gpt_case()
    exhaustive = search_for(case, "cpu")
    every = [exhaustive.evaluate(c) for c in exhaustive.candidates()]
    plain = next(r for r in every if r.candidate.label == "plain" and r.candidate.optimizer.startswith("yours"))
    limit = int(plain.need * 0.8)
    for r in every:
        r.fits = r.need <= limit
    fitting = [r for r in every if r.fits]
    assert fitting and len(fitting) < len(every)
    cheapest = min(fitting, key=lambda r: exhaustive.key(r.candidate, r.copy_bytes))
    p = plan(*case, budget=limit, device="cpu", precisions=("float32", "bf16 weights"),
             accumulate=[1, 2], offload=False, lora=False, alternatives=0, verify=False)
    assert p.choice.candidate == cheapest.candidate
    need = {r.candidate: r.need for r in every}
    bounded = [r for r in p.rows if r.need is None and "forward and backward" in r.verdict]
    assert bounded
    for r in bounded:
        assert r.fits is False and limit < r.bound <= need[r.candidate], r.candidate
    assert p.predictions < exhaustive.predictions
