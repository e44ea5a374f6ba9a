"""Kernels on the nodes of a Slurm allocation.

Users of a Slurm cluster cannot reach compute nodes they have not been allocated, so the backend
asks Slurm for the nodes and reaches each one only through Slurm itself:

1. **The allocation** is ``salloc --nodes=N --ntasks-per-node=1 ... -- python -c HOLD``, a child
   of the driver. ``salloc`` runs HOLD on the driver's machine once the nodes are granted; HOLD
   prints the job id and node list and then reads its stdin until EOF. That pipe is the
   allocation's lifeline: when the driver closes it (stop, failure, the end of the run) or dies,
   HOLD exits, and ``salloc`` relinquishes the allocation, which ends every step on the nodes.
   (``sbatch`` would leave a job running after the driver's death until its time limit.) The
   backend also ``scancel``\\ s the job on release and waits until ``squeue`` no longer lists it.
2. **One kernel per node** is ``srun --jobid=J --nodes=1 --ntasks=1 --nodelist=<node> --overlap
   -u python -c BOOT``. BOOT starts an IPython kernel listening on the node's **loopback only**,
   with a key that arrives on stdin (never on a command line, which ``ps`` shows to everyone),
   and removes the connection file once the kernel listens.
3. **The kernel's five ZeroMQ connections travel through that srun step's own stdin and stdout**
   (Slurm's I/O forwarding between srun and slurmstepd, authenticated by munge like every
   ``srun``): the driver listens on five loopback ports of its own, and each TCP connection to
   them is relayed as base64 lines (``O <id> <channel>``, ``D <id> <data>``, ``C <id>``) to BOOT,
   which connects to the kernel's port on the node's loopback. Nothing on the nodes listens on a
   network address; every message is also signed with the kernel's key (HMAC-SHA256).

Node order. torchrun's c10d numbers the nodes by sorting their ``--local-addr``; node i of the
run is the i-th address (its ``NodeAddr`` from ``scontrol show node``). Nodes whose address is
this machine's loopback (several ``slurmd`` on one host, as in the tests) get distinct loopback
addresses ``127.0.0.10 + i`` in node-list order, as the local backend gives, so rank placement
follows the planner's. The rendezvous is on node 0: the first node of ``SLURM_JOB_NODELIST``
whenever the addresses sort as the node list does (Slurm sorts hostlists).

A job that Slurm ends (``scancel`` from outside, the time limit, a node failure, preemption)
ends the srun steps and so the kernels; :meth:`SlurmBackend.end_reason` then gives Slurm's own
word for it (``JobState`` and ``Reason`` of ``scontrol show job``), which the run reports as the
cause. The job id and node list of every allocation go into the run's ``manifest.json``
(``allocations``).

Run directories. A Slurm cluster's login and compute nodes share a file system, so by default
(``shared_run_root=True``) the nodes write into the driver's run directory itself: checkpoints
are there for a resume on other nodes, and the benchmark's results for the driver. Where the
runs folder is not shared, ``shared_run_root=False`` puts each node's copy under
``remote_root/<run id>`` and the driver keeps its own from the events streamed over the kernels.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from workbench.spec.errors import ConfigError, require
from workbench.launch.kernels import KernelError, ZmqChannel, read_first_line, remote_kernel_boot
from workbench.launch.slurm_options import SlurmRequest
from workbench.rundir.record import record_allocation

PORT_NAMES = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
RELEASE_TIMEOUT_S = 30.0  # scancel to an empty queue
ENDED_STATES = ("CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "FAILED", "COMPLETED", "OUT_OF_MEMORY",
                "DEADLINE", "BOOT_FAIL", "REVOKED")

# Runs under salloc on the driver's machine: says what was granted, then holds it until EOF.
HOLD = r"""
import json, os, sys
print(json.dumps({"job_id": os.environ.get("SLURM_JOB_ID"), "nodelist": os.environ.get("SLURM_JOB_NODELIST")}),
      flush=True)
sys.stdin.read()
"""

# Runs on a node under srun. stdin: one JSON line {"key": ...}, then relay lines; EOF ends it.
BOOT = remote_kernel_boot(prelude=r'''
import base64, threading
lock = threading.Lock()
def send(line):
    with lock:
        sys.stdout.write(line + "\n"); sys.stdout.flush()
conns = {}
def pump(cid, s):
    try:
        while True:
            b = s.recv(65536)
            if not b: break
            send("D %s %s" % (cid, base64.b64encode(b).decode()))
    except OSError:
        pass
    send("C %s" % cid)
''', serve=r'''
send(json.dumps({"ports": ports, "kernel_pid": k.pid, "host": socket.gethostname()}))
for line in sys.stdin:
    op, cid, *rest = line.split()
    if op == "O":
        try:
            s = socket.create_connection(("127.0.0.1", ports[rest[0]]))
        except OSError:
            send("C %s" % cid); continue
        conns[cid] = s
        threading.Thread(target=pump, args=(cid, s), daemon=True).start()
    elif op == "D" and cid in conns:
        try:
            conns[cid].sendall(base64.b64decode(rest[0]))
        except OSError:
            pass
    elif op == "C":
        s = conns.pop(cid, None)
        if s is not None:
            try: s.shutdown(socket.SHUT_RDWR)
            except OSError: pass
            s.close()
''')


def _slurm(*argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)


def job_state(job_id: str) -> tuple[str, str]:
    """(``JobState``, ``Reason``) of a job from ``scontrol show job`` ("" when Slurm no longer
    knows it)."""
    try:
        done = _slurm("scontrol", "show", "job", "-o", job_id, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return "", ""
    fields = dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", done.stdout))
    return fields.get("JobState", ""), fields.get("Reason", "")


def expand_nodelist(nodelist: str) -> list[str]:
    """``n[1-2],gpu07`` -> ["n1", "n2", "gpu07"] (Slurm's own expansion)."""
    done = _slurm("scontrol", "show", "hostnames", nodelist)
    require(done.returncode == 0, f"scontrol show hostnames {nodelist!r} failed: {done.stderr.strip()[-200:]}",
            field="nodelist")
    return [ln.strip() for ln in done.stdout.splitlines() if ln.strip()]


def node_address(name: str) -> str:
    """A node's ``NodeAddr`` (its name when Slurm gives none), resolved to an IP address."""
    done = _slurm("scontrol", "show", "node", "-o", name)
    m = re.search(r"\bNodeAddr=(\S+)", done.stdout)
    addr = m.group(1) if m else name
    try:
        return socket.gethostbyname(addr)
    except OSError:
        return addr


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


class _Relay:
    """The driver's end of one node's kernel connections, carried over the srun step's stdio
    (see the module docstring, 3.)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self._write = threading.Lock()
        self._conns: dict[str, socket.socket] = {}
        self._next = 0
        self._closed = threading.Event()
        self.listeners = {}
        for name in PORT_NAMES:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(8)
            self.listeners[name] = s
        self.ports = {name: s.getsockname()[1] for name, s in self.listeners.items()}

    def start(self) -> None:
        threading.Thread(target=self._read_node, name="workbench-slurm-relay", daemon=True).start()
        for name, s in self.listeners.items():
            threading.Thread(target=self._accept, args=(name, s), daemon=True).start()

    def _send(self, line: str) -> None:
        with self._write:
            try:
                self.proc.stdin.write((line + "\n").encode())
                self.proc.stdin.flush()
            except (OSError, ValueError):  # the step ended: the node's side is gone
                self.close()

    def _accept(self, name: str, listener: socket.socket) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with self._write:
                self._next += 1
                cid = str(self._next)
            self._conns[cid] = conn
            self._send(f"O {cid} {name}")
            threading.Thread(target=self._pump, args=(cid, conn), daemon=True).start()

    def _pump(self, cid: str, conn: socket.socket) -> None:
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    break
                self._send(f"D {cid} {base64.b64encode(data).decode()}")
        except OSError:
            pass
        if self._conns.pop(cid, None) is not None:
            self._send(f"C {cid}")

    def _read_node(self) -> None:
        for raw in self.proc.stdout:
            parts = raw.decode(errors="replace").split()
            if len(parts) < 2:
                continue
            op, cid = parts[0], parts[1]
            conn = self._conns.get(cid)
            if op == "D" and conn is not None and len(parts) == 3:
                try:
                    conn.sendall(base64.b64decode(parts[2]))
                except OSError:
                    pass
            elif op == "C" and conn is not None:
                self._conns.pop(cid, None)
                _close(conn)
        self.close()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        for s in list(self.listeners.values()) + list(self._conns.values()):
            _close(s)
        self._conns.clear()


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


class _Step:
    """One node's srun step: the kernel's lifeline and its relay. ``end`` closes stdin (BOOT
    stops the kernel), then waits for srun."""

    def __init__(self, proc: subprocess.Popen, relay: _Relay, node: str, connection_file: Path):
        self.proc, self.relay, self.node, self.connection_file = proc, relay, node, connection_file

    def poll(self) -> int | None:
        return self.proc.poll()

    def end(self) -> None:
        try:
            if self.proc.stdin:
                with self.relay._write:
                    self.proc.stdin.close()
            self.proc.wait(timeout=15)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.relay.close()
        self.connection_file.unlink(missing_ok=True)  # the key does not outlive the kernel


class _Allocation:
    """A granted job: its HOLD process under salloc, id, nodes and their addresses."""

    def __init__(self, proc: subprocess.Popen, job_id: str, nodelist: str, nodes: list[str], addrs: list[str],
                 granted_s: float):
        self.proc, self.job_id, self.nodelist, self.nodes, self.addrs = proc, job_id, nodelist, nodes, addrs
        self.granted_s = granted_s
        self.steps: dict[int, _Step] = {}
        self.released = False


_ALLOCATIONS: dict[str, _Allocation] = {}  # job id -> allocation, for open_run() in this process


class SlurmBackend:
    """Kernels on ``nodes`` nodes of a Slurm allocation (see the module docstring)."""

    name = "slurm"

    def __init__(self, nodes: int, partition: str | None = None, account: str | None = None,
                 time_limit: str | None = None, extra_sbatch: list[str] | tuple[str, ...] = (),
                 python: str = "python3", remote_root: str = "~/.workbench/runs", shared_run_root: bool = True,
                 queue_timeout_s: float = 600.0, job_name: str | None = None, job_id: str | None = None):
        self.request = SlurmRequest(partition, account, time_limit, extra_sbatch)  # one line on a bad value
        require(isinstance(python, str) and bool(python) and not python.startswith("-"),
                f"python={python!r} must be the nodes' Python executable", field="python")
        require(isinstance(queue_timeout_s, (int, float)) and not isinstance(queue_timeout_s, bool)
                and queue_timeout_s > 0, f"queue_timeout_s={queue_timeout_s!r} must be a number of seconds > 0",
                field="queue_timeout_s")
        missing = [c for c in ("salloc", "srun", "scancel", "squeue", "scontrol") if shutil.which(c) is None]
        require(not missing, f"the slurm backend needs Slurm's commands on this machine's PATH: "
                             f"{', '.join(missing)} not found", field="backend")
        self.nodes, self.python, self.queue_timeout_s = nodes, python, float(queue_timeout_s)
        self.remote_root, self.shares_run_dir = remote_root.rstrip("/"), bool(shared_run_root)
        self.job_name = job_name
        self._alloc: _Allocation | None = _ALLOCATIONS.get(job_id) if job_id else None
        self._lock = threading.Lock()
        self._run_dir: Path | None = None

    # ---- what the launcher asks

    def public_options(self) -> dict[str, Any]:
        return dict(self.request.to_dict(), python=self.python, remote_root=self.remote_root,
                    shared_run_root=self.shares_run_dir, queue_timeout_s=self.queue_timeout_s,
                    job_id=self._alloc.job_id if self._alloc else None)

    def prepare(self, run_dir: Path) -> None:
        """The run directory where salloc's log and the allocations' record go."""
        self._run_dir = Path(run_dir)

    def node_addresses(self, n: int) -> list[str]:
        """Allocates (once): the nodes' addresses in node order."""
        return list(self._allocation(self._run_dir).addrs)

    def address_of(self, node: int) -> str:
        return self._allocation(self._run_dir).addrs[node]

    def run_dir_of(self, run_dir: Path, node: int) -> str:
        return str(run_dir.resolve()) if self.shares_run_dir else f"{self.remote_root}/{run_dir.name}"

    @property
    def job_id(self) -> str | None:
        return self._alloc.job_id if self._alloc else None

    def start(self, run_dir: Path, node: int) -> ZmqChannel:
        alloc = self._allocation(run_dir)
        name = alloc.nodes[node]
        key = secrets.token_hex(32)
        launch_dir = run_dir / "launch"
        launch_dir.mkdir(exist_ok=True)
        os.chmod(launch_dir, 0o700)
        log = open(launch_dir / f"srun-node{node}.log", "ab")
        argv = ["srun", f"--jobid={alloc.job_id}", "--nodes=1", "--ntasks=1", f"--nodelist={name}", "--overlap",
                "--unbuffered", f"--job-name=wb-kernel-{node}", self.python, "-c", BOOT]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        log.close()
        relay = _Relay(proc)
        path = launch_dir / f"kernel-node{node}.json"
        step = _Step(proc, relay, name, path)
        try:
            proc.stdin.write((json.dumps({"key": key}) + "\n").encode())
            proc.stdin.flush()
            boot = read_first_line(proc, 90.0)
            if boot is None:
                raise KernelError(f"srun on {name} (job {alloc.job_id}): no kernel came up "
                                  f"({_tail(launch_dir / f'srun-node{node}.log')})")
            info = json.loads(boot)
            relay.start()
            conn = dict(relay.ports, ip="127.0.0.1", transport="tcp", key=key, signature_scheme="hmac-sha256")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(conn, f)
            description = {"backend": "slurm", "job_id": alloc.job_id, "slurm_node": name, "node": node,
                           "connection_file": str(path), "remote_kernel_pid": info.get("kernel_pid"),
                           "host": info.get("host")}
            alloc.steps[node] = step
            return ZmqChannel(conn, description, owner=step)
        except BaseException:
            step.end()
            raise

    def reconnect(self, run_dir: Path, description: dict[str, Any]) -> ZmqChannel:
        """Through a step this process holds (Slurm kernels live as long as the driver process
        that allocated them)."""
        alloc = _ALLOCATIONS.get(str(description.get("job_id")))
        step = alloc.steps.get(int(description.get("node", -1))) if alloc else None
        if alloc is None or alloc.released or step is None or step.poll() is not None:
            raise KernelError(f"Slurm job {description.get('job_id')} is not held by this process")
        self._alloc = alloc
        conn = json.loads(Path(description["connection_file"]).read_text())
        return ZmqChannel(conn, description, owner=step)

    def end_reason(self) -> str | None:
        """Slurm's word on a job it ended (None: it did not end it, or it is still running)."""
        alloc = self._alloc
        if alloc is None or alloc.released:
            return None
        for _ in range(20):  # the steps end a moment before the job's state is written
            state, reason = job_state(alloc.job_id)
            if state.split("+")[0] in ENDED_STATES or not state:
                break
            time.sleep(0.25)
        else:
            return None
        if not state:
            return f"Slurm job {alloc.job_id} is gone (no longer known to slurmctld)"
        why = f" ({reason})" if reason and reason != "None" else ""
        return f"Slurm ended job {alloc.job_id}: {state}{why}"

    def release(self) -> None:
        """End the kernels' steps and the allocation; return once Slurm no longer holds the job."""
        with self._lock:
            alloc, self._alloc = self._alloc, None
        if alloc is None or alloc.released:
            return
        alloc.released = True
        for step in list(alloc.steps.values()):
            step.end()
        try:
            if alloc.proc.stdin:
                alloc.proc.stdin.close()
        except OSError:
            pass
        _slurm("scancel", alloc.job_id)
        try:
            alloc.proc.wait(timeout=RELEASE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            alloc.proc.kill()
            alloc.proc.wait()
        deadline = time.time() + RELEASE_TIMEOUT_S
        while time.time() < deadline:
            queued = _slurm("squeue", "-h", "-j", alloc.job_id, "-o", "%T", timeout=15)
            if queued.returncode != 0 or not queued.stdout.strip():
                break
            time.sleep(0.2)
        _ALLOCATIONS.pop(alloc.job_id, None)

    # ---- the allocation

    def _allocation(self, run_dir: Path | None) -> _Allocation:
        """The held allocation, or a new one (a resume after a release gets new nodes)."""
        with self._lock:
            if self._alloc is not None and not self._alloc.released and self._alloc.proc.poll() is None:
                return self._alloc
            require(run_dir is not None or self._run_dir is not None, "no run directory for the allocation",
                    field="run_dir")
            self._run_dir = run_dir or self._run_dir
            self._alloc = self._allocate(self._run_dir)
            _ALLOCATIONS[self._alloc.job_id] = self._alloc
            return self._alloc

    def _allocate(self, run_dir: Path) -> _Allocation:
        name = self.job_name or f"wb-{run_dir.name}"[:100]
        argv = ["salloc", f"--nodes={self.nodes}", "--ntasks-per-node=1", f"--job-name={name}",
                *self.request.salloc_options(), "--", self.python, "-c", HOLD]
        launch_dir = run_dir / "launch"
        launch_dir.mkdir(exist_ok=True)
        os.chmod(launch_dir, 0o700)
        log_path = launch_dir / "salloc.log"
        t0 = time.time()
        with open(log_path, "ab") as log:
            log.write(f"$ {shlex.join(argv[:-1])} <HOLD>\n".encode())
            log.flush()
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        line = read_first_line(proc, self.queue_timeout_s)
        if line is None:
            try:  # salloc's own end follows its output's by a moment
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            waiting = proc.poll() is None  # still queued: the wait ran out
            job = _granted_or_pending(log_path)
            if waiting:
                proc.stdin.close()
                proc.terminate()
            if job:
                _slurm("scancel", job)  # nothing stays queued
            proc.wait()
            if waiting:
                raise KernelError(f"Slurm did not grant {self.nodes} node(s) within queue_timeout_s="
                                  f"{self.queue_timeout_s:g} s (job {job or '?'}; {_tail(log_path)})")
            # salloc refused the request itself (an unknown partition or account, a limit): its own line
            raise ConfigError(f"Slurm refused the allocation: {_tail(log_path, 1)}", field="backend",
                              value="slurm")
        info = json.loads(line)
        job_id, nodelist = str(info["job_id"]), str(info["nodelist"])
        nodes = expand_nodelist(nodelist)
        addrs = [node_address(n) for n in nodes]
        if any(_is_loopback(a) for a in addrs) or len(set(addrs)) < len(addrs):
            # nodes on this machine: distinct loopback addresses in node-list order (module docstring)
            addrs = [f"127.0.0.{10 + i}" for i in range(len(nodes))]
        pairs = sorted(zip(addrs, nodes), key=lambda p: tuple(int(x) for x in p[0].split("."))
                       if p[0].count(".") == 3 and p[0].replace(".", "").isdigit() else (p[0],))
        alloc = _Allocation(proc, job_id, nodelist, [n for _, n in pairs], [a for a, _ in pairs], time.time() - t0)
        record_allocation(run_dir, {"scheduler": "slurm", "job_id": job_id, "nodelist": nodelist,
                                    "nodes": alloc.nodes, "addresses": alloc.addrs, "granted_after_s":
                                    round(alloc.granted_s, 3), **self.request.to_dict()})
        return alloc


def _granted_or_pending(log_path: Path) -> str | None:
    """The job id salloc printed ("Pending job allocation 12", "Granted job allocation 12")."""
    m = re.findall(r"job allocation (\d+)", log_path.read_text(errors="replace"))
    return m[-1] if m else None


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return " | ".join(ln for ln in text[-lines:] if not ln.startswith("$ ")) or "no output"

