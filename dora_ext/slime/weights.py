"""Multi-version weights on slime: the trainer publishes, drained engines load.

slime's weight update pauses every engine and pushes each version into all of them; DORA's R4
needs a version written once and loaded by each engine when it has drained its older work.
`patches/slime/` adds one plug point to slime's disk weight sync
(`RayTrainGroup._reload_rollout_weights_from_disk`), named by `custom_rollout_weight_reload_path`:
slime calls it instead of reloading every engine. `publish_weights` only records that the version
exists; the rollout worker loads it onto each engine as it drains (`/update_weights_from_disk`,
tagged so samples report it in `Sample.weight_versions`). NCCL sync cannot serve several versions.

The record is a JSON-lines file in the weights directory, appended once per publication:
`{"run": <driver process token>, "n": <publication number in this run>, "path": <checkpoint>}`.
Publication `n` of the current run is version `first_rollout_id + n`: slime pushes the loaded
weights once before its first step, then once after every step (`--update-weights-interval 1`).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

PUBLICATIONS = "dora_publications.jsonl"

# One token per driver process: a restarted run starts a new sequence in the same file.
_RUN = uuid.uuid4().hex
_count = 0


def publish_weights(args: Any, disk_weight_dir: str, weight_version: str, rollout_manager: Any = None) -> None:
    """The hook the slime patch calls after a disk weight sync wrote `disk_weight_dir`.

    Signature (the patch's plug point): `fn(args, disk_weight_dir, weight_version, rollout_manager)`.
    It reloads nothing: engines are loaded by the rollout worker when they drain.
    """
    global _count
    record = {"run": _RUN, "n": _count, "path": str(disk_weight_dir), "slime_weight_version": str(weight_version)}
    path = Path(args.update_weight_disk_dir) / PUBLICATIONS
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record) + "\n"
    # One write of a whole line: a reader that sees a line without its newline ignores it.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    _count += 1


class DiskWeightBoard:
    """Reads the publications of the current run; maps a (relative) version to its checkpoint."""

    def __init__(self, weights_dir: str, *, delete_old: bool = True) -> None:
        self.dir = Path(weights_dir)
        self.delete_old = delete_old
        self._run: str | None = None
        self._paths: list[str] = []

    def poll(self) -> int:
        """Re-read the file; returns how many versions of the current run are published.

        The current run is the newest run token in the file; the adapter starts reading after
        slime's initial push, so it always names this run.
        """
        try:
            text = (self.dir / PUBLICATIONS).read_text()
        except FileNotFoundError:
            return 0
        entries = []
        for line in text.splitlines(keepends=True):
            if not line.endswith("\n"):
                break
            entries.append(json.loads(line))
        if not entries:
            return 0
        run = entries[-1]["run"]
        mine = [e for e in entries if e["run"] == run]
        for i, e in enumerate(mine):
            if e["n"] != i:
                raise RuntimeError(f"{self.dir / PUBLICATIONS}: run {run} skips publication {i} (found {e['n']})")
        self._run, self._paths = run, [e["path"] for e in mine]
        return len(self._paths)

    def path(self, version: int) -> str:
        if not 0 <= version < len(self._paths):
            raise KeyError(f"version {version} is not published (published: {len(self._paths)})")
        return self._paths[version]

    def release(self, version: int) -> None:
        """No engine will load `version` again: delete its checkpoint (slime's default cleanup)."""
        if not self.delete_old or not 0 <= version < len(self._paths):
            return
        p = Path(self._paths[version])
        # Only what slime's disk sync wrote beside our record, never an arbitrary path.
        if p.parent.resolve() == self.dir.resolve() and p.name.startswith("weight_v"):
            shutil.rmtree(p, ignore_errors=True)


class StaticWeights:
    """No weight channel (slime's contract harness passes `args=None`): engines never reload.

    Version `v` counts as published as soon as the trainer finished step `v - 1` (`trained()`
    returns the number of finished steps); loading it is a no-op. Only the pass-through engines
    of `engines.py` use this.
    """

    def __init__(self, trained: Callable[[], int]) -> None:
        self._trained = trained

    def poll(self) -> int:
        return self._trained() + 1

    def path(self, version: int) -> str | None:
        return None

    def release(self, version: int) -> None:
        return None
