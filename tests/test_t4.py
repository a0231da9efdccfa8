"""The notebooks' GPU-sized steps fit a T4, the card Colab and Kaggle lend, before any GPU runs them (on the CPU,
predicted on fake tensors with the code paths CUDA takes on a T4: card="t4").

The sizes are each notebook's own: its settings cell runs here with torch told that a GPU is present, a T4
(compute capability 7.5, no bfloat16 tensor cores). Each case predicts the notebook's largest training step,
forward, backward and an Adam step (no notebook's step holds more: Adam keeps the most state), or for notebook
01 its largest evaluation (a forward that keeps its graph), and asserts that
its reserved memory at the peak (the simulated caching allocator), plus the CUDA context allowance, stays
within 90% of the T4's memory as torch reports it."""

import ast
import json
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

import gpukit
from gpukit import cudarules
from gpukit.allocator import CONTEXT_ALLOWANCE
from gpukit.estimate import predict
from gpukit.lessons.models import MLP, ConvNet

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
# A T4 has 16 GB of GDDR6; torch.cuda.get_device_properties(0).total_memory reports less, by driver and ECC:
# 15,095 MiB is the figure Colab users report, 14,930 MiB the least reported. Neither was measured here (no GPU
# has been lent to the project): the lower one is taken, the card a lesson must fit on.
T4_BYTES = 14_930 * MiB
HEADROOM = 0.9
# The cards a notebook's sizes are made for (gpukit.lessons.sizes): torch's name, the memory it reports (an H100's:
# 81,079 MiB as nvidia-smi and torch report an 80 GB HBM3 card, also not measured here) and compute capability.
CARDS = {"t4": ("Tesla T4", T4_BYTES, (7, 5)), "h100": ("NVIDIA H100 80GB HBM3", 81_079 * MiB, (9, 0))}


def code_cells(name):
    nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def gpu_settings(name, monkeypatch, card="t4"):
    """The names the notebook's settings cell (the one after the install cell) defines on a card (a T4's)."""
    device_name, total_memory, (major, minor) = CARDS[card]
    cell = code_cells(name)[1]
    assert cell.startswith("# Settings"), f"{name}: the settings cell follows the install cell"
    scope = {}
    with monkeypatch.context() as m:  # for this cell only: the predictions run on a CUDA build as on a CPU one
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
        m.setattr(torch.cuda, "get_device_name", lambda *a: device_name)  # measured_on(cuda) names the card
        m.setattr(gpukit, "warm_up", lambda *a, **k: scope.setdefault("warmed_up", []).append(a or k))
        m.setattr(torch.cuda, "get_device_properties",
                  lambda *a: SimpleNamespace(name=device_name, total_memory=total_memory, major=major, minor=minor))
        exec(cell, scope)
    assert scope["DEVICE"].type == "cuda"
    return scope


def definitions(name, cell_index, scope):
    """The classes and functions a notebook cell defines (its other statements left out), in ``scope``."""
    source = "\n".join(line for line in code_cells(name)[cell_index].splitlines() if not line.startswith("%"))
    tree = ast.parse(source)
    tree.body = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))]
    exec(compile(tree, name, "exec"), scope)
    return scope


def digits(batch):
    return lambda: (torch.randn(batch, 1, 8, 8), torch.randint(0, 10, (batch,)))


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def mlp_case(depth=None):
    """The notebook's MLP of WIDTH, at BATCH, ``depth`` layers deep (default: its DEPTH)."""
    return lambda s: ((lambda: MLP(n_in=64, width=s["WIDTH"], depth=depth or s["DEPTH"])), digits(s["BATCH"]))


def case_01(s):  # the three evaluations, the first with model.eval() alone: a forward that keeps its graph
    return (lambda: ConvNet(s["CHANNELS"]).eval()), digits(s["EVAL_BATCH"]), forward_with_graph


def forward_with_graph(model, optimizer, batch):
    """Cells 4 to 6: the output with its graph stays while the no_grad and inference_mode forwards run."""
    kept = model(batch[0])
    with torch.no_grad():
        out_no_grad = model(batch[0])
    with torch.inference_mode():
        model(batch[0])
    del kept, out_no_grad


def case_04(s):  # the deepest net, not checkpointed
    scope = definitions("05_gradient_checkpointing", 2, {**s, "nn": nn, "checkpoint_sequential": checkpoint_sequential})
    return (lambda: scope["DeepNet"](max(s["DEPTHS"]))), digits(s["BATCH"])


def case_05(s):  # the float32 model, the larger of the two
    return (lambda: ConvNet(s["CHANNELS"])), digits(s["BATCH"])


def case_06(s):  # every part on the GPU: the embedding table, its gradient and Adam's state there
    cpu = torch.device("cpu")
    scope = definitions("07_cpu_offload", 2, {**s, "nn": nn, "F": nn.functional, "torch": torch, "DEVICE": cpu})
    definitions("07_cpu_offload", 3, scope)  # forward and train_step

    def make_model():
        table, net, _ = scope["make_model"](cpu)
        return nn.ModuleDict({"table": table, "net": net})

    def make_batch():
        return torch.randint(0, s["ROWS"], (s["BATCH"], 56)), torch.randint(0, 10, (s["BATCH"],))

    def step(model, optimizer, batch):  # the notebook's train_step, with the optimizer predict() is given
        scope["train_step"](model.table, model.net, [optimizer], *batch)

    return make_model, make_batch, step


def table_and_network_adam(params):
    """Notebook 07's two Adams, as one with a group each: the table's (its one parameter, first), the network's.
    Each group steps apart, as each of the notebook's optimizers does."""
    params = list(params)
    return torch.optim.Adam([{"params": params[:1]}, {"params": params[1:]}])


def case_07(s):  # the batch the notebook shows failing under its budget: the card itself must hold it
    return (lambda: MLP(n_in=64, width=s["WIDTH"], depth=s["DEPTH"])), digits(s["BIG_BATCH"])


CASES = {"00_where_memory_goes": mlp_case(2),   # the MLP whose parameters, gradients and Adam state it measures
         "02_no_grad": case_01, "03_mixed_precision": mlp_case(3),
         "04_gradient_accumulation": mlp_case(),     # the whole batch in one step, the run accumulation remedies
         "05_gradient_checkpointing": case_04, "06_half_with_float_batchnorm": case_05, "07_cpu_offload": case_06,
         "08_oom_and_batch_size": case_07, "11_everyday_savings": mlp_case()}
# (08 and 11 have one size for every device, which their CPU runs under nbval execute; 12 and 13 predict for the
# card themselves.)


@pytest.mark.parametrize("card", CARDS)
@pytest.mark.parametrize("name", CASES)
def test_the_notebooks_gpu_sized_step_fits_its_card_with_headroom(name, card, monkeypatch):
    """Device: cpu (fake tensors), predicting a T4 (cuda), and an H100 at the sizes an 80 GB card gets."""
    settings = gpu_settings(name, monkeypatch, card)
    make_model, make_batch, *step = CASES[name](settings)
    p = predict(make_model, adam, make_batch, *step, card=card)
    need = p.reserved_peak + CONTEXT_ALLOWANCE
    memory = CARDS[card][1]
    assert p.reserved_peak >= p.peak > 0
    assert need <= HEADROOM * memory, (f"{name}: {need / MiB:,.0f} MiB needed on {card} "
                                       f"({HEADROOM:.0%} of {memory / MiB:,.0f} MiB)")


@pytest.mark.parametrize("card", CARDS)
def test_the_big_batch_of_notebook_07_is_over_its_budget_on_the_card(card, monkeypatch):
    """Device: cpu (fake tensors), predicting each card. Notebook 08 asserts that its big batch does not fit its
    budget: at a card's sizes too. On a GPU the budget caps reserved memory (the allocator's memory fraction), on
    the CPU live bytes: the step's allocated peak over it puts both over (reserved is never below allocated)."""
    settings = gpu_settings("08_oom_and_batch_size", monkeypatch, card)
    make_model, make_batch = case_07(settings)
    p = predict(make_model, adam, make_batch, card=card)
    assert p.peak > gpukit.parse_bytes(settings["BUDGET"])


def test_notebook_07s_gpu_side_is_on_the_simulated_t4_with_the_bytes_predicted(monkeypatch):
    """Device: cpu (the notebook's own simulated T4, its GPU side on meta beside the host, fake tensors), as a T4
    rehearsal runs it. The notebook's measure() at a T4's sizes: with everything on the GPU the step reaches the peak
    predict(card="t4") gives it, less what a prediction, which has no host, puts on the GPU besides: the batch (the
    notebook makes it on the host and copies it), less the loss measure() keeps and train_step does not; the
    allocator a rehearsal reads (cpu_device()) saw that peak, not 0; the table on the host takes exactly three tables
    off the card between steps; and an H100's table (4 GiB, 16 with its gradient and Adam's moments) with everything
    on the GPU does not fit the T4, while on the host it does."""
    from gpukit.allocator import cpu_device, reset_cpu_device
    from gpukit.lessons.sizes import REHEARSE_VAR, SIZES

    monkeypatch.setenv(REHEARSE_VAR, "t4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a rehearsal's machine: no GPU, here or not
    scope: dict = {}
    try:
        for cell in code_cells("07_cpu_offload")[1:5]:  # settings, the model, forward and step, measure()
            exec("\n".join(line for line in cell.splitlines() if not line.startswith("%")), scope)
        cuda, device, host = scope["cuda"], scope["DEVICE"], scope["HOST"]
        assert isinstance(cuda, gpukit.SimulatedCuda) and cuda.card.key == "t4" and device.type == "meta"
        table = scope["TABLE_BYTES"]
        on_gpu = scope["measure"](device)
        assert cpu_device() is cuda._device   # the allocator a rehearsal reads
        assert cpu_device().allocator.memory_stats()["allocated_bytes.all.peak"] == on_gpu["GPU peak"] > 4 * table
        on_host = scope["measure"](host)
        assert on_gpu["GPU between steps"] - on_host["GPU between steps"] == 3 * table

        make_model, make_batch, step = case_06(scope["S"].sizes)
        predicted = predict(make_model, table_and_network_adam, make_batch, step, card="t4", breakdown=False)
        batch = sum(gpukit.allocated_size(t.nbytes) for t in make_batch())
        # Adam's step counters are on the host in both (gpukit.hoststate). The notebook's measure() keeps its loss (a
        # float32 scalar: one block) through the optimizer steps, where the peak is; train_step drops it after backward.
        loss = gpukit.allocated_size(4)
        # Both count blocks as torch.cuda does, whole; where the batch sits moves where they fall: the prediction's
        # peak holds one handed out whole (1 MiB over its tensor), the notebook's none.
        assert predicted.peak - predicted.whole_blocks - on_gpu["GPU peak"] == batch - loss, (
            predicted.peak, on_gpu["GPU peak"], predicted.whole_blocks)

        scope["ROWS"] = SIZES["07_cpu_offload"]["h100"]["ROWS"]
        with pytest.raises(torch.OutOfMemoryError, match="simulated NVIDIA T4"):
            scope["measure"](device)
        assert scope["measure"](host)["GPU peak"] < 2 * 2**30
    finally:
        if isinstance(scope.get("cuda"), gpukit.SimulatedCuda):  # (torch.cuda has no close(): the assert above says)
            scope["cuda"].close()
        reset_cpu_device()


@pytest.mark.parametrize("card", CARDS)
def test_notebook_08s_card_step_runs_out_of_memory_until_its_batch_is_quartered(card, monkeypatch):
    """Device: cpu (fake tensors), predicting each card. Notebook 08 runs out of memory on purpose with its CARD_*
    step, on the card itself, then halves the batch until it fits: what the step allocates must pass the card at its
    batch and at half of it, and a quarter of it must fit with headroom, so that the halving ends at a quarter on a
    real card as on the simulated one (and its exercise's answer is 4 micro-batches)."""
    s = gpu_settings("08_oom_and_batch_size", monkeypatch, card)
    make_model = lambda: MLP(n_in=64, width=s["CARD_WIDTH"], depth=s["CARD_DEPTH"])  # noqa: E731
    memory = CARDS[card][1]
    half, quarter = (predict(make_model, adam, lambda: (torch.randn(b, 64), torch.randint(0, 10, (b,))), card=card,
                             breakdown=False) for b in (s["CARD_BATCH"] // 2, s["CARD_BATCH"] // 4))
    assert half.peak + CONTEXT_ALLOWANCE > memory
    assert quarter.reserved_peak + CONTEXT_ALLOWANCE <= HEADROOM * memory, quarter.reserved_peak / MiB


def test_notebook_08_warms_up_first_or_its_card_step_keeps_a_segment_its_budget_then_counts(monkeypatch):
    """Device: cpu (fake tensors on a simulated H100, one block standing for the process). On an H200 the
    notebook's budgeted real steps (1 GB, a cap on reserved memory) all failed after its card step: backward's
    first matrix product took cuBLAS's workspace (32 MiB on sm90, kept for the process's life) from that step's
    cached blocks, and empty_cache() cannot release a segment with a live block (c10/cuda/CUDACachingAllocator.cpp).
    The same order here pins a segment of GiBs; with a first forward and backward before it (what warm_up runs),
    only the workspaces stay. The settings cell warms up."""
    s = gpu_settings("08_oom_and_batch_size", monkeypatch, "h100")
    assert s["warmed_up"] == [(s["DEVICE"],)]
    limit = gpukit.parse_bytes(s["BUDGET"])
    cuda = gpukit.SimulatedCuda("h100")

    def step(batch):
        model = MLP(n_in=64, width=s["CARD_WIDTH"], depth=s["CARD_DEPTH"])
        nn.functional.cross_entropy(model(torch.randn(batch, 64)), torch.randint(10, (batch,))).backward()

    left = {}
    try:
        for warm in (False, True):
            cuda.empty_cache()  # each block starts from an empty cache, as a new process does
            with gpukit.on_card(cuda):
                if warm:
                    step(4)
                step(s["CARD_BATCH"] // 4)  # the batch the notebook's halving ends at, on an 80 GB card
                cuda.empty_cache()
                stats = cuda.memory_stats()
                left[warm] = stats["reserved_bytes.all.current"], stats["allocated_bytes.all.current"]
    finally:
        cuda.close()
    # Two cuBLAS workspaces (forward's thread, backward's) and one cuBLASLt (Linear's forward, addmm with a bias):
    # 68,157,440 B, as an H200's warm-up left on 2026-11-28.
    workspaces = 2 * cudarules.cublas_workspace_bytes() + cudarules.cublaslt_workspace_bytes()
    assert left[False][1] == left[True][1] == workspaces == 68_157_440
    assert left[False][0] > 8 * limit and left[True][0] < limit / 8, left


def test_the_check_refuses_a_step_too_big_for_a_t4(monkeypatch):
    """The same check, on notebook 04's batch eight times over: its activations alone are over 16 GB."""
    settings = gpu_settings("04_gradient_accumulation", monkeypatch)
    make_model, make_batch = mlp_case()({**settings, "BATCH": 8 * settings["BATCH"]})
    p = predict(make_model, adam, make_batch, card="t4")
    assert p.reserved_peak + CONTEXT_ALLOWANCE > HEADROOM * T4_BYTES


def test_the_technique_matrix_fits_a_t4_in_notebook_09(monkeypatch):
    """Device: cpu (fake tensors), predicting a T4. Notebook 10 runs each reference model's baseline step (AdamW,
    float32, the whole batch), the largest of its techniques, at the sizes its settings choose on a GPU."""
    from gpukit.lessons.techniques import reference_setups

    settings = gpu_settings("10_gpu_results", monkeypatch)
    for setup in reference_setups(settings["SIZE"]):
        p = predict(setup.make_model, lambda params: torch.optim.AdamW(params), lambda: setup.make_batch(setup.batch),
                    card="t4")
        need = p.reserved_peak + CONTEXT_ALLOWANCE
        assert need <= HEADROOM * T4_BYTES, f"{setup.name}: {need / MiB:,.0f} MiB needed on a T4"
