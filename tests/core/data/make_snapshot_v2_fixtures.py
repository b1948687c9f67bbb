"""Writes `snapshot_v2_<mode>.json`: a format-2 snapshot taken by the scheduler as it was before
the flat core state (git revision `a2d9384`, one object per group and trajectory), and the events
that scheduler then handled with the actions it answered. `tests/core/test_snapshot_compat.py`
restores the snapshot in today's scheduler and replays the events: same actions, same metrics.

Run from the repository root (needs git history): python tests/core/data/make_snapshot_v2_fixtures.py
"""

import importlib.util
import json
import math
import pathlib
import subprocess
import sys
import tempfile

REV = "a2d9384"
HERE = pathlib.Path(__file__).resolve().parent


def old_scheduler():
    src = subprocess.run(["git", "show", f"{REV}:dora_ext/core/scheduler.py"], check=True, capture_output=True,
                         text=True, cwd=HERE).stdout
    path = pathlib.Path(tempfile.mkdtemp()) / "dora_ext" / "core" / "scheduler.py"
    path.parent.mkdir(parents=True)
    path.write_text(src)
    import dora_ext.core  # noqa: F401 - the package its relative imports resolve in

    name = "dora_ext.core._scheduler_" + REV
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod.Scheduler


def config(mode):
    from dora_ext.config import DoraConfig

    return DoraConfig.from_dict({
        "mode": mode, "max_staleness": 2, "batch_size": 2, "group_size": 3,
        "instances": [{"capacity": c} for c in (2, 3, 4)], "max_retries": 1, "max_failed_group_share": 1.0,
    })


def main():
    from dora_ext.testing import RandomDriver

    Old = old_scheduler()
    for mode in ("partial", "dora"):
        trace = []

        class Recorder(RandomDriver):
            recording = False

            def _feed(self, event):
                out = super()._feed(event)
                if self.recording:
                    fields = {f: getattr(event, f) for f in event.__slots__}
                    trace.append([type(event).__name__, fields, [repr(a) for a in out]])
                return out

        cfg = config(mode)
        d = Recorder(cfg, seed=11, scheduler=Old(cfg), fail_prob=0.03, crash_prob=0.05, nan_prob=0.03,
                     long_tail=0.3, late_reward=0.4, fail_awaiting=0.1, stale_prob=1.0, progress_prob=0.1,
                     landed_prob=0.5, group_id=lambda n: f"uid-{n:04x}")
        d.start()
        d.run(4)
        # A moment with the state that is hardest to carry over: a trajectory generated under two
        # versions (partial), a trajectory moved and not landed (dora), a group with two trajectories
        # re-queued (its pending list out of index order).
        for _ in range(20_000):
            snap = json.loads(json.dumps(d.sched.snapshot()))
            trajs = [t for g in snap["groups"] for t in g[12]]
            if (any(len(t[4]) > 1 for t in trajs) if mode == "partial" else any(t[7] for t in trajs)) \
                    and any(g[9] != sorted(g[9]) for g in snap["groups"]):  # two re-queued in one group
                break
            assert d.tick()
        d.recording = True
        while len(trace) < 250 and d.tick():
            pass
        # NaN rewards are written as null (plain JSON); the test sends them as NaN again.
        for _, fields, _ in trace:
            if "reward" in fields and isinstance(fields["reward"], float) and math.isnan(fields["reward"]):
                fields["reward"] = "nan"
        out = {"generated_by": f"dora_ext/core/scheduler.py at {REV}, RandomDriver seed 11", "mode": mode,
               "snapshot": snap, "trace": trace, "metrics": d.sched.metrics()}
        (HERE / f"snapshot_v2_{mode}.json").write_text(json.dumps(out, separators=(",", ":")) + "\n")
        print(mode, len(trace), "events", len(snap["groups"]), "groups in the snapshot",
              sum(1 for t in trajs if len(t[4]) > 1), "multi-version,", sum(1 for t in trajs if t[7]), "moved,",
              sum(1 for t in trajs if t[6]), "retried trajectories")


if __name__ == "__main__":
    main()
