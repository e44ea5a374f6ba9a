"""Kernels on remote hosts over SSH (key authentication only, never a password prompt).

Per node, one SSH connection that is three things at once:

1. the *lifeline*: it runs a small boot script on the host (:data:`BOOT`) that picks five free
   loopback ports, writes the kernel's connection file (0600, in a private directory), starts
   ``python -m ipykernel_launcher -f <file>`` and then reads its stdin until EOF. EOF means the
   driver or the connection is gone: the script then stops the kernel, whose agent's torchrun
   and workers follow by their death signals. The key reaches the host on stdin, never on a
   command line (which ``ps`` shows to every user);
2. the *control master* (``-M -S <socket>`` in a private 0700 directory) that
3. carries the tunnels: ``ssh -O forward -L 127.0.0.1:<local>:127.0.0.1:<remote>`` for the five
   ports, so the kernel listens on the host's loopback only and the driver reaches it through
   the encrypted connection.

``BatchMode=yes``: a missing key or an unknown host key fails at once instead of prompting.
Hosts: ``hosts=["[user@]host[:port]", ...]`` or ``hosts_file`` (one per line, ``#`` comments).
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shlex
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from workbench.spec.errors import ConfigError
from workbench.launch.kernels import KernelError, ZmqChannel

PORT_NAMES = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")

# Runs on the host under the remote Python. stdin: one JSON line {"key": ...}, then the lifeline.
BOOT = r"""
import json, os, shutil, signal, socket, subprocess, sys, tempfile, time
info = json.loads(sys.stdin.readline())
d = tempfile.mkdtemp(prefix="wb-kernel-")
names = ["shell_port", "iopub_port", "stdin_port", "control_port", "hb_port"]
socks = []
for _ in names:
    s = socket.socket(); s.bind(("127.0.0.1", 0)); socks.append(s)
ports = {n: s.getsockname()[1] for n, s in zip(names, socks)}
for s in socks: s.close()
conn = dict(ports, ip="127.0.0.1", transport="tcp", key=info["key"], signature_scheme="hmac-sha256", kernel_name="")
path = os.path.join(d, "kernel.json")
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
os.write(fd, json.dumps(conn).encode()); os.close(fd)
log = open(os.path.join(d, "kernel.log"), "w")
env = dict(os.environ, JPY_PARENT_PID=str(os.getpid()))  # the kernel exits if this script goes
k = subprocess.Popen([sys.executable, "-m", "ipykernel_launcher", "-f", path], env=env,
                     stdin=subprocess.DEVNULL, stdout=log, stderr=log)
def _end(*_):
    raise SystemExit(0)
signal.signal(signal.SIGTERM, _end); signal.signal(signal.SIGHUP, _end)
try:
    for _ in range(600):  # once the kernel listens it has read the file: remove the key from disk
        try:
            socket.create_connection(("127.0.0.1", ports["hb_port"]), timeout=1).close(); break
        except OSError:
            if k.poll() is not None: break
            time.sleep(0.1)
    os.remove(path)
    print(json.dumps({"ports": ports, "kernel_pid": k.pid, "host": socket.gethostname()}), flush=True)
    sys.stdin.read()
finally:
    k.terminate()
    try:
        k.wait(10)
    except subprocess.TimeoutExpired:
        k.kill()
    shutil.rmtree(d, ignore_errors=True)
"""

_LIFELINES: dict[str, "_Lifeline"] = {}  # control socket -> lifeline, for open_run() in this process


def parse_hosts(hosts: list[str] | None, hosts_file: str | os.PathLike | None) -> list[str]:
    if hosts_file is not None:
        lines = Path(hosts_file).read_text().splitlines()
        hosts = [ln.split("#", 1)[0].split()[0] for ln in lines if ln.split("#", 1)[0].strip()]
    if not hosts:
        raise ConfigError("the ssh backend needs hosts=[...] or hosts_file=...", field="hosts", value=hosts)
    return list(hosts)


def split_host(target: str) -> tuple[str | None, str, int | None]:
    """``"user@host:port"`` -> (user, host, port)."""
    user, _, rest = target.rpartition("@")
    host, port = rest, None
    if rest.count(":") == 1:
        host, p = rest.split(":")
        port = int(p)
    return user or None, host, port


def _is_loopback(host: str) -> bool:
    try:
        import ipaddress

        return host == "localhost" or ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


class _Lifeline:
    """The SSH connection that keeps a remote kernel alive (and carries its tunnels)."""

    def __init__(self, proc: subprocess.Popen, control_path: str, base: list[str], target: str):
        self.proc, self.control_path, self.base, self.target = proc, control_path, base, target

    def poll(self) -> int | None:
        return self.proc.poll()

    def end(self) -> None:
        try:  # EOF on the boot script's stdin: it stops the kernel and cleans up
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.wait(timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        _LIFELINES.pop(self.control_path, None)


class SSHBackend:
    """Kernels on ``hosts`` (one per node, in the order of their rendezvous addresses)."""

    name = "ssh"

    def __init__(self, nodes: int, hosts: list[str] | None = None, hosts_file: str | None = None,
                 identity_file: str | None = None, known_hosts_file: str | None = None,
                 ssh_options: list[str] | tuple[str, ...] = (), python: str = "python3",
                 remote_root: str = "~/.workbench/runs", addrs: list[str] | None = None,
                 shared_run_root: bool = False, connect_timeout_s: float = 15.0):
        hosts = parse_hosts(hosts, hosts_file)
        if len(hosts) != nodes:
            raise ConfigError(f"{len(hosts)} host(s) for nodes={nodes}: give one host per node", field="hosts",
                              value=hosts)
        if addrs is None:  # the address each node's torchrun announces; loopback hosts get distinct ones
            addrs = [f"127.0.0.{10 + i}" if _is_loopback(split_host(h)[1]) else split_host(h)[1]
                     for i, h in enumerate(hosts)]
        if len(set(addrs)) != len(addrs):
            raise ConfigError(f"addrs={addrs}: two nodes on one host need distinct addresses (addrs=[...])",
                              field="addrs", value=addrs)
        # torchrun's c10d numbers nodes by sorting their addresses: node i is the i-th address.
        pairs = sorted(zip(addrs, hosts))
        self.addrs, self.hosts = [a for a, _ in pairs], [h for _, h in pairs]
        self.identity_file, self.known_hosts_file = identity_file, known_hosts_file
        self.ssh_options, self.python = list(ssh_options), python
        self.remote_root, self.shares_run_dir = remote_root.rstrip("/"), shared_run_root
        self.connect_timeout_s = connect_timeout_s
        self._control_dir = tempfile.mkdtemp(prefix="wb-ssh-")  # 0700: the control sockets

    def public_options(self) -> dict[str, Any]:
        return {"hosts": self.hosts, "identity_file": self.identity_file, "known_hosts_file": self.known_hosts_file,
                "ssh_options": self.ssh_options, "python": self.python, "remote_root": self.remote_root,
                "addrs": self.addrs, "shared_run_root": self.shares_run_dir}

    def node_addresses(self, n: int) -> list[str]:
        return list(self.addrs)

    def run_dir_of(self, run_dir: Path, node: int) -> str:
        return str(run_dir.resolve()) if self.shares_run_dir else f"{self.remote_root}/{run_dir.name}"

    def _base(self, target: str, control_path: str) -> list[str]:
        _, _, port = split_host(target)
        cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(self.connect_timeout_s)}",
               "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3", "-S", control_path]
        if port:
            cmd += ["-p", str(port)]
        if self.identity_file:
            cmd += ["-i", self.identity_file, "-o", "IdentitiesOnly=yes"]
        if self.known_hosts_file:
            cmd += ["-o", f"UserKnownHostsFile={self.known_hosts_file}", "-o", "StrictHostKeyChecking=yes"]
        return cmd + self.ssh_options

    @staticmethod
    def _destination(target: str) -> str:
        user, host, _ = split_host(target)
        return f"{user}@{host}" if user else host

    def start(self, run_dir: Path, node: int) -> ZmqChannel:
        target = self.hosts[node]
        control_path = os.path.join(self._control_dir, f"n{node}-{secrets.token_hex(3)}")
        base = self._base(target, control_path)
        key = secrets.token_hex(32)
        remote = f"{shlex.quote(self.python)} -c {shlex.quote(BOOT)}"
        proc = subprocess.Popen(base + ["-M", self._destination(target), remote], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        lifeline = _Lifeline(proc, control_path, base, target)
        stderr: list[bytes] = []
        threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
        try:
            proc.stdin.write((json.dumps({"key": key}) + "\n").encode())
            proc.stdin.flush()
            boot = self._read_line(proc, 60.0 + self.connect_timeout_s)
            if boot is None:
                time.sleep(0.2)
                tail = b"".join(stderr).decode(errors="replace").strip().splitlines()[-3:]
                raise KernelError(f"ssh {target}: no kernel came up ({' | '.join(tail) or 'no output'})")
            info = json.loads(boot)
            local = {name: _free_local_port() for name in PORT_NAMES}
            forwards = [arg for name in PORT_NAMES
                        for arg in ("-L", f"127.0.0.1:{local[name]}:127.0.0.1:{info['ports'][name]}")]
            done = subprocess.run(base + ["-O", "forward", *forwards, self._destination(target)],
                                  capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                raise KernelError(f"ssh {target}: port forwarding failed: {done.stderr.strip()[-300:]}")
            conn = dict(local, ip="127.0.0.1", transport="tcp", key=key, signature_scheme="hmac-sha256")
            path = run_dir / "launch" / f"kernel-node{node}.json"
            path.parent.mkdir(exist_ok=True)
            os.chmod(path.parent, 0o700)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(conn, f)
            description = {"backend": "ssh", "host": target, "connection_file": str(path),
                           "control_path": control_path, "remote_kernel_pid": info.get("kernel_pid")}
            _LIFELINES[control_path] = lifeline
            return ZmqChannel(conn, description, owner=lifeline)
        except BaseException:
            lifeline.end()
            raise

    @staticmethod
    def _read_line(proc: subprocess.Popen, timeout_s: float) -> bytes | None:
        deadline = time.time() + timeout_s
        buf = b""
        fd = proc.stdout.fileno()
        while time.time() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    return None  # ssh ended
                buf += chunk
                if b"\n" in buf:
                    return buf.split(b"\n", 1)[0]
            elif proc.poll() is not None:
                return None
        return None

    def reconnect(self, run_dir: Path, description: dict[str, Any]) -> ZmqChannel:
        """Through the tunnels of a lifeline this process holds (ssh kernels live as long as the
        driver process that started them)."""
        lifeline = _LIFELINES.get(description.get("control_path", ""))
        if lifeline is None or lifeline.poll() is not None:
            raise KernelError(f"the ssh connection to {description.get('host')} is gone")
        conn = json.loads(Path(description["connection_file"]).read_text())
        return ZmqChannel(conn, description, owner=lifeline)


def _free_local_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
