"""The chosen candidate as plain PyTorch code, to paste into a training loop."""

from __future__ import annotations

import inspect

import torch

from ..step import model_loss
from .candidates import Candidate
from .facts import LORA_RANK, QUANTIZATION, probe_optimizer
from .steps import CHUNK_TOKENS
from .search import PlanSearch

# -- the recipe as code ------------------------------------------------------------------------------------------


def _optimizer_expression(make, params: str) -> tuple[list[str], str, str]:
    """``(imports, the expression that builds the optimizer over params, its class name)``."""
    recipe = getattr(make, "recipe", None)  # bitsandbytes' 8-bit optimizer (facts.eight_bit_optimizer)
    if recipe is not None:
        imports, expression = recipe
        return [imports], expression.replace("model.parameters()", params), expression.split("(")[0]
    opt = probe_optimizer(make)
    cls = type(opt)
    accepted = inspect.signature(cls.__init__).parameters
    args = []
    for k, v in opt.defaults.items():
        if k in accepted and k != "params" and accepted[k].default is not inspect.Parameter.empty \
                and v != accepted[k].default and not (k == "lr" and isinstance(v, torch.Tensor)):
            args.append(f"{k}={v!r}")
    return [], f"torch.optim.{cls.__name__}({params}{''.join(', ' + a for a in args)})", f"torch.optim.{cls.__name__}"


def recipe_code(c: Candidate, search: PlanSearch, device: str) -> str:
    """The candidate as plain PyTorch: setup lines, then the loop body."""
    label = c.optimizer.removesuffix(", in backward")
    in_backward = label != c.optimizer
    imports, expression, cls_name = _optimizer_expression(search.optimizers[label][0],
                                                          "[p]" if in_backward else "model.parameters()")
    dev = device
    lines = ["import functools", "import torch", "import torch.nn.functional as F",
             "from torch.utils.checkpoint import checkpoint, checkpoint_sequential", *imports]
    if c.qlora:
        module, cls = search.facts.model_class.rsplit(".", 1)
        lines += [f"from {module} import BitsAndBytesConfig, {cls}",
                  "from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training"]
    elif c.lora:
        lines.append("from peft import LoraConfig, get_peft_model")
    if c.chunked_loss:
        lines.append("from gpukit.losses import chunked_causal_lm_loss  # the logits a chunk of tokens at a time")
    if c.precision == "bf16 weights":  # converted before it moves: the float32 weights never reach the device
        lines += ["", f"model = make_model().to(torch.bfloat16).to({dev!r})  # weights, gradients, optimizer state: "
                      "bfloat16"]
    elif c.qlora:  # the weights quantized as they are loaded: the float32 model never reaches the device
        quantization = ", ".join(f"{k}={v if isinstance(v, torch.dtype) else repr(v)}"  # (torch.bfloat16)
                                 for k, v in QUANTIZATION.items())
        lines += ["", "checkpoint = 'checkpoint'  # your model's name or directory, as from_pretrained takes it; here "
                      "the model make_model builds:",
                  "make_model().save_pretrained(checkpoint)",
                  f"model = {cls}.from_pretrained(checkpoint, device_map={{'': {dev!r}}}, "
                  f"quantization_config=BitsAndBytesConfig(",
                  f"    {quantization}))  # Linear weights in 4-bit NF4 (bitsandbytes), the output layer kept",
                  "model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)  # all frozen"]
    else:
        lines += ["", f"model = make_model().to({dev!r})"]
    if c.precision == "half":
        lines += ["model.half()  # float16 weights; BatchNorm back to float32 (its running statistics overflow)",
                  "for m in model.modules():",
                  "    if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):",
                  "        m.float()"]
    if c.lora:
        lines.append(f"model = get_peft_model(model, LoraConfig(r={LORA_RANK}, lora_alpha={2 * LORA_RANK}, "
                     f"target_modules={list(search.facts.lora_targets)!r}))  # the weights frozen")
    if in_backward:  # PyTorch's recipe (its tutorial on fusing the optimizer step into the backward pass)
        lines += [f"optimizers = {{p: {expression} for p in model.parameters() "
                  "if p.requires_grad}",
                  "",
                  "",
                  "def step_in_backward(p):  # once p's gradient is complete: step p alone, free its gradient",
                  "    optimizers[p].step()",
                  "    optimizers[p].zero_grad(set_to_none=True)",
                  "",
                  "",
                  "for p in optimizers:",
                  "    p.register_post_accumulate_grad_hook(step_in_backward)",
                  ""]
    else:
        lines.append(f"optimizer = {expression}")
    if c.precision == "fp16":
        lines.append(f"scaler = torch.amp.GradScaler({dev!r})")
    if c.checkpointed:
        lines.append(search.facts.checkpoint_code or "# checkpointing: the whole model, in the forward below")
    lines += _loop(c, search, dev) if search.loss is None else _loop_with_loss(c, search, dev)
    if c.strategy != "single GPU":
        wrap = {"DDP": "model = torch.nn.parallel.DistributedDataParallel(model)  # after .to(device), before the "
                       "optimizer",
                "ZeRO-1": "optimizer = torch.distributed.optim.ZeroRedundancyOptimizer(model.parameters(), "
                          f"optimizer_class={cls_name})  # with DDP as above",
                "FSDP": "for block in blocks: fully_shard(block); fully_shard(model)  "
                        "# torch.distributed.fsdp, before the optimizer"}[c.strategy]
        lines.insert(lines.index("") + 1, f"# {c.strategy}, launched with torchrun --nproc-per-node={search.gpus}; each batch: this "
                        f"rank's share (DistributedSampler)\n# {wrap}")
    return "\n".join(lines)


def _loop(c: Candidate, search: PlanSearch, dev: str) -> list[str]:
    """The training loop for the plain step's ``(inputs, targets)`` batches and cross-entropy."""
    k = c.accumulate
    lines = ["", "for x, y in loader:", f"    x, y = x.to({dev!r}), y.to({dev!r})"]
    if c.precision in ("half", "bf16 weights"):
        cast = "half()" if c.precision == "half" else "bfloat16()"
        lines.append(f"    x = x.{cast} if x.is_floating_point() else x")
    if not c.optimizer.endswith(", in backward"):
        lines.append("    optimizer.zero_grad(set_to_none=True)")
    ind = "    "
    if k > 1:
        lines.append(f"    for xs, ys in zip(x.chunk({k}), y.chunk({k})):  # {k} micro-batches, one optimizer step")
        ind, xs, ys = "        ", "xs", "ys"
    else:
        xs, ys = "x", "y"
    forward = (f"checkpoint(model, {xs}, use_reentrant=False)" if c.checkpointed and not search.facts.checkpoint_code
               else f"model({xs})")
    body = [f"out = {forward}", f"loss = F.cross_entropy(out.float().flatten(0, -2), {ys}.flatten())"
            + (f" / {k}" if k > 1 else "")]
    return lines + _step(c, dev, ind, body)


def _step(c: Candidate, dev: str, ind: str, body: list[str]) -> list[str]:
    """A micro-batch's lines (``body``, under autocast and save_on_cpu where the candidate has them), its backward,
    and the optimizer step (through the GradScaler for float16)."""
    ctx = []
    if c.precision in ("bf16", "fp16"):
        ctx.append(f"torch.autocast({dev!r}, dtype=torch.{'bfloat16' if c.precision == 'bf16' else 'float16'})")
    if c.offload:
        ctx.append(f"torch.autograd.graph.save_on_cpu(pin_memory={dev == 'cuda'})")
    lines = ([f"{ind}with {', '.join(ctx)}:"] + [f"{ind}    {b}" for b in body]) if ctx else [f"{ind}{b}" for b in body]
    lines.append(f"{ind}{'scaler.scale(loss)' if c.precision == 'fp16' else 'loss'}.backward()")
    if c.optimizer.endswith(", in backward"):
        return lines  # each parameter was stepped in backward
    lines += ["    scaler.step(optimizer)", "    scaler.update()"] if c.precision == "fp16" else ["    optimizer.step()"]
    return lines


def _loop_with_loss(c: Candidate, search: PlanSearch, dev: str) -> list[str]:
    """The training loop for a step whose loss comes from ``plan(loss=...)``: a batch of any structure, moved
    and cut into micro-batches as plain PyTorch does it for a dict (``gpukit.step`` for other structures)."""
    k, mapping = c.accumulate, search.facts.batch_mapping
    if mapping:
        move = f"    batch = {{name: value.to({dev!r}) for name, value in batch.items()}}"
        split = (f"[dict(zip(batch, parts)) for parts in zip(*(value.chunk({k}) for value in batch.values()))]")
        half = "{name: v.CAST if v.is_floating_point() else v for name, v in micro.items()}"
    else:
        move = f"    batch = map_tensors(lambda value: value.to({dev!r}), batch)"
        split = f"split_batch(batch, {k})"
        half = "map_tensors(lambda v: v.CAST if v.is_floating_point() else v, micro)"
    own = search.loss is model_loss
    compute = "model(**micro).loss" if own else "loss_fn(model, micro)  # the loss given to plan()"
    fn = "lambda m, b: m(**b).loss" if own else "loss_fn"
    if c.chunked_loss:
        compute = f"chunked_causal_lm_loss(model, micro, chunk_tokens={CHUNK_TOKENS})  # = model(**micro).loss"
        fn = f"functools.partial(chunked_causal_lm_loss, chunk_tokens={CHUNK_TOKENS})"
    if c.checkpointed and not search.facts.checkpoint_code:
        compute = f"checkpoint({fn}, model, micro, use_reentrant=False)"
    lines = [""] + ([] if mapping else ["from gpukit.step import map_tensors, split_batch"])
    lines += ["for batch in loader:", move]
    if not c.optimizer.endswith(", in backward"):
        lines.append("    optimizer.zero_grad(set_to_none=True)")
    ind = "    "
    if k > 1:
        lines.append(f"    for micro in {split}:  # {k} micro-batches, one optimizer step")
        ind = "        "
    else:
        lines.append("    micro = batch")
    if c.precision in ("half", "bf16 weights"):
        lines.append(f"{ind}micro = " + half.replace("CAST", "half()" if c.precision == "half" else "bfloat16()"))
    body = f"loss = {compute}" if k == 1 else f"loss = {compute.split('  #')[0]} / {k}"
    return lines + _step(c, dev, ind, [body])
