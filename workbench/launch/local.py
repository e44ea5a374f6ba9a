"""Start a run on this machine: a run directory, then ``torchrun`` with one process per rank.

``workbench train`` calls :func:`config_from_cli` and :func:`train_local` (or :func:`resume_local`).
Everything that can be checked before a process starts is checked first, and before the run
directory is made (``preflight.py``): a bad config or option raises
:class:`~workbench.spec.errors.ConfigError`.

While the job runs, SIGINT and SIGTERM to this process stop it: SIGTERM to torchrun (in a session
of its own), which forwards it to the ranks, and SIGKILL to everything left after
:data:`STOP_TIMEOUT_S`. The final line and the exit status come from the run directory
(``outcome.py``): what it says is what this process reports.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from workbench.spec.config import RunConfig, build_run_config
from workbench.rundir.events import next_seq, read_events
from workbench.rundir.record import create_run_dir
from workbench.launch.agent import descendants
from workbench.launch.outcome import Verdict, judge, judge_acceptance
from workbench.launch.preflight import (check_launch, check_resume, check_run_id_free, load_run_config,
                                        record_resume, resumed_config)
from workbench.launch.worker import TRAINER

POLL_S = 0.2


def config_from_cli(model: str, plan: str, steps: int, hf_config: str | None = None, **train_overrides: Any) -> RunConfig:
    """A RunConfig for the bundled trainer on this machine's CPUs: the defaults of a CPU run, built
    by :func:`~workbench.spec.config.build_run_config`. ``model`` preset (or ``hf_config``, a Hugging
    Face config.json), ``plan`` text
    (``"dp_shard=2,tp=2"``; an unset dp_shard is 1), ``steps``; one "node" per 2 ranks; the world
    size is the product of the plan's degrees.
    Defaults: seq_len 64, micro_batch_size 2, fp32; ``train_overrides`` replace any of them
    (``precision="bf16"`` picks a precision preset)."""
    precision = train_overrides.pop("precision", "fp32")
    fields = dict(seq_len=64, micro_batch_size=2, steps=steps, warmup_steps=min(10, max(steps // 10, 1)))
    fields.update(train_overrides)
    return build_run_config(model, hf_config=hf_config, cluster="local-cpu", plan=plan or "", plan_defaults={"dp_shard": 1},
                            size_from_plan=True, precision=precision, **fields)


def format_step(event: dict[str, Any], total: int) -> str:
    """One progress line: ``step   12/50  loss 4.1234  gnorm 0.812  lr 3.0e-04  2,345 tok/s  0.11 s``."""
    return (f"step {event['step'] + 1:>5}/{total}  loss {event['loss']:.4f}  gnorm {event['grad_norm']:.3f}  "
            f"lr {event['lr']:.1e}  {event['tokens_per_s']:,.0f} tok/s  {event['step_time_s']:.2f} s")


def torchrun_command(config_path: Path, nproc: int, resume: bool = False, max_restarts: int = 0) -> list[str]:
    """``torchrun --standalone --nproc_per_node=N [--max-restarts=R] -m workbench.launch.worker
    workbench.trainer /abs/config.json [--resume]``.

    Every rank runs under :mod:`workbench.launch.worker`, which SIGKILLs it when its torchrun goes
    (even a SIGKILLed one). The config path is absolute: it names the job's processes
    (:func:`~workbench.launch.preflight.job_pids` finds a live run by it). With ``max_restarts`` > 0
    torchrun restarts every rank when one dies; the restarted trainer resumes from the latest good
    checkpoint by itself (it sees ``TORCHELASTIC_RESTART_COUNT``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    cmd += ["-m", "workbench.launch.worker", TRAINER, str(Path(config_path).resolve())]
    return cmd + (["--resume"] if resume else [])


def format_event(event: dict[str, Any], total: int) -> str | None:
    """The progress line of an event, or None for events not shown (other ranks' steps, phases of
    a checkpoint before it is committed...)."""
    kind, rank = event["kind"], event.get("rank")
    if kind == "step" and rank == 0:
        return format_step(event, total)
    if kind == "error":
        return f"error: {event['error']}"
    if kind == "checkpoint" and event.get("phase") == "committed":
        return f"checkpoint {Path(event['path']).name} committed ({event['bytes'] / 1e6:.1f} MB, {event['duration_s']:.2f} s)"
    if kind == "checkpoint" and event.get("phase") == "failed":
        after = "the run ends with an error" if event.get("final") else "training goes on"
        return f"checkpoint {Path(event['path']).name} not written on rank {rank}: {event.get('reason', '')}; {after}"
    if kind == "checkpoint_rejected":
        return f"checkpoint {Path(event['path']).name} rejected: {event['reason']}"
    if kind == "fault":
        return f"fault: rank {rank} {event['cause']} after step {event['last_step']} (attempt {event['attempt']}): {event['detail']}"
    if kind == "restart" and rank == 0:
        return f"restart: attempt {event['attempt']}" + (f" of at most {event['max_restarts']}" if event.get("max_restarts") else "")
    if kind == "resume" and rank == 0:
        where = Path(event["path"]).name if event.get("path") else "the start (no good checkpoint)"
        return f"resume at step {event['step']} from {where}" + (" (resharded)" if event.get("resharded") else "")
    return None


def train_local(config: RunConfig, run_root: str | os.PathLike = "runs", run_id: str | None = None,
                stream: Callable[[str], None] = print, env: dict[str, str] | None = None,
                max_restarts: int = 0, baseline_of: dict[str, Any] | None = None,
                hf_config: str | os.PathLike | None = None) -> int:
    """Create the run directory, run torchrun with one process per rank, stream one line per
    step (from rank 0's events), every error, checkpoint commit, fault, restart and resume; return
    the job's exit status (:mod:`~workbench.launch.outcome`: 0 done, 1 failed, 3 stopped by a guard,
    130/143 interrupted by SIGINT/SIGTERM). ``max_restarts``: torchrun restarts the job that many
    times at most. ``baseline_of``: this run is the naive baseline of that plan (``{"plan": ...,
    "run_id": ...}``, in the manifest); ``hf_config``: the file the model was imported from (the
    lineage hashes it). Bad input raises ConfigError before anything is made or started."""
    check_launch(config, max_restarts)
    check_run_id_free(run_root, run_id)  # names a live run's pid; create_run_dir refuses any taken id
    run_dir = create_run_dir(config, run_root, run_id, hf_config=hf_config,
                             manifest_extra={"baseline_of": baseline_of} if baseline_of else None)
    stream(f"run {run_dir}  ({config.world_size} ranks, {config.plan.describe()})")
    return _run_torchrun(run_dir, config, stream, env, resume=False, max_restarts=max_restarts).exit_code


def resume_local(run_dir: str | os.PathLike, stream: Callable[[str], None] = print,
                 env: dict[str, str] | None = None, max_restarts: int = 0, **changes: Any) -> int:
    """``workbench train --resume runs/<id>``: run the run directory's own config.json again, from
    its latest good checkpoint (from step 0 when there is none), appending to the same events.

    ``changes``: the few TrainSettings fields a resume may change (``steps``, ``checkpoint_every``,
    ``checkpoint_keep``, ``checkpoint_async``). A larger ``steps`` extends the run; the learning-rate
    schedule is a function of the config's total steps, so the cosine decay is stretched over the
    new total (from the resume step on, the rate is the longer schedule's). config.json is
    rewritten with the changes, the launched values kept in manifest.json's ``resumes``. Every
    check (a run directory, not running, the same model as its checkpoints, the options) comes
    before that rewrite and before any process starts."""
    before = load_run_config(run_dir, field="resume")
    run_dir = Path(run_dir)
    config = resumed_config(before, changes)
    check_launch(config, max_restarts)
    check_resume(run_dir, before, config)
    changed = record_resume(run_dir, before, config)
    stream(f"resume {run_dir}  ({config.world_size} ranks, {config.plan.describe()})"
           + "".join(f", {f} {a} -> {b}" for f, (a, b) in changed.items()))
    return _run_torchrun(run_dir, config, stream, env, resume=True, max_restarts=max_restarts).exit_code


# How long the ranks get to end cleanly once asked to stop (SIGTERM to torchrun, which forwards it
# to them; each writes run_end "interrupted"), before the job's processes are SIGKILLed.
STOP_TIMEOUT_S = 15.0


class _StopSignals:
    """SIGINT and SIGTERM while a job runs: the first asks the job to stop, a second forces it.

    A handler, not KeyboardInterrupt: a signal must not land in the middle of reading events or
    starting torchrun, and SIGTERM (a scheduler's, ``kill``'s) must stop the job as Ctrl-C does,
    instead of killing only this process and leaving torchrun and its ranks training unwatched."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self.wake = threading.Event()
        self._old: dict[int, Any] = {}

    def __call__(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum
        self.count += 1
        self.wake.set()

    def __enter__(self) -> "_StopSignals":
        if threading.current_thread() is threading.main_thread():  # Python sets handlers there only
            self._old = {s: signal.signal(s, self) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)


class _Job:
    """torchrun in a session of its own and what it started. torchrun starts every rank in a
    session of its own too, so killing torchrun's process group does not reach them: the ranks
    seen below torchrun are remembered (with their start times, against reused pids) and killed
    by their own groups when they outlive it."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.known: dict[int, tuple[int, int]] = {}  # pid -> (pgid, start time)

    def refresh(self) -> None:
        if self.proc.poll() is None:
            self.known.update(descendants(self.proc.pid))
        self.known = {pid: v for pid, v in self.known.items() if _started_at(pid) == v[1]}

    def alive(self) -> bool:
        return self.proc.poll() is None or any(_started_at(pid) == st for pid, (_, st) in self.known.items())

    def stop(self, timeout_s: float, forced: Callable[[], bool]) -> None:
        """SIGTERM to torchrun (it forwards it to the ranks), SIGKILL to everything left after
        ``timeout_s`` or as soon as ``forced()``."""
        self.refresh()
        _signal_group(self.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < deadline and not forced():
            time.sleep(0.05)
            self.refresh()
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.kill_leftovers()

    def kill_leftovers(self) -> None:
        """SIGKILL every process seen below torchrun that is still there (the watchdog: the job
        is over once torchrun is)."""
        for pid, (pgid, start) in list(self.known.items()):
            if _started_at(pid) == start:
                _signal_group(pgid, signal.SIGKILL)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


def _started_at(pid: int) -> int | None:
    """Start time (clock ticks) of a live, non-zombie ``pid``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = data[data.rfind(")") + 2:].split()
    return None if fields[0] == "Z" else int(fields[19])


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _run_torchrun(run_dir: Path, config: RunConfig, stream: Callable[[str], None], env: dict[str, str] | None,
                  resume: bool, max_restarts: int) -> Verdict:
    """Run the job to its end (or until SIGINT/SIGTERM stops it), stream its events, then print
    and return the verdict the run directory gives (:func:`~workbench.launch.outcome.judge`)."""
    child_env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **(env or {}))
    if max_restarts:
        # torchrun shares its rendezvous TCPStore with the workers and keeps it across restarts,
        # without a per-attempt prefix: a restarted rank can read a dead peer's gloo/NCCL address
        # left by the previous attempt and fail to connect (pytorch/pytorch#135712). A store per
        # attempt (hosted by worker rank 0) avoids the race.
        child_env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    start = next_seq(read_events(run_dir))  # a resumed run is judged (and streamed) by what it adds
    since = dict(start)
    total = config.train.steps_to_run

    def drain() -> None:
        for e in read_events(run_dir, since):
            since[e["rank"]] = e["seq"] + 1
            line = format_event(e, total)
            if line is not None:
                stream(line)

    with open(run_dir / "torchrun.log", "a" if resume else "w") as log, _StopSignals() as stop:
        # A session of its own: the terminal's Ctrl-C reaches this process only, which stops the
        # job in order, and the whole group can be killed.
        proc = subprocess.Popen(torchrun_command(run_dir / "config.json", config.world_size, resume, max_restarts),
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env,
                                start_new_session=True)
        job = _Job(proc)
        try:
            last_scan = 0.0
            while proc.poll() is None and stop.signum is None:
                drain()
                if time.monotonic() - last_scan > 0.5:
                    job.refresh()
                    last_scan = time.monotonic()
                stop.wake.wait(POLL_S)
        except KeyboardInterrupt:  # raised by a caller's own handler (off the main thread none of ours is set)
            stop(signal.SIGINT, None)
        if stop.signum is not None and proc.poll() is None:
            stream(f"{signal.Signals(stop.signum).name}: stopping the job (SIGTERM to torchrun and its ranks, "
                   f"SIGKILL after {STOP_TIMEOUT_S:g} s or at a second signal)")
            job.stop(STOP_TIMEOUT_S, forced=lambda: stop.count > 1)
        else:
            job.refresh()
            job.kill_leftovers()
        drain()  # still under the handlers: a late Ctrl-C must not cut the verdict short
        verdict = judge(read_events(run_dir, start), config.world_size, proc.returncode, run_dir, stop.signum)
        if verdict.show_log:
            for line in (run_dir / "torchrun.log").read_text(errors="replace").strip().splitlines()[-5:]:
                stream(f"  {line}")
        stream(verdict.line)
        code, report = judge_acceptance(verdict.exit_code, run_dir, config.train.accept)
        for line in report:
            stream(line)
        if code != verdict.exit_code:
            verdict = dataclasses.replace(verdict, outcome="failed acceptance", exit_code=code, line=report[-1])
    return verdict
