"""The folders are the layers, and the arrows between them point one way.

``spec <- predict <- rundir <- {trainer, launch, bench} <- cli``; ``widgets`` imports only spec,
predict, rundir and launch (and the ``workbench`` facade, which re-exports those); nothing imports
``widgets``: ``workbench serve`` starts the app as a process by module name. Every import between
project modules is checked, at module level and inside functions, and a function-level one is
allowed only with a comment on its line, or the line above it, saying why (an optional or heavy dependency, never a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ALLOWED: dict[str, set[str]] = {
    "spec": {"spec"},
    "predict": {"spec", "predict"},
    "rundir": {"spec", "predict", "rundir"},
    "trainer": {"spec", "predict", "rundir", "trainer"},
    "launch": {"spec", "predict", "rundir", "launch"},
    "bench": {"spec", "predict", "rundir", "bench"},
    "cli": {"spec", "predict", "rundir", "trainer", "launch", "bench", "cli", "facade"},
    "facade": {"spec", "predict", "rundir", "launch"},
    "widgets": {"spec", "predict", "rundir", "launch", "widgets", "facade"},
}
# The planning layers import no torch and no UI (they must stay instant and importable anywhere).
FORBIDDEN_THIRD_PARTY: dict[str, tuple[str, ...]] = {
    "spec": ("torch", "panel", "holoviews", "bokeh", "ipywidgets", "jupyter_client"),
    "predict": ("torch", "panel", "holoviews", "bokeh", "ipywidgets", "jupyter_client"),
    "rundir": ("torch", "panel", "holoviews", "bokeh", "ipywidgets"),
    "launch": ("torch", "panel", "holoviews", "bokeh", "ipywidgets"),
}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "widgets":
        return "widgets"
    if parts[0] != "workbench":
        return None
    if len(parts) == 1:
        return "facade"
    return {"cli": "cli"}.get(parts[1], parts[1])


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def project_modules() -> list[Path]:
    return sorted(p for d in ("workbench", "widgets") for p in (ROOT / d).rglob("*.py"))


def imports_of(path: Path) -> list[tuple[str, int, bool, str]]:
    """(imported module, line, at module level?, the source line) for every import in ``path``."""
    source = path.read_text()
    tree = ast.parse(source)
    lines = source.splitlines()
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top = {id(n) for n in tree.body}
    # imports under "if TYPE_CHECKING:" at module level are arrows too (of types), so they count
    for node in tree.body:
        if isinstance(node, ast.If):
            top |= {id(n) for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                targets = [".".join(base + ([node.module] if node.module else []))]
            else:
                targets = [node.module or ""]
        else:
            continue
        for target in targets:
            said = lines[node.lineno - 1] + (lines[node.lineno - 2] if node.lineno > 1 else "")
            out.append((target, node.lineno, id(node) in top, said))
    return out


def violations() -> list[str]:
    found = []
    for path in project_modules():
        name = module_name(path)
        src_layer = layer_of(name)
        rel = path.relative_to(ROOT)
        for target, line, at_top, text in imports_of(path):
            dst_layer = layer_of(target)
            if dst_layer is None:
                bad = [t for t in FORBIDDEN_THIRD_PARTY.get(src_layer, ()) if target == t or target.startswith(t + ".")]
                if bad and at_top:
                    found.append(f"{rel}:{line}: the {src_layer} layer imports {target}")
                continue
            if dst_layer not in ALLOWED[src_layer]:
                found.append(f"{rel}:{line}: {src_layer} -> {dst_layer} ({name} imports {target}) is not an allowed arrow")
            if not at_top and "#" not in text:
                found.append(f"{rel}:{line}: function-level import of {target} in {name} without a comment saying why")
    return found


def test_every_import_follows_the_layer_arrows():
    found = violations()
    assert not found, "\n".join(found)


def test_no_import_cycles_between_project_modules():
    graph: dict[str, set[str]] = {}
    names = {module_name(p) for p in project_modules()}
    for path in project_modules():
        deps = graph.setdefault(module_name(path), set())
        for target, _, _, _ in imports_of(path):
            while target and target not in names:
                target = target.rpartition(".")[0]
            # a package's own __init__ is loaded by its submodules anyway: not a cycle edge
            if target and target != module_name(path) and not module_name(path).startswith(target + "."):
                deps.add(target)
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("source, target, ok", [
    ("workbench.spec.plan", "workbench.predict.pipeline", False),
    ("workbench.predict.memory", "workbench.spec.config", True),
    ("workbench.launch.worker", "workbench.trainer.train", False),
    ("widgets.launch_view", "workbench.trainer.train", False),
    ("workbench.cli", "widgets.app", False),
    ("workbench.cli", "workbench.trainer.profile", True),
])
def test_the_rule_itself_tells_allowed_from_forbidden(source, target, ok):
    assert (layer_of(target) in ALLOWED[layer_of(source)]) is ok
