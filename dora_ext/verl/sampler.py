"""``DoraReplayBuffer``: the ``trainer.v1.sampler.custom_sampler`` of trainer mode ``dora``.

It reads group state from TransferQueue exactly as verl's own replay buffer does (prompt keys
``{uid}`` with a ``status`` tag, trajectory keys ``{uid}_{session}_{index}``) and implements R3:

* only complete groups are taken (status ``finished``);
* the step takes every group that is due (version <= k - K, the mandatory set) and never trains a
  group beyond its deadline: a completed group is taken only if, afterwards, every group still
  waiting (pending, running or completed) can be trained by its deadline in the remaining slots
  of this and the following steps (an earliest-deadline-first test, as in ``dora_ext.core``).
  When no completed group passes the test the sampler *waits* for the older running group
  instead of dropping anything, and the wait is measured;
* among the groups that pass, oldest version first, then completion order;
* nothing is ever evicted for staleness (C2); a group whose rollout failed is evicted, replaced
  through ``refill_fn`` and counted (verl's ``training/rollout_failure/evicted_samples`` and
  ``dora/failed_groups``), never silently lost.

Versions are verl weight versions (the ``global_steps`` stamped by ``update_weights``): step
``global_steps = g`` trains with the weights of version ``g - 1`` and publishes ``g``, so the
staleness of a group of version ``v`` trained at ``g`` is ``g - 1 - v``. A group's version is,
in order: the ``dora_version`` tag the coordinator writes when it admits the group, the oldest
``min_global_steps`` of its trajectories (the version that generated its oldest tokens), or
``global_steps - 1`` of its prompt tag (the newest version when it was submitted).

``select_groups`` is the selection as a pure function (no TransferQueue, no clock) so that the
rule is tested on its own.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

logger = logging.getLogger("dora_ext.verl")

SAMPLER_KWARGS = ("max_staleness", "step_batch_size", "poll_interval", "max_wait_s")


@dataclass(frozen=True)
class GroupState:
    """What the sampler knows of one admitted group."""

    uid: str
    version: int
    complete: bool
    order: int  # completion order for complete groups, admission order otherwise


@dataclass(frozen=True)
class Selection:
    """``uids`` to train now, or ``uids == ()`` and ``waiting_for`` the groups that block."""

    uids: tuple[str, ...]
    waiting_for: tuple[str, ...] = ()
    mandatory: int = 0


def _feasible(counts: dict[int, int], step: int, K: int, B: int, slots_after: int) -> bool:
    """Can the groups in `counts` (version -> count) all meet their deadlines ``version + K``
    with `slots_after` slots left in step `step` and `B` in each later step?"""
    cum = 0
    for v in sorted(counts):
        c = counts[v]
        if c <= 0:
            continue
        cum += c
        if cum > slots_after + max(v + K - step, 0) * B:
            return False
    return True


def select_groups(
    groups: Iterable[GroupState], *, step: int, K: int, size: int, slots_left: int, step_size: int
) -> Selection:
    """R3 for step `step` (a version index): pick up to `size` complete groups, or say what blocks.

    `slots_left` is how many groups the step still takes (>= size; more when the step is sampled in
    several mini-batches) and `step_size` the groups per step (B). Returns a full selection of
    `size` groups or an empty one with the uids it waits for.
    """
    groups = list(groups)
    counts: dict[int, int] = {}
    for g in groups:
        counts[g.version] = counts.get(g.version, 0) + 1
    mandatory = sum(1 for g in groups if g.version <= step - K)
    candidates = sorted((g for g in groups if g.complete), key=lambda g: (g.version, g.order))
    chosen: list[str] = []
    slots = slots_left
    for g in candidates:
        if len(chosen) == size:
            break
        counts[g.version] -= 1
        if not _feasible(counts, step, K, step_size, slots - 1):
            counts[g.version] += 1
            break  # a newer candidate cannot be more feasible than this older one
        chosen.append(g.uid)
        slots -= 1
    if len(chosen) == size:
        return Selection(tuple(chosen), (), mandatory)
    chosen_set = set(chosen)
    # Block on the oldest incomplete groups: those are what an older-first step needs next.
    blocking = sorted(
        (g for g in groups if not g.complete and g.uid not in chosen_set), key=lambda g: (g.version, g.order)
    )
    return Selection((), tuple(g.uid for g in blocking[: max(size - len(chosen), 1)]), mandatory)


def group_version(prompt_tag: dict, trajectory_tags: Sequence[dict]) -> int:
    """The weight version of a group (see the module docstring for the order of sources)."""
    if prompt_tag.get("dora_version") is not None:
        return int(prompt_tag["dora_version"])
    starts = [int(t["min_global_steps"]) for t in trajectory_tags if t.get("min_global_steps") is not None]
    if starts:
        return min(starts)
    return int(prompt_tag.get("global_steps", 1)) - 1


class DoraReplayBuffer:
    """R3 over TransferQueue; constructed by verl's ``PPOTrainer._build_replay_buffer``.

    ``sampler_kwargs`` (``trainer.v1.sampler.sampler_kwargs``, filled by the dora trainer):
    ``max_staleness`` (K), ``step_batch_size`` (groups per weight version, default: the
    ``batch_size`` of each ``sample`` call), ``poll_interval`` (seconds between TransferQueue
    polls, default 0.2), ``max_wait_s`` (raise instead of waiting longer; default: wait forever).

    ``step_source`` (set by the dora trainer when the coordinator runs ``dora_ext.core``): a
    callable ``step -> list of uids or None`` returning the scheduler's batch for that step; the
    sampler then materialises those groups instead of choosing. ``on_wait`` is called on every
    poll while the sampler waits (the trainer loads weights on drained replicas meanwhile).
    """

    def __init__(
        self,
        trainer_mode: str,
        trainer_config: Any,
        max_off_policy_threshold: int | None,
        max_off_policy_strategy: str,
        sampler_kwargs: Any,
        refill_fn: Callable[[int], int] | None = None,
        **_ignored: Any,
    ) -> None:
        from dora_ext.config import ConfigError

        kwargs = dict(sampler_kwargs or {})
        for key in kwargs:
            if key not in SAMPLER_KWARGS:
                raise ConfigError(
                    f"trainer.v1.sampler.sampler_kwargs.{key}", f"unknown key; accepted: {', '.join(SAMPLER_KWARGS)}"
                )
        K = kwargs.get("max_staleness")
        if K is None:
            # verl's threshold counts versions spanned (staleness + 1).
            K = (max_off_policy_threshold - 1) if max_off_policy_threshold else 0
        if isinstance(K, bool) or not isinstance(K, int) or K < 0:
            raise ConfigError("trainer.v1.sampler.sampler_kwargs.max_staleness", f"expected an integer >= 0, got {K!r}")
        self.trainer_mode = trainer_mode
        self.max_staleness = K
        self.step_batch_size = kwargs.get("step_batch_size")
        self.poll_interval = float(kwargs.get("poll_interval", 0.2))
        self.max_wait_s = kwargs.get("max_wait_s")
        self.refill_fn = refill_fn
        self.step_source: Callable[[int], Sequence[str] | None] | None = None
        self.on_wait: Callable[[], None] | None = None
        self._completion: dict[str, int] = {}  # uid -> completion order
        self._seen: dict[str, int] = {}  # uid -> admission order (first seen)
        self._trained: set[str] = set()
        self._taken_in_step: dict[int, int] = {}
        self._from_source: dict[int, list[str]] = {}
        self.totals = {"duplicated": 0, "failed_groups": 0, "c3_violations": 0, "dropped": 0}

    # ------------------------------------------------------------------ TransferQueue view
    def _snapshot(self, partition_id: str) -> tuple[dict[str, dict], dict[str, list[tuple[str, dict]]]]:
        """(prompt uid -> tag, prompt uid -> [(trajectory key, tag)]) of one partition."""
        import transfer_queue as tq

        data = tq.kv_list(partition_id) or {}
        items = data.get(partition_id, {})
        prompts: dict[str, dict] = {}
        trajs: dict[str, list[tuple[str, dict]]] = {}
        for key, tag in items.items():
            if tag.get("is_prompt", False):
                prompts[key] = tag
            else:
                trajs.setdefault(key.split("_", 1)[0], []).append((key, tag))
        for uid in prompts:
            if uid not in self._seen:
                self._seen[uid] = len(self._seen)
        return prompts, trajs

    def _states(self, prompts: dict[str, dict], trajs: dict[str, list]) -> list[GroupState]:
        out = []
        for uid, tag in prompts.items():
            status = tag.get("status")
            if status == "failure":
                continue
            complete = status == "finished"
            if complete and uid not in self._completion:
                self._completion[uid] = len(self._completion)
            version = group_version(tag, [t for _, t in trajs.get(uid, ())])
            order = self._completion[uid] if complete else self._seen[uid]
            out.append(GroupState(uid, version, complete, order))
        return out

    def _evict_failed(self, partition_id: str, prompts: dict[str, dict], trajs: dict[str, list]) -> int:
        import transfer_queue as tq

        failed = [uid for uid, tag in prompts.items() if tag.get("status") == "failure"]
        if not failed:
            return 0
        keys = failed + [k for uid in failed for k, _ in trajs.get(uid, ())]
        tq.kv_clear(keys=keys, partition_id=partition_id)
        for uid in failed:
            prompts.pop(uid, None)
            trajs.pop(uid, None)
        logger.warning("dora sampler: %d group(s) failed in rollout; evicted, reported and replaced", len(failed))
        if partition_id != "val" and self.refill_fn is not None:
            self.refill_fn(len(failed))
        return len(failed)

    def _materialize(self, partition_id: str, uids: Sequence[str], trajs: dict[str, list]):
        import transfer_queue as tq
        from transfer_queue import KVBatchMeta

        tq.kv_clear(keys=list(uids), partition_id=partition_id)
        keys, tags = [], []
        for uid in uids:
            for key, tag in sorted(trajs.get(uid, ()), key=lambda kt: kt[0]):
                keys.append(key)
                tags.append(tag)
        return KVBatchMeta(partition_id=partition_id, keys=keys, tags=tags)

    # ------------------------------------------------------------------ verl's sampler API
    def get_sampleable_count(self, global_steps: int, partition_id: str) -> int:
        prompts, _ = self._snapshot(partition_id)
        return sum(1 for tag in prompts.values() if tag.get("status") == "finished")

    def wait_for_sampleable(self, global_steps: int, partition_id: str, target_count: int) -> tuple[set, dict]:
        while True:
            prompts, _ = self._snapshot(partition_id)
            done = {uid for uid, tag in prompts.items() if tag.get("status") == "finished"}
            if len(done) >= target_count:
                return done, {}
            self._pause()

    def _pause(self) -> None:
        if self.on_wait is not None:
            self.on_wait()
        time.sleep(self.poll_interval)

    def sample(self, global_steps: int, partition_id: str, batch_size: int):
        """Return ``(KVBatchMeta, metrics)`` with `batch_size` complete groups for step `global_steps`."""
        if partition_id == "val":
            return self._sample_val(partition_id, batch_size)
        step = global_steps - 1  # the version the trainer holds while it trains this step
        K = self.max_staleness
        B = int(self.step_batch_size or batch_size)
        taken = self._taken_in_step.get(global_steps, 0)
        start = time.perf_counter()
        waited_for_older = 0
        failed = 0
        while True:
            prompts, trajs = self._snapshot(partition_id)
            failed += self._evict_failed(partition_id, prompts, trajs)
            states = self._states(prompts, trajs)
            if self.step_source is not None:
                sel = self._from_scheduler(step, batch_size, states)
            else:
                sel = select_groups(states, step=step, K=K, size=batch_size, slots_left=B - taken, step_size=B)
            if sel.uids:
                break
            if any(s.complete for s in states):
                waited_for_older += 1
            if self.max_wait_s is not None and time.perf_counter() - start > float(self.max_wait_s):
                raise TimeoutError(
                    f"dora sampler: step {global_steps} waited {self.max_wait_s}s for groups "
                    f"{list(sel.waiting_for)[:8]}"
                )
            self._pause()
        self._taken_in_step = {global_steps: taken + len(sel.uids)}
        by_uid = {s.uid: s for s in states}
        staleness = [step - by_uid[u].version for u in sel.uids]
        dup = sum(1 for u in sel.uids if u in self._trained)
        self._trained.update(sel.uids)
        c3 = sum(1 for s in staleness if s > K or s < 0)
        if c3:
            logger.warning(
                "dora sampler: %d group(s) trained beyond max_staleness=%d at step %d (admission exceeded the R2 "
                "budget: keep num_warmup_batches <= max_staleness)", c3, K, global_steps,
            )
        self.totals["duplicated"] += dup
        self.totals["failed_groups"] += failed
        self.totals["c3_violations"] += c3
        spans = [
            (t.get("min_global_steps"), t.get("max_global_steps")) for u in sel.uids for _, t in trajs.get(u, ())
        ]
        multi = sum(1 for lo, hi in spans if lo is not None and hi is not None and lo != hi)
        pending_versions = {s.version for s in states if s.uid not in set(sel.uids)}
        metrics: dict[str, Any] = {
            "dora/staleness_mean": sum(staleness) / len(staleness),
            "dora/staleness_max": max(staleness),
            "dora/mandatory_groups": sel.mandatory,
            "dora/sample_wait_s": time.perf_counter() - start,
            "dora/waited_for_older": waited_for_older,
            "dora/dropped": self.totals["dropped"],
            "dora/duplicated": self.totals["duplicated"],
            "dora/failed_groups": self.totals["failed_groups"],
            "dora/c3_violations": self.totals["c3_violations"],
            "dora/c2_ok": float(self.totals["duplicated"] == 0 and self.totals["dropped"] == 0),
            "dora/c3_ok": float(self.totals["c3_violations"] == 0),
            "dora/multi_version_trajectory_share": multi / len(spans) if spans else 0.0,
            "dora/live_versions": len(pending_versions | {by_uid[u].version for u in sel.uids}),
        }
        for s in sorted(set(staleness)):
            metrics[f"dora/staleness_hist/{s}"] = staleness.count(s)
        if failed:
            metrics["training/rollout_failure/evicted_samples"] = failed
        return self._materialize(partition_id, sel.uids, trajs), metrics

    def _from_scheduler(self, step: int, size: int, states: list[GroupState]) -> Selection:
        """Hand out the scheduler's batch for `step` in chunks of `size`, once each is complete."""
        if step not in self._from_source:
            uids = self.step_source(step) if self.step_source is not None else None
            if uids is None:
                return Selection((), ())
            self._from_source = {step: list(uids)}
        queue = self._from_source[step]
        complete = {s.uid for s in states if s.complete}
        chunk = queue[:size]
        missing = [u for u in chunk if u not in complete]
        if missing:
            return Selection((), tuple(missing))
        del queue[: len(chunk)]
        return Selection(tuple(chunk), (), 0)

    def _sample_val(self, partition_id: str, batch_size: int):
        while True:
            prompts, trajs = self._snapshot(partition_id)
            terminal = [u for u, t in prompts.items() if t.get("status") in ("finished", "failure")]
            if len(terminal) >= batch_size:
                chosen = sorted(terminal, key=lambda u: self._seen[u])[:batch_size]
                return self._materialize(partition_id, chosen, trajs), {}
            time.sleep(self.poll_interval)
