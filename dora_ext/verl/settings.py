"""The ``dora`` key of verl's Hydra config, validated by the same ``DoraConfig`` as the core.

A verl user writes ``trainer.v1.trainer_mode=dora +dora.max_staleness=2``. Most scheduling
numbers already exist in verl's config under other names, so they are taken from there and a
``dora`` value that contradicts them is an error naming both keys:

| DoraConfig     | taken from verl                                                        |
|----------------|------------------------------------------------------------------------|
| batch_size B   | ``data.train_batch_size`` (prompts per weight version)                |
| group_size n   | ``actor_rollout_ref.rollout.n``                                        |
| instances      | standalone rollout replicas: ``rollout.nnodes * rollout.n_gpus_per_node`` / (tp * dp * pp) |
| capacity       | ``actor_rollout_ref.rollout.max_num_seqs``                             |
| max_steps      | ``trainer.total_training_steps`` (when set)                            |

Only modes ``dora`` (K >= 1) and ``pipeline`` (K = 0, RolloutPipe's on-policy CGP + FGD) run on
this trainer; verl's own trainers already are the other modes (``sync``, ``separate_async`` ...).
"""

from __future__ import annotations

from typing import Any, Mapping

from dora_ext.config import ConfigError, DoraConfig

KEY = "dora"
VERL_MODES = ("dora", "pipeline")


def _plain(section: Any) -> dict[str, Any]:
    """An OmegaConf node or a mapping as a plain dict (None -> {})."""
    if section is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(section, DictConfig):
            section = OmegaConf.to_container(section, resolve=True)
    except ImportError:  # pragma: no cover - verl always brings omegaconf
        pass
    if not isinstance(section, Mapping):
        raise ConfigError(KEY, f"expected a mapping (e.g. +{KEY}.max_staleness=2), got {section!r}")
    return dict(section)


def _select(config: Any, dotted: str, default: Any = None) -> Any:
    node = config
    for part in dotted.split("."):
        if node is None:
            return default
        try:
            node = node.get(part) if hasattr(node, "get") else getattr(node, part)
        except Exception:
            return default
    return default if node is None else node


def replica_count(config: Any) -> int:
    """Standalone rollout replicas verl will start (``LLMServerManager`` arithmetic): the pool's
    GPUs over one replica's. A replica takes tensor x data x pipeline parallel GPUs; with
    prefill/decode disaggregation its tensor-parallel part is its prefill servers' and decode
    servers' GPUs together (decode tensor parallel defaults to the prefill one)."""
    r = "actor_rollout_ref.rollout"
    gpus = int(_select(config, f"{r}.nnodes", 0)) * int(_select(config, f"{r}.n_gpus_per_node", 0))
    tp = int(_select(config, f"{r}.tensor_model_parallel_size", 1))
    if _select(config, f"{r}.disaggregation.enabled", False):
        pd = f"{r}.disaggregation"
        decode_tp = _select(config, f"{pd}.decode_tensor_model_parallel_size")
        tp = (tp * int(_select(config, f"{pd}.prefill_replicas", 1))
              + int(tp if decode_tp is None else decode_tp) * int(_select(config, f"{pd}.decode_replicas", 1)))
    per = (
        tp
        * int(_select(config, f"{r}.data_parallel_size", 1))
        * int(_select(config, f"{r}.pipeline_model_parallel_size", 1))
    )
    return gpus // max(per, 1)


def _verl_int(value: Any, verl_key: str, dora_key: str) -> int:
    """A verl setting that becomes the integer `DoraConfig.<dora_key>`: an int, never converted
    (2.5 slots per replica are not 2, and `true` is not 1); the error names verl's key."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(verl_key, f"expected an integer (it is dora's {dora_key}), got {value!r} "
                                    f"({type(value).__name__})")
    return value


def _count(instances: Any) -> int | None:
    """How many instances a ``dora.instances`` value names (a count or a list of specs); None for
    anything else, which ``DoraConfig.from_dict`` refuses with its own message."""
    if isinstance(instances, bool):
        return None
    if isinstance(instances, int):
        return instances
    return len(instances) if isinstance(instances, list) else None


def dora_config(config: Any, *, instances: int | None = None) -> DoraConfig:
    """Build and validate the ``DoraConfig`` of a verl run.

    `config` is verl's whole Hydra config (a DictConfig or nested mappings). `instances` overrides
    the replica count (tests, or a trainer that knows the real one). Raises ``ConfigError`` whose
    field is the full key, e.g. ``dora.max_staleness``.
    """
    data = _plain(_select(config, KEY))
    derived: dict[str, tuple[str, Any]] = {
        "batch_size": ("data.train_batch_size", _select(config, "data.train_batch_size")),
        "group_size": ("actor_rollout_ref.rollout.n", _select(config, "actor_rollout_ref.rollout.n")),
    }
    for key, (verl_key, value) in derived.items():
        if value is None:
            continue
        if key in data and data[key] != value:
            raise ConfigError(
                f"{KEY}.{key}",
                f"is {data[key]!r} but {verl_key} is {value!r}; leave {KEY}.{key} out or make them equal",
            )
        data[key] = value
    n = instances if instances is not None else replica_count(config)
    given = data.get("instances")
    if given is None:
        if n >= 1:
            data["instances"] = n
    elif n >= 1 and _count(given) not in (None, n):
        raise ConfigError(
            f"{KEY}.instances",
            f"is {given!r} but verl starts {n} rollout replica(s) (actor_rollout_ref.rollout.nnodes x "
            f"n_gpus_per_node over one replica's GPUs); leave {KEY}.instances out or make them equal",
        )
    if "capacity" not in data and isinstance(data.get("instances"), int):
        cap = _select(config, "actor_rollout_ref.rollout.max_num_seqs")
        if cap is not None:
            data["capacity"] = _verl_int(cap, "actor_rollout_ref.rollout.max_num_seqs", "capacity")
    if "max_steps" not in data:
        steps = _select(config, "trainer.total_training_steps")
        if steps is not None:
            data["max_steps"] = _verl_int(steps, "trainer.total_training_steps", "max_steps")
    cfg = DoraConfig.from_dict(data, where=KEY)
    if cfg.mode not in VERL_MODES:
        raise ConfigError(
            f"{KEY}.mode",
            f"{cfg.mode!r} is not run by trainer_mode=dora; accepted: {', '.join(VERL_MODES)} "
            "(verl's own trainer modes sync / separate_async already are the other baselines)",
        )
    return cfg
