"""What the views load and from where: everything from the installed packages, nothing from the
internet (a cluster login node has none, and neither has a laptop on a plane).

- :func:`extension` loads Panel's, Bokeh's and HoloViews' JavaScript *inline* into a notebook,
  not from their CDNs (a blank output cell otherwise), and makes panes shown in several notebook
  cells update correctly (:func:`update_panes_in_their_own_document`), and keeps a comm message
  that reaches the kernel before its comm is open (:func:`keep_comm_messages_until_their_comm_opens`).
- :class:`OfflineFast` is Panel's Fast design without its Google web font; the served page uses
  the system's font (:data:`SYSTEM_FONT`).
- :func:`keep_stylesheets_local` points Panel's CDN fallback for stylesheets at the server's own
  copy (the served app).
- Button icons are inline SVG (:mod:`widgets.icons`), not the tabler webfont from a CDN.
"""

from __future__ import annotations

import holoviews as hv
import panel as pn
from panel import theme as panel_theme

# The page's font: the system's own. Panel's Fast design imports Open Sans from Google Fonts, a
# request a login node without internet never answers.
SYSTEM_FONT = 'system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif'


class OfflineFast(panel_theme.Fast):
    """Panel's Fast design without its web-font import: everything the page needs comes from the
    installed packages (Panel serves its bundled CSS and JavaScript itself)."""

    _resources = {kind: res for kind, res in panel_theme.Fast._resources.items() if kind != "font"}


# Panel finds a design's bundled files by its class name ("fast/js/fast_design.js").
OfflineFast.__name__ = OfflineFast.__qualname__ = "Fast"


def extension() -> None:
    """Load what the views need (call once in a notebook, before showing a view).

    Inline resources: the notebook gets Bokeh's, Panel's and HoloViews' JavaScript from the
    installed packages, not from a CDN, so the views draw on a machine without internet."""
    pn.extension("tabulator", notifications=False, inline=True)
    hv.extension("bokeh", logo=False, inline=True)
    update_panes_in_their_own_document()
    inline_holoviews_stylesheets()
    keep_comm_messages_until_their_comm_opens()


def inline_holoviews_stylesheets() -> None:
    """A HoloViews object shown in a notebook cell (a Layout, a Curve) renders through HoloViews'
    own display path, which skips the inlining Panel gives its own outputs: its stylesheets would
    be links to Panel's CDN. They are inlined here before the cell's output is made."""
    import holoviews.plotting.renderer as hv_renderer
    from bokeh.models import UIElement
    from panel.config import config
    from panel.io.notebook import patch_inline_stylesheets

    def inlined(render):  # render_model (a static plot) and render_mimebundle (a live one)
        if getattr(render, "_inlined", False):
            return render

        def render_inlined(model, *args, **kwargs):
            if config.inline:
                for sub in model.select({"type": UIElement}):
                    patch_inline_stylesheets(sub)
            return render(model, *args, **kwargs)

        render_inlined._inlined = True
        return render_inlined

    hv_renderer.render_model = inlined(hv_renderer.render_model)
    hv_renderer.render_mimebundle = inlined(hv_renderer.render_mimebundle)


# How many early messages the kernel keeps per comm not yet opened, and for how many such comms
# (a comm whose open never comes must not grow the kernel without bound).
EARLY_MESSAGES_PER_COMM = 256
EARLY_COMMS = 64


def keep_comm_messages_until_their_comm_opens() -> None:
    """JupyterLab (>= 4.4) sends a comm's messages over a kernel *subshell*, and ipykernel (>= 7)
    runs subshells beside the main shell; the comm's ``comm_open`` still goes to the main shell.
    While the main shell is busy (*Run All*: the cells after a view still run), a view's first
    message (a layout size, a click) reaches a subshell before its comm is open there, and
    ipykernel drops it ("No such comm"). Panel's page side then waits for an acknowledgement that
    never comes, and buffers every later change of that view made within its 5 s window for good:
    a click in the page never reaches the kernel. Here a message for a comm not yet open is kept
    and handled right after that comm opens, in the order it was sent, whatever thread gets what
    first. Outside a kernel (a served app, a script) this does nothing."""
    import threading

    from ipykernel.kernelbase import Kernel

    if not Kernel.initialized():
        return
    kernel = Kernel.instance()
    handlers, manager = getattr(kernel, "shell_handlers", None), getattr(kernel, "comm_manager", None)
    if handlers is None or manager is None or getattr(handlers.get("comm_msg"), "_keeps_early", False):
        return
    comm_open, comm_msg = handlers["comm_open"], handlers["comm_msg"]
    early: dict[str, list[tuple]] = {}  # comm id -> messages that came before its comm_open
    lock = threading.Lock()

    def keep_or_handle(stream, ident, msg):
        comm_id = msg["content"].get("comm_id")
        with lock:
            if comm_id in early or manager.comms.get(comm_id) is None:
                if comm_id not in early and len(early) >= EARLY_COMMS:
                    early.pop(next(iter(early)))  # the oldest comm that never opened
                kept = early.setdefault(comm_id, [])
                if len(kept) < EARLY_MESSAGES_PER_COMM:
                    kept.append((stream, ident, msg))
                return None
        return comm_msg(stream, ident, msg)

    def open_then_handle_kept(stream, ident, msg):
        with lock:  # a message arriving meanwhile waits, so the kept ones are handled first
            result = comm_open(stream, ident, msg)
            for args in early.pop(msg["content"].get("comm_id"), []):
                comm_msg(*args)
        return result

    keep_or_handle._keeps_early = True
    handlers["comm_msg"], handlers["comm_open"] = keep_or_handle, open_then_handle_kept


def update_panes_in_their_own_document() -> None:
    """Notebook cells are one Bokeh document each, and a widget of one cell changes the panes of
    another through the shared PlanState. Panel updates those panes with the *widget's* document
    current, so the updated models get stylesheets of another document (Bokeh refuses them: "Models
    must be owned by only a single document") or, where that document has none cached, stylesheets
    linked from Panel's CDN (which a login node cannot reach). Each pane is updated here with its
    own document current, and in an inline notebook its stylesheets are then inlined, as Panel
    inlines them when it first renders a cell."""
    from bokeh.models import UIElement
    from panel.config import config
    from panel.io.notebook import patch_inline_stylesheets
    from panel.io.state import set_curdoc
    from panel.pane.base import Pane

    original = Pane._update_object
    if getattr(original, "_in_own_document", False):
        return

    def _update_object(self, ref, doc, root, parent, comm):
        with set_curdoc(doc):
            result = original(self, ref, doc, root, parent, comm)
        if comm is not None and config.inline:
            for model in root.select({"type": UIElement}):
                patch_inline_stylesheets(model)
        return result

    _update_object._in_own_document = True
    Pane._update_object = _update_object


def keep_stylesheets_local() -> None:
    """Served pages link Panel's CSS from the server, also for a pane updated while its tab is
    hidden: Panel prices such a detached model's stylesheets with no document and falls back to
    its CDN (``panel.reactive``'s ``CDN_DIST``), and since the stylesheet objects are shared, the
    tab shown next links ``cdn.holoviz.org`` (on a login node without internet: no CSS). The
    fallback here is the server's own ``static/extensions/panel/``."""
    import panel.reactive
    from panel.io.resources import LOCAL_DIST

    panel.reactive.CDN_DIST = LOCAL_DIST
