"""View 5, pipeline bubbles: the plan's own pipeline, and what if it ran another schedule.

On top, the plan's pipeline as the plan's one prediction has it (``state.prediction``): its step
time and bubble (the numbers the sidebar shows, ``predict_step``'s), and the timeline of its
schedule simulated with the plan's predicted stage times (a Gantt chart per pipeline rank:
forward, backward, input-gradient and weight-gradient actions, labelled by micro-batch, and by
stage where a rank holds several).

Below, a "what if": any schedule, pp, micro-batches and virtual stages in unit times. A rank's
work per micro-batch is F = 1, B = 2 whatever v: each of its v chunks does F = 1/v, B = 2/v (a
zero-bubble schedule splits B into I = W = 1/v), so interleaved and V schedules compare with
1F1B on the same model. "Start from the plan" fills it with the plan's schedule and stage times.

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

from workbench import ConfigError, RunConfig, simulate_schedule
from workbench.spec.plan import SCHEDULES

from widgets.icons import icon
from widgets.markup import Html, concat
from widgets.state import PlanPrediction, PlanState, prediction_of
from widgets.transforms import KIND_COLORS, bubble_fraction_of, gantt_rects, kind_words, step_headline, unit_stage_times
from widgets.ui import FieldErrors, card, cards, html_pane, muted

LABEL_PX_PER_CHAR = 6.5  # 8pt text: a label is drawn only inside a box wide enough for it


def gantt_figure(actions: Iterable[Any], title: str, time_unit: str = "", scale: float = 1.0,
                 width: int = 900) -> hv.Overlay:
    """Gantt chart of pipeline actions: one row per rank (rank 0 on top), one box per action
    coloured by kind (a rank's later chunks lighter), labelled by micro-batch (and stage, where a
    rank holds several) where the label fits; hover for rank, stage, micro-batch and times.
    ``scale`` multiplies times (1e3: seconds -> ms)."""
    rects = gantt_rects(actions)
    for r in rects:
        for k in ("x0", "x1", "xc", "start", "end"):
            r[k] *= scale
        r["kind_name"] = kind_words(r["kind"])
        r["alpha"] = 1.0 if r["chunk"] % 2 == 0 else 0.62
    n_ranks = 1 + max((r["rank"] for r in rects), default=0)
    els = []
    for kind, color in KIND_COLORS.items():
        rs = [r for r in rects if r["kind"] == kind]
        if rs:
            els.append(hv.Rectangles(rs, kdims=["x0", "y0", "x1", "y1"],
                                     vdims=["rank", "stage", "microbatch", "kind_name", "start", "end", "alpha",
                                            "label"],
                                     label=kind_words(kind)).opts(
                color=color, alpha="alpha", line_color="white", line_width=1, tools=["hover"],
                hover_tooltips=[("rank", "@rank"), ("stage", "@stage"), ("micro-batch", "@microbatch"),
                                ("action", "@kind_name"), ("start", "@start{0.000}"), ("end", "@end{0.000}")]))
    span = max((r["x1"] for r in rects), default=1.0) - min((r["x0"] for r in rects), default=0.0)
    px_per_unit = 0.9 * width / span if span > 0 else 0.0
    fitting = [r for r in rects if (r["x1"] - r["x0"]) * px_per_unit >= LABEL_PX_PER_CHAR * len(r["label"]) + 2]
    if fitting and len(fitting) <= 600:
        els.append(hv.Labels(fitting, kdims=["xc", "yc"], vdims=["label"]).opts(
            text_color="white", text_font_size="8pt"))
    unit = f" ({time_unit})" if time_unit else ""
    return hv.Overlay(els).opts(
        title=title, xlabel=f"time{unit}", ylabel="pipeline rank", invert_yaxis=True,
        yticks=[(r, str(r)) for r in range(n_ranks)], ylim=(-0.6, n_ranks - 0.4),
        width=width, height=110 + 42 * n_ranks, legend_position="bottom", toolbar=None, shared_axes=False,
        legend_opts={"orientation": "horizontal"}, show_grid=False,
    )


def plan_pipeline_cards(pred: PlanPrediction) -> Html:
    """The plan's step and bubble (the sidebar's numbers) and its simulated pipeline timeline."""
    head = step_headline(pred.step)
    config = pred.config
    items = [
        card("Step time", head["step"], "plan-step", note=f"MFU {head['mfu']}"
             + (f" ({head['mfu_fp8']} of the FP8 peak)" if head["mfu_fp8"] else "") + ": the sidebar's prediction"),
        card("Bubble", head["bubble"], "plan-bubble",
             note=f"pipeline rank {pred.step.critical_pp_rank} idle, share of the step"),
    ]
    r = pred.schedule
    if r is not None:
        items.append(card("Pipeline timeline", f"{r.step_time * 1e3:,.1f} ms", "plan-timeline",
                          note=f"{config.n_microbatches} micro-batches; the step adds the optimizer and "
                               "exposed data-parallel traffic"))
        items.append(card("Peak in flight", str(max(r.peak_in_flight_per_rank)), "plan-peak-in-flight",
                          note="micro-batches held by the busiest rank"))
    return cards(items)


class PipelineView(pn.viewable.Viewer):
    """The plan's pipeline (``state.prediction``) and a "what if" schedule beside it, simulated
    (and, when given, measured). "Start from the plan" takes the schedule, degrees, micro-batches
    and predicted stage times of ``state`` into the what-if."""

    state = param.ClassSelector(class_=PlanState)
    show_plan = param.Boolean(default=True, doc="Show the plan's own pipeline above the what-if")
    schedule = param.Selector(default="1f1b", objects=list(SCHEDULES))
    pp = param.Integer(default=4, allow_None=True)
    n_microbatches = param.Integer(default=8, allow_None=True)
    virtual_stages = param.Integer(default=1, allow_None=True)
    stage_times = param.Parameter(default=None, doc="None: unit times (F = 1/v, B = 2/v per chunk); else per stage (f, b) in s")
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
        self._use_plan = pn.widgets.Button(label="Start from the plan", color="primary", variant="outline",
                                           icon=icon("use"), margin=(22, 10, 0, 10))
        self._use_plan.on_click(lambda _e: self.use_plan())
        self._plan_note = html_pane("", margin=(26, 10, 0, 10))
        self._layout = None

    # ------------------------------------------------------------------ inputs
    def use_plan(self, config: RunConfig | None = None) -> bool:
        """Take the schedule, pp, micro-batches, virtual stages and the predicted per-stage times
        of ``config`` (default: the state's) into the what-if. False when the plan has no pipeline."""
        pred = self.state.prediction if config is None else prediction_of(config)
        if pred is None or pred.config.plan.pp == 1:
            self._plan_note.object = muted("The current plan has no pipeline (pp = 1).")
            return False
        config = pred.config
        self.param.update(
            schedule=config.plan.pp_schedule, pp=config.plan.pp, n_microbatches=config.n_microbatches,
            virtual_stages=config.plan.virtual_stages, stage_times=tuple(pred.step.stage_times_s),
            p2p_time=pred.p2p_time_s,
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
        """The ScheduleResult of the what-if's inputs (raises ConfigError on invalid ones); unit
        times split each rank's F = 1, B = 2 over its v chunks."""
        times = self.stage_times
        if times is None:
            simulate_schedule(self.schedule, self.pp, self.n_microbatches, self.virtual_stages)  # validates
            times = unit_stage_times(self.pp, self.virtual_stages)
        return simulate_schedule(self.schedule, self.pp, self.n_microbatches, self.virtual_stages,
                                 stage_times=times, p2p_time=self.p2p_time)

    # ------------------------------------------------------------------ rendered pieces
    def _plan_view(self, pred: PlanPrediction | None) -> pn.viewable.Viewable:
        if pred is None:
            return pn.pane.Markdown("*No plan: the configuration is invalid (see the other tabs).*")
        config = pred.config
        parts: list[Any] = [html_pane(plan_pipeline_cards(pred))]
        if pred.schedule is None:
            parts.append(html_pane(muted(f"{config.plan.describe()} has no pipeline (pp = 1): nothing waits "
                                         "for another stage.", "plan-no-pipeline")))
        else:
            p = config.plan
            title = (f"The plan: {p.pp_schedule}, pp={p.pp}, m={config.n_microbatches}"
                     + (f", v={p.virtual_stages}" if p.virtual_stages > 1 else "") + " (predicted stage times)")
            parts.append(pn.pane.HoloViews(gantt_figure(pred.schedule.actions, title, "ms", 1e3), backend="bokeh"))
        return pn.Column(*parts, margin=0)

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
        v = self.virtual_stages
        unit, scale = ("ms", 1e3) if timed else (
            "units: F = 1, B = 2 per rank" + (f", each of its {v} chunks 1/{v} of that" if v > 1 else ""), 1.0)
        step = result.step_time * scale
        items = [
            card("Bubble fraction", f"{result.bubble_fraction:.1%}", "bubble-fraction",
                 note="idle share of ranks × timeline"),
            card("Timeline", f"{step:,.1f} {'ms' if timed else 'units'}", "sim-step",
                 note=f"busy {max(result.busy_time) * scale:,.1f}"),
            card("Peak in flight", str(max(result.peak_in_flight_per_rank)), "peak-in-flight",
                 note="micro-batches held by the busiest rank"),
        ]
        if self.measured:
            measured_bubble = bubble_fraction_of(self.measured)
            items.append(card("Measured bubble", f"{measured_bubble:.1%}", "measured-bubble",
                              note=f"predicted {result.bubble_fraction:.1%}"))
        title = (f"What if: {self.schedule}, pp={self.pp}, m={self.n_microbatches}"
                 + (f", v={self.virtual_stages}" if self.virtual_stages > 1 else ""))
        figs = [pn.pane.HoloViews(gantt_figure(result.actions, title, unit, scale), backend="bokeh")]
        if self.measured:
            figs.append(pn.pane.HoloViews(gantt_figure(self.measured, "Measured", "ms", 1e3), backend="bokeh"))
        return pn.Column(html_pane(cards(items)), *figs)

    def panel(self) -> pn.viewable.Viewable:
        if self._layout is None:
            plan_part: list[Any] = []
            if self.show_plan:
                plan_part = [
                    html_pane(Html("<h3>The plan's pipeline</h3>"), margin=(0, 10)),
                    pn.panel(pn.bind(self._plan_view, self.state.param.prediction)),
                ]
            self._layout = pn.Column(
                *plan_part,
                html_pane(concat(Html("<h3>What if: another schedule</h3>"),
                                 muted("Unit times unless started from the plan; the plan above is unchanged.")),
                          margin=(10, 10, 0, 10)),
                pn.FlexBox(*self._controls, self._use_plan, self._plan_note),
                self._errors.general,
                pn.panel(self._view),
                pn.pane.Markdown(
                    "F forward, B full backward; zero-bubble schedules split the backward into I (input "
                    "gradient, on the critical path) and W (weight gradient, moved into the bubbles). A rank "
                    "holding v stages (interleaved, V schedules) does 1/v of its work per chunk; boxes of its "
                    "later chunks are lighter; a box labelled s3·7 is stage 3, micro-batch 7. "
                    "Orders are those torch.distributed.pipelining (torch 2.13) runs.",
                    styles={"color": "#5a6570", "font-size": "12px"},
                ),
                sizing_mode="stretch_width",
            )
        return self._layout

    def __panel__(self) -> pn.viewable.Viewable:
        return self.panel()
