"""The scheduler's two errors."""

from __future__ import annotations

from typing import Any


class ProtocolError(RuntimeError):
    """The runtime broke the event protocol (unknown id, event in the wrong state, ...), or a plugin
    gave what the scheduler cannot keep (a key JSON does not give back, an infeasible plan).

    It halts the scheduler (the event may be half applied): every later `handle`, `handle_many`
    or `snapshot` raises a `ProtocolError` saying why; the host resumes from its last snapshot.
    """


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
    """`repr(x)` for an error message, at most 80 characters."""
    try:
        r = repr(x)
    except ValueError:
        return f"<{type(x).__name__} of {x.bit_length()} bits>"
    return r if len(r) <= 80 else r[:60] + f"...<{len(r)} characters>"
