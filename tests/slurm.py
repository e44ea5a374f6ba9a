"""A real Slurm on this machine: one ``munged``, one ``slurmctld`` and two ``slurmd`` (``-N n1``,
``-N n2``), the two nodes both on 127.0.0.1 with ports of their own (Debian's build runs several
slurmd on one host). Everything lives in one private directory: the munge key and socket, the
``slurm.conf``, the daemons' state, spool and logs. The daemons run in the foreground as this
process's children (the tests run as root, as CI does), and are stopped by their PIDs.

Clients (``salloc``, ``srun``, ``squeue``, ``scancel``, ``scontrol``) find the cluster through
``SLURM_CONF``, which :func:`slurm_cluster` sets for the test session.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
NODES = ("n1", "n2")
CPUS = 2  # per node: this machine's cores (both nodes share them)


def slurm_available() -> str | None:
    """Why a real Slurm cannot start here (None: it can)."""
    missing = [d for d in DAEMONS + ("srun", "salloc", "squeue", "scancel", "scontrol")
               if shutil.which(d) is None and not os.path.exists(f"/usr/sbin/{d}")]
    if missing:
        return f"not installed: {', '.join(missing)} (apt-get install slurmctld slurmd slurm-client munge)"
    if os.geteuid() != 0:
        return "the Slurm daemons of the tests run as root"
    return None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@dataclass
class SlurmCluster:
    """The running cluster: ``env`` is what a client needs (``SLURM_CONF``)."""

    root: Path
    conf: Path
    env: dict[str, str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> str:
        done = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
        return done.stdout

    def jobs(self) -> list[str]:
        """Every job Slurm still holds queued or running: ``"<id> <state> <name>"``."""
        return [ln for ln in self.run("squeue", "-h", "-o", "%i %T %j").splitlines() if ln.strip()]

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T")
        return dict(ln.split() for ln in out.splitlines() if ln.strip())

    def log(self, daemon: str) -> str:
        path = self.root / f"{daemon}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_slurm(root: Path, timeout_s: float = 60.0) -> SlurmCluster:
    """Write the munge key and slurm.conf under ``root`` and start the daemons; returns once both
    nodes are idle (raises with the daemons' logs otherwise)."""
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    for sub in ("state", "spool"):
        (root / sub).mkdir(exist_ok=True)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    sock = root / "munge.sock"
    ctld_port, *node_ports = _free_ports(1 + len(NODES))
    host = socket.gethostname()
    nodes = "\n".join(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs={CPUS} State=UNKNOWN"
                      for n, p in zip(NODES, node_ports))
    conf = root / "slurm.conf"
    conf.write_text(f"""\
ClusterName=workbench-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
MinJobAge=600
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
{nodes}
PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")
    env = dict(os.environ, SLURM_CONF=str(conf))
    cluster = SlurmCluster(root, conf, env)
    try:
        cluster.procs["munged"] = subprocess.Popen(
            [_daemon("munged"), "--foreground", "--force", f"--key-file={key}", f"--socket={sock}",
             f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log", f"--seed-file={root}/munged.seed"],
            env=env, stdout=subprocess.DEVNULL, stderr=open(root / "munged.err", "w"))
        _wait(lambda: sock.exists(), 20, "munged's socket", cluster)
        cluster.procs["slurmctld"] = subprocess.Popen([_daemon("slurmctld"), "-D", "-i", "-f", str(conf)], env=env,
                                                      stdout=subprocess.DEVNULL, stderr=open(root / "slurmctld.err", "w"))
        for n in NODES:
            cluster.procs[f"slurmd-{n}"] = subprocess.Popen([_daemon("slurmd"), "-D", "-N", n, "-f", str(conf)], env=env,
                                                            stdout=subprocess.DEVNULL,
                                                            stderr=open(root / f"slurmd-{n}.err", "w"))
        _wait(lambda: _idle(cluster), timeout_s, "both nodes idle", cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _idle(cluster: SlurmCluster) -> bool:
    try:
        states = cluster.node_states()
    except (RuntimeError, subprocess.TimeoutExpired):
        return False
    return sorted(states) == sorted(NODES) and all(s == "idle" for s in states.values())


def _wait(predicate, timeout_s: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if predicate():
            return
        dead = [n for n, p in cluster.procs.items() if p.poll() is not None]
        if dead:
            break
        time.sleep(0.2)
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(cluster.root.glob("*.err"))
                     if p.stat().st_size) + "\n".join(f"--- {d}.log\n{cluster.log(d)[-1500:]}"
                                                      for d in ("slurmctld", "slurmd-n1", "slurmd-n2"))
    raise RuntimeError(f"Slurm did not come up ({what}; exited: "
                       f"{[n for n, p in cluster.procs.items() if p.poll() is not None]})\n{logs}")
