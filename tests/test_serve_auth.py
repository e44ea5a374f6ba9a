"""``python -m widgets --basic-auth`` (what ``workbench serve`` runs): a value that looks like a
users file must be one (issue 13). A missing file is never the password; a malformed one is
refused at start, with one line and exit status 2, not with an error at every login."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest

from browser.helpers import ROOT, free_port  # tests/browser/

pytestmark = pytest.mark.multiprocess  # each case starts the app's entry point

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _widgets(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "widgets", *args], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_users_file_that_is_not_one_is_refused_at_start(tmp_path):
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "broken.json").write_text('{"alice": ')
    cases = {  # --basic-auth value -> what the one line must say
        "/etc/wb/users.json": "does not exist",  # never the password "/etc/wb/users.json"
        str(tmp_path / "broken.json"): "is not valid JSON",
        str(tmp_path / "list.json"): "holds a JSON list, not an object",
        str(tmp_path / "empty.json"): "is empty",
    }
    t0 = time.monotonic()
    # all at once: each pays the imports (seconds), none starts a server
    procs = {value: _widgets("--basic-auth", value, "--port", str(free_port())) for value in cases}
    for value, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"--basic-auth {value}: the app started (or hung) instead of refusing")
        lines = err.strip().splitlines()
        assert proc.returncode == 2, (value, proc.returncode, err[-2000:])
        assert len(lines) == 1 and "Traceback" not in err, err
        assert lines[0].startswith(f"error: basic_auth={value!r}") and cases[value] in lines[0], lines[0]
        assert 'JSON object {"user": "password"}' in lines[0], lines[0]  # the rule, in the same line
        assert out == ""
    print(f"\n{len(cases)} refusals in {time.monotonic() - t0:.1f} s (together)")


def _request(port: int, method: str, path: str, body: str | None = None, cookie: str = ""):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/x-www-form-urlencoded"} if body is not None else {}
    if cookie:
        headers["Cookie"] = cookie
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, resp.headers, data


def _login(port: int, user: str, password: str):
    """POST the login form; (status, the cookies it set as one Cookie header)."""
    status, headers, _ = _request(port, "POST", "/login", urllib.parse.urlencode({"username": user, "password": password}))
    cookies = [c.split(";", 1)[0] for c in headers.get_all("Set-Cookie") or []]
    return status, headers, "; ".join(c for c in cookies if not c.endswith('=""'))


def test_a_good_users_file_serves_the_app_behind_its_login(tmp_path):
    users = tmp_path / "users.json"
    users.write_text(json.dumps({"alice": "correct horse"}))
    port = free_port()
    proc = _widgets("--basic-auth", str(users), "--port", str(port))
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the app did not listen within 60 s"
                time.sleep(0.2)
        users.unlink()  # read once at start: logins no longer depend on the file
        # without credentials: no page, the login form instead (Panel's basic auth redirects; no 401)
        status, headers, body = _request(port, "GET", "/")
        assert status == 302 and "login" in headers["Location"] and b"workbench" not in body
        status, headers, cookie = _login(port, "alice", "wrong")
        assert status == 302 and "error=" in headers["Location"] and "user=" not in cookie
        status, headers, cookie = _login(port, str(users), str(users))  # the path is no password
        assert status == 302 and "error=" in headers["Location"] and "user=" not in cookie
        status, _, body = _request(port, "GET", "/", cookie=cookie)
        assert status == 302
        # with them: the page
        status, headers, cookie = _login(port, "alice", "correct horse")
        assert status == 302 and "error=" not in headers["Location"] and "user=" in cookie
        status, _, body = _request(port, "GET", "/", cookie=cookie)
        assert status == 200 and b"workbench" in body
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_values_that_are_passwords_files_and_mappings_are_checked_in_process(tmp_path):
    from workbench import ConfigError
    from widgets.app import serve
    from widgets.serve_auth import resolve_basic_auth

    assert resolve_basic_auth("s3cret") == "s3cret" and resolve_basic_auth(None) is None
    assert resolve_basic_auth({"bob": "pw"}) == {"bob": "pw"}
    (tmp_path / "users").write_text('{"bob": "pw"}')
    assert resolve_basic_auth(str(tmp_path / "users")) == {"bob": "pw"}  # a separator: a file, not .json
    (tmp_path / "big.json").write_text(json.dumps({"bob": "x" * (1 << 20)}))
    (tmp_path / "numbers.json").write_text('{"bob": 1}')
    (tmp_path / "deep.json").write_text("[" * 100_000)
    cases = {
        "users.json": "does not exist",  # no separator, but .json: a file, never the password "users.json"
        str(Path("no") / "such" / "pw"): "does not exist",
        str(tmp_path): "is a directory",
        str(tmp_path / "big.json"): "bytes",
        str(tmp_path / "numbers.json"): "the password of user 'bob' is not a non-empty string",
        str(tmp_path / "deep.json"): "holds a JSON list",  # or "nested too deeply": never a RecursionError
    }
    for value, problem in cases.items():
        with pytest.raises(ConfigError) as err:
            resolve_basic_auth(value)
        assert err.value.field == "basic_auth" and "\n" not in str(err.value)
        assert str(err.value).startswith(f"basic_auth={value!r}"), str(err.value)
        assert problem in str(err.value) or "nests too deeply" in str(err.value) or "not valid JSON" in str(err.value), str(err.value)
    for bad in ({}, {"bob": ""}, {"": "pw"}, {"bob": 1}, {1: "pw"}):
        with pytest.raises(ConfigError) as err:
            resolve_basic_auth(bad)
        assert err.value.field == "basic_auth"
    with pytest.raises(ConfigError) as err:  # serve() itself checks too (the API, not only the command)
        serve(port=0, basic_auth="/etc/wb/users.json")
    assert err.value.field == "basic_auth" and "does not exist" in str(err.value)
