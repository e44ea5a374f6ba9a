"""View 8, compare runs: two run directories' curves overlaid and their predicted-vs-measured
tables (:func:`workbench.rundir.compare.compare_run`) side by side; either one can be opened and
replayed in the live view.

Only directories under the app's runs root are offered (picked by name, never a typed path).
What is selected is drawn, each run on its own: A alone draws A, B alone B, both draw both (B
dashed, so that the same run picked twice still shows both). A resumed run's curve is the run as
it stands: the steps its lost attempt ran past the checkpoint are left out, as in the live view.
Each table says how its measured numbers are taken (the "how measured" column) and heads with
how the run ended (:func:`workbench.rundir.status.run_outcome`).

Above the tables, with two runs picked, their experiment records
(:func:`workbench.rundir.runs_compare.compare_runs`, as ``workbench compare A B`` prints them):
first what differs in their lineages (data, model, code, packages, cluster, profile), so that a
difference in the numbers below is read knowing whether the runs differ by more than their plans;
then their summaries side by side (a naive baseline is labelled as the baseline of its plan) and
each run's declared acceptance thresholds with their verdicts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import panel as pn
import param
from bokeh.models import ColumnDataSource, HoverTool
from bokeh.plotting import figure

from workbench.rundir.acceptance import ThresholdResult, format_results
from workbench.rundir.compare import compare_run
from workbench.rundir.runs_compare import compare_runs
from workbench.rundir import read_events
from workbench.rundir.tail import list_runs

from widgets.markup import Html, concat, render
from widgets.run_session import RunSession, session_of
from widgets.run_transforms import (SAME_LINEAGE, acceptance_rows, comparison_rows, lineage_lines,
                                    run_step_rows, summary_rows)
from widgets.state import PlanState
from widgets.icons import icon
from widgets.ui import error_line, html_pane, muted, table

COLORS = ("#0072B2", "#D55E00")
DASHES = ("solid", "dashed")
NONE = "(none)"  # the label of "no run" in the selectors
STATUS_COLORS = {"pass": "#2e7d32", "fail": "#c62828"}  # "not measured": the text's own grey


def verdict_table(verdicts: list[ThresholdResult], testid: str, ended: bool = True) -> Html:
    """Declared acceptance thresholds and their verdicts: a heading as the CLI's
    (:func:`~workbench.rundir.acceptance.format_results`), then status, threshold, measured and how
    it was measured; nothing when the run declared none."""
    if not verdicts:
        return Html("")
    rows = [[render('<span style="color:{};font-weight:600">{}</span>', STATUS_COLORS.get(r["status"], "#5a6570"),
                    r["status"]), r["threshold"], r["measured"], r["how"]] for r in acceptance_rows(verdicts)]
    return (muted(format_results(verdicts, ended)[0], f"{testid}-head")
            + table(["status", "threshold", "measured", "how measured"], rows, testid=testid, numeric=(2,)))


def records_html(a: Path, b: Path) -> Html:
    """Two runs' experiment records: lineage differences, summaries side by side, acceptance."""
    try:
        comp = compare_runs(a, b)
    except Exception as err:  # noqa: BLE001 - an unfinished or foreign directory: say so
        return error_line(f"{a.name} against {b.name}: {err}", "compare-records-error")
    lines = lineage_lines(comp)
    same = lines == [SAME_LINEAGE]
    if same:
        lineage = muted(f"Lineage: {SAME_LINEAGE}.", "compare-lineage")
    else:
        n = len(comp.lineage)
        head = (f"Lineage: {n} difference{'s' if n != 1 else ''}: the runs differ by more than their plans"
                if n else "Lineage: unknown")
        lineage = render('<div data-testid="compare-lineage">{}{}</div>', render("<b>{}</b>", head),
                         concat(*(error_line(line, "compare-lineage-line") for line in lines)))
    summary = table(["", f"A: {a.name}", f"B: {b.name}"], summary_rows(comp), testid="compare-summary",
                    numeric=(1, 2))
    verdicts = concat(*(render("<div><b>{}</b>{}</div>", f"Acceptance of {tag} ({s.label})",
                               verdict_table(s.acceptance, f"compare-acceptance-{tag.lower()}"))
                        for tag, s in (("A", comp.a), ("B", comp.b)) if s.acceptance))
    return lineage + summary + verdicts


def comparison_html(run_dir: Path, testid: str) -> Html:
    """The predicted-vs-measured table of one run (or why there is none)."""
    try:
        comp = compare_run(run_dir)
    except Exception as err:  # noqa: BLE001 - an unfinished or foreign directory: say so
        return error_line(f"{run_dir.name}: {err}")
    rows = [[r["section"], r["name"] + (f" [rank {r['rank']}]" if r["rank"] is not None else ""), r["predicted"],
             r["measured"], r["error"], r["how"]] for r in comparison_rows(comp)]
    notes = concat(*(muted(f"note: {n}") for n in comp.notes))
    return (render("<b>{}</b> ({}, {} ranks)", run_dir.name, comp.config.plan.describe(), comp.config.world_size)
            + muted(f"run: {comp.outcome}", f"{testid}-outcome")
            + table(["section", "quantity", "predicted", "measured", "error", "how measured"], rows, testid=testid,
                    numeric=(2, 3, 4))
            + notes)


class CompareView(pn.viewable.Viewer):
    """Pick two runs under the runs root; overlay their curves; compare their tables."""

    state = param.ClassSelector(class_=PlanState)
    run_a = param.Selector(default="", objects={NONE: ""})  # a run's name under the runs root; "": none
    run_b = param.Selector(default="", objects={NONE: ""})
    metric = param.Selector(default="loss", objects=["loss", "tokens_per_s", "mfu", "grad_norm", "step_time_s"])

    def __init__(self, state: PlanState | None = None, session: RunSession | None = None, **params: Any):
        super().__init__(state=state or PlanState(), **params)
        self.session = session or session_of(self.state)
        self.sources = [ColumnDataSource(data={"step": [], "y": []}) for _ in COLORS]
        self.figure = figure(height=300, width=950, title="loss", toolbar_location=None, tools="", x_axis_label="step")
        self._lines = []
        for src, color, dash, name in zip(self.sources, COLORS, DASHES, ("run A", "run B")):
            self._lines.append(self.figure.line("step", "y", source=src, color=color, line_width=2, line_dash=dash,
                                                legend_label=name, name=f"compare-{name[-1].lower()}"))
        self.figure.add_tools(HoverTool(tooltips=[("step", "@step"), ("value", "@y{0.0000}")]))
        self.figure.legend.location = "top_right"
        self._tables = [html_pane("", sizing_mode="stretch_width"), html_pane("", sizing_mode="stretch_width")]
        self._records = html_pane("", margin=(4, 10), sizing_mode="stretch_width")
        self._refresh_btn = pn.widgets.Button(label="Refresh list", icon=icon("refresh"), margin=(22, 5, 0, 10))
        self._refresh_btn.on_click(lambda _e: self.refresh_runs())
        self._open = [pn.widgets.Button(label=f"Replay {n}", margin=(22, 5, 0, 5),
                                       description=f"Open run {n} in 7 · Live run") for n in "AB"]
        self._open[0].on_click(lambda _e: self.replay(self.run_a))
        self._open[1].on_click(lambda _e: self.replay(self.run_b))
        self._message = html_pane("")
        self._layout = None
        self._refreshing = False
        self.refresh_runs()

    def refresh_runs(self) -> list[str]:
        """List the runs under the runs root (newest first). A selection that is gone is cleared;
        an empty one takes a default: A the second newest (the newest when there is one run), B
        the newest, so that a fresh page compares the latest two. Returns the names."""
        names = list_runs(self.session.runs_root)
        options = {NONE: "", **{n: n for n in names}}
        a = self.run_a if self.run_a in names else ""
        b = self.run_b if self.run_b in names else ""
        if not a and not b and names:
            a, b = (names[1], names[0]) if len(names) > 1 else (names[0], names[0])
        self._refreshing = True  # drawn once below (a selection kept may have grown), not per change
        try:
            self.param.run_a.objects = options
            self.param.run_b.objects = options
            self.param.update(run_a=a, run_b=b)
        finally:
            self._refreshing = False
        self.show()
        return names

    def _path(self, name: str) -> Path:
        return Path(self.session.runs_root) / name

    @param.depends("run_a", watch=True)
    def _show_a(self) -> None:
        if not self._refreshing:
            self._draw(0)

    @param.depends("run_b", watch=True)
    def _show_b(self) -> None:
        if not self._refreshing:
            self._draw(1)

    @param.depends("run_a", "run_b", watch=True)
    def _show_pair(self) -> None:  # once per change of the pair, however many of the two changed
        if not self._refreshing:
            self._show_records()

    @param.depends("metric", watch=True)
    def _show_metric(self) -> None:
        for i in (0, 1):
            self._draw(i)

    def show(self) -> None:
        """Draw both selections (whole files: a finished run is read once) and their records."""
        self._show_metric()
        self._show_records()

    def _show_records(self) -> None:
        """The two runs' records above the tables (nothing unless both are picked)."""
        if not (self.run_a and self.run_b):
            self._records.object = ""
            return
        self._records.object = records_html(self._path(self.run_a), self._path(self.run_b))

    def _draw(self, i: int) -> None:
        """Run ``i`` (0: A, 1: B): its curve and its table, or nothing when none is selected."""
        self.figure.title.text = self.metric
        name = (self.run_a, self.run_b)[i]
        letter = "AB"[i]
        if not name:
            self.sources[i].data = {"step": [], "y": []}
            self.figure.legend.items[i].label = {"value": f"{letter}: {NONE}"}
            self._tables[i].object = ""
            return
        path = self._path(name)
        try:
            cols = run_step_rows(read_events(path))
        except OSError as err:  # removed since it was listed
            cols = {"step": [], self.metric: []}
            self._message.object = error_line(f"{name}: {err}")
        self.sources[i].data = {"step": cols["step"], "y": cols[self.metric]}
        self.figure.legend.items[i].label = {"value": f"{letter}: {name}"}
        self._tables[i].object = comparison_html(path, f"compare-table-{letter.lower()}")

    def replay(self, name: str | None) -> None:
        """Open run ``name`` in the live view (7 · Live run)."""
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
            self._layout = pn.Column(
                pn.Row(pn.widgets.Select.from_param(p.run_a, label="run A", width=300),
                       pn.widgets.Select.from_param(p.run_b, label="run B", width=300),
                       pn.widgets.Select.from_param(p.metric, label="curve", width=140),
                       self._refresh_btn, *self._open),
                self._message,
                pn.pane.Bokeh(self.figure),
                self._records,
                pn.Row(*self._tables, sizing_mode="stretch_width"),
                sizing_mode="stretch_width",
            )
        return self._layout

    def __panel__(self) -> pn.viewable.Viewable:
        return self.panel()
