"""The step as a GPU user writes it names CUDA (``model.cuda()``, ``x.to("cuda")``, ``device="cuda"``) and reads values
from tensors (``loss.item()`` to log it): predicted for a card, it is the same step as its device-agnostic twin.

Device: the CPU, predicting for a card (``predict(device="cuda")``, ``card="t4"``, ``predict_offload``, ``plan()``)
on fake tensors; no GPU is used or needed. A CPU-only PyTorch refuses every CUDA device named; the prediction puts the
device that stands for the card in its place (gpukit.cudadevice), so each figure must equal, to the byte, that of the
same step written without a device: the same tensors, made in the same order. The refusal of a CPU prediction is
tested as a machine without a GPU sees it (``torch.cuda.is_available()`` False).
"""

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpukit._torch import DataDependentOutputException
from gpukit.cudadevice import CudaDevices, names_cuda
from gpukit.estimate import layer_table, predict
from gpukit.offload import predict_offload
from gpukit.plan import Techniques, plan

B, D = 256, 128


def make_model(device=None):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D, device=device), nn.ReLU(), nn.Linear(D, 10, device=device))


def adamw(params):
    return torch.optim.AdamW(params)


def make_batch():
    return torch.randn(B, D), torch.randint(0, 10, (B,))


def step(model, optimizer, batch):
    x, y = batch
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


# Each spelling of CUDA: (make_model, make_batch, step), the rest as the device-agnostic ones above.
SPELLINGS = {
    "model.cuda()": (lambda: make_model().cuda(), make_batch, step),
    "model.to('cuda')": (lambda: make_model().to("cuda"), make_batch, step),
    "model.to(device=torch.device('cuda', 0))": (lambda: make_model().to(device=torch.device("cuda", 0)),
                                                 make_batch, step),
    "nn.Linear(..., device='cuda')": (lambda: make_model("cuda"), make_batch, step),
    "x.cuda(non_blocking=True)": (make_model, lambda: tuple(t.cuda(non_blocking=True) for t in make_batch()), step),
    "x.pin_memory().to(0)": (make_model, lambda: tuple(t.pin_memory().to(0) for t in make_batch()), step),
    "torch.randn(..., device='cuda:0')": (make_model, lambda: (torch.randn(B, D, device="cuda:0"),
                                                               torch.randint(0, 10, (B,), device="cuda:0")), step),
    "the step's x.to('cuda', non_blocking=True)": (
        make_model, make_batch, lambda m, o, b: step(m, o, tuple(t.to("cuda", non_blocking=True) for t in b))),
    "with torch.device('cuda') in make_model": (lambda: _built_under(torch.device("cuda")), make_batch, step),
}


def _built_under(device):
    with device:
        return make_model()


def events(p) -> list[tuple]:
    """The simulated allocator's events, each storage named by the order of its allocation (its key is an id, which
    a later storage may take again once it is freed)."""
    names: dict = {}
    out = []
    for e in p.allocator_events:
        if e[0] == "a":
            names[e[1]] = len(out)
        out.append((e[0], names[e[1]], *e[2:]))
    return out


def figures(p) -> tuple:
    return p.peak, p.before_step, p.reserved_peak, p.workspaces, events(p), p.unverified_ops


@pytest.mark.parametrize("spelling", list(SPELLINGS))
@pytest.mark.parametrize("card", [None, "t4"])
def test_a_step_that_names_cuda_is_predicted_as_its_device_agnostic_twin(spelling, card):
    model, batch, its_step = SPELLINGS[spelling]
    twin = predict(make_model, adamw, make_batch, step, device="cuda", card=card)
    assert figures(predict(model, adamw, batch, its_step, device="cuda", card=card)) == figures(twin)
    assert twin.device == "cuda" and twin.unverified_ops == {}


@pytest.mark.parametrize("spelling", ["model.cuda()", "x.pin_memory().to(0)",
                                      "the step's x.to('cuda', non_blocking=True)"])
def test_predict_offload_puts_what_names_cuda_on_its_simulated_gpu(spelling):
    model, batch, its_step = SPELLINGS[spelling]
    twin = predict_offload(make_model, adamw, make_batch, step, card="t4")
    p = predict_offload(model, adamw, batch, its_step, card="t4")
    assert (p.device_peak, p.device_state, p.host_peak) == (twin.device_peak, twin.device_state, twin.host_peak)


def test_plan_takes_factories_that_name_cuda():
    techniques = Techniques(precisions=["float32"], accumulate=[1, 2], lora=False, implementations=False)
    twin = plan(make_model, adamw, make_batch, "2GB", card="t4", techniques=techniques, verify=False)
    p = plan(lambda: make_model().cuda(), adamw, lambda: tuple(t.to("cuda") for t in make_batch()), "2GB", card="t4",
             techniques=techniques, verify=False)
    assert [(r.candidate, r.need, r.verdict) for r in p.rows] == [(r.candidate, r.need, r.verdict) for r in twin.rows]
    assert p.choice is not None and p.choice.need == twin.choice.need


@pytest.mark.parametrize("moved", ["cuda", "cpu", torch.float64], ids=["cuda", "cpu", "float64"])
def test_plan_takes_a_factory_that_moves_or_converts_its_model(moved):
    """``model.to(...)`` of a fake model swaps its parameters (nn.Module._apply, always for a FakeTensor), which
    torch refuses for a tensor with weak references; plan()'s facts now build the model as predict() does
    (gpukit.factories.swappable_fakes)."""
    techniques = Techniques(precisions=["float32"], accumulate=[1], lora=False, implementations=False)
    batch = (lambda: tuple(t.double() if t.is_floating_point() else t for t in make_batch())) \
        if moved is torch.float64 else make_batch
    p = plan(lambda: make_model().to(moved), adamw, batch, "2GB", card="t4", techniques=techniques, verify=False)
    assert p.choice is not None


def test_plan_verifies_a_step_that_names_cuda_on_the_cpu_of_a_machine_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU (this one, in CI)
    techniques = Techniques(precisions=["float32"], accumulate=[1], lora=False, implementations=False)
    p = plan(lambda: make_model().cuda(), adamw, lambda: tuple(t.cuda() for t in make_batch()), "2GB", card="t4",
             techniques=techniques)
    assert p.verification.ran and p.verification.fitted, p.verification


def test_a_block_on_the_simulated_card_that_names_cuda_is_the_same_block():
    import gpukit

    peaks = []
    for spelled in (False, True):
        cuda = gpukit.SimulatedCuda("t4")
        try:
            with gpukit.on_card(cuda):
                model = make_model().cuda() if spelled else make_model()
                x, y = (t.cuda(non_blocking=True) for t in make_batch()) if spelled else make_batch()
                F.cross_entropy(model(x), y).backward()
                del model, x, y
            peaks.append((cuda.max_memory_allocated(), cuda.max_memory_reserved()))
        finally:
            cuda.close()
    assert peaks[0] == peaks[1] and peaks[0][0] > 0


def test_a_layer_table_of_a_model_built_on_cuda_is_the_same():
    assert layer_table(lambda: make_model().cuda(), lambda: torch.randn(2, D, device="cuda")) == \
        layer_table(make_model, lambda: torch.randn(2, D))


def test_a_cpu_prediction_of_a_step_written_for_a_gpu_says_to_predict_for_a_card(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU (this one, in CI)
    for model, batch, its_step in (SPELLINGS["model.cuda()"], SPELLINGS["torch.randn(..., device='cuda:0')"]):
        with pytest.raises(RuntimeError, match=r"predict\(\) for the CPU met .*naming.*device='cuda', or card='t4'"):
            predict(model, adamw, batch, its_step)
    # nothing is left half-done: the next prediction is the same as one made before
    assert figures(predict(make_model, adamw, make_batch, step)) == \
        figures(predict(make_model, adamw, make_batch, step))


def test_cuda_is_named_by_any_spelling_and_only_cuda():
    for device in ("cuda", "cuda:1", " cuda ", torch.device("cuda"), torch.device("cuda", 2), 0, 3):
        assert names_cuda(device), device
    for device in ("cpu", "meta", torch.device("cpu"), "mps", None, True, torch.float16):
        assert not names_cuda(device), device
    with pytest.raises(ValueError, match="'cpu' or 'meta'"):
        CudaDevices("cuda")


def test_a_copy_asked_for_is_still_a_copy_and_other_devices_are_left_alone():
    with torch._subclasses.fake_tensor.FakeTensorMode(), CudaDevices("cpu"):
        x = torch.zeros(4)
        assert x.cuda() is x and x.to("cuda") is x and x.to("cpu") is x and x.pin_memory() is x
        copied = x.to("cuda", copy=True)
        assert copied is not x and copied.device.type == "cpu"
        assert x.to("meta").device.type == "meta" and x.to(torch.float16).dtype == torch.float16


def log(model, optimizer, batch, seen):
    """The plain step, then what a training loop does with its loss: log it, skip the step on NaN, count."""
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if not torch.isnan(loss):
        optimizer.step()
    optimizer.zero_grad()
    seen.append(loss.item())


def test_values_the_step_reads_are_made_up_as_a_healthy_steps_and_named():
    seen = []
    p = predict(make_model, adamw, make_batch, lambda m, o, b: log(m, o, b, seen), card="t4")
    twin = predict(make_model, adamw, make_batch, step, card="t4")
    assert seen == [1.0, 1.0]  # the warm-up step's and the measured one's
    assert p.made_up == {"bool": 2, "float": 2}
    assert (p.peak, p.before_step, p.reserved_peak) == (twin.peak, twin.before_step, twin.reserved_peak)
    assert not p.lower_bound and "truth values read in the step" in p.unfollowed
    assert "values made up in the step" in repr(p) and twin.made_up == {}


def test_predict_offload_makes_up_the_values_the_step_reads_too():
    seen = []
    p = predict_offload(make_model, adamw, make_batch, lambda m, o, b: log(m, o, b, seen), card="t4")
    twin = predict_offload(make_model, adamw, make_batch, step, card="t4")
    assert seen == [1.0, 1.0] and p.made_up == {"bool": 2, "float": 2} and twin.made_up == {}
    assert (p.device_peak, p.device_state, p.host_peak) == (twin.device_peak, twin.device_state, twin.host_peak)
    assert "truth values read in the step" in p.unfollowed


def test_an_integer_the_step_reads_makes_the_prediction_a_lower_bound():
    """(A count of the batch's labels would be read as it is: the labels' values are followed, gpukit.fakecheck;
    the model's outputs have none.)"""
    def step_counting(model, optimizer, batch):
        x, y = batch
        out = model(x)
        right = int((out.argmax(1) == y).sum().item())  # a count read back, which may size what follows
        (F.cross_entropy(out, y, reduction="sum") / max(right, 1)).backward()
        optimizer.step()
        optimizer.zero_grad()

    p = predict(make_model, adamw, make_batch, step_counting, device="cuda")
    assert p.made_up == {"int": 2} and p.lower_bound and "integers read in the step" in p.unverified_ops


def test_a_value_a_library_reads_in_the_step_is_refused_naming_the_librarys_line():
    def step_with_gaussian_nll(model, optimizer, batch):
        x, _ = batch
        out = model(x)
        F.gaussian_nll_loss(out, torch.zeros_like(out), torch.ones_like(out)).backward()  # it checks var >= 0
        optimizer.step()

    with pytest.raises(RuntimeError, match=r"functional\.py:\d+ \(gaussian_nll_loss\) reads a value from a fake "
                                           r"tensor.*your own step reads \(loss\.item\(\)\) are made up") as raised:
        predict(make_model, adamw, make_batch, step_with_gaussian_nll, card="t4")
    # still fake tensors' own error, which code that meets them catches (bench/layer_coverage.py did, and crashed)
    assert isinstance(raised.value, DataDependentOutputException)
    with pytest.raises(DataDependentOutputException, match="gaussian_nll_loss"):
        predict_offload(make_model, adamw, make_batch, step_with_gaussian_nll, card="t4")


def test_torch_cudas_own_calls_in_the_step_run_as_the_simulated_card_can(monkeypatch):
    """synchronize() orders nothing on the simulated card; empty_cache() is named (the prediction keeps its cached
    blocks, so reserved memory may be above the card's); a read the card does not answer (memory_stats()) says where
    the figures are."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU (this one, in CI)
    synchronize, empty_cache = torch.cuda.synchronize, torch.cuda.empty_cache

    def timed(model, optimizer, batch):
        torch.cuda.synchronize()
        step(model, optimizer, batch)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        other = threading.Thread(target=torch.cuda.empty_cache)  # another thread's: torch's own, not counted
        other.start()
        other.join()

    twin = predict(make_model, adamw, make_batch, step, card="t4")
    p = predict(make_model, adamw, make_batch, timed, card="t4")
    assert figures(p) == figures(twin) and p.unfollowed["torch.cuda.empty_cache()"].startswith("called 2 time(s)")
    offloaded = predict_offload(make_model, adamw, make_batch, timed, card="t4")
    assert "torch.cuda.empty_cache()" in offloaded.unfollowed

    def reporting(model, optimizer, batch):
        step(model, optimizer, batch)
        print(torch.cuda.memory_stats()["allocated_bytes.all.peak"])

    with pytest.raises(RuntimeError, match=r"torch.cuda.memory_stats\(\) in a step predicted for a card.* is not "
                                           r"answered \(the simulated card answers memory_allocated\(\), .*p.peak"):
        predict(make_model, adamw, make_batch, reporting, card="t4")
    # torch's own functions are back, outside the prediction and on every thread
    assert torch.cuda.synchronize is synchronize and torch.cuda.empty_cache is empty_cache


@pytest.mark.parametrize("on_a_gpu_machine", [False, True])
def test_the_memory_a_step_logs_is_the_predicted_cards_at_that_moment(monkeypatch, on_a_gpu_machine):
    """Device: cpu, predicting for a T4; and as on a machine with a GPU of its own (torch.cuda.is_available()), where
    the step's reads are still the predicted card's, not that GPU's. A step that resets the peaks, trains, and logs
    torch.cuda's figures, as a training loop on Colab does, is predicted as its twin that logs nothing; and what it
    logged in the measured step is the prediction: the peak since its reset is p.peak, what stays allocated is what
    the step starts with, the reserved peak p.reserved_peak. Without a reset the peak runs from the process's start
    (the warm-up's included). predict_offload answers for the GPU's side the same way."""
    if on_a_gpu_machine:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    logged = []

    def logging(model, optimizer, batch, reset=True):
        if reset:
            torch.cuda.reset_peak_memory_stats()
        step(model, optimizer, batch)
        logged.append((torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(0),
                       torch.cuda.memory_reserved(device="cuda"), torch.cuda.max_memory_reserved()))

    twin = predict(make_model, adamw, make_batch, step, card="t4")
    p = predict(make_model, adamw, make_batch, logging, card="t4")
    assert figures(p) == figures(twin)
    assert len(logged) == 2 and logged[1] == (p.before_step, p.peak, p.reserved_peak, p.reserved_peak)
    logged.clear()
    q = predict(make_model, adamw, make_batch, lambda *a: logging(*a, reset=False), card="t4")
    assert figures(q) == figures(twin) and logged[1][1] == max(logged[0][1], p.peak)
    logged.clear()
    offloaded = predict_offload(make_model, adamw, make_batch, logging, card="t4")
    assert logged[1][:3] == (offloaded.device_state, offloaded.device_peak, offloaded.reserved_peak)
