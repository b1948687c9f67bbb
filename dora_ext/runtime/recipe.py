"""Recipes: one YAML file says what the embedded runtime trains, on which task, in which mode.

    name: long-tail            # used for output folders
    seed: 0                    # prompt stream, warm start, sampling (overridden by --seed)
    steps: 40                  # trainer steps (overridden by --steps)
    task:      {name: long_tail, median: 6, cap: 32, ...}   # LongTailConfig / CountConfig fields
    model:     {type: tiny, d_model: 64, n_layer: 2, n_head: 4}  # or {type: smollm2, max_len: 256}
    warm_start: {steps: 100, batch_size: 16, lr: 0.003}     # supervised start (tiny models only)
    trainer:   {algorithm: grpo, lr: 0.0005, ...}           # TrainerConfig fields
    engine:    {temperature: 1.0, top_p: 1.0, device: cpu, step_s: 0}  # step_s > 0: GPU-shaped decode
    runtime:   {cores: 2, trainer_cores: 1, pin: true, trainer_borrow: false}  # the core split, see below
    eval:      {prompts: 64, samples: 2}
    dora:      {mode: dora, max_staleness: 2, batch_size: 4, group_size: 4, instances: 2, capacity: 8}

Every section is validated before a model is built; errors are `ConfigError`s naming the field
(`trainer.lr: expected a number in (0.0, inf), got -1`). `dora:` is `DoraConfig.from_dict`.

Cores (`runtime:`), equal hardware as in design.md: `sync` is colocated (instances and trainer
each get all `cores`, in turn); the other modes give `cores - trainer_cores` to the instances and
`trainer_cores` to the trainer at once. `trainer_borrow: true` adds a low-priority trainer rank
on the rollout cores. `pin: true` pins each worker to its cores; `pin: false` (the CPU recipes)
lets the OS place them, so an idle trainer's core is not wasted.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..config import ADMISSION_MODES, MODES, ConfigError, DoraConfig

TASKS = ("long_tail", "count")
MODEL_TYPES = ("tiny", "smollm2")
BACKENDS = ("auto", "process", "thread")
TOP_LEVEL = ("name", "seed", "steps", "task", "model", "warm_start", "trainer", "engine", "runtime", "eval", "dora")
_TINY_KEYS = ("d_model", "n_layer", "n_head", "arch", "n_kv_head", "d_ff", "rope_theta", "norm_eps", "tie_embeddings")


@dataclass(frozen=True)
class ModelSpec:
    """`type: tiny` builds a random-initialised `TinyLM` sized for the task (vocab, max_len) with
    the shape fields in `shape`; `type: smollm2` loads the real SmolLM2-135M-Instruct offline."""

    type: str = "tiny"
    shape: Mapping[str, Any] = field(default_factory=dict)
    max_len: int = 512


@dataclass(frozen=True)
class WarmStartSpec:
    """Supervised steps on correct answers before RL (RL post-training starts from a tuned model)."""

    steps: int = 0
    batch_size: int = 16
    lr: float = 3e-3


@dataclass(frozen=True)
class EngineSpec:
    """Sampling of the rollout engines; `device` None = CUDA when present, else CPU. `step_s`: the
    decode shape. 0 (shape `cpu`): a decode iteration costs what the CPU takes. > 0 (shape
    `gpu-shaped`): an iteration lasts at least `step_s` seconds, the rest spent idle, as a
    memory-bound GPU decode step costs about the same for 1 or 64 sequences and leaves the host's
    cores free (`benchmarks/decode_cost.py` measures the CPU's shape). At most 10 s; the
    runtime refuses one whose longest response would outlast `runtime.stall_timeout_s`."""

    temperature: float = 1.0
    top_p: float = 1.0
    device: str | None = None
    step_s: float = 0.0

    @property
    def decode_shape(self) -> str:
        return "gpu-shaped" if self.step_s > 0 else "cpu"


@dataclass(frozen=True)
class RuntimeSpec:
    """The core split (see the module docstring). `backend`: `process`, `thread` or `auto`
    (processes on CPU, threads on CUDA; see `workers.py`). `max_threads`: cap on torch intra-op
    threads per worker (0 = none; tiny kernels gain nothing from OpenMP teams). `stall_timeout_s`:
    how long to wait for any report before declaring the run stuck. `sync_trainer_ranks`: sync's
    trainer as that many gloo data-parallel processes (0 = one per core on the process backend).
    `max_instance_restarts`: fresh processes per run for exited instances (0 = never).
    `trainer_borrow`: async modes get a second trainer rank on the rollout cores at
    `trainer_borrow_nice` (0-19) below the instances, sharing groups by measured speed
    (`Runtime._assign`) with unchanged minibatches; CPU process backend only."""

    cores: int
    trainer_cores: int
    pin: bool = True
    backend: str = "auto"
    max_threads: int = 0
    stall_timeout_s: float = 300.0
    sync_trainer_ranks: int = 0
    max_instance_restarts: int = 3
    trainer_borrow: bool = False
    trainer_borrow_nice: int = 19

    @property
    def rollout_cores(self) -> int:
        return max(1, self.cores - self.trainer_cores)

    def threads(self, share: int) -> int:
        """Intra-op threads for a worker whose share is `share` cores."""
        return max(1, min(share, self.max_threads) if self.max_threads else share)


@dataclass(frozen=True)
class EvalSpec:
    """Held-out prompts scored before and after training with the engine's sampling settings
    (`samples` answers per prompt, fixed seeds, so every mode is scored on the same draws)."""

    prompts: int = 64
    samples: int = 2


@dataclass(frozen=True)
class Recipe:
    """A validated recipe. `dora` carries the mode; `with_mode` swaps it (and K where needed)."""

    name: str
    seed: int
    steps: int
    task_name: str
    task: Mapping[str, Any]
    model: ModelSpec
    warm_start: WarmStartSpec
    trainer: Mapping[str, Any]
    engine: EngineSpec
    runtime: RuntimeSpec
    eval: EvalSpec
    dora: DoraConfig
    dora_raw: Mapping[str, Any]
    path: str | None = None

    def with_mode(self, mode: str) -> "Recipe":
        """The same recipe in another mode: `sync`/`pipeline` take K=0, `one_step_off` K=1, `dora` and
        `partial` keep the recipe's K if it suits them (else their default) and `admission`."""
        if mode not in MODES:
            raise ConfigError("mode", f"unknown mode {mode!r}; accepted: {', '.join(MODES)}")
        data = dict(self.dora_raw)
        data["mode"] = mode
        k = data.get("max_staleness")
        if mode in ("sync", "pipeline", "one_step_off") or (mode == "dora" and (k is None or k < 1)):
            data.pop("max_staleness", None)
        if mode not in ADMISSION_MODES:
            data.pop("admission", None)
        return dataclasses.replace(self, dora=_dora(data, self.steps), dora_raw=data)

    def with_steps(self, steps: int) -> "Recipe":
        steps = _positive_int(steps, "steps")
        return dataclasses.replace(self, steps=steps, dora=_dora(self.dora_raw, steps))

    def with_seed(self, seed: int) -> "Recipe":
        return dataclasses.replace(self, seed=_positive_int(seed, "seed", 0))

    def trainer_config(self) -> Any:
        """The `TrainerConfig` (imports torch)."""
        from ..algo import TrainerConfig

        return TrainerConfig.from_dict(self.trainer, where="trainer")

    def to_dict(self) -> dict[str, Any]:
        """Plain data for reports (what was run)."""
        return {
            "name": self.name, "seed": self.seed, "steps": self.steps,
            "task": {"name": self.task_name, **self.task},
            "model": {"type": self.model.type, **self.model.shape} | ({"max_len": self.model.max_len} if self.model.type == "smollm2" else {}),
            "warm_start": dataclasses.asdict(self.warm_start), "trainer": dict(self.trainer),
            "engine": dataclasses.asdict(self.engine), "runtime": dataclasses.asdict(self.runtime),
            "eval": dataclasses.asdict(self.eval), "dora": self.dora.to_dict(),
        }


# ---------------------------------------------------------------------------------- loading
def load_recipe(path: str, overrides: Sequence[str] = ()) -> Recipe:
    """Read and validate a YAML recipe file; `overrides` are `section.key=value` strings (values
    parsed as YAML) applied before validation, e.g. `dora.capacity=16`, `steps=10`."""
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except FileNotFoundError:
        raise ConfigError("recipe", f"file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError("recipe", f"{path} is a directory, expected a YAML file") from None
    except yaml.YAMLError as exc:
        raise ConfigError("recipe", f"{path} is not valid YAML: {exc}") from None
    data = {} if data is None else data
    if overrides:
        if not isinstance(data, Mapping):
            raise ConfigError("recipe", f"expected a mapping of sections, got {type(data).__name__}")
        data = apply_overrides(data, overrides)
    default_name = os.path.splitext(os.path.basename(path))[0]
    return recipe_from_dict(data, path=path, default_name=default_name)


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """`section.key=value` (or `key=value` for top-level keys) applied to a copy of `data`."""
    import copy

    import yaml

    out = copy.deepcopy(dict(data))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(str(item), "an override must look like section.key=value (e.g. dora.capacity=16)")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw)
        parts = key.strip().split(".")
        if len(parts) == 1:
            out[parts[0]] = value
        elif len(parts) == 2:
            section = out.get(parts[0])
            if section is None:
                section = out[parts[0]] = {}
            if not isinstance(section, dict):
                raise ConfigError(parts[0], f"expected a mapping, got {type(section).__name__}")
            section[parts[1]] = value
        else:
            raise ConfigError(key, "an override names at most section.key")
    return out


def recipe_from_dict(data: Mapping[str, Any], *, path: str | None = None, default_name: str = "recipe") -> Recipe:
    """Validate a recipe given as a mapping (a parsed YAML file)."""
    if not isinstance(data, Mapping):
        raise ConfigError("recipe", f"expected a mapping of sections ({', '.join(TOP_LEVEL)}), got {type(data).__name__}")
    for key in data:
        if key not in TOP_LEVEL:
            raise ConfigError(str(key), f"unknown section; accepted: {', '.join(TOP_LEVEL)}")
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name or any(c in name for c in "/\\ "):
        raise ConfigError("name", f"expected a non-empty name without spaces or slashes, got {name!r}")
    seed = _positive_int(data.get("seed", 0), "seed", 0)
    steps = _positive_int(data.get("steps", 20), "steps")

    task_name, task = _task(_section(data, "task"))
    model = _model(_section(data, "model"), task_name)
    warm = _warm_start(_section(data, "warm_start"), model)
    engine = _engine(_section(data, "engine"))
    trainer = _trainer(_section(data, "trainer"), engine)
    runtime = _runtime(_section(data, "runtime"))
    ev = _eval(_section(data, "eval"))
    dora_raw = dict(_section(data, "dora"))
    dora = _dora(dora_raw, steps)
    algorithm = trainer.get("algorithm", "grpo")
    if algorithm == "grpo" and dora.group_size < 2:
        raise ConfigError("dora.group_size", "trainer.algorithm 'grpo' needs group_size >= 2 "
                          "(group-normalised advantages); use trainer.algorithm: sao for single rollouts")
    return Recipe(name, seed, steps, task_name, task, model, warm, trainer, engine, runtime, ev, dora, dora_raw, path)


def _section(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"expected a mapping, got {type(value).__name__}")
    return value


def _check_keys(data: Mapping[str, Any], section: str, accepted: tuple[str, ...] | list[str]) -> None:
    for key in data:
        if key not in accepted:
            raise ConfigError(f"{section}.{key}", f"unknown key; accepted: {', '.join(sorted(accepted))}")


def _positive_int(value: Any, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(name, f"expected an integer >= {minimum}, got {value!r}")
    return value


def _number(value: Any, name: str, lo: float, hi: float = math.inf, *, open_lo: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > lo if open_lo else value >= lo) and value <= hi
    if not ok:
        rng = f"{'(' if open_lo else '['}{lo}, {hi}{']' if math.isfinite(hi) else ')'}"
        raise ConfigError(name, f"expected a number in {rng}, got {value!r}")
    return float(value)


def _task(data: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    values = dict(data)
    name = values.pop("name", "long_tail")
    if name not in TASKS:
        raise ConfigError("task.name", f"unknown task {name!r}; accepted: {', '.join(TASKS)}")
    # Validate now with the task's own config class (cheap, no tokenizer or model is built).
    if name == "long_tail":
        from ..tasks.long_tail import LongTailConfig as cls
    else:
        from ..tasks.count import CountConfig as cls
    _check_keys(values, "task", [f.name for f in dataclasses.fields(cls)] + ["name"])
    try:
        cls(**values)
    except ConfigError as exc:
        field_name = exc.field if exc.field.startswith("task.") else f"task.{exc.field}"
        raise ConfigError(field_name, str(exc).split(": ", 1)[1]) from None
    except TypeError as exc:
        raise ConfigError("task", str(exc)) from None
    return name, values


def _model(data: Mapping[str, Any], task_name: str) -> ModelSpec:
    values = dict(data)
    mtype = values.pop("type", "smollm2" if task_name == "count" else "tiny")
    if mtype not in MODEL_TYPES:
        raise ConfigError("model.type", f"unknown model type {mtype!r}; accepted: {', '.join(MODEL_TYPES)}")
    if task_name == "count" and mtype != "smollm2":
        raise ConfigError("model.type", "task 'count' uses the SmolLM2 tokenizer: model.type must be 'smollm2'")
    if task_name == "long_tail" and mtype != "tiny":
        raise ConfigError("model.type", "task 'long_tail' has its own local tokenizer: model.type must be 'tiny'")
    if mtype == "smollm2":
        _check_keys(values, "model", ["max_len"])
        return ModelSpec("smollm2", {}, _positive_int(values.get("max_len", 512), "model.max_len", 16))
    # No `seed` here: the run's seed decides the initial weights (and --seed changes them).
    _check_keys(values, "model", list(_TINY_KEYS))
    from ..models.tiny import TinyConfig

    try:
        TinyConfig(vocab_size=8, max_len=8, **values)
    except ValueError as exc:
        msg = str(exc)
        fname = msg.split(":", 1)[0].removeprefix("TinyConfig.")
        raise ConfigError(f"model.{fname}", msg.split(": ", 1)[-1]) from None
    except TypeError as exc:
        raise ConfigError("model", str(exc)) from None
    return ModelSpec("tiny", values)


def _warm_start(data: Mapping[str, Any], model: ModelSpec) -> WarmStartSpec:
    _check_keys(data, "warm_start", [f.name for f in dataclasses.fields(WarmStartSpec)])
    steps = _positive_int(data.get("steps", 0), "warm_start.steps", 0)
    if steps and model.type != "tiny":
        raise ConfigError("warm_start.steps", "only a tiny random-initialised model is warm-started; use 0 for smollm2")
    return WarmStartSpec(
        steps=steps,
        batch_size=_positive_int(data.get("batch_size", 16), "warm_start.batch_size"),
        lr=_number(data.get("lr", 3e-3), "warm_start.lr", 0.0, open_lo=True),
    )


def _engine(data: Mapping[str, Any]) -> EngineSpec:
    _check_keys(data, "engine", [f.name for f in dataclasses.fields(EngineSpec)])
    device = data.get("device")
    if device is not None:
        if not isinstance(device, str) or device.split(":")[0] not in ("cpu", "cuda"):
            raise ConfigError("engine.device", f"expected 'cpu', 'cuda' or 'cuda:N' (or leave it out), got {device!r}")
    return EngineSpec(
        temperature=_number(data.get("temperature", 1.0), "engine.temperature", 0.0, open_lo=True),
        top_p=_number(data.get("top_p", 1.0), "engine.top_p", 0.0, 1.0, open_lo=True),
        device=device,
        step_s=_number(data.get("step_s", 0.0), "engine.step_s", 0.0, 10.0),
    )


def _trainer(data: Mapping[str, Any], engine: EngineSpec) -> dict[str, Any]:
    values = dict(data)
    if "temperature" in values and values["temperature"] != engine.temperature:
        raise ConfigError("trainer.temperature", f"must equal engine.temperature ({engine.temperature}): the trainer "
                          f"scores tokens with the distribution they were sampled from; got {values['temperature']!r}")
    values["temperature"] = engine.temperature
    from ..algo.trainer import TrainerConfig  # validates every field, naming it

    TrainerConfig.from_dict(values, where="trainer")
    return values


def _runtime(data: Mapping[str, Any]) -> RuntimeSpec:
    _check_keys(data, "runtime", [f.name for f in dataclasses.fields(RuntimeSpec)])
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cores = data.get("cores", available)
    cores = _positive_int(cores, "runtime.cores")
    if cores > available:
        raise ConfigError("runtime.cores", f"this machine lets the process use {available} cores, got {cores}")
    trainer_cores = _positive_int(data.get("trainer_cores", max(1, cores // 2)), "runtime.trainer_cores")
    if cores >= 2 and trainer_cores >= cores:
        raise ConfigError("runtime.trainer_cores", f"expected an integer in [1, {cores - 1}] (the rest are the "
                          f"rollout instances'), got {trainer_cores}")
    pin = data.get("pin", True)
    if not isinstance(pin, bool):
        raise ConfigError("runtime.pin", f"expected true or false, got {pin!r}")
    backend = data.get("backend", "auto")
    if backend not in BACKENDS:
        raise ConfigError("runtime.backend", f"unknown backend {backend!r}; accepted: {', '.join(BACKENDS)}")
    max_threads = _positive_int(data.get("max_threads", 0), "runtime.max_threads", 0)
    stall = _number(data.get("stall_timeout_s", 300.0), "runtime.stall_timeout_s", 0.0, open_lo=True)
    ranks = _positive_int(data.get("sync_trainer_ranks", 0), "runtime.sync_trainer_ranks", 0)
    if ranks > cores:
        raise ConfigError("runtime.sync_trainer_ranks", f"expected an integer in [0, {cores}] (runtime.cores), got {ranks}")
    restarts = _positive_int(data.get("max_instance_restarts", 3), "runtime.max_instance_restarts", 0)
    borrow = data.get("trainer_borrow", False)
    if not isinstance(borrow, bool):
        raise ConfigError("runtime.trainer_borrow", f"expected true or false, got {borrow!r}")
    if borrow and backend == "thread":
        raise ConfigError("runtime.trainer_borrow", "needs the process backend (runtime.backend: process or auto): "
                          "a borrowing trainer rank is a process of its own, at a lower priority")
    if borrow and cores < 2:
        raise ConfigError("runtime.trainer_borrow", f"needs runtime.cores >= 2 (rollout cores to borrow from), "
                          f"got cores {cores}")
    borrow_nice = data.get("trainer_borrow_nice", 19)
    if isinstance(borrow_nice, bool) or not isinstance(borrow_nice, int) or not 0 <= borrow_nice <= 19:
        raise ConfigError("runtime.trainer_borrow_nice", f"expected an integer in [0, 19] (how much lower the "
                          f"borrowing rank's priority is), got {borrow_nice!r}")
    return RuntimeSpec(cores, min(trainer_cores, cores), pin, backend, max_threads, stall, ranks, restarts,
                       borrow, borrow_nice)


def _eval(data: Mapping[str, Any]) -> EvalSpec:
    _check_keys(data, "eval", [f.name for f in dataclasses.fields(EvalSpec)])
    return EvalSpec(
        prompts=_positive_int(data.get("prompts", 64), "eval.prompts", 0),
        samples=_positive_int(data.get("samples", 2), "eval.samples"),
    )


def _dora(data: Mapping[str, Any], steps: int) -> DoraConfig:
    values = dict(data)
    if "max_steps" in values:
        raise ConfigError("dora.max_steps", "set the top-level 'steps' (or --steps) instead")
    values["max_steps"] = steps
    return DoraConfig.from_dict(values, where="dora")
