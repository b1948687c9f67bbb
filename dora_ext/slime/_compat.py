"""slime's rollout output types, or same-shaped stand-ins where slime is absent.

slime is not on PyPI, so CI (and `dora-ext slime-args`) run without it. The adapter returns
slime's own `RolloutFnTrainOutput` / `RolloutFnEvalOutput` whenever slime is importable; without
slime it returns dataclasses with the same two fields, which is all slime's
`call_rollout_fn` and `RolloutManager` read (`samples`/`data` and `metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

try:
    from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput

    SLIME_PRESENT = True
except ImportError:
    SLIME_PRESENT = False

    @dataclass
    class RolloutFnTrainOutput:  # type: ignore[no-redef]
        """Stand-in for slime's type of the same name: groups of samples, plus metrics to log."""

        samples: list[list[Any]]
        metrics: dict[str, Any] | None = None

    @dataclass
    class RolloutFnEvalOutput:  # type: ignore[no-redef]
        """Stand-in for slime's type of the same name: {dataset: {rewards, truncated, samples}}."""

        data: dict[str, dict[str, Any]]
        metrics: dict[str, Any] | None = None


__all__ = ["RolloutFnEvalOutput", "RolloutFnTrainOutput", "SLIME_PRESENT"]
