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
