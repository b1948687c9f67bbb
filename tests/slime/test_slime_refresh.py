"""The engine refresh (`SglangEngines.refresh`, `RolloutSession._refresh`): what it keeps when it
is interrupted, what it costs, and where it reads an engine's weight version.

slime is ABSENT here (CI): the stand-ins of `slime_standins.py` speak SGLang's and
sglang-router's HTTP interface (no SGLang server can run on a CPU machine). Orders are forced with
events held inside the stand-in HTTP client, never by timing; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import collections
import os
import subprocess
import sys
import textwrap

import pytest

from slime_helpers import HARNESS, SimulatedSlimeDriver, fleet_engines, install_fleet_session, make_args

from dora_ext.slime.data_source import DoraDataSource


class Interrupted(BaseException):
    """What no `except Exception` catches (as KeyboardInterrupt): it ends the refresh part-way."""


# ------------------------------------------------------------------ interrupted part-way
@pytest.mark.parametrize("how", ["cancelled", "raises"])
def test_a_refresh_interrupted_part_way_keeps_what_it_would_have_dropped(tmp_path, standins, how):
    """Engine 0 is dead; the refresh is interrupted while it waits on engine 1's /health (the task
    cancelled there, or the await raising). It used to drop engine 0 before that await: the
    caller never got `gone`, and the next refresh no longer knew engine 0, so the scheduler
    was never told. Now nothing changes, and the next refresh reports it."""
    fleet, engines = fleet_engines(standins, tmp_path, 32400)
    real_get = fleet.get
    asked, never = asyncio.Event(), asyncio.Event()

    async def get(url):
        if url == fleet.engines[1].url + "/health":
            asked.set()
            if how == "raises":
                raise Interrupted()
            await never.wait()  # held until the refresh is cancelled
        return await real_get(url)

    async def run():
        await engines.discover()
        await engines.load(0, "3", str(tmp_path / "w"))
        await engines.load(1, "3", str(tmp_path / "w"))
        before = (dict(engines.urls), dict(engines._loaded_tags), dict(engines._worker_ids))
        fleet.engines[0].alive = False
        fleet.get = get
        refresh = asyncio.ensure_future(engines.refresh())
        await asyncio.wait_for(asked.wait(), 10)
        if how == "cancelled":
            refresh.cancel()
            with pytest.raises(asyncio.CancelledError):
                await refresh
        else:
            with pytest.raises(Interrupted):
                await refresh
        assert (dict(engines.urls), dict(engines._loaded_tags), dict(engines._worker_ids)) == before
        fleet.get = real_get
        gone, new = await engines.refresh()
        assert (gone, new) == ([0], []) and engines.reasons == {0: "the engine fails /health"}
        assert sorted(engines.urls) == [1] and engines._loaded_tags == {1: "3"}

    asyncio.run(run())


# ------------------------------------------------------------------ one pass, concurrent
def test_one_refresh_asks_every_engine_concurrently(tmp_path, standins):
    """Engine 0's /health answers only once engine 1's /health has been asked in the same pass
    (bounded: asked one after the other, engine 0's check times out and it would be declared
    dead). Each engine is asked once per pass."""
    fleet, engines = fleet_engines(standins, tmp_path, 32500)
    engines.health_timeout_s = 5.0
    real_get = fleet.get
    other_asked = asyncio.Event()
    health = collections.Counter()

    async def get(url):
        if url.endswith("/health"):
            health[url] += 1
            if url.startswith(fleet.engines[1].url):
                other_asked.set()
            else:
                await asyncio.wait_for(other_asked.wait(), 2)
        return await real_get(url)

    async def run():
        await engines.discover()
        fleet.get = get
        assert await engines.refresh() == ([], [])

    asyncio.run(run())
    assert sorted(health.values()) == [1, 1]


def test_wrong_version_trajectories_share_refresh_passes(tmp_path, standins):
    """N = 4 trajectories come back from engine 0 with a weight version other than their pin (the
    first 4 requests it finishes report "999"; it is not restarted, so it stays). Each used to
    run its own refresh, one after another: N passes, N /health calls per engine. Forced order:
    the first pass is held at its router read until all N have asked for a refresh; those that
    asked while it ran share the next pass. Evidence: the /health calls each engine got."""
    n_wrong = 4
    args = make_args(tmp_path, mode="dora", k=1, batch=4, n=2, num_rollout=3, capacity=4)
    args.dora_slime["engine_check_interval_s"] = 600  # no periodic refresh during the run
    fleet = standins.FakeSglangFleet(2, capacity=4, base_port=32600)
    fleet.engines[0].wrong_versions = n_wrong
    ds = DoraDataSource(args)
    session = install_fleet_session(args, ds, fleet, first_step=0)
    mismatches: list = []
    all_asked = asyncio.Event()

    def probe(name, value):
        if name == "version_mismatch":
            mismatches.append(value)
            if len(mismatches) == n_wrong:
                all_asked.set()

    session.probe = probe
    real_get = fleet.get
    health = collections.Counter()
    router_reads = [0]

    async def get(url):
        if url.endswith("/workers"):
            router_reads[0] += 1
            if mismatches and not all_asked.is_set():
                await asyncio.wait_for(all_asked.wait(), 10)
        if url.endswith("/health"):
            health[url] += 1
        return await real_get(url)

    fleet.get = get
    outs = SimulatedSlimeDriver(args, ds).run_async(0, 3)
    assert len(mismatches) == n_wrong and {iid for *_, iid in mismatches} == {0}
    # discover's router read, then two passes: the first mismatch's, and the one the other three shared.
    assert router_reads[0] == 1 + 2 and session.refresh_passes == 2
    assert health == {e.url + "/health": 2 for e in fleet.engines}, health
    m = outs[2].metrics
    assert m["dora/engine_refresh_passes"] == 2
    assert m["dora/retries"] == n_wrong and m["dora/failed_groups"] == 0
    for out in outs.values():  # C1: "999" was never trained
        assert all(s.weight_versions != ["999"] for g in out.samples for s in g)
    assert fleet.violations == []


# ------------------------------------------------------------------ multiple tokenizer workers
def test_an_engine_with_several_tokenizer_workers_is_judged_by_its_schedulers_version(tmp_path, standins):
    """SGLang 0.5.23 with `--tokenizer-worker-num 2`: the load's HTTP request is handled by one
    tokenizer worker, which alone records the new version; `/model_info` is answered by either
    worker, so it reports the launch version half the time. The adapter read `/model_info` and
    retired a healthy engine as "restarted". It now reads the scheduler's version
    (`/server_info`'s internal states); a real restart is still caught."""
    fleet, engines = fleet_engines(standins, tmp_path, 32700)
    for e in fleet.engines:
        e.tokenizer_workers = 2

    async def run():
        await engines.discover()
        await engines.load(0, "3", str(tmp_path / "w"))
        await engines.load(1, "3", str(tmp_path / "w"))
        answers = {(await fleet.get(fleet.engines[0].url + "/model_info"))["weight_version"] for _ in range(2)}
        assert answers == {"3", "initial"}  # the hazard: a tokenizer worker's stale copy
        for _ in range(4):
            assert await engines.refresh() == ([], []), engines.reasons
        fleet.restart_engine(32700, reregister=False)  # same router id: only the version tells
        gone, new = await engines.refresh()
        assert (gone, new) == ([0], [(2, 2)]) and "weight version 'default'" in engines.reasons[0]

    asyncio.run(run())


@pytest.mark.parametrize("workers", [None, 1, 2])
def test_without_the_schedulers_version_model_info_decides_only_with_one_tokenizer_worker(
        tmp_path, standins, workers):
    """An SGLang whose `/server_info` internal states carry no weight version: `/model_info`
    decides when the engine runs one tokenizer worker (or does not say); with several, its answer
    is one worker's copy and gives no verdict (a restart with a renewed registration is still
    told by the router's id)."""
    fleet, engines = fleet_engines(standins, tmp_path, 32800)
    real_get = fleet.get

    async def get(url):
        reply = await real_get(url)
        if url.endswith("/server_info"):
            reply = {k: v for k, v in reply.items() if k != "internal_states"}
            if workers is None:
                reply.pop("tokenizer_worker_num")
            else:
                reply["tokenizer_worker_num"] = workers
        return reply

    fleet.get = get

    async def run():
        await engines.discover()
        await engines.load(0, "3", str(tmp_path / "w"))
        fleet.restart_engine(32800, reregister=False)
        gone, new = await engines.refresh()
        if workers == 2:
            assert (gone, new) == ([], [])
        else:
            assert (gone, new) == ([0], [(2, 2)]) and "weight version 'default'" in engines.reasons[0]

    asyncio.run(run())


def test_sglangs_response_version_is_the_schedulers(tmp_path):
    """With SGLang 0.5.23 installed (extra slime-test): the `weight_version` a finished request
    reports (what slime appends to `Sample.weight_versions`) is computed from the scheduler's
    version spans, replacing the answering tokenizer worker's copy, so the per-sample check
    (C1) holds with several tokenizer workers. SGLang's own functions, run in a subprocess
    (importing sglang loads torchcodec, which this machine's torch cannot load)."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("msgspec") is None:
        pytest.skip("sglang 0.5.23 is not installed (scripts/test.sh installs it with the extra slime-test)")
    script = textwrap.dedent("""
        import sglang
        from sglang.srt.utils.weight_versions import (
            WeightVersionEvent, add_weight_versions_to_meta_info, compute_weight_version_spans)
        assert sglang.__version__ == "0.5.23", sglang.__version__
        # The tokenizer worker fills its own (stale) copy, then the scheduler's spans replace it.
        meta = {"weight_version": "default"}
        add_weight_versions_to_meta_info(meta, compute_weight_version_spans([], "3", 5), 5)
        assert meta["weight_version"] == "3", meta
        # A request that spanned an update reports the version it ended on, and both spans.
        meta = {"weight_version": "default"}
        spans = compute_weight_version_spans([WeightVersionEvent(old_version="2", num_output_tokens=2)], "3", 5)
        add_weight_versions_to_meta_info(meta, spans, 5)
        assert meta["weight_version"] == "3", meta
        assert [(s["version"], s["start"], s["end"]) for s in meta["weight_versions"]] == [("2", 0, 2), ("3", 2, 5)]
        print("ok")
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(HARNESS, "no_torchcodec"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
