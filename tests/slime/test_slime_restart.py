"""An engine that slime's fault tolerance restarts at the SAME address between two refreshes.

slime relaunches a dead engine at the address it had: `ServerGroup.start_engines` scans for a
free port from 15000 again, and the dead engine's port is free (slime 624b824,
`slime/ray/rollout.py`). The adapter used to tell engines apart by URL and only noticed a restart
when a refresh fell between the death and the re-registration; otherwise it kept the old instance
id, assumed the old weights were loaded, and failed every trajectory the successor answered with
its launch weight version until their retries ran out.

slime is ABSENT here (CI): the stand-ins of `slime_standins.py` speak SGLang's and sglang-router's
HTTP interface (a fresh router id per registration, the `weight_version` of `/server_info`'s
internal states and of `/model_info`), and the
stand-in generate retries at the same URL as slime's HTTP client does. The restart is forced as
the victim's 3rd request starts; the periodic refresh is pushed out of the run
(`engine_check_interval_s` = 600 s), so no refresh can fall between the death and the restart.
`tests/slime/test_slime_loops.py::test_engine_restarted_at_the_same_address` does the same under
slime's own loop.
"""

from __future__ import annotations

import asyncio
import collections
import pytest

from slime_helpers import (
    SimulatedSlimeDriver, check_train_eval_train, check_trained, eval_fleet_session, fleet_engines, install_eval_rollout,
    install_fleet_session, make_args, probe_eval, record_probes, train_eval_train,
)



@pytest.mark.parametrize("reregister", [True, False], ids=["new-registration", "old-registration-kept"])
def test_engine_restarted_at_the_same_address_joins_under_a_fresh_id(tmp_path, standins, reregister):
    pytest.importorskip("slime.utils.health_monitor", reason="fault tolerance needs a slime checkout (DORA_SLIME_PATH)")
    args = make_args(tmp_path, mode="dora", k=1, batch=2, n=2, num_rollout=6, capacity=2, use_fault_tolerance=True)
    args.dora_slime["engine_check_interval_s"] = 600  # no periodic refresh during the run
    fleet = standins.FakeSglangFleet(2, capacity=2, base_port=31200)
    victim = fleet.engines[0]
    restarted = {}

    def on_start(engine):
        if engine is victim and engine.started == 3 and not restarted:
            restarted["engine"] = fleet.restart_engine(victim.port, reregister=reregister)

    session = install_fleet_session(args, None, fleet, first_step=0)
    seen = collections.defaultdict(list)
    session.probe = lambda name, value: seen[name].append(value)
    standins.ON_START = on_start
    try:
        outs = SimulatedSlimeDriver(args, session.data_source).run_async(0, 6)
    finally:
        standins.ON_START = None
    successor = restarted["engine"]
    assert successor.url == victim.url
    # The victim's request was answered by its successor (slime's client retries the same URL),
    # with the successor's launch weight version: that answer is what told the worker.
    assert successor.inherited >= 1
    # The old instance id was retired and the successor joined under a fresh, larger one.
    assert seen["engine_failed"] == [0] and seen["engine_joined"] == [2]
    assert seen["group_failed"] == []
    # It loaded a version before serving, and served.
    assert successor.loads and successor.started > 0
    check_trained(outs, 6 * 2, k=1)  # C1: "default" was never trained
    m = outs[5].metrics
    assert m["dora/redispatched"] >= 1
    # Nothing was failed for the successor's launch version: the answer it gave for the old
    # instance's attempt was stale once the instance was retired.
    assert m["dora/retries"] == 0 and m["dora/failed_groups"] == 0


def test_refresh_names_the_evidence_of_a_restart(tmp_path, standins):
    """What each kind of evidence says, and that an engine still holding what was loaded stays."""
    fleet, engines = fleet_engines(standins, tmp_path, 31300)

    async def run():
        assert await engines.discover() == [2, 2]
        await engines.load(0, "3", str(tmp_path / "w"))
        await engines.load(1, "3", str(tmp_path / "w"))
        assert await engines.refresh() == ([], [])
        fleet.restart_engine(31300, reregister=True)
        gone, new = await engines.refresh()
        assert (gone, new) == ([0], [(2, 2)]) and "new registration" in engines.reasons[0]
        assert engines.urls[2] == fleet.engines[0].url
        fleet.restart_engine(31301, reregister=False)  # same router id: only the weight version tells
        gone, new = await engines.refresh()
        assert (gone, new) == ([1], [(3, 2)]) and "weight version 'default'" in engines.reasons[1]
        # A fresh instance has no load yet: its launch version is not held against it.
        assert await engines.refresh() == ([], [])

    asyncio.run(run())


def test_a_load_in_flight_voids_the_version_check(tmp_path, standins):
    """The version is read while a load starts: the engine may report the old one; no verdict."""
    fleet, engines = fleet_engines(standins, tmp_path, 31400)
    real_get = fleet.get

    async def run():
        await engines.discover()
        await engines.load(0, "3", str(tmp_path / "w"))

        async def get(url):
            reply = await real_get(url)
            if url.endswith("/server_info") and "31400" in url:
                # The worker starts loading version 4 while this answer ("3") is on its way.
                await engines.load(0, "4", str(tmp_path / "w"))
            return reply

        fleet.get = get
        assert await engines.refresh() == ([], [])
        fleet.get = real_get
        assert await engines.refresh() == ([], [])  # it holds 4, which was loaded

    asyncio.run(run())


def test_router_without_ids_still_catches_the_restart_by_version(tmp_path, standins):
    """A router that gives no worker ids: the weight version alone tells."""
    fleet, engines = fleet_engines(standins, tmp_path, 31500)
    real_get = fleet.get

    async def get(url):
        reply = await real_get(url)
        if url.endswith("/workers"):
            reply = {"workers": [{k: v for k, v in w.items() if k != "id"} for w in reply["workers"]]}
        return reply

    fleet.get = get

    async def run():
        await engines.discover()
        await engines.load(0, "1", str(tmp_path / "w"))
        fleet.restart_engine(31500, reregister=True)
        gone, new = await engines.refresh()
        assert gone == [0] and new == [(2, 2)]

    asyncio.run(run())


def test_sglang_router_gives_a_fresh_id_per_registration(tmp_path):
    """The evidence the adapter reads, from the real router (sglang-router from PyPI, as slime
    launches it): slime's `SGLangEngine.shutdown` deletes a dead engine's registration and its
    successor registers the same URL anew, under a new id; a registration that was never deleted
    keeps its id (the router refuses the duplicate). The stand-in fleet follows this."""
    import importlib.util
    import json
    import os
    import socket
    import subprocess
    import sys
    import threading
    import time
    import urllib.request
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from slime_helpers import HARNESS

    if importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang-router is not installed (extra slime-test; scripts/test.sh installs it)")

    class Engine(BaseHTTPRequestHandler):  # enough of SGLang's HTTP API for the router to add it
        def log_message(self, *a):
            return

        def do_GET(self):
            body = json.dumps({"model_path": "m", "weight_version": "default", "tp_size": 1, "dp_size": 1}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    engine = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{engine.server_address[1]}"
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(HARNESS, "no_torchcodec"),
                                                        os.environ.get("PYTHONPATH", "")]))
    router = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                               "--port", str(port), "--prometheus-port", str(free_port())],
                              env=env, stdout=open(tmp_path / "router.log", "w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def call(method, path, payload=None):
        req = urllib.request.Request(base + path, method=method, data=None if payload is None else
                                     json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read() or b"{}")

    def listed_id(until, limit_s=60.0):
        """The router adds and removes workers in the background: wait for the listing to show it."""
        t = time.monotonic()
        while True:
            try:
                ids = [w["id"] for w in call("GET", "/workers")["workers"] if w["url"] == url]
            except OSError:
                ids = None
            if ids is not None and until(ids):
                return ids[0] if ids else None
            assert time.monotonic() - t < limit_s, f"router never listed what was expected: {ids}"
            time.sleep(0.1)

    try:
        listed_id(lambda ids: True)  # the router answers
        call("POST", "/workers", {"url": url, "worker_type": "regular"})
        first = listed_id(lambda ids: len(ids) == 1)
        call("DELETE", f"/workers/{first}")  # slime's SGLangEngine.shutdown
        listed_id(lambda ids: not ids)
        call("POST", "/workers", {"url": url, "worker_type": "regular"})  # the successor registers
        second = listed_id(lambda ids: len(ids) == 1)
        assert second != first
        call("POST", "/workers", {"url": url, "worker_type": "regular"})  # registered again, no delete
        # The duplicate is refused in the background; the listing keeps one entry, the old id.
        assert "already exists" in _wait_for_text(tmp_path / "router.log", "already exists")
        assert listed_id(lambda ids: True) == second
    finally:
        router.kill()
        router.wait()
        engine.shutdown()


def _wait_for_text(path, text, limit_s=60.0):
    import time

    t = time.monotonic()
    while text not in path.read_text():
        assert time.monotonic() - t < limit_s, f"{text!r} never appeared in {path}"
        time.sleep(0.1)
    return path.read_text()


def test_eval_engine_restarted_at_the_same_address_evaluates_again_elsewhere(tmp_path, standins, monkeypatch):
    """The engine slime's eval is pinned to is restarted at its address under the eval (its
    request answered by the successor with its launch version, the old registration kept): the
    eval used to end slime's job ("saw versions ['default']"); it now runs again on another
    engine holding the newest version, and the successor joins under a fresh id. The successor's
    load may run while the second eval's request is on top of the scheduler's 2 (the test was
    flaky: the fleet's check allowed 2): forced here, the fleet is checked at that moment."""
    # no periodic refresh during the run
    args, fleet, ds, session = eval_fleet_session(tmp_path, standins, 31700, check_interval_s=600)
    seen = collections.defaultdict(list)
    session.probe = lambda name, value: seen[name].append(value)
    calls: list = []

    async def eval_rollout(eval_args, rollout_id):
        port = int(eval_args.sglang_router_port)
        calls.append(port)
        if len(calls) == 1:
            fleet.restart_engine(port, reregister=False)
            return await probe_eval(standins, eval_args)
        request = asyncio.ensure_future(probe_eval(standins, eval_args))
        while not request.done() and standins.ENGINES[port].running < 3:
            await asyncio.sleep(0)
        fleet.observe()  # what a load on another engine records now
        return await request

    install_eval_rollout(monkeypatch, eval_rollout)
    outs, ev = train_eval_train(args, ds, standins)
    assert len(calls) == 2 and calls[0] != calls[1], calls
    assert len(seen["engine_failed"]) == 1 and seen["engine_joined"] == [2]
    assert ev.metrics["dora/eval_instance"] != seen["engine_failed"][0]
    check_train_eval_train(outs, ev, fleet)


def test_eval_engine_restarted_with_a_load_waiting_on_it_is_retired_before_the_load_runs(
        tmp_path, standins, monkeypatch):
    """The eval's engine E (newest version, 1) is restarted at its address during the eval, its
    old registration kept: only the weight version it reports tells. A load waits on E for the
    eval to end: the other engine died with a straggler of version 0, so the scheduler sends the
    idle-looking E back to 0 (see test_slime_review). The eval used to release E before checking
    the version it saw: the waiting load then started first (on the successor), the check found
    E loading and gave no verdict, and the eval ended slime's job ("saw versions ['default']").
    The check now runs while E is still the eval's: E is retired, the waiting load finds it gone
    and the eval runs again on an engine holding version 1.

    Order forced: no periodic refresh in the run (600 s); the other engine's death is told by
    the straggler's failed request; E is restarted only once the load waits on it."""
    args, fleet, ds, session = eval_fleet_session(tmp_path, standins, 31800, check_interval_s=600)
    probes, load_waits = record_probes(session, "load_waits_for_eval")
    straggler = asyncio.Event()
    calls: list = []

    async def eval_rollout(eval_args, rollout_id):
        port = int(eval_args.sglang_router_port)
        calls.append(port)
        if len(calls) == 1:
            for other in fleet.engines:
                if other.port != port:
                    other.alive = False  # dies with the straggler running
            straggler.set()  # its request fails now: the worker refreshes, E is sent back to 0
            await asyncio.wait_for(load_waits.wait(), 30)
            fleet.restart_engine(port, reregister=False)
        return await probe_eval(standins, eval_args)

    install_eval_rollout(monkeypatch, eval_rollout)
    standins.HOLD[("p2", 4)] = straggler  # p2's first sample: dispatched at version 0, kept running
    outs, ev = train_eval_train(args, ds, standins)
    failed = [v for n, v in probes if n == "engine_failed"]
    assert len(calls) == 2 and ev.metrics["dora/eval_instance"] not in failed, (calls, failed, probes)
    assert len(failed) == 2 and len(set(failed)) == 2  # the other engine, then E: once each
    assert "p2" in check_train_eval_train(outs, ev, fleet)


@pytest.mark.parametrize("load_starts", ["before-the-refresh", "during-its-health-check"])
def test_an_engine_reporting_a_version_it_is_still_being_told_about_is_not_retired(tmp_path, standins, load_starts):
    """SGLang sets the version `/model_info` reports when the load is done, before its reply
    reaches the adapter (tokenizer_manager.update_weights_from_disk): for a while the engine is
    ahead of what the adapter recorded. A refresh in that window must give no verdict: the
    engine is healthy and holds what it was told to load. Both orders forced with gates: the
    load's reply held after the engine switched, and (second case) the refresh's /health held
    until then. (The stand-in's loads are otherwise instantaneous: without the gates no refresh
    can ever see this window.)"""
    fleet, engines = fleet_engines(standins, tmp_path, 31900)
    real_get, real_post = fleet.get, fleet.post
    switched, reply_go, health_in, health_go = (asyncio.Event() for _ in range(4))

    async def post(url, payload):
        reply = await real_post(url, payload)  # the engine now reports the new version
        switched.set()
        await asyncio.wait_for(reply_go.wait(), 10)  # ... and its reply is still on its way
        return reply

    async def get(url):
        if url.endswith("/health_generate") and "31900" in url and load_starts == "during-its-health-check":
            health_in.set()
            await asyncio.wait_for(health_go.wait(), 10)
        return await real_get(url)

    async def run():
        await engines.discover()
        await engines.load(0, "3", str(tmp_path / "w"))
        fleet.get, fleet.post = get, post
        if load_starts == "before-the-refresh":
            load = asyncio.ensure_future(engines.load(0, "4", str(tmp_path / "w")))
            await asyncio.wait_for(switched.wait(), 10)
            assert (await engines.refresh()) == ([], [])
        else:
            refresh = asyncio.ensure_future(engines.refresh())
            await asyncio.wait_for(health_in.wait(), 10)
            load = asyncio.ensure_future(engines.load(0, "4", str(tmp_path / "w")))
            await asyncio.wait_for(switched.wait(), 10)
            health_go.set()
            assert (await refresh) == ([], [])
        assert fleet.engines[0].version == "4" and engines._loaded_tags[0] == "3"  # the window was open
        reply_go.set()
        await load
        fleet.get, fleet.post = real_get, real_post
        assert await engines.refresh() == ([], [])  # it holds 4, which was loaded

    asyncio.run(run())


def test_a_url_listed_under_two_registrations_is_not_taken_for_a_restart(tmp_path, standins):
    """sglang-router 0.3.2 refuses a second registration of a URL (test above), but a router
    that listed one URL under two ids, in an order that varies between reads (a hash map), made
    the adapter keep whichever came last and take the other for "a new registration": a healthy
    engine retired on every other refresh, with its trajectories. An id is evidence of a restart
    only when the one the adapter knew is no longer listed for that URL."""
    fleet, engines = fleet_engines(standins, tmp_path, 32000)
    real_get = fleet.get
    reads = [0]

    async def get(url):
        reply = await real_get(url)
        if url.endswith("/workers"):
            reads[0] += 1
            first = reply["workers"][0]
            twin = dict(first, id="twin-" + first["id"])
            pair = [first, twin] if reads[0] % 2 else [twin, first]
            reply = {"workers": pair + reply["workers"][1:]}
        return reply

    fleet.get = get

    async def run():
        assert await engines.discover() == [2, 2]
        await engines.load(0, "3", str(tmp_path / "w"))
        for _ in range(4):
            assert await engines.refresh() == ([], []), engines.reasons
        # Both registrations gone and a new one at the URL: that is a restart.
        fleet.get = real_get
        fleet.restart_engine(32000, reregister=True)
        gone, new = await engines.refresh()
        assert (gone, new) == ([0], [(2, 2)]) and "new registration" in engines.reasons[0]

    asyncio.run(run())


def test_a_restart_told_by_two_refreshes_at_once_fails_its_instance_once(tmp_path, standins):
    """Two refreshes see the same restart at once (a trajectory answered with the successor's
    launch version, and the periodic watcher): the instance is failed once, the successor joins
    once. Order forced: the trajectory's refresh is held at the victim's /server_info until a
    second refresh (what `_watch_engines` calls) has started and reached its first wait, and, if
    that second one got into the engines' refresh (nothing serialised them), until it is done;
    the periodic watcher itself is pushed out of the run (600 s)."""
    pytest.importorskip("slime.utils.health_monitor", reason="fault tolerance needs a slime checkout (DORA_SLIME_PATH)")
    args = make_args(tmp_path, mode="dora", k=1, batch=2, n=2, num_rollout=6, capacity=2, use_fault_tolerance=True)
    args.dora_slime["engine_check_interval_s"] = 600
    fleet = standins.FakeSglangFleet(2, capacity=2, base_port=32100)
    victim = fleet.engines[0]
    session = install_fleet_session(args, None, fleet, first_step=0)
    seen = collections.defaultdict(list)
    session.probe = lambda name, value: seen[name].append(value)
    real_get, real_refresh, real_engines_refresh = fleet.get, session._refresh, session.engines.refresh
    entered, left = asyncio.Event(), asyncio.Event()
    held: list = []
    inside = [0]  # refreshes inside SglangEngines.refresh now

    async def refresh():
        entered.set()
        return await real_refresh()

    async def engines_refresh():
        inside[0] += 1
        try:
            return await real_engines_refresh()
        finally:
            inside[0] -= 1
            left.set()

    async def get(url):
        if (url == victim.url + "/server_info" and standins.ENGINES[victim.port] is not victim
                and not held):
            held.append(url)
            entered.clear()
            session._spawn(session._refresh())  # the second refresh, as the watcher starts it
            await asyncio.wait_for(entered.wait(), 10)
            while inside[0] > 1:  # it runs beside this one: let it finish first
                left.clear()
                await asyncio.wait_for(left.wait(), 10)
        return await real_get(url)

    def on_start(engine):
        if engine is victim and engine.started == 3:
            fleet.restart_engine(victim.port, reregister=False)

    fleet.get = get
    session._refresh = refresh
    session.engines.refresh = engines_refresh
    standins.ON_START = on_start
    try:
        outs = SimulatedSlimeDriver(args, session.data_source).run_async(0, 6)
    finally:
        standins.ON_START = None
    assert held, "the restart was never checked"
    assert seen["engine_failed"] == [0] and seen["engine_joined"] == [2], dict(seen)
    check_trained(outs, 6 * 2)
    assert outs[5].metrics["dora/failed_groups"] == 0


@pytest.mark.parametrize("answer", ["error-status", "never", "no-field"])
def test_an_engine_whose_model_info_gives_no_answer_is_not_retired(tmp_path, standins, answer):
    """/server_info and /model_info that fail, hang past the health timeout, or have no
    `weight_version` (an older SGLang) are no evidence: a healthy engine stays. A restart whose
    registration was renewed is still told by the router's id."""
    fleet, engines = fleet_engines(standins, tmp_path, 32200)
    engines.health_timeout_s = 0.05  # the hang below is cut by it
    real_get = fleet.get
    never = asyncio.Event()

    async def get(url):
        if url.endswith(("/model_info", "/server_info")):
            if answer == "error-status":
                raise RuntimeError("503 Service Unavailable")
            if answer == "never":
                await never.wait()
            return {"model_path": "m"}
        return await real_get(url)

    async def run():
        await engines.discover()
        await engines.load(0, "3", str(tmp_path / "w"))
        fleet.get = get
        fleet.engines[0].version = "default"  # what it reports would differ, if it said
        assert await engines.refresh() == ([], [])
        fleet.restart_engine(32200, reregister=True)
        gone, new = await engines.refresh()
        assert (gone, new) == ([0], [(2, 2)]) and "new registration" in engines.reasons[0]

    asyncio.run(run())


@pytest.mark.parametrize("reregister", [True, False], ids=["new-registration", "old-registration-kept"])
def test_an_engine_restarted_during_a_weight_load(tmp_path, standins, reregister):
    """The engine dies while loading and slime restarts it at its address; slime's HTTP client
    retries the load there, so the successor performs it. A renewed registration retires the
    instance at once, loading or not (the late load reply records nothing for it). With the old
    registration kept, a refresh gives no verdict while the load runs, and afterwards the
    successor holds exactly the version loaded: it stays (no trajectory ran on it: loads wait
    for the engine to drain)."""
    fleet, engines = fleet_engines(standins, tmp_path, 32300)
    real_post = fleet.post
    in_load, go = asyncio.Event(), asyncio.Event()

    async def post(url, payload):
        in_load.set()
        await asyncio.wait_for(go.wait(), 10)
        return await real_post(url, payload)  # lands on whichever engine serves the URL now

    async def run():
        await engines.discover()
        await engines.load(0, "3", str(tmp_path / "w"))
        fleet.post = post
        load = asyncio.ensure_future(engines.load(0, "4", str(tmp_path / "w")))
        await asyncio.wait_for(in_load.wait(), 10)
        successor = fleet.restart_engine(32300, reregister=reregister)
        gone, new = await engines.refresh()
        assert (gone, new) == (([0], [(2, 2)]) if reregister else ([], []))
        go.set()
        await load
        assert successor.version == "4"
        if reregister:
            assert 0 not in engines._loaded_tags and 2 not in engines._loaded_tags
        else:
            assert engines._loaded_tags[0] == "4"
        assert await engines.refresh() == ([], [])

    asyncio.run(run())
