"""Stand-ins for what cannot exist on a CPU CI machine. slime itself is ABSENT in CI.

slime is not on PyPI, and its engines are SGLang servers on GPUs. These stand-ins follow slime's
documented data shapes and interfaces (read from slime's source, commit 624b824):

* `Sample`: the fields of `slime.utils.types.Sample` the adapter touches, with its `Status` enum.
* `StandinBaseDataSource`: the behaviour of slime's `RolloutDataSource` (groups of
  `n_samples_per_prompt` deep copies of one prompt, a cursor saved under `args.save/rollout/`).
* `FakeSglangFleet`: the HTTP surface of SGLang servers behind slime's router that the adapter
  uses (`GET /workers` on the router, with sglang-router's fresh `id` per registration;
  `GET /health` (as slime launches SGLang, `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false`: 200
  while the process lives, whatever its scheduler does), `GET /health_generate` (answers only if
  the engine generates), `GET /server_info`, `GET /model_info` and `POST /update_weights_from_disk`
  on an engine, with SGLang 0.5.23's two places for the weight version: the scheduler's, read back
  in `/server_info`'s `internal_states`, and each tokenizer worker's, which `/model_info` answers
  from; see `FakeEngine.tokenizer_workers`; `FakeEngine.empty_states`: slime's SGLang 0.5.15
  patch, whose `/server_info` returns `internal_states: []` when the scheduler does not answer in
  2 s); `GET /flush_cache` as SGLang answers it, 200 only when nothing runs, else 400; a request
  its client cancelled stays in the batch a moment (`ABORT_LINGER_S`, SGLang: up to 4 s and a
  decode step) without the weight-update lock, and a load meanwhile swaps the weights and answers
  400 (the cache not flushed). `FakeEngine.stuck`: an engine that accepts requests and never answers them. It records
  violations instead of hiding them: a load on an engine with requests running (R4), more
  requests than the engine's capacity. `restart_engine` replaces an engine by a fresh one at the
  same address, as slime's fault tolerance does.
* `generate`: a custom generate function with slime's real signature
  `async def generate(args, sample, sampling_params) -> Sample`, the one slime's
  `--custom-generate-function-path` takes. It stands in for an SGLang `/generate` call: it finds
  the engine by the address in `args` (as slime's generate builds its URL), "decodes" a
  deterministic long-tailed number of tokens, and reports the engine's weight version the way
  SGLang's `meta_info["weight_version"]` lands in `Sample.weight_versions`.

When `DORA_SLIME_PATH` points at a real slime checkout, `test_slime_real.py` runs the same
adapter against slime's real `Sample`, output types, `load_function` and `generate_and_rm`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import random
import threading
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass
class Sample:
    """Stand-in for slime.utils.types.Sample (slime is absent here)."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)


class StandinBaseDataSource:
    """Stand-in for slime's RolloutDataSource: numbered prompts, a saved cursor."""

    def __init__(self, args: Any) -> None:
        self.args = args
        self.n = args.n_samples_per_prompt
        self.num_prompts = getattr(args, "standin_num_prompts", 1000)
        self.offset = 0
        self.sample_index = 0
        self.sample_cls = getattr(args, "standin_sample_cls", Sample)

    def get_samples(self, num_samples: int) -> list[list[Any]]:
        groups = []
        for _ in range(num_samples):
            if self.offset >= self.num_prompts:
                break
            prompt = self.sample_cls(prompt=f"p{self.offset}", label=str(self.offset), tokens=[1, 2, 3])
            group = []
            for _ in range(self.n):
                s = copy.deepcopy(prompt)
                s.group_index = self.offset
                s.index = self.sample_index
                self.sample_index += 1
                group.append(s)
            self.offset += 1
            groups.append(group)
        return groups

    def add_samples(self, samples: list[list[Any]]) -> None:
        raise RuntimeError("read-only")

    def save(self, rollout_id: int) -> None:
        path = os.path.join(self.args.save, f"rollout/standin_cursor_{rollout_id}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            json.dump({"offset": self.offset, "sample_index": self.sample_index}, fh)

    def load(self, rollout_id: int | None = None) -> None:
        if self.args.load is None:
            return
        path = os.path.join(self.args.load, f"rollout/standin_cursor_{rollout_id}.json")
        if os.path.exists(path):
            with open(path) as fh:
                state = json.load(fh)
            self.offset, self.sample_index = state["offset"], state["sample_index"]

    def __len__(self) -> int:
        return self.num_prompts


class HoldingSaveBaseDataSource(StandinBaseDataSource):
    """The stand-in base data source whose `save` waits, after writing its cursor, until
    `SAVE_GO` is set or `SAVE_HOLD_S` passed (an injected delay that opens the race window)."""

    def save(self, rollout_id: int) -> None:
        super().save(rollout_id)
        SAVE_IN.set()
        SAVE_GO.wait(SAVE_HOLD_S)


SAVE_IN = threading.Event()
SAVE_GO = threading.Event()
SAVE_HOLD_S = 2.0


class FakeEngine:
    def __init__(self, url: str, port: int) -> None:
        self.url = url
        self.port = port
        self.version: str = "initial"
        self.worker_id = uuid.uuid4().hex  # the router's id for this engine's registration
        self.running = 0
        self.max_running = 0
        self.loads: list[str] = []
        self.relabels: list[str] = []
        self.wrong_version_once = False
        self.wrong_versions = 0  # the next this many requests report weight version "999"
        self.alive = True
        self.stuck = False  # accepts requests, never answers a generation (nor /health_generate)
        self.empty_states = False
        # version -> (event, max s): its disk load holds SGLang's writer lock until the event is set
        # (or max s passed), carried on when its caller gives up; requests and /health_generate queue.
        self.load_hold: dict[str, tuple[Any, float]] = {}
        self.load_done: Any = None  # an asyncio.Event while a held load runs
        self.started = 0
        self.lingering = 0  # cancelled requests still in the batch (`ABORT_LINGER_S`)
        self.flushes: list[bool] = []  # each /flush_cache: did it flush (the scheduler was idle)?
        self.inherited = 0  # requests retried here from a predecessor at the same URL
        self.launch_version = "initial"
        # SGLang's `--tokenizer-worker-num`: each worker process keeps its own copy of the weight
        # version, set only in the worker whose HTTP handler ran the update; `/model_info` is
        # answered by one worker after another (the HTTP server's workers share the port).
        self.tokenizer_workers = 1
        self.worker_versions: dict[int, str] = {}
        self._turn = 0

    def tokenizer_worker(self) -> int:
        """The tokenizer worker that takes the next HTTP request."""
        w = self._turn % self.tokenizer_workers
        self._turn += 1
        return w

    def worker_version(self, worker: int) -> str:
        return self.worker_versions.get(worker, self.launch_version)


# port -> engine: the stand-in generate finds its engine by the address slime puts in args.
ENGINES: dict[int, FakeEngine] = {}
# (prompt, sample index) in the order requests started and finished, across engines.
STARTS: list[tuple[str, int]] = []
FINISHES: list[tuple[str, int]] = []


class FakeSglangFleet:
    """Stand-in for SGLang engines behind slime's router (no GPU inference server can run here)."""

    def __init__(self, n_engines: int, *, capacity: int, base_port: int = 31000) -> None:
        self.capacity = capacity
        self.engines = [FakeEngine(f"http://127.0.0.1:{base_port + i}", base_port + i) for i in range(n_engines)]
        for e in self.engines:
            ENGINES[e.port] = e
        self.violations: list[str] = []
        self.live_version_sets: list[frozenset] = []

    def add_engine(self, port: int) -> FakeEngine:
        """A new engine registered with the router (what slime's fault tolerance does on restart)."""
        e = FakeEngine(f"http://127.0.0.1:{port}", port)
        ENGINES[port] = e
        self.engines.append(e)
        return e

    def restart_engine(self, port: int, *, reregister: bool = True) -> FakeEngine:
        """slime's fault tolerance: the engine at `port` dies and a fresh one (launch weights,
        SGLang's launch weight version) serves at the SAME address. `reregister`: slime's
        `SGLangEngine.shutdown` deleted the old registration and the new engine registered anew
        (sglang-router gives it a fresh id); otherwise the old registration stayed (the router
        refuses the duplicate and keeps the old id)."""
        old = ENGINES[port]
        old.alive = False
        new = FakeEngine(old.url, port)
        new.version = new.launch_version = "default"
        new.tokenizer_workers = old.tokenizer_workers
        if not reregister:
            new.worker_id = old.worker_id
        ENGINES[port] = new
        self.engines[self.engines.index(old)] = new
        return new

    def observe(self) -> None:
        self.live_version_sets.append(frozenset(e.version for e in self.engines))
        for e in self.engines:
            if e.running > self.capacity:
                self.violations.append(f"{e.url}: {e.running} requests > capacity {self.capacity}")

    async def get(self, url: str) -> dict:
        if url.endswith("/workers"):
            return {"workers": [{"id": e.worker_id, "url": e.url, "worker_type": "regular"} for e in self.engines]}
        if url.endswith("/flush_cache"):  # SGLang: 200 (text) only when nothing runs or queues, else 400
            engine = next(e for e in self.engines if url.startswith(e.url))
            if not engine.alive:
                raise ConnectionError(f"{engine.url} is down")
            if engine.stuck:
                await asyncio.Event().wait()  # the scheduler never answers; the caller's bound cuts it
            busy = engine.running + engine.lingering
            engine.flushes.append(not busy)
            if engine.running:  # only a load asks, and the scheduler sends one to a drained engine
                self.violations.append(f"{engine.url}: a load asked for /flush_cache with {engine.running} running (R4)")
            if busy:
                raise http_error("GET", url, 400, text=f"Cache not flushed because there are pending requests. "
                                                       f"#queue-req: 0, #running-req: {busy}")
            return {"text": "Cache flushed."}
        if url.endswith(("/health", "/health_generate", "/model_info", "/server_info")):
            engine = next(e for e in self.engines if url.startswith(e.url))
            if not engine.alive:
                raise ConnectionError(f"{engine.url} is down")
            if url.endswith("/health_generate") and engine.load_done is not None:
                await engine.load_done.wait()
            if url.endswith("/health_generate") and engine.stuck:
                await asyncio.Event().wait()  # never answers; the caller's bound cuts it
            if url.endswith("/model_info"):  # the answering tokenizer worker's copy
                return {"weight_version": engine.worker_version(engine.tokenizer_worker())}
            if url.endswith("/server_info"):  # launch config on top, the scheduler's state below
                return {"weight_version": engine.launch_version, "tokenizer_worker_num": engine.tokenizer_workers,
                        "internal_states": [] if engine.empty_states or engine.stuck
                        else [{"weight_version": engine.version}]}
            return {}
        raise AssertionError(f"unexpected GET {url}")

    async def post(self, url: str, payload: dict) -> dict:
        engine = next(e for e in self.engines if url.startswith(e.url))
        if not engine.alive:
            raise ConnectionError(f"{engine.url} is down")
        if url.endswith("/update_weights_from_disk") and payload["weight_version"] in engine.load_hold:
            (hold, max_s), engine.load_done = engine.load_hold.pop(payload["weight_version"]), asyncio.Event()
            return await asyncio.shield(asyncio.ensure_future(self._held_load(engine, url, payload, hold, max_s)))
        if url.endswith("/update_weights_from_disk"):
            if engine.running:
                self.violations.append(f"{engine.url}: loaded {payload['weight_version']} with {engine.running} running")
            if not os.path.isdir(payload["model_path"]):
                self.violations.append(f"{engine.url}: checkpoint {payload['model_path']} does not exist")
            engine.version = payload["weight_version"]
            engine.loads.append(payload["weight_version"])
            self.observe()
            if engine.lingering:  # SGLang 0.5.23: the scheduler swaps the weights, the cache flush after
                # it fails, and the tokenizer keeps its old version (`/model_info`)
                raise http_error("POST", url, 400, json={
                    "success": False, "num_paused_requests": 0,
                    "message": "Weights were updated, but the cache was not flushed because requests are still "
                               "running or queued. Retract or finish them, then call /flush_cache."})
            engine.worker_versions[engine.tokenizer_worker()] = payload["weight_version"]
            return {"success": True, "message": "ok"}
        if url.endswith("/update_weight_version"):  # SGLang: a new tag, no load
            engine.version = payload["new_version"]
            engine.worker_versions[engine.tokenizer_worker()] = payload["new_version"]
            engine.relabels.append(payload["new_version"])
            return {"success": True}
        raise AssertionError(f"unexpected POST {url}")

    async def _held_load(self, engine: FakeEngine, url: str, payload: dict, hold: Any, max_s: float) -> dict:
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(hold.wait(), max_s)
            return await self.post(url, payload)
        finally:
            engine.load_done.set()
            engine.load_done = None


def http_error(method: str, url: str, status: int, **body: Any) -> Exception:
    """The error slime's and the adapter's HTTP clients raise for an error status (httpx's
    `HTTPStatusError` from `raise_for_status`), with the reply's body (`json=` or `text=`)."""
    import httpx

    request = httpx.Request(method, url)
    return httpx.HTTPStatusError(f"HTTP {status} for {url}", request=request,
                                 response=httpx.Response(status, request=request, **body))


def _linger(engine: FakeEngine) -> None:
    """A request its client cancelled stays in the engine's batch after letting go of the
    weight-update lock (SGLang: until it sees the client gone, up to 4 s, then one decode step):
    for `ABORT_LINGER_S`, or until `ABORT_HOLD` is set where a test sets one (to force an order)."""
    engine.lingering += 1

    async def leave() -> None:
        try:
            if ABORT_HOLD is not None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(ABORT_HOLD.wait(), HOLD_TIMEOUT_S)
            else:
                await asyncio.sleep(ABORT_LINGER_S)
        finally:
            engine.lingering -= 1

    asyncio.ensure_future(leave())


def response_length(sample: Any) -> int:
    """Long-tailed, deterministic per (prompt, index): most short, a few ~10x longer."""
    rng = random.Random(f"{sample.prompt}/{sample.index}")
    return max(1, min(40, int(rng.lognormvariate(1.5, 0.9))))


TICK_S = 0.0005

# Fault injection (tests reset them): requests that fail every time, and requests held until
# their event is set (or HOLD_TIMEOUT_S passed: an injected delay, never a hang).
FAIL_ALWAYS: set[tuple[str, int]] = set()
HOLD: dict[tuple[str, int], Any] = {}
HOLD_TIMEOUT_S = 30.0  # far over what a held request waits for under CI load
# How long a cancelled request stays in its engine's batch (`_linger`); ABORT_HOLD (an
# asyncio.Event a test sets) holds it there until set instead.
ABORT_LINGER_S = 0.02
ABORT_HOLD: Any = None
# (prompt, weight version) of each request a stuck engine took.
STUCK: list[tuple[str, str]] = []
# Called with the engine each time a request starts on it (fault injection).
ON_START: Any = None
# (prompt, sample index) -> the sampling params its last request was sent with.
PARAMS: dict[tuple[str, int], dict] = {}
# Calls of `record_all_samples` (slime's --rollout-all-samples-process-path signature).
ALL_SAMPLES_CALLS: list[tuple[Any, list, Any]] = []


def record_all_samples(args: Any, samples: list, data_source: Any) -> None:
    ALL_SAMPLES_CALLS.append((args, samples, data_source))


async def generate(args: Any, sample: Any, sampling_params: dict) -> Any:
    """slime's custom-generate signature; stands in for one SGLang /generate request."""
    return await _request(ENGINES[int(args.sglang_router_port)], args, sample, sampling_params)


async def _request(engine: FakeEngine, args: Any, sample: Any, sampling_params: dict, inherited: bool = False) -> Any:
    """One request on `engine`. `inherited`: sent to its predecessor at the same URL and retried
    here by slime's HTTP client; the adapter no longer counts it (its attempt was retired), so it
    is kept out of the capacity and R4 checks, and counted in `engine.inherited`."""
    if not engine.alive:
        raise ConnectionError(f"{engine.url} is down")
    while engine.load_done is not None:  # behind a load's writer lock
        await engine.load_done.wait()
    fleet_capacity = None if inherited else getattr(args, "standin_capacity", None)
    running = 0 if inherited else 1
    engine.inherited += 1 - running
    engine.running += running
    engine.max_running = max(engine.max_running, engine.running)
    STARTS.append((sample.prompt, sample.index))
    version = engine.version
    try:
        key = (sample.prompt, sample.index)
        PARAMS[key] = dict(sampling_params)
        if key in FAIL_ALWAYS:
            raise ConnectionError(f"injected: request {key} fails on every attempt")
        if key in HOLD:
            try:
                await asyncio.wait_for(HOLD[key].wait(), HOLD_TIMEOUT_S)
            except asyncio.TimeoutError:
                pass
        engine.started += 1
        if ON_START is not None:
            ON_START(engine)
        if engine.stuck:
            STUCK.append((sample.prompt, version))
            await asyncio.Event().wait()  # accepted, never answered (cancelled by the adapter)
        n = response_length(sample)
        await asyncio.sleep(n * TICK_S)
        if not engine.alive:
            successor = ENGINES.get(engine.port)
            if successor is not None and successor is not engine and successor.alive:
                # slime's HTTP client (`http_utils.post`) retries a failed request at the same
                # URL for a minute: a successor restarted there answers it.
                return await _request(successor, args, sample, sampling_params, inherited=True)
            raise ConnectionError(f"{engine.url} died with this request running")
        if engine.version != version:
            raise AssertionError(f"{engine.url} changed version {version} -> {engine.version} mid-request")
        reported = version
        if engine.wrong_version_once:
            engine.wrong_version_once = False
            reported = "999"
        elif engine.wrong_versions > 0:
            engine.wrong_versions -= 1
            reported = "999"
        sample.tokens = list(sample.tokens) + [7] * n
        sample.response = "y" * n
        sample.response_length += n
        sample.rollout_log_probs = (sample.rollout_log_probs or []) + [-0.5] * n
        sample.loss_mask = [1] * sample.response_length
        sample.weight_versions.append(reported)
        sample.reward = float(len(sample.prompt) % 2 + n % 3)
        sample.status = type(sample).Status.COMPLETED
        FINISHES.append((sample.prompt, sample.index))
        if fleet_capacity is not None and engine.running > fleet_capacity:
            raise AssertionError(f"{engine.url}: {engine.running} requests > capacity {fleet_capacity}")
        return sample
    except asyncio.CancelledError:
        if running:
            _linger(engine)
        raise
    finally:
        engine.running -= running


class StandinGenerateState:
    """Stand-in for slime's `GenerateState` when slime IS present (test_slime_real.py).

    slime's GenerateState loads the tokenizer of `--hf-checkpoint`, which does not exist on this
    machine; slime's own contract tests replace it the same way. It keeps what `generate_and_rm`
    and the adapter read: a semaphore, `aborted`, `dp_rank_context`, `sampling_params`.
    """

    def __init__(self, args: Any) -> None:
        import contextlib

        self.args = args
        self.semaphore = asyncio.Semaphore(10_000)
        self.aborted = False
        self.pendings: set = set()
        self.remaining_batch_size = 0
        self.sampling_params = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 64}
        self.dp_rank_context = contextlib.nullcontext
