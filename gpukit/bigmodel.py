"""The optimizer step fused into the backward pass: each gradient is used and freed as soon as it is complete.

    from gpukit.bigmodel import OptimizerInBackward
    optimizer = OptimizerInBackward(model.parameters(), lambda p: torch.optim.AdamW(p, lr=1e-4))
    loss.backward()      # each parameter is stepped, and its gradient freed, while backward goes on
    optimizer.step()     # does nothing: the step happened in backward

PyTorch's own recipe (the tutorial "How to save memory by fusing the optimizer step into the backward pass"):
one optimizer per parameter, stepped from the parameter's ``register_post_accumulate_grad_hook``, which
runs once the gradient is fully accumulated into ``.grad``; the hook then sets ``.grad`` to None. So at most
the gradients that backward is still producing exist at once, never the whole model's: the gradient's share
of the peak (as large as the weights) goes. What it excludes: gradient accumulation (a parameter would be
stepped after each micro-batch) and anything that needs every gradient before the step (clipping by the
global norm, a GradScaler's unscale and inf check).

``OptimizerInBackward`` is a ``torch.optim.Optimizer`` so that code written for one (a training step that
calls ``zero_grad()``, ``backward()``, ``step()``; ``gpukit.step.train_step``; ``predict()``) runs it as it is:
``zero_grad`` and ``step`` do nothing, ``state`` shows the per-parameter optimizers' state, ``state_dict()`` and
``load_state_dict()`` save and restore theirs, and ``optimizers`` holds them. ``remove()`` takes the hooks off the
parameters.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch


class OptimizerInBackward(torch.optim.Optimizer):
    """One optimizer per parameter that requires a gradient, stepped in backward (see the module's docstring).

    Args:
        params: the parameters (or parameter groups) to train; those that do not require a gradient (a LoRA
            model's frozen weights) get no optimizer.
        make_optimizer: builds one optimizer over the list of one parameter it is given
            (``lambda p: torch.optim.AdamW(p, lr=1e-4)``), as ``predict()``'s ``make_optimizer`` does.

    Raises:
        TypeError: ``make_optimizer`` is an optimizer (or anything else that cannot be called).
        ValueError: no parameter requires a gradient.
    """

    def __init__(self, params: Iterable[Any], make_optimizer: Callable[[list], torch.optim.Optimizer]) -> None:
        if not callable(make_optimizer) or isinstance(make_optimizer, torch.optim.Optimizer):
            raise TypeError("make_optimizer builds one optimizer over the one parameter it is given: "
                            f"lambda p: torch.optim.AdamW(p), not {type(make_optimizer).__name__}")
        super().__init__(params, {})
        trained = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        if not trained:
            raise ValueError("OptimizerInBackward: no parameter requires a gradient, so none would be stepped")
        self.optimizers: dict[torch.Tensor, torch.optim.Optimizer] = {p: make_optimizer([p]) for p in trained}
        # The hook reaches this object through a weak reference: a parameter's hooks are held by its C++ side,
        # where the collector cannot see a cycle back to the parameter, so a strong one would keep the model, its
        # gradients and every optimizer state alive after the last reference to them is gone.
        this = weakref.ref(self)

        def step_one(param: torch.Tensor) -> None:
            owner = this()
            if owner is not None:
                optimizer = owner.optimizers[param]
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        self._handles = [p.register_post_accumulate_grad_hook(step_one) for p in trained]

    @property
    def state(self) -> dict:  # the per-parameter optimizers' state, as one optimizer's
        return {p: opt.state[p] for p, opt in self.optimizers.items() if p in opt.state}

    @state.setter
    def state(self, value) -> None:  # torch.optim.Optimizer.__init__ sets an empty one: the state is the inner ones'
        pass

    def state_dict(self) -> dict:
        """Each parameter's optimizer's ``state_dict()``, in the order of the parameters."""
        return {"optimizers": [opt.state_dict() for opt in self.optimizers.values()]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what ``state_dict()`` saved into each parameter's optimizer, in the same order.

        Raises:
            ValueError: a state dict of another kind, or of another number of parameters.
        """
        saved = state_dict.get("optimizers") if isinstance(state_dict, dict) else None
        if not isinstance(saved, list) or len(saved) != len(self.optimizers):
            raise ValueError(f"an OptimizerInBackward's state_dict() has one entry per trained parameter "
                             f"({len(self.optimizers)} here); got {type(state_dict).__name__} with "
                             f"{len(saved) if isinstance(saved, list) else 'no'} 'optimizers' entries")
        for opt, one in zip(self.optimizers.values(), saved):
            opt.load_state_dict(one)

    def step(self, closure=None):
        """Nothing to do: every parameter was stepped during backward."""
        if closure is not None:
            raise ValueError("OptimizerInBackward steps in backward: a closure (re-evaluating the loss) cannot run")
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: each gradient was freed as soon as its parameter was stepped."""

    def remove(self) -> None:
        """Take the hooks off the parameters (the parameters are then trained by nothing; so they are when this
        optimizer is gone)."""
        for handle in getattr(self, "_handles", ()):  # (none where __init__ raised)
            handle.remove()
        self._handles = []

    def __del__(self) -> None:
        self.remove()


__all__ = ["OptimizerInBackward"]
