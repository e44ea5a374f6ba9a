"""View 2, the memory bill: bytes per component on the most loaded rank and on every pipeline
rank, against the GPU's HBM; toggles for recomputation, precision and ZeRO stage, and the
framework profile that prices the bill (built in, or a fitted profile JSON), whose error band
the bill states.

The bill is the plan's one prediction (``state.prediction.bill``, ``workbench.estimate_memory``):
the cards, the table and the bars all read it, so they show the same bytes. The bars are
:func:`widgets.transforms.memory_bars`, stacked in the bill's component order. The charts are
plain Bokeh figures whose data is replaced in place, so a toggle costs milliseconds, not a new
figure; in a notebook the change is pushed to the page (``pn.io.push_notebook``), which a
server does by itself.

Beside recompute sits the attention kernel (``TrainSettings.attention``): flash attention keeps no
scores, so selective recompute saves only what the attention core keeps besides them; eager
attention keeps the ``s x s`` scores and softmax, which selective recompute drops. The precision
follows the cluster (bf16 on GPUs, fp32 on the CPU cluster) until one is chosen here.
"""

from __future__ import annotations

from typing import Any

import panel as pn
import param
from bokeh.models import ColumnDataSource, FactorRange, HoverTool, Range1d, Span
from bokeh.plotting import figure

from workbench import RunConfig
from workbench.predict.memory import COMPONENTS

from widgets.framework_control import FrameworkPicker
from widgets.markup import Html, concat
from widgets.state import PlanPrediction, PlanState, prediction_of
from widgets.transforms import (
    ATTENTION_CHOICES,
    COMPONENT_COLORS,
    RECOMPUTE_CHOICES,
    attention_words,
    band_text,
    component_words,
    format_bytes,
    memory_axis,
    memory_bars,
    memory_summary,
    recompute_words,
    stack_columns,
)
from widgets.ui import FieldErrors, card, cards, html_pane, labelled, muted, swatch, table


class BillChart:
    """A stacked-bar chart of memory components (Bokeh) whose data is replaced in place: an update
    sends new column values, not a new figure (the ~100 ms budget of a toggle)."""

    def __init__(self, title: str, width: int, legend: bool):
        self.source = ColumnDataSource(data={"bar": [], "unit": [], **{c: [] for c in COMPONENTS}})
        self.figure = figure(x_range=FactorRange(), y_range=Range1d(0, 1), height=380, width=width, title=title,
                             toolbar_location=None, tools="")
        renderers = self.figure.vbar_stack(
            list(COMPONENTS), x="bar", width=0.65, source=self.source, line_color="white",
            color=[COMPONENT_COLORS[c] for c in COMPONENTS],
            **({"legend_label": [component_words(c) for c in COMPONENTS]} if legend else {}),
        )
        self.figure.add_tools(HoverTool(renderers=renderers, tooltips=[
            ("rank", "@bar"), ("component", "$name"), ("size", "@$name{0,0.00} @unit")]))
        self.hbm = Span(location=0, dimension="width", line_color="#c62828", line_dash="dashed", line_width=2)
        self.figure.add_layout(self.hbm)
        if legend:
            self.figure.legend.location = "top_left"
            self.figure.add_layout(self.figure.legend[0], "right")
        self.figure.xgrid.grid_line_color = None
        self.figure.title.text_font_size = "14px"

    def update(self, records: list[dict[str, Any]], axis: dict[str, Any], title: str | None = None) -> None:
        cols = stack_columns(records)
        cols["unit"] = [axis["unit_name"]] * len(cols["bar"])
        self.figure.x_range.factors = cols["bar"]
        self.source.data = cols
        self.figure.y_range.end = axis["ymax"]
        self.figure.yaxis.axis_label = axis["unit_name"]
        self.hbm.location = axis["hbm"]
        if title is not None:
            self.figure.title.text = title


def bill_chart_data(source: "PlanPrediction | RunConfig | None") -> dict[str, Any]:
    """What the two charts show (the prediction's bill): bar records, the axis, the per-stage
    chart's title, and the peak the bars reach (``peak_bytes``, the cards' number)."""
    pred = prediction_of(source)
    if pred is None:
        return {"peak": [], "stages": [], "title": "Per pipeline rank (no bill)", "peak_bytes": 0,
                "axis": {"unit_name": "GiB", "unit": 1 << 30, "ymax": 1.0, "hbm": 2.0, "show_hbm": False}}
    bill = pred.bill
    axis = memory_axis(bill)
    bars = memory_bars(bill, axis["unit"])
    note = (f"dashed: HBM {axis['hbm']:.0f} {axis['unit_name']}" if axis["show_hbm"]
            else f"HBM {format_bytes(bill.hbm_bytes)} is far above")
    return {**bars, "axis": axis, "title": f"Per pipeline rank ({note})", "peak_bytes": bill.peak_bytes}


def precision_note(state: PlanState) -> Html:
    """Where the precision comes from: the cluster, or the user's choice."""
    if state.precision_follows_cluster:
        return muted(f"{state.precision}: follows the cluster ({state.cluster})", "precision-source")
    return muted(f"{state.precision}: chosen here (the cluster's recipe is {state.cluster_precision})",
                 "precision-source")


def bill_notes(config: RunConfig) -> Html:
    """Why a toggle changes what it changes: ZeRO without data parallelism, and what selective
    recompute saves under the chosen attention kernel."""
    plan, train = config.plan, config.train
    notes = []
    if plan.shard_degree == 1:
        notes.append(muted(
            f"ZeRO changes nothing here: it shards model states over the data-parallel ranks "
            f"(data parallel (sharded) × context = {plan.shard_degree}), and this plan has no data "
            "parallelism to shard over; every stage gives the same bill.", "zero-note"))
    if train.recompute == "selective":
        saves = ("drops the s × s attention scores and softmax the eager kernel keeps" if train.attention == "eager"
                 else "saves little: flash attention keeps no scores, only its log-sum-exp is dropped")
        notes.append(muted(f"{recompute_words(train.recompute)} with {attention_words(train.attention)} {saves}.",
                           "recompute-note"))
    else:
        notes.append(muted(f"{recompute_words(train.recompute)}, {attention_words(train.attention)}.",
                           "recompute-note"))
    return concat(*notes)


class MemoryView(pn.viewable.Viewer):
    """The memory bill of ``state.prediction`` (a fresh :class:`PlanState` when none is given)."""

    state = param.ClassSelector(class_=PlanState)

    def __init__(self, state: PlanState | None = None, **params: Any):
        super().__init__(state=state or PlanState(), **params)
        s = self.state.param
        self._errors = FieldErrors("set it in the Model or Mesh tab")
        self.framework = FrameworkPicker(self.state)
        self._precision_note = html_pane(precision_note(self.state), margin=(0, 10))
        self._follow = pn.widgets.Button(label="Follow the cluster", variant="outline", width=150, margin=(0, 10),
                                         visible=not self.state.precision_follows_cluster)
        self._follow.on_click(lambda _e: setattr(self.state, "precision_follows_cluster", True))
        self._controls = [
            self._errors.wrap("recompute", labelled("recompute", pn.widgets.RadioButtonGroup.from_param(
                s.recompute, options=RECOMPUTE_CHOICES, color="primary", variant="outline", width=300))),
            self._errors.wrap("attention", labelled("attention kernel", pn.widgets.RadioButtonGroup.from_param(
                s.attention, options=ATTENTION_CHOICES, color="primary", variant="outline", width=150))),
            self._errors.wrap("precision", pn.Column(
                pn.widgets.Select.from_param(s.precision, label="precision", width=160),
                self._precision_note, self._follow, margin=0)),
            self._errors.wrap("zero_stage", labelled("ZeRO stage", pn.widgets.RadioButtonGroup.from_param(
                s.zero_stage, color="primary", variant="outline", width=200))),
            self._errors.wrap("seq_len", pn.widgets.IntInput.from_param(s.seq_len, label="sequence length", width=130)),
            self._errors.wrap("micro_batch_size", pn.widgets.IntInput.from_param(
                s.micro_batch_size, label="micro-batch size", width=140)),
            self._errors.wrap("global_batch_size", pn.widgets.IntInput.from_param(
                s.global_batch_size, label="global batch size (0 = auto)", width=190)),
            self._errors.wrap("framework", self.framework.panel()),
        ]
        self.state.param.watch(self._on_error, ["error", "error_field"])
        self.state.param.watch(self._on_precision, ["precision", "precision_follows_cluster", "cluster"])
        self._on_error()
        self._layout = None

    def _on_error(self, *_: Any) -> None:
        self._errors.show(self.state.error or None, self.state.error_field or None)

    def _on_precision(self, *_: Any) -> None:
        self._precision_note.object = precision_note(self.state)
        self._follow.visible = not self.state.precision_follows_cluster

    # ------------------------------------------------------------------ rendered pieces
    @staticmethod
    def summary_html(source: "PlanPrediction | RunConfig | None") -> Html:
        """The cards and the table of the prediction's bill (a RunConfig finds its prediction)."""
        pred = prediction_of(source)
        if pred is None:
            return cards([card("Peak memory", "—", "peak-memory", note="invalid configuration", tone="bad")])
        config = pred.config
        s = memory_summary(pred.bill)
        tone = "good" if s["fits"] else "bad"
        verdict = "fits" if s["fits"] else "does not fit"
        head = (f'{format_bytes(s["headroom_bytes"])} free ({s["headroom_fraction"]:.0%})' if s["fits"]
                else f'over by {format_bytes(-s["headroom_bytes"])}')
        rows = [
            (swatch(COMPONENT_COLORS[c]), component_words(c), format_bytes(b), f"{b / s['peak_bytes']:.1%}")
            for c, b in s["components"].items()
        ]
        profile = config.train.profile
        band = band_text(profile, pred.step.step_time_s)
        return cards([
            card("Peak memory", format_bytes(s["peak_bytes"]), "peak-memory",
                 note=f'rank {s["most_loaded_rank"]} (pp rank {s["pp_rank"]})', tone=tone),
            card("GPU memory", format_bytes(s["hbm_bytes"]), "hbm", note=config.cluster.gpu.name),
            card("Verdict", verdict, "fit-status", note=head, tone=tone),
            card("Framework", profile.name, "framework-profile", note=band_text(profile)),
        ]) + table(["", "component", "bytes", "share"], rows, testid="memory-components", numeric=(2, 3)) + muted(
            f"Predicted {band}", "bill-band") + bill_notes(config)

    def _figures(self) -> pn.Row:
        self._peak_chart = BillChart("Most loaded rank", 230, legend=False)
        self._stage_chart = BillChart("Per pipeline rank", 620, legend=True)
        self._chart_panes = (pn.pane.Bokeh(self._peak_chart.figure), pn.pane.Bokeh(self._stage_chart.figure))
        self.state.param.watch(lambda _e: self._update_charts(), "prediction")
        self._update_charts()
        return pn.Row(*self._chart_panes)

    def _update_charts(self) -> None:
        data = bill_chart_data(self.state.prediction)
        self._peak_chart.update(data["peak"], data["axis"])
        self._stage_chart.update(data["stages"], data["axis"], data["title"])
        # a notebook sees in-place changes of Bokeh models only when pushed (a server syncs them itself)
        pn.io.push_notebook(*self._chart_panes)

    def panel(self) -> pn.viewable.Viewable:
        if self._layout is None:
            self._layout = pn.Column(
                pn.FlexBox(*self._controls),
                self._errors.general,
                pn.Row(
                    html_pane(pn.bind(self.summary_html, self.state.param.prediction), width=430),
                    self._figures(),
                ),
                pn.pane.Markdown(
                    "Components per ZeRO (Rajbhandari et al. 2020) and activation memory per Korthikanti et al. "
                    "2022; *overhead* is the CUDA context plus allocator fragmentation. The first pipeline rank "
                    "holds the most micro-batches in flight; the last holds the output layer and the logits. "
                    "The *framework* profile sets what is kept: the bundled trainer saves sequence-parallel "
                    "inputs all-gathered, Megatron keeps them sharded; a fitted profile states the error band "
                    "it was validated to (else *uncalibrated*). The attention kernel decides what selective "
                    "recompute saves: eager attention keeps the scores it drops, flash attention none.",
                    styles={"color": "#5a6570", "font-size": "12px"},
                ),
                sizing_mode="stretch_width",
            )
        return self._layout

    def __panel__(self) -> pn.viewable.Viewable:
        return self.panel()


__all__ = ["BillChart", "MemoryView", "bill_chart_data", "bill_notes", "precision_note"]
