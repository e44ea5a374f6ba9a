"""View 7, the live run (and 5b, the measured pipeline beside the simulated one).

Curves of loss, tokens/s, MFU and gradient norm; the step-time distribution (median, p95, max,
with the slowest rank); memory per rank measured against predicted; communication per group
(time, bytes, bus bandwidth against the link's peak); the expert-load heat map of an MoE model;
the checkpoint timeline on the curves' step axis (saved, committed, verified, loaded, rejected,
failed: a lane and a marker shape each, with a legend); stops, errors, guards, faults, restarts
and resumes marked on the curves; each rank's state as the run directory says; and the measured
pipeline timeline of the latest step beside the planner's simulation.

Everything refreshes from the session's poll (:mod:`widgets.run_session`): each poll hands over
only the events appended since the last one, :class:`~widgets.run_transforms.RunDigest` folds
them in, and the curves *stream* the new rows into their ColumnDataSources (Bokeh sends just
those rows to the browser). Tables are re-rendered only when their kind of event arrived, and
the measured Gantt chart at most every :data:`PIPELINE_REFRESH_S` seconds while the run goes on,
and at its last step as soon as it has ended (a poll without events included).

The run's state, its errors and the marks come from :mod:`workbench.rundir.status`, as
``workbench compare`` takes them: an error a stop raised (a peer's connection reset after another
rank was stopped) is part of the stop, and an earlier attempt's failure is a fault once a resume
or restart went on. The marks are derived from the whole history and redrawn when they change.
Another run shown (:meth:`LiveView.reset`) clears everything derived from the previous one: a run
without a pipeline shows no schedule at all.
"""

from __future__ import annotations

import time
from typing import Any

import panel as pn
import param
from bokeh.models import ColumnDataSource, FactorRange, HoverTool, LinearColorMapper, Range1d
from bokeh.plotting import figure

from widgets.markup import Html
from widgets.pipeline_view import PipelineView
from widgets.run_session import RunSession, session_of
from widgets.run_transforms import CURVES, TIMELINE_KINDS, RunDigest, heatmap_rects, outcome_rows
from widgets.state import PlanState
from widgets.transforms import format_bytes, format_seconds
from widgets.ui import card, cards, html_pane, muted, table

PIPELINE_REFRESH_S = 5.0  # a redraw of the measured Gantt re-renders the pipeline view (~1 s of the server)
CURVE_TITLES = {"loss": "loss", "tokens_per_s": "tokens/s", "mfu": "MFU", "grad_norm": "gradient norm"}
CURVE_COLORS = {"loss": "#0072B2", "tokens_per_s": "#009E73", "mfu": "#E69F00", "grad_norm": "#CC79A7"}
MARK_COLORS = {"guard": "#c62828", "stop": "#546e7a", "fault": "#6a1b9a", "restart": "#ef6c00",
               "resume": "#2e7d32", "error": "#b71c1c", "checkpoint_rejected": "#8d6e63"}
# The checkpoint timeline: one lane and one marker shape per kind (colour-blind-safe colours).
CHECKPOINT_GLYPHS = {"saved": ("circle", "#0072B2"), "committed": ("square", "#009E73"),
                     "verified": ("triangle", "#E69F00"), "loaded": ("diamond", "#CC79A7"),
                     "rejected": ("x", "#c62828"), "failed": ("inverted_triangle", "#8d6e63")}
ENDED = ("finished", "stopped", "failed")


def _rate(x: float | None) -> str:
    if x is None:
        return "-"
    for div, unit in ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s")):
        if x >= div:
            return f"{x / div:,.2f} {unit}"
    return f"{x:,.0f} B/s"


def _split_at_resumes(events: list) -> list[list]:
    """A batch cut before each resume: a replay reads a resumed run in one batch, and the lost
    attempt's steps must leave the curves before the resumed attempt's come in."""
    parts: list[list] = [[]]
    for e in events:
        if e.get("kind") == "resume" and parts[-1]:
            parts.append([])
        parts[-1].append(e)
    return parts


class LiveView(pn.viewable.Viewer):
    """The run of this session (launched or replayed), refreshed as its events arrive."""

    state = param.ClassSelector(class_=PlanState)

    def __init__(self, state: PlanState | None = None, session: RunSession | None = None, **params: Any):
        super().__init__(state=state or PlanState(), **params)
        self.session = session or session_of(self.state)
        self.digest = RunDigest()
        self.curves = ColumnDataSource(data={"step": [], **{k: [] for k in CURVES}, "step_time_s": []})
        self.step_source = ColumnDataSource(data={k: [] for k in ("step", "p50", "p95", "max", "min", "slowest")})
        self.experts = ColumnDataSource(data={"expert": [], "layer": [], "tokens": [], "share": []})
        self.marks: list[dict[str, Any]] = []
        # the marks (stops, errors, faults, resumes...) as one source drawn as vertical lines on
        # every curve: redrawn whole when they change (a later event can reclassify an earlier one)
        self.mark_source = ColumnDataSource(data={"step": [], "kind": [], "label": [], "color": []})
        self.checkpoint_sources = {k: ColumnDataSource(data={"step": [], "lane": [], "label": []})
                                   for k in TIMELINE_KINDS}
        # the step axis, shared by the curves and the checkpoint timeline: the run's planned steps
        # (set per run, so that no bound of the previous run's data is left; widened if it runs past)
        self.x_range = Range1d(0, 1)
        self.figures = {k: self._curve_figure(k) for k in CURVES}
        self.checkpoint_figure = self._checkpoint_figure()
        self.step_figure = self._step_time_figure()
        self.expert_figure = self._expert_figure()
        self.pipeline = PipelineView(self.state)
        self._pipeline_step: int | None = None
        self._pipeline_at = 0.0
        self._headline = html_pane(self._headline_html(), sizing_mode="stretch_width")
        self._ranks = html_pane("", sizing_mode="stretch_width")
        self._pipe_note = html_pane("", sizing_mode="stretch_width")
        # the pipeline, or why there is none: both made here and shown or hidden per run (a pane
        # made in a callback would link Panel's stylesheet from its CDN, unreachable offline)
        self._no_pipeline = html_pane("", sizing_mode="stretch_width")
        self._pipeline_slot = pn.Column(self._no_pipeline, self.pipeline.panel(), margin=0,
                                        sizing_mode="stretch_width")
        self._marks_pane = html_pane("", sizing_mode="stretch_width")
        self._memory = html_pane("", sizing_mode="stretch_width")
        self._comm = html_pane("", sizing_mode="stretch_width")
        self._checkpoints = html_pane("", sizing_mode="stretch_width")
        self._expert_pane = pn.pane.Bokeh(self.expert_figure)
        self._expert_slot = pn.Row(margin=0)  # holds the heat map once an MoE run reports expert counts
        self._show_pipeline(self.session.config)
        self.session.on_reset(self.reset)
        self.session.on_events(self.update)
        self._layout = None

    # ---- figures
    def _curve_figure(self, key: str):
        fig = figure(height=220, width=470, title=CURVE_TITLES[key], toolbar_location=None,
                     tools="", x_axis_label="step", x_range=self.x_range)
        fig.line("step", key, source=self.curves, line_width=2, color=CURVE_COLORS[key])
        r = fig.scatter("step", key, source=self.curves, size=3, color=CURVE_COLORS[key])
        fig.vspan(x="step", source=self.mark_source, line_color="color", line_dash="dashed", line_width=2,
                  name="marks")
        fig.add_tools(HoverTool(renderers=[r], tooltips=[("step", "@step"), (CURVE_TITLES[key], f"@{key}{{0.0000}}")]))
        fig.title.text_font_size = "13px"
        return fig

    def _checkpoint_figure(self):
        """Checkpoints on the curves' step axis: a lane per kind, a marker shape per kind, a legend."""
        lanes = list(TIMELINE_KINDS)
        fig = figure(height=250, width=950, title="checkpoints (step axis of the curves)", toolbar_location=None,
                     tools="", x_axis_label="step", x_range=self.x_range, y_range=FactorRange(*reversed(lanes)))
        renderers = []
        for kind, (marker, color) in CHECKPOINT_GLYPHS.items():
            renderers.append(fig.scatter("step", "lane", source=self.checkpoint_sources[kind], marker=marker,
                                         size=11, color=color, line_width=2, legend_label=kind,
                                         name=f"checkpoint-{kind}"))
        fig.add_tools(HoverTool(renderers=renderers, tooltips=[("step", "@step"), ("", "@label")]))
        fig.legend.location = "top_left"
        fig.add_layout(fig.legend[0], "right")
        fig.title.text_font_size = "13px"
        return fig

    def _step_time_figure(self):
        fig = figure(height=240, width=950, title="step time per rank: median, p95, max (slowest rank on hover)",
                     toolbar_location=None, tools="", x_axis_label="step", y_axis_label="s")
        lines = (("p50", "#0072B2", "solid"), ("p95", "#E69F00", "dashed"), ("max", "#c62828", "dotted"))
        for key, color, dash in lines:
            fig.line("step", key, source=self.step_source, color=color, line_dash=dash, line_width=2, legend_label=key)
        r = fig.scatter("step", "max", source=self.step_source, color="#c62828", size=4)
        fig.add_tools(HoverTool(renderers=[r], tooltips=[("step", "@step"), ("median", "@p50{0.000} s"),
                                                         ("p95", "@p95{0.000} s"), ("max", "@max{0.000} s"),
                                                         ("slowest rank", "@slowest")]))
        fig.legend.location = "top_right"
        fig.legend.orientation = "horizontal"
        fig.title.text_font_size = "13px"
        return fig

    def _expert_figure(self):
        fig = figure(height=220, width=470, title="tokens per expert (latest step, all ranks)",
                     toolbar_location=None, tools="", x_axis_label="expert", y_axis_label="MoE layer")
        mapper = LinearColorMapper(palette="Viridis256", low=0, high=1)
        fig.rect("expert", "layer", width=1, height=1, source=self.experts,
                 fill_color={"field": "share", "transform": mapper}, line_color=None)
        fig.add_tools(HoverTool(tooltips=[("layer", "@layer"), ("expert", "@expert"), ("tokens", "@tokens"),
                                          ("share", "@share{0.0%}")]))
        fig.title.text_font_size = "13px"
        return fig

    # ---- refresh
    def reset(self) -> None:
        """Another run is shown: clear everything derived from the previous one (curves, marks,
        checkpoints, tables, the measured and the simulated pipeline) and set up for this run."""
        self.digest = RunDigest(config=self.session.config)
        self.curves.data = {k: [] for k in self.curves.data}
        self.step_source.data = {k: [] for k in self.step_source.data}
        self.experts.data = {k: [] for k in self.experts.data}
        self.mark_source.data = {k: [] for k in self.mark_source.data}
        for src in self.checkpoint_sources.values():
            src.data = {k: [] for k in src.data}
        self._expert_slot.clear()
        self.marks = []
        self._fit_steps(0)
        self._pipeline_step, self._pipeline_at = None, 0.0
        self.pipeline.measured = []
        self._show_pipeline(self.session.config)
        for pane in (self._marks_pane, self._memory, self._comm, self._checkpoints, self._pipe_note, self._ranks):
            pane.object = ""
        self._headline.object = self._headline_html()

    def _show_pipeline(self, config: Any) -> None:
        """The run's own schedule simulated beside its measurement; a run without a pipeline shows
        no schedule at all (not the previous run's, nor the planner's default)."""
        piped = config is not None and config.plan.pp > 1
        if piped:
            self.pipeline.use_plan(config)
        why = ("No run yet." if config is None else
               "This run has no pipeline (pp = 1): no schedule to simulate or measure.")
        self._no_pipeline.object = "" if piped else muted(why, "live-no-pipeline")
        self._no_pipeline.visible, self.pipeline.panel().visible = not piped, piped

    def update(self, new: list, status: Any = None) -> None:
        """Fold a batch of new events in, stream what changed to the page, and follow the run to
        its last step (called on every poll, with or without new events)."""
        if self.digest.config is None and self.session.config is not None:
            self.digest.config = self.session.config
        kinds = {e.get("kind") for e in new}
        if new:
            for part in _split_at_resumes(new):
                self._fold(part)
            ranks = self._ranks_html()
            if ranks != self._ranks.object:
                self._ranks.object = ranks
            if "memory" in kinds:
                self._memory.object = self._memory_html()
            if "collectives" in kinds:
                self._comm.object = self._comm_html()
            if kinds & {"checkpoint", "checkpoint_rejected"}:
                self._checkpoints.object = self._checkpoint_html()
                for kind, cols in self.digest.checkpoint_timeline().items():
                    if cols["step"] != self.checkpoint_sources[kind].data["step"]:
                        self.checkpoint_sources[kind].data = cols
            if "step" in kinds:
                step, load = self.digest.experts()
                if step is not None:
                    self.experts.data = heatmap_rects(load)
                    if not self._expert_slot.objects:
                        self._expert_slot.append(self._expert_pane)
        self._refresh_pipeline(force=self._ended(status))
        self._headline.object = self._headline_html(status)

    def _fold(self, events: list) -> None:
        """One stretch of a batch into the digest and the curves (a stretch begins at a resume)."""
        out = self.digest.add(events)
        if out["resumed"]:  # the steps after the checkpoint run again: drop the lost attempt's tail
            self._trim(min(out["resumed"]))
        if out["curves"]["step"]:
            self._fit_steps(max(out["curves"]["step"]))
            self.curves.stream(out["curves"])
        if out["step_times"]["step"]:
            self.step_source.stream(out["step_times"])
        if out["markers"] is not None:
            self._show_marks(out["markers"])

    def _fit_steps(self, last: int) -> None:
        """The step axis from 0 to the run's planned steps, or past them to ``last``."""
        config = self.session.config
        end = max(last, config.train.steps_to_run if config is not None else 1, 1) + 0.5
        if (self.x_range.start, self.x_range.end) != (0, end):
            self.x_range.update(start=0, end=end)

    def _ended(self, status: Any) -> bool:
        """The run has ended: its launcher says so, or (a replay) its events do."""
        if status is not None:
            return status.state not in ("starting", "running")
        return self.digest.outcome().state in ENDED

    def _trim(self, step: int) -> None:
        """Keep the curve rows of steps <= ``step`` (1-based: steps completed before the resume)."""
        for src in (self.curves, self.step_source):
            keep = [i for i, s in enumerate(src.data["step"]) if s <= step]
            if len(keep) < len(src.data["step"]):
                src.data = {k: [v[i] for i in keep] for k, v in src.data.items()}

    def _refresh_pipeline(self, force: bool = False) -> None:
        """Draw the latest step every pipeline rank reported, at most every PIPELINE_REFRESH_S while
        the run goes on, and its last step as soon as it has ended."""
        now = time.monotonic()
        if not force and now - self._pipeline_at < PIPELINE_REFRESH_S:
            return
        step, actions = self.digest.pipeline()
        if step is None or step == self._pipeline_step:
            return
        self._pipeline_step, self._pipeline_at = step, now
        self.pipeline.show_measured(actions)
        self._pipe_note.object = cards([card("Measured step", str(step + 1), "measured-step",
                                             note="the latest step every pipeline rank reported")])

    def _show_marks(self, cols: dict[str, list[Any]]) -> None:
        """Draw the run's marks (all of them: they replace the previous ones) and list the latest."""
        self.marks = [{"step": st, "kind": k, "label": lb} for st, k, lb in zip(cols["step"], cols["kind"], cols["label"])]
        data = {"step": list(cols["step"]), "kind": list(cols["kind"]), "label": list(cols["label"]),
                "color": [MARK_COLORS.get(k, "#555") for k in cols["kind"]]}
        if data != self.mark_source.data:
            self.mark_source.data = data
        rows = [[m["step"], m["kind"], m["label"]] for m in self.marks[-20:]]
        self._marks_pane.object = (Html("<b>Marked on the curves</b>") + table(["step", "kind", "what"], rows,
                                                                               testid="run-marks", numeric=(0,))
                                   if rows else Html(""))

    # ---- html pieces
    def _headline_html(self, status: Any = None) -> Html:
        d = self.digest
        if not self.session.run_dir:
            return muted("No run yet: start one in 6 · Launch, or open a finished one in 8 · Compare.")
        n = len(self.curves.data["step"])
        loss = self.curves.data["loss"][-1] if n else None
        tps = self.curves.data["tokens_per_s"][-1] if n else None
        total = self.session.config.train.steps_to_run if self.session.config else None
        outcome = d.outcome()
        if status is not None:
            state, note = status.state, ""
        else:  # a replay: what its events say
            state, note = outcome.state, ("replay of the run directory" if self.session.replay else "")
        tone = {"failed": "bad", "stopped": "warn", "finished": "good"}.get(state, "")
        items = [
            card("State", state, "live-state", note=note or outcome.why[:120], tone=tone),
            card("Step", f"{d.last_step or 0}" + (f" / {total}" if total else ""), "live-step"),
            card("Loss", "-" if loss is None else f"{loss:.4f}", "live-loss"),
            card("Tokens/s", "-" if tps is None else f"{tps:,.0f}", "live-tps"),
            card("Points", str(n), "live-points", note="on the loss curve"),
            card("Events", f"{d.events:,}", "live-events"),
        ]
        failures = d.failures()
        if failures:
            items.append(card("Errors", str(len(failures)), "live-errors", note=failures[0][:120], tone="bad"))
        else:
            stopped = [m for m in outcome.errors if m.role != "failure"]
            items.append(card("Errors", "0", "live-errors",
                              note=f"{len(stopped)} raised by a stop or before a resume, not failures" if stopped else ""))
        return cards(items)

    def _ranks_html(self) -> Html:
        """Each rank as the run directory says (workbench.rundir.status): the same verdict as compare."""
        rows = outcome_rows(self.digest.outcome())
        if not rows:
            return Html("")
        return (Html("<b>Ranks</b> (from the run directory)")
                + table(["rank", "state", "steps", "why"], rows, testid="live-ranks", numeric=(0, 2)))

    def _memory_html(self) -> Html:
        rows = []
        for r in self.digest.memory():
            cells = [r["rank"]]
            for k in ("parameters", "gradients", "optimizer", "activations"):
                p = r[f"{k}_predicted"]
                cells.append(f"{format_bytes(r[k])} / {format_bytes(p) if p is not None else '-'}")
            rows.append(cells)
        return (Html("<b>Memory per rank</b> (measured / predicted)")
                + table(["rank", "parameters", "gradients", "optimizer", "activations (peak)"], rows,
                        testid="live-memory", numeric=(0, 1, 2, 3, 4)))

    def _comm_html(self) -> Html:
        rows = []
        for r in self.digest.comm_rows():
            share = f"{r['busbw'] / r['peak']:.1%}" if r["peak"] else "-"
            rows.append([r["dim"], r["op"], r["tier"] or "-", f"{r['calls']:.1f}", format_bytes(r["bytes"]),
                         format_seconds(r["time_s"]), _rate(r["busbw"]), _rate(r["peak"]), share])
        return (Html("<b>Communication per group</b> (per step and rank)")
                + table(["group", "op", "link", "calls", "bytes", "time", "bus bw", "link peak", "of peak"], rows,
                        testid="live-comm", numeric=(3, 4, 5, 6, 7, 8)))

    def _checkpoint_html(self) -> Html:
        rows = self.digest.checkpoints()
        t0 = rows[0]["t"] if rows else 0.0
        cells = [[r["step"], r["phase"], r["mode"], f"+{r['t'] - t0:,.2f} s",
                  format_bytes(r["bytes"]) if r["bytes"] else "-",
                  format_seconds(r["duration_s"]) if r["duration_s"] else "-"] for r in rows[-24:]]
        return (Html("<b>Checkpoints</b> (save: started, staged, written, committed, verified; restore: verified, "
                     "loaded)")
                + table(["step", "phase", "mode", "when", "bytes", "duration"], cells, testid="live-checkpoints",
                        numeric=(0, 3, 4, 5)))

    def panel(self) -> pn.viewable.Viewable:
        if self._layout is None:
            grid = pn.GridBox(*[pn.pane.Bokeh(f) for f in self.figures.values()], ncols=2)
            self._layout = pn.Column(
                self._headline,
                self._ranks,
                grid,
                pn.pane.Bokeh(self.checkpoint_figure),
                self._marks_pane,
                pn.pane.Markdown("### Pipeline: measured (latest step) beside simulated", margin=(10, 10, 0, 10)),
                self._pipe_note,
                self._pipeline_slot,
                pn.pane.Bokeh(self.step_figure),
                pn.Row(self._memory, self._expert_slot),
                self._comm,
                self._checkpoints,
                sizing_mode="stretch_width",
            )
        return self._layout

    def __panel__(self) -> pn.viewable.Viewable:
        return self.panel()
