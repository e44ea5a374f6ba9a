"""The node agent: the code that runs inside each node's Jupyter kernel.

One kernel per node; the driver sends this module's *source* to the kernel and executes it there
(stdlib only, so the agent always matches the driver that sent it). The agent then:

1. ``start(spec)``: starts ``torchrun --nnodes N --node-rank i --rdzv-backend c10d ...`` for its
   node in a session of its own (``start_new_session``) and returns at once;
2. supervises it from a thread: the node's state (idle, starting, running, finished, failed,
   stopped) and why, the worker processes below torchrun;
3. tails the node's event files (``events/rank-<r>.jsonl`` of the ranks this node holds) and
   streams new events, plus a heartbeat status every second, to the driver as Jupyter comm
   messages (target :data:`COMM_TARGET`); printed lines prefixed with :data:`MARKER` are the
   fallback where the kernel has no comm support;
4. ``stop()``: SIGTERM to torchrun's process group and to every worker's (torchrun starts each
   worker in a session of its own), SIGKILL to what is left after a timeout.

No orphans. torchrun is started with ``PR_SET_PDEATHSIG`` = SIGTERM, so it goes when the kernel
goes (it then stops its workers); every worker runs :mod:`workbench.launch.worker`, which sets its
own death signal to SIGKILL, so the workers go even when torchrun is SIGKILLed. The supervisor
thread is the watchdog for the rest: when torchrun has ended it kills any worker still there.

Rank placement. torchrun's c10d rendezvous numbers the nodes by sorting their ``--local-addr``
(then process ids), not by ``--node-rank``. The driver gives each node a distinct address in node
order (on one machine: ``127.0.0.10``, ``127.0.0.11``, ... all on the loopback interface), so node
``i`` holds global ranks ``i * nproc ... (i + 1) * nproc - 1``, exactly as the planner places them.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

COMM_TARGET = "workbench.agent"
MARKER = "@@workbench-agent@@ "  # prefix of fallback lines on stdout
POLL_S = 0.2
HEARTBEAT_S = 1.0
MAX_BATCH = 500  # events per comm message
TERMINAL = ("finished", "failed", "stopped")

PR_SET_PDEATHSIG = 1
try:  # loaded before any fork: the pre-exec hook must not load libraries in the child
    _LIBC = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - not Linux
    _LIBC = None


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` to this process when the thread that started it exits
    (``prctl(PR_SET_PDEATHSIG)``); a no-op elsewhere. Used as a ``preexec_fn``."""
    if _LIBC is not None and sys.platform.startswith("linux"):
        _LIBC.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


# --------------------------------------------------------------------------- processes (/proc)


def _proc_stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, pgid, start time in clock ticks) of ``pid``, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = data[data.rfind(")") + 2 :].split()  # after "pid (comm) "
    if fields[0] == "Z":  # a zombie has ended; only its parent's wait() is missing
        return None
    return int(fields[1]), int(fields[2]), int(fields[19])


def descendants(root: int) -> dict[int, tuple[int, int]]:
    """Every live process below ``root``: pid -> (pgid, start time)."""
    children: dict[int, list[int]] = {}
    stats: dict[int, tuple[int, int, int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _proc_stat(int(name))
            if st is not None:
                stats[int(name)] = st
                children.setdefault(st[0], []).append(int(name))
    out: dict[int, tuple[int, int]] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in stats and pid not in out:
            out[pid] = (stats[pid][1], stats[pid][2])
            todo.extend(children.get(pid, []))
    return out


def _same_process(pid: int, start: int) -> bool:
    st = _proc_stat(pid)
    return st is not None and st[2] == start  # the start time guards against a reused pid


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def interface_for(addr: str) -> str | None:
    """The network interface this machine uses to reach ``addr`` ("lo" for loopback), so gloo
    and NCCL bind where the peers can reach them; None when it cannot be told."""
    try:
        import ipaddress

        if ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback:
            return "lo"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))  # no packet is sent: this only asks the routing table
            local = s.getsockname()[0]
        import fcntl
        import struct

        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:  # SIOCGIFADDR: the interface's IPv4 address
                    raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    continue
            if socket.inet_ntoa(raw[20:24]) == local:
                return name
    except (OSError, ValueError, ImportError):
        pass
    return None


# --------------------------------------------------------------------------- event tailing


class RankTail:
    """Reads one rank's event file from a byte offset: only complete lines, only ``seq >= next_seq``."""

    def __init__(self, path: str, next_seq: int = 0):
        self.path, self.offset, self.next_seq = path, 0, next_seq

    def rewind(self, next_seq: int) -> None:
        self.offset, self.next_seq = 0, next_seq

    def read(self, limit: int) -> list[dict]:
        out: list[dict] = []
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                for line in f:
                    if not line.endswith(b"\n"):
                        break  # torn last line: the writer is still writing it
                    self.offset += len(line)
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue
                    if event.get("seq", -1) >= self.next_seq:
                        out.append(event)
                        self.next_seq = event["seq"] + 1
                        if len(out) >= limit:
                            break
        except FileNotFoundError:
            pass
        return out


# --------------------------------------------------------------------------- the agent


class Outbox:
    """Messages to the driver: a Jupyter comm when the kernel has one, marked stdout lines if not."""

    def __init__(self, node: int):
        self._comm = None
        try:
            import comm  # ipykernel >= 6.20 routes this package's comms over the kernel

            self._comm = comm.create_comm(target_name=COMM_TARGET, data={"node": node})
        except Exception:  # noqa: BLE001 - any failure means: use the fallback
            self._comm = None

    def send(self, message: dict) -> None:
        if self._comm is not None:
            self._comm.send(message)
        else:
            print(MARKER + json.dumps(message), flush=True)


class NodeAgent:
    """This node's half of a run. Every public method returns a JSON-able dict."""

    def __init__(self, node: int):
        self.node = node
        self.state, self.why = "idle", ""
        self.proc: subprocess.Popen | None = None
        self.known: dict[int, tuple[int, int]] = {}  # processes below torchrun: pid -> (pgid, start)
        self.tails: dict[int, RankTail] = {}
        self.ranks: list[int] = []
        self.run_dir = ""
        self.log_path = ""
        self.attempt = -1
        self._stopping = False
        self._lock = threading.RLock()
        self._outbox = Outbox(node)
        self._last_beat = 0.0
        self._thread = threading.Thread(target=self._supervise, name="workbench-agent", daemon=True)
        self._thread.start()

    # ---- control (called by the driver through execute requests)

    def start(self, spec: dict) -> dict:
        """Start torchrun for this node; return at once. ``spec``: run_dir, config_json, nnodes,
        nproc, node_rank, rdzv_endpoint, rdzv_id, local_addr, join_timeout_s, max_restarts,
        resume, env, since (rank -> next seq wanted)."""
        with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                return {"ok": False, "why": f"node {self.node} is already running (pid {self.proc.pid})"}
            self.run_dir = os.path.expanduser(spec["run_dir"])
            os.makedirs(os.path.join(self.run_dir, "events"), exist_ok=True)
            os.makedirs(os.path.join(self.run_dir, "launch"), exist_ok=True)
            config_path = os.path.join(self.run_dir, "config.json")
            if not os.path.exists(config_path):  # a node that does not share the driver's disk
                with open(config_path, "w") as f:
                    f.write(spec["config_json"])
            for name, text in (spec.get("files") or {}).items():  # e.g. a benchmark's bench.json
                path = os.path.join(self.run_dir, os.path.basename(name))
                if not os.path.exists(path):
                    with open(path, "w") as f:
                        f.write(text)
            nproc = int(spec["nproc"])
            self.ranks = list(range(spec["node_rank"] * nproc, (spec["node_rank"] + 1) * nproc))
            since = {int(r): int(s) for r, s in (spec.get("since") or {}).items()}
            self.tails = {r: RankTail(os.path.join(self.run_dir, "events", f"rank-{r}.jsonl"), since.get(r, 0))
                          for r in self.ranks}
            self.attempt = int(spec.get("attempt", 0))
            env = self._environment(spec)
            cmd = self._torchrun_command(spec, config_path)
            self.log_path = os.path.join(self.run_dir, "launch", f"torchrun-node{self.node}.log")
            log = open(self.log_path, "a")
            log.write(f"--- attempt {self.attempt}: {' '.join(cmd)}\n")
            log.flush()
            self.known, self._stopping = {}, False
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=self.run_dir, start_new_session=True,
                                         preexec_fn=die_with_parent)
            log.close()
            self.state, self.why = "starting", "waiting for the rendezvous"
            self._beat(force=True)
            return {"ok": True, "pid": self.proc.pid, "ranks": self.ranks, "host": socket.gethostname()}

    def stop(self, timeout_s: float = 10.0, why: str = "stopped by the driver") -> dict:
        """SIGTERM to torchrun's process group and each worker's, SIGKILL after ``timeout_s``."""
        with self._lock:
            self._stopping = True
            if self.proc is None or self.proc.poll() is not None:
                self._kill_leftovers()
                if self.state not in TERMINAL:
                    self.state, self.why = "stopped", why
                return self.status()
            self._refresh_known()
            groups = {os.getpgid(self.proc.pid)} | {pgid for pgid, _ in self.known.values()}
            for pgid in groups:
                _signal_group(pgid, signal.SIGTERM)
            deadline = time.time() + timeout_s
            while time.time() < deadline and (self.proc.poll() is None or self._alive_known()):
                time.sleep(0.05)
            killed = 0
            if self.proc.poll() is None:
                _signal_group(self.proc.pid, signal.SIGKILL)
                killed += 1
            killed += self._kill_leftovers()
            self.proc.wait()
            self.state = "stopped"
            self.why = why + (f" ({killed} process group(s) needed SIGKILL)" if killed else "")
            self._flush_events()
            self._beat(force=True)
            return self.status()

    def attach(self, since: dict) -> dict:
        """Stream again from ``since`` (rank -> next seq the driver wants): a driver that
        reconnects, or that saw a gap, gets every event it lacks, once."""
        with self._lock:
            for r, s in since.items():
                if int(r) in self.tails:
                    self.tails[int(r)].rewind(int(s))
            self._beat(force=True)
            return self.status()

    def status(self) -> dict:
        with self._lock:
            alive = sorted(pid for pid, (_, start) in self.known.items() if _same_process(pid, start))
            return {"type": "status", "node": self.node, "state": self.state, "why": self.why,
                    "attempt": self.attempt, "pid": self.proc.pid if self.proc else None,
                    "returncode": self.proc.poll() if self.proc else None, "ranks": self.ranks,
                    "workers": alive, "kernel_pid": os.getpid(), "host": socket.gethostname(),
                    "cursors": {r: t.next_seq for r, t in self.tails.items()}, "t": time.time()}

    def shutdown(self) -> dict:
        """Stop everything this agent started (the kernel is about to go)."""
        return self.stop(timeout_s=5.0)

    # ---- internals

    def _environment(self, spec: dict) -> dict:
        env = dict(os.environ)
        env.pop("JPY_PARENT_PID", None)  # the kernel's lifeline, not torchrun's
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        ifname = spec.get("ifname") or interface_for(spec["rdzv_endpoint"].rsplit(":", 1)[0])
        if ifname:  # gloo and NCCL pick an interface of their own otherwise, maybe one peers cannot reach
            env.setdefault("GLOO_SOCKET_IFNAME", ifname)
            env.setdefault("NCCL_SOCKET_IFNAME", ifname)
        env.update({str(k): str(v) for k, v in (spec.get("env") or {}).items()})
        return env

    def _torchrun_command(self, spec: dict, config_path: str) -> list[str]:
        is_host = 1 if spec["node_rank"] == 0 else 0  # node 0 serves the c10d store, the others join it
        cmd = [sys.executable, "-m", "torch.distributed.run",
               f"--nnodes={spec['nnodes']}", f"--nproc-per-node={spec['nproc']}", f"--node-rank={spec['node_rank']}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={spec['rdzv_endpoint']}", f"--rdzv-id={spec['rdzv_id']}",
               f"--rdzv-conf=join_timeout={int(spec.get('join_timeout_s', 120))},is_host={is_host}",
               f"--local-addr={spec['local_addr']}", f"--max-restarts={int(spec.get('max_restarts', 0))}",
               "-m", "workbench.launch.worker"]
        program = spec.get("program")
        if program:  # another program than the trainer: its module and arguments, {run_dir} filled in
            return cmd + [str(a).replace("{run_dir}", self.run_dir) for a in program]
        return cmd + ["workbench.trainer", config_path] + (["--resume"] if spec.get("resume") else [])

    def _refresh_known(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.known.update(descendants(self.proc.pid))
        self.known = {pid: v for pid, v in self.known.items() if _same_process(pid, v[1])}

    def _alive_known(self) -> bool:
        return any(_same_process(pid, start) for pid, (_, start) in self.known.items())

    def _kill_leftovers(self) -> int:
        """SIGKILL every process that was below torchrun and is still there; return how many groups."""
        groups = {pgid for pid, (pgid, start) in self.known.items() if _same_process(pid, start)}
        for pgid in groups:
            _signal_group(pgid, signal.SIGKILL)
        for pid, (_, start) in list(self.known.items()):
            if _same_process(pid, start):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        return len(groups)

    def _flush_events(self) -> None:
        for rank, tail in self.tails.items():
            while True:
                batch = tail.read(MAX_BATCH)
                if not batch:
                    break
                self._outbox.send({"type": "events", "node": self.node, "rank": rank, "events": batch})

    def _beat(self, force: bool = False) -> None:
        now = time.time()
        if force or now - self._last_beat >= HEARTBEAT_S:
            self._last_beat = now
            self._outbox.send(self.status())

    def _supervise(self) -> None:
        last_scan = 0.0
        while True:
            try:
                with self._lock:
                    self._flush_events()
                    if self.proc is not None and self.state in ("starting", "running"):
                        if time.time() - last_scan > 0.5:
                            self._refresh_known()
                            last_scan = time.time()
                            if self.known and self.state == "starting":
                                self.state, self.why = "running", ""
                        code = self.proc.poll()
                        if code is not None and not self._stopping:
                            self._refresh_known()
                            leftovers = self._kill_leftovers()  # the watchdog: torchrun is gone, so are its workers
                            self._flush_events()
                            if code == 0:
                                self.state, self.why = "finished", ""
                            else:
                                self.state, self.why = "failed", self._failure(code)
                            if leftovers:
                                self.why += f" ({leftovers} leftover process group(s) killed)"
                            self._beat(force=True)
                    self._beat()
            except Exception as e:  # noqa: BLE001 - the supervisor must outlive any one bad poll
                try:
                    print(f"workbench agent: {type(e).__name__}: {e}", file=sys.stderr)
                except Exception:  # noqa: BLE001
                    pass
            time.sleep(POLL_S)

    def _failure(self, code: int) -> str:
        """Why torchrun failed, from the last lines of its log."""
        why = f"torchrun exited with status {code}"
        if code < 0:
            why = f"torchrun was killed by signal {-code}"
        try:
            with open(self.log_path, errors="replace") as f:
                lines = [ln.strip() for ln in f.readlines()[-80:] if ln.strip()]
        except OSError:
            return why
        keys = ("RendezvousTimeoutError", "RendezvousClosedError", "RendezvousConnectionError", "ChildFailedError",
                "Error:", "error:", "exitcode")
        hits = [ln for ln in lines if any(k in ln for k in keys)]
        return f"{why}: {hits[-1][:300]}" if hits else why


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


AGENT: NodeAgent | None = None


def agent(node: int) -> NodeAgent:
    """This kernel's agent (one per kernel; made on first use)."""
    global AGENT
    if AGENT is None:
        AGENT = NodeAgent(node)
        import atexit

        atexit.register(lambda: AGENT.shutdown() if AGENT else None)
    return AGENT
