"""The scheduler's two errors."""

from __future__ import annotations

from typing import Any


class ProtocolError(RuntimeError):
    """The runtime broke the event protocol (unknown id, event in the wrong state, ...).

    Like h11's ProtocolError it is raised, never swallowed: a runtime that keeps going on a broken
    protocol would lose or duplicate data silently.

    The offending event is mostly refused before it changes the scheduler (an unknown id, bad
    tokens, a meta, an admission or batch key that is refused). The exception is a plugin's
    migration plan (`dora_plan_migration`) found infeasible: it is checked move by move, so the
    event and the moves before the bad one stay applied. `actions` holds what was decided and not
    yet answered: the actions of the events before it in a `handle_many` batch, and of that
    partly applied event; never returned with a later answer. A host that stops on the error
    executes them first (or at least learns of them), so that a snapshot taken then holds nothing
    decided but never sent.
    """

    actions: list = []  # (set on the raised instance by `handle`/`handle_many`)


class FailureStorm(RuntimeError):
    """The circuit breaker tripped: too many groups failed (`max_failed_group_share`).

    Raised by `handle()` on the event that tripped it and on every event after; the scheduler's
    state stays consistent (`snapshot()`, `metrics()` still work) but it admits nothing more.
    `actions` holds what the tripping event produced (e.g. the `ReportGroupFailed`).
    """

    def __init__(self, message: str, *, failed: int, completed: int, retries: int, actions: list | None = None):
        super().__init__(message)
        self.failed = failed
        self.completed = completed
        self.retries = retries
        self.actions = list(actions or [])


def _brief(x: Any) -> str:
    """`repr(x)` for an error message, at most 80 characters: a bad value a host sends may be a
    huge integer, whose repr is that long (or raises ValueError past 4,300 digits)."""
    try:
        r = repr(x)
    except ValueError:
        return f"<{type(x).__name__} of {x.bit_length()} bits>"
    return r if len(r) <= 80 else r[:60] + f"...<{len(r)} characters>"
