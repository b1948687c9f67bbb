"""Everything in dora-ext revolves around this: one `Scheduler` owns the scheduling state.

It is a pure state machine in the sans-I/O style of h11: a runtime feeds it events
(`handle(event)` or `handle_many(events)`) and executes the actions it returns. It never touches
a thread, socket, clock, tensor or host, so the simulator, the embedded runtime and the
verl/slime adapters all run this same code, and what the simulator measures is what users run.

The five modes are policies over one state (see `docs/design.md`):

| mode         | admission                          | versions on instances        | trainer          |
|--------------|------------------------------------|------------------------------|------------------|
| sync         | a whole batch per version (K=0)    | switch when drained          | per batch        |
| one_step_off | a whole batch when the fleet is idle, one version behind (K=1) | switch when drained | per batch |
| partial      | keep slots full within R2          | all switch on publish, running work is preempted and resumed (C1 broken, metered) | per batch |
| pipeline     | a whole batch per version (K=0)    | switch when drained          | streamed (R7)    |
| dora         | keep slots full within R2          | R1 pinning, R4 drain-then-switch, R5 migration | streamed (R7) |

Only live state is kept: a group leaves the scheduler when its trainer step finishes (or, once
reported failed, when none of its trajectories runs any more); totals live on in `metrics()`.
So memory, snapshot size and per-event cost do not grow with the length of a run.

Every per-event path is O(1) in the number of groups and instances (amortised), except where a
whole fleet must act (a publish in `partial` preempts every instance):

- queued work: one heap per version of groups with pending trajectories (R6, group-major);
- occupancy levels: per version, the loaded instances bucketed by how many trajectories they run
  (`_lv`), so dispatch takes the least loaded instance within its fair share in O(1) (`_dispatch`,
  `_pick`), and R5 is considered in O(1) on every release and acts only when the version runs on
  more instances than its work needs (`_maybe_consolidate`);
- completed groups: one heap per version (R3 looks at each live version's head only), and batch
  formation runs only when one of its inputs changed (`_form_dirty`);
- idle instances: a set, so that a publish or a re-queued old trajectory plans only those.

A note on R3. Taking "the mandatory set, then the oldest completed groups" is not enough to keep
C3: a step that takes a newer group while two older ones still run can leave the next step with
more mandatory groups than slots. Each group has a deadline (`version + K`); the scheduler takes a
group only if, afterwards, for every future step `k + j` the unassigned groups due by then still
fit into the remaining slots (`r + j * B`), an earliest-deadline-first feasibility test. R2
guarantees such a schedule exists, so waiting always ends when the engines make progress.
"""

from __future__ import annotations

import heapq
import itertools
import math
from array import array
import numbers
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Callable, Iterable

from ..config import DoraConfig
from . import actions as A
from . import events as E
from .admission import Admission

# Trajectory states, kept as small ints in a byte array (`_ts`); the letters name them in
# snapshots and error messages.
_QUEUED, _RUNNING, _AWAIT_REWARD, _DONE, _DEAD = 0, 1, 2, 3, 4
_LETTERS = "QRFDX"
_CODES = {c: i for i, c in enumerate(_LETTERS)}
# Group states, kept as small ints in a byte array (`_gst`); `_STATES` names them.
_ACTIVE, _COMPLETE, _ASSIGNED, _TRAINED, _FAILED = 0, 1, 2, 3, 4
_STATES = ("active", "complete", "assigned", "trained", "failed")
_STATE_CODES = {c: i for i, c in enumerate(_STATES)}
# One occupancy level's instances in arrival order (`Scheduler._lv`): instance id -> its
# `_Instance`. An OrderedDict, not a dict: dispatch takes the first one (`popitem(last=False)`),
# which is O(1) in a linked list but O(deleted entries) in a dict, whose deleted slots stay in
# front until it resizes (with 10k instances moving through a level, the scan made every dispatch
# slower). The value is the instance itself, so that dispatch gets it with the id in one call,
# without a lookup in `Scheduler.instances`.
_Level = OrderedDict
_ANY = -1  # the single queue/instance bucket of mode `partial`, where nothing is pinned
_NAN = float("nan")  # `_tr`: no reward yet
_NOI = -(2**63)  # `_ti`: running on no instance
_NOV, _MULTI = -1, -2  # `_tv`: no version yet; several versions (in `_tvm`)
_NOP = -1  # `_tp`: placed on no instance

#: `snapshot()` writes this format; `restore()` reads it and format 2 (which listed every
#: instance that ever failed, `"dead"`, where format 3 keeps one number, `"id_max"`).
SNAPSHOT_FORMAT = 3
_READS_FORMATS = (2, 3)


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


_JSON_DEPTH = 64  # `_json_data`: deeper nesting (or a cycle) is refused
# `_json_data`: at most this many values in all (containers and scalars, each appearance of a
# shared list or dict counted: JSON has no sharing, so its round trip, and the snapshot, write a
# shared sub-object out each time it appears; `a = [0]; for _ in range(40): a = [a, a]` is a
# small object in memory but 3 * 2**40 - 1 values in JSON), and at most this many characters in its
# strs (keys and values, counted the same way).
_JSON_VALUES = 1_000_000
_JSON_CHARS = 100_000_000
# An int of more than this many decimal digits is refused (in meta, a plugin key, a group id):
# Python's default `sys.get_int_max_str_digits()`, past which `json.dumps` (writing the snapshot)
# and `json.loads` (reading it back) raise ValueError. `_INT_LOW < x < _INT_BOUND` is cheap: ints
# of different sizes are compared by their size first.
_INT_DIGITS = 4300
_INT_BOUND = 10**_INT_DIGITS
_INT_LOW = -_INT_BOUND


def _big_int(x: int, where: str) -> ProtocolError:
    return ProtocolError(
        f"{where} is {_brief(x)}: an int of more than {_INT_DIGITS:,} decimal digits, which Python's JSON "
        f"cannot write or read back (`sys.get_int_max_str_digits()`, {_INT_DIGITS} by default; the snapshot "
        f"is JSON data)"
    )


def _json_data(x: Any, where: str) -> Any:
    """`x` as a JSON round trip gives it back, as a fresh copy: a tuple becomes a list, a
    subclass of dict, list, str, int or float its base type with the value JSON writes (a
    namedtuple a list, an IntEnum an int, a numpy float64 a float, a `(str, Enum)` member its
    value: JSON writes the value itself, not what an overridden `__str__`, `__int__` or
    `__float__` returns), a sub-object that appears more than once a copy at each place (JSON
    has no sharing). What JSON cannot give back unchanged is refused with a `ProtocolError`
    naming `where` and the path in it: a mapping key that is not a str (JSON would turn 1 into
    "1"), NaN or an infinite float (Python's `json.dumps` writes them as `NaN`/`Infinity`,
    which is not JSON, and NaN is not equal to itself), an int of more than 4,300 decimal
    digits (`_INT_DIGITS`: Python's JSON cannot write or read it back), any other type (a set,
    bytes, a numpy integer), nesting deeper than `_JSON_DEPTH` (64; or a cycle).

    Its size as JSON writes it is bounded too: at most `_JSON_VALUES` (1,000,000) values and
    `_JSON_CHARS` (100,000,000) characters of strs (keys and values), each appearance of a
    shared sub-object counted. More is a `ProtocolError` naming `where` and the limit. The walk
    costs what `x` holds in memory, not its size in JSON: a container walked once is remembered
    with its size, so its next appearance is charged without a walk; only when the whole is
    under the limits are the shared parts copied out, one copy per appearance (a cost bounded
    by the limit). `a = [0]; for _ in range(40): a = [a, a]` (3 * 2**40 - 1 values in JSON) is
    refused after walking its 41 lists once.

    A group's `meta` is kept in this form from admission on, so policies see the same value in
    a run resumed from a JSON snapshot as in the uninterrupted run (`_on_group_admitted`)."""
    t = type(x)
    if t is bool or x is None or (t is int and _INT_LOW < x < _INT_BOUND) or (t is str and len(x) <= _JSON_CHARS):
        return x
    if t is dict and len(x) < _JSON_VALUES:
        # The common meta, a flat mapping of str keys to plain str, bool, None, int or finite
        # float values: copied as is, without the walk.
        chars = 0
        for k, v in x.items():
            tv = type(v)
            if type(k) is not str or not (tv is str or tv is bool or v is None
                                          or (tv is int and _INT_LOW < v < _INT_BOUND)
                                          or (tv is float and v - v == 0.0)):
                break
            chars += len(k) + len(v) if tv is str else len(k)
        else:
            if chars <= _JSON_CHARS:
                return dict(x)
    # [values left, characters left, the whole's name, {id: walked container's size}, deepest
    # level, "a container was met again"]
    budget = [_JSON_VALUES - 1, _JSON_CHARS, where, {}, 0, False]
    out = _json_walk(x, where, 0, budget)
    return _tree_copy(out) if budget[5] else out  # (under the limits: a copy per appearance)


def _over(budget: list) -> ProtocolError:
    what = (f"{_JSON_VALUES:,} values" if budget[0] < 0 else f"{_JSON_CHARS:,} characters of str (keys and values)")
    return ProtocolError(
        f"{budget[2]}: JSON data of more than {what}, each appearance of a shared sub-object counted "
        f"(JSON has no sharing: the snapshot writes it out each time it appears)"
    )


def _where(path: Any) -> str:
    """A `_json_walk` path as text: `path` is the whole's name (a str) or (parent path, key or
    index), built as text only for an error message."""
    keys = []
    while type(path) is tuple:
        path, k = path
        keys.append(f"[{k!r}]")
    return path + "".join(reversed(keys))


def _tree_copy(c: Any) -> Any:
    """A copy of `c`, JSON data as `_json_walk` returns it (dicts, lists, scalars), without sharing."""
    if type(c) is dict:
        return {k: _tree_copy(v) if type(v) is dict or type(v) is list else v for k, v in c.items()}
    return [_tree_copy(v) if type(v) is dict or type(v) is list else v for v in c]


def _json_walk(x: Any, path: Any, depth: int, budget: list) -> Any:
    """`_json_data`'s walk of `x`, at `path` (`_where`), `depth` containers deep. `budget` is
    [values left, characters left, the whole's name, walked, deepest, shared]: the caller has
    charged `x` itself as one value; `walked` maps the id of each container walked to (values and
    characters inside it, its depth below itself, its copy, itself), `deepest` is the deepest container's
    depth, `shared` whether a container was met again (its copy is then returned again: the
    caller copies the whole out as a tree)."""
    t = type(x)
    if t is str:
        budget[1] -= len(x)
        if budget[1] < 0:
            raise _over(budget)
        return x
    if t is bool or x is None:
        return x
    if t is int:
        if _INT_LOW < x < _INT_BOUND:
            return x
        raise _big_int(x, _where(path))
    if t is float:
        if x - x == 0.0:
            return x
        raise ProtocolError(f"{_where(path)} is {x!r}: JSON has no NaN or infinity (the snapshot is JSON data)")
    is_dict = isinstance(x, dict)
    if is_dict or isinstance(x, (list, tuple)):
        seen = budget[3].get(id(x))
        if seen is not None and depth + seen[2] < _JSON_DEPTH:
            # Walked before (a shared sub-object), as deep here as its nesting allows: charged its
            # size without a walk; its copy shared until `_json_data` copies the whole out.
            budget[0] -= seen[0]
            budget[1] -= seen[1]
            if budget[0] < 0 or budget[1] < 0:
                raise _over(budget)
            if depth + seen[2] > budget[4]:
                budget[4] = depth + seen[2]
            budget[5] = True
            return seen[3]
        if depth >= _JSON_DEPTH:
            raise ProtocolError(f"{_where(path)}: JSON data nested deeper than {_JSON_DEPTH} levels (or a cycle)")
        values, chars, deepest = budget[0], budget[1], budget[4]
        budget[4] = depth
        # All its items charged before any is walked. An exact dict, list or tuple holds `len(x)`
        # items; a subclass's `__len__` may say anything, and its `items()` or `__iter__` (what
        # JSON and this walk read) may yield more than it holds: what it yields is counted, up to
        # one item past the limit.
        if is_dict:
            items = x.items() if t is dict else list(itertools.islice(x.items(), budget[0] + 1))
            budget[0] -= len(items)
        else:
            out = list(x) if t is list or t is tuple else list(itertools.islice(x, budget[0] + 1))
            budget[0] -= len(out)
        if budget[0] < 0:
            raise _over(budget)
        n_chars = 0
        if is_dict:
            out = {}
            for k, v in items:
                if type(k) is not str:
                    if not isinstance(k, str):
                        raise ProtocolError(
                            f"{_where(path)} has the key {_brief(k)} ({type(k).__name__}): the keys of a JSON "
                            f"object are str (a JSON round trip, as the snapshot's, would give back another key)"
                        )
                    k = str.__str__(k)
                n_chars += len(k)
                tv = type(v)
                # (a str, bool, None or int that JSON writes as is, without the call: the common
                # meta is a flat mapping)
                if tv is str:
                    n_chars += len(v)
                elif not (tv is bool or v is None or (tv is int and _INT_LOW < v < _INT_BOUND)):
                    v = _json_walk(v, (path, k), depth + 1, budget)
                out[k] = v
        else:
            # (`out`, a copy: items that are not a plain str, bool, int or None replaced below)
            for i, v in enumerate(out):
                tv = type(v)
                if tv is str:
                    n_chars += len(v)
                elif not (tv is bool or v is None or (tv is int and _INT_LOW < v < _INT_BOUND)):
                    out[i] = _json_walk(v, (path, i), depth + 1, budget)
        budget[1] -= n_chars
        if budget[1] < 0:
            raise _over(budget)
        # (`x` kept in the entry: its id is not reused during the walk, even when `x` was made by
        # an overridden `items()` or `__iter__` of its parent)
        budget[3][id(x)] = (values - budget[0], chars - budget[1], budget[4] - depth, out, x)
        if deepest > budget[4]:
            budget[4] = deepest
        return out
    if isinstance(x, str):
        # (the value, as JSON writes it: `str()` gives a `(str, Enum)` member's name)
        return _json_walk(str.__str__(x), path, depth, budget)
    if isinstance(x, int):
        return _json_walk(int.__int__(x), path, depth, budget)
    if isinstance(x, float):
        return _json_walk(float.__float__(x), path, depth, budget)
    raise ProtocolError(
        f"{_where(path)} is {_brief(x)} ({type(x).__name__}): expected JSON data (None, bool, int, float, str, "
        f"list, tuple, dict with str keys), as the scheduler's snapshot holds it"
    )


def _json_key(key: Any, hook: str) -> tuple:
    """A plugin's admission or batch key as a tuple of JSON scalars (None, bool, int of at most
    4,300 decimal digits, finite float, str; a subclass of int, float or str as its base type, as
    JSON gives it back): the key is part of the snapshot, and a tuple or a numpy integer in it
    would come back from the JSON round trip as a list (a resumed queue then compares a list with
    a tuple: TypeError) or not at all, NaN as a value not equal to itself, and a longer int not at
    all (Python's JSON refuses it: `_INT_DIGITS`). Anything else is a `ProtocolError` naming the
    hook."""
    if isinstance(key, (str, bytes)) or not isinstance(key, (tuple, list)):
        raise ProtocolError(f"{hook} returned {_brief(key)} ({type(key).__name__}): expected a tuple of JSON scalars")
    if type(key) is not tuple:
        # (read once, here: a tuple or list subclass's `__iter__` or `__getitem__` may give other
        # elements each time, and what is kept must be what was checked)
        key = tuple(key)
    out = None
    for i, x in enumerate(key):
        t = type(x)
        if t is str or t is bool or x is None or (t is int and _INT_LOW < x < _INT_BOUND):
            y = x
        elif isinstance(x, float) and (y := float.__float__(x)) - y == 0.0:
            pass
        elif isinstance(x, int) and t is not bool:
            y = int.__int__(x)  # (the value, as JSON writes it: `int()` may call an override)
            if not _INT_LOW < y < _INT_BOUND:
                raise _big_int(y, f"{hook} returned a key whose element {i}")
        elif isinstance(x, str):
            y = str.__str__(x)  # (the value: `str()` gives a `(str, Enum)` member's name)
        else:
            raise ProtocolError(
                f"{hook} returned {_brief(key)}: its element {_brief(x)} ({t.__name__}) is not a JSON scalar "
                f"(None, bool, int, finite float, str); the key is part of the snapshot and must come back "
                f"unchanged from its JSON round trip"
            )
        if out is None and t is not type(y):  # (a subclass: the rest is copied as base types)
            out = list(key[:i])
        if out is not None:
            out.append(y)
    if out is not None:
        return tuple(out)
    return key


def _ordered(key: tuple) -> tuple:
    """A plugin's key (a tuple of JSON scalars) as the scheduler's queues and pools compare it:
    each element preceded by its kind, None (0) < numbers (1) < strs (2), in one flat tuple, so
    that any two keys compare. Keys whose elements are of one kind at each position keep their
    order; a mix (None against an int, a str against a float, at the same position) compared by
    `<` raised `TypeError` inside a heap push or pop, halfway through an event. `_plain` gives
    the key back (snapshots, views)."""
    if None in key or str in map(type, key):
        out: list = []
        for x in key:
            out += (0, 0) if x is None else (2, x) if type(x) is str else (1, x)
        return tuple(out)
    return tuple(_flat(zip(_ONES, key)))  # (numbers only, the common key: built in C)


_ONES = itertools.repeat(1)  # (`_ordered`: an endless 1 to precede numbers with)
_flat = itertools.chain.from_iterable


def _plain(key: tuple) -> tuple:
    """The key `_ordered` was given."""
    return tuple(None if key[i] == 0 else key[i + 1] for i in range(0, len(key), 2))


def _vlist(vs: int | list[int] | None, base: int) -> list[int]:
    """A trajectory's versions relative to `base`, as the snapshot stores them (a list)."""
    if vs is None:
        return []
    if type(vs) is int:
        return [vs - base]
    return [x - base for x in vs]


class GroupView:
    """A read-only view of one live group (`Scheduler.groups[gid]`): `gid`, `version`, `state`
    ("active", "complete", "assigned", "trained", "failed"), `step`, `meta`, `seq`, `key`,
    `done`, `live`, `complete_seq`, `in_queue`. It reads the scheduler's per-group arrays when
    accessed. Once the group leaves the scheduler (trained, or failed and retired) its slot is
    reused by another group, so reading the view then raises `LookupError` naming the group
    (`gid` stays readable) instead of reporting the other group's state."""

    __slots__ = ("_s", "_g", "_q", "_gid")

    def __init__(self, sched: "Scheduler", slot: int) -> None:
        # The slot and the group's admission number: a slot reused by a later group (even one
        # admitted under the same id) has another number.
        self._s, self._g, self._q, self._gid = sched, slot, sched._gseq[slot], sched._ggid[slot]

    def _slot(self) -> int:
        return _live_slot(self._s, self._g, self._q, f"group {self._gid!r}")

    gid = property(lambda self: self._gid)
    version = property(lambda self: self._s._gver[self._slot()])
    seq = property(lambda self: self._s._gseq[self._slot()])
    key = property(lambda self: self._s._key_of(self._slot()))
    meta = property(lambda self: self._s._gmeta.get(self._slot()))
    state = property(lambda self: _STATES[self._s._gst[self._slot()]])
    step = property(lambda self: None if (x := self._s._gstep[self._slot()]) < 0 else x)
    complete_seq = property(lambda self: None if (x := self._s._gcseq[self._slot()]) < 0 else x)
    done = property(lambda self: self._s._gdone[self._slot()])
    live = property(lambda self: self._s._glive[self._slot()])
    in_queue = property(lambda self: bool(self._s._ginq[self._slot()]))

    def __repr__(self) -> str:
        try:
            return f"GroupView(gid={self.gid!r}, version={self.version}, state={self.state!r})"
        except LookupError:
            return f"GroupView(gid={self._gid!r}, left the scheduler)"


def _live_slot(sched: "Scheduler", g: int, seq: int, what: str) -> int:
    """Slot `g` if it still holds the group admitted as number `seq`; else `LookupError`."""
    if g not in sched._ggid or sched._gseq[g] != seq:
        raise LookupError(f"{what} left the scheduler with its group (trained, or failed and retired): "
                          f"this view of it is no longer valid")
    return g


class _Groups(Mapping):
    """`Scheduler.groups`: the live groups by id, as read-only `GroupView`s."""

    __slots__ = ("_s",)

    def __init__(self, sched: "Scheduler") -> None:
        self._s = sched

    def __getitem__(self, gid: Any) -> GroupView:
        return GroupView(self._s, self._s._gslot[gid])

    def __contains__(self, gid: Any) -> bool:
        return gid in self._s._gslot

    def __iter__(self):
        return iter(self._s._gslot)

    def __len__(self) -> int:
        return len(self._s._gslot)


class _Instance:
    """A rollout instance. The trajectories it runs are kept as an append-only log: `log` holds,
    for each handle placed here (dispatched, or moved in) in placement order, the handle and its
    placement's stamp (unique: `Scheduler._pseq`), one after the other in one array (`hs` and `ps`
    read them apart: for tests and debugging); an entry is live while the handle's current
    placement is that one (`Scheduler._tp[h] == stamp`: a move gives the handle a new stamp, a
    release sets `_NOP`), and `nrun` counts the live entries. One array, not one for handles and
    one for stamps: a dispatch appends to one buffer (at 1M slots over 10k instances each
    dispatch lands on another instance, and the second buffer was one more cache miss). A trajectory that leaves (finishes, fails, moves
    away) only decrements `nrun`: no hash table per instance is touched on the hot path (with 10k
    instances those tables did not fit the CPU caches). Dead entries are dropped when the log is
    cleared (`nrun` reaches 0) or compacted (`Scheduler._place`, before a placement into a log
    longer than three times the live entries + 32), so a log stays within three times what ran
    at its last placement + 33: at most `3 * capacity + 33` entries, not three times what runs
    now (departures alone never compact)."""

    __slots__ = ("id", "capacity", "version", "loading", "nrun", "log", "_tp")

    def __init__(self, iid: int, capacity: int, tp: array) -> None:
        self.id = iid
        self.capacity = capacity
        self.version: int | None = None  # loaded version (None: nothing loaded yet)
        self.loading: int | None = None  # version being loaded
        self.nrun = 0  # trajectories running here
        self.log = array("q")  # placed handles and their stamps, h0, p0, h1, p1, ... (live and dead)
        self._tp = tp  # the scheduler's per-handle placement stamps

    @property
    def running(self) -> dict[int, None]:
        """The handles running here, in placement (dispatch) order (built on each access: for
        the cold paths; the hot ones read `nrun`)."""
        return dict.fromkeys(self.live())

    @property
    def hs(self) -> array:
        """The log's handles, in placement order (live and dead; a copy)."""
        return self.log[0::2]

    @property
    def ps(self) -> array:
        """The log's placement stamps, in placement order (a copy)."""
        return self.log[1::2]

    def live(self) -> list[int]:
        """The handles running here, in placement order, as a list."""
        tp = self._tp
        it = iter(self.log)
        return [h for h, p in zip(it, it) if tp[h] == p]

    def _drop(self) -> None:
        """One trajectory left (its `_ti` changed): the log is cleared when none is left."""
        self.nrun -= 1
        if not self.nrun:
            del self.log[:]

    @property
    def target(self) -> int | None:
        return self.loading if self.loading is not None else self.version


class TrajectoryView:
    """A read-only view of one live trajectory's state (`Scheduler.trajectory`), for tests and
    debugging; it reads the scheduler's arrays when accessed. Once its group leaves the
    scheduler (and its slot may hold another group's trajectories), reading it raises
    `LookupError` naming the trajectory."""

    __slots__ = ("_s", "_h", "_q", "_gid")

    def __init__(self, sched: "Scheduler", h: int) -> None:
        g = h // sched.n
        self._s, self._h, self._q, self._gid = sched, h, sched._gseq[g], sched._ggid[g]

    def _handle(self) -> int:
        s, h = self._s, self._h
        _live_slot(s, h // s.n, self._q, f"trajectory {self._gid!r}/{h % s.n}")
        return h

    status = property(lambda self: _LETTERS[self._s._ts[self._handle()]])
    instance = property(lambda self: None if (i := self._s._ti[self._handle()]) == _NOI else i)
    attempt = property(lambda self: self._s._ta[self._handle()])
    tokens = property(lambda self: self._s._tt[self._handle()])
    versions = property(lambda self: self._s._versions(self._handle()))
    retries = property(lambda self: self._s._tn[self._handle()])
    moved = property(lambda self: bool(self._s._tm[self._handle()]))
    reward = property(lambda self: None if (r := self._s._tr[self._handle()]) != r else r)


class Scheduler:
    """The sans-I/O scheduler. See the module docstring and `dora_ext.core.events/actions`."""

    def __init__(self, config: DoraConfig, plugins: Any = None) -> None:
        self.config = config
        self.mode = config.mode
        self.K = config.max_staleness
        self.B = config.batch_size
        self.n = config.group_size
        self._pinned = self.mode != "partial"
        self._cgp = self.mode in ("pipeline", "dora")
        self._admission = {"sync": "batch", "pipeline": "batch", "one_step_off": "fleet",
                           "partial": "fill", "dora": "fill"}[self.mode]
        self._adm = Admission(config.admission_policy, self.B, self.K)  # how far `fill` runs ahead
        self._migrate = self.mode == "dora" and config.migrate
        self._spread = self._migrate and config.spread
        self._set_plugins(plugins)

        self.newest = 0  # newest published version
        self.step = 0  # the trainer step being formed (or running)
        self._trainer_busy: int | None = None
        self._forming: list[Any] = []
        self._started = False
        self._exhausted = False
        self._outstanding = 0  # groups requested and not yet admitted/declined
        self._admitted = 0  # admitted and not failed
        self._seq = 0
        self._complete_seq = 0
        self._n_active = 0  # admitted groups neither complete nor failed
        # The largest instance id ever registered. Instead of a set of failed ids, one entry per
        # crash for the whole run: a report from an id at or below it that is not registered now
        # (nor on the trainer's side) comes from an instance declared failed and is stale
        # (`_stale_instance`); hosts give a restarted engine a fresh, larger id.
        self._id_max = _NOI
        self._orphaned = False  # work was queued for a version no instance holds
        self._halted: str | None = None  # the circuit breaker's message once it tripped
        self._form_dirty = True  # an input of batch formation changed since it last ran

        # Live groups only. A group is an integer slot `g`: its fields are per-slot arrays and
        # dicts keyed by slot, its trajectories the integer handles `g * n + index`. No object
        # per group or per trajectory: the cyclic GC walks nothing per group or trajectory (the
        # dicts below hold ints and strings, which the GC does not track), and no tuple is built
        # per event. Slots are reused once their group leaves (`_free`), so every array is as
        # long as the most groups ever live at once. Group ids map to slots only at the event
        # boundary (`_gslot`) and back in actions (`_ggid`).
        self._gslot: dict[Any, int] = {}  # group id -> slot
        self._ggid: dict[int, Any] = {}  # slot -> group id
        self._gver = array("q")  # version it was admitted under
        self._gseq = array("q")  # admission order
        self._gst = array("b")  # state (`_ACTIVE` ...)
        self._gstep = array("q")  # trainer step it is assigned to (-1: none)
        self._gcseq = array("q")  # completion order (-1: not complete)
        self._gdone = array("q")  # trajectories with their reward
        self._glive = array("q")  # trajectories running or awaiting their reward
        self._ginq = array("b")  # in its version's queue heap
        # Pending trajectories (queued, in dispatch order) are `reversed(_gretry[g]) +
        # range(_gnext[g], n)`: fresh ones in index order behind the re-queued ones (a stack,
        # the last re-queued first).
        self._gnext = array("q")
        self._gretry: dict[int, list[int]] = {}  # slot -> re-queued trajectories (when any)
        self._gkey: dict[int, tuple] = {}  # slot -> admission key, when not the default `(seq,)`
        self._gmeta: dict[int, Any] = {}  # slot -> meta, when not None
        # Trajectory state, one entry per handle, per field.
        self._ts = array("b")  # status (`_QUEUED` ...)
        self._ta = array("q")  # attempt
        self._tn = array("q")  # retries
        self._tm = array("b")  # moved once in this attempt (never moved twice: it may be in flight)
        self._tr = array("d")  # reward (NaN: none yet)
        self._ti = array("q")  # instance running it (`_NOI`: none)
        self._tp = array("q")  # the stamp of its placement on an instance (`_Instance`; `_NOP`: none)
        self._pseq = 0  # the next placement stamp (derived state: not snapshotted)
        self._tt = array("q")  # tokens
        # The version that generated it (`_NOV`: none yet), or `_MULTI`: several, listed in `_tvm`
        # (`partial` only, where a preempted trajectory resumes under a newer version).
        self._tv = array("q")
        self._tvm: dict[int, list[int]] = {}
        self._free: list[int] = []  # free slots
        self._zero_b = array("b", bytes(self.n))
        self._zero_q = array("q", [0]) * self.n
        self._nan_d = array("d", [_NAN]) * self.n
        self._noi = array("q", [_NOI]) * self.n
        self._nov = array("q", [_NOV]) * self.n
        self._nop = array("q", [_NOP]) * self.n
        self.instances: dict[int, _Instance] = {}
        self._unassigned: dict[int, int] = {}  # version -> admitted groups not yet in a step
        self._queue: dict[int, list] = {}  # bucket -> heap of (key, seq, gid)
        self._queued: dict[int, int] = {}  # bucket -> queued trajectories
        self._cap: dict[int, int] = {}  # bucket -> capacity of instances loaded or loading it
        self._occupied: dict[int, int] = {}  # bucket -> running on instances targeting it
        self._pools: dict[int, list] = {}  # version -> heap of (batch key, complete_seq, gid)
        self._pool_n = 0  # completed groups not yet in a step
        self._targets: dict[int, int] = {}  # version -> instances loaded with or loading it
        self._idle: dict[int, None] = {}  # instances running nothing and loading nothing
        self._n_loading = 0  # instances loading a version
        # Loaded instances by bucket and running count (level), each level in arrival order:
        # dispatch serves the least loaded first (R6 fair share), R5 finds holders by level.
        self._lv: dict[int, dict[int, dict[int, None]]] = {}
        self._lo: dict[int, int] = {}  # bucket -> a level <= the lowest non-empty one
        self._nhold: dict[int, int] = {}  # bucket -> loaded instances running at least one trajectory
        self._uniform = True  # every instance has the same capacity (fair share is O(1) then)
        self._r5_tried: dict[int, tuple[int, int]] = {}  # R5: version -> (occupied, holders) of a fruitless try
        # R5: version -> (holder, dispatches, landings) when that holder, the first the plan would
        # empty, ran only trajectories that moved already. Until a trajectory is dispatched or a
        # move lands it still does (releases and moves only take trajectories away from it, or
        # bring moved ones), so the plan would move nothing again. Derived state: not snapshotted.
        self._r5_stuck: dict[int, tuple[int, int, int]] = {}
        self._n_sent = 0  # trajectories dispatched (only `_r5_stuck` reads it)
        self._n_landed = 0  # moves landed (only `_r5_stuck` reads it)
        self._cap_max = 1  # the largest instance capacity seen (R5's packing bound)
        # `_form` takes the smallest key among the versions that can be taken now; in mode dora
        # with the built-in keys (oldest version first) the global head, or waits for it: when
        # the oldest pooled version cannot be taken, no newer one can (EDF). A plugin's batch key
        # may order a newer version first: waiting for that head, while the older group it waits
        # for sits in the pool behind it, was a deadlock.
        self._pool_fifo = self.mode != "dora" or not self._builtin_keys
        # Elastic colocation: instance id -> capacity of instances on the trainer side (switchable
        # to rollout), switching to the trainer, and switching to rollout.
        self._elastic = config.elastic
        self._trainer_side: dict[int, int] = {}
        self._to_trainer: dict[int, int] = {}
        self._to_rollout: dict[int, int] = {}
        if self._elastic:
            first = max(s.id for s in config.instances) + 1
            cap0 = config.instances[0].capacity
            self._trainer_side = {first + i: cap0 for i in range(config.elastic_spare)}
        self._trainer_idle = False  # reported by TrainerIdle, cleared by the next delivery
        self._spreading: dict[int, int] = {}  # instance -> version it loads to take stragglers
        self._min_rollout = max(1, math.ceil(len(config.instances) * (1.0 - config.elastic_max_lent)))
        self.step_log: list[tuple[int, tuple]] = []
        self.m = {
            "staleness_hist": {}, "trajectories_trained": 0, "multi_version_trajectories": 0,
            "groups_trained": 0, "dropped": 0, "truncated": 0, "duplicated": 0, "failed_groups": 0,
            "retries": 0, "redispatched": 0, "invalid_rewards": 0, "stale_events": 0,
            "migrations": 0, "weight_loads": 0, "live_versions_max": 0, "c1_violations": 0,
            "c3_violations": 0, "trainer_waits_for_older": 0, "tokens_trained": 0,
            "switches_to_trainer": 0, "switches_to_rollout": 0,
            "groups_admitted": 0, "groups_completed": 0,
        }
        self._out: list = []

    # ------------------------------------------------------------------ plugins
    def _set_plugins(self, plugins: Any) -> None:
        from .. import defaults

        if plugins is None or [p for p in plugins.get_plugins() if p is not defaults] == []:
            # Only the built-ins: call them directly, no dispatch overhead on the hot path.
            self._admission_key = defaults.dora_admission_key
            self._batch_key = defaults.dora_batch_key
            self._plan_migration = defaults.dora_plan_migration
            self._builtin_r5 = True
            # The built-in keys are computed inline (`_on_group_admitted`, `_set_reward`): the
            # same tuples, without a keyword call per group.
            self._builtin_keys = True
            self._qkey = self._key_of  # (the queue's key: the built-in keys are ints, they compare)
        else:
            hook = plugins.hook
            self._admission_key = lambda **kw: hook.dora_admission_key(**kw)
            self._batch_key = lambda **kw: hook.dora_batch_key(**kw)
            self._plan_migration = lambda **kw: hook.dora_plan_migration(**kw)
            self._builtin_r5 = False
            self._builtin_keys = False
            self._qkey = self._key_ordered
        self._plugins = plugins

    # ------------------------------------------------------------------ public API
    def start(self) -> list:
        """Register the configured instances and emit the first actions."""
        if self._started:
            raise ProtocolError("start() called twice")
        self._started = True
        for spec in self.config.instances:
            self._add_instance(spec.id, spec.capacity)
        return self._finish()

    def handle(self, event: Any) -> list:
        """Feed one event; returns the actions to execute, in order."""
        if not self._started:
            raise ProtocolError("handle() before start()")
        if self._halted is not None:
            raise self._storm([])
        try:
            method = self._handlers[type(event)]
        except KeyError:
            raise ProtocolError(f"unknown event {event!r}") from None
        try:
            method(self, event)
            return self._finish()
        except ProtocolError as exc:
            exc.actions, self._out = self._out, []  # (mostly empty: see `ProtocolError`)
            raise

    def handle_many(self, events: Iterable[Any]) -> list:
        """Feed events in order; returns the actions for all of them.

        Equivalent to calling `handle` on each event, except that admission, batch formation
        and idle-instance planning run once at the end instead of after every event (so, e.g.,
        one `RequestGroups` may ask for what several calls would have asked for one by one), and
        that a `Dispatch` or `LoadVersion` for an instance that fails later in the same batch is
        not returned (its trajectories were re-queued), nor a `Migrate` whose source and
        destination both fail later in the batch (the destination's failure re-queued the
        trajectory; nothing of its attempt is left on either engine). A `Migrate` with only one
        end failing later is returned: from a live source the move must still free it, and out
        of a dead source the runtime learns that the trajectory was in transit (it reports it
        failed, as for any migration whose source dies). Actions may still name a trajectory
        whose finish the runtime has already reported (a `Migrate`, a `preempt` entry): the
        runtime ignores those, as it would when the engine finishes while the action is sent.
        A runtime draining an inbox of engine reports uses this; a `ProtocolError` leaves the
        events before the offending one applied (and the offending one not), and carries their
        actions (`ProtocolError.actions`: not returned with a later answer). The admission,
        batch formation and planning that would run at the end of the batch run with the next
        event.
        """
        if not self._started:
            raise ProtocolError("handle_many() before start()")
        if self._halted is not None:
            raise self._storm([])
        half: dict[int, tuple] = {}  # id(Migrate) -> (it, its end that failed later in the batch)
        try:
            self._handle_each(events, half)
            return self._finish()
        except ProtocolError as exc:
            exc.actions, self._out = self._out, []
            raise

    def _handle_each(self, events: Iterable[Any], half: dict) -> None:
        """`handle_many`'s loop (see there)."""
        handlers = self._handlers
        failed = E.InstanceFailed
        for event in events:
            try:
                method = handlers[type(event)]
            except KeyError:
                raise ProtocolError(f"unknown event {event!r}") from None
            if type(event) is failed and event.instance_id in self.instances:
                # Dispatches and loads this batch sent to the instance before it failed are void
                # (their trajectories are re-queued): drop them, else a runtime would execute
                # them, possibly on an engine re-registered under the same id in this batch. So is
                # a move decided before both of its ends failed (see the docstring).
                mark = len(self._out)
                method(self, event)
                iid = event.instance_id
                kept = []
                for a in self._out[:mark]:
                    ta = type(a)
                    if ta is A.Migrate and iid in (a.src, a.dst):
                        other = a.dst if iid == a.src else a.src
                        seen = half.get(id(a))
                        if seen is not None and seen[0] is a and seen[1] == other:
                            self.m["migrations"] -= 1  # counted when emitted: this one is not
                            continue  # both ends failed after it was decided: void
                        half[id(a)] = (a, iid)
                    elif (ta is A.Dispatch or ta is A.LoadVersion) and a.instance_id == iid:
                        continue
                    kept.append(a)
                self._out[:mark] = kept
                continue
            method(self, event)

    def _storm(self, actions: list) -> FailureStorm:
        return FailureStorm(self._halted or "", failed=self.m["failed_groups"],
                            completed=self.m["groups_completed"], retries=self.m["retries"], actions=actions)

    @property
    def done(self) -> bool:
        if self._trainer_busy is not None:
            return False
        if self.config.max_steps is not None and self.step >= self.config.max_steps:
            return True
        return self._exhausted and self._n_active == 0 and not self._pool_n and not self._forming

    @property
    def newest_version(self) -> int:
        return self.newest

    @property
    def groups(self) -> Mapping[Any, GroupView]:
        """The live groups by id (read-only views)."""
        return _Groups(self)

    @property
    def trainer_busy(self) -> int | None:
        return self._trainer_busy

    def live_versions(self) -> list[int]:
        """Versions loaded (or loading) on at least one instance."""
        return sorted(v for v, c in self._targets.items() if c > 0)

    def metrics(self) -> dict[str, Any]:
        m = dict(self.m)
        hist = {int(k): v for k, v in m.pop("staleness_hist").items()}
        total = sum(hist.values())
        trained = m["trajectories_trained"]
        m["staleness_hist"] = dict(sorted(hist.items()))
        m["staleness_max"] = max(hist) if hist else 0
        m["staleness_mean"] = (sum(k * v for k, v in hist.items()) / total) if total else 0.0
        m["multi_version_trajectory_share"] = (m["multi_version_trajectories"] / trained) if trained else 0.0
        m["live_versions"] = len(self.live_versions())
        m["newest_version"] = self.newest
        m["steps"] = self.step
        # Dropped: admitted groups that are neither trained, nor reported failed, nor still held.
        # Counted from the group table itself, so a group lost from it shows up here.
        gst = self._gst
        held = sum(1 for g in self._gslot.values() if gst[g] in (_ACTIVE, _COMPLETE))
        if self._trainer_busy is None:
            held += len(self._forming)
        m["dropped"] = m["groups_admitted"] - m["groups_trained"] - m["failed_groups"] - held
        m["live_groups"] = len(self._gslot)
        m["halted"] = self._halted or ""
        m["c1_ok"] = m["c1_violations"] == 0 and m["multi_version_trajectories"] == 0
        m["c2_ok"] = m["dropped"] == 0 and m["truncated"] == 0 and m["duplicated"] == 0
        m["c3_ok"] = m["c3_violations"] == 0
        return m

    # ------------------------------------------------------------------ event handlers
    def _on_instance_ready(self, ev: E.InstanceReady) -> None:
        if ev.instance_id in self.instances:
            raise ProtocolError(f"instance {ev.instance_id} is already registered")
        if ev.capacity < 1:
            raise ProtocolError(f"instance {ev.instance_id}: capacity must be >= 1")
        if ev.instance_id in self._trainer_side or ev.instance_id in self._to_trainer:
            raise ProtocolError(f"instance {ev.instance_id} reported ready while its accelerators serve the trainer")
        # An instance back from the trainer (SwitchToRollout) loads a version before anything else.
        back = self._to_rollout.pop(ev.instance_id, None) is not None
        if back and self._spread:
            self._spreading[ev.instance_id] = -1  # it came for the tail: it may take stragglers
        self._add_instance(ev.instance_id, ev.capacity, lend=not back)

    def _on_migration_landed(self, ev: E.MigrationLanded) -> None:
        g = self._gslot.get(ev.group_id)
        idx = ev.index
        if g is not None and 0 <= idx < self.n:
            h = g * self.n + idx  # (`_group` and `_traj` of a live group and a valid index, inlined)
        else:
            g = self._group(ev.group_id, ev.attempt)  # a group no longer held: stale with an attempt
            if g is None:
                return
            h = self._traj(g, idx)  # raises ProtocolError
        if (ev.attempt is not None and ev.attempt != self._ta[h]) or self._ts[h] != _RUNNING:
            self.m["stale_events"] += 1  # it finished, failed or was re-dispatched meanwhile
            return
        self._tm[h] = 0  # it runs on its destination: it may move again (R5)
        self._n_landed += 1

    def _on_trainer_idle(self, ev: E.TrainerIdle) -> None:
        self._trainer_idle = self._trainer_busy is None

    def _on_switched_to_trainer(self, ev: E.SwitchedToTrainer) -> None:
        cap = self._to_trainer.pop(ev.instance_id, None)
        if cap is None:
            raise ProtocolError(f"instance {ev.instance_id} switched to the trainer without a SwitchToTrainer")
        self._trainer_side[ev.instance_id] = cap

    def _stale_instance(self, iid: int) -> bool:
        """A late event from an instance declared failed: counted and ignored.

        Failed ids are not remembered one by one (that set grew by one per crash for the whole
        run, and was in every snapshot). An id at or below the largest ever registered
        (`_id_max`) that is neither registered now nor on the trainer's side (elastic) was
        registered once and has failed since: every host gives a restarted engine a fresh id above
        all earlier ones (the embedded runtime `next_instance_id`, verl's coordinator the largest
        id + 1, slime's engine table a counter), so a late report of the dead engine is never
        taken for its successor, however long after the crash it arrives. An id above every
        registered one is a protocol error (`_instance`). What this gives up: an id below
        `_id_max` that no instance ever had (a gap in a host's numbering) reads as stale too,
        and is counted in `stale_events` rather than raised."""
        if iid in self.instances or not isinstance(iid, numbers.Integral) or iid > self._id_max:
            return False
        if iid in self._trainer_side or iid in self._to_trainer or iid in self._to_rollout:
            return False  # lent to the trainer, not failed: `_instance` raises
        self.m["stale_events"] += 1
        return True

    def _on_instance_loaded(self, ev: E.InstanceLoaded) -> None:
        if self._stale_instance(ev.instance_id):
            return
        inst = self._instance(ev.instance_id)
        if inst.loading != ev.version:
            raise ProtocolError(
                f"instance {inst.id} reported version {ev.version} loaded, but was asked for {inst.loading}"
            )
        # The scheduler's own int, not the event's equal value (a host may report a numpy integer):
        # a trajectory keeps the version it ran under unboxed (`_tv`), as an int.
        v = inst.loading
        inst.version = v
        self.m["weight_loads"] += 1
        if not self._pinned:
            # partial: preempted trajectories resume under the new version (C1 broken, metered).
            tv, tvm = self._tv, self._tvm
            for h in inst.running:
                vs = tv[h]
                if vs >= 0:
                    if vs != v:
                        tv[h] = _MULTI
                        tvm[h] = [vs, v]
                elif (vs := tvm[h])[-1] != v:
                    vs.append(v)
            if v < self.newest:
                # A newer version was published while this one loaded: load it too (the
                # instance stays in the loading state throughout).
                self._start_load(inst, self.newest, preempt=True)
                return
        inst.loading = None
        self._n_loading -= 1
        b = self._bucket(v)
        self._lv_set(b, inst.id, None, inst.nrun)
        if not inst.nrun:
            self._idle[inst.id] = None
        if self._queue.get(b):  # (`_dispatch`'s first test, inlined: mostly nothing is queued)
            self._dispatch(b)
        if not inst.nrun:
            self._plan_instance(inst)
        live = len(self._targets)  # (its counts are all positive: `_dec_target` drops a zero)
        if live > self.m["live_versions_max"]:
            self.m["live_versions_max"] = live

    def _on_instance_failed(self, ev: E.InstanceFailed) -> None:
        if self._stale_instance(ev.instance_id):
            return
        inst = self._instance(ev.instance_id)
        target = inst.target
        if target is not None:
            b = self._bucket(target)
            self._cap[b] -= inst.capacity
            self._occupied[b] -= inst.nrun
            self._dec_target(target)
        if inst.loading is not None:
            self._n_loading -= 1
        elif inst.version is not None:
            self._lv_set(self._bucket(inst.version), inst.id, inst.nrun, None)
        self._idle.pop(inst.id, None)
        # Its reason to load the gating version died with it: left behind, it would count as a
        # holder of that version's even share (`_spread_plan`) and, when a host registers an engine
        # under the same id again, let it skip `_maybe_spread`'s "nothing else to do" test.
        self._spreading.pop(inst.id, None)
        del self.instances[inst.id]  # from now on its id reads as failed (`_stale_instance`)
        touched = set()
        n = self.n
        for h in inst.running:
            g = h // n
            self._ti[h] = _NOI
            self._ta[h] += 1
            self._tt[h] = 0
            self._tm[h] = 0  # a new attempt: no move of it can be in flight
            self._clear_versions(h)
            self.m["redispatched"] += 1
            if self._gst[g] == _FAILED:
                self._retire(g, h)
                continue
            self._ts[h] = _QUEUED
            self._glive[g] -= 1
            self._requeue(g, h - g * n)
            self._enqueue(g, 1)
            touched.add(self._bucket(self._gver[g]))
        for bb in touched:
            self._dispatch(bb)
        self._plan_all()

    def _on_group_admitted(self, ev: E.GroupAdmitted) -> None:
        gid = ev.group_id
        if not isinstance(gid, (int, str)) or isinstance(gid, bool):
            # The id travels in actions and snapshots: `snapshot()` is JSON data, and a tuple
            # came back from a JSON round trip as a list (unhashable: `restore` failed), a float
            # or numpy integer not at all, and True is the same key as group 1.
            raise ProtocolError(
                f"GroupAdmitted.group_id {_brief(gid)} ({type(gid).__name__}): a group id must be an int "
                f"or a str (a JSON scalar that survives the snapshot's JSON round trip), not a bool"
            )
        # (an int subclass's value compared: its own `<` and `>` are called first, and may say anything)
        if isinstance(gid, int) and not _INT_LOW < (gid if type(gid) is int else int.__int__(gid)) < _INT_BOUND:
            raise _big_int(gid, "GroupAdmitted.group_id")
        if self._outstanding <= 0:
            raise ProtocolError(f"group {ev.group_id!r} admitted without a RequestGroups outstanding")
        if ev.group_id in self._gslot:
            raise ProtocolError(f"group id {ev.group_id!r} admitted twice")
        # Kept (and handed to the admission key) as its JSON round trip gives it back, so that a run
        # resumed from a JSON snapshot sees the same meta as the uninterrupted one (`_json_data`).
        meta = ev.meta
        if meta is not None:
            meta = _json_data(meta, "GroupAdmitted.meta")
        v = self.newest
        seq = self._seq
        if self._builtin_keys:
            key = None  # `defaults.dora_admission_key`: `(seq,)`, the default, which is not stored
        else:
            # (before any state changes: a key refused leaves the group not admitted, and the
            # scheduler as it was)
            key = _json_key(self._admission_key(group_id=ev.group_id, version=v, seq=seq, meta=meta, mode=self.mode),
                            "dora_admission_key")
        self._outstanding -= 1
        self._seq = seq + 1
        g = self._alloc()
        self._gslot[ev.group_id] = g
        self._ggid[g] = ev.group_id
        self._gver[g] = v
        self._gseq[g] = seq
        if key is not None and key != (seq,):
            self._gkey[g] = key
        if meta is not None:
            self._gmeta[g] = meta
        self._admitted += 1
        self.m["groups_admitted"] += 1
        self._unassigned[v] = self._unassigned.get(v, 0) + 1
        self._n_active += 1
        self._form_dirty = True
        # `_enqueue(g, n)` and `_bucket`, inlined (once per admitted group): a fresh group has all
        # its trajectories pending, so it joins its version's queue
        n = self.n
        b = v if self._pinned else _ANY
        self._queued[b] = self._queued.get(b, 0) + n
        if self._pinned and not self._cap.get(b):
            self._orphaned = True  # no instance holds or loads this version: see `_finish`
        heapq.heappush(self._queue.setdefault(b, []), ((seq,) if key is None else self._qkey(g), seq, gid))
        self._ginq[g] = 1
        self._dispatch(b)

    def _on_groups_declined(self, ev: E.GroupsDeclined) -> None:
        if ev.count < 0 or ev.count > self._outstanding:
            raise ProtocolError(f"declined {ev.count} groups but {self._outstanding} are outstanding")
        self._outstanding -= ev.count

    def _on_data_exhausted(self, ev: E.DataExhausted) -> None:
        self._exhausted = True
        self._outstanding = 0
        self._form_dirty = True

    def _on_progressed(self, ev: E.TrajectoryProgressed) -> None:
        h = self._running_traj(ev.group_id, ev.index, ev.attempt)
        if h is not None:
            self._set_tokens(h, ev.tokens)

    def _on_finished(self, ev: E.TrajectoryFinished) -> None:
        g = self._gslot.get(ev.group_id)
        idx = ev.index
        n = self.n
        ts = self._ts
        if (g is None or not 0 <= idx < n or ts[h := g * n + idx] != _RUNNING
                or ((a := ev.attempt) is not None and a != self._ta[h])):
            # the general path: errors and stale reports
            h = self._running_traj(ev.group_id, idx, ev.attempt)
            if h is None:
                return
            g = h // n
        key = None
        if not self._builtin_keys and ev.reward is not None and self._gdone[g] + 1 == n and self._gst[g] != _FAILED:
            # This finish completes the group (if its reward is valid): a plugin's batch key is
            # computed (and checked) first, before anything changes, so that a key refused leaves
            # the scheduler as it was before the event (the trajectory still runs; nothing was
            # released nor dispatched into its slot), as a refused admission does.
            key = self._completion_key(g, ev.reward)
        try:
            self._tt[h] = ev.tokens
        except (TypeError, OverflowError):
            self._set_tokens(h, ev.tokens)
        if ev.truncated_early:
            self.m["truncated"] += 1
        # `_release(h)`, inlined for its common case (a loaded instance: this runs on every
        # finish; the same steps in the same order, `_release` does the others)
        ti = self._ti
        inst = self.instances.get(ti[h])
        if inst is None or inst.loading is not None:
            self._release(h)
        else:
            ti[h] = _NOI
            self._tp[h] = _NOP  # its log entry is dead
            n_run = inst.nrun - 1
            inst.nrun = n_run
            if not n_run:
                del inst.log[:]
            v = inst.version
            b = v if self._pinned else _ANY
            self._occupied[b] -= 1
            lv = self._lv[b]
            iid = inst.id
            d = lv[n_run + 1]
            del d[iid]
            if not d:
                del lv[n_run + 1]
            d = lv.get(n_run)
            if d is None:
                lv[n_run] = d = _Level()
            d[iid] = inst
            if n_run < self._lo[b]:
                self._lo[b] = n_run
            if not n_run or self._queue.get(b) or (self._migrate and v < self.newest):
                self._release_rest(inst, v, b, n_run)
        reward = ev.reward
        if self._gst[g] == _FAILED:
            if reward is not None:
                self._retire(g, h)
                return
            # (A trajectory of a failed group without its reward yet stays until the runtime
            # sends the reward or a failure for it, so that those events are still understood.)
            ts[h] = _AWAIT_REWARD
            return
        if reward is None:
            ts[h] = _AWAIT_REWARD
        elif type(reward) is float and reward - reward == 0.0 and self._gdone[g] + 1 < n:
            # `_set_reward`'s common case, inlined: a finite float that does not complete its group
            self._tr[h] = reward
            ts[h] = _DONE
            self._glive[g] -= 1
            self._gdone[g] += 1
        else:
            ts[h] = _AWAIT_REWARD
            self._set_reward(g, h, reward, key)

    def _on_reward(self, ev: E.RewardReady) -> None:
        g = self._group(ev.group_id, ev.attempt)
        if g is None:
            return
        h = self._traj(g, ev.index)
        if ev.attempt is not None and ev.attempt != self._ta[h]:
            self.m["stale_events"] += 1
            return
        if self._gst[g] == _FAILED:
            self._retire(g, h)
            return
        if self._ts[h] != _AWAIT_REWARD:
            raise ProtocolError(f"reward for trajectory {ev.group_id!r}/{ev.index}, which is not awaiting one "
                                f"({_LETTERS[self._ts[h]]})")
        self._set_reward(g, h, ev.reward)

    def _on_failed(self, ev: E.TrajectoryFailed) -> None:
        g = self._group(ev.group_id, ev.attempt)
        if g is None:
            return
        h = self._traj(g, ev.index)
        if ev.attempt is not None and ev.attempt != self._ta[h]:
            self.m["stale_events"] += 1
            return
        st = self._ts[h]
        if st == _RUNNING:
            self._release(h)
        elif st != _AWAIT_REWARD:
            raise ProtocolError(f"trajectory {ev.group_id!r}/{ev.index} failed but is not running ({_LETTERS[st]})")
        if self._gst[g] == _FAILED:
            self._retire(g, h)  # its group was already reported failed
            return
        self._fail_traj(g, h, ev.reason)

    def _on_step_started(self, ev: E.TrainerStepStarted) -> None:
        if self._trainer_busy != ev.step:
            raise ProtocolError(f"trainer started step {ev.step}, but the running step is {self._trainer_busy}")

    def _on_step_finished(self, ev: E.TrainerStepFinished) -> None:
        if self._trainer_busy != ev.step:
            raise ProtocolError(f"trainer finished step {ev.step}, but the running step is {self._trainer_busy}")
        gslot = self._gslot
        for gid in self._forming:
            g = gslot.pop(gid)  # trained: it leaves the scheduler (its totals are in the metrics)
            self._gst[g] = _TRAINED
            self._release_slot(g)
        self._forming = []
        self._trainer_busy = None
        self.step += 1
        self._form_dirty = True
        self._adm.step_finished()

    def _on_published(self, ev: E.VersionPublished) -> None:
        if not isinstance(ev.version, numbers.Integral):
            # (a float would pass the test below and then fail the int arrays that hold versions,
            # half-way through admitting the next group)
            raise ProtocolError(f"version {ev.version!r} published: expected an integer")
        if ev.version != self.newest + 1:
            raise ProtocolError(f"version {ev.version} published, expected {self.newest + 1}")
        if ev.version > self.step:
            raise ProtocolError(f"version {ev.version} published before trainer step {ev.version - 1} finished")
        self.newest = int(ev.version)
        for b in [b for b, c in self._queued.items() if not c and not self._queue.get(b) and b != _ANY]:
            del self._queued[b]  # versions with nothing queued leave (live state only)
            self._queue.pop(b, None)
        for b in [b for b, c in self._cap.items() if not c and not self._occupied.get(b)]:
            del self._cap[b]  # versions no instance holds any more
            self._occupied.pop(b, None)
        if not self._pinned:
            # partial: every instance switches now; running work is preempted and resumed.
            for inst in list(self.instances.values()):
                if inst.version is None or inst.loading is not None or inst.version == ev.version:
                    continue
                self._start_load(inst, ev.version, preempt=True)
            return
        self._plan_all()

    _handlers: dict[type, Callable] = {
        E.InstanceReady: _on_instance_ready,
        E.InstanceLoaded: _on_instance_loaded,
        E.InstanceFailed: _on_instance_failed,
        E.SwitchedToTrainer: _on_switched_to_trainer,
        E.TrainerIdle: _on_trainer_idle,
        E.MigrationLanded: _on_migration_landed,
        E.GroupAdmitted: _on_group_admitted,
        E.GroupsDeclined: _on_groups_declined,
        E.DataExhausted: _on_data_exhausted,
        E.TrajectoryProgressed: _on_progressed,
        E.TrajectoryFinished: _on_finished,
        E.RewardReady: _on_reward,
        E.TrajectoryFailed: _on_failed,
        E.TrainerStepStarted: _on_step_started,
        E.TrainerStepFinished: _on_step_finished,
        E.VersionPublished: _on_published,
    }

    # ------------------------------------------------------------------ lookups
    def _instance(self, iid: int) -> _Instance:
        try:
            return self.instances[iid]
        except KeyError:
            raise ProtocolError(f"unknown (or failed) instance {iid!r}") from None

    def _group(self, gid: Any, attempt: int | None = None) -> int | None:
        """The live group `gid`. A trajectory event carrying an `attempt` for a group that is no
        longer held (trained, or failed and retired) is a late report: counted and ignored."""
        g = self._gslot.get(gid)
        if g is None:
            if attempt is not None:
                self.m["stale_events"] += 1
                return None
            raise ProtocolError(f"unknown group {gid!r} (never admitted, or already trained/failed)")
        return g

    def _traj(self, g: int, idx: int) -> int:
        """The handle of trajectory `idx` of group slot `g`."""
        if not 0 <= idx < self.n:
            raise ProtocolError(f"group {self._ggid[g]!r} has no trajectory {idx} (group size {self.n})")
        return g * self.n + idx

    def _running_traj(self, gid: Any, idx: int, attempt: int | None) -> int | None:
        g = self._group(gid, attempt)
        if g is None:
            return None
        h = self._traj(g, idx)
        if attempt is not None and attempt != self._ta[h]:
            self.m["stale_events"] += 1
            return None
        if self._ts[h] != _RUNNING:
            raise ProtocolError(f"trajectory {gid!r}/{idx} is not running ({_LETTERS[self._ts[h]]})")
        return h

    def _key(self, h: int) -> tuple[Any, int]:
        """The runtime's name `(group_id, index)` of handle `h` (at the event boundary only)."""
        g, idx = divmod(h, self.n)
        return (self._ggid[g], idx)

    def _key_of(self, g: int) -> tuple:
        """Group slot `g`'s admission key."""
        key = self._gkey.get(g)
        return (self._gseq[g],) if key is None else key

    def _key_ordered(self, g: int) -> tuple:
        """Group slot `g`'s admission key as the queue compares it with a plugin's keys (`_ordered`)."""
        key = self._gkey.get(g)
        return (1, self._gseq[g]) if key is None else _ordered(key)

    def _pending(self, g: int) -> list[int]:
        """Group slot `g`'s pending trajectories' indices, in dispatch order."""
        retry = self._gretry.get(g)
        return (retry[::-1] if retry else []) + list(range(self._gnext[g], self.n))

    def trajectory(self, group_id: Any, index: int) -> TrajectoryView:
        """A read-only view of a live trajectory's state (status letter, instance, attempt,
        tokens, versions, retries, moved, reward), for tests and debugging."""
        return TrajectoryView(self, self._traj(self._group(group_id), index))

    def running_on(self, instance_id: int) -> list[tuple[Any, int]]:
        """The trajectories `(group_id, index)` running on a live instance, in dispatch order."""
        return [self._key(h) for h in self._instance(instance_id).running]

    def trajectories(self, group_id: Any) -> list[TrajectoryView]:
        g = self._group(group_id)
        return [TrajectoryView(self, g * self.n + i) for i in range(self.n)]

    def _alloc(self) -> int:
        """A free group slot, its group fields and `n` trajectory handles in their initial
        state (version, seq, key and meta are the caller's to set)."""
        n = self.n
        if self._free:
            g = self._free.pop()
            sl = slice(g * n, g * n + n)  # (one slice object for the nine resets)
            zb, zq = self._zero_b, self._zero_q
            self._ts[sl] = zb
            self._ta[sl] = zq
            self._tn[sl] = zq
            self._tm[sl] = zb
            self._tr[sl] = self._nan_d
            self._ti[sl] = self._noi
            self._tp[sl] = self._nop  # (a failed instance's handles kept their stamp)
            self._tt[sl] = zq
            self._tv[sl] = self._nov
            self._gst[g] = _ACTIVE
            self._gstep[g] = -1
            self._gcseq[g] = -1
            self._gdone[g] = self._glive[g] = self._ginq[g] = self._gnext[g] = 0
            return g
        g = len(self._gver)
        self._ts.extend(self._zero_b)
        self._ta.extend(self._zero_q)
        self._tn.extend(self._zero_q)
        self._tm.extend(self._zero_b)
        self._tr.extend(self._nan_d)
        self._ti.extend(self._noi)
        self._tp.extend(self._nop)
        self._tt.extend(self._zero_q)
        self._tv.extend(self._nov)
        for a in (self._gver, self._gseq, self._gdone, self._glive, self._gnext):
            a.append(0)
        self._gst.append(_ACTIVE)
        self._ginq.append(0)
        self._gstep.append(-1)
        self._gcseq.append(-1)
        return g

    def _release_slot(self, g: int) -> None:
        """Group slot `g` left the scheduler: it is free for the next admitted group."""
        del self._ggid[g]
        self._gkey.pop(g, None)
        self._gmeta.pop(g, None)
        self._gretry.pop(g, None)
        self._free.append(g)
        if self._tvm:
            for h in range(g * self.n, (g + 1) * self.n):
                self._tvm.pop(h, None)

    def _versions(self, h: int) -> int | list[int] | None:
        """Trajectory `h`'s versions: None, the one version, or a list of several."""
        v = self._tv[h]
        return v if v >= 0 else None if v == _NOV else self._tvm[h]

    def _clear_versions(self, h: int) -> None:
        if self._tv[h] == _MULTI:
            del self._tvm[h]
        self._tv[h] = _NOV

    def _set_tokens(self, h: int, tokens: Any) -> None:
        try:
            self._tt[h] = tokens
        except (TypeError, OverflowError):
            raise ProtocolError(f"trajectory {self._key(h)!r}: tokens must be an integer (64-bit), "
                                f"got {_brief(tokens)}") from None

    def _bucket(self, version: int) -> int:
        return version if self._pinned else _ANY

    # ------------------------------------------------------------------ state changes
    def _add_instance(self, iid: int, capacity: int, lend: bool = True) -> None:
        if not isinstance(iid, numbers.Integral) or not _NOI < iid < 2**63:
            raise ProtocolError(f"instance id {_brief(iid)}: expected a 64-bit integer")
        self.instances[iid] = inst = _Instance(iid, capacity, self._tp)
        if iid > self._id_max:
            self._id_max = iid
        if capacity != self._cap_max and self.instances.keys() - {iid}:
            self._uniform = False
        if capacity > self._cap_max:
            self._cap_max = capacity
        self._idle[iid] = None
        self._plan_instance(inst, lend=lend)

    def _dec_target(self, version: int) -> None:
        c = self._targets[version] - 1
        if c:
            self._targets[version] = c
        else:
            del self._targets[version]

    def _start_load(self, inst: _Instance, version: int, preempt: bool = False) -> None:
        """`inst` loads `version`; `preempt` (partial): its running trajectories pause meanwhile."""
        old = inst.target
        if old is not None:
            self._dec_target(old)
            ob = self._bucket(old)
            self._cap[ob] -= inst.capacity
            self._occupied[ob] -= inst.nrun
            if inst.loading is None:
                self._lv_set(ob, inst.id, inst.nrun, None)
        nb = self._bucket(version)
        self._cap[nb] = self._cap.get(nb, 0) + inst.capacity
        self._occupied[nb] = self._occupied.get(nb, 0) + inst.nrun
        self._targets[version] = self._targets.get(version, 0) + 1
        if inst.loading is None:
            self._n_loading += 1
        inst.loading = version
        self._idle.pop(inst.id, None)
        self._out.append(A.LoadVersion(inst.id, version, tuple(map(self._key, inst.running)) if preempt else ()))

    def _requeue(self, g: int, idx: int) -> None:
        """Trajectory `idx` of group slot `g` is pending again, first in line (it ran before)."""
        retry = self._gretry.get(g)
        if retry is None:
            self._gretry[g] = [idx]
        else:
            retry.append(idx)

    def _enqueue(self, g: int, added: int) -> None:
        """`added` trajectories of group slot `g` joined its pending list; make sure the group is
        queued."""
        b = self._bucket(self._gver[g])
        self._queued[b] = self._queued.get(b, 0) + added
        if self._pinned and not self._cap.get(b):
            self._orphaned = True  # no instance holds or loads this version: see `_finish`
        if not self._ginq[g] and (g in self._gretry or self._gnext[g] < self.n):
            heapq.heappush(self._queue.setdefault(b, []), (self._qkey(g), self._gseq[g], self._ggid[g]))
            self._ginq[g] = 1

    def _lv_set(self, b: int, iid: int, old: int | None, new: int | None) -> None:
        """Loaded instance `iid` of bucket `b` went from `old` to `new` running trajectories
        (None: not loaded in `b`). Keeps the levels, the low-level hint and the holder count."""
        lv = self._lv.get(b)
        if lv is None:
            lv = self._lv[b] = {}
            self._lo[b] = new if new is not None else 0
        if old is not None:
            d = lv[old]
            del d[iid]
            if not d:
                del lv[old]
            if old:
                c = self._nhold[b] - 1
                if c:
                    self._nhold[b] = c
                else:
                    del self._nhold[b]
                    self._r5_tried.pop(b, None)
                    self._r5_stuck.pop(b, None)
        if new is not None:
            d = lv.get(new)
            if d is None:
                lv[new] = d = _Level()
            d[iid] = self.instances[iid]
            if new < self._lo[b]:
                self._lo[b] = new
            if new:
                self._nhold[b] = self._nhold.get(b, 0) + 1
        elif not lv:
            del self._lv[b], self._lo[b]

    def _pick(self, b: int, lv: dict, work: int, share_of: int) -> _Instance | None:
        """The instance of bucket `b` that takes the next trajectory: the least loaded one (the
        first to arrive at that level), unless it is full or at its fair share of the bucket's
        work (`work` running + queued, shared in proportion to capacity, counting instances still
        loading the version: otherwise the first instance to finish loading would take a whole
        batch and leave the others idle)."""
        lo = self._lo[b]
        while lo not in lv:
            lo += 1
        self._lo[b] = lo
        inst = self.instances[next(iter(lv[lo]))]
        cap = inst.capacity
        if lo < cap and lo < -(-work * cap // share_of):
            return inst
        if self._uniform:
            return None  # everyone else runs at least as much and has the same capacity and share
        for level in sorted(lv):
            for iid in lv[level]:
                inst = self.instances[iid]
                cap = inst.capacity
                if level < cap and level < -(-work * cap // share_of):
                    return inst
        return None

    def _dispatch(self, b: int, first: int | None = None) -> None:
        """Give free slots of bucket `b` to its queued trajectories, group-major (R6): the group
        at the head of the queue fills first, each trajectory going to `_pick`'s instance.
        (`first` is accepted for compatibility; the least loaded instance is served first.)"""
        heap = self._queue.get(b)
        lv = self._lv.get(b)
        if not heap or not lv:
            return
        gslot = self._gslot
        n = self.n
        ts, ti, tm, tv, ta = self._ts, self._ti, self._tm, self._tv, self._ta
        gretry, gnext, glive = self._gretry, self._gnext, self._glive
        share_of = self._cap[b]
        work = self._occupied[b] + self._queued[b]  # constant here: each dispatch moves one over
        append = self._out.append
        Dispatch = A.Dispatch
        uniform = self._uniform
        lo_of = self._lo
        lo = lo_of[b]
        heappop = heapq.heappop
        tp, pseq = self._tp, self._pseq
        fcap = limit = -1  # the capacity `limit` was computed for: min(capacity, fair share)
        level = up = None  # lv[lo] (None: look it up) and lv[up_of + 1] (up_of -1: look it up)
        up_of = -1
        sent = 0
        # The head group's slot (-1: read the heap's head again). While a group is the head, its
        # re-queued stack, next fresh index and count of trajectories started here are kept in
        # locals (`retry`, `nxt`, `added`) and written back when it leaves the head or the loop
        # ends: nothing else reads them meanwhile.
        g = -1
        retry = None
        nxt = added = 0
        while True:
            if g < 0:
                if not heap:
                    break
                gid = heap[0][2]
                g = gslot.get(gid)
                if g is None:
                    heappop(heap)
                    g = -1
                    continue
                retry = gretry.get(g)
                nxt = gnext[g]
                added = 0
            if retry is None and nxt >= n:
                heappop(heap)  # nothing left to start in this group
                self._ginq[g] = 0
                gnext[g] = nxt
                glive[g] += added
                g = -1
                continue
            # `_pick`, inlined for the common case (equal capacities): the least loaded instance,
            # the first to arrive at its level, taken out of its level at once (`popitem`: the id
            # and the instance in one call) and put back in front if it takes nothing. `level` (the
            # level `lo`) and `up` (the level `up_of + 1`) are kept across trajectories while no
            # other code touches the levels: a group's trajectories go one by one from the lowest
            # level to the one above, so the two dict lookups per trajectory are mostly saved.
            if level is None:
                while lo not in lv:
                    lo += 1
                level = lv[lo]
            iid, inst = level.popitem(False)
            cap = inst.capacity
            if cap != fcap:
                fcap = cap
                limit = min(cap, -(-work * cap // share_of))
            if lo >= limit:
                level[iid] = inst  # (back in front of its level: the levels are as they were)
                level.move_to_end(iid, False)
                if uniform:
                    break
                lo_of[b] = lo
                inst = self._pick(b, lv, work, share_of)
                if inst is None:
                    break
                iid = inst.id
                n_run = inst.nrun
                d = lv[n_run]
                del d[iid]
                if not d:
                    del lv[n_run]
                level = None  # (either cached level may be the one just emptied)
                up_of = -1
            else:
                n_run = lo
                if not level:
                    del lv[lo]
                    level = None
            if retry is not None:
                idx = retry.pop()
                if not retry:
                    del gretry[g]
                    retry = None
            else:
                idx = nxt
                nxt += 1
            h = g * n + idx
            ver = inst.version
            ts[h] = _RUNNING
            ti[h] = iid
            tm[h] = 0
            tv[h] = ver
            added += 1
            # `_place`, inlined: logged on the instance under a fresh stamp
            tp[h] = pseq
            log = inst.log
            if len(log) > 6 * n_run + 64:  # (more than 3 * n_run + 32 entries)
                self._compact(inst)
                log = inst.log
            log.append(h)
            log.append(pseq)
            inst.nrun = n_run + 1
            pseq += 1
            # one level up (`_lv_set`, inlined)
            if up_of != n_run:
                up = lv.get(n_run + 1)
                if up is None:
                    lv[n_run + 1] = up = _Level()
                up_of = n_run
            up[iid] = inst
            if not n_run:
                self._idle.pop(iid, None)
                self._nhold[b] = self._nhold.get(b, 0) + 1
            sent += 1
            append(Dispatch(gid, idx, iid, ver, ta[h]))
        if g >= 0:
            gnext[g] = nxt
            glive[g] += added
        lo_of[b] = lo
        self._pseq = pseq
        if sent:
            self._n_sent += sent
            self._occupied[b] += sent
            self._queued[b] -= sent
        if not heap and self._queued.get(b) == 0 and b != (self.newest if self._pinned else _ANY):
            del self._queue[b], self._queued[b]  # keep per-version dicts as short as the live set

    def _release(self, h: int) -> None:
        """Running trajectory `h` left its instance (finished or failed)."""
        ti = self._ti
        inst = self.instances.get(ti[h])
        ti[h] = _NOI
        self._tp[h] = _NOP  # its log entry is dead
        if inst is None:
            return
        n_run = inst.nrun - 1  # (`_Instance._drop`, inlined: this runs on every finish)
        inst.nrun = n_run
        if not n_run:
            del inst.log[:]
        if inst.loading is None:
            v = inst.version
            b = v if self._pinned else _ANY
            self._occupied[b] -= 1
            # one level down (the `_lv_set` common case, inlined: this runs on every finish)
            lv = self._lv[b]
            iid = inst.id
            d = lv[n_run + 1]
            del d[iid]
            if not d:
                del lv[n_run + 1]
            d = lv.get(n_run)
            if d is None:
                lv[n_run] = d = _Level()
            d[iid] = inst
            if n_run < self._lo[b]:
                self._lo[b] = n_run
            if not n_run or self._queue.get(b) or (self._migrate and v < self.newest):
                self._release_rest(inst, v, b, n_run)
        else:
            # partial: preempted while loading; it stops counting against the version it loads.
            self._occupied[self._bucket(inst.loading)] -= 1

    def _release_rest(self, inst: _Instance, v: int, b: int, n_run: int) -> None:
        """The rest of `_release` (and of its copy in `_on_finished`), once the levels are
        updated: only when the instance emptied, or its version has queued work, or (R5) it
        runs an old version; otherwise each step below would only test and return."""
        if not n_run:
            c = self._nhold[b] - 1
            if c:
                self._nhold[b] = c
            else:
                del self._nhold[b]
                self._r5_tried.pop(b, None)
                self._r5_stuck.pop(b, None)
        if self._queue.get(b):
            self._dispatch(b)
            n_run = inst.nrun  # (the dispatch may have given the instance new work)
        if not n_run:
            self._idle[inst.id] = None
            self._plan_instance(inst)
        elif (self._migrate and v < (newest := self.newest) and v + self.K > self.step
              and self._queued.get(v, 0) <= 0 and self._nhold.get(v, 0) >= 2
              and self._occupied.get(v, 0) <= self.config.migrate_threshold * self._cap.get(v, 0)
              and ((newest + self.K + 1) * self.B > self._admitted + self._outstanding
                   or self._queued.get(self._bucket(newest), 0) > 0)):
            # (its first O(1) tests, inlined: this runs on every finish of an old version; the
            # last one is `_maybe_consolidate`'s "the newest version could use the freed
            # slots" without `max_steps`, a necessary condition of it. Each test only returns,
            # so testing them here first changes nothing but the cost.)
            self._maybe_consolidate(v)

    def _retire(self, g: int, h: int) -> None:
        """A trajectory of a failed group stopped running (or got its late reward): once none of
        them runs, the group leaves the scheduler."""
        if self._ts[h] in (_RUNNING, _AWAIT_REWARD):
            self._glive[g] -= 1
        self._ts[h] = _DEAD
        if self._glive[g] == 0 and self._gslot.get(gid := self._ggid[g]) == g:
            del self._gslot[gid]
            self._release_slot(g)

    @staticmethod
    def _bad_reward(reward: Any) -> bool:
        # Any real number (numpy/torch scalars register as `numbers.Real`), finite.
        try:
            return (reward is None or (type(reward) is not float and not isinstance(reward, numbers.Real))
                    or not math.isfinite(reward))
        except OverflowError:  # an int (or Fraction) too large for a float
            return True

    def _completion_key(self, g: int, reward: Any) -> tuple | None:
        """The batch key of group slot `g` if `reward` (valid) completes it now, computed by the
        plugin and checked (None: an invalid reward, whose key is never asked for). Only with a
        plugin's keys (`_on_finished`, before its changes)."""
        if self._bad_reward(reward):
            return None
        key = _ordered(_json_key(self._batch_key(group_id=self._ggid[g], version=self._gver[g],
                                                 complete_seq=self._complete_seq, mode=self.mode),
                                 "dora_batch_key"))
        return (self._complete_seq, key)

    def _set_reward(self, g: int, h: int, reward: Any, pre: tuple | None = None) -> None:
        """`pre`: (completion sequence number, batch key) computed by `_completion_key` before
        the event changed anything (used if the group completes under that number)."""
        if self._bad_reward(reward):
            self.m["invalid_rewards"] += 1
            idx = h - g * self.n
            gid = self._ggid[g]
            msg = f"invalid reward {_brief(reward)} for trajectory {gid!r}/{idx} (version {self._gver[g]})"
            self._out.append(A.ReportError(gid, idx, msg))
            self._fail_traj(g, h, msg)
            return
        completes = self._gdone[g] + 1 == self.n
        if completes:
            # The group completes with this reward: its batch key first, before any state changes,
            # so that a key refused (or a plugin that raises) leaves the trajectory awaiting its
            # reward and the group active, as they were (a later `RewardReady` completes it);
            # computed after, the group was complete but in no pool: never trained, not failed.
            # (A finish carrying the reward computed it before its own changes: `pre`.)
            cseq = self._complete_seq
            gid, v = self._ggid[g], self._gver[g]
            if self._builtin_keys:  # `defaults.dora_batch_key`
                key = (v, cseq) if self.mode == "dora" else (cseq,)
            elif pre is not None and pre[0] == cseq:
                key = pre[1]
            else:
                key = _ordered(_json_key(self._batch_key(group_id=gid, version=v, complete_seq=cseq,
                                                         mode=self.mode), "dora_batch_key"))
        self._tr[h] = float(reward)
        self._ts[h] = _DONE
        self._glive[g] -= 1
        self._gdone[g] += 1
        if completes:
            self._gst[g] = _COMPLETE
            self.m["groups_completed"] += 1
            self._n_active -= 1
            self._gcseq[g] = cseq
            self._complete_seq = cseq + 1
            heapq.heappush(self._pools.setdefault(v, []), (key, cseq, gid))
            self._pool_n += 1
            self._form_dirty = True

    def _fail_traj(self, g: int, h: int, reason: str) -> None:
        """Trajectory `h` (running before, already released, or awaiting its reward) failed."""
        n = self.n
        idx = h - g * n
        v = self._gver[g]
        if self._tn[h] < self.config.max_retries:
            self._tn[h] += 1
            self._ta[h] += 1
            self._ts[h], self._tt[h], self._tr[h], self._tm[h] = _QUEUED, 0, _NAN, 0
            self._clear_versions(h)
            self._glive[g] -= 1
            self.m["retries"] += 1
            self._requeue(g, idx)
            self._enqueue(g, 1)
            self._dispatch(self._bucket(v))
            return
        # Retries exhausted: the group is reported, never silently dropped (C2).
        self._gst[g] = _FAILED
        self._admitted -= 1
        self._n_active -= 1
        self._dec_unassigned(v)
        self._form_dirty = True
        b = self._bucket(v)
        pending = self._pending(g)
        self._queued[b] = self._queued.get(b, 0) - len(pending)
        for i in pending:
            self._ts[g * n + i] = _DEAD
        self._gretry.pop(g, None)
        self._gnext[g] = n
        self.m["failed_groups"] += 1
        self._out.append(A.ReportGroupFailed(self._ggid[g], f"trajectory {idx} failed {self._tn[h] + 1} times: {reason}"))
        self._retire(g, h)
        self._check_storm(reason)

    def _check_storm(self, reason: str) -> None:
        """The circuit breaker: stop a failure storm instead of replacing failed groups forever."""
        failed, completed = self.m["failed_groups"], self.m["groups_completed"]
        share = self.config.max_failed_group_share
        if self._halted is None and failed >= max(self.B, 4) and failed > share * (failed + completed):
            self._halted = (
                f"failure storm: {failed} groups failed and {completed} completed "
                f"(failed share {failed / (failed + completed):.2f} > max_failed_group_share {share}); "
                f"{self.m['retries']} retries, {self.m['invalid_rewards']} invalid rewards; "
                f"last failure: {reason}"
            )

    # ------------------------------------------------------------------ instance planning (R4, R5)
    def _orphan_version(self) -> int | None:
        """The oldest version with queued work and no instance loaded with or loading it."""
        best = None
        for b, cnt in self._queued.items():
            if cnt > 0 and b != _ANY and self._cap.get(b, 0) == 0 and (best is None or b < best):
                best = b
        return best

    def _plan_instance(self, inst: _Instance, lend: bool = True) -> None:
        """An instance is idle (or new): keep it, or switch it to the version that needs it (R4),
        or (elastic) lend it to the trainer when no work is left for it."""
        if inst.loading is not None or inst.nrun:
            return
        want = self._orphan_version()
        if want is None:
            if inst.version is not None and self._queued.get(self._bucket(inst.version), 0) > 0:
                return  # its own version still has queued work
            # (`_maybe_spread`'s first O(1) test, inlined: an instance that is not loading to
            # spread does so only when no admission is outstanding)
            if self._spread and (not self._outstanding or inst.id in self._spreading) and self._maybe_spread(inst):
                return
            if lend and self._elastic and self._should_lend():
                self._switch_to_trainer(inst)
                return
            want = self.newest
        if inst.version == want:
            return
        if not self._pinned and inst.version is not None:
            return  # partial switches on publish only
        self._start_load(inst, want)

    def _plan_all(self) -> None:
        """Something changed for every instance (a publish, a failure): plan the idle ones, and
        consider R5 for every old version that still runs somewhere."""
        instances = self.instances
        for iid in list(self._idle):
            inst = instances.get(iid)
            if inst is not None:
                self._plan_instance(inst)
        if self._migrate:
            for v in sorted(self._nhold):
                if v < self.newest:
                    self._maybe_consolidate(v)

    def _plan_idle(self) -> None:
        """Work was queued for a version no instance holds (a retry or a crash re-queued a
        trajectory of an older version): switch an idle instance to it (R4). Busy instances
        switch when they drain (`_release`)."""
        instances = self.instances
        for iid in list(self._idle):
            self._plan_instance(instances[iid])
            if self._orphan_version() is None:
                return

    def _maybe_consolidate(self, v: int) -> None:
        """R5: when an old version's running work is spread thin, move it onto fewer instances.

        Called on every release of an old-version trajectory, so every test before the plan is
        O(1): the version must not gate the step being formed, its running work must fill at
        most `migrate_threshold` of its slots, it must run on more instances than the work needs
        when each is filled to `migrate_threshold` (the occupancy levels `_lv` count holders),
        and the newest version must be able to use the freed instances.
        """
        if self._queued.get(v, 0) > 0 or v + self.K <= self.step:
            # A version the step being formed must take gates the trainer: its stragglers keep
            # their instances (packing them would slow each one down).
            return
        nh = self._nhold.get(v, 0)
        if nh < 2:
            return
        fill = self.config.migrate_threshold
        occ = self._occupied.get(v, 0)
        if occ > fill * self._cap.get(v, 0):
            return
        limit = max(1, int(fill * self._cap_max))
        if nh <= -(-occ // limit):
            return  # already on as few instances as the plan could use
        if self._r5_tried.get(v) == (occ, nh):
            return  # tried in this very state and could not move (trajectories already moved once)
        # Only worth it when the newest version could use the freed slots.
        if self._budget_left() <= 0 and self._queued.get(self._bucket(self.newest), 0) <= 0:
            return
        if self._builtin_r5:
            self._consolidate_builtin(v)
        else:
            self._consolidate_plugin(v)
        if self._nhold.get(v, 0) == nh and self._occupied.get(v, 0) == occ:
            self._r5_tried[v] = (occ, nh)

    def _consolidate_builtin(self, v: int) -> None:
        """The built-in plan, applied incrementally: empty the least loaded holders into the most
        loaded ones that are below `migrate_threshold` of their capacity (fewest moves, as few
        instances as can hold the work, none packed tighter than the threshold)."""
        fill = self.config.migrate_threshold
        instances = self.instances
        top = max(1, int(fill * self._cap_max))  # no instance takes more than this
        emptied = []
        dst = None
        dst_full = 0  # the running count at which `dst` reaches the threshold
        lo_of = self._lo
        while True:
            lv = self._lv.get(v)
            if not lv or self._nhold.get(v, 0) <= -(-self._occupied.get(v, 0) // top):
                break
            # The lowest non-empty level above 0: walked up from the hint `_lo[v]` (at or below
            # the lowest level) for a few steps, else a min over every level (with capacity 1,000
            # a version has hundreds of levels, and this runs for every instance R5 empties).
            low = lo_of[v]
            if not low:
                low = 1
            stop = low + 32
            while low not in lv and low < stop:
                low += 1
            if low not in lv:
                low = min(lv)
                if not low:
                    low = min(n for n in lv if n)
            src = lv[low]
            src = src[next(iter(src))]  # (a level maps id -> instance)
            stuck = (src.id, self._n_sent, self._n_landed)
            if self._r5_stuck.get(v) == stuck:
                break  # it still runs only moved trajectories: nothing to move
            progressed = False
            movable = False
            tm = self._tm
            for h in src.live():
                if tm[h]:
                    continue  # its move may still be in flight: it moves again only after MigrationLanded
                movable = True
                if dst is None or dst is src or dst.nrun >= dst_full:
                    # The most loaded holder still below the threshold (the previous destination
                    # stays the best until it reaches it, so this search runs once per filled one).
                    dst = None
                    # The levels below `top`, highest first. Mostly the highest level of all is
                    # below `top` and holds an instance other than `src`: that one is tried first
                    # (a max over the levels, no list built and sorted); else the levels are
                    # walked in order, counted down when that is the shorter walk, else sorted
                    # (the same order either way; the highest level, tried again, takes nothing).
                    hi = max(lv)
                    if 0 < hi < top:
                        for iid, inst in lv[hi].items():  # (a level maps id -> instance)
                            if iid != src.id and hi < max(1, int(fill * inst.capacity)):
                                dst = inst
                                dst_full = max(1, int(fill * dst.capacity))
                                break
                    if dst is None:
                        if top <= 2 * len(lv):
                            levels = range(top - 1, 0, -1)
                        else:
                            levels = sorted([n for n in lv if 0 < n < top], reverse=True)
                        for level in levels:
                            if level not in lv:
                                continue
                            for iid in lv[level]:
                                if iid != src.id and level < max(1, int(fill * instances[iid].capacity)):
                                    dst = instances[iid]
                                    dst_full = max(1, int(fill * dst.capacity))
                                    break
                            if dst is not None:
                                break
                    if dst is None:
                        break
                self._move(v, h, src, dst)
                progressed = True
            if not movable:
                self._r5_stuck[v] = stuck
            if src.nrun or not progressed:
                break
            emptied.append(src)
        for i in emptied:
            self._plan_instance(i)

    def _consolidate_plugin(self, v: int) -> None:
        """A plugin's `dora_plan_migration`: hand it the holders, validate and apply its plan.

        O(view + moves): the view is built once, and each move is checked in O(1) against the
        state as the earlier moves of the plan left it (`_ti[h]` names the instance a trajectory
        runs on: it is `src` only while it runs there)."""
        instances = self.instances
        holders = [instances[i] for n, level in self._lv.get(v, {}).items() if n for i in level]
        holders.sort(key=lambda i: i.id)
        key = self._key
        plan = self._plan_migration(
            version=v,
            instances=[{"id": i.id, "capacity": i.capacity, "running": [key(h) for h in i.live()]}
                       for i in holders],
            newest_version=self.newest,
            fill=self.config.migrate_threshold,
        )
        n, ti, tm, gslot = self.n, self._ti, self._tm, self._gslot
        for gid, idx, src, dst in plan or ():
            s, d = instances.get(src), instances.get(dst)
            if s is None or d is None or s.version != v or d.version != v or d.loading is not None:
                raise ProtocolError(f"migration plan moves {gid!r}/{idx} between instances not holding version {v}")
            g = gslot.get(gid) if isinstance(gid, (int, str)) else None  # (a list is unhashable)
            ok = g is not None and isinstance(idx, numbers.Integral) and 0 <= idx < n
            h = g * n + int(idx) if ok else None
            if s is d or h is None or ti[h] != s.id or d.nrun >= d.capacity:
                # (a move onto its own instance left the occupancy levels wrong: a KeyError later)
                raise ProtocolError(f"migration plan for {gid!r}/{idx} from {src} to {dst} is not feasible")
            if tm[h]:
                continue  # its move may still be in flight: it moves again only after MigrationLanded
            self._move(v, h, s, d)
        for i in holders:
            if not i.nrun:
                self._plan_instance(i)

    def _gating_crowd(self) -> tuple[int, int] | None:
        """(version, most running on one of its instances) of the crowded gating version: the
        oldest version that the step being formed must take (`v + K <= step`) and whose running
        trajectories share an instance (at least two on one)."""
        best = None
        for v, lv in self._lv.items():
            if v == _ANY or v + self.K > self.step or not lv:
                continue
            most = max(lv)
            if most >= 2 and (best is None or v < best[0]):
                best = (v, most)
        return best

    def _maybe_spread(self, inst: _Instance) -> bool:
        """R5 the other way: spread the gating version's stragglers onto an idle instance.

        Only when the instance has nothing else to do (the staleness budget is spent and no work
        is queued). A decode iteration costs more with every running sequence and every context
        token on the instance, so stragglers the trainer waits for finish sooner when fewer share
        an instance. The idle instance loads the gating version if it holds another (R4 allows
        it: it runs nothing), and takes an even share of that version's running trajectories.

        A switch costs a weight load, so an instance loads the gating version only when, in the
        state of now, it would take at least one trajectory (`_spread_plan`), counting the other
        instances already loading it to spread as holders of their share: a load that moves
        nothing (the stragglers already sit evenly, or every one of the excess moved once and has
        not landed) would be followed by a load back to the newest version, a switch thrash.
        """
        chosen = self._spreading.pop(inst.id, None)
        if chosen is None:
            if self._budget_left() > 0 or self._outstanding or any(self._queued.values()):
                return False
        crowd = self._gating_crowd()
        if crowd is None:
            return False
        v = crowd[0]
        plan = self._spread_plan(v, inst)
        if not plan:
            return False
        if inst.version != v:
            self._spreading[inst.id] = v
            self._start_load(inst, v)  # it spreads when loaded (`_plan_instance` again)
            return True
        for src, h in plan:
            self._move(v, h, src, inst)
        self._idle.pop(inst.id, None)
        return True

    def _spread_plan(self, v: int, inst: _Instance) -> list:
        """The moves (holder, trajectory handle) that give idle `inst` its even share of
        version `v`'s running trajectories: from the most loaded holders, only what they run
        above the even share, never a trajectory that moved and has not landed.

        The even share counts `inst` and the instances already loading `v` to spread; those
        come first: each will take up to `room` of the same candidates, so `inst` gets the
        candidates after theirs (none when they take them all, and then it does not load)."""
        nh = self._nhold.get(v, 0)
        if nh == 0:
            return []
        pending = 0
        for iid, u in self._spreading.items():
            if u == v and iid != inst.id:
                pending += 1
        total = self._occupied.get(v, 0)
        keep = -(-total // (nh + pending + 1))  # each instance's even share
        lv = self._lv.get(v, {})
        if max(lv) <= keep:
            return []  # O(1): no holder runs more than its share
        room = min(inst.capacity, keep)
        want = (pending + 1) * room
        # The holders above the share, most loaded first, then by id: level by level (a loaded
        # instance's level is its running count), so that only the levels the plan reaches are
        # sorted, not every holder.
        plan = []
        tm = self._tm
        instances = self.instances
        for level in sorted([lvl for lvl in lv if lvl > keep], reverse=True):
            for iid in sorted(lv[level]):
                if iid == inst.id:
                    continue
                src = instances[iid]
                excess = src.nrun - keep
                tp = self._tp
                it = iter(src.log)
                for h, p in zip(it, it):  # (`src.live()`, lazily: the plan stops early)
                    if tp[h] != p:
                        continue  # a dead log entry
                    if len(plan) >= want or excess <= 0:
                        break
                    if tm[h]:
                        continue  # it moves again only after MigrationLanded (it may be in flight)
                    excess -= 1
                    plan.append((src, h))
                if len(plan) >= want:
                    return plan[pending * room:]
        return plan[pending * room:]

    def _move(self, v: int, h: int, s: _Instance, d: _Instance) -> None:
        """R5: running trajectory `h` moves from `s` to `d`, both loaded with `v` (`s` is not
        `d`). `s._drop()`, `_place(d, h)` and the two `_lv_set` calls are inlined, the same steps
        in the same order (R5 moves in bulk: at K=3 over 1k instances they were a fifth of the
        event path), including `_lv_set`'s holder count going down before it goes up again (when
        it touches 0, R5's records of the version are dropped)."""
        ns, nd = s.nrun, d.nrun
        sid, did = s.id, d.id
        self._ti[h] = did
        s.nrun = ns - 1  # (`s._drop()`)
        if ns == 1:
            del s.log[:]
        p = self._pseq  # (`_place(d, h)`)
        self._pseq = p + 1
        self._tp[h] = p
        if len(d.log) > 6 * nd + 64:  # (more than 3 * nrun + 32 entries)
            self._compact(d)
        log = d.log
        log.append(h)
        log.append(p)
        d.nrun = nd + 1
        lv, nhold, lo_of = self._lv[v], self._nhold, self._lo
        # (`_lv_set(v, sid, ns, ns - 1)`: `ns` >= 1)
        lvl = lv[ns]
        del lvl[sid]
        if not lvl:
            del lv[ns]
        c = nhold[v] - 1
        if c:
            nhold[v] = c
        else:
            del nhold[v]
            self._r5_tried.pop(v, None)
            self._r5_stuck.pop(v, None)
        lvl = lv.get(ns - 1)
        if lvl is None:
            lv[ns - 1] = lvl = _Level()
        lvl[sid] = s
        if ns - 1 < lo_of[v]:
            lo_of[v] = ns - 1
        if ns > 1:
            nhold[v] = nhold.get(v, 0) + 1
        # (`_lv_set(v, did, nd, nd + 1)`)
        lvl = lv[nd]
        del lvl[did]
        if not lvl:
            del lv[nd]
        if nd:
            c = nhold[v] - 1
            if c:
                nhold[v] = c
            else:
                del nhold[v]
                self._r5_tried.pop(v, None)
                self._r5_stuck.pop(v, None)
        lvl = lv.get(nd + 1)
        if lvl is None:
            lv[nd + 1] = lvl = _Level()
        lvl[did] = d
        if nd + 1 < lo_of[v]:
            lo_of[v] = nd + 1
        nhold[v] = nhold.get(v, 0) + 1
        self._tm[h] = 1
        if ns == 1:
            self._idle[sid] = None
        self.m["migrations"] += 1
        g, idx = divmod(h, self.n)  # (`_key`, inlined: R5 moves in bulk)
        self._out.append(A.Migrate(self._ggid[g], idx, sid, did, v))

    def _place(self, inst: _Instance, h: int) -> None:
        """Trajectory `h` (`_ti[h]` names `inst` already) starts running on `inst`: logged under a
        fresh stamp. A log of more than about three times its live entries is compacted first, so its
        length stays proportional to what runs there (amortised O(1))."""
        p = self._pseq
        self._pseq = p + 1
        self._tp[h] = p
        if len(inst.log) > 6 * inst.nrun + 64:  # (more than 3 * nrun + 32 entries)
            self._compact(inst)
        log = inst.log
        log.append(h)
        log.append(p)
        inst.nrun += 1

    def _compact(self, inst: _Instance) -> None:
        """Drop the dead entries of `inst`'s log (keeping the live ones in order)."""
        tp = self._tp
        log = array("q")
        for h in inst.live():
            log.append(h)
            log.append(tp[h])
        inst.log = log

    # ------------------------------------------------------------------ admission (R2)
    def _budget_left(self) -> int:
        left = self._adm.limit(self.newest) - self._admitted - self._outstanding
        if self.config.max_steps is not None:
            left = min(left, self.config.max_steps * self.B - self._admitted - self._outstanding)
        return left

    def _admit(self) -> None:
        if self._exhausted or self._halted is not None:
            return
        left = self._budget_left()
        if left <= 0:
            return
        if self._admission == "batch":
            want = left
        elif self._admission == "fleet":
            if self._outstanding or any(self._occupied.values()) or any(self._queued.values()):
                return
            # The whole fleet holds the newest version and nothing loads.
            if self._n_loading or not self.instances or self._targets.get(self.newest, 0) != len(self.instances):
                return
            want = min(self.B, left)
        else:
            b = self._bucket(self.newest)
            free = self._cap.get(b, 0) - self._occupied.get(b, 0) - self._queued.get(b, 0)
            free -= self._outstanding * self.n
            if free <= 0:
                return
            want = min(left, -(-free // self.n))
        if want > 0:
            self._outstanding += want
            self._out.append(A.RequestGroups(want, self.newest))

    # ------------------------------------------------------------------ batch selection (R3, R7)
    def _dec_unassigned(self, v: int) -> None:
        c = self._unassigned[v] - 1
        if c:
            self._unassigned[v] = c
        else:
            del self._unassigned[v]

    def _feasible(self, vg: int, r: int) -> bool:
        """EDF test: after taking a group of version `vg` with `r` slots left (before taking), can
        every unassigned group still be trained within its staleness deadline?"""
        k, K, B = self.step, self.K, self.B
        cum = 0
        for v in sorted(self._unassigned):
            c = self._unassigned[v] - (1 if v == vg else 0)
            if c <= 0:
                continue
            cum += c
            j = v + K - k
            if j < 0:
                j = 0
            if cum > (r - 1) + j * B:
                return False
        return True

    def _form(self) -> None:
        """Fill the step being formed from the completed groups (R3); start it when full, or
        short when nothing more can come. Runs only when one of its inputs changed."""
        if not self._form_dirty or self._trainer_busy is not None:
            return
        self._form_dirty = False
        if (not self._pool_n and not self._exhausted) or self.done:
            return
        k = self.step
        r = self.B - len(self._forming)
        pools = self._pools
        fifo = self._pool_fifo
        dora = self.mode == "dora"
        # The version just taken when its next group is known to pass `_feasible` without the
        # test: it passed for a version `vg` that was the oldest unassigned one; taking one of its
        # groups lowers both `cum` (at every version, all >= vg) and the bound `r - 1` by one, so
        # the test passes again for `vg` while it stays unassigned (then still the oldest) and
        # nothing else is taken (None: test).
        sure = None
        while r > 0 and self._pool_n:
            # Each version's pool is ordered by the batch key, and feasibility depends only on
            # the version: the candidates are the heads of the live versions' pools.
            best = None
            waited = False
            if fifo:
                # The smallest key among the versions that can be taken now.
                low = None  # the smallest head found untakeable
                for v, heap in pools.items():
                    if best is not None and heap[0] >= best[0]:
                        continue
                    if self._feasible(v, r):
                        best = (heap[0], v)
                    elif low is None or heap[0] < low:
                        low = heap[0]
                # A wait: in dora (a plugin's keys), when the smallest key of all cannot be taken
                # (it is checked whatever the pools' order: every head below the best is), as the
                # global-head path counts it; a head that cannot be taken behind a smaller one that
                # can is no wait. The other modes count any head found untakeable, as they did.
                waited = low is not None and (not dora or best is None or low < best[0])
            else:
                # dora with the built-in keys: the global head (oldest version first), or wait for it.
                if len(pools) == 1:
                    v = next(iter(pools))  # (the only pooled version: nothing to compare)
                else:
                    v = min(pools, key=lambda u: pools[u][0])
                if v == sure and v in self._unassigned:
                    best = (pools[v][0], v)
                elif self._feasible(v, r):
                    best = (pools[v][0], v)
                    sure = v if v == min(self._unassigned) else None
                else:
                    waited = True
            if waited:
                self.m["trainer_waits_for_older"] += 1
            if best is None:
                break
            v = best[1]
            if v != sure:
                sure = None
            heap = pools[v]
            _, _, gid = heapq.heappop(heap)
            if not heap:
                del pools[v]
            self._pool_n -= 1
            self._assign(self._gslot[gid], k)
            r -= 1
        r = self.B - len(self._forming)
        if r == 0 or (r > 0 and self._forming and self._nothing_more_coming()):
            self._start_step(k)

    def _nothing_more_coming(self) -> bool:
        return self._exhausted and not self._pool_n and self._n_active == 0

    def _assign(self, g: int, k: int) -> None:
        self._gst[g] = _ASSIGNED
        self._gstep[g] = k
        self._dec_unassigned(self._gver[g])
        gid = self._ggid[g]
        self._forming.append(gid)
        self._trainer_idle = False
        if self._cgp:
            self._out.append(A.DeliverGroup(gid, k))

    def _start_step(self, k: int) -> None:
        gids = tuple(self._forming)
        hist = self.m["staleness_hist"]
        m = self.m
        seen: set = set()
        pinned = self._pinned
        n, tt, tv = self.n, self._tt, self._tv
        trajs = tokens = multi = c1 = 0
        for gid in gids:
            g = self._gslot[gid]
            v = self._gver[g]
            s = k - v
            hist[s] = hist.get(s, 0) + 1
            if s > self.K or s < 0:
                m["c3_violations"] += 1
            # Trained twice: twice in this batch, or not in the state of a group assigned to it.
            if gid in seen or self._gst[g] != _ASSIGNED or self._gstep[g] != k:
                m["duplicated"] += 1
            seen.add(gid)
            base = g * n
            tokens += sum(tt[base:base + n])
            vs_g = tv[base:base + n]
            if vs_g.count(v) != n:  # (all generated by the group's version: nothing to count)
                for vs in vs_g:  # several only when a resume appended a different one
                    if vs == _MULTI:
                        multi += 1
                    elif pinned and vs != v:
                        c1 += 1
            trajs += n
        m["trajectories_trained"] += trajs
        m["tokens_trained"] += tokens
        m["multi_version_trajectories"] += multi
        m["c1_violations"] += c1
        m["groups_trained"] += len(gids)
        self._trainer_busy = k
        self._trainer_idle = False
        self._out.append(A.StartStep(k, gids))
        if self._elastic:
            # The trainer has work now: instances that drained while it waited may be lent.
            for iid in list(self._idle):
                inst = self.instances.get(iid)
                if inst is not None and not inst.nrun and inst.loading is None:
                    self._plan_instance(inst)

    # ------------------------------------------------------------------ snapshot / restore
    def snapshot(self) -> dict[str, Any]:
        """The whole live state as JSON-serialisable data; `restore` rebuilds an identical
        scheduler (same actions for the same events from then on).

        Small and bounded: it holds live groups and instances only (never the run's history),
        so its size does not grow with the number of steps. `format` is `SNAPSHOT_FORMAT`.
        Runtimes store it in their own checkpoints and resume from it.
        """
        groups = []
        n = self.n
        ts, ti, ta, tt, tv, tr, tn, tm = self._ts, self._ti, self._ta, self._tt, self._tv, self._tr, self._tn, self._tm
        gst, gstep, gcseq = self._gst, self._gstep, self._gcseq
        for gid, g in self._gslot.items():
            v = self._gver[g]
            b0 = g * n
            key = self._gkey.get(g)
            # Compact (delta-coded, so the size does not grow with the counters' digits): version,
            # seq, step and completion order relative to the scheduler's own counters, the
            # admission key only when it is not the default `(seq,)`, trajectory versions
            # relative to the group's version (almost always `[0]`).
            groups.append([
                gid, self.newest - v, self._seq - self._gseq[g], None if key is None else list(key), _json_data(self._gmeta.get(g), "meta"),
                _STATES[gst[g]], None if gstep[g] < 0 else self.step - gstep[g],
                None if gcseq[g] < 0 else self._complete_seq - gcseq[g],
                bool(self._ginq[g]), self._pending(g), self._gdone[g], self._glive[g],
                [[_LETTERS[ts[h]], None if ti[h] == _NOI else ti[h], ta[h], tt[h], _vlist(self._versions(h), v),
                  None if tr[h] != tr[h] else tr[h], tn[h],
                  bool(tm[h])] for h in range(b0, b0 + n)],
            ])
        insts = [[i.id, i.capacity, i.version, i.loading, [list(self._key(h)) for h in i.running]]
                 for i in self.instances.values()]
        live = self._gslot

        plain = (lambda k: k) if self._builtin_keys else _plain  # (a plugin's keys: as it gave them)

        def heap(h):
            return [[list(plain(e[0])), e[1], e[2]] for e in h if e[2] in live]

        return {
            "format": SNAPSHOT_FORMAT,
            "config": self.config.to_dict(),
            "scalars": {
                "newest": self.newest, "step": self.step, "trainer_busy": self._trainer_busy,
                "started": self._started, "exhausted": self._exhausted,
                "outstanding": self._outstanding, "admitted": self._admitted, "seq": self._seq,
                "complete_seq": self._complete_seq, "n_active": self._n_active,
                "halted": self._halted, "orphaned": self._orphaned, "form_dirty": self._form_dirty,
                "cap_max": self._cap_max, "uniform": self._uniform, "id_max": self._id_max,
                **self._adm.snapshot(),
            },
            "idle": list(self._idle),
            "levels": [[b, self._lo[b], [[n, list(d)] for n, d in lv.items()]] for b, lv in self._lv.items()],
            "forming": list(self._forming),
            "groups": groups,
            "instances": insts,
            "unassigned": [[v, c] for v, c in self._unassigned.items()],
            "queue": [[b, heap(h)] for b, h in self._queue.items()],
            "queued": [[b, c] for b, c in self._queued.items()],
            "pools": [[v, heap(h)] for v, h in self._pools.items()],
            "r5_tried": [[v, list(x)] for v, x in self._r5_tried.items()],
            "elastic": [[[i, c] for i, c in d.items()]
                        for d in (self._trainer_side, self._to_trainer, self._to_rollout, self._spreading)],
            "trainer_idle": self._trainer_idle,
            "metrics": {**self.m, "staleness_hist": [[k, v] for k, v in self.m["staleness_hist"].items()]},
        }

    @classmethod
    def restore(cls, snap: dict[str, Any], plugins: Any = None) -> "Scheduler":
        """Rebuild a scheduler from `snapshot()` output (possibly after a JSON round trip), of
        format `SNAPSHOT_FORMAT` or 2."""
        fmt = snap.get("format") if isinstance(snap, dict) else None
        if fmt not in _READS_FORMATS or type(fmt) is not int:
            raise ProtocolError(
                f"snapshot format {fmt!r} is not supported: this dora-ext reads formats "
                f"{', '.join(map(str, _READS_FORMATS))} "
                f"(a snapshot from another dora-ext version cannot be resumed)"
            )
        # (a snapshot from before `admission` existed ran `fill`)
        self = cls(DoraConfig.from_dict({"admission": "fill", **snap["config"]}), plugins=plugins)
        sc = snap["scalars"]
        self.newest, self.step, self._trainer_busy = sc["newest"], sc["step"], sc["trainer_busy"]
        self._started, self._exhausted = sc["started"], sc["exhausted"]
        self._outstanding, self._admitted = sc["outstanding"], sc["admitted"]
        self._seq, self._complete_seq, self._n_active = sc["seq"], sc["complete_seq"], sc["n_active"]
        self._halted, self._orphaned = sc["halted"], sc["orphaned"]
        self._form_dirty, self._uniform = sc["form_dirty"], sc["uniform"]
        self._adm.restore(sc)
        if fmt == 2:
            # Format 2 listed every failed id; every id it names (configured, live, failed) was
            # registered, so the largest of them is the mark format 3 keeps.
            ids = [s.id for s in self.config.instances] + [i[0] for i in snap["instances"]] + list(snap["dead"])
            self._id_max = max(ids)
        else:
            self._id_max = sc["id_max"]
        self._forming = list(snap["forming"])
        for (gid, dv, dseq, key, meta, state, dstep, dcseq, in_queue, pending, done, live, trajs) in snap["groups"]:
            version, seq = self.newest - dv, self._seq - dseq
            step = None if dstep is None else self.step - dstep
            cseq = None if dcseq is None else self._complete_seq - dcseq
            if len(trajs) != self.n:
                raise ProtocolError(f"snapshot group {gid!r} has {len(trajs)} trajectories, group_size is {self.n}")
            g = self._alloc()
            self._gslot[gid], self._ggid[g], self._gver[g], self._gseq[g] = g, gid, version, seq
            if key is not None and tuple(key) != (seq,):
                self._gkey[g] = tuple(key)
            if meta is not None:
                # (a copy in JSON form: the same meta whether `snap` went through JSON or not)
                self._gmeta[g] = _json_data(meta, f"snapshot group {gid!r} meta")
            self._gst[g], self._ginq[g] = _STATE_CODES[state], 1 if in_queue else 0
            self._gstep[g] = -1 if step is None else step
            self._gcseq[g] = -1 if cseq is None else cseq
            # Pending: re-queued ones first (the retry stack), then the fresh tail `next .. n - 1`.
            j, n_p = len(pending), len(pending)
            while j > 0 and pending[j - 1] == self.n - (n_p - j) - 1:
                j -= 1
            self._gnext[g] = self.n - (n_p - j)
            if j:
                self._gretry[g] = list(reversed(pending[:j]))
            self._gdone[g], self._glive[g] = done, live
            for h, (status, inst, attempt, tokens, versions, reward, retries, moved) in enumerate(trajs, g * self.n):
                self._ts[h], self._ti[h], self._ta[h], self._tt[h] = _CODES[status], _NOI if inst is None else inst, attempt, tokens
                self._tm[h] = 1 if moved else 0
                vs = [x + version for x in versions]
                self._tv[h] = _NOV if not vs else vs[0] if len(vs) == 1 else _MULTI
                if len(vs) > 1:
                    self._tvm[h] = vs
                self._tr[h] = _NAN if reward is None else reward
                self._tn[h] = retries
        for iid, cap, version, loading, running in snap["instances"]:
            inst = _Instance(iid, cap, self._tp)
            inst.version, inst.loading = version, loading
            for gid, idx in running:
                self._place(inst, self._gslot[gid] * self.n + idx)
            self.instances[iid] = inst
            target = inst.target
            if target is not None:
                b = self._bucket(target)
                self._cap[b] = self._cap.get(b, 0) + cap
                self._occupied[b] = self._occupied.get(b, 0) + inst.nrun
                self._targets[target] = self._targets.get(target, 0) + 1
            if loading is not None:
                self._n_loading += 1
        self._cap_max = sc["cap_max"]
        # Insertion orders matter (round robin, R5's choice among equals): restored as saved.
        self._idle = dict.fromkeys(snap["idle"])
        insts = self.instances
        self._lv = {b: {n: _Level((i, insts[i]) for i in d) for n, d in lv} for b, _, lv in snap["levels"]}
        self._lo = {b: lo for b, lo, _ in snap["levels"]}
        self._nhold = {b: sum(len(d) for n, d in lv.items() if n) for b, lv in self._lv.items()}
        self._nhold = {b: c for b, c in self._nhold.items() if c}
        self._unassigned = {v: c for v, c in snap["unassigned"]}
        keyed = tuple if self._builtin_keys else _ordered  # (as `_enqueue` and `_set_reward` push them)
        self._queue = {b: [(keyed(k), s, gid) for k, s, gid in h] for b, h in snap["queue"]}
        for h in self._queue.values():
            heapq.heapify(h)
        self._queued = {b: c for b, c in snap["queued"]}
        self._pools = {v: [(keyed(k), s, gid) for k, s, gid in h] for v, h in snap["pools"]}
        for h in self._pools.values():
            heapq.heapify(h)
        self._pool_n = sum(len(h) for h in self._pools.values())
        self._r5_tried = {v: tuple(x) for v, x in snap["r5_tried"]}
        if "elastic" in snap:
            self._trainer_side, self._to_trainer, self._to_rollout, self._spreading = (
                {i: c for i, c in d} for d in snap["elastic"])
        self._trainer_idle = snap.get("trainer_idle", False)
        m = dict(snap["metrics"])
        m["staleness_hist"] = {int(k): v for k, v in m["staleness_hist"]}
        self.m = m
        return self

    # ------------------------------------------------------------------ pump
    def _finish(self) -> list:
        if self._orphaned:
            self._orphaned = False
            self._plan_idle()
        self._admit()
        self._form()
        if self._adm.watch:
            self._adm.step_formed(self._trainer_busy is not None, len(self._forming), self._pool_n)
        if self._trainer_side:
            self._maybe_switch_to_rollout()
        out, self._out = self._out, []
        if self._halted is not None:
            raise self._storm(out)
        return out

    # ------------------------------------------------------------------ elastic colocation
    def _should_lend(self) -> bool:
        """Rollout -> trainer: the staleness budget is spent and no work waits for a slot, so the
        trainer is the bottleneck and an idle instance's accelerators serve it better."""
        if len(self.instances) <= self._min_rollout:
            return False
        if self._budget_left() > 0 or self._outstanding or any(self._queued.values()):
            return False
        # ... and the trainer has work (a step runs, or groups of the step being formed were
        # delivered and it has not reported running dry): a trainer stalled on stragglers would
        # gain nothing from more accelerators.
        return not self._trainer_idle and (self._trainer_busy is not None or bool(self._forming))

    def _switch_to_trainer(self, inst: _Instance) -> None:
        """Take the idle instance out of the rollout pool and lend its accelerators to the trainer."""
        if inst.version is not None:
            b = self._bucket(inst.version)
            self._cap[b] -= inst.capacity
            self._dec_target(inst.version)
            self._lv_set(b, inst.id, 0, None)
        self._idle.pop(inst.id, None)
        del self.instances[inst.id]
        self._to_trainer[inst.id] = inst.capacity
        self.m["switches_to_trainer"] += 1
        self._out.append(A.SwitchToTrainer(inst.id))

    def _maybe_switch_to_rollout(self) -> None:
        """Trainer -> rollout: the trainer waits for trajectories (no step runs and none can be
        formed) while the rollout has more work than slots: the long tail."""
        if not self._trainer_idle or self._trainer_busy is not None or self.done:
            return
        b = self._bucket(self.newest)
        demand = self._queued.get(b, 0) + (self._outstanding + max(0, self._budget_left())) * self.n
        need = demand - (self._cap.get(b, 0) - self._occupied.get(b, 0)) - sum(self._to_rollout.values())
        if need <= 0 and self._spread and not self._to_rollout:
            crowd = self._gating_crowd()
            if crowd is not None and self._spread_plan(crowd[0], _Instance(-1, self.config.instances[0].capacity, self._tp)):
                need = 1  # the stragglers the trainer waits for share instances: spread them (R5)
        while need > 0 and self._trainer_side:
            iid = min(self._trainer_side)
            cap = self._trainer_side.pop(iid)
            self._to_rollout[iid] = cap
            need -= cap
            self.m["switches_to_rollout"] += 1
            self._out.append(A.SwitchToRollout(iid, cap))
