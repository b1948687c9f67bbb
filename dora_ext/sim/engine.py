"""One simulated rollout instance: continuous batching on a virtual clock, in closed form.

Instead of an event per decode iteration: between two membership changes (a trajectory joins,
finishes, migrates, is preempted) every running sequence advances by the same number of
iterations `m`, and iteration `j` (counted from the last change) costs

    alpha + beta * j,   alpha = a + b * r + c * C0,   beta = c * r

because the total context `C` grows by `r` tokens per iteration. `m` iterations therefore take
the arithmetic series `T(m) = alpha * m + beta * m * (m - 1) / 2`; its inverse is a quadratic's
positive root. `T` composes exactly, so advancing at arbitrary times never changes the outcome.

Per-sequence state is kept relative to an instance-wide iteration counter `it`: a sequence
finishes when `it` reaches its `finish` mark, and its context is `offset + it`. A membership
change is O(log r); the time of the next finish is the heap's minimum.

KV memory (`kv`, a host's KV-token budget; 0 = unbounded): the iteration at which the context no
longer fits is closed-form too, an event like a finish. There the newest sequence is preempted
and waits at the head of `waiting`; waiting sequences join first come first served when they fit
under a 1% watermark, re-prefilling (vLLM's recompute preemption).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Hashable

from .presets import EngineCost

#: display states in `SimInstance.log` besides a version number (>= 0) being served
STATE_LOADING, STATE_IDLE, STATE_EMPTY = -1, -2, -3


class SimInstance:
    """The decode state of one instance. The runner owns versions, loading and events."""

    __slots__ = (
        "id", "a", "b", "c", "prefill", "capacity", "it", "S", "r", "heap", "seqs", "t_last",
        "busy_until", "version", "loading", "paused", "inbound", "gen", "sched_gen", "load_token",
        "slot_time", "log", "state", "base", "kv", "kv_due", "waiting", "preemptions", "recomputed",
    )

    def __init__(self, iid: int, cost: EngineCost, kv: int = 0) -> None:
        self.id = iid
        self.a, self.b, self.c = cost.decode_a_s, cost.decode_b_s, cost.decode_c_s
        self.base = (self.a, self.b, self.c)
        self.prefill = cost.prefill_s_per_token
        self.capacity = cost.capacity
        self.it = 0.0  # iterations executed (fractional between events)
        self.S = 0.0  # sum over running of (context - it): total context = S + r * it
        self.r = 0  # running sequences
        self.heap: list[tuple[float, Hashable]] = []  # (finish mark, key), lazily invalidated
        self.seqs: dict[Hashable, tuple[float, float]] = {}  # key -> (finish mark, context offset)
        self.t_last = 0.0
        self.busy_until = 0.0  # prefill stalls decoding until then
        self.version: int | None = None
        self.loading: int | None = None
        self.paused: dict[Hashable, tuple[float, float]] = {}  # preempted: key -> (remaining, context)
        self.inbound = 0  # migrations on their way here (they hold a slot)
        self.gen = 0  # bumps when the next-finish time may have changed
        self.sched_gen = -1  # the gen of the finish event in the runner's heap
        self.load_token = 0  # identifies the load in flight (a newer LoadVersion replaces it)
        self.slot_time = 0.0  # integral of running sequences over time (bubble ratio)
        self.log: list[tuple[float, int]] | None = None  # (time, state code) for plots
        self.state = STATE_EMPTY
        self.kv = kv  # KV-token budget (0: unbounded)
        self.kv_due = False  # the next event is the KV budget filling up, not a finish
        self.waiting: deque = deque()  # (key, remaining, context, prefill tokens, preempted)
        self.preemptions = 0
        self.recomputed = 0.0  # context tokens re-prefilled after a preemption

    # ------------------------------------------------------------------ clock
    def _alpha_beta(self) -> tuple[float, float]:
        r = self.r
        return self.a + self.b * r + self.c * (self.S + r * self.it), self.c * r

    def iterations_in(self, dt: float) -> float:
        """Iterations that fit in `dt` seconds of decoding from the current state."""
        if dt <= 0.0 or self.r == 0:
            return 0.0
        alpha, beta = self._alpha_beta()
        h = alpha - 0.5 * beta
        # Positive root of beta/2 m^2 + h m - dt = 0, in the cancellation-free form.
        return 2.0 * dt / (h + math.sqrt(h * h + 2.0 * beta * dt))

    def time_for(self, m: float) -> float:
        """Seconds to decode `m` more iterations with the current running set."""
        if m <= 0.0:
            return 0.0
        alpha, beta = self._alpha_beta()
        return alpha * m + 0.5 * beta * m * (m - 1.0)

    def advance(self, t: float) -> None:
        """Move the instance's state to time `t` (>= the last time)."""
        last = self.t_last
        if t <= last:
            return
        r = self.r
        if r:
            self.slot_time += r * (t - last)
            start = last if last > self.busy_until else self.busy_until
            if t > start:
                # iterations_in(t - start), inlined: this is the simulator's hottest line.
                dt = t - start
                beta = self.c * r
                h = self.a + self.b * r + self.c * (self.S + r * self.it) - 0.5 * beta
                self.it += 2.0 * dt / (h + math.sqrt(h * h + 2.0 * beta * dt))
        self.t_last = t

    def set_speed(self, factor: float, t: float) -> None:
        """From time `t` on, a decode iteration costs `factor` times the base (MoE imbalance)."""
        self.advance(t)
        a, b, c = self.base
        self.a, self.b, self.c = a * factor, b * factor, c * factor
        self.gen += 1

    def next_finish(self) -> float | None:
        """Virtual time at which the next running sequence finishes (None when idle)."""
        heap, seqs = self.heap, self.seqs
        while heap:
            mark, key = heap[0]
            cur = seqs.get(key)
            if cur is not None and cur[0] == mark:
                break
            heapq.heappop(heap)
        else:
            return None
        start = self.t_last if self.t_last > self.busy_until else self.busy_until
        m = mark - self.it
        r = self.r
        self.kv_due = False
        if self.kv and r > 1:
            # iterations until the next one would not fit: total context + r > kv
            full = (self.kv - self.S - r * self.it) / r - 1.0
            self.kv_due = full < m
            if self.kv_due:
                m = full
        if m <= 0.0:
            return start
        # time_for(m), inlined
        beta = self.c * r
        alpha = self.a + self.b * r + self.c * (self.S + r * self.it)
        return start + alpha * m + 0.5 * beta * m * (m - 1.0)

    # ------------------------------------------------------------------ membership
    def add(self, key: Hashable, remaining: float, context: float, t: float, prefill_tokens: float) -> None:
        """A sequence joins at time `t` with `remaining` tokens to go and `context` tokens of KV.

        `prefill_tokens` of prefill stall decoding first (0 when the KV arrived by migration).
        With a KV budget, a sequence that does not fit waits behind any earlier waiting one."""
        self.advance(t)
        if self.kv and (self.waiting or not self._fits(context)):
            self.waiting.append((key, remaining, context, prefill_tokens, False))
            self.gen += 1
            return
        self._join(key, remaining, context, t, prefill_tokens)

    def _fits(self, context: float) -> bool:
        # vLLM's watermark: join only if 1% of the budget stays free (no preemption thrash)
        r = self.r
        return not r or self.S + r * self.it + context + r + 1 <= 0.99 * self.kv

    def _join(self, key: Hashable, remaining: float, context: float, t: float, prefill_tokens: float) -> None:
        it = self.it
        mark = it + remaining
        self.seqs[key] = (mark, context - it)
        self.S += context - it
        self.r += 1
        heapq.heappush(self.heap, (mark, key))
        if prefill_tokens > 0:
            start = t if t > self.busy_until else self.busy_until
            self.busy_until = start + self.prefill * prefill_tokens
        self.gen += 1

    def holds(self, key: Hashable) -> bool:
        """Runs it, or holds it waiting for KV memory."""
        return key in self.seqs or any(w[0] == key for w in self.waiting)

    def remove(self, key: Hashable, t: float) -> tuple[float, float]:
        """Take a running (or KV-waiting) sequence out at time `t`; returns `(remaining tokens, context)`."""
        if key not in self.seqs:
            w = next(w for w in self.waiting if w[0] == key)
            self.waiting.remove(w)
            self.gen += 1
            return w[1], w[2]
        out = self._remove(key, t)
        if self.waiting:
            self._admit(t)
        return out

    def _remove(self, key: Hashable, t: float) -> tuple[float, float]:
        self.advance(t)
        mark, off = self.seqs.pop(key)
        self.S -= off
        self.r -= 1
        if self.r == 0:
            self.S = 0.0  # no float drift carried into the next busy period
        self.gen += 1
        return max(0.0, mark - self.it), off + self.it

    def pop_finished(self, t: float) -> list[Hashable]:
        """Sequences finished by time `t` (called when the next-finish event fires)."""
        self.advance(t)
        heap, seqs, pop = self.heap, self.seqs, heapq.heappop
        while not self.kv_due:  # skip stale heap entries down to the live minimum
            mark, key = heap[0]
            cur = seqs.get(key)
            if cur is not None and cur[0] == mark:
                # The event fired for this minimum: it is due even if float rounding left a sliver.
                if mark > self.it:
                    self.it = mark
                break
            pop(heap)
        limit = self.it + 1e-9 * (1.0 + self.it)
        done: list[Hashable] = []
        S = self.S
        while heap:
            mark, key = heap[0]
            if mark > limit:
                break
            pop(heap)
            cur = seqs.get(key)
            if cur is None or cur[0] != mark:
                continue
            del seqs[key]
            S -= cur[1]
            done.append(key)
        self.r -= len(done)
        self.S = S if self.r else 0.0
        if self.kv:
            self.kv_due = False
            # preempt the newest while the next iteration would not fit (half a token of slack)
            while self.r > 1 and self.S + self.r * (self.it + 1.0) > self.kv - 0.5:
                key = next(reversed(self.seqs))
                remaining, context = self._remove(key, t)
                self.waiting.appendleft((key, remaining, context, context, True))
                self.preemptions += 1
            self._admit(t)
        self.gen += 1
        return done

    def _admit(self, t: float) -> None:
        """Waiting sequences join, first come first served, while their context fits."""
        waiting = self.waiting
        while waiting and self._fits(waiting[0][2]):
            key, remaining, context, prefill, preempted = waiting.popleft()
            if preempted:
                self.recomputed += prefill
            self._join(key, remaining, context, t, prefill)

    @property
    def occupied(self) -> int:
        """Slots held: running, paused for a weight load, or reserved by an inbound migration."""
        return self.r + len(self.paused) + self.inbound + len(self.waiting)

    def record(self, t: float) -> None:
        """Log the display state (loading / serving version v / idle) when it changed."""
        if self.loading is not None:
            code = STATE_LOADING
        elif self.version is None:
            code = STATE_EMPTY
        elif self.r or self.inbound or self.waiting:
            code = self.version
        else:
            code = STATE_IDLE
        if code != self.state:
            self.state = code
            if self.log is not None:
                self.log.append((t, code))

