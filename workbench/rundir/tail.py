"""Reading run directories as they grow: the incremental event tailer and the run listing.

:class:`EventTail` reads only the bytes appended to a run's ``events/rank-*.jsonl`` since its
last call (a torn last line waits for its newline), so a viewer that refreshes twice a second
pays for what is new, not for the whole history. :func:`list_runs` names the run directories
under a runs root. Both only read the run-directory contract (:mod:`workbench.rundir.record`);
shaping the events for a view is the UI's business. No torch, no UI here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class EventTail:
    """New events of a run directory, incrementally: per rank file, the byte offset read so far.

    ``read()`` returns the complete lines appended since the previous call (a torn last line
    waits for its newline), ordered by time. Reading is proportional to what was appended, so a
    run of tens of thousands of events costs nothing per refresh once read."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self._offsets: dict[Path, int] = {}
        self.count = 0

    def read(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for path in sorted((self.run_dir / "events").glob("rank-*.jsonl")):
            offset = self._offsets.get(path, 0)
            try:
                if path.stat().st_size <= offset:
                    continue
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                continue
            end = chunk.rfind(b"\n") + 1  # only whole lines: the writer may be mid-line
            for line in chunk[:end].splitlines():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
            self._offsets[path] = offset + end
        out.sort(key=lambda e: (e.get("t", 0.0), e.get("rank", 0), e.get("seq", 0)))
        self.count += len(out)
        return out


def list_runs(runs_root: str | os.PathLike) -> list[str]:
    """Run directories (holding a config.json and an events/ folder) under ``runs_root``, newest
    first, as names."""
    root = Path(runs_root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if (p / "config.json").is_file() and (p / "events").is_dir()]
    return [p.name for p in sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)]
