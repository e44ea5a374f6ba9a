"""View 4, the plan advisor: the top plans for the state's model, cluster and settings, with memory
and the headroom it leaves, step time, MFU, bubble and the advisor's explanation, priced under the
state's framework profile (the table's caption states its error band); choosing one applies it to
the shared state, so the mesh, memory and pipeline views show that plan.

What the table shows belongs to the inputs it was computed for. The search records them
(:class:`~workbench.predict.advisor.AdviceInputs`: model, cluster and nodes, sequence length,
global batch, precision, framework profile, headroom); when any of them changes, the table is put
away and one line says what it was computed for and that the inputs changed, and no row can be
applied until the search runs again (back to the same inputs, the table returns).

Every plan is compared at ONE global batch: the user's ``global_batch_size``, or, for 0 (auto),
the batch the advisor fixes before searching (2 sequences per GPU), shown in its own card and as
the table's ``global batch`` column. Plans differ in micro-batch size and micro-batches per
replica, never in the batch. Applying a plan keeps the user's batch: a set batch is the one the
plan was predicted at; auto stays auto where auto resolves that plan to the advisor's batch, and
is otherwise set to the advisor's batch (the applied line says so), so the sidebar's step time
after applying is the row's.

A plan fits only with the headroom (``% of HBM`` box, default 8 %) left free. ``workbench.advise``
takes up to seconds on large clusters: it runs in a worker thread after a button press, which
writes its progress into a counter that the page's coroutine reads four times a second ("evaluated
N of M plan slots" under a progress bar), so the page stays responsive and no widget is touched
from the worker.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Any

import panel as pn
import param

from workbench import Cluster, ConfigError, RunConfig, TrainSettings, advise
from workbench.predict.advisor import (DEFAULT_HEADROOM, MAX_HEADROOM, RECOMPUTE_WORDS, AdviceInputs,
                                       check_headroom, percent, plan_words, search_batch)

from widgets.framework_control import framework_select
from widgets.icons import icon
from widgets.markup import Html, concat, render
from widgets.state import PlanState
from widgets.transforms import advice_rows, band_text, format_bytes, format_seconds, plan_settings
from widgets.ui import card, cards, error_line, html_pane, labelled, muted

# The state's parameters a search depends on (not the plan, micro-batch and recomputation: it
# chooses them), and the training settings among them it passes on when the state has them.
INPUT_PARAMS = ("model", "model_error", "cluster", "nodes", "seq_len", "global_batch_size", "precision",
                "framework", "profiles", "attention")
PASSED_TRAIN_PARAMS = ("attention",)


def _fp8_mfu(step: Any) -> str:
    """`` (30.7% of the FP8 peak)`` beside an FP8 recipe's MFU, else nothing."""
    return "" if step.mfu_fp8_peak is None else f" ({step.mfu_fp8_peak:.1%} of the FP8 peak)"


@dataclass(frozen=True)
class Search:
    """One search's inputs, taken from the state on the page's thread before the worker starts."""

    model: Any
    cluster: Cluster
    train: TrainSettings  # global_batch_size as the user set it (0: auto)
    headroom: float

    @property
    def inputs(self) -> AdviceInputs:
        """What the Advice of this search will record (the batch resolved)."""
        return AdviceInputs(self.model, self.cluster,
                            replace(self.train, global_batch_size=search_batch(self.cluster, self.train)),
                            self.headroom, auto_batch=self.train.global_batch_size == 0)

    def run(self, top: int = 10, progress: Any = None):
        return advise(self.model, self.cluster, self.train, top=top, headroom=self.headroom, progress=progress)


def search_of(state: PlanState, headroom: Any = DEFAULT_HEADROOM) -> Search:
    """The search the state's model, cluster and training settings ask for (ConfigError naming the
    field when one is invalid)."""
    if state.model is None:
        raise ConfigError(f"model: {state.model_error}", field="model")
    try:
        cluster = Cluster.preset(state.cluster, nodes=state.nodes)
        passed = {k: getattr(state, k) for k in PASSED_TRAIN_PARAMS if k in state.param}
        train = TrainSettings(seq_len=state.seq_len, global_batch_size=state.global_batch_size,
                              framework=state.framework_setting, **passed).with_precision(state.precision)
    except TypeError as err:  # an emptied number box
        raise ConfigError(str(err)) from None
    return Search(state.model, cluster, train, check_headroom(headroom))


def run_advisor(state: PlanState, top: int = 10, headroom: Any = DEFAULT_HEADROOM, progress: Any = None):
    """``workbench.advise`` on the state's model, cluster and training settings (the advisor
    chooses the plan, micro-batch size and recomputation itself), under the state's framework
    profile, leaving ``headroom`` of HBM free."""
    return search_of(state, headroom).run(top, progress)


class SearchProgress:
    """What the searching thread has done: it calls the object, the page reads :attr:`value`
    (one attribute written at a time, so a read never sees half an update)."""

    def __init__(self) -> None:
        self.value: tuple[int, int] = (0, 0)

    def __call__(self, done: int, total: int) -> None:
        self.value = (done, total)

    def words(self) -> str:
        done, total = self.value
        return "enumerating the plans ..." if not total else f"evaluated {done:,} of {total:,} plan slots"

    def percent(self) -> int:
        done, total = self.value
        return round(100 * done / total) if total else 0


class AdvisorView(pn.viewable.Viewer):
    """Search plans for ``state`` and apply the chosen one to it."""

    state = param.ClassSelector(class_=PlanState)
    top = param.Selector(default=10, objects=[5, 10, 20])
    headroom = param.Number(default=DEFAULT_HEADROOM, allow_None=True,
                            doc="Fraction of HBM a plan must leave free, in [0, 0.5)")
    advice = param.Parameter(default=None, doc="The last workbench.predict.advisor.Advice")
    stale = param.String(default="", doc="Why the shown advice no longer belongs to the inputs ('' : it does)")

    def __init__(self, state: PlanState | None = None, **params: Any):
        super().__init__(state=state or PlanState(), **params)
        self._button = pn.widgets.Button(label="Find plans", color="primary", icon=icon("search"), width=140)
        self._button.on_click(self._on_click)
        self._top = labelled("show the top", pn.widgets.RadioButtonGroup.from_param(
            self.param.top, color="primary", variant="outline", width=160))
        self._headroom = pn.widgets.FloatInput(
            label="memory headroom (% of HBM)", value=self._percent_of(self.headroom), start=0,
            end=100 * MAX_HEADROOM - 0.1, step=1, width=180)
        self._headroom.param.watch(self._on_headroom_box, "value")
        self._framework = framework_select(self.state)
        self._status = html_pane(Html('<div class="wb-muted">Press <b>Find plans</b> to search every valid plan '
                                      "for this model, cluster and batch.</div>"), sizing_mode="stretch_width")
        self._progress = pn.indicators.Progress(value=0, max=100, width=320,
                                                visible=False, bar_color="primary")
        self._progress_text = html_pane("", visible=False)
        self._table = pn.widgets.Tabulator(
            None, selectable=1, disabled=True, show_index=False, layout="fit_data_table",
            sizing_mode="stretch_width", height=330, visible=False,
            # the plan is read whole, and stays in view while the numbers scroll
            widths={"#": 50, "plan": 340, "recompute": 140}, frozen_columns=["#", "plan"],
        )
        self._table.param.watch(self._on_select, "selection")
        self._band = html_pane("", sizing_mode="stretch_width")
        self._explain = html_pane("", sizing_mode="stretch_width")
        self._layout = None
        watched = [p for p in INPUT_PARAMS if p in self.state.param]
        self.state.param.watch(lambda *_events: self._check_inputs(), watched)

    # ------------------------------------------------------------------ headroom box <-> param
    @staticmethod
    def _percent_of(fraction: float | None) -> float | None:
        return None if fraction is None else round(100 * fraction, 6)

    def _on_headroom_box(self, event: Any) -> None:
        self.headroom = None if event.new is None else event.new / 100

    @param.depends("headroom", watch=True)
    def _headroom_changed(self) -> None:
        if self._headroom.value != self._percent_of(self.headroom):
            self._headroom.value = self._percent_of(self.headroom)
        self._check_inputs()

    # ------------------------------------------------------------------ inputs
    def current_inputs(self) -> AdviceInputs:
        """The inputs a search would have now (ConfigError when one is invalid)."""
        return search_of(self.state, self.headroom).inputs

    def stale_reason(self) -> str:
        """'' when the shown advice belongs to the current inputs; else the line that says not."""
        advice = self.advice
        if advice is None or advice.inputs is None:
            return ""
        was = advice.inputs
        try:
            now = self.current_inputs()
        except ConfigError as err:
            return (f"These plans were computed for {was.describe()}; the inputs changed and are invalid ({err}): "
                    "fix them and search again.")
        if now == was:
            return ""
        changed = ", ".join(was.differences(now)) or "inputs"
        return f"These plans were computed for {was.describe()}; the inputs changed ({changed}): search again."

    def _check_inputs(self) -> None:
        why = self.stale_reason()
        if why == self.stale:
            if why:
                self._status.object = error_line(why, "advisor-stale")
            return
        self.stale = why
        if why:
            self._put_away(why)
        elif self.advice is not None:
            self._render(self.advice)  # back to the inputs it was computed for

    def _put_away(self, why: str) -> None:
        """Results of other inputs: no table to apply from, one line that says why."""
        self._table.selection = []
        self._table.visible = False
        self._band.object = ""
        self._explain.object = ""
        self._status.object = error_line(why, "advisor-stale")

    # ------------------------------------------------------------------ search
    async def _on_click(self, _event: Any) -> None:
        try:
            search = search_of(self.state, self.headroom)  # read here, not from the worker thread
        except ConfigError as err:
            self._status.object = error_line(err, "advisor-error")
            return
        progress = SearchProgress()
        # No loading spinner: Panel fetches its CSS from a CDN, which a login node never answers.
        self._button.disabled = True
        self._status.object = muted("Searching plans ...")
        self._show_progress(progress, visible=True)
        try:
            t0 = time.perf_counter()
            task = asyncio.ensure_future(asyncio.to_thread(search.run, self.top, progress))
            while not task.done():
                self._show_progress(progress)
                await asyncio.wait({task}, timeout=0.25)
            self.show(task.result(), time.perf_counter() - t0)
        except ConfigError as err:
            self._status.object = error_line(err, "advisor-error")
        finally:
            self._show_progress(progress, visible=False)
            self._button.disabled = False

    def _show_progress(self, progress: SearchProgress, visible: bool | None = None) -> None:
        self._progress.value = progress.percent()
        self._progress_text.object = muted(progress.words(), "advisor-progress")
        if visible is not None:
            self._progress.visible = self._progress_text.visible = visible

    def search(self) -> None:
        """Search synchronously (for notebooks and tests)."""
        t0 = time.perf_counter()
        self.show(run_advisor(self.state, self.top, self.headroom), time.perf_counter() - t0)

    def show(self, advice: Any, seconds: float = 0.0) -> None:
        self.advice = advice
        self._seconds = seconds
        self.stale = ""
        self._render(advice)
        self._check_inputs()  # the inputs may have changed while it searched

    def _render(self, advice: Any) -> None:
        import pandas as pd

        rows = advice_rows(advice)
        self._table.value = pd.DataFrame(rows)
        self._table.visible = bool(rows)
        self._table.selection = []
        self._explain.object = ""
        self._band.object = self.band_html(advice)
        base = advice.baseline
        baseline = (f"plain data parallel: {format_seconds(base.prediction.step_time_s)} per step, "
                    f"MFU {base.prediction.mfu:.1%}" + _fp8_mfu(base.prediction) if base.fits else base.reason)
        gain = advice.gain_over_baseline()
        seconds = getattr(self, "_seconds", 0.0)
        items = [card("Top plans", str(len(advice)), "n-plans", note=f"{advice.stats.get('plans', 0):,} plans checked, "
                      f"{advice.stats.get('too_big', 0):,} too big; {seconds:.2f} s")]
        inputs = advice.inputs
        if inputs is not None:
            items.append(card("Global batch", f"{inputs.global_batch_size} sequences", "advisor-batch",
                              note=("auto: 2 per GPU, " if inputs.auto_batch else "") + "the same for every plan"))
            items.append(card("Headroom", percent(inputs.headroom), "advisor-headroom",
                              note=f"of {format_bytes(inputs.cluster.gpu.hbm_bytes)} left free by every plan"))
        if advice:
            best = advice[0]
            items.append(card("Best", best.plan.describe(), "best-plan",
                              note=f"MFU {best.prediction.mfu:.1%}{_fp8_mfu(best.prediction)}, "
                                   f"{format_bytes(best.memory.peak_bytes)}", tone="good"))
        items.append(card("Baseline", "fits" if base.fits else "does not fit", "baseline",
                          note=baseline + (f" — best is {gain:.2f}x faster" if gain else ""),
                          tone="" if base.fits else "warn"))
        self._status.object = cards(items) + (
            muted("Click a row to apply that plan to the mesh, memory and pipeline views.") if advice
            else error_line("No plan fits: try more nodes, a shorter sequence or less headroom."))

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
        """Apply candidate ``index`` (0 = best) to the shared state. ConfigError (field
        ``advice``) when the advice was computed for other inputs: nothing is applied."""
        why = self.stale_reason()
        if why:
            raise ConfigError(why, field="advice")
        c = self.advice[index]
        user_batch = self.state.global_batch_size
        settings = plan_settings(c, user_batch)
        self.state.apply(**settings)
        gbs = c.train.global_batch_size
        if user_batch == 0 and settings["global_batch_size"] == 0:
            batch = f"global batch: auto, which trains {gbs} sequences with this plan"
        elif user_batch == 0:
            cfg = c.config
            auto = RunConfig(cfg.model, cfg.cluster, cfg.plan, replace(cfg.train, global_batch_size=0))
            batch = (f"global batch set to {gbs} sequences, the batch the advisor compared at (auto would "
                     f"train {auto.train.global_batch_size} with this plan, at another step time)")
        else:
            batch = f"global batch kept at {gbs} sequences"
        lines = concat(*(render("<li>{}</li>", x) for x in c.explanation))
        self._explain.object = render(
            '<h4 data-testid="chosen-plan">Applied #{}: {} ({}), micro-batch {} × {} per replica, {}</h4>'
            '<div class="wb-muted" data-testid="chosen-batch">{}</div><ul>{}</ul>',
            c.rank, c.plan.describe(), plan_words(c.plan), c.train.micro_batch_size, c.config.n_microbatches,
            RECOMPUTE_WORDS.get(c.train.recompute, c.train.recompute), batch, lines)

    def _on_select(self, event: Any) -> None:
        if not event.new or self.advice is None:
            return
        why = self.stale_reason()
        if why:  # a click that raced the inputs' change: nothing applied
            self._put_away(why)
            return
        self.choose(event.new[0])

    def panel(self) -> pn.viewable.Viewable:
        if self._layout is None:
            self._layout = pn.Column(
                pn.Row(self._button, self._top, self._headroom, self._framework),
                pn.Row(self._progress, self._progress_text),
                self._status,
                self._band,
                self._table,
                self._explain,
                sizing_mode="stretch_width",
            )
        return self._layout

    def __panel__(self) -> pn.viewable.Viewable:
        return self.panel()
