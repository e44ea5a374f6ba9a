"""The login of the served app: what ``--basic-auth`` means, checked before anything is served.

A value is a password, or a users file of ``{"user": "password"}``. Which one must never depend on
whether a file happens to exist: a users file that is missing would otherwise make its own path
the password. So a value that *looks like a path* (:func:`looks_like_path`) is a users file, and
must be one (:func:`read_users_file`); it is read once, at start, so a malformed file is refused
there with one line (exit status 2 from ``python -m widgets``), not with an error at every login.

No UI imports here: ``python -m widgets`` checks the value before it loads Panel (seconds).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Mapping, Sequence

from workbench.spec.errors import ConfigError
from workbench.spec.files import parse_json, read_user_bytes

MAX_USERS_FILE_BYTES = 1 << 20  # a users file is a few lines; anything bigger is the wrong file
USERS_FILE_RULE = ('a value that looks like a path (a path separator, .json, or an existing file) must name a '
                   'regular file of at most 1 MiB holding a JSON object {"user": "password"} of non-empty strings')


def looks_like_path(value: str) -> bool:
    """Whether a --basic-auth value is meant as a users file rather than a password."""
    seps = {os.sep, os.altsep} - {None}
    return any(s in value for s in seps) or value.lower().endswith(".json") or os.path.isfile(value)


def _users_error(source: str, problem: str) -> ConfigError:
    return ConfigError(f"basic_auth={source!r}: {problem}; {USERS_FILE_RULE}", field="basic_auth", value=source)


def check_users(users: Any, source: str) -> dict[str, str]:
    """``users`` as ``{user: password}``, or ConfigError (field ``basic_auth``) naming ``source``."""
    def bad(problem: str) -> ConfigError:
        return _users_error(source, problem)

    if not isinstance(users, Mapping):
        raise bad(f"holds a JSON {type(users).__name__}, not an object")
    if not users:
        raise bad("names no user")
    for user, password in users.items():
        if not isinstance(user, str) or not user:
            raise bad(f"user {user!r} is not a non-empty string")
        if not isinstance(password, str) or not password:
            raise bad(f"the password of user {user!r} is not a non-empty string")
    return dict(users)


def read_users_file(path: str) -> dict[str, str]:
    """The ``{user: password}`` of a users file, checked once at start (a file that is missing or
    malformed is refused here, not with an error at every login, and never taken as a password).
    Read as every file a user names is (:mod:`workbench.spec.files`: a regular file under the cap,
    never a FIFO or a device, valid JSON without NaN, not nested past the parser)."""
    try:
        raw = read_user_bytes(path, "basic_auth", MAX_USERS_FILE_BYTES)
        if not raw.strip():
            raise _users_error(path, "is empty")
        text = raw.decode("utf-8")
        users = parse_json(text, "basic_auth", path)
    except UnicodeDecodeError:
        raise _users_error(path, "is not UTF-8 text") from None
    except ConfigError as err:
        if USERS_FILE_RULE in str(err):
            raise
        raise ConfigError(f"{err}; {USERS_FILE_RULE}", field="basic_auth", value=path) from None
    return check_users(users, path)


def resolve_basic_auth(basic_auth: "str | Mapping[str, str] | None") -> "str | dict[str, str] | None":
    """What the server checks logins against: None (no login), a password, or ``{user: password}``
    (a mapping, or read from a users file: :func:`looks_like_path` decides which a string is)."""
    if basic_auth is None or basic_auth == "":
        return None
    if isinstance(basic_auth, Mapping):
        return check_users(basic_auth, "<mapping>")
    if not isinstance(basic_auth, str):
        raise ConfigError(f"basic_auth={basic_auth!r} must be a password, a users file or a mapping",
                          field="basic_auth", value=basic_auth)
    return read_users_file(basic_auth) if looks_like_path(basic_auth) else basic_auth


def refuse_bad_basic_auth(argv: Sequence[str]) -> None:
    """Exit with one line and status 2 when ``argv``'s ``--basic-auth`` is no sound login (what
    ``python -m widgets`` checks first: the UI's imports take seconds)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--basic-auth", default=None)
    known, _rest = parser.parse_known_args(list(argv))
    try:
        resolve_basic_auth(known.basic_auth)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
