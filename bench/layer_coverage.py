"""Is predict() exact for every trainable layer type torch.nn ships, and for the usual optimizers?

For each case: a small model around one layer type (recurrent, convolutions 1d/2d/3d and transposed,
attention and transformer layers, normalizations, embeddings and EmbeddingBag, sparse ones too,
pooling, dropout, losses), one training step predicted under fake tensors and the same step
measured for real on the CPU (the counter of gpukit.counter), and the error. Then every optimizer
of torch.optim on one small model, the for-loop and the foreach implementations (foreach is what
CUDA runs by default). A case is "exact", or "flagged" with the reason the prediction gives
(ops it could not check against their real kernels), or "WRONG".
Writes bench/out/layer_coverage.csv.

    python3 kit.py bench layer_coverage
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

F = nn.functional
B, T, D = 8, 6, 16  # batch, sequence length, features: small, so that every op can be checked for real


def _x(*shape):
    return lambda: torch.randn(*shape)


def _classes(n, *shape):
    return lambda: torch.randint(0, n, shape)


def _ce(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _sum_sq(out, *_):
    out = out[0] if isinstance(out, tuple) else out
    return out.float().pow(2).mean()


class _Pool(nn.Module):
    """A convolution to train, then the parameter-free layer under test, then a mean."""

    def __init__(self, dims: int, layer: nn.Module, channels: int = 4) -> None:
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
        self.conv, self.layer = conv(3, channels, 3, padding=1), layer

    def forward(self, x):
        return self.layer(self.conv(x))


class _Loss(nn.Module):
    """A Linear to train; the loss under test is applied by the case."""

    def __init__(self, n_in: int = D, n_out: int = 5) -> None:
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)

    def forward(self, x):
        return self.lin(x)


class _Cell(nn.Module):
    """A recurrent cell unrolled over the sequence, as a user writes it."""

    def __init__(self, cell: nn.Module) -> None:
        super().__init__()
        self.cell = cell

    def forward(self, x):
        h, outs = None, []
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
            outs.append(h[0] if isinstance(h, tuple) else h)
        return torch.stack(outs, 1)


class _Bag(nn.Module):
    def __init__(self, **kw) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(50, D, **kw)

    def forward(self, x):
        ids, offsets = x
        return self.bag(ids, offsets)


class _Two(nn.Module):
    """A layer that takes two inputs (Bilinear, the decoder, the whole Transformer)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(*x)


class _Attention(nn.Module):
    def __init__(self, **kw) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(D, 4, batch_first=True, **kw)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


def _pair(*shapes):
    return lambda: tuple(torch.randn(*s) for s in shapes)


def _bag_batch():
    return (torch.randint(0, 50, (B * 4,)), torch.arange(0, B * 4, 4)), None


Case = tuple  # (make_model, make_inputs, make_target or None, loss(out, target))

LAYERS: dict[str, Case] = {
    "Linear": (lambda: nn.Linear(D, 5), _x(B, D), _classes(5, B), _ce),
    "Bilinear": (lambda: _Two(nn.Bilinear(D, 8, 5)), _pair((B, D), (B, 8)), _classes(5, B), _ce),
    "Conv1d": (lambda: nn.Conv1d(3, 4, 3), _x(B, 3, 20), None, _sum_sq),
    "Conv2d": (lambda: nn.Conv2d(3, 4, 3, padding=1), _x(B, 3, 10, 10), None, _sum_sq),
    "Conv3d": (lambda: nn.Conv3d(3, 4, 3), _x(2, 3, 6, 6, 6), None, _sum_sq),
    "ConvTranspose1d": (lambda: nn.ConvTranspose1d(3, 4, 3, stride=2), _x(B, 3, 10), None, _sum_sq),
    "ConvTranspose2d": (lambda: nn.ConvTranspose2d(3, 4, 3, stride=2), _x(B, 3, 6, 6), None, _sum_sq),
    "ConvTranspose3d": (lambda: nn.ConvTranspose3d(3, 4, 3), _x(2, 3, 4, 4, 4), None, _sum_sq),
    "RNN": (lambda: nn.RNN(D, 24, 2, batch_first=True), _x(B, T, D), None, _sum_sq),
    "LSTM": (lambda: nn.LSTM(D, 24, 2, batch_first=True), _x(B, T, D), None, _sum_sq),
    "LSTM bidirectional": (lambda: nn.LSTM(D, 24, 1, batch_first=True, bidirectional=True), _x(B, T, D), None,
                           _sum_sq),
    "GRU": (lambda: nn.GRU(D, 24, 2, batch_first=True), _x(B, T, D), None, _sum_sq),
    "RNNCell": (lambda: _Cell(nn.RNNCell(D, 24)), _x(B, T, D), None, _sum_sq),
    "LSTMCell": (lambda: _Cell(nn.LSTMCell(D, 24)), _x(B, T, D), None, _sum_sq),
    "GRUCell": (lambda: _Cell(nn.GRUCell(D, 24)), _x(B, T, D), None, _sum_sq),
    "MultiheadAttention": (lambda: _Attention(), _x(B, T, D), None, _sum_sq),
    "TransformerEncoderLayer": (lambda: nn.TransformerEncoderLayer(D, 4, 32, batch_first=True), _x(B, T, D),
                                None, _sum_sq),
    "TransformerDecoderLayer": (lambda: _Two(nn.TransformerDecoderLayer(D, 4, 32, batch_first=True)),
                                _pair((B, T, D), (B, T, D)), None, _sum_sq),
    "Transformer": (lambda: _Two(nn.Transformer(D, 4, 1, 1, 32, batch_first=True)),
                    _pair((B, T, D), (B, T, D)), None, _sum_sq),
    "BatchNorm1d": (lambda: nn.BatchNorm1d(D), _x(B, D), None, _sum_sq),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(3), _x(B, 3, 8, 8), None, _sum_sq),
    "BatchNorm3d": (lambda: nn.BatchNorm3d(3), _x(2, 3, 4, 4, 4), None, _sum_sq),
    "LayerNorm": (lambda: nn.LayerNorm(D), _x(B, T, D), None, _sum_sq),
    "RMSNorm": (lambda: nn.RMSNorm(D), _x(B, T, D), None, _sum_sq),
    "GroupNorm": (lambda: nn.GroupNorm(2, 4), _x(B, 4, 6, 6), None, _sum_sq),
    "InstanceNorm1d": (lambda: nn.InstanceNorm1d(3, affine=True), _x(B, 3, 20), None, _sum_sq),
    "InstanceNorm2d": (lambda: nn.InstanceNorm2d(3, affine=True), _x(B, 3, 8, 8), None, _sum_sq),
    "InstanceNorm3d": (lambda: nn.InstanceNorm3d(3, affine=True), _x(2, 3, 4, 4, 4), None, _sum_sq),
    "LocalResponseNorm": (lambda: _Pool(2, nn.LocalResponseNorm(2)), _x(B, 3, 8, 8), None, _sum_sq),
    "PReLU": (lambda: nn.PReLU(3), _x(B, 3, 8, 8), None, _sum_sq),
    "Embedding": (lambda: nn.Embedding(50, D), _classes(50, B, T), None, _sum_sq),
    "Embedding sparse=True": (lambda: nn.Embedding(50, D, sparse=True), _classes(50, B, T), None, _sum_sq),
    "Embedding padding_idx": (lambda: nn.Embedding(50, D, padding_idx=0), _classes(50, B, T), None, _sum_sq),
    "EmbeddingBag mean": (lambda: _Bag(mode="mean"), lambda: _bag_batch()[0], None, _sum_sq),
    "EmbeddingBag sum": (lambda: _Bag(mode="sum"), lambda: _bag_batch()[0], None, _sum_sq),
    "EmbeddingBag max": (lambda: _Bag(mode="max"), lambda: _bag_batch()[0], None, _sum_sq),
    "EmbeddingBag sparse=True": (lambda: _Bag(mode="sum", sparse=True), lambda: _bag_batch()[0], None, _sum_sq),
    "MaxPool1d": (lambda: _Pool(1, nn.MaxPool1d(2)), _x(B, 3, 20), None, _sum_sq),
    "MaxPool2d": (lambda: _Pool(2, nn.MaxPool2d(2)), _x(B, 3, 8, 8), None, _sum_sq),
    "MaxPool3d": (lambda: _Pool(3, nn.MaxPool3d(2)), _x(2, 3, 4, 4, 4), None, _sum_sq),
    "AvgPool1d": (lambda: _Pool(1, nn.AvgPool1d(2)), _x(B, 3, 20), None, _sum_sq),
    "AvgPool2d": (lambda: _Pool(2, nn.AvgPool2d(2)), _x(B, 3, 8, 8), None, _sum_sq),
    "AvgPool3d": (lambda: _Pool(3, nn.AvgPool3d(2)), _x(2, 3, 4, 4, 4), None, _sum_sq),
    "AdaptiveAvgPool2d": (lambda: _Pool(2, nn.AdaptiveAvgPool2d(3)), _x(B, 3, 8, 8), None, _sum_sq),
    "AdaptiveMaxPool2d": (lambda: _Pool(2, nn.AdaptiveMaxPool2d(3)), _x(B, 3, 8, 8), None, _sum_sq),
    "LPPool2d": (lambda: _Pool(2, nn.LPPool2d(2, 2)), _x(B, 3, 8, 8), None, _sum_sq),
    "FractionalMaxPool2d": (lambda: _Pool(2, nn.FractionalMaxPool2d(2, output_size=3)), _x(B, 3, 8, 8), None,
                            _sum_sq),
    "Dropout": (lambda: nn.Sequential(nn.Linear(D, D), nn.Dropout(0.5)), _x(B, D), None, _sum_sq),
    "Dropout2d": (lambda: _Pool(2, nn.Dropout2d(0.5)), _x(B, 3, 8, 8), None, _sum_sq),
    "AlphaDropout": (lambda: nn.Sequential(nn.Linear(D, D), nn.AlphaDropout(0.5)), _x(B, D), None, _sum_sq),
}


def _loss_case(loss: Callable, target: Callable, n_out: int = 5) -> Case:
    return (lambda: _Loss(D, n_out), _x(B, D), target, loss)


LOSSES: dict[str, Case] = {
    "CrossEntropyLoss": _loss_case(nn.CrossEntropyLoss(), _classes(5, B)),
    "CrossEntropyLoss label_smoothing": _loss_case(nn.CrossEntropyLoss(label_smoothing=0.1), _classes(5, B)),
    "NLLLoss": _loss_case(lambda o, y: F.nll_loss(F.log_softmax(o, 1), y), _classes(5, B)),
    "MSELoss": _loss_case(nn.MSELoss(), _x(B, 5)),
    "L1Loss": _loss_case(nn.L1Loss(), _x(B, 5)),
    "SmoothL1Loss": _loss_case(nn.SmoothL1Loss(), _x(B, 5)),
    "HuberLoss": _loss_case(nn.HuberLoss(), _x(B, 5)),
    "BCELoss": _loss_case(lambda o, y: F.binary_cross_entropy(torch.sigmoid(o), y), lambda: torch.rand(B, 5)),
    "BCEWithLogitsLoss": _loss_case(nn.BCEWithLogitsLoss(), lambda: torch.rand(B, 5)),
    "KLDivLoss": _loss_case(lambda o, y: F.kl_div(F.log_softmax(o, 1), y, reduction="batchmean"),
                            lambda: torch.rand(B, 5).softmax(1)),
    "PoissonNLLLoss": _loss_case(nn.PoissonNLLLoss(), lambda: torch.rand(B, 5)),
    "GaussianNLLLoss": _loss_case(lambda o, y: F.gaussian_nll_loss(o, y, torch.ones(B, 5)), _x(B, 5)),
    "SoftMarginLoss": _loss_case(nn.SoftMarginLoss(), lambda: torch.randint(0, 2, (B, 5)).float() * 2 - 1),
    "MultiLabelSoftMarginLoss": _loss_case(nn.MultiLabelSoftMarginLoss(), lambda: torch.randint(0, 2, (B, 5))),
    "MultiMarginLoss": _loss_case(nn.MultiMarginLoss(), _classes(5, B)),
    "MultiLabelMarginLoss": _loss_case(nn.MultiLabelMarginLoss(),
                                       lambda: torch.tensor([[2, 0, -1, -1, -1]]).expand(B, 5).clone()),
    "HingeEmbeddingLoss": _loss_case(nn.HingeEmbeddingLoss(), lambda: torch.randint(0, 2, (B, 5)).float() * 2 - 1),
    "CosineEmbeddingLoss": _loss_case(lambda o, y: F.cosine_embedding_loss(o, y, torch.ones(B)), _x(B, 5)),
    "MarginRankingLoss": _loss_case(lambda o, y: F.margin_ranking_loss(o[:, 0], o[:, 1], y), lambda: torch.ones(B)),
    "TripletMarginLoss": _loss_case(lambda o, y: F.triplet_margin_loss(o, y, y.flip(0)), _x(B, 5)),
    "CTCLoss": (lambda: _Loss(D, 5), _x(T, 2, D), lambda: torch.randint(1, 5, (2, 3)),
                lambda o, y: F.ctc_loss(o.log_softmax(2), y, torch.full((2,), T), torch.full((2,), 3))),
}

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.01),
    "SGD momentum": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
    "SGD momentum foreach": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, foreach=True),
    "Adam": lambda p: torch.optim.Adam(p),
    "Adam foreach": lambda p: torch.optim.Adam(p, foreach=True),
    "Adam fused": lambda p: torch.optim.Adam(p, fused=True),
    "AdamW": lambda p: torch.optim.AdamW(p),
    "AdamW foreach": lambda p: torch.optim.AdamW(p, foreach=True),
    "AdamW amsgrad": lambda p: torch.optim.AdamW(p, amsgrad=True),
    "RMSprop": lambda p: torch.optim.RMSprop(p),
    "Adagrad": lambda p: torch.optim.Adagrad(p),
    "Adadelta": lambda p: torch.optim.Adadelta(p),
    "Adamax": lambda p: torch.optim.Adamax(p),
    "NAdam": lambda p: torch.optim.NAdam(p),
    "RAdam": lambda p: torch.optim.RAdam(p),
    "ASGD": lambda p: torch.optim.ASGD(p),
    "Rprop": lambda p: torch.optim.Rprop(p),
}
OPTIMIZER_MODEL = (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)),
                   _x(B, 3, 8, 8), _classes(5, B), _ce)


def cases() -> dict[str, tuple]:
    """name -> (make_model, make_optimizer, make_batch, step): every layer and loss with Adam (SGD for sparse
    gradients, which Adam refuses), and every optimizer on one small model."""
    out = {}
    for name, case in {**LAYERS, **LOSSES}.items():
        opt = OPTIMIZERS["SGD momentum"] if "sparse" in name else OPTIMIZERS["Adam"]
        out[f"{name} + {'sgd momentum' if 'sparse' in name else 'adam'}"] = (*_as_step(case), opt)
    for name, opt in OPTIMIZERS.items():
        out[f"optimizer {name}"] = (*_as_step(OPTIMIZER_MODEL), opt)
    return {k: (v[0], v[3], v[1], v[2]) for k, v in out.items()}


def _as_step(case: Case):
    make_model, make_inputs, make_target, loss = case

    def make_batch():
        torch.manual_seed(0)
        return make_inputs(), (make_target() if make_target else None)

    def step(model, optimizer, batch):
        x, y = batch
        optimizer.zero_grad(set_to_none=True)
        loss(model(x), y).backward()
        optimizer.step()

    return make_model, make_batch, step


def check(make_model, make_optimizer, make_batch, step) -> dict:
    """One case: predicted and measured bytes, and the verdict."""
    from gpukit.estimate import measured_step_peak, predict

    t0 = time.perf_counter()
    pred = predict(make_model, make_optimizer, make_batch, step)
    seconds = time.perf_counter() - t0
    real = measured_step_peak(make_model, make_optimizer, make_batch, step, device="cpu")
    error = (pred.peak - real) / real
    if pred.peak == real:
        verdict = "exact" + (" (flagged anyway)" if pred.lower_bound else "")
    elif pred.lower_bound:
        verdict = "flagged"
    else:
        verdict = "WRONG"
    note = "; ".join([f"{op}: {why}" for op, why in pred.unverified_ops.items()] +
                     [f"{op} corrected by +{n:,} B" for op, n in pred.corrected_ops.items()])
    return {"predicted_bytes": pred.peak, "measured_bytes": real, "error_pct": round(100 * error, 3),
            "verdict": verdict, "note": note, "predict_seconds": round(seconds, 3)}


def main() -> list[dict]:
    from results import write_csv

    rows = []
    print(f"{'case':<44}{'predicted B':>13}{'measured B':>13}{'error %':>9}  verdict", flush=True)
    for name, case in cases().items():
        try:
            result = check(*case)
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            # The step reads a value (``.item()``) or makes a tensor whose size depends on values: fake tensors
            # have no values, so there is nothing to predict with them.
            result = {"predicted_bytes": 0, "measured_bytes": 0, "error_pct": float("nan"),
                      "verdict": "unsupported", "note": f"{type(e).__name__}: {e}", "predict_seconds": 0}
        row = {"case": name, **result, "torch": torch.__version__}
        rows.append(row)
        print(f"{name:<44}{row['predicted_bytes']:>13,}{row['measured_bytes']:>13,}{row['error_pct']:>9.3f}  "
              f"{row['verdict']}  {row['note']}", flush=True)
    write_csv("layer_coverage.csv", rows)
    return rows


def summary(rows: list[dict]) -> list[str]:
    counts = {v: sum(r["verdict"].startswith(v) for r in rows) for v in ("exact", "flagged", "WRONG", "unsupported")}
    return [f"layer coverage: {len(rows)} cases, {counts['exact']} exact, {counts['flagged']} flagged, "
            f"{counts['WRONG']} wrong, {counts['unsupported']} not predictable under fake tensors"]


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
