"""Shared helpers for the slime adapter tests.

slime itself is absent in CI (it is not on PyPI): these tests run the adapter against the
stand-ins of `slime_standins.py`, which follow slime's documented shapes and interfaces.
`test_slime_real.py` repeats the key checks against a real slime checkout when
`DORA_SLIME_PATH` names one.
"""

from __future__ import annotations

import os
import sys
import uuid

import pytest

# The stand-ins are imported by dotted path (slime's load_function style: custom generate,
# base data source) and pickled in checkpoints, so they need a stable importable module name.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# A real slime checkout, when given, must be importable before the adapter looks for slime.
if os.environ.get("DORA_SLIME_PATH"):
    sys.path.insert(0, os.path.abspath(os.environ["DORA_SLIME_PATH"]))

import slime_standins  # noqa: E402

from dora_ext.slime import rollout as slime_rollout  # noqa: E402
from dora_ext.slime import weights  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_driver(monkeypatch):
    """Each test is one slime driver process: a fresh publication sequence, no leftover worker."""
    monkeypatch.setattr(weights, "_RUN", uuid.uuid4().hex)
    monkeypatch.setattr(weights, "_count", 0)
    try:
        from slime.rollout import sglang_rollout
    except ImportError:
        pass  # slime absent (CI): the adapter calls the custom generate function directly
    else:
        monkeypatch.setattr(sglang_rollout, "GenerateState", slime_standins.StandinGenerateState)
    slime_rollout.close_session()
    yield
    slime_rollout.close_session()


@pytest.fixture
def standins():
    return slime_standins


# ---------------------------------------------------------------- slime checkout (DORA_SLIME_PATH)
@pytest.fixture(scope="session")
def patched_slime(tmp_path_factory):
    """A copy of the slime checkout with patches/slime applied (the checkout itself is untouched)."""
    from slime_helpers import patched_slime_copy

    return patched_slime_copy(tmp_path_factory.mktemp("slime") / "slime")
