"""slime's `--data-source-path`: prompts from slime's own data source, plus a ledger that makes
a resumed run lose and repeat nothing.

    --data-source-path dora_ext.slime.data_source.DoraDataSource

With streaming rollout, groups handed out are not yet trained when slime checkpoints step `r`, and
slime's data source saves only its cursor. `DoraDataSource` wraps it and keeps a ledger of handed
out groups: `save(r)` writes the groups not trained by step `r` (as prompts) next to slime's file,
`load(r)` re-queues them first, oldest first; groups reported failed (C2) are not re-queued.
The rollout function updates the ledger (`dora_assign`, `dora_fail`, `dora_forget_before`).
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import threading
from pathlib import Path
from typing import Any

from .engines import load_object
from .settings import slime_settings

logger = logging.getLogger("dora_ext.slime")

STATE_FORMAT = 1
_FAILED = "failed"


def state_path(root: str, rollout_id: int) -> Path:
    """Where the ledger of checkpoint `rollout_id` lives (beside slime's `global_dataset_state_dict_*.pt`)."""
    return Path(root) / "rollout" / f"dora_state_{rollout_id}.pkl"


class DoraDataSource:
    """slime's DataSource interface: `get_samples`, `add_samples`, `save`, `load`, `__len__`."""

    def __init__(self, args: Any) -> None:
        self.args = args
        settings = slime_settings(args)
        self.base = load_object(settings.base_data_source_path)(args)
        # slime calls save/load from its actor thread while the rollout worker takes prompts.
        self._lock = threading.RLock()
        self._requeued: list[list[Any]] = []
        self._ledger: dict[int, list] = {}  # ledger id -> [pristine group, step | None | "failed"]
        self._next_id = 0

    # ------------------------------------------------------------------ slime's interface
    def get_samples(self, num_samples: int) -> list[list[Any]]:
        """Re-queued groups first (oldest first), then new prompts from slime's data source."""
        with self._lock:
            out = self._requeued[:num_samples]
            del self._requeued[:num_samples]
            if len(out) < num_samples:
                out += list(self.base.get_samples(num_samples - len(out)))
            for group in out:
                lid = self._next_id
                self._next_id += 1
                for s in group:
                    if s.metadata is None:
                        s.metadata = {}
                    s.metadata["dora_ledger"] = lid
                self._ledger[lid] = [copy.deepcopy(group), None]
            return out

    def add_samples(self, samples: list[list[Any]]) -> None:
        """Groups given back (slime's buffer); they come out of `get_samples` again, newly ledgered."""
        self.base.add_samples(samples)

    def save(self, rollout_id: int) -> None:
        """slime's checkpoint of step `rollout_id`: slime's cursor plus the groups not yet trained.

        slime's cursor and the ledger are taken under one lock: a prompt the rollout worker takes
        in between would be both after the saved cursor and in the saved ledger (resumed twice).
        """
        root = getattr(self.args, "save", None)
        with self._lock:
            self.base.save(rollout_id)
            if not root:
                return
            pending = [
                copy.deepcopy(group)
                for _, (group, step) in sorted(self._ledger.items())
                if step is None or (step != _FAILED and step > rollout_id)
            ]
            pending = self._requeued_copy() + pending
            state = {
                "format": STATE_FORMAT,
                "rollout_id": rollout_id,
                "pending": pending,
                "failed": sum(1 for _, step in self._ledger.values() if step == _FAILED),
            }
        path = state_path(root, rollout_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as fh:
            pickle.dump(state, fh)
        os.replace(tmp, path)

    def load(self, rollout_id: int | None = None) -> None:
        """Resume from checkpoint `rollout_id`: slime's cursor, then our not-yet-trained groups."""
        self.base.load(rollout_id)
        root = getattr(self.args, "load", None)
        if not root or rollout_id is None:
            return
        path = state_path(root, rollout_id)
        if not path.exists():
            logger.info("dora: no ledger at %s; resuming from slime's cursor alone", path)
            return
        with open(path, "rb") as fh:
            state = pickle.load(fh)
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"{path}: unknown dora state format {state.get('format')!r}")
        with self._lock:
            self._requeued = list(state["pending"]) + self._requeued
        logger.info("dora: %d groups from checkpoint %s go first", len(state["pending"]), rollout_id)

    def __len__(self) -> int:
        return len(self.base)

    def __getattr__(self, name: str) -> Any:
        # slime's helpers that some rollouts call (get_metadata, buffer, ...) are the base's.
        if name.startswith("_") or name in ("base", "args"):
            raise AttributeError(name)
        return getattr(self.base, name)

    # ------------------------------------------------------------------ the rollout function's side
    def dora_assign(self, ledger_ids: list[Any], step: int) -> None:
        """These groups are batch `step` (slime's rollout id)."""
        with self._lock:
            for lid in ledger_ids:
                if lid in self._ledger:
                    self._ledger[lid][1] = step

    def dora_fail(self, ledger_id: Any) -> None:
        """The scheduler reported this group failed: it is neither trained nor re-queued."""
        with self._lock:
            if ledger_id in self._ledger:
                self._ledger[ledger_id][1] = _FAILED

    def dora_forget_before(self, step: int) -> None:
        """Batches before `step` are trained by the time slime can checkpoint again: drop them."""
        with self._lock:
            for lid in [k for k, (_, s) in self._ledger.items() if isinstance(s, int) and s < step]:
                del self._ledger[lid]

    def _requeued_copy(self) -> list[list[Any]]:
        return [copy.deepcopy(g) for g in self._requeued]

    def pending_count(self) -> int:
        """Groups handed out and not yet assigned to a step, plus those waiting to be re-queued."""
        with self._lock:
            return len(self._requeued) + sum(1 for _, s in self._ledger.values() if s is None)
