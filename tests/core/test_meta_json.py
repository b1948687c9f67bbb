"""A group's `meta` and the plugins' keys are accepted when their JSON round trip gives them back
(`json.loads(json.dumps(x, allow_nan=False)) == x`): the snapshot is JSON data, and a run resumed
from it must see the same values. Anything else is a `ProtocolError` naming the field, and halts."""

import json

import pytest

from dora_ext import hookimpl
from dora_ext.config import DoraConfig
from dora_ext.core import ProtocolError, Scheduler
from dora_ext.core import events as E
from dora_ext.plugins import get_plugin_manager

CFG = {"mode": "pipeline", "instances": 1, "capacity": 2, "group_size": 1}


def _sched(plugins=None):
    s = Scheduler(DoraConfig.from_dict(CFG), plugins)
    s.start()
    s.handle(E.InstanceLoaded(0, 0))
    return s


def _key_plugin(hook, key):
    class Key:
        @hookimpl
        def dora_admission_key(self, group_id, version, seq, meta, mode):
            return key if hook == "dora_admission_key" else (seq,)

        @hookimpl
        def dora_batch_key(self, group_id, version, complete_seq, mode):
            return key if hook == "dora_batch_key" else (complete_seq,)

    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(Key())
    return pm


def test_meta_that_survives_json_is_kept_as_a_copy_and_restored_alike():
    meta = {"length": 7, "prompt_tokens": [1, 2, 3], "tag": None, "x": {"a": 1.5}}
    s = _sched()
    s.handle(E.GroupAdmitted("g", meta))
    kept = s.groups["g"].meta
    assert kept == meta and kept is not meta
    t = Scheduler.restore(json.loads(json.dumps(s.snapshot())))
    assert t.groups["g"].meta == meta and t.snapshot() == s.snapshot()


@pytest.mark.parametrize("meta", [{1: "a"}, {"len": float("nan")}, {"s": {1, 2}}, {"shape": (3, 4)}, b"raw"])
def test_meta_json_cannot_give_back_is_refused_by_name_and_halts(meta):
    s = _sched()
    with pytest.raises(ProtocolError, match=r"^GroupAdmitted\.meta"):
        s.handle(E.GroupAdmitted("g", meta))
    with pytest.raises(ProtocolError, match="halted after a protocol error: GroupAdmitted.meta"):
        s.handle(E.GroupAdmitted("h"))


@pytest.mark.parametrize("hook", ["dora_admission_key", "dora_batch_key"])
def test_plugin_keys_are_taken_as_json_gives_them_back(hook):
    s = _sched(_key_plugin(hook, [2, "b", None]))
    s.handle(E.GroupAdmitted("g"))
    s.handle(E.TrajectoryFinished("g", 0, 5, 1.0))
    t = Scheduler.restore(json.loads(json.dumps(s.snapshot())), _key_plugin(hook, [2, "b", None]))
    assert t.snapshot() == s.snapshot()


@pytest.mark.parametrize("hook", ["dora_admission_key", "dora_batch_key"])
@pytest.mark.parametrize("key", [(("a", 1),), (1, {2}), "ab", 7, (float("nan"),)])
def test_plugin_keys_json_cannot_give_back_are_refused_naming_the_hook(hook, key):
    s = _sched(_key_plugin(hook, key))
    with pytest.raises(ProtocolError, match=rf"^{hook} returned"):
        s.handle(E.GroupAdmitted("g"))
        s.handle(E.TrajectoryFinished("g", 0, 5, 1.0))
