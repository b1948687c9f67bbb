"""Elastic colocation: lend idle rollout instances to the trainer, and take them back for the tail."""

from __future__ import annotations

import math

from . import actions as A
from ._fleet import _Instance
from ._state import _drop_one


class _Elastic:
    """Elastic colocation (mixed into `Scheduler`)."""

    def _init_elastic(self, config) -> None:
        """The trainer-side spares of `config`."""
        # Elastic colocation: instance id -> capacity of instances on the trainer side (switchable
        # to rollout), switching to the trainer, and switching to rollout.
        self._elastic = config.elastic
        self._trainer_side: dict[int, int] = {}
        self._to_trainer: dict[int, int] = {}
        self._to_rollout: dict[int, int] = {}
        if self._elastic:
            first = max(s.id for s in config.instances) + 1
            cap0 = config.instances[0].capacity
            self._trainer_side = {first + i: cap0 for i in range(config.elastic_spare)}
        self._trainer_idle = False  # reported by TrainerIdle, cleared by the next delivery
        self._min_rollout = max(1, math.ceil(len(config.instances) * (1.0 - config.elastic_max_lent)))

    def _should_lend(self) -> bool:
        """Rollout -> trainer: the staleness budget is spent and no work waits for a slot, so the
        trainer is the bottleneck and an idle instance's accelerators serve it better."""
        if len(self.instances) <= self._min_rollout:
            return False
        if self._budget_left() > 0 or self._outstanding or any(self._queued.values()):
            return False
        # ... and the trainer has work (a step runs, or groups of the step being formed were
        # delivered and it has not reported running dry): a trainer stalled on stragglers would
        # gain nothing from more accelerators.
        return not self._trainer_idle and (self._trainer_busy is not None or bool(self._forming))

    def _switch_to_trainer(self, inst: _Instance) -> None:
        """Take the idle instance out of the rollout pool and lend its accelerators to the trainer."""
        if inst.version is not None:
            b = self._bucket(inst.version)
            self._cap[b] -= inst.capacity
            _drop_one(self._targets, inst.version)
            self._set_level(b, inst.id, 0, None)
        self._idle.pop(inst.id, None)
        del self.instances[inst.id]
        self._to_trainer[inst.id] = inst.capacity
        self.m["switches_to_trainer"] += 1
        self._out.append(A.SwitchToTrainer(inst.id))

    def _maybe_switch_to_rollout(self) -> None:
        """Trainer -> rollout: the trainer waits for trajectories (no step runs and none can be
        formed) while the rollout has more work than slots: the long tail."""
        if not self._trainer_idle or self._trainer_busy is not None or self.done:
            return
        b = self._bucket(self.newest)
        demand = self._queued.get(b, 0) + (self._outstanding + max(0, self._budget_left())) * self.n
        need = demand - (self._cap.get(b, 0) - self._occupied.get(b, 0)) - sum(self._to_rollout.values())
        if need <= 0 and self._spread and not self._to_rollout:
            crowd = self._gating_crowd()
            if crowd is not None and self._spread_plan(crowd[0], _Instance(-1, self.config.instances[0].capacity, self._traj_stamp)):
                need = 1  # the stragglers the trainer waits for share instances: spread them (R5)
        while need > 0 and self._trainer_side:
            iid = min(self._trainer_side)
            cap = self._trainer_side.pop(iid)
            self._to_rollout[iid] = cap
            need -= cap
            self.m["switches_to_rollout"] += 1
            self._out.append(A.SwitchToRollout(iid, cap))
