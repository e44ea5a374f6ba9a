"""The teaching notebooks run top to bottom: every ``notebooks/NN_*.ipynb`` is executed fresh with
nbclient in a python3 kernel of *this* interpreter; any cell error fails the test, and each notebook
holds ``assert`` cells that check the numbers it teaches (ZeRO's Figure 1, Korthikanti's
activations, bubble closed forms, published MFU...), so a wrong result fails it too."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from browser.helpers import CHROMIUM  # tests/browser/: where the browser tests find Chromium
from selection import selected

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
CELL_TIMEOUT_S = 120  # one cell; the whole series takes well under two minutes
NOTEBOOK_BUDGET_S = 90
# Notebooks 04 and 05 launch real torchrun jobs (kernels, rendezvous, restarts): more headroom.
BUDGET_S = {"04_launching_and_watching_a_run": 150, "05_checkpoints_resharding_recovery": 150}


# Notebooks that tests/test_jupyterlab.py runs top to bottom in JupyterLab with Chromium (their asserts
# fail there as here): run here only where that test is not selected or cannot run (no Chromium).
RUN_ALL_IN_JUPYTERLAB = {"03_pipeline_schedules": "test_jupyterlab.py::test_a_teaching_notebook_runs_all_in_jupyterlab"}


def _selected(request: pytest.FixtureRequest, nodeid_tail: str) -> bool:
    return os.path.exists(CHROMIUM) and selected(request, nodeid_tail)


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``python3`` kernelspec that runs this interpreter (``sys.executable``), searched first:
    a user-level python3 kernel elsewhere must not run the notebooks with other packages."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (workbench tests)",
        "language": "python",
    }))
    return root


def test_the_series_is_there():
    names = [p.name for p in PATHS]
    for expected in ("01_memory_bill.ipynb", "02_meshes_and_topology.ipynb", "03_pipeline_schedules.ipynb",
                     "04_launching_and_watching_a_run.ipynb", "05_checkpoints_resharding_recovery.ipynb",
                     "06_choosing_a_plan.ipynb"):
        assert expected in names


def test_notebooks_match_their_sources():
    """The committed .ipynb files are what ``notebooks/build.py`` makes of ``notebooks/src``."""
    spec = importlib.util.spec_from_file_location("workbench_notebooks_build", NOTEBOOKS / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    srcs = build.sources()
    assert [s.stem for s in srcs] == [p.stem for p in PATHS]
    for src, path in zip(srcs, PATHS):
        assert path.read_text() == build.render(build.build_notebook(src)), (
            f"{path.name} is out of date with notebooks/src/{src.name}: run python notebooks/build.py")


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_committed_without_outputs(path: Path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    assert any("assert " in c.source for c in code), "a notebook checks the numbers it teaches"


@pytest.mark.multiprocess  # a Jupyter kernel per notebook (04 and 05 start torchrun jobs too)
@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_notebook_runs(path: Path, kernel_dir: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):
    if path.stem in RUN_ALL_IN_JUPYTERLAB and _selected(request, RUN_ALL_IN_JUPYTERLAB[path.stem]):
        pytest.skip(f"runs with Run All in a real JupyterLab ({RUN_ALL_IN_JUPYTERLAB[path.stem]}), which fails "
                    "on any error output, as this does")
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_dir))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # quiets the kernel's debugger warning
    assert KernelSpecManager().get_kernel_spec("python3").argv[0] == sys.executable
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", allow_errors=False,
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    start = time.perf_counter()
    try:
        client.execute()
    except CellExecutionError as err:
        pytest.fail(f"{path.name}: a cell failed\n{err}")
    elapsed = time.perf_counter() - start
    budget = BUDGET_S.get(path.stem, NOTEBOOK_BUDGET_S)
    assert elapsed < budget, f"{path.name} took {elapsed:.0f} s; keep each notebook fast"
