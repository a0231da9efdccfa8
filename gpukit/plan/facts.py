"""What the search needs to know about the model (its layers, batch and optimizer) before predicting anything."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .._torch import FakeTensorMode, _disable_current_modes, active_fake_mode
from ..bigmodel import OptimizerInBackward
from ..counter import round_up
from ..cudadevice import CudaDevices
from ..estimate import storage_bytes
from ..factories import (TensorsFromFakeLists, ValuesWhileBuilding, check_model, check_optimizer, fake_copy,
                         preload_quietly, quiet_import, real_tensors, swappable_fakes)
from ..step import batch_size, batch_tensors, checkpoint_plan, is_pair_batch, model_loss, own_checkpointing_methods

# -- what the search needs to know about the model -------------------------------------------------------------


@dataclass
class ModelFacts:
    """What the search knows of the model before predicting anything (``model_facts``)."""

    parameters: int
    batch_size: int
    batch_bytes_per_sample: list[tuple[int, int]]  # per batch tensor: (elements per sample, element size)
    forward_flops: int
    recompute_flops: int
    has_batchnorm: bool
    checkpoint_text: str
    checkpoint_code: str
    largest_block_bytes: int  # float32 parameter bytes of the largest checkpoint block (FSDP's unit)
    existing_model: bool = False  # make_model() returns a model that already exists (real tensors under fake mode)
    batch_mapping: bool = False  # the batch is a mapping of tensors (a dict, a BatchEncoding): keyword arguments
    lora_targets: tuple[str, ...] = ()  # the modules LoRA would adapt (steps.lora_targets); none: no LoRA candidate
    head_flops: int = 0  # a causal LM's output layer, one forward over the batch; 0: no chunked loss candidate
    tokens: int = 0  # the batch's tokens (its labels), where head_flops is not 0
    # Per parameter (numel, element size, floating point, trained), per buffer (numel, element size, floating
    # point), and the rounded bytes of their distinct storages as built: what a host-offload optimizer's bounds
    # read (gpukit.plan.host), without building the model again.
    parameter_shapes: tuple = ()
    buffer_shapes: tuple = ()
    model_bytes: int = 0
    # QLoRA: the elements of each Linear weight bitsandbytes quantizes (``quantized_shapes``; none: no QLoRA
    # candidate) and their element size; the model's class, as the recipe loads it ("transformers.LlamaForCausalLM")
    qlora_shapes: tuple[int, ...] = ()
    qlora_element_size: int = 4
    model_class: str = ""
    qlora_odd_inputs: bool = False  # a quantized layer with an odd number of inputs (dequantized otherwise on a CPU)

    def batch_bytes(self, n: int) -> int:
        return sum(round_up(per * n * size) for per, size in self.batch_bytes_per_sample)


LORA_RANK = 16  # the adapters' rank: peft's examples use 8 to 64; the memory it adds is small at any of them
# QLoRA's base weights, as its paper and transformers' documentation load them: BitsAndBytesConfig(**QUANTIZATION).
# No double quantization (bnb_4bit_use_double_quant, False by default): the absmax stays float32.
QUANTIZATION = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": torch.bfloat16}
QLORA_PRECISIONS = ("float32", "bf16", "fp16")  # (prepare_model_for_kbit_training makes 16-bit weights float32)
NF4_BLOCKSIZE = 64  # bitsandbytes' Params4bit default, which transformers' Linear4bit layers keep: 64 weights an absmax


def lora_targets(model: nn.Module) -> list[str]:
    """The modules LoRA adapts, as ``peft.LoraConfig(target_modules=...)`` takes them (a name matches every
    module whose name ends with it): each ``nn.Linear`` but the output layer (``get_output_embeddings()`` for a
    transformers model, else the last ``nn.Linear``), which stays trained whole in no LoRA recipe. By the last part
    of their names (``q_proj``) where that names no other module, else by their full names (``mlp.0``)."""
    modules = list(model.named_modules())
    linears = [(name, m) for name, m in modules if isinstance(m, nn.Linear)]
    if not linears:
        return []
    output = getattr(model, "get_output_embeddings", lambda: None)() or linears[-1][1]
    targets = set()
    for name, m in linears:
        if m is output:
            continue
        last = name.rsplit(".", 1)[-1]
        alike = [other for n, other in modules if n.rsplit(".", 1)[-1] == last]
        only_these = all(isinstance(o, nn.Linear) and o is not output for o in alike)
        targets.add(last if only_these else name)
    return sorted(targets)


def _qualified_names(model: nn.Module) -> dict[nn.Module, str]:
    return {m: n for n, m in model.named_modules()}


def model_facts(make_model, make_batch, loss=None) -> ModelFacts:
    """Shapes, parameters and forward FLOPs, under fake tensors (nothing allocated). ``loss``: as for
    ``gpukit.step.train_step`` (resolved: None or a function)."""
    from torch.utils.flop_counter import FlopCounterMode

    preload_quietly()
    # (shapes alone: the CUDA devices the user's code names are the fake CPU tensors, whatever the plan is for)
    with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode, CudaDevices("cpu"), TensorsFromFakeLists():
        # initialisers that read values (a ViT's trunc_normal_); model.to(...) of a fake model (gpukit.factories)
        with ValuesWhileBuilding(), swappable_fakes(fake_mode):
            model = make_model()
        check_model(model)
        existing = bool(real_tensors(model))
        if existing:  # the user's own model (lambda: model): read through a fake copy, never run itself
            model = fake_copy(model, fake_mode)
        batch = make_batch()
        if loss is None:
            if not is_pair_batch(batch):
                raise ValueError("make_batch() must return (inputs, targets), two tensors whose first dimension is "
                                 "the batch, as gpukit.step.train_step takes them; for another batch (a dict, a "
                                 "BatchEncoding...) say how the loss is computed: loss='model' (model(**batch).loss) "
                                 "or loss=lambda model, batch: ...")
            x, y = batch
            if x.dim() == 0 or y.dim() == 0 or x.shape[0] != y.shape[0]:
                raise ValueError(f"inputs {tuple(x.shape)} and targets {tuple(y.shape)} need the same first "
                                 "dimension: the batch")
        b = batch_size(batch)
        per_sample = [(t.numel() // b if t.dim() else 0, t.element_size()) for t in batch_tensors(batch)]
        cp = checkpoint_plan(model)
        names = _qualified_names(model)
        counted: list[int] = []
        counter = FlopCounterMode(display=False)
        if cp.kind == "blocks":
            watched = list(cp.modules)
        elif cp.kind == "sequential":
            seq = cp.modules[0]
            size = len(seq) // cp.segments
            watched = list(seq)[: size * (cp.segments - 1)]  # checkpoint_sequential runs the last segment plainly
        else:
            watched = []
        handles = []
        for m in watched:
            handles.append(m.register_forward_pre_hook(lambda *_: counted.append(-counter.get_total_flops())))
            handles.append(m.register_forward_hook(lambda *_: counted.append(counter.get_total_flops())))
        try:
            with torch.no_grad(), counter:
                model(x) if loss is None else loss(model, batch)
        finally:
            for h in handles:
                h.remove()
        total = counter.get_total_flops()
        recompute = total if cp.kind == "whole" else sum(counted)
        n_params = sum(p.numel() for p in model.parameters())
        parameter_shapes = tuple((p.numel(), p.element_size(), p.is_floating_point(), p.requires_grad)
                                 for p in model.parameters())
        buffer_shapes = tuple((t.numel(), t.element_size(), t.is_floating_point()) for t in model.buffers())
        model_bytes = storage_bytes([*model.parameters(), *model.buffers()])
        has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        largest = max((sum(p.numel() * 4 for p in m.parameters()) for m in cp.modules), default=0) \
            if cp.kind == "blocks" else n_params * 4
        if cp.kind == "blocks":
            parent = names[cp.modules[0]].rsplit(".", 1)[0] if "." in names[cp.modules[0]] else ""
            where = f"model.{parent}" if parent else "model"
            code = (f"for block in {where}:  # {cp}\n"
                    "    block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)")
        elif cp.kind == "sequential":
            where = f"model.{names[cp.modules[0]]}" if names[cp.modules[0]] else "model"
            code = (f"{where}.forward = functools.partial(  # {cp}\n"
                    f"    checkpoint_sequential, {where}, {cp.segments}, use_reentrant=False)")
        else:
            code = ""
        own = own_checkpointing_methods(model) if cp.kind == "blocks" else None
        if own is not None:
            # A transformers model checkpoints the same blocks, each decoder or encoder layer, its own way (the
            # step uses it too, gpukit.step.checkpointing): the recipe says it as its users write it.
            code = f'model.{own[0]}({own[2]}={{"use_reentrant": False}})  # {cp}'
        targets = tuple(lora_targets(model)) if importlib.util.find_spec("peft") is not None else ()
        quantized = quantized_shapes(model) if targets else []
    mapping = isinstance(batch, Mapping) and all(torch.is_tensor(v) for v in batch.values())
    return ModelFacts(n_params, b, per_sample, int(total), int(recompute), has_bn, str(cp), code, largest, existing,
                       mapping, targets, *(_head_flops(model, batch) if loss is model_loss else (0, 0)),
                       parameter_shapes, buffer_shapes, model_bytes, tuple(n for n, _, _ in quantized),
                       max((size for _, size, _ in quantized), default=4),
                       f"transformers.{type(model).__name__}" if quantized else "",
                       any(inputs % 2 for _, _, inputs in quantized))


def quantized_shapes(model: nn.Module) -> list[tuple[int, int, int]]:
    """QLoRA's layers: ``(elements, element size, inputs)`` of each ``nn.Linear`` weight that ``from_pretrained`` with a 4-bit
    ``BitsAndBytesConfig`` quantizes (transformers' ``replace_with_bnb_linear``: every ``nn.Linear`` but the modules
    ``get_keys_to_not_convert`` names, the output layer and the last module). Empty where QLoRA is not offered: a
    model that is not a transformers ``PreTrainedModel`` (its recipe loads the model with ``from_pretrained``), or
    where bitsandbytes or peft is not installed."""
    if importlib.util.find_spec("bitsandbytes") is None or importlib.util.find_spec("peft") is None \
            or importlib.util.find_spec("transformers") is None:
        return []
    with _disable_current_modes():
        from transformers import PreTrainedModel
        from transformers.quantizers.base import get_keys_to_not_convert
        from transformers.quantizers.quantizers_utils import should_convert_module
    if not isinstance(model, PreTrainedModel):
        return []
    keep = get_keys_to_not_convert(model)
    return [(m.weight.numel(), m.weight.element_size(), m.in_features) for name, m in model.named_modules()
            if type(m) is nn.Linear and should_convert_module(name, keep)]


def quantization_state_bytes(shapes) -> int:
    """The bytes (each tensor rounded as the CUDA allocator rounds it) of the quantization state bitsandbytes keeps
    beside the packed NF4 weights of layers with ``shapes`` elements (``QUANTIZATION``: no double quantization), as
    ``bitsandbytes.functional.quantize_4bit`` makes it (bitsandbytes 0.50): one float32 absmax per
    ``NF4_BLOCKSIZE`` weights (its ``quantize_4bit`` op: ``-(n // -blocksize)`` blocks) and the 16-value float32
    NF4 code (``get_4bit_type``, a new tensor per layer). Neither is a parameter or a buffer: a count of the model's
    parameters and buffers leaves them out."""
    return sum(round_up(4 * -(n // -NF4_BLOCKSIZE)) + round_up(4 * 16) for n in shapes)


def quantization_state_of(model: nn.Module) -> int:
    """The bytes of the quantization state of a model's ``bitsandbytes.nn.Linear4bit`` layers as they hold it (its
    tensors' distinct storages, rounded as the CUDA allocator rounds them): what ``quantization_state_bytes``
    computes from the layers' shapes, read from a real model."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return 0
    bnb = import_bitsandbytes()
    tensors = []
    for m in model.modules():
        state = getattr(getattr(m, "weight", None), "quant_state", None) if isinstance(m, bnb.nn.Linear4bit) else None
        while state is not None:
            tensors += [t for t in (state.absmax, state.code, state.offset) if torch.is_tensor(t)]
            state = state.state2
    return storage_bytes(tensors)


def _head_flops(model: nn.Module, batch) -> tuple[int, int]:
    """FLOPs of a causal LM's output layer over the batch's tokens, and those tokens, where
    ``gpukit.losses.chunked_causal_lm_loss`` can compute its loss (an output embedding, a body giving hidden states,
    labels in the batch), else ``(0, 0)``."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    body = getattr(model, "base_model", None)
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(head, nn.Linear) or not isinstance(body, nn.Module) or body is model \
            or not torch.is_tensor(labels):
        return 0, 0
    return 2 * labels.numel() * head.weight.numel(), labels.numel()


# -- optimizers --------------------------------------------------------------------------------------------------


def other_implementations(label: str, make_optimizer, device: str) -> list[tuple[str, Callable, str, str]]:
    """The other implementations of an optimizer's step (for-loop, fused) that its class offers and the device
    does not already use: ``(label, make_optimizer, note, state)``; ``state``: how its state compares with the
    optimizer's own step's: "same" for the for-loop step (both make it in ``_init_group``: torch/optim/adam.py),
    "more" for the fused one (the same tensors, its ``step`` counters on the device: ``_init_group``'s
    ``fused`` branch)."""
    probe = probe_optimizer(make_optimizer)
    cls = type(probe)
    accepted = inspect.signature(cls.__init__).parameters
    group = probe.param_groups[0]
    if group.get("fused") or group.get("differentiable"):
        return []
    found = []
    default_foreach = device == "cuda" and group.get("foreach") is None  # CUDA's default: foreach
    if "foreach" in accepted and (default_foreach or group.get("foreach")):
        found.append((f"{label}, foreach=False", {"foreach": False}, "for-loop step: same update"))
    if "fused" in accepted:
        found.append((f"{label}, fused=True", {"fused": True, "foreach": False}, "fused step: same update"))

    def variant(changes):
        def make(params):
            opt = make_optimizer(params)
            groups = [dict(g) for g in opt.param_groups]
            for g in groups:
                g.update(changes)
            kwargs = {k: v for k, v in opt.defaults.items() if k in accepted and k != "params"}
            kwargs.update(changes)
            return type(opt)(groups, **kwargs)

        return make

    return [(name, variant(changes), note, "same" if changes == {"foreach": False} else "more")
            for name, changes, note in found]


def probe_optimizer(make_optimizer) -> torch.optim.Optimizer:
    """The optimizer ``make_optimizer`` builds, over one fake parameter (values it reads when built, as
    bitsandbytes' quantisation maps, made up: ``ValuesWhileBuilding``); for the step in backward, the optimizer
    of one parameter. Raises as ``check_optimizer`` for one that already exists."""
    with FakeTensorMode(), ValuesWhileBuilding():
        opt = make_optimizer([nn.Parameter(torch.zeros(2))])
        check_optimizer(opt)
    return next(iter(opt.optimizers.values())) if isinstance(opt, OptimizerInBackward) else opt


def eight_bit_optimizer(make_optimizer) -> tuple[str, Callable, str] | None:
    """bitsandbytes' 8-bit version of a torch.optim Adam or AdamW (its moments stored block-wise in 8 bits), with
    the same hyperparameters: ``(label, make_optimizer, note)``; None where bitsandbytes is not installed, or the
    optimizer is another or uses an option the 8-bit one lacks (amsgrad, maximize, a tensor lr)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return None
    probe = probe_optimizer(make_optimizer)
    if type(probe) not in (torch.optim.Adam, torch.optim.AdamW):
        return None
    d = probe.defaults
    if d.get("amsgrad") or d.get("maximize") or isinstance(d.get("lr"), torch.Tensor) or \
            any(len(g["params"]) and g.get("lr") != d.get("lr") for g in probe.param_groups[1:]):
        return None
    name = f"{type(probe).__name__}8bit"
    kwargs = {"lr": d["lr"], "betas": tuple(d["betas"]), "eps": d["eps"], "weight_decay": d["weight_decay"]}

    def make(params):
        optim = _bnb_optim()
        with _maps_once():
            return getattr(optim, name)(params, **kwargs)

    make.recipe = ("import bitsandbytes as bnb", f"bnb.optim.{name}(model.parameters(), "
                   + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")")
    return f"{name} (bitsandbytes)", make, "8-bit moments, block-wise (bitsandbytes)"


def import_bitsandbytes():
    """``bitsandbytes`` with its optimizers, imported quietly (``quiet_import``: its CPU backend warns where an
    optional kernel package is missing, a faster CPU kernel of 4-bit products for inference, which no plan runs:
    training dequantizes)."""
    with quiet_import():
        import bitsandbytes
        import bitsandbytes.optim  # noqa: F401
    return bitsandbytes


def _bnb_optim():
    """``bitsandbytes.optim``, imported as ``import_bitsandbytes`` imports it."""
    return import_bitsandbytes().optim


_MAPS: dict[tuple, list[float]] = {}  # bitsandbytes' quantisation maps, by their arguments, as computed for real


@contextlib.contextmanager
def _maps_once():
    """While an 8-bit optimizer is built under fake tensors: bitsandbytes' quantisation maps
    (``create_dynamic_map``, two per optimizer) are computed once, for real, and each optimizer gets its own
    tensor of those values, made as bitsandbytes makes it (``torch.tensor`` of the list). Under fake tensors each
    map otherwise reads its 256 values one at a time (``.tolist()``): a tenth of a second per optimizer, and an
    optimizer stepped in backward builds one per parameter. Outside a fake mode nothing changes."""
    import bitsandbytes.functional as F

    original = F.create_dynamic_map

    def create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8):
        if active_fake_mode() is None:
            return original(signed, max_exponent_bits, total_bits)
        key = (signed, max_exponent_bits, total_bits)
        if key not in _MAPS:
            with _disable_current_modes():
                _MAPS[key] = original(signed, max_exponent_bits, total_bits).tolist()
        return torch.tensor(_MAPS[key], dtype=torch.float32)

    F.create_dynamic_map = create_dynamic_map
    try:
        yield
    finally:
        F.create_dynamic_map = original


def stepped_in_backward(make_optimizer) -> Callable:
    """The optimizer's step fused into backward (``gpukit.bigmodel.OptimizerInBackward``): one per parameter."""
    def make(params):
        return OptimizerInBackward(params, make_optimizer)

    return make


def optimizer_name(make_optimizer) -> str:
    """The optimizer's class name, as the table names it (SGD with its momentum)."""
    opt = probe_optimizer(make_optimizer)  # one that already exists is refused first: predictions would step it
    name = type(opt).__name__
    if isinstance(opt, torch.optim.SGD):
        name += f"(momentum={opt.defaults.get('momentum', 0)})"
    return name


def is_adam_like(make_optimizer) -> bool:
    """Optimizers with a second moment and an eps (Adam, AdamW, RMSprop...): unsafe with float16 weights."""
    return "eps" in probe_optimizer(make_optimizer).defaults
