"""Jupyter kernels as the driver sees them: one :class:`KernelChannel` per node, made by a backend.

A channel does three things: run code in the kernel and return the JSON value of an expression
(an ``execute_request`` on the shell channel, the value in the reply's ``user_expressions``),
hand over the messages the kernel published (iopub: the agent's comm messages), and tell whether
the kernel is alive. Backends make channels:

* :class:`LocalBackend`: kernels on this machine through ``jupyter_client`` (this module);
* :class:`~workbench.launch.ssh.SSHBackend`: kernels on remote hosts, ports tunnelled over SSH;
* :class:`~workbench.launch.gateway.GatewayBackend`: kernels of a Jupyter Kernel Gateway.

Security: local kernels listen on Unix sockets (ZeroMQ ``ipc``) in a private 0700 directory,
so no other user of the machine can connect; every message is signed with the kernel's key
(HMAC-SHA256); connection files are written 0600 and never logged.
"""

from __future__ import annotations

import ast
import atexit
import json
import os
import queue
import select
import shutil
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

from workbench.spec.errors import ConfigError

READY_TIMEOUT_S = 60.0
HEARTBEAT_GRACE_S = 10.0


class KernelError(RuntimeError):
    """Code sent to a kernel raised, or the kernel did not answer."""


def bootstrap_code(node: int) -> str:
    """Code that installs the agent (this package's ``agent.py``, sent as source) in a kernel
    once, as the module ``workbench_agent``, and makes this node's agent."""
    source = (Path(__file__).parent / "agent.py").read_text()
    return (
        "import sys as _s, types as _t\n"
        "if 'workbench_agent' not in _s.modules:\n"
        "    _m = _t.ModuleType('workbench_agent')\n"
        "    _s.modules['workbench_agent'] = _m\n"
        f"    exec(compile({source!r}, 'workbench_agent', 'exec'), _m.__dict__)\n"
        f"_wb_out = _s.modules['workbench_agent'].agent({node}).status()\n"
    )


# A kernel on a remote node (SSH, Slurm): the script its Python runs. stdin: one JSON line {"key":
# ...} first. The kernel listens on the node's loopback only (five free ports), reads its key from a
# 0600 file that is removed once it listens, and watches this script's pid (JPY_PARENT_PID); when
# the script ends (EOF on stdin, SIGTERM, SIGHUP) the kernel is stopped and its folder removed.
_REMOTE_KERNEL_BOOT = r"""
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
#PRELUDE#
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
#SERVE#finally:
    k.terminate()
    try:
        k.wait(10)
    except subprocess.TimeoutExpired:
        k.kill()
    shutil.rmtree(d, ignore_errors=True)
"""


def remote_kernel_boot(serve: str, prelude: str = "") -> str:
    """The boot script above, with ``serve`` run once the kernel listens (``ports``: its port per
    name, ``k``: its process; reading stdin to EOF keeps it) and ``prelude``'s definitions before."""
    return _REMOTE_KERNEL_BOOT.replace("#PRELUDE#", prelude.strip("\n")).replace(
        "#SERVE#", textwrap.indent(serve.strip("\n") + "\n", "    "))


def read_first_line(proc: Any, timeout_s: float) -> bytes | None:
    """The first line of ``proc``'s stdout within ``timeout_s`` (None: it ended or took longer).
    Read byte by byte from the descriptor: what follows the line (a relay's traffic) stays unread."""
    deadline = time.time() + timeout_s
    buf = b""
    fd = proc.stdout.fileno()
    while time.time() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            chunk = os.read(fd, 1)
            if not chunk:
                return None
            if chunk == b"\n":
                return buf
            buf += chunk
        elif proc.poll() is not None:
            return None
    return None


class KernelChannel:
    """One kernel: ``call`` code, read ``messages``, ask ``alive``; ``close`` disconnects (the
    kernel keeps running), ``shutdown`` ends the kernel."""

    description: dict[str, Any]  # how to reconnect, without secrets (saved in launch.json)
    _inbox: queue.Queue  # iopub messages, filled by the channel's reader thread

    def call(self, code: str, timeout_s: float = 60.0) -> Any:
        """Run ``code`` (which sets ``_wb_out``) and return ``_wb_out`` (JSON-able)."""
        content = self._execute(code, {"out": "__import__('json').dumps(_wb_out)"}, timeout_s)
        if content.get("status") != "ok":
            raise KernelError(f"{content.get('ename', 'error')}: {content.get('evalue', '')}")
        value = content["user_expressions"]["out"]
        if value.get("status") != "ok":
            raise KernelError(f"{value.get('ename', 'error')}: {value.get('evalue', '')}")
        return json.loads(ast.literal_eval(value["data"]["text/plain"]))

    def _execute(self, code: str, expressions: dict[str, str], timeout_s: float) -> dict[str, Any]:
        raise NotImplementedError

    def messages(self) -> list[dict[str, Any]]:
        """Every message received since the last call (never blocks)."""
        out = []
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out

    def alive(self) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


class ZmqChannel(KernelChannel):
    """A kernel reached over ZeroMQ with ``jupyter_client`` (local kernels, and remote ones
    through SSH-forwarded ports). A reader thread collects iopub messages; shell requests are
    serialised by a lock."""

    def __init__(self, connection_info: dict[str, Any], description: dict[str, Any], owner: Any = None):
        from jupyter_client import BlockingKernelClient, KernelManager

        self.description = description
        self.owner = owner  # what keeps the kernel alive here (a KernelManager, an ssh process), or None
        if isinstance(owner, KernelManager):
            self.client = owner.client()  # asks its manager whether the kernel lives
        else:
            self.client = BlockingKernelClient()
            self.client.load_connection_info(connection_info)
        # The heartbeat starts once the kernel has answered: before, "not beating" means nothing.
        self.client.start_channels(hb=False)
        self._hb_bad_since: float | None = None
        self._lock = threading.Lock()
        self._inbox: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        try:
            self.client.wait_for_ready(timeout=READY_TIMEOUT_S)
        except RuntimeError as e:
            self.client.stop_channels()
            raise KernelError(f"kernel did not answer within {READY_TIMEOUT_S:.0f} s: {e}") from e
        self.client.hb_channel.start()
        self._reader = threading.Thread(target=self._read_iopub, name="workbench-iopub", daemon=True)
        self._reader.start()

    def _read_iopub(self) -> None:
        while not self._closed.is_set():
            try:
                self._inbox.put(self.client.get_iopub_msg(timeout=0.2))
            except queue.Empty:
                continue
            except Exception:  # noqa: BLE001 - socket closed under us: stop reading
                if self._closed.is_set():
                    return
                time.sleep(0.2)

    def _execute(self, code: str, expressions: dict[str, str], timeout_s: float) -> dict[str, Any]:
        with self._lock:
            msg_id = self.client.execute(code, silent=False, store_history=False, user_expressions=expressions,
                                         allow_stdin=False)
            deadline = time.time() + timeout_s
            while True:
                left = deadline - time.time()
                if left <= 0:
                    raise KernelError(f"no reply within {timeout_s:.0f} s")
                try:
                    reply = self.client.get_shell_msg(timeout=min(left, 1.0))
                except queue.Empty:
                    if not self.alive():
                        raise KernelError("the kernel died") from None
                    continue
                if reply["parent_header"].get("msg_id") == msg_id:
                    return reply["content"]

    def alive(self) -> bool:
        if self.owner is not None and hasattr(self.owner, "is_alive"):
            return bool(self.owner.is_alive())
        if self.owner is not None and hasattr(self.owner, "poll"):
            if self.owner.poll() is not None:
                return False
        # The heartbeat channel; a loaded machine can miss a beat, so only a long silence counts.
        if self.client.hb_channel.is_beating():
            self._hb_bad_since = None
            return True
        self._hb_bad_since = self._hb_bad_since or time.time()
        return time.time() - self._hb_bad_since < HEARTBEAT_GRACE_S

    def close(self) -> None:
        self._closed.set()
        self._reader.join(timeout=2)
        self.client.stop_channels()

    def shutdown(self) -> None:
        owner = self.owner
        if owner is not None and hasattr(owner, "shutdown_kernel"):
            self.close()
            try:
                owner.shutdown_kernel(now=False)
            except Exception:  # noqa: BLE001 - already gone
                pass
            _LOCAL_KERNELS.pop(self.description.get("connection_file", ""), None)
            return
        try:
            with self._lock:
                self.client.shutdown()
        except Exception:  # noqa: BLE001
            pass
        self.close()
        if owner is not None and hasattr(owner, "end"):
            owner.end()  # e.g. the SSH lifeline: its end stops the remote kernel for sure


# Kernel managers this process started, by connection file: open_run() in the same process
# reuses them, and they are shut down when the process exits (they would exit a second later
# anyway: each kernel watches its parent's pid).
_LOCAL_KERNELS: dict[str, Any] = {}


@atexit.register
def _shutdown_local_kernels() -> None:
    for km in list(_LOCAL_KERNELS.values()):
        try:
            km.shutdown_kernel(now=True)
        except Exception:  # noqa: BLE001
            pass


def _kernel_spec_manager():
    """A KernelSpecManager whose every kernel is ipykernel under *this* Python: the trainer and
    the agent must run in the environment that has workbench and torch, whatever kernelspecs
    the user has installed."""
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager

    class ThisPython(KernelSpecManager):
        def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
            return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                              display_name="workbench agent", language="python")

    return ThisPython()


class LocalBackend:
    """Kernels on this machine, one per node, started with ``jupyter_client``'s KernelManager.

    Each kernel is this process's child and watches it (``JPY_PARENT_PID``): if the driver dies,
    the kernels exit, their torchruns get their death signal, and nothing is left behind."""

    name = "local"
    shares_run_dir = True  # the nodes write into the driver's run directory itself

    def __init__(self, transport: str = "ipc", ip: str = "127.0.0.1"):
        if transport not in ("ipc", "tcp"):
            raise ConfigError(f"transport={transport!r} is not one of 'ipc', 'tcp'", field="transport", value=transport)
        self.transport, self.ip = transport, ip

    def node_addresses(self, n: int) -> list[str]:
        """Distinct loopback addresses, sorting in node order (see agent.py, "Rank placement")."""
        if n > 90:
            raise ConfigError(f"nodes={n}: the local backend runs at most 90 nodes", field="nodes", value=n)
        return [f"127.0.0.{10 + i}" for i in range(n)]

    def run_dir_of(self, run_dir: Path, node: int) -> str:
        return str(run_dir.resolve())

    def start(self, run_dir: Path, node: int) -> ZmqChannel:
        from jupyter_client import KernelManager

        launch_dir = run_dir / "launch"
        launch_dir.mkdir(exist_ok=True)
        os.chmod(launch_dir, 0o700)
        km = KernelManager(kernel_spec_manager=_kernel_spec_manager(), kernel_name="workbench")
        km.connection_file = str(launch_dir / f"kernel-node{node}.json")  # written 0600 by jupyter_client
        sockets_dir = None
        if self.transport == "ipc":
            # A short private directory: Unix socket paths are limited to ~100 bytes.
            sockets_dir = tempfile.mkdtemp(prefix="wb-k-")
            km.transport, km.ip = "ipc", os.path.join(sockets_dir, "k")
        else:
            km.ip = self.ip
        env = {k: v for k, v in os.environ.items() if not k.startswith("JPY_")}
        km.start_kernel(env=env, cwd=str(run_dir.resolve()))
        if sockets_dir is not None:
            atexit.register(shutil.rmtree, sockets_dir, True)
        _LOCAL_KERNELS[km.connection_file] = km
        description = {"backend": "local", "connection_file": km.connection_file, "kernel_pid": km.provisioner.pid
                       if getattr(km, "provisioner", None) is not None else None}
        try:
            return ZmqChannel(km.get_connection_info(session=True), description, owner=km)
        except KernelError:
            km.shutdown_kernel(now=True)
            raise

    def reconnect(self, run_dir: Path, description: dict[str, Any]) -> ZmqChannel:
        """The node's kernel again, from its connection file (kernels outlive a closed RunHandle, not
        the process that started them)."""
        path = description["connection_file"]
        km = _LOCAL_KERNELS.get(path)
        if km is not None:
            return ZmqChannel(km.get_connection_info(session=True), description, owner=km)
        pid = description.get("kernel_pid")
        if not pid or not _pid_alive(int(pid)):
            raise KernelError(f"the kernel (pid {pid}) is gone")
        info = json.loads(Path(path).read_text())
        return ZmqChannel(info, description, owner=_Pid(int(pid)))


class _Pid:
    """A kernel this process did not start: alive while its pid is."""

    def __init__(self, pid: int):
        self.pid = pid

    def is_alive(self) -> bool:
        return _pid_alive(self.pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
