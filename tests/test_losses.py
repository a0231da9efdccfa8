"""The chunked causal-LM loss: the model's own loss and gradients, a lower peak by at least the logits it never
holds, predicted to the byte, clear refusals, and the user's model and batch left as they were. Device: cpu (the
exact counter; fake tensors for the prediction), no GPU needed; small transformers models built from configs
(random weights, nothing downloaded)."""

import functools

import pytest
import torch
from torch import nn

import gpukit
from gpukit.estimate import predict
from gpukit.losses import chunked_causal_lm_loss
from gpukit.step import Technique, resolve_loss, train_step

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning:transformers.*")

VOCAB, ROWS, LENGTH = 1024, 8, 32
TOKENS = ROWS * LENGTH                       # 256 tokens, flattened
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def causal_lm(model_class=None, config_class=None, **settings):
    torch.manual_seed(0)
    config = (config_class or transformers.LlamaConfig)(**SIZES, **settings)
    return (model_class or transformers.LlamaForCausalLM)(config)


llama = causal_lm
gemma2 = functools.partial(causal_lm, transformers.Gemma2ForCausalLM, transformers.Gemma2Config, head_dim=16)
cohere = functools.partial(causal_lm, transformers.CohereForCausalLM, transformers.CohereConfig)


def text_batch():
    """A tokenizer's output: every second sequence ends in 8 padding tokens (masked, and left out of the loss)."""
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[::2, -8:] = 0
    return transformers.BatchEncoding({"input_ids": ids, "attention_mask": mask,
                                       "labels": ids.masked_fill(mask == 0, -100)})


def chunked(chunk_tokens):
    return functools.partial(chunked_causal_lm_loss, chunk_tokens=chunk_tokens)


def gradients(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def assert_close_in_float32(value, reference):
    """Equal but for float32 sums taken in another order (chunks, then their sum): a few units of roundoff of
    the reference's scale (float32's unit is 1.2e-7; 1e-5 leaves room for the sums' lengths)."""
    scale = reference.abs().max().item()
    assert torch.allclose(value, reference, rtol=1e-5, atol=1e-6 * scale), (value - reference).abs().max().item()


@pytest.mark.parametrize("make", [llama, gemma2, cohere], ids=["llama", "gemma2-softcapped", "cohere-logit-scale"])
def test_the_loss_and_every_gradient_are_the_models_own(make):
    """Chunks that divide the 256 tokens (64), that do not (100: 56 left in the last) and one larger than all;
    Gemma 2 soft-caps its logits (final_logit_softcapping), Cohere scales them (logit_scale)."""
    model, batch = make(), text_batch()
    reference = model(**batch).loss
    reference.backward()
    expected = gradients(model)
    for chunk_tokens in (64, 100, 4 * TOKENS):
        model.zero_grad(set_to_none=True)
        value = chunked_causal_lm_loss(model, batch, chunk_tokens=chunk_tokens)
        value.backward()
        assert value.dtype == torch.float32 and value.dim() == 0
        assert_close_in_float32(value.detach(), reference.detach())
        assert_close_in_float32(gradients(model), expected)


@pytest.mark.parametrize("technique", [Technique(), Technique("ckpt + accumulate", checkpointed=True, accumulate=2)],
                         ids=lambda t: t.name)
def test_train_step_gives_the_gradients_of_the_models_own_loss(technique):
    """As train_step's loss, under its techniques too: the model's own checkpointing around the body, the batch
    cut into micro-batches (each the mean of its own tokens, for either loss)."""
    batch, grads = text_batch(), []
    for loss in ("model", chunked(100)):
        model = llama()
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, technique, loss=loss)
        grads.append(gradients(model))
    assert_close_in_float32(grads[1], grads[0])


CHUNK = 64
LOSSES = {"plain": "model", "chunked": chunked(CHUNK)}
ONE_LOGITS_COPY_LESS_A_CHUNK = (TOKENS - CHUNK) * VOCAB * 4      # float32 bytes: 768 KiB of the 1 MiB logits


def second_run_measured(run):
    """``run(model, optimizer, batch)`` once (gradients and AdamW's state then exist, as in training), then
    measured; what it returns (a loss and its graph) lives until the measurement ends."""
    model, batch = llama(), text_batch()
    optimizer = torch.optim.AdamW(model.parameters())
    run(model, optimizer, batch)
    with gpukit.measure("cpu", record=False) as measured:
        returned = run(model, optimizer, batch)
    del returned
    return measured


def test_the_chunked_forward_keeps_no_logits_for_backward():
    """What a loss's forward leaves for backward (``delta``: allocated at its end less at its start). The plain
    loss keeps its log-softmax, tokens x vocabulary x 4 bytes (cross-entropy's backward reads it); the chunked
    one keeps no tensor as wide as the vocabulary: each chunk's checkpoint keeps its inputs, views of the hidden
    states and the labels, which the plain loss keeps too (for its output embedding's and its cross-entropy's
    backward). Claimed, with a chunk's worth to spare: (tokens - chunk) x vocabulary x 4 bytes less. Without the
    checkpoints it would keep every chunk's log-softmax, as much as the plain loss."""
    kept = {name: second_run_measured(lambda m, o, b: resolve_loss(loss)(m, b)).delta
            for name, loss in LOSSES.items()}
    assert kept["plain"] - kept["chunked"] >= ONE_LOGITS_COPY_LESS_A_CHUNK, kept


def test_the_chunked_step_peaks_lower_by_at_least_the_logits_it_never_holds_and_is_predicted_to_the_byte():
    """The bound, from the sizes alone (not from a measured figure): while the plain step's cross-entropy takes
    the log-softmax of its float32 logits, the logits and the log-softmax both exist, tokens x vocabulary x 4
    bytes each, over what the chunked step holds at the same point of its loss (the body's saved activations,
    the weights, AdamW's state), where it has chunk x vocabulary of each: 2 x (tokens - chunk) x vocabulary x 4
    bytes more. Both steps peak about there, at the end of the forward with every activation saved: the logits,
    16 times as wide as the hidden states (vocabulary 1024, hidden size 64), are the step's largest tensors.
    Claimed: half of that, one logits copy, (tokens - chunk) x vocabulary x 4 bytes; the other half is margin
    for the chunked step's backward, which holds a chunk's logits, log-softmax and their gradients at once, and
    the output embedding's gradient."""
    steps = {name: functools.partial(train_step, loss=loss) for name, loss in LOSSES.items()}
    peaks = {name: second_run_measured(step).peak for name, step in steps.items()}
    assert peaks["plain"] - peaks["chunked"] >= ONE_LOGITS_COPY_LESS_A_CHUNK, peaks
    predicted = predict(llama, torch.optim.AdamW, text_batch, steps["chunked"])
    assert predicted.step_peak == peaks["chunked"] and not predicted.lower_bound


class NoBody(nn.Module):
    """An output embedding but no body that gives last hidden states."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 8)

    def get_output_embeddings(self):
        return self.head


@pytest.mark.parametrize("chunk_tokens", [0, -64, 64.0, True, "64"])
def test_a_chunk_that_is_not_a_whole_number_of_tokens_is_refused(chunk_tokens):
    with pytest.raises(ValueError, match=r"chunk_tokens must be a whole number of tokens >= 1"):
        chunked_causal_lm_loss(llama(), text_batch(), chunk_tokens=chunk_tokens)


@pytest.mark.parametrize("make, batch, match", [
    (llama, lambda: {k: v for k, v in text_batch().items() if k != "labels"}, r"with 'labels'.*keys \['attention"),
    (llama, lambda: tuple(text_batch().values()), r"with 'labels'.*a tuple"),
    (lambda: transformers.LlamaModel(transformers.LlamaConfig(**SIZES)), text_batch,
     r"output embedding \(lm_head\); LlamaModel.get_output_embeddings\(\) gives none"),
    (functools.partial(causal_lm, transformers.GraniteForCausalLM, transformers.GraniteConfig, logits_scaling=8.0),
     text_batch, r"logits_scaling=8.0.*Supported: .*logit_scale.*final_logit_softcapping"),
    (NoBody, text_batch, r"NoBody.base_model\(...\) gave no last_hidden_state"),
], ids=["no-labels", "tuple-batch", "no-output-embedding", "logits-scaling", "no-body"])
def test_what_cannot_be_computed_is_refused_saying_why(make, batch, match):
    with pytest.raises(ValueError, match=match):
        chunked_causal_lm_loss(make(), batch())


def modules_state(model):
    """Per module: its hooks, its training flag and whether its forward is patched (an instance attribute)."""
    return {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks), m.training, "forward" in vars(m))
            for name, m in model.named_modules()}


def test_the_users_model_and_batch_are_left_as_they_were():
    """Through train_step, plain and with gpukit's checkpointing (which turns transformers' own on and off)."""
    model, batch = llama(), text_batch()
    model.eval()                                            # a flag the loss must not turn back to training
    model.model.layers[0].register_forward_hook(lambda module, args, output: None)
    before = modules_state(model)
    weights = [p.detach().clone() for p in model.parameters()]
    tensors = dict(batch.items())
    values = {k: v.clone() for k, v in tensors.items()}
    for technique in (Technique(), Technique(checkpointed=True)):
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, technique, loss=chunked(100))
    assert type(batch) is transformers.BatchEncoding and list(batch) == list(tensors)
    assert all(batch[k] is tensors[k] and torch.equal(batch[k], values[k]) for k in tensors)
    assert modules_state(model) == before
    assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters()))
