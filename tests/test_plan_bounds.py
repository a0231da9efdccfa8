"""plan()'s bound from another optimizer's prediction of the same configuration: exact before the optimizer step
(the same model, batch and techniques allocate the same whatever the optimizer, but for its state), below every
pruned candidate's own prediction, and never the reason the true cheapest recipe is missed. Small models."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import replace

import pytest
import torch

from gpukit._torch import in_backward as autograd_running
from gpukit.estimate import predict
from gpukit.lessons.data import digit_tokens_batch
from gpukit.lessons.models import GPTConfig, TinyGPT
from gpukit.plan import DEFAULT_CARD, Techniques
from gpukit.plan.search import PlanSearch
from gpukit.plan.steps import model_maker, prefix_residual, step_for
from gpukit.step import resolve_loss

SGD = {"SGD momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)}


def gpt_case(batch: int = 32):
    x, y = digit_tokens_batch(batch)
    return (lambda: TinyGPT(GPTConfig(n_layer=2, n_embd=32, n_head=2))), (lambda p: torch.optim.AdamW(p)), \
        (lambda: (x.clone(), y.clone()))


def search_for(case, device: str, limit: int = 10**12, *, loss=None, card=None, allowance: int = 0,
               pairwise: bool = False, **techniques) -> PlanSearch:
    """A search of ``case`` on one GPU for ``device`` (``card``, else DEFAULT_CARD, with ``allowance``), with these
    techniques, those given replaced (``Techniques``' fields); with ``pairwise``, over ``pairwise_cover``'s
    configurations only."""
    options = dict(precisions=("float32", "bf16 weights"), accumulate=[1, 2], offload=False, lora=False)
    options.update(techniques)
    search = PlanSearch(*case, limit, device=device, loss=loss, techniques=Techniques(**options),
                        card=replace(card or DEFAULT_CARD, context_allowance=allowance))
    if pairwise:
        every = search.candidates()
        plain = next(settings(c) for c in every if c.label == "plain")
        cover = pairwise_cover({settings(c) for c in every}, plain)
        search.candidates = lambda: [c for c in every if settings(c) in cover]  # (what run() searches too)
    return search


def settings(c) -> tuple:
    """A candidate's setting of each technique the bound tests vary."""
    return c.precision, c.accumulate, c.checkpointed, c.offload


def pairwise_cover(configurations: set[tuple], first: tuple) -> set[tuple]:
    """``first`` and configurations in which every two settings of two techniques meet at least once (chosen
    greedily, in a fixed order): a bound that goes wrong where two techniques meet is still found, in about a
    third of the predictions of every combination (the Llama's and the GPT's took 400 s of the suite's time)."""
    def pairs(k: tuple) -> set[tuple]:
        return {(i, k[i], j, k[j]) for i in range(len(k)) for j in range(i + 1, len(k))}

    ordered = sorted(configurations)
    todo, chosen = set().union(*map(pairs, ordered)) - pairs(first), {first}
    while todo:
        best = max(ordered, key=lambda k: len(pairs(k) & todo))
        chosen.add(best)
        todo -= pairs(best)
    return chosen


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_before_the_optimizer_step_every_optimizer_allocates_the_same_but_for_its_state(device):
    """Device: none (fake tensors, CUDA's rules for "cuda"). For each configuration, the peak before the optimizer
    step less the optimizer's state is one number for SGD, AdamW (its default step, foreach on CUDA and for-loop on the
    CPU, and fused) and 8-bit AdamW: the bound's premise, checked exactly; and the state a floor counts is the one the
    step starts with."""
    search = search_for(gpt_case(), device, optimizers=SGD, precisions=("float32", "bf16", "bf16 weights"),
                        checkpointing=False)
    seen: dict[tuple, dict[str, int]] = {}
    for c in search.candidates():
        if c.optimizer.endswith(", in backward") or c.optimizer in search.host or c.optimizer in search.same_state:
            continue  # (the host's optimizers: tests/test_plan_host.py, predicted with predict_offload; a for-loop
            # step's state is its foreach step's, made by the same _init_group: test_the_state_without_a_floor...)
        phases: dict = {}
        p = predict(model_maker(search.make_model, c.precision), search.optimizers[c.optimizer][0],
                    search.make_batch, step=step_for(c, c.accumulate, None, None, phases), device=device,
                    breakdown=False)  # (the bytes alone: the same, without the roles' bookkeeping)
        assert phases["every_grad"] and phases["state"] == search.floor(c)["state"] > 0
        seen.setdefault(search.configuration(c), {})[c.optimizer] = p.before_step + phases["backward"] - phases["state"]
    assert len(seen) == 3 * 2
    for config, by_optimizer in seen.items():
        assert len(by_optimizer) >= 4 and len(set(by_optimizer.values())) == 1, (config, by_optimizer)


# -- bounds from a prefix of the step (no warm-up, no optimizer step) ---------------------------------------------


def llama_case(batch: int = 8, length: int = 32):
    """A transformers Llama (tied embeddings) trained with the loss it computes, from a padded dict batch of
    ``length`` tokens a sequence."""
    transformers = pytest.importorskip("transformers")

    def make_model():
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=max(64, length),
                                          tie_word_embeddings=True, use_cache=False)
        return transformers.LlamaForCausalLM(config)

    ids = torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[::2, -8:] = 0
    batch_ = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    return make_model, (lambda p: torch.optim.AdamW(p)), (lambda: {k: v.clone() for k, v in batch_.items()})


CASES = {"gpt": (gpt_case, None, ("float32", "bf16 weights")),
         "llama": (llama_case, "model", ("float32", "fp16", "bf16 weights"))}


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("name", list(CASES))
def test_every_bound_from_a_prefix_of_the_step_is_below_the_candidates_own_prediction(name, monkeypatch):
    """Device: none (CUDA's rules: reserved memory, offload). Each configuration's step run without its warm-up up
    to the optimizer step, stopped at the end of its forward, in its middle where the budget is passed, or not at
    all (three budgets), bounds every candidate of the configuration, with any optimizer (stepped in backward too:
    by the forward alone), at most its own need; with the optimizer's state only where every parameter got a
    gradient. The prefix is read where the step ran to its end: within 10% of the plain step's allocated peak. On the
    same exhaustive search: on the GPT, every candidate's bound from the other optimizers' phases is below its need
    (``every_bound_from_another_optimizer_is_below``); on the Llama, a transformers model with the loss it computes,
    the plan's searches at two budgets never drop the true cheapest (``never_drop_the_true_cheapest``)."""
    make_case, loss, precisions = CASES[name]
    case = make_case()
    if name == "llama":  # the host optimizers' bounds are checked on the GPT (and in tests/test_plan_host.py), and
        # so are the for-loop and fused steps': each would cost the Llama's exhaustive search more predictions
        search_module = sys.modules["gpukit.plan.search"]  # (the names as the search holds them)
        monkeypatch.setattr(search_module, "host_variants", lambda *args: [])
        monkeypatch.setattr(search_module, "other_implementations", lambda *args: [])
    options = dict(precisions=precisions, offload=True, loss=None if loss is None else resolve_loss(loss),
                   pairwise=True)
    exhaustive = search_for(case, "cuda", **options)
    need = {c: exhaustive.evaluate(c).need for c in exhaustive.candidates()}
    plain = max(need.values())
    checked = {}
    residuals: dict = {}  # fraction -> configuration -> what its prefix left allocated but its gradients
    bounds_module = sys.modules["gpukit.plan.bounds"]  # (the names as the bounds hold them)
    for fraction in (10.0, 1.0, 0.3):  # the end of the forward (hopeless); the whole prefix; its middle
        search = search_for(case, "cuda", limit=int(plain * fraction), **options)
        search.hopeless = 0.0 if fraction == 1.0 else search.hopeless
        for c in search.candidates():
            with monkeypatch.context() as m:
                m.setattr(bounds_module, "prefix_residual", lambda found, c=c, f=fraction: residuals.setdefault(
                    f, {}).setdefault(search.configuration(c), prefix_residual(found)))
                search.prefix(c)
            for floor in (False, True):
                bound = search.phase_bound(c, floor=floor)
                if bound is not None:
                    assert bound <= need[c], (fraction, c, floor, bound, need[c])
                    checked[fraction, floor] = checked.get((fraction, floor), 0) + 1
        assert search.predictions == len({search.configuration(c) for c in search.candidates()})
    assert all(checked.get((f, False)) for f in (10.0, 1.0, 0.3)) and checked.get((1.0, True))
    # Wherever a prefix stops (never in backward, where a checkpointed module's forward runs again and the graph is
    # still held), what it leaves is what the whole prefix leaves: a module's cache, never its graph.
    # (less only by what the step makes later: a GradScaler's scale and growth tracker, 1,024 bytes once rounded)
    for f in (10.0, 0.3):
        for key, left in residuals[f].items():
            assert residuals[1.0][key] - (1024 if key[0] == "fp16" else 0) <= left <= residuals[1.0][key], \
                (f, key, left, residuals[1.0][key])
    whole = search_for(case, "cuda", limit=int(plain), **options)
    whole.hopeless = 0.0
    first = next(c for c in whole.candidates() if c.optimizer == "yours: AdamW" and c.label == "plain")
    whole.prefix(first)
    assert whole.phase_bound(first) > 0.9 * exhaustive.rows[first].peak
    # And on the same exhaustive search (one search of each model, not two):
    if name == "gpt":  # every candidate's bound from the other optimizers' phases
        every_bound_from_another_optimizer_is_below(exhaustive)
    else:  # what the bounds are for, on a transformers model with the loss it computes
        never_drop_the_true_cheapest(case, exhaustive, options)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("technique", ["checkpointing", "chunked loss"])
def test_a_prefix_over_the_budget_in_backward_stops_at_the_optimizer_step(technique, monkeypatch):
    """Device: none (CUDA's rules). Checkpointing and the chunked loss run modules' forwards again in backward (a
    block's; the output embedding's, a chunk at a time), and a prefix reads its bytes after each module's forward.
    It used to stop there when over the budget: in backward, where its own rule says not to stop (the graph may
    still be held, and count as what the step leaves: a 1.24B Llama's chunked configuration's bound fell by 10 GiB,
    below its own forward, and a candidate 11 GiB over the budget was predicted in full). A prefix now never stops
    in backward: at budgets between its forward's peak and its backward's, it stops at the end of a forward or at
    the optimizer step, leaves nothing but its gradients, and where it ran into its optimizer step its backward is
    the whole prefix's."""
    if technique == "checkpointing":  # (the GPT)
        case, loss, options = gpt_case(), None, dict(checkpointing=True)
    else:  # a transformers Llama with the loss it computes, sequences long enough to chunk
        case, loss, options = llama_case(batch=4, length=1024), resolve_loss("model"), dict(checkpointing=False)
    bounds_module, steps = sys.modules["gpukit.plan.bounds"], sys.modules["gpukit.plan.steps"]
    full = search_for(case, "cuda", loss=loss, **options)
    full.hopeless = 0.0
    chosen = [c for c in full.candidates() if c.optimizer == "yours: AdamW" and c.precision == "float32" and
              (c.checkpointed if technique == "checkpointing" else c.chunked_loss)]
    assert len(chosen) == 2  # one micro-batch or two (the chunked loss's: 4,096 tokens, or 2,048)
    found, in_backward = [], []

    def prefix_step(c, k, loss, into, enough, last_only=True):
        def told(allocated: int, forward: bool) -> bool:
            stop = enough(allocated, forward)
            in_backward.append(stop and autograd_running())
            return stop
        found.append(into)
        return steps.prefix_step(c, k, loss, into, told, last_only)

    left = []
    monkeypatch.setattr(bounds_module, "prefix_step", prefix_step)
    monkeypatch.setattr(bounds_module, "prefix_residual", lambda into: left.append(prefix_residual(into)) or left[-1])
    over_in_backward = 0
    for c in chosen:
        full.prefix(c)
        key = full.configuration(c)
        whole = dict(found[-1])
        forward, backward = (whole["base"] + whole[phase] for phase in ("forward", "backward"))
        for i in range(4):  # budgets from the forward's peak up to the backward's
            limit = forward + (backward - forward) * i // 4
            search = search_for(case, "cuda", limit=limit, loss=loss, **options)
            search.hopeless = 0.0
            search.prefix(c)
            last = found[-1]
            assert not any(in_backward) and left[-1] == 0, (key, i, left[-1])
            if key in search.every_grad:  # (ran to its optimizer step)
                assert search.phases[key]["backward"] == full.phases[key]["backward"], (key, i)
                over_in_backward += last["base"] + last["backward"] > limit
    assert over_in_backward  # (where a prefix used to stop in backward)


def every_bound_from_another_optimizer_is_below(exhaustive: PlanSearch) -> None:
    """Every candidate predicted; then each one's bound from the others' phases (stepped in backward too: bounded by
    the forward alone) is at most its need, on reserved memory."""
    rows = [exhaustive.evaluate(c) for c in exhaustive.candidates()]
    checked = 0
    for r in rows:
        for floor in (False, True):
            bound = exhaustive.phase_bound(r.candidate, floor=floor)
            assert bound is not None
            assert bound <= r.need, (r.candidate, floor, bound, r.need)
            checked += 1
    in_backward = [r for r in rows if r.candidate.optimizer.endswith(", in backward")]
    assert in_backward and checked == 2 * len(rows)
    # Close where the forward and backward dominate: within the optimizer step's own temporaries.
    plain = next(r for r in rows if r.candidate.optimizer == "yours: AdamW" and r.candidate.label == "plain")
    assert exhaustive.phase_bound(plain.candidate) > 0.9 * plain.peak


def never_drop_the_true_cheapest(case, exhaustive: PlanSearch, options: dict) -> None:
    """Budgets between the most and the least any candidate needs: the plan's choice and its need are the exhaustive
    search's cheapest fitting candidate's, every candidate a bound pruned does not fit, and the plan predicts less
    than the exhaustive search."""
    every = {c: exhaustive.evaluate(c) for c in exhaustive.candidates()}
    most, least = max(r.need for r in every.values()), min(r.need for r in every.values())
    bounded = 0
    for fraction in (0.6, 0.1):
        limit = int(least + (most - least) * fraction)
        fitting = [r for r in every.values() if r.need <= limit]
        cheapest = exhaustive.rank_fitting(fitting, note=False)[0]  # (the plan's own ranking)
        search = search_for(case, "cuda", limit=limit, **options)
        rows = search.run()
        choice = next(r for r in rows if r.fits and r.need is not None)
        assert (choice.candidate, choice.need) == (cheapest.candidate, cheapest.need), fraction
        for r in rows:
            if r.need is None and r.bound is not None:
                assert r.fits is False and limit < r.bound <= every[r.candidate].need, (fraction, r.candidate)
                bounded += "forward and backward" in r.verdict
        assert search.predictions < exhaustive.predictions
    assert bounded  # the phases' bound pruned candidates, not only the floors


def prefix_phases(search: PlanSearch, candidates, last_only: bool, monkeypatch) -> dict:
    """Each candidate configuration's phases from its prefix, the accumulated ones run by their last micro-batch
    alone (``last_only``) or every micro-batch, and whether a prefix said its last micro-batch cannot tell
    ("shared")."""
    steps = sys.modules["gpukit.plan.steps"]
    flags: dict = {}

    def prefix_step(c, k, loss, found, enough, last=True):
        flags.setdefault(search.configuration(c), []).append(found)
        return steps.prefix_step(c, k, loss, found, enough, last and last_only)

    with monkeypatch.context() as m:
        m.setattr(sys.modules["gpukit.plan.bounds"], "prefix_step", prefix_step)
        for c in candidates:
            search.prefix(c)
    return {key: (dict(search.phases[key]), key in search.every_grad, any("shared" in f for f in flags[key]))
            for key in {search.configuration(c) for c in candidates}}


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("name", list(CASES))
def test_an_accumulated_prefix_run_by_its_last_micro_batch_is_the_whole_ones(name, monkeypatch):
    """Device: none (CUDA's rules). Accumulating 2 micro-batches (checkpointed, offloaded, float16 with its
    GradScaler, bfloat16 weights), the prefix that runs only the last micro-batch, with the gradients the earlier
    ones leave made at the end of its forward, gives the phases of the prefix that runs them all, to the byte:
    the same first forward, the same peak up to the optimizer step, the same parameters with a gradient. One
    exception, from the theory: a GradScaler's scale and growth tracker (two one-element tensors, 512 bytes each
    once rounded), which the first micro-batch makes before the last one's forward, are made after it; the bound
    leaves them out anyway (what outlives the step is the warm-up's), so it is lower by at most those 1,024
    bytes, never higher."""
    make_case, loss, precisions = CASES[name]
    options = dict(precisions=precisions, offload=True, loss=None if loss is None else resolve_loss(loss),
                   accumulate=[1, 2])
    found = {}
    for last_only in (True, False):
        search = search_for(make_case(), "cuda", **options)
        search.hopeless = 0.0  # every prefix runs to the optimizer step
        found[last_only] = prefix_phases(search, [c for c in search.candidates() if c.accumulate > 1], last_only,
                                         monkeypatch)
    assert len(found[True]) >= 2 * 2 * len(precisions)  # checkpointed or not, offloaded or not
    for key, (phases, every_grad, shared) in found[True].items():
        whole, whole_every_grad, _ = found[False][key]
        assert not shared and every_grad == whole_every_grad
        assert phases["forward"] == whole["forward"], key
        allowed = 1024 if key[0] == "fp16" else 0
        assert whole["backward"] - allowed <= phases["backward"] <= whole["backward"], (key, phases, whole)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("name", list(CASES))
def test_the_copies_read_from_a_prefix_are_at_most_offloads_own(name):
    """Device: none (CUDA's rules). A prefix stopped before backward reads what its forward saved so far; the
    configuration with offload copies each saved tensor to the host and back, so twice that (per micro-batch) is
    a lower bound of its copies, which queues it at a cost it has at least: at the end of the forward and in its
    middle, never above the copies counted under offload. At the end of the forward of a loss the model computes,
    only the saved 0-dimensional tensors are not read: within 1%."""
    make_case, loss, precisions = CASES[name]
    case = make_case()
    options = dict(precisions=precisions, offload=True, loss=None if loss is None else resolve_loss(loss),
                   accumulate=[1, 2, 4], checkpointing=False)
    exhaustive = search_for(case, "cuda", **options)
    plain = max(exhaustive.evaluate(c).need for c in exhaustive.candidates() if c.label == "plain")
    offloaded = [c for c in exhaustive.candidates() if c.offload and c.optimizer == "yours: AdamW"]
    assert len(offloaded) == 3 * len(precisions)
    for fraction in (10.0, 0.4):  # the end of the forward (hopeless); its middle, over the budget
        search = search_for(case, "cuda", limit=int(plain * fraction), **options)
        bounded = 0
        for c in offloaded:
            search.prefix(replace(c, offload=False))
            low, copies = search.copies_at_least(c), exhaustive.copy_bytes(c)
            if fraction == 10.0:
                assert low is not None
            if low is not None:
                bounded += 1
                assert 0 < low <= copies, (fraction, c, low, copies)
                if fraction == 10.0 and loss is not None:
                    assert low >= 0.99 * copies, (c, low, copies)
        assert bounded


class _OneStorage(torch.autograd.Function):
    """``x * (a.sum() + b.sum())``, whose backward returns the gradients of ``a`` and ``b`` as two rows of one
    tensor: both taken over as ``.grad`` (torch/csrc/autograd/functions/accumulate_grad.h), one storage."""

    @staticmethod
    def forward(ctx, x, a, b):
        ctx.save_for_backward(x)
        return x * (a.sum() + b.sum())

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        rows = (grad * x).sum().expand(2, 64).clone()
        return grad * 2, rows[0], rows[1]


class _TwinGrads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Parameter(torch.ones(64)), torch.nn.Parameter(torch.ones(64))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(_OneStorage.apply(x, self.a, self.b))


def test_an_accumulated_prefix_whose_gradients_share_a_storage_runs_every_micro_batch(monkeypatch):
    """Device: none. Two parameters whose gradients come as rows of one storage: made apart at the end of the last
    micro-batch's forward they would count two storages where the first micro-batch leaves one (on the CPU, 512
    bytes more once rounded: a bound above the truth). The prefix says so, and the search runs every micro-batch:
    its phases are the whole prefix's; stopped before backward, it is below them."""
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    case = (_TwinGrads, lambda p: torch.optim.SGD(p, lr=0.1), lambda: (x.clone(), y.clone()))
    real = _TwinGrads()
    real(x).sum().backward()
    assert real.a.grad.untyped_storage() is real.b.grad.untyped_storage()  # the premise, on real tensors
    options = dict(precisions=("float32",), checkpointing=False, accumulate=[2])
    found = {}
    for last_only in (True, False):
        search = search_for(case, "cpu", **options)
        search.hopeless = 0.0
        found[last_only] = prefix_phases(search, [c for c in search.candidates() if c.accumulate == 2], last_only,
                                         monkeypatch)
    (key, (phases, every_grad, shared)), = found[True].items()
    whole = found[False][key][0]
    assert shared and phases == whole and every_grad
    # Budgets that stop it at the end of its forward, where its gradients are made and backward has not yet shown
    # that they share a storage: they count for their elements' bytes, never above the truth.
    stopped = 0
    for limit in range(whole["forward"], whole["backward"] + 1024, 64):
        search = search_for(case, "cpu", limit=limit, **options)
        search.hopeless = 0.0
        (bounded, _, shared), = prefix_phases(search, [c for c in search.candidates() if c.accumulate == 2], True,
                                              monkeypatch).values()
        assert bounded["backward"] <= whole["backward"], limit
        stopped += not shared
    assert stopped


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("name", list(CASES))
def test_the_state_without_a_floor_is_the_floors(name):
    """Device: none. The figures a search takes from one optimizer step outside predict() (parameters, gradients,
    optimizer state) are the floor's, to the byte, for every optimizer (8-bit and stepped in backward included) and
    parameter type; and what that step starts with is below the floor's peak. A fused step's state is at least
    its foreach step's."""
    make_case, loss, precisions = CASES[name]
    case = make_case()
    options = dict(precisions=precisions, loss=None if loss is None else resolve_loss(loss))
    for device in ("cpu", "cuda"):
        cheap, floors = search_for(case, device, **options), search_for(case, device, **options)
        seen = set()
        for c in cheap.candidates():
            key = (c.optimizer, c.precision == "bf16 weights")
            if key in seen:
                continue
            seen.add(key)
            info, floor = cheap.state_info(c), floors.floor(c)
            assert {k: info[k] for k in ("params", "grads", "optimizer_state", "state")} == \
                {k: floor[k] for k in ("params", "grads", "optimizer_state", "state")}, (device, c)
            assert info["before"] <= floor["peak"]
        assert cheap.predictions == 0 and len(seen) >= 8
        # A fused step holds at least its foreach step's state (the bound that prunes it before its own is made).
        if device == "cuda":
            assert cheap.state_above
        for fused, base in cheap.state_above.items():
            for c in cheap.candidates():
                if c.optimizer == fused:
                    assert cheap.state_info(c)["state"] >= cheap.state_info(replace(c, optimizer=base))["state"] > 0


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_state_of_adapters_is_read_before_any_prediction_of_them():
    """Device: cpu. A prefix reads its candidate's state before its first prediction (``PlanSearch.prefix``): the
    state of LoRA and QLoRA adapters over a transformers model, read first, is the floor's (peft moves the adapters
    it adds with ``nn.Module._apply``, which swaps fake parameters: it failed there, before any prediction)."""
    pytest.importorskip("peft")
    case = llama_case()
    options = dict(loss=resolve_loss("model"), lora=True, implementations=False)
    cheap, floors = search_for(case, "cpu", **options), search_for(case, "cpu", **options)
    adapters = {(c.qlora, c.precision): c for c in cheap.candidates() if c.lora}
    assert {qlora for qlora, _ in adapters} == ({False, True} if cheap.facts.qlora_shapes else {False})
    for c in adapters.values():
        info, floor = cheap.state_info(c), floors.floor(c)
        assert {k: info[k] for k in ("params", "grads", "optimizer_state", "state")} == \
            {k: floor[k] for k in ("params", "grads", "optimizer_state", "state")}, c
    assert cheap.predictions == 0


def test_a_forward_far_below_the_budget_goes_on_where_its_optimizers_state_could_cross_it():
    """Device: cpu. A prefix ends at its forward where what it allocated is under half the budget (``hopeless``),
    with the gradients and optimizer state its candidate adds: a wide MLP stepped by AdamW on a batch of 2 has a
    forward of little more than its parameters and a state of twice them, so at a budget between twice its forward
    and its backward with that state, its prefix runs to the optimizer step and its bound prunes it unpredicted
    (where the forward alone was compared, the prefix ended there, bounded nothing, and the step was predicted)."""
    x, y = torch.randn(2, 1024), torch.randint(0, 1024, (2,))
    case = (lambda: torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]),
            lambda p: torch.optim.AdamW(p), lambda: (x.clone(), y.clone()))
    whole = search_for(case, "cpu", accumulate=[1], precisions=("float32",), checkpointing=False,
                       implementations=False)
    whole.hopeless = 0.0
    c = next(c for c in whole.candidates() if c.label == "plain")
    whole.prefix(c)
    forward, bound = whole.phases[whole.configuration(c)]["forward"], whole.phase_bound(c)
    assert 2 * forward < bound  # (the premise: 16 MiB of weights, their 32 MiB of AdamW state)
    limit = (2 * forward + bound) // 2
    search = search_for(case, "cpu", limit=limit, accumulate=[1], precisions=("float32",), checkpointing=False,
                        implementations=False)
    search.prefix(c)
    assert search.phase_bound(c) == bound > limit and search.predictions == 1
    assert search.evaluate(c).need >= bound


def test_a_candidate_whose_state_alone_is_over_the_budget_costs_no_prediction():
    """Device: cpu (a CUDA plan). What a step starts with (parameters, gradients, optimizer state: read without a
    prediction) and the context allowance over the budget prune a candidate before any prefix of its configuration is
    predicted: under the model's state, or under the allowance alone, a plan makes no prediction (it made one prefix
    per configuration: 224 for this MLP under 30 MB), and every row says what was over the budget."""
    x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))
    case = (lambda: torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10)),
            lambda p: torch.optim.AdamW(p), lambda: (x.clone(), y.clone()))
    # float32 parameters, gradients and AdamW's two moments; the least a candidate holds is an eighth of it (bfloat16
    # weights alone on the card, their gradients and moments on the host)
    state = 4 * 4 * (512 * 2048 + 2048 + 2048 * 10 + 10)
    for limit, allowance in ((state // 10, 0), (10**8, 2 * 10**8)):
        search = search_for(case, "cuda", limit=limit, allowance=allowance, offload=True)
        rows = search.run()
        assert search.predictions == 0 and rows and all(r.fits is False and r.bound > limit for r in rows)
        assert all(r.verdict.startswith("pruned: model state alone need") for r in rows)
        # nor a forward to count what offload would copy: its state, read for the same optimizer, was over already
        assert any(r.candidate.offload for r in rows) and not search.copies
    # After a floor was predicted (its figures hold no "before"), the bound is the floor's peak.
    search = search_for(case, "cuda", limit=state // 10, precisions=("float32",), accumulate=[1], checkpointing=False,
                        implementations=False)
    c = search.candidates()[0]
    floor = search.floor(c)["peak"]
    assert search.state_bound(c) == floor > state and search.lower_bound(c) == floor
    assert search.run() and search.predictions == 1


def test_quantisation_maps_made_once_change_no_prediction(monkeypatch):
    """Device: none. bitsandbytes' 8-bit AdamW, alone and stepped in backward (one optimizer per parameter): its
    quantisation maps computed once for every optimizer built under fake tensors leave the prediction as it was
    (allocated and reserved peaks, what the step starts with), on CUDA's rules (the maps are made before any step,
    whatever the device's rules)."""
    pytest.importorskip("bitsandbytes")
    import sys

    facts = sys.modules["gpukit.plan.facts"]
    _, make, _ = facts.eight_bit_optimizer(lambda p: torch.optim.AdamW(p))
    make_model, _, make_batch = gpt_case()
    for make_optimizer in (make, facts.stepped_in_backward(make)):
        once = predict(make_model, make_optimizer, make_batch, device="cuda", breakdown=False)
        with monkeypatch.context() as m:
            m.setattr(facts, "_maps_once", contextlib.nullcontext)
            each = predict(make_model, make_optimizer, make_batch, device="cuda", breakdown=False)
        assert (once.peak, once.reserved_peak, once.before_step) == (each.peak, each.reserved_peak, each.before_step)
