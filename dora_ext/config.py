"""One validated configuration object for every runtime (simulator, embedded runtime, hosts).

`DoraConfig` is built from a dict (`from_dict`), a YAML file (`from_yaml`) or CLI-style overrides
(`with_overrides(["max_staleness=2"])`). Every invalid value raises `ConfigError`, whose message
names the field and says what is accepted, so that a typo in a recipe fails before any GPU time is
spent. Integer fields take an `int` and nothing else: a float (even 2.0), a bool or a numeric
string is refused, never converted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

MODES = ("sync", "one_step_off", "partial", "pipeline", "dora")

#: Modes that take `elastic` colocation: pinned versions with a streamed trainer, where single
#: instances drain and can change role one at a time. (`sync` time-shares every accelerator when
#: colocated; `one_step_off` admits a batch for the whole fleet at once; `partial` preempts
#: instead of draining. The option is not implemented for them.)
ELASTIC_MODES = ("pipeline", "dora")

#: The staleness bound each mode takes when `max_staleness` is not given.
DEFAULT_STALENESS = {"sync": 0, "one_step_off": 1, "partial": 2, "pipeline": 0, "dora": 2}


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field and the accepted values."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
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
      instances: number of rollout instances, or a list of `{"capacity": c}` mappings (each may
        give its `"id"`, an integer in [0, 2**63); default its position in the list).
      capacity: sequences an instance runs at once when `instances` is a number.
      max_retries: how often a failed trajectory is re-dispatched before its group is reported
        failed.
      max_steps: optional cap on trainer steps; admission stops at `max_steps * batch_size`
        groups so that every admitted group is trained.
      migrate: R5 same-version migration in mode `dora`.
      migrate_threshold: R5 fires when an old version's running trajectories fill at most this
        share of the slots of the instances holding it, and fit on fewer of them.
      spread: in mode `dora` with `migrate`, an idle instance with nothing else to do takes an even
        share of the running trajectories of the version the trainer waits for (R5 the other
        way: stragglers decode faster when fewer share an instance).
      elastic: elastic colocation (modes `dora` and `pipeline`): idle rollout instances are lent
        to the trainer while the staleness budget is spent (the trainer is the bottleneck), and
        trainer accelerators serve as rollout instances while the trainer waits for a long tail
        (actions `SwitchToTrainer` / `SwitchToRollout`).
      elastic_spare: with `elastic`, how many more instances the trainer's accelerators can form
        (they start on the trainer side, with ids after the configured instances and the
        capacity of the first instance).
      elastic_max_lent: with `elastic`, the largest share of the configured instances lent to the
        trainer at once.
      max_failed_group_share: the circuit breaker. Once at least `max(batch_size, 4)` groups have
        failed and failed groups exceed this share of all groups that ended (completed or failed),
        the scheduler stops with `FailureStorm` instead of replacing failed groups forever.
        In [0, 1]; 1 disables the breaker.
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

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "") -> "DoraConfig":
        """Validate `data` and build a config. Unknown keys are errors. `where` prefixes field names."""
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
        if mode not in MODES:
            raise ConfigError(f"{pre}mode", f"unknown mode {mode!r}; accepted: {', '.join(MODES)}")
        k = _int(data, "max_staleness", DEFAULT_STALENESS[mode], pre, minimum=0)
        fixed = {"sync": 0, "pipeline": 0, "one_step_off": 1}
        if mode in fixed and k != fixed[mode]:
            raise ConfigError(
                f"{pre}max_staleness",
                f"mode {mode!r} requires max_staleness={fixed[mode]}, got {k}",
            )
        if mode == "dora" and k < 1:
            raise ConfigError(
                f"{pre}max_staleness", "mode 'dora' requires max_staleness >= 1 (use 'pipeline' for K=0)"
            )
        b = _int(data, "batch_size", 8, pre, minimum=1)
        n = _int(data, "group_size", 4, pre, minimum=1)
        cap = _int(data, "capacity", 8, pre, minimum=1)
        raw = data.get("instances", 4)
        if isinstance(raw, bool):
            raise ConfigError(f"{pre}instances", "expected an integer >= 1 or a list of {capacity: int}")
        if isinstance(raw, int):
            if raw < 1:
                raise ConfigError(f"{pre}instances", f"expected an integer >= 1, got {raw}")
            instances = tuple(InstanceSpec(i, cap) for i in range(raw))
        elif isinstance(raw, Sequence) and not isinstance(raw, str):
            if not raw:
                raise ConfigError(f"{pre}instances", "expected at least one instance")
            specs = []
            for i, item in enumerate(raw):
                if isinstance(item, InstanceSpec):  # checked like a mapping: the dataclass checks nothing
                    item = {"id": item.id, "capacity": item.capacity}
                if not isinstance(item, Mapping) or set(item) - {"capacity", "id"}:
                    raise ConfigError(
                        f"{pre}instances[{i}]", f"expected a mapping with key 'capacity', got {item!r}"
                    )
                c = _int(item, "capacity", cap, f"{pre}instances[{i}].", minimum=1)
                # An id is a non-negative 64-bit integer (the scheduler keeps ids in 64-bit arrays,
                # the runtime names workers `instance-<id>`); 1.5 or "3" is refused, not truncated.
                iid = _int(item, "id", i, f"{pre}instances[{i}].", minimum=0, maximum=2**63 - 1)
                specs.append(InstanceSpec(iid, c))
            if len({s.id for s in specs}) != len(specs):
                raise ConfigError(f"{pre}instances", "instance ids must be unique")
            instances = tuple(specs)
        else:
            raise ConfigError(
                f"{pre}instances", f"expected an integer >= 1 or a list of {{capacity: int}}, got {raw!r}"
            )
        retries = _int(data, "max_retries", 2, pre, minimum=0)
        steps = data.get("max_steps")
        if steps is not None:
            steps = _int(data, "max_steps", None, pre, minimum=1)
        migrate = data.get("migrate", True)
        if not isinstance(migrate, bool):
            raise ConfigError(f"{pre}migrate", f"expected true or false, got {migrate!r}")
        thr = data.get("migrate_threshold", 0.5)
        if isinstance(thr, bool) or not isinstance(thr, (int, float)) or not 0.0 < thr <= 1.0:
            raise ConfigError(f"{pre}migrate_threshold", f"expected a number in (0, 1], got {thr!r}")
        spread = data.get("spread", True)
        if not isinstance(spread, bool):
            raise ConfigError(f"{pre}spread", f"expected true or false, got {spread!r}")
        elastic = data.get("elastic", False)
        if not isinstance(elastic, bool):
            raise ConfigError(f"{pre}elastic", f"expected true or false, got {elastic!r}")
        if elastic and mode not in ELASTIC_MODES:
            raise ConfigError(
                f"{pre}elastic", f"mode {mode!r} does not take elastic colocation; accepted modes: {', '.join(ELASTIC_MODES)}"
            )
        spare = _int(data, "elastic_spare", 0, pre, minimum=0)
        if spare and not elastic:
            raise ConfigError(f"{pre}elastic_spare", f"needs elastic: true, got elastic_spare={spare}")
        lent = data.get("elastic_max_lent", 0.5)
        if isinstance(lent, bool) or not isinstance(lent, (int, float)) or not 0.0 <= lent < 1.0:
            raise ConfigError(f"{pre}elastic_max_lent", f"expected a number in [0, 1), got {lent!r}")
        share = data.get("max_failed_group_share", 0.5)
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
            raise ConfigError(f"{pre}max_failed_group_share", f"expected a number in [0, 1], got {share!r}")
        return cls(
            mode=mode,
            max_staleness=k,
            batch_size=b,
            group_size=n,
            instances=instances,
            max_retries=retries,
            max_steps=steps,
            migrate=migrate,
            migrate_threshold=float(thr),
            spread=spread,
            elastic=elastic,
            elastic_spare=spare,
            elastic_max_lent=float(lent),
            max_failed_group_share=float(share),
        )

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
        return {
            "mode": self.mode,
            "max_staleness": self.max_staleness,
            "batch_size": self.batch_size,
            "group_size": self.group_size,
            "instances": [{"id": s.id, "capacity": s.capacity} for s in self.instances],
            "max_retries": self.max_retries,
            "max_steps": self.max_steps,
            "migrate": self.migrate,
            "migrate_threshold": self.migrate_threshold,
            "spread": self.spread,
            "elastic": self.elastic,
            "elastic_spare": self.elastic_spare,
            "elastic_max_lent": self.elastic_max_lent,
            "max_failed_group_share": self.max_failed_group_share,
        }

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
            if key in ("mode",) and "max_staleness" not in dict(items):
                data.pop("max_staleness", None)
            if key == "capacity":
                data["instances"] = [{"id": s["id"], "capacity": value} for s in data["instances"]]
                continue
            data[key] = value
        if isinstance(data.get("instances"), int):
            data.setdefault("capacity", self.instances[0].capacity)
        return DoraConfig.from_dict(data)

    # ------------------------------------------------------------------ derived
    @property
    def total_capacity(self) -> int:
        return sum(s.capacity for s in self.instances)


def _int(data: Mapping[str, Any], key: str, default: Any, pre: str, *, minimum: int,
         maximum: int | None = None) -> Any:
    """The integer `data[key]` (or `default`): an `int` and nothing else. A float (even 2.0), a
    bool, a numeric string or None is refused, never converted: 1.5 must not become 1."""
    value = data.get(key, default)
    if maximum is None:
        accepted = f"an integer >= {minimum}"
    elif maximum == 2**63 - 1:
        accepted = f"an integer in [{minimum}, 2**63)"
    else:
        accepted = f"an integer in [{minimum}, {maximum}]"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{pre}{key}", f"expected {accepted}, got {value!r} ({type(value).__name__})")
    if value < minimum or (maximum is not None and value > maximum):
        raise ConfigError(f"{pre}{key}", f"expected {accepted}, got {value}")
    return value
