"""View 4, the plan advisor: the top plans for the state's model, cluster and settings, with memory,
step time, MFU, bubble and the advisor's explanation, priced under the state's framework profile
(the table's caption states its error band); choosing one applies it to the shared state, so the
mesh, memory and pipeline views show that plan.

``workbench.advise`` takes up to about a second on large clusters: it runs in a worker thread
after a button press, with a spinner, so the page stays responsive.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import panel as pn
import param

from workbench import Cluster, ConfigError, TrainSettings, advise

from widgets.framework_control import framework_select
from widgets.markup import Html, concat, render
from widgets.state import PlanState
from widgets.transforms import advice_rows, band_text, format_bytes, format_seconds, plan_settings
from widgets.ui import card, cards, error_line, html_pane, labelled, muted


def run_advisor(state: PlanState, top: int = 10):
    """``workbench.advise`` on the state's model, cluster and training settings (the advisor
    chooses the plan, micro-batch size and recomputation itself), under the state's framework profile."""
    if state.model is None:
        raise ConfigError(f"model: {state.model_error}", field="model")
    cluster = Cluster.preset(state.cluster, nodes=state.nodes)
    train = TrainSettings(seq_len=state.seq_len, global_batch_size=state.global_batch_size,
                          framework=state.framework_setting).with_precision(state.precision)
    return advise(state.model, cluster, train, top=top)


class AdvisorView(pn.viewable.Viewer):
    """Search plans for ``state`` and apply the chosen one to it."""

    state = param.ClassSelector(class_=PlanState)
    top = param.Selector(default=10, objects=[5, 10, 20])
    advice = param.Parameter(default=None, doc="The last workbench.predict.advisor.Advice")

    def __init__(self, state: PlanState | None = None, **params: Any):
        super().__init__(state=state or PlanState(), **params)
        self._button = pn.widgets.Button(label="Find plans", color="primary", icon="search", width=140)
        self._button.on_click(self._on_click)
        self._top = labelled("show the top", pn.widgets.RadioButtonGroup.from_param(
            self.param.top, color="primary", variant="outline", width=160))
        self._framework = framework_select(self.state)
        self._status = html_pane(Html('<div class="wb-muted">Press <b>Find plans</b> to search every valid plan '
                                      "for this model, cluster and batch.</div>"), sizing_mode="stretch_width")
        self._table = pn.widgets.Tabulator(
            None, selectable=1, disabled=True, show_index=False, layout="fit_data_table",
            sizing_mode="stretch_width", height=330, visible=False,
        )
        self._table.param.watch(self._on_select, "selection")
        self._band = html_pane("", sizing_mode="stretch_width")
        self._explain = html_pane("", sizing_mode="stretch_width")
        self._layout = None

    # ------------------------------------------------------------------ search
    async def _on_click(self, _event: Any) -> None:
        self._button.disabled = True
        self._table.loading = True
        self._status.object = muted("Searching plans ...")
        try:
            t0 = time.perf_counter()
            advice = await asyncio.to_thread(run_advisor, self.state, self.top)
            self.show(advice, time.perf_counter() - t0)
        except ConfigError as err:
            self._status.object = error_line(err, "advisor-error")
        finally:
            self._table.loading = False
            self._button.disabled = False

    def search(self) -> None:
        """Search synchronously (for notebooks and tests)."""
        t0 = time.perf_counter()
        self.show(run_advisor(self.state, self.top), time.perf_counter() - t0)

    def show(self, advice: Any, seconds: float = 0.0) -> None:
        import pandas as pd

        self.advice = advice
        rows = advice_rows(advice)
        self._table.value = pd.DataFrame(rows)
        self._table.visible = bool(rows)
        self._table.selection = []
        self._explain.object = ""
        self._band.object = self.band_html(advice)
        base = advice.baseline
        baseline = (f"plain data parallel: {format_seconds(base.prediction.step_time_s)} per step, "
                    f"MFU {base.prediction.mfu:.1%}" if base.fits else f"plain data parallel: {base.reason}")
        gain = advice.gain_over_baseline()
        items = [card("Top plans", str(len(advice)), "n-plans", note=f"{advice.stats.get('plans', 0):,} plans checked, "
                      f"{advice.stats.get('too_big', 0):,} too big; {seconds:.2f} s")]
        if advice:
            best = advice[0]
            items.append(card("Best", best.plan.describe(), "best-plan",
                              note=f"MFU {best.prediction.mfu:.1%}, {format_bytes(best.memory.peak_bytes)}", tone="good"))
        items.append(card("Baseline", "fits" if base.fits else "does not fit", "baseline",
                          note=baseline + (f" — best is {gain:.2f}x faster" if gain else ""),
                          tone="" if base.fits else "warn"))
        self._status.object = cards(items) + (
            muted("Click a row to apply that plan to the mesh, memory and pipeline views.") if advice
            else error_line("No plan fits: try more nodes or a shorter sequence."))

    @staticmethod
    def band_html(advice: Any) -> Html:
        """The table's caption: the profile its times are priced under and that profile's band."""
        if not advice:
            return Html("")
        best = advice[0]
        text = band_text(best.config.train.profile, best.prediction.step_time_s)
        return muted(f"Step times priced under the {best.config.train.profile.name} profile; best plan: {text}",
                     "advisor-band")

    # ------------------------------------------------------------------ choose
    def choose(self, index: int) -> None:
        """Apply candidate ``index`` (0 = best) to the shared state."""
        c = self.advice[index]
        self.state.apply(**plan_settings(c))
        lines = concat(*(render("<li>{}</li>", x) for x in c.explanation))
        self._explain.object = render('<h4 data-testid="chosen-plan">Applied #{}: {}, mbs {}, recompute {}</h4>'
                                      "<ul>{}</ul>", c.rank, c.plan.describe(), c.train.micro_batch_size,
                                      c.train.recompute, lines)

    def _on_select(self, event: Any) -> None:
        if event.new and self.advice is not None:
            self.choose(event.new[0])

    def panel(self) -> pn.viewable.Viewable:
        if self._layout is None:
            self._layout = pn.Column(
                pn.Row(self._button, self._top, self._framework),
                self._status,
                self._band,
                self._table,
                self._explain,
                sizing_mode="stretch_width",
            )
        return self._layout

    def __panel__(self) -> pn.viewable.Viewable:
        return self.panel()
