"""plan()'s QLoRA candidate: a transformers model's Linear weights in 4-bit NF4 (bitsandbytes), prepared by peft and
trained through LoRA adapters. Its need is predicted under fake tensors with bitsandbytes' own quantization and
checked, to the byte, against real steps on this CPU (bitsandbytes 0.50 runs Linear4bit's forward and backward
here): the plan's own verification, and the printed recipe, which loads the model with from_pretrained and a
BitsAndBytesConfig. Small Llama built from a config (nothing downloaded)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

import gpukit
from gpukit.estimate import state_bytes
from gpukit.lessons.data import digit_tokens_batch
from gpukit.lessons.models import GPTConfig, TinyGPT
from gpukit.plan import Candidate, Techniques, plan
from gpukit.plan.facts import quantization_state_bytes, quantization_state_of
from gpukit.plan.steps import with_qlora
from gpukit.step import resolve_loss

pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed here")
pytest.importorskip("peft", reason="peft is not installed here")
pytest.importorskip("transformers", reason="transformers is not installed here")
from test_bigmodel import adamw, hf_step, llama, text_batch  # noqa: E402
from test_plan_bounds import search_for  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
DEVICE = "cpu"
CASE = (llama, adamw, lambda: text_batch(2, 12))
QLORA = Candidate("yours: AdamW", lora=True, qlora=True)


@pytest.fixture(scope="module")
def lora_misses():
    """The plan under one byte less than LoRA needs (QLoRA's need below it), verified by a real step; and QLoRA's
    need as the search predicts it alone."""
    search = search_for(CASE, DEVICE, precisions=("float32",), accumulate=[1], checkpointing=False,
                        implementations=False, loss=resolve_loss("model"), lora=True)
    lora, qlora = search.evaluate(Candidate("yours: AdamW", lora=True)), search.evaluate(QLORA)
    p = plan(*CASE, lora.need - 1, device=DEVICE, loss="model", alternatives=0, techniques=Techniques(
        precisions=("float32",), accumulate=[1], checkpointing=False, implementations=False))
    return p, qlora, search


def test_where_lora_misses_the_budget_qlora_is_chosen_and_a_real_step_measures_its_need(lora_misses):
    """Device: cpu. LoRA over float32 weights misses the budget by a byte, QLoRA fits: it is chosen, its numerics
    say it trains another model, and one real step of it on this CPU (bitsandbytes' CPU kernels) under the budget
    measures what was predicted, to the byte, its quantization state counted on both sides."""
    p, qlora, _ = lora_misses
    choice = p.choice
    assert choice.candidate == QLORA and choice.candidate.label == "QLoRA (NF4 weights)"
    assert choice.need == qlora.need == choice.peak and not choice.lower_bound  # (a CPU plan: allocated)
    v = p.verification
    assert v.ran and v.fitted and v.measured_peak == choice.peak, v.message
    cells = choice.cells(p.budget, p.device)
    assert cells["numerics"] == ("a different model: 4-bit frozen base, trained adapters (NF4 weights, "
                                 "bitsandbytes; peft LoRA)")
    assert cells["libraries"] == "PyTorch + bitsandbytes + peft"
    assert "bitsandbytes' own quantize_4bit under fake tensors" in choice.how
    assert "of their quantization state (absmax, code: not parameters" in choice.how


def test_the_quantization_state_from_the_layers_shapes_is_what_bitsandbytes_holds(lora_misses):
    """Device: cpu. What the prediction adds for the quantization state (from the shapes: a float32 absmax per 64
    weights, a 16-value code per layer) is what the layers bitsandbytes made hold; each packed weight holds half a
    byte an element; the output layer stays a float32 nn.Linear."""
    _, _, search = lora_misses
    shapes = search.facts.qlora_shapes
    assert len(shapes) == 2 * 7 and search.facts.model_class == "transformers.LlamaForCausalLM"
    model = with_qlora(llama())
    import bitsandbytes as bnb

    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert sorted(m.weight.untyped_storage().nbytes() * 2 for m in quantized) == sorted(shapes)
    assert quantization_state_of(model) == quantization_state_bytes(shapes) == 14 * (512 + 512)
    assert type(model.base_model.model.lm_head) is nn.Linear and model.base_model.model.lm_head.weight.dtype == \
        torch.float32


def wide_llama():
    torch.manual_seed(0)  # 33.6 M weights quantized: 134 MB in float32, far more than a step's transient blocks
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=1024, intermediate_size=4096, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def test_on_cuda_the_qlora_need_is_reserved_memory_once_the_cache_is_emptied_as_peft_does(monkeypatch):
    """Device: none (an H100's rules, fake tensors). On CUDA the need is the simulated allocator's reserved memory,
    which holds the quantization state (its blocks were placed), after the float32 weights were quantized and the
    cache emptied, as prepare_model_for_kbit_training empties CUDA's: without the emptying the float32 weights'
    cached blocks would stay reserved, more than half of their bytes above it, for the same allocated peak."""
    from gpukit.allocator.caching import CachingAllocator

    case = (wide_llama, adamw, lambda: text_batch(2, 12))
    options = dict(precisions=("float32",), accumulate=[1], checkpointing=False, implementations=False,
                   loss=resolve_loss("model"), lora=True)
    row = search_for(case, "cuda", **options).evaluate(QLORA)
    assert row.peak <= row.reserved == row.need  # (no context allowance)
    assert "cache is emptied as peft's prepare_model_for_kbit_training does" in row.how
    monkeypatch.setattr(CachingAllocator, "empty_cache", lambda self: None)
    search = search_for(case, "cuda", **options)
    kept = search.evaluate(QLORA)
    float32_weights = 4 * sum(search.facts.qlora_shapes)
    assert kept.peak == row.peak and kept.reserved > row.reserved + float32_weights // 2, (kept.reserved, row.reserved)


def test_the_printed_qlora_recipe_loads_the_model_in_4_bit_and_its_step_needs_what_was_predicted(lora_misses,
                                                                                                 tmp_path,
                                                                                                 monkeypatch):
    """Device: cpu. The recipe, pasted as printed (its checkpoint saved from make_model() and loaded by
    from_pretrained with the BitsAndBytesConfig, on the CPU), trains two steps; a third step of its model and
    optimizer, measured by gpukit's counter, peaks at what the plan predicted, to the byte."""
    p, _, _ = lora_misses
    code = p.code
    assert "BitsAndBytesConfig(\n    load_in_4bit=True, bnb_4bit_quant_type='nf4', " \
           "bnb_4bit_compute_dtype=torch.bfloat16)" in code
    assert "LlamaForCausalLM.from_pretrained(checkpoint, device_map={'': 'cpu'}" in code
    assert "prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)" in code
    monkeypatch.chdir(tmp_path)
    scope = {"make_model": llama, "loader": [text_batch(2, 12), text_batch(2, 12)]}
    exec(code, scope)
    del scope["loss"], scope["micro"], scope["batch"]  # the loop's last loss, its graph freed by backward
    model, optimizer, batch = scope["model"], scope["optimizer"], text_batch(2, 12)
    assert all(int(st["step"]) == 2 for st in optimizer.state.values()) and optimizer.state
    with gpukit.measure(DEVICE, record=False) as report:
        hf_step(model, optimizer, batch)
    measured = state_bytes(model, optimizer, batch)[0] + report.peak + quantization_state_of(model)
    assert measured == p.choice.peak


def test_qlora_is_tried_only_for_a_transformers_model_where_bitsandbytes_is_installed(monkeypatch):
    """Device: none (facts read under fake tensors). A model that is not a transformers one (its recipe loads it
    with from_pretrained) gets no QLoRA candidate, nor the Llama where bitsandbytes is not installed; a QLoRA
    candidate without LoRA is refused."""
    x, y = digit_tokens_batch(8)
    gpt = search_for((lambda: TinyGPT(GPTConfig(n_layer=2, n_embd=32, n_head=2)), adamw, lambda: (x, y)), DEVICE,
                     lora=True)
    assert gpt.facts.lora_targets and not any(c.qlora for c in gpt.candidates())
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    without = search_for(CASE, DEVICE, lora=True, loss=resolve_loss("model"))
    assert any(c.lora for c in without.candidates()) and not any(c.qlora for c in without.candidates())
    with pytest.raises(ValueError, match="lora=True"):
        Candidate("yours: AdamW", qlora=True)
