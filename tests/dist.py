"""The one multi-process harness of the tests: torchrun jobs of gloo ranks on CPU.

A test hands :func:`run_torchrun` a worker, ``"test_module:function"`` (a function of a module in
tests/) or a script path, the number of ranks and JSON-able arguments; torchrun starts the ranks
(one thread each, no GPU, a rendezvous on a free port, a process-group timeout that ends a job
with a lost peer), each rank calls ``function(*args)``, and the harness tears the process group
down. A failing job raises with the tail of its log. Workers write their results to files named in
their arguments (rank 0, usually).

Also here, because tests and their workers both use them: :func:`make_config`, the settings the
loss-equality tests share, and :func:`max_rel_diff`.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

HERE = Path(__file__).resolve().parent
PG_TIMEOUT_S = "60"
LOG_TAIL = (3000, 6000)  # characters of stdout, of stderr, in a failure's message


class JobFailed(AssertionError):
    """A torchrun job exited non-zero or ran past its timeout; the message ends with its log."""


def _tail(text: str | bytes | None, n: int) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-n:]


# The last line of a Python traceback: "ValueError: ...", "torch.distributed.DistBackendError: ...".
_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)\b.*$", re.M)


def _rank_errors(err: str | None) -> str:
    """The ranks' own exception lines, first in a failure's message: a log's tail is mostly
    torchrun's ChildFailedError traceback, and a CI summary may cut the middle away."""
    lines = [m.group(0) for m in _EXCEPTION_LINE.finditer(err or "") if "ChildFailedError" not in m.group(0)]
    unique = list(dict.fromkeys(lines))[:8]
    return "".join(f"rank error: {line}\n" for line in unique)


def torchrun_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a job's ranks: this one, one thread per rank (two cores are shared by
    all ranks), CPU only (so gloo), the trainer's process-group timeout, then ``env``."""
    out = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               WORKBENCH_PG_TIMEOUT_S=PG_TIMEOUT_S)
    out.update(env or {})
    return out


def run_torchrun(target: str | Path, nproc: int, args: Sequence[Any] = (), env: dict[str, str] | None = None,
                 timeout: float = 300, check: bool = True, timing: bool = False) -> subprocess.CompletedProcess:
    """Run ``target`` on ``nproc`` gloo ranks with torchrun; return the finished process (text
    stdout and stderr). ``target``: ``"module:function"``, called as ``function(*args)`` on every
    rank (``args`` travel as JSON), or the path of a script, given ``args`` as its argv. With
    ``check`` (the default), a non-zero exit or a timeout raises :class:`JobFailed` with the log's
    tail; without, the caller reads ``returncode`` (-9 after a timeout). ``timing``: the job
    measures timings, so its processes run at the highest CPU priority this user may set
    (:func:`_timing_priority`): on a machine busy with other jobs the scheduler then gives each rank
    its core whenever it is runnable, and the timings measure the job, not the other jobs."""
    if isinstance(target, str) and ":" in target and not target.endswith(".py"):
        script, argv = [str(HERE / "dist.py"), "worker", target, json.dumps(list(args))], []
    else:
        script, argv = [str(target)], [str(a) for a in args]
    # --standalone: a c10d rendezvous on localhost port 0, i.e. a free port picked when bound.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *script, *argv]
    # Its own session: on a timeout the whole job (torchrun and every rank) is killed, not only
    # torchrun, so no orphaned rank keeps a core of the shared machine.
    with subprocess.Popen(cmd, env=torchrun_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, preexec_fn=_timing_priority if timing else None) as popen:
        try:
            out, err = popen.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            out, err = popen.communicate()
            timed_out = True
    proc = subprocess.CompletedProcess(cmd, -signal.SIGKILL if timed_out else popen.returncode, out, err)
    if check and (timed_out or proc.returncode != 0):
        why = f"ran past {timeout} s" if timed_out else f"exited {proc.returncode}"
        raise JobFailed(f"{target} x {nproc} {why}\n{_rank_errors(err)}" + _tail(out, LOG_TAIL[0]) + _tail(err, LOG_TAIL[1]))
    return proc


def _set_autogroup_nice(nice: int) -> bool:
    """Linux schedules a session's processes as one group (autogroup) against other sessions, so a
    process's own nice value orders it only within its session: another job in another session
    gets half the CPU whatever the nice values. The group's nice is set here (on a process that
    just started a session of its own); False where the kernel has no autogroups or refuses."""
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
        return True
    except OSError:
        return False


def _timing_priority() -> None:
    """In the job's first process, before torchrun starts (its ranks inherit it; the job is a
    session of its own): nice -20 for the session's autogroup and for the process where permitted
    (root, CAP_SYS_NICE), else as low a nice value as allowed. A group or process at nice -20
    weighs about 87 times a nice-0 one in Linux's fair scheduler, so another job's processes get a
    core only while the rank waits; the job itself is 2 ranks on 2 cores, so no rank waits for one."""
    _set_autogroup_nice(-20)
    for nice in (-20, -10, -5, 0):
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
            return
        except OSError:
            continue


def _idle_priority() -> None:
    """A spinner's priority: a session whose autogroup is at nice 19 (so that the group weighs
    1/68 of another session's), and SCHED_IDLE where the OS has it (Linux), else nice 19."""
    _set_autogroup_nice(19)
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


@contextlib.contextmanager
def cores_kept_awake(limit_s: float = 600.0) -> Iterator[None]:
    """One spinning process per core, under the SCHED_IDLE policy, while the block runs.

    On a virtual machine an idle vCPU halts, and waking it for a rank whose message arrived costs
    a round trip through the hypervisor: hundreds of microseconds, at random, on a collective
    that takes a few hundred. The spinners keep every vCPU running, in a session of their own at
    autogroup nice 19 and under SCHED_IDLE: a spinner beside the ranks' session at equal group
    weight (a nice value alone orders processes only within their session) took half the CPU and
    held a core until its slice ended, bursts of 3-4 ms on gloo all_reduce calls of 0.5 ms. Each
    spinner also ends by itself after ``limit_s``."""
    code = f"import time\nend = time.monotonic() + {limit_s}\nwhile time.monotonic() < end: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", code], start_new_session=True, preexec_fn=_idle_priority)
                for _ in range(len(os.sched_getaffinity(0)))]
    try:
        yield
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


def _worker_main(target: str, args_json: str) -> None:
    """One rank: import the test module (tests/ is on sys.path: this script's folder), call the
    function, then end the process group it made, together with the other ranks."""
    module, _, name = target.partition(":")
    getattr(importlib.import_module(module), name)(*json.loads(args_json))
    import torch.distributed as torch_dist

    if torch_dist.is_initialized():
        torch_dist.barrier()
        torch_dist.destroy_process_group()


# --------------------------------------------------------------------------- shared settings

# The loss-equality settings (tests/test_trainer_layouts.py, test_context_parallel.py,
# test_expert_parallel.py, test_checkpoint.py): fp32 on CPU, the pydoc corpus, a fixed seed.
LOSS_SETTINGS = dict(seq_len=32, micro_batch_size=2, global_batch_size=8, steps=10, warmup_steps=2, lr=3e-3,
                     seed=1)


def make_config(plan_text: str = "", world: int = 1, model: Any = "tiny", settings: dict | None = None,
                **train):
    """A RunConfig on the ``local-cpu`` cluster (2 ranks a node) for ``world`` ranks: ``model`` (a
    preset name or a ModelSpec), the plan ``plan_text`` (dp_shard=1 unless named; "" for one
    process) and fp32 TrainSettings of ``settings`` (LOSS_SETTINGS by default) updated by
    ``train``."""
    from workbench import Cluster, ModelSpec, ParallelPlan, RunConfig, TrainSettings

    fields = dict(LOSS_SETTINGS if settings is None else settings)
    fields.update(train)
    cluster = Cluster.preset("local-cpu", nodes=max(1, world // 2), gpus_per_node=min(world, 2))
    plan = ParallelPlan.parse(plan_text, dp_shard=1) if plan_text else ParallelPlan(dp_shard=1)
    spec = ModelSpec.preset(model) if isinstance(model, str) else model
    return RunConfig(spec, cluster, plan, TrainSettings(**fields).with_precision("fp32"))


def max_rel_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """max |a_i - b_i| / |b_i| over two loss curves of the same length."""
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "worker":
    _worker_main(sys.argv[2], sys.argv[3])


# --------------------------------------------------------------------------- leftovers
JOB_PROGRAMS = ("torch.distributed.run", "workbench.launch.worker")  # torchrun and a rank


def live_processes(*marks: str, programs: Sequence[str] | None = JOB_PROGRAMS) -> list[Any]:
    """Live (not zombie) processes, other than this one, whose command line names one of
    ``marks`` (a run directory, a run id) and, unless ``programs`` is None, one of ``programs``:
    what a stopped or failed run must not leave behind."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE or not any(m in cmd for m in marks):
            continue
        if programs is None or any(prog in cmd for prog in programs):
            out.append(p)
    return out

