"""A stop reaches the nodes one after another: the handle's verdict on a stopped run.

Node 0's stop call ends its ranks ("interrupted"); node 1's ranks lose their connection to them
and its torchrun exits 1 before node 1's own stop call arrives, so that agent answers "failed".
That is the stop's echo (``workbench.rundir.status``), and the run is "stopped"; a node whose
ranks raised something else, or which failed before the stop began, still fails the run. The
agents here answer the driver's stop call with a fixed status: the race itself cannot be timed
on purpose with real kernels (tests/test_launch_local.py runs the real stop).
"""

from __future__ import annotations

import time

from workbench.launch.handle import RunHandle, _Node
from workbench.launch.local import config_from_cli


class AnsweringAgent:
    """A kernel channel whose agent answers every call with ``state`` (what a real agent's
    ``stop`` returns when torchrun has already exited)."""

    def __init__(self, state: str, why: str):
        self.state, self.why = state, why

    def call(self, code: str, timeout_s: float = 60.0) -> dict:
        return {"type": "status", "state": self.state, "why": self.why, "attempt": 0, "t": time.time(),
                "cursors": {}, "ranks": []}

    def alive(self) -> bool:
        return True

    def close(self) -> None:
        pass


def stopped_run(tmp_path, node1_error: str, node1_failed_before_stop: bool = False) -> RunHandle:
    config = config_from_cli("tiny", "dp_shard=4", 10, seq_len=32, micro_batch_size=1)
    nodes = [_Node(0, "127.0.0.1", str(tmp_path), AnsweringAgent("stopped", "stopped by the user"), state="running"),
             _Node(1, "127.0.0.2", str(tmp_path), AnsweringAgent("failed", "torchrun exited with status 1"),
                   state="running")]
    run = RunHandle(tmp_path, config, backend=None, nodes=nodes)
    t = time.time()
    if node1_failed_before_stop:
        nodes[1].state, nodes[1].why, nodes[1].failed_at = "failed", "torchrun exited with status 1", t - 30
    events = []
    for rank in range(4):
        events += [{"kind": "run_start", "rank": rank, "seq": 0, "t": t - 10, "step": 0},
                   {"kind": "step", "rank": rank, "seq": 1, "t": t - 5, "step": 0, "loss": 5.0}]
    for rank in (0, 1):  # node 0: SIGTERM, a clean end
        events.append({"kind": "run_end", "rank": rank, "seq": 2, "t": t + 0.1, "status": "interrupted", "step": 1})
    for rank in (2, 3):  # node 1: the connection to rank 0 or 1 closed
        events += [{"kind": "error", "rank": rank, "seq": 2, "t": t + 0.2, "error": node1_error},
                   {"kind": "run_end", "rank": rank, "seq": 3, "t": t + 0.3, "status": "error", "step": 1}]
    for e in events:
        run._history.append(e)
        run._update_rank(e["rank"], e)
    return run


def test_a_node_that_lost_its_peers_to_the_stop_is_stopped(tmp_path):
    run = stopped_run(tmp_path, "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection reset by peer")
    status = run.stop(timeout_s=1)
    assert status.state == "stopped", status
    assert [n.state for n in status.nodes] == ["stopped", "stopped"]
    assert [r.state for r in status.ranks] == ["stopped"] * 4
    assert "lost the connection to a stopped rank" in status.nodes[1].why


def test_a_real_error_during_a_stop_still_fails_the_run(tmp_path):
    run = stopped_run(tmp_path, "ValueError: the loss went to the moon")
    status = run.stop(timeout_s=1)
    assert status.state == "failed" and status.nodes[1].state == "failed"
    assert status.ranks[2].state == "failed" and "moon" in status.ranks[2].why


def test_a_node_that_failed_before_the_stop_still_fails_the_run(tmp_path):
    run = stopped_run(tmp_path, "RuntimeError: Connection reset by peer", node1_failed_before_stop=True)
    status = run.stop(timeout_s=1)
    assert status.state == "failed" and status.nodes[1].state == "failed"
