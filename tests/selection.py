"""Which tests this session runs: a test that another selected test covers with the same assertions
(a notebook that runs the same drill, JupyterLab running the same notebook) runs only where that
other test does not, so that CI pays for each check once and a narrower selection still has it."""

from __future__ import annotations

import pytest


def selected(request: pytest.FixtureRequest, nodeid_tail: str) -> bool:
    """True when this session also runs the test whose node id ends with ``nodeid_tail``."""
    return any(item.nodeid.endswith(nodeid_tail) for item in request.session.items)
