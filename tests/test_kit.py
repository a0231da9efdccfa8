"""The README's set-up command: `python3 kit.py lab` starts JupyterLab on notebooks/."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kit_lab_starts_jupyterlab_on_the_notebooks(tmp_path):
    port, token = free_port(), "gpukit-test"
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "kit.py"), "lab", "--no-browser", f"--port={port}",
         "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env=dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime")))
    try:
        deadline, listing = time.monotonic() + 90, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                url = f"http://127.0.0.1:{port}/api/contents/?token={token}"
                listing = json.load(urllib.request.urlopen(url, timeout=5))
                break
            except OSError:
                time.sleep(0.5)
        assert listing is not None, (tmp_path / "lab.log").read_text()[-3000:]
        names = {item["name"] for item in listing["content"]}
        assert "00_where_memory_goes.ipynb" in names
        lab = urllib.request.urlopen(f"http://127.0.0.1:{port}/lab?token={token}", timeout=10)
        assert lab.status == 200 and b"JupyterLab" in lab.read()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_kit_without_a_command_prints_its_usage():
    done = subprocess.run([sys.executable, str(ROOT / "kit.py")], capture_output=True, text=True)
    assert done.returncode == 2
    assert "python3 kit.py test" in done.stderr and "python3 kit.py lab" in done.stderr
