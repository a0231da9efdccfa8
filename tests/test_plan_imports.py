"""plan() imports the libraries a candidate needs (peft, torchao, bitsandbytes) quietly: what they log and warn
while loading stays out of the user's output, unless the import fails. Device: cpu (nothing is computed)."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

import pytest

from gpukit.factories import IMPORT_LOGGERS, quiet_import


def noisy_package(tmp_path, monkeypatch, fails: bool):
    (tmp_path / "noisy_library.py").write_text(
        "import logging, warnings\n"
        "logging.getLogger('torchao.kernels').warning('Failed to load _C_cutlass_90a.abi3.so')\n"
        "warnings.warn('a library deprecation', FutureWarning)\n"
        + ("raise ImportError('built for another torch')\n" if fails else ""))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "noisy_library", raising=False)


def test_a_library_that_imports_says_nothing_and_the_loggers_are_put_back(tmp_path, monkeypatch, caplog, capsys):
    noisy_package(tmp_path, monkeypatch, fails=False)
    before = {name: (logging.getLogger(name).propagate, list(logging.getLogger(name).handlers))
              for name in IMPORT_LOGGERS}
    with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.DEBUG):
        warnings.simplefilter("always")
        with quiet_import():
            import noisy_library  # noqa: F401
    assert seen == [] and caplog.records == [] and capsys.readouterr() == ("", "")
    assert before == {name: (logging.getLogger(name).propagate, list(logging.getLogger(name).handlers))
                      for name in IMPORT_LOGGERS}


def test_a_library_that_fails_to_import_shows_what_it_said_then_the_error(tmp_path, monkeypatch, caplog):
    noisy_package(tmp_path, monkeypatch, fails=True)
    with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.DEBUG):
        warnings.simplefilter("always")
        with pytest.raises(ImportError, match="another torch"):
            with quiet_import():
                import noisy_library  # noqa: F401
    assert [r.getMessage() for r in caplog.records] == ["Failed to load _C_cutlass_90a.abi3.so"]
    assert [str(w.message) for w in seen] == ["a library deprecation"]


def test_the_libraries_plan_imports_print_nothing_in_a_fresh_process():
    """Device: cpu. What transformers imports on a model's first build (its quantizers, which import torchao),
    torchao's optimizers and bitsandbytes, first imported the way a prediction and plan() import them (peft, which
    imports torchao, the same way): the process prints nothing, where a plain ``import torchao.optim`` prints that
    its CUDA kernels for other GPUs could not be loaded and torch's warning about how it registers its enums."""
    for name in ("transformers", "torchao", "bitsandbytes"):
        pytest.importorskip(name)
    code = ("import sys, transformers\n"
            "from gpukit.factories import preload_quietly\n"
            "from gpukit.plan.facts import import_bitsandbytes\n"
            "from gpukit.plan.host import torchao_optim\n"
            "preload_quietly()\n"
            "assert 'torchao' in sys.modules and torchao_optim() is not None and import_bitsandbytes().optim\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (done.stdout, done.stderr) == ("", ""), done.stderr[-2000:]
