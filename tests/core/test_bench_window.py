"""`benchmarks/core_events.py` says what its measured window holds: check that a row's window
holds the trainer steps, publishes, version switches and migrations (and re-moves of landed
trajectories) it reports, counted by its driver from the actions it executed, and that the
capacity-1 row says why it holds no migration. No timing is asserted (a benchmark, not a test)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    path = ROOT / "benchmarks" / "core_events.py"
    spec = importlib.util.spec_from_file_location("core_events_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


@pytest.mark.parametrize("K", [1, 2, 3])
def test_a_window_holds_what_the_row_reports(bench, K):
    r = bench.measure(K, 10_000, 1_000, events=60_000)
    assert r["events"] >= 60_000
    assert r["window_steps"] >= 2 and r["window_publishes"] == r["window_steps"]
    assert r["window_switches"] > 0 and r["window_dispatches"] > 0 and r["window_migrations"] > 0
    assert r["c2_ok"] and r["c3_ok"]
    r["slots"] = 10_000
    assert "no R5 move" not in bench._line(r)


def test_landings_let_a_trajectory_move_again_and_their_absence_does_not(bench):
    landed = bench.measure(3, 10_000, 1_000, events=60_000)
    none = bench.measure(3, 10_000, 1_000, events=60_000, landings=False)
    assert landed["window_remigrations"] > 0  # moved again after its MigrationLanded
    assert none["window_remigrations"] == 0  # at most one move per attempt without landings
    assert none["window_migrations"] > 0


def test_the_capacity_one_row_says_it_holds_no_move(bench):
    r = bench.measure(1, 1_000, 1_000, events=20_000)
    assert r["capacity"] == 1 and r["window_migrations"] == 0 and r["window_steps"] > 0
    r["slots"] = 1_000
    assert "capacity 1" in bench._line(r)
