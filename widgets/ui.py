"""Small Panel building blocks shared by the views: stat cards, tables and inline field errors."""

from __future__ import annotations

import html
from typing import Any, Iterable, Sequence

import panel as pn

CSS = """
:host { --wb-accent: #0b5394; }
.wb-cards { display: flex; flex-wrap: wrap; gap: 10px; margin: 4px 0 8px 0; }
.wb-card { border: 1px solid #d8dee6; border-radius: 6px; padding: 8px 12px; min-width: 130px;
           background: #fbfcfe; }
.wb-card .wb-label { font-size: 11px; color: #5a6570; text-transform: uppercase; letter-spacing: .04em; }
.wb-card .wb-value { font-size: 20px; font-weight: 600; color: #1f2d3a; margin-top: 2px; }
.wb-card .wb-note { font-size: 11px; color: #5a6570; }
.wb-card.good { border-left: 4px solid #2e7d32; }
.wb-card.bad { border-left: 4px solid #c62828; }
.wb-card.warn { border-left: 4px solid #ef6c00; }
table.wb-table { border-collapse: collapse; font-size: 13px; margin: 2px 0 8px 0; }
table.wb-table th { text-align: left; color: #5a6570; font-weight: 600; border-bottom: 2px solid #d8dee6;
                    padding: 3px 10px 3px 0; }
table.wb-table td { border-bottom: 1px solid #eef1f4; padding: 3px 10px 3px 0; }
table.wb-table td.num { text-align: right; font-variant-numeric: tabular-nums; }
.wb-swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 6px; }
.wb-error { color: #b71c1c; font-size: 12px; line-height: 1.3; max-width: 420px; }
.wb-muted { color: #5a6570; font-size: 12px; }
"""


def html_pane(text: str = "", **kw: Any) -> pn.pane.HTML:
    """An HTML pane that carries the shared stylesheet (panes live in their own shadow DOM)."""
    return pn.pane.HTML(text, stylesheets=[CSS], **kw)


def card(label: str, value: str, testid: str, note: str = "", tone: str = "") -> str:
    """One stat card; ``data-testid`` lets the browser tests read the number."""
    note_html = f'<div class="wb-note">{html.escape(note)}</div>' if note else ""
    return (
        f'<div class="wb-card {tone}"><div class="wb-label">{html.escape(label)}</div>'
        f'<div class="wb-value" data-testid="{testid}">{html.escape(value)}</div>{note_html}</div>'
    )


def cards(items: Iterable[str]) -> str:
    return '<div class="wb-cards">' + "".join(items) + "</div>"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], testid: str = "", numeric: Sequence[int] = ()) -> str:
    """A plain HTML table; cells are escaped unless wrapped in :class:`Raw`."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for i, v in enumerate(row):
            text = v.html if isinstance(v, Raw) else html.escape(str(v))
            cls = ' class="num"' if i in numeric else ""
            cells.append(f"<td{cls}>{text}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    tid = f' data-testid="{testid}"' if testid else ""
    return f'<table class="wb-table"{tid}><tr>{head}</tr>{"".join(body)}</table>'


class Raw:
    """Trusted HTML for :func:`table` (built here, never from user input)."""

    def __init__(self, html_text: str):
        self.html = html_text


def swatch(color: str) -> Raw:
    return Raw(f'<span class="wb-swatch" style="background:{color}"></span>')


def labelled(label: str, widget: pn.viewable.Viewable) -> pn.Column:
    """A widget under a small label (button groups show none of their own)."""
    return pn.Column(pn.pane.HTML(f'<div style="font-size:13px;color:#333">{html.escape(label)}</div>',
                                  margin=(4, 10, 0, 10)), widget, margin=0)


class FieldErrors:
    """Inline validation: an error line under each named widget, plus one general alert for errors
    naming a field this view does not edit (the message says which field; the app never raises)."""

    def __init__(self, where: str = "") -> None:
        self._slots: dict[str, pn.pane.HTML] = {}
        self._where = where
        self.general = pn.pane.Alert("", alert_type="danger", visible=False, sizing_mode="stretch_width")

    def wrap(self, name: str, widget: pn.viewable.Viewable) -> pn.Column:
        slot = html_pane("", visible=False, margin=(0, 10, 4, 10))
        self._slots[name] = slot
        return pn.Column(widget, slot, margin=0)

    def show(self, message: str | None, field: str | None) -> None:
        """Show ``message`` under the widget for ``field`` (or in the general alert); None clears."""
        for slot in self._slots.values():
            slot.visible = False
        self.general.visible = False
        if not message:
            return
        slot = self._slots.get(field or "")
        if slot is not None:
            slot.object = f'<div class="wb-error" data-testid="error-{field}">{html.escape(message)}</div>'
            slot.visible = True
        else:
            where = f" ({self._where})" if self._where else ""
            self.general.object = f"**Invalid configuration{html.escape(where)}:** {html.escape(message)}"
            self.general.visible = True
