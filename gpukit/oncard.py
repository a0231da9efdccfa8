"""A block at a card's own sizes on a machine without the card: ``on_card``, and what the block did, ``CardRun``.

``with gpukit.on_card(cuda):`` runs a block at the card's own sizes: on a GPU it runs as written; with a
``gpukit.SimulatedCuda``, on fake tensors (shapes without values, ``FakeTensorMode``), every allocation placed on the
simulated card under the CUDA rules that ``predict(card=...)`` applies (gpukit.cudarules): a T4-sized step that needs
20 GB runs out of memory with CUDA's own message, in a second, on a laptop. A value read from a tensor there
(``loss.item()``) is made up as a healthy step's and counted (``CardRun.made_up``).
"""

from __future__ import annotations

import collections
import contextlib
import warnings
from typing import Any

import torch

from .counter import FAKE_LEDGER, ONE_PREDICTION
from .simulated import CardDevice, SimulatedCuda, simulated_cuda

__all__ = ["CardRun", "on_card"]


class CardRun:
    """What a block run by ``on_card`` on the simulated card did: ``made_up`` values read from fake tensors (by kind),
    ``simulated`` (False on a GPU, where the block ran for real), and the card's name."""

    def __init__(self, card: str, simulated: bool) -> None:
        self.card, self.simulated = card, simulated
        self.made_up: dict[str, int] = {}

    def __repr__(self) -> str:
        if not self.simulated:
            return f"CardRun(ran for real on {self.card})"
        made = sum(self.made_up.values())
        return (f"CardRun(simulated {self.card} on fake tensors"
                + (f": {made} value(s) read from tensors made up as a healthy step's" if made else "") + ")")


class _CardRunContext:
    def __init__(self, cuda: SimulatedCuda, gpu: str = "cpu") -> None:
        self.cuda = cuda
        self.only = None if gpu == "cpu" else gpu  # the device type whose fake tensors are the card's (None: all)

    def __enter__(self) -> CardRun:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        from ._torch import FakeTensorMode
        from .cudarules import use_cuda_optimizer_defaults
        from .factories import ValuesWhileBuilding, swappable_fakes
        from .fakecheck import FakeKernelCheck

        cuda = self.cuda
        card_alloc = cuda.allocator  # (a card replaced or closed refuses); the real tensors' events run first

        class _Healthy(ValuesWhileBuilding):
            MADE_UP = {"bool": False, "float": 0.0, "int": 0}

        stack = self.stack = contextlib.ExitStack()
        stack.enter_context(ONE_PREDICTION)  # a prediction or block of another thread ends first; held to the end
        try:
            if FAKE_LEDGER.listener is not None:
                raise RuntimeError("on_card() cannot run inside predict(), plan() or another on_card(): each has the "
                                   "fake tensors' counter to itself")
            run = self.run = CardRun(cuda.card.name, simulated=True)
            device = self.device = CardDevice(allocator=card_alloc, lazy=False, only=self.only)
            device.raise_oom = True
            mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            mode.__deepcopy__ = lambda memo: mode  # deep copies stay in this mode (see gpukit.estimate)
            stack.enter_context(swappable_fakes(mode))
            stack.enter_context(FakeKernelCheck())
            stack.enter_context(_card_rules(cuda.card.compute_capability, device))
            if self.only == "meta":  # PyTorch's own kernels on meta are not the card's (fused, attention)
                from .offload import card_kernels

                stack.enter_context(card_kernels(cuda.card.compute_capability))
            self.values = stack.enter_context(_Healthy())
            stack.enter_context(warnings.catch_warnings())
            # Tensor.__deepcopy__ asks a fake tensor for its data pointer (see gpukit.estimate): torch's question
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor", category=UserWarning)
            handle = register_optimizer_step_pre_hook(lambda opt, *_: (use_cuda_optimizer_defaults(opt), None)[1])
            stack.callback(handle.remove)
            tally = FAKE_LEDGER.start()
            stack.callback(FAKE_LEDGER.stop, tally)
            device.attach(FAKE_LEDGER, place=False)  # after the start: fake tensors of earlier work are not placed
            cuda.follow_block(device)
            stack.callback(self._release)
        except BaseException:
            stack.close()
            raise
        return run

    def _release(self) -> None:
        """The block's end: its fake tensors still referenced (a model kept in a variable) leave the card, as a
        process's memory does when it ends; the peaks they reached stay in the statistics."""
        device = self.device
        FAKE_LEDGER.settle()  # tensors that died in the block are freed in their order first
        self.cuda.follow_block(None)
        device.detach()
        alloc = device._alloc
        for addr in list(device.addr.values())[::-1]:
            alloc.free(addr)
        device.addr.clear()
        for block in getattr(device, "workspaces", []):
            alloc.free(block)

    def __exit__(self, *exc) -> bool:
        try:
            self.stack.close()
        finally:
            self.run.made_up = dict(self.values.made_up)
        return False


_RULES_CLASS = None


def _card_rules(capability, device: CardDevice):
    """CUDA's rules for the block (``gpukit.cudarules.CudaRules`` for the card), with each cuBLAS and cuBLASLt
    workspace placed on the card when the first matrix product of its thread takes it, and kept to the block's end
    (CUDA keeps them for the process's life)."""
    global _RULES_CLASS
    if _RULES_CLASS is None:
        from .cudarules import CudaRules

        class _PlacingRules(CudaRules):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = super().__torch_dispatch__(func, types, args, kwargs)
                want = collections.Counter(n for n in self.workspace_blocks() if n)
                if want != self.placed:
                    for n, count in (want - self.placed).items():
                        for _ in range(count):
                            self.device.workspaces.append(self.device._alloc.malloc(n))
                    self.placed.update(want - self.placed)
                return out

        _RULES_CLASS = _PlacingRules
    rules = _RULES_CLASS(capability, gpu=device.only)  # the GPU's side alone where the CPU is the host
    rules.device, rules.placed = device, collections.Counter()
    device.workspaces = []
    return rules


@contextlib.contextmanager
def on_card(cuda: Any = None, gpu: Any = "cpu"):
    """Run a block at the card's own sizes: ``with on_card(cuda): train_step(...)``.

    On a GPU (``cuda`` is ``torch.cuda``) the block runs as written, for real. With a ``SimulatedCuda`` it runs on
    fake tensors (``FakeTensorMode``: shapes and dtypes, no values, no memory), every allocation placed on the
    simulated card under CUDA's rules for it (``gpukit.cudarules``: the attention kernel the card has, foreach
    optimizers, cuBLAS workspaces, dropout's fused kernel), so ``cuda.max_memory_allocated()`` afterwards reads
    what the card would, and an allocation the card cannot hold raises CUDA's out-of-memory error, marked as
    simulated. Values read from
    tensors inside (``loss.item()``, a GradScaler's check for inf) are made up as a healthy step's (0, no inf) and
    counted in the ``CardRun`` the block gets. Tensors made inside are fake: use them inside.

    A block that keeps a host beside the card (a layer or saved tensors on the CPU, the rest on the GPU) puts its
    GPU side on ``meta`` where there is no GPU, and says so: ``on_card(cuda, gpu="meta")``. Then only the fake
    tensors on ``meta`` are the card's; those on the CPU are the host's and are not placed (fake CUDA tensors cannot
    stand for the GPU on a CPU-only PyTorch: gpukit.offload).

    Args:
        cuda: ``torch.cuda`` or a ``SimulatedCuda``; by default the process's simulated card.
        gpu: the device that stands for the GPU in the block: "cpu" (every fake tensor is the card's) or "meta"
            (the CPU is the host); a ``torch.device`` too. Ignored where the block runs on a GPU.

    Raises:
        TypeError: for anything else.
        ValueError: ``gpu`` other than "cpu" or "meta" on the simulated card.
        RuntimeError: without a simulated card to run on, or inside ``predict()`` / another ``on_card()``.
    """
    if cuda is None:
        cuda = simulated_cuda()
        if cuda is None:
            raise RuntimeError("on_card() needs a card: make one first (gpukit.SimulatedCuda('t4')) or pass torch.cuda")
    if cuda is torch.cuda:
        run = CardRun(torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU", simulated=False)
        yield run
        return
    if not isinstance(cuda, SimulatedCuda):
        raise TypeError(f"on_card({cuda!r}): pass torch.cuda (a GPU runs the block for real) or a gpukit.SimulatedCuda")
    gpu = torch.device(gpu).type
    if gpu not in ("cpu", "meta"):
        raise ValueError(f"on_card(gpu={gpu!r}): on the simulated card the GPU stands on 'cpu' or 'meta' (fake CUDA "
                         "tensors abort a CPU-only PyTorch)")
    with _CardRunContext(cuda, gpu) as run:
        yield run
