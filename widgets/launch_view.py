"""View 6, launch: start the current plan with the bundled trainer, stop and resume it, export it.

What starts is the shared current plan (``PlanState.config``, set in the planning tabs: model,
cluster, degrees, batch, precision) with the trainer's own knobs added here (steps, checkpoint
interval, the acceptance thresholds declared before the run: ``TrainSettings.accept``):
:func:`launch_config`. The browser launches only the bundled trainer, with that
validated RunConfig, never a command line. The backend is where the nodes run: ``local``
(Jupyter kernels on this machine), ``ssh`` (kernels on the listed hosts), ``gateway`` (a Jupyter
Enterprise/Kernel Gateway: URL and token) or ``slurm`` (an allocation: partition, account, time
limit, further sbatch options, checked as the CLI checks them: :class:`SlurmRequest`).

Before anything starts, :func:`blockers` says in one line each (field, value, rule) why this
machine cannot train the plan: a GPU cluster with no local GPUs to run it on, a model too large for
the CPU trainer, a bill that does not fit, a layout the trainer does not implement
(:func:`~workbench.spec.trainable.unsupported`). Nothing is substituted: :func:`offers` proposes
plans that can run (the same plan on the tiny model, on local-cpu), and one applies only when
pressed. The export (:mod:`widgets.plan_export`) shows the ``workbench`` lines and the RunConfig
JSON of exactly what Start runs, to copy or download.

Once a plan has been launched, "Run the naive baseline" launches its baseline
(:func:`workbench.launch.baseline.baseline_config`: plain data parallel over the same ranks, the
same model, data and global batch, the first steps of its schedule) on the same backend, recorded
in the baseline's manifest as the baseline of that run, so that 8 · Compare labels it; a baseline
that cannot run says why in one line and nothing starts. An ended run's declared thresholds are
judged (:func:`workbench.rundir.acceptance.evaluate_acceptance`) and shown under its status.

Launching, stopping and resuming take seconds (kernels start, torchrun stops): they run in a
worker thread, with a spinner and a line saying what is happening and for how long, so the page
stays responsive; the status table refreshes from the session's poll.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import panel as pn
import param

from workbench import ConfigError, ModelSpec, RunConfig, estimate_memory
from workbench.launch import launch
from workbench.launch.baseline import BASELINE_STEPS, baseline_config
from workbench.launch.handle import BACKENDS
from workbench.launch.local import config_from_cli
from workbench.launch.slurm_options import SlurmRequest
from workbench.rundir.acceptance import evaluate_acceptance
from workbench.spec.acceptance import METRICS as ACCEPT_METRICS
from workbench.spec.trainable import check_trainable, unsupported

from widgets.compare_view import verdict_table
from widgets.icons import icon
from widgets.markup import Html, concat, render
from widgets.plan_export import JSON_NAME, config_json, export_text, memory_line, train_line, warmup_for
from widgets.run_session import RunSession, session_of
from widgets.run_transforms import status_rows
from widgets.state import PlanState
from widgets.transforms import format_bytes, format_count, recompute_words
from widgets.ui import FieldErrors, card, cards, error_line, html_pane, muted, table

STATE_TONES = {"running": "good", "finished": "good", "failed": "bad", "stopped": "warn", "starting": ""}
# On CPU a step of a larger model takes minutes: the bundled trainer trains small models there.
CPU_MAX_PARAMS = 100_000_000
SMALL_MODEL = "tiny"
MAX_OFFERED_CPU_RANKS = 8  # an offer starts no more processes than a laptop runs comfortably
MAX_OFFERS = 2
SLURM_FIELDS = ("partition", "account", "time_limit", "extra_sbatch")
OWN_FIELDS = ("steps", "checkpoint_every", "accept", "hosts", "url", *SLURM_FIELDS)  # the fields of this tab
ACCEPT_EXAMPLE = "tokens_per_s_per_gpu>=2000,step_time_error<=0.25"
PRE_STYLE = ("background:#f6f8fa;border:1px solid #d8dee6;border-radius:6px;padding:6px 10px;font-size:12px;"
             "white-space:pre-wrap;overflow-wrap:anywhere;max-height:260px;overflow:auto;margin:2px 0 8px 0;"
             "user-select:text")


# ---------------------------------------------------------------------------- the config that starts
def build_launch_config(model: str, plan: str, steps: int, checkpoint_every: int = 0, seq_len: int = 64,
                        micro_batch_size: int = 2) -> RunConfig:
    """A RunConfig from a model preset and a plan text, as ``workbench train`` builds it
    (ConfigError naming the field when the trainer cannot run it): ``model`` preset, ``plan`` text
    ("pp=2,dp_shard=2"), local-cpu cluster with two ranks per node
    (:func:`workbench.launch.local.config_from_cli`). The view launches the current plan
    (:func:`launch_config`); this is the same check for loose values."""
    check_trainer_knobs(steps=steps, checkpoint_every=checkpoint_every, seq_len=seq_len,
                        micro_batch_size=micro_batch_size)
    if model not in ModelSpec.presets():
        raise ConfigError(f"model={model!r} is not a preset ({', '.join(ModelSpec.presets())})", field="model",
                          value=model)
    try:
        config = config_from_cli(model, plan, int(steps), checkpoint_every=int(checkpoint_every),
                                 seq_len=int(seq_len), micro_batch_size=int(micro_batch_size))
    except ConfigError as err:
        if err.field in (None, "", "plan") or "=" in str(plan):
            raise ConfigError(str(err), field=err.field or "plan", value=err.value) from None
        raise
    except ValueError as err:  # a plan text that does not parse
        raise ConfigError(f"plan={plan!r}: {err}", field="plan", value=plan) from None
    check_trainable(config)
    return config


def check_trainer_knobs(**values: Any) -> None:
    """steps >= 1, checkpoint_every >= 0, ...: ConfigError naming the first that is not."""
    lows = {"steps": 1, "checkpoint_every": 0, "seq_len": 1, "micro_batch_size": 1}
    for name, v in values.items():
        if v is None or int(v) < lows[name]:
            raise ConfigError(f"{name}={v} must be an integer >= {lows[name]}", field=name, value=v)


def launch_config(plan: RunConfig, steps: int, checkpoint_every: int = 0, accept: str = "") -> RunConfig:
    """The current plan with the trainer's knobs: ``steps``, the warm-up ``workbench train`` gives
    them, ``checkpoint_every``, and the acceptance thresholds ``accept``
    (:func:`workbench.spec.acceptance.parse_accept`: a bad one is a ConfigError with field
    "accept" naming the rule). Everything else (model, cluster, degrees, batch, precision,
    framework) is the plan's."""
    check_trainer_knobs(steps=steps, checkpoint_every=checkpoint_every)
    steps, every = int(steps), int(checkpoint_every)
    return plan.replace(train=replace(plan.train, steps=steps, warmup_steps=warmup_for(steps),
                                      checkpoint_every=every, accept=(accept or "").strip()))


# ---------------------------------------------------------------------------- can it train here
def local_gpu_count() -> int:
    """NVIDIA GPUs this machine shows its processes (the driver's list, narrowed by
    ``CUDA_VISIBLE_DEVICES``), without importing torch into the app."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    try:
        n = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:  # a container may show the devices without the driver's /proc
        try:
            n = len([d for d in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", d)])
        except OSError:
            return 0
    if visible:
        n = min(n, len([v for v in visible.split(",") if v.strip()]))
    return n


@dataclass(frozen=True)
class Blocker:
    """Why this machine cannot train the plan: the field, its value and the rule."""

    field: str
    value: Any
    rule: str

    def line(self) -> str:
        return f"{self.field}={self.value!r}: {self.rule}"


def blockers(config: RunConfig, backend: str = "local", gpus: int | None = None) -> list[Blocker]:
    """Everything that stops the bundled trainer from running ``config`` from here (empty: it can).
    ``gpus``: this machine's GPUs (default :func:`local_gpu_count`); the ssh, gateway and slurm
    backends start the nodes elsewhere, so their GPUs are not counted here."""
    c, model = config.cluster, config.model
    out: list[Blocker] = []
    on_cpu = c.gpu.name == "cpu"
    if not on_cpu and backend == "local":  # only the local backend starts its nodes on this machine
        have = local_gpu_count() if gpus is None else gpus
        if have < c.world_size:
            mine = f"this machine has {have} GPU{'s' if have != 1 else ''}" if have else "this machine has no GPU"
            out.append(Blocker("cluster", c.name, (
                f"{c.nodes} × {c.gpus_per_node} {c.gpu.name} = {c.world_size} GPUs, and {mine}; the local backend "
                "starts every node here (plan on local-cpu to train on this machine's CPUs)")))
    if on_cpu and model.n_params() > CPU_MAX_PARAMS:
        out.append(Blocker("model", model.name or "custom", (
            f"{format_count(model.n_params())} parameters; on CPU the bundled trainer trains models of at most "
            f"{format_count(CPU_MAX_PARAMS)}")))
    fit = estimate_memory(config).fits()
    if not fit.fits:
        out.append(Blocker("peak memory", format_bytes(fit.peak_bytes), (
            f"more than the {format_bytes(fit.hbm_bytes)} of one {c.gpu.name}: the plan does not fit (2 · Memory)")))
    out += [Blocker("plan", config.plan.describe(), why) for why in unsupported(config)]
    return out


@dataclass(frozen=True)
class Offer:
    """A plan that can run, as the PlanState changes that make it (applied only when pressed)."""

    label: str
    changes: dict[str, Any]


RESULTS = ("name", "config", "prediction", "error", "error_field")  # PlanState params it computes


def config_with(state: PlanState, changes: dict[str, Any]) -> RunConfig | None:
    """The config the state would have after ``state.apply(**changes)`` (None: invalid), worked out
    on a scratch copy (so the precision follows a new cluster as it would): the state is left as it is."""
    scratch = PlanState(**{k: v for k, v in state.param.values().items() if k not in RESULTS})
    scratch.apply(**changes)
    return scratch.config


def offers(state: PlanState, backend: str = "local", gpus: int | None = None) -> list[Offer]:
    """Plans close to the current one that this machine can train: the same degrees on the tiny
    model (and on local-cpu when the cluster is out of reach), then the tiny model with pp=2 on
    one local-cpu node. Empty when the current plan trains here."""
    config = state.config
    if config is not None and not blockers(config, backend, gpus):
        return []
    small = ModelSpec.preset(SMALL_MODEL)
    candidates: list[tuple[str, dict[str, Any]]] = []
    if config is not None:
        world = config.world_size
        same: dict[str, Any] = {"model": small}
        where = ""
        if config.cluster.gpu.name != "cpu":
            same.update(cluster="local-cpu", nodes=max(1, world // 2))
            where = f" on local-cpu ({world} ranks)"
        if world <= MAX_OFFERED_CPU_RANKS or config.cluster.gpu.name == "cpu":
            candidates.append((f"the same plan ({config.plan.describe()}) on the {SMALL_MODEL} model{where}", same))
    candidates.append((f"the {SMALL_MODEL} model, pp=2 on one local-cpu node (2 ranks)", dict(
        model=small, cluster="local-cpu", nodes=1, tp=1, pp=2, cp=1, ep=1, dp_shard=-1, dp_replicate=1,
        pp_schedule="1f1b", virtual_stages=1, global_batch_size=0)))
    out: list[Offer] = []
    seen: list[RunConfig] = []
    for label, changes in candidates:
        cfg = config_with(state, changes)
        if cfg is None or cfg in seen or blockers(cfg, backend, gpus):
            continue
        seen.append(cfg)
        out.append(Offer(label, changes))
    return out


# ---------------------------------------------------------------------------- what the page shows
def backend_options(backend: str, hosts: str, url: str, token: str, *, partition: str = "", account: str = "",
                    time_limit: str = "", extra_sbatch: str = "") -> dict[str, Any]:
    """Keyword arguments of ``launch`` for the backend (hosts: comma- or space-separated;
    ``extra_sbatch``: whitespace-separated ``--option=value`` items). ConfigError names the field."""
    if backend == "ssh":
        names = [h for h in hosts.replace(",", " ").split() if h]
        if not names:
            raise ConfigError("hosts='' : the ssh backend needs the hosts to start the nodes on", field="hosts",
                              value=hosts)
        return {"hosts": names}
    if backend == "gateway":
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"url={url!r} must be an http(s) URL of the gateway", field="url", value=url)
        return {"url": url, "token": token or None}
    if backend == "slurm":
        return slurm_options(partition, account, time_limit, extra_sbatch)
    return {}


def slurm_options(partition: str, account: str, time_limit: str, extra_sbatch: str) -> dict[str, Any]:
    """The slurm backend's options from the form's text, checked by :class:`SlurmRequest` (the
    CLI's rules): empty fields are Slurm's defaults (None)."""
    request = SlurmRequest(partition=partition.strip() or None, account=account.strip() or None,
                           time_limit=time_limit.strip() or None, extra_sbatch=tuple(extra_sbatch.split()))
    return request.to_dict()


def status_html(status: Any, run_dir: str, replay: bool, digest_note: str = "", verdicts: Html = Html("")) -> Html:
    """Run state card and the per-rank table (a replayed directory has no live status), then the
    verdicts of its acceptance thresholds once it has ended (:func:`acceptance_html`)."""
    if status is None:
        if not run_dir:
            return muted("No run yet.")
        return cards([card("Run", "replay", "run-state", note=run_dir)]) + (
            muted(digest_note) if digest_note else Html("")) + verdicts
    head = cards([card("Run", status.state, "run-state", note=run_dir, tone=STATE_TONES.get(status.state, ""))])
    why = error_line(status.why, "run-why") if status.why else Html("")
    rows = [[r["node"], r["host"], r["rank"], r["state"], r["step"], r["loss"], r["events"], r["why"]]
            for r in status_rows(status)]
    return head + why + table(["node", "host", "rank", "state", "step", "loss", "events", "why"], rows,
                              testid="rank-status", numeric=(0, 2, 4, 5, 6)) + verdicts


def acceptance_html(run_dir: str) -> tuple[Html, bool]:
    """(the verdicts of the run's declared thresholds once it has ended, whether it has): a table
    of status, threshold and measured value; nothing while it runs or when it declared none."""
    try:
        verdicts, ended = evaluate_acceptance(run_dir)
    except Exception as err:  # noqa: BLE001 - a damaged run directory: said, the view keeps working
        return error_line(f"acceptance thresholds not judged: {err}", "run-acceptance-error"), True
    if not ended:
        return Html(""), False
    return verdict_table(verdicts, "run-acceptance", ended), True


def plan_html(config: RunConfig | None, error: str) -> Html:
    """The plan Start runs, as cards (or why there is none)."""
    if config is None:
        return cards([card("Current plan", "invalid", "launch-plan", note=error, tone="bad")])
    c, t = config.cluster, config.train
    return cards([
        card("Model", config.model.name or "custom", "launch-model",
             note=f"{format_count(config.model.n_params())} parameters"),
        card("Cluster", f"{c.nodes} × {c.gpus_per_node} {c.gpu.name}", "launch-cluster", note=c.name),
        card("Plan", config.plan.describe(), "launch-plan", note=f"{config.world_size} ranks"),
        card("Batch", f"seq {t.seq_len} · mbs {t.micro_batch_size} · gbs {t.global_batch_size}", "launch-batch",
             note=f"{config.n_microbatches} micro-batches per step"),
        card("Precision", t.precision or "custom", "launch-precision",
             note=f"{recompute_words(t.recompute)}, {t.profile.name}"),
    ])


def verdict_html(config: RunConfig | None, error: str, found: list[Blocker]) -> Html:
    """One line per reason this machine cannot train the plan, or that it can."""
    if config is None:
        return error_line(f"The current plan is invalid: {error}", "launch-blocked")
    if not found:
        return muted(f"Start runs this plan here: {config.world_size} ranks of the bundled trainer on "
                     f"{config.cluster.nodes} node{'s' if config.cluster.nodes > 1 else ''}.", "launch-ok")
    lines = [reason_line(b.line(), "launch-blocked" + (f"-{i}" if i else "")) for i, b in enumerate(found)]
    return concat(render('<div class="wb-muted">{}</div>', "This machine cannot train the current plan:"), *lines)


def baseline_record(baseline_of: dict[str, Any]) -> dict[str, Any]:
    """The keyword of :func:`workbench.launch.handle.launch` that records ``baseline_of`` in the
    run's manifest (``create_run_dir``'s ``manifest_extra``)."""
    return {"manifest_extra": {"baseline_of": baseline_of}}


def reason_line(text: str, testid: str) -> Html:
    """A red line as wide as the page: a reason is one line, not a narrow paragraph."""
    return render('<div class="wb-error" style="max-width:none" data-testid="{}">{}</div>', testid, text)


def export_html(plan: RunConfig | None, launched: RunConfig | None, run_root: str, error: str = "") -> Html:
    """The ``workbench`` lines and the RunConfig JSON of what Start runs, as copyable text."""
    if plan is None or launched is None:
        return muted(f"Nothing to export: {error}" if error else "Nothing to export.", "export-none")
    mem, train = memory_line(plan), train_line(launched, run_root)

    def block(title: str, text: str, testid: str, note: str = "") -> Html:
        head = render('<div class="wb-muted">{}</div>', title + (f" ({note})" if note else ""))
        return head + render('<pre style="{}" data-testid="{}">{}</pre>', PRE_STYLE, testid, text)

    return concat(
        block("The plan's bill and predictions: workbench memory", mem.text or f"# {mem.why}", "export-memory"),
        block("Train it with the bundled trainer: workbench train", train.text, "export-train", train.why),
        block(f"RunConfig JSON ({JSON_NAME}: workbench train --config {JSON_NAME})", config_json(launched).rstrip(),
              "export-json"),
    )


# ---------------------------------------------------------------------------- the view
class LaunchView(pn.viewable.Viewer):
    """Launch the current plan with the bundled trainer; stop and resume it; watch its status."""

    state = param.ClassSelector(class_=PlanState)
    backend = param.Selector(default="local", objects=list(BACKENDS))
    hosts = param.String(default="", doc="ssh: host names, comma-separated (node 0 first)")
    url = param.String(default="", doc="gateway: its URL")
    token = param.String(default="", doc="gateway: its token (never written to disk)")
    partition = param.String(default="", doc="slurm: the partition (several: comma-separated; empty: the default)")
    account = param.String(default="", doc="slurm: the account to charge (empty: the user's default)")
    time_limit = param.String(default="", doc="slurm: the allocation's time limit (empty: the partition's)")
    extra_sbatch = param.String(default="", doc="slurm: further --option=value items, whitespace-separated")
    steps = param.Integer(default=40, allow_None=True)
    checkpoint_every = param.Integer(default=0, allow_None=True)
    accept = param.String(default="", doc="Acceptance thresholds declared before the run (TrainSettings.accept), "
                          "e.g. " + ACCEPT_EXAMPLE)
    gpus = param.Integer(default=None, allow_None=True, doc="This machine's GPUs (None: look)")

    def __init__(self, state: PlanState | None = None, session: RunSession | None = None, **params: Any):
        super().__init__(state=state or PlanState(), **params)
        self.session = session or session_of(self.state)
        self._errors = FieldErrors("launch")
        p = self.param
        self._backend = pn.widgets.RadioButtonGroup.from_param(p.backend, color="primary",
                                                              variant="outline", margin=(22, 10, 4, 10))
        self._hosts = self._errors.wrap("hosts", pn.widgets.TextInput.from_param(p.hosts, label="hosts", width=260))
        self._url = self._errors.wrap("url", pn.widgets.TextInput.from_param(p.url, label="gateway URL", width=260))
        self._token = pn.widgets.PasswordInput.from_param(p.token, label="token", width=160)
        self._slurm = self._slurm_inputs()
        self._fields = [
            self._errors.wrap("steps", pn.widgets.IntInput.from_param(p.steps, label="steps", width=90, start=1)),
            self._errors.wrap("checkpoint_every", pn.widgets.IntInput.from_param(
                p.checkpoint_every, label="checkpoint every", width=120, start=0)),
            self._errors.wrap("accept", pn.widgets.TextInput.from_param(
                p.accept, label="Acceptance thresholds", placeholder=ACCEPT_EXAMPLE, width=340,
                description="metric>=value or metric<=value, comma-separated; judged when the run ends "
                            "(metrics: " + ", ".join(ACCEPT_METRICS) + ")")),
        ]
        self._start = pn.widgets.Button(label="Start", color="primary", icon=icon("play"), margin=(22, 5, 0, 10))
        self._stop = pn.widgets.Button(label="Stop", color="danger", icon=icon("stop"), margin=(22, 5, 0, 5),
                                       disabled=True)
        self._resume = pn.widgets.Button(label="Resume", color="success", icon=icon("resume"),
                                         margin=(22, 5, 0, 5), disabled=True)
        self._baseline = pn.widgets.Button(
            label="Run the naive baseline", color="primary", variant="outline", icon=icon("play"),
            margin=(22, 5, 0, 5), disabled=True,
            description=f"The plan launched here as plain data parallel over the same ranks (the same model, data "
                        f"and global batch, the first {BASELINE_STEPS} steps of its schedule), on the same backend")
        self._start.on_click(self._on_start)
        self._stop.on_click(self._on_stop)
        self._resume.on_click(self._on_resume)
        self._baseline.on_click(self._on_baseline)
        self._plan = html_pane("", margin=(0, 10), sizing_mode="stretch_width")
        self._verdict = html_pane("", margin=(0, 10), sizing_mode="stretch_width")
        # made once and relabelled: a widget made in a callback links Panel's CSS from its CDN
        self._offer_buttons = [self._offer_button(i) for i in range(MAX_OFFERS)]
        self._shown_offers: list[Offer] = []
        self._offers = pn.Row(*self._offer_buttons, margin=(0, 5))
        self._spinner = pn.indicators.LoadingSpinner(value=False, visible=False, size=22, color="primary",
                                                     margin=(6, 4, 0, 10))
        self._progress = html_pane("", margin=(8, 4))
        self._message = html_pane("", margin=(4, 10))
        self._status = html_pane(status_html(None, "", False), margin=(4, 10), sizing_mode="stretch_width")
        self._export = html_pane("", margin=(0, 10), sizing_mode="stretch_width")
        self._download_json = pn.widgets.FileDownload(callback=self._json_file, filename=JSON_NAME,
                                                      label=f"Download {JSON_NAME}", icon=icon("export"),
                                                      color="primary", variant="outline", width=200,
                                                      margin=(4, 10))
        self._download_sh = pn.widgets.FileDownload(callback=self._script_file, filename="plan.sh",
                                                    label="Download plan.sh", icon=icon("export"),
                                                    color="primary", variant="outline", width=200,
                                                    margin=(4, 10))
        # launched or resumed, waiting for the ranks' first step: (what, since when)
        self._waiting: tuple[str, float] | None = None
        # the plan last launched by Start (its RunHandle) and where: what the baseline button baselines
        self._planned: Any = None
        self._planned_on: tuple[str, dict[str, Any]] = ("local", {})
        # the shown run's acceptance verdicts once it has ended (judged again only when events arrive)
        self._verdicts: tuple[str, Html] | None = None
        self.session.on_events(self._refresh)
        self.state.param.watch(self._show_plan, ["config", "error"])
        self._layout = None
        self._show_backend_fields()
        self._show_plan()

    # ---- inputs
    def _slurm_inputs(self) -> list[pn.Column]:
        """The slurm backend's boxes, each with its error line under it."""
        boxes = [("partition", "partition", "the default", 150), ("account", "account", "the default", 150),
                 ("time_limit", "time limit", "1:00:00", 100),
                 ("extra_sbatch", "extra sbatch options", "--qos=high --constraint=h100", 280)]
        return [self._errors.wrap(name, pn.widgets.TextInput.from_param(self.param[name], label=label,
                                                                         placeholder=hint, width=width))
                for name, label, hint, width in boxes]

    @param.depends("backend", watch=True)
    def _show_backend_fields(self) -> None:
        self._hosts.visible = self.backend == "ssh"
        self._url.visible = self._token.visible = self.backend == "gateway"
        for box in self._slurm:
            box.visible = self.backend == "slurm"

    def launch_config(self) -> RunConfig:
        """What Start runs: the current plan with steps and checkpoints (ConfigError names the field)."""
        config = self.state.config
        if config is None:
            raise ConfigError(f"the current plan is invalid: {self.state.error}", field=self.state.error_field or None)
        return launch_config(config, self.steps, self.checkpoint_every, self.accept)

    def blockers(self) -> list[Blocker]:
        return blockers(self.state.config, self.backend, self.gpus) if self.state.config is not None else []

    def build(self) -> tuple[RunConfig, dict[str, Any]]:
        """The validated config and backend options (ConfigError names the field)."""
        config = self.launch_config()
        found = self.blockers()
        if found:
            raise ConfigError(found[0].line(), field=found[0].field, value=found[0].value)
        check_trainable(config)
        return config, backend_options(self.backend, self.hosts, self.url, self.token, partition=self.partition,
                                       account=self.account, time_limit=self.time_limit,
                                       extra_sbatch=self.extra_sbatch)

    @param.depends("backend", "steps", "checkpoint_every", "accept", "gpus", watch=True)
    def _show_plan(self, *_: Any) -> None:
        config, error = self.state.config, self.state.error
        self._plan.object = plan_html(config, error)
        found = self.blockers()
        self._verdict.object = verdict_html(config, error, found)
        # only a valid plan that cannot run here gets offers (an invalid one is being edited)
        self._shown_offers = offers(self.state, self.backend, self.gpus)[:MAX_OFFERS] if found else []
        for i, button in enumerate(self._offer_buttons):
            button.visible = i < len(self._shown_offers)
            if button.visible:
                button.label = f"Use {self._shown_offers[i].label}"
        try:
            launched = self.launch_config() if config is not None else None
        except ConfigError as err:
            launched, error = None, str(err)
        self._export.object = export_html(config, launched, self.session.runs_root, error)
        self._download_json.disabled = self._download_sh.disabled = launched is None

    def _offer_button(self, i: int) -> pn.widgets.Button:
        button = pn.widgets.Button(label="Use", color="primary", variant="outline", icon=icon("use"),
                                   margin=(4, 5, 8, 5), visible=False)
        button.on_click(lambda _e: self.use_offer(i))
        return button

    def use_offer(self, i: int) -> None:
        """Make the ``i``-th offered plan the current plan (the user pressed its button)."""
        if i < len(self._shown_offers):
            self.state.apply(**self._shown_offers[i].changes)

    def _json_file(self) -> io.StringIO:
        return io.StringIO(config_json(self.launch_config()))

    def _script_file(self) -> io.StringIO:
        return io.StringIO(export_text(self.state.config, self.launch_config(), self.session.runs_root))

    def _fail(self, err: BaseException) -> None:
        field = getattr(err, "field", None)
        if field in OWN_FIELDS:  # under its box; the plan's own fields are fixed in their tabs
            self._errors.show(str(err), field)
        self._message.object = reason_line(f"{type(err).__name__}: {err}", "launch-error")

    def _refuse(self, found: list[Blocker]) -> None:
        """Start pressed on a plan this machine cannot train: the first reason, and nothing starts."""
        self._message.object = reason_line(f"Not started: {found[0].line()}", "launch-error")

    # ---- progress: a spinner and what is happening, with the seconds it has taken
    def _show_progress(self, what: str, since: float) -> None:
        self._spinner.visible = self._spinner.value = True
        self._progress.object = muted(f"{what}… {time.monotonic() - since:.0f} s", "launch-progress")

    def _hide_progress(self) -> None:
        self._spinner.visible = self._spinner.value = False
        self._progress.object = ""

    async def _in_thread(self, what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)`` in a worker thread, the progress line ticking every half second."""
        since = time.monotonic()
        task = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kw))
        self._show_progress(what, since)
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            self._show_progress(what, since)
        return task.result()

    # ---- actions (in a worker thread: they take seconds)
    async def _on_start(self, _event: Any = None) -> None:
        self._errors.show(None, None)
        self._message.object = ""
        found = self.blockers()
        if found:  # said above the buttons already; the reason again where the click is
            self._refuse(found)
            return
        try:
            config, options = self.build()
        except ConfigError as err:
            self._fail(err)
            return
        self._start.disabled = True
        since, nodes = time.monotonic(), config.cluster.nodes
        try:
            run = await self._in_thread(f"Starting {nodes} kernel{'s' if nodes > 1 else ''} for "
                                        f"{config.world_size} ranks", launch, config, self.backend,
                                        run_root=self.session.runs_root, **options)
        except Exception as err:  # noqa: BLE001 - shown plainly, the app keeps working
            self._hide_progress()
            self._fail(err)
            self._start.disabled = False
            return
        self._waiting = ("Kernels started; waiting for the ranks' first step", since)
        self._message.object = muted(f"Launched {run.run_id}.", "launch-message")
        self._planned, self._planned_on = run, (self.backend, options)
        self.session.attach(run)

    async def _on_baseline(self, _event: Any = None) -> None:
        """Launch the naive baseline of the plan last launched here, on the same backend; a
        baseline that cannot run (ConfigError) is one line, and nothing starts."""
        self._errors.show(None, None)
        self._message.object = ""
        planned = self._planned
        if planned is None:
            return
        backend, options = self._planned_on
        of = {"plan": planned.config.plan.describe(), "run_id": planned.run_id}
        try:
            config = baseline_config(planned.config)
        except ConfigError as err:
            self._message.object = reason_line(f"No baseline: {err}", "baseline-error")
            return
        self._start.disabled = self._baseline.disabled = True
        since = time.monotonic()
        try:
            run = await self._in_thread(f"Starting the naive baseline of {of['plan']} ({config.plan.describe()}, "
                                        f"{config.world_size} ranks)", launch, config, backend,
                                        run_root=self.session.runs_root, **baseline_record(of), **options)
        except ConfigError as err:  # refused before anything started (the launcher's checks)
            self._hide_progress()
            self._message.object = reason_line(f"No baseline: {err}", "baseline-error")
            self._start.disabled = self._baseline.disabled = False
            return
        except Exception as err:  # noqa: BLE001 - shown plainly, the app keeps working
            self._hide_progress()
            self._fail(err)
            self._start.disabled = self._baseline.disabled = False
            return
        self._waiting = ("Kernels started; waiting for the baseline's first step", since)
        self._message.object = muted(
            f"Launched {run.run_id}: the naive baseline of {of['run_id']} ({of['plan']}), {config.plan.describe()} "
            f"for the first {config.train.stop_after} of its {config.train.steps} steps.", "launch-message")
        self.session.attach(run)

    async def _on_stop(self, _event: Any = None) -> None:
        run = self.session.run
        if run is None:
            return
        self._stop.disabled = True
        self._waiting = None
        try:
            await self._in_thread("Stopping the ranks", run.stop)
        except Exception as err:  # noqa: BLE001
            self._fail(err)
        self._hide_progress()
        self._message.object = ""
        self.session.poll()

    async def _on_resume(self, _event: Any = None) -> None:
        run = self.session.run
        if run is None:
            return
        self._resume.disabled = True
        since = time.monotonic()
        try:
            await self._in_thread("Resuming from the latest checkpoint: starting the kernels", run.resume)
            self._waiting = ("Resumed; the ranks load the checkpoint, waiting for their first step", since)
        except Exception as err:  # noqa: BLE001
            self._hide_progress()
            self._fail(err)
        self._message.object = ""
        self.session.start_polling()
        self.session.poll()

    # ---- refresh
    def _refresh(self, new: list, status: Any) -> None:  # after each poll of the session
        running = status is not None and status.state in ("starting", "running")
        ended = status is not None and not running
        self._status.object = status_html(status, self.session.run_dir, self.session.replay,
                                          verdicts=self._judged(new, status))
        self._start.disabled = running
        self._stop.disabled = not running
        self._resume.disabled = not ended or self.session.run is None
        self._baseline.disabled = running or self._planned is None
        if self._waiting is not None:
            if ended or any(e.get("kind") == "step" for e in new):
                self._waiting = None
                self._hide_progress()
            else:
                self._show_progress(*self._waiting)

    def _judged(self, new: list, status: Any) -> Html:
        """The shown run's acceptance verdicts once it has ended (:func:`acceptance_html`), judged
        again only when events arrive: a launched run once its status says it ended, a replayed one
        (which may be running elsewhere) once a poll brings no new events."""
        run_dir, config = self.session.run_dir, self.session.config
        if not run_dir or config is None or not config.train.accept or (
                status is not None and status.state in ("starting", "running")):
            self._verdicts = None
            return Html("")
        if self._verdicts is not None and self._verdicts[0] == run_dir and not new:
            return self._verdicts[1]
        if status is None and new:
            self._verdicts = None
            return Html("")
        verdicts, ended = acceptance_html(run_dir)
        self._verdicts = (run_dir, verdicts if ended else Html(""))
        return self._verdicts[1]

    def panel(self) -> pn.viewable.Viewable:
        if self._layout is None:
            self._layout = pn.Column(
                pn.pane.Markdown("**What Start runs**: the current plan (set it in tabs 1-5; **Launch this plan** "
                                 "in the sidebar brings you here)", margin=(10, 10, 0, 10)),
                self._plan,
                self._verdict,
                self._offers,
                # a FlexBox: the slurm boxes wrap onto a second line rather than run off a narrow page
                pn.FlexBox(pn.pane.Markdown("**Backend**", margin=(26, 0, 0, 10)), self._backend,
                           self._hosts, self._url, self._token, *self._slurm),
                pn.FlexBox(*self._fields, self._start, self._stop, self._resume, self._baseline),
                self._errors.general,
                pn.Row(self._spinner, self._progress),
                self._message,
                self._status,
                pn.pane.Markdown("**Export**: the same plan as commands and as a RunConfig JSON",
                                 margin=(10, 10, 0, 10)),
                self._export,
                pn.Row(self._download_json, self._download_sh),
                pn.pane.Markdown(
                    "Only the bundled trainer runs, with the current plan's validated RunConfig plus the steps "
                    "and checkpoints set here. Watch it in **7 · Live run**.",
                    styles={"color": "#5a6570", "font-size": "12px"}),
                sizing_mode="stretch_width",
            )
        return self._layout

    def __panel__(self) -> pn.viewable.Viewable:
        return self.panel()
