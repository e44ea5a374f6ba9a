"""View 3, the mesh on the cluster: the degrees of each parallelism, the cluster drawn as nodes x
GPUs with their intra-node and network links, every rank coloured by its group of a chosen
dimension, the predicted traffic per group and per link tier, and warnings for bad mappings.

The picture is :func:`widgets.transforms.mesh_layout`, built from ``ParallelPlan.rank_coords`` and
``group_ranks`` (the same mapping the trainer builds its process groups from). The traffic is the
plan's one prediction (``state.prediction``): the collectives ``predict_step`` priced for the
pipeline rank that sets the step, so a group's time is the sum of its per-tier parts and its
exposed time is the step breakdown's. Links a bad mapping overloads (tensor, context or expert
parallel traffic on the network) are drawn in the warning colour, labelled with the bytes and the
time they carry per step.
"""

from __future__ import annotations

from typing import Any

import holoviews as hv
import holoviews.plotting.bokeh  # noqa: F401  (registers the backend .opts() needs, without notebook output)
import panel as pn
import param

from workbench import RunConfig

from widgets.state import PlanPrediction, PlanState, prediction_of
from widgets.transforms import (
    COLOR_DIMS,
    TIER_ORDER,
    MeshLayout,
    dim_short,
    dim_words,
    format_bytes,
    format_seconds,
    group_color,
    group_traffic_rows,
    mesh_layout,
    overloaded_links,
    step_headline,
    tier_rows,
    tier_words,
)
from widgets.markup import Html, concat, render
from widgets.ui import FieldErrors, labelled, card, cards, html_pane, muted, swatch, table

_LINK_STYLE = {
    "intra_node": dict(color="#2e7d32", line_width=5),
    "inter_node": dict(color="#5e35b1", line_width=2),
    "inter_leaf": dict(color="#ad1457", line_width=3),
}
OVERLOAD_COLOR = "#ef6c00"  # the warning cards' colour
_COORDS = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")


def mesh_figure(source: "PlanPrediction | RunConfig", dim: str) -> tuple[hv.Overlay, MeshLayout]:
    """The cluster with its ranks coloured by group of ``dim``; hover a rank for its coordinates.
    Links that carry in-stage traffic over the network are drawn in :data:`OVERLOAD_COLOR`, with
    their bytes and time per step as labels and on hover."""
    pred = prediction_of(source)
    config = pred.config
    c = config.cluster
    lay = mesh_layout(c, config.plan, dim)
    hot = overloaded_links(lay, pred)
    ppu = max(14.0, min(56.0, 1000.0 / max(lay.width, 1.0)))  # pixels per GPU pitch
    pad = 0.9
    below = 1.1 if hot else 0.0  # room for the overload labels under the last switch
    els = [hv.Rectangles([(n["x0"], n["y0"], n["x1"], n["y1"]) for n in lay.nodes]).opts(
        color="#eef2f7", line_color="#8a97a8", line_width=1)]
    for tier in TIER_ORDER:
        segs = [(s["x0"], s["y0"], s["x1"], s["y1"]) for s in lay.links if s["tier"] == tier]
        if segs:
            els.append(hv.Segments(segs).opts(**_LINK_STYLE[tier]))
    if hot:
        els.append(hv.Segments(hot, kdims=["x0", "y0", "x1", "y1"],
                               vdims=["tier_words", "node", "what", "sent", "time", "label"]).opts(
            color=OVERLOAD_COLOR, line_width=7, tools=["hover"],
            hover_tooltips=[("link", "@tier_words (node @node)"), ("carries", "@what"),
                            ("sent / GPU / step", "@sent"), ("time of those calls", "@time")]))
    els.append(hv.Rectangles([(s["x0"], s["y0"], s["x1"], s["y1"]) for s in lay.switches]).opts(
        color="#37474f", line_color="#37474f"))
    if hot and len(hot) <= 32:
        marks = [{"x": h["x0"], "y": min(h["y0"], h["y1"]) - 0.45, "text": h["label"].replace(" ", "\n", 1)}
                 for h in hot if h["node"] >= 0]
        els.append(hv.Labels(marks, kdims=["x", "y"], vdims=["text"]).opts(
            text_color=OVERLOAD_COLOR, text_font_size="8pt", text_font_style="bold", text_baseline="top"))
    vdims = ["rank", "node", "gpu", *_COORDS, "group", "color", "members"]
    tooltips = [("rank", "@rank"), ("node / gpu", "@node / @gpu")] + [(d, f"@{d}") for d in _COORDS] + [
        (f"{dim_words(dim)} group", "@group: @members")]
    els.append(hv.Points(lay.gpus, kdims=["x", "y"], vdims=vdims).opts(
        color="color", marker="square", size=max(8, 0.62 * ppu), line_color="white",
        hover_tooltips=tooltips, tools=["hover"]))
    if len(lay.gpus) <= 256:
        els.append(hv.Labels(lay.gpus, kdims=["x", "y"], vdims=["rank"]).opts(
            text_color="white", text_font_size=f"{max(7, int(0.24 * ppu))}pt", text_font_style="bold"))
    width_units = lay.width + 2 * pad + (1.2 if len(lay.switches) > 1 else 0)
    x0 = -0.6 - pad - (1.2 if len(lay.switches) > 1 else 0)
    fig = hv.Overlay(els).opts(
        xlim=(x0, x0 + width_units), ylim=(-lay.height + 1.2 - below, 1.3),
        frame_width=int(width_units * ppu), frame_height=int((lay.height + 0.1 + below) * ppu),
        xaxis=None, yaxis=None, toolbar=None, shared_axes=False, show_frame=False, show_legend=False,
        title=f"{c.nodes} node{'s' if c.nodes > 1 else ''} × {c.gpus_per_node} {c.gpu.name}",
    )
    return fig, lay


def traffic_table(pred: PlanPrediction) -> Html:
    """The prediction's traffic per group: a row per group, then its parts per link tier (they add
    up to the group's row); exposed is what the step breakdown charges the group."""
    groups = group_traffic_rows(pred)
    if not groups:
        return muted("No communication: a single rank.")
    rows = []
    for g in groups:
        exposed = "in the bubble" if g["exposed_time_s"] is None else format_seconds(g["exposed_time_s"])
        where = g["parts"][0]["label"] if len(g["parts"]) == 1 else tier_words(g["tier"])
        rows.append((render("<b>{}</b>", g["words"]), g["group_size"], where, g["calls"],
                     format_bytes(g["wire_bytes"]), format_seconds(g["time_s"]), exposed))
        if len(g["parts"]) > 1:
            for part in g["parts"]:
                rows.append((render('<span class="wb-muted">&nbsp;&nbsp;↳ {}</span>', part["label"]), "", "",
                             part["calls"], format_bytes(part["wire_bytes"]), format_seconds(part["time_s"]), ""))
    exposed_total = sum(g["exposed_time_s"] or 0.0 for g in groups)
    rows.append((render("<b>{}</b>", "all groups"), "", "", sum(g["calls"] for g in groups),
                 format_bytes(sum(g["wire_bytes"] for g in groups)), format_seconds(sum(g["time_s"] for g in groups)),
                 format_seconds(exposed_total)))
    return table(["group", "size", "link tier", "calls", "sent / GPU / step", "time", "exposed in the step"],
                 rows, testid="traffic-by-group", numeric=(1, 3, 4, 5, 6))


def tier_table(pred: PlanPrediction) -> Html:
    rows = []
    for r in tier_rows(pred):
        carried = ", ".join(f"{dim_words(d)} {format_bytes(b)}" for d, b in r["by_dim"].items() if b > 0) or "—"
        rows.append((tier_words(r["tier"]), r["link"], format_bytes(r["bytes"]),
                     f'{r["bandwidth_bytes_per_s"] / 1e9:.0f} GB/s', carried))
    return table(["link tier", "link", "sent / GPU / step", "bandwidth / GPU", "carries"], rows,
                 testid="traffic-by-tier", numeric=(2, 3))


class MeshView(pn.viewable.Viewer):
    """The mesh of ``state.prediction`` on its cluster (a fresh :class:`PlanState` when none is given)."""

    state = param.ClassSelector(class_=PlanState)
    color_by = param.Selector(default="tp", objects=list(COLOR_DIMS), doc="Colour ranks by their group of this dimension")
    drawn = param.Parameter(default=None, doc="(key, prediction, dim) the picture shows; it changes only when the picture does")

    def __init__(self, state: PlanState | None = None, **params: Any):
        super().__init__(state=state or PlanState(), **params)
        s = self.state.param
        self._errors = FieldErrors("set it in the Model or Memory tab")

        def num(p, label, width=95):
            return self._errors.wrap(p.name, pn.widgets.IntInput.from_param(p, label=label, width=width))

        self._cluster_controls = [
            self._errors.wrap("cluster", pn.widgets.Select.from_param(s.cluster, label="Cluster", width=150)),
            num(s.nodes, "nodes", 90),
        ]
        self._degree_controls = [
            num(s.tp, "tp"), num(s.pp, "pp"), num(s.cp, "cp"), num(s.ep, "ep"),
            num(s.dp_shard, "dp (sharded), -1 = rest", 150), num(s.dp_replicate, "dp (replicated)", 115),
            self._errors.wrap("pp_schedule", pn.widgets.Select.from_param(s.pp_schedule, label="pipeline schedule",
                                                                          width=150)),
            num(s.virtual_stages, "virtual stages per rank", 150),
        ]
        self._color = labelled("colour ranks by their group of", pn.widgets.RadioButtonGroup.from_param(
            self.param.color_by, options={dim_short(d): d for d in COLOR_DIMS}, color="primary", variant="outline",
            width=560))
        self.state.param.watch(self._on_error, ["error", "error_field"])
        self.state.param.watch(self._on_config, "prediction")
        self._on_error()
        self._on_config()
        self._layout = None

    @param.depends("color_by", watch=True)
    def _on_config(self, *_: Any) -> None:
        # colouring by a dimension of degree 1 shows nothing: move to one the plan uses
        pred = self.state.prediction
        cfg = pred.config if pred is not None else None
        if cfg is not None and cfg.plan.degree(self.color_by) == 1:
            used = [d for d in ("tp", "cp", "ep", "pp", "dp") if cfg.plan.degree(d) > 1]
            if used:
                self.color_by = used[0]
                return  # the watcher on color_by redraws
        # redraw only when the picture changes (a ZeRO toggle leaves it as it is; the traffic the
        # overloaded links carry is part of the picture)
        key = None
        if cfg is not None:
            lay = mesh_layout(cfg.cluster, cfg.plan, self.color_by)
            hot = tuple((h["node"], h["tier"], h["label"]) for h in overloaded_links(lay, pred))
            key = (cfg.cluster, tuple(cfg.plan.degree(d) for d in COLOR_DIMS), self.color_by, hot)
        if self.drawn is None or self.drawn[0] != key:
            self.drawn = (key, pred, self.color_by)

    def _on_error(self, *_: Any) -> None:
        self._errors.show(self.state.error or None, self.state.error_field or None)

    # ------------------------------------------------------------------ rendered pieces
    def _figure(self, drawn: tuple | None) -> pn.viewable.Viewable:
        pred, dim = (drawn[1], drawn[2]) if drawn else (None, self.color_by)
        if pred is None:
            return pn.pane.Markdown("*No mesh: the configuration is invalid (see the message above).*")
        fig, _ = mesh_figure(pred, dim)
        return pn.pane.HoloViews(fig, backend="bokeh")

    @staticmethod
    def info_html(source: "PlanPrediction | RunConfig | None", dim: str) -> Html:
        """Cards, legends and the traffic tables of the prediction (a RunConfig finds its prediction)."""
        pred = prediction_of(source)
        if pred is None:
            return Html("")
        config = pred.config
        plan, c = config.plan, config.cluster
        lay = mesh_layout(c, plan, dim)
        head_numbers = step_headline(pred.step)
        head = cards([
            card("Plan", plan.describe(), "plan-label", note=f"world size {config.world_size}"),
            card(f"colour: {dim_words(dim)} groups", str(lay.n_groups), "n-groups",
                 note=f"of {plan.degree(dim)} ranks each"),
            card("Step time", head_numbers["step"], "mesh-step",
                 note=render('bubble <span data-testid="mesh-bubble">{}</span>', head_numbers["bubble"])),
        ])
        groups = plan.group_ranks(dim)[:8]
        legend = table(
            ["", f"{dim_words(dim)} group", "ranks", "link tier"],
            [(swatch(group_color(i)), i, ", ".join(map(str, g)) if len(g) <= 16 else f"{g[0]} ... {g[-1]}",
              tier_words(c.tier_between(g))) for i, g in enumerate(groups)],
            testid="group-legend",
        )
        more = muted(f"... and {lay.n_groups - 8} more groups") if lay.n_groups > 8 else Html("")
        link_rows = [(swatch(_LINK_STYLE[t]["color"]), tier_words(t), c.link(t).name,
                      f"{c.link(t).bandwidth_bytes_per_s / 1e9:.0f} GB/s")
                     for t in TIER_ORDER if t != "inter_leaf" or c.nodes_per_leaf]
        hot = overloaded_links(lay, pred)
        if hot:
            what = ", ".join(sorted({h["what"] for h in hot}))
            link_rows.append((swatch(OVERLOAD_COLOR), "overloaded", f"carries {what} traffic", "see the labels"))
        links = table(["", "link tier", "link", "bandwidth / GPU each way"], link_rows, testid="link-legend")
        warn = concat(*(render('<div class="wb-card warn" data-testid="mesh-warning">{}</div>', w)
                        for w in lay.warnings))
        crit = f", pipeline rank {pred.step.critical_pp_rank}" if plan.pp > 1 else ""
        return concat(
            head, render('<div class="wb-cards">{}</div>', warn) if warn else Html(""), legend, more, links,
            render("<h4>Predicted traffic per group (the rank that sets the step{}; {} profile)</h4>",
                   crit, config.train.profile.name),
            traffic_table(pred),
            muted("time: every call of the step, as if none overlapped (a call spanning nodes runs on both tiers at "
                  "once: one time for both); exposed: what the step time pays for it, as the step breakdown says."),
            Html("<h4>Per link tier</h4>"), tier_table(pred))

    def panel(self) -> pn.viewable.Viewable:
        if self._layout is None:
            self._layout = pn.Column(
                pn.FlexBox(*self._cluster_controls, *self._degree_controls),
                self._errors.general,
                self._color,
                pn.Row(
                    pn.panel(pn.bind(self._figure, self.param.drawn)),
                    html_pane(pn.bind(self.info_html, self.state.param.prediction, self.param.color_by),
                              min_width=420, sizing_mode="stretch_width"),
                ),
                sizing_mode="stretch_width",
            )
        return self._layout

    def __panel__(self) -> pn.viewable.Viewable:
        return self.panel()
