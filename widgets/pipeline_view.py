"""View 5, pipeline bubbles: the simulated timeline of a schedule (a Gantt chart per pipeline
rank: forward, backward, input-gradient and weight-gradient actions, labelled by micro-batch)
with its bubble fraction.

The same drawing takes *measured* actions (records with ``rank, stage, microbatch, kind, start,
end``, as the trainer's pipeline events carry): :meth:`PipelineView.show_measured` draws them
beside the simulation, with the predicted and measured bubble fractions side by side.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import holoviews as hv
import holoviews.plotting.bokeh  # noqa: F401  (registers the backend .opts() needs, without notebook output)
import panel as pn
import param

from workbench import ConfigError, RunConfig, predict_step, simulate_schedule
from workbench.predict.comms import p2p_time
from workbench.spec.plan import SCHEDULES

from widgets.state import PlanState
from widgets.transforms import KIND_COLORS, KIND_NAMES, bubble_fraction_of, gantt_rects
from widgets.ui import FieldErrors, card, cards, html_pane, muted


def gantt_figure(actions: Iterable[Any], title: str, time_unit: str = "", scale: float = 1.0,
                 width: int = 900) -> hv.Overlay:
    """Gantt chart of pipeline actions: one row per rank (rank 0 on top), one box per action
    coloured by kind, labelled by micro-batch. ``scale`` multiplies times (1e3: seconds -> ms)."""
    rects = gantt_rects(actions)
    for r in rects:
        for k in ("x0", "x1", "xc", "start", "end"):
            r[k] *= scale
        r["kind_name"] = KIND_NAMES.get(r["kind"], r["kind"])
    n_ranks = 1 + max((r["rank"] for r in rects), default=0)
    els = []
    for kind, color in KIND_COLORS.items():
        rs = [r for r in rects if r["kind"] == kind]
        if rs:
            els.append(hv.Rectangles(rs, kdims=["x0", "y0", "x1", "y1"],
                                     vdims=["rank", "stage", "microbatch", "kind_name", "start", "end"],
                                     label=KIND_NAMES[kind]).opts(
                color=color, line_color="white", line_width=1, tools=["hover"],
                hover_tooltips=[("rank", "@rank"), ("stage", "@stage"), ("micro-batch", "@microbatch"),
                                ("action", "@kind_name"), ("start", "@start{0.000}"), ("end", "@end{0.000}")]))
    if len(rects) <= 600:
        els.append(hv.Labels(rects, kdims=["xc", "yc"], vdims=["label"]).opts(
            text_color="white", text_font_size="8pt"))
    unit = f" ({time_unit})" if time_unit else ""
    return hv.Overlay(els).opts(
        title=title, xlabel=f"time{unit}", ylabel="pipeline rank", invert_yaxis=True,
        yticks=[(r, str(r)) for r in range(n_ranks)], ylim=(-0.6, n_ranks - 0.4),
        width=width, height=110 + 42 * n_ranks, legend_position="bottom", toolbar=None, shared_axes=False,
        legend_opts={"orientation": "horizontal"}, show_grid=False,
    )


class PipelineView(pn.viewable.Viewer):
    """A pipeline schedule simulated (and, when given, measured). Stand-alone by default; "Use the
    plan" takes the schedule, degrees, micro-batches and predicted stage times of ``state``."""

    state = param.ClassSelector(class_=PlanState)
    schedule = param.Selector(default="1f1b", objects=list(SCHEDULES))
    pp = param.Integer(default=4, allow_None=True)
    n_microbatches = param.Integer(default=8, allow_None=True)
    virtual_stages = param.Integer(default=1, allow_None=True)
    stage_times = param.Parameter(default=None, doc="None: unit times (F=1, B=2); else per stage (f, b) in s")
    p2p_time = param.Number(default=0.0)
    measured = param.List(default=[], doc="Measured actions (rank, stage, microbatch, kind, start, end), s")

    def __init__(self, state: PlanState | None = None, **params: Any):
        super().__init__(state=state or PlanState(), **params)
        self._errors = FieldErrors("pipeline")
        p = self.param
        self._controls = [
            self._errors.wrap("pp_schedule", pn.widgets.Select.from_param(p.schedule, label="schedule", width=170)),
            self._errors.wrap("pp", pn.widgets.IntInput.from_param(p.pp, label="pp", width=90, start=1)),
            self._errors.wrap("n_microbatches", pn.widgets.IntInput.from_param(
                p.n_microbatches, label="micro-batches (m)", width=130, start=1)),
            self._errors.wrap("virtual_stages", pn.widgets.IntInput.from_param(
                p.virtual_stages, label="virtual_stages (v)", width=130, start=1)),
        ]
        self._use_plan = pn.widgets.Button(label="Use the plan", color="primary", variant="outline",
                                           icon="arrow-down", margin=(22, 10, 0, 10))
        self._use_plan.on_click(lambda _e: self.use_plan())
        self._plan_note = html_pane("", margin=(26, 10, 0, 10))
        self._layout = None

    # ------------------------------------------------------------------ inputs
    def use_plan(self, config: RunConfig | None = None) -> bool:
        """Take the schedule, pp, micro-batches, virtual stages and the predicted per-stage times
        of ``config`` (default: the state's). False when the plan has no pipeline."""
        config = config or self.state.config
        if config is None or config.plan.pp == 1:
            self._plan_note.object = muted("The current plan has no pipeline (pp = 1).")
            return False
        pred = predict_step(config)
        self.param.update(
            schedule=config.plan.pp_schedule, pp=config.plan.pp, n_microbatches=config.n_microbatches,
            virtual_stages=config.plan.virtual_stages, stage_times=tuple(pred.stage_times_s),
            p2p_time=p2p_time(config),
        )
        self._plan_note.object = muted(f"Predicted stage times of {config.plan.describe()}")
        return True

    @param.depends("schedule", "pp", "n_microbatches", "virtual_stages", watch=True)
    def _back_to_unit_times(self) -> None:
        # per-stage times belong to one plan's stages; a hand edit makes them meaningless
        if self.stage_times is not None and len(self.stage_times) != (self.pp or 0) * (self.virtual_stages or 0):
            self.param.update(stage_times=None, p2p_time=0.0)
            self._plan_note.object = ""

    def show_measured(self, actions: Sequence[Any]) -> None:
        """Draw measured pipeline actions beside the simulation (times in seconds)."""
        self.measured = list(actions)

    def simulate(self):
        """The ScheduleResult of the current inputs (raises ConfigError on invalid ones)."""
        return simulate_schedule(self.schedule, self.pp, self.n_microbatches, self.virtual_stages,
                                 stage_times=self.stage_times, p2p_time=self.p2p_time)

    # ------------------------------------------------------------------ rendered pieces
    @param.depends("schedule", "pp", "n_microbatches", "virtual_stages", "stage_times", "p2p_time", "measured")
    def _view(self) -> pn.viewable.Viewable:
        try:
            result = self.simulate()
        except ConfigError as err:
            self._errors.show(str(err), err.field)
            return pn.pane.Markdown("*No timeline: fix the highlighted field.*")
        except TypeError as err:  # an emptied number box
            self._errors.show(str(err), None)
            return pn.pane.Markdown("*No timeline: fill in every field.*")
        self._errors.show(None, None)
        timed = self.stage_times is not None
        unit, scale = ("ms", 1e3) if timed else ("units: F = 1, B = 2", 1.0)
        step = result.step_time * scale
        items = [
            card("Bubble fraction", f"{result.bubble_fraction:.1%}", "bubble-fraction",
                 note="idle share of ranks × step"),
            card("Step", f"{step:,.1f} {'ms' if timed else 'units'}", "sim-step",
                 note=f"busy {max(result.busy_time) * scale:,.1f}"),
            card("Peak in flight", str(max(result.peak_in_flight_per_rank)), "peak-in-flight",
                 note="micro-batches held by the busiest rank"),
        ]
        if self.measured:
            measured_bubble = bubble_fraction_of(self.measured)
            items.append(card("Measured bubble", f"{measured_bubble:.1%}", "measured-bubble",
                              note=f"predicted {result.bubble_fraction:.1%}"))
        title = (f"Simulated: {self.schedule}, pp={self.pp}, m={self.n_microbatches}"
                 + (f", v={self.virtual_stages}" if self.virtual_stages > 1 else ""))
        figs = [pn.pane.HoloViews(gantt_figure(result.actions, title, unit, scale), backend="bokeh")]
        if self.measured:
            figs.append(pn.pane.HoloViews(gantt_figure(self.measured, "Measured", "ms", 1e3), backend="bokeh"))
        return pn.Column(html_pane(cards(items)), *figs)

    def panel(self) -> pn.viewable.Viewable:
        if self._layout is None:
            self._layout = pn.Column(
                pn.FlexBox(*self._controls, self._use_plan, self._plan_note),
                self._errors.general,
                pn.panel(self._view),
                pn.pane.Markdown(
                    "F forward, B full backward; zero-bubble schedules split the backward into I (input "
                    "gradient, on the critical path) and W (weight gradient, moved into the bubbles). "
                    "Orders are those torch.distributed.pipelining (torch 2.13) runs.",
                    styles={"color": "#5a6570", "font-size": "12px"},
                ),
                sizing_mode="stretch_width",
            )
        return self._layout

    def __panel__(self) -> pn.viewable.Viewable:
        return self.panel()
