"""Parse a launch script's flags with slime's OWN parser (`slime.utils.arguments.parse_args`:
slime's arguments, sglang's and the router's, then Megatron-LM's phase and slime's validation).

Stand-ins: Megatron-LM's parser (`megatron_args.py`) and the HF checkpoint the flags name (it is
not on this machine: `AutoConfig` in slime's Megatron-argument module returns an empty config, so
slime's HF-vs-Megatron shape check has nothing to compare). Flags no parser knows are reported.

    python -m slime_cpu.parse_flags < argvs.json   (a list of argv lists)
    -> prints a JSON list, one {"unknown": [...], "args": {...}} per argv
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace


def main() -> int:
    argvs = json.load(sys.stdin)
    os.environ["SLIME_ACCELERATOR"] = "cpu"
    from slime_cpu import accel, megatron_args

    megatron_args.install()
    accel.setup()
    import slime.backends.megatron_utils.arguments as slime_megatron_args

    class _AbsentCheckpointConfig:
        @staticmethod
        def from_pretrained(path, **kwargs):
            return SimpleNamespace()

    slime_megatron_args.AutoConfig = _AbsentCheckpointConfig
    from slime.utils.arguments import parse_args

    outs = [_parse(parse_args, argv) for argv in argvs]
    print(json.dumps(outs, default=str))
    return 0


def _parse(parse_args, argv: list[str]) -> dict:
    from slime_cpu import megatron_args

    sys.argv = ["train.py", *argv]
    args = parse_args()
    keep = ("rollout_function_path", "eval_function_path", "data_source_path", "update_weight_transport",
            "update_weight_disk_dir", "update_weights_interval", "custom_config_path", "loss_type",
            "custom_loss_function_path", "use_tis", "custom_tis_function_path", "colocate",
            "custom_rollout_weight_reload_path", "dora", "dora_slime")
    out = {"unknown": megatron_args.UNKNOWN, "args": {k: getattr(args, k, None) for k in keep}}
    if getattr(args, "dora", None) is not None:
        from dora_ext.slime.settings import check_launch, dora_config, slime_settings

        check_launch(args)  # dora-ext's own launch check, on the args slime parsed
        slime_settings(args)
        out["dora_config"] = dora_config(args, instances=[1]).to_dict()
    return out


if __name__ == "__main__":
    sys.exit(main())
