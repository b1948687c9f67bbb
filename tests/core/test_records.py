"""Events and actions are frozen, slotted dataclasses; `record` only swaps in a faster `__init__`.

Each check compares a record class with a reference built by the stock
`@dataclass(frozen=True, slots=True)` from the same fields, so a difference in behaviour
(signature, defaults, equality, hash, repr, pickling, replace/asdict, frozenness) shows.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
import sys
import typing

import pytest

from dora_ext.core import actions as A
from dora_ext.core import events as E
from dora_ext.core._record import record

RECORDS = [c for m in (A, E) for c in vars(m).values()
           if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == m.__name__]


def _reference(cls: type) -> type:
    """The same class as stock `@dataclass(frozen=True, slots=True)` would build it."""
    ns = {"__annotations__": {f.name: f.type for f in dataclasses.fields(cls)}, "__module__": cls.__module__,
          "__qualname__": cls.__qualname__}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            ns[f.name] = f.default
    return dataclasses.dataclass(frozen=True, slots=True)(type(cls.__name__, (), ns))


def _sample(cls: type, salt: int) -> dict:
    return {f.name: (salt, f.name) for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}


def test_every_event_and_action_is_covered():
    assert A.Dispatch in RECORDS and E.TrajectoryFinished in RECORDS and len(RECORDS) >= 20


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
def test_record_behaves_like_a_frozen_slotted_dataclass(cls):
    ref = _reference(cls)
    assert str(inspect.signature(cls)) == str(inspect.signature(ref))
    kw = _sample(cls, 1)
    a, r = cls(**kw), ref(**kw)
    pos = cls(*kw.values())  # positional, defaults filled
    assert a == pos and hash(a) == hash(pos)
    assert repr(a) == repr(r)  # same text (same class name and fields)
    assert dataclasses.asdict(a) == dataclasses.asdict(r)
    assert dataclasses.astuple(a) == dataclasses.astuple(r)
    assert not hasattr(a, "__dict__") and cls.__slots__ == ref.__slots__
    b = cls(**_sample(cls, 2))
    assert (a == b) == (kw == _sample(cls, 2)) and a != r  # different classes never compare equal
    names = [f.name for f in dataclasses.fields(cls)]
    if names:  # (assigning an unknown name on a fieldless one trips a CPython 3.11 bug, stock too)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(a, names[0], 0)
    for x in (pickle.loads(pickle.dumps(a)), copy.copy(a), copy.deepcopy(a)):
        assert x == a and type(x) is cls
    if kw:
        first = next(iter(kw))
        assert dataclasses.replace(a, **{first: "z"}) == cls(**{**kw, first: "z"})
    if kw:
        with pytest.raises(TypeError):
            cls()  # a missing field is an error, as with the stock __init__
    with pytest.raises(TypeError):
        cls(**kw, no_such_field=1)


def test_defaults_are_the_declared_ones():
    assert A.LoadVersion(3, 1).preempt == () and A.LoadVersion(3, 1, ((0, 1),)).preempt == ((0, 1),)
    ev = E.TrajectoryFinished("g", 0, 5)
    assert ev == E.TrajectoryFinished(group_id="g", index=0, tokens=5)
    assert all(getattr(ev, f.name) == f.default for f in dataclasses.fields(ev) if f.default is not dataclasses.MISSING)


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
def test_init_type_hints_resolve_in_the_records_module(cls):
    # The stock __init__'s globals are the class's module, so its string annotations resolve.
    hints = typing.get_type_hints(cls.__init__)
    assert set(hints) == {f.name for f in dataclasses.fields(cls)} | {"return"}
    assert hints == typing.get_type_hints(_reference(cls).__init__, sys.modules[cls.__module__].__dict__)


def test_a_record_subclass_of_a_record_inherits_the_fields():
    @record
    class Base:
        a: int

    @record
    class Sub(Base):
        b: int = 2

    s = Sub(1)
    assert (s.a, s.b) == (1, 2) and Sub(b=3, a=4) == Sub(4, 3) and str(inspect.signature(Sub)) == "(a: 'int', b: 'int' = 2) -> None"


def test_keyword_only_fields_stay_keyword_only():
    @record
    class K:
        a: int
        _: dataclasses.KW_ONLY
        b: int = 0

    @record
    class K2:
        a: int = dataclasses.field(kw_only=True)
        b: int = 0

    assert K(1, b=2).b == 2 and K2(5, a=1) == K2(a=1, b=5)
    with pytest.raises(TypeError):
        K(1, 2)
    with pytest.raises(TypeError):
        K2(5)  # `a` is keyword-only and missing


def test_field_names_that_look_like_the_generated_helpers():
    @record
    class N:
        _set0: int
        _dflt0: int = 3
        _dora_set0: int = 4

    assert N(1) == N(_set0=1, _dflt0=3, _dora_set0=4) and N(1, 2)._dflt0 == 2
