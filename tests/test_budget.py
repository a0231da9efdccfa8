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
    lambda base: base.expand(2**43).contiguous(),                       # no size argument: sized on meta
    lambda base: torch.outer(base.expand(2**22), base.expand(2**22)),    # 64 TiB from two 16 MiB views
], ids=["ones-400MB", "empty-32TiB", "new_ones", "empty_like", "contiguous-32TiB", "outer-64TiB"])
def test_a_request_past_the_budget_raises_out_of_memory_before_the_memory_is_taken(make):
    base = torch.ones(1)
    with gpukit.measure(device="cpu", record=False):
        pass
    live = LEDGER.live_rounded
    with pytest.raises(torch.OutOfMemoryError) as refused:
        with gpukit.budget(live + 1_000_000, device="cpu"):
            make(base)
    assert LEDGER.live_rounded == live
    # The budget refused it, from the op's sizes: a machine that overcommits memory (Linux's
    # vm.overcommit_memory=1) would grant the 32 TiB and be killed while filling it.
    assert "the machine itself could not provide" not in str(refused.value)


def test_an_op_sized_on_meta_once_is_refused_again_and_its_smaller_self_still_fits():
    """Device: cpu. Sizes found on meta tensors are kept by the op's shapes (a step repeats them): the same
    request is refused the second time too, and the same op on a small shape is not confused with it."""
    base = torch.ones(1)
    with gpukit.measure(device="cpu", record=False):
        pass
    live = LEDGER.live_rounded
    for _ in range(2):
        with pytest.raises(torch.OutOfMemoryError) as refused:
            with gpukit.budget(live + 1_000_000, device="cpu"):
                base.expand(2**43).contiguous()
        assert "the machine itself could not provide" not in str(refused.value)
    with gpukit.budget(live + 1_000_000, device="cpu"):
        small = base.expand(1000).contiguous()
    assert small.shape == (1000,)


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


# -- data in host memory: budget(host=...) --------------------------------------------------------------------

def tiny_step():
    model = torch.nn.Linear(64, 10)
    model(torch.randn(32, 64)).sum().backward()


@pytest.fixture
def dataset():
    """Device: cpu. 64 MB of data, as a user holds a data set in memory: far more than the budgets below."""
    return torch.ones(16_000_000)


def test_a_dataset_named_as_host_memory_does_not_count_against_a_cpu_budget(dataset):
    room = live_now() - round_up(dataset.nbytes) + 4 * 2**20  # 4 MiB besides everything else the process holds
    with pytest.warns(gpukit.BudgetWarning):
        with pytest.raises(torch.OutOfMemoryError, match="already allocated; budget"):
            with gpukit.budget(room, "cpu"):
                tiny_step()
    with gpukit.budget(room, "cpu", host=dataset):
        tiny_step()
        batch = dataset[:1000]                    # a view: the data's own storage, nothing new
        with pytest.raises(torch.OutOfMemoryError, match=r"not counting 61\.04 MiB \(64,000,000 B\) on the host"):
            dataset[:2_000_000].clone()          # a copy is device memory: 8 MB does not fit in 4 MiB
    assert LEDGER.limits == []
    del batch


@pytest.mark.parametrize("host", [
    lambda data: {"train": [data], "name": "digits"},
    lambda data: torch.utils.data.TensorDataset(data).tensors,
    lambda data: data[10:],                        # a view names its whole storage
], ids=["nested", "TensorDataset.tensors", "view"])
def test_host_takes_any_structure_of_tensors(dataset, host):
    room = live_now() - round_up(dataset.nbytes) + 4 * 2**20
    with gpukit.budget(room, "cpu", host=host(dataset)):
        tiny_step()


def test_a_module_and_its_optimizer_state_can_live_on_the_host():
    model = torch.nn.Linear(2000, 2000)                                   # 16 MB of weights
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2000)).sum().backward()
    opt.step()                                                            # 32 MB of state, 16 MB of grads
    room = live_now() - 4 * round_up(model.weight.nbytes) + 4 * 2**20     # not enough for any of them
    with gpukit.budget(room, "cpu", host=[model, opt]):
        kept = torch.empty(500_000)                                       # 2 MB
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1_000_000)                                        # 4 MB more: past the 4 MiB
    del kept


def test_host_data_that_dies_or_grows_in_the_block_leaves_the_room_as_it_was():
    data = torch.ones(8_000_000)
    room = live_now() - round_up(data.nbytes) + 4 * 2**20
    with gpukit.budget(room, "cpu", host=data):
        data.resize_(12_000_000)                  # the host grows: not the device
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1_100_000)
        del data                                  # its bytes leave the process and the host together
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1_100_000)                # 4.4 MB: the room did not grow by the data's 48 MB
        kept = torch.empty(1_000_000)             # 4 MB: fits, as before
    del kept


def test_a_budget_nested_in_one_with_host_data_leaves_the_same_data_out(dataset):
    room = live_now() - round_up(dataset.nbytes) + 4 * 2**20
    with gpukit.budget(room, "cpu", host=dataset):
        with gpukit.budget(room - 2 * 2**20, "cpu"):  # the smaller cap, still without the data
            kept = torch.empty(250_000)               # 1 MB of the 2 MiB
            with pytest.raises(torch.OutOfMemoryError):
                torch.empty(600_000)                  # 2.4 MB more
    del kept


@pytest.mark.parametrize("kwargs, says", [
    ({"host": 3}, "host= holds no CPU tensor"),
    ({"host": [torch.ones(1)], "reserved": True}, "host= is not available with reserved=True"),
])
def test_host_that_cannot_be_honoured_is_refused(kwargs, says):
    with pytest.raises(ValueError, match=says):
        gpukit.budget("1GB", "cpu", **kwargs)


def test_a_budget_exceeded_as_it_opens_warns_once_at_the_users_line_with_the_figures(dataset):
    import warnings

    room = live_now() - round_up(dataset.nbytes) + 4 * 2**20
    used = live_now()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        with gpukit.budget(room, "cpu"):
            pass
        with gpukit.budget(room, "cpu", host=dataset):   # the data left out: under the budget, no warning
            pass
    assert [w.category for w in caught] == [gpukit.BudgetWarning]
    warning = caught[0]
    assert (warning.filename, warning.lineno) == (__file__, line)
    message = str(warning.message)
    assert f"{gpukit.format_bytes(used)} of CPU tensors are allocated" in message
    assert "The largest storages: 61.04 MiB" in message          # the data set's 64,000,000 B
    assert "host=" in message


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
