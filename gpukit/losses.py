"""A causal language model's loss, computed a chunk of tokens at a time so that its logits never exist whole.

    import functools
    from gpukit.losses import chunked_causal_lm_loss
    from gpukit.step import train_step
    train_step(model, optimizer, batch, loss=functools.partial(chunked_causal_lm_loss, chunk_tokens=1024))

Its one job: the loss a transformers causal LM computes itself, ``model(**batch).loss`` (transformers'
``ForCausalLMLoss``: labels shifted one token left, the last position and labels of -100 left out, cross-entropy
in float32 averaged over the tokens left in), with the same value and gradients, to float32 roundoff, but
without the (tokens x vocabulary) logits. With a big vocabulary those are the largest tensors of a step: the
logits, their float32 copy, the log-softmax saved for backward and the gradients of both in backward, each
tokens x vocabulary. Here the model's body runs as usual; then the output embedding (``lm_head``) and the
cross-entropy run on ``chunk_tokens`` tokens at a time, each chunk inside ``torch.utils.checkpoint``
(non-reentrant), which keeps only the chunk's hidden states for backward and recomputes its logits there. So
one chunk's logits exist at a time, in forward and in backward: about ``chunk_tokens x vocabulary`` times a few
bytes instead of ``tokens x vocabulary`` times a few, for one more matrix product of the output embedding
(the recomputation) in backward.

Why it is written here, in plain PyTorch: neither PyTorch nor transformers ships such a loss that runs on a
CPU. torchtune's ``CEWithChunkedOutputLoss`` chunks only the float32 upcast of logits that already exist;
Liger Kernel's fused linear cross-entropy and Apple's cut-cross-entropy are Triton kernels, GPU only. This one
runs wherever PyTorch does (and under ``gpukit.estimate.predict``'s fake tensors: it reads no values).

What the model must be: a transformers causal LM whose logits are its output embedding of its body's last
hidden states (``model.get_output_embeddings()`` of ``model.base_model(...).last_hidden_state``, as
``LlamaForCausalLM`` computes them), optionally scaled by ``config.logit_scale`` (the Cohere models) and then
soft-capped by ``config.final_logit_softcapping`` (the Gemma models), both in the logits' own dtype before the
float32 upcast, as those models do it. ``config.logits_scaling`` other than 1 is refused: Granite divides the
logits by it, HyperCLOVAX multiplies them. A head that does something else and says nothing of it in its
config (a bias added to the logits, say) cannot be seen from here: compare with ``model(**batch).loss`` once
for a new kind of model. Forward hooks of the model itself do not run (its body and output embedding are
called, not the model); the output embedding's hooks run once per chunk. In a 16-bit model its gradient is
summed over the chunks in its own dtype: a 16-bit rounding per chunk, where the plain loss has one.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100  # transformers' label for a token left out of the loss

# Config fields of a causal LM that change its logits after the output embedding: applied as the models do it
# (logit_scale: Cohere's logits * scale; final_logit_softcapping: Gemma's cap * tanh(logits / cap)), or refused.
SUPPORTED_LOGIT_SETTINGS = ("logit_scale", "final_logit_softcapping")
REFUSED_LOGIT_SETTINGS = ("logits_scaling",)


def _logits(head: nn.Module, scale: float | None, cap: float | None, hidden: torch.Tensor) -> torch.Tensor:
    logits = head(hidden)
    if scale is not None:
        logits = logits * scale
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits.float()  # float32 for the cross-entropy, as transformers' loss computes it


def _summed_cross_entropy(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                          labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_of(hidden), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def _logits_function(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``hidden states -> float32 logits`` for ``model``, as its forward computes them (see the module's
    docstring); ValueError where it cannot be done here."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None:
        raise ValueError(f"chunked_causal_lm_loss needs a causal LM with an output embedding (lm_head); "
                         f"{type(model).__name__}.get_output_embeddings() gives none")
    config = getattr(model, "config", None)
    if callable(getattr(config, "get_text_config", None)):  # a multimodal model keeps its LM's settings there
        config = config.get_text_config()
    refused = [f"{name}={getattr(config, name)!r}" for name in REFUSED_LOGIT_SETTINGS
               if getattr(config, name, None) not in (None, 1, 1.0)]  # 1: no scaling, either way
    if refused:
        raise ValueError(f"chunked_causal_lm_loss cannot compute the logits of {type(model).__name__}: its config "
                         f"sets {', '.join(refused)}, which models apply differently. Supported: logits = "
                         f"lm_head(hidden states), scaled by config.{SUPPORTED_LOGIT_SETTINGS[0]} (Cohere) and "
                         f"soft-capped by config.{SUPPORTED_LOGIT_SETTINGS[1]} (Gemma); use loss='model'")
    scale, cap = (getattr(config, name, None) for name in SUPPORTED_LOGIT_SETTINGS)
    return functools.partial(_logits, head, scale, cap)


def _check_chunk_tokens(chunk_tokens: Any) -> None:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a whole number of tokens >= 1, not {chunk_tokens!r}")


def chunked_causal_lm_loss(model: nn.Module, batch: Mapping[str, Any], chunk_tokens: int = 1024) -> torch.Tensor:
    """``model(**batch).loss`` of a transformers causal LM, computed ``chunk_tokens`` tokens at a time: the same
    value and gradients (to float32 roundoff) with one chunk's logits in memory at a time, not the whole batch's.

    A loss for ``gpukit.step.train_step`` (``loss=functools.partial(chunked_causal_lm_loss, chunk_tokens=...)``)
    or for a loop of one's own (``chunked_causal_lm_loss(model, batch).backward()``).

    Args:
        model: a transformers causal LM (``LlamaForCausalLM``, say; see the module's docstring for the heads
            supported), or a peft model of one (LoRA: its ``get_base_model()``, the adapters inside). Only called: its modules, hooks and training flag stay as they are.
        batch: the keyword arguments of the model's forward, a dict or a ``BatchEncoding``: ``input_ids``
            (or ``inputs_embeds``), optionally ``attention_mask`` and the like, and ``labels`` (-100 for a token
            left out of the loss), unshifted, as for ``model(**batch).loss``. Every key but ``labels`` goes to
            the model's body (``model.base_model``). Not changed.
        chunk_tokens: tokens (batch x sequence positions, flattened) whose logits are computed at once. The
            last chunk holds what is left.

    Returns:
        The mean cross-entropy over the tokens whose (shifted) label is not -100, a float32 scalar
        (NaN where there are none, as for transformers' own loss).

    Raises:
        ValueError: ``chunk_tokens`` not a whole number >= 1; a batch that is not a mapping or has no
            ``labels``; a model without an output embedding, whose config sets ``logits_scaling`` (other than 1),
            or whose ``base_model`` returns no ``last_hidden_state``.
    """
    _check_chunk_tokens(chunk_tokens)
    if callable(getattr(model, "get_base_model", None)):  # a peft model: the transformers model, adapters inside
        model = model.get_base_model()
    if not isinstance(batch, Mapping) or "labels" not in batch:
        keys = f"keys {sorted(batch)}" if isinstance(batch, Mapping) else f"a {type(batch).__name__}"
        raise ValueError(f"chunked_causal_lm_loss needs a batch of keyword arguments with 'labels' (as for "
                         f"model(**batch).loss); it got {keys}")
    return _AS_ONE_MODULE_CALL(model, batch, _logits_function(model), chunk_tokens)


class _OneModuleCall(nn.Module):
    """The loss as one module call, as ``model(**batch).loss`` is one. PyTorch's MemTracker (gpukit's memory by
    role: ``predict``, ``measure(model=...)``) takes a module called again outside any other for the start of
    the next micro-batch and drops what it tracked of the one before: the output embedding, called once per
    chunk, runs inside this module for that. It holds nothing (what it needs comes as arguments): one serves
    every call."""

    def forward(self, model: nn.Module, batch: Mapping[str, Any], logits_of: Callable[[torch.Tensor], torch.Tensor],
                chunk_tokens: int) -> torch.Tensor:
        body = getattr(model, "base_model", None)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        outputs = body(**inputs) if isinstance(body, nn.Module) and body is not model else None
        hidden = getattr(outputs, "last_hidden_state", None)
        if not isinstance(hidden, torch.Tensor):
            raise ValueError(f"chunked_causal_lm_loss needs the last hidden states of the model's body: "
                             f"{type(model).__name__}.base_model(...) gave no last_hidden_state")
        del outputs  # the body's other outputs (a cache, say) need not live through the loss
        # Shifted as transformers' ForCausalLMLoss shifts them: position i predicts token i + 1; the last, none.
        labels = F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[..., 1:].to(hidden.device).reshape(-1)
        hidden = hidden.reshape(labels.numel(), hidden.shape[-1])
        total = sum(checkpoint(_summed_cross_entropy, logits_of, h, y, use_reentrant=False)
                    for h, y in zip(hidden.split(chunk_tokens), labels.split(chunk_tokens)))
        return total / (labels != IGNORE_INDEX).sum()


_AS_ONE_MODULE_CALL = _OneModuleCall()


__all__ = ["chunked_causal_lm_loss", "IGNORE_INDEX", "SUPPORTED_LOGIT_SETTINGS", "REFUSED_LOGIT_SETTINGS"]
