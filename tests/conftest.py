import gc

import pytest
import torch

import gpukit
import gpukit.meter
from gpukit.counter import LEDGER


def _no_default_device() -> torch.device:
    raise RuntimeError(
        "this test measures gpukit's default device, which is the CPU here but the GPU on a GPU machine: "
        "name the device it measures (measure('cpu'), budget(size, 'cpu'), device='cpu'...)")


@pytest.fixture(autouse=True)
def every_test_names_its_device(request, monkeypatch):
    """On a GPU machine gpukit's default device is the GPU, so a test that leaves the device out and then
    builds CPU tensors measures nothing there. Here the default raises, so such a test fails on the CPU too.
    A test of the default itself is marked ``uses_default_device``."""
    if request.node.get_closest_marker("uses_default_device") is None:
        monkeypatch.setattr(gpukit.meter, "default_device", _no_default_device)


@pytest.fixture(autouse=True)
def clean_state():
    """Each test starts with an empty history and leaves the counter switched off."""
    gpukit.clear_history()
    yield
    gpukit.clear_history()
    assert not LEDGER.active, "a test left the CPU counter running"
    assert not LEDGER.tallies
    gc.collect()


@pytest.fixture
def digits():
    from gpukit.lessons.data import load_digits

    images, labels = load_digits()
    return images[:256], labels[:256]


# Unit-test files whose tests take 20 s to 3 minutes each (exhaustive plan searches, notebooks run by the rehearsal):
# run right after the notebooks, so that no such test starts last while the other worker has nothing left.
SLOW_FILES = ("test_plan_bounds.py", "test_plan_ranking.py", "test_plan_qlora.py", "test_plan.py",
              "test_rehearsal.py")


def pytest_collection_modifyitems(session, config, items):
    """The notebooks first, in the browser or not, longest first (each takes 10 to 80 s), then the slowest unit
    tests' files, then the rest, which fill in around them: with each test sent to the next free worker
    (``--maxschedchunk 1``, kit.py), the two workers finish within a short test of each other."""
    from notebook_outputs import LONGEST_FIRST

    def rank(item) -> tuple:
        if item.get_closest_marker("notebook") is None:
            return 1, item.path.name not in SLOW_FILES, 0
        path = getattr(item, "callspec", None) and item.callspec.params.get("notebook")
        prefix = path.name[:2] if path is not None else ""
        return 0, False, LONGEST_FIRST.index(prefix) if prefix in LONGEST_FIRST else -1

    items.sort(key=rank)  # stable: each group keeps its order


def pytest_collection_finish(session):
    """Move every object that exists once the tests are collected (torch, dynamo, IPython: some 300,000) to
    the collector's permanent generation. ``clean_state`` collects after each test, which then scans what the
    tests made rather than every module (170 ms a test here), and the counter's first scan after a collection
    meets only those too. The objects frozen are modules, functions and their constants: they live as long as
    the process, whatever the tests do."""
    import torch._dynamo  # noqa: F401  (imported by the first optimizer a test builds: frozen with the rest)

    gc.collect()
    gc.freeze()


def pytest_configure(config):
    config.addinivalue_line("markers", "uses_default_device: the test is about gpukit's default device itself")
