"""The rollout instances, as slime runs them: SGLang engines behind slime's router.

Trajectories are pinned to one instance (R1), so requests go to an engine directly: slime's own
`generate_and_rm` with `args_i`, a copy of `args` whose router address is that engine's. Its
semaphore (`--sglang-server-concurrency` x engines, the size of slime's HTTP pool, so it binds no
sooner than the pool would), dp-rank context, spans, hooks and reward models apply. Weights load
with SGLang's `/update_weights_from_disk`, tagged with the version (`Sample.weight_versions`),
once `/flush_cache` says the engine's scheduler is idle (`_load_from_disk`).

Everything that is not generation goes through `ControlHttp` (own pool, bounded calls) so it never
queues behind slime's HTTP client; generate requests are bounded by `request_timeout_s`.

`refresh()` re-reads slime's router and probes every engine with `/health_generate` (all answers in
before anything changes): a dead or stuck engine leaves, one slime's fault tolerance restarted joins
as a new instance. Loading engines are not probed, nor by slime's monitor (`guard_slime_health_monitor`).
slime restarts an engine at the same address (`ServerGroup.start_engines`, `get_free_port`), so a
restart is told by a new router worker id or by the engine reporting a version other than the one
loaded (`reported_version`); it retires the instance (`InstanceFailed`) and joins under a new id.

`/health` is not asked: slime launches SGLang with `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false`,
so it answers 200 without touching the scheduler; `/health_generate` answers once any output is made.
Why not slime's own liveness code: `RolloutHealthMonitor` runs only with `--use-fault-tolerance`
and answers a failed check by killing the engine's actor without saying which requests to move, and
`ServerGroup.recover` restarts engines only before slime's own reload of every engine, which the
patch replaces. The adapter needs, per engine, "gone or not" to send its trajectories back to their
version, so it probes itself and lets slime's monitor and restarts act beside it.

`SglangEngines` takes its HTTP client and `generate_and_rm` as arguments (stand-ins in tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import itertools
import threading
import time
from typing import Any, Awaitable, Callable, Protocol
from urllib.parse import urlsplit

from .settings import SlimeSettings


class AdapterError(RuntimeError):
    """Something the adapter cannot recover from; raised to slime from the rollout function."""


class EngineGone(RuntimeError):
    """The engine an action was meant for has left (died, or slime's fault tolerance replaced it)."""


class Engines(Protocol):
    """What the rollout worker needs from a fleet of engines."""

    async def discover(self) -> list[int]:
        """Capacities of the instances, in instance-id order."""

    async def generate(self, instance_id: int, sample: Any, sampling_params: dict) -> Any:
        """Generate (and reward) one trajectory on that instance; returns the Sample (or a list)."""

    async def load(self, instance_id: int, version_tag: str, path: str | None) -> None:
        """Load the checkpoint at `path` on an idle instance, reporting `version_tag` from now on."""

    async def refresh(self) -> tuple[list[int], list[tuple[int, int]]]:
        """(instances that died or left, new instances as (id, capacity)) since the last call."""


GenerateAndRm = Callable[..., Awaitable[Any]]


def slime_generate_and_rm() -> GenerateAndRm:
    """slime's `generate_and_rm`, or (slime absent) the custom-generate call alone: without slime
    there is no reward hub and no default SGLang client, so `args.custom_generate_function_path`
    must produce the sample with its reward filled, as slime's contract allows."""
    try:
        from slime.rollout.sglang_rollout import generate_and_rm
    except ImportError:
        return _custom_generate_only
    return generate_and_rm


async def _custom_generate_only(args: Any, sample: Any, sampling_params: dict, evaluation: bool = False) -> Any:
    path = getattr(args, "custom_generate_function_path", None)
    if not path:
        raise AdapterError("slime is not importable and no custom_generate_function_path is set: nothing can generate")
    fn = load_object(path)
    out = await fn(args, sample, sampling_params)
    for s in out if isinstance(out, list) else [out]:
        if s.reward is None and not getattr(args, "group_rm", False):
            raise AdapterError(f"{path} returned sample {s.index} without a reward, and slime's reward hub is absent")
    return out


def load_object(path: str) -> Any:
    """`module.attr` -> the object (slime's `load_function` semantics, without requiring slime)."""
    module, _, attr = path.rpartition(".")
    if not module:
        raise AdapterError(f"expected a dotted path module.name, got {path!r}")
    return getattr(importlib.import_module(module), attr)


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status an HTTP client's error carries (httpx's `HTTPStatusError`, which slime's
    `http_utils.get` raises through `raise_for_status`), None for any other failure."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return status if isinstance(status, int) else None


def _http_message(exc: BaseException) -> str:
    """What the engine said with an error status (SGLang: `{"success": false, "message": ...}`)."""
    response = getattr(exc, "response", None)
    try:
        body = response.json()
    except Exception:  # noqa: BLE001 - not JSON: its text
        return str(getattr(response, "text", exc))[:500]
    return str(body.get("message", body) if isinstance(body, dict) else body)[:500]


def slime_http() -> Any:
    """slime's async HTTP helpers (`get(url)`, `post(url, payload)`), as a namespace."""
    from slime.utils import http_utils

    return http_utils


class ControlHttp:
    """The adapter's own HTTP client for everything but generation: a pool of its own, so that
    control calls never wait for one of the `--sglang-server-concurrency` x engines connections
    slime's generation holds. Callers bound each call (`asyncio.wait_for`).

    The pool has no cap: a weight load holds its connection for the whole load (minutes from a
    shared filesystem), and a capped pool full of loads would make every probe of the other
    engines wait for a connection until its bound retires a healthy engine. Idle connections are
    dropped after 2 s, before uvicorn closes them (SGLang: 5 s), so none is reused as it closes.
    A reply that is not JSON (SGLang's `/flush_cache` answers text) comes back as `{"text": ...}`."""

    def __init__(self) -> None:
        self._client: Any = None

    def _http(self) -> Any:
        if self._client is None:  # created on the worker's loop, where it is used
            import httpx

            self._client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, keepalive_expiry=2.0),
                                             timeout=httpx.Timeout(None), trust_env=False)
        return self._client

    @staticmethod
    def _body(r: Any) -> Any:
        if not r.content:
            return {}
        try:
            return r.json()
        except ValueError:
            return {"text": r.text}

    async def get(self, url: str) -> Any:
        r = await self._http().get(url)
        r.raise_for_status()
        return self._body(r)

    async def post(self, url: str, payload: dict) -> Any:
        r = await self._http().post(url, json=payload)
        r.raise_for_status()
        return self._body(r)


#: How often a load asks an engine whether its scheduler is idle (`_until_idle`; slime: 1 s), and
#: for how long before it loads anyway (`_load_from_disk`): SGLang sees a client gone within 4 s.
FLUSH_RETRY_S = 0.5
IDLE_WAIT_S = 10.0
#: Tries of one load that SGLang answers 400 with the new version in place (`_load_from_disk`).
LOAD_TRIES = 3


class _NoVerdict(Exception):
    """SGLang refused a load (this message) and then reported no weight version."""


class _LoadTimeout(Exception):
    """A load did not end within `load_timeout_s` (the message: what SGLang last said, if anything)."""


def _connection_refused(exc: BaseException) -> bool:
    """Could the client not connect at all (the engine's process is gone)?"""
    if isinstance(exc, ConnectionError):
        return True
    try:
        import httpx
    except ImportError:  # pragma: no cover - slime depends on httpx
        return False
    return isinstance(exc, httpx.ConnectError)


#: Engines dora-ext loads weights onto, and engines slime's health monitor is checking (URL ->
#: checks in flight), shared with the monitor's thread under `_MONITOR_LOCK`: a load waits for a
#: check that started before it (that check's `/health_generate` would wait behind the load).
LOADING_URLS: set[str] = set()
CHECKING_URLS: dict[str, int] = {}
_MONITOR_LOCK = threading.Lock()


def guard_slime_health_monitor() -> None:
    """Make slime's `RolloutHealthMonitor` (`--use-fault-tolerance`) skip the engines dora-ext is
    loading, and only those. Its public API pauses a whole server group (`pause()`/`resume()`,
    what slime does around its own reloads of every engine); here one engine loads while the
    others generate, so the per-engine check (`_check_engine_health`) is wrapped instead: a
    `/health_generate` waits behind SGLang's writer lock for the whole load, and a load longer
    than `--rollout-health-check-timeout` would get a healthy engine killed. Idempotent; the
    monitor runs in slime's RolloutManager process, as the rollout worker does."""
    from slime.utils import health_monitor

    cls = health_monitor.RolloutHealthMonitor
    check = getattr(cls, "_check_engine_health", None)
    if check is None:
        raise AdapterError("slime's RolloutHealthMonitor has no _check_engine_health: dora-ext cannot keep it "
                           "from killing engines that load weights; run without --use-fault-tolerance")
    if getattr(check, "dora_guard", False):
        return
    urls: dict[Any, str] = {}

    def guarded(self: Any, rollout_engine_id: int, engine: Any) -> None:
        if engine is None:
            return check(self, rollout_engine_id, engine)
        key = getattr(engine, "_actor_id", None) or id(engine)
        if key not in urls:
            try:
                urls[key] = str(health_monitor.ray.get(engine.get_url.remote(), timeout=30)).rstrip("/")
            except Exception:  # noqa: BLE001 - a dead actor: slime's own check kills it
                return check(self, rollout_engine_id, engine)
        url = urls[key]
        with _MONITOR_LOCK:
            if url in LOADING_URLS:
                health_monitor.logger.info("dora: engine %s loads weights; health check skipped", url)
                return None
            CHECKING_URLS[url] = CHECKING_URLS.get(url, 0) + 1
        try:
            return check(self, rollout_engine_id, engine)
        finally:
            with _MONITOR_LOCK:
                CHECKING_URLS[url] -= 1
                if not CHECKING_URLS[url]:
                    del CHECKING_URLS[url]

    guarded.dora_guard = True
    cls._check_engine_health = guarded


class SglangEngines:
    """slime's SGLang engines, addressed one by one.

    `http` (generation: slime's client) and `control` (everything else: `ControlHttp` by default)
    must offer `async get(url) -> dict` and `async post(url, payload) -> dict`.
    """

    def __init__(
        self,
        args: Any,
        settings: SlimeSettings,
        *,
        http: Any = None,
        control: Any = None,
        generate_and_rm: GenerateAndRm | None = None,
    ) -> None:
        self.args = args
        self.settings = settings
        self.control = control if control is not None else ControlHttp()
        self.http = http if http is not None else slime_http()
        self._generate_and_rm = generate_and_rm if generate_and_rm is not None else slime_generate_and_rm()
        self.urls: dict[int, str] = {}
        self._args: dict[int, Any] = {}
        # Evidence of which incarnation of the engine at `urls[i]` instance i is: the router's
        # ids for its registration (empty where the router gives none; more than one only if a
        # router lists the URL twice) and the weight version the adapter last loaded onto it
        # (absent before the first load: the launch weights).
        self._worker_ids: dict[int, frozenset[str]] = {}
        self._loaded_tags: dict[int, str] = {}
        #: Why each instance of the last refresh's `gone` left (for the worker's log and events).
        self.reasons: dict[int, str] = {}
        self._cap = 0
        self._next_id = 0
        self.health_timeout_s = settings.probe_timeout_s  # /health_generate, /server_info, /model_info
        self.router_timeout_s = 30.0  # a refresh's read of slime's router
        self.probe_s: list[float] = []  # the last 1000 probes' durations
        #: The version tag of the weights engines were launched with (set by the session when
        #: version 0 is the launch checkpoint: a fresh run): an engine that never loaded
        #: anything is only told its version tag, not reloaded from disk.
        self.launch_tag: str | None = None
        if getattr(args, "use_fault_tolerance", False):
            guard_slime_health_monitor()
        # Instances with /update_weights_from_disk in flight: the probe would wait behind
        # SGLang's writer lock for the whole load, so they are not asked (nor by slime's health
        # monitor: LOADING_URLS). A load that fails sends the worker to refresh() again.
        self._loading: set[int] = set()
        self._loads_started: dict[int, int] = {}  # a load that starts during a health check voids it
        self._load_watch: dict[int, set[asyncio.Event]] = {}  # checks that stop waiting when a load starts
        # Loads past `load_timeout_s` or refused with no version after (iid -> reason: the next
        # refresh retires it); URLs whose weights are unknown until a load succeeds (never
        # relabelled as the launch weights).
        self._retiring: dict[int, str] = {}
        self._unknown_weights: set[str] = set()

    async def _listed(self) -> dict[str, frozenset[str]]:
        """The regular workers slime's router lists: URL -> the router's ids for its registration
        (one with sglang-router, which refuses a second registration of a URL; every one listed
        is kept, so that the order a router lists them in is never read as a change)."""
        router = f"http://{self.args.sglang_router_ip}:{self.args.sglang_router_port}"
        reply = await self.control.get(f"{router}/workers")
        listed: dict[str, set[str]] = {}
        for w in reply.get("workers", []):
            if w.get("worker_type", "regular") == "regular":
                wid = w.get("id")
                ids = listed.setdefault(w["url"].rstrip("/"), set())
                if wid is not None:
                    ids.add(str(wid))
        return {url: frozenset(ids) for url, ids in sorted(listed.items())}

    def _add(self, url: str, worker_ids: frozenset[str]) -> int:
        iid = self._next_id
        self._next_id += 1
        self.urls[iid] = url
        self._args[iid] = self._args_for(url)
        self._worker_ids[iid] = worker_ids
        return iid

    def _drop(self, iid: int) -> None:
        del self.urls[iid]
        del self._args[iid]
        self._worker_ids.pop(iid, None)
        self._loaded_tags.pop(iid, None)
        self._retiring.pop(iid, None)

    async def discover(self) -> list[int]:
        listed = await self._listed()
        if not listed:
            raise AdapterError(
                f"slime's router at {self.args.sglang_router_ip}:{self.args.sglang_router_port} lists no regular SGLang worker"
            )
        cap = self.settings.capacity or getattr(self.args, "sglang_server_concurrency", None)
        if not isinstance(cap, int) or cap < 1:
            raise AdapterError(f"no engine capacity: set dora_slime.capacity (got sglang_server_concurrency={cap!r})")
        self._cap = cap
        for url, worker_ids in listed.items():
            self._add(url, worker_ids)
        return [cap] * len(listed)

    async def healthy(self, url: str) -> bool:
        """Does the engine generate? SGLang's `/health_generate` (see the module docstring)."""
        t = time.monotonic()
        try:
            await asyncio.wait_for(self.control.get(f"{url}/health_generate"), self.health_timeout_s)
        except Exception:  # noqa: BLE001 - unreachable, refused, timed out or an error status: not healthy
            return False
        finally:
            self.probe_s.append(time.monotonic() - t)
            del self.probe_s[:-1000]
        return True

    async def reported_version(self, url: str, expected: str | None = None) -> str | None:
        """The weight version the engine's scheduler holds, None where the engine gives no verdict.

        `/server_info`'s `internal_states` first (`/model_info` can be a stale tokenizer worker's copy),
        `/model_info` only with one tokenizer worker or no `/server_info` (404); other failures give
        no verdict. `expected` on top of `/server_info` also means the engine holds it.
        """
        try:
            info = await asyncio.wait_for(self.control.get(f"{url}/server_info"), self.health_timeout_s)
        except Exception as exc:  # noqa: BLE001 - only an SGLang without /server_info leaves /model_info to tell
            if _http_status(exc) != 404:
                return None
            info = None
        if isinstance(info, dict):
            states = info.get("internal_states")
            if states == []:
                return None  # slime's SGLang 0.5.15 patch: the scheduler did not answer in 2 s
            versions = {str(st["weight_version"]) for st in states or []
                        if isinstance(st, dict) and st.get("weight_version") is not None}
            top = info.get("weight_version")
            if expected is not None and top is not None and str(top) == expected and expected not in versions:
                return expected  # the scheduler's copy is the launch one (see above)
            if len(versions) == 1:
                return versions.pop()
            if len(versions) > 1:
                return None  # ranks disagree (an update landing now): no verdict from this
            workers = info.get("tokenizer_worker_num")
            if isinstance(workers, int) and workers > 1:
                return None  # /model_info would answer for one tokenizer worker: no verdict
        try:
            reply = await asyncio.wait_for(self.control.get(f"{url}/model_info"), self.health_timeout_s)
        except Exception:  # noqa: BLE001 - no verdict from this; /health decides whether it is alive
            return None
        version = reply.get("weight_version") if isinstance(reply, dict) else None
        return None if version is None else str(version)

    async def _verdict(self, iid: int, url: str, started: int | None = None) -> str | None:
        """Why instance `iid` at `url` should leave (fails /health, or holds another version), or None.
        `started`: the loads started on it when it was picked; once another starts, nothing more
        is asked (it would wait behind the load)."""
        if not await self.healthy(url):
            return "the engine does not generate (/health_generate failed or timed out)"
        if started is not None and self._load_began(iid, started):
            return None
        expected = self._loaded_tags.get(iid)
        if expected is None:
            return None
        reported = await self.reported_version(url, expected)
        if reported is not None and reported != expected:
            return (f"{url} reports weight version {reported!r}, the adapter loaded {expected!r}: "
                    "the engine was restarted")
        return None

    def _load_began(self, iid: int, started: int) -> bool:
        """Is a load of `iid` running, or has one started since `started` loads had (when it was
        picked for a check)? Then what that check asks is voided: it waits behind the load."""
        return iid in self._loading or self._loads_started.get(iid, 0) != started

    async def _verdict_until_load(self, iid: int, url: str, started: int) -> str | None:
        """`_verdict`, abandoned (None) as soon as a load starts on the engine (`started`: the loads
        started when it was picked), or not begun if one started since: its answer would be
        voided anyway (`refresh`), and SGLang answers it only after the load (the writer lock), so
        a pass that waited for it would hold every caller of refresh for the whole load."""
        if self._load_began(iid, started):
            return None
        began = asyncio.Event()
        watchers = self._load_watch.setdefault(iid, set())
        watchers.add(began)
        check = asyncio.ensure_future(self._verdict(iid, url, started))
        stop = asyncio.ensure_future(began.wait())
        try:
            await asyncio.wait((check, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not check.done():
                check.cancel()  # may still finish (a cancel lost in wait_for): its outcome is dropped
                check.add_done_callback(lambda t: t.cancelled() or t.exception())
            watchers.discard(began)
            if not watchers and self._load_watch.get(iid) is watchers:
                del self._load_watch[iid]
        return check.result() if check.done() and not check.cancelled() else None

    async def refresh(self) -> tuple[list[int], list[tuple[int, int]]]:
        """Every question is asked first (the engines concurrently), then the answers are applied
        with no await in between: a refresh that raises or is cancelled part-way (its router read,
        an engine's check) changes nothing, and the next one sees everything again. Every await
        is bounded (slime's HTTP client has no timeout of its own): the router read by
        `router_timeout_s`, so a router that never answers fails the refresh (the caller tries
        again later) instead of holding every caller that waits for it."""
        listed = await asyncio.wait_for(self._listed(), self.router_timeout_s)
        reasons: dict[int, str] = {}
        checked: dict[int, tuple[str, int]] = {}  # iid -> (url, loads started when asked)
        for iid, url in sorted(self.urls.items()):
            known_ids = self._worker_ids.get(iid)
            if url not in listed:
                reasons[iid] = "the engine left slime's router"
            elif iid in self._retiring:
                reasons[iid] = self._retiring[iid]
            elif known_ids and listed[url] and not known_ids & listed[url]:
                # A new registration at the same address: slime deleted the old one and the
                # restarted engine registered again. Whatever it holds, it is not what we loaded.
                reasons[iid] = (f"slime's router lists {url} under a new registration "
                                f"({', '.join(sorted(listed[url]))}, was {', '.join(sorted(known_ids))}): "
                                "the engine was restarted")
            elif iid not in self._loading:
                checked[iid] = (url, self._loads_started.get(iid, 0))
        # One probe pass over the engines, concurrently (each check is bounded by health_timeout_s).
        verdicts = await asyncio.gather(*(self._verdict_until_load(iid, url, started)
                                          for iid, (url, started) in checked.items()))
        for (iid, (url, started)), reason in zip(checked.items(), verdicts):
            if self._load_began(iid, started):
                continue  # a load started while it was asked: no verdict from this check
            if reason is not None:
                reasons[iid] = reason
        # A load that timed out (or gave no version) holds its engine still: it rejoins on a later pass, not probed now.
        staying = {url for iid, url in self.urls.items() if iid not in reasons or iid in self._retiring}
        candidates = [url for url in listed if url not in staying]
        alive = await asyncio.gather(*(self.healthy(url) for url in candidates))
        # Apply (no await from here on).
        gone = []
        for iid in sorted(reasons):
            url = self.urls.get(iid)
            if url is not None:
                if self._loaded_tags.get(iid, self.launch_tag) != self.launch_tag:
                    # If it comes back (a probe that failed once, not a restart), it holds what was
                    # loaded onto it, not the launch weights: never relabel it, load it from disk (a
                    # load in flight marked it already, `load`).
                    self._unknown_weights.add(url)
                self._drop(iid)
                gone.append(iid)
        self.reasons = {iid: reasons[iid] for iid in gone}
        known = set(self.urls.values())
        new = []
        for url, ok in zip(candidates, alive):
            if ok and url not in known:
                new.append((self._add(url, listed[url]), self._cap))
        return gone, new

    def args_for_instance(self, instance_id: int) -> Any:
        """slime's args aimed at one engine (what slime's own generate and eval read)."""
        return self._args[instance_id]

    def _args_for(self, url: str) -> Any:
        # generate() builds its URL from args.sglang_router_ip/port: point them at one engine.
        parts = urlsplit(url)
        host = parts.hostname or ""
        a = copy.copy(self.args)
        a.sglang_router_ip = f"[{host}]" if ":" in host else host
        a.sglang_router_port = parts.port
        return a

    async def generate(self, instance_id: int, sample: Any, sampling_params: dict) -> Any:
        args = self._args.get(instance_id)
        if args is None:
            raise EngineGone(f"instance {instance_id} left")
        return await asyncio.wait_for(self._generate_and_rm(args, sample, sampling_params, evaluation=False),
                                      self.settings.request_timeout_s)

    async def _relabel(self, instance_id: int, url: str, version_tag: str) -> bool:
        """Tag an engine that holds the launch weights as `version_tag` (SGLang's
        `/update_weight_version`, no load); False where the engine does not take it or does not
        report the tag afterwards (then the caller loads from disk)."""
        try:
            await asyncio.wait_for(self.control.post(f"{url}/update_weight_version",
                                                     {"new_version": version_tag, "abort_all_requests": False}),
                                   self.health_timeout_s)
        except Exception:  # noqa: BLE001 - an SGLang without it, or a failure: load from disk
            return False
        if await self.reported_version(url, version_tag) not in (version_tag, None):
            return False
        self._loaded_tags[instance_id] = version_tag
        return True

    async def load(self, instance_id: int, version_tag: str, path: str | None) -> None:
        url = self.urls.get(instance_id)
        if url is None:
            raise EngineGone(f"instance {instance_id} left")
        if (version_tag == self.launch_tag and instance_id not in self._loaded_tags
                and url not in self._unknown_weights and await self._relabel(instance_id, url, version_tag)):
            return
        self._loading.add(instance_id)
        with _MONITOR_LOCK:
            LOADING_URLS.add(url)
        self._loads_started[instance_id] = self._loads_started.get(instance_id, 0) + 1
        for began in self._load_watch.pop(instance_id, ()):
            began.set()
        try:
            while url in CHECKING_URLS:  # slime's monitor checks it now: let that check finish first
                await asyncio.sleep(0.05)
            # Unknown until the load succeeds, whatever ends it (a failure part-way, a cancel): an
            # instance retired meanwhile that rejoins is loaded from disk, never relabelled.
            self._unknown_weights.add(url)
            retire = None
            try:
                reply = await self._load_from_disk(url, version_tag, path)
            except _LoadTimeout as exc:
                retire = (f"{url} did not load version {version_tag} within "
                          f"dora_slime.load_timeout_s = {self.settings.load_timeout_s:g} s{exc}")
            except _NoVerdict as exc:
                retire = (f"{url} answered the load of version {version_tag} with an error ({exc}) and then "
                          "gave no weight version")
            if retire is not None:  # retired at the next refresh (it may rejoin)
                if self.urls.get(instance_id) == url:
                    self._retiring[instance_id] = retire
                raise EngineGone(retire)
        finally:
            self._loading.discard(instance_id)
            with _MONITOR_LOCK:
                LOADING_URLS.discard(url)
        if isinstance(reply, dict) and reply.get("success") is False:
            raise AdapterError(f"engine {url} failed to load {path}: {reply.get('message')}")
        if self.urls.get(instance_id) == url:  # (retired meanwhile: what its URL holds stays unknown)
            self._unknown_weights.discard(url)
            self._loaded_tags[instance_id] = version_tag

    async def _load_from_disk(self, url: str, version_tag: str, path: str | None) -> Any:
        """`/update_weights_from_disk` until SGLang answers 200, within `load_timeout_s`.

        SGLang swaps the weights, then flushes the cache, which each data-parallel rank refuses
        while a request is in its batch (then the load answers 400, the weights swapped). Ours have
        ended when the scheduler sends a load (R4), but one the adapter cancelled (past
        `request_timeout_s`, on an engine retired and back) stays in the batch until SGLang sees its
        client gone (up to 4 s) and one decode step more, having let go of the weight-update lock
        the load takes. So each try first waits up to `IDLE_WAIT_S` for `/flush_cache` to answer
        200 (the scheduler idle, as slime waits before its own loads), then loads anyway: the
        load's writer lock holds back new requests, and traffic that never pauses would otherwise
        keep the engine from ever looking idle. A 400 with the new version in place is tried
        again, at most `LOAD_TRIES` times in all (only a 200 says every rank flushed;
        `/flush_cache` answers for one); a 400 without it, or one that persists, is SGLang refusing
        the checkpoint (`AdapterError`, with its message); no version at all, `_NoVerdict`;
        `load_timeout_s` passed, `_LoadTimeout` (with SGLang's last message, if any)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.load_timeout_s
        message = None
        for tries in itertools.count(1):
            with contextlib.suppress(asyncio.TimeoutError):
                await self._until_idle(url, min(deadline, loop.time() + IDLE_WAIT_S))
            try:
                return await asyncio.wait_for(self.control.post(f"{url}/update_weights_from_disk", {
                    "model_path": path, "weight_version": version_tag}), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise _LoadTimeout(f" (SGLang's last answer: {message})" if message else "") from None
            except Exception as exc:
                if _http_status(exc) != 400:
                    raise
                message = _http_message(exc)
            reported = await self.reported_version(url)
            if reported is None:
                raise _NoVerdict(message)
            if reported != version_tag or tries == LOAD_TRIES:
                raise AdapterError(f"engine {url} failed to load {path}: {message}"
                                   + (f" ({tries} tries)" if tries > 1 else ""))
            await asyncio.sleep(FLUSH_RETRY_S)

    async def _until_idle(self, url: str, deadline: float) -> None:
        """Return once the engine's `/flush_cache` answers 200 (its scheduler runs and queues
        nothing, and the cache is flushed: free, a load flushes it anyway); TimeoutError at
        `deadline` (the loop's clock)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                await asyncio.wait_for(self.control.get(f"{url}/flush_cache"), max(0.0, deadline - loop.time()))
                return
            except asyncio.TimeoutError:
                raise
            except Exception as exc:  # noqa: BLE001 - busy (400), or a transient error: ask again
                if _connection_refused(exc):
                    raise  # the engine is gone: the caller's refresh retires it
            if loop.time() + FLUSH_RETRY_S >= deadline:
                raise asyncio.TimeoutError
            await asyncio.sleep(FLUSH_RETRY_S)


class PassThroughEngines:
    """No engines at all: slime's contract harness calls the rollout function with `args=None`.

    The harness's data source hands out samples that are already generated and rewarded; this
    "engine" returns them unchanged and refuses any sample that still needs generating, so the
    scheduler, batching and output shapes are exercised without pretending to generate.
    """

    def __init__(self, capacities: list[int]) -> None:
        self.capacities = capacities

    async def discover(self) -> list[int]:
        return list(self.capacities)

    async def generate(self, instance_id: int, sample: Any, sampling_params: dict) -> Any:
        status = getattr(sample.status, "value", sample.status)
        if status not in ("completed", "truncated") or sample.reward is None:
            raise AdapterError(
                f"args is None (no engines): sample {sample.index} is {status} with reward {sample.reward!r}; "
                "only already generated samples can pass through"
            )
        return sample

    async def load(self, instance_id: int, version_tag: str, path: str | None) -> None:
        return None

    async def refresh(self) -> tuple[list[int], list[tuple[int, int]]]:
        return [], []
