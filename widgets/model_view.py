"""View 1, the model sketch: a preset, a Hugging Face config.json (uploaded or pasted), or every
ModelSpec field by hand; parameters and FLOPs per token update as you type.

An invalid edit never raises: the ConfigError's text appears under the field it names, and the
shared state's model becomes None (with the reason), so no other view shows stale numbers.
"""

from __future__ import annotations

from typing import Any

import panel as pn
import param

from workbench import ModelSpec

from widgets.markup import Html, render
from widgets.state import PlanState
from widgets.transforms import MODEL_FIELDS, build_model, format_count, format_flops, model_form_values, model_summary, parse_hf_config
from widgets.ui import FieldErrors, card, cards, error_line, html_pane

CUSTOM = "custom"
GROUP_ORDER = ("Shape", "Attention", "Latent attention", "MLP", "Mixture of experts")


def _editor(f) -> pn.widgets.Widget:
    common = dict(label=f.name, description=f.help or None, width=160, margin=(2, 10))
    if f.kind == "int":
        return pn.widgets.IntInput(start=0, **common)
    if f.kind == "float":
        return pn.widgets.FloatInput(**common)
    if f.kind == "bool":
        # a checkbox has no description tooltip: the help goes into its label
        label = f"{f.name} ({f.help})" if f.help else f.name
        return pn.widgets.Checkbox(label=label, width=330, margin=(10, 10, 2, 10))
    if f.kind == "choice":
        return pn.widgets.Select(options=list(f.choices), **common)
    return pn.widgets.TextInput(**common)


class ModelSketch(pn.viewable.Viewer):
    """Edit the model of ``state`` (a fresh :class:`PlanState` when none is given)."""

    state = param.ClassSelector(class_=PlanState)
    preset = param.Selector(default=CUSTOM, objects=[CUSTOM, *ModelSpec.presets()])

    def __init__(self, state: PlanState | None = None, **params: Any):
        super().__init__(state=state or PlanState(), **params)
        self._errors = FieldErrors("model")
        self._editors = {f.name: _editor(f) for f in MODEL_FIELDS}
        self._loading = False
        self._last: ModelSpec | None = None
        for w in self._editors.values():
            w.param.watch(self._on_edit, "value")
        # Import from Hugging Face
        self._upload = pn.widgets.FileInput(accept=".json", multiple=False, margin=(4, 10))
        self._paste = pn.widgets.TextAreaInput(
            placeholder='{"model_type": "llama", "num_hidden_layers": 32, ...}', height=110,
            sizing_mode="stretch_width", margin=(4, 10),
        )
        self._import = pn.widgets.Button(label="Import pasted config", color="primary", margin=(4, 10))
        self._import_note = html_pane("", margin=(0, 10))
        self._upload.param.watch(self._on_upload, "value")
        self._import.on_click(self._on_paste)
        self._preset_select = pn.widgets.Select.from_param(self.param.preset, label="Preset", width=220)
        self._fill(self.state.model or ModelSpec.preset("tiny"))
        self.state.param.watch(self._on_state_model, "model")

    # ------------------------------------------------------------------ model <-> form
    def _fill(self, spec: ModelSpec) -> None:
        self._loading = True
        try:
            for name, value in model_form_values(spec).items():
                self._editors[name].value = value
        finally:
            self._loading = False
        self._last = spec
        self._errors.show(None, None)
        self.preset = spec.name if spec.name in ModelSpec.presets() and spec == ModelSpec.preset(spec.name) else CUSTOM

    def _on_edit(self, _event: Any) -> None:
        if self._loading:
            return
        checked = build_model({n: w.value for n, w in self._editors.items()})
        self._errors.show(checked.error, checked.field)
        self._last = checked.value
        if checked.ok and not (checked.value.name in ModelSpec.presets()
                               and checked.value == ModelSpec.preset(checked.value.name)):
            self.preset = CUSTOM
        self.state.param.update(model=checked.value, model_error=checked.error or "")

    def _on_state_model(self, event: Any) -> None:
        if event.new is not None and event.new != self._last:
            self._fill(event.new)

    @param.depends("preset", watch=True)
    def _on_preset(self) -> None:
        if self.preset != CUSTOM and (self._last is None or self._last.name != self.preset
                                      or self._last != ModelSpec.preset(self.preset)):
            self.state.param.update(model=ModelSpec.preset(self.preset), model_error="")

    # ------------------------------------------------------------------ Hugging Face import
    def load_hf_config(self, text: str | bytes) -> bool:
        """Replace the model by the one a config.json describes; False (and the reason shown)
        when it cannot be read."""
        checked = parse_hf_config(text)
        if not checked.ok:
            self._import_note.object = error_line(checked.error, "error-hf_config")
            return False
        spec = checked.value
        self._import_note.object = render(
            '<div class="wb-muted" data-testid="hf-imported">Imported {}: {} layers, d_model {}, {} parameters</div>',
            spec.name or "model", spec.n_layers, spec.d_model, format_count(spec.n_params()))
        self.state.param.update(model=spec, model_error="")
        return True

    def _on_upload(self, event: Any) -> None:
        if event.new:
            self.load_hf_config(event.new)

    def _on_paste(self, _event: Any) -> None:
        self.load_hf_config(self._paste.value or "")

    # ------------------------------------------------------------------ views
    def _summary(self, model: ModelSpec | None, seq_len: int | None, model_error: str) -> Html:
        if model is None:
            return cards([card("Parameters", "—", "n-params", note="fix the field marked below", tone="bad")])
        s = model_summary(model, seq_len or 1)
        items = [card("Parameters", format_count(s["n_params"]), "n-params", note=f'{s["n_params"]:,}')]
        if model.is_moe:
            items.append(card("Active parameters", format_count(s["n_active_params"]), "n-active-params",
                              note=f"top {model.top_k} of {model.n_experts} experts"))
        items.append(card("Training FLOPs / token", format_flops(s["flops_per_token"]), "flops-per-token",
                          note=("6N + 6·L·H·(d_qk + d_v)·s" if model.is_mla else "6N + 12·L·h·s") + f" at seq_len {s['seq_len']}"))
        if model.n_mtp_layers:
            items.append(card("MTP modules", format_count(s["n_mtp_params"]), "n-mtp-params",
                              note=f"{model.n_mtp_layers} multi-token-prediction module(s), not in the total"))
        if model.is_mla:
            heads = (f"{model.n_heads} heads, latent attention: q {model.q_lora_rank or 'direct'}, kv {model.kv_lora_rank}, "
                     f"head {model.qk_nope_head_dim}+{model.qk_rope_head_dim} / v {model.v_head_dim}")
        else:
            heads = f"{model.n_heads} heads ({model.n_kv_heads} KV) × {model.head_dim}"
        items.append(card("Shape", f"{model.n_layers} × {model.d_model}", "shape", note=heads))
        items.append(card("KV cache / token", f'{s["kv_cache_values_per_token"]:,}', "kv-cache-per-token",
                          note="values per layer: " + ("the latent and the RoPE key" if model.is_mla else "K and V of every KV head")))
        return cards(items)

    def panel(self) -> pn.viewable.Viewable:
        """The view's layout (built once: a widget lives in one layout)."""
        if getattr(self, "_layout", None) is None:
            self._layout = self._build()
        return self._layout

    def _build(self) -> pn.viewable.Viewable:
        groups = []
        for g in GROUP_ORDER:
            items = [self._errors.wrap(f.name, self._editors[f.name]) for f in MODEL_FIELDS if f.group == g]
            groups.append(pn.Card(pn.FlexBox(*items), title=g, collapsible=False, width=400, margin=(5, 8)))
        summary = html_pane(pn.bind(self._summary, self.state.param.model, self.state.param.seq_len,
                                    self.state.param.model_error), sizing_mode="stretch_width")
        importer = pn.Card(
            pn.pane.Markdown("Upload a Hugging Face `config.json` (Llama, Mistral, Mixtral, Qwen2/3, DeepSeek-V2/V3) or paste it:",
                             margin=(0, 10)),
            self._upload, self._paste, self._import, self._import_note,
            title="Import from Hugging Face", collapsed=False, sizing_mode="stretch_width", margin=(5, 8),
        )
        return pn.Column(
            pn.Row(self._preset_select, pn.pane.Markdown(
                "Pick a preset, import a config, or edit any field: numbers update as you type. "
                "Fields marked *0 = auto* derive from the others.", margin=(22, 10, 0, 10))),
            summary,
            self._errors.general,
            pn.FlexBox(*groups),
            importer,
            sizing_mode="stretch_width",
        )

    def __panel__(self) -> pn.viewable.Viewable:
        return self.panel()
