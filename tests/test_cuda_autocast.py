"""torch.autocast("cuda") under a prediction for a GPU runs CUDA autocast's op lists (gpukit.cuda_autocast).

Device: none. The ops run on fake CPU tensors; each list of torch's include/ATen/autocast_mode.h is read from the
installed header and every op of it is run, with the dtype CUDA autocast gives it checked against the list's policy.
"""

import contextlib

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import gpukit.cuda_autocast as ca
from gpukit.estimate import predict

POLICY = ca.cuda_policy()
NO_CPU_KERNEL = {  # CUDA-only ops: no CPU kernel nor meta function runs them here (they are registered all the same)
    "aten::cudnn_convolution", "aten::cudnn_convolution_transpose", "aten::_thnn_fused_gru_cell",
}


def t(*shape, dtype=None):
    return torch.rand(*shape, dtype=dtype or DTYPE[0]) + 0.5


def long(*shape, high=4):
    return torch.randint(0, high, shape)


DTYPE = [torch.float32]  # the floating inputs' dtype, set per list


def img(*rest, dtype=None):
    return t(1, 2, *rest, dtype=dtype)


def conv(n):
    return img(*[4] * n), t(2, 2, *[3] * n)


SAMPLES = {  # op -> its positional arguments (built inside the fake mode); every other op takes (x,) or (x, x)
    "aten::_convolution.deprecated": lambda: (*conv(2), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, False, False,
                                               True),
    "aten::_convolution": lambda: (*conv(2), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, False, False, True, True),
    "aten::convolution": lambda: (*conv(2), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
    "aten::conv1d": lambda: conv(1), "aten::conv2d": lambda: conv(2), "aten::conv3d": lambda: conv(3),
    "aten::conv_transpose1d": lambda: conv(1), "aten::conv_transpose2d.input": lambda: conv(2),
    "aten::conv_transpose3d.input": lambda: conv(3),
    "aten::conv_tbc": lambda: (t(5, 1, 2), t(3, 2, 2), t(2)),
    "aten::prelu": lambda: (t(2, 4), t(4)),
    "aten::addmv": lambda: (t(4), t(4, 4), t(4)), "aten::addr": lambda: (t(4, 4), t(4), t(4)),
    "aten::mv": lambda: (t(4, 4), t(4)),
    "aten::einsum": lambda: ("ij,jk->ik", [t(4, 4), t(4, 4)]),
    "aten::chain_matmul": lambda: ([t(4, 4), t(4, 4)],), "aten::linalg_multi_dot": lambda: ([t(4, 4), t(4, 4)],),
    "aten::addbmm": lambda: (t(4, 4), t(2, 4, 4), t(2, 4, 4)), "aten::baddbmm": lambda: (t(2, 4, 4),) * 3,
    "aten::bmm": lambda: (t(2, 4, 4),) * 2,
    "aten::_thnn_fused_lstm_cell": lambda: (t(4, 16), t(4, 16), t(4, 4), t(16), t(16)),
    "aten::lstm_cell": lambda: (t(4, 4), [t(4, 4), t(4, 4)], t(16, 4), t(16, 4)),
    "aten::gru_cell": lambda: (t(4, 4), t(4, 4), t(12, 4), t(12, 4)),
    "aten::rnn_tanh_cell": lambda: (t(4, 4), t(4, 4), t(4, 4), t(4, 4)),
    "aten::rnn_relu_cell": lambda: (t(4, 4), t(4, 4), t(4, 4), t(4, 4)),
    "aten::_scaled_dot_product_flash_attention": lambda: (t(1, 2, 4, 8),) * 3,
    "aten::scaled_dot_product_attention": lambda: (t(1, 2, 4, 8),) * 3,
    "aten::pow.Tensor_Scalar": lambda: (t(4, 4), 2), "aten::pow.Scalar": lambda: (2, t(4, 4)),
    "aten::layer_norm": lambda: (t(4, 4), [4]), "aten::rms_norm": lambda: (t(4, 4), [4]),
    "aten::native_layer_norm": lambda: (t(4, 4), [4], None, None, 1e-5),
    "aten::group_norm": lambda: (img(4, 4), 2),
    "aten::frobenius_norm.dim": lambda: (t(4, 4), [1]), "aten::nuclear_norm.dim": lambda: (t(4, 4), [0, 1]),
    "aten::cosine_embedding_loss": lambda: (t(4, 4), t(4, 4), t(4)),
    "aten::nll_loss": lambda: (t(4, 4), long(4)), "aten::nll_loss2d": lambda: (t(1, 4, 2, 2), long(1, 2, 2)),
    "aten::multilabel_margin_loss": lambda: (t(4, 4), long(4, 4)),
    "aten::multi_margin_loss": lambda: (t(4, 4), long(4)),
    "aten::renorm": lambda: (t(4, 4), 2, 0, 1.0), "aten::logsumexp": lambda: (t(4, 4), [0]),
    "aten::poisson_nll_loss": lambda: (t(4, 4), t(4, 4), True, False, 1e-8, 1),
    "aten::upsample_nearest1d": lambda: (img(4), [8]), "aten::_upsample_nearest_exact1d": lambda: (img(4), [8]),
    "aten::upsample_nearest2d": lambda: (img(4, 4), [8, 8]),
    "aten::_upsample_nearest_exact2d": lambda: (img(4, 4), [8, 8]),
    "aten::upsample_nearest3d": lambda: (img(4, 4, 4), [8, 8, 8]),
    "aten::_upsample_nearest_exact3d": lambda: (img(4, 4, 4), [8, 8, 8]),
    "aten::upsample_linear1d": lambda: (img(4), [8], False),
    "aten::upsample_bilinear2d": lambda: (img(4, 4), [8, 8], False),
    "aten::_upsample_bilinear2d_aa": lambda: (img(4, 4), [8, 8], False),
    "aten::upsample_trilinear3d": lambda: (img(4, 4, 4), [8, 8, 8], False),
    "aten::upsample_bicubic2d": lambda: (img(4, 4), [8, 8], False),
    "aten::_upsample_bicubic2d_aa": lambda: (img(4, 4), [8, 8], False),
    "aten::prod.dim_int": lambda: (t(4, 4), 0), "aten::softmax.int": lambda: (t(4, 4), 0),
    "aten::log_softmax.int": lambda: (t(4, 4), 0), "aten::cumprod": lambda: (t(4, 4), 0),
    "aten::cumsum": lambda: (t(4, 4), 0), "aten::linalg_matrix_norm": lambda: (t(4, 4), 1),
    "aten::sum.dim_IntList": lambda: (t(4, 4), [0]),
    "aten::norm.Scalar": lambda: (t(4, 4), 2), "aten::norm.ScalarOpt_dim": lambda: (t(4, 4), 2, [0]),
    # promote: the first input float32, the others in the lower precision
    "aten::bilinear": lambda: (t(4, 3, dtype=torch.float32), t(4, 5), t(2, 3, 5)),
    "aten::cross": lambda: (t(4, 3, dtype=torch.float32), t(4, 3), 1),
    "aten::dot": lambda: (t(4, dtype=torch.float32), t(4)), "aten::vdot": lambda: (t(4, dtype=torch.float32), t(4)),
    "aten::grid_sampler": lambda: (img(4, 4, dtype=torch.float32), t(1, 4, 4, 2), 0, 0, False),
    "aten::index_put": lambda: (t(4, 4, dtype=torch.float32), [long(2)], t(2, 4)),
    "aten::tensordot": lambda: (t(4, 4, dtype=torch.float32), t(4, 4), [1], [0]),
    "aten::scatter_add": lambda: (t(4, 4, dtype=torch.float32), 0, long(4, 4), t(4, 4)),
    "aten::binary_cross_entropy": lambda: (t(4, 4) - 0.5, t(4, 4) - 0.5),
}
for _op in ("addcdiv", "addcmul", "atan2"):
    SAMPLES[f"aten::{_op}"] = (lambda n: lambda: (t(4, 4, dtype=torch.float32),) + (t(4, 4),) * (n - 1))(
        3 if _op.startswith("addc") else 2)
INPUT = {"lower_precision_fp": torch.float32, "fp32": torch.float16, "fp32_set_opt_dtype": torch.float16,
         "fp32_append_dtype": torch.float16, "promote": torch.float16, "banned": torch.float16}
EXPECTED = {"lower_precision_fp": torch.float16, "fp32": torch.float32, "fp32_set_opt_dtype": torch.float32,
            "fp32_append_dtype": torch.float32, "promote": torch.float32}


def run(qualname: str, cast: str, cuda: bool):
    """The op under autocast (float16) on fake CPU tensors, with CUDA's policy or CPU autocast's: the dtype of its
    (first) output, or the error it raised."""
    DTYPE[0] = INPUT[cast]
    op = ca._overload(qualname)
    with FakeTensorMode():
        args = SAMPLES.get(qualname, lambda: (t(4, 4),) * sum(
            1 for a in op._schema.arguments if str(a.type) == "Tensor" and not a.has_default_value()))()
        try:
            with ca.CudaAutocast() if cuda else contextlib.nullcontext(), \
                    torch.autocast("cpu", dtype=torch.float16):
                out = op(*args)
        except RuntimeError as e:
            return str(e)
    return (out[0] if isinstance(out, (tuple, list)) else out).dtype


def test_the_header_lists_every_op_cuda_autocast_has_a_kernel_for():
    """The lists read from the installed header, with the ops autocast_mode.cpp adds, are exactly the ops the
    dispatcher holds an AutocastCUDA kernel for in this torch; and CPU autocast's own kernels are back afterwards."""
    assert POLICY is not None, f"torch installs no {ca.HEADER}"
    assert set(POLICY) == set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))
    assert {cast for cast in POLICY.values()} == set(INPUT)
    before = ca.cpu_autocast_ops()
    with ca.CudaAutocast():
        pass
    assert ca.cpu_autocast_ops() == before
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.ones(2, 2).softmax(0).dtype == torch.float32 and torch.mv(torch.ones(2, 2), torch.ones(2)).dtype \
            == torch.float32 and (torch.ones(2, 2) @ torch.ones(2, 2)).softmax(0).dtype == torch.bfloat16


@pytest.mark.parametrize("cast", [c for c in INPUT if c != "banned"])
def test_every_op_of_a_header_list_runs_in_the_dtype_its_policy_gives(cast):
    """Each op of the list, fed float32 (lower_precision_fp) or float16 inputs (the float32 lists; promote: float32
    mixed with float16) under autocast to float16, gives float16 (lower_precision_fp) or float32 (the others), as
    CUDA autocast does; and CPU autocast's lists alone differ on some op of every list."""
    ops = sorted(q for q, c in POLICY.items() if c == cast and q not in NO_CPU_KERNEL)
    assert ops
    wrong = {q: got for q in ops if (got := run(q, cast, cuda=True)) != EXPECTED[cast]}
    assert not wrong, wrong
    assert any(run(q, cast, cuda=False) != EXPECTED[cast] for q in ops)


def test_binary_cross_entropy_raises_cudas_error_under_autocast():
    """autocast_mode.cpp bans binary_cross_entropy for CUDA (CPU autocast runs it in float32)."""
    assert "unsafe to autocast" in run("aten::binary_cross_entropy", "banned", cuda=True)
    assert run("aten::binary_cross_entropy", "banned", cuda=False) == torch.float32


def test_the_header_is_parsed_by_its_macros():
    text = ("#define AT_FORALL_LOWER_PRECISION_FP(_) \\\n  _(mm) \\\n  _(conv_transpose2d, input)\n"
            "#define AT_FORALL_FP32(_) \\\n  _(pow, Tensor_Scalar)\n#define AT_FORALL_FP32_SET_OPT_DTYPE(_) \\\n"
            "  _(sum)\n#define AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(_) \\\n  _(ADD_NS(norm), \\\n"
            '    "norm.Scalar", \\\n    Tensor(const Tensor&, const Scalar&), \\\n    fp32_append_dtype)\n'
            "#define AT_FORALL_PROMOTE(_) \\\n  _(dot)\n_(not_a_list_entry)\n")
    assert ca.parse_header(text) == {
        "aten::mm": "lower_precision_fp", "aten::conv_transpose2d.input": "lower_precision_fp",
        "aten::pow.Tensor_Scalar": "fp32", "aten::sum": "fp32_set_opt_dtype", "aten::norm.Scalar": "fp32_append_dtype",
        "aten::dot": "promote"}
    with pytest.raises(ValueError, match="AT_FORALL_PROMOTE"):
        ca.parse_header(text.split("#define AT_FORALL_PROMOTE")[0])


def softmax_step(device_type: str, dtype: torch.dtype):
    def step(model, optimizer, batch):
        with torch.no_grad(), torch.autocast(device_type, dtype=dtype):
            model(batch[0]).softmax(-1)
    return step


@pytest.mark.parametrize("dtype, extra", [(torch.float16, 4 - 2), (torch.bfloat16, 4 + 4 - 2)])
def test_a_predicted_softmax_under_cuda_autocast_is_float32_and_copies_its_input_only_in_bfloat16(dtype, extra):
    """Device: none (predict for an H100 against the CPU's own rules). A 1024 x 1024 Linear's output under autocast,
    then softmax: CUDA autocast runs softmax in float32 (AT_FORALL_FP32_SET_OPT_DTYPE), and SoftMax.cpp reads a
    float16 input as it is (``_softmax(input, dim, half_to_float=true)`` on CUDA) but copies a bfloat16 one to
    float32 first. The softmax is the step's peak: above CPU autocast's (output in the lower precision, 2 bytes an
    element) by 2 bytes an element in float16 and by 6 in bfloat16, the workspaces aside."""
    n = 1024
    make = (lambda: nn.Linear(n, n), lambda q: torch.optim.SGD(q, lr=0.1), lambda: (torch.randn(n, n),))
    cuda = predict(*make, softmax_step("cuda", dtype), card="h100", breakdown=False)
    cpu = predict(*make, softmax_step("cpu", dtype), device="cpu", breakdown=False)
    assert not cuda.lower_bound, cuda.unverified_ops
    assert cuda.peak - cuda.workspaces - cpu.peak == n * n * extra  # (a multiple of the 512-byte block)


def test_without_the_header_cpu_autocasts_lists_run_and_are_named(monkeypatch):
    """Device: none. A torch installed without its headers (or with lists of another layout): the step's autocast
    runs CPU autocast's lists, and the prediction says so and is a lower bound."""
    monkeypatch.setattr(ca, "cuda_policy", lambda: None)
    n = 256
    make = (lambda: nn.Linear(n, n), lambda q: torch.optim.SGD(q, lr=0.1), lambda: (torch.randn(n, n),))
    p = predict(*make, softmax_step("cuda", torch.float16), card="h100", breakdown=False)
    assert p.lower_bound and "could not be read" in p.unverified_ops["autocast"]


def test_an_interrupted_prediction_puts_cpu_autocasts_own_kernels_back():
    """Device: none. Ctrl-C inside the step's autocast region: the prediction stops, and CPU autocast runs its own
    lists again (softmax stays in bfloat16 on the CPU)."""
    def step(model, optimizer, batch):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(batch[0]).softmax(-1)
            raise KeyboardInterrupt

    before = ca.cpu_autocast_ops()
    with pytest.raises(KeyboardInterrupt):
        predict(lambda: nn.Linear(8, 8), lambda q: torch.optim.SGD(q, lr=0.1), lambda: (torch.randn(4, 8),), step,
                card="t4", breakdown=False)
    assert ca.cpu_autocast_ops() == before
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).softmax(0).dtype == torch.bfloat16


@pytest.mark.parametrize("softmax", ["softmax", "log_softmax"])
def test_a_small_float16_softmax_to_float32_is_checked_against_the_cpus_stand_in(softmax):
    """Device: none. At sizes small enough for gpukit.fakecheck to run each op for real, CUDA's float16-to-float32
    softmax (half_to_float, which the CPU kernel refuses) and its backward are checked against the same computation
    on the CPU, in float32: the prediction runs, nothing is flagged, and the gradient reaches the weights."""
    def step(model, optimizer, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            out = getattr(model(batch[0]), softmax)(-1)
        assert out.dtype == torch.float32
        out.sum().backward()
        assert model.weight.grad is not None

    p = predict(lambda: nn.Linear(8, 8), lambda q: torch.optim.SGD(q, lr=0.1), lambda: (torch.randn(4, 8),), step,
                card="t4", breakdown=False)
    assert not p.lower_bound, p.unverified_ops
