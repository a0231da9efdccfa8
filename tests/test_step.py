"""The one training step: checkpointing chosen by the model's structure, and the techniques as options."""

import pytest
import torch
from torch import nn

import gpukit
from gpukit.lessons.models import MLP, ConvNet, GPTConfig, TinyGPT
from gpukit.step import BASELINE, Technique, checkpoint_plan, checkpointing, train_step


def test_the_checkpoint_plan_follows_the_structure_not_the_class():
    gpt = TinyGPT(GPTConfig(n_layer=3, n_head=2, n_embd=16))
    assert (checkpoint_plan(gpt).kind, checkpoint_plan(gpt).segments) == ("blocks", 3)  # one per block
    mlp = MLP(width=32, depth=8)
    plan = checkpoint_plan(mlp)
    assert plan.kind == "sequential" and plan.modules[0] is mlp.net
    assert plan.segments == round(len(mlp.net) ** 0.5)  # sqrt(n) segments of sqrt(n) layers
    conv = ConvNet(channels=4)
    assert checkpoint_plan(conv).modules[0] is conv.features
    assert checkpoint_plan(nn.Linear(4, 4)).kind == "whole"
    bare = nn.Sequential(*[nn.Linear(8, 8) for _ in range(9)])  # the model itself is the Sequential
    assert (checkpoint_plan(bare).modules[0], checkpoint_plan(bare).segments) == (bare, 3)


def test_checkpointing_leaves_the_model_as_it_was_even_when_the_forward_fails():
    mlp = MLP(width=16, depth=4)
    with pytest.raises(RuntimeError):
        with checkpointing(mlp):
            mlp(torch.randn(2, 5, device="cpu"))  # wrong width
    assert "forward" not in mlp.net.__dict__
    assert "forward" not in vars(mlp.net)


@pytest.mark.parametrize("technique", [BASELINE, Technique("ckpt", checkpointed=True),
                                       Technique("accumulate", accumulate=4),
                                       Technique("offload", offload=True)], ids=lambda t: t.name)
def test_every_technique_gives_the_plain_steps_gradients(digits, technique):
    """Checkpointing, accumulation and offloading change memory, not the gradients (to float32 rounding:
    accumulation adds four partial sums in another order)."""
    x, y = digits
    grads = {}
    for t in (BASELINE, technique):
        torch.manual_seed(0)
        model = MLP(width=64, depth=4)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the step keeps the gradients to compare
        train_step(model, opt, (x, y), t)
        grads[t.name] = torch.cat([p.grad.flatten() for p in model.parameters()])
    plain, other = grads["baseline"], grads[technique.name]
    tolerance = 1e-5
    assert torch.linalg.vector_norm(plain - other) <= tolerance * torch.linalg.vector_norm(plain)


def test_checkpointing_lowers_the_measured_peak_of_a_deep_model(digits):
    x, y = digits
    peaks = {}
    for t in (BASELINE, Technique("ckpt", checkpointed=True)):
        torch.manual_seed(0)
        model = MLP(width=128, depth=16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train_step(model, opt, (x, y), t)
        with gpukit.measure("cpu", record=False) as r:
            train_step(model, opt, (x, y), t)
        peaks[t.name] = r.peak
    assert peaks["ckpt"] < peaks["baseline"]


def test_float16_without_a_scaler_and_bad_options_are_refused(digits):
    with pytest.raises(ValueError, match="GradScaler"):
        model = MLP(width=8, depth=1)
        train_step(model, torch.optim.SGD(model.parameters()), digits, Technique("fp16", amp=torch.float16))
    with pytest.raises(ValueError, match="accumulate"):
        Technique("bad", accumulate=0)
    with pytest.raises(ValueError, match="amp"):
        Technique("bad", amp=torch.float64)


# -- batches of any structure (device: cpu) ----------------------------------------------------------------------

def test_split_batch_cuts_every_tensor_of_any_structure_along_the_batch_and_keeps_its_types():
    from collections import OrderedDict, namedtuple

    from gpukit.step import batch_size, first_samples, split_batch

    Pair = namedtuple("Pair", "x y")
    batch = OrderedDict(ids=torch.arange(12).view(6, 2), nested=[Pair(torch.zeros(6, 3), torch.ones(6))],
                        scale=torch.tensor(2.0), name="text")
    assert batch_size(batch) == 6
    parts = split_batch(batch, 3)
    assert len(parts) == 3 and all(type(p) is OrderedDict and type(p["nested"][0]) is Pair for p in parts)
    assert torch.equal(torch.cat([p["ids"] for p in parts]), batch["ids"])
    assert all(p["scale"] is batch["scale"] and p["name"] == "text" for p in parts)
    assert parts[1]["ids"].untyped_storage().data_ptr() == batch["ids"].untyped_storage().data_ptr()  # views
    first = first_samples(batch, 2)
    assert first["ids"].shape == (2, 2) and first["ids"].untyped_storage().nbytes() == 2 * 2 * 8  # a copy


@pytest.mark.parametrize("batch, k, says", [
    ({"a": torch.zeros(4, 2), "b": torch.zeros(5)}, 1, r"share their first dimension.*\(4, 2\), \(5,\)"),
    ({"a": torch.tensor(1.0)}, 1, "no tensor with a batch dimension"),
    ((torch.zeros(6, 2), torch.zeros(6)), 4, "4 micro-batches need a batch that divides by 4; it has 6"),
])
def test_a_batch_that_cannot_be_cut_is_refused_saying_why(batch, k, says):
    from gpukit.step import split_batch

    with pytest.raises(ValueError, match=says):
        split_batch(batch, k)


def test_a_loss_that_is_not_one_is_refused_and_nothing_is_stepped():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = {"x": torch.randn(4, 4)}
    before = model.weight.detach().clone()
    with pytest.raises(ValueError, match="loss='nope'"):
        train_step(model, opt, batch, loss="nope")
    with pytest.raises(TypeError, match=r"scalar floating-point tensor; it returned Tensor\(4, 2\)"):
        train_step(model, opt, batch, loss=lambda m, b: m(b["x"]))
    assert torch.equal(model.weight, before)
    train_step(model, opt, batch, Technique(accumulate=2), loss=lambda m, b: m(b["x"]).square().mean())
    assert not torch.equal(model.weight, before)


def test_a_batch_of_keyword_arguments_without_a_loss_is_refused_saying_what_to_pass():
    """Device: cpu. The default step (loss=None) takes (inputs, targets); a transformers-style dict, a single
    tensor or a triple is refused before anything runs, in train_step and in predict() with its default step,
    with the loss that would take it, and the model is left as it was."""
    from gpukit.estimate import predict

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    three = (torch.zeros(2, 4), torch.zeros(2), torch.zeros(2))
    words = {"input_ids": torch.zeros(2, 4), "labels": torch.zeros(2)}
    for batch, kind in [(words, "a dict with keys input_ids, labels"),
                        (torch.zeros(2, 4), "a Tensor"),
                        (three, r"a tuple of 3 item\(s\) \(Tensor, Tensor, Tensor\)")]:
        says = rf"loss=None takes a batch \(inputs, targets\) of two tensors, and this batch is {kind}: pass loss="
        with pytest.raises(TypeError, match=says):
            train_step(model, opt, batch)
        assert torch.equal(model.weight, before) and model.weight.grad is None
    says = r"plan\(\.\.\., loss='model'\), and predict\(\.\.\., step=lambda model, optimizer, batch: gpukit"
    with pytest.raises(TypeError, match=says):
        predict(lambda: torch.nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1), lambda: words)


def test_a_batch_registered_with_torchs_pytree_is_reached_too():
    """Device: cpu. A dataclass batch registered as a pytree node (as libraries register their outputs) is cut
    and mapped like a dict, as torch's own tree functions reach it."""
    import dataclasses

    from torch.utils import _pytree

    from gpukit.step import batch_size, map_tensors, split_batch

    @dataclasses.dataclass
    class Batch:
        ids: torch.Tensor
        labels: torch.Tensor

    _pytree.register_dataclass(Batch)
    try:
        batch = Batch(torch.arange(8).view(4, 2), torch.arange(4))
        assert batch_size(batch) == 4
        halves = split_batch(batch, 2)
        assert all(type(h) is Batch for h in halves) and torch.equal(halves[1].labels, torch.tensor([2, 3]))
        assert map_tensors(lambda t: t.float(), batch).ids.dtype == torch.float32
    finally:
        _pytree._deregister_pytree_node(Batch)
