"""plan()'s optimizer state on the host (torchao's CPUOffloadOptimizer, gpukit.plan.host): which plans try it, its
need (predict_offload's simulated GPU), the host's memory, its bounds, the recipe it prints and its real step on
this CPU with CUDA's streams and pinned memory stood in. Small models built here; where torchao is not installed
the tests that need it are skipped."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch
from torch import nn

from gpukit.lessons.data import digit_tokens_batch
from gpukit.lessons.models import GPTConfig, TinyGPT
from gpukit.offload import cuda_stand_ins, predict_offload
from gpukit.plan import DEFAULT_CARD, Host, Techniques, plan
from gpukit.plan import host
from gpukit.plan.search import PlanSearch
from gpukit.step import train_step

pytest.importorskip("torchao.optim", reason="torchao is not installed here")

HOST = "AdamW on the host (torchao CPUOffloadOptimizer)"
HOST_GRADS = "AdamW on the host, gradients too (torchao CPUOffloadOptimizer)"
# A model whose AdamW state is what breaks the budget: 3.2 M parameters (12.6 MB in float32), a batch of 8.
# with no context allowance, on an H100's rules: plain AdamW needs 134 MB, torchao's with gradients 92 MB
BUDGET = "95MB"


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                         nn.ReLU(), nn.Linear(1024, 10))


def make_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 1024, generator=g), torch.randint(0, 10, (8,), generator=g)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


# DEFAULT_CARD (an H100's rules) with no context allowance: the needs are the simulated reserved peaks
NO_ALLOWANCE = replace(DEFAULT_CARD, context_allowance=0)
ONLY_OPTIMIZERS = Techniques(precisions=("float32",), accumulate=[1], checkpointing=False, offload=False, lora=False)
# what the bounds are checked over (tried with every optimizer implementation)
SEARCHED = Techniques(precisions=("float32", "bf16 weights"), accumulate=[1, 2], offload=False, lora=False)


def small_plan(budget=BUDGET, make_model=make_model, make_batch=make_batch, **kwargs):
    options = dict(device="cuda", card=NO_ALLOWANCE, techniques=ONLY_OPTIMIZERS, alternatives=0)
    options.update(kwargs)
    return plan(make_model, adamw, make_batch, budget, **options)


@pytest.fixture(scope="module")
def only_host_fits():
    """The plan as a machine without a GPU makes it: its chosen step runs for real on the CPU, with CUDA's streams
    and pinned memory stood in (on a GPU it runs on the GPU, as seen on an H200 with torch 2.11)."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: False)
        return small_plan()


def test_the_host_candidates_are_tried_for_adam_and_adamw_on_one_cuda_gpu_only(monkeypatch):
    """Device: none (the optimizers are probed under fake tensors). AdamW and Adam on a CUDA plan get two host
    optimizers with the same hyperparameters (Adam's asked to be fused: torchao makes only AdamW fused); SGD, a CPU
    plan, several GPUs and a machine without torchao get none."""
    found = host.host_variants(lambda p: torch.optim.AdamW(p, lr=3e-4, weight_decay=0.1), "cuda", 1)
    assert [(label, gradients) for label, _, _, gradients in found] == [(HOST, False), (HOST_GRADS, True)]
    assert found[1][1].recipe == ("from torchao.optim import CPUOffloadOptimizer",
                                  "CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=True, "
                                  "lr=0.0003, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.1)")
    adam = host.host_variants(lambda p: torch.optim.Adam(p), "cuda", 1)
    assert adam[0][0].startswith("Adam on the host") and "fused=True" in adam[0][1].recipe[1]
    assert host.host_variants(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "cuda", 1) == []
    assert host.host_variants(adamw, "cpu", 1) == [] and host.host_variants(adamw, "cuda", 2) == []
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    assert host.host_variants(adamw, "cuda", 1) == []


def test_a_cpu_plan_and_sgd_have_no_host_candidate():
    """Device: cpu plan, and a cuda plan with SGD (predicted on the CPU)."""
    for device, make in (("cpu", adamw), ("cuda", lambda p: torch.optim.SGD(p, lr=0.1))):
        p = plan(make_model, make, make_batch, "1GB", device=device, techniques=ONLY_OPTIMIZERS, alternatives=0,
                 verify=False)
        assert not any("on the host" in r.candidate.optimizer for r in p.rows)


def test_where_only_the_host_fits_the_plan_chooses_it_and_its_need_is_predict_offloads(only_host_fits):
    """Device: cuda plan (an H100's rules), predicted on the CPU. The GPU need of the chosen host optimizer is
    predict_offload's reserved peak (no context allowance asked); its copies are the prediction's, both ways."""
    p = only_host_fits
    assert p.choice.candidate.optimizer == HOST_GRADS
    assert [r.candidate.optimizer for r in p.rows if r.fits] == [HOST_GRADS]
    make = p.optimizers[HOST_GRADS]
    alone = predict_offload(make_model, make, make_batch)
    assert p.choice.need == alone.reserved_peak and p.choice.peak == alone.device_peak
    assert p.choice.host_peak == alone.host_peak
    offloaded = sum(q.numel() * 4 for q in make_model().parameters() if q.numel() >= host.MINIMAL_SIZE)
    assert p.choice.copy_bytes == alone.copies.total == 2 * offloaded
    assert "reserved at the peak" in p.choice.how


def test_the_chosen_host_step_ran_here_and_measured_what_was_predicted_for_gpu_and_host(only_host_fits):
    """Device: cpu, as GPU and host at once (cuda_stand_ins): the verification's measured peak is the prediction's
    GPU (without CUDA's workspaces) and host together, to the byte."""
    v = only_host_fits.verification
    assert v.ran and v.fitted
    assert f"({v.measured_peak:,} B) without CUDA's workspaces" in v.message


def test_the_printed_recipe_builds_torchaos_optimizer_and_trains_like_fused_adamw(only_host_fits):
    """Device: cpu, with CUDA's streams and pinned memory stood in (cuda_stand_ins); the recipe's 'cuda' read as
    'cpu'. torchao steps a fused AdamW on the host: the recipe's update is fused AdamW's, bit for bit."""
    code = only_host_fits.code
    assert "from torchao.optim import CPUOffloadOptimizer" in code
    assert "CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=True, lr=0.001" in code
    namespace = {"make_model": make_model, "loader": [make_batch(), make_batch()]}
    with cuda_stand_ins():
        exec(code.replace("'cuda'", "'cpu'"), namespace)
    reference = make_model()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True)
    for _ in range(2):
        train_step(reference, optimizer, make_batch())
    for a, b in zip(namespace["model"].parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_plan_build_steps_the_chosen_host_optimizer_on_this_cpu_without_a_block_of_the_users(only_host_fits):
    """Device: cpu. Plan.build(row) of a host-offload choice builds torchao's optimizer and its step under the
    stand-ins itself (torchao asks for CUDA), also inside a block of the user's own: its update is fused AdamW's."""
    model, optimizer, step = only_host_fits.build(only_host_fits.choice)
    reference = make_model()
    fused = torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True)
    step(model, optimizer, make_batch())
    with cuda_stand_ins():
        step(model, optimizer, make_batch())
    for _ in range(2):
        train_step(reference, fused, make_batch())
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_host_too_small_for_the_optimizers_copies_makes_the_host_candidates_not_fit():
    """Device: cuda plan, predicted on the CPU. Below the host's four copies of the offloaded weights the host
    candidates are pruned unpredicted; a byte above them they are predicted, and the host's step counters (512 B a
    parameter) put them over: 'does not fit', saying why. Nothing fits the budget then."""
    offloaded = [q for q in make_model().parameters() if q.numel() >= host.MINIMAL_SIZE]
    copies = 4 * sum((q.numel() * 4 + 511) // 512 * 512 for q in offloaded)
    pruned = small_plan(host=Host(memory=copies - 1), verify=False)
    rows = [r for r in pruned.rows if "on the host" in r.candidate.optimizer]
    assert rows and all(r.need is None and "the host's memory" in r.verdict for r in rows)
    predicted = small_plan(host=Host(memory=copies + 1), verify=False)
    rows = [r for r in predicted.rows if r.candidate.optimizer == HOST_GRADS]
    assert rows[0].need is not None and rows[0].need <= predicted.budget and rows[0].fits is False
    assert rows[0].verdict.startswith("does not fit: the host needs") and rows[0].host_peak > copies
    assert predicted.choice is None


@pytest.mark.parametrize("value", ["lots", -5, "12.7 parsecs"])
def test_a_host_memory_that_is_not_a_size_says_what_is_allowed(value):
    """Device: none (refused before anything is predicted)."""
    with pytest.raises(ValueError, match=r"Host\(memory=.*'12.7GB'.*GiB\).*None"):
        Host(memory=value)


def test_every_bound_of_a_host_candidate_is_at_most_its_need():
    """Device: none (CUDA's rules, fake tensors). For each host candidate of a small GPT (some parameters below
    torchao's minimal_size, kept on the GPU with their state): the floor (never predicted: torchao asks for CUDA),
    the bound of its configuration's prefix with and without the optimizer's state, and the host's bound, each at
    most what the candidate is predicted to need."""
    x, y = digit_tokens_batch(16)
    search = PlanSearch(lambda: TinyGPT(GPTConfig(n_layer=2, n_embd=32, n_head=2)), lambda p: torch.optim.AdamW(p),
                        lambda: (x.clone(), y.clone()), 10**12, device="cuda", card=NO_ALLOWANCE,
                        techniques=SEARCHED)
    candidates = [c for c in search.candidates() if c.optimizer in search.host]
    assert {c.optimizer for c in candidates} == {HOST, HOST_GRADS}
    assert not any(c.accumulate > 1 for c in candidates if search.host[c.optimizer])  # no accumulation
    checked = 0
    for c in candidates:
        search.prefix(c)
        before = search.predictions
        bounds = [search.lower_bound(c), search.phase_bound(c, floor=False), search.phase_bound(c)]
        assert search.predictions == before  # the floor of a host optimizer is never predicted
        row = search.evaluate(c)
        for bound in bounds:
            assert bound is None or bound <= row.need, (c, bounds, row.need)
            checked += bound is not None
        assert host.host_bound(search, c) <= row.host_peak
        assert row.copy_bytes == search.host_copies(c)  # the copies counted before it was predicted
    assert checked >= 2 * len(candidates)


def test_host_candidates_the_search_prunes_by_a_bound_need_at_least_that_bound():
    """Device: none (CUDA's rules, fake tensors). A budget below what the cuBLAS workspaces and the weights need:
    the search prunes the host candidates by their bounds without predicting them; each, predicted afterwards,
    needs at least the bound it was pruned by."""
    search = PlanSearch(make_model, adamw, make_batch, 60 * 10**6, device="cuda", card=NO_ALLOWANCE,
                        techniques=SEARCHED)
    rows = search.run()
    pruned = [r for r in rows if r.candidate.optimizer in search.host and r.bound is not None]
    assert pruned and all(r.need is None and r.bound > search.limit for r in pruned)
    for r in pruned:
        assert r.bound <= search.evaluate(r.candidate).need, r.candidate


def test_a_convnets_host_rows_say_their_need_is_a_lower_bound_as_its_other_rows_do():
    """Device: cpu, a plan for CUDA (an H100's rules). cuDNN's convolution workspaces are sized by the algorithm it
    picks on the card: every predicted row of a plan for this file's model behind a convolution names its need a
    lower bound, the host rows (predict_offload's simulated GPU) as the others, where they said nothing."""
    def convnet():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 1, 3, padding=1), nn.Flatten(), make_model())

    def images():
        g = torch.Generator().manual_seed(0)
        return torch.randn(8, 1, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)

    p = small_plan(make_model=convnet, make_batch=images, verify=False)
    predicted = [r for r in p.rows if r.prediction is not None]
    assert {HOST, HOST_GRADS} <= {r.candidate.optimizer for r in predicted}
    assert all(r.lower_bound for r in predicted)
