"""RL algorithms as small torch functions, and a streaming trainer that uses them.

`advantages` (GRPO, GAE, value loss), `losses` (PPO clip, truncated IS, decoupled PPO, SAO's
double-side mask, entropy, KL), `trainer` (`Trainer`, `TrainerConfig`, `Trajectory`). Importing
this package imports torch; `dora_ext.core` never does.
"""

from .advantages import gae, grpo_advantages, masked_whiten, token_rewards, value_loss
from .losses import (
    LOSS_AGG_MODES, agg_loss, decoupled_ppo_loss, double_side_mask, entropy_from_logits,
    kl_penalty, masked_mean, ppo_policy_loss, sao_policy_loss, tis_ppo_loss,
    truncated_is_pg_loss, truncated_is_weights,
)
from .trainer import ALGORITHMS, CORRECTIONS, Trainer, TrainerConfig, Trajectory, default_logits_fn

__all__ = [
    "ALGORITHMS", "CORRECTIONS", "LOSS_AGG_MODES", "Trainer", "TrainerConfig", "Trajectory",
    "agg_loss", "decoupled_ppo_loss", "default_logits_fn", "double_side_mask",
    "entropy_from_logits", "gae", "grpo_advantages", "kl_penalty", "masked_mean",
    "masked_whiten", "ppo_policy_loss", "sao_policy_loss", "tis_ppo_loss", "token_rewards",
    "truncated_is_pg_loss", "truncated_is_weights", "value_loss",
]
