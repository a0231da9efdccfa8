"""Private PyTorch names are used in one module, checked against the torch version in use."""

import ast
from pathlib import Path

import pytest

import gpukit
from gpukit import _torch

PACKAGE = Path(gpukit.__file__).parent


def _private_uses(path: Path) -> list[str]:
    """Private torch names a source file imports or reads (``torch._C.x``, ``from torch.utils._pytree ...``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("torch") and "._" in a.name]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "torch" and chain[-1] != "ops":  # aten ops are public
                found.append(".".join(["torch", *reversed(chain)]))
        elif (isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute)
                                                 and t.value.attr == "UntypedStorage" for t in node.targets)):
            found.append("assignment to torch.UntypedStorage")
    return found


def test_no_module_but_one_touches_private_torch_names():
    offenders = {str(p.relative_to(PACKAGE)): uses for p in sorted(PACKAGE.rglob("*.py"))
                 if p.name != "_torch.py" and (uses := _private_uses(p))}
    assert offenders == {}
    assert _private_uses(PACKAGE / "_torch.py")  # the scan does see them where they are


def test_the_scan_finds_each_kind_of_private_access(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import torch\nfrom torch.utils._pytree import tree_map\nx = torch._C._current_graph_task_id()\n"
                      "torch.UntypedStorage.resize_ = None\nimport torch._dynamo\n")
    assert set(_private_uses(source)) >= {"from torch.utils._pytree import ...", "torch._C._current_graph_task_id",
                                          "assignment to torch.UntypedStorage", "torch._dynamo"}


@pytest.mark.parametrize("version", ["2.10.0+cu128", "2.11.0+cu130", "2.13.0+cpu", "2.15.0", "2.15.3+cu132"])
def test_the_checked_versions_are_accepted(version):
    _torch.check_version(version, allow_unchecked=False)


@pytest.mark.parametrize("version", ["2.9.1", "2.16.0.dev20261101", "3.0.0"])
def test_a_version_outside_the_checked_range_is_refused_with_what_to_do(version):
    with pytest.raises(_torch.UnsupportedTorch, match=r"checked on torch 2\.10 to 2\.15.*GPUKIT_UNCHECKED_TORCH=1"):
        _torch.check_version(version, allow_unchecked=False)
    _torch.check_version(version, allow_unchecked=True)  # the user's own risk, when asked for


def test_the_environment_variable_allows_an_unchecked_torch(monkeypatch):
    monkeypatch.setenv("GPUKIT_UNCHECKED_TORCH", "1")
    _torch.check_version("2.16.0")
    monkeypatch.setenv("GPUKIT_UNCHECKED_TORCH", "0")
    with pytest.raises(_torch.UnsupportedTorch):
        _torch.check_version("2.16.0")


def test_an_unreadable_version_and_a_missing_name_are_refused():
    with pytest.raises(_torch.UnsupportedTorch, match="cannot read"):
        _torch.check_version("nightly", allow_unchecked=False)

    class Bare:
        pass

    with pytest.raises(_torch.UnsupportedTorch, match=r"no torch\._C\.gone"):
        _torch._require(Bare, "gone", "torch._C")


def test_in_backward_is_true_only_inside_autograd_backward():
    import torch

    seen = []
    x = torch.ones(2, device="cpu", requires_grad=True)
    x.register_hook(lambda g: seen.append(_torch.in_backward()))
    assert not _torch.in_backward()
    (x * 2).sum().backward()
    assert seen == [True]


def test_importing_gpukit_leaves_memtracker_and_its_1_5_s_of_imports_until_roles_are_asked_for():
    # No device: a fresh interpreter, so that nothing imported before counts.
    import subprocess
    import sys

    code = ("import sys, gpukit\n"
            "before = 'torch.distributed._tools.mem_tracker' in sys.modules\n"
            "from gpukit import _torch\n"
            "assert _torch.StepTracker.__mro__[2] is _torch.MemTracker\n"
            "print(before, 'torch.distributed._tools.mem_tracker' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]
