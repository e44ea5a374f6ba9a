"""Reading files a user names: regular files only, up to a size cap, one clear line otherwise.

A path on the command line or in the app can be ``/dev/zero``, a FIFO that never ends, a
directory, a 10 GB file or binary junk. :func:`read_user_text` looks before it reads (``stat``
does not block on a FIFO or a device) and reads at most ``max_bytes + 1`` bytes, so a hostile
path costs a system call, not memory. :func:`read_user_json` adds the JSON rules: valid, finite
numbers (``NaN`` and ``Infinity`` are not JSON), and a bounded nesting depth.
"""

from __future__ import annotations

import json
import os
import stat
from typing import IO, Any

from workbench.spec.errors import ConfigError

KiB, MiB = 1 << 10, 1 << 20
CONFIG_MAX_BYTES = 4 * MiB  # a config.json, cluster or profile JSON is kilobytes; a calibrated one tens of KB
TABLE_MAX_BYTES = 64 * MiB  # measured-run tables and benchmark results


def _fail(field: str, path: Any, rule: str) -> ConfigError:
    return ConfigError(f"{field}={str(path)!r} {rule}", field=field, value=str(path))


class NotRegularFile(OSError):
    """``path`` exists but is a directory, a FIFO, a device or a socket."""


def open_regular(path: str | os.PathLike) -> IO[bytes]:
    """``path`` opened for binary reading if it is a regular file; OSError otherwise (a FIFO would
    block its reader, a device never end, a directory is no file). Opened without blocking, then
    checked on the open descriptor, so a swap after a check cannot slip past it."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else \
                "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file"
            raise NotRegularFile(f"not a regular file ({what})")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_user_bytes(path: str | os.PathLike, field: str, max_bytes: int = CONFIG_MAX_BYTES) -> bytes:
    """The bytes of the regular file at ``path``; :class:`ConfigError` naming ``field`` when it
    does not exist, is not a regular file, cannot be read or is larger than ``max_bytes``."""
    try:
        f = open_regular(path)
    except FileNotFoundError:
        raise _fail(field, path, "does not exist") from None
    except IsADirectoryError:
        raise _fail(field, path, "is a directory, not a file") from None
    except NotRegularFile as err:
        raise _fail(field, path, f"is {err}".replace("is not a regular file (a directory)",
                                                      "is a directory, not a file")) from None
    except (OSError, ValueError) as err:  # ValueError: a NUL in the path
        raise _fail(field, path, f"cannot be read ({getattr(err, 'strerror', None) or err})") from None
    try:
        with f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:  # refused without reading it
                raise _fail(field, path, f"is {size:,} bytes; at most {max_bytes:,} are read")
            data = f.read(max_bytes + 1)
    except OSError as err:
        raise _fail(field, path, f"cannot be read ({err.strerror or err})") from None
    if len(data) > max_bytes:  # it grew after the check
        raise _fail(field, path, f"is larger than {max_bytes:,} bytes")
    return data


def read_user_text(path: str | os.PathLike, field: str, max_bytes: int = CONFIG_MAX_BYTES) -> str:
    """The UTF-8 text of the regular file at ``path`` (see :func:`read_user_bytes`)."""
    data = read_user_bytes(path, field, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _fail(field, path, f"is not UTF-8 text (byte {err.start}: binary?)") from None


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):  # 1e999 parses to infinity
        raise ValueError(f"{text} is beyond the range of a number")
    return value


def parse_json(text: str, field: str, source: str | None = None) -> Any:
    """Parse JSON text; :class:`ConfigError` naming ``field`` (and ``source``, a file) when it is
    invalid, holds NaN/Infinity, or nests deeper than Python's recursion allows."""
    where = f"{field}={source!r}" if source is not None else field
    try:
        return json.loads(text, parse_constant=_no_constants, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})",
                          field=field) from None
    except ValueError as e:  # NaN / Infinity
        raise ConfigError(f"{where}: {e}", field=field) from None
    except RecursionError:
        raise ConfigError(f"{where} nests too deeply to be a configuration", field=field) from None


def read_user_json(path: str | os.PathLike, field: str, max_bytes: int = CONFIG_MAX_BYTES) -> Any:
    """The parsed JSON of the regular file at ``path`` (see :func:`read_user_text`, :func:`parse_json`)."""
    return parse_json(read_user_text(path, field, max_bytes), field, str(path))
