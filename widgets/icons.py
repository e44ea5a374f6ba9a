"""The app's button icons, drawn inline as SVG.

Panel looks an icon *name* up in the tabler webfont, which it loads from a public CDN
(``@tabler/icons-webfont@latest``): offline, on a cluster login node, every such button shows no
icon. An SVG given as ``icon=`` is drawn from the page itself, so every icon here is one: simple
strokes in ``currentColor`` (they take the button's text colour), 24 x 24.
"""

from __future__ import annotations

_SVG = ('<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24" fill="none" '
        'stroke="currentColor" stroke-width="2" stroke-linecap="round" stroke-linejoin="round">{}</svg>')

ICONS: dict[str, str] = {
    "search": _SVG.format('<circle cx="10" cy="10" r="6"/><path d="M15 15l6 6"/>'),
    "refresh": _SVG.format('<path d="M20 11a8 8 0 0 0-14.9-3.5M4 4v4h4"/><path d="M4 13a8 8 0 0 0 14.9 3.5M20 20v-4h-4"/>'),
    "play": _SVG.format('<path d="M7 4v16l13-8z"/>'),
    "stop": _SVG.format('<rect x="5" y="5" width="14" height="14" rx="2"/>'),
    "resume": _SVG.format('<path d="M4 5v14l11-7z"/><path d="M19 5v14"/>'),
    "launch": _SVG.format('<path d="M12 3c4 2 6 6 6 10l-3 3H9l-3-3c0-4 2-8 6-10z"/><circle cx="12" cy="10" r="2"/>'
                          '<path d="M9 19l-2 2M15 19l2 2"/>'),
    "export": _SVG.format('<path d="M12 3v12M7 8l5-5 5 5"/><path d="M5 15v4a2 2 0 0 0 2 2h10a2 2 0 0 0 2-2v-4"/>'),
    "use": _SVG.format('<path d="M12 4v14M6 12l6 6 6-6"/>'),
    "compare": _SVG.format('<rect x="3" y="4" width="7" height="16" rx="1"/><rect x="14" y="4" width="7" height="16" rx="1"/>'),
}


def icon(name: str) -> str:
    """The inline SVG of ``name`` (KeyError names the icons there are)."""
    try:
        return ICONS[name]
    except KeyError:
        raise KeyError(f"no icon {name!r}; there are {sorted(ICONS)}") from None
