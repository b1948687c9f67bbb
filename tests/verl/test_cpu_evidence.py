"""``dora_ext.verl.cpu.evidence.analyze``'s ``trained_staleness_max``: the number
``test_main_ppo_cpu.py::test_dora_k1_six_steps`` asserts equals K (old and new versions overlap)
must be able to show a run in which they do not.

The sampler's ``train`` reports carry, per trained group, ``(global_steps - 1) - version`` where
the version is the oldest engine-reported ``min_global_steps`` of its trajectories (TransferQueue
tags). Evidence written here in the reports' own format (``dora_ext.verl.cpu.report``): a K=1 run
whose step 2 trains version-0 groups, an on-policy run (mode ``pipeline``, K=0: every group
trained at the version it was generated under) and a run of verl's own modes (no ``train``
reports: DoraReplayBuffer is not in use).
"""

from __future__ import annotations

from dora_ext.verl.cpu.evidence import analyze


def _metrics(steps: int) -> list[dict]:
    return [{"step": s, "timing_s/step": 1.0, "training/off_policy/trajectory_spans/max": 1,
             "training/off_policy/trajectory_staleness_worst/max": 0, "dora/c1_ok": 1.0, "dora/c2_ok": 1.0,
             "dora/c3_ok": 1.0, "actor/pg_loss": 0.1} for s in range(1, steps + 1)]


def _trained(versions_by_step: dict[int, list[int]]) -> list[dict]:
    return [{"kind": "train", "global_steps": step, "groups": [f"g{step}_{i}" for i in range(len(vs))],
             "staleness": [(step - 1) - v for v in vs], "versions": vs}
            for step, vs in versions_by_step.items()]


def test_trained_staleness_max_tells_an_overlapping_run_from_an_on_policy_one():
    overlapping = _trained({1: [0, 0], 2: [0, 0], 3: [1, 1]})  # K=1: step 2 trains version 0
    on_policy = _trained({1: [0, 0], 2: [1, 1], 3: [2, 2]})  # each step trains the version it holds
    assert analyze(_metrics(3), overlapping, mode="dora", max_staleness=1)["trained_staleness_max"] == 1
    # The K=1 test's assertion (trained_staleness_max == K) fails on on-policy evidence ...
    assert analyze(_metrics(3), on_policy, mode="pipeline", max_staleness=0)["trained_staleness_max"] == 0
    # ... and on a run with no train reports (verl's own modes): None, not a passing default.
    assert analyze(_metrics(3), [], mode="sync", max_staleness=0)["trained_staleness_max"] is None
    # A group staler than K shows as more than K (the K=1 test's `== K` fails on it too).
    beyond = _trained({1: [0, 0], 2: [0, 0], 3: [0, 1]})
    assert analyze(_metrics(3), beyond, mode="dora", max_staleness=1)["trained_staleness_max"] == 2


# ------------------------------------------------------------ load_checks: negative evidence
# The counters the CPU end-to-end tests and the GPU smoke require (>= 2 partial-subset loads, an
# old-version load, aborted_unasked == 0) read the coordinator's ``load_checked`` reports and the
# replicas' ``generate`` / ``abort_request`` reports. Each is shown here on evidence where it must
# stay 0 next to evidence where it must not, in the reports' own format.
from dora_ext.verl.cpu.evidence import load_checks  # noqa: E402


def _published(*versions: int) -> list[dict]:
    return [{"kind": "publish", "version": v, "checksum": f"c{v}"} for v in versions]


def _checked(instance: int, version: int, *, newest: int, loading: list[int], initial: bool = False) -> dict:
    return {"kind": "load_checked", "instance": instance, "version": version, "checksum": f"c{version}",
            "published": f"c{version}", "newest": newest, "replicas": 3, "loading": loading, "initial": initial}


_FIRST_SYNC = [_checked(i, 0, newest=0, loading=[0, 1, 2], initial=True) for i in range(3)]


def test_a_load_of_every_replica_at_once_is_not_a_subset_load():
    """Version 1 loaded on all three replicas at once (all in ``loading``: verl's own modes, or dora
    with every replica drained together) leaves no replica serving another version: 0 subset loads.
    One by one, the first two loads leave a replica on version 0 serving: 2. The third one-by-one
    load is not one either (the others already hold version 1), so counting loads that were not
    the initial sync, or loads with fewer replicas loading than the pool (labels, not what the
    replicas held), gives 3 and fails here."""
    at_once = _published(0, 1) + _FIRST_SYNC + [_checked(i, 1, newest=1, loading=[0, 1, 2]) for i in range(3)]
    one_by_one = _published(0, 1) + _FIRST_SYNC + [_checked(i, 1, newest=1, loading=[i]) for i in range(3)]
    assert load_checks(at_once)["subset_loads"] == 0
    assert load_checks(one_by_one)["subset_loads"] == 2


def test_a_load_of_the_newest_version_is_not_an_old_version_load():
    """Replica 0 loads version 1 while 1 is the newest published; version 2 is published later.
    That load is not old (counting against the newest version of the whole run would call it old).
    Replica 2 loading version 1 once 2 is published is the one old-version load."""
    newest_only = _published(0, 1) + _FIRST_SYNC + [_checked(0, 1, newest=1, loading=[0])] + _published(2) + [
        _checked(1, 2, newest=2, loading=[1])]
    assert load_checks(newest_only)["old_version_loads"] == 0
    with_old = newest_only + [_checked(2, 1, newest=2, loading=[2])]
    assert load_checks(with_old)["old_version_loads"] == 1


def _generated(request_id: str, stop: str) -> dict:
    return {"kind": "generate", "replica": 0, "request_id": request_id, "version": 0, "tokens": 3, "stop": stop,
            "start": 0.0, "time": 1.0}


def test_an_abort_all_that_took_co_resident_requests_counts_them_as_aborted_unasked():
    """An R5 move off replica 0 aborts r1 alone (the coordinator's and the replica's
    ``abort_request`` reports name it). Per request, r2 and r3 (co-resident) finish normally: 0
    aborted unasked. Through an abort-all, they come back aborted too, named by no abort: 2 (a
    constant 0 fails here; counting every aborted request fails on the first run)."""
    asked = [{"kind": "abort_request", "instance": 0, "request_id": "r1", "aborted": True},
             {"kind": "abort_request", "replica": 0, "request_id": "r1", "tokens": 2}]
    per_request = asked + [_generated("r1", "aborted"), _generated("r2", "stop"), _generated("r3", "length")]
    abort_all = asked + [_generated("r1", "aborted"), _generated("r2", "aborted"), _generated("r3", "aborted")]
    assert load_checks(per_request)["aborted_unasked"] == 0
    assert load_checks(abort_all)["aborted_unasked"] == 2
    assert load_checks(per_request)["requests_aborted_alone"] == load_checks(abort_all)["requests_aborted_alone"] == 1


def test_observed_setup_reads_replicas_and_backend_from_what_the_run_reported(tmp_path, monkeypatch):
    """``benchmarks/verl_cpu_compare.py``'s ``replicas`` and ``weight_backend`` per mode come from the
    reports, not from the flags it passed: the replicas that loaded or served, and the backend named
    by the code that published (``dora_store``'s weight store writes it itself, checked here)."""
    import asyncio

    from dora_ext.verl.cpu.evidence import observed_setup
    from dora_ext.verl.cpu.report import read_reports
    from dora_ext.verl.weights import WeightStore

    monkeypatch.setenv("DORA_CPU_REPORT_DIR", str(tmp_path))
    asyncio.run(WeightStore(3).publish(0, [{}], "c0"))
    store = read_reports(str(tmp_path))
    served = [{"kind": "load", "replica": i, "version": 0, "checksum": "c0"} for i in (0, 2)] + [
        _generated("r1", "stop") | {"replica": 1}]
    assert observed_setup(store + served) == {"replicas": 3, "replica_ranks": [0, 1, 2], "weight_backend": "dora_store"}
    # verl's sync trainer: one colocated replica, versions handed over in-process (mode naive).
    colocated = [{"kind": "publish", "version": 0, "checksum": "c0", "replica": 0, "backend": "naive"},
                 {"kind": "load", "replica": 0, "version": 0, "checksum": "c0"}]
    assert observed_setup(colocated) == {"replicas": 1, "replica_ranks": [0], "weight_backend": "naive"}
    assert observed_setup([]) == {"replicas": 0, "replica_ranks": [], "weight_backend": None}
