"""A group's `meta` and the plugins' keys survive the snapshot's JSON round trip unchanged.

The snapshot is JSON data (the simulator's `--resume` and the embedded runtime store it as JSON).
A tuple in a group's `meta` came back from it as a list, so a run resumed from a checkpoint
handed policies other values than the uninterrupted run. The scheduler now keeps `meta` as its
JSON round trip gives it back from admission on (a tuple becomes a list) and refuses, naming
`GroupAdmitted.meta` and the path, what JSON cannot give back (a non-str key, NaN, a set, ...).
The admission and batch keys of plugins, also in the snapshot, must be tuples of JSON scalars.

Two limits of what JSON can hold are checked at admission too, so that they fail there, naming
the field, and not later when the snapshot is written: a meta whose shared sub-objects make a
huge tree (JSON has no sharing: `a = [a, a]` forty times is 3 * 2**40 - 1 values written out) is refused
past 1,000,000 values (or 100,000,000 characters of str) after walking at most that many, and
an int of more than 4,300 decimal digits (Python's `json.dumps` and `json.loads` raise on it) is
refused in meta, in a plugin's key and as a group id.
"""

import collections
import enum
import json
import math
import random

import pytest

from dora_ext import hookimpl
from dora_ext.config import DoraConfig
from dora_ext.core import Scheduler
from dora_ext.core import actions as A
from dora_ext.core import events as E
from dora_ext.core.scheduler import ProtocolError
from dora_ext.plugins import get_plugin_manager
from dora_ext.testing import RandomDriver, stable_seed


class ShapeFirst:
    """A batch policy that reads each group's `meta` through the scheduler (`groups[gid].meta`)
    and tells a tuple from a list: groups whose `shape` is a tuple are trained first. It notes
    what it saw for each group."""

    def __init__(self):
        self.sched = None
        self.seen = {}

    @hookimpl
    def dora_batch_key(self, group_id, version, complete_seq, mode):
        shape = self.sched.groups[group_id].meta["shape"]
        self.seen[group_id] = type(shape).__name__
        return (0 if isinstance(shape, tuple) else 1, complete_seq)


def _scheduler(cfg, snap=None):
    policy = ShapeFirst()
    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(policy)
    s = Scheduler(cfg, plugins=pm) if snap is None else Scheduler.restore(snap, plugins=pm)
    policy.sched = s
    return s, policy


def _random_config(rng, modes, instances, max_steps):
    """A random (mode, staleness) of `modes` and a config of 2-4 batch, 1-3 group, `instances`
    (an inclusive range), 2-4 capacity; returns the mode and the config."""
    mode, k = rng.choice(modes)
    return mode, DoraConfig.from_dict({"mode": mode, "max_staleness": k, "batch_size": rng.randint(2, 4),
                                       "group_size": rng.randint(1, 3), "instances": rng.randint(*instances),
                                       "capacity": rng.randint(2, 4), "max_steps": max_steps})


class _Twinned(RandomDriver):
    """A driver that also starts a second scheduler, `self.twin` (set by the subclass), which
    must answer the start with the same actions."""

    def start(self):
        out = self.sched.start()
        assert self.twin.start() == out
        self.execute(out)


class ResumedTwin(_Twinned):
    """Drives an uninterrupted scheduler; a second one gets the same events and, at event
    `resume_at`, is replaced by a scheduler restored from its own snapshot's JSON round trip.
    Each answers every event with the same actions; their snapshots and metas stay equal."""

    def __init__(self, cfg, seed, resume_at, **kw):
        sched, self.policy = _scheduler(cfg)  # the uninterrupted one
        super().__init__(cfg, seed, scheduler=sched, **kw)
        self.twin, self.twin_policy = _scheduler(cfg)
        self.resume_at = resume_at
        self.fed = 0
        self.resumed = False
        self.restored_active = set()

    def _feed(self, event):
        if isinstance(event, E.GroupAdmitted):  # meta with tuples, as a host may build it
            n = event.meta["len"]
            event = E.GroupAdmitted(event.group_id, {"len": n, "shape": (n, 2), "tags": ("t", (n, "x"))})
        if self.fed == self.resume_at:
            snap = json.loads(json.dumps(self.twin.snapshot()))
            self.twin, policy = _scheduler(self.config, snap)
            policy.seen = self.twin_policy.seen
            self.restored_active = {g for g, view in self.twin.groups.items() if view.state == "active"}
            self.twin_policy = policy
            self.resumed = True
        self.fed += 1
        twin = self.twin.handle(event)
        out = super()._feed(event)
        assert twin == out, (event, twin, out)
        if self.fed % 50 == 0 or self.fed == self.resume_at + 1:
            assert self.twin.snapshot() == self.sched.snapshot()  # (== tells a tuple from a list)
            for gid in self.sched.groups:
                assert repr(self.twin.groups[gid].meta) == repr(self.sched.groups[gid].meta)
        return out


def test_a_run_resumed_from_json_with_tuple_meta_acts_as_the_uninterrupted_one():
    resumed = restored_completions = 0
    for seed in range(40):
        rng = random.Random(stable_seed(f"meta-json/{seed}"))
        mode, cfg = _random_config(rng, [("dora", 2), ("dora", 3), ("partial", 3)], (2, 4), max_steps=8)
        d = ResumedTwin(cfg, rng.randrange(2**31), resume_at=rng.randint(10, 60), long_tail=0.5, late_reward=0.3)
        d.start()
        d.run(8)
        assert d.sched.step == 8
        assert d.twin.snapshot() == d.sched.snapshot()
        resumed += d.resumed
        # The policy saw the same meta for every group in both runs: lists (a tuple kept in the
        # uninterrupted run came back from the JSON snapshot as a list in the resumed one, and
        # such a group was then trained later there: other StartStep groups in some runs).
        assert d.policy.seen == d.twin_policy.seen and set(d.policy.seen.values()) == {"list"}
        restored_completions += len(set(d.twin_policy.seen) & d.restored_active)
    assert resumed == 40
    assert restored_completions  # groups active at the resume completed after it (the policy read their meta)


def _admit(meta, plugins=None, cfg=None):
    s = Scheduler(cfg or DoraConfig.from_dict({"mode": "pipeline", "instances": 1, "capacity": 2}), plugins)
    s.start()
    return s, s.handle(E.GroupAdmitted("g", meta))


class Color(enum.IntEnum):
    RED = 1


Point = collections.namedtuple("Point", "x y")


def test_meta_is_kept_as_its_json_round_trip_gives_it_back():
    meta = collections.OrderedDict(shape=(3, 4), p=Point(1, 2.5), c=Color.RED, tags=["a", ("b",)], none=None,
                                   flag=True)
    s, _ = _admit(meta)
    kept = s.groups["g"].meta
    assert kept == json.loads(json.dumps(meta)) == {"shape": [3, 4], "p": [1, 2.5], "c": 1, "tags": ["a", ["b"]],
                                                    "none": None, "flag": True}
    assert type(kept) is dict and type(kept["c"]) is int and kept is not meta
    assert s.snapshot()["groups"][0][4] == kept
    assert s.snapshot()["groups"][0][4] is not kept  # the snapshot is a copy: mutating it changes nothing here
    # The admission key sees the same meta (a plugin's, here).
    seen = []

    class Key:
        @hookimpl
        def dora_admission_key(self, group_id, version, seq, meta, mode):
            seen.append(meta)
            return (seq,)

    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(Key())
    _admit({"shape": (1, 2)}, pm)
    assert seen == [{"shape": [1, 2]}]


@pytest.mark.parametrize(
    "meta, words",
    [
        ({1: "a"}, "GroupAdmitted.meta has the key 1 (int): the keys of a JSON object are str"),
        ({"a": {None: 1}}, "GroupAdmitted.meta['a'] has the key None"),
        ({"len": float("nan")}, "GroupAdmitted.meta['len'] is nan: JSON has no NaN or infinity"),
        ({"x": [1, float("inf")]}, "GroupAdmitted.meta['x'][1] is inf"),
        ({"s": {1, 2}}, "GroupAdmitted.meta['s'] is {1, 2} (set): expected JSON data"),
        (b"raw", "GroupAdmitted.meta is b'raw' (bytes)"),
    ],
)
def test_meta_json_cannot_give_back_is_refused_and_nothing_changes(meta, words):
    s = Scheduler(DoraConfig.from_dict({"mode": "pipeline", "instances": 1, "capacity": 2}))
    s.start()
    s.handle(E.InstanceLoaded(0, 0))
    before = json.dumps(s.snapshot())
    with pytest.raises(ProtocolError) as err:
        s.handle(E.GroupAdmitted("g", meta))
    assert str(err.value).startswith(words), err.value
    assert json.dumps(s.snapshot()) == before  # the group was not admitted; the request still stands
    assert any(isinstance(a, A.Dispatch) for a in s.handle(E.GroupAdmitted("g", {"ok": [1]})))


def test_a_cycle_in_meta_is_refused_by_name():
    cyc: list = []
    cyc.append(cyc)
    with pytest.raises(ProtocolError, match=r"^GroupAdmitted\.meta(\[0\])+: JSON data nested deeper than 64"):
        _admit(cyc)


def test_restore_keeps_meta_in_json_form_without_a_json_round_trip():
    """A snapshot restored in memory (no JSON in between) gives the same meta as through JSON."""
    s, _ = _admit({"shape": [3, 4]})
    snap = s.snapshot()
    snap["groups"][0][4] = {"shape": (3, 4)}  # (as an older in-memory snapshot may hold it)
    t = Scheduler.restore(snap)
    assert t.groups["g"].meta == {"shape": [3, 4]} and type(t.groups["g"].meta["shape"]) is list
    snap["groups"][0][4] = {"bad": {1, 2}}
    with pytest.raises(ProtocolError, match=r"^snapshot group 'g' meta\['bad'\] is \{1, 2\} \(set\)"):
        Scheduler.restore(snap)


@pytest.mark.parametrize("hook", ["dora_admission_key", "dora_batch_key"])
@pytest.mark.parametrize("key", [(("a", 1),), (1, {2}), "ab", 7, (float("nan"),), (1, float("inf"))])
def test_plugin_keys_must_be_tuples_of_json_scalars(hook, key):
    """A key element JSON cannot give back unchanged (a tuple came back as a list, and a resumed
    queue then compared a list with a tuple) is refused naming the hook, when the plugin returns it."""
    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(_key_plugin(hook, key))
    s = Scheduler(DoraConfig.from_dict({"mode": "pipeline", "instances": 1, "capacity": 2, "group_size": 1}), pm)
    s.start()
    s.handle(E.InstanceLoaded(0, 0))
    with pytest.raises(ProtocolError, match=rf"^{hook} returned .*(is not a JSON scalar|expected a tuple of JSON scalars)"):
        s.handle(E.GroupAdmitted("g"))
        s.handle(E.TrajectoryFinished("g", 0, 5, 1.0))


@pytest.mark.parametrize("hook", ["dora_admission_key", "dora_batch_key"])
def test_plugin_keys_of_json_scalars_are_taken_as_json_gives_them_back(hook, monkeypatch):
    key = [Color.RED, "x", None, 1.5, True]
    s, taken = _admitted_with_key(hook, key, monkeypatch)
    snap = s.snapshot()
    s.handle(E.TrajectoryFinished("g", 0, 5, 1.0))
    mine = [k for name, k in taken if name == hook]  # (the other hook is the default's)
    assert mine == [(1, "x", None, 1.5, True)] and type(mine[0][0]) is int
    if hook == "dora_admission_key":
        assert snap["groups"][0][3] == [1, "x", None, 1.5, True]
    assert json.loads(json.dumps(snap)) == snap


def _admitted_with_key(hook, key, monkeypatch):
    """A scheduler (dora, 1 instance, group size 1) whose plugin's `hook` returns `key`, with
    group "g" admitted and dispatched; and the list that gets (hook name, key taken) at each call
    of the scheduler's `_json_key`."""
    from dora_ext.core import scheduler as S

    taken = []
    real = S._json_key
    monkeypatch.setattr(S, "_json_key", lambda key, name: taken.append((name, real(key, name))) or taken[-1][1])
    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(_key_plugin(hook, key))
    s = Scheduler(DoraConfig.from_dict({"mode": "dora", "instances": 1, "capacity": 2, "group_size": 1,
                                        "batch_size": 2}), pm)
    s.start()
    s.handle(E.InstanceLoaded(0, 0))
    s.handle(E.GroupAdmitted("g"))
    return s, taken


def _key_plugin(hook, key):
    class Plugin:
        if hook == "dora_admission_key":
            @hookimpl
            def dora_admission_key(self, group_id, version, seq, meta, mode):
                return key
        else:
            @hookimpl
            def dora_batch_key(self, group_id, version, complete_seq, mode):
                return key

    return Plugin()


class Level(str, enum.Enum):
    """A `(str, Enum)`: `str(Level.HARD)` is "Level.HARD", JSON writes its value "hard"."""

    HARD = "hard"


class Loud(str):
    def __str__(self):
        return "LOUD"


class Seven(int):
    def __int__(self):
        return 7


class Half(float):
    def __float__(self):
        return 0.5


def test_subclasses_of_str_int_float_are_kept_as_json_writes_them():
    """JSON writes the value of a str, int or float subclass, not what `str()`, `int()` or
    `float()` return (a `(str, Enum)` member's name, an override): the kept meta is what the
    JSON round trip gives back, in keys, values, lists and at the top."""
    meta = {"level": Level.HARD, Level.HARD: [Level.HARD, Loud("q"), Seven(3), Half(2.25)], Loud("k"): Loud("v")}
    s, _ = _admit(meta)
    kept = s.groups["g"].meta
    assert kept == json.loads(json.dumps(meta)) == {"level": "hard", "hard": ["hard", "q", 3, 2.25], "k": "v"}
    assert [type(x) for x in kept["hard"]] == [str, str, int, float]
    for scalar in (Level.HARD, Loud("q"), Seven(3), Half(2.25)):
        s, _ = _admit(scalar)
        assert s.groups["g"].meta == json.loads(json.dumps(scalar))


@pytest.mark.parametrize("hook", ["dora_admission_key", "dora_batch_key"])
def test_plugin_key_subclass_elements_are_taken_as_json_writes_them(hook, monkeypatch):
    key = (Level.HARD, Loud("q"), Seven(3), Half(2.25))
    s, taken = _admitted_with_key(hook, key, monkeypatch)
    s.handle(E.TrajectoryFinished("g", 0, 5, 1.0))
    mine = [k for name, k in taken if name == hook]
    assert mine == [tuple(json.loads(json.dumps(key)))] == [("hard", "q", 3, 2.25)]


def test_a_refused_batch_key_loses_no_group():
    """The batch key was computed after the group was recorded complete: a key refused (or a
    plugin that raised) left a complete group in no pool, never trained and never failed, and
    the reward sent again was a stale report. The key now comes first, before the finish changes
    anything: the trajectory still runs, and the finish sent again completes the group, which is
    trained; a late reward refused likewise leaves the trajectory awaiting it."""
    calls = []

    class FirstBad:
        @hookimpl
        def dora_batch_key(self, group_id, version, complete_seq, mode):
            calls.append(complete_seq)
            return ((1, 2),) if len(calls) == 1 else (complete_seq,)

    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(FirstBad())
    s = Scheduler(DoraConfig.from_dict({"mode": "dora", "instances": 1, "capacity": 2, "group_size": 2,
                                        "batch_size": 1}), pm)
    s.start()
    s.handle(E.InstanceLoaded(0, 0))
    s.handle(E.GroupAdmitted("g"))
    s.handle(E.TrajectoryFinished("g", 0, 5, 1.0))
    before = s.snapshot()
    with pytest.raises(ProtocolError, match=r"^dora_batch_key returned") as err:
        s.handle(E.TrajectoryFinished("g", 1, 5, 1.0))
    assert err.value.actions == [] and s.snapshot() == before
    g = s.groups["g"]
    assert (g.state, g.done, g.complete_seq, s.metrics()["groups_completed"]) == ("active", 1, None, 0)
    assert [t.status for t in s.trajectories("g")] == ["D", "R"]  # (done; still running)
    out = s.handle(E.TrajectoryFinished("g", 1, 5, 1.0))  # the finish again: the group completes now
    assert calls == [0, 0]  # (the same completion sequence number the second time)
    assert any(isinstance(a, A.StartStep) and a.group_ids == ("g",) for a in out), out
    assert s.metrics()["stale_events"] == 0
    # A reward sent late (`RewardReady`) whose key is refused: the trajectory still awaits it.
    calls.clear()
    s.handle(E.GroupAdmitted("h"))
    s.handle(E.TrajectoryFinished("h", 0, 5, 1.0))
    s.handle(E.TrajectoryFinished("h", 1, 5))
    with pytest.raises(ProtocolError, match=r"^dora_batch_key returned") as err:
        calls.clear()  # (the next key is the bad one again)
        s.handle(E.RewardReady("h", 1, 1.0))
    assert err.value.actions == [] and [t.status for t in s.trajectories("h")] == ["D", "F"]


class MixedKinds:
    """Keys whose elements differ in kind at one position: None or an int (batch), a str or an
    int (admission). Compared by `<`, those raised `TypeError` inside a heap push or pop,
    halfway through an event."""

    @hookimpl
    def dora_admission_key(self, group_id, version, seq, meta, mode):
        return ("late", seq) if seq % 3 == 0 else (seq % 2, seq)

    @hookimpl
    def dora_batch_key(self, group_id, version, complete_seq, mode):
        return (None if complete_seq % 2 else complete_seq, complete_seq)


class _SnapshotTwin(_Twinned):
    """Also feeds every event to a second scheduler, restored at event `at` from a JSON round
    trip of its own snapshot; both must answer every event with the same actions."""

    def __init__(self, cfg, seed, at, **kw):
        super().__init__(cfg, seed, plugins=_mixed_plugins(), **kw)
        self.twin = Scheduler(cfg, plugins=_mixed_plugins())
        self.at, self.fed, self.resumed = at, 0, False

    def _feed(self, event):
        if self.fed == self.at:
            snap = json.loads(json.dumps(self.twin.snapshot()))
            self.twin = Scheduler.restore(snap, plugins=_mixed_plugins())
            assert self.twin.snapshot() == snap  # (the plugin's keys as it gave them, in JSON form)
            self.resumed = True
        self.fed += 1
        twin = self.twin.handle(event)
        out = super()._feed(event)
        assert twin == out, (event, twin, out)
        return out


def _mixed_plugins():
    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(MixedKinds())
    return pm


def test_keys_of_mixed_kinds_are_ordered_none_numbers_strs_and_survive_a_resume():
    """Each position of a key orders None before numbers before strs (the same order as before
    among keys of one kind), so such a plugin runs: every property holds, and a run resumed
    from a JSON snapshot answers every event as the uninterrupted one."""
    from .test_properties import check_run

    resumed = 0
    for seed in range(30):
        rng = random.Random(stable_seed(f"mixed-keys/{seed}"))
        mode, cfg = _random_config(rng, [("dora", 2), ("partial", 2), ("pipeline", 0)], (1, 3), max_steps=6)
        d = _SnapshotTwin(cfg, rng.randrange(2**31), at=rng.randint(5, 30), long_tail=0.5, late_reward=0.3)
        d.start()
        d.run(6)
        check_run(mode, d, 6)
        resumed += d.resumed
    assert resumed == 30
    # The order itself: an admission queue of one version, none dispatched yet.
    s = Scheduler(DoraConfig.from_dict({"mode": "pipeline", "instances": 1, "capacity": 5, "group_size": 1,
                                        "batch_size": 5}), _mixed_plugins())
    s.start()
    for g in range(5):
        s.handle(E.GroupAdmitted(f"g{g}"))
    out = s.handle(E.InstanceLoaded(0, 0))
    # keys: g0 ("late", 0), g1 (1, 1), g2 (0, 2), g3 ("late", 3), g4 (0, 4)
    assert [a.group_id for a in out if isinstance(a, A.Dispatch)] == ["g2", "g4", "g1", "g0", "g3"]
    assert s.groups["g0"].key == ("late", 0)  # (the view: the key as the plugin gave it)


# --- Limits checked at admission: a huge JSON tree, an int Python's JSON cannot write ---------

_BIG = 10**4300  # 4,301 digits: `json.dumps` raises ValueError (Python's default int-to-str limit)


class _ShortList(list):
    def __repr__(self):  # (so that a failing test's report does not write out the tree)
        return f"<list of {len(self)}>"


class _ShortDict(dict):
    def __repr__(self):
        return f"<dict of {len(self)}>"


def _shared_tree(kind, levels=40):
    """A small object (`levels` + 1 containers in memory) whose JSON form is a tree of
    3 * 2**levels - 1 values: each level holds the one below twice. Walked as a tree, 40 levels
    are about 3.3e12 visits, days of Python. (The outermost one's repr is short.)"""
    a = [0] if kind == "list" else {"leaf": 0}
    for _ in range(levels - 1):
        a = [a, a] if kind == "list" else {"l": a, "r": a}
    return _ShortList([a, a]) if kind == "list" else _ShortDict(l=a, r=a)


def _ready():
    """A pipeline scheduler with one instance loaded and a request for groups outstanding; and its
    snapshot as JSON text, to check that a refused admission changed nothing."""
    s = Scheduler(DoraConfig.from_dict({"mode": "pipeline", "instances": 1, "capacity": 2}))
    s.start()
    s.handle(E.InstanceLoaded(0, 0))
    return s, json.dumps(s.snapshot(), allow_nan=False)


def _refused_and_nothing_changed(s, before, event, words):
    with pytest.raises(ProtocolError) as err:
        s.handle(event)
    assert str(err.value).startswith(words), err.value
    assert json.dumps(s.snapshot(), allow_nan=False) == before  # not admitted; the request still stands
    out = s.handle(E.GroupAdmitted("next", {"ok": [1]}))  # the next admission works
    assert any(isinstance(a, A.Dispatch) and a.group_id == "next" for a in out), out


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_a_meta_of_shared_sub_objects_past_the_limit_is_refused_without_walking_the_tree(kind):
    """Before the limit, admission walked the 3 * 2**40 - 1 values of this meta (a hang: the JSON
    of the snapshot is that tree too). It is refused by name after at most the limit's values."""
    s, before = _ready()
    _refused_and_nothing_changed(
        s, before, E.GroupAdmitted("g", _shared_tree(kind)),
        "GroupAdmitted.meta: JSON data of more than 1,000,000 values, each appearance of a shared sub-object "
        "counted")


@pytest.mark.parametrize("form", ["list", "flat"])
def test_a_meta_of_shared_strs_past_the_character_limit_is_refused(form):
    """A 1,000,000-character str appearing 101 times (in a list, or as the values of a flat
    mapping): 101,000,000 characters written out."""
    s, before = _ready()
    text = "x" * 1_000_000
    meta = {"texts": [text] * 101} if form == "list" else {f"t{i}": text for i in range(101)}
    _refused_and_nothing_changed(s, before, E.GroupAdmitted("g", meta),
                                 "GroupAdmitted.meta: JSON data of more than 100,000,000 characters of str")
    if form == "flat":  # (99 appearances and the keys: under the limit, admitted)
        meta.popitem(), meta.popitem()
        s.handle(E.GroupAdmitted("flat", meta))
        assert s.groups["flat"].meta == meta


def test_the_value_limit_is_exact_and_a_shared_meta_under_it_is_kept_as_a_tree():
    s, before = _ready()
    # A list of 999,999 ints is 1,000,000 values with the list itself: admitted.
    s.handle(E.GroupAdmitted("at", list(range(999_999))))
    assert s.groups["at"].meta == list(range(999_999))
    s, before = _ready()
    _refused_and_nothing_changed(s, before, E.GroupAdmitted("over", list(range(1_000_000))),
                                 "GroupAdmitted.meta: JSON data of more than 1,000,000 values")
    # Shared sub-objects under the limit: kept as JSON gives them back, a tree without sharing
    # (mutating one branch of the kept meta does not change the other).
    s, _ = _ready()
    tree = _shared_tree("dict", levels=10)
    s.handle(E.GroupAdmitted("g", tree))
    kept = s.groups["g"].meta
    assert kept == json.loads(json.dumps(tree)) and kept["l"] is not kept["r"]


def test_metas_as_hosts_send_them_are_unaffected_by_the_limits():
    """The adapters' metas (`{"length": n}`, `{"prompt_tokens": n}`) and a larger, verl-like one
    (a chat of a few thousand values, token ids, floats near the ends of their range): kept as
    their JSON round trip gives them back, and the snapshot is strict JSON (no NaN, no infinity)."""
    chat = {"messages": [{"role": "user" if i % 2 else "assistant", "content": f"turn {i} " * 20}
                         for i in range(1000)],
            "prompt_ids": list(range(5000)), "data_source": "gsm8k", "reward_model": {"style": "rule"},
            "extra_info": {"index": 7, "split": "train", "temperature": 0.7, "tiny": 5e-324, "huge": 1.7e308,
                           "neg_zero": -0.0, "max_int": _BIG - 1, "min_int": 1 - _BIG}}
    s, _ = _ready()
    for gid, meta in [("a", {"length": 17}), ("b", {"prompt_tokens": 300}), ("c", chat)]:
        s.handle(E.GroupAdmitted(gid, meta))
        assert s.groups[gid].meta == json.loads(json.dumps(meta)) == meta
    text = json.dumps(s.snapshot(), allow_nan=False)
    assert json.loads(text) == s.snapshot()
    assert Scheduler.restore(json.loads(text)).groups["c"].meta == chat


@pytest.mark.parametrize(
    "meta, words",
    [
        ({"n": _BIG}, "GroupAdmitted.meta['n'] is <int of 14285 bits>: an int of more than 4,300 decimal digits"),
        ([1, {"n": -_BIG}], "GroupAdmitted.meta[1]['n'] is <int of 14285 bits>: an int of more than 4,300"),
        ({"c": Color(1), "n": (Seven(_BIG),)}, "GroupAdmitted.meta['n'][0] is <int of 14285 bits>"),
        (_BIG, "GroupAdmitted.meta is <int of 14285 bits>: an int of more than 4,300 decimal digits"),
    ],
    ids=["in-a-dict", "negative", "int-subclass-in-a-tuple", "the-meta"],
)
def test_an_int_json_cannot_write_is_refused_at_admission(meta, words):
    """Admitted, it made `json.dumps(snapshot)` raise ValueError later, far from the cause."""
    with pytest.raises(ValueError):
        json.dumps(meta)  # (what the snapshot met)
    s, before = _ready()
    _refused_and_nothing_changed(s, before, E.GroupAdmitted("g", meta), words)


def test_a_group_id_json_cannot_write_is_refused_at_admission():
    s, before = _ready()
    _refused_and_nothing_changed(s, before, E.GroupAdmitted(-_BIG),
                                 "GroupAdmitted.group_id is <int of 14285 bits>: an int of more than 4,300")
    s.handle(E.GroupAdmitted(_BIG - 1))  # (the longest int JSON writes is admitted)
    assert json.loads(json.dumps(s.snapshot()))["groups"][-1][0] == _BIG - 1


class _BigFirst:
    """A plugin whose `hook` returns a key with an int JSON cannot write the first time, then
    a good key."""

    def __init__(self, hook):
        self.calls = 0
        if hook == "dora_admission_key":
            self.dora_admission_key = hookimpl(lambda group_id, version, seq, meta, mode: self._key(seq))
        else:
            self.dora_batch_key = hookimpl(lambda group_id, version, complete_seq, mode: self._key(complete_seq))

    def _key(self, n):
        self.calls += 1
        return ("x", Seven(_BIG)) if self.calls == 1 else ("x", _BIG - 1, n)


def test_an_admission_key_json_cannot_write_is_refused_and_nothing_changes():
    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(_BigFirst("dora_admission_key"))
    s = Scheduler(DoraConfig.from_dict({"mode": "pipeline", "instances": 1, "capacity": 2}), pm)
    s.start()
    s.handle(E.InstanceLoaded(0, 0))
    before = json.dumps(s.snapshot(), allow_nan=False)
    _refused_and_nothing_changed(
        s, before, E.GroupAdmitted("g"),
        "dora_admission_key returned a key whose element 1 is <int of 14285 bits>: an int of more than 4,300")
    assert s.groups["next"].key == ("x", _BIG - 1, 0)
    assert json.loads(json.dumps(s.snapshot()))["groups"][0][3] == ["x", _BIG - 1, 0]


def test_a_batch_key_json_cannot_write_is_refused_and_loses_no_group():
    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(_BigFirst("dora_batch_key"))
    s = Scheduler(DoraConfig.from_dict({"mode": "dora", "instances": 1, "capacity": 2, "group_size": 1,
                                        "batch_size": 1}), pm)
    s.start()
    s.handle(E.InstanceLoaded(0, 0))
    s.handle(E.GroupAdmitted("g"))
    with pytest.raises(ProtocolError, match=r"^dora_batch_key returned a key whose element 1 is <int of 14285 bits>"):
        s.handle(E.TrajectoryFinished("g", 0, 5, 1.0))
    assert s.groups["g"].state == "active" and [t.status for t in s.trajectories("g")] == ["R"]
    out = s.handle(E.TrajectoryFinished("g", 0, 5, 1.0))  # the finish again: the group completes, is trained
    assert any(isinstance(a, A.StartStep) and a.group_ids == ("g",) for a in out), out
    json.dumps(s.snapshot(), allow_nan=False)


def _tree_reference(x, depth=0):
    """(values inside `x`, characters of its strs, its deepest container's depth), walking
    `x` as JSON writes it: each appearance of a shared sub-object again."""
    if isinstance(x, (dict, list, tuple)):
        values, chars, deepest = len(x), 0, depth
        for k, y in (x.items() if isinstance(x, dict) else enumerate(x)):
            chars += len(k) if isinstance(x, dict) else 0
            v, c, d = _tree_reference(y, depth + 1)
            values, chars, deepest = values + v, chars + c, max(deepest, d)
        return values, chars, deepest
    return 0, len(x) if isinstance(x, str) else 0, -1


def _no_sharing(x, seen):
    if isinstance(x, (dict, list)):
        assert id(x) not in seen
        seen.add(id(x))
        for y in x.values() if isinstance(x, dict) else x:
            _no_sharing(y, seen)


def _set_limits(monkeypatch, limits):
    """The meta walk's limits (values, str characters, depth) set to `limits` for one test."""
    from dora_ext.core import _json as S

    monkeypatch.setattr(S, "_JSON_VALUES", limits[0])
    monkeypatch.setattr(S, "_JSON_CHARS", limits[1])
    monkeypatch.setattr(S, "_JSON_DEPTH", limits[2])


@pytest.mark.parametrize("limits", [(60, 1000, 8), (150, 400, 6), (10**6, 10**8, 5)])
def test_random_shared_metas_are_kept_or_refused_as_a_tree_walk_decides(limits, monkeypatch):
    """The walk remembers each container's size, so a shared one is charged without a second
    walk: on random objects with shared sub-objects (lists, tuples, dicts, at different depths)
    and small limits, it keeps what a plain tree walk keeps (the JSON round trip, no sharing in
    the copy) and refuses, with a limit that the tree walk finds exceeded, what it refuses."""
    from dora_ext.core import _json as S

    _set_limits(monkeypatch, limits)
    rng = random.Random(stable_seed(f"shared-metas/{limits}"))
    seen = collections.Counter()
    for _ in range(3000):
        pool = [0, "ab", "xyzw" * 3, 1.5, None, True]
        for _ in range(rng.randint(1, 12)):
            items = [rng.choice(pool[6:] if len(pool) > 6 and rng.random() < 0.6 else pool)
                     for _ in range(rng.randint(0, 4))]
            kind = rng.choice(["list", "tuple", "dict"])
            pool.append(items if kind == "list" else tuple(items) if kind == "tuple"
                        else {f"k{i}": y for i, y in enumerate(items)})
        x = pool[-1]
        values, chars, deepest = _tree_reference(x)
        exceeded = {what for what, over in [("nested deeper", deepest >= limits[2]),
                                            ("values", values + 1 > limits[0]),
                                            ("characters", chars > limits[1])] if over}
        try:
            kept = S._json_data(x, "m")
        except ProtocolError as e:
            what = next(w for w in ["nested deeper", "characters", "values"] if w in str(e))
            assert what in exceeded, (str(e), exceeded)
            seen[what] += 1
        else:
            assert not exceeded, exceeded
            assert kept == json.loads(json.dumps(x))
            _no_sharing(kept, set())
            seen["kept"] += 1
    assert seen["kept"] > 100 and len(seen) > 1, seen  # (both outcomes drawn)


# --- Containers whose `len()` is not what they hold (review of the limits) -----------------


class _LenZeroList(list):
    def __len__(self):  # (a list subclass may say anything; `list()` and JSON iterate it)
        return 0


class _LenZeroDict(dict):
    def __len__(self):
        return 0


class _ItemsDict(dict):
    """Holds one item but its `items()` (what JSON and the walk read) yields `self.n`."""

    def __init__(self, n):
        super().__init__(a=0)
        self.n = n

    def items(self):
        return ((f"k{i}", i) for i in range(self.n))


class _IterList(list):
    """Empty, but its `__iter__` (what JSON and the walk read) yields `self.n` items."""

    def __init__(self, n):
        super().__init__()
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


@pytest.mark.parametrize("make", [lambda n: _LenZeroList(range(n)),
                                  lambda n: _LenZeroDict((f"k{i}", i) for i in range(n)), _ItemsDict, _IterList],
                         ids=["len-list", "len-dict", "items-dict", "iter-list"])
def test_a_container_whose_len_lies_is_charged_what_it_yields(make, monkeypatch):
    """The walk charged a container `len(x)` values before walking it, and its items were not
    charged again: a list or dict subclass whose `__len__` said 0 (or whose `items()` or
    `__iter__` yields more than it holds) passed any number of values under the limit. It is
    charged what it yields now (and reads at most one item past the limit)."""
    from dora_ext.core import _json as S

    monkeypatch.setattr(S, "_JSON_VALUES", 100)
    for where in ("top", "nested"):
        over = make(500)
        with pytest.raises(ProtocolError, match=r"^m: JSON data of more than 100 values"):
            S._json_data(over if where == "top" else {"x": [over]}, "m")
        under = make(90)
        meta = under if where == "top" else {"x": [under]}
        kept = S._json_data(meta, "m")
        # (90 items, as JSON writes them)
        assert kept == json.loads(json.dumps(meta)) and json.dumps(meta).count(",") == 89


class _AlwaysIn(int):
    """An int whose comparisons say True: Python calls a subclass's reflected `>` first, so
    `low < x < high` asked `x` itself."""

    def __lt__(self, other):
        return True

    def __gt__(self, other):
        return True

    __hash__ = int.__hash__


def test_a_group_id_of_an_int_subclass_is_bounded_by_its_value():
    """The group id's bound compared the id itself: an int subclass whose `<` and `>` say True
    was admitted with 4,301 digits, and `json.dumps(snapshot)` raised ValueError later."""
    s, before = _ready()
    _refused_and_nothing_changed(s, before, E.GroupAdmitted(_AlwaysIn(_BIG)),
                                 "GroupAdmitted.group_id is <_AlwaysIn of 14285 bits>: an int of more than 4,300")
    s.handle(E.GroupAdmitted(_AlwaysIn(7)))
    assert json.loads(json.dumps(s.snapshot()))["groups"][-1][0] == 7


class _Flip(tuple):
    """A key whose first iteration yields `(1, "a")` and every later one `(1, <4,301-digit int>)`."""

    def __iter__(self):
        self.n = getattr(self, "n", 0) + 1
        return iter((1, "a") if self.n == 1 else (1, _BIG))


@pytest.mark.parametrize("hook", ["dora_admission_key", "dora_batch_key"])
def test_a_key_is_read_once_and_what_was_checked_is_kept(hook):
    """`_json_key` checked a key's elements by iterating it, then kept `tuple(key)`, which
    iterates a tuple or list subclass again: what its second iteration yielded (here an int
    JSON cannot write) was kept unchecked, and `json.dumps(snapshot)` raised later. The key is
    read once now: what was checked is what is kept."""
    from dora_ext.core._json import _json_key

    assert _json_key(_Flip(), hook) == (1, "a")
    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(_key_plugin(hook, _Flip()))
    s = Scheduler(DoraConfig.from_dict({"mode": "dora", "instances": 1, "capacity": 2, "group_size": 1,
                                        "batch_size": 2}), pm)
    s.start()
    s.handle(E.InstanceLoaded(0, 0))
    s.handle(E.GroupAdmitted("g"))
    s.handle(E.TrajectoryFinished("g", 0, 5, 1.0))
    assert json.loads(json.dumps(s.snapshot(), allow_nan=False))["groups"][0][0] == "g"


# --- Random metas with subclasses and sharing against a plain tree walk (review) ------------

try:
    import numpy as _np
except ImportError:  # (numpy scalars are drawn only where numpy is installed)
    _np = None


class _DSub(dict):
    pass


class _LSub(list):
    pass


class _Fresh(list):
    """Yields fresh copies of its list items at each iteration: new objects (new ids) each time."""

    def __iter__(self):
        return iter([list(y) if type(y) is list else y for y in list.__iter__(self)])


class _FreshItems(dict):
    def items(self):
        return [(k, list(v) if type(v) is list else v) for k, v in dict.items(self)]


_GOOD = [0, -5, True, False, None, 1.5, -0.0, "ab", "", Level.HARD, Loud("q"), Color.RED, Seven(3), Half(2.25),
         _BIG - 1, 1 - _BIG, 5e-324, "xyzw" * 3] + ([] if _np is None else [_np.float64(2.5), _np.str_("s")])
_BAD = [_BIG, -_BIG, Seven(_BIG), float("nan"), float("inf"), Half(float("nan")), b"x", {1, 2}] + (
    [] if _np is None else [_np.int64(3), _np.bool_(True), _np.float64("nan")])
_KEYS_BAD = [1, None, 1.5, True, (1,), Color.RED]
_DICTS = {"dict": dict, "dsub": _DSub, "odict": collections.OrderedDict, "len0": _LenZeroDict, "fresh": _FreshItems}
_LISTS = {"list": list, "lsub": _LSub, "len0": _LenZeroList, "fresh": _Fresh, "tuple": tuple}


def _plain_walk(x, limits):
    """What JSON writes of `x` (each appearance of a shared part again), as a straightforward
    walk: (the JSON data, the set of reasons to refuse it: "values", "chars", "int", "nan",
    "key", "depth", "type"); "values" alone when it stopped at the value limit."""
    values, depth_limit = [0], limits[2]
    chars = [0]
    reasons = set()

    class Stop(Exception):
        pass

    def walk(x, depth):
        values[0] += 1
        if values[0] > limits[0]:
            reasons.add("values")
            raise Stop
        if x is None or x is True or x is False:
            return x
        if isinstance(x, str):
            chars[0] += len(str.__str__(x))
            return str.__str__(x)
        if isinstance(x, int):
            if abs(int.__int__(x)) >= _BIG:
                reasons.add("int")
            return int.__int__(x)
        if isinstance(x, float):
            if not math.isfinite(float.__float__(x)):
                reasons.add("nan")
            return float.__float__(x)
        if isinstance(x, (dict, list, tuple)):
            if depth >= depth_limit:
                reasons.add("depth")
                return None
            if isinstance(x, dict):
                out = {}
                for k, v in x.items():
                    if not isinstance(k, str):
                        reasons.add("key")
                    k = str.__str__(k) if isinstance(k, str) else repr(k)
                    chars[0] += len(k)
                    out[k] = walk(v, depth + 1)
                return out
            return [walk(v, depth + 1) for v in x]
        reasons.add("type")
        return None

    try:
        out = walk(x, 0)
    except Stop:
        return None, reasons
    if chars[0] > limits[1]:
        reasons.add("chars")
    return out, reasons


_REASONS = [("values", " values, each appearance"), ("chars", "characters of str"), ("int", "decimal digits"),
            ("nan", "NaN or infinity"), ("key", "keys of a JSON object"), ("depth", "nested deeper"),
            ("type", "expected JSON data")]


def _same(a, b):
    """Equal and of the same types throughout (1 == 1.0 == True, and -0.0 == 0.0, otherwise)."""
    if type(a) is not type(b):
        return False
    if type(a) is dict:
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if type(a) is list:
        return len(a) == len(b) and all(_same(p, q) for p, q in zip(a, b))
    return a == b and (type(a) is not float or math.copysign(1, a) == math.copysign(1, b))


def _random_meta(rng, p_bad):
    """Random containers of random kinds (dict, list, tuple, their subclasses, ones whose `len()`
    says 0, ones giving fresh objects at each read, a namedtuple), whose items are drawn from the
    scalars or, more often, from the containers built before: shared sub-objects, at different
    depths; now and then a cycle."""
    pool = []
    for _ in range(rng.randint(1, 14)):
        kind = rng.choice(list(_DICTS) * 1 + [f"l:{k}" for k in _LISTS] + ["point"])
        n = 2 if kind == "point" else rng.randint(0, 4)
        items = [rng.choice(pool) if pool and rng.random() < 0.6
                 else rng.choice(_BAD) if rng.random() < p_bad else rng.choice(_GOOD) for _ in range(n)]
        if kind in _DICTS:
            c = _DICTS[kind]()
            for i, y in enumerate(items):
                bad = rng.random() < p_bad / 2
                c[rng.choice(_KEYS_BAD) if bad else rng.choice(["a", Loud("k"), Level.HARD]) + str(i)] = y
        else:
            c = Point(*items) if kind == "point" else _LISTS[kind[2:]](items)
        pool.append(c)
    if rng.random() < 0.03:
        lists = [c for c in pool if type(c) in (list, _LSub)]
        if lists:
            list.append(rng.choice(lists), pool[-1])
    return pool[-1] if rng.random() < 0.7 else {"m": pool[-1]}


@pytest.mark.parametrize("limits", [(60, 1000, 8), (150, 400, 6), (25, 60, 4), (10**6, 10**8, 64)])
def test_random_metas_with_subclasses_are_kept_or_refused_as_a_plain_walk_decides(limits, monkeypatch):
    """Against a straightforward walk of what JSON writes (no memo, no fast path): the same
    decision, keep or refuse, with a reason the plain walk finds (the first one met may differ);
    what is kept is the plain walk's result, of the same types, without sharing, and equal to
    `json.loads(json.dumps(meta))`. The memo is keyed by object id: containers giving fresh
    objects at each read check that no id is reused within a walk."""
    from dora_ext.core import _json as S

    _set_limits(monkeypatch, limits)
    rng = random.Random(stable_seed(f"subclass-metas/{limits}"))
    seen = collections.Counter()
    for _ in range(1000):
        meta = _random_meta(rng, p_bad=rng.choice([0, 0, 0.02, 0.1]))
        expected, reasons = _plain_walk(meta, limits)
        try:
            kept = S._json_data(meta, "m")
        except ProtocolError as e:
            reason = next(r for r, words in _REASONS if words in str(e))
            assert reason in reasons or reasons == {"values"}, (str(e)[:200], reasons)
            seen[reason] += 1
            continue
        assert not reasons, reasons
        assert _same(kept, expected) and _same(kept, json.loads(json.dumps(meta)))
        _no_sharing(kept, set())
        seen["kept"] += 1
    assert seen["kept"] > 300 and len(seen) >= 5, seen


def test_the_flat_fast_path_decides_as_the_walk_on_random_flat_dicts():
    """A flat dict of str keys and plain scalars is copied without the walk: on random flat
    dicts (bool, int and float subclasses, numpy scalars, str subclasses, non-str keys, big ints,
    NaN, infinity, -0.0, near the limits) it keeps what the walk keeps, of the same types, and
    refuses for the same reason."""
    from dora_ext.core import _json as S

    def walk(x):
        budget = [S._JSON_VALUES - 1, S._JSON_CHARS, "m", {}, 0, False]
        out = S._json_walk(x, "m", 0, budget)
        return S._tree_copy(out) if budget[5] else out

    def outcome(f, x):
        try:
            return "kept", f(x)
        except ProtocolError as e:
            return "refused", next(r for r, words in _REASONS if words in str(e))

    values = [0, 1, -1, True, False, None, 0.0, -0.0, 1.5, 5e-324, 1.7e308, "", "x", "é" * 3, float("nan"),
              float("inf"), -float("inf"), Level.HARD, Loud("q"), Color.RED, Seven(3), Half(2.5), _BIG - 1, 1 - _BIG,
              _BIG, -_BIG, b"b", [1], (1,), {"a": 1}]
    keys = ["a", "b", "", Loud("k"), Level.HARD, 1, 0, True, None, 1.5, float("nan"), _BIG]
    if _np is not None:
        values += [_np.float64(2.5), _np.float64("nan"), _np.int64(3), _np.bool_(True), _np.str_("s")]
        keys += [_np.str_("ns")]
    rng = random.Random(stable_seed("flat-fast-path"))
    seen = collections.Counter()
    for limits in [(S._JSON_VALUES, S._JSON_CHARS), (5, 12)]:
        for _ in range(4000):
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(S, "_JSON_VALUES", limits[0])
                mp.setattr(S, "_JSON_CHARS", limits[1])
                d = {}
                for _ in range(rng.randint(0, 6)):
                    k = (rng.choice(keys) if rng.random() < 0.15
                         else rng.choice(["a", "b", "key"]) + str(rng.randint(0, 9)))
                    d[k] = rng.choice(values) if rng.random() < 0.3 else rng.choice(values[:14])
                fast, full = outcome(lambda y: S._json_data(y, "m"), d), outcome(walk, d)
                assert fast[0] == full[0] and (_same(fast[1], full[1]) if fast[0] == "kept" else fast[1] == full[1]), d
                if fast[0] == "kept":
                    assert fast[1] is not d and _same(fast[1], json.loads(json.dumps(d)))
                seen[fast[0] if fast[0] == "kept" else fast[1]] += 1
    assert seen["kept"] > 1000 and len(seen) >= 6, seen


def _two_groups_one_slot_waiting(plugin):
    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(plugin)
    s = Scheduler(DoraConfig.from_dict({"mode": "dora", "instances": 1, "capacity": 2, "group_size": 2,
                                        "batch_size": 4}), pm)
    s.start()
    s.handle(E.InstanceLoaded(0, 0))
    s.handle(E.GroupAdmitted("g0"))  # both trajectories run
    assert s.handle(E.TrajectoryFinished("g0", 0, 5, 1.0)) == [A.RequestGroups(1, 0)]
    assert s.handle(E.GroupAdmitted("g1")) == [A.Dispatch("g1", 0, 0, 0, 0)]  # g1/1 waits for a slot
    return s


def test_a_refused_batch_key_leaves_the_finish_unapplied_and_dispatches_nothing():
    """A finish that completes its group frees a slot, into which queued work is dispatched. The
    batch key was computed after that: refused, the `Dispatch` stayed behind and came back with
    the answer to the next event, and a host that took a snapshot after the error (and restored
    it) held a trajectory recorded as running that was never started. The key is now computed
    before the finish changes anything: the scheduler is exactly as before the event (its
    snapshot equal), the error carries no action, and the finish sent again is answered with the
    dispatch into the freed slot and the group's delivery."""
    plugin = _BigFirst("dora_batch_key")
    plugin.calls = -1  # (the first completion's key is the bad one: g0's)
    s = _two_groups_one_slot_waiting(plugin)
    plugin.calls = 0
    before = json.dumps(s.snapshot())
    with pytest.raises(ProtocolError, match=r"^dora_batch_key returned a key whose element 1") as err:
        s.handle(E.TrajectoryFinished("g0", 1, 5, 1.0))
    assert err.value.actions == [] and json.dumps(s.snapshot()) == before
    assert [t.status for t in s.trajectories("g0")] == ["D", "R"] and s.groups["g0"].state == "active"
    assert [t.status for t in s.trajectories("g1")] == ["R", "Q"]  # (g1/1 still waits)
    out = s.handle(E.TrajectoryFinished("g0", 1, 5, 1.0))
    assert out == [A.Dispatch("g1", 1, 0, 0, 0), A.DeliverGroup("g0", 0)]


def test_handle_many_carries_the_actions_of_the_events_before_a_refused_one():
    """`handle_many` applies the events before the offending one: their actions come on the
    error (`ProtocolError.actions`), not with the answer to a later call, where a host that stops
    on the error never sees them (and a snapshot then holds work decided but never sent)."""
    plugin = _BigFirst("dora_batch_key")
    plugin.calls = -1
    s = _two_groups_one_slot_waiting(plugin)
    plugin.calls = 0
    with pytest.raises(ProtocolError, match=r"^dora_batch_key returned a key whose element 1") as err:
        # g1/0 finishes (g1/1 is dispatched into its slot), then g0/1's key is refused
        s.handle_many([E.TrajectoryFinished("g1", 0, 5, 1.0), E.TrajectoryFinished("g0", 1, 5, 1.0)])
    assert err.value.actions == [A.Dispatch("g1", 1, 0, 0, 0)]
    assert [t.status for t in s.trajectories("g1")] == ["D", "R"]
    assert [t.status for t in s.trajectories("g0")] == ["D", "R"]  # (the refused finish: not applied)
    out = s.handle(E.TrajectoryFinished("g0", 1, 5, 1.0))  # nothing left over from the batch
    assert out == [A.RequestGroups(1, 0), A.DeliverGroup("g0", 0)]


def test_an_id_freed_during_the_walk_is_not_taken_for_a_container_walked_before():
    """The walk remembers containers by id. A list subclass yielding a fresh list at each read
    (freed once copied) frees an id that the next fresh list, of the same size, usually gets:
    were the remembered entry not keeping its container alive, the second fresh list would be
    taken for the first and kept with its items (this meta was kept as [[[0]], [[1]], [[1]], ...])."""
    meta = [_Fresh([[i]]) for i in range(5)]
    for _ in range(20):
        assert _json_data_of(meta) == [[[i]] for i in range(5)] == json.loads(json.dumps(meta))


def _json_data_of(meta):
    from dora_ext.core._json import _json_data

    return _json_data(meta, "m")
