"""The notebooks a browser must see, run once in JupyterLab in a real browser: no cell error, every widget renders,
no page error.

A notebook runs here when its stored outputs hold a widget or JavaScript (``notebook_outputs.in_the_browser``), and
the README's picture does: a widget whose front end fails shows "Error displaying widget" while its kernel reports
no error, and a script error in the page breaks what the reader sees. The other notebooks print text, tables and
plots, which no front end runs: they run in a kernel alone (tests/test_notebooks.py), for about half the CPU time
that JupyterLab and Chromium add around the same run, and fail there if they make such an output after all. The
checks here are what nbval --nbval-lax checks (every code cell runs, and none outputs an error unless it is tagged
raises-exception: the notebooks' asserts are their claims) and what only a browser shows. nbval stays for one
notebook at a time (`pytest notebooks/04_gradient_accumulation.ipynb`), without a browser.

It starts JupyterLab on a free local port, over a copy of notebooks/ (autosave writes nothing into the
repository), opens each notebook in headless Chromium driven by Playwright (found or installed as
tests/find_chromium.py says: an installed one, Debian's package, or Playwright's own), runs all cells,
checks the page and saves a screenshot. One server and one browser serve all notebooks; each notebook gets its
own workspace and its kernel is shut down before the next one starts, so only one kernel runs at a time.

Screenshots go to tests/screenshots/ (ignored by git), or to $GPUKIT_SCREENSHOT_DIR. The README's picture is
refreshed with

    GPUKIT_README_PICTURE=docs/notebook.png python3 kit.py test tests/test_browser.py -k 00_where

Skip these tests with `-m "not browser"`, and every notebook's run with `-m "not notebook"`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError
from playwright.sync_api import sync_playwright

from find_chromium import NoChromium, find_chromium
from notebook_outputs import README_NOTEBOOK, copy_repository, in_the_browser, longest_first

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = [p for p in longest_first((ROOT / "notebooks").glob("*.ipynb")) if in_the_browser(p)]
RUN_TIMEOUT_S = 300                         # one notebook's cells; they take 5-40 s on two cores
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# JupyterLab settings for a quiet, complete page: no news prompt or toasts in the screenshots, and every cell
# kept in the page (the default windowing leaves cells out of view unrendered, widgets included).
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}

pytestmark = [pytest.mark.notebook, pytest.mark.browser]


def api(lab, method: str, path: str):
    """Call JupyterLab's REST API; returns the decoded JSON (None for an empty reply)."""
    request = urllib.request.Request(f"{lab['url']}api/{path}", method=method,
                                     headers={"Authorization": f"token {lab['token']}"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        body = reply.read()
    return json.loads(body) if body else None


def shut_down_kernels(lab) -> None:
    """End every session and kernel the server runs, so the next notebook has the machine to itself."""
    for session in api(lab, "GET", "sessions"):
        api(lab, "DELETE", f"sessions/{session['id']}")
    for kernel in api(lab, "GET", "kernels"):
        api(lab, "DELETE", f"kernels/{kernel['id']}")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on a free port over a copy of notebooks/, with its own settings, workspaces and runtime."""
    home = tmp_path_factory.mktemp("lab")
    notebooks = copy_repository(home / "repo")
    jupyter = home / "jupyter"
    for name, values in LAB_SETTINGS.items():
        (jupyter / "settings" / name).parent.mkdir(parents=True, exist_ok=True)
        (jupyter / "settings" / name).write_text(json.dumps(values))
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(jupyter / "runtime"), JUPYTER_CONFIG_DIR=str(jupyter / "config"),
               JUPYTER_DATA_DIR=str(jupyter / "data"), JUPYTERLAB_SETTINGS_DIR=str(jupyter / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(jupyter / "workspaces"), IPYTHONDIR=str(jupyter / "ipython"))
    env.pop("MPLBACKEND", None)  # `kit.py test` sets Agg for nbval; in JupyterLab plots show inline, as for a reader
    # The kernel shares the cores with the server and the browser: torch threads waiting for a preempted sibling
    # slow small steps down several times over on a two-core machine.
    env.setdefault("OMP_NUM_THREADS", "1")
    token = "gpukit-browser-test"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--port=0", "--ServerApp.ip=127.0.0.1",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={notebooks}",
           "--expose-app-in-browser", "--LabApp.news_url=None"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")  # JupyterLab refuses to run as root without it
    log = open(home / "lab.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    info_file = jupyter / "runtime" / f"jpserver-{proc.pid}.json"
    server = None
    try:
        deadline = time.monotonic() + 120
        while server is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                info = json.loads(info_file.read_text())
                server = {"url": info["url"], "token": token, "home": home}
                api(server, "GET", "status")
            except (OSError, ValueError, KeyError):
                server = None
                time.sleep(0.5)
        assert server is not None, f"JupyterLab did not start:\n{(home / 'lab.log').read_text()[-3000:]}"
        yield server
    finally:
        try:
            if server is not None and proc.poll() is None:
                shut_down_kernels(server)
        finally:
            stop(proc)
            log.close()


def stop(proc: subprocess.Popen) -> None:
    """Stop the server by its process id (with its process group), waiting up to 30 s before killing it."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass  # already gone
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def browser(lab):
    try:
        executable = find_chromium()
    except NoChromium as missing:
        pytest.fail(str(missing), pytrace=False)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def screenshot_dir() -> Path:
    path = Path(os.environ.get("GPUKIT_SCREENSHOT_DIR") or ROOT / "tests" / "screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


# JavaScript run in the page. window.jupyterapp is there because of --expose-app-in-browser.
FIND_PANEL = """name => {
    const app = window.jupyterapp;
    if (!app) return null;
    for (const w of app.shell.widgets('main')) {
        if (w.context && w.context.path === name && w.content && w.content.model) return w;
    }
    return null;
}"""

KERNEL_READY = f"""name => {{
    const panel = ({FIND_PANEL})(name);
    const kernel = panel && panel.sessionContext.session && panel.sessionContext.session.kernel;
    return !!(panel && panel.context.isReady && kernel && kernel.status === 'idle');
}}"""

# Not awaited: the command resolves only when every cell has run, and the test keeps its own time limit.
RUN_ALL = f"""name => {{
    const app = window.jupyterapp;
    const panel = ({FIND_PANEL})(name);
    app.shell.activateById(panel.id);
    app.commands.execute('notebook:run-all-cells');
}}"""

CELL_STATE = f"""name => {{
    const panel = ({FIND_PANEL})(name);
    const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
    const cells = [];
    const list = panel.content.model.cells;
    for (let i = 0; i < list.length; i++) {{
        const cell = list.get(i);
        // JupyterLab does not send an empty cell to the kernel: it never gets an execution count.
        if (cell.type !== 'code' || !cell.sharedModel.getSource().trim()) continue;
        // Each output's type and keys only: serialising every output (plots, tables) twice a second cost
        // the page more than rendering them.
        const errors = [];
        let widgets = 0;
        for (let j = 0; j < cell.outputs.length; j++) {{
            const output = cell.outputs.get(j);
            if (output.type === 'error') {{
                const o = output.toJSON();
                errors.push([o.ename, o.evalue, (o.traceback || []).join('\\n')]);
            }} else if (output.data && output.data['application/vnd.jupyter.widget-view+json']) {{
                widgets++;
            }}
        }}
        cells.push({{
            index: i,
            count: cell.executionCount,
            running: cell.executionState === 'running',
            source: cell.sharedModel.getSource(),
            tags: cell.getMetadata('tags') || [],
            errors,
            widgets,
        }});
    }}
    return {{kernel: kernel ? kernel.status : 'none', cells}};
}}"""


def first_line(source: str) -> str:
    return next((line for line in source.splitlines() if line.strip()), "")[:100]


def run_all_cells(page, name: str) -> list[dict]:
    """Run every cell of the open notebook and wait until all have run; fails at the first cell error."""
    page.evaluate(RUN_ALL, name)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        state = page.evaluate(CELL_STATE, name)
        for cell in state["cells"]:
            if "raises-exception" in cell["tags"]:
                continue  # an error the notebook shows on purpose (nbval and JupyterLab honour the tag too)
            for ename, evalue, traceback in cell["errors"]:
                traceback = re.sub(r"\x1b\[[0-9;]*m", "", traceback)
                pytest.fail(f"{name}: cell {cell['index']} ({first_line(cell['source'])!r}) raised "
                            f"{ename}: {evalue}\n{traceback[-3000:]}")
        if state["kernel"] in ("dead", "unknown"):
            pytest.fail(f"{name}: the kernel died ({state['kernel']})")
        waiting = [c for c in state["cells"] if c["count"] is None or c["running"]]
        if not waiting and state["kernel"] == "idle":
            return state["cells"]
        if time.monotonic() > deadline:
            cell = waiting[0] if waiting else state["cells"][-1]
            pytest.fail(f"{name}: not done after {RUN_TIMEOUT_S} s; waiting on cell {cell['index']} "
                        f"({first_line(cell['source'])!r}), kernel {state['kernel']}")
        time.sleep(0.5)


def check_widgets(page, name: str, cells: list[dict]) -> None:
    """Every widget output has a rendered view, none failed, and gpukit's own widgets show what they should."""
    expected = sum(c["widgets"] for c in cells)
    views = page.locator(".jp-Cell-outputArea > .jp-OutputArea-child > .jp-OutputArea-output")
    rendered = views.filter(has=page.locator(".jupyter-widgets"))
    deadline = time.monotonic() + 60
    while rendered.count() < expected or page.get_by_text("Loading widget...").count():
        if time.monotonic() > deadline or page.get_by_text("Error displaying widget").count():
            break
        time.sleep(0.5)
    failed = [line for line in page.locator("body").inner_text().splitlines() if "Error displaying widget" in line]
    if failed:
        pytest.fail(f"{name}: a widget failed to render: {failed[0]}")
    assert rendered.count() == expected, f"{name}: {expected} widget outputs, {rendered.count()} rendered"

    source = "\n".join(c["source"] for c in cells)
    if "MemoryGauge(" in source:
        gauge = page.locator(".widget-vbox").filter(has=page.locator(".widget-html", has_text=re.compile(
            r"step \d+: current .+, peak"))).filter(has=page.locator(".widget-hprogress"))
        assert gauge.count() >= 1, f"{name}: no memory gauge with its bars and text"
        assert gauge.first.is_visible()
        assert gauge.first.locator(".widget-hprogress").count() == 2, f"{name}: the gauge has no current and peak bars"
    if "TechniqueExplorer(" in source:
        explorer = page.locator(".widget-vbox").filter(has=page.get_by_role("button", name="run one step"))
        assert explorer.count() >= 1, f"{name}: no technique explorer"
        explorer = explorer.last
        assert explorer.is_visible()
        for toggle in ("autocast (bf16)", "checkpointing"):
            assert explorer.get_by_role("button", name=toggle, exact=True).is_visible(), \
                f"{name}: the explorer has no {toggle!r} toggle"
        assert explorer.locator(".widget-output img").count() == 1, f"{name}: the explorer shows no role bars"
        assert explorer.locator("table tr").count() >= 2, f"{name}: the explorer shows no table of runs"


def screenshot(page, path: Path) -> None:
    """The notebook scrolled to its first widget (else its first plot, else its top), as a reader would see it:
    the output at the top, under the last lines of the code that made it."""
    for selector in (".jp-Cell-outputArea .jupyter-widgets", ".jp-Cell-outputArea img", ".jp-Cell"):
        found = page.locator(selector)
        if found.count():
            found.first.evaluate("""e => {
                e.closest('.jp-OutputArea-child, .jp-Cell').scrollIntoView({block: 'start'});
                const scroller = e.closest('.jp-WindowedPanel-outer');
                if (scroller && scroller.scrollTop > 0) scroller.scrollTop -= 120;
            }""")
            break
    page.wait_for_timeout(300)  # let the scroll settle
    page.screenshot(path=str(path))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_jupyterlab_without_errors(notebook, lab, browser, screenshot_dir):
    name = notebook.name
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(60_000)
    page_errors = []
    page.on("pageerror", lambda err: page_errors.append(str(err)))
    shot = screenshot_dir / f"{notebook.stem}.png"
    try:
        # Its own workspace, reset: JupyterLab would otherwise reopen every notebook opened before.
        page.goto(f"{lab['url']}lab/workspaces/{notebook.stem}/tree/{name}?reset&token={lab['token']}")
        try:
            page.wait_for_function(KERNEL_READY, arg=name, timeout=120_000)
        except PlaywrightTimeoutError:
            pytest.fail(f"{name}: JupyterLab did not show the notebook with an idle kernel within 120 s")
        page.evaluate("() => window.jupyterapp.shell.collapseLeft()")  # the file browser: room for the notebook
        cells = run_all_cells(page, name)
        check_widgets(page, name, cells)
        assert not page_errors, f"{name}: errors in the page: {page_errors}"
        screenshot(page, shot)
        picture = os.environ.get("GPUKIT_README_PICTURE")
        if picture and notebook.stem == README_NOTEBOOK:
            shutil.copyfile(shot, ROOT / picture)
    except BaseException:
        try:
            page.screenshot(path=str(shot))
        except Exception as err:  # a crashed page: the original failure matters more
            print(f"no screenshot of the failure: {err}")
        log = (lab["home"] / "lab.log").read_text()
        print(f"screenshot of the failure: {shot}\nerrors in the page: {page_errors}\n"
              f"end of the JupyterLab log:\n{log[-3000:]}")
        raise
    finally:
        page.close()
        shut_down_kernels(lab)
