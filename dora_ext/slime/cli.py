"""`dora-ext slime-args`: the flags that apply dora-ext to an existing slime launch script.

    DORA_ARGS=($(dora-ext slime-args --config dora.yaml))
    ray job submit ... -- python3 train_async.py "${ARGS[@]}" "${DORA_ARGS[@]}"

It validates the YAML first (every error names its key) and imports neither slime nor torch.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from types import SimpleNamespace
from typing import Any

from ..config import ConfigError
from .settings import (
    DATA_SOURCE_PATH, ROLLOUT_FUNCTION_PATH, WEIGHT_RELOAD_HOOK_PATH,
    SlimeSettings, dora_config,
)

EXAMPLE_CONFIG = f"""\
# dora-ext settings for slime: pass this file with --custom-config-path
# (`dora-ext slime-args --config THIS_FILE` prints every flag to add).
dora:
  mode: dora              # sync | one_step_off | pipeline | dora
  max_staleness: 2        # K; batch_size/group_size are slime's --rollout-batch-size/--n-samples-per-prompt
dora_slime:
  weights_dir: /shared/dora-weights   # a directory the trainer and every engine can read
  # capacity: 32          # sequences per engine (default: --sglang-server-concurrency)
  # loss: sao             # SAO's double-side masked loss instead of slime's policy loss
  staleness_correction: tis   # tis | mask | none
  is_cap: 2.0
# Read by slime's disk weight sync once patches/slime is applied: publish, do not reload.
custom_rollout_weight_reload_path: {WEIGHT_RELOAD_HOOK_PATH}
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "slime-args",
        help="print the flags that apply dora-ext to a slime launch script",
        description="Validate a dora-ext YAML for slime and print the slime flags that apply it.",
    )
    p.add_argument("--config", metavar="FILE", help="the YAML passed to slime with --custom-config-path")
    p.add_argument("--weights-dir", help="shared weights directory (overrides dora_slime.weights_dir)")
    p.add_argument("--format", choices=("line", "array"), default="line",
                   help="one shell line (default) or a bash array to paste into a script")
    p.add_argument("--example-config", action="store_true", help="print a commented example YAML and exit")
    p.set_defaults(func=run)


def slime_flags(data: dict, config_path: str | None, weights_dir: str | None = None) -> list[str]:
    """Validate the YAML's content and return the flags (a list of argv words)."""
    if not isinstance(data, dict):
        raise ConfigError("config", f"expected a mapping at the top of the file, got {type(data).__name__}")
    settings = SlimeSettings.from_dict(data.get("dora_slime"))
    config = dora_config(SimpleNamespace(dora=data.get("dora")), instances=[1])
    hook = data.get("custom_rollout_weight_reload_path")
    if hook != WEIGHT_RELOAD_HOOK_PATH:
        raise ConfigError(
            "custom_rollout_weight_reload_path",
            f"must be {WEIGHT_RELOAD_HOOK_PATH} (got {hook!r}): it makes slime publish versions instead of "
            "reloading every engine",
        )
    wd = weights_dir or settings.weights_dir
    flags = [
        "--rollout-function-path", ROLLOUT_FUNCTION_PATH,
        # Evaluation through ours too: slime's eval on one engine holding the newest version.
        "--eval-function-path", ROLLOUT_FUNCTION_PATH,
        "--data-source-path", DATA_SOURCE_PATH,
        "--update-weight-transport", "disk",
    ]
    if wd:
        flags += ["--update-weight-disk-dir", wd]
    flags += ["--update-weights-interval", "1"]
    if config_path is not None:
        flags += ["--custom-config-path", config_path]
    if settings.loss == "sao":
        flags += ["--loss-type", "custom_loss", "--custom-loss-function-path", "dora_ext.slime.loss.sao_loss"]
    if settings.staleness_correction != "none" and config.max_staleness > 0 and settings.loss != "sao":
        # slime applies --custom-tis-function-path inside its own policy loss only; SAO's loss
        # replaces that loss and already weighs by pi_theta / pi_rollout (masked), its correction.
        if settings.staleness_correction == "tis":  # slime's own truncated IS, cap C
            flags += ["--use-tis", "--tis-clip", str(settings.is_cap), "--tis-clip-low", "0"]
        else:
            flags += ["--use-tis", "--custom-tis-function-path", "dora_ext.slime.loss.staleness_tis"]
    return flags


def run(ns: argparse.Namespace) -> int:
    if ns.example_config:
        sys.stdout.write(EXAMPLE_CONFIG)
        return 0
    data: dict = {"custom_rollout_weight_reload_path": WEIGHT_RELOAD_HOOK_PATH}
    path = None
    if ns.config:
        import yaml

        path = os.path.abspath(ns.config)
        try:
            with open(path, encoding="utf-8") as fh:
                data = yaml.safe_load(fh) or {}
        except OSError as exc:
            print(f"dora-ext slime-args: cannot read {ns.config}: {exc.strerror}", file=sys.stderr)
            return 2
    else:
        print("dora-ext slime-args: no --config; the settings must reach slime through --custom-config-path "
              "(see --example-config)", file=sys.stderr)
    try:
        flags = slime_flags(data, path, ns.weights_dir)
        k = dora_config(SimpleNamespace(dora=data.get("dora")), instances=[1]).max_staleness
    except ConfigError as exc:
        print(f"dora-ext slime-args: {exc}", file=sys.stderr)
        return 2
    loop = "train.py" if k == 0 else "train_async.py (or train.py)"
    print(f"# K={k}: launch with {loop}; apply patches/slime first", file=sys.stderr)
    if "--update-weight-disk-dir" not in flags:
        print("# no dora_slime.weights_dir or --weights-dir: engines load each version from slime's own "
              "--update-weight-disk-dir, which the launch script must set (a directory the trainer and "
              "every engine share; slime refuses disk weight sync without it)", file=sys.stderr)
    if ns.format == "array":
        pairs, i = [], 0
        while i < len(flags):
            if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
                pairs.append(f"   {flags[i]} {shlex.quote(flags[i + 1])}")
                i += 2
            else:
                pairs.append(f"   {flags[i]}")
                i += 1
        print("DORA_ARGS=(\n" + "\n".join(pairs) + "\n)")
    else:
        print(" ".join(shlex.quote(f) for f in flags))
    return 0
