"""The one validation boundary of the configuration dataclasses.

Every configuration class calls :func:`check_types` first thing in ``__post_init__``: each field
must hold a value of its annotated type, so that ``"no"`` is not False, ``True`` is not a ZeRO
stage, ``1.5`` is not a layer count and ``nan`` is not a learning rate. The range rules that
need arithmetic stay next to the field they constrain, in each class. :func:`from_mapping` is how
every ``from_dict`` reads JSON: an object, no unknown keys, every required key present.

The checks are compiled once per class from its type hints, so validating a configuration costs
microseconds (the advisor builds thousands of them).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Callable, Mapping

from workbench.spec.errors import ConfigError

INT64_MAX = (1 << 63) - 1  # what torch and NumPy can hold; larger "sizes" are typos or attacks

Check = Callable[[Any], bool]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -INT64_MAX <= v <= INT64_MAX


def _is_float(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)  # an int beyond float's range raises OverflowError
    except OverflowError:
        return False


_SCALARS: dict[Any, tuple[Check, str]] = {
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (_is_int, "an integer (64-bit)"),
    float: (_is_float, "a finite number"),
    str: (lambda v: isinstance(v, str), "a string"),
}


def _compile(hint: Any) -> tuple[Check, str]:
    """A predicate for values of ``hint`` and how to say what it wants."""
    if hint is Any:
        return (lambda v: True), "anything"
    if hint in _SCALARS:
        return _SCALARS[hint]
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        parts = [_compile(a) for a in args]
        return (lambda v: any(p(v) for p, _ in parts)), " or ".join(
            "null" if a is type(None) else what for a, (_, what) in zip(args, parts))
    if hint is type(None):
        return (lambda v: v is None), "null"
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            item, what = _compile(args[0])
            return (lambda v: isinstance(v, (tuple, list)) and all(item(x) for x in v)), f"a list of {what}"
        items = [_compile(a) for a in args]
        whats = ", ".join(w for _, w in items)
        return (lambda v: isinstance(v, (tuple, list)) and len(v) == len(items)
                and all(p(x) for (p, _), x in zip(items, v))), f"a list of {len(items)} ({whats})"
    if origin in (dict, Mapping, typing.Mapping) or hint in (dict, Mapping):
        return (lambda v: isinstance(v, Mapping)), "an object"
    if isinstance(hint, type):
        return (lambda v: isinstance(v, hint)), f"a {hint.__name__}"
    return (lambda v: True), str(hint)  # a hint this module does not know: the class checks it


def _always_valid(hint: Any) -> frozenset[type]:
    """Types whose every value is valid for ``hint`` (str, bool, None): checked by one set lookup.
    Numbers are not among them: an int must fit int64 and a float be finite."""
    if hint in (str, bool) or hint is type(None):
        return frozenset({hint})
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return frozenset().union(*(_always_valid(a) for a in typing.get_args(hint)))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return frozenset({hint})
    return frozenset()


_COMPILED: dict[type, list[tuple[str, frozenset[type], Check, str]]] = {}


def _checks(cls: type) -> list[tuple[str, frozenset[type], Check, str]]:
    checks = _COMPILED.get(cls)
    if checks is None:
        hints = typing.get_type_hints(cls)
        checks = [(f.name, _always_valid(hints[f.name]), *_compile(hints[f.name]))
                  for f in dataclasses.fields(cls) if f.init]
        _COMPILED[cls] = checks
    return checks


def check_types(obj: Any, prefix: str = "") -> None:
    """Raise :class:`ConfigError` naming the first field of dataclass ``obj`` whose value is not of
    its annotated type (``prefix`` qualifies the name: ``"gpu."``)."""
    for name, fast, ok, what in _checks(type(obj)):
        value = getattr(obj, name)
        if type(value) in fast or ok(value):
            continue
        raise ConfigError(f"{prefix}{name}={value!r} must be {what}", field=prefix + name, value=value)


def from_mapping(cls: type, data: Any, where: str, convert: Mapping[str, Callable[[Any], Any]] | None = None) -> Any:
    """``cls(**data)`` for a JSON object: unknown and missing keys are errors naming them, and
    ``convert[key]`` turns a nested object into its class first (None stays None)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a JSON object, not {type(data).__name__}", field=where)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise ConfigError(f"{where} has unknown fields {unknown}; known: {', '.join(known)}", field=where,
                          value=unknown)
    missing = [n for n, f in known.items() if n not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where} is missing {', '.join(missing)}", field=f"{where}.{missing[0]}")
    d = dict(data)
    for key, make in (convert or {}).items():
        if d.get(key) is not None:
            d[key] = make(d[key])
    return cls(**d)
