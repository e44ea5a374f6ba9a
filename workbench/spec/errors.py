"""Configuration errors that name the field, the value and the rule.

Every invalid configuration raises :class:`ConfigError` (a ``ValueError``), whose message reads
like ``"tp=3 does not divide n_heads=32"``: the CLI prints that one line and exits with code 2.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

MAX_MESSAGE_CHARS = 1500  # a hostile value must not turn the one line into a screenful


def one_line(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` as one printable line: control characters escaped, shortened past ``limit``."""
    flat = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


class ConfigError(ValueError):
    """An invalid configuration value; ``field`` names what to change. The message is always one
    printable line (a value holding newlines or escape codes is shown escaped)."""

    def __init__(self, message: str, *, field: str | None = None, value: Any = None):
        super().__init__(one_line(message))
        self.field = field
        self.value = value


def require(condition: bool, message: str, *, field: str | None = None, value: Any = None) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message, field=field, value=value)


def check_choice(field: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = tuple(allowed)
    # True == 1 and 1.0 == 1 in Python: a choice must also be of the allowed values' type
    if not any(type(value) is type(a) and value == a for a in allowed):
        listed = ", ".join(repr(a) for a in allowed)
        raise ConfigError(f"{field}={value!r} is not one of {listed}", field=field, value=value)


def check_positive(field: str, value: Any, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{field}={value!r} must be a number", field=field, value=value)
    try:
        finite = math.isfinite(value)
    except OverflowError:
        finite = False
    require(finite, f"{field}={value!r} must be finite", field=field, value=value)
    if allow_zero:
        require(value >= 0, f"{field}={value} must be >= 0", field=field, value=value)
    else:
        require(value > 0, f"{field}={value} must be > 0", field=field, value=value)


def check_int(field: str, value: Any, *, minimum: int = 1, maximum: int = (1 << 63) - 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{field}={value!r} must be an integer", field=field, value=value)
    require(value >= minimum, f"{field}={value} must be >= {minimum}", field=field, value=value)
    require(value <= maximum, f"{field}={value} must be <= {maximum}", field=field, value=value)


def check_fraction(field: str, value: Any, *, closed: bool = True) -> None:
    """``value`` in [0, 1] (``closed``) or [0, 1)."""
    check_positive(field, value, allow_zero=True)
    ok = value <= 1 if closed else value < 1
    require(ok, f"{field}={value} must be in [0, 1{']' if closed else ')'}", field=field, value=value)


def check_instance(field: str, value: Any, kind: type | tuple[type, ...]) -> None:
    """``value`` is a ``kind`` (the public entry points' arguments: a RunConfig, a ModelSpec, ...)."""
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise ConfigError(f"{field}={shown} must be a {names}", field=field, value=value)
