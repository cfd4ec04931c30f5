"""Fixtures the command tests share."""

from __future__ import annotations

import pytest

import hf_memkit._plan as plan_mod


@pytest.fixture
def kept(monkeypatch, tmp_path):
    """Answers on (the suite runs with the caches off), in a folder of this test's own; a spy
    counting the plans really made."""
    monkeypatch.delenv("HF_MEMKIT_NO_CACHE", raising=False)
    monkeypatch.setenv("HF_MEMKIT_CACHE", str(tmp_path / "cache"))
    real, made = plan_mod.plan_training, []

    def spy(*args, **kwargs):
        made.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_mod, "plan_training", spy)
    return made
