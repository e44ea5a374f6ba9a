"""The ssh backend through a real sshd on 127.0.0.1: a generated host key and user key in a temp
dir, key authentication only. Two nodes (both on this host, each its own kernel over its own SSH
connection) run a tiny job to the end; the node run directory is not the driver's, so the
driver's copy is filled from the streamed events alone."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from workbench.spec.errors import ConfigError
from workbench.launch import launch
from workbench.launch.local import config_from_cli
from workbench.launch.ssh import SSHBackend
from workbench.rundir.events import find_gaps, read_events

from test_launch_local import job_processes

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """sshd -D on 127.0.0.1:<free port>; yields (port, identity file, known_hosts file)."""
    if not os.path.exists(SSHD) or not shutil.which("ssh"):
        pytest.skip("openssh-server is not installed (Debian: apt-get install openssh-server)")
    d = tmp_path_factory.mktemp("sshd")
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    (d / "authorized_keys").write_text((d / "user_key.pub").read_text())
    os.chmod(d / "authorized_keys", 0o600)
    port = _free_port()
    (d / "sshd_config").write_text(f"""
Port {port}
ListenAddress 127.0.0.1
HostKey {d / 'host_key'}
AuthorizedKeysFile {d / 'authorized_keys'}
PidFile {d / 'sshd.pid'}
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
AllowTcpForwarding yes
""")
    host_pub = (d / "host_key.pub").read_text().split()
    (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    proc = subprocess.Popen([SSHD, "-f", str(d / "sshd_config"), "-D", "-e"], stdout=subprocess.DEVNULL,
                            stderr=open(d / "sshd.log", "w"))
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None:
                pytest.skip(f"sshd cannot run here: {(d / 'sshd.log').read_text()[-300:]}")
            time.sleep(0.1)
    yield port, str(d / "user_key"), str(d / "known_hosts")
    proc.terminate()
    proc.wait(timeout=10)


def test_hosts_are_checked_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="1 host\\(s\\) for nodes=2"):
        SSHBackend(2, hosts=["127.0.0.1"])
    with pytest.raises(ConfigError, match="needs hosts"):
        SSHBackend(2)
    (tmp_path / "hosts").write_text("# two nodes\nnode-b slots=2\nnode-a\n")
    backend = SSHBackend(2, hosts_file=tmp_path / "hosts")
    assert backend.hosts == ["node-a", "node-b"]  # node order = rendezvous order (sorted addresses)


def test_without_the_key_it_fails_at_once_instead_of_prompting(sshd, tmp_path):
    port, _, known_hosts = sshd
    config = config_from_cli("tiny", "dp_shard=4", 2)
    t0 = time.time()
    with pytest.raises(Exception, match="Permission denied"):
        launch(config, "ssh", run_root=tmp_path / "runs", hosts=[f"root@127.0.0.1:{port}"] * 2,
               known_hosts_file=known_hosts, identity_file=str(tmp_path / "missing-key"),
               ssh_options=["-o", "IdentityAgent=none"], python=sys.executable)
    assert time.time() - t0 < 30


def test_two_nodes_over_ssh_run_a_job(sshd, tmp_path):
    port, key, known_hosts = sshd
    config = config_from_cli("tiny", "dp_shard=4", 6, seq_len=32, micro_batch_size=1)
    remote_root = tmp_path / "remote"
    run = launch(config, "ssh", run_root=tmp_path / "runs", hosts=[f"root@127.0.0.1:{port}"] * 2,
                 identity_file=key, known_hosts_file=known_hosts, python=sys.executable,
                 remote_root=str(remote_root), join_timeout_s=90)
    try:
        status = run.wait(timeout_s=180)
        assert status.state == "finished", status
        assert [n.state for n in status.nodes] == ["finished", "finished"]
        events = run.history()
        assert {e["rank"] for e in events} == {0, 1, 2, 3} and find_gaps(events) == {}
        steps = {r: [e["step"] for e in events if e["kind"] == "step" and e["rank"] == r] for r in range(4)}
        assert all(s == list(range(6)) for s in steps.values())
        # The nodes wrote into remote_root; the driver's copy came from the stream, event for event.
        node_dir = remote_root / run.run_id
        for r in range(4):
            assert (run.path / "events" / f"rank-{r}.jsonl").read_text() == \
                (node_dir / "events" / f"rank-{r}.jsonl").read_text()
        assert read_events(run.path) and find_gaps(read_events(run.path)) == {}

        async def drain():  # the UI's async iterator: everything once, then it ends with the run
            return [e for batch in [b async for b in run.aevents(poll_s=0.05)] for e in batch]

        assert asyncio.run(drain()) == events
        # The connection files hold the keys: 0600; the remote copies were removed once read.
        for f in (run.path / "launch").glob("kernel-node*.json"):
            assert f.stat().st_mode & 0o777 == 0o600
    finally:
        run.shutdown()
    assert job_processes(run.path) == [] and job_processes(remote_root) == []
    remote_kernels = subprocess.run(["pgrep", "-f", "wb-kernel-"], capture_output=True, text=True).stdout.split()
    assert remote_kernels == [], "the remote kernels ended with their SSH connections"
