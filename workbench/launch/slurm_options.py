"""What a user may ask of Slurm for a run, checked where it enters (the API, the CLI, the app).

Every value ends up on ``salloc``'s command line (an argv, never a shell), so the rules are
Slurm's own and one more: nothing may be read as an option it is not.

* ``partition``, ``account``: Slurm names (letters, digits, ``. _ -``; not starting with ``-``),
  at most 64 characters; ``partition`` may list several, comma-separated, as ``-p a,b`` does.
* ``time_limit``: one of Slurm's formats ("minutes", "minutes:seconds", "hours:minutes:seconds",
  "days-hours", "days-hours:minutes", "days-hours:minutes:seconds"), or "infinite"/"unlimited".
* ``extra_sbatch``: further options of ``salloc``/``sbatch`` (they share them), one
  ``--option`` or ``--option=value`` per item; the ones the backend sets itself (the node count,
  the tasks, the command) are refused, since a second value would silently win or conflict.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

from workbench.spec.errors import ConfigError

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")
_LONG_OPTION = re.compile(r"--[A-Za-z][A-Za-z0-9-]*(?:=.*)?", re.S)
# salloc options the backend owns: the shape of the allocation and what runs in it.
OWNED = ("--nodes", "--ntasks", "--ntasks-per-node", "--no-shell", "--jobid", "--wrap", "--overcommit",
         "--array", "--het-group", "--chdir")
TIME_FORMATS = ("M", "M:S", "H:M:S", "D-H", "D-H:M", "D-H:M:S", "infinite")


def check_slurm_name(field: str, value: Any, several: bool = False) -> str | None:
    """``value`` if it is a Slurm partition/account name (or None), else ConfigError."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{field}={value!r} must be a string", field=field, value=value)
    parts = value.split(",") if several else [value]
    for part in parts:
        if not _NAME.fullmatch(part):
            raise ConfigError(f"{field}={value[:80]!r} is not a Slurm name: 1-64 of A-Z a-z 0-9 . _ -, not starting "
                              f"with '-' or '.'" + (" (several: comma-separated)" if several else ""),
                              field=field, value=value)
    return value


def time_limit_minutes(value: str) -> float:
    """Minutes of a checked Slurm time limit (``math.inf`` for "infinite")."""
    if value.lower() in ("infinite", "unlimited"):
        return float("inf")
    days, a, b, c = _TIME.fullmatch(value).groups()
    if days is not None:  # D-H[:M[:S]]
        return int(days) * 1440 + int(a) * 60 + int(b or 0) + int(c or 0) / 60
    if c is not None:  # H:M:S
        return int(a) * 60 + int(b) + int(c) / 60
    return int(a) + int(b or 0) / 60  # M or M:S


def check_time_limit(value: Any) -> str | None:
    """``value`` as Slurm reads a time limit (None: the partition's default), else ConfigError."""
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigError(f"time_limit={value!r} must be a Slurm time (e.g. '30', '1:30:00', '2-00:00:00')",
                          field="time_limit", value=value)
    text = str(value).strip()
    if text.lower() in ("infinite", "unlimited"):
        return text.lower()
    m = _TIME.fullmatch(text)
    if m is None:
        raise ConfigError(f"time_limit={value!r} is not a Slurm time: one of {', '.join(TIME_FORMATS)} "
                          "(e.g. '30' minutes, '1:30:00', '2-00:00:00')", field="time_limit", value=value)
    days, a, b, c = m.groups()
    if days is not None and c is not None and b is None:
        raise ConfigError(f"time_limit={value!r} is not a Slurm time", field="time_limit", value=value)
    # minutes and seconds of a clock reading stay below 60 (hours below 24 after a day count)
    clock = [x for x in (b, c) if x is not None] if (days is not None or c is not None) else ([b] if b else [])
    if any(int(x) >= 60 for x in clock) or (days is not None and int(a) >= 24):
        raise ConfigError(f"time_limit={value!r}: minutes and seconds must be below 60 (hours below 24 after "
                          "'days-')", field="time_limit", value=value)
    if time_limit_minutes(text) <= 0:
        raise ConfigError(f"time_limit={value!r} must be more than zero", field="time_limit", value=value)
    return text


def check_extra_sbatch(value: Any) -> tuple[str, ...]:
    """``extra_sbatch`` as a tuple of ``--option[=value]`` strings, else ConfigError."""
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise ConfigError(f"extra_sbatch={value!r} must be a list of --option or --option=value strings",
                          field="extra_sbatch", value=value)
    out = []
    for item in value:
        if not isinstance(item, str) or not _LONG_OPTION.fullmatch(item):
            raise ConfigError(f"extra_sbatch item {item!r} must be one --option or --option=value (long options "
                              "only: a short one's value would be a separate item)", field="extra_sbatch", value=item)
        if any(not c.isprintable() for c in item):
            raise ConfigError(f"extra_sbatch item {item[:60]!r} contains a control character",
                              field="extra_sbatch", value=item)
        name = item.split("=", 1)[0]
        if name in OWNED:
            raise ConfigError(f"extra_sbatch item {item!r}: {name} is set by the backend (the allocation is one task "
                              "per node, nodes = the plan's)", field="extra_sbatch", value=item)
        out.append(item)
    return tuple(out)


@dataclass(frozen=True)
class SlurmRequest:
    """A checked request for an allocation (see the module docstring)."""

    partition: str | None = None
    account: str | None = None
    time_limit: str | None = None
    extra_sbatch: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "partition", check_slurm_name("partition", self.partition, several=True))
        object.__setattr__(self, "account", check_slurm_name("account", self.account))
        object.__setattr__(self, "time_limit", check_time_limit(self.time_limit))
        object.__setattr__(self, "extra_sbatch", check_extra_sbatch(self.extra_sbatch))

    def salloc_options(self) -> list[str]:
        """The user's part of salloc's argv."""
        out = []
        if self.partition:
            out.append(f"--partition={self.partition}")
        if self.account:
            out.append(f"--account={self.account}")
        if self.time_limit:
            out.append(f"--time={self.time_limit}")
        return out + list(self.extra_sbatch)

    def to_dict(self) -> dict[str, Any]:
        return {"partition": self.partition, "account": self.account, "time_limit": self.time_limit,
                "extra_sbatch": list(self.extra_sbatch)}
