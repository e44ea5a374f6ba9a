"""View 8, compare runs: two run directories' curves overlaid and their predicted-vs-measured
tables (:func:`workbench.rundir.compare.compare_run`) side by side; either one can be opened and
replayed in the live view.

Only directories under the app's runs root are offered (picked by name, never a typed path).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import panel as pn
import param
from bokeh.models import ColumnDataSource, HoverTool
from bokeh.plotting import figure

from workbench.rundir.compare import compare_run
from workbench.rundir import read_events
from workbench.rundir.tail import list_runs

from widgets.markup import Html, concat, render
from widgets.run_session import RunSession, session_of
from widgets.run_transforms import comparison_rows, step_rows
from widgets.state import PlanState
from widgets.ui import error_line, html_pane, muted, table

COLORS = ("#0072B2", "#D55E00")


def comparison_html(run_dir: Path, testid: str) -> Html:
    """The predicted-vs-measured table of one run (or why there is none)."""
    try:
        comp = compare_run(run_dir)
    except Exception as err:  # noqa: BLE001 - an unfinished or foreign directory: say so
        return error_line(f"{run_dir.name}: {err}")
    rows = [[r["section"], r["name"] + (f" [rank {r['rank']}]" if r["rank"] is not None else ""), r["predicted"],
             r["measured"], r["error"]] for r in comparison_rows(comp)]
    notes = concat(*(muted(f"note: {n}") for n in comp.notes))
    return (render("<b>{}</b> ({}, {} ranks)", run_dir.name, comp.config.plan.describe(), comp.config.world_size)
            + table(["section", "quantity", "predicted", "measured", "error"], rows, testid=testid, numeric=(2, 3, 4))
            + notes)


class CompareView(pn.viewable.Viewer):
    """Pick two runs under the runs root; overlay their curves; compare their tables."""

    state = param.ClassSelector(class_=PlanState)
    run_a = param.Selector(default=None, objects=[], allow_None=True)
    run_b = param.Selector(default=None, objects=[], allow_None=True)
    metric = param.Selector(default="loss", objects=["loss", "tokens_per_s", "mfu", "grad_norm", "step_time_s"])

    def __init__(self, state: PlanState | None = None, session: RunSession | None = None, **params: Any):
        super().__init__(state=state or PlanState(), **params)
        self.session = session or session_of(self.state)
        self.sources = [ColumnDataSource(data={"step": [], "y": []}) for _ in COLORS]
        self.figure = figure(height=300, width=950, title="loss", toolbar_location=None, tools="", x_axis_label="step")
        self._lines = []
        for src, color, name in zip(self.sources, COLORS, ("run A", "run B")):
            self._lines.append(self.figure.line("step", "y", source=src, color=color, line_width=2, legend_label=name))
        self.figure.add_tools(HoverTool(tooltips=[("step", "@step"), ("value", "@y{0.0000}")]))
        self.figure.legend.location = "top_right"
        self._tables = [html_pane("", sizing_mode="stretch_width"), html_pane("", sizing_mode="stretch_width")]
        self._refresh_btn = pn.widgets.Button(label="Refresh list", icon="refresh", margin=(22, 5, 0, 10))
        self._refresh_btn.on_click(lambda _e: self.refresh_runs())
        self._open = [pn.widgets.Button(label=f"Replay {n}", margin=(22, 5, 0, 5),
                                       description=f"Open run {n} in 7 · Live run") for n in "AB"]
        self._open[0].on_click(lambda _e: self.replay(self.run_a))
        self._open[1].on_click(lambda _e: self.replay(self.run_b))
        self._message = html_pane("")
        self._layout = None
        self.refresh_runs()

    def refresh_runs(self) -> list[str]:
        names = list_runs(self.session.runs_root)
        self.param.run_a.objects = names
        self.param.run_b.objects = names
        if self.run_a not in names:
            self.run_a = names[1] if len(names) > 1 else (names[0] if names else None)
        if self.run_b not in names:
            self.run_b = names[0] if names else None
        return names

    def _path(self, name: str) -> Path:
        return Path(self.session.runs_root) / name

    @param.depends("run_a", "run_b", "metric", watch=True)
    def show(self) -> None:
        """Load both runs' curves and tables (whole files: a finished run is read once)."""
        self.figure.title.text = self.metric
        for i, (name, src) in enumerate(zip((self.run_a, self.run_b), self.sources)):
            if not name:
                src.data = {"step": [], "y": []}
                self._tables[i].object = ""
                continue
            path = self._path(name)
            cols = step_rows(read_events(path))
            src.data = {"step": cols["step"], "y": cols[self.metric]}
            self._lines[i].name = name
            self.figure.legend.items[i].label = {"value": f"{'AB'[i]}: {name}"}
            self._tables[i].object = comparison_html(path, f"compare-table-{'ab'[i]}")

    def replay(self, name: str | None) -> None:
        if not name:
            return
        try:
            self.session.open(self._path(name))
            self._message.object = muted(f"Replaying {name} in 7 · Live run.", "replay-message")
        except Exception as err:  # noqa: BLE001
            self._message.object = error_line(err)

    def panel(self) -> pn.viewable.Viewable:
        if self._layout is None:
            p = self.param
            self.show()
            self._layout = pn.Column(
                pn.Row(pn.widgets.Select.from_param(p.run_a, label="run A", width=300),
                       pn.widgets.Select.from_param(p.run_b, label="run B", width=300),
                       pn.widgets.Select.from_param(p.metric, label="curve", width=140),
                       self._refresh_btn, *self._open),
                self._message,
                pn.pane.Bokeh(self.figure),
                pn.Row(*self._tables, sizing_mode="stretch_width"),
                sizing_mode="stretch_width",
            )
        return self._layout

    def __panel__(self) -> pn.viewable.Viewable:
        return self.panel()
