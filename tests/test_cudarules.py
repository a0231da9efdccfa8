"""predict(..., device="cuda"): CUDA's code paths applied to a fake CPU step (gpukit.cudarules).

No GPU here: each rule is checked on the CPU against the CPU run of the same code path it stands for.
"""

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import gpukit
from gpukit.counter import round_up
from gpukit.cudarules import cublas_workspace_bytes, sdpa_backend, use_cuda_optimizer_defaults
from gpukit.estimate import predict


def wide_mlp():  # the optimizer step is the peak: big parameters, a batch of one
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def batch():
    return torch.randn(1, 256), torch.zeros(1, dtype=torch.long)


def test_cuda_adam_is_the_foreach_implementation():
    cuda = predict(wide_mlp, lambda p: torch.optim.Adam(p), batch, device="cuda")
    cpu_foreach = predict(wide_mlp, lambda p: torch.optim.Adam(p, foreach=True), batch, device="cpu")
    cpu_default = predict(wide_mlp, lambda p: torch.optim.Adam(p), batch, device="cpu")
    # (less Adam's step counters, which CUDA keeps on the host: gpukit.hoststate)
    assert cuda.peak - cuda.workspaces == cpu_foreach.peak - round_up(4) * len(list(wide_mlp().parameters()))
    assert cpu_foreach.peak != cpu_default.peak  # the two implementations make different temporaries


def test_an_explicit_choice_of_implementation_is_kept():
    params = [nn.Parameter(torch.zeros(2))]
    for kwargs in ({"foreach": False}, {"fused": True}):
        opt = torch.optim.Adam(params, **kwargs)
        assert not use_cuda_optimizer_defaults(opt)
        assert opt.param_groups[0]["foreach"] in (False, None)
    opt = torch.optim.SGD(params, lr=0.1)
    assert use_cuda_optimizer_defaults(opt) and opt.param_groups[0]["foreach"] is True


def test_matrix_products_allocate_the_cublas_and_cublaslt_workspaces(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    p = predict(wide_mlp, lambda q: torch.optim.SGD(q, lr=0.1), batch, device="cuda")
    # sm90's cuBLAS default for forward's thread and for backward's (autograd's device thread), cuBLASLt's for
    # forward's addmm (Linear with a bias); backward multiplies with mm only
    assert p.workspaces == 2 * 4096 * 1024 * 8 + 1024 * 1024
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    assert cublas_workspace_bytes() == 4096 * 1024 * 2 + 16 * 1024 * 8
    no_matmul = predict(lambda: nn.Sequential(nn.Flatten(), nn.LayerNorm(256)), lambda q: torch.optim.SGD(q, lr=0.1),
                        batch, device="cuda")
    assert no_matmul.workspaces == 0


@pytest.mark.parametrize("dtype, head, mask, kernel", [
    (torch.float16, 64, False, "flash"), (torch.bfloat16, 256, False, "flash"),
    (torch.float16, 64, True, "efficient"), (torch.float32, 64, False, "efficient"),
    (torch.float16, 264, False, "efficient"), (torch.float32, 6, False, "math"), (torch.float16, 12, True, "math"),
])
def test_the_attention_kernel_follows_sdp_utils(dtype, head, mask, kernel):
    q = torch.empty(2, 4, 16, head, dtype=dtype, device="meta")
    assert sdpa_backend(q, q, q, mask) == kernel


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(dim, 3 * dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def attention_step(model, optimizer, x):
    optimizer.zero_grad(set_to_none=True)
    model(x).backward()
    optimizer.step()


def test_memory_efficient_attention_pads_its_logsumexp_to_32_queries():
    make = (lambda: Attention(32, 4), lambda q: torch.optim.SGD(q, lr=0.1), lambda: torch.randn(64, 33, 32))
    cuda = predict(*make, attention_step, device="cuda")
    cpu = predict(*make, attention_step, device="cpu")
    assert cuda.attention_kernels == {"efficient": 2}  # warm-up step and predicted step
    # float32 logsumexp of (batch 64, heads 4, queries 33) on the CPU, padded to 64 queries on CUDA
    assert cuda.peak - cuda.workspaces - cpu.peak == round_up(64 * 4 * 64 * 4) - round_up(64 * 4 * 33 * 4)


@pytest.mark.parametrize("capability, dtype, head, mask, kernel", [
    ((7, 5), torch.float16, 64, False, "efficient"),   # a T4: no flash attention below sm80
    ((7, 5), torch.bfloat16, 64, False, "math"),       # nor bfloat16 in memory-efficient attention
    ((7, 5), torch.float32, 6, False, "efficient"),    # float32 takes no tensor cores there: alignment 1
    ((8, 0), torch.float32, 6, False, "math"),         # alignment 4 from sm80
    ((8, 0), torch.bfloat16, 64, False, "flash"), ((8, 0), torch.bfloat16, 64, True, "efficient"),
    ((8, 9), torch.bfloat16, 64, False, "flash"),      # an L4
    ((12, 2), torch.float16, 64, False, "math"),       # past the kernels' sm121
])
def test_the_attention_kernel_follows_sdp_utils_per_compute_capability(capability, dtype, head, mask, kernel):
    q = torch.empty(2, 4, 16, head, dtype=dtype, device="meta")
    assert sdpa_backend(q, q, q, mask, capability) == kernel


class AttentionOutput(Attention):
    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def amp_attention_step(model, optimizer, x):
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out.float().sum().backward()  # the sum outside autocast, in float32 as CUDA's would be
    optimizer.step()


def math_attention_step(model, optimizer, x):
    with sdpa_kernel(SDPBackend.MATH):
        amp_attention_step(model, optimizer, x)


def test_a_t4_in_bfloat16_takes_the_math_attention_and_its_attention_matrix_is_counted():
    """Device: cpu. On a T4 (sm75) no fused kernel takes bfloat16: attention.cpp's math composite runs, the same
    code on every device but MPS, which copies q, k, v to float32 and keeps the (batch, heads, queries, keys)
    matrix. The prediction for the T4 equals the step measured on this CPU with the math kernel forced; for an
    H100 (flash attention) it equals the CPU's own fused kernel, which keeps no matrix."""
    make = (lambda: AttentionOutput(64, 4), lambda q: torch.optim.AdamW(q, foreach=True),
            lambda: torch.randn(2, 256, 64))
    t4 = predict(*make, amp_attention_step, card="t4")
    h100 = predict(*make, amp_attention_step, card="h100")
    assert (t4.attention_kernels, h100.attention_kernels) == ({"math": 2}, {"flash": 2})
    assert not t4.lower_bound and t4.device == "cuda" and t4.card == "t4"
    measured = {}
    for name, step in (("math", math_attention_step), ("flash", amp_attention_step)):
        torch.manual_seed(0)
        model, x = make[0](), make[2]()
        optimizer = make[1](model.parameters())
        step(model, optimizer, x)  # gradients and AdamW's state exist, as in the prediction's warm-up
        with gpukit.measure("cpu", record=False) as report:
            step(model, optimizer, x)
        measured[name] = report.peak  # above what the step started with
    assert t4.step_peak == measured["math"] and h100.step_peak == measured["flash"]
    matrix = 2 * 4 * 256 * 256 * 4  # (batch, heads, queries, keys) in float32
    assert t4.step_peak - h100.step_peak >= matrix


def test_attention_that_takes_the_math_kernel_without_a_card_is_counted_too():
    make = (lambda: Attention(24, 4), lambda q: torch.optim.SGD(q, lr=0.1), lambda: torch.randn(4, 8, 24))
    p = predict(*make, attention_step, device="cuda")  # head dimension 6: not a multiple of 4 on sm90
    cpu = predict(*make, lambda m, o, x: _with_math(attention_step, m, o, x))
    assert p.attention_kernels == {"math": 2} and not p.lower_bound
    assert p.step_peak == cpu.step_peak


def _with_math(step, *args):
    with sdpa_kernel(SDPBackend.MATH):
        step(*args)


def test_a_card_is_a_cuda_device():
    with pytest.raises(ValueError, match="a card is a CUDA device"):
        predict(wide_mlp, lambda q: torch.optim.SGD(q, lr=0.1), batch, device="cpu", card="t4")
    with pytest.raises(ValueError, match="no GPU card 'v100'"):
        predict(wide_mlp, lambda q: torch.optim.SGD(q, lr=0.1), batch, card="v100")


def test_unknown_devices_are_refused():
    with pytest.raises(ValueError, match="'cpu' and 'cuda'"):
        predict(wide_mlp, lambda q: torch.optim.SGD(q, lr=0.1), batch, device="mps")


def test_a_backward_without_matrix_products_takes_no_second_workspace(monkeypatch):
    """A frozen Linear under a trained LayerNorm: backward stops at the LayerNorm, so only forward's thread
    takes cuBLAS handles; the same model trained throughout takes backward's too."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)

    def model(frozen):
        def make():
            m = nn.Sequential(nn.Linear(256, 10), nn.LayerNorm(10))
            m[0].requires_grad_(not frozen)
            return m
        return make

    sgd = lambda q: torch.optim.SGD(q, lr=0.1)
    frozen = predict(model(True), sgd, batch, device="cuda")
    trained = predict(model(False), sgd, batch, device="cuda")
    assert frozen.workspaces == 4096 * 1024 * 8 + 1024 * 1024
    assert trained.workspaces - frozen.workspaces == 4096 * 1024 * 8


def test_convolutions_on_cuda_are_flagged_a_lower_bound():
    """cuDNN's convolution workspace depends on the algorithm picked at run time: named, not silently left out."""
    conv = lambda: nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4 * 14 * 14, 10))
    images = lambda: (torch.randn(2, 1, 16, 16, device="cpu"), torch.zeros(2, dtype=torch.long, device="cpu"))
    sgd = lambda q: torch.optim.SGD(q, lr=0.1)
    cuda = predict(conv, sgd, images, device="cuda")
    assert cuda.lower_bound
    assert {"aten.convolution.default", "aten.convolution_backward.default"} <= set(cuda.unverified_ops)
    assert not predict(conv, sgd, images, device="cpu").lower_bound
    assert not predict(wide_mlp, sgd, batch, device="cuda").lower_bound
    # with the optimizer's state on the host too (it said nothing, and the convnet's GPU peak there missed 15%)
    from gpukit.offload import predict_offload

    offload = predict_offload(conv, sgd, images)
    assert offload.lower_bound and set(offload.unverified_ops) == set(cuda.unverified_ops)
    assert "LOWER BOUND: unchecked ops     aten.convolution.default, aten.convolution_backward.default" in repr(offload)
    assert not predict_offload(wide_mlp, sgd, batch).lower_bound


def _amp_step(model, optimizer, batch):
    from gpukit.step import Technique, train_step

    train_step(model, optimizer, batch, Technique(amp=torch.bfloat16))


def _small_batch():
    return torch.randn(16, 32), torch.randint(0, 10, (16,))


def test_an_op_cuda_autocast_runs_in_float32_is_run_in_float32_not_flagged():
    """Device: fake tensors under CUDA's rules. torch.autocast('cuda') runs layer_norm in float32
    (aten/src/ATen/autocast_mode.h, AT_FORALL_FP32), where CPU autocast leaves it in bfloat16: the prediction runs
    CUDA's lists (tests/test_cuda_autocast.py), so the float32 output is counted and nothing is flagged.
    torch.autocast and CPU autocast's kernels are as they were afterwards."""
    enter = torch.amp.autocast_mode.autocast.__enter__
    with_norm = lambda: nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 10))
    adamw = lambda q: torch.optim.AdamW(q)
    cuda = predict(with_norm, adamw, _small_batch, step=_amp_step, device="cuda")
    assert not cuda.lower_bound, cuda.unverified_ops
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.nn.functional.layer_norm(torch.ones(2, 4).bfloat16(), (4,)).dtype == torch.bfloat16
    assert torch.amp.autocast_mode.autocast.__enter__ is enter


def test_attention_dropout_in_training_runs_the_cards_fused_kernel_not_the_cpus_math_path():
    """Device: cpu, predicting a T4 and an H100. BERT trains with attention dropout 0.1. CUDA's memory-efficient and
    flash kernels take dropout and keep no mask (sdp_utils.cpp; attention.cu draws it again in backward from a philox
    seed and offset, CPU scalars outside graph capture); the CPU's flash kernel refuses dropout, and torch would
    decompose the call into the math path with its (batch, heads, queries, keys) matrices. Under a card's rules the
    step with dropout holds what the step without it holds, in the kernel the card has."""
    from transformers import AutoModelForSequenceClassification, BertConfig

    def step(model, optimizer, batch):
        model(input_ids=batch[0], labels=batch[1]).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def bert(dropout):
        config = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=128, attention_probs_dropout_prob=dropout, num_labels=2)
        return lambda: AutoModelForSequenceClassification.from_config(config)

    batch = lambda: (torch.randint(0, 512, (4, 128)), torch.randint(0, 2, (4,)))
    t4 = {d: predict(bert(d), torch.optim.AdamW, batch, step, card="t4", breakdown=False) for d in (0.0, 0.1)}
    assert t4[0.1].attention_kernels == t4[0.0].attention_kernels == {"efficient": 4}
    assert t4[0.1].peak == t4[0.0].peak
    # The CPU's own rules: with dropout the math path, which keeps each layer's 4 x 2 x 128 x 128 attention matrix.
    cpu = {d: predict(bert(d), torch.optim.AdamW, batch, step, breakdown=False) for d in (0.0, 0.1)}
    assert cpu[0.1].step_peak - cpu[0.0].step_peak >= 4 * 2 * 128 * 128 * 4


def test_a_checkpointed_forward_recomputed_in_backward_takes_the_same_attention_kernel():
    """Device: cpu, predicting a T4. A checkpoint recomputes its forward inside backward, where a torch-function mode
    is off (it is handling the backward call); the CPU would then pick another kernel than the forward did, and
    torch.utils.checkpoint refuses recomputed tensors of other shapes. With dropout (the card's fused kernel) and in
    bfloat16 (a T4's math path), the recompute takes the forward's kernel: every call is counted, the step runs."""
    from transformers import AutoModelForSequenceClassification, BertConfig

    def step(model, optimizer, batch):
        with torch.autocast("cpu", dtype=batch[2]):
            loss = model(input_ids=batch[0], labels=batch[1]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def bert():
        config = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=128, attention_probs_dropout_prob=0.1, num_labels=2)
        model = AutoModelForSequenceClassification.from_config(config)
        model.gradient_checkpointing_enable()
        return model

    for dtype, kernel in ((torch.float32, "efficient"), (torch.bfloat16, "math")):
        batch = lambda: (torch.randint(0, 512, (4, 128)), torch.randint(0, 2, (4,)), dtype)
        p = predict(bert, torch.optim.AdamW, batch, step, card="t4", breakdown=False)
        assert p.attention_kernels == {kernel: 8}  # 2 layers, forward and recompute, warm-up step and step


def test_dropout_in_training_keeps_the_fused_kernels_one_byte_mask_on_a_card():
    """Device: cpu, predicting a T4 against the CPU's own rules. On a CUDA tensor F.dropout in training with 0 < p < 1
    takes the fused native_dropout (aten/src/ATen/native/Dropout.cpp, is_fused_kernel_acceptable), whose backward
    keeps a bool mask (Dropout.cu; derivatives.yaml: native_dropout_backward(grad, result1, scale)); on a CPU tensor it
    keeps a noise tensor of the input's dtype. Here the 4096 x 4096 float32 output of the Linear is dropped out and
    the mask is live at the step's peak: the T4's peak is 4096 x 4096 x (4 - 1) bytes (48 MiB) below the CPU's, its
    workspaces aside. Without dropout (p = 0, no kernel on either device) the two are the same to the byte."""
    n = 4096
    sgd = lambda q: torch.optim.SGD(q, lr=0.1)  # plain SGD: CUDA's foreach step makes no temporaries either
    batch = lambda: (torch.randn(n, n), torch.randint(0, n, (n,)))
    for p, fewer in ((0.1, n * n * (4 - 1)), (0.0, 0)):
        model = lambda: nn.Sequential(nn.Linear(n, n), nn.Dropout(p))
        t4 = predict(model, sgd, batch, card="t4", breakdown=False)
        cpu = predict(model, sgd, batch, device="cpu", breakdown=False)
        assert cpu.peak - (t4.peak - t4.workspaces) == fewer, p


def test_the_dropout_rule_keeps_the_values_and_leaves_other_dropouts_and_the_cpu_as_they_are():
    """Device: cpu (real tensors). Under the rules F.dropout, nn.Dropout and torch.dropout in training are
    native_dropout: a bool mask kept for backward, the kept elements scaled by 1 / (1 - p), the gradient the mask
    times the scale. In-place, feature (Dropout2d) and alpha dropout take no fused kernel on CUDA and are the CPU's
    composites; so is p = 1, and eval mode and p = 0 return the input. With a device named for the GPU (meta, as the
    simulated GPU of predict_offload), the CPU's tensors (the host's) keep the CPU's dropout. Outside the rules the
    names are torch's again."""
    from gpukit.cudarules import CudaRules

    functional, torch_dropout = nn.functional.dropout, torch.dropout
    x = torch.ones(10_000, requires_grad=True)
    with CudaRules():
        outs = [nn.functional.dropout(x, 0.25), nn.Dropout(0.25)(x), torch.dropout(x, 0.25, True)]
        composite = [nn.Dropout(0.25, inplace=True)(x.clone()), nn.Dropout2d(0.25)(torch.ones(4, 8, 3, 3) * x[0]),
                     nn.AlphaDropout(0.25)(x), nn.functional.dropout(x, 1.0)]
        same = [nn.functional.dropout(x, 0.25, training=False), nn.functional.dropout(x, 0.0)]
    for y in outs:
        assert type(y.grad_fn).__name__ == "NativeDropoutBackward0"
        assert y.grad_fn._saved_result1.dtype == torch.bool
        assert torch.equal(y.unique(), torch.tensor([0.0, 1 / 0.75]))
        assert 0.2 < (y == 0).float().mean() < 0.3
        x.grad = None
        y.sum().backward()
        assert torch.equal(x.grad, y.detach())  # d(sum)/dx: the mask times the scale
    assert [type(y.grad_fn).__name__ for y in composite] == ["MulBackward0", "MulBackward0", "AddBackward0",
                                                             "MulBackward0"]
    assert all(y is x for y in same)
    with CudaRules(gpu="meta"):
        on_host = nn.functional.dropout(x, 0.25)
        on_gpu = nn.functional.dropout(torch.ones(8, device="meta", requires_grad=True), 0.25)
    assert type(on_host.grad_fn).__name__ == "MulBackward0" and on_host.grad_fn._saved_other.dtype == torch.float32
    assert type(on_gpu.grad_fn).__name__ == "NativeDropoutBackward0"
    assert nn.functional.dropout is functional and torch.dropout is torch_dropout
    assert type(nn.functional.dropout(x, 0.25).grad_fn).__name__ == "MulBackward0"  # the CPU's own, outside


def test_a_long_reduction_over_the_batch_stages_partial_sums_as_reduce_cuh_sizes_them():
    """Device: cpu. aten/src/ATen/native/cuda/Reduce.cuh, worked by hand for the bias gradient of a 4096-wide Linear
    over a batch of 8192 (sum over dim 0 of a row-major (8192, 4096) tensor) on sm90 (132 multiprocessors, 2048
    threads each): the reduced dimension is not the fastest-moving one, so outputs are vectorized by 4
    (get_output_vec_size), the block is 32 x 4 threads (512 / 4 at most), lanes split the outputs (step_output 32)
    and warps the 8192 inputs (2048 values a thread, at least 256: split across blocks too). grid.x = 4096 / 4 / 32,
    target_grid_size = 132 x (2048 / 128), ctas_per_output = max(min(ceil(target / grid.x), ceil(2048 / 16)),
    ceil(2048 / 256)); global_memory_size() = 4 (float accumulator) x 4096 outputs x ctas x block.x x 4, and
    semaphore_size() = 4 x grid.x."""
    from gpukit.cudarules import reduction_staging_blocks

    grid = 4096 // 4 // 32
    target = 132 * (2048 // (32 * 4))
    ctas = max(min(-(-target // grid), 2048 // 16), 2048 // 256)
    assert ctas == 66
    expected = [4 * 4096 * ctas * 32 * 4, 4 * grid]
    gradient = torch.empty(8192, 4096)
    assert reduction_staging_blocks(gradient, [0]) == expected  # 132 MiB and 128 bytes
    assert reduction_staging_blocks(gradient.half(), [0]) == expected  # float16 accumulates in float32 too
    assert reduction_staging_blocks(torch.empty(64, 128, 4096), [0, 1]) == expected  # coalesced into one dimension
    assert reduction_staging_blocks(gradient, [1]) == []  # along the fastest-moving dimension: not modelled
    assert reduction_staging_blocks(torch.empty(256, 4096), [0]) == []  # 64 values a thread: no split across blocks
    # a T4: 40 multiprocessors of 1024 threads; target_grid_size = 40 x (1024 / 128) = 320, ctas = 10
    assert reduction_staging_blocks(gradient, [0], (7, 5)) == [4 * 4096 * 10 * 32 * 4, 4 * grid]
    assert reduction_staging_blocks(gradient, [0], (8, 6)) is None  # the A10G's multiprocessors: not known here


def test_the_staging_buffer_is_live_in_the_predicted_step_during_the_bias_gradients_sum():
    """Device: cpu. A Linear(64, 4096) over a batch of 8192 with a mean loss: its backward's peak is the sum of the
    (8192, 4096) gradient into the bias's, during which CUDA holds the staging blocks above (Reduce.cuh,
    gpu_reduce_kernel, after the output). The CUDA step's peak is the CPU's plus those blocks, each rounded to 512
    bytes; a capability whose multiprocessors are not known names the sum as unmodelled and adds nothing."""
    from gpukit.cudarules import reduction_staging_blocks

    model = lambda: nn.Linear(64, 4096)
    sgd = lambda q: torch.optim.SGD(q, lr=0.1)  # plain SGD: CUDA's foreach step makes no temporaries either
    batch = lambda: torch.randn(8192, 64)
    step = lambda m, o, x: (o.zero_grad(), m(x).mean().backward(), o.step())
    staged = sum(round_up(n) for n in reduction_staging_blocks(torch.empty(8192, 4096), [0]))
    h100 = predict(model, sgd, batch, step, card="h100", breakdown=False)
    cpu = predict(model, sgd, batch, step, device="cpu", breakdown=False)
    assert h100.step_peak - cpu.step_peak == staged == 132 * 2**20 + 512
    a10g = predict(model, sgd, batch, step, card="a10g", breakdown=False)
    assert a10g.step_peak == cpu.step_peak
    assert "aten.sum.dim_IntList" in a10g.unverified_ops
