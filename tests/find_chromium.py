"""A Chromium for the browser test, found in this order:

1. one already installed: $GPUKIT_CHROMIUM, or `chromium` / `chromium-browser` / `google-chrome` /
   `google-chrome-stable` on PATH that really starts (Ubuntu's `chromium-browser` is only a pointer to a snap);
2. Debian's `chromium` package, installed with apt-get (as root, where the package exists: Ubuntu has none);
3. Playwright's own build, `python -m playwright install chromium`, where the network reaches its download host.

If none can be had, the test fails with one line that says what to run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
WHAT_TO_RUN = ("install one: `apt-get install -y chromium` (Debian), or `python -m playwright install chromium`, "
               "or set GPUKIT_CHROMIUM=/path/to/chrome; or leave the browser test out with -m 'not browser'")


class NoChromium(Exception):
    """No Chromium could be found or installed; the message is one line saying what to run."""


def starts(path: str) -> bool:
    """Whether ``path`` is a browser that runs here (`--version` answers with a Chrome or Chromium version)."""
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and ("Chrom" in done.stdout or "chrome" in done.stdout)


def installed(which=shutil.which) -> str | None:
    candidates = [os.environ.get("GPUKIT_CHROMIUM")] + [which(name) for name in NAMES]
    return next((path for path in candidates if path and starts(path)), None)


def apt_chromium(which=shutil.which) -> tuple[str | None, str]:
    """Install Debian's chromium with apt-get: (its path, or None; why not)."""
    if not which("apt-get"):
        return None, "no apt-get"
    if os.geteuid() != 0:
        return None, "apt-get needs root"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    apt = ["apt-get", "-q", "-o", "DPkg::Lock::Timeout=300"]
    for cmd in (apt + ["update"], apt + ["install", "-y", "--no-install-recommends", "chromium"]):
        for attempt in range(2):  # a mirror that does not answer once is no reason to give up
            try:
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            except subprocess.TimeoutExpired:
                return None, f"`{' '.join(cmd)}` timed out"
            if done.returncode == 0:
                break
            time.sleep(5)
        if done.returncode != 0:
            last = (done.stderr.strip() or done.stdout.strip() or "failed").splitlines()[-1]
            return None, f"`{' '.join(cmd[-3:])}`: {last}"
    found = installed(which)
    return found, "" if found else "apt-get installed no chromium that starts (a snap pointer?)"


def playwright_chromium() -> tuple[str | None, str]:
    """Playwright's own Chromium, downloaded by `playwright install chromium` unless it is there already."""
    def executable() -> str | None:
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            path = p.chromium.executable_path
        return path if path and os.path.exists(path) and starts(path) else None

    found = executable()
    if found:
        return found, ""
    try:
        done = subprocess.run([sys.executable, "-m", "playwright", "install", "chromium"],
                              capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return None, "`playwright install chromium` timed out"
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip() or "failed").splitlines()[-1]
        return None, f"`playwright install chromium`: {last[:200]}"
    found = executable()
    return found, "" if found else "`playwright install chromium` left no browser that starts"


def find_chromium(which=shutil.which, apt=apt_chromium, playwright=playwright_chromium) -> str:
    """The path of a Chromium to drive, by the order above.

    Raises:
        NoChromium: none found or installable; its message is one line saying what to run.
    """
    found = installed(which)
    if found:
        return found
    found, apt_failed = apt()
    if found:
        return found
    found, playwright_failed = playwright()
    if found:
        return found
    raise NoChromium(f"no Chromium for the browser test (none installed; apt: {apt_failed}; playwright: "
                     f"{playwright_failed}): {WHAT_TO_RUN}".replace("\n", " "))
