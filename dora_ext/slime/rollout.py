"""slime's `--rollout-function-path`, backed by the dora-ext scheduler.

    --rollout-function-path dora_ext.slime.rollout.generate_rollout

Call `k` collects batch `k` (rollout_id = first_id + k) from a background worker that runs
`dora_ext.core.Scheduler` against slime's SGLang engines (R1-R4, R6; version v is weight version
first_id + v). A request for batch k + 1 or the publication of version k + 1 means batch k is
consumed. With K = 0 use `train.py` (`train_async.py` asks for k + 1 before publishing it).
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import copy
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from typing import Any

from ..config import DoraConfig
from ..core import (
    DataExhausted, DeliverGroup, Dispatch, GroupAdmitted, InstanceFailed, InstanceLoaded, InstanceReady,
    LoadVersion, Migrate,
    ReportError, ReportGroupFailed, RequestGroups, RewardReady, Scheduler, StartStep,
    TrainerStepFinished, TrajectoryFailed, TrajectoryFinished, VersionPublished,
)
from ..core.actions import without_failed
from .engines import AdapterError, EngineGone, Engines, PassThroughEngines, SglangEngines, load_object
from .settings import SlimeSettings, check_launch, check_shared_weights_dir, dora_config, slime_settings
from .weights import DiskWeightBoard, StaticWeights

logger = logging.getLogger("dora_ext.slime")

__all__ = ["generate_rollout", "RolloutSession", "close_session", "install_session"]

#: Metrics copied from `Scheduler.metrics()` into slime's rollout log, prefixed `dora/`.
_METRICS = (
    "staleness_mean", "staleness_max", "multi_version_trajectory_share", "dropped", "truncated",
    "duplicated", "live_versions", "live_versions_max", "migrations", "weight_loads",
    "failed_groups", "retries", "redispatched", "trainer_waits_for_older", "newest_version", "c1_ok", "c2_ok", "c3_ok",
)


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """slime's rollout-function signature. Returns batch `rollout_id` as a `RolloutFnTrainOutput`.

    With `evaluation=True` it runs slime's own evaluation (`eval_rollout`) on the engines that
    hold the newest published version (see `RolloutSession.evaluate`).
    """
    from ._compat import RolloutFnTrainOutput

    if evaluation:
        return _evaluate(args, rollout_id, data_source)
    session = _session_for(args, data_source, rollout_id)
    groups, metrics = session.next_batch(rollout_id)
    path = getattr(args, "rollout_sample_filter_path", None)
    if path:
        # slime's post-selection hook (marks samples `remove_sample`), applied as slime applies it.
        load_object(path)(args, groups)
    path = getattr(args, "rollout_all_samples_process_path", None)
    if path:
        # slime hands this hook every sample of the rollout; a dora batch filters none out.
        load_object(path)(args, groups, data_source)
    return RolloutFnTrainOutput(samples=groups, metrics=metrics)


def _evaluate(args: Any, rollout_id: int, data_source: Any) -> Any:
    from ._compat import RolloutFnEvalOutput

    if args is not None:
        return _session_for(args, data_source, rollout_id).evaluate(rollout_id)
    # args=None: slime's contract harness, no engines: report one data-source batch as it is.
    samples = [s for group in data_source.get_samples(1) for s in group]
    for s in samples:
        status = getattr(s.status, "value", s.status)
        if status not in ("completed", "truncated") or s.reward is None:
            raise AdapterError(f"args is None (no engines): cannot evaluate sample {s.index} ({status})")
    data = {
        "data_source": {
            "rewards": [s.reward for s in samples],
            "truncated": [getattr(s.status, "value", s.status) == "truncated" for s in samples],
            "samples": samples,
        }
    }
    return RolloutFnEvalOutput(data=data, metrics={"dora/eval_passthrough": 1})


# ---------------------------------------------------------------------------- session registry
_session: "RolloutSession | None" = None
_session_lock = threading.Lock()


def _session_for(args: Any, data_source: Any, rollout_id: int) -> "RolloutSession":
    global _session
    with _session_lock:
        if _session is not None and (_session.args is not args or _session.data_source is not data_source):
            _session.close()
            _session = None
        if _session is None:
            _session = RolloutSession.for_slime(args, data_source, rollout_id)
        return _session


def install_session(session: "RolloutSession") -> None:
    """Make `generate_rollout` use `session` for its args and data source (embedding, tests)."""
    global _session
    with _session_lock:
        if _session is not None and _session is not session:
            _session.close()
        _session = session


def close_session() -> None:
    """Stop the worker (slime's process exit does it too)."""
    global _session
    with _session_lock:
        if _session is not None:
            _session.close()
            _session = None


atexit.register(close_session)


class _LoopThread:
    """An event loop in a daemon thread (used when slime's own background loop is absent)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="dora-slime-rollout", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


def _event_loop() -> tuple[asyncio.AbstractEventLoop, _LoopThread | None]:
    # Share slime's background loop: its GenerateState semaphore binds to the loop that first uses it.
    try:
        from slime.utils.async_utils import get_async_loop
    except ImportError:
        own = _LoopThread()
        return own.loop, own
    return get_async_loop().loop, None


def _fresh_run(args: Any, first_step: int) -> bool:
    """Version 0 is `--hf-checkpoint`, the weights slime launched the engines with: step 0 and no
    Megatron checkpoint under `--load` (slime then starts from the HF weights)."""
    import os

    load = getattr(args, "load", None)
    return first_step == 0 and not (load and os.path.exists(os.path.join(load, "latest_checkpointed_iteration.txt")))


def _ray_nodes() -> int:
    """Alive nodes of the Ray cluster this process is part of (0 outside Ray)."""
    try:
        import ray
    except ImportError:
        return 0
    return len([n for n in ray.nodes() if n.get("Alive")]) if ray.is_initialized() else 0


def _sampling_params(args: Any) -> dict:
    if args is None:
        return {}
    try:
        from slime.rollout.sglang_rollout import GenerateState
    except ImportError:
        params = {
            "temperature": getattr(args, "rollout_temperature", 1.0),
            "top_p": getattr(args, "rollout_top_p", 1.0),
            "top_k": getattr(args, "rollout_top_k", -1),
            "max_new_tokens": getattr(args, "rollout_max_response_len", None),
        }
        return {k: v for k, v in params.items() if v is not None}
    return dict(GenerateState(args).sampling_params)


def _status(sample: Any) -> str:
    return getattr(sample.status, "value", sample.status)


def _reward_value(args: Any, sample: Any) -> Any:
    r = sample.reward
    key = getattr(args, "reward_key", None)
    if isinstance(r, dict) and key:
        return r.get(key)
    return r


def _flat(out: Any) -> list:
    return out if isinstance(out, list) else [out]


class RolloutSession:
    """The background worker: executes the scheduler's actions against slime's engines.

    All scheduler calls happen on one event loop (the scheduler is a plain state machine, not
    thread-safe); `next_batch` is the only entry from slime's thread.
    """

    def __init__(
        self,
        args: Any,
        data_source: Any,
        *,
        first_step: int,
        engines: Engines,
        board: Any,
        settings: SlimeSettings,
        config: DoraConfig | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        plugins: Any = None,
    ) -> None:
        self.args = args
        self.data_source = data_source
        self.first_step = first_step
        self.engines = engines
        self.board = board
        self.settings = settings
        self._config = config
        self._plugins = plugins
        if loop is None:
            loop, self._own_loop = _event_loop()
        else:
            self._own_loop = None
        self.loop = loop
        self.sched: Scheduler | None = None
        self._groups: dict[int, list] = {}
        self._pristine: dict[int, list] = {}
        self._attempt: dict[tuple[int, int], int] = {}
        self._finished: dict[int, set] = {}
        self._batches: dict[int, tuple] = {}
        self._failed: list[tuple[Any, str, Any]] = []  # (group id, reason, prompt)
        self._delivered = 0
        self._next_gid = 0
        self._prefetched: list[list] = []
        self._released: set[int] = set()
        self._pending: deque = deque()
        self._draining = False
        self._fatal: BaseException | None = None
        self._changed: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()
        # In-flight trajectory tasks per instance: cancelled (request aborted) when it is retired.
        self._requests: dict[int, set[asyncio.Task]] = {}
        self._params: dict | None = None
        self._started = False
        self._closed = False
        self._next_step = 0  # the step slime asks for next (relative to first_step)
        #: Test probe(name, value), called on the worker loop at "request", "published" and "batch".
        self.probe: Any = None
        # The instance slime's eval runs on and its end event: scheduler loads there wait for it.
        self._eval_on: set[int] = set()
        self._eval_over: asyncio.Event | None = None
        # Engine refreshes: the pass callers wait for next, and the task running the passes.
        self._refresh_next: asyncio.Future | None = None
        self._refresh_runner: asyncio.Task | None = None
        #: Refresh passes run (each asks the router once and every engine once), engines retired.
        self.refresh_passes = 0
        self.retired = 0

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_slime(cls, args: Any, data_source: Any, first_step: int, *, engines: Engines | None = None) -> "RolloutSession":
        """The session slime's loop gets: its engines and weight channel, or pass-through for args=None.

        `engines` replaces slime's SGLang engines (tests give them a stand-in HTTP client)."""
        settings = slime_settings(args)
        if args is None:
            sess = cls(args, data_source, first_step=first_step, engines=PassThroughEngines([8] * 4),
                       board=None, settings=settings)
            sess.board = StaticWeights(lambda: sess.sched.step if sess.sched else 0)
            return sess
        check_launch(args)
        dora_config(args, instances=[1], start_step=first_step)  # fail on a bad file before any I/O
        weights_dir = settings.weights_dir or getattr(args, "update_weight_disk_dir", None)
        if not weights_dir:
            raise AdapterError("no weights directory: pass --update-weight-disk-dir (or dora_slime.weights_dir)")
        check_shared_weights_dir(settings, weights_dir, _ray_nodes())
        keep = bool(getattr(args, "update_weight_disk_keep_files", False))
        board = DiskWeightBoard(weights_dir, delete_old=settings.delete_old_weights and not keep)
        from ..plugins import get_plugin_manager

        if engines is None:
            engines = SglangEngines(args, settings)
        if isinstance(engines, SglangEngines) and _fresh_run(args, first_step):
            engines.launch_tag = str(first_step)  # version 0 is the checkpoint engines launched with
        return cls(args, data_source, first_step=first_step, engines=engines,
                   board=board, settings=settings, plugins=get_plugin_manager())

    # ------------------------------------------------------------------ slime's thread
    def next_batch(self, rollout_id: int) -> tuple[list[list], dict]:
        """Block until batch `rollout_id` is chosen; return its groups and the metrics to log."""
        if self._closed:
            raise AdapterError("the rollout session is closed")
        return asyncio.run_coroutine_threadsafe(self._next_batch(rollout_id), self.loop).result()

    def evaluate(self, rollout_id: int) -> Any:
        """slime's evaluation on the newest published version, on the engines that hold it.

        Through slime's router eval requests would land on engines holding older versions; they
        go to the engines holding the newest instead, one request to the next engine
        (`_spread_args`), waiting until one holds it (once the scheduler has nothing left to run,
        every engine loads it). slime's `eval_rollout` runs unchanged
        with its own semaphore, which the rollout worker does not take (see `engines.py`).
        """
        if self._closed:
            raise AdapterError("the rollout session is closed")
        return asyncio.run_coroutine_threadsafe(self._evaluate(rollout_id), self.loop).result()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def _cancel() -> None:
            for t in list(self._tasks):
                t.cancel()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)

        if self.loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(_cancel(), self.loop).result(timeout=10)
            except Exception:  # noqa: BLE001 - closing must not raise over slime's own shutdown
                logger.exception("dora: error while stopping the rollout worker")
        if self._own_loop is not None:
            self._own_loop.stop()

    # ------------------------------------------------------------------ the worker (event loop)
    async def _start(self) -> None:
        self._changed = asyncio.Event()
        capacities = await self.engines.discover()
        config = self._config
        if config is None:
            if self.args is None or getattr(self.args, "n_samples_per_prompt", None) is None:
                # No slime args: the group size is the data source's.
                self._prefetched = list(self.data_source.get_samples(1))
                n = len(self._prefetched[0]) if self._prefetched else 1
                config = DoraConfig.from_dict(
                    {"group_size": n, "migrate": False, "instances": [{"capacity": c} for c in capacities]}
                )
            else:
                config = dora_config(self.args, instances=capacities, start_step=self.first_step)
        self._config = config
        self._params = _sampling_params(self.args)
        self.sched = Scheduler(config, plugins=self._plugins)
        self._pending.extend(self.sched.start())
        self._drain()
        self._spawn(self._watch_weights())
        self._spawn(self._watch_engines())
        logger.info("dora: rollout worker started at step %d: %s", self.first_step, config.to_dict())

    async def _ensure_started(self) -> None:
        if not self._started:
            self._started = True
            try:
                await self._start()
            except BaseException as exc:
                self._fatal = exc
                raise

    async def _evaluate(self, rollout_id: int) -> Any:
        from slime.rollout.sglang_rollout import eval_rollout

        from ._compat import RolloutFnEvalOutput

        await self._ensure_started()
        waited = time.monotonic()
        for _attempt in range(3):
            iids, newest = await self._eval_instances()
            iid = iids[0]
            tag = str(self.first_step + newest)
            bases = [self.engines.args_for_instance(i) for i in iids]
            self._probe("eval_start", (rollout_id, iid, tag))
            # slime's eval retries a dead engine; the watcher notices sooner and the eval restarts elsewhere.
            self._eval_on, self._eval_over = set(iids), asyncio.Event()
            children: set = set()
            task = _tracked(self.loop, eval_rollout(_spread_args(bases, children), rollout_id), children)
            try:
                while not task.done():
                    await asyncio.wait({task}, timeout=self.settings.engine_check_interval_s)
                    if not task.done() and not set(iids) <= set(self.sched.instances):
                        task.cancel()
                        await asyncio.gather(task, return_exceptions=True)
                        break
                if task.cancelled():
                    logger.warning("dora: engine %s died during evaluation of rollout %d; evaluating again",
                                   iid, rollout_id)
                    continue
                # Judge the engine while it is still the eval's, before a waiting load (_load) starts.
                try:
                    out, _ = task.result()
                except Exception:
                    await self._refresh()
                    if set(iids) <= set(self.sched.instances):
                        raise
                    continue
                seen = {str(v) for d in out.data.values() for s in d["samples"] for v in s.weight_versions}
                if seen - {tag}:
                    # A restarted engine at the same address: evaluate elsewhere after the refresh; else an error.
                    await self._refresh()
                    if set(iids) <= set(self.sched.instances):
                        raise AdapterError(
                            f"evaluation of rollout {rollout_id} pinned to version {tag} saw versions {sorted(seen)}")
                    continue
            finally:
                task.cancel()  # done, or this evaluation was cancelled: nothing of it keeps running
                _cancel_all(children)
                self._eval_on = set()
                self._eval_over.set()
            break
        else:
            raise AdapterError(f"evaluation of rollout {rollout_id}: engines kept dying")
        metrics = dict(out.metrics or {})
        metrics.update({"dora/eval_version": int(tag), "dora/eval_instance": iid, "dora/eval_engines": len(iids),
                        "dora/eval_wait_s": time.monotonic() - waited, **self._engine_metrics()})
        return RolloutFnEvalOutput(data=out.data, metrics=metrics)

    async def _eval_instances(self) -> tuple[list[int], int]:
        """The engines holding the newest published version (waits for one), and that version.

        Loads are the scheduler's alone (`_load`): an idle engine with nothing left to run takes
        the newest version (R4), so after the last step every engine loads it and the final
        evaluation waits for all of them. A load that fails or times out is `_load`'s to handle:
        the engine leaves at a refresh and the evaluation runs on the others (or waits for one
        to rejoin and load it); only a load SGLang refuses ends the job, as it does in training.
        """
        started = logged = time.monotonic()
        while True:
            if self._fatal is not None:
                raise AdapterError(f"the rollout worker stopped: {self._fatal!r}") from self._fatal
            sched = self.sched
            newest = self.board.poll() - 1
            if newest >= 0 and sched.newest_version >= newest:
                insts = sorted(sched.instances.items())
                iids = [i for i, inst in insts if inst.version == newest and inst.loading is None]
                if sched.done and any(inst.loading == newest for _, inst in insts):
                    iids = []  # after the last step: wait for every engine loading it, not the first one done
                if iids:
                    return iids, newest
                if sched.done and insts and all(not inst.running and inst.loading is None for _, inst in insts):
                    raise AdapterError(f"after the last step no engine holds or loads version {self.first_step + newest}: "
                                       "the scheduler left its engines idle on older versions")
            self._probe("eval_waits", newest)
            if time.monotonic() - logged >= 60:  # as a training batch waits: engines may rejoin (slime restarts them)
                logged = time.monotonic()
                f = self.first_step
                held = ", ".join(f"{i} at {f + inst.version}"
                                 + ("" if inst.loading is None else f" loading {f + inst.loading}")
                                 for i, inst in sorted(sched.instances.items()))
                logger.info("dora: evaluation waits %.0fs for an engine holding version %s (engines: %s)",
                            logged - started, f + newest if newest >= 0 else "(none published yet)",
                            held or "none: every engine was retired")
            await asyncio.sleep(self.settings.poll_interval_s)

    async def _next_batch(self, rollout_id: int) -> tuple[list[list], dict]:
        await self._ensure_started()
        if self._fatal is not None:
            raise AdapterError(f"the rollout worker stopped: {self._fatal!r}") from self._fatal
        sched = self.sched
        step = rollout_id - self.first_step
        if step != self._next_step:
            raise AdapterError(
                f"slime asked for rollout {rollout_id}, the adapter serves rollout {self.first_step + self._next_step} "
                "next: each rollout id is served once, in order (restart the run to resume from a checkpoint)"
            )
        busy = sched.trainer_busy
        if busy is not None and busy < step:
            # slime asks for the next batch: the previous one is the trainer's now (may already be formed).
            self._feed(TrainerStepFinished(busy))
        self._probe("request", rollout_id)
        forget = getattr(self.data_source, "dora_forget_before", None)
        if forget is not None:
            forget(rollout_id)
        waited = time.monotonic()
        while step not in self._batches:
            if self._fatal is not None:
                raise AdapterError(f"the rollout worker stopped: {self._fatal!r}") from self._fatal
            if sched.done:
                raise AdapterError(f"rollout {rollout_id} requested after the last step ({sched.config.max_steps})")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=60)
            except asyncio.TimeoutError:
                m = sched.metrics()
                logger.info("dora: waiting %.0fs for rollout %d (newest version %d, live versions %s)",
                            time.monotonic() - waited, rollout_id, m["newest_version"], sched.live_versions())
        if self._fatal is not None:
            raise AdapterError(f"the rollout worker stopped: {self._fatal!r}") from self._fatal
        gids = self._batches.pop(step)
        self._next_step = step + 1
        groups = [self._groups.pop(g) for g in gids]
        versions = [sched.groups[g].version for g in gids]
        for g in gids:
            self._pristine.pop(g, None)
            self._finished.pop(g, None)
            for i in range(sched.n):
                self._attempt.pop((g, i), None)
        assign = getattr(self.data_source, "dora_assign", None)
        if assign is not None:
            assign([_ledger_id(group) for group in groups], rollout_id)
        return groups, self._metrics(step, versions, time.monotonic() - waited)

    def _metrics(self, step: int, versions: list[int], waited: float) -> dict:
        m = self.sched.metrics()
        out = {f"dora/{k}": (int(m[k]) if isinstance(m[k], bool) else m[k]) for k in _METRICS}
        stale = [step - v for v in versions]
        out["dora/batch_staleness_mean"] = sum(stale) / len(stale) if stale else 0.0
        out["dora/batch_staleness_max"] = max(stale) if stale else 0
        for k in sorted(set(stale)):  # the batch's distribution: groups per staleness, as verl's
            out[f"dora/batch_staleness_hist/{k}"] = stale.count(k)
        out["dora/delivered_groups"] = self._delivered
        out.update(self._engine_metrics())
        out["dora/batch_wait_s"] = waited
        return out

    def _engine_metrics(self) -> dict:
        """Since the worker started: refresh passes, engines retired, the p99 of the engine probes.
        In every training batch's metrics and every evaluation's (a retirement during the last
        evaluation shows only there)."""
        out = {"dora/engine_refresh_passes": self.refresh_passes, "dora/engines_retired": self.retired}
        probes = sorted(getattr(self.engines, "probe_s", []))
        if probes:
            out["dora/health_check_p99_s"] = probes[min(len(probes) - 1, int(0.99 * len(probes)))]
        return out

    def _probe(self, name: str, value: Any) -> None:
        if self.probe is not None:
            self.probe(name, value)

    # ------------------------------------------------------------------ action execution
    def _feed(self, event: Any) -> None:
        self._pending.extend(self.sched.handle(event))
        self._drain()

    def _drain(self) -> None:
        if self._draining:
            return  # the outer _drain picks up what this event added
        self._draining = True
        try:
            while self._pending:
                self._execute(self._pending.popleft())
        finally:
            self._draining = False

    def _execute(self, a: Any) -> None:
        if isinstance(a, Dispatch):
            self._spawn(self._run_trajectory(a))
        elif isinstance(a, RequestGroups):
            self._admit(a.count)
        elif isinstance(a, LoadVersion):
            if a.preempt:
                raise AdapterError("preempting loads (mode 'partial') are not supported on slime")
            self._spawn(self._load(a))
        elif isinstance(a, DeliverGroup):
            self._delivered += 1
        elif isinstance(a, StartStep):
            self._batches[a.step] = a.group_ids
            self._changed.set()
            self._probe("batch", self.first_step + a.step)
        elif isinstance(a, ReportGroupFailed):
            logger.error("dora: group %s failed and will not be trained: %s", a.group_id, a.reason)
            # Siblings still running finish into nothing: `_run_trajectory` checks the group is here.
            group = self._pristine.pop(a.group_id, None)
            self._failed.append((a.group_id, a.reason, group[0].prompt if group else None))
            self._groups.pop(a.group_id, None)
            self._finished.pop(a.group_id, None)
            fail = getattr(self.data_source, "dora_fail", None)
            if fail is not None and group is not None:
                fail(_ledger_id(group))
            self._probe("group_failed", a.group_id)
        elif isinstance(a, ReportError):
            logger.warning("dora: %s", a.message)
        elif isinstance(a, Migrate):
            raise AdapterError(f"migration requested on slime, where it is disabled: {a}")
        else:
            raise AdapterError(f"unknown action {a!r}")

    def _admit(self, count: int) -> None:
        groups = self._prefetched[:count]
        del self._prefetched[:count]
        if len(groups) < count:
            groups += list(self.data_source.get_samples(count - len(groups)))
        n = self.sched.n
        for group in groups:
            if len(group) != n:
                raise AdapterError(f"the data source returned a group of {len(group)} samples, expected {n}")
            gid = self._next_gid
            self._next_gid += 1
            self._groups[gid] = list(group)
            self._pristine[gid] = copy.deepcopy(list(group))
            self._feed(GroupAdmitted(gid))
        if len(groups) < count:
            self._feed(DataExhausted())

    def _spawn(self, coro: Any) -> None:
        if self._closed:  # a task whose cancel lost to its answer (3.11's wait_for) starts nothing
            coro.close()
            return
        task = self.loop.create_task(self._guard(coro))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guard(self, coro: Any) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - surfaced to slime by next_batch
            logger.exception("dora: rollout worker error")
            self._fatal = exc
            if self._changed is not None:
                self._changed.set()

    async def _run_trajectory(self, d: Dispatch) -> None:
        gid, idx = d.group_id, d.index
        if gid not in self._groups:
            return  # the group was reported failed while this dispatch was queued
        if d.attempt > 0:
            # A retry starts from the prompt again: nothing of a failed attempt is kept (C1, C2).
            self._groups[gid][idx] = copy.deepcopy(self._pristine[gid][idx])
        self._attempt[(gid, idx)] = d.attempt
        sample = self._groups[gid][idx]
        params = dict(self._params)
        if getattr(self.args, "sglang_enable_deterministic_inference", False):
            # slime's per-sample seed: the sample's index in its group (generate_and_rm_group).
            params["sampling_seed"] = self.args.rollout_seed + idx
        inflight = self._requests.setdefault(d.instance_id, set())
        inflight.add(asyncio.current_task())
        try:
            out = await self.engines.generate(d.instance_id, sample, params)
        except AdapterError:
            raise
        except Exception as exc:  # noqa: BLE001 - one failed request is retried by the scheduler
            inflight.discard(asyncio.current_task())
            if d.instance_id in self.sched.instances:
                # Did the engine die? Then InstanceFailed re-dispatches its trajectories; this failure is stale.
                await self._refresh()
            self._feed(TrajectoryFailed(gid, idx, reason=repr(exc), attempt=d.attempt))
            return
        finally:
            inflight.discard(asyncio.current_task())
        samples = _flat(out)
        if self._attempt.get((gid, idx)) != d.attempt:
            # Superseded (engine declared dead, trajectory re-dispatched): the scheduler ignores it.
            self._feed(TrajectoryFinished(gid, idx, tokens=0, reward=None, attempt=d.attempt))
            return
        if gid not in self._groups:
            # A sibling failed for good and the group was reported (C2): the scheduler needs the slot back.
            self._feed(TrajectoryFinished(gid, idx, tokens=0, reward=None, attempt=d.attempt))
            return
        self._groups[gid][idx] = out
        tag = str(self.first_step + d.version)
        reason = None
        mismatch = False
        for s in samples:
            status = _status(s)
            if status in ("aborted", "failed", "pending"):
                reason = f"the engine returned the sample {status}"
            elif any(str(v) != tag for v in s.weight_versions):
                # C1: every token from the version the group was pinned to. Never trained.
                reason = f"engine reported weight versions {list(s.weight_versions)}, pinned to {tag}"
                mismatch = True
        if reason is not None:
            if mismatch:
                self._probe("version_mismatch", (gid, idx, d.instance_id))
            if mismatch and d.instance_id in self.sched.instances:
                # The engine does not hold what was loaded (restarted at the same address?): refresh, retry.
                await self._refresh()
            self._feed(TrajectoryFailed(gid, idx, reason=reason, attempt=d.attempt))
            return
        for s in samples:
            s.metadata["dora_version"] = self.first_step + d.version
        tokens = sum(int(s.response_length) for s in samples)
        group_rm = bool(getattr(self.args, "group_rm", False))
        reward = None if group_rm else _reward_value(self.args, samples[-1])
        self._feed(TrajectoryFinished(gid, idx, tokens=tokens, reward=reward, attempt=d.attempt))
        if group_rm and gid in self._groups:
            done = self._finished.setdefault(gid, set())
            done.add(idx)
            if len(done) == self.sched.n:
                await self._group_reward(gid)

    async def _group_reward(self, gid: int) -> None:
        from slime.rollout.rm_hub import batched_async_rm

        group = self._groups[gid]
        flat = [_flat(o)[-1] for o in group]
        rewards = await batched_async_rm(self.args, flat)
        if gid not in self._groups:
            return  # reported failed while the reward model ran
        for idx, (s, r) in enumerate(zip(flat, rewards)):
            s.reward = r
            self._feed(RewardReady(gid, idx, _reward_value(self.args, s), attempt=self._attempt[(gid, idx)]))

    async def _load(self, a: LoadVersion) -> None:
        while self.board.poll() <= a.version:
            await asyncio.sleep(self.settings.poll_interval_s)
        while a.instance_id in self._eval_on:
            # slime's eval runs on this engine: load after it, so eval versions are not mixed (R4).
            self._probe("load_waits_for_eval", (a.instance_id, self.first_step + a.version))
            await self._eval_over.wait()
        try:
            await self.engines.load(a.instance_id, str(self.first_step + a.version), self.board.path(a.version))
        except AdapterError:
            raise
        except Exception as exc:
            await self._refresh()
            if a.instance_id in self.sched.instances and not isinstance(exc, EngineGone):
                raise
            return  # the engine died while loading (InstanceFailed told the scheduler), or leaves at a refresh
        if a.instance_id not in self.sched.instances:
            return
        self._feed(InstanceLoaded(a.instance_id, a.version))
        self._probe("loaded", (a.instance_id, self.first_step + a.version))
        # A version older than every instance's and unfinished group's is never loaded again.
        sched = self.sched
        needed = sched.live_versions() + [g.version for g in sched.groups.values() if g.state == "active"]
        floor = min(needed + [sched.newest_version])
        for v in range(floor):
            if v not in self._released:
                self._released.add(v)
                self.board.release(v)

    async def _refresh(self) -> None:
        """Re-read slime's router and the engines' health; tell the scheduler who left or joined.

        Callers share passes: a caller waits for the next pass that starts after its call (one
        that is running may have asked an engine before what the caller saw happened), and every
        caller that arrives while a pass runs shares the one after it. So N trajectories coming
        back with a wrong weight version at once cost at most two passes, not N (each pass asks
        every engine once, concurrently: `SglangEngines.refresh`).
        """
        fut = self._refresh_next
        if fut is None:
            fut = self._refresh_next = self.loop.create_future()
            fut.add_done_callback(_retrieve)
            if self._refresh_runner is None:
                self._refresh_runner = self.loop.create_task(self._run_refreshes())
                self._tasks.add(self._refresh_runner)
                self._refresh_runner.add_done_callback(self._tasks.discard)
                self._refresh_runner.add_done_callback(self._refresh_runner_done)
        # A caller cancelled (its task closed) leaves the pass to the others.
        await asyncio.shield(fut)

    async def _run_refreshes(self) -> None:
        try:
            while self._refresh_next is not None:
                fut, self._refresh_next = self._refresh_next, None
                self.refresh_passes += 1
                try:
                    await self._refresh_pass()
                except asyncio.CancelledError:
                    fut.cancel()
                    raise
                except BaseException as exc:  # noqa: BLE001 - the callers raise it
                    fut.set_exception(exc)
                else:
                    fut.set_result(None)
        finally:
            self._refresh_runner = None
            if self._refresh_next is not None:  # cancelled (closing) with callers waiting
                self._refresh_next.cancel()
                self._refresh_next = None

    def _refresh_runner_done(self, task: asyncio.Task) -> None:
        """A runner cancelled before it ever ran (closing, in the loop turn that created it) never
        reaches its `finally`: its pass is cancelled here, so no caller waits for it forever (a
        caller outside the worker's tasks, such as slime's evaluation, is not cancelled with them)."""
        if self._refresh_runner is task:
            self._refresh_runner = None
            if self._refresh_next is not None:
                self._refresh_next.cancel()
                self._refresh_next = None

    async def _refresh_pass(self) -> None:
        try:
            gone, new = await self.engines.refresh()
        except Exception:  # noqa: BLE001 - the router itself unreachable: try again next time
            logger.warning("dora: could not re-read slime's router", exc_info=True)
            return
        # One batch, so a trajectory moved onto another gone engine is dropped (`without_failed`).
        events: list = []
        reasons = getattr(self.engines, "reasons", {})
        for iid in gone:
            if iid in self.sched.instances:
                reason = reasons.get(iid, "the engine left slime's router or fails /health")
                logger.warning("dora: engine %s is gone (%s); its trajectories go back to their versions", iid, reason)
                events.append(InstanceFailed(iid, reason=reason))
                self.retired += 1
                self._probe("engine_failed", iid)
            for task in self._requests.pop(iid, ()):
                if task is not asyncio.current_task():
                    task.cancel()
        for iid, cap in new:
            logger.info("dora: engine %s joined (capacity %d)", iid, cap)
            events.append(InstanceReady(iid, cap))
            self._probe("engine_joined", iid)
        if events:
            failed = {ev.instance_id for ev in events if isinstance(ev, InstanceFailed)}
            self._pending.extend(without_failed(self.sched.handle_many(events), failed))
            self._drain()

    async def _watch_engines(self) -> None:
        while True:
            await asyncio.sleep(self.settings.engine_check_interval_s)
            await self._refresh()

    async def _watch_weights(self) -> None:
        while True:
            published = self.board.poll()
            sched = self.sched
            while published > sched.newest_version + 1:
                v = sched.newest_version + 1
                if sched.trainer_busy == v - 1:
                    # Weights v exist, so the trainer finished step v - 1 (train.py's order).
                    self._feed(TrainerStepFinished(v - 1))
                if v > sched.step:
                    raise AdapterError(f"version {v} was published before batch {v - 1} was handed out")
                self._feed(VersionPublished(v))
                self._probe("published", self.first_step + v)
            await asyncio.sleep(self.settings.poll_interval_s)


#: Inside a tracked task (see `_tracked`): the set its tasks (and theirs) are added to.
_CHILDREN: contextvars.ContextVar[set | None] = contextvars.ContextVar("dora_children", default=None)
_TRACKING: "weakref.WeakSet[asyncio.AbstractEventLoop]" = weakref.WeakSet()


def _tracked(loop: asyncio.AbstractEventLoop, coro: Any, children: set) -> asyncio.Task:
    """Run `coro` as a task whose own tasks are known (added to `children`), so that cancelling
    it cancels them too: slime's `eval_rollout` starts one task per eval sample
    (`asyncio.create_task`) and awaits them with `as_completed`, which leaves them running when
    it is cancelled. The loop's task factory records every task created in the tracked task's
    context (chained to any factory the loop has)."""
    if loop not in _TRACKING:
        prev = loop.get_task_factory()

        def factory(loop: asyncio.AbstractEventLoop, c: Any, **kw: Any) -> asyncio.Future:
            task = prev(loop, c, **kw) if prev is not None else asyncio.Task(c, loop=loop, **kw)
            tracked = _CHILDREN.get()
            if tracked is not None:
                tracked.add(task)
            return task

        loop.set_task_factory(factory)
        _TRACKING.add(loop)
    ctx = contextvars.copy_context()
    ctx.run(_CHILDREN.set, children)
    return loop.create_task(coro, context=ctx)


def _spread_args(bases: list, children: set) -> Any:
    """slime's args for an evaluation spread over engines: `bases[i]` aims at engine i (slime's
    generate builds its URL from `sglang_router_ip/port`). Each task of the evaluation (one of
    `children`) that reads them is given the next engine, once, when it first reads them: slime
    starts its per-dataset tasks (`asyncio.gather`) before their per-sample ones, so an engine
    chosen when a task is created would be one per dataset. The eval's own task reads the first."""
    chosen: "weakref.WeakKeyDictionary[asyncio.Task, Any]" = weakref.WeakKeyDictionary()
    turn = itertools.cycle(bases)

    def base() -> Any:
        task = asyncio.current_task()
        if task is None or task not in children:
            return bases[0]
        if task not in chosen:
            chosen[task] = next(turn)
        return chosen[task]

    def aimed(name: str) -> property:
        return property(lambda self: getattr(base(), name))

    spread = type("DoraEvalArgs", (type(bases[0]),), {"sglang_router_ip": aimed("sglang_router_ip"),
                                                      "sglang_router_port": aimed("sglang_router_port")})
    a = spread.__new__(spread)
    a.__dict__.update(vars(bases[0]))
    return a


def _cancel_all(tasks: set) -> None:
    for t in list(tasks):
        if not t.done():
            t.cancel()


def _retrieve(fut: asyncio.Future) -> None:
    """Mark a refresh's outcome seen (its callers may all have been cancelled meanwhile)."""
    if not fut.cancelled():
        fut.exception()


def _ledger_id(group: list) -> Any:
    first = _flat(group[0])[0]
    return (first.metadata or {}).get("dora_ledger")
