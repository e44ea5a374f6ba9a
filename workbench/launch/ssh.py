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

A host string comes from a browser form or a file, and ends up on ssh's command line, where
``-oProxyCommand=...`` is an option that runs a command and ``a;b`` would be two commands to a
shell. So :func:`parse_host` checks every host where it enters (the backend's constructor) against
a narrow grammar (user: ``[A-Za-z0-9._-]``; host: a DNS name, an IPv4 address or a bracketed IPv6
address; port 1-65535), and every argv built here ends its options with ``--`` before the
destination. The one remote command is built from :func:`shlex.quote`'d parts.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import shlex
import socket
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

from workbench.spec.errors import ConfigError
from workbench.launch.kernels import KernelError, ZmqChannel, read_first_line, remote_kernel_boot

PORT_NAMES = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")

# Runs on the host under the remote Python. stdin: one JSON line {"key": ...}, then the lifeline.
BOOT = remote_kernel_boot('''
print(json.dumps({"ports": ports, "kernel_pid": k.pid, "host": socket.gethostname()}), flush=True)
sys.stdin.read()
''')

_LIFELINES: dict[str, "_Lifeline"] = {}  # control socket -> lifeline, for open_run() in this process


MAX_HOSTS_FILE_BYTES = 1 << 20
_USER = re.compile(r"[A-Za-z0-9._][A-Za-z0-9._-]{0,63}")  # POSIX portable names; never a leading '-'
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")  # a DNS label (with ssh-config '_')
_SPEC_CHARS = re.compile(r"[A-Za-z0-9._@:\[\]-]*")  # everything a valid spec can hold: no shell metacharacter
_PORT = re.compile(r"[0-9]{1,5}")


class Host(NamedTuple):
    """A checked ``[user@]host[:port]``: ``host`` is a DNS name, an IPv4 or a (bare) IPv6 address."""

    user: str | None
    host: str
    port: int | None

    @property
    def destination(self) -> str:
        """What ssh gets after ``--``: ``user@host`` or ``host``."""
        return f"{self.user}@{self.host}" if self.user else self.host


def host_problem(name: str) -> str | None:
    """Why ``name`` is not a DNS name, an IPv4 address or a bracketed IPv6 address (None: it is one).
    Shared with the gateway's URL check."""
    if name.startswith("[") or name.endswith("]"):
        try:
            if not (name.startswith("[") and name.endswith("]")):
                raise ValueError
            ipaddress.IPv6Address(name[1:-1])
        except ValueError:
            return f"{name[:60]!r} is no bracketed IPv6 address"
        return None
    if not name:
        return "the host name is empty"
    if name.startswith("-"):
        return f"host name {name[:60]!r} starts with '-' (a command line would read it as an option)"
    if len(name) > 253:
        return f"host name of {len(name)} characters: a DNS name has at most 253"
    labels = name.split(".")
    if any(not _LABEL.fullmatch(label) for label in labels):
        return (f"host name {name[:60]!r} is no DNS name (labels of 1-63 letters, digits, '-' and '_', not "
                "starting or ending with '-')")
    if all(label.isdigit() for label in labels):
        try:
            ipaddress.IPv4Address(name)
        except ValueError:
            return f"{name!r} is no IPv4 address"
    return None


def parse_host(spec: Any) -> Host:
    """``"[user@]host[:port]"`` -> :class:`Host`, or a ConfigError of one line naming the host and
    the rule it breaks (see the module docstring: this is what keeps hosts from being options)."""
    if not isinstance(spec, str):
        raise ConfigError(f"host {spec!r} must be a string [user@]host[:port]", field="hosts", value=spec)
    shown = repr(spec if len(spec) <= 80 else spec[:80] + "...")

    def fail(rule: str) -> ConfigError:
        return ConfigError(f"host {shown}: {rule}", field="hosts", value=spec)

    if not spec:
        raise fail("empty; give [user@]host[:port]")
    if spec.startswith("-"):
        raise fail("starts with '-' (ssh would read it as an option)")
    if any(c.isspace() or not c.isprintable() for c in spec):
        raise fail("contains whitespace or a control character")
    if not spec.isascii():
        bad = next(c for c in spec if not c.isascii())
        raise fail(f"contains the non-ASCII character {bad!r} (U+{ord(bad):04X}); host names are ASCII (IDNA: xn--...)")
    if not _SPEC_CHARS.fullmatch(spec):
        bad = next(c for c in spec if not _SPEC_CHARS.fullmatch(c))
        raise fail(f"contains {bad!r}: a host spec holds letters, digits and . _ - (with @ : [ ] between its parts)")
    if spec.count("@") > 1:
        raise fail("has more than one '@'")
    user, at, rest = spec.rpartition("@")
    if at and not user:
        raise fail("has an empty user before '@'")
    if user and not _USER.fullmatch(user):
        raise fail(f"user {user[:60]!r} must be 1-64 of A-Z a-z 0-9 . _ - not starting with '-'")
    host, port_text = rest, None
    if rest.startswith("["):  # [v6] or [v6]:port
        close = rest.find("]")
        host, tail = rest[:close + 1], rest[close + 1:]
        if close < 0 or (tail and not tail.startswith(":")):
            raise fail("an IPv6 address goes in brackets: [::1] or [::1]:22")
        port_text = tail[1:] if tail else None
    elif rest.count(":") > 1:
        raise fail("an IPv6 address goes in brackets: [::1] or [::1]:22")
    elif ":" in rest:
        host, port_text = rest.split(":")
    problem = host_problem(host)
    if problem:
        raise fail(problem)
    port = None
    if port_text is not None:
        if not _PORT.fullmatch(port_text) or not 1 <= int(port_text) <= 65535:
            raise fail(f"port {port_text[:20]!r} must be an integer 1-65535")
        port = int(port_text)
    return Host(user or None, host[1:-1] if host.startswith("[") else host, port)


def _read_hosts_file(path: str | os.PathLike) -> list[str]:
    """The first word of every line of a hosts file (``#`` comments), as a ConfigError when it is
    no readable text file of at most :data:`MAX_HOSTS_FILE_BYTES`."""
    try:  # opened without blocking (a FIFO would), then checked on the descriptor
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_HOSTS_FILE_BYTES:
                raise ConfigError(f"hosts_file={str(path)!r} must be a regular file of at most {MAX_HOSTS_FILE_BYTES} "
                                  "bytes", field="hosts_file", value=str(path))
            text = f.read(MAX_HOSTS_FILE_BYTES).decode("utf-8")
    except OSError as e:
        raise ConfigError(f"hosts_file={str(path)!r} cannot be read: {e.strerror or e}", field="hosts_file",
                          value=str(path)) from None
    except UnicodeDecodeError:
        raise ConfigError(f"hosts_file={str(path)!r} is not UTF-8 text", field="hosts_file", value=str(path)) from None
    return [ln.split("#", 1)[0].split()[0] for ln in text.splitlines() if ln.split("#", 1)[0].strip()]


def parse_hosts(hosts: list[str] | None, hosts_file: str | os.PathLike | None) -> list[str]:
    """The hosts, each checked by :func:`parse_host` (ConfigError naming the first bad one)."""
    if hosts_file is not None:
        hosts = _read_hosts_file(hosts_file)
    if isinstance(hosts, str):
        raise ConfigError(f"hosts={hosts[:80]!r} must be a list of [user@]host[:port] strings, one per node",
                          field="hosts", value=hosts)
    if not hosts:
        raise ConfigError("the ssh backend needs hosts=[...] or hosts_file=...", field="hosts", value=hosts)
    hosts = list(hosts)
    for h in hosts:
        parse_host(h)
    return hosts


def split_host(target: str) -> tuple[str | None, str, int | None]:
    """``"user@host:port"`` -> (user, host, port), checked (:func:`parse_host`)."""
    return tuple(parse_host(target))  # type: ignore[return-value]


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
        hosts = parse_hosts(hosts, hosts_file)  # each checked: no option, no shell metacharacter
        if not isinstance(ssh_options, (list, tuple)) or not all(isinstance(o, str) for o in ssh_options):
            raise ConfigError(f"ssh_options={ssh_options!r} must be a list of strings (ssh's own options)",
                              field="ssh_options", value=ssh_options)
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
        return parse_host(target).destination

    def ssh_argv(self, target: str, control_path: str, *options: str, command: str | None = None) -> list[str]:
        """``ssh <ours> <options> -- <destination> [command]``: the ``--`` ends the options, so nothing
        in the destination can be read as one (it was checked too); ``command`` is one string that
        the remote shell parses, so build it from :func:`shlex.quote`'d parts."""
        argv = self._base(target, control_path) + list(options) + ["--", self._destination(target)]
        return argv + ([command] if command is not None else [])

    def start(self, run_dir: Path, node: int) -> ZmqChannel:
        target = self.hosts[node]
        control_path = os.path.join(self._control_dir, f"n{node}-{secrets.token_hex(3)}")
        base = self._base(target, control_path)
        key = secrets.token_hex(32)
        remote = f"{shlex.quote(self.python)} -c {shlex.quote(BOOT)}"
        proc = subprocess.Popen(self.ssh_argv(target, control_path, "-M", command=remote), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        lifeline = _Lifeline(proc, control_path, base, target)
        stderr: list[bytes] = []
        threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
        try:
            proc.stdin.write((json.dumps({"key": key}) + "\n").encode())
            proc.stdin.flush()
            boot = read_first_line(proc, 60.0 + self.connect_timeout_s)
            if boot is None:
                time.sleep(0.2)
                tail = b"".join(stderr).decode(errors="replace").strip().splitlines()[-3:]
                raise KernelError(f"ssh {target}: no kernel came up ({' | '.join(tail) or 'no output'})")
            info = json.loads(boot)
            local = {name: _free_local_port() for name in PORT_NAMES}
            forwards = [arg for name in PORT_NAMES
                        for arg in ("-L", f"127.0.0.1:{local[name]}:127.0.0.1:{info['ports'][name]}")]
            done = subprocess.run(self.ssh_argv(target, control_path, "-O", "forward", *forwards),
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
