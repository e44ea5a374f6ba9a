"""The framework control: which profile prices the plan (``--framework NAME|profile.json`` on the
CLI). A selector of the built-in profiles (bundled, megatron, fsdp) and of those loaded here, and
a file input for a fitted profile JSON (``workbench calibrate --measured ... -o fit.json``). The
file is read in the browser and sent to the server (Bokeh's own FileInput: nothing is fetched from
a CDN). An invalid file leaves the choice as it was and shows its one-line ConfigError, escaped.
"""

from __future__ import annotations

from typing import Any

import panel as pn

from workbench import ConfigError

from widgets.markup import Html
from widgets.state import PlanState
from widgets.transforms import band_text
from widgets.ui import error_line, html_pane, muted


def framework_select(state: PlanState, width: int = 170) -> pn.widgets.Select:
    """A selector bound to ``state.framework`` (several views may each show one)."""
    return pn.widgets.Select.from_param(
        state.param.framework, label="framework", width=width,
        description="The framework whose memory conventions and time constants price the plan",
    )


class FrameworkPicker:
    """``select`` (the profile), ``upload`` (a fitted profile JSON) and ``note`` (what was loaded,
    or why not); :meth:`load` is the upload's action, callable from notebooks and tests."""

    def __init__(self, state: PlanState):
        self.state = state
        self.select = framework_select(state)
        self.upload = pn.widgets.FileInput(accept=".json", multiple=False, width=230, margin=(4, 10))
        self.note = html_pane("", margin=(0, 10), max_width=420)
        self.upload.param.watch(self._on_upload, "value")

    def load(self, text: str | bytes) -> bool:
        """Load a profile JSON's text and choose it; False (and the reason shown) when it is invalid."""
        try:
            profile = self.state.load_profile(text)
        except ConfigError as err:
            self.note.object = error_line(err, "error-framework")
            return False
        self.note.object = muted(f"Loaded {profile.name}: {band_text(profile)}", "framework-loaded")
        return True

    def _on_upload(self, event: Any) -> None:
        if event.new:
            self.load(event.new)

    def panel(self) -> pn.Column:
        return pn.Column(
            self.select,
            html_pane(Html('<div style="font-size:12px;color:#5a6570">or load a fitted profile (.json)</div>'),
                      margin=(0, 10)),
            self.upload, self.note, margin=0,
        )


__all__ = ["FrameworkPicker", "framework_select"]
