"""The gateway backend through a real Jupyter Kernel Gateway on 127.0.0.1 with a token: two
gateway kernels as two nodes run a tiny job to the end; a wrong token is refused; the token is
written nowhere in the run directory; a second driver reattaches (open_run) with the token."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from workbench.spec.errors import ConfigError
from workbench.launch import launch, open_run
from workbench.launch.gateway import GatewayBackend
from workbench.launch.kernels import KernelError
from workbench.launch.local import config_from_cli
from workbench.rundir.events import find_gaps

from test_launch_local import job_processes

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """``jupyter kernelgateway`` on 127.0.0.1:<free port> with a random token; yields (url, token)."""
    try:
        import kernel_gateway  # noqa: F401
    except ImportError:
        pytest.skip("jupyter_kernel_gateway is not installed (pip install jupyter_kernel_gateway)")
    d = tmp_path_factory.mktemp("gateway")
    token, port = secrets.token_hex(16), _free_port()
    env = dict(os.environ, KG_AUTH_TOKEN=token)  # in the environment, not on the command line
    log = open(d / "gateway.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kernel_gateway", "--KernelGatewayApp.ip=127.0.0.1",
                             f"--KernelGatewayApp.port={port}"], env=env, stdout=log, stderr=subprocess.STDOUT,
                            cwd=d)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            req = urllib.request.Request(url + "/api", headers={"Authorization": f"token {token}"})
            urllib.request.urlopen(req, timeout=2).read()
            break
        except (urllib.error.URLError, ConnectionError, OSError):
            if proc.poll() is not None or time.time() > deadline:
                pytest.skip(f"the kernel gateway did not start: {(d / 'gateway.log').read_text()[-300:]}")
            time.sleep(0.3)
    yield url, token
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_gateway_options_are_checked(gateway):
    with pytest.raises(ConfigError, match="must start with http"):
        GatewayBackend("127.0.0.1:8888")
    url, _ = gateway
    with pytest.raises(KernelError, match="HTTP 403|HTTP 401"):
        GatewayBackend(url, token="wrong").start(None, 0)  # type: ignore[arg-type]


def test_two_gateway_kernels_run_a_job(gateway, tmp_path):
    url, token = gateway
    config = config_from_cli("tiny", "dp_shard=4", 6, seq_len=32, micro_batch_size=1)
    run = launch(config, "gateway", run_root=tmp_path / "runs", url=url, token=token,
                 remote_root=str(tmp_path / "remote"), join_timeout_s=90)
    try:
        # A second driver attaches while the first one watches; both see every event once.
        second = open_run(run.path, token=token)
        status = run.wait(timeout_s=180)
        assert status.state == "finished", status
        other = second.wait(timeout_s=60)
        assert other.state == "finished", other
        for handle in (run, second):
            events = handle.history()
            assert {e["rank"] for e in events} == {0, 1, 2, 3} and find_gaps(events) == {}
            keys = [(e["rank"], e["seq"]) for e in events]
            assert len(keys) == len(set(keys))
            assert [e["step"] for e in events if e["kind"] == "step" and e["rank"] == 3] == list(range(6))
        second.close()
        # The token is written nowhere in the run directory.
        for f in run.path.rglob("*"):
            if f.is_file():
                assert token not in f.read_text(errors="replace"), f
    finally:
        run.shutdown()
    assert job_processes(tmp_path / "remote") == []
