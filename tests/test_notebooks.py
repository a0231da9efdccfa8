"""Every notebook whose outputs no front end runs (text, tables, plots), run once in a kernel of its own, as
JupyterLab's "run all cells" runs it: each code cell in order, none outputting an error unless it is tagged
raises-exception (the notebooks' asserts are their claims). The notebooks with a widget or JavaScript, and the
README's picture, run in a browser instead (tests/test_browser.py); a notebook here that makes such an output fails,
as a browser would have to show it.

The run is over a copy of notebooks/ beside links to the rest of the repository, so what a notebook writes stays out
of the repository; plots are inline, as for a reader. Device: the notebooks' own (the CPU here)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbclient
import nbformat
import pytest

from notebook_outputs import NOTEBOOKS, copy_repository, front_end_outputs, in_the_browser, longest_first

RUN_TIMEOUT_S = 300  # one cell; a whole notebook takes 5-75 s on two cores
HEADLESS = [p for p in longest_first(NOTEBOOKS.glob("*.ipynb")) if not in_the_browser(p)]

pytestmark = pytest.mark.notebook


@pytest.mark.parametrize("notebook", HEADLESS, ids=[p.stem for p in HEADLESS])
def test_notebook_runs_without_errors(notebook: Path, tmp_path):
    copy = copy_repository(tmp_path / "repo") / notebook.name
    nb = nbformat.read(copy, as_version=4)
    env = dict(os.environ)
    env.pop("MPLBACKEND", None)  # `kit.py test` sets Agg; in a notebook plots show inline, as for a reader
    env.setdefault("OMP_NUM_THREADS", "1")  # the kernel shares the cores with the other worker
    client = nbclient.NotebookClient(nb, timeout=RUN_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(copy.parent)}})
    try:
        client.execute(env=env)
    except nbclient.exceptions.CellExecutionError as err:  # (a cell tagged raises-exception may raise)
        plain = re.sub(r"\x1b\[[0-9;]*m", "", str(err))  # (the traceback's colours)
        pytest.fail(f"{notebook.name}: {plain[-3000:]}", pytrace=False)
    missed = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.strip()
              and c.execution_count is None]
    assert not missed, f"{notebook.name}: code cells {missed} did not run"
    shown = front_end_outputs(nb)
    assert not shown, (f"{notebook.name} shows what only a browser can show to fail ({', '.join(shown[:3])}), and its "
                       f"stored outputs do not: store them (python3 kit.py outputs notebooks/{notebook.name}), "
                       "so that tests/test_browser.py runs it")
