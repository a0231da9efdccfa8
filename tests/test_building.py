"""Models whose code reads what fake tensors do not hold, predicted all the same or refused by name: initialisers
that read values (``trunc_normal_``), an integer read while building, tensors made from lists of tensors (Llama
3.1's rotary scaling, a forward's list of norms), and torchao's low-bit optimizers (compiled steps)."""

import pytest
import torch

from gpukit.estimate import measured_step_peak, predict


class _TruncNormalViT(torch.nn.Module):
    """A ViT-like block initialised as timm's and transformers' ViTs are: ``nn.init.trunc_normal_``, which in
    torch 2.13 redraws ``while mask.any()``: a value a fake tensor does not hold."""

    def __init__(self, dim: int = 64, patches: int = 16, patch: int = 48, classes: int = 10, int_read: bool = False):
        super().__init__()
        self.embed = torch.nn.Linear(patch, dim)
        self.pos = torch.nn.Parameter(torch.zeros(1, patches, dim))
        self.block = torch.nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(dim, classes)
        for module in self.modules():
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.trunc_normal_(module.weight, std=0.02)
        torch.nn.init.trunc_normal_(self.pos, std=0.02)
        if int_read:  # a size read from the weights' values: a fake build cannot know it
            extra = int((self.head.weight.abs() > 1.0).sum().item()) + 7
            self.register_buffer("extra", torch.zeros(extra))

    def forward(self, x):
        return self.head(self.block(self.embed(x) + self.pos).mean(1))


def test_a_model_whose_initialisers_read_values_is_predicted_exactly_on_the_cpu():
    """Device: cpu (predicted on fake tensors, measured for real). nn.init.trunc_normal_ raised
    DataDependentOutputException under fake tensors; the values it reads are made up while building (memory
    depends on shapes, not on values), and the prediction equals the measured peak to the byte, flagged nothing."""
    make_batch = lambda: (torch.randn(8, 16, 48, device="cpu"), torch.randint(0, 10, (8,), device="cpu"))  # noqa: E731
    adamw = lambda p: torch.optim.AdamW(p)  # noqa: E731
    p = predict(_TruncNormalViT, adamw, make_batch)
    assert not p.lower_bound, p.unverified_ops
    assert p.peak == measured_step_peak(_TruncNormalViT, adamw, make_batch, device="cpu")


def test_an_integer_read_from_weights_while_building_is_named_by_the_prediction_on_the_cpu():
    """Device: cpu, fake tensors. An integer read from values a fake tensor does not hold may size a tensor:
    it is made up (1), and the prediction says so (a lower bound, naming the read) instead of raising."""
    make_batch = lambda: (torch.randn(2, 16, 48, device="cpu"), torch.randint(0, 10, (2,), device="cpu"))  # noqa: E731
    p = predict(lambda: _TruncNormalViT(int_read=True), lambda q: torch.optim.SGD(q, lr=0.1), make_batch)
    assert p.lower_bound and "integer value(s) read from tensors while building" in \
        p.unverified_ops["aten._local_scalar_dense"]


def _llama31_scaled_frequencies(dim: int, theta: float = 500000.0, scale_factor: float = 8.0, low: float = 1.0,
                                high: float = 4.0, old_context_len: int = 8192) -> torch.Tensor:
    """Llama 3.1's RoPE frequency scaling as its reference code writes it (and torchtune's Llama3ScaledRoPE after
    it): each frequency a 0-d tensor, compared, scaled, and the list made a tensor again."""
    import math

    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    low_wavelen, high_wavelen = old_context_len / low, old_context_len / high
    new = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            new.append(freq)
        elif wavelen > low_wavelen:
            new.append(freq / scale_factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            new.append((1 - smooth) * freq / scale_factor + smooth * freq)
    return torch.tensor(new, dtype=freqs.dtype, device=freqs.device)


class _ScaledRoPE(torch.nn.Module):
    def __init__(self, dim: int = 32, seq: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(dim, dim)
        angles = torch.outer(torch.arange(seq).float(), _llama31_scaled_frequencies(dim))
        self.register_buffer("cos", angles.cos().repeat(1, 2))
        self.head = torch.nn.Linear(dim, 4)

    def forward(self, x):
        return self.head((self.embed(x) * self.cos).mean(1))


def test_a_model_that_makes_a_tensor_from_a_list_of_tensors_is_predicted_exactly_on_the_cpu():
    """Device: cpu (predicted on fake tensors, measured for real). torch.tensor of a list of 0-d tensors reads each
    one's data in C++, which a fake tensor has none of: building such a model raised "The tensor has a non-zero
    number of elements, but its data is not allocated yet". It is built on fake tensors, and predicted to the byte."""
    make_batch = lambda: (torch.randn(4, 16, 32), torch.randint(0, 4, (4,)))  # noqa: E731
    adamw = lambda p: torch.optim.AdamW(p)  # noqa: E731
    p = predict(_ScaledRoPE, adamw, make_batch, device="cpu")
    assert p.peak == measured_step_peak(_ScaledRoPE, adamw, make_batch, device="cpu")


class _ListInForward(torch.nn.Module):
    """A forward that makes a tensor of per-row norms from a list of 0-d tensors, as a step logging or weighting
    its parts does."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 4)

    def forward(self, x):
        out = self.layer(x)
        weights = torch.tensor([row.norm() for row in out.detach()], device=x.device)
        return out * weights[:, None]


def test_a_step_that_makes_a_tensor_from_a_list_of_tensors_is_predicted_exactly_on_the_cpu():
    """Device: cpu (predicted on fake tensors, measured for real); and the simulated GPU of predict_offload."""
    from gpukit.offload import predict_offload

    make_batch = lambda: (torch.randn(8, 16), torch.randint(0, 4, (8,)))  # noqa: E731
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    p = predict(_ListInForward, sgd, make_batch, device="cpu")
    assert p.peak == measured_step_peak(_ListInForward, sgd, make_batch, device="cpu")
    assert predict_offload(_ListInForward, sgd, make_batch, card="t4").device_step_peak > 0
    from gpukit.plan import plan  # its facts of the model run a forward on fake tensors too

    assert plan(_ListInForward, sgd, make_batch, "16GB", device="cuda", verify=False).choice.candidate.label == "plain"


def test_a_tensor_made_from_a_list_of_fake_tensors_is_the_one_torch_makes_from_real_ones():
    """Device: cpu, fake tensors. Shape, dtype (torch's promotion, the dtype asked for), device and requires_grad as
    torch makes them from the same lists of real tensors and numbers; what torch refuses it still refuses."""
    from gpukit._torch import FakeTensorMode
    from gpukit.factories import ValuesWhileBuilding

    cases = [
        lambda a, b, h: ([a, a * 2], {}), lambda a, b, h: ([b, 1.5], {}), lambda a, b, h: ([h, 2.0], {}),
        lambda a, b, h: ([h, b], {}), lambda a, b, h: ([[a], [a + 1]], {}), lambda a, b, h: ((a, 3, True), {}),
        lambda a, b, h: ([a.reshape(1), b], {"dtype": torch.float64}),
        lambda a, b, h: ([a, a], {"requires_grad": True}),
    ]

    def made(fake: bool, case, func=torch.tensor):
        values = (torch.tensor(1.5), torch.tensor(2), torch.tensor(0.5, dtype=torch.float16))
        if not fake:
            data, kwargs = case(*values)
            return func(data, **kwargs)
        with FakeTensorMode() as mode, ValuesWhileBuilding():
            data, kwargs = case(*(mode.from_tensor(v) for v in values))
            return func(data, **kwargs)

    by_keyword = lambda data, **kwargs: torch.tensor(data=data, **kwargs)  # noqa: E731
    for case in cases:
        for func in (torch.tensor, torch.as_tensor, by_keyword) if case is cases[6] else (torch.tensor,):
            real, fake = made(False, case, func), made(True, case, func)
            assert (fake.shape, fake.dtype, fake.device, fake.requires_grad) == \
                (real.shape, real.dtype, real.device, real.requires_grad)
    with pytest.raises(ValueError, match="only one element tensors"):
        made(True, lambda a, b, h: ([a.expand(2), a.expand(2)], {}))


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit", "AdamWFp8"])
def test_torchaos_low_bit_optimizers_are_refused_by_name_with_what_to_do_instead(name):
    """Device: none. torchao's low-bit optimizers step through torch.compile(fullgraph=True), which cannot run under
    the fake tensors' dispatch modes: predict() and predict_offload() refuse them before any step, naming the
    library and the alternatives, never with a fake-tensor exception from inside torchao."""
    optim = pytest.importorskip("torchao.optim")
    from gpukit.factories import UnsupportedOptimizer
    from gpukit.offload import predict_offload

    make = (lambda: torch.nn.Linear(16, 4), lambda p: getattr(optim, name)(p),
            lambda: (torch.randn(2, 16), torch.zeros(2, dtype=torch.long)))
    for run in (lambda: predict(*make, device="cpu"), lambda: predict(*make, card="t4"),
                lambda: predict_offload(*make, card="t4")):
        with pytest.raises(UnsupportedOptimizer, match=rf"torchao\.optim\.{name} cannot be predicted.*bitsandbytes"):
            run()
