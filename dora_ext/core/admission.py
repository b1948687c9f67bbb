"""How far admission runs ahead of the trainer within R2 (config `admission`): staleness as a cost.

R2 lets the groups admitted at versions `<= v` reach `(v + K + 1) * B`. `fill` uses all of it
whenever slots are free (a trainer-bound run then keeps every group waiting until it is K steps
old). The look-ahead policies cap the count at `(v + 1) * B + look`, `look` in [B, K * B]
(`K * B` is R2 itself), counted against the newest published version.

- `ahead`: `look = B`, one batch beyond the step being formed.
- `adaptive`: starts at R2's `K * B`; after each step it grows `look` by the groups missing from
  the next step if that one cannot start, or, if it and the step before started at once, shrinks
  it by half the surplus left in the pool, within [B, K * B]. Groups that completed while the
  trainer waited for an older straggler are no surplus (the rollout is the bottleneck).

Sans-I/O like the scheduler: the scheduler feeds it its counters (`limit`, `step_finished`,
`step_formed`).
"""

from __future__ import annotations


class Admission:
    """The admission policy's state: the look-ahead `look` (groups beyond the newest version's step)."""

    __slots__ = ("policy", "B", "lo", "hi", "look", "short", "watch")

    def __init__(self, policy: str, batch_size: int, max_staleness: int) -> None:
        self.policy = policy
        self.B = batch_size
        self.hi = max_staleness * batch_size  # R2: `(v + K + 1) * B`
        self.lo = min(batch_size, self.hi)
        self.look = self.lo if policy == "ahead" else self.hi
        self.short = False  # the last step observed could not start when its predecessor finished
        self.watch = False  # a step finished: `step_formed` reads how the next one starts

    def limit(self, newest: int) -> int:
        """The most groups admitted at versions `<= newest` (R2's bound or below it)."""
        return (newest + 1) * self.B + min(self.look, self.hi)

    def step_finished(self) -> None:
        self.watch = self.policy == "adaptive"

    def step_formed(self, started: bool, forming: int, pooled: int) -> None:
        """Batch formation ran after a step finished: the next step `started` (then `pooled`
        completed groups wait for a later one: the surplus) or has `forming` of its B groups (the
        trainer waits for the rest)."""
        self.watch = False
        if not started:
            self.look = min(self.hi, self.look + self.B - forming)
        elif not self.short:
            self.look = max(self.lo, self.look - pooled // 2)
        self.short = not started

    def snapshot(self) -> dict:
        """Its state for `Scheduler.snapshot` (only `adaptive` has one); `restore` reads it back."""
        return {"look": self.look, "short": self.short} if self.policy == "adaptive" else {}

    def restore(self, scalars: dict) -> None:
        self.look, self.short = scalars.get("look", self.look), scalars.get("short", self.short)
