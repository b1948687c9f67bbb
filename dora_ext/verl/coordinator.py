"""The coordinator: ``dora_ext.core.Scheduler`` inside verl's request router (a Ray actor).

verl routes every generation request through one load-balancer actor
(``verl.workers.rollout.router``): the agent-loop workers' ``LLMServerClient`` calls
``acquire_server(request_id, **fields)`` before each request and ``release_server`` after it.
The coordinator *is* that actor, so the scheduler's decisions are enforced where requests are
placed, with no change to verl's workers:

* a trajectory's first ``acquire_server`` waits until the scheduler dispatches it
  (``Dispatch(group, index, instance, version)``): R1 pinning (the instance holds the group's
  version), R6 frontier-first order and per-instance capacity are the scheduler's;
* later acquires of the same trajectory (multi-turn turns, and resumes after an abort) go to the
  instance the trajectory is on now, which after an R5 ``Migrate`` is the new instance: the
  engine re-prefills there under the same version (C1 kept);
* the first acquire of a moved trajectory routed to its destination is its landing: the
  coordinator answers the ``Migrate`` with ``MigrationLanded`` there (see ``_land``), so R5 may
  move the trajectory again in the same attempt;
* the workers report ``trajectory_done`` / ``reward_ready`` / ``trajectory_failed``;
* the trainer reports ``start``, ``step_finished`` and ``loaded``, takes the batch of each step
  (``step_batch``) and the weight loads and aborts to execute (``take_work``).

Versions seen by verl are weight versions (``global_steps`` of ``update_weights``); the
scheduler counts from 0 at the start of ``fit``, so ``verl = scheduler + base``.

Requests without a group (validation, or a worker that is not dora's) go least-loaded to an
instance holding the newest loaded version among those with no load pending, and do not use
scheduler slots.

A weight load never overtakes a request routed to its instance (C1). ``acquire_server`` counts a
request in flight on its server the moment it routes it, before the request has crossed the Ray
hop to the server; ``release_server`` (verl's client calls it in a ``finally`` once the server
answered, also on an abort or an error) uncounts it, matched to its acquire by ``request_id``
(a late release of an instance removed since, its address serving again, uncounts nothing). A
``LoadVersion`` decided while its instance still counts requests in flight (a trajectory R5
moved off it, or whose end was reported before its release arrived) is *held* (not handed out)
until the count reaches 0, then handed out from that ``release_server``. Otherwise the request
could reach the server behind the load and run under the new version: a resumed trajectory would
span two versions. Ungrouped requests go to an instance with no load pending whenever one is
loaded, so they do not keep a held load waiting. A caller cancelled while its acquire is answered
never releases (verl's ``finally`` starts after the answer): ``DoraLLMServerClient`` releases such
an acquire once it answers. A request never released for another reason (a caller that is not
dora's client) keeps its instance's load held; ``loads_held_now`` in the metrics shows it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from dora_ext.config import DoraConfig
from dora_ext.core import actions as A
from dora_ext.core import events as E

logger = logging.getLogger("dora_ext.verl")


def _report(kind: str, **fields: Any) -> None:
    from .cpu.report import report

    report(kind, **fields)


def plugin_manager() -> Any:
    """dora-ext's pluggy manager (built-in policies plus the ``dora_ext`` entry points), or None.

    None (with a warning) when pluggy or the hook modules are unavailable: the core then uses
    its built-in policies.
    """
    try:
        from dora_ext.plugins import get_plugin_manager
    except Exception as exc:
        logger.warning("dora-ext: pluggy hooks unavailable (%s); using built-in policies", exc)
        return None
    return get_plugin_manager()


class GroupFailedError(RuntimeError):
    """The scheduler gave up on a group (retries exhausted); its trajectories stop."""


class DoraCoordinator:
    """Plain class; ``create_coordinator`` wraps it with ``ray.remote`` (an async actor)."""

    def __init__(self, config: dict[str, Any], servers: dict[str, Any], use_plugins: bool = True) -> None:
        from dora_ext.core.scheduler import Scheduler

        self.config = DoraConfig.from_dict(config)
        if len(servers) != len(self.config.instances):
            raise ValueError(f"{len(servers)} servers but {len(self.config.instances)} instances in the config")
        self.server_ids = list(servers)
        self.handles = dict(servers)
        self.instance_of = {sid: spec.id for sid, spec in zip(self.server_ids, self.config.instances)}
        self.server_of = {iid: sid for sid, iid in self.instance_of.items()}
        plugins = None
        if use_plugins:
            plugins = plugin_manager()
        self.sched = Scheduler(self.config, plugins=plugins)
        self.base = 0
        self.started = False
        self.versions: dict[int, int] = {}  # instance -> loaded scheduler version
        self.inflight: dict[str, int] = {sid: 0 for sid in self.server_ids}
        self.sticky: dict[str, str] = {}  # request_id -> server id (ungrouped requests)
        # (server id, request id) -> instances it was acquired on, oldest first, until released: a
        # release is matched to its acquire, so that a late release of an instance removed since
        # (its address serving again as a new instance), or one never acquired, uncounts nothing.
        self.acquired: dict[tuple[str, Any], list[int]] = {}
        self.route: dict[tuple, int] = {}  # (group, index) -> instance it runs on
        self.waiters: dict[tuple, list[asyncio.Future]] = {}
        self.pool: list[tuple[Any, Any]] = []  # offered (group id, meta), not yet admitted
        self.owed = 0  # groups requested by the scheduler and not yet admitted
        self.steps: dict[int, tuple] = {}
        self.failed: dict[Any, str] = {}
        self.loads: list[tuple[int, int]] = []  # (instance, verl version) to load
        # Loads decided while requests routed to their instance were still in flight: handed out
        # by the release that brings the instance's in-flight count to 0 (see the module docstring).
        self.held: dict[int, list[int]] = {}  # instance -> verl versions
        self.loading: dict[int, int] = {}  # instance -> verl version handed out, not loaded yet
        self.aborts: list[int] = []  # instances whose requests all abort (no per-request abort)
        # (group, index) -> (server id, request id) of its request in flight (per-request aborts)
        self.request_of: dict[tuple, tuple[str, str]] = {}
        self.key_of_request: dict[tuple[str, str], tuple] = {}
        # Requests with an abort sent, in flight or confirmed, until released: a request moved and
        # then failed with its group is aborted once (`_abort`).
        self.aborting: set[tuple[str, str]] = set()
        self.abort_requests = False
        self.log: list[tuple] = []  # (kind, ...) for tests and debugging, bounded
        # (group, index) -> (destination instance, scheduler attempt): moved by R5, not landed yet.
        # At most one entry per running trajectory (cleared on landing, re-dispatch, failure,
        # generation end, group failure or training, and when the destination is removed).
        self.moving: dict[tuple, tuple[int, int]] = {}
        # Every Migrate applied ends as one of: landed, dropped (with its cause), or still pending
        # (``moving``); the scheduler's ``migrations`` is their sum.
        self.counts = {"delivered": 0, "errors": 0, "load_errors": 0, "late_reports": 0,
                       "migrations_landed": 0, "moves_dropped": 0,
                       # loads decided while requests routed to their instance were in flight
                       "loads_held": 0,
                       # ... and handed out once the last of them was released
                       "loads_released": 0,
                       # ... or dropped, their instance removed (held = released + dropped + held now)
                       "held_loads_dropped": 0,
                       # ungrouped requests sent to an instance with a load pending (no other was loaded)
                       "ungrouped_on_pending_load": 0,
                       # releases matching no acquire of the server's current instance: ignored
                       "unmatched_releases": 0}
        self.load_error_text = ""
        self.admitted: dict[Any, int] = {}  # group id -> verl version at admission, until trained
        self.loaders: dict[int, list] = {}  # instance -> rollout worker handles
        self.checks: dict[int, dict] = {}  # instance -> {"server", "address", "store"}: engine checksums
        self.rollout = ""
        self.dtype: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ scheduler plumbing
    def _feed(self, event: Any) -> None:
        self._apply(self.sched.handle(event))

    def _apply(self, actions: list) -> None:
        for act in actions:
            if isinstance(act, A.RequestGroups):
                self.owed += act.count
            elif isinstance(act, A.Dispatch):
                key = (act.group_id, act.index)
                self.route[key] = act.instance_id
                self._drop_move(key, "dispatch")  # a new attempt: no move of the old one can land
                self._record(("dispatch", act.group_id, act.index, act.instance_id, act.version + self.base))
                for fut in self.waiters.pop(key, ()):
                    if not fut.done():
                        fut.set_result(act.instance_id)
            elif isinstance(act, A.LoadVersion):
                if act.preempt:
                    raise RuntimeError("dora: preempting loads (mode 'partial') are verl's own separate_async")
                self._issue_load(act.instance_id, act.version + self.base)
            elif isinstance(act, A.Migrate):
                key = (act.group_id, act.index)
                self._drop_move(key, "moved_again")  # (the scheduler moves no trajectory not landed)
                self._record(("migrate", act.group_id, act.index, act.src, act.dst))
                _report("migrate", group=str(act.group_id), index=act.index, src=act.src, dst=act.dst)
                if self._serving(act.dst):
                    self.route[key] = act.dst
                    self._moved(key, act.dst)
                else:
                    self._unlanded(key, "removed")
                    # Decided in a `remove_servers` batch before its destination was removed in it:
                    # re-queued, its request waits for the new Dispatch (not the removed server).
                    self.route.pop(key, None)
                if self.abort_requests and self._loop is not None:
                    # Abort only the moved trajectory's request on its source (the others there run on);
                    # between two turns nothing is in flight and its next acquire lands.
                    req = self.request_of.get(key)
                    if req is not None and req[0] == self.server_of.get(act.src):
                        self._abort(act.src, req, key)
                elif act.src not in self.aborts:
                    self.aborts.append(act.src)
            elif isinstance(act, A.StartStep):
                self.steps[act.step] = act.group_ids
            elif isinstance(act, A.DeliverGroup):
                self.counts["delivered"] += 1  # verl trains whole batches; kept as a metric
            elif isinstance(act, A.ReportGroupFailed):
                self.failed[act.group_id] = act.reason
                self.admitted.pop(act.group_id, None)
                for idx in range(self.config.group_size):
                    key = (act.group_id, idx)
                    self._drop_move(key, "group_failed")
                    self.route.pop(key, None)  # its acquires raise GroupFailedError
                    # A sibling still generating is wasted and delays verl's failure record (the refill).
                    req = self.request_of.get(key)
                    if req is not None and self.abort_requests and self._loop is not None:
                        self._abort(self.instance_of.get(req[0], -1), req, key)
                _report("group_failed", group=str(act.group_id), reason=str(act.reason)[:300])
                logger.warning("dora: group %s failed: %s", act.group_id, act.reason)
                for key in [k for k in self.waiters if k[0] == act.group_id]:
                    for fut in self.waiters.pop(key):
                        if not fut.done():
                            fut.set_exception(GroupFailedError(act.reason))
            elif isinstance(act, A.ReportError):
                self.counts["errors"] += 1
                logger.warning("dora: %s", act.message)
        self._admit()

    def _issue_load(self, iid: int, verl_version: int) -> None:
        """The scheduler decided to load `verl_version` on instance `iid`: hand it out now, or hold
        it while requests routed to the instance are in flight (see the module docstring)."""
        sid = self.server_of.get(iid)
        busy = self.inflight.get(sid, 0) if self._serving(iid) else 0
        if busy > 0:
            self.held.setdefault(iid, []).append(verl_version)
            self.counts["loads_held"] += 1
            self._record(("load_held", iid, verl_version, busy))
            _report("load_held", instance=iid, version=verl_version, inflight=busy)
            return
        self._hand_out(iid, verl_version)

    def _hand_out(self, iid: int, verl_version: int) -> None:
        """Execute a load: in the coordinator (publishing backends with loaders) or by the trainer
        (``take_work``). Only called while no request routed to `iid` is in flight."""
        self.loading[iid] = verl_version
        self._record(("load_out", iid, verl_version))
        if iid in self.loaders and self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._load(iid, verl_version), self._loop)
        else:
            self.loads.append((iid, verl_version))

    def _load_pending(self, iid: int) -> bool:
        return iid in self.held or iid in self.loading

    def _moved(self, key: tuple, dst: int) -> None:
        """Remember that R5 moved `key` to `dst`, with the attempt it moved in, until it lands.

        The scheduler's view is read after the whole batch: a trajectory that does not run on
        `dst` by then (re-queued later in the same ``remove_servers`` batch) gets no entry (the
        move is counted dropped)."""
        from dora_ext.core.scheduler import ProtocolError

        try:
            t = self.sched.trajectory(*key)
            if t.status == "R" and t.instance == dst:
                self.moving[key] = (dst, t.attempt)
                return
        except (ProtocolError, LookupError):  # its group left the scheduler in the same batch
            pass
        self._unlanded(key, "requeued")

    def _drop_move(self, key: tuple, cause: str) -> None:
        """The pending move of `key` (if any) can no longer land: `cause` ended its attempt."""
        if self.moving.pop(key, None) is not None:
            self._unlanded(key, cause)

    def _unlanded(self, key: tuple, cause: str) -> None:
        self.counts["moves_dropped"] += 1
        self._record(("move_dropped", key[0], key[1], cause))
        _report("move_dropped", group=str(key[0]), index=key[1], cause=cause)

    def _land(self, key: tuple, iid: int) -> None:
        """An acquire of trajectory `key` routed to instance `iid`: if it is the destination of the
        trajectory's pending move, the move has landed (verl's client re-acquires after the abort
        of the source, or the agent loop acquires for its next turn), and the scheduler is told.

        verl's agent loop carries no attempt number; the coordinator sends the scheduler's attempt
        it recorded at the ``Migrate``, and drops the entry on every event that ends that attempt,
        so a landing is never sent for a later attempt (nor for a group no longer live)."""
        entry = self.moving.get(key)
        if entry is None or entry[0] != iid:
            return
        gid, idx = key
        if gid in self.failed or self._late(gid, idx, "migration_landed"):
            self._drop_move(key, "late")
            return
        # Counted landed only if the scheduler takes it: the trajectory runs on `iid` in the attempt
        # it moved in, still marked moved. Otherwise (a bookkeeping slip) the scheduler would count
        # the event stale and keep the trajectory unmovable, and ``migrations_landed`` would lie.
        from dora_ext.core.scheduler import ProtocolError

        try:
            t = self.sched.trajectory(gid, idx)
            takes = t.status == "R" and t.instance == iid and t.attempt == entry[1] and t.moved
        except (ProtocolError, LookupError):
            takes = False
        if not takes:
            logger.warning("dora: landing of %s/%s on instance %s does not match the scheduler's state: dropped",
                           gid, idx, iid)
            self._drop_move(key, "stale")
            return
        del self.moving[key]
        self.counts["migrations_landed"] += 1
        self._record(("landed", gid, idx, iid))
        _report("landed", group=str(gid), index=idx, instance=iid, attempt=entry[1])
        self._feed(E.MigrationLanded(gid, idx, entry[1]))

    def _admit(self) -> None:
        while self.owed > 0 and self.pool:
            gid, meta = self.pool.pop(0)
            self.owed -= 1
            self._record(("admit", gid, self.sched.newest_version + self.base))
            self.admitted[gid] = self.sched.newest_version + self.base
            _report("admit", group=str(gid), version=self.sched.newest_version + self.base)
            self._apply(self.sched.handle(E.GroupAdmitted(gid, meta)))

    def _record(self, item: tuple) -> None:
        self.log.append(item)
        if len(self.log) > 100_000:
            del self.log[: len(self.log) // 2]

    # ------------------------------------------------------------------ trainer side
    def set_loaders(self, loaders: dict[int, list], checks: dict[int, dict] | None = None, rollout: str = "",
                    abort_requests: bool = False, dtype: str | None = None) -> None:
        """Rollout workers per instance: loads are then run here, each ``update_weights(global_steps=v)``
        on the instance's workers (``dora_store`` fetches ``v`` from the node's store), without the
        trainer. With `checks` (instance -> its server handle, address and node store) each load is
        then verified: the engine's checksum of what it holds must be the one published for ``v``
        (``weights.engine_checksum``), else the load is refused and the run stops. With
        `abort_requests` an R5 move aborts only the moved trajectory's request on its source
        (``abort_request``, verl's client passes the request id through: ``DoraLLMServerClient``),
        not every request there."""
        self.abort_requests = bool(abort_requests)
        self.loaders = {int(k): list(v) for k, v in loaders.items()}
        self.checks = {int(k): dict(v) for k, v in (checks or {}).items()}
        self.rollout = str(rollout)
        self.dtype = dtype  # the engine's weight dtype: both checksums round to it (weights.checksum)

    async def _load(self, instance: int, verl_version: int) -> None:
        try:
            await asyncio.gather(*[w.update_weights.remote(global_steps=verl_version) for w in self.loaders[instance]])
            if instance in self.checks:
                await self._check_load(instance, verl_version)
        except Exception as exc:  # surfaced to the trainer by take_work(); the instance stays unloaded
            self.counts["load_errors"] += 1
            self.load_error_text = f"instance {instance} version {verl_version}: {exc}"[:1500]
            logger.error("dora: load failed: %s", self.load_error_text)
            if self.loading.get(instance) == verl_version:
                del self.loading[instance]
            return
        self.loaded([instance], verl_version)

    def _abort(self, instance: int, req: tuple[str, str], key: tuple) -> None:
        """Start `req`'s abort (`_abort_request`) unless one was sent and the request has not come
        back since: a trajectory moved (R5) whose group then fails is aborted once, not twice."""
        if req not in self.aborting:
            self.aborting.add(req)
            asyncio.run_coroutine_threadsafe(self._abort_request(instance, req, key), self._loop)

    async def _abort_request(self, instance: int, req: tuple[str, str], key: tuple) -> None:
        """Abort request `req` (server id, request id) of trajectory `key` alone. It may reach the
        engine before the request (they travel on different paths), which ignores an unknown id
        (vLLM, ``dora_cpu``: "not found"; SGLang: 200 either way). So it is sent again, backing off,
        until the engine confirms it, this acquire is released, or its server is removed (a dead
        worker releases nothing: no endless calls on a removed server). ``tries`` counts sends."""
        from .weights import abort_request

        out, tries, delay = {"aborted": False}, 0, 0.01
        while self.request_of.get(key) is req and req[0] in self.instance_of:  # (not a later turn's tuple)
            tries += 1
            try:
                out = await abort_request(self.rollout, self.handles[req[0]], *req)
            except Exception as exc:  # (a dead server fails the request, which is then released)
                out = {"aborted": False, "error": repr(exc)[:300]}
            if out.get("aborted") and out.get("confirmed", True):
                break
            await asyncio.sleep(delay)
            delay = min(2 * delay, 0.5)
        if not (out.get("aborted") and out.get("confirmed", True)) or self.request_of.get(key) is not req:
            self.aborting.discard(req)  # (confirmed, it stays marked until its release)
        self._record(("abort_request", instance, req[1], bool(out.get("aborted"))))
        _report("abort_request", instance=instance, request_id=req[1], aborted=bool(out.get("aborted")), key=key,
                tries=tries)

    async def _check_load(self, instance: int, verl_version: int, initial: bool = False) -> None:
        from .weights import WeightsMismatch, engine_checksum

        c = self.checks[instance]
        published, names = await c["store"].evidence.remote(verl_version)
        got = await engine_checksum(self.rollout, c["server"], c["address"], names, c["store"],
                                    f"{instance}_{verl_version}_{uuid.uuid4().hex[:12]}", self.dtype)
        newest = self.sched.newest_version + self.base
        _report("load_checked", instance=instance, version=verl_version, checksum=got, published=published,
                newest=newest, replicas=len(self.server_ids), loading=sorted(self.loading), tensors=len(names),
                initial=initial)
        if got != published:
            raise WeightsMismatch(
                f"the engine of instance {instance} holds weights with checksum {got} after loading version "
                f"{verl_version}, published with {published} (over {len(names)} sampled tensors): refused, the "
                "replica is not marked loaded. The engine did not apply the weights it was sent: keep "
                "actor_rollout_ref.rollout.checkpoint_engine.backend=dora_store and check that the rollout "
                "(actor_rollout_ref.rollout.name) serves actor_rollout_ref.model.path")

    async def check_loaded(self, verl_version: int) -> None:
        """Every checked engine must hold `verl_version` (verl's first sync, ``on_init_end``, loads
        all replicas itself): raises ``WeightsMismatch`` naming the first instance that does not."""
        await asyncio.gather(*[self._check_load(i, int(verl_version), initial=True) for i in sorted(self.checks)])

    async def start(self, base_version: int = 0, preloaded: bool = True) -> None:
        """Start the scheduler. `preloaded`: verl already loaded `base_version` on every replica."""
        self._loop = asyncio.get_running_loop()
        self.base = int(base_version)
        self.started = True
        acts = self.sched.start()
        if preloaded:
            initial = [a for a in acts if isinstance(a, A.LoadVersion) and a.version == 0]
            acts = [a for a in acts if a not in initial]
            self._apply(acts)
            for a in initial:
                self.versions[a.instance_id] = 0
                self._feed(E.InstanceLoaded(a.instance_id, 0))
        else:
            self._apply(acts)

    def offer(self, group_ids: list, metas: list | None = None) -> int:
        """Prompts the trainer submitted (verl ``uid``\\ s); admitted when the scheduler asks."""
        metas = metas or [None] * len(group_ids)
        self.pool.extend(zip(group_ids, metas))
        if self.started:
            self._admit()
        return len(self.pool)

    def step_batch(self, step: int) -> list | None:
        """The group ids of trainer step `step` (a verl version index), or None if not formed yet."""
        gids = self.steps.get(step - self.base)
        return None if gids is None else list(gids)

    def step_finished(self, actor_version: int) -> None:
        """The actor finished the step that produced `actor_version` (verl units)."""
        k = actor_version - 1 - self.base
        for gid in self.steps.pop(k, ()):
            self.admitted.pop(gid, None)
            for idx in range(self.config.group_size):
                self.route.pop((gid, idx), None)
                self._drop_move((gid, idx), "trained")
        self._feed(E.TrainerStepFinished(k))
        self._feed(E.VersionPublished(k + 1))

    def take_work(self) -> dict[str, list]:
        """Weight loads ``[(instance, verl version)]`` and instances to abort (R5) to execute now."""
        work = {"load": self.loads, "abort": self.aborts}
        if self.load_error_text:
            work["error"] = self.load_error_text  # a failed or refused load: the trainer stops
        self.loads, self.aborts = [], []
        return work

    def loaded(self, instances: list[int], verl_version: int) -> None:
        for iid in instances:
            if self.loading.get(iid) == verl_version:
                del self.loading[iid]
            if self._serving(iid):
                self.versions[iid] = verl_version - self.base
            # else a late answer for a server removed since (its address may serve again under a
            # new instance id that loaded nothing yet): not recorded, and the scheduler counts it stale.
            self._record(("loaded", iid, verl_version))
            self._feed(E.InstanceLoaded(iid, verl_version - self.base))

    def _serving(self, iid: int) -> bool:
        """Instance `iid` is its server's current instance (not removed, nor replaced by a later
        ``add_servers`` of the same address)."""
        sid = self.server_of.get(iid)
        return sid is not None and self.instance_of.get(sid) == iid

    def metrics(self) -> dict[str, Any]:
        m = self.sched.metrics()
        m.update(self.counts)
        m["load_error_text"] = self.load_error_text
        m["pool"] = len(self.pool)
        m["waiting_requests"] = sum(len(v) for v in self.waiters.values())
        m["moves_not_landed"] = len(self.moving)
        m["loads_held_now"] = sum(len(v) for v in self.held.values())
        return m

    def checkpoint_state(self) -> dict[str, Any]:
        """What verl's checkpoint keeps of the coordinator (``dora_state.json``): the groups admitted
        and not trained (by the steps finished so far), the base version, the scheduler snapshot.

        Moves not landed yet (``moving``) are not kept: a resumed run starts a new scheduler, under
        which every untrained group is generated again (``DoraTrainer._prepare_resume``)."""
        import time

        # "time": admissions reported (``admit``) after this instant are not in this state.
        return {"base": self.base, "time": time.time(), "admitted": [str(g) for g in self.admitted],
                "failed": {str(g): r for g, r in self.failed.items()}, "scheduler": self.sched.snapshot()}

    def get_log(self) -> list[tuple]:
        return list(self.log)

    # ------------------------------------------------------------------ worker side
    def _late(self, group_id: Any, index: int, kind: str) -> bool:
        """A report for a group that is no longer live: already trained (its step finished) or
        never admitted here. verl's agent loop carries no attempt number, so the scheduler could
        not tell such a report from a current one and would stop the run with a ProtocolError;
        it is counted (``late_reports``) and dropped instead."""
        if group_id in self.admitted:
            return False
        self.counts["late_reports"] += 1
        self._record(("late", kind, group_id, index))
        logger.warning("dora: %s for group %s index %s, which is not live (trained or unknown): ignored",
                       kind, group_id, index)
        return True

    def _status_in_failed_group(self, group_id: Any, index: int) -> str | None:
        """The scheduler's status letter of a trajectory of a group it gave up on, or None once the
        group left it. Its trajectories that were running when it failed stay in the scheduler,
        holding their slots, until their end is reported (``_retire``): these reports must reach
        it, else the slots leak for the rest of the run (the instance never drains, so it never
        loads a newer version, and R5 moves the ghost, a move that can never land)."""
        from dora_ext.core.scheduler import ProtocolError

        try:
            return self.sched.trajectory(group_id, index).status
        except (ProtocolError, LookupError):
            return None

    def trajectory_done(self, group_id: Any, index: int, tokens: int, reward: float | None = None) -> None:
        # Generation is over: an aborted last request may come back finished (its token budget
        # was used up, or the abort came after its end) with no re-acquire on the destination.
        self._drop_move((group_id, index), "done")
        if group_id in self.failed:
            if self._status_in_failed_group(group_id, index) == "R":  # frees its slot (see above)
                self._feed(E.TrajectoryFinished(group_id, index, int(tokens), reward=reward))
            return
        if self._late(group_id, index, "trajectory_done"):
            return
        self._feed(E.TrajectoryFinished(group_id, index, int(tokens), reward=reward))

    def reward_ready(self, group_id: Any, index: int, reward: float | None) -> None:
        if group_id in self.failed:
            if self._status_in_failed_group(group_id, index) == "F":  # awaiting it: retired
                self._feed(E.RewardReady(group_id, index, reward))
            return
        if self._late(group_id, index, "reward_ready"):
            return
        self._feed(E.RewardReady(group_id, index, reward))

    def trajectory_failed(self, group_id: Any, index: int, reason: str = "") -> str:
        """Report a failed trajectory; returns "retry" (run it again) or "failed" (give up)."""
        self._drop_move((group_id, index), "failed")  # its next run is a new attempt
        if group_id in self.failed:
            if self._status_in_failed_group(group_id, index) in ("R", "F"):  # retired, slot freed
                self.route.pop((group_id, index), None)
                self._feed(E.TrajectoryFailed(group_id, index, reason))
            return "failed"
        if self._late(group_id, index, "trajectory_failed"):
            return "failed"
        self.route.pop((group_id, index), None)
        self._feed(E.TrajectoryFailed(group_id, index, reason))
        return "failed" if group_id in self.failed else "retry"

    # ------------------------------------------------------------------ verl's load-balancer API
    def require_acquire_fields(self) -> list[str]:
        return ["dora_group", "dora_index", "dora_validate"]

    def require_release_fields(self) -> list[str]:
        return ["request_id"]  # matches each release to its acquire (``release_server``)

    async def acquire_server(self, request_id: str, dora_group: Any = None, dora_index: int | None = None,
                             dora_validate: bool = False, **_: Any) -> tuple[str, Any]:
        if dora_group is None or dora_validate:
            sid = self._ungrouped(request_id)
        else:
            key = (dora_group, int(dora_index))
            if dora_group in self.failed:
                raise GroupFailedError(self.failed[dora_group])
            iid = self.route.get(key)
            while iid is None:
                fut = asyncio.get_running_loop().create_future()
                self.waiters.setdefault(key, []).append(fut)
                await fut
                # Between its Dispatch and this task's resumption the group may have failed (its
                # request must not run), the trajectory moved (R5: it goes where it runs now), or
                # the Dispatch been voided (its instance removed, the trajectory re-queued): it then
                # waits for the next one. (Sent to the removed server, it failed there, and the
                # failure report for a trajectory the scheduler holds queued was a ProtocolError.)
                if dora_group in self.failed:
                    raise GroupFailedError(self.failed[dora_group])
                iid = self.route.get(key)
            self._land(key, iid)
            sid = self.server_of[iid]
            self.request_of[key] = (sid, request_id)
            self.key_of_request[(sid, request_id)] = key
        self.inflight[sid] += 1
        self.acquired.setdefault((sid, request_id), []).append(self.instance_of[sid])
        return sid, self.handles[sid]

    def _ungrouped(self, request_id: str) -> str:
        """Least-loaded among the instances holding the newest loaded version, preferring those
        with no load pending (held or handed out): there a request could keep a held load waiting,
        or meet the load before it starts. When every loaded instance has one it goes to them as
        before (counted, ``ungrouped_on_pending_load``): it never waits, since the trainer may be
        waiting for it (validation) and not executing loads. Validation is not a trajectory of the
        scheduler: C1 is not promised for it (verl's own sync aborts and resumes it across versions)."""
        loaded = {i: v for i, v in self.versions.items() if self._serving(i)}
        if not loaded:
            raise RuntimeError("No available servers in load balancer")
        free = {i: v for i, v in loaded.items() if not self._load_pending(i)}
        pool = free or loaded
        sid = self.sticky.get(request_id)
        # (Its address may serve a new instance since, with nothing loaded yet: then not sticky.)
        if sid is not None and sid in self.inflight and self.instance_of[sid] in pool:
            if not free:
                self.counts["ungrouped_on_pending_load"] += 1
            return sid
        if not free:
            self.counts["ungrouped_on_pending_load"] += 1
        newest = max(pool.values())
        candidates = [self.server_of[i] for i, v in pool.items() if v == newest]
        sid = min(candidates, key=lambda s: self.inflight[s])
        self.sticky[request_id] = sid
        if len(self.sticky) > 10_000:
            self.sticky.pop(next(iter(self.sticky)))
        return sid

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        """verl's client releases each acquire once its request came back (``finally``: also after
        an abort or an error). The release that ends the last request in flight on an instance
        hands out the loads held for it.

        A release uncounts only an acquire of the server's current instance that it matches (by
        ``request_id``; verl's clients send it, ``require_release_fields``): a late release of an
        instance removed since, whose address serves again as a new instance, must not end the new
        instance's requests early (a held load would go out under a request in flight there), nor
        may a release no acquire made. Such releases are counted (``unmatched_releases``)."""
        iid = self.instance_of.get(server_id)
        key = (server_id, request_id)
        traj = self.key_of_request.pop(key, None)
        if traj is not None and self.request_of.get(traj) == key:
            del self.request_of[traj]
        self.aborting.discard(key)
        if request_id is None and key not in self.acquired:
            # A caller that does not send request ids: any acquire of the current instance.
            key = next((k for k, iids in self.acquired.items() if k[0] == server_id and iid in iids), key)
        iids = self.acquired.get(key)
        if not iids:
            self._unmatched(server_id, request_id, "no acquire")
            return
        # Releases of one request id come in the order of its acquires (verl's client releases a
        # request before it re-acquires): this one is for the oldest acquire not released yet.
        if request_id is None and iid in iids:
            iids.remove(iid)
        elif iids.pop(0) != iid:
            self._unmatched(server_id, request_id, "instance removed")
            iid = None
        if not iids:
            del self.acquired[key]
        if iid is None or self.inflight.get(server_id, 0) <= 0:
            return
        self.inflight[server_id] -= 1
        if self.inflight[server_id] == 0:
            for version in self.held.pop(iid, []):
                self.counts["loads_released"] += 1
                self._hand_out(iid, version)

    def _unmatched(self, server_id: str, request_id: Any, why: str) -> None:
        self.counts["unmatched_releases"] += 1
        self._record(("unmatched_release", server_id, request_id, why))

    def add_servers(self, servers: dict[str, Any]) -> None:
        for sid, handle in servers.items():
            iid = max(self.server_of, default=-1) + 1
            self.handles[sid] = handle
            self.inflight[sid] = 0
            self.instance_of[sid], self.server_of[iid] = iid, sid
            self._feed(E.InstanceReady(iid, self.config.instances[0].capacity))

    def remove_servers(self, server_ids: list[str]) -> None:
        # One batch: a trajectory re-dispatched from one removed server onto another removed in
        # the same call is not routed there (`without_failed` drops actions for the removed ones).
        events = []
        for sid in server_ids:
            iid = self.instance_of.pop(sid, None)
            self.inflight.pop(sid, None)
            if iid is not None:
                self.versions.pop(iid, None)
                self.loading.pop(iid, None)
                for version in self.held.pop(iid, []):  # the instance is gone: nothing to load
                    self.counts["held_loads_dropped"] += 1
                    self._record(("load_dropped", iid, version))
                events.append(E.InstanceFailed(iid, "removed from the load balancer"))
        if events:
            # A request for a trajectory of a removed server waits for its re-dispatch (it had
            # been routed to the removed server and failed on its missing in-flight count).
            gone = {ev.instance_id for ev in events}
            for key in [k for k, iid in self.route.items() if iid in gone]:
                del self.route[key]
            for key in [k for k, (dst, _) in self.moving.items() if dst in gone]:
                self._drop_move(key, "removed")  # re-queued by the scheduler: its next Dispatch is a new attempt
            from dora_ext.core.actions import without_failed

            self._apply(without_failed(self.sched.handle_many(events), gone))

    def get_all_servers(self) -> list[str]:
        return list(self.inflight)

    def get_inflight_count(self, server_id: str) -> int:
        return self.inflight.get(server_id, 0)

    def get_total_inflight(self) -> int:
        return sum(self.inflight.values())

    def clear_sticky_cache(self) -> dict:
        cleared = len(self.sticky)
        self.sticky.clear()
        return {"cleared_entries": cleared, "server_loads": dict(self.inflight)}

    def get_status(self) -> dict:
        return {
            "servers": dict(self.inflight),
            "total_inflight": sum(self.inflight.values()),
            "active_servers": len(self.inflight),
            "registered_handles": list(self.handles),
            "versions": {self.server_of[i]: v + self.base for i, v in self.versions.items()},
        }


def create_coordinator(config: DoraConfig, servers: dict[str, Any], *, name: str | None = None) -> Any:
    """Start the coordinator actor for `servers` (``{address: server actor handle}``)."""
    import ray

    opts: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 100_000}
    if name:
        opts["name"] = name
    return ray.remote(DoraCoordinator).options(**opts).remote(config.to_dict(), servers)
