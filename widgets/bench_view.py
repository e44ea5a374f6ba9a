"""The bandwidth view (issue 8): a comms benchmark's bus bandwidth against message size, per group,
beside the planner's prediction for the same groups.

Reads ``comms.json`` files (``workbench bench comms``) under the app's runs root; for the
chosen collective, one solid line per group dimension (measured busbw, from the median time)
and a dashed one of the same colour (``workbench.predict.comms.collective_time`` on the benchmark's
cluster, tier and group size, turned into busbw the nccl-tests way). Log x: sizes double.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import panel as pn
import param
from bokeh.models import ColumnDataSource, HoverTool
from bokeh.plotting import figure

from workbench.rundir.benchmarks import load_results

from widgets.markup import Html
from widgets.run_session import RunSession, session_of
from widgets.run_transforms import bandwidth_series
from widgets.state import PlanState
from widgets.transforms import PALETTE, format_bytes
from widgets.icons import icon
from widgets.ui import error_line, html_pane, table


def list_bench_results(runs_root: str) -> list[str]:
    """``<run>/comms.json`` files under ``runs_root``, newest first, relative to it."""
    root = Path(runs_root)
    if not root.is_dir():
        return []
    found = sorted(root.glob("*/comms.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    return [str(p.relative_to(root)) for p in found]


def bandwidth_figure(series: list[dict[str, Any]], op: str, width: int = 900):
    """busbw (bytes/s) vs size (log-log) of every group for ``op``: measured solid, predicted dashed."""
    fig = figure(height=380, width=width, x_axis_type="log", y_axis_type="log", toolbar_location=None, tools="",
                 title=f"{op}: bus bandwidth vs message size (solid: measured, dashed: planner)",
                 x_axis_label="message size S (bytes)", y_axis_label="bus bandwidth (bytes/s)")
    for i, s in enumerate(x for x in series if x["op"] == op):
        color = PALETTE[i % len(PALETTE)]
        src = ColumnDataSource(data={"size": s["size"], "busbw": s["busbw"], "predicted": s["predicted_busbw"],
                                     "dim": [str(s["dim"])] * len(s["size"])})
        r = fig.line("size", "busbw", source=src, color=color, line_width=2, legend_label=f"{s['dim']} (n={s['n']})")
        fig.scatter("size", "busbw", source=src, color=color, size=5)
        fig.line("size", "predicted", source=src, color=color, line_width=2, line_dash="dashed")
        fig.add_tools(HoverTool(renderers=[r], tooltips=[("group", "@dim"), ("size", "@size{0,0} B"),
                                                         ("measured", "@busbw{0.00a}B/s"),
                                                         ("planner", "@predicted{0.00a}B/s")]))
    if fig.legend:
        fig.legend.location = "top_left"
    return fig


class BenchView(pn.viewable.Viewer):
    """Pick a comms benchmark under the runs root and a collective; see measured vs planned busbw."""

    state = param.ClassSelector(class_=PlanState)
    results = param.Selector(default=None, objects=[], allow_None=True)
    op = param.Selector(default="all_reduce", objects=["all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                                       "send_recv"])

    def __init__(self, state: PlanState | None = None, session: RunSession | None = None, **params: Any):
        super().__init__(state=state or PlanState(), **params)
        self.session = session or session_of(self.state)
        self.series: list[dict[str, Any]] = []
        self._plot = pn.pane.Bokeh(bandwidth_figure([], self.op))
        self._table = html_pane("", sizing_mode="stretch_width")
        self._refresh_btn = pn.widgets.Button(label="Refresh list", icon=icon("refresh"), margin=(22, 5, 0, 10))
        self._refresh_btn.on_click(lambda _e: self.refresh())
        self._layout = None
        self.refresh()

    def refresh(self) -> list[str]:
        names = list_bench_results(self.session.runs_root)
        self.param.results.objects = names
        if self.results not in names:
            self.results = names[0] if names else None
        return names

    @param.depends("results", "op", watch=True)
    def show(self) -> None:
        if not self.results:
            self.series = []
            self._table.object = Html('<div class="wb-muted">No comms benchmark under the runs root yet: '
                                      "<code>workbench bench comms</code> writes one.</div>")
        else:
            try:
                self.series = bandwidth_series(load_results(Path(self.session.runs_root) / self.results))
            except Exception as err:  # noqa: BLE001 - a foreign or broken file: say so
                self.series = []
                self._table.object = error_line(err)
            else:
                rows = [[s["dim"], s["n"], s["tier"], format_bytes(size), f"{m / 1e6:,.1f}", f"{p / 1e6:,.1f}"]
                        for s in self.series if s["op"] == self.op
                        for size, m, p in zip(s["size"], s["busbw"], s["predicted_busbw"])]
                self._table.object = table(["group", "n", "link", "size", "measured MB/s", "planner MB/s"], rows,
                                           testid="bench-table", numeric=(1, 3, 4, 5))
        self._plot.object = bandwidth_figure(self.series, self.op)

    def panel(self) -> pn.viewable.Viewable:
        if self._layout is None:
            p = self.param
            self.show()
            self._layout = pn.Column(
                pn.Row(pn.widgets.Select.from_param(p.results, label="benchmark (comms.json)", width=360),
                       pn.widgets.Select.from_param(p.op, label="collective", width=160), self._refresh_btn),
                self._plot,
                self._table,
                sizing_mode="stretch_width",
            )
        return self._layout

    def __panel__(self) -> pn.viewable.Viewable:
        return self.panel()
