"""Small Panel building blocks shared by the views: stat cards, tables and inline field errors.

All of them build :class:`~widgets.markup.Html` with :func:`~widgets.markup.render`, so every
label, value and cell is escaped; :func:`html_pane` shows nothing else as markup."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import panel as pn

from widgets.markup import Html, concat, markup_only, render

CSS = """
:host { --wb-accent: #0b5394; }
.wb-cards { display: flex; flex-wrap: wrap; gap: 10px; margin: 4px 0 8px 0; }
.wb-card { border: 1px solid #d8dee6; border-radius: 6px; padding: 8px 12px; min-width: 130px;
           background: #fbfcfe; }
.wb-card .wb-label { font-size: 11px; color: #5a6570; text-transform: uppercase; letter-spacing: .04em; }
.wb-card .wb-value { font-size: 20px; font-weight: 600; color: #1f2d3a; margin-top: 2px; overflow-wrap: anywhere; }
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
.wb-alert { color: #842029; background: #f8d7da; border: 1px solid #f5c2c7; border-radius: 6px;
            padding: 8px 12px; font-size: 13px; }
"""


def html_pane(text: Any = "", **kw: Any) -> pn.pane.HTML:
    """An HTML pane that carries the shared stylesheet (panes live in their own shadow DOM) and
    renders only :class:`~widgets.markup.Html`: a plain ``str`` (or a bound function returning one)
    shows as text. Every pane of the views that shows data is one of these."""
    return pn.pane.HTML(text, stylesheets=[CSS], sanitize_html=True, sanitize_hook=markup_only, **kw)


def card(label: str, value: Any, testid: str, note: Any = "", tone: str = "") -> Html:
    """One stat card; ``data-testid`` lets the browser tests read the number."""
    note_html = render('<div class="wb-note">{}</div>', note) if note else Html("")
    return render('<div class="wb-card {}"><div class="wb-label">{}</div>'
                  '<div class="wb-value" data-testid="{}">{}</div>{}</div>', tone, label, testid, value, note_html)


def cards(items: Iterable[Html]) -> Html:
    return render('<div class="wb-cards">{}</div>', concat(*items))


def muted(text: Any, testid: str = "") -> Html:
    """A grey line of text (a hint, a status message)."""
    return _line("wb-muted", text, testid)


def error_line(text: Any, testid: str = "") -> Html:
    """A red line of text: why something failed (the ConfigError, the exception's message)."""
    return _line("wb-error", text, testid)


def _line(cls: str, text: Any, testid: str) -> Html:
    if testid:
        return render('<div class="{}" data-testid="{}">{}</div>', cls, testid, text)
    return render('<div class="{}">{}</div>', cls, text)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], testid: str = "", numeric: Sequence[int] = ()) -> Html:
    """A plain HTML table; cells are escaped unless they are :class:`~widgets.markup.Html`."""
    head = concat(*(render("<th>{}</th>", h) for h in headers))
    body = []
    for row in rows:
        cells = [render('<td class="num">{}</td>' if i in numeric else "<td>{}</td>", v) for i, v in enumerate(row)]
        body.append(render("<tr>{}</tr>", concat(*cells)))
    tid = render(' data-testid="{}"', testid) if testid else Html("")
    return render('<table class="wb-table"{}><tr>{}</tr>{}</table>', tid, head, concat(*body))


def swatch(color: str) -> Html:
    return render('<span class="wb-swatch" style="background:{}"></span>', color)


def labelled(label: str, widget: pn.viewable.Viewable) -> pn.Column:
    """A widget under a small label (button groups show none of their own)."""
    return pn.Column(html_pane(render('<div style="font-size:13px;color:#333">{}</div>', label),
                               margin=(4, 10, 0, 10)), widget, margin=0)


class FieldErrors:
    """Inline validation: an error line under each named widget, plus one general alert for errors
    naming a field this view does not edit (the message says which field; the app never raises)."""

    def __init__(self, where: str = "") -> None:
        self._slots: dict[str, pn.pane.HTML] = {}
        self._where = where
        # an HTML pane, not pn.pane.Alert: the message holds input, and Markdown renders HTML too
        self.general = html_pane("", visible=False, sizing_mode="stretch_width")

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
            slot.object = error_line(message, f"error-{field}")
            slot.visible = True
        else:
            where = f" ({self._where})" if self._where else ""
            self.general.object = render('<div class="wb-alert" data-testid="error-general">'
                                         "<b>Invalid configuration{}:</b> {}</div>", where, message)
            self.general.visible = True
