"""Optimizer state on the host: torchao's CPUOffloadOptimizer, and PyTorch's own recipe for it (notebook 07), each
predicted on a simulated GPU (fake tensors on 'meta') with a host (fake tensors on the CPU), the copies of a step
counted by gpukit.copies; torchao's also run for real on this CPU. Each figure is checked against its arithmetic.

The simulated GPU follows CUDA's code paths as predict(device="cuda") does; with an optimizer that keeps everything
on the GPU the two agree to the byte.

torchao is in the lessons' extra (Colab and Kaggle have it too); where it is not installed its tests are skipped."""

import pytest
import torch

import gpukit
from gpukit.counter import round_up
from gpukit.cudarules import cublas_workspace_bytes
from gpukit.estimate import predict
from gpukit.offload import cuda_stand_ins, predict_offload
from gpukit.step import train_step

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning:transformers.*")

# Llama-3.2-1B's shape (bench/plan_search.py): 1.24B parameters, vocabulary 128,256, tied embeddings.
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048, tie_word_embeddings=True,
                use_cache=False)
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def offload_optimizer():
    """torchao's class, where torchao is installed."""
    return pytest.importorskip("torchao.optim", reason="torchao is not installed here").CPUOffloadOptimizer


def llama(shape=SMALL, **options):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, **options))


def eager_llama():
    """Attention written out in the model's own ops: the CPU and the simulated GPU run the same kernels (on 'meta',
    scaled_dot_product_attention takes the math composite; on the CPU, the CPU's flash kernel)."""
    return llama(attn_implementation="eager")


def text_batch(n=8, length=32, vocab=256):
    ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def hf_step(model, optimizer, batch):
    train_step(model, optimizer, batch, loss="model")


def rounded(tensors):
    return sum(round_up(t.numel() * t.element_size()) for t in tensors)


def split(shape=SMALL, minimal_size=4096):
    """The parameters torchao offloads (at least ``minimal_size`` elements), those it keeps on the GPU, and the
    bytes of the model's buffers (the rotary embedding's frequencies), which stay on the GPU."""
    with torch.device("meta"):
        model = llama(shape)
    params = list(model.parameters())
    return ([p for p in params if p.numel() >= minimal_size], [p for p in params if p.numel() < minimal_size],
            rounded(model.buffers()))


STEP = 512  # a fused AdamW's step counter: one float32 tensor a parameter, one 512-byte block
# cuBLAS's workspaces on the GPU: one for forward's matrix products, one for backward's (autograd's device thread);
# a Llama multiplies without a bias, so no cuBLASLt one (gpukit.cudarules).
WORKSPACES = 2 * cublas_workspace_bytes()


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_the_gpu_keeps_weights_gradients_and_activations_and_the_host_four_copies_of_each_offloaded_weight(
        offload_gradients):
    """Device: meta (a simulated GPU) and cpu (the host), both fake tensors. torchao/optim/cpu_offload.py: per
    parameter of 4,096 elements or more, the host holds a copy of it and of its gradient and a fused AdamW's two
    moments and step; smaller ones keep a fused AdamW on the GPU. Each step copies each offloaded gradient to the
    host and each offloaded parameter back. With offload_gradients, the GPU frees each offloaded gradient once it
    is on the host."""
    CPUOffloadOptimizer = offload_optimizer()
    offloaded, kept, buffers = split()
    assert len(offloaded) == 12 and len(kept) == 9  # embedding, lm_head, q/o/gate/up/down; k/v and the norms
    p = predict_offload(llama, lambda ps: CPUOffloadOptimizer(ps, torch.optim.AdamW,
                                                              offload_gradients=offload_gradients), text_batch, hf_step)
    weights = rounded(offloaded) + rounded(kept)
    batch = round_up(8 * 32 * 8)  # the input ids, int64, which are the labels too
    grads = rounded(kept) + (0 if offload_gradients else rounded(offloaded))
    assert p.device_state == weights + buffers + grads + 2 * rounded(kept) + len(kept) * STEP + batch + WORKSPACES
    assert p.workspaces == WORKSPACES
    assert p.host_state == 4 * rounded(offloaded) + len(offloaded) * STEP and p.host_step_peak == 0
    offloaded_bytes = sum(t.numel() * 4 for t in offloaded)
    assert (p.copies.device_to_host, p.copies.copies_to_host) == (offloaded_bytes, len(offloaded))
    assert (p.copies.host_to_device, p.copies.copies_to_device) == (offloaded_bytes, len(offloaded))
    assert p.parameters == sum(t.numel() for t in offloaded + kept)


def test_offloading_takes_the_offloaded_weights_moments_off_the_gpu_and_lowers_its_peak():
    """Device: meta (a simulated GPU) and cpu (the host). The same model with AdamW on the GPU: its two moments of
    every weight are on the GPU (its step counters on the host, as a for-each AdamW keeps them on CUDA too), and
    nothing is copied."""
    CPUOffloadOptimizer = offload_optimizer()
    offloaded, _, _ = split()
    plain = predict_offload(llama, lambda ps: torch.optim.AdamW(ps), text_batch, hf_step)
    offload = predict_offload(llama, lambda ps: CPUOffloadOptimizer(ps, torch.optim.AdamW), text_batch, hf_step)
    assert plain.copies.total == 0
    assert plain.device_state - offload.device_state == 2 * rounded(offloaded) - 9 * STEP  # (9 fused steps stay)
    assert offload.device_peak < plain.device_peak


def test_on_this_cpu_torchaos_update_is_adamws_and_its_bytes_are_the_predictions():
    """Device: cpu, as GPU and host at once, with CUDA's streams and pinned memory stood in (cuda_stand_ins). The
    update is fused AdamW's, bit for bit (torchao steps a fused AdamW per parameter on the host, and fused AdamW
    updates each tensor on its own). The bytes the counter measures are the prediction's GPU and host together."""
    CPUOffloadOptimizer = offload_optimizer()
    batch = text_batch()
    reference = eager_llama()
    plain = torch.optim.AdamW(reference.parameters(), fused=True)
    with cuda_stand_ins():
        with gpukit.measure("cpu", record=False) as built:
            model = eager_llama()
            optimizer = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW)
            data = text_batch()
            hf_step(model, optimizer, data)
        with gpukit.measure("cpu", record=False) as stepped:
            hf_step(model, optimizer, data)
    for _ in range(2):
        hf_step(reference, plain, batch)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    predicted = predict_offload(eager_llama, lambda ps: CPUOffloadOptimizer(ps, torch.optim.AdamW), text_batch, hf_step)
    assert built.delta == predicted.device_state - predicted.workspaces + predicted.host_state  # no cuBLAS here
    assert stepped.peak == predicted.combined_step_peak


def test_torchao_refuses_a_machine_without_cuda_and_the_stand_ins_leave_torch_as_it_was():
    """Device: cpu. Without the stand-ins torchao's constructor refuses (it asks for CUDA or XPU); after them,
    torch.cuda's streams, Tensor.record_stream and torchao's question are torch's and torchao's own again, and a
    block inside another leaves the outer one standing in."""
    CPUOffloadOptimizer = offload_optimizer()
    import torchao.optim.cpu_offload as module

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: torchao runs as it is")
    before = (torch.cuda.Stream, torch.cuda.Event, torch.cuda.current_stream, torch.cuda.stream,
              module.get_available_devices)
    with pytest.raises(AssertionError, match="CUDA"):
        CPUOffloadOptimizer(llama().parameters(), torch.optim.AdamW)
    with cuda_stand_ins():
        CPUOffloadOptimizer(llama().parameters(), torch.optim.AdamW)
        assert torch.cuda.Stream is not before[0]
        stood_in = torch.cuda.Stream
        with cuda_stand_ins():  # a block inside another (plan's recipe stepped inside the user's) changes nothing
            CPUOffloadOptimizer(llama().parameters(), torch.optim.AdamW)
        assert torch.cuda.Stream is stood_in and "record_stream" in torch.Tensor.__dict__
        CPUOffloadOptimizer(llama().parameters(), torch.optim.AdamW)
    assert (torch.cuda.Stream, torch.cuda.Event, torch.cuda.current_stream, torch.cuda.stream,
            module.get_available_devices) == before
    assert "record_stream" not in torch.Tensor.__dict__
    with pytest.raises(RuntimeError, match="pin"):
        torch.empty(4, pin_memory=True)


def host_optimizer(params):
    """PyTorch's own recipe (notebook 07): a float32 copy of each weight on the host, with Adam there."""
    params = list(params)
    host = [p.detach().to("cpu").requires_grad_() for p in params]
    optimizer = torch.optim.Adam(host, lr=1e-3)
    optimizer.pairs = list(zip(host, params))
    return optimizer


def host_step(model, optimizer, batch):
    for p in model.parameters():
        p.grad = None
    model(**batch).loss.backward()
    for host, p in optimizer.pairs:
        host.grad = p.grad.to("cpu")   # the gradient to the host, freed on the GPU at once
        p.grad = None
    optimizer.step()
    with torch.no_grad():
        for host, p in optimizer.pairs:
            p.copy_(host)              # the updated weight back to the GPU


def test_pytorchs_own_host_optimizer_recipe_leaves_the_gpu_its_weights_and_costs_the_model_each_way():
    """Device: meta (a simulated GPU) and cpu (the host). Every weight's copy, gradient and two Adam moments on the
    host (and Adam's step counters, one float32 tensor each); on the GPU the weights and the batch, the gradients
    gone before the step ends. Each step copies every gradient to the host and every weight back."""
    offloaded, kept, buffers = split(minimal_size=0)
    params = offloaded + kept
    p = predict_offload(llama, host_optimizer, text_batch, host_step)
    assert p.device_state == rounded(params) + buffers + round_up(8 * 32 * 8) + WORKSPACES
    assert p.host_state == 4 * rounded(params) + len(params) * STEP
    model_bytes = sum(t.numel() * 4 for t in params)
    assert (p.copies.device_to_host, p.copies.host_to_device) == (model_bytes, model_bytes)
    assert p.copies.copies_to_host == p.copies.copies_to_device == len(params)


def test_a_llama_3_2_1b_shape_with_torchao_keeps_on_the_gpu_only_weights_gradients_and_activations():
    """Device: meta (a simulated GPU) and cpu (the host): a full-size prediction, nothing downloaded or allocated.
    With minimal_size=0 every weight is offloaded: the GPU holds the weights and gradients (and the batch) when a
    step starts; the host four float32 copies of the model; each step copies the model each way."""
    CPUOffloadOptimizer = offload_optimizer()
    offloaded, kept, buffers = split(LLAMA_1B, minimal_size=0)
    assert not kept and 1.2e9 < sum(t.numel() for t in offloaded) < 1.3e9
    p = predict_offload(lambda: llama(LLAMA_1B), lambda ps: CPUOffloadOptimizer(ps, torch.optim.AdamW, minimal_size=0),
                        lambda: text_batch(1, 256, LLAMA_1B["vocab_size"]), hf_step)
    weights = rounded(offloaded)
    assert p.device_state == 2 * weights + buffers + round_up(256 * 8) + WORKSPACES
    assert p.host_state == 4 * weights + len(offloaded) * STEP
    model_bytes = sum(t.numel() * 4 for t in offloaded)
    assert p.copies.device_to_host == p.copies.host_to_device == model_bytes
    assert p.device_step_peak > 0 and p.host_step_peak == 0
    print(p)


# Every two settings of two of card, dtype and padding meet once (4 of the 8 combinations), and so do the three
# attention kernels: flash (an H100, bfloat16, no padding), math (bfloat16 on a T4), memory-efficient (the rest).
@pytest.mark.parametrize("card,dtype,padded", [("h100", torch.float32, True), ("h100", torch.bfloat16, False),
                                               ("t4", torch.float32, False), ("t4", torch.bfloat16, True)],
                         ids=["h100-float32-padded", "h100-bfloat16-unpadded", "t4-float32-unpadded",
                              "t4-bfloat16-padded"])
def test_with_everything_on_the_gpu_the_simulated_gpu_is_predict_cudas_step_to_the_byte(card, dtype, padded):
    """Device: meta (a simulated GPU) against predict(device="cuda") on the CPU, for an H100 and a T4. A fused AdamW
    keeps everything on the GPU, its step counters too: the two predictions agree to the byte, before the step and
    at its peak, allocated and reserved (the simulated caching allocator fed the simulated GPU's storages alone, the
    host's left out), with the same attention kernels (flash, memory-efficient with the padding mask, the math one for
    bfloat16 on a T4). Without the CUDA rules the simulated device took the math kernel for every call (meta has no
    fused choice), and the for-loop optimizer instead of CUDA's foreach one."""
    def make():
        return llama().to(dtype)

    def batch():
        ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))
        if not padded:
            return {"input_ids": ids, "labels": ids}
        mask = torch.ones_like(ids)
        mask[::2, -5:] = 0
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    fused = lambda ps: torch.optim.AdamW(ps, fused=True)
    on_cpu = predict(make, fused, batch, hf_step, card=card)
    simulated = predict_offload(make, fused, batch, hf_step, card=card)
    assert (simulated.device_state, simulated.device_peak) == (on_cpu.before_step, on_cpu.peak)
    assert simulated.reserved_peak == on_cpu.reserved_peak
    assert simulated.attention_kernels == on_cpu.attention_kernels
    expected = "math" if (card, dtype) == ("t4", torch.bfloat16) else \
        "efficient" if padded or dtype == torch.float32 else "flash"
    assert set(simulated.attention_kernels) == {expected}
    assert simulated.host_state == 0 and simulated.copies.total == 0


def test_adamws_step_counters_are_on_the_host_where_cuda_keeps_them():
    """Device: meta (a simulated GPU) and cpu (the host). Left to choose, AdamW on CUDA takes the foreach
    implementation, which keeps each parameter's step counter on the host (torch/optim/adam.py ``_init_group``:
    on the parameter's device only if capturable or fused): 512 bytes a parameter that neither the simulated GPU
    nor predict(device="cuda"), with one memory, holds (gpukit.hoststate); a CPU run's one memory holds them."""
    offloaded, kept, _ = split()
    n = len(offloaded + kept)
    default = lambda ps: torch.optim.AdamW(ps)
    simulated = predict_offload(llama, default, text_batch, hf_step)
    on_cuda = predict(llama, default, text_batch, hf_step, device="cuda")
    on_cpu = predict(llama, default, text_batch, hf_step, device="cpu", breakdown=False)
    assert simulated.host_state == n * STEP
    assert (on_cuda.before_step, on_cuda.peak) == (simulated.device_state, simulated.device_peak)
    assert on_cpu.before_step - (on_cuda.before_step - on_cuda.workspaces) == n * STEP


def test_a_prediction_with_torchao_leaves_nothing_for_the_next_one():
    """Device: meta (a simulated GPU) and cpu (the host). torchao's hooks on the parameters hold the optimizer, which
    holds the parameters: a cycle through C++ that the collector cannot free. The prediction takes the hooks off its
    own model, so no fake storage outlives it and the next prediction is the same as before it. What the process held
    before it (under pytest-xdist, whatever an earlier test in this worker left, seen on an H200 with torch 2.11) is
    not the prediction's to free: the fake storages are compared before and after it."""
    import gc

    from gpukit.counter import FAKE_LEDGER

    def held():
        gc.collect()
        FAKE_LEDGER.settle()
        return dict(FAKE_LEDGER.sizes)

    CPUOffloadOptimizer = offload_optimizer()
    first = predict(llama, lambda ps: torch.optim.AdamW(ps), text_batch, hf_step, card="t4")
    before = held()
    predict_offload(llama, lambda ps: CPUOffloadOptimizer(ps, torch.optim.AdamW, minimal_size=0), text_batch, hf_step)
    left = {key: (n, FAKE_LEDGER.labels.get(key)) for key, n in held().items() if key not in before}
    assert left == {}
    again = predict(llama, lambda ps: torch.optim.AdamW(ps), text_batch, hf_step, card="t4")
    assert (again.peak, again.reserved_peak) == (first.peak, first.reserved_peak)


def test_an_unknown_card_is_refused_before_anything_is_built():
    """Device: none (the card is checked first). The error lists the cards; torch.cuda is left as it was."""
    built = []
    before = torch.cuda.Stream
    with pytest.raises(ValueError, match="t4"):
        predict_offload(lambda: built.append(1) or llama(), lambda ps: torch.optim.AdamW(ps), text_batch, hf_step,
                        card="a card nobody makes")
    assert built == [] and torch.cuda.Stream is before


@pytest.mark.parametrize("card", ["h100", "t4"])
def test_a_checkpointed_model_recomputes_its_attention_with_the_cards_kernel_on_the_simulated_gpu(card):
    """Device: meta (a simulated GPU) against predict(device="cuda") on the CPU. Backward runs without the forward's
    torch-function modes, so the forward that checkpointing recomputes there took the math composite on 'meta' and
    torch.utils.checkpoint refused its other saved tensors; the card's kernel is taken there too, and with a fused
    AdamW the two predictions agree to the byte, allocated and reserved."""
    def make():
        model = llama()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    fused = lambda ps: torch.optim.AdamW(ps, fused=True)
    on_cpu = predict(make, fused, text_batch, hf_step, card=card)
    simulated = predict_offload(make, fused, text_batch, hf_step, card=card)
    assert (simulated.device_state, simulated.device_peak, simulated.reserved_peak) == \
        (on_cpu.before_step, on_cpu.peak, on_cpu.reserved_peak)
    assert simulated.attention_kernels == on_cpu.attention_kernels


def test_dropout_on_the_simulated_gpu_keeps_the_fused_kernels_bool_mask_as_predict_for_the_card_does():
    """Device: meta (a simulated T4) against predict(card="t4") and predict(device="cpu") on the CPU. On meta, as on
    the CPU, F.dropout is the composite that keeps a noise tensor of the input's dtype; a CUDA tensor takes the fused
    native_dropout, which keeps a bool mask (aten/src/ATen/native/Dropout.cpp, is_fused_kernel_acceptable). The
    simulated GPU keeps the mask: its peak is predict's for the T4 to the byte, and 1024 x 1024 x (4 - 1) bytes below
    the CPU's own (the workspaces aside), the float32 noise tensor being live at the peak. The Linear has no bias: a
    bias's gradient, summed over the 1024 rows, would make the peak the T4's reduction staging buffer (8 MiB,
    gpukit.cudarules: Reduce.cuh's global_memory_size) and no longer the mask's."""
    n = 1024
    model = lambda: torch.nn.Sequential(torch.nn.Linear(n, n, bias=False), torch.nn.Dropout(0.1))
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)
    batch = lambda: (torch.randn(n, n), torch.randint(0, n, (n,)))
    simulated = predict_offload(model, sgd, batch, card="t4")
    t4 = predict(model, sgd, batch, card="t4", breakdown=False)
    cpu = predict(model, sgd, batch, device="cpu", breakdown=False)
    assert (simulated.device_state, simulated.device_peak) == (t4.before_step, t4.peak)
    assert cpu.peak - (simulated.device_peak - simulated.workspaces) == n * n * 3
