"""Configuration errors that name the field, the value and the rule.

Every invalid configuration raises :class:`ConfigError` (a ``ValueError``), whose message reads
like ``"tp=3 does not divide n_heads=32"``: the CLI prints that one line and exits with code 2.
"""

from __future__ import annotations

from typing import Any, Iterable


class ConfigError(ValueError):
    """An invalid configuration value; ``field`` names what to change."""

    def __init__(self, message: str, *, field: str | None = None, value: Any = None):
        super().__init__(message)
        self.field = field
        self.value = value


def require(condition: bool, message: str, *, field: str | None = None, value: Any = None) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message, field=field, value=value)


def check_choice(field: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        listed = ", ".join(repr(a) for a in allowed)
        raise ConfigError(f"{field}={value!r} is not one of {listed}", field=field, value=value)


def check_positive(field: str, value: Any, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{field}={value!r} must be a number", field=field, value=value)
    if allow_zero:
        require(value >= 0, f"{field}={value} must be >= 0", field=field, value=value)
    else:
        require(value > 0, f"{field}={value} must be > 0", field=field, value=value)


def check_int(field: str, value: Any, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{field}={value!r} must be an integer", field=field, value=value)
    require(value >= minimum, f"{field}={value} must be >= {minimum}", field=field, value=value)
