"""The :class:`RunHandle`: a live training job you control, whose nodes are Jupyter kernels
(a run directory on disk, read back, is a :class:`~workbench.rundir.record.RunRecord`).

``launch(config, backend=...)`` makes the run directory, starts one kernel per node (the node's
agent, ``agent.py``), starts torchrun on every node against one c10d rendezvous, and returns a
:class:`RunHandle`. The run then streams events live, says per node and per rank how things stand,
stops what is left when something fails, and stops, resumes and restarts on request.

The run directory is the source of truth. Events are accepted per rank in ``seq`` order only: a
duplicate (``seq`` below the next one wanted) is dropped, a gap makes the driver ask the node's
agent to stream again from the missing ``seq``. So a driver that disconnects and comes back
(``open_run``) continues from what the run directory holds, without losing or repeating events.
When a node does not share the driver's disk (ssh, gateway), the driver appends the events it
accepts to its own copy of the run directory, which makes that copy complete too.

Node numbering: node ``i`` holds global ranks ``i * nproc ... (i + 1) * nproc - 1``, as the
planner places them (see ``agent.py``, "Rank placement").
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import secrets
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

from workbench.spec.config import RunConfig
from workbench.spec.errors import ConfigError, check_choice, check_positive, require
from workbench.rundir.acceptance import record_acceptance
from workbench.rundir.events import read_events
from workbench.rundir.record import create_run_dir
from workbench.rundir.status import STOP_SKEW_S, run_outcome
from workbench.spec.trainable import check_trainable
from workbench.launch.agent import MARKER
from workbench.launch.preflight import (check_data_path, check_max_restarts, check_run_id_free, load_run_config)
from workbench.launch.gateway import GatewayBackend
from workbench.launch.kernels import KernelChannel, KernelError, LocalBackend, bootstrap_code
from workbench.launch.slurm import SlurmBackend
from workbench.launch.ssh import SSHBackend

BACKENDS = ("local", "ssh", "gateway", "slurm")
STATES = ("starting", "running", "finished", "failed", "stopped")
TERMINAL = ("finished", "failed", "stopped")
POLL_S = 0.1
LIVENESS_S = 1.0  # how often the driver asks whether each kernel is alive


# --------------------------------------------------------------------------- status


@dataclass(frozen=True)
class RankStatus:
    """One rank: ``state`` is one of :data:`STATES`; ``why`` says why it failed or stopped."""

    rank: int
    node: int
    state: str
    why: str = ""
    step: int | None = None  # last step logged
    loss: float | None = None
    events: int = 0  # events received from this rank


@dataclass(frozen=True)
class NodeStatus:
    """One node (one kernel, one torchrun)."""

    node: int
    host: str
    state: str
    why: str = ""
    ranks: tuple[int, ...] = ()
    pid: int | None = None  # torchrun's pid on the node


@dataclass(frozen=True)
class RunStatus:
    state: str
    why: str
    nodes: tuple[NodeStatus, ...]
    ranks: tuple[RankStatus, ...]

    def __str__(self) -> str:
        lines = [f"run: {self.state}" + (f" ({self.why})" if self.why else "")]
        for n in self.nodes:
            lines.append(f"  node {n.node} [{n.host}]: {n.state}" + (f" - {n.why}" if n.why else ""))
            for r in self.ranks:
                if r.node == n.node:
                    extra = f" step {r.step} loss {r.loss:.4f}" if r.step is not None and r.loss is not None else ""
                    lines.append(f"    rank {r.rank}: {r.state}{extra}, {r.events} events" + (f" - {r.why}" if r.why else ""))
        return "\n".join(lines)


@dataclass
class _Node:
    """The driver's record of one node."""

    index: int
    addr: str  # its --local-addr (node 0's is also the rendezvous host)
    run_dir: str  # the run directory on the node's own disk
    channel: KernelChannel | None = None
    state: str = "starting"
    why: str = ""
    host: str = ""
    pid: int | None = None
    cursors: dict[int, int] = field(default_factory=dict)  # the agent's next seq per rank
    started_at: float = 0.0
    last_rewind: float = 0.0
    last_seen: float = 0.0  # time of the agent's last status (a dead kernel died after it)
    failed_at: float = 0.0


@dataclass
class _Rank:
    state: str = "starting"
    why: str = ""
    failed_at: float = 0.0
    step: int | None = None
    loss: float | None = None
    events: int = 0


# --------------------------------------------------------------------------- backends


def make_backend(name: str, config: RunConfig, **options: Any):
    """The backend object for ``name`` (``local``, ``ssh``, ``gateway``, ``slurm``) and its options. An
    unknown or missing option is a ConfigError naming it (not the constructor's TypeError)."""
    check_choice("backend", name, BACKENDS)
    if name == "local":
        return LocalBackend(**_backend_options(LocalBackend, name, options))
    if name == "ssh":
        if not options.get("hosts") and not options.get("hosts_file") and getattr(config.cluster, "hosts", None):
            options["hosts"] = list(config.cluster.hosts)  # a Cluster that names its hosts
        return SSHBackend(config.cluster.nodes, **_backend_options(SSHBackend, name, options, "nodes"))
    if name == "slurm":
        return SlurmBackend(config.cluster.nodes, **_backend_options(SlurmBackend, name, options, "nodes"))
    return GatewayBackend(**_backend_options(GatewayBackend, name, options))


def _backend_options(cls: type, name: str, options: dict[str, Any], *given: str) -> dict[str, Any]:
    """``options`` checked against ``cls``'s constructor (``given``: the parameters the launcher
    itself passes)."""
    params = {n: p for n, p in inspect.signature(cls).parameters.items() if n not in given}
    unknown = sorted(set(options) - set(params))
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in options]
    accepted = ", ".join(params) or "none"
    require(not unknown, f"backend={name!r} has no option {', '.join(unknown)} (its options: {accepted})",
            field=unknown[0] if unknown else None)
    require(not missing, f"backend={name!r} needs {', '.join(f'{n}=' for n in missing)}",
            field=missing[0] if missing else None)
    return options


# --------------------------------------------------------------------------- the run


class RunHandle:
    """A launched (or reopened) run. Thread-safe; one monitor thread per handle."""

    def __init__(self, path: Path, config: RunConfig, backend: Any, nodes: list[_Node], *,
                 env: dict[str, str] | None = None, join_timeout_s: float = 120.0, max_restarts: int = 0,
                 stop_timeout_s: float = 10.0, attempt: int = 0, program: list[str] | None = None,
                 files: dict[str, str] | None = None):
        self.path, self.config, self.backend, self.nodes = Path(path), config, backend, nodes
        self.env = dict(env or {})
        # Another program than the trainer under the same launcher (the cluster benchmark):
        # worker arguments with {run_dir} filled in on each node, and files written there first.
        self.program, self.files = program, dict(files or {})
        self.join_timeout_s, self.max_restarts, self.stop_timeout_s = join_timeout_s, max_restarts, stop_timeout_s
        self.attempt = attempt
        self.nproc = config.cluster.gpus_per_node
        self._cond = threading.Condition()
        self._history: list[dict[str, Any]] = []
        self._since: dict[int, int] = {}
        self._ranks = {r: _Rank() for r in range(config.world_size)}
        self._user_stop = False
        self._failure = ""  # the first failure of this attempt
        self._stopping_rest = False
        self._mirror = not getattr(backend, "shares_run_dir", True)
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(nodes)), thread_name_prefix="workbench-run")
        self._closed = threading.Event()
        self._monitor: threading.Thread | None = None
        # A scheduler's allocation (the slurm backend) is given back once the run has ended.
        self._release_lock = threading.Lock()
        self._released = False
        self._judged = False  # the declared acceptance thresholds judged once the attempt has ended

    # ---- public API

    @property
    def run_id(self) -> str:
        return self.path.name

    def status(self) -> RunStatus:
        """Per node and per rank: starting, running, finished, failed or stopped, and why."""
        with self._cond:
            nodes = tuple(NodeStatus(n.index, n.host or n.addr, n.state, n.why, tuple(self._ranks_of(n.index)), n.pid)
                          for n in self.nodes)
            ranks = []
            for r, st in sorted(self._ranks.items()):
                node = self.nodes[r // self.nproc] if self.nodes else None
                state, why = st.state, st.why
                if node is not None and node.state in ("failed", "stopped") and state in ("starting", "running"):
                    state, why = node.state, node.why
                ranks.append(RankStatus(r, r // self.nproc, state, why, st.step, st.loss, st.events))
            return RunStatus(self._run_state(), self._run_why(), nodes, tuple(ranks))

    def events(self, timeout_s: float | None = None, from_start: bool = True) -> Iterator[list[dict[str, Any]]]:
        """Batches of events as they arrive (every rank's in ``seq`` order), until the run has
        ended and every event is in, or ``timeout_s`` has passed without one."""
        index = 0 if from_start else len(self._history)
        while True:
            batch, done = self._take(index, timeout_s)
            if batch:
                index += len(batch)
                yield batch
            elif done:
                return

    async def aevents(self, poll_s: float = 0.2, from_start: bool = True) -> AsyncIterator[list[dict[str, Any]]]:
        """:meth:`events` as an async iterator, for the UI's event loop."""
        index = 0 if from_start else len(self._history)
        while True:
            batch, done = self._take(index, 0)
            if batch:
                index += len(batch)
                yield batch
            elif done:
                return
            else:
                await asyncio.sleep(poll_s)

    def history(self) -> list[dict[str, Any]]:
        """Every event received so far (each rank's in ``seq`` order, without gaps or repeats)."""
        with self._cond:
            return list(self._history)

    def wait(self, timeout_s: float | None = None) -> RunStatus:
        """Block until the run has ended (or ``timeout_s``); return its status."""
        deadline = None if timeout_s is None else time.time() + timeout_s
        with self._cond:
            while not self._done():
                left = None if deadline is None else deadline - time.time()
                if left is not None and left <= 0:
                    break
                self._cond.wait(timeout=0.5 if left is None else min(left, 0.5))
        return self.status()

    def stop(self, timeout_s: float | None = None) -> RunStatus:
        """SIGTERM to every node's torchrun process group (and its workers'), SIGKILL to what is
        left after ``timeout_s``; then the final events are read. A run that has already ended is
        left as it is and reports how it ended (finished, failed, stopped by a guard...). A run
        without kernels (``workbench train``'s) has nothing here to stop it with: SIGINT or SIGTERM
        to that command stops it."""
        if self._ended() or not self.nodes:
            return self.status()
        self._user_stop = True
        began = time.time()
        self._stop_nodes([n for n in self.nodes], timeout_s or self.stop_timeout_s, "stopped by the user")
        self.wait(timeout_s=5)
        self._absolve_stop_echoes(began)
        self._release_allocation()
        return self.status()

    def _absolve_stop_echoes(self, began: float) -> None:
        """A stop reaches the nodes one after another: a node whose ranks lost the connection to an
        already stopped rank sees its torchrun exit 1 before its own stop call arrives, and its
        ranks write a peer-lost error. Those are the stop's echo, not failures, when the run's
        events say so (:func:`workbench.rundir.status.run_outcome`, the one classification of a
        stop) and the node failed after the stop began; a failure the events do not explain, or
        one from before the stop, stands."""
        with self._cond:
            outcome = run_outcome(self._history, len(self._ranks))
            last = outcome.attempts - 1
            if outcome.failures or not any(s.attempt == last for s in outcome.stops):
                return
            for node in self.nodes:
                if node.state == "failed" and node.failed_at >= began - STOP_SKEW_S:
                    node.state = "stopped"
                    node.why = "stopped with the job: its ranks lost the connection to a stopped rank"
            for ro in outcome.ranks:
                st = self._ranks.get(ro.rank)
                if st is not None and st.state == "failed" and ro.state == "stopped":
                    st.state, st.why = "stopped", ro.why

    def resume(self) -> "RunHandle":
        """Start the job again, from the latest good checkpoint (``--resume``), with a fresh
        rendezvous id; nodes whose kernel has gone get a new one."""
        if self._run_state() not in TERMINAL:
            raise RuntimeError(f"run {self.run_id} is {self._run_state()}: stop() it first, or restart()")
        try:
            for node in self.nodes:
                if node.channel is None or not node.channel.alive():
                    self._start_kernel(node)
            self.attempt += 1
            self._start_attempt(resume=True)
        except BaseException:
            self._released = False  # what was allocated for the attempt goes back
            self._release_allocation()
            raise
        # Only now: until the nodes are starting, the monitor would take the ended run's state
        # for this attempt's and give the new allocation back.
        self._released = False
        self._judged = False
        return self

    def restart(self) -> "RunHandle":
        """stop() if running, then resume()."""
        if self._run_state() not in TERMINAL:
            self.stop()
        return self.resume()

    def close(self) -> None:
        """Stop streaming and disconnect; the job and its kernels keep running (reattach with
        ``open_run(path)``). A closed handle is done with."""
        self._closed.set()
        if self._monitor is not None:
            self._monitor.join(timeout=5)
        self._save_launch()
        for node in self.nodes:
            if node.channel is not None:
                node.channel.close()
                node.channel = None
        self._pool.shutdown(wait=False)

    def shutdown(self) -> RunStatus:
        """Stop the job if it runs, then end the kernels."""
        if self._run_state() not in TERMINAL or not self._nodes_ended():
            self.stop()
        status = self.status()
        self._closed.set()
        if self._monitor is not None:
            self._monitor.join(timeout=5)
        self._pool.shutdown(wait=True)  # no control call may still be on its way to a kernel
        self._save_launch()  # the final states, for open_run once the kernels are gone
        for node in self.nodes:
            if node.channel is not None:
                node.channel.shutdown()
                node.channel = None
        self._release_allocation()
        return status

    def _judge_acceptance(self) -> None:
        """A run that ran to its end (finished, or stopped by a guard) has its declared thresholds
        judged into its events (:func:`~workbench.rundir.acceptance.record_acceptance`, written
        once however many end paths call it), for the app and ``workbench compare`` alike."""
        self._judged = True
        if not self.config.train.accept:
            return
        state = self._run_state()
        guarded = any(e["kind"] == "guard" for e in read_events(self.path))
        if state == "finished" or (state == "stopped" and guarded):
            try:
                record_acceptance(self.path)
            except (ConfigError, OSError) as e:  # a damaged run directory: the run's end stands
                sys.stderr.write(f"[workbench] {self.path}: acceptance thresholds not judged: {e}\n")

    def _release_allocation(self) -> None:
        """Give a scheduler's allocation back (the backend's ``release``: scancel, and wait until
        the queue no longer holds the job) once the run has ended: after a stop, a failure, the
        last step. Every event is in by then (:meth:`_done`); the kernels end with the allocation,
        so their channels are closed first. A resume asks for a new allocation."""
        release = getattr(self.backend, "release", None)
        if release is None:
            return
        with self._release_lock:
            if self._released:
                return
            self._released = True
            for node in self.nodes:
                channel, node.channel = node.channel, None
                if channel is not None:
                    channel.close()
            release()
            self._save_launch()

    def __repr__(self) -> str:
        return f"RunHandle({str(self.path)!r}, {self._run_state()})"

    # ---- starting

    def _call(self, node: _Node, method: str, *args: Any, timeout_s: float = 60.0) -> Any:
        if node.channel is None:
            raise KernelError(f"node {node.index} has no kernel")
        code = (f"import sys as _s, json as _j\n"
                f"_wb_out = _s.modules['workbench_agent'].AGENT.{method}(*_j.loads({json.dumps(args)!r}))\n")
        return node.channel.call(code, timeout_s)

    def _start_kernel(self, node: _Node) -> None:
        node.channel = None
        node.channel = self.backend.start(self.path, node.index)
        address_of = getattr(self.backend, "address_of", None)
        if address_of is not None:  # a new allocation may have given other nodes
            node.addr = address_of(node.index)
        self._apply_status(node, node.channel.call(bootstrap_code(node.index)))

    def _start_attempt(self, resume: bool) -> None:
        """Start torchrun on every node: a free port on node 0, a fresh rendezvous id."""
        self._user_stop, self._failure, self._stopping_rest = False, "", False
        with self._cond:
            for st in self._ranks.values():
                st.state, st.why = "starting", ""
        first = self.nodes[0]
        port = int(first.channel.call(f"import sys as _s\n_wb_out = _s.modules['workbench_agent'].free_port({first.addr!r})"))
        endpoint = f"{first.addr}:{port}"
        rdzv_id = f"{self.run_id}-a{self.attempt}-{secrets.token_hex(4)}"

        def start(node: _Node) -> None:
            node.state, node.why, node.started_at, node.pid = "starting", "waiting for the rendezvous", 0.0, None
            spec = dict(run_dir=node.run_dir, config_json=self.config.to_json(), nnodes=len(self.nodes),
                        nproc=self.nproc, node_rank=node.index, rdzv_endpoint=endpoint, rdzv_id=rdzv_id,
                        # torchrun's own limit comes later: the driver's verdict names the node that is missing.
                        local_addr=node.addr, join_timeout_s=self.join_timeout_s + 30, max_restarts=self.max_restarts,
                        resume=resume, env=self.env, since={str(k): v for k, v in self._since.items()},
                        attempt=self.attempt, program=self.program, files=self.files)
            reply = self._call(node, "start", spec)
            if not reply.get("ok"):
                node.state, node.why = "failed", reply.get("why", "start failed")
            else:
                node.pid, node.host = reply.get("pid"), reply.get("host", node.host)

        errors = self._each(start, self.nodes)
        now = time.time()  # the rendezvous clock starts once every torchrun has been started
        for node, error in zip(self.nodes, errors):
            node.started_at = now
            if error is not None:
                node.state, node.why = "failed", f"could not start torchrun: {error}"
        self._save_launch()
        self._ensure_monitor()

    def _each(self, fn, nodes: list[_Node]) -> list[BaseException | None]:
        futures = [self._pool.submit(fn, n) for n in nodes]
        out: list[BaseException | None] = []
        for f in futures:
            try:
                f.result()
                out.append(None)
            except BaseException as e:  # noqa: BLE001 - reported per node
                out.append(e)
        return out

    def _save_launch(self) -> None:
        """``launch/launch.json``: how to reach the nodes again (no secrets: keys stay in the 0600
        connection files, tokens are never written)."""
        launch_dir = self.path / "launch"
        launch_dir.mkdir(exist_ok=True)
        data = {"backend": self.backend.name, "backend_options": self.backend.public_options()
                if hasattr(self.backend, "public_options") else {},
                "attempt": self.attempt, "join_timeout_s": self.join_timeout_s, "max_restarts": self.max_restarts,
                "stop_timeout_s": self.stop_timeout_s, "env": self.env,
                "nodes": [{"node": n.index, "addr": n.addr, "run_dir": n.run_dir, "host": n.host,
                           "state": n.state, "why": n.why,
                           "kernel": n.channel.description if n.channel is not None else None} for n in self.nodes]}
        os.chmod(launch_dir, 0o700)
        tmp = launch_dir / "launch.json.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # env may hold secrets of the user's
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, launch_dir / "launch.json")

    # ---- the monitor: messages in, faults out

    def _ensure_monitor(self) -> None:
        if self._monitor is None or not self._monitor.is_alive():
            self._closed.clear()
            self._monitor = threading.Thread(target=self._watch, name="workbench-monitor", daemon=True)
            self._monitor.start()

    def _watch(self) -> None:
        last_liveness = 0.0
        while not self._closed.is_set():
            for node in self.nodes:
                channel = node.channel
                if channel is None:
                    continue
                for msg in channel.messages():
                    self._handle(node, msg)
            if time.time() - last_liveness > LIVENESS_S:
                last_liveness = time.time()
                self._check_liveness()
            self._check_faults()
            if not self._released and self._done():
                self._release_allocation()
            if not self._judged and self._done():
                self._judge_acceptance()
            with self._cond:
                self._cond.notify_all()
            time.sleep(POLL_S)

    def _handle(self, node: _Node, msg: dict[str, Any]) -> None:
        kind = msg.get("msg_type")
        if kind == "comm_msg":
            self._handle_data(node, msg["content"].get("data") or {})
        elif kind == "stream":  # the fallback: marked lines on stdout
            for line in msg["content"].get("text", "").splitlines():
                if line.startswith(MARKER):
                    try:
                        self._handle_data(node, json.loads(line[len(MARKER):]))
                    except ValueError:
                        pass

    def _handle_data(self, node: _Node, data: dict[str, Any]) -> None:
        if data.get("type") == "events":
            for event in data.get("events", []):
                self._accept(node, event)
        elif data.get("type") == "status":
            self._apply_status(node, data)

    def _apply_status(self, node: _Node, data: dict[str, Any]) -> None:
        with self._cond:
            node.cursors = {int(r): int(s) for r, s in (data.get("cursors") or {}).items()}
            node.host = data.get("host") or node.host
            if data.get("pid"):
                node.pid = data["pid"]
            node.last_seen = max(node.last_seen, float(data.get("t", 0.0)))
            state = data.get("state")
            if int(data.get("attempt", self.attempt)) < self.attempt:
                return  # a late word about the previous attempt
            if state == "idle" or node.state == "failed" and state != "failed":
                return  # a driver-side verdict (kernel died, never joined) stands
            if state in STATES:
                if state == "failed" and node.state != "failed":
                    node.failed_at = float(data.get("t", time.time()))
                node.state, node.why = state, data.get("why", "")

    def _accept(self, node: _Node, event: dict[str, Any]) -> None:
        rank, seq = int(event.get("rank", -1)), int(event.get("seq", -1))
        with self._cond:
            want = self._since.get(rank, 0)
            if seq < want:
                return  # already have it
            if seq > want:  # a gap: ask the agent for the rest, at most once a second
                if time.time() - node.last_rewind > 1.0:
                    node.last_rewind = time.time()
                    self._pool.submit(self._rewind, node)
                return
            self._since[rank] = seq + 1
            self._history.append(event)
            self._update_rank(rank, event)
            if self._mirror:
                append_once(self.path / "events" / f"rank-{rank}.jsonl", event)

    def _rewind(self, node: _Node) -> None:
        try:
            with self._cond:
                since = {str(r): self._since.get(r, 0) for r in self._ranks_of(node.index)}
            self._apply_status(node, self._call(node, "attach", since, timeout_s=30))
        except Exception:  # noqa: BLE001 - the liveness check reports a dead kernel
            pass

    def _update_rank(self, rank: int, event: dict[str, Any]) -> None:
        st = self._ranks.setdefault(rank, _Rank())
        st.events += 1
        kind = event.get("kind")
        if kind == "run_start":
            st.state, st.why = "running", ""
        elif kind == "step":
            st.step, st.loss = event.get("step"), event.get("loss")
            if st.state == "starting":
                st.state = "running"
        elif kind == "error":
            st.state, st.why, st.failed_at = "failed", event.get("error", "error"), event.get("t", time.time())
        elif kind == "guard":  # run_end "stopped" follows: this says which guard and why
            st.why = f"stopped by the {event.get('guard', '?')} guard: {event.get('message', '')}"
        elif kind == "run_end":
            status = event.get("status")
            if status == "ok":
                st.state, st.why = "finished", ""
            elif status == "interrupted":
                st.state, st.why = "stopped", st.why or "interrupted"
            elif status == "stopped":  # a guard stopped the run cleanly; its "guard" event says why
                st.state, st.why = "stopped", st.why or "stopped by a guard"
            elif st.state != "failed":
                st.state, st.why, st.failed_at = "failed", f"run_end status {status!r}", event.get("t", time.time())

    def _check_liveness(self) -> None:
        for node in self.nodes:
            if node.channel is None or node.state in ("finished",):
                continue
            try:
                alive = node.channel.alive()
            except Exception:  # noqa: BLE001
                alive = False
            if not alive and not (node.state == "failed" and node.why.startswith("kernel")):
                # a scheduler that ended the job says why (Slurm: scancel, time limit, node failure)
                end_reason = getattr(self.backend, "end_reason", None)
                reason = end_reason() if end_reason is not None else None
                with self._cond:
                    node.state, node.why = "failed", reason or f"kernel died while {node.state}"
                    node.failed_at = node.last_seen or time.time()
                    node.channel = None

    def _check_faults(self) -> None:
        """Something failed: say which and why, and stop the rest. A node that has not joined the
        rendezvous ``join_timeout_s`` after its start has failed too."""
        with self._cond:
            if self._stopping_rest or self._user_stop:
                return  # a cause was named already; what follows is its echo
            now = time.time()
            late = [n for n in self.nodes if n.state == "starting" and n.started_at
                    and now - n.started_at > self.join_timeout_s]
            if late:
                # Blame the nodes whose torchrun is not there to wait (no pid: never started); when
                # every late node is waiting, none can be told apart: all of them failed to meet.
                absent = [n for n in late if n.pid is None]
                for node in absent or late:
                    node.state, node.failed_at = "failed", node.started_at + self.join_timeout_s
                    node.why = f"did not join the rendezvous within {self.join_timeout_s:g} s"
            if not self._failures():
                return
            self._failure = self._failures()[0][1]
            self._stopping_rest = True
            rest = [n for n in self.nodes if n.state in ("starting", "running")]
        if rest:
            self._pool.submit(self._stop_nodes, rest, self.stop_timeout_s, f"stopped because {self._failure}")

    def _stop_nodes(self, nodes: list[_Node], timeout_s: float, why: str) -> None:
        def stop(node: _Node) -> None:
            if node.channel is None:
                return
            self._apply_status(node, self._call(node, "stop", timeout_s, why, timeout_s=timeout_s + 30))

        self._each(stop, nodes)

    def _load_history(self) -> None:
        """The events already in the run directory: the history, and where streaming resumes."""
        events = read_events(self.path)
        with self._cond:
            for e in sorted(events, key=lambda e: (e.get("rank", 0), e.get("seq", 0))):
                r, s = e.get("rank", -1), e.get("seq", -1)
                if s != self._since.get(r, 0):
                    continue  # a gap in the copy: streaming fills it from the node
                self._since[r] = s + 1
                self._history.append(e)
                self._update_rank(r, e)
            self._history.sort(key=lambda e: (e.get("t", 0.0), e.get("rank", 0), e.get("seq", 0)))

    # ---- state

    def _ranks_of(self, node: int) -> list[int]:
        return list(range(node * self.nproc, (node + 1) * self.nproc))

    def _run_state(self) -> str:
        states = [n.state for n in self.nodes]
        if not states:  # no launch record: the events tell
            ranks = [st.state for st in self._ranks.values()]
            if ranks and all(s == "finished" for s in ranks):
                return "finished"
            if any(s == "failed" for s in ranks):
                return "failed"
            if ranks and all(s in TERMINAL for s in ranks):
                return "stopped"  # interrupted, or a guard stopped it
            return "running" if any(s == "running" for s in ranks) else "starting"
        if all(s in TERMINAL for s in states):
            if any(s == "failed" for s in states) or self._failure:
                return "failed"
            if all(s == "finished" for s in states):  # torchrun exits 0 after a guard stop too
                return "stopped" if any(st.state == "stopped" for st in self._ranks.values()) else "finished"
            return "stopped"
        if self._failure:
            return "failed"
        return "running" if any(s == "running" for s in states) else "starting"

    def _failures(self) -> list[tuple[float, str]]:
        """Every failure of this attempt, earliest first: the first is the cause, the rest are
        mostly its echo (peers that lost a connection)."""
        out = [(n.failed_at, f"node {n.index}: {n.why}") for n in self.nodes if n.state == "failed"]
        out += [(st.failed_at, st.why if st.why.startswith(f"rank {r}:") else f"rank {r}: {st.why}")
                for r, st in self._ranks.items() if st.state == "failed"]
        return sorted(out)

    def _run_why(self) -> str:
        if self._failure:
            return self._failures()[0][1] if self._failures() else self._failure
        state = self._run_state()
        if state == "failed" and self._failures():  # no launch record: a rank's own error line
            return self._failures()[0][1]
        if state == "stopped":
            if self._user_stop:
                return "stopped by the user"
            return next((st.why for st in self._ranks.values() if st.state == "stopped" and st.why), "")
        return ""

    def _nodes_ended(self) -> bool:
        return all(n.state in TERMINAL for n in self.nodes)

    def _ended(self) -> bool:
        """The run is over: every node ended (or, for a run without kernels, every rank)."""
        return self._run_state() in TERMINAL and self._nodes_ended()

    def _done(self) -> bool:
        """Ended on every node, and every event the agents have read is in."""
        if self._run_state() not in TERMINAL or not self._nodes_ended():
            return False
        for node in self.nodes:
            if node.channel is None:
                continue
            if any(self._since.get(r, 0) < s for r, s in node.cursors.items()):
                return False
        return True

    def _take(self, index: int, timeout_s: float | None) -> tuple[list[dict[str, Any]], bool]:
        deadline = None if timeout_s is None else time.time() + timeout_s
        with self._cond:
            while len(self._history) <= index:
                if self._done():
                    return [], True
                left = None if deadline is None else deadline - time.time()
                if left is not None and left <= 0:
                    return [], timeout_s is not None and timeout_s > 0
                self._cond.wait(timeout=0.5 if left is None else min(left, 0.5))
            return list(self._history[index:]), False


def append_once(path: Path, event: dict[str, Any]) -> bool:
    """Append ``event`` to a rank's events file of the driver's copy, unless the file already
    holds its ``seq`` (another driver attached to the same run wrote it): under an exclusive
    lock, only the next ``seq`` is written, so the copy stays gap-free and without repeats."""
    import fcntl

    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        size = f.seek(0, os.SEEK_END)
        last = -1
        if size:
            f.seek(max(0, size - 65536))
            tail = f.read()
            lines = tail[: tail.rfind(b"\n")].rsplit(b"\n", 1) if b"\n" in tail else []
            try:
                last = int(json.loads(lines[-1])["seq"]) if lines else -1
            except (ValueError, KeyError):
                last = -1
        if int(event["seq"]) != last + 1:
            return False
        f.write((json.dumps(event) + "\n").encode())
        return True


# --------------------------------------------------------------------------- entry points


def launch(config: RunConfig, backend: str = "local", *, run_root: str | os.PathLike = "runs",
           run_id: str | None = None, env: dict[str, str] | None = None, join_timeout_s: float = 120.0,
           max_restarts: int = 0, stop_timeout_s: float = 10.0, program: list[str] | None = None,
           files: dict[str, str] | None = None, manifest_extra: dict[str, Any] | None = None,
           hf_config: str | os.PathLike | None = None, **backend_options: Any) -> RunHandle:
    """Start ``config`` on ``config.cluster.nodes`` kernels and return its :class:`RunHandle`.

    ``backend``: "local" (kernels on this machine), "ssh" (``hosts=[...]`` or ``hosts_file=``,
    key authentication), "gateway" (``url=``, ``token=``). ``env``: extra environment of every
    rank. ``join_timeout_s``: how long the nodes may take to meet at the rendezvous (a node still
    missing then is named as the failure). ``program`` / ``files``: run another program of the
    worker than the trainer (the cluster benchmark: ``["--bench", "{run_dir}/bench.json"]`` with
    ``files={"bench.json": ...}``); ``config`` then only sizes the job. ``manifest_extra`` joins
    the run's manifest (a naive baseline's ``baseline_of``: :mod:`workbench.launch.baseline`);
    ``hf_config``: the config.json the model was imported from (its hash goes into the lineage). Raises :class:`ConfigError`
    before anything is made or started when the trainer cannot run the config or an argument is
    wrong (the backend, its options, the timeouts, a data path, a run id already taken)."""
    require(isinstance(config, RunConfig), f"config={type(config).__name__} is not a RunConfig", field="config")
    if program is None:
        check_trainable(config)
    if config.cluster.nodes * config.cluster.gpus_per_node != config.world_size:
        raise ConfigError(f"nodes x gpus_per_node = {config.cluster.nodes} x {config.cluster.gpus_per_node} "
                          f"!= world size {config.world_size}", field="cluster.nodes", value=config.cluster.nodes)
    check_max_restarts(max_restarts)
    check_positive("join_timeout_s", join_timeout_s)
    check_positive("stop_timeout_s", stop_timeout_s)
    be = make_backend(backend, config, **backend_options)
    if program is None and getattr(be, "shares_run_dir", False):
        _check_local_data_path(config)
    check_run_id_free(run_root, run_id)  # names a live run's pid; create_run_dir refuses any taken id
    path = create_run_dir(config, run_root, run_id, hf_config=hf_config, manifest_extra=manifest_extra)
    if hasattr(be, "prepare"):  # a scheduler's backend logs and records its allocation there
        be.prepare(path)
    addrs = be.node_addresses(config.cluster.nodes)
    nodes = [_Node(i, addrs[i], be.run_dir_of(path, i)) for i in range(config.cluster.nodes)]
    run = RunHandle(path, config, be, nodes, env=env, join_timeout_s=join_timeout_s, max_restarts=max_restarts,
              stop_timeout_s=stop_timeout_s, program=program, files=files)
    errors = run._each(run._start_kernel, nodes)
    if any(errors):
        bad = next(f"node {n.index}: {e}" for n, e in zip(nodes, errors) if e is not None)
        for n in nodes:
            if n.channel is not None:
                n.channel.shutdown()
        if hasattr(be, "release"):
            be.release()
        raise KernelError(f"could not start the kernels ({bad})")
    run._start_attempt(resume=False)
    return run


def _check_local_data_path(config: RunConfig) -> None:
    """On a disk the nodes share, a data path is checked before the kernels start. Each node's
    torchrun starts in the run directory, so a relative path would be read from there."""
    t = config.train
    if t.dataset in ("text", "bin") and t.data_path and not Path(t.data_path).is_absolute():
        raise ConfigError(f"data_path={t.data_path!r} is relative: the ranks of a launched run start in its run "
                          f"directory, give an absolute path", field="data_path", value=t.data_path)
    check_data_path(config)


def _read_launch_record(launch_file: Path) -> dict[str, Any]:
    """``launch/launch.json``, or a ConfigError naming it when it is damaged."""
    try:
        data = json.loads(launch_file.read_text())
        require(isinstance(data, dict) and isinstance(data.get("backend"), str) and isinstance(data.get("nodes"), list)
                and isinstance(data.get("backend_options") or {}, dict)
                and all(isinstance(d, dict) and {"node", "addr", "run_dir"} <= set(d) for d in data["nodes"]),
                "not a launch record")
        return data
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{launch_file} is damaged ({e})", field="path", value=str(launch_file)) from None


def open_run(path: str | os.PathLike, **backend_options: Any) -> RunHandle:
    """Reattach to a running or finished run: its run directory is the source of truth, and
    streaming continues from the events it holds. Secrets the launch did not save (a gateway
    token) are passed again here. A path that is not a run directory, or a damaged config.json
    or launch record, raises :class:`ConfigError`."""
    config = load_run_config(path, field="path")
    path = Path(path)
    launch_file = path / "launch" / "launch.json"
    if not launch_file.exists():  # started without kernels (workbench train): events only
        run = RunHandle(path, config, _NoBackend(), [])
        run._load_history()
        return run
    data = _read_launch_record(launch_file)
    options = dict(data.get("backend_options") or {})
    options.update(backend_options)
    be = make_backend(data["backend"], config, **options)
    if hasattr(be, "prepare"):
        be.prepare(path)
    nodes = [_Node(d["node"], d["addr"], d["run_dir"], host=d.get("host", "")) for d in data["nodes"]]
    run = RunHandle(path, config, be, nodes, env=data.get("env"), join_timeout_s=data.get("join_timeout_s", 120),
              max_restarts=data.get("max_restarts", 0), stop_timeout_s=data.get("stop_timeout_s", 10),
              attempt=data.get("attempt", 0))
    run._load_history()

    def reconnect(node: _Node, description: dict[str, Any] | None) -> None:
        if description is None:
            raise KernelError("no kernel was recorded")
        node.channel = be.reconnect(path, description)
        node.channel.call(bootstrap_code(node.index))
        since = {str(r): run._since.get(r, 0) for r in run._ranks_of(node.index)}
        run._apply_status(node, run._call(node, "attach", since))

    for node, d in zip(nodes, data["nodes"]):
        try:
            reconnect(node, d.get("kernel"))
        except Exception as e:  # noqa: BLE001 - the node is gone; the record or the events tell how it ended
            node.channel = None
            ranks = [run._ranks[r] for r in run._ranks_of(node.index)]
            if d.get("state") in TERMINAL:
                node.state, node.why = d["state"], d.get("why", "")
            elif all(st.state == "finished" for st in ranks):
                node.state, node.why = "finished", ""
            elif any(st.state == "failed" for st in ranks):
                node.state, node.why = "failed", next(st.why for st in ranks if st.state == "failed")
            else:
                node.state, node.why = "failed", f"kernel gone ({e})"
    run._ensure_monitor()
    return run


class _NoBackend:
    name = "none"
    shares_run_dir = True
