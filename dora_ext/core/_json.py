"""Meta and plugin keys as their JSON round trip gives them back (the snapshot is JSON data)."""

from __future__ import annotations

import itertools
from typing import Any

from .errors import ProtocolError, _brief


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

