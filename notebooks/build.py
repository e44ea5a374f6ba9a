"""Build the teaching notebooks from their sources: ``python notebooks/build.py``.

Each notebook is written as a plain Python file in ``notebooks/src/`` in the "percent" format
(the one Jupytext, VS Code and Spyder read): a line ``# %%`` starts a code cell and a line
``# %% [markdown]`` a Markdown cell whose lines are comments. Plain files review and diff well;
the ``.ipynb`` files built from them are what readers open, committed without outputs (CI
executes them fresh, ``tests/test_notebooks.py``), and checked to be in sync with the sources.

``python notebooks/build.py --check`` exits 1 when a committed notebook differs from its source.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "src"
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def parse_cells(text: str) -> list[tuple[str, str]]:
    """``(kind, source)`` per cell of a percent-format file; kind is "code" or "markdown"."""
    cells: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("# %%"):
            kind = "markdown" if "[markdown]" in line else "code"
            cells.append((kind, []))
        elif cells:
            cells[-1][1].append(line)
        elif line.strip():  # only a module docstring-free preamble is allowed before the first cell
            raise ValueError(f"text before the first '# %%' marker: {line!r}")
    out = []
    for kind, lines in cells:
        if kind == "markdown":
            # "# text" -> "text", a bare "#" -> an empty line
            lines = [ln[2:] if ln.startswith("# ") else ln.lstrip("#") for ln in lines]
        source = "\n".join(lines).strip("\n")
        if source:
            out.append((kind, source))
    return out


def build_notebook(source: Path) -> nbformat.NotebookNode:
    """The notebook of one source file, with stable cell ids (so that rebuilding changes nothing)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    for i, (kind, text) in enumerate(parse_cells(source.read_text())):
        cell_id = f"{source.stem[:40]}-{i:03d}"
        if kind == "markdown":
            nb.cells.append(nbformat.v4.new_markdown_cell(text, id=cell_id))
        else:
            nb.cells.append(nbformat.v4.new_code_cell(text, id=cell_id))
    nbformat.validate(nb)
    return nb


def render(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def sources() -> list[Path]:
    return sorted(SOURCES.glob("[0-9][0-9]_*.py"))


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for src in sources():
        target = HERE / f"{src.stem}.ipynb"
        text = render(build_notebook(src))
        if check:
            if not target.exists() or target.read_text() != text:
                stale.append(target.name)
        else:
            target.write_text(text)
            print(f"wrote {target.relative_to(HERE.parent)}")
    if stale:
        print(f"out of date with notebooks/src: {', '.join(stale)}; run python notebooks/build.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
