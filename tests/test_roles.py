"""The role breakdown (a thin wrapper over PyTorch's private MemTracker): its behaviour, pinned."""

import pytest
import torch

import gpukit
from gpukit.lessons.models import MLP, parameter_bytes


def test_tiny_mlp_adam_step_gives_params_p_grads_p_adam_state_2p():
    torch.manual_seed(0)
    model = MLP(n_in=64, width=32, depth=1)
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    P = parameter_bytes(model)
    n_tensors = len(list(model.parameters()))
    with gpukit.measure("cpu", model=model, optimizer=opt) as r:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    end = r.roles_end
    assert end["parameters"] == P
    assert end["gradients"] == P
    # exp_avg and exp_avg_sq are each the size of the parameters; `step` is one float32 scalar per tensor.
    assert end["optimizer state"] == 2 * P + 4 * n_tensors
    assert "by role" in repr(r)


def test_forward_saves_activations_and_backward_frees_them():
    model = MLP(n_in=64, width=64, depth=2)
    x = torch.randn(32, 64)
    with gpukit.measure("cpu", model=model) as fwd:
        out = model(x)
    # Saved for backward: the inputs of the two ReLUs' successors (32 x 64 floats each) and more.
    assert fwd.roles_end["activations"] >= 2 * 32 * 64 * 4
    with gpukit.measure("cpu", model=model) as bwd:
        out.sum().backward()
        del out
    # Gradients are recognised even though the forward ran in an earlier block.
    assert bwd.roles_end["gradients"] == parameter_bytes(model)
    assert bwd.roles_end.get("activations", 0) < 0.01 * fwd.roles_end["activations"]


def test_roles_survive_gradient_accumulation_running_the_model_several_times():
    model = MLP(width=32, depth=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gpukit.measure("cpu", model=model, optimizer=opt) as r:
        for _ in range(4):
            model(torch.randn(8, 64)).sum().backward()
        opt.step()
    assert r.roles_end["gradients"] == parameter_bytes(model)


def test_roles_need_a_model_or_optimizer():
    from gpukit.roles import RoleTracker

    with pytest.raises(ValueError, match="model"):
        RoleTracker(torch.device("cpu"))


def test_a_failing_block_with_roles_restores_state():
    model = MLP(width=8, depth=1)
    with pytest.raises(RuntimeError):
        with gpukit.measure("cpu", model=model):
            model(torch.randn(2, 3))  # wrong shape
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None
    with gpukit.measure("cpu", model=model) as r:  # and the next block works
        model(torch.randn(2, 64))
    assert r.roles_end["parameters"] == parameter_bytes(model)


def _step_weakrefs(measure_block):
    """Run one Adam step of a fresh MLP inside ``measure_block(model, opt)``; weak references to what it made."""
    import weakref

    model = MLP(n_in=64, width=32, depth=3)
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    with measure_block(model, opt):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [weakref.ref(p) for p in model.parameters()] + [weakref.ref(p.grad) for p in model.parameters()]


def test_a_measured_step_with_roles_lets_go_of_the_model_once_the_user_does():
    import gc

    refs = _step_weakrefs(lambda model, opt: gpukit.measure("cpu", model=model, optimizer=opt))
    gc.collect()
    assert [r() for r in refs if r() is not None] == []


def test_pytorchs_own_mod_tracker_keeps_the_hidden_layers_alive_which_is_why_gpukit_removes_its_hooks():
    # The cause, pinned: ModTracker's multi-grad hooks on module inputs close over the inputs' grad_fns and
    # are stored on them (torch/autograd/graph.py), a cycle the garbage collector cannot see. When this
    # fails on a newer torch, ModTrackerThatLetsGo (gpukit/_torch.py) is no longer needed there.
    import gc

    from gpukit._torch import MemTracker

    def plain(model, opt):
        tracker = MemTracker()
        tracker.track_external(model, opt)
        return tracker

    refs = _step_weakrefs(plain)
    gc.collect()
    kept = [r for r in refs if r() is not None]
    assert kept, "torch's ModTracker no longer keeps a step's tensors: the workaround can go"
    # The hidden layers' parameters and gradients (reachable from a later layer's input), not the last layer's.
    assert 0 < len(kept) < len(refs)
