"""The step a GPU user writes (``torch.autocast("cuda")``, a ``GradScaler``), predicted for a card as the card runs it.

Device: the CPU, predicting for a card (``predict(device="cuda")``, ``card="t4"``, ``predict_offload``) on fake
tensors; no GPU is used or needed.

The figures come from theory, for an MLP of ``L`` layers ``Linear(D, D)`` + ``ReLU`` on a batch of ``B`` rows, whose
step peaks at the start of backward (``A = B * D`` elements an activation):

* float32: the ``L`` ReLU outputs saved for backward (``L * A * 4`` bytes) and the gradients in flight.
* Autocast to a 16-bit type halves every activation saved and every gradient in flight, and adds what autocast
  casts and keeps for backward: the input's 16-bit copy (``A * 2``) and each layer's weight and bias (``L * (D * D +
  D) * 2``). What the peak holds besides differs by at most one layer's float32 weight gradient (a weight's
  gradient is made in 16 bits, then cast to float32 to accumulate).
* On a card the peak is a moment later, in the last layer's backward: the sum of its bias's gradient over the batch,
  while CUDA's reduction kernel holds its staging buffer ``S`` (gpukit.cudarules: Reduce.cuh's
  ``global_memory_size``, the same for float32 and 16-bit gradients: the accumulator is float32), over that layer's
  weight gradient in the step's type. The weight gradients halve with the rest, so the 16-bit peak is half the
  float32 one plus ``S / 2`` and what autocast keeps.
* A GradScaler keeps its scale (float32) and growth tracker (int32) from step to step: 0-dimensional tensors, one
  512-byte block each on CUDA (the allocator's smallest). Its unscale holds four more for a moment: the inverse
  scale and found_inf, and a per-device copy of each.
"""

import contextlib
import warnings

import pytest
import torch
from torch import nn

from gpukit.cards import card as card_named
from gpukit.counter import round_up
from gpukit.cudarules import reduction_staging_blocks
from gpukit.estimate import predict
from gpukit.offload import predict_offload

B, D, L = 4096, 512, 6
A = B * D
BLOCK = 512  # the CUDA caching allocator's smallest block (kMinBlockSize)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(L) for m in (nn.Linear(D, D), nn.ReLU())])


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def batch():
    return torch.randn(B, D)


def step_with(autocast=None, scaler=None):
    """The step as a GPU user writes it: forward under ``autocast`` (a function making the context), the loss
    outside it, backward through ``scaler`` where there is one."""

    def step(model, optimizer, x):
        with (autocast() if autocast is not None else contextlib.nullcontext()):
            out = model(x)
        loss = out.mean()
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()

    return step


def fp16():
    return torch.autocast("cuda", dtype=torch.float16)


def bf16():
    return torch.autocast(device_type="cuda", dtype=torch.bfloat16)


@contextlib.contextmanager
def no_warnings():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield
    assert [str(w.message) for w in seen] == []


@pytest.fixture
def no_gpu(monkeypatch):
    """A machine without a GPU, on a GPU machine too: only there does torch disable a ``GradScaler("cuda")`` or a
    ``torch.autocast("cuda")`` when made (``torch.cuda.amp.common.amp_definitely_not_available()``, which asks
    ``torch.cuda.is_available()``), and only there does the prediction take a disabled one for that; on a GPU it is
    the user's ``enabled=False``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def made_without_a_gpu(make):
    """A scaler or autocast made outside the prediction, as a script makes it at its top; torch warns there without
    a GPU (the user's own line, not the prediction's)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make()


def scaler_view(scaler) -> dict:
    """A scaler's state as comparable values (tensors by identity and value)."""
    out = {}
    for k, v in vars(scaler).items():
        if isinstance(v, torch.Tensor):
            out[k] = (id(v), v.dtype, v.tolist())
        elif k == "_per_optimizer_states":
            out[k] = {o: (s["stage"], {d: (id(t), t.tolist()) for d, t in s["found_inf_per_device"].items()})
                      for o, s in v.items()}
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("card", [None, "t4"])
def test_float16_autocast_keeps_the_activations_in_half(card):
    with no_warnings():
        full = predict(mlp, sgd, batch, step_with(), device="cuda", card=card)
        half = predict(mlp, sgd, batch, step_with(fp16), device="cuda", card=card)
    assert half.before_step == full.before_step  # autocast keeps the model's state in float32
    staged = sum(round_up(n) for n in reduction_staging_blocks(torch.empty(B, D), [0], card_named(card or "h100")
                                                               .compute_capability))
    theory = (full.step_peak + staged) // 2 + A * 2 + L * (D * D + D) * 2
    assert abs(half.step_peak - theory) <= (D * D + D) * 4
    assert full.step_peak - half.step_peak >= L * A * 2 - A * 2 - L * (D * D + D) * 2 - (D * D + D) * 4
    assert half.unverified_ops == {} and half.unfollowed == {}


@pytest.mark.parametrize("spelling", ["device_type", "torch.amp.autocast", "positional"])
def test_bfloat16_autocast_takes_what_float16_takes(spelling):
    spell = {"device_type": bf16,
             "torch.amp.autocast": lambda: torch.amp.autocast("cuda", dtype=torch.bfloat16),
             "positional": lambda: torch.autocast("cuda", torch.bfloat16)}[spelling]
    with no_warnings():
        half = predict(mlp, sgd, batch, step_with(fp16), card="t4")
        brain = predict(mlp, sgd, batch, step_with(spell), card="t4")
        full = predict(mlp, sgd, batch, step_with(), card="t4")
    assert brain.peak == half.peak < full.peak  # two bytes a value either way; a T4 emulates bfloat16


def test_cudas_default_autocast_type_is_float16():
    with no_warnings():
        default = predict(mlp, sgd, batch, step_with(lambda: torch.autocast("cuda")), device="cuda")
        half = predict(mlp, sgd, batch, step_with(fp16), device="cuda")
    assert default.peak == half.peak


@pytest.mark.skipif(not hasattr(torch.cuda.amp, "autocast"), reason="torch.cuda.amp.autocast is gone in this torch")
def test_the_deprecated_cuda_amp_autocast_is_the_cards_autocast_too():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        old = predict(mlp, sgd, batch, step_with(lambda: torch.cuda.amp.autocast(dtype=torch.float16)), device="cuda")
    # only its deprecation, which a GPU prints too; nothing about a missing GPU
    assert {w.category for w in seen} <= {FutureWarning}
    assert predict(mlp, sgd, batch, step_with(fp16), device="cuda").peak == old.peak


@pytest.mark.parametrize("make", [lambda: torch.amp.GradScaler("cuda"), lambda: torch.amp.GradScaler("cpu"),
                                  lambda: torch.amp.GradScaler()],
                         ids=["GradScaler('cuda')", "GradScaler('cpu')", "GradScaler()"])
def test_a_gradscaler_keeps_its_scale_and_growth_tracker_on_the_card(make):
    scaler = made_without_a_gpu(make)
    with no_warnings():
        plain = predict(mlp, sgd, batch, step_with(fp16), card="t4")
        scaled = predict(mlp, sgd, batch, step_with(fp16, scaler), card="t4")
    assert scaled.before_step - plain.before_step == 2 * BLOCK  # _scale and _growth_tracker
    assert scaled.peak - plain.peak >= 2 * BLOCK  # and the scaled loss, alive with them at the peak


def test_a_gradscaler_made_inside_the_step_counts_the_same():
    def step(model, optimizer, x):
        state = step.__dict__
        if "scaler" not in state:
            state["scaler"] = torch.amp.GradScaler("cuda")  # made once, at the first step, as a loop does
        step_with(fp16, state["scaler"])(model, optimizer, x)

    with no_warnings():
        inside = predict(mlp, sgd, batch, step, device="cuda")
        outside = predict(mlp, sgd, batch, step_with(fp16, made_without_a_gpu(torch.amp.GradScaler)), device="cuda")
    assert inside.peak == outside.peak
    assert inside.unfollowed == {}  # made inside, with the card there: nothing assumed


@pytest.mark.usefixtures("no_gpu")
def test_the_users_scaler_and_model_are_left_as_they_were():
    model = mlp()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    cpu_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    real = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(8, D)
    step_with(lambda: torch.autocast("cpu", dtype=torch.bfloat16), cpu_scaler)(model, real, x)  # a real step first
    model.zero_grad(set_to_none=True)
    cuda_scaler = made_without_a_gpu(lambda: torch.amp.GradScaler("cuda"))
    before = scaler_view(cpu_scaler), scaler_view(cuda_scaler)
    for scaler in (cpu_scaler, cuda_scaler):
        with no_warnings():
            predict(lambda: model, sgd, batch, step_with(fp16, scaler), card="t4")
    assert (scaler_view(cpu_scaler), scaler_view(cuda_scaler)) == before
    assert cpu_scaler.get_scale() == 1024.0 and not cuda_scaler.is_enabled()
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_get_scale_reads_a_healthy_runs_scale_inside_the_step():
    seen = []

    def step(model, optimizer, x):
        step_with(fp16, scaler)(model, optimizer, x)
        seen.append(scaler.get_scale())

    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    predict(mlp, sgd, batch, step, device="cuda")
    assert seen == [256.0, 256.0]


def _torch_as_it_was():
    """What a prediction may change while it runs, and must put back: the classes' own attributes and functions."""
    return (dict(vars(torch.amp.GradScaler)), dict(vars(torch.autocast)), dict(vars(torch.cuda.amp.autocast)),
            torch.cuda.amp.common.amp_definitely_not_available, torch.cuda.is_bf16_supported)


def test_torch_is_left_as_it_was_and_still_makes_scalers_and_autocasts():
    before = _torch_as_it_was()
    with no_warnings():
        predict(mlp, sgd, batch, step_with(fp16, torch.amp.GradScaler("cpu")), device="cuda")
    assert _torch_as_it_was() == before
    assert torch.amp.GradScaler("cpu", init_scale=2.0).get_scale() == 2.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt], ids=["raises", "interrupt"])
def test_everything_is_put_back_when_the_step_stops_half_way(error):
    scaler = torch.amp.GradScaler("cpu")
    before, state = _torch_as_it_was(), scaler_view(scaler)

    def step(model, optimizer, x):
        with fp16():
            loss = model(x).mean()
            scaler.scale(loss).backward()
            raise error("the user's bug")  # inside the autocast region, after the scaler made its scale
            # (a new exception each time: one kept by the parametrization would keep its traceback's fake tensors)

    with pytest.raises(error):
        predict(mlp, sgd, batch, step, device="cuda")
    assert _torch_as_it_was() == before
    assert scaler_view(scaler) == state
    assert not torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert not torch.is_autocast_enabled("cuda")


@pytest.mark.usefixtures("no_gpu")
def test_the_step_as_written_runs_with_its_loss_inside_autocast():
    """The loss under autocast: CUDA sums in float32 (its float32 list, AT_FORALL_FP32_SET_OPT_DTYPE) where CPU
    autocast does not; the prediction runs CUDA's lists (gpukit.cuda_autocast), so the loss is float32 and nothing is
    left to flag."""
    scaler = made_without_a_gpu(lambda: torch.amp.GradScaler("cuda"))
    losses = []

    def step(model, optimizer, x):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).sum()
        losses.append(loss.dtype)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    with no_warnings():
        p = predict(mlp, sgd, batch, step, card="t4")
    assert p.peak < predict(mlp, sgd, batch, step_with(), card="t4").peak
    assert not p.unverified_ops and not p.lower_bound and set(losses) == {torch.float32}
    assert "GradScaler('cuda') disabled when made" in p.unfollowed  # enabled=False is not told apart


@pytest.mark.usefixtures("no_gpu")
def test_an_autocast_made_before_the_prediction_without_a_gpu_is_named():
    region = made_without_a_gpu(fp16)  # torch disabled it here, for want of a GPU

    with no_warnings():
        p = predict(mlp, sgd, batch, step_with(lambda: region), device="cuda")
    assert "torch.autocast('cuda') made off" in p.unfollowed
    assert p.peak == predict(mlp, sgd, batch, step_with(), device="cuda").peak  # run as made: float32
    assert "NOT AS ON THE CARD" in repr(p)


def test_a_cpu_prediction_runs_a_cpu_gradscaler():
    scaler = torch.amp.GradScaler("cpu")
    with no_warnings():
        scaled = predict(mlp, sgd, batch, step_with(lambda: torch.autocast("cpu", dtype=torch.bfloat16), scaler))
        plain = predict(mlp, sgd, batch, step_with(lambda: torch.autocast("cpu", dtype=torch.bfloat16)))
    assert scaled.before_step - plain.before_step == 2 * BLOCK


@pytest.mark.parametrize("spelling", ["cuda", "x.device.type"])
def test_predict_offload_takes_an_autocast_step_and_names_what_meta_cannot_run(spelling):
    """The simulated GPU is ``meta``, whose tensors have no autocast: the step runs (torch refused
    ``torch.autocast("meta")``), in float32, and the prediction says so."""
    region = {"cuda": lambda x: torch.autocast("cuda", dtype=torch.float16),
              "x.device.type": lambda x: torch.autocast(x.device.type, dtype=torch.float16)}[spelling]

    def step(model, optimizer, x):
        step_with(lambda: region(x))(model, optimizer, x)

    before = _torch_as_it_was()
    with no_warnings():
        amp = predict_offload(mlp, sgd, batch, step)
        full = predict_offload(mlp, sgd, batch, step_with())
    assert "autocast on the simulated GPU" in amp.unfollowed and "NOT AS ON THE CARD" in repr(amp)
    assert amp.device_peak == full.device_peak and full.unfollowed == {}
    assert _torch_as_it_was() == before


def test_predict_offload_keeps_the_gradscalers_tensors_on_the_gpu():
    scaler = made_without_a_gpu(lambda: torch.amp.GradScaler("cuda"))
    state = scaler_view(scaler)
    with no_warnings():
        scaled = predict_offload(mlp, sgd, batch, step_with(None, scaler))
        plain = predict_offload(mlp, sgd, batch, step_with())
    assert scaled.device_state - plain.device_state == 2 * BLOCK
    assert scaled.host_state == plain.host_state
    assert scaler_view(scaler) == state


@pytest.mark.usefixtures("no_gpu")
def test_gpukits_own_train_step_takes_the_users_cuda_scaler():
    """``gpukit.step.train_step`` asks ``scaler.is_enabled()`` before a float16 step: a ``GradScaler("cuda")``
    that torch disabled where there is no GPU answers as on the card."""
    from gpukit.step import Technique, train_step

    scaler = made_without_a_gpu(lambda: torch.amp.GradScaler("cuda"))

    def loss(model, x):
        return model(x).float().pow(2).mean()

    with no_warnings():
        p = predict(mlp, sgd, batch, lambda m, o, b: train_step(m, o, b, Technique(amp=torch.float16), scaler, loss),
                    card="t4")
    assert "GradScaler('cuda') disabled when made" in p.unfollowed
    assert not scaler.is_enabled()  # as it was


@pytest.mark.parametrize("card", [None, "t4"])
def test_unscale_holds_its_inverse_scale_and_found_inf_with_their_per_device_copies(card):
    """A step whose peak is the scaler's unscale: one bias-free ``Linear(N, N)`` on a batch of one row, so the weight's
    gradient (``N * N * 4`` bytes) dwarfs every activation. ``unscale_`` (torch/amp/grad_scaler.py) holds the inverse
    scale and found_inf, and ``_MultiDeviceReplicator.get`` copies each to the gradients' device (``copy=True``):
    four 0-dimensional float32 tensors, a block each, beside the gradient and the loss the step still holds."""
    n = 1024

    def step_keeping_the_loss(scaler):
        def step(model, optimizer, x):
            loss = model(x).sum()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        return step

    with no_warnings():
        p = predict(lambda: nn.Linear(n, n, bias=False), sgd, lambda: torch.randn(1, n),
                    step_keeping_the_loss(made_without_a_gpu(lambda: torch.amp.GradScaler("cuda"))),
                    device="cuda", card=card)
    assert p.step_peak == n * n * 4 + BLOCK + 4 * BLOCK  # the gradient, the loss, the unscale's four tensors
