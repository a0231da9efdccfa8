"""Models as their users train them: transformers models built from small configs (random weights, nothing
downloaded), the loss computed by the model from a dict batch. Device: cpu (the exact counter; fake tensors for
the predictions), no GPU needed."""

import copy

import pytest
import torch

import gpukit
from gpukit.estimate import predict
from gpukit.step import Technique, train_step

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning:transformers.*")


def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def vit():  # its weights are drawn with trunc_normal_, which reads values while the model is built
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=128, num_labels=10)
    return transformers.ViTForImageClassification(config)


def text_batch(n=8, length=32, padded=True):
    """A tokenizer's output: half the sequences end in 8 padding tokens (masked, and left out of the loss)."""
    ids = torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[::2, -8:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return transformers.BatchEncoding({"input_ids": ids, "attention_mask": mask, "labels": labels})


def image_batch(n=8):
    g = torch.Generator().manual_seed(1)
    return {"pixel_values": torch.randn(n, 3, 32, 32, generator=g), "labels": torch.randint(0, 10, (n,), generator=g)}


def hf_step(model, optimizer, batch):
    train_step(model, optimizer, batch, loss="model")


@pytest.mark.parametrize("make, make_batch", [(llama, text_batch), (vit, image_batch)], ids=["llama", "vit"])
def test_a_transformers_step_is_predicted_to_the_byte_and_leaves_the_users_model_training(make, make_batch):
    model, batch = make(), make_batch()
    optimizer = torch.optim.AdamW(model.parameters())
    hf_step(model, optimizer, batch)                      # gradients and AdamW's state exist, as in training
    with gpukit.measure("cpu", record=False) as measured:
        hf_step(model, optimizer, batch)
    predicted = predict(make, torch.optim.AdamW, make_batch, hf_step)
    assert predicted.step_peak == measured.peak and not predicted.lower_bound
    # The same from the user's own model, which must train as before afterwards.
    before = [p.detach().clone() for p in model.parameters()]
    assert predict(lambda: model, torch.optim.AdamW, make_batch, hf_step).step_peak == measured.peak
    assert all(p.grad is None or type(p.grad) is torch.Tensor for p in model.parameters())
    hf_step(model, optimizer, batch)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_batch_without_padding_is_predicted_as_if_it_had_some():
    """transformers reads values of the batch in an eager step to skip building an attention mask: an all-ones
    attention mask (masking_utils._ignore_causal_mask_sdpa), position ids that show no packed sequences. Under
    fake tensors, as under torch.compile, it cannot read them (utils.import_utils.is_tracing is true for a
    FakeTensor) and builds the mask. So for such a batch the prediction is high by the masks, never low; with
    padding, as a tokenizer pads a batch, it is exact (the tests above)."""
    def unpadded():
        return text_batch(padded=False)

    model, batch = llama(), unpadded()
    optimizer = torch.optim.AdamW(model.parameters())
    hf_step(model, optimizer, batch)
    with gpukit.measure("cpu", record=False) as measured:
        hf_step(model, optimizer, batch)
    assert predict(llama, torch.optim.AdamW, unpadded, hf_step).step_peak > measured.peak
    no_mask = lambda: {k: v for k, v in unpadded().items() if k != "attention_mask"}  # noqa: E731
    assert predict(llama, torch.optim.AdamW, no_mask, hf_step).step_peak == measured.peak


def test_accumulation_cuts_every_tensor_of_a_batchencoding_and_gives_the_whole_batchs_gradients():
    batch, grads = text_batch(), []
    for k in (1, 4):
        model = llama()
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, Technique(accumulate=k), loss="model")
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    # float32 sums in another order: a few units of roundoff of the gradient's scale
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-6 * grads[0].abs().max().item())


def test_transformers_own_checkpointing_keeps_what_gpukits_keeps():
    """The recipe a plan prints checkpoints with activation_checkpointing_enable; the plan predicted gpukit's
    checkpointing of the same decoder layers: the two steps peak alike, to the byte."""
    batch, peaks = text_batch(), []
    for own in (False, True):
        model = llama()
        optimizer = torch.optim.AdamW(model.parameters())
        if own:  # activation_checkpointing_enable from transformers 5.24; gradient_checkpointing_enable before
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        technique = Technique(checkpointed=not own)
        train_step(model, optimizer, batch, technique, loss="model")
        with gpukit.measure("cpu", record=False) as report:
            train_step(model, optimizer, batch, technique, loss="model")
        peaks.append(report.peak)
        if not own:  # the step turned the model's own checkpointing on for itself, and off again after
            assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
            assert not hasattr(model, "_require_grads_hook")
    assert peaks[0] == peaks[1]


def planned_below(make, batch, fraction: float, alternatives: int):
    """The plain step's peak, and the plan on the CPU under ``fraction`` of it (its choice run for real)."""
    unlimited = gpukit.plan(make, torch.optim.AdamW, lambda: batch, budget="100GB", device="cpu", loss="model",
                            verify=False, alternatives=0)
    plain = unlimited.choice.peak
    p = gpukit.plan(make, torch.optim.AdamW, lambda: batch, budget=int(fraction * plain), device="cpu", loss="model",
                    alternatives=alternatives, techniques=gpukit.plan.Techniques(implementations=False))
    v = p.verification
    assert v.ran and v.fitted and v.measured_peak == p.choice.peak < fraction * plain
    return plain, p


def test_a_causal_lm_is_planned_without_a_wrapper_and_its_recipe_runs_as_printed():
    batch = text_batch()
    _, p = planned_below(llama, batch, 0.85, alternatives=1)
    assert "model(**micro).loss" in p.code and "F.cross_entropy" not in p.code.split("for batch")[1]
    scope = {"make_model": llama, "loader": [copy.deepcopy(batch), copy.deepcopy(batch)]}
    exec(p.code, scope)
    trained, fresh = scope["model"], llama()
    assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), fresh.parameters()))


def test_a_vision_transformer_whose_initialiser_reads_values_is_planned_and_its_choice_measured():
    """A ViT's weights are drawn with trunc_normal_, which reads values while the model is built; every model the
    planner builds under fake tensors (its facts, each bound and prediction, the optimizer states) makes them up
    as predict() does (it once stopped at the first: DataDependentOutputException). Its choice under a budget the
    plain step misses, run for real under the budget on the CPU, has the predicted peak."""
    planned_below(vit, image_batch(), 0.9, alternatives=0)


def test_a_dict_batch_without_a_loss_is_refused_saying_what_to_pass():
    with pytest.raises(ValueError, match=r"loss='model'"):
        gpukit.plan(llama, torch.optim.AdamW, text_batch, budget="1GB", device="cpu")


def test_the_technique_explorer_runs_a_transformers_model_on_its_own_loss():
    """The widget's steps on a dict batch with the model's own loss: the measured peak is the step's, checkpointing
    (transformers' own, on the decoder layers) lowers it, and the explorer's model is its own (no user object)."""
    from gpukit.widgets import TechniqueExplorer

    explorer = TechniqueExplorer(llama, lambda b: text_batch(n=b), torch.optim.AdamW, device="cpu", batch_sizes=(8,),
                                 loss="model")
    plain = explorer.run(checkpointing=False)
    checkpointed = explorer.run(checkpointing=True)
    model, batch = llama(), text_batch()
    optimizer = torch.optim.AdamW(model.parameters())
    hf_step(model, optimizer, batch)
    with gpukit.measure("cpu", record=False) as measured:
        hf_step(model, optimizer, batch)
    assert plain.peak == measured.peak and checkpointed.peak < plain.peak
    with pytest.raises(ValueError, match="loss="):
        TechniqueExplorer(llama, lambda b: text_batch(n=b), loss="the model's")
