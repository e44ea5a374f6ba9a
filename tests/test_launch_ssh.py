"""The ssh backend through a real sshd on 127.0.0.1: a generated host key and user key in a temp
dir, key authentication only. Two nodes (both on this host, each its own kernel over its own SSH
connection) run a tiny job to the end; the node run directory is not the driver's, so the
driver's copy is filled from the streamed events alone.

Before any of that (no process, no network): hostile host strings are refused where they enter,
in one line, and every ssh argv ends its options with ``--`` before the destination."""

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
from workbench.launch.gateway import GatewayBackend
from workbench.launch.ssh import SSHBackend, parse_host
from workbench.rundir.events import find_gaps, read_events

from test_launch_local import job_processes

pytestmark = [pytest.mark.timeout(300)]  # the tests with sshd are marked multiprocess one by one

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


# Host strings as a browser form or a hosts file may hand them over: each must be refused before
# it reaches ssh's command line (where -oProxyCommand=... runs a command) or a shell.
HOSTILE_HOSTS = [
    ("-oProxyCommand=touch /tmp/pwned", "starts with '-'"),
    ("-oProxyCommand=sh", "starts with '-'"),
    ("a b", "whitespace"),
    ("host;rm -rf /", "whitespace"),
    ("host;id", "contains ';'"),
    ("$(id)", "contains '$'"),
    ("`id`", "contains '`'"),
    ("host|nc", "contains '|'"),
    ("host&", "contains '&'"),
    ("ho'st", "contains \"'\""),
    ("host\n", "control character"),
    ("host\x00", "control character"),
    ("user@-x", "starts with '-'"),
    ("-l@host", "starts with '-'"),
    ("h:0", "port '0' must be an integer 1-65535"),
    ("h:70000", "port '70000' must be an integer 1-65535"),
    ("h:abc", "port 'abc' must be an integer 1-65535"),
    ("h:", "port '' must be an integer 1-65535"),
    ("", "empty"),
    ("@host", "empty user"),
    ("a@b@c", "more than one '@'"),
    ("hоbox", "non-ASCII character"),  # a Cyrillic o, not a Latin one
    ("a" * 254, "at most 253"),
    ("x." + "b" * 64, "no DNS name"),
    ("::1", "brackets"),
    ("[::1", "brackets"),
    ("[not-v6]:22", "no bracketed IPv6"),
    ("999.1.2.3", "no IPv4 address"),
    ("user.with.bad*char@h", "contains '*'"),
]


@pytest.mark.parametrize(("host", "rule"), HOSTILE_HOSTS, ids=[repr(h)[:40] for h, _ in HOSTILE_HOSTS])
def test_hostile_hosts_are_refused_in_one_line(host, rule):
    with pytest.raises(ConfigError) as e:
        SSHBackend(1, hosts=[host])
    message = str(e.value)
    assert "\n" not in message and message.startswith("host ") and rule in message, message
    assert e.value.field == "hosts"
    with pytest.raises(ConfigError):
        parse_host(host)


def test_a_hosts_file_is_checked_like_hosts(tmp_path):
    (tmp_path / "hosts").write_text("node-a\n-oProxyCommand=id\n")
    with pytest.raises(ConfigError, match="starts with '-'"):
        SSHBackend(2, hosts_file=tmp_path / "hosts")
    os.mkfifo(tmp_path / "fifo")  # opening it to read would block: it is refused without reading
    with pytest.raises(ConfigError, match="must be a regular file"):
        SSHBackend(1, hosts_file=tmp_path / "fifo")
    with pytest.raises(ConfigError, match="must be a list"):
        SSHBackend(1, hosts="node-a")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ssh_options"):
        SSHBackend(1, hosts=["node-a"], ssh_options="-oProxyCommand=id")  # type: ignore[arg-type]


@pytest.mark.parametrize(("host", "destination", "port"), [
    ("node-a", "node-a", None), ("root@127.0.0.1:2222", "root@127.0.0.1", "2222"),
    ("u.s_er@gpu-01.cluster.example", "u.s_er@gpu-01.cluster.example", None), ("user@[::1]:22", "user@::1", "22"),
])
def test_the_destination_comes_after_double_dash(host, destination, port):
    backend = SSHBackend(1, hosts=[host], ssh_options=["-o", "IdentityAgent=none"], identity_file="/k",
                         addrs=["10.0.0.1"])
    lifeline, forward = ("-M",), ("-O", "forward", "-L", "127.0.0.1:1:127.0.0.1:2")
    for options, command in ((lifeline, "python3 -c 'x'"), (forward, None)):
        argv = backend.ssh_argv(host, "/tmp/wb-ssh/n0", *options, command=command)
        dash = argv.index("--")
        assert argv.count("--") == 1 and argv[dash + 1] == destination
        assert argv[dash + 2:] == ([command] if command else [])
        assert argv[dash - len(options):dash] == list(options)  # every option before it
        assert (argv[argv.index("-p") + 1] if "-p" in argv else None) == port


# The gateway's URL: the same host rule (workbench.launch.ssh.host_problem), http(s) only.
HOSTILE_URLS = [
    ("127.0.0.1:8888", "must start with http"), ("file:///etc/passwd", "must start with http"),
    ("javascript:alert(1)", "must start with http"), ("http://", "no valid host"),
    ("http://a b", "whitespace"), ("http://h\r\nX-Injected: 1", "control character"),
    ("http://user:secret@h:8888", "user or password"), ("http://h:0", "port"), ("http://h:99999", "port"),
    ("http://h:abc", "port"), ("http://h/?token=x", "query or fragment"), ("http://-oX", "starts with '-'"),
    ("http://$(id)", "no valid host"), ("http://hоst", "non-ASCII"), ("http://[::1", "not a valid URL"),
]


@pytest.mark.parametrize(("url", "rule"), HOSTILE_URLS, ids=[u[:30] for u, _ in HOSTILE_URLS])
def test_hostile_gateway_urls_are_refused_in_one_line(url, rule):
    with pytest.raises(ConfigError) as e:
        GatewayBackend(url, token="t")
    assert "\n" not in str(e.value) and rule in str(e.value) and e.value.field == "url", str(e.value)


def test_valid_gateway_urls_pass():
    for url in ("http://127.0.0.1:8888", "https://gw.example.com/prefix/", "http://[::1]:8888", "http://localhost"):
        assert GatewayBackend(url, token="t").url == url.rstrip("/")


@pytest.mark.multiprocess
def test_without_the_key_it_fails_at_once_instead_of_prompting(sshd, tmp_path):
    port, _, known_hosts = sshd
    config = config_from_cli("tiny", "dp_shard=4", 2)
    t0 = time.time()
    with pytest.raises(Exception, match="Permission denied"):
        launch(config, "ssh", run_root=tmp_path / "runs", hosts=[f"root@127.0.0.1:{port}"] * 2,
               known_hosts_file=known_hosts, identity_file=str(tmp_path / "missing-key"),
               ssh_options=["-o", "IdentityAgent=none"], python=sys.executable)
    assert time.time() - t0 < 30


@pytest.mark.multiprocess
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
