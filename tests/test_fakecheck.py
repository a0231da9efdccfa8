"""Predictions checked against real kernels: every layer type exact or flagged, and invalid steps raising.

Every prediction here runs on fake CPU tensors and every measurement on the CPU (device="cpu").
"""

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

import gpukit.fakecheck
from gpukit.estimate import measured_step_peak, predict

spec = importlib.util.spec_from_file_location("layer_coverage", Path(__file__).parent.parent / "bench" / "layer_coverage.py")
layer_coverage = importlib.util.module_from_spec(spec)
spec.loader.exec_module(layer_coverage)
CASES = layer_coverage.cases()
UNSUPPORTED = ("GaussianNLLLoss", "CTCLoss", "optimizer ASGD")  # read values (.item()) or value-sized outputs


# One case per kernel family of the list (the whole list, 80 cases, runs in bench/layer_coverage.py: minutes).
FAMILIES = ["Bilinear", "ConvTranspose3d", "LSTM", "GRU", "LSTMCell", "MultiheadAttention", "TransformerDecoderLayer",
            "BatchNorm2d", "GroupNorm", "Embedding", "Embedding sparse=True", "EmbeddingBag max", "MaxPool3d",
            "FractionalMaxPool2d", "Dropout2d", "CrossEntropyLoss label_smoothing", "MultiLabelMarginLoss", "MSELoss"]
SAMPLE = [n for n in CASES if n.split(" + ")[0] in FAMILIES] + ["optimizer Adam foreach", "optimizer NAdam"]


def test_the_sample_names_cases_of_the_list():
    assert len(SAMPLE) == len(FAMILIES) + 2


@pytest.mark.parametrize("name", SAMPLE)
def test_every_layer_is_predicted_exactly_or_flagged_with_a_reason(name):
    make_model, make_optimizer, make_batch, step = CASES[name]
    p = predict(make_model, make_optimizer, make_batch, step)
    measured = measured_step_peak(make_model, make_optimizer, make_batch, step, device="cpu")
    assert p.peak == measured or (p.lower_bound and all(p.unverified_ops.values())), (p.peak, measured)


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith(UNSUPPORTED)])
def test_steps_that_read_values_are_refused_not_guessed(name):
    with pytest.raises(Exception, match="DataDependent|DynamicOutputShape|_local_scalar_dense|_ctc_loss"):
        predict(*CASES[name])


def lstm_case(hidden):
    def step(model, optimizer, batch):
        optimizer.zero_grad(set_to_none=True)
        model(batch)[0].pow(2).mean().backward()
        optimizer.step()

    return (lambda: nn.LSTM(16, hidden, 2, batch_first=True), lambda p: torch.optim.Adam(p),
            lambda: torch.randn(8, 20, 16), step)


def test_an_lstm_workspace_missing_from_the_fake_kernel_is_found_and_counted():
    # aten.mkldnn_rnn_layer's fake kernel returns an empty workspace; the real one does not (12.5 MB for
    # 64 -> 128 features, batch 32, sequence 50).
    p = predict(*lstm_case(32))
    assert p.corrected_ops["aten.mkldnn_rnn_layer.default"] > 0
    assert not p.lower_bound
    assert p.peak == measured_step_peak(*lstm_case(32), device="cpu")


def test_ops_too_big_to_check_make_the_prediction_a_named_lower_bound(monkeypatch):
    monkeypatch.setattr(gpukit.fakecheck, "CHECK_LIMIT", 0)
    p = predict(*lstm_case(24))  # a size no earlier check met (what was checked once stays known)
    assert p.lower_bound
    assert "too big" in p.unverified_ops["aten.mkldnn_rnn_layer.default"]
    assert "LOWER BOUND" in repr(p)
    assert p.peak < measured_step_peak(*lstm_case(24), device="cpu")  # what the check finds is really missing


def linear_step(x, y):
    return lambda: nn.Linear(4, 3), lambda p: torch.optim.SGD(p, lr=0.1), lambda: (x, y)


@pytest.mark.parametrize("x, y, error, message", [
    (torch.randn(5, 4, dtype=torch.float64), torch.zeros(5, dtype=torch.long), RuntimeError, "same dtype"),
    (torch.randn(5, 7), torch.zeros(5, dtype=torch.long), RuntimeError, r"cannot be multiplied \(5x7 and 4x3\)"),
    (torch.randn(5, 4), torch.tensor([0, 1, 2, 3, 0]), IndexError, "Target 3 is out of bounds"),
])
def test_a_step_that_fails_for_real_raises_the_real_error(x, y, error, message):
    with pytest.raises(error, match=message):
        predict(*linear_step(x, y))
    with pytest.raises(error, match=message):  # the same error as the real step on the CPU
        measured_step_peak(*linear_step(x, y), device="cpu")


def test_token_ids_out_of_range_raise_even_when_made_inside_make_batch():
    def step(model, optimizer, batch):
        model(batch).sum().backward()
        optimizer.step()

    with pytest.raises(IndexError, match="index out of range"):
        predict(lambda: nn.Embedding(10, 4), lambda p: torch.optim.SGD(p, lr=0.1),
                lambda: torch.arange(12).reshape(3, 4), step)


def test_a_prediction_leaves_the_random_state_alone():
    # Dropout and randint are run for real by the check; the user's random numbers must not move.
    def step(model, optimizer, batch):
        x, y = batch
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    predict(lambda: nn.Sequential(nn.Linear(4, 3), nn.Dropout()), lambda p: torch.optim.SGD(p, lr=0.1),
            lambda: (torch.randn(5, 4), torch.randint(0, 3, (5,))), step)
    assert torch.equal(torch.rand(3), expected)


def test_out_of_range_ids_raise_where_the_op_is_too_big_to_run(monkeypatch):
    # Embedding and loss too big to run here (more than 64 B), the ids and labels small enough to follow:
    # they are checked against the sizes they index.
    monkeypatch.setattr(gpukit.fakecheck, "CHECK_LIMIT", 64)

    def step(model, optimizer, batch):
        x, y = batch
        nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        optimizer.step()

    model = lambda: nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 7))  # noqa: E731
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    with pytest.raises(IndexError, match="index out of range"):
        predict(model, sgd, lambda: (torch.tensor([[1, 10]]), torch.tensor([[0, 1]])), step)
    with pytest.raises(IndexError, match="Target 7 is out of bounds"):
        predict(model, sgd, lambda: (torch.tensor([[1, 9]]), torch.tensor([[0, 7]])), step)
    # In range, too big to run: the embedding's output shape is known by its rule (SHAPE_RULES), so not a bound.
    assert not predict(model, sgd, lambda: (torch.tensor([[1, 9]]), torch.tensor([[-100, 6]])), step).lower_bound


def test_a_large_16_bit_structured_op_is_not_rerun_on_the_cpu(monkeypatch):
    """Device: cpu (fake tensors). A float16 matrix product of a few MiB takes seconds on a CPU without 16-bit
    arithmetic and could only look for an error: it is not run; the float32 one of the same shapes still is."""
    from gpukit.fakecheck import FakeKernelCheck

    ran = []
    real_run = FakeKernelCheck._run

    def recording(self, func, args, kwargs):
        ran.append((str(func), next((a.dtype for a in args if isinstance(a, torch.Tensor)), None)))
        return real_run(self, func, args, kwargs)

    monkeypatch.setattr(FakeKernelCheck, "_run", recording)
    FakeKernelCheck._cache.clear()  # process-wide: signatures met by other tests would not be run again
    for dtype in (torch.float16, torch.float32):
        def step(model, optimizer, batch, dtype=dtype):
            (model(batch.to(dtype)).float().sum()).backward()
            optimizer.step()

        predict(lambda dtype=dtype: nn.Linear(1024, 1024, bias=False, dtype=dtype),
                lambda p: torch.optim.SGD(p, lr=0.1), lambda: torch.randn(512, 1024), step)
    assert ("aten.mm.default", torch.float32) in ran and ("aten.mm.default", torch.float16) not in ran


@pytest.mark.parametrize("op", sorted(gpukit.fakecheck.SHAPE_RULES))
def test_each_shape_rule_is_the_real_kernels(op):
    """Device: cpu. The rules stand for real kernels too big to run here: each is checked against the real kernel
    at small sizes of several shapes (odd sizes, a batch of one, another value width)."""
    rule, aten = gpukit.fakecheck.SHAPE_RULES[op], torch.ops.aten
    calls = {
        "aten.embedding.default": [(torch.randn(50, 8), torch.randint(0, 50, shape)) for shape in [(3, 5), (7,), (1, 2, 3)]],
        "aten.embedding_dense_backward.default": [(torch.randn(*shape, 8), torch.randint(0, 50, shape), 50, -1, False)
                                                  for shape in [(3, 5), (7,)]],
        "aten.slice_backward.default": [(torch.randn(3, 2, 8), [3, 7, 8], 1, 1, 5, 2), (torch.randn(4), [9], 0, 0, 4, 1)],
        "aten.native_layer_norm.default": [(torch.randn(3, 5, 8), shape, torch.ones(shape), None, 1e-5)
                                           for shape in [[8], [5, 8]]],
        "aten.stack.default": [([torch.randn(3, 5)] * 2,), ([torch.randn(3, 5)] * 4, 1), ([torch.randn(3, 5)] * 3, -1),
                               ([torch.randn(7)], -2)],
        "aten._scaled_dot_product_flash_attention_for_cpu.default": [
            (torch.randn(b, h, q, 8), torch.randn(b, h, k, 8), torch.randn(b, h, k, v), 0.0, causal)
            for b, h, q, k, v, causal in [(2, 4, 16, 16, 8, True), (1, 3, 5, 9, 8, False)]],
    }[op]
    name, overload = op.removeprefix("aten.").rsplit(".", 1)
    func = getattr(getattr(aten, name), overload)
    for args in calls:
        real = func(*args)
        real = real if isinstance(real, tuple) else (real,)
        assert [tuple(shape) for shape in rule(args)] == [tuple(t.shape) for t in real]


def test_a_big_op_whose_outputs_have_its_inputs_shapes_or_a_known_rule_is_not_a_lower_bound(monkeypatch):
    """Device: cpu. With nothing small enough to run for real, an embedding (by its rule), casts and AdamW's foreach
    ops (their outputs mirror their inputs) leave the prediction exact; an LSTM's layer, whose workspace has a shape
    of its own, still makes it a named lower bound (the test above)."""
    monkeypatch.setattr(gpukit.fakecheck, "CHECK_LIMIT", 0)
    model = lambda: nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 100))  # noqa: E731
    adam = lambda p: torch.optim.Adam(p, foreach=True)  # noqa: E731

    def step(m, o, batch):
        o.zero_grad()
        x, y = batch
        torch.nn.functional.cross_entropy(m(x).double().flatten(0, 1), y.flatten()).backward()
        o.step()

    batch = lambda: (torch.randint(0, 100, (4, 9)), torch.randint(0, 100, (4, 9)))  # noqa: E731
    p = predict(model, adam, batch, step)
    assert not p.lower_bound, p.unverified_ops
