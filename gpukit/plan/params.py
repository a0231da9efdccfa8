"""What ``plan()`` is told besides the model, the optimizer and the batch, as data: the card
(``gpukit.cards.Card``, or ``DEFAULT_CARD`` where none is named), the host (``Host``) and the techniques to try
(``Techniques``); and the keywords ``plan()`` took before them, each turned into its new home with a
DeprecationWarning that names it.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping

from ..cards import CARDS, Card, card as find_card
from ..estimate import CONTEXT_ALLOWANCE
from ..report import parse_bytes
from .candidates import PRECISIONS, STRATEGIES

# The GPU plan() assumes where no card is named: Hopper's kernels (compute capability 9.0, the CUDA rules gpukit
# applies without a card), 24 GB, and the round figures the time cost is estimated with, 100 TFLOP/s (float32) and
# 2 TB/s. No data sheet's: its sources are empty. For a card gpukit.cards does not list, replace a listed one's
# figures (``dataclasses.replace(gpukit.cards.card("a100-40gb"), memory_bytes=..., ...)``) or this one's.
DEFAULT_CARD = Card(
    key="default", name="a GPU", memory_text="24 GB", memory_bytes=24 * 10**9, bandwidth_text="2 TB/s",
    memory_bandwidth=2e12, compute_capability=(9, 0), fp16_tflops=100.0, fp16_sparse_tflops=None,
    bf16_tflops=100.0, bf16_sparse_tflops=None, fp32_tflops=100.0, torch_total_memory=None, sources={})


def _size(owner: str, name: str, value, what: str, *, none: str | None = None, zero: bool = False) -> int | None:
    """``value`` in bytes (``"16GB"``, ``"64 GiB"``, a number), or a ValueError that says what ``name`` is."""
    if value is None and none is not None:
        return None
    if zero and value == 0 and not isinstance(value, bool):
        return 0
    try:
        return parse_bytes(value)
    except ValueError as err:
        allowed = (f"{'0 or ' if zero else ''}bytes or a size such as '12.7GB' or '64 GiB' (B, KB, MB, GB, KiB, "
                   "MiB, GiB)")
        raise ValueError(f"{owner}({name}={value!r}): {what}: {allowed}{f', or None ({none})' if none else ''}; "
                         f"{err}") from None


@dataclass(frozen=True)
class Host:
    """The machine the GPU sits in, as ``plan()`` counts it.

    Args:
        memory: its memory for what a recipe keeps there (an optimizer's state: torchao's ``CPUOffloadOptimizer``),
            bytes, ``"12.7GB"`` or ``"64 GiB"``; a recipe whose predicted host peak is above it does not fit, and
            its verdict says so. None: not limited, but a recipe whose host peak is above Colab's 12.7 GB ranks
            after every fitting one that is not, and its "ranking" cell says so.
        memory_bandwidth: its memory's bandwidth, per second, for an optimizer step on the host; default 51.2 GB/s,
            two channels of DDR4-3200 (3,200 MT/s x 8 bytes = 25.6 GB/s a channel, JEDEC JESD79-4): a desktop's or
            a cloud VM's share; a server socket has 4 to 12 channels.
        link: the link between the host and the card, per second, for what is copied over it (saved tensors
            sent to the host, an offloaded optimizer's weights and gradients); default 16 GB/s, PCIe 4.0 x16's
            order.

    Each is kept in bytes (``Host(memory="64 GiB").memory == 68719476736``); anything that is not a positive size
    raises ValueError when the Host is made, before any prediction.
    """

    memory: int | str | None = None
    memory_bandwidth: int | str = "51.2GB"
    link: int | str = "16GB"

    def __post_init__(self):
        object.__setattr__(self, "memory", _size("Host", "memory", self.memory, "the host's memory for optimizer "
                                                 "state kept there", none="not limited"))
        object.__setattr__(self, "memory_bandwidth", _size("Host", "memory_bandwidth", self.memory_bandwidth,
                                                           "the host's memory bandwidth, per second"))
        object.__setattr__(self, "link", _size("Host", "link", self.link, "the host-to-card link's bandwidth, per "
                                               "second"))


def _flag(name: str, value, what: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"Techniques({name}={value!r}): True ({what}) or False")


@dataclass(frozen=True)
class Techniques:
    """The techniques ``plan()`` tries, as one set; each left at its default tries all it can.

    Args:
        optimizers: other optimizers you allow, ``{"SGD momentum": lambda p: torch.optim.SGD(p, 0.1, 0.9)}``.
        implementations: also try the optimizer's for-loop and fused steps (``foreach=False``, ``fused=True``),
            an Adam or AdamW with 8-bit moments (bitsandbytes' ``Adam8bit``, ``AdamW8bit``, where installed),
            the optimizer step fused into backward (``gpukit.bigmodel.OptimizerInBackward``: no accumulation, no
            GradScaler, one GPU), and for a CUDA plan on one GPU an Adam or AdamW with its state and step on the
            host (torchao's ``CPUOffloadOptimizer``, where installed; with ``offload_gradients=True`` too, then
            without accumulation; in float32 or bfloat16 weights, no autocast: the simulated GPU has no autocast
            kernels of its own). Its step is fused Adam(W) on the CPU: rounding-level, as ``fused=True``.
        precisions: of ``"float32"``, ``"bf16"``, ``"fp16"`` (autocast; float16 with a GradScaler), ``"half"``
            (``model.half()`` with BatchNorm in float32; only with optimizers without an eps, such as SGD: Adam's
            eps of 1e-8 is 0 in float16) and ``"bf16 weights"`` (``model.to(torch.bfloat16)``: weights, gradients
            and optimizer state in bfloat16, no float32 copy). The last two lose every update below 2^-11 (float16)
            or 2^-8 (bfloat16) of its weight: their numerics say "small updates lost", and they rank after every
            fitting recipe that keeps a float32 copy.
        accumulate: micro-batch counts to try (default: the powers of two that divide the batch per GPU).
        checkpointing, offload: try activation checkpointing (``gpukit.step.checkpoint_plan``), and saved tensors
            sent to the host (CUDA plans only: on a CPU the host is the device).
        strategies: with ``gpus > 1``, of ``"DDP"``, ``"ZeRO-1"``, ``"FSDP"`` (default all three).
        lora: also try training LoRA adapters instead of the model (peft, where installed: rank 16 on every
            ``nn.Linear`` but the output layer, the weights frozen), and for a transformers model where bitsandbytes
            is installed QLoRA (those weights quantized to 4-bit NF4 as ``from_pretrained`` with
            ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16)`` does, ``prepare_model_for_kbit_training``, then the adapters).
            A different model is trained: such a recipe ranks after every one that trains the model itself, on one
            GPU only.

    Sequences are kept as tuples and ``optimizers`` read-only; a value that is none of the above raises ValueError
    (TypeError for an optimizer that is not a function) when the Techniques is made, before any prediction.
    """

    optimizers: Mapping[str, Callable] | None = None
    implementations: bool = True
    precisions: tuple[str, ...] = PRECISIONS
    accumulate: tuple[int, ...] | None = None
    checkpointing: bool = True
    offload: bool = True
    strategies: tuple[str, ...] | None = None
    lora: bool = True

    def __post_init__(self):
        if self.optimizers is not None:
            if not isinstance(self.optimizers, Mapping):
                raise ValueError(f"Techniques(optimizers={self.optimizers!r}): a dict of name -> a function that "
                                 "builds an optimizer from parameters, {'SGD': lambda p: torch.optim.SGD(p, lr=0.1)}")
            for name, make in self.optimizers.items():
                if not callable(make):
                    raise TypeError(f"optimizers[{name!r}] must build an optimizer from parameters "
                                    f"(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)), not {make!r}")
            object.__setattr__(self, "optimizers", MappingProxyType(dict(self.optimizers)))
        precisions = self.precisions
        if isinstance(precisions, str) or not _sequence(precisions) or not precisions \
                or any(p not in PRECISIONS for p in precisions):
            raise ValueError(f"Techniques(precisions={precisions!r}): choose from {', '.join(PRECISIONS)}")
        object.__setattr__(self, "precisions", tuple(precisions))
        if self.accumulate is not None:
            ks = self.accumulate
            if isinstance(ks, str) or not _sequence(ks) or not ks \
                    or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in ks):
                raise ValueError(f"Techniques(accumulate={ks!r}): micro-batch counts, whole numbers 1 or more "
                                 "([1, 2, 4]), or None (the powers of two that divide the batch per GPU)")
            object.__setattr__(self, "accumulate", tuple(ks))
        if self.strategies is not None:
            s = self.strategies
            if isinstance(s, str) or not _sequence(s) or not s or any(x not in STRATEGIES for x in s):
                raise ValueError(f"Techniques(strategies={s!r}): choose from {', '.join(STRATEGIES[1:])} (several "
                                 "GPUs), or None (all three)")
            object.__setattr__(self, "strategies", tuple(s))
        _flag("implementations", self.implementations, "also try other implementations of the optimizer")
        _flag("checkpointing", self.checkpointing, "also try activation checkpointing")
        _flag("offload", self.offload, "also try saved tensors sent to the host")
        _flag("lora", self.lora, "also try LoRA adapters, where peft is installed")


def _sequence(value) -> bool:
    return isinstance(value, (tuple, list))


def resolve_card(card, device: str) -> Card:
    """``plan(card=...)`` as a Card: a Card as it is, a name as ``gpukit.cards.card`` reads it, None as
    ``DEFAULT_CARD``. A card ``gpukit.cards`` lists (or one replaced from it) is a GPU: only a CUDA plan takes it;
    ``DEFAULT_CARD`` (or one replaced from it) gives a CPU plan its time figures too."""
    if card is None:
        return DEFAULT_CARD
    if isinstance(card, str):
        resolved = find_card(card)
    elif isinstance(card, Card):
        resolved = card
    else:
        raise TypeError(f"card={card!r}: a gpukit.cards.Card or its name ('t4', 'A100 80GB', "
                        "torch.cuda.get_device_name()), or None (gpukit.plan.DEFAULT_CARD)")
    if device != "cuda" and resolved.key != DEFAULT_CARD.key:
        raise ValueError(f"card={card!r} is a GPU: plan for it with device='cuda'")
    if not (isinstance(resolved.fp32_tflops, (int, float)) and resolved.fp32_tflops > 0):
        raise ValueError(f"card {resolved.key!r}: fp32_tflops={resolved.fp32_tflops!r}: the GPU's arithmetic rate in "
                         "TFLOP/s, a positive number")
    if not resolved.memory_bandwidth > 0:
        raise ValueError(f"card {resolved.key!r}: memory_bandwidth={resolved.memory_bandwidth!r}: bytes per second, "
                         "a positive number")
    allowance = resolved.context_allowance
    if allowance is not None and (not isinstance(allowance, int) or isinstance(allowance, bool) or allowance < 0):
        raise ValueError(f"card {resolved.key!r}: context_allowance={allowance!r}: bytes, 0 or more, or None "
                         f"(gpukit's {CONTEXT_ALLOWANCE:,})")
    return resolved


def named(card: Card) -> bool:
    """Whether ``card`` is a card ``gpukit.cards`` lists (its figures perhaps replaced), not ``DEFAULT_CARD``."""
    return card.key in CARDS


# -- the keywords plan() took before --------------------------------------------------------------------------

TECHNIQUE_KEYWORDS = ("optimizers", "implementations", "precisions", "accumulate", "checkpointing", "offload",
                      "strategies", "lora")
HOST_KEYWORDS = {"host_memory": "memory", "host_memory_bandwidth": "memory_bandwidth", "host_bandwidth": "link"}
CARD_KEYWORDS = {"tflops": "fp32_tflops", "memory_bandwidth": "memory_bandwidth", "allowance": "context_allowance"}


def from_deprecated(old: dict[str, Any], card, host: Host | None, techniques: Techniques | None, device: str,
                    stacklevel: int = 3):
    """``(card, host, techniques)`` with the keywords ``plan()`` took before moved into them, each with a
    DeprecationWarning naming its new form. A keyword ``plan()`` never took raises TypeError as Python would; one
    given with its new home (``precisions=`` with ``techniques=``) raises ValueError."""
    unknown = [k for k in old if k not in TECHNIQUE_KEYWORDS and k not in HOST_KEYWORDS and k not in CARD_KEYWORDS]
    if unknown:
        raise TypeError(f"plan() got an unexpected keyword argument {unknown[0]!r}")
    if not old:
        return card, host, techniques
    moved: dict[str, dict[str, Any]] = {"techniques": {}, "host": {}, "card": {}}
    for key, value in old.items():
        if key in TECHNIQUE_KEYWORDS:
            new = f"techniques=gpukit.plan.Techniques({key}=...)"
            clash = techniques is not None and "techniques"
            moved["techniques"][key] = value
        elif key in HOST_KEYWORDS:
            new = f"host=gpukit.plan.Host({HOST_KEYWORDS[key]}=...)"
            clash = host is not None and "host"
            moved["host"][HOST_KEYWORDS[key]] = value
        else:
            base = ("gpukit.plan.DEFAULT_CARD" if card is None else f"gpukit.cards.card({card!r})"
                    if isinstance(card, str) else f"gpukit.cards.card({card.key!r})" if CARDS.get(card.key) == card
                    else "card")
            new = f"card=dataclasses.replace({base}, {CARD_KEYWORDS[key]}=...)"
            clash = False  # (the card's figure replaced, as before)
            moved["card"][CARD_KEYWORDS[key]] = value
        if clash:
            raise ValueError(f"plan({key}=...) is the old form of {new}: pass it there, not beside {clash}=")
        warnings.warn(f"plan({key}=...) is deprecated: pass {new}", DeprecationWarning, stacklevel=stacklevel)
    if moved["techniques"]:
        techniques = Techniques(**moved["techniques"])
    if moved["host"]:
        host = Host(**moved["host"])
    if moved["card"]:
        figures = moved["card"]
        if "memory_bandwidth" in figures:
            figures["memory_bandwidth"] = _size("plan", "memory_bandwidth", figures["memory_bandwidth"],
                                                "the GPU's memory bandwidth, per second")
        if figures.get("context_allowance") is not None:
            figures["context_allowance"] = _size("plan", "allowance", figures["context_allowance"],
                                                 "memory beyond PyTorch's (CUDA context, libraries)", zero=True)
        if "fp32_tflops" in figures and not (isinstance(figures["fp32_tflops"], (int, float))
                                             and not isinstance(figures["fp32_tflops"], bool)
                                             and figures["fp32_tflops"] > 0):
            raise ValueError(f"tflops={figures['fp32_tflops']!r}: the GPU's arithmetic rate in TFLOP/s, a positive "
                             "number")
        card = dataclasses.replace(resolve_card(card, device), **figures)
    return card, host, techniques
