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



class Interrupted(BaseException):
    """What no `except Exception` catches (as KeyboardInterrupt): it ends the refresh part-way."""


# ------------------------------------------------------------------ interrupted part-way
@pytest.mark.parametrize("how", ["cancelled", "raises"])
def test_a_refresh_interrupted_part_way_keeps_what_it_would_have_dropped(tmp_path, standins, how):
    """Engine 0 is dead; the refresh is interrupted while it waits on engine 1's /health (the task cancelled there, or
    the await raising). It used to drop engine 0 before that await: the caller never got `gone`, and the next refresh no
    longer knew engine 0, so the scheduler was never told. Now nothing changes, and the next refresh reports it."""
    fleet, engines = fleet_engines(standins, tmp_path, 32400)
    real_get = fleet.get
    asked, never = asyncio.Event(), asyncio.Event()

    async def get(url):
        if url == fleet.engines[1].url + "/health_generate":
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
        assert (gone, new) == ([0], []) and engines.reasons == {0: "the engine does not generate (/health_generate failed or timed out)"}
        assert sorted(engines.urls) == [1] and engines._loaded_tags == {1: "3"}

    asyncio.run(run())


# ------------------------------------------------------------------ an engine retired and back
@pytest.mark.parametrize("loaded", ["version_2", "launch_version_only"])
def test_an_engine_back_after_one_failed_probe_is_loaded_from_disk_unless_it_held_the_launch_weights(
        tmp_path, standins, loaded):
    """Engine 0 loaded version 2 from disk; one `/health_generate` fails (a transient error), so the
    refresh retires it, and, healthy at once, it rejoins under a new id still holding version 2's
    weights. Asked for the launch version, it used to be relabelled only (`/update_weight_version`):
    it then reported the launch version while it generated with version 2's weights, a C1
    violation no check could see. Now it loads the launch checkpoint from disk. An engine that
    never held anything but the launch weights is still only relabelled."""
    fleet, engines = fleet_engines(standins, tmp_path, 32600)
    engines.launch_tag = "0"
    real_get, failures = fleet.get, [1]
    e0 = fleet.engines[0]

    async def get(url):
        if url == e0.url + "/health_generate" and failures[0]:
            failures[0] -= 1
            raise ConnectionError("injected: one probe fails")
        return await real_get(url)

    async def run():
        await engines.discover()
        await engines.load(0, "0", str(tmp_path / "w"))  # the launch weights: a relabel
        if loaded == "version_2":
            await engines.load(0, "2", str(tmp_path / "w"))
        fleet.get = get
        gone, new = await engines.refresh()
        assert gone == [0] and [engines.urls[i] for i, _ in new] == [e0.url]
        await engines.load(new[0][0], "0", str(tmp_path / "w"))

    asyncio.run(run())
    assert e0.version == "0"
    if loaded == "version_2":
        assert (e0.relabels, e0.loads) == (["0"], ["2", "0"])
    else:
        assert (e0.relabels, e0.loads) == (["0", "0"], [])


# ------------------------------------------------------------------ one pass, concurrent
def test_one_refresh_asks_every_engine_concurrently(tmp_path, standins):
    """Engine 0's /health answers only once engine 1's /health has been asked in the same pass (bounded: asked one after
    the other, engine 0's check times out and it would be declared dead). Each engine is asked once per pass."""
    fleet, engines = fleet_engines(standins, tmp_path, 32500)
    engines.health_timeout_s = 5.0
    real_get = fleet.get
    other_asked = asyncio.Event()
    health = collections.Counter()

    async def get(url):
        if url.endswith("/health_generate"):
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
    """N = 4 trajectories come back from engine 0 with a weight version other than their pin (the first 4 requests it
    finishes report "999"; it is not restarted, so it stays). Each used to run its own refresh, one after another: N
    passes, N /health calls per engine. Forced order: the first pass is held at its router read until all N have asked
    for a refresh; those that asked while it ran share the next pass. Evidence: the /health calls each engine got."""
    n_wrong = 4
    args = make_args(tmp_path, mode="dora", k=1, batch=4, n=2, num_rollout=3, capacity=4)
    args.dora_slime["engine_check_interval_s"] = 600  # no periodic refresh during the run
    fleet = standins.FakeSglangFleet(2, capacity=4, base_port=32600)
    fleet.engines[0].wrong_versions = n_wrong
    session = install_fleet_session(args, None, fleet, first_step=0)
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
        if url.endswith("/health_generate"):
            health[url] += 1
        return await real_get(url)

    fleet.get = get
    outs = SimulatedSlimeDriver(args, session.data_source).run_async(0, 3)
    assert len(mismatches) == n_wrong and {iid for *_, iid in mismatches} == {0}
    # discover's router read, then at most two passes: the first mismatch's, and the one the
    # others shared (one, where all four asked before the first pass began).
    passes = session.refresh_passes
    assert 1 <= passes <= 2 and router_reads[0] == 1 + passes
    assert health == {e.url + "/health_generate": passes for e in fleet.engines}, health
    m = outs[2].metrics
    assert m["dora/engine_refresh_passes"] == passes
    assert m["dora/retries"] == n_wrong and m["dora/failed_groups"] == 0
    for out in outs.values():  # C1: "999" was never trained
        assert all(s.weight_versions != ["999"] for g in out.samples for s in g)
    assert fleet.violations == []


# ------------------------------------------------------------------ multiple tokenizer workers
def test_an_engine_with_several_tokenizer_workers_is_judged_by_its_schedulers_version(tmp_path, standins):
    """SGLang 0.5.23 with `--tokenizer-worker-num 2`: the load's HTTP request is handled by one tokenizer worker, which
    alone records the new version; `/model_info` is answered by either worker, so it reports the launch version half the
    time. The adapter read `/model_info` and retired a healthy engine as "restarted". It now reads the scheduler's
    version (`/server_info`'s internal states); a real restart is still caught."""
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
def test_without_the_schedulers_version_model_info_decides_only_with_one_tokenizer_worker(tmp_path, standins, workers):
    """An SGLang whose `/server_info` internal states carry no weight version: `/model_info` decides when the engine
    runs one tokenizer worker (or does not say); with several, its answer is one worker's copy and gives no verdict (a
    restart with a renewed registration is still told by the router's id)."""
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
    """With SGLang 0.5.23 installed (extra slime-test): the `weight_version` a finished request reports (what slime
    appends to `Sample.weight_versions`) is computed from the scheduler's version spans, replacing the answering
    tokenizer worker's copy, so the per-sample check (C1) holds with several tokenizer workers. SGLang's own functions,
    run in a subprocess (importing sglang loads torchcodec, which this machine's torch cannot load)."""
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


# ------------------------------------------------------------------ review: where the version is read
@pytest.mark.parametrize("failure", ["times-out", "refused", "error-status"])
def test_a_failing_server_info_gives_no_verdict_with_several_tokenizer_workers(tmp_path, standins, failure):
    """`/server_info` fails on a healthy engine with two tokenizer workers (its readback waits on a busy scheduler past
    the timeout, the connection is refused, a 503). The adapter then asked `/model_info`, whose answer is one tokenizer
    worker's copy: the worker that did not run the load reports the launch version, and the healthy engine was retired
    as "restarted" (the hazard the scheduler's version was read to avoid). Only a `/server_info` that does not exist
    (404) leaves the verdict to `/model_info` now; any other failure gives none."""
    fleet, engines = fleet_engines(standins, tmp_path, 32900)
    engines.health_timeout_s = 0.05  # cuts the hang below
    for e in fleet.engines:
        e.tokenizer_workers = 2
    real_get = fleet.get
    never = asyncio.Event()
    asked = collections.Counter()

    async def get(url):
        if url.endswith("/server_info"):
            if failure == "times-out":
                await never.wait()
            raise ConnectionRefusedError(url) if failure == "refused" else standins.http_error("GET", url, 503)
        if url.endswith("/model_info"):
            asked[url] += 1
        return await real_get(url)

    async def run():
        await engines.discover()
        for iid in (0, 1):
            await engines.load(iid, "3", str(tmp_path / "w"))
        fleet.get = get
        for _ in range(2):  # /model_info would answer from each worker in turn: one is stale
            assert await engines.refresh() == ([], []), engines.reasons

    asyncio.run(run())
    assert asked == {}  # /model_info is not asked: its answer would be no evidence


def test_an_sglang_without_server_info_is_judged_by_model_info(tmp_path, standins):
    """An SGLang that has no `/server_info` (404, slime's client raises httpx's HTTPStatusError):
    `/model_info` decides (one tokenizer worker), so a restart that kept its registration is told."""
    fleet, engines = fleet_engines(standins, tmp_path, 33000)
    real_get = fleet.get

    async def get(url):
        if url.endswith("/server_info"):
            raise standins.http_error("GET", url, 404)
        return await real_get(url)

    async def run():
        await engines.discover()
        await engines.load(0, "3", str(tmp_path / "w"))
        fleet.get = get
        assert await engines.refresh() == ([], [])
        fleet.restart_engine(33000, reregister=False)
        gone, new = await engines.refresh()
        assert (gone, new) == ([0], [(2, 2)]) and "weight version 'default'" in engines.reasons[0]

    asyncio.run(run())


def test_a_scheduler_that_keeps_the_launch_version_does_not_retire_a_healthy_engine(tmp_path, standins):
    """SGLang releases before the scheduler recorded weight versions: the scheduler's readback is its own copy of the
    launch arguments (`get_internal_state` returns `vars(get_global_server_args())`) and a weight update sets the
    version in the tokenizer manager alone (`_update_weight_version_if_provided`: `self.server_args.weight_version =
    ...`), whose arguments are the top of `/server_info`. So `internal_states` say "initial" for a healthy engine that
    loaded "3", and every refresh retired every loaded engine. An engine that reports the version loaded anywhere holds
    it (a fresh process reports its launch version in both places); a real restart is still told."""
    fleet, engines = fleet_engines(standins, tmp_path, 33100)
    real_get = fleet.get

    async def get(url):
        reply = await real_get(url)
        if url.endswith("/server_info"):
            engine = next(e for e in fleet.engines if url.startswith(e.url))
            # the older shape: the tokenizer manager's (updated) arguments on top, the
            # scheduler's launch copy in its internal state
            reply = {**reply, "weight_version": engine.version,
                     "internal_states": [{"weight_version": engine.launch_version}]}
        return reply

    async def run():
        await engines.discover()
        for iid in (0, 1):
            await engines.load(iid, "3", str(tmp_path / "w"))
        fleet.get = get
        for _ in range(2):
            assert await engines.refresh() == ([], []), engines.reasons
        fleet.restart_engine(33100, reregister=False)
        gone, new = await engines.refresh()
        assert (gone, new) == ([0], [(2, 2)]) and "weight version 'default'" in engines.reasons[0]

    asyncio.run(run())


# ------------------------------------------------------------------ review: shared passes, faults
class _HeldEngines:
    """An `Engines` whose refresh passes are held until the test lets each one go (a stand-in for
    `SglangEngines.refresh`; no scheduler is needed while passes report nobody gone or new)."""

    def __init__(self) -> None:
        self.holds: collections.deque = collections.deque()  # (started, release, outcome), one per pass
        self.passes = 0

    def hold_next(self, outcome=None) -> tuple[asyncio.Event, asyncio.Event]:
        """The next pass not yet held: it sets `started`, waits for `release`, then returns
        nothing changed or raises `outcome`."""
        started, release = asyncio.Event(), asyncio.Event()
        self.holds.append((started, release, outcome))
        return started, release

    async def refresh(self):
        self.passes += 1
        started, release, outcome = self.holds.popleft()
        started.set()
        await asyncio.wait_for(release.wait(), 10)
        if outcome is not None:
            raise outcome
        return [], []


def _bare_session(engines, loop):
    from dora_ext.slime.rollout import RolloutSession
    from dora_ext.slime.settings import slime_settings

    return RolloutSession(None, None, first_step=0, engines=engines, board=None,
                          settings=slime_settings(None), loop=loop)


def _unretrieved(loop) -> list:
    """Errors the loop reports (a future's exception never retrieved, a task's)."""
    seen: list = []
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx.get("message")))
    return seen


@pytest.mark.parametrize("outcome", ["ok", "raises"])
def test_a_cancelled_refresh_caller_leaves_the_others_their_pass(outcome):
    """Caller A runs pass 1 (held); B and C arrive meanwhile and share pass 2; B is cancelled while pass 1 runs. C still
    gets pass 2's outcome (its result, or the exception it raised: every caller of the pass raises it), A gets pass 1's;
    nothing is reported as never retrieved, even when the only caller left of a failing pass was cancelled."""
    engines = _HeldEngines()

    async def run():
        loop = asyncio.get_running_loop()
        errors = _unretrieved(loop)
        session = _bare_session(engines, loop)
        failure = Interrupted("pass 2") if outcome == "raises" else None
        (s1, r1), (s2, r2) = engines.hold_next(), engines.hold_next(failure)
        a = asyncio.ensure_future(session._refresh())
        await asyncio.wait_for(s1.wait(), 10)
        b = asyncio.ensure_future(session._refresh())
        c = asyncio.ensure_future(session._refresh())
        await asyncio.sleep(0)  # B and C are waiting (a yield, not a timing wait)
        b.cancel()
        r1.set()
        await asyncio.wait_for(a, 10)
        await asyncio.wait_for(s2.wait(), 10)
        assert not c.done()
        r2.set()
        done, _ = await asyncio.wait({c}, timeout=10)
        assert c in done
        if outcome == "raises":
            assert isinstance(c.exception(), Interrupted)
        else:
            assert c.result() is None
        assert b.cancelled() and session.refresh_passes == 2
        # The same failure, its only caller cancelled: retrieved all the same.
        s3, r3 = engines.hold_next(Interrupted("pass 3"))
        d = asyncio.ensure_future(session._refresh())
        await asyncio.wait_for(s3.wait(), 10)
        runner = session._refresh_runner
        d.cancel()
        r3.set()
        await asyncio.wait_for(runner, 10)  # the runner hands a pass's failure to its callers, never raises
        assert session.refresh_passes == 3 and session._refresh_runner is None
        import gc

        gc.collect()
        await asyncio.sleep(0)
        assert errors == []

    asyncio.run(run())


def test_a_refresh_runner_cancelled_before_it_ran_leaves_no_caller_waiting():
    """Closing cancels the worker's tasks; a refresh runner created in that same loop turn is
    cancelled before it ever ran, so its `finally` never runs. A caller outside the worker's
    tasks (slime's evaluation, `_evaluate`) waited for its pass forever; it is cancelled now."""
    engines = _HeldEngines()

    async def run():
        loop = asyncio.get_running_loop()
        session = _bare_session(engines, loop)
        caller = asyncio.ensure_future(session._refresh())
        await asyncio.sleep(0)  # the caller ran: the runner exists, not started yet
        runner = session._refresh_runner
        assert runner is not None and session.refresh_passes == 0 and engines.passes == 0
        runner.cancel()
        done, _ = await asyncio.wait({caller}, timeout=10)
        assert caller in done and caller.cancelled()
        assert session._refresh_runner is None and session._refresh_next is None
        # A later caller gets a fresh pass.
        s, r = engines.hold_next()
        later = asyncio.ensure_future(session._refresh())
        await asyncio.wait_for(s.wait(), 10)
        r.set()
        await asyncio.wait_for(later, 10)

    asyncio.run(run())


def test_a_router_that_never_answers_does_not_hold_the_refresh_callers(tmp_path, standins):
    """slime's HTTP client has no timeout (`httpx.Timeout(None)`), and the refresh's read of the router had none either:
    a router that never answers held the pass, and with it every caller sharing it (trajectories back with a wrong
    version, a failed load, the eval, the watcher). The read is bounded now: the pass fails (logged, nothing changed)
    and its callers go on; the next pass sees the router again."""
    args = make_args(tmp_path, capacity=2)
    fleet = standins.FakeSglangFleet(2, capacity=2, base_port=33200)
    from dora_ext.slime.engines import SglangEngines
    from dora_ext.slime.settings import slime_settings

    engines = SglangEngines(args, slime_settings(args), http=fleet, control=fleet)
    engines.router_timeout_s = 0.05
    real_get = fleet.get
    never = asyncio.Event()
    hang = [True]

    async def get(url):
        if url.endswith("/workers") and hang[0]:
            await never.wait()
        return await real_get(url)

    async def run():
        loop = asyncio.get_running_loop()
        session = _bare_session(engines, loop)
        await engines.discover()
        fleet.get = get
        callers = [asyncio.ensure_future(session._refresh()) for _ in range(3)]
        done, _ = await asyncio.wait(callers, timeout=10)
        assert len(done) == 3 and all(c.result() is None for c in callers)
        assert sorted(engines.urls) == [0, 1]
        hang[0] = False
        fleet.engines[0].alive = False
        assert await engines.refresh() == ([0], [])

    asyncio.run(run())


@pytest.mark.parametrize("first", ["restarted", "slow"])
def test_a_slow_server_info_beside_a_restarted_engine(tmp_path, standins, first):
    """Engine 0 was restarted (its registration kept: only its version tells); engine 1 is healthy
    and its `/server_info` is slow. Both orders forced within the one pass: the answer of one
    engine's `/server_info` is held until the other's has been answered. Either way the pass
    retires engine 0 alone (its successor joins), and engine 1 keeps its instance."""
    fleet, engines = fleet_engines(standins, tmp_path, 33300)
    real_get = fleet.get
    answered = {0: asyncio.Event(), 1: asyncio.Event()}
    held = 0 if first == "slow" else 1  # the one answered second

    async def get(url):
        if url.endswith("/server_info"):
            i = next(i for i, e in enumerate(fleet.engines[:2]) if url.startswith(e.url))
            if i == held:
                await asyncio.wait_for(answered[1 - i].wait(), 10)
            reply = await real_get(url)
            answered[i].set()
            return reply
        return await real_get(url)

    async def run():
        await engines.discover()
        for iid in (0, 1):
            await engines.load(iid, "3", str(tmp_path / "w"))
        fleet.restart_engine(33300, reregister=False)
        fleet.get = get
        gone, new = await engines.refresh()
        assert (gone, new) == ([0], [(2, 2)]) and "weight version 'default'" in engines.reasons[0]
        assert sorted(engines.urls) == [1, 2] and engines._loaded_tags == {1: "3"}
        assert all(e.is_set() for e in answered.values())

    asyncio.run(run())
