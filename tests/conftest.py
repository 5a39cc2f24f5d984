"""Fixtures shared by the test files (plain builders are in ``*_helpers.py`` beside this file)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from sweep_helpers import script_launcher

from moebench.sweep.suite import Point


@pytest.fixture
def fake_trainer(tmp_path, monkeypatch) -> Callable[..., Callable[[Point], list[str]]]:
    """``fake_trainer(SCRIPT, **env)``: a launcher running SCRIPT in place of ``moebench train``,
    written to ``tmp_path/fake_train.py``, with ``env`` set for the test's duration."""

    def make(script: str, **env: str) -> Callable[[Point], list[str]]:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        return script_launcher(tmp_path / "fake_train.py", script)

    return make
