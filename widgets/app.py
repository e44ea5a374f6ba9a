"""The served workbench app: the planning views in one page, one fresh state per browser session.

``create_app()`` builds one session's :class:`App`: the page (``app.template``) together with
the :class:`PlanState` behind it (``app.state``) and its views, all owned by the caller (the
server builds one per browser session and serves its template: :func:`session_page`);
``serve()`` starts the server, on 127.0.0.1 unless told otherwise, and refuses any other
address without authentication; a users file for the login is read and checked once, at start
(:mod:`widgets.serve_auth`: a value that looks like a path is never taken as a password).

The page is a list of sections (:data:`SECTIONS`, one tab each): the planning views (1-5), the run
views (6 launch, 7 live run, 8 compare runs; one :class:`~widgets.run_session.RunSession` per
browser session, so a session sees and stops only its own runs) and 9, the measured bandwidth.
Launched runs go under ``--runs`` (default ``$WORKBENCH_RUNS`` or ``./runs``).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import socket
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import panel as pn

from workbench import ConfigError, RunConfig
from workbench.rundir.record import check_runs_root

from widgets.advisor_view import AdvisorView
from widgets.bench_view import BenchView
from widgets.compare_view import CompareView
from widgets.launch_view import LaunchView
from widgets.live_view import LiveView
from widgets.markup import Html, render
from widgets.memory_view import MemoryView
from widgets.mesh_view import MeshView
from widgets.model_view import ModelSketch
from widgets.pipeline_view import PipelineView
from widgets.plan_compare_view import PlanCompareView
from widgets.resources import OfflineFast, SYSTEM_FONT, extension, keep_stylesheets_local
from widgets.run_session import session_of
from widgets.serve_auth import resolve_basic_auth
from widgets.icons import icon
from widgets.state import PlanState, prediction_of
from widgets.transforms import band_text, format_bytes, format_count, recompute_words, step_headline
from widgets.ui import card, cards, html_pane

LOCAL_ADDRESSES = ("127.0.0.1", "localhost", "::1")
ACCENT = "#0b5394"

# (tab title, view class): each view takes the shared PlanState. Later sections append here.
SECTIONS: list[tuple[str, Callable[[PlanState], pn.viewable.Viewer]]] = [
    ("1 · Model", ModelSketch),
    ("2 · Memory", MemoryView),
    ("3 · Mesh", MeshView),
    ("4 · Advisor", AdvisorView),
    ("5 · Pipeline", PipelineView),
    ("6 · Launch", LaunchView),
    ("7 · Live run", LiveView),
    ("8 · Compare", CompareView),
    ("9 · Bandwidth", BenchView),
    ("10 · Compare plans", PlanCompareView),
]


def summary_html(config: "RunConfig | None", error: str, model_name: str) -> Html:
    """The sidebar: what is being planned and its headline predictions, read from the plan's one
    prediction (``state.prediction``; a RunConfig finds the one its state computed)."""
    pred = prediction_of(config)
    if pred is None:
        return cards([card("Configuration", "invalid", "summary-status", note=error, tone="bad")])
    config = pred.config
    fit = pred.bill.fits()
    head = step_headline(pred.step)
    c, train = config.cluster, config.train
    return cards([
        card("Model", model_name or "custom", "summary-model", note=f"{format_count(config.model.n_params())} parameters"),
        card("Cluster", f"{c.nodes} × {c.gpus_per_node} {c.gpu.name}", "summary-cluster", note=c.name),
        card("Plan", config.plan.describe(), "summary-plan",
             note=f"mbs {train.micro_batch_size}, {config.n_microbatches} micro-batches, "
                  f"{train.precision or 'custom'}, {recompute_words(train.recompute)}"),
        card("Peak memory", format_bytes(fit.peak_bytes), "summary-peak",
             note=f"of {format_bytes(fit.hbm_bytes)}: " + ("fits" if fit.fits else "does NOT fit"),
             tone="good" if fit.fits else "bad"),
        card("Step time", head["step"], "summary-step",
             note=render('MFU <span data-testid="summary-mfu">{}</span>, bubble '
                         '<span data-testid="summary-bubble">{}</span>', head["mfu"], head["bubble"])
             + (render(', <span data-testid="summary-mfu-fp8">{}</span> of the FP8 peak', head["mfu_fp8"])
                if head["mfu_fp8"] else "")),
        card("Throughput", head["tokens_per_s_per_gpu"], "summary-tps", note="tokens/s per GPU"),
        card("Framework", train.profile.name, "summary-framework", note=band_text(train.profile)),
    ])


@dataclass(frozen=True)
class App:
    """One session's page and what it is made of: ``template`` (the page to show or serve),
    ``state`` (the :class:`PlanState` every view shares) and ``views`` (tab title -> view)."""

    template: pn.template.FastListTemplate
    state: PlanState
    views: dict[str, pn.viewable.Viewer]

    def __panel__(self) -> pn.template.FastListTemplate:
        return self.template


def plan_actions(views: dict[str, pn.viewable.Viewer], tabs: pn.Tabs) -> list[pn.viewable.Viewable]:
    """The sidebar's buttons on the current plan: "Launch this plan" opens the Launch tab, which
    shows that plan (and why it cannot run here, if it cannot); "Pin as plan A" pins it in the
    plan comparison (change anything, then read A beside it there)."""
    titles = list(views)

    def index_of(kind: type) -> int | None:
        return next((i for i, t in enumerate(titles) if isinstance(views[t], kind)), None)

    out: list[pn.viewable.Viewable] = []
    at_launch, at_compare = index_of(LaunchView), index_of(PlanCompareView)
    if at_launch is not None:
        go = pn.widgets.Button(label="Launch this plan", color="primary", icon=icon("launch"), width=260,
                               margin=(4, 10))
        go.on_click(lambda _e: setattr(tabs, "active", at_launch))
        out.append(go)
    if at_compare is not None:
        compare = views[titles[at_compare]]
        pin = pn.widgets.Button(label="Pin as plan A (10 · Compare plans)", color="primary", variant="outline",
                                icon=icon("compare"), width=260, margin=(4, 10))
        pin.on_click(lambda _e: compare.pin())
        out.append(pin)
    return out


def create_app(state: PlanState | None = None) -> App:
    """A fresh page (and, unless given, a fresh :class:`PlanState`): one per browser session."""
    extension()
    state = state or PlanState()
    views = {title: make(state) for title, make in SECTIONS}
    tabs = pn.Tabs(*[(title, view.panel()) for title, view in views.items()], dynamic=True,  # only the visible tab renders
                   sizing_mode="stretch_width", margin=(0, 10))
    summary = html_pane(pn.bind(lambda cfg, err, m: summary_html(cfg, err, m.name if m else ""),
                                state.param.config, state.param.error, state.param.model))
    template = pn.template.FastListTemplate(
        title="workbench · plan a distributed training run",
        sidebar=[pn.pane.Markdown("### Current plan", margin=(0, 10)), summary, *plan_actions(views, tabs),
                 pn.pane.Markdown("Model, cluster, mesh and settings are shared by every tab; an advisor "
                                  "plan fills them all.", styles={"color": "#5a6570", "font-size": "12px"})],
        main=[tabs],
        accent=ACCENT,
        header_background=ACCENT,
        sidebar_width=300,
        theme_toggle=False,
        design=OfflineFast,
        font=SYSTEM_FONT,
        font_url="",
    )
    if pn.state.curdoc is not None and pn.state.curdoc.session_context is not None:
        runs = session_of(state)  # the session's own runs end with it
        pn.state.curdoc.on_session_destroyed(lambda _ctx: runs.shutdown())
    return App(template, state, views)


def session_page() -> pn.template.FastListTemplate:
    """What the server shows a new browser session: a fresh :func:`create_app`'s page."""
    return create_app().template


def _origins(address: str, port: int) -> list[str]:
    if address in LOCAL_ADDRESSES:
        return [f"127.0.0.1:{port}", f"localhost:{port}"]
    if address in ("0.0.0.0", "::", ""):
        return ["*"]  # any interface: the page is behind the login, so any Host may connect
    return [f"{h}:{port}" for h in {address, socket.gethostname(), socket.getfqdn()}]


def serve(port: int = 5006, address: str = "127.0.0.1", show: bool = False,
          basic_auth: "str | Mapping[str, str] | None" = None, **kwargs: Any) -> Any:
    """Serve the app (blocks). ``address`` other than 127.0.0.1/localhost needs ``basic_auth`` (a
    password, a JSON file of ``{"user": "password"}`` or such a mapping): the app shows and later
    launches runs, so it is never open to a network without a login. A users file is read and
    checked here, once (:func:`resolve_basic_auth`); ConfigError when it is not one. Extra keyword
    arguments go to ``pn.serve``.
    """
    basic_auth = resolve_basic_auth(basic_auth)
    if address not in LOCAL_ADDRESSES and not basic_auth:
        raise ConfigError(
            f"address={address!r} exposes the app beyond this machine: serving it there requires "
            "authentication (basic_auth='password' or a JSON file of users, --basic-auth on the command line)",
            field="address",
            value=address,
        )
    opts: dict[str, Any] = {}
    if basic_auth:
        opts["basic_auth"] = basic_auth
        opts["cookie_secret"] = kwargs.pop("cookie_secret", None) or secrets.token_hex(32)
    opts.update(kwargs)
    keep_stylesheets_local()
    return pn.serve(
        {"/": session_page}, port=port, address=address, show=show, title="workbench",
        websocket_origin=_origins(address, port), **opts,
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m widgets.app [--port N] [--address A] [--basic-auth PW|USERS.json] [--show] [--runs DIR]``."""
    ap = argparse.ArgumentParser(prog="python -m widgets.app", description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=5006)
    ap.add_argument("--address", default="127.0.0.1")
    ap.add_argument("--basic-auth", default=None,
                    help="a password, or a users file (JSON {user: password}); a value with a path separator, "
                         "ending in .json or naming a file is read as a users file and must be one")
    ap.add_argument("--show", action="store_true")
    ap.add_argument("--runs", default=None, help="where launched runs go (default $WORKBENCH_RUNS or ./runs)")
    a = ap.parse_args(argv)
    try:
        if a.runs is not None:
            check_runs_root(a.runs)
            os.environ["WORKBENCH_RUNS"] = a.runs  # read by every session's RunSession
        serve(port=a.port, address=a.address, show=a.show, basic_auth=a.basic_auth)
    except ConfigError as err:  # one line and exit status 2, as every workbench command
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
