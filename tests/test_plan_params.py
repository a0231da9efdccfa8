"""plan()'s parameters: the card, the host and the techniques as data (gpukit.plan.params), at most 12 of them;
the keywords it took before, each still working for one release with a DeprecationWarning that names its new form
and giving the same plan as that form; bad input refused when it is made, before anything is predicted. Small
models on the CPU's rules and CUDA's under fake tensors: seconds."""

from __future__ import annotations

import dataclasses
import inspect
import sys
import warnings

import pytest
import torch

import gpukit
from gpukit.cards import card
from gpukit.lessons.data import digits_batch
from gpukit.lessons.models import MLP
from gpukit.plan import DEFAULT_CARD, Host, Techniques, plan
from gpukit.plan.search import PlanSearch

X, Y = digits_batch(64)
CASE = ((lambda: MLP(width=16, depth=1)), (lambda p: torch.optim.Adam(p, lr=1e-3)), (lambda: (X.clone(), Y.clone())))
BUDGET = "1GB"
SMALL = dict(implementations=False, precisions=("float32",), accumulate=[1, 2], checkpointing=False, lora=False)


def frame(p) -> dict:
    return {"table": p.frame().to_dict(), "code": p.code, "assumptions": p.assumptions, "budget": p.budget,
            "allowance": p.allowance}


def test_plan_has_at_most_12_parameters_and_a_shim_for_the_old_keywords():
    parameters = inspect.signature(plan).parameters
    named = [p for p in parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert len(named) <= 12, list(parameters)
    assert [p.name for p in named] == ["make_model", "make_optimizer", "make_batch", "budget", "card", "host",
                                       "techniques", "gpus", "device", "loss", "alternatives", "verify"]
    assert [p.name for p in parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD] == ["deprecated"]
    assert gpukit.plan.Techniques is Techniques and gpukit.plan.Host is Host  # spelled as the warnings spell them
    assert gpukit.plan.DEFAULT_CARD is DEFAULT_CARD


# old keyword, its value, the new form's keywords (the same plan), the new form as the warning names it
OLD = [
    ("optimizers", {"SGD": lambda p: torch.optim.SGD(p, lr=0.1)}, None,
     "techniques=gpukit.plan.Techniques(optimizers=...)"),
    ("implementations", True, None, "techniques=gpukit.plan.Techniques(implementations=...)"),
    ("precisions", ("float32", "bf16"), None, "techniques=gpukit.plan.Techniques(precisions=...)"),
    ("accumulate", [1, 4], None, "techniques=gpukit.plan.Techniques(accumulate=...)"),
    ("checkpointing", True, None, "techniques=gpukit.plan.Techniques(checkpointing=...)"),
    ("offload", False, None, "techniques=gpukit.plan.Techniques(offload=...)"),
    ("strategies", ("single GPU",), None, "techniques=gpukit.plan.Techniques(strategies=...)"),
    ("lora", True, None, "techniques=gpukit.plan.Techniques(lora=...)"),
    ("host_memory", "64GB", {"host": Host(memory="64GB")}, "host=gpukit.plan.Host(memory=...)"),
    ("host_memory_bandwidth", "100GB", {"host": Host(memory_bandwidth="100GB")},
     "host=gpukit.plan.Host(memory_bandwidth=...)"),
    ("host_bandwidth", "8GB", {"host": Host(link="8GB")}, "host=gpukit.plan.Host(link=...)"),
    ("tflops", 7.5, {"card": dataclasses.replace(DEFAULT_CARD, fp32_tflops=7.5)},
     "card=dataclasses.replace(gpukit.plan.DEFAULT_CARD, fp32_tflops=...)"),
    ("memory_bandwidth", "500GB", {"card": dataclasses.replace(DEFAULT_CARD, memory_bandwidth=500e9)},
     "card=dataclasses.replace(gpukit.plan.DEFAULT_CARD, memory_bandwidth=...)"),
    ("allowance", "100MB", {"card": dataclasses.replace(DEFAULT_CARD, context_allowance=10**8)},
     "card=dataclasses.replace(gpukit.plan.DEFAULT_CARD, context_allowance=...)"),
]


@pytest.mark.parametrize("old, value, new, named", OLD, ids=[o[0] for o in OLD])
def test_each_old_keyword_warns_naming_its_new_form_and_plans_as_that_form(old, value, new, named):
    """Device: none (a CPU plan: the CPU's rules; verify=False, nothing runs for real)."""
    fields = {f.name for f in dataclasses.fields(Techniques)}
    techniques = dict(SMALL)
    if old in fields:
        techniques[old] = value
        new = {"techniques": Techniques(**techniques)}
        techniques = dict(SMALL)
        techniques.pop(old, None)
        old_kwargs = {old: value, **techniques}  # every technique by its old keyword, as before
    else:
        old_kwargs = {old: value, **SMALL}
        new = {**new, "techniques": Techniques(**SMALL)}
    with pytest.warns(DeprecationWarning) as caught:
        before = plan(*CASE, BUDGET, device="cpu", alternatives=1, verify=False, **old_kwargs)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert f"plan({old}=...) is deprecated: pass {named}" in messages
    assert caught[0].filename == __file__  # the warning points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new form warns of nothing
        after = plan(*CASE, BUDGET, device="cpu", alternatives=1, verify=False, **new)
    assert frame(before) == frame(after)


def test_the_card_figures_replace_a_named_cards_and_its_warning_names_it():
    """Device: none (a CUDA plan on a T4's rules, fake tensors). tflops= and allowance= beside card="t4" are the T4's
    figures replaced: the same plan as the replaced Card, and the warning names the T4."""
    techniques = Techniques(**SMALL)
    with pytest.warns(DeprecationWarning) as caught:
        before = plan(*CASE, BUDGET, card="t4", techniques=techniques, alternatives=1, verify=False, tflops=3.0,
                      allowance=0)
    assert [str(w.message) for w in caught] == [
        "plan(tflops=...) is deprecated: pass card=dataclasses.replace(gpukit.cards.card('t4'), fp32_tflops=...)",
        "plan(allowance=...) is deprecated: pass card=dataclasses.replace(gpukit.cards.card('t4'), "
        "context_allowance=...)"]
    t4 = dataclasses.replace(card("t4"), fp32_tflops=3.0, context_allowance=0)
    after = plan(*CASE, BUDGET, card=t4, techniques=techniques, alternatives=1, verify=False)
    assert frame(before) == frame(after) and after.allowance == 0 and "NVIDIA T4" in after.assumptions
    assert "3 TFLOP/s" in after.assumptions


def test_an_old_keyword_beside_its_new_home_and_an_unknown_keyword_are_refused():
    """Device: none (refused before anything is predicted)."""
    with pytest.raises(ValueError, match=r"plan\(precisions=\.\.\.\) is the old form of techniques=.*not beside "
                                         r"techniques="):
        plan(*CASE, BUDGET, device="cpu", techniques=Techniques(), precisions=("float32",))
    with pytest.raises(ValueError, match=r"plan\(host_memory=\.\.\.\) is the old form of host=.*not beside host="):
        plan(*CASE, BUDGET, device="cpu", host=Host(), host_memory="1GB")
    with pytest.raises(TypeError, match=r"plan\(\) got an unexpected keyword argument 'precision'"):
        plan(*CASE, BUDGET, device="cpu", precision=("float32",))


@pytest.mark.parametrize("make, message", [
    (lambda: Techniques(precisions=("fp8",)), r"Techniques\(precisions=\('fp8',\)\): choose from float32, bf16"),
    (lambda: Techniques(precisions="bf16"), r"Techniques\(precisions='bf16'\): choose from"),
    (lambda: Techniques(accumulate=[0]), r"Techniques\(accumulate=\[0\]\): micro-batch counts"),
    (lambda: Techniques(strategies=("ZeRO-3",)), r"Techniques\(strategies=.*DDP, ZeRO-1, FSDP"),
    (lambda: Techniques(lora="yes"), r"Techniques\(lora='yes'\): True .* or False"),
    (lambda: Techniques(optimizers={"sgd": "SGD"}), r"optimizers\['sgd'\] must build an optimizer"),
    (lambda: Host(memory=-5), r"Host\(memory=-5\): the host's memory.*a size must be positive"),
    (lambda: Host(memory="lots"), r"Host\(memory='lots'\): .*'12.7GB'.*or None"),
    (lambda: Host(link=0), r"Host\(link=0\): the host-to-card link's bandwidth"),
    (lambda: Host(memory_bandwidth="fast"), r"Host\(memory_bandwidth='fast'\)"),
])
def test_bad_techniques_and_hosts_are_refused_when_made(make, message):
    """Device: none."""
    with pytest.raises((ValueError, TypeError), match=message):
        make()


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(card=16), TypeError, r"card=16: a gpukit.cards.Card or its name"),
    (dict(card="a t5"), ValueError, r"no GPU card 'a t5'"),
    (dict(card="t4", device="cpu"), ValueError, r"card='t4' is a GPU: plan for it with device='cuda'"),
    (dict(card=dataclasses.replace(DEFAULT_CARD, fp32_tflops=0)), ValueError, r"fp32_tflops=0: .* positive"),
    (dict(card=dataclasses.replace(DEFAULT_CARD, context_allowance=-1)), ValueError, r"context_allowance=-1"),
    (dict(host={"memory": "1GB"}), TypeError, r"host=.*gpukit.plan.Host"),
    (dict(techniques={"precisions": ("bf16",)}), TypeError, r"techniques=.*gpukit.plan.Techniques"),
    (dict(verify="no"), TypeError, r"verify='no': True \(run the chosen recipe's step once for real\) or False"),
])
def test_a_card_host_or_techniques_of_the_wrong_kind_is_refused_before_any_work(kwargs, error, message,
                                                                                monkeypatch):
    """Device: none: the model is never built (its factory would fail the test)."""
    def never(*args):
        raise AssertionError("built before the parameters were checked")

    monkeypatch.setattr(sys.modules["gpukit.plan.search"], "model_facts", never)
    with pytest.raises(error, match=message):
        plan(*CASE, BUDGET, **kwargs)


def test_factories_that_return_no_model_or_no_optimizer_are_refused_naming_what_they_returned():
    """Device: cpu. plan() builds the model to read its facts: a factory that returns something else raised
    AttributeError: 'int' object has no attribute 'modules' from inside gpukit."""
    make_model, make_optimizer, make_batch = CASE
    with pytest.raises(TypeError, match=r"make_model\(\) must return the model, a torch\.nn\.Module; it returned int"):
        plan(lambda: 3, make_optimizer, make_batch, BUDGET, device="cpu", verify=False)
    with pytest.raises(TypeError, match=r"make_optimizer\(parameters\) must return the optimizer.*NoneType"):
        plan(make_model, lambda params: None, make_batch, BUDGET, device="cpu", verify=False)


def test_the_default_card_is_the_plan_without_a_card():
    """Device: none (CUDA's rules, fake tensors). card=None and card=DEFAULT_CARD give the same plan: 24 GB, Hopper's
    kernels, 100 TFLOP/s and 2 TB/s, a 1 GiB context allowance."""
    techniques = Techniques(**SMALL)
    none = plan(*CASE, techniques=techniques, alternatives=0, verify=False)
    default = plan(*CASE, card=DEFAULT_CARD, techniques=techniques, alternatives=0, verify=False)
    assert frame(none) == frame(default)
    assert none.budget == 24 * 10**9 and none.allowance == 2**30
    assert none.assumptions.startswith("slowdown estimated at 100 TFLOP/s, memory 1862.65 GiB/s, host copies "
                                       "14.90 GiB/s")


def test_the_search_takes_the_same_objects():
    """Device: none. PlanSearch takes the card, the host and the techniques as plan() does: their figures are
    the search's."""
    host = Host(memory="64GB", memory_bandwidth="100GB", link="8GB")
    search = PlanSearch(*CASE, 10**9, device="cuda", card="t4", host=host, techniques=Techniques(**SMALL))
    t4 = card("t4")
    assert (search.tflops, search.memory_bw, search.allowance) == (t4.fp32_tflops * 1e12, int(t4.memory_bandwidth),
                                                                   2**30)
    assert (search.host_memory, search.host_memory_bw, search.host_bw) == (64 * 10**9, 100 * 10**9, 8 * 10**9)
    assert search.slow_bf16 and search.card == t4 and search.ks == [1, 2] and search.precisions == ("float32",)
