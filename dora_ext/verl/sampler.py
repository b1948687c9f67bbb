"""``DoraReplayBuffer``: the ``trainer.v1.sampler.custom_sampler`` of trainer mode ``dora``.

It reads group state from TransferQueue exactly as verl's own replay buffer does (prompt keys
``{uid}`` with a ``status`` tag, trajectory keys ``{uid}_{session}_{index}``) and hands out, for
each trainer step, the batch the scheduler (``dora_ext.core`` in the coordinator) formed for it
(``step_source``), in chunks of the requested size once each group is complete (R3: only complete
groups, oldest version first, never beyond the staleness bound is the scheduler's rule).

Every constraint metric is computed here from what TransferQueue shows, not from the scheduler's
bookkeeping:

* C1 (``dora/c1_ok``): every trained trajectory carries one engine-reported weight version, i.e.
  its ``min_global_steps`` and ``max_global_steps`` tags (written by verl from the versions the
  rollout servers returned with the tokens) are set and equal;
* C2 (``dora/c2_ok``): no group is trained twice (``dora/duplicated``), none trained with fewer
  than ``group_size`` trajectories (``dora/truncated``), and none vanished: a prompt group seen in
  TransferQueue that disappeared without being trained here or reported failed is counted in
  ``dora/dropped``;
* C3 (``dora/c3_ok``): staleness ``(global_steps - 1) - version`` of each trained group is in
  ``[0, K]``; a group's version is the oldest engine-reported ``min_global_steps`` of its
  trajectories.

A group whose rollout failed is evicted, replaced through ``refill_fn`` and counted
(verl's ``training/rollout_failure/evicted_samples`` and ``dora/failed_groups``), never silently
lost.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

logger = logging.getLogger("dora_ext.verl")

SAMPLER_KWARGS = ("max_staleness", "step_batch_size", "group_size", "poll_interval", "max_wait_s")


@dataclass(frozen=True)
class GroupState:
    """What the sampler knows of one admitted group."""

    uid: str
    version: int
    complete: bool
    order: int  # completion order for complete groups, admission order otherwise


@dataclass(frozen=True)
class Selection:
    """``uids`` to hand out now, or ``uids == ()`` and ``waiting_for`` the groups that block."""

    uids: tuple[str, ...]
    waiting_for: tuple[str, ...] = ()


def group_version(prompt_tag: dict, trajectory_tags: Sequence[dict]) -> int:
    """The weight version of a group: the oldest engine-reported ``min_global_steps`` of its
    trajectories, or (no trajectory yet) ``global_steps - 1`` of its prompt tag."""
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
        self.group_size = kwargs.get("group_size")
        self.poll_interval = float(kwargs.get("poll_interval", 0.2))
        self.max_wait_s = kwargs.get("max_wait_s")
        self.refill_fn = refill_fn
        self.step_source: Callable[[int], Sequence[str] | None] | None = None
        self.on_wait: Callable[[], None] | None = None
        self._completion: dict[str, int] = {}  # uid -> completion order
        self._seen: dict[str, int] = {}  # uid -> admission order (first seen)
        self._trained: set[str] = set()
        self._evicted: set[str] = set()
        self._gone: set[str] = set()
        self._seen_train: set[str] = set()  # seen in TransferQueue, vanished untrained and unreported
        self._taken_in_step: dict[int, int] = {}
        self._from_source: dict[int, list[str]] = {}
        self.totals = {"duplicated": 0, "failed_groups": 0, "c3_violations": 0, "dropped": 0, "truncated": 0,
                       "c1_violations": 0}

    def trained_uids(self) -> set[str]:
        return set(self._trained)

    def _count_dropped(self, prompts: dict[str, dict]) -> int:
        """Groups seen in TransferQueue earlier that are gone now, neither trained nor evicted."""
        gone = [u for u in self._seen_train if u not in prompts and u not in self._trained and u not in self._evicted
                and u not in self._gone]
        self._gone.update(gone)
        if gone:
            logger.error("dora sampler: %d admitted group(s) vanished from TransferQueue untrained: %s",
                         len(gone), gone[:8])
        return len(gone)

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
        if partition_id == "train":
            self._seen_train.update(prompts)
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
        self._evicted.update(failed)
        from .cpu.report import report

        report("evicted", groups=failed)
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
        taken = self._taken_in_step.get(global_steps, 0)
        start = time.perf_counter()
        waited_for_older = 0
        failed = 0
        while True:
            prompts, trajs = self._snapshot(partition_id)
            failed += self._evict_failed(partition_id, prompts, trajs)
            self.totals["dropped"] += self._count_dropped(prompts)
            states = self._states(prompts, trajs)
            sel = self._from_scheduler(step, batch_size, states)
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
        n = int(self.group_size or 0)
        truncated = sum(1 for u in sel.uids if n and len({k.rsplit("_", 1)[0] for k, _ in trajs.get(u, ())}) < n)
        c1 = sum(1 for u in sel.uids for _, t in trajs.get(u, ())
                 if t.get("min_global_steps") is None or t.get("min_global_steps") != t.get("max_global_steps"))
        self.totals["truncated"] += truncated
        self.totals["c1_violations"] += c1
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
            "dora/sample_wait_s": time.perf_counter() - start,
            "dora/waited_for_older": waited_for_older,
            "dora/dropped": self.totals["dropped"],
            "dora/duplicated": self.totals["duplicated"],
            "dora/failed_groups": self.totals["failed_groups"],
            "dora/c3_violations": self.totals["c3_violations"],
            "dora/truncated": self.totals["truncated"],
            "dora/c1_violations": self.totals["c1_violations"],
            "dora/c1_ok": float(self.totals["c1_violations"] == 0),
            "dora/c2_ok": float(self.totals["duplicated"] == 0 and self.totals["dropped"] == 0
                                and self.totals["truncated"] == 0),
            "dora/c3_ok": float(self.totals["c3_violations"] == 0),
            "dora/multi_version_trajectory_share": multi / len(spans) if spans else 0.0,
            "dora/live_versions": len(pending_versions | {by_uid[u].version for u in sel.uids}),
        }
        for s in sorted(set(staleness)):
            metrics[f"dora/staleness_hist/{s}"] = staleness.count(s)
        if failed:
            metrics["training/rollout_failure/evicted_samples"] = failed
        from .cpu.report import report

        report("train", global_steps=int(global_steps), groups=list(sel.uids), staleness=staleness,
               versions=[by_uid[u].version for u in sel.uids])
        return self._materialize(partition_id, sel.uids, trajs), metrics

    def _from_scheduler(self, step: int, size: int, states: list[GroupState]) -> Selection:
        """Hand out the scheduler's batch for `step` in chunks of `size`, once each is complete."""
        if self.step_source is None:
            raise RuntimeError(
                "DoraReplayBuffer takes each step's batch from the dora scheduler: use it with "
                "trainer.v1.trainer_mode=dora (DoraTrainer sets step_source)"
            )
        if step not in self._from_source:
            uids = self.step_source(step)
            if uids is None:
                return Selection((), ())
            # C2: a group listed again (already trained here, or twice in this batch) is counted
            # and skipped. Trained groups left TransferQueue, so waiting for one would hang forever.
            fresh: list[str] = []
            dups: list[str] = []
            for uid in uids:
                (dups if uid in self._trained or uid in fresh else fresh).append(uid)
            if dups:
                self.totals["duplicated"] += len(dups)
                logger.error("dora sampler: the scheduler's batch for step %d lists %d group(s) already trained or "
                             "twice: %s (counted in dora/duplicated, skipped)", step + 1, len(dups), dups[:8])
                if not fresh:
                    raise RuntimeError(f"dora sampler: the scheduler's batch for step {step + 1} holds only groups "
                                       f"already trained: {dups[:8]}")
            self._from_source = {step: fresh}
        queue = self._from_source[step]
        if not queue:
            raise RuntimeError(f"dora sampler: step {step + 1} asked for more groups than the scheduler's batch holds")
        complete = {s.uid for s in states if s.complete}
        chunk = queue[:size]
        missing = [u for u in chunk if u not in complete]
        if missing:
            return Selection((), tuple(missing))
        del queue[: len(chunk)]
        return Selection(tuple(chunk), ())

    def _sample_val(self, partition_id: str, batch_size: int):
        while True:
            prompts, trajs = self._snapshot(partition_id)
            terminal = [u for u, t in prompts.items() if t.get("status") in ("finished", "failure")]
            if len(terminal) >= batch_size:
                chosen = sorted(terminal, key=lambda u: self._seen[u])[:batch_size]
                return self._materialize(partition_id, chosen, trajs), {}
            time.sleep(self.poll_interval)
