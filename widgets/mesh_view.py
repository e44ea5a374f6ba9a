"""View 3, the mesh on the cluster: the degrees of each parallelism, the cluster drawn as nodes x
GPUs with their intra-node and network links, every rank coloured by its group of a chosen
dimension, the predicted traffic per group and per link tier, and warnings for bad mappings.

The picture is :func:`widgets.transforms.mesh_layout`, built from ``ParallelPlan.rank_coords`` and
``group_ranks`` (the same mapping the trainer builds its process groups from).
"""

from __future__ import annotations

from typing import Any

import holoviews as hv
import holoviews.plotting.bokeh  # noqa: F401  (registers the backend .opts() needs, without notebook output)
import panel as pn
import param

from workbench import RunConfig

from widgets.state import PlanState
from widgets.transforms import (
    COLOR_DIMS,
    TIER_LABELS,
    MeshLayout,
    dim_traffic_rows,
    format_bytes,
    format_seconds,
    group_color,
    mesh_layout,
    tier_rows,
)
from widgets.markup import Html, concat, render
from widgets.ui import FieldErrors, labelled, card, cards, html_pane, muted, swatch, table

_LINK_STYLE = {
    "intra_node": dict(color="#2e7d32", line_width=5),
    "inter_node": dict(color="#5e35b1", line_width=2),
    "inter_leaf": dict(color="#ad1457", line_width=3),
}
_COORDS = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")


def mesh_figure(config: RunConfig, dim: str) -> tuple[hv.Overlay, MeshLayout]:
    """The cluster with its ranks coloured by group of ``dim``; hover a rank for its coordinates."""
    c = config.cluster
    lay = mesh_layout(c, config.plan, dim)
    ppu = max(14.0, min(56.0, 1000.0 / max(lay.width, 1.0)))  # pixels per GPU pitch
    pad = 0.9
    els = [hv.Rectangles([(n["x0"], n["y0"], n["x1"], n["y1"]) for n in lay.nodes]).opts(
        color="#eef2f7", line_color="#8a97a8", line_width=1)]
    for tier in ("intra_node", "inter_node", "inter_leaf"):
        segs = [(s["x0"], s["y0"], s["x1"], s["y1"]) for s in lay.links if s["tier"] == tier]
        if segs:
            els.append(hv.Segments(segs).opts(**_LINK_STYLE[tier]))
    els.append(hv.Rectangles([(s["x0"], s["y0"], s["x1"], s["y1"]) for s in lay.switches]).opts(
        color="#37474f", line_color="#37474f"))
    vdims = ["rank", "node", "gpu", *_COORDS, "group", "color", "members"]
    tooltips = [("rank", "@rank"), ("node / gpu", "@node / @gpu")] + [(d, f"@{d}") for d in _COORDS] + [
        (f"{dim} group", "@group: @members")]
    els.append(hv.Points(lay.gpus, kdims=["x", "y"], vdims=vdims).opts(
        color="color", marker="square", size=max(8, 0.62 * ppu), line_color="white",
        hover_tooltips=tooltips, tools=["hover"]))
    if len(lay.gpus) <= 256:
        els.append(hv.Labels(lay.gpus, kdims=["x", "y"], vdims=["rank"]).opts(
            text_color="white", text_font_size=f"{max(7, int(0.24 * ppu))}pt", text_font_style="bold"))
    width_units = lay.width + 2 * pad + (1.2 if len(lay.switches) > 1 else 0)
    x0 = -0.6 - pad - (1.2 if len(lay.switches) > 1 else 0)
    fig = hv.Overlay(els).opts(
        xlim=(x0, x0 + width_units), ylim=(-lay.height + 1.2, 1.3),
        frame_width=int(width_units * ppu), frame_height=int((lay.height + 0.1) * ppu),
        xaxis=None, yaxis=None, toolbar=None, shared_axes=False, show_frame=False, show_legend=False,
        title=f"{c.nodes} node{'s' if c.nodes > 1 else ''} × {c.gpus_per_node} {c.gpu.name}",
    )
    return fig, lay


class MeshView(pn.viewable.Viewer):
    """The mesh of ``state.config`` on its cluster (a fresh :class:`PlanState` when none is given)."""

    state = param.ClassSelector(class_=PlanState)
    color_by = param.Selector(default="tp", objects=list(COLOR_DIMS), doc="Colour ranks by their group of this dimension")
    drawn = param.Parameter(default=None, doc="(config, dim) the picture shows; it changes only when the mesh does")

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
            num(s.dp_shard, "dp_shard (-1 = rest)", 140), num(s.dp_replicate, "dp_replicate", 105),
            self._errors.wrap("pp_schedule", pn.widgets.Select.from_param(s.pp_schedule, label="pp_schedule", width=150)),
            num(s.virtual_stages, "virtual_stages", 110),
        ]
        self._color = labelled("colour ranks by their group of", pn.widgets.RadioButtonGroup.from_param(
            self.param.color_by, color="primary", variant="outline", width=520))
        self.state.param.watch(self._on_error, ["error", "error_field"])
        self.state.param.watch(self._on_config, "config")
        self._on_error()
        self._on_config()
        self._layout = None

    @param.depends("color_by", watch=True)
    def _on_config(self, *_: Any) -> None:
        # colouring by a dimension of degree 1 shows nothing: move to one the plan uses
        cfg = self.state.config
        if cfg is not None and cfg.plan.degree(self.color_by) == 1:
            used = [d for d in ("tp", "cp", "ep", "pp", "dp") if cfg.plan.degree(d) > 1]
            if used:
                self.color_by = used[0]
                return  # the watcher on color_by redraws
        # redraw only when the picture changes (a ZeRO or recompute toggle leaves it as it is)
        key = None if cfg is None else (cfg.cluster, tuple(cfg.plan.degree(d) for d in COLOR_DIMS), self.color_by)
        if self.drawn is None or self.drawn[0] != key:
            self.drawn = (key, cfg, self.color_by)

    def _on_error(self, *_: Any) -> None:
        self._errors.show(self.state.error or None, self.state.error_field or None)

    # ------------------------------------------------------------------ rendered pieces
    def _figure(self, drawn: tuple | None) -> pn.viewable.Viewable:
        config, dim = (drawn[1], drawn[2]) if drawn else (None, self.color_by)
        if config is None:
            return pn.pane.Markdown("*No mesh: the configuration is invalid (see the message above).*")
        fig, _ = mesh_figure(config, dim)
        return pn.pane.HoloViews(fig, backend="bokeh")

    @staticmethod
    def info_html(config: RunConfig | None, dim: str) -> Html:
        if config is None:
            return Html("")
        plan, c = config.plan, config.cluster
        lay = mesh_layout(c, plan, dim)
        head = cards([
            card("Plan", plan.describe(), "plan-label", note=f"world size {config.world_size}"),
            card(f"colour: {dim} groups", str(lay.n_groups), "n-groups", note=f"of {plan.degree(dim)} ranks each"),
        ])
        groups = plan.group_ranks(dim)[:8]
        legend = table(
            ["", f"{dim} group", "ranks", "link tier"],
            [(swatch(group_color(i)), i, ", ".join(map(str, g)) if len(g) <= 16 else f"{g[0]} ... {g[-1]}",
              TIER_LABELS[c.tier_between(g)]) for i, g in enumerate(groups)],
            testid="group-legend",
        )
        more = muted(f"... and {lay.n_groups - 8} more groups") if lay.n_groups > 8 else Html("")
        links = table(
            ["", "link tier", "link", "bandwidth / GPU each way"],
            [(swatch(_LINK_STYLE[t]["color"]), TIER_LABELS[t], c.link(t).name, f"{c.link(t).bandwidth_bytes_per_s / 1e9:.0f} GB/s")
             for t in ("intra_node", "inter_node", "inter_leaf") if t != "inter_leaf" or c.nodes_per_leaf],
            testid="link-legend",
        )
        dims = dim_traffic_rows(config)
        traffic = table(
            ["group", "size", "slowest tier", "sent / GPU / step", "time", "exposed"],
            [(r["dim"], r["group_size"], TIER_LABELS[r["tier"]], format_bytes(r["wire_bytes"]),
              format_seconds(r["time_s"]), format_seconds(r["exposed_time_s"])) for r in dims],
            testid="traffic-by-group", numeric=(1, 3, 4, 5),
        ) if dims else muted("No communication: a single rank.")
        tiers = table(
            ["link tier", "link", "sent / GPU / step", "bandwidth / GPU", "time at peak"],
            [(TIER_LABELS[r["tier"]], r["link"], format_bytes(r["bytes"]),
              f'{r["bandwidth_bytes_per_s"] / 1e9:.0f} GB/s', format_seconds(r["time_s"])) for r in tier_rows(config)],
            testid="traffic-by-tier", numeric=(2, 3, 4),
        )
        warn = concat(*(render('<div class="wb-card warn" data-testid="mesh-warning">{}</div>', w)
                        for w in lay.warnings))
        return concat(
            head, render('<div class="wb-cards">{}</div>', warn) if warn else Html(""), legend, more, links,
            render("<h4>Predicted traffic per group (most loaded pipeline rank, {} profile)</h4>",
                   config.train.profile.name),
            traffic, Html("<h4>Per link tier</h4>"), tiers)

    def panel(self) -> pn.viewable.Viewable:
        if self._layout is None:
            cfg = self.state.param.config
            self._layout = pn.Column(
                pn.FlexBox(*self._cluster_controls, *self._degree_controls),
                self._errors.general,
                self._color,
                pn.Row(
                    pn.panel(pn.bind(self._figure, self.param.drawn)),
                    html_pane(pn.bind(self.info_html, cfg, self.param.color_by), min_width=420,
                              sizing_mode="stretch_width"),
                ),
                sizing_mode="stretch_width",
            )
        return self._layout

    def __panel__(self) -> pn.viewable.Viewable:
        return self.panel()
