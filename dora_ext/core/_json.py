"""Meta and plugin keys are kept only as their JSON round trip gives them back (the snapshot is JSON)."""

from __future__ import annotations

import json
from typing import Any

from .errors import ProtocolError, _brief


def _json_data(x: Any, where: str) -> Any:
    """A copy of `x` if `json.loads(json.dumps(x, allow_nan=False)) == x`, else a `ProtocolError`
    naming `where`: a run resumed from a JSON snapshot must see the same value."""
    try:
        y = json.loads(json.dumps(x, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"{where} {_brief(x)} is not JSON data ({exc})") from None
    if y != x:
        raise ProtocolError(f"{where} {_brief(x)} comes back from a JSON round trip as {_brief(y)} "
                            f"(the snapshot is JSON data: use lists, str keys)")
    return y


def _json_key(key: Any, hook: str) -> tuple:
    """A plugin's admission or batch key (a tuple or list) as a tuple, if JSON gives it back."""
    if not isinstance(key, (tuple, list)):
        raise ProtocolError(f"{hook} returned {_brief(key)} ({type(key).__name__}): expected a tuple")
    return tuple(_json_data(list(key), f"{hook} returned"))
