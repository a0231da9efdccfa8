"""Every notebook is stored with the outputs of a run of its current code (no device: files only)."""

import json
import pytest

from notebook_outputs import NOTEBOOKS, code_digest, problems

PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_the_stored_outputs_are_current_clean_and_small(path):
    assert problems(path) == []


def _stored_copy(tmp_path):
    """A small notebook stored as the refresh command stores one: run, on the CPU, with its digest."""
    nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": ["# A lesson"]},
                    {"cell_type": "code", "metadata": {}, "execution_count": 1, "source": ["print(DEVICE)"],
                     "outputs": [{"output_type": "stream", "name": "stdout", "text": ["cpu\n"]}]}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    nb["metadata"]["gpukit"] = {"outputs": {"device": "cpu", "torch": "2.13.0", "code": code_digest(nb)}}
    copy = tmp_path / "lesson.ipynb"
    copy.write_text(json.dumps(nb))
    assert problems(copy) == []
    return copy, nb


def test_the_check_sees_outputs_made_by_older_code(tmp_path):
    copy, nb = _stored_copy(tmp_path)
    code = next(c for c in nb["cells"] if c["cell_type"] == "code")
    code["source"] = "".join(code["source"]) + "\nprint('a line added after the run')"
    copy.write_text(json.dumps(nb))
    assert any("older code" in p for p in problems(copy))


def test_the_check_sees_missing_outputs_machine_paths_and_size(tmp_path):
    copy, nb = _stored_copy(tmp_path)
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    copy.write_text(json.dumps(nb))
    found = " ".join(problems(copy))
    assert "has not run" in found and "names the device" in found

    copy, nb = _stored_copy(tmp_path)
    cell = next(c for c in nb["cells"] if c["cell_type"] == "code")
    cell["outputs"].append({"output_type": "stream", "name": "stderr",
                            "text": ["/home/someone/venv/lib/python3.11/site-packages/torch/x.py:1: Warning\n"]})
    cell["outputs"].append({"output_type": "stream", "name": "stdout", "text": ["x" * (1024 * 1024)]})
    copy.write_text(json.dumps(nb))
    found = " ".join(problems(copy))
    assert "machine paths" in found and "more than" in found

    del nb["metadata"]["gpukit"]
    copy.write_text(json.dumps(nb))
    assert any("no stored outputs" in p for p in problems(copy))


def test_the_digest_covers_code_cells_only(tmp_path):
    _, nb = _stored_copy(tmp_path)
    before = code_digest(nb)
    markdown = next(c for c in nb["cells"] if c["cell_type"] == "markdown")
    markdown["source"] = "changed prose"
    for cell in nb["cells"]:
        cell.get("outputs", []).clear()
    assert code_digest(nb) == before
