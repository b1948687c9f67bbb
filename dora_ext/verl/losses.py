"""dora-ext's policy losses in verl's registry (``actor_rollout_ref.actor.policy_loss.loss_mode``).

Registered by ``plugin`` right after ``verl.trainer.ppo.core_algos`` is imported, with verl's own
signature ``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
rollout_is_weights) -> (loss, metrics)``. The maths is ``dora_ext.algo.losses``; this module only
maps verl's arguments onto it:

* ``dora_sao``: SAO's strict double-side mask on r = pi_theta / pi_rollout. verl passes the
  rollout log-probs as ``old_log_prob`` in *bypass mode*, so use it with
  ``algorithm.rollout_correction.bypass_mode=true`` (the loss checks nothing it cannot see; the
  recipe sets both). Band: ``[1 - clip_ratio_low, 1 + clip_ratio_high]`` of the actor config.
* ``dora_decoupled``: decoupled PPO for stale groups (AReaL): the clip is anchored at
  pi_prox = ``old_log_prob`` (verl's recomputed log-probs), the behaviour correction
  w = pi_prox / pi_rollout arrives as ``rollout_is_weights`` (verl computes and truncates it with
  ``algorithm.rollout_correction.rollout_is=token`` and ``rollout_is_threshold``). Without
  weights it is plain PPO.

Aggregation follows verl across data-parallel ranks: verl's ``agg_loss`` divides by the *global*
token (or sequence) count times ``dp_size``; our functions take that divisor as ``denom``.
"""

from __future__ import annotations

from typing import Any

LOSS_NAMES = ("dora_sao", "dora_decoupled")


def _clip(config: Any) -> tuple[float, float]:
    base = float(config.clip_ratio)
    low = config.clip_ratio_low if getattr(config, "clip_ratio_low", None) is not None else base
    high = config.clip_ratio_high if getattr(config, "clip_ratio_high", None) is not None else base
    return float(low), float(high)


def _denom(mode: str, config: Any) -> float | None:
    """verl's global divisor for `mode` as our ``denom`` (None: the local default)."""
    from dora_ext.config import ConfigError

    info = dict(getattr(config, "global_batch_info", None) or {})
    dp = int(info.get("dp_size") or 1)
    if mode == "token-mean":
        total = info.get("batch_num_tokens")
    elif mode == "seq-mean-token-mean":
        total = info.get("global_batch_size")
    else:
        raise ConfigError(
            "actor_rollout_ref.actor.loss_agg_mode",
            f"{mode!r} is not supported by the dora losses; accepted: token-mean, seq-mean-token-mean",
        )
    if total is None:
        if dp > 1:
            raise ValueError(f"loss_agg_mode {mode}: verl gave no global count with dp_size={dp}")
        return None
    return float(total) / dp


def _actor_metrics(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    return {f"actor/{prefix}{k}": float(v) for k, v in metrics.items() if k != "pg_loss"}


def dora_sao(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
             rollout_is_weights=None):
    """SAO double-side masked policy gradient (see ``dora_ext.algo.losses.sao_policy_loss``)."""
    from dora_ext.algo.losses import sao_policy_loss

    if config is None:
        raise ValueError("dora_sao: verl passed no actor config")
    low, high = _clip(config)
    loss, metrics = sao_policy_loss(
        log_prob, old_log_prob, advantages, response_mask.float(),
        eps_low=low, eps_high=high, loss_agg_mode=loss_agg_mode, denom=_denom(loss_agg_mode, config),
    )
    return loss, _actor_metrics(metrics, "sao_")


def dora_decoupled(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                   rollout_is_weights=None):
    """Decoupled PPO with verl's behaviour weights (see ``dora_ext.algo.losses.ppo_policy_loss``)."""
    from dora_ext.algo.losses import ppo_policy_loss

    if config is None:
        raise ValueError("dora_decoupled: verl passed no actor config")
    low, high = _clip(config)
    loss, metrics = ppo_policy_loss(
        log_prob, old_log_prob, advantages, response_mask.float(),
        clip_low=low, clip_high=high, loss_agg_mode=loss_agg_mode,
        is_weights=rollout_is_weights, denom=_denom(loss_agg_mode, config),
    )
    out = _actor_metrics(metrics, "")
    out["actor/dora_is_weighted"] = 0.0 if rollout_is_weights is None else 1.0
    return loss, out


def register() -> None:
    """Put both losses into ``verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY``."""
    from verl.trainer.ppo.core_algos import register_policy_loss

    register_policy_loss("dora_sao")(dora_sao)
    register_policy_loss("dora_decoupled")(dora_decoupled)
