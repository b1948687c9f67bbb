"""The limits of slime's real components that only recipe-scale concurrency shows (issue 22):
slime's connection pool of `--sglang-server-concurrency` x engines connections, held by
generation; SGLang's `/health` that does not generate (as slime launches it); a stuck engine;
SGLang's weight-update writer lock under slime's `RolloutHealthMonitor`; SGLang 0.5.15's
`/server_info` with slime's patch; a cancelled request that stays in SGLang's batch after it lets
go of the writer lock, where a load fails to flush the cache; many loads holding control
connections at once.

The HTTP tests run the CPU SGLang stand-in of `harness/slime_cpu/server.py` (a batching decode
loop, the writer lock, `/health` without generation) in this process, over real sockets.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from slime_helpers import (SimulatedSlimeDriver, check_trained, fleet_engines, install_fleet_session, make_args,
                           record_probes)

from dora_ext.slime.data_source import DoraDataSource
from dora_ext.slime.engines import SglangEngines
from dora_ext.slime.rollout import generate_rollout
from dora_ext.slime.settings import memory_fs, slime_settings

sys.path.insert(0, str(Path(__file__).resolve().parent / "harness"))

from slime_cpu import server as sglang_standin  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(httpd) -> None:
    threading.Thread(target=httpd.serve_forever, daemon=True).start()


def _fleet(tmp_path: Path, n: int, **engine_kw) -> tuple[list, list, str, list]:
    """`n` stand-in SGLang servers and a stand-in router listing them: (engines, urls, router, servers)."""
    engines, urls, servers = [], [], []
    for i in range(n):
        port = _port()
        e = sglang_standin.Engine(str(tmp_path), str(tmp_path / f"engine{i}.jsonl"), None, port, cheap=True, **engine_kw)
        servers.append(sglang_standin.serve(e, port))
        engines.append(e)
        urls.append(f"http://127.0.0.1:{port}")
    rport = _port()
    servers.append(sglang_standin.serve_router(urls, rport))
    for s in servers:
        _serve(s)
    return engines, urls, f"127.0.0.1:{rport}", servers


class _SlimePool:
    """slime's generation client as `slime.utils.http_utils.init_http_client` builds it:
    `sglang_server_concurrency` x engines connections, no timeout (slime's own module when a
    checkout is importable)."""

    def __init__(self, concurrency: int, engines: int, monkeypatch) -> None:
        import httpx

        try:
            from slime.utils import http_utils
        except ImportError:
            self.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency * engines),
                                            timeout=httpx.Timeout(None), trust_env=False)
            self.slime = None
        else:
            monkeypatch.setattr(http_utils, "_http_client", None)
            monkeypatch.setattr(http_utils, "_distributed_post_enabled", False)
            http_utils.init_http_client(SimpleNamespace(rollout_num_engines=engines, sglang_server_concurrency=concurrency,
                                                        use_distributed_post=False))
            self.slime = http_utils
            self.client = http_utils._http_client

    async def get(self, url: str):
        if self.slime is not None:
            return await self.slime.get(url)
        r = await self.client.get(url)
        r.raise_for_status()
        return r.json()

    async def post(self, url: str, payload: dict, max_retries: int = 60):
        if self.slime is not None:
            return await self.slime.post(url, payload, max_retries=max_retries)
        r = await self.client.post(url, json=payload)
        r.raise_for_status()
        return r.json()


def _args(tmp_path: Path, router: str, concurrency: int, **extra) -> SimpleNamespace:
    ip, port = router.split(":")
    args = make_args(tmp_path, capacity=concurrency, **extra)
    args.sglang_router_ip, args.sglang_router_port = ip, int(port)
    return args


def test_engines_whose_generation_holds_slimes_whole_pool_are_not_retired(tmp_path, monkeypatch):
    """slime's pool (concurrency x engines connections) full of generate requests, as at
    start-up and during every evaluation: the router read and each engine's probe must not queue
    behind them. Three engines, 8 requests each (the pool's size), answered only at the end."""
    c, n = 8, 3
    standins, urls, router, servers = _fleet(tmp_path, n, step_s=0.01)
    pool = _SlimePool(c, n, monkeypatch)
    args = _args(tmp_path, router, c)
    engines = SglangEngines(args, slime_settings(args), http=pool)
    engines.health_timeout_s = engines.router_timeout_s = 10.0

    async def run():
        assert await engines.discover() == [c] * n
        reqs = [asyncio.ensure_future(pool.post(f"{u}/generate", {"input_ids": [3, 4],
                                                                  "sampling_params": {"max_new_tokens": 10**7}}))
                for u in urls for _ in range(c)]
        t = time.monotonic()
        while sum(len(e.running) for e in standins) < n * c:  # every connection is generation's
            assert time.monotonic() - t < 30, [len(e.running) for e in standins]
            await asyncio.sleep(0.02)
        try:
            return await engines.refresh()
        finally:
            for e in standins:
                e.finish_all()
            await asyncio.gather(*reqs, return_exceptions=True)

    try:
        gone, new = asyncio.run(run())
    finally:
        for s in servers:
            s.shutdown()
    assert (gone, new) == ([], []), engines.reasons


def test_a_stuck_engine_is_retired_and_its_trajectories_run_again_at_their_version(tmp_path, standins):
    """Engine 1 sticks as its first request starts: it accepts requests and never answers them,
    while `/health` (no generation, as slime launches SGLang) still says 200. The probe
    (`/health_generate`) times out, the engine is retired, its requests are cancelled, and each
    of its trajectories runs again elsewhere at the version it was pinned to."""
    args = make_args(tmp_path, mode="dora", k=1, batch=3, n=2, num_rollout=4, capacity=2)
    args.dora_slime["engine_check_interval_s"] = 0.05
    fleet = standins.FakeSglangFleet(3, capacity=2, base_port=31700)
    stuck = fleet.engines[1]
    held: list = []
    standins.STUCK.clear()

    def on_start(engine):
        if engine is stuck:
            engine.stuck = True
            held.append(engine.version)

    standins.ON_START = on_start
    session = install_fleet_session(args, None, fleet, first_step=0)
    session.engines.health_timeout_s = 1.0
    probes: list = []
    session.probe = lambda name, value: probes.append((name, value))
    out: dict = {}
    try:
        t = threading.Thread(target=lambda: out.update(SimulatedSlimeDriver(args, session.data_source).run_async(0, 4)), daemon=True)
        t.start()
        t.join(120)
    finally:
        standins.ON_START = None
    assert not t.is_alive(), f"the run hangs on the stuck engine: {probes}"
    assert held, "the stuck engine never took a request"
    assert [v for n, v in probes if n == "engine_failed"] == [1]
    assert stuck.running == 0, "the stuck engine's requests were not cancelled"
    check_trained(out, 4 * 3)
    groups = [g for o in out.values() for g in o.samples]
    versions = {g[0].prompt: g[0].weight_versions[0] for g in groups}
    assert standins.STUCK and all(versions[p] == v for p, v in standins.STUCK), (standins.STUCK, versions)
    assert fleet.violations == []


def test_server_info_without_internal_states_is_no_verdict(tmp_path, standins):
    """SGLang 0.5.15 with slime's patch answers `/server_info` with `internal_states: []` when its
    scheduler takes over 2 s (a busy engine): that is unknown, not a restart, even where
    `/model_info` (one tokenizer worker's copy) reports another version."""
    from slime_helpers import fleet_engines

    fleet, engines = fleet_engines(standins, tmp_path, 31750, n=1)

    async def run():
        await engines.discover()
        await engines.load(0, "3", str(tmp_path / "w"))
        e = fleet.engines[0]
        e.empty_states = True
        e.worker_versions = {0: "default"}  # /model_info answered by a worker that never saw the load
        return await engines.reported_version(e.url, "3"), await engines.refresh()

    reported, (gone, new) = asyncio.run(run())
    assert reported is None
    assert (gone, new) == ([], [])


@pytest.mark.parametrize("order", ["check_first", "load_first"])
def test_a_refresh_does_not_wait_for_a_check_that_a_load_started_behind(tmp_path, standins, order):
    """A refresh picks engine 0 to check, and a load of engine 0 starts that holds SGLang's writer
    lock. check_first: the check is asked first and reaches the engine only once the load runs
    (as a check in transit when `/update_weights_from_disk` arrives). load_first: the load starts
    in the loop turn the refresh picked the engine in, before its check began. That check's
    verdict would be voided anyway, so the refresh returns while the load is still held instead
    of holding every caller of refresh behind the load (SGLang's /health_generate gives up after
    its own SGLANG_HEALTH_CHECK_TIMEOUT, 20 s by default; the adapter's bound is probe_timeout_s)."""
    from slime_helpers import fleet_engines

    fleet, engines = fleet_engines(standins, tmp_path, 31770, n=2)
    e = fleet.engines[0]
    release = asyncio.Event()
    e.load_hold = {"3": (release, standins.HOLD_TIMEOUT_S)}
    get = fleet.get
    loads: list = []

    def start_load():
        loads.append(asyncio.ensure_future(engines.load(0, "3", str(tmp_path / "w"))))

    class PickingEngine0StartsTheLoad(dict):  # refresh reads engine 0's load count as it picks it
        def get(self, key, default=None):
            if key == 0 and not loads and engines.urls and not engines._loading:
                start_load()
            return super().get(key, default)

    async def run():
        await engines.discover()
        asked, loading = asyncio.Event(), asyncio.Event()

        async def ordered_get(url):
            if url == f"{e.url}/health_generate" and not asked.is_set():
                asked.set()
                await loading.wait()  # reaches the engine behind the load
            return await get(url)

        if order == "check_first":
            fleet.get = ordered_get
        else:
            engines._loads_started = PickingEngine0StartsTheLoad()
            loading.set()
        refresh = asyncio.ensure_future(engines.refresh())
        if order == "check_first":
            await asked.wait()
            start_load()
        while e.load_done is None:
            await asyncio.sleep(0)
        loading.set()
        done, _ = await asyncio.wait({refresh}, timeout=standins.HOLD_TIMEOUT_S / 2)
        held = e.load_done is not None
        release.set()
        await loads[0]
        return refresh in done, held, (await refresh if refresh.done() else None)

    returned, held, result = asyncio.run(run())
    assert returned and held, "the refresh waited for the held load"
    assert result == ([], [])
    assert fleet.engines[0].loads == ["3"] and engines._load_watch == {}


def test_slimes_health_monitor_does_not_kill_an_engine_dora_loads(tmp_path, monkeypatch):
    """`--use-fault-tolerance`: slime's `RolloutHealthMonitor` asks every engine's
    `/health_generate` with `--rollout-health-check-timeout`; a load holds SGLang's writer lock
    longer than that. The monitor (slime's own code) must skip exactly the engine being loaded:
    engine 0's load holds the lock until a check of engine 0 came back during it (a bound of 30 s,
    over the 2 s check timeout) and engine 0 survives; engine 1, stuck, is killed.

    What runs: slime's own monitor class (its thread, its interval, its `_check_engine_health`
    under dora's guard) against two CPU SGLang stand-ins over HTTP, and dora's `SglangEngines.load`.
    Stood in: slime's `SGLangEngine` Ray actors (the two calls the monitor makes, `get_url` and
    `health_generate`, here plain HTTP calls) and `ray.get` / `ray.kill`. Not covered: slime building
    the monitor. Its RolloutManager builds one per server group it launched (on GPUs); the loop
    harness's engines are external, for which slime builds none, so no slime loop test can run it."""
    health_monitor = pytest.importorskip("slime.utils.health_monitor", reason="needs a slime checkout (DORA_SLIME_PATH)")
    cls = health_monitor.RolloutHealthMonitor
    monkeypatch.setattr(cls, "_check_engine_health", cls._check_engine_health)  # restored after the test
    import requests

    standins, urls, router, servers = _fleet(tmp_path, 2, load_s=30.0)
    standins[1].stuck = True
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "config.json").write_text("{}")
    killed: list = []

    class Call:  # a Ray ObjectRef stand-in: ray.get runs it
        def __init__(self, fn):
            self.fn = fn

    class Method:
        def __init__(self, fn):
            self.fn = fn

        def remote(self, *a, **kw):
            return Call(lambda: self.fn(*a, **kw))

    class EngineActor:  # slime's SGLangEngine actor, the two methods the monitor calls
        def __init__(self, url):
            self.url = url
            self.get_url = Method(lambda: url)
            self.health_generate = Method(self._health)
            self.shutdown = Method(lambda: killed.append(url))

        def _health(self, timeout=5.0):
            requests.get(f"{self.url}/health_generate", timeout=timeout).raise_for_status()
            return True

    ray_stub = SimpleNamespace(get=lambda ref, timeout=None: ref.fn() if isinstance(ref, Call) else [r.fn() for r in ref],
                               kill=lambda actor: None)
    monkeypatch.setattr(health_monitor, "ray", ray_stub)
    group = SimpleNamespace(all_engines=[EngineActor(u) for u in urls], nodes_per_engine=1)
    group.engines = group.all_engines
    args = _args(tmp_path, router, 2, use_fault_tolerance=True)
    monitor = cls(group, SimpleNamespace(rollout_health_check_interval=0.05, rollout_health_check_timeout=2.0,
                                         rollout_health_check_first_wait=0.0))
    engines = SglangEngines(args, slime_settings(args), http=_SlimePool(2, 2, monkeypatch))
    guarded = cls._check_engine_health

    def spy(self, rollout_engine_id, engine):  # a check of engine 0 came back while its load holds the lock
        out = guarded(self, rollout_engine_id, engine)
        if rollout_engine_id == 0 and standins[0].update_lock.writer:
            standins[0].load_hold.set()
        return out

    monkeypatch.setattr(cls, "_check_engine_health", spy)

    async def run():
        await engines.discover()
        monitor.start()
        monitor.resume()
        t = time.monotonic()
        while urls[1] not in killed:  # the monitor runs (and kills the stuck engine)
            assert time.monotonic() - t < 30, "slime's health monitor never checked"
            await asyncio.sleep(0.05)
        await engines.load(next(i for i, u in engines.urls.items() if u == urls[0]), "1", str(tmp_path / "w"))

    try:
        asyncio.run(run())
    finally:
        monitor.stop()
        for s in servers:
            s.shutdown()
    assert killed == [urls[1]]
    assert group.all_engines[0] is not None
    assert [e["version"] for e in map(__import__("json").loads, (tmp_path / "engine0.jsonl").read_text().splitlines())
            if e["kind"] == "load"] == ["1"]


def test_an_evaluation_cancelled_on_a_dead_engine_cancels_its_requests(tmp_path, standins, monkeypatch):
    """slime's `eval_rollout` starts one task per eval sample and awaits them with
    `as_completed`; cancelling it (its engine is stuck, the eval runs again elsewhere) used to
    leave those tasks and their requests running. Here the first eval's request hangs on the
    stuck engine for ever; it must be cancelled."""
    from slime_helpers import eval_fleet_session, install_eval_rollout, probe_eval, record_probes, train_eval_train

    args, fleet, ds, session = eval_fleet_session(tmp_path, standins, 31450, check_interval_s=0.02)
    session.engines.health_timeout_s = 0.5
    probes, _ = record_probes(session, "engine_failed")
    calls: list = []
    ended: list = []

    async def request(eval_args):
        try:
            return await probe_eval(standins, eval_args)
        except BaseException as exc:
            ended.append("cancelled" if isinstance(exc, asyncio.CancelledError) else repr(exc))
            raise

    async def eval_rollout(eval_args, rollout_id):  # slime's shape: a task per sample, as_completed
        engine = standins.ENGINES[int(eval_args.sglang_router_port)]
        calls.append(engine.port)
        if len(calls) == 1:
            engine.stuck = True  # its requests never end; its probe times out
        tasks = [asyncio.create_task(request(eval_args))]
        for coro in asyncio.as_completed(tasks):
            return await coro

    install_eval_rollout(monkeypatch, eval_rollout)
    outs, ev = train_eval_train(args, ds, standins)
    assert len(calls) == 2, calls
    assert ended[0] == "cancelled", ended


def test_a_multi_node_cluster_without_a_shared_weights_dir_refuses_to_start(tmp_path, standins, monkeypatch):
    """Engines load each version from the directory the trainer wrote: on a cluster of several
    nodes that directory must be shared, and a launch that does not say so fails naming the key."""
    from dora_ext.config import ConfigError
    from dora_ext.slime import rollout

    monkeypatch.setattr(rollout, "_ray_nodes", lambda: 2)
    args = make_args(tmp_path)
    with pytest.raises(ConfigError, match="dora_slime.shared_weights_dir"):
        rollout.RolloutSession.for_slime(args, DoraDataSource(args), 0)
    args.dora_slime["shared_weights_dir"] = True
    from dora_ext.slime.engines import PassThroughEngines

    rollout.RolloutSession.for_slime(args, DoraDataSource(args), 0, engines=PassThroughEngines([1])).close()
    if memory_fs("/dev/shm") is None:
        pytest.skip("no tmpfs at /dev/shm on this machine")
    args.dora_slime["weights_dir"] = args.update_weight_disk_dir = "/dev/shm/dora-w"  # one node's memory
    with pytest.raises(ConfigError, match="dora_slime.weights_dir.*/dev/shm/dora-w' is on tmpfs"):
        rollout.RolloutSession.for_slime(args, DoraDataSource(args), 0)


def test_a_weights_dir_is_judged_by_the_mount_that_is_visible_there(tmp_path):
    """/proc/mounts: the last mount at a point hides those below it (a disk bind-mounted over a
    tmpfs, or a tmpfs over a disk), and a space in a mount point is written \\040."""
    mounts = tmp_path / "mounts"
    mounts.write_text("overlay / overlay rw 0 0\ntmpfs /data tmpfs rw 0 0\n/dev/sda1 /data ext4 rw 0 0\n"
                      "/dev/sda1 /scratch ext4 rw 0 0\ntmpfs /scratch tmpfs rw 0 0\ntmpfs /my\\040shm tmpfs rw 0 0\n")
    judged = {p: memory_fs(p, str(mounts)) for p in ("/data/w", "/scratch/w", "/my shm/w", "/w")}
    assert judged == {"/data/w": None, "/scratch/w": "tmpfs", "/my shm/w": "tmpfs", "/w": None}


def test_engines_holding_the_launch_weights_are_not_reloaded_with_version_0(tmp_path, standins, monkeypatch):
    """A fresh run's version 0 is the checkpoint slime launched the engines with: they are told
    the tag (SGLang's `/update_weight_version`), not reloaded from disk; a resumed run loads it."""
    args = make_args(tmp_path, mode="dora", k=1, batch=2, n=2, num_rollout=3, capacity=2)
    fleet = standins.FakeSglangFleet(3, capacity=2, base_port=31800)
    ds = install_fleet_session(args, None, fleet, first_step=0).data_source
    outs = SimulatedSlimeDriver(args, ds).run_async(0, 3)
    assert [e.relabels for e in fleet.engines] == [["0"]] * 3
    assert all("0" not in e.loads for e in fleet.engines)
    assert {v for o in outs.values() for g in o.samples for s in g for v in s.weight_versions} >= {"0"}
    assert fleet.violations == []

    from dora_ext.slime import rollout, weights

    rollout.close_session()
    monkeypatch.setattr(weights, "_RUN", "second-driver")
    monkeypatch.setattr(weights, "_count", 0)  # a second slime driver process
    (tmp_path / "ckpt2").mkdir()
    (tmp_path / "ckpt2" / "latest_checkpointed_iteration.txt").write_text("1")
    args = make_args(tmp_path / "b", mode="dora", k=1, batch=2, n=2, num_rollout=3, capacity=2, load=str(tmp_path / "ckpt2"))
    fleet = standins.FakeSglangFleet(2, capacity=2, base_port=31810)
    ds = install_fleet_session(args, None, fleet, first_step=0).data_source
    SimulatedSlimeDriver(args, ds).run_async(0, 2)
    assert all(e.relabels == [] and "0" in e.loads for e in fleet.engines)


def test_eval_requests_are_spread_over_the_engines_holding_the_version():
    """slime's `eval_rollout` builds each request's URL from `args.sglang_router_ip/port`, one
    task per sample: each task is given the next engine holding the eval's version (the eval's
    own code sees the first), so the eval's requests do not all land on one engine."""
    from dora_ext.slime.rollout import _spread_args, _tracked

    bases = [SimpleNamespace(sglang_router_ip=f"10.0.0.{i}", sglang_router_port=30000 + i, other=i) for i in range(3)]
    seen: list = []

    async def one_dataset(args):  # slime's shape: a task per sample reads args when it runs
        async def one(j):
            await asyncio.sleep(0)
            return (j, args.sglang_router_ip, args.sglang_router_port, args.other)

        tasks = [asyncio.create_task(one(j)) for j in range(6)]
        return [await t for t in tasks]

    async def eval_rollout(args):  # slime's eval_rollout: the datasets under asyncio.gather
        seen.append(("eval", args.sglang_router_port))
        (out,) = await asyncio.gather(one_dataset(args))
        return out

    async def run():
        children: set = set()
        task = _tracked(asyncio.get_running_loop(), eval_rollout(_spread_args(bases, children)), children)
        return await task, children

    out, children = asyncio.run(run())
    assert [(ip, port) for _, ip, port, _ in out] == [(b.sglang_router_ip, b.sglang_router_port) for b in bases] * 2
    assert {o for *_, o in out} == {0} and seen == [("eval", 30000)]
    assert len(children) == 7  # the dataset's task and its samples'


def test_the_guarded_health_check_kills_an_engine_whose_actor_is_gone(monkeypatch):
    """slime's `_check_engine_health` turns any failure of a check (a dead actor too) into a
    kill. The guard reads the engine's URL first (`get_url`, a Ray call): a failure there must
    end the same way, not escape the check (it would end slime's monitor thread: no more checks
    for the rest of the job)."""
    health_monitor = pytest.importorskip("slime.utils.health_monitor", reason="needs a slime checkout (DORA_SLIME_PATH)")
    from dora_ext.slime.engines import guard_slime_health_monitor

    cls = health_monitor.RolloutHealthMonitor
    monkeypatch.setattr(cls, "_check_engine_health", cls._check_engine_health)  # restored after the test

    def gone(*a, **kw):
        raise RuntimeError("the actor died")  # ray.exceptions.RayActorError, or a GetTimeoutError

    actor = SimpleNamespace(get_url=SimpleNamespace(remote=gone), health_generate=SimpleNamespace(remote=gone),
                            shutdown=SimpleNamespace(remote=gone))
    monkeypatch.setattr(health_monitor, "ray", SimpleNamespace(get=lambda ref, timeout=None: ref, kill=lambda a: None))
    group = SimpleNamespace(all_engines=[actor], engines=[actor], nodes_per_engine=1)
    monitor = cls(group, SimpleNamespace(rollout_health_check_interval=1.0, rollout_health_check_timeout=1.0,
                                         rollout_health_check_first_wait=0.0))
    guard_slime_health_monitor()
    monitor._check_engine_health(0, actor)
    assert group.all_engines == [None]  # killed, as slime's own check does


@pytest.mark.parametrize("newest_held", [True, False])
def test_eval_takes_an_engine_holding_the_newest_version_and_its_wait_holds_no_load(
        tmp_path, standins, monkeypatch, newest_held):
    """Issue 22 point 4. Both engines run version-0 work (held per engine) as version 1 is
    published. `newest_held`: engine X was released, drained and loaded version 1 before the
    eval, which takes X without waiting. Otherwise no engine holds version 1: the eval waits,
    X is released only then, and the scheduler's load of version 1 onto X goes through during
    that wait. Either way the eval runs on X while Y's version-0 work is still held."""
    import contextlib

    from slime_helpers import check_train_eval_train, eval_fleet_session, install_eval_rollout, probe_eval

    args, fleet, ds, session = eval_fleet_session(tmp_path, standins, 31860, check_interval_s=600)
    x, y = fleet.engines

    def iid(engine):  # the session discovers its engines at the first rollout
        return next(i for i, url in session.engines.urls.items() if url == engine.url)

    gates = {x.port: asyncio.Event(), y.port: asyncio.Event()}
    loaded, probes, seen = threading.Event(), [], {}
    request = standins._request

    async def gated(engine, a, sample, params, inherited=False):
        if sample.prompt in ("p2", "p3"):  # rollout 1's groups, dispatched at version 0
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(gates[engine.port].wait(), standins.HOLD_TIMEOUT_S)
        return await request(engine, a, sample, params, inherited)

    def probe(name, value):
        probes.append((name, value))
        if name == "eval_waits":
            gates[x.port].set()
        if (name, value) == ("loaded", (iid(x), 1)):
            loaded.set()

    async def eval_rollout(eval_args, rollout_id):
        seen["at_start"] = {i: (inst.version, len(inst.running)) for i, inst in session.sched.instances.items()}
        return await probe_eval(standins, eval_args)

    def release(port):
        session.loop.call_soon_threadsafe(gates[port].set)

    monkeypatch.setattr(standins, "_request", gated)
    install_eval_rollout(monkeypatch, eval_rollout)
    session.probe = probe
    driver = SimulatedSlimeDriver(args, ds)
    try:
        driver.push_weights()
        outs = {0: driver.generate(0)}
        if newest_held:
            release(x.port)
        driver.push_weights()
        assert not newest_held or loaded.wait(30), probes
        before = len(probes)
        # session.evaluate, bounded: an eval that deadlocks with the load fails instead of hanging
        ev = asyncio.run_coroutine_threadsafe(session._evaluate(0), session.loop).result(timeout=60)
        release(y.port)
        for k in (1, 2):
            outs[k] = driver.generate(k)
            driver.push_weights()
    finally:
        release(x.port)
        release(y.port)
    at_start = seen["at_start"]
    assert at_start[iid(x)][0] == 1 and at_start[iid(y)] == (0, 2), seen  # Y: its version-0 work held
    assert ev.metrics["dora/eval_instance"] == iid(x)
    names = [n for n, _ in probes[before:]]
    if newest_held:
        assert "eval_waits" not in names
    else:
        assert names.index("eval_waits") < probes[before:].index(("loaded", (iid(x), 1)))
    check_train_eval_train(outs, ev, fleet)


@pytest.mark.parametrize("answer", ["after_timeout", "after_timeout_router_down", "before_timeout"])
def test_a_load_past_load_timeout_s_retires_the_engine(tmp_path, standins, caplog, answer):
    """The one engine's first disk load holds SGLang's writer lock (requests and `/health_generate`
    queue behind it). after_timeout: it answers only once the adapter gave up on it (0.2 s) and
    retired the engine; healthy again, the engine rejoins under a new id and loads version 1 again
    (what it holds is unknown: never relabelled). _router_down: slime's router does not answer
    from the load's start until the refresh its timeout asked for failed (a later one retires it;
    it was fatal). before_timeout: it answers after 0.3 s of a 30 s bound and nothing is retired.
    Either way every group trains once, from one version."""
    after = answer != "before_timeout"
    args = make_args(tmp_path, mode="dora", k=1, batch=3, n=2, num_rollout=4, capacity=2)
    args.dora_slime.update(engine_check_interval_s=0.05, load_timeout_s=0.2 if after else 30)
    fleet = standins.FakeSglangFleet(1, capacity=2, base_port=31800)
    session = install_fleet_session(args, None, fleet, first_step=0)
    probes, retired = record_probes(session, "engine_failed")
    slow, get, load, returned = fleet.engines[0], fleet.get, session._load, []
    slow.load_hold = {"1": (retired, 5.0) if after else (asyncio.Event(), 0.3)}

    async def router_down(url):
        if answer.endswith("router_down") and url.endswith("/workers") and slow.load_done and not returned:
            raise ConnectionError("slime's router does not answer")
        return await get(url)

    async def held_load_returns(a):
        try:
            await load(a)
        finally:
            returned.append(a) if (a.instance_id, a.version) == (0, 1) else None

    fleet.get, session._load = router_down, held_load_returns
    out = SimulatedSlimeDriver(args, session.data_source).run_async(0, 4)
    assert ([v for n, v in probes if n in ("engine_failed", "engine_joined")], slow.load_hold) == ([0, 1] if after else [], {})
    assert ("engine 0 is gone (http://127.0.0.1:31800 did not load version 1 within dora_slime.load_timeout_s = 0.2 s)"
            in caplog.text) == after
    loads = slow.loads[after:]  # after_timeout: the timed-out load ended on the engine; then version 1 again
    assert slow.relabels == ["0"] and loads[0] == "1" and loads == sorted(set(loads)), (slow.relabels, slow.loads)
    check_trained(out, 4 * 3)
    assert fleet.violations == []


def test_the_final_evaluation_waits_for_every_engine_loading_the_newest_version(tmp_path, standins, monkeypatch):
    """After the last step every engine loads the newest version; the evaluation started on the
    first one done, and all of slime's eval requests piled onto it while the others finished
    their load and stayed idle. Engine 1's load of that version is held until the eval waits for it."""
    from slime_helpers import eval_fleet_session, install_eval_rollout, probe_eval

    args, fleet, ds, session = eval_fleet_session(tmp_path, standins, 31850, check_interval_s=600)
    waits = asyncio.Event()  # the eval waits while engine 0 holds version 6: engine 1's load may answer
    session.probe = lambda name, value: name == "eval_waits" and session.sched.instances[0].version == 6 and waits.set()
    fleet.engines[1].load_hold = {"6": (waits, 5.0)}
    # 4 eval requests: more than one engine's capacity (3) unless they spread over both.
    install_eval_rollout(monkeypatch, lambda eval_args, rollout_id: probe_eval(standins, eval_args, n=4))
    SimulatedSlimeDriver(args, ds).run_async(0, 6)
    ev = generate_rollout(args, 5, ds, evaluation=True)
    assert (ev.metrics["dora/eval_version"], ev.metrics["dora/eval_engines"]) == (6, 2)
    assert [e.loads[-1] for e in fleet.engines] == ["6", "6"] and fleet.violations == []


@pytest.mark.parametrize("first", ["failure", "load"])
@pytest.mark.parametrize("failure", ["dies", "times_out", "times_out_router_down"])
def test_a_load_failing_before_the_final_evaluation_leaves_it_to_the_other_engines(
        tmp_path, standins, monkeypatch, failure, first):
    """After the last step both engines load the newest version (6) and the final evaluation waits
    for both. Engine Y's load fails: Y dies as it starts (dies), or it holds SGLang's writer lock
    past dora_slime.load_timeout_s (times_out; _router_down: slime's router does not answer the
    refresh the timeout asks for, so Y stays listed until a later refresh retires it). `first`:
    Y's failure is handled before X's load of version 6 starts, or only once X holds version 6.
    Either way Y is retired, the job goes on, and the evaluation runs on X alone, at version 6
    (Y, if alive, stays busy with its load until the evaluation started)."""
    from slime_helpers import eval_fleet_session, install_eval_rollout, probe_eval

    down = failure.endswith("router_down")
    args, fleet, ds, session = eval_fleet_session(tmp_path, standins, 31900, check_interval_s=0.05 if down else 600,
                                                  load_timeout_s=0.2 if failure != "dies" else 30)
    x, y = fleet.engines
    y_failed, x_loaded, eval_started = asyncio.Event(), asyncio.Event(), asyncio.Event()
    iids, probes, returned = {}, [], []
    if failure != "dies":
        y.load_hold = {"6": (eval_started, standins.HOLD_TIMEOUT_S)}

    def probe(name, value):
        probes.append((name, value))
        if (name, value) == ("engine_failed", iids.get(y.url)):
            y_failed.set()
        if (name, value) == ("loaded", (iids.get(x.url), 6)):
            x_loaded.set()
        if name == "eval_start":
            eval_started.set()

    load, get, session_load = session.engines.load, fleet.get, session._load

    async def ordered_load(iid, tag, path):  # the order of Y's failure and X's load of version 6
        url = session.engines.urls.get(iid)
        if tag == "6" and url not in iids:
            iids[url] = iid
            gate = {("failure", x.url): y_failed, ("load", y.url): x_loaded}.get((first, url))
            if gate is not None:
                await asyncio.wait_for(gate.wait(), 30)
            if url == y.url and failure == "dies":
                y.alive = False
        return await load(iid, tag, path)

    async def router(url):
        if down and url.endswith("/workers") and y.load_done is not None and not returned:
            raise ConnectionError("slime's router does not answer")
        return await get(url)

    async def returns(a):
        try:
            await session_load(a)
        finally:
            returned.append(a) if (a.instance_id, a.version) == (iids.get(y.url), 6) else None

    session.engines.load, fleet.get, session._load, session.probe = ordered_load, router, returns, probe
    install_eval_rollout(monkeypatch, lambda eval_args, rollout_id: probe_eval(standins, eval_args, n=2))
    SimulatedSlimeDriver(args, ds).run_async(0, 6)
    # session.evaluate, bounded: an eval that waits for a retirement that never comes fails instead of hanging
    ev = asyncio.run_coroutine_threadsafe(session._evaluate(5), session.loop).result(timeout=60)
    m = ev.metrics
    assert (m["dora/eval_version"], m["dora/eval_engines"], m["dora/eval_instance"]) == (6, 1, iids[x.url])
    assert m["dora/engines_retired"] == 1  # after the last step only the eval's metrics can report it
    assert [s.weight_versions for s in ev.data["probe"]["samples"]] == [["6"], ["6"]]
    failed, loaded = probes.index(("engine_failed", iids[y.url])), probes.index(("loaded", (iids[x.url], 6)))
    assert (failed < loaded) == (first == "failure"), probes
    assert fleet.violations == []


# ---------------------------------------------------------------- a load beside a request whose client hung up
def _records(tmp_path: Path, kind: str, engine: int = 0) -> list[dict]:
    import json

    path = tmp_path / f"engine{engine}.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind] if path.exists() else []


async def _until(cond, what: str, limit_s: float = 20.0) -> None:
    t = time.monotonic()
    while not cond():
        assert time.monotonic() - t < limit_s, f"never: {what}"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("order", ["load_first", "request_leaves_first", "request_arrives_after_the_wait"])
def test_a_load_after_a_cancelled_request_waits_until_the_engine_is_idle(tmp_path, monkeypatch, order):
    """A request the adapter cancelled (past `request_timeout_s`, or on an engine retired and
    back): SGLang lets go of the weight-update lock as soon as it sees the client gone (here
    within 0.05 s; SGLang: 4 s), but its scheduler drops the request only at the next decode step.
    A load that took the lock in between swapped the weights, then could not flush the cache and
    answered 400, which stopped the job. The stand-in server keeps such a request in its batch
    until released, to force each order: the load asked first waits (its `/flush_cache` refused)
    until the request leaves; asked after, it loads at once; and when the request is still there
    at the load itself (it came after the wait: here the first wait is skipped), the engine
    reports the new version after the 400, and the load is sent again once the engine is idle:
    only a 200 says every rank flushed its cache."""
    import httpx

    (engine,), (url,), router, _ = _fleet(tmp_path, 1, step_s=0.01, disconnect_check_s=0.05, hold_aborted=True)
    args = _args(tmp_path, router, 4)
    engines = SglangEngines(args, slime_settings(args))
    ckpt = tmp_path / "v1"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    if order == "request_arrives_after_the_wait":
        real, waits = SglangEngines._until_idle, []

        async def first_wait_skipped(self, url, deadline):
            waits.append(url)
            if len(waits) > 1:
                await real(self, url, deadline)

        monkeypatch.setattr(SglangEngines, "_until_idle", first_wait_skipped)

    async def run():
        await engines.discover()
        async with httpx.AsyncClient(timeout=None, trust_env=False) as client:
            req = asyncio.ensure_future(client.post(f"{url}/generate", json={
                "input_ids": [3, 4], "sampling_params": {"max_new_tokens": 10**7}}))
            await _until(lambda: engine.busy() == 1, "the request runs")
            req.cancel()
        await _until(lambda: _records(tmp_path, "disconnect"), "the engine sees the client gone")
        assert engine.busy() == 1 and engine.update_lock.readers == 0  # in the batch, the lock let go
        if order == "request_leaves_first":
            engine.release()
            await _until(lambda: engine.busy() == 0, "the request leaves")
        load = asyncio.ensure_future(engines.load(0, "1", str(ckpt)))
        if order == "load_first":
            await _until(lambda: len(_records(tmp_path, "flush_cache")) >= 2, "two refused flushes")
            assert not load.done() and not _records(tmp_path, "load") and engine.version == sglang_standin.LAUNCH_VERSION
        elif order == "request_arrives_after_the_wait":
            await _until(lambda: _records(tmp_path, "load"), "the load")
            await _until(lambda: len(_records(tmp_path, "flush_cache")) >= 1, "a refused flush after it")
            assert not load.done() and engine.version == "1"
        if order != "request_leaves_first":
            engine.release()
        await asyncio.wait_for(load, 20)

    asyncio.run(run())
    loads, flushes = _records(tmp_path, "load"), _records(tmp_path, "flush_cache")
    again = order == "request_arrives_after_the_wait"
    assert [(r["version"], r["flushed"]) for r in loads] == [("1", False)] * again + [("1", True)]
    assert engines._loaded_tags == {0: "1"} and engine.tokenizer_version == "1"
    assert flushes[-1]["flushed"] and not all(f["flushed"] for f in flushes[:-1]) == (order != "request_leaves_first")
    assert not _records(tmp_path, "violation")


def test_a_load_sglang_refuses_stops_the_job_with_its_message(tmp_path):
    """SGLang answers a load that fails with 400 and `{"success": false, "message": ...}` (the old
    weights stay): the error names the engine, the checkpoint and SGLang's reason."""
    from dora_ext.slime.engines import AdapterError

    _, (url,), router, _ = _fleet(tmp_path, 1)
    args = _args(tmp_path, router, 4)
    engines = SglangEngines(args, slime_settings(args))

    async def run():
        await engines.discover()
        await engines.load(0, "1", str(tmp_path / "missing"))

    with pytest.raises(AdapterError, match=rf"engine {url} failed to load .*missing: no checkpoint at .*missing"):
        asyncio.run(run())
    assert engines._loaded_tags == {}


def test_loads_in_flight_on_many_engines_leave_a_connection_for_the_probes(tmp_path):
    """A weight load holds its control connection for the whole load (minutes from a shared
    filesystem). With 70 engines loading at once (the control pool had 64 connections), the probe
    of an engine that is not loading must not wait for a connection until its bound retires it.
    71 stand-in servers in this process; their loads hold until released."""
    n = 71
    fleet, urls, router, _ = _fleet(tmp_path, n, load_s=60.0)
    args = _args(tmp_path, router, 4)
    engines = SglangEngines(args, slime_settings(args))
    engines.health_timeout_s = 10.0
    ckpt = tmp_path / "v1"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")

    async def run():
        await engines.discover()
        loads = [asyncio.ensure_future(engines.load(i, "1", str(ckpt))) for i, u in engines.urls.items() if u != urls[-1]]
        await _until(lambda: all(e.update_lock.writer for e in fleet[:n - 1]), "every load holds its engine")
        try:
            assert await engines.healthy(urls[-1])
        finally:
            for e in fleet:
                e.load_hold.set()
            await asyncio.wait_for(asyncio.gather(*loads), 30)

    asyncio.run(run())
    assert set(engines._loaded_tags.values()) == {"1"} and len(engines._loaded_tags) == n - 1


def test_slimes_loop_goes_on_when_a_request_past_request_timeout_s_lingers_at_a_load(tmp_path, standins, monkeypatch):
    """slime's loop (train_async order, 4 rollouts) on one engine: p0's second sample answers
    only after `request_timeout_s`, so the adapter cancels it and runs it again; the cancelled
    request stays in the engine's batch (held until the engine refused two `/flush_cache`s, which
    forces the next load to come while it is there). That load used to get SGLang's 400 (weights
    swapped, cache not flushed) and stop the job; now it waits for the engine to be idle, and
    every group trains once, from one version."""
    args = make_args(tmp_path, mode="dora", k=1, batch=3, n=2, num_rollout=4, capacity=4)
    args.dora_slime.update(request_timeout_s=0.3)
    fleet = standins.FakeSglangFleet(1, capacity=4, base_port=31950)
    session = install_fleet_session(args, None, fleet, first_step=0)
    engine, get = fleet.engines[0], fleet.get
    lingering = asyncio.Event()
    monkeypatch.setattr(standins, "ABORT_HOLD", lingering)
    held = []

    async def answers_late_once():
        if not held:
            held.append(True)
            await asyncio.Event().wait()  # cut by request_timeout_s

    standins.HOLD[("p0", 1)] = SimpleNamespace(wait=answers_late_once)

    async def flush_then_let_it_go(url):
        try:
            return await get(url)
        finally:
            if url.endswith("/flush_cache") and engine.flushes.count(False) >= 2:
                lingering.set()

    fleet.get = flush_then_let_it_go
    try:
        out = SimulatedSlimeDriver(args, session.data_source).run_async(0, 4)
    finally:
        standins.HOLD.clear()
    assert held and engine.flushes.count(False) >= 2 and engine.flushes[-1]
    check_trained(out, 4 * 3)
    assert fleet.violations == []


@pytest.mark.parametrize("answer", ["busy", "server_error", "read_error"])
def test_a_load_goes_ahead_when_the_engine_never_looks_idle(tmp_path, standins, monkeypatch, answer):
    """Traffic that never pauses (another client of the engine through slime's router): SGLang's
    `/flush_cache` refuses every time (400), or fails otherwise (a 503, a connection dropped
    part-way). The load waits `IDLE_WAIT_S` (here 0.2 s), then goes ahead: its writer lock holds new
    requests back, so it flushes; the engine is neither retired nor the job stopped."""
    from dora_ext.slime import engines as adapter

    monkeypatch.setattr(adapter, "IDLE_WAIT_S", 0.2)
    monkeypatch.setattr(adapter, "FLUSH_RETRY_S", 0.05)
    fleet, engines = fleet_engines(standins, tmp_path, 32700)
    get, refused = fleet.get, []

    async def always_busy(url):
        if url.endswith("/flush_cache"):
            refused.append(url)
            if answer == "read_error":
                raise RuntimeError("injected: the connection dropped part-way")
            raise standins.http_error("GET", url, 400 if answer == "busy" else 503, text="not flushed")
        return await get(url)

    async def run():
        await engines.discover()
        fleet.get = always_busy
        await asyncio.wait_for(engines.load(0, "1", str(tmp_path / "w")), 10)

    asyncio.run(run())
    assert len(refused) >= 2 and fleet.engines[0].loads == ["1"] and engines._loaded_tags == {0: "1"}
    assert engines._retiring == {} and fleet.violations == []


def test_a_refused_load_with_no_version_after_it_retires_the_engine(tmp_path, standins, monkeypatch):
    """A load answered 400 while a cancelled request lingers (the weights swapped), and then the
    engine gives no weight version (`/server_info`'s `internal_states` empty, as SGLang 0.5.15
    with slime's patch answers a slow scheduler): what it holds is unknown. It used to stop the
    job; now the engine is retired (it may rejoin, then loads from disk)."""
    from dora_ext.slime import engines as adapter
    from dora_ext.slime.engines import EngineGone

    monkeypatch.setattr(adapter, "IDLE_WAIT_S", 0.2)
    monkeypatch.setattr(adapter, "FLUSH_RETRY_S", 0.05)
    fleet, engines = fleet_engines(standins, tmp_path, 32800)
    e0 = fleet.engines[0]

    async def run():
        monkeypatch.setattr(standins, "ABORT_HOLD", asyncio.Event())
        await engines.discover()
        standins._linger(e0)  # a cancelled request left in the batch (held: the test ends first)
        e0.empty_states = True
        with pytest.raises(EngineGone, match="answered the load of version 1 with an error .*then gave no weight version"):
            await engines.load(0, "1", str(tmp_path / "w"))
        standins.ABORT_HOLD.set()
        gone, _ = await engines.refresh()
        return gone

    assert asyncio.run(run()) == [0]
    assert e0.version == "1" and e0.url in engines._unknown_weights and fleet.violations == []


def test_a_load_sglang_keeps_refusing_with_the_new_version_in_place_stops_after_a_few_tries(
        tmp_path, standins, monkeypatch):
    """SGLang answers 400 and reports the version asked for (an engine that already held it and
    refuses the checkpoint reads the same as one whose cache could not be flushed): the load is
    tried `LOAD_TRIES` times, then the job stops with SGLang's message (it used to be tried until
    `load_timeout_s`, then the engine retired with the message lost, and again once it rejoined)."""
    from dora_ext.slime import engines as adapter
    from dora_ext.slime.engines import AdapterError

    monkeypatch.setattr(adapter, "FLUSH_RETRY_S", 0.01)
    fleet, engines = fleet_engines(standins, tmp_path, 32900)
    post, e0, tries = fleet.post, fleet.engines[0], []

    async def refuses(url, payload):
        if url.endswith("/update_weights_from_disk"):
            tries.append(payload["weight_version"])
            e0.version = payload["weight_version"]
            raise standins.http_error("POST", url, 400, json={"success": False, "message": "injected: bad shard"})
        return await post(url, payload)

    async def run():
        await engines.discover()
        fleet.post = refuses
        await engines.load(0, "1", str(tmp_path / "w"))

    with pytest.raises(AdapterError, match=r"failed to load .*: injected: bad shard \(3 tries\)"):
        asyncio.run(run())
    assert tries == ["1"] * adapter.LOAD_TRIES and engines._loaded_tags == {}


def test_a_load_that_fails_part_way_leaves_the_engines_weights_unknown(tmp_path, standins):
    """The load's connection drops after SGLang swapped the weights (not a timeout, not a 400):
    the error goes to the caller as before, and what the engine holds is unknown, so if the
    engine is retired and rejoins it loads the launch version from disk, never a relabel."""
    fleet, engines = fleet_engines(standins, tmp_path, 33000)
    engines.launch_tag = "0"
    post, e0 = fleet.post, fleet.engines[0]

    async def drops(url, payload):
        if url.endswith("/update_weights_from_disk"):
            e0.version = payload["weight_version"]
            raise RuntimeError("injected: the connection dropped after the swap")
        return await post(url, payload)

    async def run():
        await engines.discover()
        fleet.post = drops
        with pytest.raises(RuntimeError, match="dropped after the swap"):
            await engines.load(0, "2", str(tmp_path / "w"))
        fleet.post = post
        e0.alive = False  # then the probe fails: retired
        gone, _ = await engines.refresh()
        e0.alive = True
        _, new = await engines.refresh()
        await engines.load(new[0][0], "0", str(tmp_path / "w"))
        return gone

    assert asyncio.run(run()) == [0]
    assert (e0.relabels, e0.loads) == ([], ["0"])
