"""Reading run directories as they grow: the incremental event tailer and the run listing.

:class:`EventTail` reads only the bytes appended to a run's ``events/rank-*.jsonl`` since its
last call (a torn last line waits for its newline), so a viewer that refreshes twice a second
pays for what is new, not for the whole history. :func:`list_runs` names the run directories
under a runs root. Both only read the run-directory contract (:mod:`workbench.rundir.record`);
shaping the events for a view is the UI's business. No torch, no UI here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from workbench.rundir.events import (ReadReport, complete_lines, event_order, open_regular, os_reason, parse_line,
                                     rank_files)


class EventTail:
    """New events of a run directory, incrementally: per rank file, the byte offset read so far.

    ``read()`` returns the complete lines appended since the previous call (a torn last line
    waits for its newline), ordered by time. Reading is proportional to what was appended, so a
    run of tens of thousands of events costs nothing per refresh once read. Lines go through the
    one validating reader (:func:`workbench.rundir.events.parse_line`): a line that holds no valid
    event is skipped and counted in :attr:`report`, and a line over ``MAX_LINE_BYTES`` is read past
    without being held."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self._offsets: dict[Path, int] = {}
        self.count = 0
        self.report = ReadReport()

    @property
    def skipped(self) -> int:
        """Lines skipped so far: they held no valid event."""
        return self.report.n_skipped

    def read(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for rank, path in rank_files(self.run_dir, self.report).items():
            self._offsets[path] = self._read_file(rank, path, out)
        out.sort(key=event_order)
        self.count += len(out)
        return out

    def _read_file(self, rank: int, path: Path, out: list[dict[str, Any]]) -> int:
        """Append the valid events of ``path`` past its offset to ``out``; return the new offset
        (the end of its last complete line)."""
        offset = self._offsets.get(path, 0)
        name = f"events/{path.name}"
        try:
            with open_regular(path) as f:
                if os.fstat(f.fileno()).st_size <= offset:
                    return offset
                f.seek(offset)
                for line, end in complete_lines(f):
                    event, why = parse_line(line, rank)
                    if event is None:
                        self.report.skip(name, why)
                    else:
                        out.append(event)
                    offset = end
        except OSError as e:  # gone or replaced by something else: what was read stands
            self.report.unreadable[name] = f"{os_reason(e)}, ignored"
        return offset


def list_runs(runs_root: str | os.PathLike) -> list[str]:
    """Run directories (holding a config.json and an events/ folder) under ``runs_root``, newest
    first, as names."""
    root = Path(runs_root)
    try:
        entries = list(root.iterdir())
    except OSError:  # no such folder, or not one
        return []
    found = []
    for p in entries:
        try:
            if (p / "config.json").is_file() and (p / "events").is_dir():
                found.append((p.stat().st_mtime, p.name))
        except OSError:  # removed while listed
            continue
    return [name for _, name in sorted(found, reverse=True)]
