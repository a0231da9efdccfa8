"""gpukit.budget on CPU: a real torch.OutOfMemoryError at the right byte, and clean recovery."""

import gc
import os
import sys

import pytest
import torch

import gpukit
from gpukit.counter import LEDGER, round_up
from gpukit.estimate import default_step
from gpukit.lessons.models import MLP


@pytest.fixture
def setup():
    torch.manual_seed(0)
    model = MLP(width=128, depth=2)
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))
    default_step(model, opt, (x, y))  # steady state: grads and Adam state exist
    return model, opt, (x, y)


def test_a_budget_of_exactly_the_needed_bytes_passes_and_one_byte_less_fails(setup):
    model, opt, batch = setup
    with gpukit.measure("cpu", record=False) as r:
        default_step(model, opt, batch)
    assert r.delta == 0  # the steady state: the next step starts from the same live bytes
    need = r.live_start + r.peak
    with gpukit.budget(need, "cpu"):
        default_step(model, opt, batch)
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        with gpukit.budget(need - 1, "cpu"):
            default_step(model, opt, batch)


def live_now():
    gc.collect()
    with gpukit.measure("cpu", record=False) as r:
        pass
    return r.live_end


def test_the_error_says_what_was_asked_what_is_used_and_the_budget():
    limit = live_now() + 10_000_000  # a CPU budget counts every live CPU tensor of the process
    with gpukit.budget(limit, "cpu"):
        a = torch.empty(1_000_000)
        with pytest.raises(torch.OutOfMemoryError) as err:
            torch.empty(2_000_000)
    message = str(err.value)
    assert "Tried to allocate 7.63 MiB (8,000,000 B)" in message
    assert f"budget {gpukit.format_bytes(limit)} ({limit:,} B)" in message
    assert f"{gpukit.format_bytes(limit - 10_000_000 + 4_000_256)} ({limit - 10_000_000 + 4_000_256:,} B) already" \
        in message
    assert f"of which {gpukit.format_bytes(10_000_000 - 4_000_256)}" in message
    del a


def test_nested_budgets_the_smallest_applies_and_each_exit_restores():
    with gpukit.budget(live_now() + 10**9, "cpu"):
        with gpukit.budget(live_now() + 10**6, "cpu"):
            with pytest.raises(torch.OutOfMemoryError):
                torch.empty(1_000_000)                # 4 MB > 1 MB
            with gpukit.budget(live_now() + 10**9, "cpu"):   # a looser inner budget does not loosen
                with pytest.raises(torch.OutOfMemoryError):
                    torch.empty(1_000_000)
        t = torch.empty(1_000_000)                   # back under the 1 GB budget: fits
    assert LEDGER.limits == [] and not LEDGER.active
    del t


def test_after_an_oom_no_tensor_of_the_failed_step_stays_alive(setup):
    model, opt, batch = setup
    with gpukit.measure("cpu", record=False):
        pass
    before = LEDGER.live_rounded

    def failing_step():
        with gpukit.budget(before + 4096, "cpu"):
            default_step(model, opt, batch)

    oom = False
    try:
        failing_step()
    except torch.OutOfMemoryError:
        oom = True
    # Outside the except block the traceback, and the activations its frames held, are gone.
    model.zero_grad(set_to_none=True)
    gc.collect()
    assert oom
    grads = sum(round_up(p.nbytes) for p in model.parameters())
    with gpukit.measure("cpu", record=False):
        pass
    assert LEDGER.live_rounded == before - grads  # only the gradients we dropped on purpose are gone


def test_recovery_leaves_parameters_and_optimizer_state_bit_identical(setup):
    model, opt, batch = setup
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for s in opt.state.values()]
    with gpukit.measure("cpu", record=False) as r:  # the live bytes before the step
        pass
    skipped = 0
    try:
        with gpukit.budget(r.live_end + 64 * 1024, "cpu"):  # room for far less than the batch's activations
            default_step(model, opt, batch)
    except torch.OutOfMemoryError:
        skipped += 1
    opt.zero_grad(set_to_none=True)
    assert skipped == 1
    assert all(torch.equal(p, p0) for p, p0 in zip(model.parameters(), params))
    for s, s0 in zip(opt.state.values(), state):
        for k, v in s0.items():
            assert torch.equal(s[k], v) if torch.is_tensor(v) else s[k] == v


@pytest.mark.parametrize("size, expected", [("4GB", 4 * 10**9), ("512 MiB", 512 * 2**20), ("1e9", 10**9),
                                            (2048, 2048), ("1.5 KiB", 1536)])
def test_sizes_parse(size, expected):
    assert gpukit.parse_bytes(size) == expected


@pytest.mark.parametrize("bad", ["four GB", "4 XB", "-1MB", "0", "", float("inf"), float("nan"), "1e400"])
def test_bad_sizes_are_refused_saying_what_is_accepted(bad):
    with pytest.raises(ValueError, match="size"):
        gpukit.budget(bad, device="cpu")


def test_a_budget_on_a_device_without_memory_to_cap_is_refused():
    with pytest.raises(ValueError, match="a budget caps 'cpu' or 'cuda' memory, not 'meta'"):
        gpukit.budget("1MB", device="meta")


def believed_bytes(t):
    """The size the counter has on file for ``t``'s storage."""
    return LEDGER.sizes.get(id(t.untyped_storage()))


@pytest.mark.parametrize("grow", [
    lambda t: t.resize_(10_000_000),
    lambda t: torch.randn(10_000_000, out=t),
    lambda t: torch.add(torch.ones(10_000_000).expand(2, 10_000_000)[0], 1, out=t),
    lambda t: t.untyped_storage().resize_(40_000_000),
], ids=["resize_", "randn-out", "add-out", "storage-resize_"])
@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
def test_a_storage_that_would_grow_past_the_budget_is_refused_before_it_grows(grow):
    t = torch.empty(10)
    with gpukit.measure(device="cpu", record=False):
        pass
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 38.15 MiB"):
        with gpukit.budget(LEDGER.live_rounded + 1_000_000, device="cpu"):
            grow(t)
    nbytes = t.untyped_storage().nbytes()
    assert (nbytes, believed_bytes(t)) == (40, 40)  # refused before: the 40 MB never existed


@pytest.mark.parametrize("grow", [
    lambda t: t.resize_(1_000_000),
    lambda t: torch.randn(1_000_000, out=t),
    lambda t: torch.add(torch.zeros(1_000_000), 1, out=t),
], ids=["resize_", "randn-out", "add-out"])
@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
def test_a_storage_that_grows_in_place_is_counted_at_its_new_size(grow):
    t = torch.empty(10)
    with gpukit.budget(10**9, device="cpu"), gpukit.measure(device="cpu", record=False) as r:
        grow(t)
    nbytes = t.untyped_storage().nbytes()
    assert (nbytes, believed_bytes(t)) == (4_000_000, 4_000_000)
    with gpukit.measure(device="cpu", record=False) as freed:
        del t
    assert freed.delta == -round_up(4_000_000)
    assert r.delta >= round_up(4_000_000) - 512


@pytest.mark.parametrize("make", [
    lambda base: torch.ones(100_000_000),
    lambda base: torch.empty(2**45, dtype=torch.uint8),                 # 32 TiB: more than any machine here
    lambda base: base.new_ones((2**22, 2**22)),
    lambda base: torch.empty_like(base.expand(2**43)),
    lambda base: base.expand(2**43).contiguous(),                       # no size argument: the allocator fails
], ids=["ones-400MB", "empty-32TiB", "new_ones", "empty_like", "contiguous-32TiB"])
def test_a_request_past_the_budget_raises_out_of_memory_before_the_memory_is_taken(make):
    base = torch.ones(1)
    with gpukit.measure(device="cpu", record=False):
        pass
    live = LEDGER.live_rounded
    with pytest.raises(torch.OutOfMemoryError):
        with gpukit.budget(live + 1_000_000, device="cpu"):
            make(base)
    assert LEDGER.live_rounded == live


def test_a_refused_step_frees_its_tensors_when_the_error_is_dropped_without_a_garbage_collection():
    """Device: cpu. The OOM's traceback holds the failed step's frames; gpukit's own frames must not hold the
    error back (a reference cycle), or the step's tensors stay until the garbage collector runs."""
    import gc

    from gpukit.counter import LEDGER

    def step():
        kept = torch.ones(256 * 1024)  # 1 MiB, alive in this frame when the next allocation is refused
        return kept + torch.ones(64 * 1024 * 1024)

    gc.disable()
    try:
        with gpukit.measure("cpu", record=False) as r:
            try:
                with gpukit.budget(LEDGER.live_rounded + 8 * 2**20, "cpu"):
                    step()
            except torch.OutOfMemoryError:
                pass
        assert r.delta == 0
    finally:
        gc.enable()


# -- what a user sees when a budget refuses an op ------------------------------------------------------------

def visible_frames(tb):
    """The traceback's frames that pytest and IPython show: those without ``__tracebackhide__``."""
    frames = []
    while tb is not None:
        if not tb.tb_frame.f_locals.get("__tracebackhide__"):
            frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    return frames


@pytest.mark.parametrize("op", ["announced", "found after it ran"])
def test_an_out_of_memory_traceback_ends_at_the_users_op_with_no_dynamo_frames(op):
    base = torch.ones(1)
    with pytest.raises(torch.OutOfMemoryError) as err:
        with gpukit.budget(live_now() + 1_000_000, "cpu"):
            line = sys._getframe().f_lineno + 1
            torch.empty(1_000_000) if op == "announced" else base.expand(1_000_000).contiguous()
    tb, every = err.value.__traceback__, []
    assert visible_frames(tb)[-1] == (__file__, line)
    while tb is not None:
        every.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    assert not [f for f in every if "torch" + os.sep in f]  # torch._disable_dynamo's wrappers are gone
