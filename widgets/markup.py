"""The one place text becomes HTML in the UI: :class:`Html` marks markup this code built; anything
else is text and is escaped on its way into markup or onto the page.

Model names, error texts, run ids, host and file names, fields of run-directory events and names
from uploaded JSON all reach the views; none of them may become markup. So the rule is inverted:
a view builds its HTML with :func:`render` (a template whose every field is escaped, as
``markupsafe.Markup.format``), and the page's HTML panes (:func:`widgets.ui.html_pane`) show a
plain ``str`` as text (:func:`markup_only`). Forgetting to mark code-built HTML then shows tags as
text, never runs a script. Markdown panes (which render inline HTML too) show code-written text
only; Bokeh hover templates are HTML as well, so they are code, and data reaches them only through
``@column`` fields (whose values Bokeh escapes).
"""

from __future__ import annotations

import html as _stdlib_html
import string
from typing import Any, Iterable


class Html(str):
    """HTML built by this code (never from input). Joined with a plain ``str``, the ``str`` is
    escaped first, so ``Html`` stays safe through ``+`` and :meth:`join`."""

    __slots__ = ()

    def __add__(self, other: Any) -> "Html":
        return Html(str.__add__(self, escape(other)))

    def __radd__(self, other: Any) -> "Html":
        return Html(str.__add__(escape(other), self))

    def join(self, items: Iterable[Any]) -> "Html":  # type: ignore[override]
        return Html(str.join(self, (escape(i) for i in items)))

    def __html__(self) -> "Html":  # the markupsafe protocol: already markup
        return self


def escape(value: Any) -> Html:
    """``value`` as HTML text (``<>&"'`` escaped); :class:`Html` is returned as it is."""
    if isinstance(value, Html):
        return value
    return Html(_stdlib_html.escape("" if value is None else str(value), quote=True))


class _EscapingFormatter(string.Formatter):
    # format first (so "{:.1%}" and "{!r}" work on the value), then escape the result
    def format_field(self, value: Any, format_spec: str) -> str:
        if isinstance(value, Html):
            return value
        return escape(format(value, format_spec))


_FORMATTER = _EscapingFormatter()


def render(template: str, /, *args: Any, **kwargs: Any) -> Html:
    """``template`` (HTML written in the code) with its ``{}`` fields filled by escaped values:
    ``render('<div class="wb-error">{}</div>', err)``. :class:`Html` values are inserted as they are."""
    return Html(_FORMATTER.vformat(template, args, kwargs))


def concat(*parts: Any) -> Html:
    """Markup pieces and text, one after the other (text escaped)."""
    return Html("").join(parts)


def markup_only(text: Any) -> str:
    """What an HTML pane may render: :class:`Html` as it is, anything else as text (escaped).
    The ``sanitize_hook`` of :func:`widgets.ui.html_pane`."""
    return text if isinstance(text, Html) else escape(text)


__all__ = ["Html", "concat", "escape", "markup_only", "render"]
