"""One validated configuration object for every runtime (simulator, embedded runtime, hosts).

`DoraConfig` is built from a dict (`from_dict`), a YAML file (`from_yaml`), CLI-style overrides
(`with_overrides(["max_staleness=2"])`) or directly (`DoraConfig(mode="dora")`, `dataclasses.replace`);
the constructor checks every field: an invalid value raises `ConfigError` naming the field and what
is accepted, so a typo fails before any GPU time is spent; integer fields take an `int` only."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

MODES = ("sync", "one_step_off", "partial", "pipeline", "dora")

#: Modes that take `elastic` colocation: pinned versions with a streamed trainer, where single
#: instances drain and can change role one at a time.
ELASTIC_MODES = ("pipeline", "dora")

#: The staleness bound each mode takes when `max_staleness` is not given.
DEFAULT_STALENESS = {"sync": 0, "one_step_off": 1, "partial": 2, "pipeline": 0, "dora": 2}

#: `admission` policies (`dora_ext.core.admission`), the modes they apply in (the others admit a
#: batch at a time), and each mode's default there.
ADMISSIONS = ("fill", "ahead", "adaptive")
ADMISSION_MODES = ("partial", "dora")
DEFAULT_ADMISSION = {"partial": "fill", "dora": "adaptive"}


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field and the accepted values."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        self.detail = message  # the message without the field name
        super().__init__(f"{field_name}: {message}")


@dataclass(frozen=True)
class InstanceSpec:
    """One rollout instance (engine replica): an id and the number of sequences it runs at once."""

    id: int
    capacity: int


@dataclass(frozen=True)
class DoraConfig:
    """Scheduling settings shared by the core and every runtime.

    Fields:
      mode: one of `MODES`.
      max_staleness: K, the staleness bound (0 = on-policy). `sync` and `pipeline` need K=0,
        `one_step_off` needs K=1, `dora` needs K>=1, `partial` takes any K>=0.
      batch_size: B, groups per trainer step (>=1).
      group_size: n, trajectories per group (>=1; n=1 is SAO single-rollout).
      instances: a tuple of `InstanceSpec(id, capacity)` (ids unique integers in [0, 2**63),
        capacities >= 1; a list is turned into a tuple). `from_dict` also takes a number of
        instances, or a list of `{"capacity": c}` mappings (each may give its `"id"`; default its
        position in the list).
      capacity (`from_dict` only): sequences an instance runs at once when `instances` is a number.
      max_retries: how often a failed trajectory is re-dispatched before its group is reported failed.
      max_steps: optional cap on trainer steps; admission stops at `max_steps * batch_size` groups.
      migrate: R5 same-version migration in mode `dora`.
      migrate_threshold: R5 fires when an old version's running trajectories fill at most this
        share of the slots of the instances holding it, and fit on fewer of them.
      spread: in mode `dora` with `migrate`, an idle instance with nothing else to do takes an even
        share of the running trajectories of the version the trainer waits for (R5 the other
        way: stragglers decode faster when fewer share an instance).
      elastic: elastic colocation (modes `dora`, `pipeline`): idle rollout instances are lent to
        the trainer while the staleness budget is spent, and trainer accelerators serve as rollout
        instances while the trainer waits (`SwitchToTrainer` / `SwitchToRollout`).
      elastic_spare: with `elastic`, how many more instances the trainer's accelerators can form
        (starting on the trainer side, ids after the configured ones, the first one's capacity).
      elastic_max_lent: with `elastic`, the largest share of the configured instances lent at once.
      admission: how far admission runs ahead of the trainer within R2 (modes `dora`, `partial`
        only; the others admit a batch at a time): `fill` (every free slot), `ahead` (one batch beyond
        the step being formed) or `adaptive` (a look-ahead in [B, K * B] that grows when the
        trainer starts a step short); None: the mode's default (`DEFAULT_ADMISSION`).
      max_failed_group_share: the circuit breaker: once at least `max(batch_size, 4)` groups failed
        and they exceed this share of the groups that ended, the scheduler raises `FailureStorm`.
        In [0, 1]; 1 disables it.
    """

    mode: str = "dora"
    max_staleness: int = 2
    batch_size: int = 8
    group_size: int = 4
    instances: tuple[InstanceSpec, ...] = field(
        default_factory=lambda: tuple(InstanceSpec(i, 8) for i in range(4))
    )
    max_retries: int = 2
    max_steps: int | None = None
    migrate: bool = True
    migrate_threshold: float = 0.5
    spread: bool = True
    elastic: bool = False
    elastic_spare: int = 0
    elastic_max_lent: float = 0.5
    max_failed_group_share: float = 0.5
    admission: str | None = None

    def __post_init__(self) -> None:
        _check(self)  # every construction path (direct, `replace`, `from_dict`) runs the checks

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "") -> "DoraConfig":
        """Validate `data`, what a recipe's `dora:` holds (`instances`, `capacity`: see the class),
        and build a config; `max_staleness` defaults to the mode's (`DEFAULT_STALENESS`). Unknown
        keys are errors; `where` prefixes field names; the constructor checks the fields."""
        if not isinstance(data, Mapping):
            raise ConfigError(where or "config", f"expected a mapping, got {type(data).__name__}")
        pre = f"{where}." if where else ""
        known = {f.name for f in dataclasses.fields(cls)} | {"capacity"}
        for key in data:
            if key not in known:
                raise ConfigError(
                    f"{pre}{key}", f"unknown key; accepted keys are {', '.join(sorted(known))}"
                )
        mode = data.get("mode", "dora")
        mode = _check_mode(mode, f"{pre}mode")
        cap = _int(data, "capacity", 8, pre, minimum=1)
        raw = data.get("instances", 4)
        if isinstance(raw, bool):
            raise ConfigError(f"{pre}instances", "expected an integer >= 1 or a list of {capacity: int}")
        if isinstance(raw, int):
            if raw < 1:
                raise ConfigError(f"{pre}instances", f"expected an integer >= 1, got {raw}")
            instances: Any = tuple(InstanceSpec(i, cap) for i in range(raw))
        elif isinstance(raw, Sequence) and not isinstance(raw, str):
            specs = []
            for i, item in enumerate(raw):
                if isinstance(item, InstanceSpec):  # checked like a mapping, by the constructor
                    item = {"id": item.id, "capacity": item.capacity}
                if not isinstance(item, Mapping) or set(item) - {"capacity", "id"}:
                    raise ConfigError(
                        f"{pre}instances[{i}]", f"expected a mapping with key 'capacity', got {item!r}"
                    )
                specs.append(InstanceSpec(item.get("id", i), item.get("capacity", cap)))
            instances = tuple(specs)
        else:
            raise ConfigError(
                f"{pre}instances", f"expected an integer >= 1 or a list of {{capacity: int}}, got {raw!r}"
            )
        values = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        values.update(mode=mode, instances=instances,
                      max_staleness=data.get("max_staleness", DEFAULT_STALENESS[mode]))
        try:
            return cls(**values)
        except ConfigError as exc:
            if not pre:
                raise
            raise ConfigError(f"{pre}{exc.field}", exc.detail) from None

    @classmethod
    def from_yaml(cls, path: str, *, key: str | None = None) -> "DoraConfig":
        """Load a YAML file (optionally the mapping under `key`) and validate it."""
        import yaml

        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
        if key is not None:
            if not isinstance(data, Mapping) or key not in data:
                raise ConfigError(key, f"missing section {key!r} in {path}")
            data = data[key]
        return cls.from_dict(data, where=key or "")

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON-serialisable dict that `from_dict` accepts."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["instances"] = [{"id": s.id, "capacity": s.capacity} for s in self.instances]
        return data

    def with_overrides(self, overrides: Sequence[str] | Mapping[str, Any]) -> "DoraConfig":
        """Apply `key=value` strings (values parsed as YAML scalars) or a mapping, and re-validate."""
        import yaml

        data = self.to_dict()
        if isinstance(overrides, Mapping):
            items = list(overrides.items())
        else:
            items = []
            for item in overrides:
                if "=" not in item:
                    raise ConfigError(str(item), "an override must look like key=value")
                key, value = item.split("=", 1)
                items.append((key.strip(), yaml.safe_load(value)))
        for key, value in items:
            if key == "mode" and "max_staleness" not in dict(items):
                data.pop("max_staleness", None)
            if key == "mode" and value not in ADMISSION_MODES and "admission" not in dict(items):
                data.pop("admission", None)  # (a mode that takes no admission policy)
            if key == "capacity":
                data["instances"] = [{"id": s["id"], "capacity": value} for s in data["instances"]]
                continue
            data[key] = value
        if isinstance(data.get("instances"), int):
            data.setdefault("capacity", self.instances[0].capacity)
        return DoraConfig.from_dict(data)

    # ------------------------------------------------------------------ derived
    @property
    def admission_policy(self) -> str:
        """`admission`, or the mode's default; `fill` (R2 alone) where a batch is admitted at a time."""
        return self.admission or DEFAULT_ADMISSION.get(self.mode, "fill")

    @property
    def total_capacity(self) -> int:
        return sum(s.capacity for s in self.instances)


def _int(data: Mapping[str, Any], key: str, default: Any, pre: str, *, minimum: int,
         maximum: int | None = None) -> Any:
    """The integer `data[key]` (or `default`), checked by `_integer`."""
    return _integer(data.get(key, default), f"{pre}{key}", minimum=minimum, maximum=maximum)


def _integer(value: Any, name: str, *, minimum: int, maximum: int | None = None) -> int:
    """`value` as a plain `int` if it is one (an IntEnum too) in range; anything else (None, 2.0,
    True, "3") is refused, never converted: 1.5 must not become 1."""
    if maximum is None:
        accepted = f"an integer >= {minimum}"
    elif maximum == 2**63 - 1:
        accepted = f"an integer in [{minimum}, 2**63)"
    else:
        accepted = f"an integer in [{minimum}, {maximum}]"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"expected {accepted}, got {value!r} ({type(value).__name__})")
    value = int.__int__(value)  # (the value itself: `int()` or a comparison may be overridden)
    if value < minimum or (maximum is not None and value > maximum):
        raise ConfigError(name, f"expected {accepted}, got {value}")
    return value


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(name, f"expected true or false, got {value!r}")
    return value


def _share(value: Any, name: str, *, low_open: bool, high_open: bool) -> float:
    """A number (int or float, not a bool) in the interval, as a float (a subclass checked as
    the plain number it holds)."""
    interval = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
    ok = False
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        v = int.__int__(value) if isinstance(value, int) else float.__float__(value)
        ok = (0 < v if low_open else 0 <= v) and (v < 1 if high_open else v <= 1)
    if not ok:
        raise ConfigError(name, f"expected a number in {interval}, got {value!r}")
    return float(v)


def _check_mode(mode: Any, name: str) -> str:
    """`mode` as a plain str (a `(str, Enum)` member as its value), if it is one of `MODES`."""
    if not isinstance(mode, str) or str.__str__(mode) not in MODES:
        raise ConfigError(name, f"unknown mode {mode!r}; accepted: {', '.join(MODES)}")
    return str.__str__(mode)


def _check(cfg: DoraConfig) -> None:
    """Check every field in order (the first bad one raises `ConfigError`) and normalise in place:
    `instances` a tuple, the shares floats, a str or int subclass (an Enum member) the plain value
    it holds, so that a config reads, prints and compares as one built from a recipe file."""
    put = object.__setattr__  # (the dataclass is frozen)
    mode = _check_mode(cfg.mode, "mode")
    put(cfg, "mode", mode)
    k = _integer(cfg.max_staleness, "max_staleness", minimum=0)
    put(cfg, "max_staleness", k)
    fixed = {"sync": 0, "pipeline": 0, "one_step_off": 1}
    if mode in fixed and k != fixed[mode]:
        raise ConfigError("max_staleness", f"mode {mode!r} requires max_staleness={fixed[mode]}, got {k}")
    if mode == "dora" and k < 1:
        raise ConfigError("max_staleness", "mode 'dora' requires max_staleness >= 1 (use 'pipeline' for K=0)")
    put(cfg, "batch_size", _integer(cfg.batch_size, "batch_size", minimum=1))
    put(cfg, "group_size", _integer(cfg.group_size, "group_size", minimum=1))
    specs = cfg.instances
    if isinstance(specs, (str, bytes)) or not isinstance(specs, (tuple, list)):
        raise ConfigError(
            "instances", f"expected a tuple of InstanceSpec(id, capacity), got {specs!r} "
            f"(DoraConfig.from_dict takes a count of instances and their capacity)"
        )
    if not specs:
        raise ConfigError("instances", "expected at least one instance")
    checked = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, InstanceSpec):
            raise ConfigError(f"instances[{i}]", f"expected an InstanceSpec(id, capacity), got {spec!r}")
        cap = _integer(spec.capacity, f"instances[{i}].capacity", minimum=1)
        # An id is a non-negative 64-bit integer (the scheduler keeps ids in 64-bit arrays, the
        # runtime names workers `instance-<id>`); 1.5 or "3" is refused, not truncated.
        iid = _integer(spec.id, f"instances[{i}].id", minimum=0, maximum=2**63 - 1)
        same = type(spec) is InstanceSpec and type(spec.id) is int and type(spec.capacity) is int
        checked.append(spec if same else InstanceSpec(iid, cap))
    if len({s.id for s in checked}) != len(checked):
        raise ConfigError("instances", "instance ids must be unique")
    put(cfg, "instances", tuple(checked))
    put(cfg, "max_retries", _integer(cfg.max_retries, "max_retries", minimum=0))
    if cfg.max_steps is not None:
        put(cfg, "max_steps", _integer(cfg.max_steps, "max_steps", minimum=1))
    _flag(cfg.migrate, "migrate")
    put(cfg, "migrate_threshold", _share(cfg.migrate_threshold, "migrate_threshold", low_open=True, high_open=False))
    _flag(cfg.spread, "spread")
    if _flag(cfg.elastic, "elastic") and mode not in ELASTIC_MODES:
        raise ConfigError(
            "elastic", f"mode {mode!r} does not take elastic colocation; accepted modes: {', '.join(ELASTIC_MODES)}"
        )
    spare = _integer(cfg.elastic_spare, "elastic_spare", minimum=0)
    put(cfg, "elastic_spare", spare)
    if spare and not cfg.elastic:
        raise ConfigError("elastic_spare", f"needs elastic: true, got elastic_spare={spare}")
    put(cfg, "elastic_max_lent", _share(cfg.elastic_max_lent, "elastic_max_lent", low_open=False, high_open=True))
    put(cfg, "max_failed_group_share",
        _share(cfg.max_failed_group_share, "max_failed_group_share", low_open=False, high_open=False))
    adm = cfg.admission
    if adm is not None:
        if not isinstance(adm, str) or str.__str__(adm) not in ADMISSIONS:
            raise ConfigError("admission", f"unknown policy {adm!r}; accepted: {', '.join(ADMISSIONS)} "
                              f"(or leave it unset for the mode's default)")
        if mode not in ADMISSION_MODES:
            raise ConfigError("admission", f"mode {mode!r} admits a batch at a time and takes no admission policy; "
                              f"accepted modes: {', '.join(ADMISSION_MODES)} (leave it unset for the others)")
        put(cfg, "admission", str.__str__(adm))
