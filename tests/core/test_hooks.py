"""Policies are pluggy hooks; third-party plugins load from the `dora_ext` entry-point group."""

import json
import subprocess
import sys
import textwrap

import pytest

from dora_ext import hookimpl
from dora_ext.config import DoraConfig
from dora_ext.plugins import get_plugin_manager
from dora_ext.testing import RandomDriver

CFG = {"mode": "pipeline", "batch_size": 3, "group_size": 1, "instances": 1, "capacity": 1}

PROGRAM = textwrap.dedent(
    """
    import json
    from dora_ext.config import DoraConfig
    from dora_ext.core import Dispatch, GroupAdmitted, InstanceLoaded, LoadVersion, RequestGroups, Scheduler
    from dora_ext.plugins import get_plugin_manager

    pm = get_plugin_manager()
    s = Scheduler(DoraConfig.from_dict(%r), plugins=pm)
    order, todo = [], list(s.start())
    # bind the prompts before the instance finishes loading, so all three groups queue
    todo.sort(key=lambda a: not isinstance(a, RequestGroups))
    while todo:
        a = todo.pop(0)
        if isinstance(a, LoadVersion):
            todo += s.handle(InstanceLoaded(a.instance_id, a.version))
        elif isinstance(a, RequestGroups):
            for gid in range(a.count):
                todo += s.handle(GroupAdmitted(gid))
        elif isinstance(a, Dispatch):
            order.append(a.group_id)
    print(json.dumps({"plugins": sorted(n for n, _ in pm.list_name_plugin()), "first": order}))
    """
) % (CFG,)


def pack_plan(instances, fill):
    """A plugin's plan: keep the fewest instances that hold the work within `fill` (those running the
    most), move everything else onto them."""
    order = sorted(instances, key=lambda d: (-len(d["running"]), d["id"]))
    total = sum(len(d["running"]) for d in order)
    kept, room = [], 0
    for d in order:
        if room >= total:
            break
        kept.append(d)
        room += max(len(d["running"]), int(fill * d["capacity"]), 1)
    free = [[max(len(d["running"]), int(fill * d["capacity"]), 1) - len(d["running"]), d["id"]] for d in kept]
    moves = []
    for d in order[len(kept):]:
        for gid, idx in d["running"]:
            slot = next(f for f in free if f[0] > 0)
            slot[0] -= 1
            moves.append((gid, idx, d["id"], slot[1]))
    return moves


def random_dora_config(rng, instances=(1, 4)):
    """A small random dora config: K 1-3, batches of 1-4 groups of 1-3, capacity 1-4, 8 steps."""
    return DoraConfig.from_dict({"mode": "dora", "max_staleness": rng.choice([1, 2, 3]),
                                 "batch_size": rng.randint(1, 4), "group_size": rng.randint(1, 3),
                                 "instances": rng.randint(*instances), "capacity": rng.randint(1, 4), "max_steps": 8})


def test_every_hook_has_a_documented_spec_and_a_default():
    pm = get_plugin_manager(load_entrypoints=False)
    for name in ("dora_admission_key", "dora_batch_key", "dora_plan_migration", "dora_metrics"):
        caller = getattr(pm.hook, name)
        assert caller.spec is not None and caller.spec.function.__doc__
    assert "dora_ext.defaults" in dict(pm.list_name_plugin())


def test_a_registered_plugin_changes_admission_order():
    class LastFirst:
        @hookimpl
        def dora_admission_key(self, group_id, version, seq, meta, mode):
            return (-seq,)

    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(LastFirst())
    d = RandomDriver(DoraConfig.from_dict({**CFG, "max_steps": 2}), seed=1, plugins=pm)
    d.start()
    d.run(2)
    # all three groups queue while the only instance loads; the plugin serves the last one first
    assert d.stats.steps[0][1] == (2, 1, 0)


def test_plugin_installed_through_a_real_entry_point(tmp_path):
    pkg = tmp_path / "plugin_src"
    (pkg / "reverse_admission").mkdir(parents=True)
    (pkg / "reverse_admission" / "__init__.py").write_text(
        "from dora_ext import hookimpl\n\n"
        "@hookimpl\n"
        "def dora_admission_key(group_id, version, seq, meta, mode):\n"
        "    return (-seq,)\n"
    )
    (pkg / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "reverse-admission"\nversion = "0.0.1"\n'
        '[project.entry-points.dora_ext]\nreverse = "reverse_admission"\n'
        '[tool.setuptools]\npackages = ["reverse_admission"]\n'
    )
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(pkg)],
        capture_output=True, text=True,
    )
    if r.returncode != 0:
        pytest.fail(f"could not install the test plugin distribution: {r.stderr[-2000:]}")
    env_with = {"PYTHONPATH": str(site)}
    import os

    def run(extra):
        out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                             env={**os.environ, **extra}, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    plain = run({})
    plugged = run(env_with)
    assert "reverse" in plugged["plugins"] and "reverse" not in plain["plugins"]
    assert plain["first"] == [0]  # default: admission order, group 0 takes the only slot
    assert plugged["first"] == [2]  # the plugin reverses it


def _rules():
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("rules", pathlib.Path(__file__).with_name("test_rules.py"))
    rules = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rules)
    return rules


def test_a_migration_plugin_is_called_and_its_plan_applied():
    """R5 through the hook: the plugin gets the holders of the thin old version and its moves are
    applied (the built-in path applies the same policy incrementally: same packing here)."""
    from dora_ext.core import LoadVersion, Migrate

    rules = _rules()

    calls = []

    class Recorder:
        @hookimpl
        def dora_plan_migration(self, version, instances, newest_version, fill):
            calls.append((version, sorted(len(d["running"]) for d in instances)))
            return pack_plan(instances, fill)

    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(Recorder())
    packs = {}
    for name, plugins in (("hook", pm), ("builtin", None)):
        h, mark = rules.r5_after_step0(2, plugins)
        assert h.of(Migrate, mark)
        packs[name] = rules.v0_per_instance(h)
        freed = {m.src for m in h.of(Migrate, mark)}
        assert {a.instance_id for a in h.of(LoadVersion, mark) if a.version == 1} == freed
    assert calls and calls[0] == (0, [2, 2, 2, 2])
    assert packs["hook"] == packs["builtin"] == [4, 4]


def test_a_migration_plan_onto_the_same_instance_is_refused():
    """A plugin's move whose source is its destination is not feasible: it is refused with a
    `ProtocolError` naming the move (it raised a bare KeyError from the occupancy levels, after
    the instance's count and levels had gone out of step)."""
    from dora_ext.core.scheduler import ProtocolError

    rules = _rules()

    class OntoItself:
        @hookimpl
        def dora_plan_migration(self, version, instances, newest_version, fill):
            i = instances[0]
            return [(g, idx, i["id"], i["id"]) for g, idx in i["running"][:1]]

    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(OntoItself())
    h = rules.Harness(pm, mode="dora", max_staleness=2, batch_size=2, group_size=2, instances=4, capacity=8)
    h.finish_group(0)
    h.finish_group(1)
    with pytest.raises(ProtocolError, match="from 0 to 0 is not feasible"):
        h.train(0)


def test_a_batch_key_that_puts_a_newer_version_first_does_not_deadlock():
    """A plugin's `dora_batch_key` of plain completion order `(complete_seq,)` in mode dora: a completed group of a
    newer version could head the pool while the older group the step must take (C3) completed behind it; the scheduler
    waited for the head to become takeable, which it never did (115 of these 200 runs deadlocked). It now takes the
    smallest key among the versions it can take, as the other modes do, and every run keeps C2/C3."""
    import random

    from dora_ext.testing import Deadlock

    from .test_properties import check_run

    class CompletionOrder:
        @hookimpl
        def dora_batch_key(self, group_id, version, complete_seq, mode):
            return (complete_seq,)

    waits = 0
    for seed in range(200):
        rng = random.Random(seed)
        cfg = random_dora_config(rng)
        pm = get_plugin_manager(load_entrypoints=False)
        pm.register(CompletionOrder())
        d = RandomDriver(cfg, seed, plugins=pm, long_tail=0.5)
        d.start()
        try:
            d.run(8)
        except Deadlock as exc:
            raise AssertionError(f"seed {seed}: {exc}") from None
        check_run("dora", d, 8)
        waits += d.sched.metrics()["trainer_waits_for_older"]
    assert waits  # the runs reached the state: a pooled version that could not be taken yet


def test_a_plugin_keeping_the_default_keys_counts_the_same_waits_as_the_built_ins():
    """Mode dora with any plugin takes the smallest key it can take (see the test above); with the default keys that is
    the built-in choice, and `trainer_waits_for_older` ("the first group in key order had to wait for older ones") must
    count the same. It counted every pooled version it found untakeable, in the pools' order, even behind a smaller key
    it took: with a plugin that only restates the default admission key, 2 waits became 3, 4 became 6."""
    import random

    from dora_ext.core import Scheduler

    class DefaultAdmission:
        @hookimpl
        def dora_admission_key(self, group_id, version, seq, meta, mode):
            return (seq,)

    class Twin(RandomDriver):
        def start(self):
            pm = get_plugin_manager(load_entrypoints=False)
            pm.register(DefaultAdmission())
            self.twin = Scheduler(self.config, plugins=pm)
            out = self.sched.start()
            assert self.twin.start() == out
            self.execute(out)

        def _feed(self, event):
            twin = self.twin.handle(event)
            out = super()._feed(event)
            assert twin == out, (event, twin, out)
            return out

    waits = 0
    for seed in range(60):
        rng = random.Random(seed)
        cfg = random_dora_config(rng)
        d = Twin(cfg, seed, long_tail=0.5, late_reward=0.3)
        d.start()
        d.run(8)
        assert d.twin.metrics()["trainer_waits_for_older"] == d.sched.metrics()["trainer_waits_for_older"], seed
        waits += d.sched.metrics()["trainer_waits_for_older"]
    assert waits  # (the runs waited: the counts compared are not all zero)


class MetricsOnly:
    @hookimpl
    def dora_metrics(self, step, metrics):
        pass


@pytest.mark.parametrize("plugin", ["metrics", "declining"])
def test_a_plugin_that_decides_nothing_changes_no_decision(plugin):
    """A plugin implementing only `dora_metrics` (or policy hooks that all decline with None) changes
    no action: one R5 algorithm and one R3 order whatever is registered. verl and slime load
    entry points, so installing a metrics sink once changed migrations in most dora runs."""
    import random

    from dora_ext.core import Scheduler
    from dora_ext.testing import feed_twinned

    class Declining(MetricsOnly):
        @hookimpl
        def dora_plan_migration(self, version, instances, newest_version, fill):
            return None

    class Twin(RandomDriver):
        def start(self):
            self.plain = Scheduler(self.config)
            out = self.sched.start()
            assert self.plain.start() == out
            self.execute(out)

        def _feed(self, event):
            return feed_twinned(self.plain, super()._feed, event)

    moves = 0
    for seed in range(40):
        rng = random.Random(seed)
        cfg = random_dora_config(rng, instances=(2, 5))
        pm = get_plugin_manager(load_entrypoints=False)
        pm.register(MetricsOnly() if plugin == "metrics" else Declining())
        d = Twin(cfg, seed, plugins=pm, long_tail=0.5, late_reward=0.3, landed_prob=0.5)
        d.start()
        d.run(8)
        moves += d.stats.migrations
    assert moves  # migration was on and moved trajectories: the compared runs include R5
