"""predict() against GPU memory that others measured and published.

Each configuration is a training run someone printed the memory of, on a GPU, in a public document: the source
(repository, file and commit, or a versioned URL), the run as that source wrote it, the metric it printed and the
figure. The run is rebuilt here with random weights (the model's real dimensions written out in its config,
``from_config``; nothing downloaded), the step written as the library of the time ran it, and predicted for the
card the source used (``predict(card=...)``). The published metric is then derived from the prediction and the
error printed; where the metric holds more than PyTorch allocates (nvidia-smi counts the CUDA context), what was
added is said, with its source.

Writes bench/out/published.csv and prints the table.

    python3 kit.py bench published
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from results import write_csv

from gpukit.estimate import predict
from gpukit.step import own_checkpointing_methods

MiB = 2**20
GOAL_PCT = 3.0  # the error each configuration should stay within

# -- sources ----------------------------------------------------------------------------------------------------

HF_SINGLE_GPU = (
    "huggingface/transformers, docs/source/en/perf_train_gpu_one.mdx at commit "
    "0016acf7ef421c7fe8eff7945de52c71896c3b01 (\"Efficient Training on a Single GPU\"): "
    "https://github.com/huggingface/transformers/blob/0016acf7ef421c7fe8eff7945de52c71896c3b01/"
    "docs/source/en/perf_train_gpu_one.mdx")

# What the source prints before any model exists: `torch.ones((1, 1)).to("cuda")` then nvidia-smi's used memory,
# "GPU memory occupied: 1343 MB." (info.used // 1024**2, so MiB), on the same Tesla V100-SXM2 16 GB the runs used.
# That figure holds the CUDA context (with the kernels loaded: CUDA 11.2 loaded every module eagerly) and the one
# 2 MiB segment the caching allocator reserved for the 1x1 tensor, which the training runs reuse: the context
# alone is 1343 - 2 = 1341 MiB, and the runs' reserved memory is added to it.
HF_CONTEXT_MIB = 1343 - 2


def checkpoint_layers(model: torch.nn.Module, **options) -> None:
    """A transformers model's own checkpointing turned on, under the name the installed transformers gives it
    (``activation_checkpointing_enable`` from 5.24, ``gradient_checkpointing_enable`` before: gpukit allows
    5.0 on), with ``options`` for ``torch.utils.checkpoint.checkpoint``."""
    enable, _, kwargs, _ = own_checkpointing_methods(model)
    getattr(model, enable)(**({kwargs: options} if options else {}))


# -- bert-large-uncased, random weights ------------------------------------------------------------------------


def bert_large_config():
    """bert-large-uncased's dimensions (https://huggingface.co/google-bert/bert-large-uncased, config.json: 24 layers,
    hidden 1024, 16 heads, intermediate 4096, vocabulary 30522, 512 positions, 2 token types, dropout 0.1, GELU) with
    the classifier's default 2 labels, as ``AutoModelForSequenceClassification.from_pretrained`` builds it."""
    from transformers import BertConfig

    return BertConfig(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                      intermediate_size=4096, hidden_act="gelu", hidden_dropout_prob=0.1,
                      attention_probs_dropout_prob=0.1, max_position_embeddings=512, type_vocab_size=2,
                      layer_norm_eps=1e-12, num_labels=2)


def bert_classifier(config=None, checkpointing: bool = False) -> Callable[[], torch.nn.Module]:
    """A BERT sequence classifier with random weights (bert-large-uncased's config unless ``config``). Attention is
    the eager one: the BERT of transformers in early 2022 wrote its attention out (matmul, softmax, dropout,
    matmul) and had no SDPA path. Checkpointing as ``gradient_checkpointing=True`` ran it then:
    ``torch.utils.checkpoint.checkpoint`` around each layer, the reentrant variant."""
    from transformers import BertForSequenceClassification

    def make_model():
        model = BertForSequenceClassification._from_config(config or bert_large_config(), attn_implementation="eager")
        if checkpointing:
            checkpoint_layers(model, use_reentrant=True)
        return model.train()

    return make_model


def dummy_batch(batch: int) -> Callable[[], dict]:
    """The source's dummy data: token ids drawn from [100, 30000), sequences of 512, a binary label, as the
    Trainer's default collator stacks them (no attention mask: the data set has none)."""
    return lambda: {"input_ids": torch.randint(100, 30000, (batch, 512)), "labels": torch.randint(0, 2, (batch,))}


# -- the optimizers the Trainer builds ---------------------------------------------------------------------------


def adamw_hf(params):
    """``optim="adamw_hf"``, the Trainer's default then: transformers' own AdamW, a loop over the parameters
    keeping exp_avg and exp_avg_sq in float32 (lr 5e-5, weight decay 0). torch's AdamW with ``foreach=False`` holds
    the same state; its temporaries, one parameter at a time, are one tensor more (``exp_avg_sq.sqrt()``, then its
    division by the bias correction, where transformers' loop added eps to the square root in place)."""
    return torch.optim.AdamW(params, lr=5e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, foreach=False)


def adafactor(params):
    """``optim="adafactor"``: transformers' Adafactor with ``scale_parameter=False, relative_step=False`` and the
    Trainer's learning rate, as Trainer.create_optimizer built it."""
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=5e-5, scale_parameter=False, relative_step=False)


def adam8bit(params):
    """``bnb.optim.Adam8bit`` with the Trainer's betas, eps and learning rate, as the source builds it (its two
    parameter groups differ only in weight decay, which changes no memory)."""
    import bitsandbytes as bnb

    return bnb.optim.Adam8bit(params, lr=5e-5, betas=(0.9, 0.999), eps=1e-8)


# -- the Trainer's step -------------------------------------------------------------------------------------------


def trainer_step(accumulation: int = 1, fp16: bool = False) -> Callable[[torch.nn.Module, Any, dict], None]:
    """One optimizer step of transformers' Trainer of early 2022 (src/transformers/trainer.py, ``Trainer.train``'s
    loop and ``training_step``): per micro-batch the forward (under ``torch.cuda.amp.autocast()`` with ``fp16=True``),
    the loss divided by the accumulation steps, backward (through the GradScaler with fp16); then the scaler's
    unscale, ``clip_grad_norm_`` to ``max_grad_norm=1.0`` (the Trainer's default), the optimizer step and
    ``model.zero_grad()``, which torch before 2.0 ran with ``set_to_none=False``: the gradients stay allocated, as
    zeros, between steps. The scaler is made at the first step, inside the prediction, as the card makes it."""
    scaler = None

    def step(model, optimizer, batch):
        nonlocal scaler
        if fp16 and scaler is None:
            scaler = torch.amp.GradScaler("cuda")
        micro = batch["input_ids"].shape[0] // accumulation
        for i in range(accumulation):
            part = {k: v[i * micro:(i + 1) * micro] for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16) if fp16 else contextlib.nullcontext():
                loss = model(**part).loss
            loss = loss / accumulation
            (scaler.scale(loss) if fp16 else loss).backward()
        if fp16:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
        if fp16:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        model.zero_grad(set_to_none=False)

    return step


# -- the configurations -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One published measurement and how to rebuild its run."""

    name: str
    source: str          # repository, file and commit, or a versioned URL
    quote: str           # the published figure as the source prints it
    configuration: str   # the run as the source wrote it
    metric: str          # what the figure measures
    published_mib: float
    card: str            # gpukit.cards key of the card predicted for
    counts: str          # "allocated" (max_memory_allocated: the prediction's peak) or "reserved" (the simulated
                         # allocator's reserved bytes at the peak, plus context_mib: what nvidia-smi shows)
    context_mib: float   # the part of the metric PyTorch does not allocate (the CUDA context), 0 for "allocated"
    assumed: str         # what the source leaves open, and what was taken
    make_model: Callable[[], torch.nn.Module]
    make_optimizer: Callable[[Any], Any]
    make_batch: Callable[[], Any]
    make_step: Callable[[], Callable]  # a fresh step (a fresh GradScaler) per prediction


NVIDIA_SMI = "nvidia-smi used memory (pynvml nvmlDeviceGetMemoryInfo .used // 1024**2) after trainer.train()"
HF_CARD = "t4"
HF_ASSUMED = (
    "Tesla V100-SXM2 16 GB (sm70), predicted as card='t4' (sm75; gpukit.cards has no V100): predict reads only "
    "the compute capability, and sm70 and sm75 take the same kernels (no flash attention, no bfloat16, "
    "memory-efficient attention for float16/float32; BERT's eager attention uses none). The figure, read after "
    "the epoch, is taken as the context plus the caching allocator's reserved memory at the step's peak (nothing "
    "in the Trainer empties the cache); steady state: one warm-up step, gradients kept as zeros. The versions are "
    "not named: the nvidia-smi output is dated 11 January 2022 (driver 460.91.03, CUDA 11.2), so transformers "
    "v4.15-4.16 and torch 1.10 are taken; the step is torch " + torch.__version__.split("+")[0] + "'s now.")


def _hf(name: str, quote: str, configuration: str, figure: int, *, batch: int, accumulation: int = 1,
        checkpointing: bool = False, fp16: bool = False, optimizer=adamw_hf, assumed: str = "") -> Config:
    return Config(name=name, source=HF_SINGLE_GPU, quote=quote, configuration=configuration, metric=NVIDIA_SMI,
                  published_mib=figure, card=HF_CARD, counts="reserved", context_mib=HF_CONTEXT_MIB,
                  assumed=HF_ASSUMED + (" " + assumed if assumed else ""),
                  make_model=bert_classifier(checkpointing=checkpointing), make_optimizer=optimizer,
                  make_batch=dummy_batch(batch * accumulation),
                  make_step=lambda: trainer_step(accumulation, fp16))


BERT = "bert-large-uncased classifier, seq 512"
CONFIGS = [
    _hf(f"{BERT}, batch 4, AdamW", 'section "Vanilla Training": "GPU memory occupied: 14949 MB."',
        "TrainingArguments(per_device_train_batch_size=4)", 14949, batch=4),
    _hf(f"{BERT}, batch 1 x 4 accumulated", 'section "Gradient Accumulation": "GPU memory occupied: 8681 MB."',
        "TrainingArguments(per_device_train_batch_size=1, gradient_accumulation_steps=4)", 8681,
        batch=1, accumulation=4),
    _hf(f"{BERT}, batch 1 x 4 accumulated, checkpointing",
        'section "Gradient Checkpointing": "GPU memory occupied: 6775 MB."',
        "TrainingArguments(per_device_train_batch_size=1, gradient_accumulation_steps=4, "
        "gradient_checkpointing=True)", 6775, batch=1, accumulation=4, checkpointing=True),
    _hf(f"{BERT}, batch 4, fp16", 'section "FP16 Training", first run: "GPU memory occupied: 13939 MB."',
        "TrainingArguments(per_device_train_batch_size=4, fp16=True)", 13939, batch=4, fp16=True,
        assumed="fp16=True is native AMP: torch.cuda.amp.autocast() and GradScaler() (no apex)."),
    _hf(f"{BERT}, batch 1 x 4, checkpointing, fp16",
        'section "FP16 Training", with the previous methods: "GPU memory occupied: 7275 MB."',
        "TrainingArguments(per_device_train_batch_size=1, gradient_accumulation_steps=4, "
        "gradient_checkpointing=True, fp16=True)", 7275, batch=1, accumulation=4, checkpointing=True, fp16=True,
        assumed="fp16=True is native AMP: torch.cuda.amp.autocast() and GradScaler() (no apex)."),
    _hf(f"{BERT}, batch 4, Adafactor", 'section "Adafactor", first run: "GPU memory occupied: 12295 MB."',
        "TrainingArguments(per_device_train_batch_size=4, optim=\"adafactor\")", 12295, batch=4, optimizer=adafactor),
    _hf(f"{BERT}, batch 1 x 4, checkpointing, fp16, Adafactor",
        'section "Adafactor", with the other methods: "GPU memory occupied: 4847 MB."',
        "TrainingArguments(per_device_train_batch_size=1, gradient_accumulation_steps=4, "
        "gradient_checkpointing=True, fp16=True, optim=\"adafactor\")", 4847, batch=1, accumulation=4,
        checkpointing=True, fp16=True, optimizer=adafactor,
        assumed="fp16=True is native AMP: torch.cuda.amp.autocast() and GradScaler() (no apex)."),
    _hf(f"{BERT}, batch 4, Adam8bit", 'section "8-bit Adam", first run: "GPU memory occupied: 13085 MB."',
        "TrainingArguments(per_device_train_batch_size=4), optimizers=(bnb.optim.Adam8bit(...), None)", 13085,
        batch=4, optimizer=adam8bit,
        assumed="bitsandbytes of early 2022 (its version is not named): today's Adam8bit, blockwise, states of "
        "tensors under 4096 elements in float32; the CUDA module bitsandbytes loads adds to the context, "
        "not counted."),
    _hf(f"{BERT}, batch 1 x 4, checkpointing, fp16, Adam8bit",
        'section "8-bit Adam", with the full settings: "GPU memory occupied: 5363 MB."',
        "TrainingArguments(per_device_train_batch_size=1, gradient_accumulation_steps=4, "
        "gradient_checkpointing=True, fp16=True), optimizers=(bnb.optim.Adam8bit(...), None)", 5363,
        batch=1, accumulation=4, checkpointing=True, fp16=True, optimizer=adam8bit,
        assumed="fp16=True is native AMP. bitsandbytes of early 2022 (its version is not named): today's "
        "Adam8bit, blockwise; the CUDA module bitsandbytes loads adds to the context, not counted."),
]


# -- torchao's optimizer benchmarks: timm ViTs, rebuilt with transformers' ViT and DINOv2 ---------------------------

TORCHAO_README = ("pytorch/ao, torchao/optim/README.md at commit 072500abcfbdec15a429eb53160c63fb92534b85 "
                  "(\"Low-bit and specialized optimizers\", section {}): https://github.com/pytorch/ao/blob/"
                  "072500abcfbdec15a429eb53160c63fb92534b85/torchao/optim/README.md")
TORCHAO_METRIC = ("torch.cuda.max_memory_allocated() / 1e9, printed as GB by pytorch/ao benchmarks/"
                  "benchmark_low_bit_adam.py (\"Max memory used\", at commit 03cf0adec63fdbae2fd6d2aa7688b52ee8c64004)")
# The 4070Ti SUPER (16 GB, Ada, sm89) is not in gpukit.cards; the L4 is the same architecture and compute capability,
# which is all predict reads.
TORCHAO_CARD = "l4"
TORCHAO_RUN = ("benchmark_low_bit_adam.py: timm.create_model(..., pretrained=True, num_classes=45), images "
               "RandomResizedCrop(224), lr 1e-4, weight decay 0, F.cross_entropy, GradScaler enabled only for fp16, "
               "optim.zero_grad() (set_to_none=True from torch 2.0)")


def dinov2_giant(checkpointing: bool = True) -> Callable[[], torch.nn.Module]:
    """timm's ``vit_giant_patch14_dinov2`` (1.1B parameters) at 224 px, as transformers' DINOv2 with the same
    dimensions (timm vit_giant_patch14_dinov2: patch 14, width 1536, 40 blocks, 24 heads, SwiGLU MLP of 2 x 4096
    (mlp_ratio 2.66667 x 2, packed), layer scale), 45 classes, in bfloat16 (``model.bfloat16()``), checkpointed per
    block (timm's ``set_grad_checkpointing()``)."""
    from transformers import Dinov2Config, Dinov2ForImageClassification

    config = Dinov2Config(hidden_size=1536, num_hidden_layers=40, num_attention_heads=24, mlp_ratio=4,
                          use_swiglu_ffn=True, image_size=224, patch_size=14, layerscale_value=1e-5,
                          layer_norm_eps=1e-6, num_labels=45)

    def make_model():
        model = Dinov2ForImageClassification._from_config(config)
        if checkpointing:
            checkpoint_layers(model)
        return model.bfloat16().train()

    return make_model


def vit_huge() -> Callable[[], torch.nn.Module]:
    """timm's ``vit_huge_patch14_224`` (630M parameters) as transformers' ViT with the same dimensions (patch 14, width
    1280, 32 blocks, 16 heads, MLP 5120, class token, LayerNorm eps 1e-6), 45 classes, float32 weights (AMP)."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(hidden_size=1280, num_hidden_layers=32, num_attention_heads=16, intermediate_size=5120,
                       image_size=224, patch_size=14, layer_norm_eps=1e-6, num_labels=45)
    return lambda: ViTForImageClassification._from_config(config).train()


def images(batch: int, dtype=torch.float32) -> Callable[[], tuple]:
    """A batch as the benchmark's loader gives it: 224 x 224 RGB images (bfloat16 with --full_bf16) and labels."""
    return lambda: (torch.randn(batch, 3, 224, 224).to(dtype), torch.randint(0, 45, (batch,)))


def torchao_step(amp: torch.dtype | None = None) -> Callable:
    """The benchmark's loop body: forward and cross-entropy (under ``torch.autocast("cuda", dtype=amp)`` with --amp),
    backward, the optimizer step, ``zero_grad()``. Its GradScaler is disabled unless --amp fp16, and a disabled
    scaler passes the loss and the step through: left out."""

    def step(model, optimizer, batch):
        x, y = batch
        with torch.autocast("cuda", dtype=amp) if amp is not None else contextlib.nullcontext():
            loss = torch.nn.functional.cross_entropy(model(pixel_values=x).logits, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return lambda: step


def fused_adamw(params):
    """OPTIM_MAP["AdamW"]: ``partial(torch.optim.AdamW, fused=True)``, lr 1e-4, weight decay 0."""
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=True)


def bnb_adamw8bit(params):
    """OPTIM_MAP["AdamW8bitBnb"]: ``bnb.optim.AdamW8bit``, lr 1e-4, weight decay 0."""
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, lr=1e-4, weight_decay=0.0)


TORCHAO_IMG = ("The README does not print --model_kwargs; timm's DINOv2 giant is configured for 518 px and the loader "
               "gives 224 px crops: img_size=224 is taken (a 16 x 16 position embedding, resampled at load). ")
TORCHAO_IMPL = ("transformers' implementation stands in for timm's (no timm here): the same dimensions, SDPA "
                "attention (timm's fused_attn), dropout 0, a linear classifier. ")

TORCHAO_CONFIGS = [
    Config(name="dinov2 giant 224px, batch 32, full bf16, checkpointing, fused AdamW",
           source=TORCHAO_README.format("Optimizer CPU offload"),
           quote="timm/vit_giant_patch14_dinov2.lvd142m (1.1B params), eager mode, full BF16 training, activations "
                 "checkpointing, batch size 32, on 4070Ti SUPER (16GB VRAM): Adam offload None | 1.27s/it | 9.82 GB",
           configuration="--model timm/vit_giant_patch14_dinov2.lvd142m --full_bf16 --checkpoint_activations "
                         "--batch_size 32 --optim AdamW; " + TORCHAO_RUN,
           metric=TORCHAO_METRIC, published_mib=9.82e9 / MiB, card=TORCHAO_CARD, counts="allocated", context_mib=0,
           assumed=TORCHAO_IMG + TORCHAO_IMPL + "DINOv2's classifier here reads the class token and the mean "
                   "patch token (2 x 1536 inputs: 138 KB more than timm's head). Checkpointing: "
                   "torch.utils.checkpoint per block (timm's checkpoint_seq "
                   "of mid 2024; transformers' default, non-reentrant, here). 4070Ti SUPER predicted as card='l4' "
                   "(both Ada, sm89). The figure is rounded to 10 MB: +-0.05%.",
           make_model=dinov2_giant(), make_optimizer=fused_adamw, make_batch=images(32, torch.bfloat16),
           make_step=torchao_step()),
    Config(name="ViT-H/14 224px, batch 8, bf16 AMP, compiled, fused AdamW",
           source=TORCHAO_README.format("Benchmarks"),
           quote="Fine-tune timm's ViT-H (630M params) on resisc45 dataset. PyTorch 2.4, BF16 AMP, compiled model, "
                 "1 epoch, batch size 8 ... PyTorch (fused) | 12.23",
           configuration="--model timm/vit_huge_patch14_224.orig_in21k --amp bf16 --compile --batch_size 8 "
                         "--optim AdamW --cosine_lr_scheduler; " + TORCHAO_RUN,
           metric=TORCHAO_METRIC, published_mib=12.23e9 / MiB, card=TORCHAO_CARD, counts="allocated", context_mib=0,
           assumed=TORCHAO_IMPL + "The model is compiled there (model.compile(fullgraph=True)); predicted eagerly "
                   "here. 4070Ti SUPER predicted as card='l4' (both Ada, sm89).",
           make_model=vit_huge(), make_optimizer=fused_adamw, make_batch=images(8),
           make_step=torchao_step(torch.bfloat16)),
    Config(name="ViT-H/14 224px, batch 8, bf16 AMP, compiled, bnb AdamW8bit",
           source=TORCHAO_README.format("Benchmarks"),
           quote="Fine-tune timm's ViT-H (630M params) on resisc45 dataset. PyTorch 2.4, BF16 AMP, compiled model, "
                 "1 epoch, batch size 8 ... bnb 8-bit | 8.32",
           configuration="--model timm/vit_huge_patch14_224.orig_in21k --amp bf16 --compile --batch_size 8 "
                         "--optim AdamW8bitBnb --cosine_lr_scheduler; " + TORCHAO_RUN,
           metric=TORCHAO_METRIC, published_mib=8.32e9 / MiB, card=TORCHAO_CARD, counts="allocated", context_mib=0,
           assumed=TORCHAO_IMPL + "The model is compiled there (model.compile(fullgraph=True)); predicted eagerly "
                   "here. bitsandbytes' version is not named: today's AdamW8bit (blockwise). 4070Ti SUPER predicted "
                   "as card='l4' (both Ada, sm89).",
           make_model=vit_huge(), make_optimizer=bnb_adamw8bit, make_batch=images(8),
           make_step=torchao_step(torch.bfloat16)),
]
CONFIGS = CONFIGS + TORCHAO_CONFIGS


def predicted_mib(config: Config, prediction) -> float:
    """The published metric, as predicted: the peak allocated (cuBLAS workspaces included: torch allocates them
    through the caching allocator), or the context plus the reserved bytes at the peak."""
    if config.counts == "allocated":
        return prediction.peak / MiB
    return config.context_mib + prediction.reserved_peak / MiB


def run(config: Config) -> dict:
    """Predict one configuration; its row of the table."""
    t0 = time.perf_counter()
    p = predict(config.make_model, config.make_optimizer, config.make_batch, config.make_step(), card=config.card,
                breakdown=False)
    seconds = time.perf_counter() - t0
    predicted = predicted_mib(config, p)
    error = 100 * (predicted - config.published_mib) / config.published_mib
    flags = [f"lower bound: {', '.join(p.unverified_ops)}"] if p.lower_bound else []
    flags += [f"not as on the card: {what}" for what in p.unfollowed]
    return {"configuration": config.name, "run": config.configuration, "source": config.source,
            "quote": config.quote, "metric": config.metric, "card": config.card, "counts": config.counts,
            "published_mib": round(config.published_mib, 1), "context_mib": config.context_mib,
            "predicted_allocated_mib": round(p.peak / MiB, 1),
            "predicted_reserved_mib": round(p.reserved_peak / MiB, 1),
            "predicted_mib": round(predicted, 1), "error_pct": round(error, 2),
            "within_goal": abs(error) <= GOAL_PCT, "note": NOTES.get(config.name, ""), "flags": "; ".join(flags),
            "assumed": config.assumed, "predict_seconds": round(seconds, 1), "torch": torch.__version__}


# What the BERT rows rest on, found by experiments on the same predictions (2026-11-27). Each row's error as it was
# predicted before gpukit.cudarules ran F.dropout as CUDA's fused kernel (native_dropout, a 1-byte bool mask kept
# for backward, aten/src/ATen/native/Dropout.cpp, is_fused_kernel_acceptable), when the fake CPU tensors kept the
# CPU's noise tensor of the input's dtype (4 bytes an element in float32): the table's figures until then.
CPU_DROPOUT: dict[str, float] = {
    f"{BERT}, batch 4, AdamW": -0.60,
    f"{BERT}, batch 1 x 4 accumulated": -1.38,
    f"{BERT}, batch 1 x 4 accumulated, checkpointing": -0.18,
    f"{BERT}, batch 4, fp16": -16.76,
    f"{BERT}, batch 1 x 4, checkpointing, fp16": -1.57,
    f"{BERT}, batch 4, Adafactor": +0.42,
    f"{BERT}, batch 1 x 4, checkpointing, fp16, Adafactor": +0.12,
    f"{BERT}, batch 4, Adam8bit": +0.66,
    f"{BERT}, batch 1 x 4, checkpointing, fp16, Adam8bit": +0.26,
}
# And the experiment (`python3 bench/published.py --torch-1.10`): the error with softmax also keeping its input for
# backward, as the torch of 2022 did (under autocast the float32 copy that autocast made of it).
TORCH_110: dict[str, float] = {
    f"{BERT}, batch 4, AdamW": -0.23,
    f"{BERT}, batch 1 x 4 accumulated": -1.11,
    f"{BERT}, batch 1 x 4 accumulated, checkpointing": -0.09,
    f"{BERT}, batch 4, fp16": -3.13,
    f"{BERT}, batch 1 x 4, checkpointing, fp16": -1.29,
    f"{BERT}, batch 4, Adafactor": +0.42,
    f"{BERT}, batch 1 x 4, checkpointing, fp16, Adafactor": +0.37,
    f"{BERT}, batch 4, Adam8bit": +0.38,
    f"{BERT}, batch 1 x 4, checkpointing, fp16, Adam8bit": +0.34,
}


def _experiment_note(name: str) -> str:
    return (f"with the CPU's dropout (its noise tensor), as predicted before: {CPU_DROPOUT[name]:+.2f}%; "
            f"softmax keeping its input (torch 1.10): {TORCH_110[name]:+.2f}%")


# Why a configuration misses the goal, or what its agreement rests on, as far as it was found out.
NOTES: dict[str, str] = {name: _experiment_note(name) for name in TORCH_110}
NOTES[f"{BERT}, batch 4, fp16"] = (
    "low: the torch of 2022 kept softmax's input for backward, here the float32 copy CUDA autocast makes of each "
    "float16 attention matrix (softmax is on its float32 list); w" + _experiment_note(f"{BERT}, batch 4, fp16")[1:])


class _SoftmaxKeepingItsInput(torch.autograd.Function):
    """softmax whose backward holds its input as well as its output, as torch's did before 1.11 (derivatives.yaml
    then: ``self: _softmax_backward_data(grad, result, dim, self)``; since: ``self.scalar_type()``)."""

    @staticmethod
    def forward(ctx, x, dim):
        out = torch.softmax(x, dim)
        ctx.save_for_backward(x, out)
        ctx.dim = dim
        return out

    @staticmethod
    def backward(ctx, grad):
        x, out = ctx.saved_tensors
        return torch.ops.aten._softmax_backward_data(grad, out, ctx.dim, x.dtype), None


@contextlib.contextmanager
def _softmax_replaced(softmax):
    """``F.softmax`` replaced by ``softmax(original, x, ...)`` while the block runs, the original put back after."""
    original = torch.nn.functional.softmax
    torch.nn.functional.softmax = functools.partial(softmax, original)
    try:
        yield
    finally:
        torch.nn.functional.softmax = original


@contextlib.contextmanager
def softmax_keeping_its_input():
    """An experiment: ``F.softmax`` in training keeping its input for backward, as torch 1.10 did (2022's runs)."""
    def softmax(original, x, dim=None, _stacklevel=3, dtype=None):
        if dtype is None and x.requires_grad:
            if x.dtype in (torch.float16, torch.bfloat16) and torch.is_autocast_enabled("cpu"):
                x = x.float()  # autocast's float32 copy (softmax is on CUDA's float32 list), which 2022's kept
            return _SoftmaxKeepingItsInput.apply(x, dim)
        return original(x, dim=dim, _stacklevel=_stacklevel, dtype=dtype)

    with _softmax_replaced(softmax):
        yield


def main(configs: list[Config] = CONFIGS) -> list[dict]:
    rows = []
    width = max(len(c.name) for c in configs) + 2
    print(f"{'configuration':<{width}}{'published MiB':>14}{'predicted MiB':>14}{'error %':>9}  note")
    for config in configs:
        row = run(config)
        rows.append(row)
        note = row["note"] or row["flags"]
        print(f"{config.name:<{width}}{row['published_mib']:>14,.0f}{row['predicted_mib']:>14,.0f}"
              f"{row['error_pct']:>+9.2f}  {note}", flush=True)
    write_csv("published.csv", rows)
    return rows


def summary(rows: list[dict]) -> list[str]:
    within = sum(r["within_goal"] for r in rows)
    worst = max(rows, key=lambda r: abs(r["error_pct"]))
    return [f"published measurements: {within}/{len(rows)} configurations within {GOAL_PCT:.0f}% of the published "
            f"figure; largest error {worst['error_pct']:+.2f}% ({worst['configuration']})"]


if __name__ == "__main__":
    import sys

    if "--torch-1.10" in sys.argv:  # the BERT rows with softmax keeping its input, as 2022's torch did
        for config in CONFIGS:
            if not config.name.startswith(BERT):
                continue
            with softmax_keeping_its_input():
                row = run(config)
            print(f"{config.name}, softmax keeping its input: {row['predicted_mib']:,.0f} MiB "
                  f"({row['error_pct']:+.2f}%)", flush=True)
    else:
        main()
