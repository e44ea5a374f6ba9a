"""View 6, launch: start, stop and resume a run of the bundled trainer, and its status per node and rank.

The browser can launch only the bundled trainer, with a RunConfig built from validated fields
(model preset, plan, steps, checkpoint interval): never a command line. The backend is where
the nodes run: ``local`` (Jupyter kernels on this machine), ``ssh`` (kernels on the listed
hosts) or ``gateway`` (a Jupyter Enterprise/Kernel Gateway: URL and token). Errors show as they
are: a ConfigError names the field, the value and the rule; a failed run says why.

Launching and stopping take seconds (kernels start, torchrun stops): they run in a worker
thread, so the page stays responsive, and the status table refreshes from the session's poll.
"""

from __future__ import annotations

import asyncio
from typing import Any

import panel as pn
import param

from workbench import ConfigError, ModelSpec, RunConfig
from workbench.launch import launch
from workbench.launch.local import config_from_cli
from workbench.spec.trainable import check_trainable

from widgets.markup import Html
from widgets.run_session import RunSession, session_of
from widgets.run_transforms import status_rows
from widgets.state import PlanState
from widgets.ui import FieldErrors, card, cards, error_line, html_pane, muted, table

BACKENDS = ("local", "ssh", "gateway")
STATE_TONES = {"running": "good", "finished": "good", "failed": "bad", "stopped": "warn", "starting": ""}


def build_launch_config(model: str, plan: str, steps: int, checkpoint_every: int = 0, seq_len: int = 64,
                        micro_batch_size: int = 2) -> RunConfig:
    """The RunConfig the Launch view starts (ConfigError naming the field when the trainer
    cannot run it): ``model`` preset, ``plan`` text ("pp=2,dp_shard=2"), local-cpu cluster with
    two ranks per node (:func:`workbench.launch.local.config_from_cli`)."""
    for name, v, low in (("steps", steps, 1), ("checkpoint_every", checkpoint_every, 0), ("seq_len", seq_len, 1),
                         ("micro_batch_size", micro_batch_size, 1)):
        if v is None or int(v) < low:
            raise ConfigError(f"{name}={v} must be an integer >= {low}", field=name, value=v)
    if model not in ModelSpec.presets():
        raise ConfigError(f"model={model!r} is not a preset ({', '.join(ModelSpec.presets())})", field="model",
                          value=model)
    try:
        config = config_from_cli(model, plan, int(steps), checkpoint_every=int(checkpoint_every),
                                 seq_len=int(seq_len), micro_batch_size=int(micro_batch_size))
    except ConfigError as err:
        if err.field in (None, "", "plan") or "=" in str(plan):
            raise ConfigError(str(err), field=err.field or "plan", value=err.value) from None
        raise
    except ValueError as err:  # a plan text that does not parse
        raise ConfigError(f"plan={plan!r}: {err}", field="plan", value=plan) from None
    check_trainable(config)
    return config


def backend_options(backend: str, hosts: str, url: str, token: str) -> dict[str, Any]:
    """Keyword arguments of ``launch`` for the backend (hosts: comma- or space-separated)."""
    if backend == "ssh":
        names = [h for h in hosts.replace(",", " ").split() if h]
        if not names:
            raise ConfigError("hosts='' : the ssh backend needs the hosts to start the nodes on", field="hosts",
                              value=hosts)
        return {"hosts": names}
    if backend == "gateway":
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"url={url!r} must be an http(s) URL of the gateway", field="url", value=url)
        return {"url": url, "token": token or None}
    return {}


def status_html(status: Any, run_dir: str, replay: bool, digest_note: str = "") -> Html:
    """Run state card and the per-rank table (a replayed directory has no live status)."""
    if status is None:
        if not run_dir:
            return muted("No run yet.")
        return cards([card("Run", "replay", "run-state", note=run_dir)]) + (
            muted(digest_note) if digest_note else Html(""))
    head = cards([card("Run", status.state, "run-state", note=run_dir, tone=STATE_TONES.get(status.state, ""))])
    why = error_line(status.why, "run-why") if status.why else Html("")
    rows = [[r["node"], r["host"], r["rank"], r["state"], r["step"], r["loss"], r["events"], r["why"]]
            for r in status_rows(status)]
    return head + why + table(["node", "host", "rank", "state", "step", "loss", "events", "why"], rows,
                              testid="rank-status", numeric=(0, 2, 4, 5, 6))


class LaunchView(pn.viewable.Viewer):
    """Launch the bundled trainer from the browser; stop and resume it; watch its status."""

    state = param.ClassSelector(class_=PlanState)
    backend = param.Selector(default="local", objects=list(BACKENDS))
    hosts = param.String(default="", doc="ssh: host names, comma-separated (node 0 first)")
    url = param.String(default="", doc="gateway: its URL")
    token = param.String(default="", doc="gateway: its token (never written to disk)")
    model = param.Selector(default="tiny", objects=list(ModelSpec.presets()))
    plan = param.String(default="pp=2")
    steps = param.Integer(default=40, allow_None=True)
    checkpoint_every = param.Integer(default=0, allow_None=True)
    seq_len = param.Integer(default=64, allow_None=True)

    def __init__(self, state: PlanState | None = None, session: RunSession | None = None, **params: Any):
        super().__init__(state=state or PlanState(), **params)
        self.session = session or session_of(self.state)
        self._errors = FieldErrors("launch")
        p = self.param
        self._backend = pn.widgets.RadioButtonGroup.from_param(p.backend, color="primary",
                                                              variant="outline", margin=(22, 10, 4, 10))
        self._hosts = self._errors.wrap("hosts", pn.widgets.TextInput.from_param(p.hosts, label="hosts", width=260))
        self._url = self._errors.wrap("url", pn.widgets.TextInput.from_param(p.url, label="gateway URL", width=260))
        self._token = pn.widgets.PasswordInput.from_param(p.token, label="token", width=160)
        self._fields = [
            self._errors.wrap("model", pn.widgets.Select.from_param(p.model, label="model", width=130)),
            self._errors.wrap("plan", pn.widgets.TextInput.from_param(p.plan, label="plan", width=170)),
            self._errors.wrap("steps", pn.widgets.IntInput.from_param(p.steps, label="steps", width=90, start=1)),
            self._errors.wrap("checkpoint_every", pn.widgets.IntInput.from_param(
                p.checkpoint_every, label="checkpoint every", width=120, start=0)),
            self._errors.wrap("seq_len", pn.widgets.IntInput.from_param(p.seq_len, label="seq_len", width=90, start=1)),
        ]
        self._start = pn.widgets.Button(label="Start", color="primary", icon="player-play", margin=(22, 5, 0, 10))
        self._stop = pn.widgets.Button(label="Stop", color="danger", icon="player-stop", margin=(22, 5, 0, 5),
                                       disabled=True)
        self._resume = pn.widgets.Button(label="Resume", color="success", icon="player-track-next",
                                         margin=(22, 5, 0, 5), disabled=True)
        self._start.on_click(self._on_start)
        self._stop.on_click(self._on_stop)
        self._resume.on_click(self._on_resume)
        self._message = html_pane("", margin=(4, 10))
        self._status = html_pane(status_html(None, "", False), margin=(4, 10), sizing_mode="stretch_width")
        self.session.on_events(self._refresh)
        self._layout = None
        self._show_backend_fields()

    # ---- inputs
    @param.depends("backend", watch=True)
    def _show_backend_fields(self) -> None:
        self._hosts.visible = self.backend == "ssh"
        self._url.visible = self._token.visible = self.backend == "gateway"

    def build(self) -> tuple[RunConfig, dict[str, Any]]:
        """The validated config and backend options (ConfigError names the field)."""
        config = build_launch_config(self.model, self.plan, self.steps, self.checkpoint_every, self.seq_len)
        return config, backend_options(self.backend, self.hosts, self.url, self.token)

    def _fail(self, err: BaseException) -> None:
        field = getattr(err, "field", None)
        self._errors.show(str(err), field)
        self._message.object = error_line(f"{type(err).__name__}: {err}", "launch-error")

    # ---- actions (in a worker thread: they take seconds)
    async def _on_start(self, _event: Any = None) -> None:
        self._errors.show(None, None)
        self._message.object = ""
        try:
            config, options = self.build()
        except ConfigError as err:
            self._fail(err)
            return
        self._start.disabled = True
        self._message.object = muted("Starting the kernels…", "launch-message")
        try:
            run = await asyncio.to_thread(launch, config, self.backend, run_root=self.session.runs_root, **options)
        except Exception as err:  # noqa: BLE001 - shown plainly, the app keeps working
            self._fail(err)
            self._start.disabled = False
            return
        self._message.object = muted(f"Launched {run.run_id}.", "launch-message")
        self.session.attach(run)

    async def _on_stop(self, _event: Any = None) -> None:
        run = self.session.run
        if run is None:
            return
        self._stop.disabled = True
        self._message.object = muted("Stopping…", "launch-message")
        try:
            await asyncio.to_thread(run.stop)
        except Exception as err:  # noqa: BLE001
            self._fail(err)
        self._message.object = ""
        self.session.poll()

    async def _on_resume(self, _event: Any = None) -> None:
        run = self.session.run
        if run is None:
            return
        self._resume.disabled = True
        self._message.object = muted("Resuming…", "launch-message")
        try:
            await asyncio.to_thread(run.resume)
        except Exception as err:  # noqa: BLE001
            self._fail(err)
        self._message.object = ""
        self.session.start_polling()
        self.session.poll()

    # ---- refresh
    def _refresh(self, _new: list, status: Any) -> None:
        self._status.object = status_html(status, self.session.run_dir, self.session.replay)
        running = status is not None and status.state in ("starting", "running")
        ended = status is not None and not running
        self._start.disabled = running
        self._stop.disabled = not running
        self._resume.disabled = not ended or self.session.run is None

    def panel(self) -> pn.viewable.Viewable:
        if self._layout is None:
            self._layout = pn.Column(
                pn.Row(pn.pane.Markdown("**Backend**", margin=(26, 0, 0, 10)), self._backend,
                       self._hosts, self._url, self._token),
                pn.FlexBox(*self._fields, self._start, self._stop, self._resume),
                self._errors.general,
                self._message,
                self._status,
                pn.pane.Markdown(
                    "Only the bundled trainer runs, with the config built from these fields (local-cpu "
                    "cluster, two ranks per node). Watch it in **7 · Live run**.",
                    styles={"color": "#5a6570", "font-size": "12px"}),
                sizing_mode="stretch_width",
            )
        return self._layout

    def __panel__(self) -> pn.viewable.Viewable:
        return self.panel()
