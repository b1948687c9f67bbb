"""dora-ext settings on slime: one YAML file given to slime with `--custom-config-path`.

slime's `--custom-config-path` sets every top-level key of the YAML as an attribute of `args`, so
the add-on's settings travel with slime's own arguments to every Ray actor without a new flag:

```yaml
dora:                      # the scheduler (dora_ext.config.DoraConfig), validated on load
  mode: dora
  max_staleness: 2
dora_slime:                # how the adapter talks to slime (SlimeSettings below)
  weights_dir: /shared/dora-weights
  capacity: 32
custom_rollout_weight_reload_path: dora_ext.slime.weights.publish_weights   # read by the patch
```

`batch_size` and `group_size` are slime's `--rollout-batch-size` and `--n-samples-per-prompt`; the
`dora` section may repeat them but never contradict them. `instances` is discovered from slime's
router at run time (one instance per SGLang engine). Every invalid value raises `ConfigError`
naming the key, before any GPU time is spent.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from ..config import ConfigError, DoraConfig

#: The rollout function and data source that `dora-ext slime-args` prints.
ROLLOUT_FUNCTION_PATH = "dora_ext.slime.rollout.generate_rollout"
DATA_SOURCE_PATH = "dora_ext.slime.data_source.DoraDataSource"
WEIGHT_RELOAD_HOOK_PATH = "dora_ext.slime.weights.publish_weights"
SAO_LOSS_PATH = "dora_ext.slime.loss.sao_loss"
SLIME_BASE_DATA_SOURCE_PATH = "slime.rollout.data_source.RolloutDataSourceWithBuffer"

LOSSES = ("slime", "sao")
CORRECTIONS = ("none", "tis", "mask")


@dataclass(frozen=True)
class SlimeSettings:
    """The `dora_slime` section.

    Fields:
      weights_dir: the shared directory slime's disk weight sync writes to
        (`--update-weight-disk-dir`); engines load each version from it when they drain.
      capacity: sequences one SGLang engine runs at once; default `--sglang-server-concurrency`.
      poll_interval_s: how often the rollout worker looks for a newly published version.
      base_data_source_path: the data source whose prompts `DoraDataSource` hands out
        (default slime's own `RolloutDataSourceWithBuffer`).
      delete_old_weights: remove a version's directory once no engine can need it again
        (nothing is deleted with slime's `--update-weight-disk-keep-files`).
      loss: `slime` keeps slime's policy loss; `sao` selects SAO's double-side masked loss
        (`dora-ext slime-args` then prints `--loss-type custom_loss`).
      staleness_correction: `none`, `tis` (truncated importance weights pi_old / pi_rollout, cap
        `is_cap`) or `mask` (drop tokens whose ratio leaves [1/is_cap, is_cap]); through
        `--use-tis --custom-tis-function-path`.
      is_cap: the cap C of the correction (> 1).
      engine_check_interval_s: how often the rollout worker re-reads slime's router and checks
        each engine's health and reported weight version (dead engines leave, restarted ones join
        under a new instance id); a trajectory answered with another version checks at once.
      probe_timeout_s: bound on each control call to an engine (`/health_generate`,
        `/server_info`, `/model_info`); an engine whose `/health_generate` takes longer is stuck.
      shared_weights_dir: the weights directory is on a filesystem every Ray node sees; a
        cluster of more than one node refuses to start until this says so.
      request_timeout_s: bound on one generate request (then it is cancelled, its engine probed,
        and the trajectory retried); above the longest response's decode time.
      load_timeout_s: bound on one weight load, the wait for the engine to be idle and every
        `/update_weights_from_disk` it takes included; an engine past it is retired (it may
        rejoin). Default 600 s: 8 GB (a 4B checkpoint) read at 50 MB/s from a network disk, ~x4.
    """

    weights_dir: str | None = None
    capacity: int | None = None
    poll_interval_s: float = 0.2
    base_data_source_path: str = SLIME_BASE_DATA_SOURCE_PATH
    delete_old_weights: bool = True
    loss: str = "slime"
    staleness_correction: str = "tis"
    is_cap: float = 2.0
    engine_check_interval_s: float = 2.0
    probe_timeout_s: float = 60.0
    request_timeout_s: float = 3600.0
    load_timeout_s: float = 600.0
    shared_weights_dir: bool = False

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, *, where: str = "dora_slime") -> "SlimeSettings":
        data = {} if data is None else data
        if not isinstance(data, Mapping):
            raise ConfigError(where, f"expected a mapping, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        for key in data:
            if key not in known:
                raise ConfigError(f"{where}.{key}", f"unknown key; accepted keys are {', '.join(sorted(known))}")
        d = cls()
        wd = data.get("weights_dir", d.weights_dir)
        if wd is not None and (not isinstance(wd, str) or not wd):
            raise ConfigError(f"{where}.weights_dir", f"expected a directory path, got {wd!r}")
        cap = data.get("capacity", d.capacity)
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ConfigError(f"{where}.capacity", f"expected an integer >= 1, got {cap!r}")
        poll = data.get("poll_interval_s", d.poll_interval_s)
        if isinstance(poll, bool) or not isinstance(poll, (int, float)) or not 0 < poll <= 60:
            raise ConfigError(f"{where}.poll_interval_s", f"expected a number in (0, 60], got {poll!r}")
        base = data.get("base_data_source_path", d.base_data_source_path)
        if not isinstance(base, str) or "." not in base:
            raise ConfigError(f"{where}.base_data_source_path", f"expected a dotted path module.Class, got {base!r}")
        delete = data.get("delete_old_weights", d.delete_old_weights)
        if not isinstance(delete, bool):
            raise ConfigError(f"{where}.delete_old_weights", f"expected true or false, got {delete!r}")
        loss = data.get("loss", d.loss)
        if loss not in LOSSES:
            raise ConfigError(f"{where}.loss", f"unknown loss {loss!r}; accepted: {', '.join(LOSSES)}")
        corr = data.get("staleness_correction", d.staleness_correction)
        if corr not in CORRECTIONS:
            raise ConfigError(
                f"{where}.staleness_correction", f"unknown correction {corr!r}; accepted: {', '.join(CORRECTIONS)}"
            )
        is_cap = data.get("is_cap", d.is_cap)
        if isinstance(is_cap, bool) or not isinstance(is_cap, (int, float)) or not is_cap > 1.0:
            raise ConfigError(f"{where}.is_cap", f"expected a number > 1, got {is_cap!r}")
        check = data.get("engine_check_interval_s", d.engine_check_interval_s)
        if isinstance(check, bool) or not isinstance(check, (int, float)) or not 0 < check <= 600:
            raise ConfigError(f"{where}.engine_check_interval_s", f"expected a number in (0, 600], got {check!r}")
        bounds = {}
        for key in ("probe_timeout_s", "request_timeout_s", "load_timeout_s"):
            v = data.get(key, getattr(d, key))
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"{where}.{key}", f"expected a number of seconds > 0, got {v!r}")
            bounds[key] = float(v)
        shared = data.get("shared_weights_dir", d.shared_weights_dir)
        if not isinstance(shared, bool):
            raise ConfigError(f"{where}.shared_weights_dir", f"expected true or false, got {shared!r}")
        bounds["shared_weights_dir"] = shared
        return cls(wd, cap, float(poll), base, delete, loss, corr, float(is_cap), float(check), **bounds)


def check_shared_weights_dir(settings: SlimeSettings, weights_dir: str, nodes: int) -> None:
    """A Ray cluster of several nodes needs the weights directory on a shared filesystem (never a
    node's memory: /dev/shm, whatever `shared_weights_dir` says)."""
    if nodes > 1 and not settings.shared_weights_dir:
        raise ConfigError(
            "dora_slime.shared_weights_dir",
            f"the Ray cluster has {nodes} nodes: the trainer writes each version under {weights_dir!r} and every "
            "engine loads it from there, so that directory must be on a filesystem all nodes share; mount one "
            "and set dora_slime.shared_weights_dir: true",
        )
    fs = memory_fs(weights_dir)
    if nodes > 1 and fs:
        raise ConfigError("dora_slime.weights_dir", f"{weights_dir!r} is on {fs}, one node's memory, which the other "
                          f"{nodes - 1} node(s) of the Ray cluster do not see: put it on a shared filesystem")


def memory_fs(path: str, mounts_file: str = "/proc/mounts") -> str | None:
    """`tmpfs` or `ramfs` when `path` (or the directory it will be made in) is in a node's memory:
    the filesystem of the deepest mount point above its real path, the last one mounted there
    (a mount stacked on another hides it); the file escapes a space in a mount point as \\040."""
    try:
        with open(mounts_file) as fh:
            mounts = [(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point), fs)
                      for point, fs in (line.split()[1:3] for line in fh)]
    except OSError:
        return None
    real = os.path.realpath(path)
    under = [m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")]
    fs = max(reversed(under), key=lambda m: len(m[0]))[1] if under else None
    return fs if fs in ("tmpfs", "ramfs") else None


def dora_section(args: Any) -> Mapping[str, Any]:
    """The `dora` mapping carried on `args` (empty when absent)."""
    data = getattr(args, "dora", None)
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError("dora", f"expected a mapping (the `dora:` section of --custom-config-path), got {data!r}")
    return data


def slime_settings(args: Any) -> SlimeSettings:
    """The validated `dora_slime` section of `args` (defaults when absent or when `args` is None)."""
    return SlimeSettings.from_dict(getattr(args, "dora_slime", None))


def dora_config(args: Any, *, instances: list[int] | None = None, start_step: int = 0) -> DoraConfig:
    """Build the scheduler config from slime's args and the `dora` section.

    `instances` lists engine capacities (discovered at run time; a placeholder of one engine is
    used when validating a file before launch). `start_step` is slime's first rollout id of this
    run: `max_steps` counts the steps left (`--num-rollout` minus it), so admission stops where
    training stops and nothing is generated in vain.
    """
    data = dict(dora_section(args))
    for key, flag, attr in (
        ("batch_size", "--rollout-batch-size", "rollout_batch_size"),
        ("group_size", "--n-samples-per-prompt", "n_samples_per_prompt"),
    ):
        host = getattr(args, attr, None)
        if host is None:
            continue
        if key in data and data[key] != host:
            raise ConfigError(f"dora.{key}", f"must equal slime's {flag} ({host}), got {data[key]!r}")
        data[key] = host
    if data.get("migrate"):
        raise ConfigError(
            "dora.migrate",
            "not available on slime: moving one running request needs a per-request abort that "
            "slime's generate path does not expose; set it to false",
        )
    data["migrate"] = False
    if data.get("elastic"):
        raise ConfigError("dora.elastic", "not available on slime: its trainer cannot take an idle engine's GPUs "
                          "(the rollout worker has no SwitchToTrainer); set it to false")
    if data.get("mode") == "partial":
        raise ConfigError(
            "dora.mode",
            "'partial' on slime is slime's own --partial-rollout / fully_async rollout; use it "
            "unmodified as the baseline, or pick one of sync, one_step_off, pipeline, dora",
        )
    num_rollout = getattr(args, "num_rollout", None)
    if isinstance(num_rollout, int) and "max_steps" not in data:
        left = num_rollout - start_step
        if left < 1:
            raise ConfigError("num_rollout", f"no step left to run: --num-rollout {num_rollout}, first step {start_step}")
        data["max_steps"] = left
    if instances is not None:
        data.pop("capacity", None)
        data["instances"] = [{"id": i, "capacity": c} for i, c in enumerate(instances)]
    return DoraConfig.from_dict(data, where="dora")


def check_launch(args: Any) -> None:
    """Check slime's own flags against what the adapter needs; raises `ConfigError` naming the flag."""
    if getattr(args, "colocate", False):
        raise ConfigError(
            "colocate", "dora-ext needs separate rollout and trainer GPUs; slime's --colocate offloads the engines while training"
        )
    if getattr(args, "offload_rollout", False):
        raise ConfigError("offload_rollout", "the rollout worker keeps generating while the trainer runs; drop --offload-rollout")
    if getattr(args, "dynamic_sampling_filter_path", None):
        raise ConfigError(
            "dynamic_sampling_filter_path",
            "not applied by dora-ext's rollout: dropping complete groups would break C2 (every admitted "
            "group is trained); remove the flag, or filter with --rollout-sample-filter-path (remove_sample)",
        )
    if getattr(args, "partial_rollout", False):
        raise ConfigError("partial_rollout", "slime's --partial-rollout resumes aborted requests under new weights; "
                          "dora-ext never aborts: drop the flag")
    interval = getattr(args, "update_weights_interval", 1)
    if interval not in (None, 1):
        raise ConfigError(
            "update_weights_interval", f"must be 1: version v is the policy after v steps, got {interval}"
        )
    transport = getattr(args, "update_weight_transport", None)
    if transport is not None and transport != "disk":
        raise ConfigError(
            "update_weight_transport",
            f"must be 'disk': engines load each version from disk when they drain (got {transport!r})",
        )
    if getattr(args, "loss_type", None) == "custom_loss" and getattr(args, "use_tis", False) and \
            getattr(args, "custom_loss_function_path", None) == SAO_LOSS_PATH:
        raise ConfigError(
            "use_tis",
            "has no effect with --loss-type custom_loss: slime applies --custom-tis-function-path inside its own "
            "policy loss, which dora-ext's SAO loss replaces (SAO already weighs tokens by pi_theta / pi_rollout); "
            "drop --use-tis, or use dora_slime.loss: slime",
        )
    mode = getattr(args, "update_weight_mode", None)
    if mode not in (None, "full"):
        raise ConfigError(
            "update_weight_mode",
            f"must be 'full' (got {mode!r}): 'delta' patches one checkpoint per host in place, and the "
            "patched reload hook is skipped for it; engines that hold different versions at once "
            "need each version as a complete checkpoint",
        )
    local = getattr(args, "update_weight_local_checkpoint_dir", None)
    if local:
        raise ConfigError(
            "update_weight_local_checkpoint_dir",
            "not supported by dora-ext: it keeps one checkpoint per host, pulled into by every engine "
            "at once, while dora-ext loads each version onto an engine only once that engine drained "
            "(engines on one host hold different versions); drop the flag so engines load from "
            "--update-weight-disk-dir",
        )
    wd = slime_settings(args).weights_dir
    disk_dir = getattr(args, "update_weight_disk_dir", None)
    if wd and disk_dir and os.path.abspath(wd) != os.path.abspath(disk_dir):
        raise ConfigError(
            "dora_slime.weights_dir",
            f"{wd!r} differs from slime's --update-weight-disk-dir {disk_dir!r}: slime writes versions there, so "
            "leave dora_slime.weights_dir out or make them equal",
        )
    hook = getattr(args, "custom_rollout_weight_reload_path", None)
    if transport == "disk" and hook is None:
        raise ConfigError(
            "custom_rollout_weight_reload_path",
            f"missing: set it to {WEIGHT_RELOAD_HOOK_PATH} in the --custom-config-path YAML and apply "
            "patches/slime (without it slime reloads every engine at once and aborts their requests)",
        )
