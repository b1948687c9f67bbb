"""Compose verl's installed ``ppo_trainer.yaml`` with a recipe's overrides, without running it.

Used as ``PYTHON="python recipes/verl/check_overrides.py" ./recipes/verl/<recipe>.sh``: the recipe
then calls ``$PYTHON -m verl.trainer.main_ppo <overrides>``, this script drops ``-m <module>``,
composes the config (so a misspelt key fails here, not after the GPUs are allocated), validates
the ``dora`` key when the trainer mode is ``dora`` (``DoraTrainer``'s ``configure``: what it sets
shows in the summary) and prints ``OK <mode> <summary>``.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    args = list(argv)
    if args[:1] == ["-m"]:
        args = args[2:]
    from hydra import compose, initialize_config_dir

    import verl

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=args)
    mode = cfg.trainer.v1.trainer_mode
    summary = f"batch={cfg.data.train_batch_size} n={cfg.actor_rollout_ref.rollout.n}"
    if mode == "dora":
        from dora_ext.verl.trainer import configure

        d = configure(cfg)
        ce = cfg.actor_rollout_ref.rollout.checkpoint_engine
        summary += f" K={d.max_staleness} instances={len(d.instances)} mode={d.mode} weights={ce.backend}"
        if cfg.actor_rollout_ref.rollout.name == "vllm":  # the worker extension the load checks call
            summary += f" vllm_worker={cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls}"
    print(f"OK {mode} {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
