"""A real JupyterLab for the browser tests: ``jupyter lab`` on 127.0.0.1 with a token, its kernels
running this interpreter, its settings and workspaces in a temporary folder (nothing of the user's
own JupyterLab is read or written), and nothing that reaches for the internet (no news feed, no
update check)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from browser.helpers import ROOT, free_port


@dataclass(frozen=True)
class Lab:
    url: str      # http://127.0.0.1:PORT
    token: str
    root: Path    # the server's root_dir: notebooks put here open as /lab/tree/NAME

    def notebook_url(self, name: str) -> str:
        """The notebook ``name`` alone in a fresh workspace of its own (``reset``): no tab of an
        earlier test is restored beside it."""
        workspace = Path(name).stem.replace("_", "-")
        return f"{self.url}/lab/workspaces/{workspace}/tree/{name}?reset&token={self.token}"


def write_kernelspec(home: Path) -> Path:
    """A ``python3`` kernelspec of this interpreter under ``home/kernels`` (put first on JUPYTER_PATH)."""
    spec = home / "kernels" / "python3"
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (workbench tests)", "language": "python",
    }))
    return home


@contextmanager
def jupyter_lab(root: Path, home: Path, timeout_s: float = 90.0) -> Iterator[Lab]:
    """Start ``jupyter lab`` serving ``root``; yield a :class:`Lab` once ``/api/status`` answers."""
    port, token = free_port(), secrets.token_hex(16)
    write_kernelspec(home)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", JUPYTER_PATH=str(home),
               JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_RUNTIME_DIR=str(home / "runtime"),
               PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
           f"--LabApp.workspaces_dir={home / 'workspaces'}", f"--LabApp.user_settings_dir={home / 'settings'}",
           "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # JupyterLab refuses to run as root without it (CI runs as root)
    (ROOT / "test-artifacts").mkdir(exist_ok=True)
    log = open(ROOT / "test-artifacts" / "jupyterlab.log", "w")
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with code {proc.returncode}; see test-artifacts/jupyterlab.log")
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"jupyter lab did not answer on {url} within {timeout_s:.0f} s")
            time.sleep(0.5)
        yield Lab(url, token, root)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        log.close()
