"""plan(): every verdict against a real step under gpukit.budget on the CPU, the gradients of the chosen recipe,
the pruning against an exhaustive search, the pasted code, and bad input. Small models: seconds in all."""

from __future__ import annotations

import sys
import threading
import warnings

import pytest
import torch

import gpukit
from gpukit.estimate import predict
from gpukit.lessons.data import digit_tokens_batch, digits_batch
from gpukit.lessons.models import MLP, GPTConfig, TinyGPT
from gpukit.plan import Candidate, Techniques, plan
from gpukit.plan.search import PlanSearch
from gpukit.plan.steps import step_for
from gpukit.step import Technique, train_step

DEVICE = "cpu"  # every figure here is the CPU's: predicted on its code paths, measured with its counter


def mlp_case(batch: int = 512):
    x, y = digits_batch(batch)
    return (lambda: MLP(width=64, depth=3)), (lambda p: torch.optim.Adam(p, lr=1e-3)), (lambda: (x.clone(), y.clone()))


def gpt_case(batch: int = 32):
    x, y = digit_tokens_batch(batch)
    return (lambda: TinyGPT(GPTConfig(n_layer=2, n_embd=32, n_head=2))), (lambda p: torch.optim.AdamW(p)), \
        (lambda: (x.clone(), y.clone()))


def plain_peak(case) -> int:
    make_model, make_opt, make_batch = case
    return predict(make_model, make_opt, make_batch, device=DEVICE).peak


@pytest.fixture(scope="module")
def mlp_plan():
    case = mlp_case()
    limit = int(plain_peak(case) * 0.85)  # the plain step does not fit; techniques must make room
    techniques = Techniques(precisions=("float32", "bf16"), accumulate=[1, 2, 4], implementations=False)
    return case, limit, plan(*case, budget=limit, device=DEVICE, techniques=techniques, alternatives=3, verify=False)


def test_every_verdict_is_confirmed_by_a_real_step_under_budget(mlp_plan):
    _, limit, p = mlp_plan
    confirmed = {True: 0, False: 0}
    for row in p.rows:
        if row.fits is None:
            continue  # dominated: no verdict was given
        if row.fits:
            _, measured, _ = p.run(row, limit=limit, device=DEVICE)
            if row.peak is not None:
                assert measured == row.peak, row.candidate.label  # exact on the CPU, accumulation's shortcut too
        else:
            with pytest.raises(torch.OutOfMemoryError):
                p.run(row, limit=limit, device=DEVICE)
        confirmed[bool(row.fits)] += 1
    assert confirmed[True] >= 1 and confirmed[False] >= 1  # both verdicts were put to the test


def test_the_plain_step_does_not_fit_and_the_choice_does(mlp_plan):
    _, limit, p = mlp_plan
    plain = next(r for r in p.rows if r.candidate == Candidate(r.candidate.optimizer))
    # Predicted, or bounded over the budget without a prediction (a prefix of its step, its floor).
    assert plain.fits is False and (plain.need if plain.need is not None else plain.bound) > limit
    assert p.choice is not None and p.choice.need <= limit and p.choice is p.rows[0]


@pytest.mark.parametrize("precision,accumulate,checkpointed", [("float32", 4, True), ("bf16", 2, False),
                                                                ("fp16", 1, True)])
def test_a_recipe_gives_the_plain_gradients_within_its_stated_tolerance(precision, accumulate, checkpointed):
    make_model, make_opt, make_batch = gpt_case()
    search = PlanSearch(make_model, make_opt, make_batch, 10**12, device=DEVICE,
                        techniques=Techniques(implementations=False, precisions=(precision,), offload=False))
    c = Candidate(next(iter(search.optimizers)), precision, accumulate, checkpointed)
    tolerance = search.numerics(c)[2]
    assert tolerance is not None

    def gradients(technique, scaler=None):
        torch.manual_seed(0)
        model = make_model()
        train_step(model, make_opt(model.parameters()), make_batch(), technique, scaler)
        return torch.cat([p.grad.float().flatten() for p in model.parameters()])

    plain = gradients(Technique())
    scaler = torch.amp.GradScaler(DEVICE) if precision == "fp16" else None
    got = gradients(c.technique(), scaler)
    error = float((got - plain).norm() / plain.norm())
    assert error <= tolerance, (c.label, error, tolerance)
    if precision != "float32":
        assert error > 0  # the comparison can tell rounding from no change


@pytest.mark.parametrize("gpu_here", [False, True], ids=["no-gpu", "a-gpu-here"])
def test_the_chosen_recipe_was_verified_by_a_real_step(mlp_plan, gpu_here, monkeypatch):
    """Device: cpu. A plan for the CPU is verified on the CPU also where torch sees a GPU (stood in here: on a
    GPU machine it had run its steps on CUDA and called the machine GPU-less)."""
    case, limit, _ = mlp_plan
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu_here)
    # Adam asks a CUDA build whether a graph is being captured when torch sees a GPU; no graph is, as on a GPU.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    p = plan(*case, budget=limit, device=DEVICE, alternatives=0,
             techniques=Techniques(precisions=("float32",), accumulate=[1, 2], implementations=False))
    v = p.verification
    assert v.ran and v.fitted and v.measured_peak == p.choice.peak
    assert "fitted" in v.message and p.choice.measured_on == DEVICE


def test_on_a_gpu_the_verified_step_is_set_beside_the_prediction_without_the_warm_ups_workspaces(monkeypatch):
    """Device: none (the real step stood in). On a GPU the warm-up step makes the cuBLAS workspaces before the
    measured step, whose peak then holds none of them: the verification compares it with the prediction less its
    workspaces, and says so."""
    from types import SimpleNamespace

    verify = sys.modules["gpukit.plan.verify"]
    workspaces, need = 2 * 32 * 2**20, 5 * 2**30
    monkeypatch.setattr(verify, "_small_enough", lambda search, row: True)
    monkeypatch.setattr(verify, "_verify_on", lambda search: "cuda")
    monkeypatch.setattr(verify, "run_candidate", lambda *args, **kwargs: (None, need - workspaces, None))
    search = SimpleNamespace(device="cuda", limit=8 * 2**30, allowance=2**29, optimizers={"yours: AdamW": (None,)},
                             make_real_model=None, make_batch=None, loss=None)
    choice = SimpleNamespace(candidate=Candidate("yours: AdamW"), peak=need, host_peak=None,
                             prediction=SimpleNamespace(workspaces=workspaces))
    v = verify.verify_choice(search, choice, None)
    assert v.fitted and v.measured_peak == v.predicted_peak == need - workspaces
    assert f"({need - workspaces:,} B) without the cuBLAS workspaces (64.00 MiB)" in v.message


def test_measured_costs_rank_the_fitting_recipes_where_they_were_measured(mlp_plan, monkeypatch):
    """Device: cpu. The steps' times are stood in by a clock that makes the estimated cheapest recipe the slowest
    (on a CPU, autocast to bfloat16 is estimated free and measured many times slower): the plan then picks and
    verifies the measured cheapest. Planned for CUDA but timed on this CPU, the same times rank nothing."""
    import sys

    planning = sys.modules["gpukit.plan.verify"]  # where run_candidate is called from
    case, limit, _ = mlp_plan
    real_run = planning.run_candidate
    fake_seconds = {}

    def run_with_a_stand_in_clock(*args, timed_steps=0, **kwargs):
        model, peak, seconds = real_run(*args, timed_steps=0, **kwargs)
        return model, peak, fake_seconds.get(args[3], 1.0) if timed_steps else None

    monkeypatch.setattr(planning, "run_candidate", run_with_a_stand_in_clock)
    techniques = Techniques(precisions=("float32", "bf16"), accumulate=[1, 2, 4], implementations=False,
                            lora=False)  # (LoRA trains another model: it would rank after these)
    kwargs = dict(budget=limit, alternatives=3, techniques=techniques)
    estimated = plan(*case, device=DEVICE, verify=False, **kwargs)
    fitting = [r.candidate for r in estimated.rows if r.fits and r.need is not None]  # predicted, not dominated
    assert len(fitting) >= 2 and len({r.numerics for r in estimated.rows if r.candidate in fitting}) == 1
    for i, c in enumerate(fitting):  # the estimated order, reversed
        fake_seconds[c] = 2.0 + len(fitting) - i
    p = plan(*case, device=DEVICE, **kwargs)
    ranked = [r for r in p.rows if r.fits and r.need is not None]
    assert [r.candidate for r in ranked] == fitting[::-1]
    assert [r.measured_slowdown for r in ranked] == sorted(r.measured_slowdown for r in ranked)
    assert p.choice.candidate == fitting[-1] and p.verification.fitted

    cuda = plan(*case, device="cuda", budget=limit + estimated.allowance + 2**30, alternatives=3, techniques=Techniques(
        precisions=("float32", "bf16"), accumulate=[1, 2], implementations=False, lora=False))
    timed = [r for r in cuda.rows if r.fits and r.need is not None]
    assert all(r.measured_on == "cpu" for r in timed)  # timed here, on the CPU...
    assert [r.slowdown for r in timed] == sorted(r.slowdown for r in timed)  # ...ranked by the estimates


def test_the_pasted_code_trains_like_train_step():
    make_model, make_opt, make_batch = mlp_case()
    limit = int(plain_peak((make_model, make_opt, make_batch)) * 0.85)
    p = plan(make_model, make_opt, make_batch, budget=limit, device=DEVICE, alternatives=0, verify=False,
             techniques=Techniques(precisions=("float32",), accumulate=[1, 2, 4], implementations=False))
    c = p.choice.candidate
    assert c.accumulate > 1 or c.checkpointed  # a recipe with a technique in it
    torch.manual_seed(0)
    namespace = {"make_model": make_model, "loader": [make_batch()]}
    exec(p.code, namespace)
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_step(model, optimizer, make_batch(), c.technique())
    for a, b in zip(namespace["model"].parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_offload_takes_every_saved_tensor_off_the_device_and_counts_its_copies():
    """The prediction's stand-in for save_on_cpu: the copies it counts are twice the bytes autograd saves in a real
    forward (counted by a hook of our own), and the device's peak goes down."""
    make_model, make_opt, make_batch = gpt_case()
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    torch.manual_seed(0)
    model = make_model()
    x, y = make_batch()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # train_step's forward and loss
        torch.nn.functional.cross_entropy(model(x).float().flatten(0, -2), y.flatten())
    c = Candidate("yours", offload=True)
    copies = [0]
    offloaded = predict(make_model, make_opt, make_batch, step=step_for(c, 1, copies), device=DEVICE,
                        warmup_steps=0)
    plain = predict(make_model, make_opt, make_batch, device=DEVICE, warmup_steps=0)
    assert copies[0] == 2 * saved[0] > 0
    assert offloaded.peak < plain.peak


def test_several_gpus_give_per_rank_figures_by_the_sharding_formulas():
    case = gpt_case(batch=8)
    p = plan(*case, budget="1GB", device=DEVICE, gpus=2, alternatives=5, verify=True, techniques=Techniques(
        precisions=("float32",), accumulate=[1], checkpointing=False, implementations=False))
    need = {r.candidate.strategy: r.need for r in p.rows if r.need is not None}
    assert set(need) == {"DDP", "ZeRO-1", "FSDP"}
    assert need["FSDP"] < need["ZeRO-1"] < need["DDP"]  # each stage shards more
    assert "not run here" in p.verification.message


def test_the_plan_renders_as_text_and_html(mlp_plan):
    _, _, p = mlp_plan
    text, page = repr(p), p._repr_html_()
    assert p.choice.candidate.label in text and p.choice.candidate.label in page
    assert "optimizer.step()" in text and "<table" in page and "recipe" in page


@pytest.mark.parametrize("kwargs,message", [
    ({"budget": "lots"}, "not a size"),
    ({"budget": "24GB", "device": "tpu"}, "'cuda'"),
    ({"budget": "24GB", "techniques": {"precisions": ("fp8",)}}, "float32, bf16, fp16, half"),
    ({"budget": "24GB", "gpus": 0}, "whole number of GPUs"),
    ({"budget": "24GB", "techniques": {"accumulate": [3]}}, "must divide"),
    ({"budget": "24GB", "techniques": {"strategies": ("FSDP",)}}, "gpus=2"),
    ({"budget": "24GB", "gpus": 2, "techniques": {"strategies": ("ZeRO-3",)}}, "DDP, ZeRO-1, FSDP"),
    ({"budget": "24GB", "techniques": {"optimizers": {"sgd": "SGD"}}}, "must build an optimizer"),
])
def test_bad_input_says_what_is_allowed(kwargs, message):
    make_model, make_opt, make_batch = mlp_case()
    kwargs = dict(kwargs)
    techniques = kwargs.pop("techniques", None)
    with pytest.raises((ValueError, TypeError), match=message):
        plan(make_model, make_opt, make_batch, techniques=techniques and Techniques(**techniques), **kwargs)


def test_a_batch_that_is_not_inputs_and_targets_is_refused():
    make_model, make_opt, _ = mlp_case()
    with pytest.raises(ValueError, match="inputs, targets"):
        plan(make_model, make_opt, lambda: torch.zeros(4, 64), budget="1GB", device=DEVICE)


def test_a_model_that_already_exists_is_planned_and_verified_on_copies_and_left_as_it_is_on_the_cpu():
    """plan(lambda: model, ...) converts a candidate's model to half and runs real steps: on copies (fake ones to
    predict, a real one to verify), never on the user's model, which keeps its float32 weights and trains."""
    torch.manual_seed(0)
    model = MLP(width=16, depth=1)
    x, y = digits_batch(16)
    weights = [w.detach().clone() for w in model.parameters()]
    p = plan(lambda: model, lambda q: torch.optim.SGD(q, lr=0.1), lambda: (x, y), budget="1GB", device=DEVICE,
             alternatives=0, techniques=Techniques(precisions=("half",), accumulate=[1], checkpointing=False,
                                                   offload=False, implementations=False))
    assert p.choice.candidate.precision == "half" and p.verification.ran and p.verification.fitted  # a real step
    for w, w0 in zip(model.parameters(), weights):
        assert type(w) is torch.nn.Parameter and w.dtype == torch.float32 and w.grad is None and torch.equal(w, w0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(model, optimizer, (x, y))
    assert not torch.equal(model.net[-1].weight, weights[-2])


@pytest.mark.parametrize("wrong, message", [
    ("model", r"make_model is a model \(MLP\), not a function that builds one: pass lambda: MLP\(\.\.\.\)"),
    ("optimizer", r"make_optimizer is an optimizer \(Adam\), not a function that builds one"),
    ("existing optimizer", r"make_optimizer returned an optimizer \(Adam\) over real tensors"),
])
def test_an_object_passed_where_its_factory_is_expected_is_refused_on_the_cpu(wrong, message):
    make_model, make_opt, make_batch = mlp_case(16)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters())
    args = {"model": (model, make_opt), "optimizer": (make_model, optimizer),
            "existing optimizer": (make_model, lambda q: optimizer)}[wrong]
    with pytest.raises((TypeError, ValueError), match=message):
        plan(*args, make_batch, budget="1GB", device=DEVICE)
    assert not optimizer.state and all(w.grad is None for w in model.parameters())


class _WarnsInBfloat16(torch.nn.Module):
    """Warns in its forward where its weights are bfloat16, as torch does for torchtune's RMSNorm there."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))

    def forward(self, x):
        if self.layers[0].weight.dtype == torch.bfloat16:
            warnings.warn("a forward in bfloat16 weights", UserWarning)
            # and a thread of the user's warns meanwhile (a data loader's, a logger's): not the candidate's
            other = threading.Thread(target=lambda: warnings.warn("from the user's other thread", UserWarning))
            other.start()
            other.join()
        return self.layers(x.to(self.layers[0].weight.dtype))


def test_what_a_candidate_warns_goes_into_its_row_not_to_the_users_output():
    """Device: cpu. A recipe the user did not write may make torch or the model warn while it is predicted: the
    warning goes into that candidate's row (its "how"), once, and never to the user's output, and the user's own
    warning filters are as they were."""
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    case = (_WarnsInBfloat16, lambda p: torch.optim.Adam(p), lambda: (x.clone(), y.clone()))
    techniques = Techniques(precisions=("float32", "bf16 weights"), accumulate=[1], checkpointing=False,
                            implementations=False)
    budget = int(plain_peak(case) * 0.8)  # float32 does not fit; bfloat16 weights, half its bytes, do
    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        p = plan(*case, budget=budget, device=DEVICE, techniques=techniques, verify=False)
    assert not [w for w in shown if "bfloat16 weights" in str(w.message)]
    assert p.choice.candidate.precision == "bf16 weights"
    assert p.choice.how.count("UserWarning: a forward in bfloat16 weights") == 1
    assert warnings.filters == filters
    # what the user's other thread warned while the plan ran reached the output, and no row
    assert [w for w in shown if str(w.message) == "from the user's other thread"]
    assert not [r for r in p.rows if "other thread" in r.how]


def test_plan_is_exported():
    assert gpukit.plan is plan


def test_a_card_gives_the_budget_and_speeds_and_on_a_t4_bfloat16_ranks_after_float16():
    """Device: none (plans for CUDA on fake tensors). The T4 has no bfloat16 tensor cores (gpukit.cards): where
    AMP bf16 and AMP fp16 cost alike in the estimate, fp16 comes first on it, bf16 first on an H100 (the order of
    PRECISIONS); the budget is what torch reports of a T4's memory."""
    from gpukit.cards import card

    case = gpt_case()
    options = dict(techniques=Techniques(precisions=("bf16", "fp16"), accumulate=[1], checkpointing=False,
                                         offload=False, implementations=False, lora=False),
                   alternatives=1, verify=False)
    t4 = plan(*case, card="T4", **options)
    assert t4.budget == card("t4").torch_total_memory and "NVIDIA T4" in t4.assumptions
    assert f"{card('t4').fp32_tflops:g} TFLOP/s" in t4.assumptions
    fitting = [r for r in t4.rows if r.fits and r.need is not None]
    assert [r.candidate.precision for r in fitting] == ["fp16", "bf16"]
    assert "no bfloat16 tensor cores" in fitting[1].numerics_note
    h100 = plan(*case, card="h100", **options)
    assert [r.candidate.precision for r in h100.rows if r.fits and r.need is not None] == ["bf16", "fp16"]
    # The attention kernels are the card's: bfloat16 has none fused on a T4 (the math kernel keeps the attention
    # matrix, in float32), float16 has the memory-efficient one; on an H100 both take flash attention.
    kernels = {(name, r.candidate.precision): r.prediction.attention_kernels
               for name, p in (("t4", t4), ("h100", h100)) for r in p.rows if r.prediction is not None}
    assert set(kernels[("t4", "bf16")]) == {"math"} and set(kernels[("t4", "fp16")]) == {"efficient"}
    assert set(kernels[("h100", "bf16")]) == set(kernels[("h100", "fp16")]) == {"flash"}
    need = {(name, r.candidate.precision): r.need for name, p in (("t4", t4), ("h100", h100)) for r in p.rows
            if r.need is not None}
    assert need[("t4", "bf16")] > need[("t4", "fp16")] and need[("h100", "bf16")] == need[("h100", "fp16")]
    with pytest.raises(ValueError, match="t4"):
        plan(*case, card="a t5", **options)
    with pytest.raises(ValueError, match="device='cuda'"):
        plan(*case, card="t4", device="cpu", **options)
