"""Kernels of a Jupyter Kernel Gateway (or Enterprise Gateway): the REST API starts and ends them,
one websocket per kernel carries its messages (the gateway signs them towards the kernel).

Every request carries ``Authorization: token <token>``; the token is taken from ``token=`` or the
environment (``WORKBENCH_GATEWAY_TOKEN``, ``JUPYTER_GATEWAY_AUTH_TOKEN``), is never written to the
run directory and never logged. Use an ``https://`` URL where the gateway is not on this machine
(``verify_tls``: True, False, or a CA bundle path).

A Kernel Gateway runs its kernels on its own host, so by default the nodes get distinct loopback
addresses there; give ``addrs=[...]`` for an Enterprise Gateway that spreads kernels over hosts.
Gateway kernels belong to the gateway: they outlive the driver (reattach with ``open_run``, and
``run.shutdown()`` deletes them).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import queue
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from workbench.spec.errors import ConfigError
from workbench.launch.kernels import READY_TIMEOUT_S, KernelChannel, KernelError
from workbench.launch.ssh import host_problem

TOKEN_ENV = ("WORKBENCH_GATEWAY_TOKEN", "JUPYTER_GATEWAY_AUTH_TOKEN")


def check_url(url: object) -> str:
    """``url`` if it is a gateway's base URL: http or https, a host (DNS name, IPv4, [IPv6]), a port
    1-65535 where given, an optional path, and nothing else: no whitespace or control characters
    (a header or request line could be split with them), no user:password (the token goes in
    ``token=``, never in a URL that is saved with the run), no query or fragment (API paths are
    appended to it). A ConfigError of one line naming the URL and the rule otherwise."""
    if not isinstance(url, str):
        raise ConfigError(f"url={url!r} must be a string http(s)://host[:port][/path]", field="url", value=url)
    shown = repr(url if len(url) <= 100 else url[:100] + "...")

    def fail(rule: str) -> ConfigError:
        return ConfigError(f"url={shown} {rule}", field="url", value=url)

    if not url.startswith(("http://", "https://")):
        raise fail("must start with http:// or https://")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise fail("contains whitespace or a control character")
    if not url.isascii():
        raise fail("contains a non-ASCII character (give the host in its IDNA form, xn--...)")
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as e:  # "Invalid IPv6 URL"
        raise fail(f"is not a valid URL ({e})") from None
    if "@" in parts.netloc:
        raise fail("holds a user or password: pass the token as token= (or $WORKBENCH_GATEWAY_TOKEN)")
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise fail("has a query or fragment: give the gateway's base URL (API paths are appended to it)")
    host = parts.netloc.rsplit(":", 1)[0] if not parts.netloc.endswith("]") else parts.netloc
    problem = host_problem(host)
    if problem:
        raise fail(f"has no valid host ({problem})")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0 or (parts.netloc.endswith(":") and port is None):
        raise fail("has a port that is not an integer 1-65535")
    return url


class _Http:
    """The gateway's REST API (stdlib only)."""

    def __init__(self, url: str, token: str, verify_tls: bool | str):
        self.url, self._token = url.rstrip("/"), token
        self.context = None
        if self.url.startswith("https://"):
            if verify_tls is False:
                self.context = ssl._create_unverified_context()  # noqa: S323 - asked for explicitly
            else:
                self.context = ssl.create_default_context(cafile=verify_tls if isinstance(verify_tls, str) else None)

    @property
    def header(self) -> str:
        return f"token {self._token}"

    def request(self, method: str, path: str, body: dict | None = None, timeout_s: float = 30.0) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Authorization": self.header, "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s, context=self.context) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:  # the message names the status, never the token
            raise KernelError(f"gateway {method} {path}: HTTP {e.code} {e.reason}") from None
        except urllib.error.URLError as e:
            raise KernelError(f"gateway {self.url} unreachable: {e.reason}") from None
        return json.loads(raw) if raw else None

    def __repr__(self) -> str:  # no token in any repr
        return f"_Http({self.url!r})"


class GatewayChannel(KernelChannel):
    """One gateway kernel over its ``/api/kernels/<id>/channels`` websocket."""

    def __init__(self, http: _Http, kernel_id: str, description: dict[str, Any]):
        import websocket  # websocket-client

        self.http, self.kernel_id, self.description = http, kernel_id, description
        self._session = uuid.uuid4().hex
        ws_url = "ws" + http.url[len("http"):] + f"/api/kernels/{kernel_id}/channels"
        sslopt = None
        if http.context is not None:
            sslopt = {"context": http.context}
        try:
            self.ws = websocket.create_connection(ws_url, header=[f"Authorization: {http.header}"], timeout=30,
                                                  sslopt=sslopt)
        except Exception as e:  # noqa: BLE001 - reported without the header
            raise KernelError(f"gateway websocket for kernel {kernel_id}: {type(e).__name__}: {e}") from None
        self.ws.settimeout(0.5)
        self._inbox: queue.Queue = queue.Queue()
        self._replies: dict[str, dict[str, Any]] = {}
        self._cond = threading.Condition()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name="workbench-gateway-ws", daemon=True)
        self._reader.start()
        self._wait_ready()

    def _message(self, msg_type: str, content: dict[str, Any], channel: str = "shell") -> dict[str, Any]:
        header = {"msg_id": uuid.uuid4().hex, "username": "workbench", "session": self._session,
                  "date": _dt.datetime.now(_dt.timezone.utc).isoformat(), "msg_type": msg_type, "version": "5.3"}
        return {"header": header, "parent_header": {}, "metadata": {}, "content": content, "channel": channel,
                "buffers": []}

    def _read(self) -> None:
        import websocket

        while not self._closed.is_set():
            try:
                raw = self.ws.recv()
            except websocket.WebSocketTimeoutException:
                continue
            except Exception:  # noqa: BLE001 - closed: alive() says so
                self._closed.set()
                with self._cond:
                    self._cond.notify_all()
                return
            try:
                msg = json.loads(raw)
            except (TypeError, ValueError):
                continue  # a binary frame: not ours
            if msg.get("channel") == "shell":
                with self._cond:
                    self._replies[msg.get("parent_header", {}).get("msg_id", "")] = msg
                    self._cond.notify_all()
            elif msg.get("channel") == "iopub":
                self._inbox.put(msg)

    def _request(self, msg: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
        msg_id = msg["header"]["msg_id"]
        self.ws.send(json.dumps(msg))
        deadline = time.time() + timeout_s
        with self._cond:
            while msg_id not in self._replies:
                left = deadline - time.time()
                if left <= 0 or self._closed.is_set():
                    return None
                self._cond.wait(min(left, 0.5))
            return self._replies.pop(msg_id)

    def _wait_ready(self) -> None:
        deadline = time.time() + READY_TIMEOUT_S
        while time.time() < deadline:
            if self._request(self._message("kernel_info_request", {}), 5.0) is not None:
                return
        raise KernelError(f"gateway kernel {self.kernel_id} did not answer within {READY_TIMEOUT_S:.0f} s")

    def _execute(self, code: str, expressions: dict[str, str], timeout_s: float) -> dict[str, Any]:
        content = {"code": code, "silent": False, "store_history": False, "user_expressions": expressions,
                   "allow_stdin": False, "stop_on_error": True}
        with self._lock:
            reply = self._request(self._message("execute_request", content), timeout_s)
        if reply is None:
            raise KernelError("the kernel died" if self._closed.is_set() else f"no reply within {timeout_s:.0f} s")
        return reply["content"]

    def alive(self) -> bool:
        try:
            model = self.http.request("GET", f"/api/kernels/{self.kernel_id}", timeout_s=10)
        except KernelError:
            return False
        return bool(model) and model.get("execution_state") != "dead"

    def close(self) -> None:
        self._closed.set()
        try:
            self.ws.close()
        except Exception:  # noqa: BLE001
            pass
        self._reader.join(timeout=2)

    def shutdown(self) -> None:
        self.close()
        try:
            self.http.request("DELETE", f"/api/kernels/{self.kernel_id}")
        except KernelError:
            pass  # already gone


class GatewayBackend:
    """Kernels from the gateway at ``url`` (``http(s)://host:port``)."""

    name = "gateway"

    def __init__(self, url: str, token: str | None = None, kernel_name: str = "python3",
                 remote_root: str = "~/.workbench/runs", addrs: list[str] | None = None,
                 verify_tls: bool | str = True, shared_run_root: bool = False):
        url = check_url(url)
        token = token or next((os.environ[k] for k in TOKEN_ENV if os.environ.get(k)), "")
        self.url, self.kernel_name, self.remote_root = url.rstrip("/"), kernel_name, remote_root.rstrip("/")
        self.addrs, self.verify_tls, self.shares_run_dir = addrs, verify_tls, shared_run_root
        self._http = _Http(self.url, token, verify_tls)

    def public_options(self) -> dict[str, Any]:
        """What open_run needs again, without the token."""
        return {"url": self.url, "kernel_name": self.kernel_name, "remote_root": self.remote_root,
                "addrs": self.addrs, "verify_tls": self.verify_tls, "shared_run_root": self.shares_run_dir}

    def node_addresses(self, n: int) -> list[str]:
        if self.addrs is not None:
            if len(self.addrs) != n or sorted(self.addrs) != list(self.addrs):
                raise ConfigError(f"addrs={self.addrs}: give {n} addresses, in sorted order (the rendezvous "
                                  "numbers nodes by sorting them)", field="addrs", value=self.addrs)
            return list(self.addrs)
        return [f"127.0.0.{10 + i}" for i in range(n)]

    def run_dir_of(self, run_dir: Path, node: int) -> str:
        return str(run_dir.resolve()) if self.shares_run_dir else f"{self.remote_root}/{run_dir.name}"

    def start(self, run_dir: Path, node: int) -> GatewayChannel:
        model = self._http.request("POST", "/api/kernels", {"name": self.kernel_name})
        description = {"backend": "gateway", "url": self.url, "kernel_id": model["id"]}
        try:
            return GatewayChannel(self._http, model["id"], description)
        except KernelError:
            try:
                self._http.request("DELETE", f"/api/kernels/{model['id']}")
            except KernelError:
                pass
            raise

    def reconnect(self, run_dir: Path, description: dict[str, Any]) -> GatewayChannel:
        self._http.request("GET", f"/api/kernels/{description['kernel_id']}")  # 404: gone
        return GatewayChannel(self._http, description["kernel_id"], description)
