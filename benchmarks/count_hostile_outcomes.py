"""Count how the rows of tests/test_hostile_inputs.py's tables end: clean (one line, exit 2 /
ConfigError), a traceback, silently accepted, several lines, or a hang (60 s alarm).

    python benchmarks/count_hostile_outcomes.py tests/test_hostile_inputs.py

It runs against the workbench importable from the current directory, so it also counts an older
checkout: run it from a clone of an older commit, giving the table's path in this one (names the
table needs and the old code lacks are stubbed). It skips the ``serve`` rows (older code execs the
app for a port click accepts) and, on code without the size-capped reader, does not read
/dev/zero (counted as a hang: that reader grew without bound, 18 GB in 50 s).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import tempfile
import types
from collections import Counter
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, os.getcwd())
try:
    import workbench.spec.files  # noqa: F401  (present since the size-capped reader)
    BOUNDED_READS = True
except ImportError:
    BOUNDED_READS = False
    stub = types.ModuleType("workbench.spec.files")
    stub.CONFIG_MAX_BYTES = 4 << 20  # type: ignore[attr-defined]
    sys.modules["workbench.spec.files"] = stub
import workbench.rundir.record as record  # noqa: E402

if not hasattr(record, "check_run_id"):
    record.check_run_id = lambda x: x  # type: ignore[attr-defined]

from click.testing import CliRunner  # noqa: E402

from workbench.cli import main as cli_main  # noqa: E402
from workbench.spec.errors import ConfigError  # noqa: E402

ALARM_S = 60


def _alarm(*_: Any) -> None:
    raise TimeoutError


def run_cli(args: list[str]) -> str:
    signal.alarm(ALARM_S)
    try:
        result = CliRunner().invoke(cli_main, args)
    except TimeoutError:
        return "hang"
    finally:
        signal.alarm(0)
    if isinstance(result.exception, TimeoutError):
        return "hang"
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return "traceback"
    if result.exit_code == 0:
        return "accepted"
    err = result.stderr
    if result.exit_code == 2 and err.startswith("error") and err.count("\n") <= 1 and "Traceback" not in err:
        return "clean"
    return "traceback" if "Traceback" in result.output else "not one line"


def run_api(call: Callable[[], Any]) -> str:
    signal.alarm(ALARM_S)
    try:
        call()
        return "accepted"
    except ConfigError as err:
        return "clean" if "\n" not in str(err) else "not one line"
    except TimeoutError:
        return "hang"
    except Exception:
        return "traceback"
    finally:
        signal.alarm(0)


def main(table_path: str) -> None:
    spec = importlib.util.spec_from_file_location("hostile_table", table_path)
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)  # type: ignore[union-attr]
    signal.signal(signal.SIGALRM, _alarm)
    counts: Counter[str] = Counter()
    examples: dict[str, list[str]] = {}

    def count(outcome: str, label: str) -> None:
        counts[outcome] += 1
        examples.setdefault(outcome, []).append(label)

    folder = Path(tempfile.mkdtemp())
    for i, (option, kind) in enumerate(table.FILE_CASES):
        if kind == "dev-zero" and not BOUNDED_READS:
            count("hang", f"{option}:{kind}")
            continue
        sub = folder / str(i)
        sub.mkdir()
        count(run_cli(table.FILE_OPTIONS[option](table.HOSTILE_FILES[kind](sub, kind))), f"{option}:{kind}")
    for args in table.OPTION_CASES:
        if args[0] != "serve":
            count(run_cli(args), " ".join(args))
    for name, call in table.API_CASES.items():
        count(run_api(call), name)
    print(f"{sum(counts.values())} rows: " + ", ".join(f"{k} {counts[k]}" for k in
                                                      ("clean", "traceback", "accepted", "not one line", "hang")))
    for outcome in ("traceback", "accepted", "not one line", "hang"):
        if examples.get(outcome):
            print(f"{outcome}: {', '.join(examples[outcome][:12])}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/test_hostile_inputs.py")
