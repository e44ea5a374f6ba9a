"""View 10, compare plans: pin the current plan as A, change anything, read A beside B (the current
plan) in one table: the bill, the step time, MFU, the bubble, the traffic, and what changed.

Both columns come from the plan's one prediction (:func:`widgets.state.prediction_of`: the state's
:class:`~widgets.state.PlanPrediction` of a config, ``estimate_memory`` and ``predict_step``), so a
number reads here as it reads in the sidebar and the other tabs. "Back to A" puts A's settings back
into the shared plan; nothing changes the plan otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import panel as pn
import param

from workbench import RunConfig

from widgets.icons import icon
from widgets.markup import Html, render
from widgets.state import PlanState, prediction_of
from widgets.transforms import (dim_words, format_bytes, format_count, format_rate, format_seconds,
                                recompute_words)
from widgets.ui import html_pane, muted, table

COMPONENT_WORDS = {"parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer states",
                   "master_weights": "master weights", "activations": "activations", "buffers": "buffers",
                   "overhead": "overhead"}
DERIVED = ("name", "config", "prediction", "error", "error_field")  # PlanState params that are results


@dataclass(frozen=True)
class Measure:
    """One row's value for one plan: ``kind`` says how two of them differ ("text": same or
    changed; "rel": relative change; "pt": percentage points of a fraction)."""

    key: str
    label: str
    value: Any
    text: str
    kind: str = "rel"


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    a: str
    b: str
    diff: str
    changed: bool


def measures(config: RunConfig) -> list[Measure]:
    """What the table shows of one plan, from its prediction."""
    pred = prediction_of(config)
    bill, step = pred.bill, pred.step
    fit = bill.fits()
    c, t = config.cluster, config.train
    out = [
        Measure("model", "model", config.model, f"{config.model.name or 'custom'} "
                                                f"({format_count(config.model.n_params())} parameters)", "text"),
        Measure("cluster", "cluster", (c.name, c.nodes, c.gpus_per_node, c.gpu.name),
                f"{c.nodes} × {c.gpus_per_node} {c.gpu.name} ({c.name})", "text"),
        Measure("plan", "plan", config.plan, config.plan.describe(), "text"),
        Measure("batch", "batch", (t.seq_len, t.micro_batch_size, t.global_batch_size),
                f"seq {t.seq_len} · mbs {t.micro_batch_size} · gbs {t.global_batch_size} "
                f"({config.n_microbatches} micro-batch{'es' if config.n_microbatches != 1 else ''})", "text"),
        Measure("training", "precision, recompute", (t.precision, t.recompute, t.attention),
                f"{t.precision or 'custom'}, {recompute_words(t.recompute)}, {t.attention} attention", "text"),
        Measure("framework", "framework", t.profile.name, t.profile.name, "text"),
        Measure("peak", "peak memory (most loaded GPU)", fit.peak_bytes, format_bytes(fit.peak_bytes)),
        Measure("fits", "fits", fit.fits, f"fits, {fit.headroom_fraction:.0%} free" if fit.fits
                else f"does not fit ({format_bytes(fit.hbm_bytes)})", "text"),
    ]
    for name, nbytes in bill.components.items():
        if nbytes:
            out.append(Measure(f"mem-{name}", f"\u2003{COMPONENT_WORDS.get(name, name)}", nbytes, format_bytes(nbytes)))
    comm = sum(v for k, v in step.breakdown.items() if k.startswith("comm_"))
    out += [
        Measure("step", "step time", step.step_time_s, format_seconds(step.step_time_s)),
        Measure("mfu", "MFU", step.mfu, f"{step.mfu:.1%}", "pt"),
        Measure("bubble", "pipeline bubble", step.bubble_fraction, f"{step.bubble_fraction:.1%}", "pt"),
        Measure("tps", "tokens/s per GPU", step.tokens_per_s_per_gpu, format_rate(step.tokens_per_s_per_gpu)),
        Measure("comm", "exposed communication", comm, format_seconds(comm)),
    ]
    sent = sum(pred.link_bytes.values())
    out.append(Measure("traffic", "traffic sent per GPU per step", sent, format_bytes(sent)))
    by_dim: dict[str, float] = {}
    for coll in pred.collectives:
        by_dim[coll.dim] = by_dim.get(coll.dim, 0.0) + coll.wire_bytes * coll.count
    for dim, nbytes in sorted(by_dim.items(), key=lambda kv: -kv[1]):
        out.append(Measure(f"traffic-{dim}", f"\u2003{dim_words(dim)}", nbytes, format_bytes(nbytes)))
    return out


def difference(a: Measure | None, b: Measure | None) -> tuple[str, bool]:
    """How B differs from A, in words, and whether it does."""
    if a is None or b is None:
        return ("only in B" if a is None else "only in A"), True
    if a.kind == "text":
        return ("same", False) if a.value == b.value else ("changed", True)
    if a.value == b.value:
        return "same", False
    if a.kind == "pt":
        return f"{(b.value - a.value) * 100:+.1f} pt", True
    if not a.value:
        return "from 0", True
    return f"{(b.value - a.value) / a.value:+.1%}", True


def compare_rows(a: list[Measure], b: list[Measure]) -> list[Row]:
    """A's rows in order, then B's that A has not (a traffic dimension only B uses)."""
    by_a, by_b = {m.key: m for m in a}, {m.key: m for m in b}
    keys = [m.key for m in a] + [m.key for m in b if m.key not in by_a]
    rows = []
    for k in keys:
        ma, mb = by_a.get(k), by_b.get(k)
        diff, changed = difference(ma, mb)
        label = (ma or mb).label
        rows.append(Row(k, label, ma.text if ma else "—", mb.text if mb else "—", diff, changed))
    return rows


def compare_html(rows: list[Row]) -> Html:
    """The A / B / difference table; every cell carries ``cmp-<row>-a|b|diff`` for the tests."""
    def cell(text: str, testid: str, strong: bool = False) -> Html:
        return render('<span data-testid="{}"{}>{}</span>', testid,
                      render(' style="font-weight:600;color:#0b5394"') if strong else Html(""), text)

    body = [[r.label, cell(r.a, f"cmp-{r.key}-a"), cell(r.b, f"cmp-{r.key}-b"),
             cell(r.diff, f"cmp-{r.key}-diff", r.changed)] for r in rows]
    return table(["", "A (pinned)", "B (current plan)", "B vs A"], body, testid="plan-compare", numeric=(1, 2, 3))


class PlanCompareView(pn.viewable.Viewer):
    """Pin a plan as A; the table compares it with the current plan (B)."""

    state = param.ClassSelector(class_=PlanState)
    pinned = param.ClassSelector(class_=RunConfig, allow_None=True, default=None, doc="Plan A")

    def __init__(self, state: PlanState | None = None, **params: Any):
        super().__init__(state=state or PlanState(), **params)
        self._values: dict[str, Any] = {}  # A's PlanState settings, for "Back to A"
        self._measures_a: list[Measure] = []
        self._pin = pn.widgets.Button(label="Pin the current plan as A", color="primary", icon=icon("compare"),
                                      margin=(10, 5, 4, 10))
        self._back = pn.widgets.Button(label="Back to A", color="primary", variant="outline",
                                       icon=icon("use"), margin=(10, 5, 4, 5), disabled=True)
        self._clear = pn.widgets.Button(label="Unpin", color="default", margin=(10, 5, 4, 5), disabled=True)
        self._pin.on_click(lambda _e: self.pin())
        self._back.on_click(lambda _e: self.back_to_a())
        self._clear.on_click(lambda _e: self.unpin())
        self._note = html_pane("", margin=(4, 10))
        self._table = html_pane("", margin=(4, 10), sizing_mode="stretch_width")
        self.state.param.watch(self._redraw, ["config"])
        self._layout = None
        self._redraw()

    # ---- actions
    def pin(self) -> bool:
        """Pin the current plan as A (False: it is invalid, nothing pinned)."""
        if self.state.config is None:
            self._note.object = muted(f"The current plan is invalid, so there is nothing to pin: {self.state.error}",
                                      "compare-note")
            return False
        self._values = {k: v for k, v in self.state.param.values().items() if k not in DERIVED}
        self._measures_a = measures(self.state.config)
        self.pinned = self.state.config
        return True

    def back_to_a(self) -> None:
        """Put A's settings back into the shared plan."""
        if self._values:
            self.state.apply(**self._values)

    def unpin(self) -> None:
        self._values, self._measures_a = {}, []
        self.pinned = None

    # ---- the table
    def rows(self) -> list[Row]:
        """A vs B (empty when nothing is pinned or the current plan is invalid)."""
        if self.pinned is None or self.state.config is None:
            return []
        return compare_rows(self._measures_a, measures(self.state.config))

    @param.depends("pinned", watch=True)
    def _redraw(self, *_: Any) -> None:
        self._back.disabled = self._clear.disabled = self.pinned is None
        if self.pinned is None:
            self._note.object = muted("Pin the current plan as A (here or in the sidebar), then change anything in "
                                      "tabs 1-5: the table shows A beside the current plan, B.", "compare-note")
            self._table.object = ""
            return
        if self.state.config is None:
            self._note.object = muted(f"B, the current plan, is invalid: {self.state.error}", "compare-note")
            self._table.object = ""
            return
        rows = self.rows()
        n = sum(r.changed for r in rows)
        self._note.object = muted(f"A: {self.pinned.model.name or 'custom'}, {self.pinned.plan.describe()}. "
                                  f"B: the current plan. {n} row{'s' if n != 1 else ''} differ.", "compare-note")
        self._table.object = compare_html(rows)

    def panel(self) -> pn.viewable.Viewable:
        if self._layout is None:
            self._layout = pn.Column(
                pn.Row(self._pin, self._back, self._clear),
                self._note,
                self._table,
                pn.pane.Markdown("Both columns are the plans' predictions (the memory bill of the most loaded GPU, "
                                 "the step of the pipeline rank that sets it); the last column is B relative to A.",
                                 styles={"color": "#5a6570", "font-size": "12px"}, margin=(0, 10)),
                sizing_mode="stretch_width",
            )
        return self._layout

    def __panel__(self) -> pn.viewable.Viewable:
        return self.panel()
