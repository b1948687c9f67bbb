"""`record`: the frozen, slotted dataclass that every event and action is, built faster.

`@dataclass(frozen=True, slots=True)` generates an `__init__` that assigns each field through
`object.__setattr__` (frozenness forbids `self.x = ...`), and the scheduler builds one
`Dispatch` per trajectory it starts. `record`
keeps the dataclass exactly as it is (`==`, `hash`, `repr`, `dataclasses.replace`/`asdict`,
pickling, `FrozenInstanceError` on assignment, the same signature and defaults) and only
replaces `__init__` by one that stores each field through its slot's descriptor directly
(cheaper than `object.__setattr__`). Stdlib only, sans-I/O.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import dataclass_transform

_MISSING = dataclasses.MISSING


@dataclass_transform(frozen_default=True)
def record(cls: type) -> type:
    """`@dataclass(frozen=True, slots=True)` with a faster `__init__` (same behaviour)."""
    cls = dataclasses.dataclass(frozen=True, slots=True)(cls)
    if hasattr(cls, "__post_init__"):
        return cls
    fields = dataclasses.fields(cls)
    setters, defaults = {}, {}
    params, body = [], []
    for i, f in enumerate(fields):
        # Keep the generated __init__ for anything this fast path does not reproduce: init=False,
        # default_factory, keyword-only fields (the `*` in the signature), names that would collide
        # with the generated parameters, and an inherited field whose storage is not a slot.
        desc = next((k.__dict__[f.name] for k in cls.__mro__ if f.name in k.__dict__), None)
        if (not f.init or f.default_factory is not _MISSING or f.kw_only or f.name == "self"
                or f.name.startswith("_dora_") or not isinstance(desc, types.MemberDescriptorType)):
            return cls
        setters[f"_dora_set{i}"] = desc.__set__
        if f.default is _MISSING:
            params.append(f.name)
        else:
            defaults[f"_dora_dflt{i}"] = f.default
            params.append(f"{f.name}=_dora_dflt{i}")
        body.append(f"        _dora_set{i}(self, {f.name})")
    # A factory closes over the setters and defaults, so `__init__`'s globals are the class's
    # module (as with the generated one): `typing.get_type_hints(cls.__init__)` resolves names.
    outer = ", ".join([*setters, *defaults])
    src = (f"def _dora_make({outer}):\n"
           f"    def __init__(self, {', '.join(params)}):\n" + ("\n".join(body) or "        pass")
           + "\n    return __init__\n")
    module = sys.modules.get(cls.__module__)
    ns: dict = {}
    exec(src, module.__dict__ if module is not None else {}, ns)  # noqa: S102 -- from the field names, as dataclasses does
    init = ns["_dora_make"](**setters, **defaults)
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__annotations__ = dict(cls.__init__.__annotations__)
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init
    return cls
