"""Policy losses: PPO clipping, off-policy corrections for stale samples, SAO's double-side mask.

Every loss takes per-token tensors `[B, T]` (log-probs of the sampled response tokens under the
policies involved, and a 0/1 `mask` of real response tokens), advantages `[B, T]` or `[B]`, and
returns `(loss, metrics)`: a scalar tensor to back-propagate and a dict of plain floats.

Policies: pi_theta is trained (`logp`, the only tensor with gradients); pi_behav / pi_rollout
generated the tokens (`behaviour_logp` / `rollout_logp`, from the engine); pi_old / pi_prox is the
trainer's weights before this update (the PPO anchor), which differs from pi_behav for stale data.

Aggregation (`loss_agg_mode`):

* "token-mean":           sum_{b,t} l[b,t] m[b,t] / sum_{b,t} m[b,t]
* "seq-mean-token-mean":  mean over sequences b (with >= 1 token) of sum_t l[b,t] m[b,t] / sum_t m[b,t]

`denom` replaces the outer mean's divisor: a streaming trainer (R7) passes `denom=1` and divides
the accumulated gradient by the whole batch's divisor at the end, which equals the batch mean.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["LOSS_AGG_MODES", "masked_mean", "agg_loss", "ppo_policy_loss", "truncated_is_weights",
           "tis_ppo_loss", "decoupled_ppo_loss", "truncated_is_pg_loss", "double_side_mask",
           "sao_policy_loss", "entropy_from_logits", "kl_penalty"]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean")

# exp() of a log-ratio beyond this overflows float32 long before it means anything.
_MAX_LOG_RATIO = 20.0


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """sum(x * mask) / max(sum(mask), 1)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def agg_loss(per_token: Tensor, mask: Tensor, mode: str = "token-mean", denom: float | None = None) -> Tensor:
    """Reduce a `[B, T]` per-token loss to a scalar (see the module docstring for the formulas)."""
    mask = mask.to(per_token.dtype)
    if mode == "token-mean":
        total = (per_token * mask).sum()
        d = mask.sum().clamp(min=1.0) if denom is None else denom
        return total / d
    if mode == "seq-mean-token-mean":
        count = mask.sum(dim=-1)
        seq_mean = (per_token * mask).sum(dim=-1) / count.clamp(min=1.0)
        d = (count > 0).sum().clamp(min=1).to(per_token.dtype) if denom is None else denom
        return seq_mean.sum() / d
    raise ValueError(f"loss_agg_mode: unknown mode {mode!r}; accepted: {', '.join(LOSS_AGG_MODES)}")


def _check(logp: Tensor, mask: Tensor, advantages: Tensor, **others: Tensor) -> Tensor:
    """Shape checks shared by the losses; returns advantages broadcast to `[B, T]`."""
    if logp.dim() != 2 or mask.shape != logp.shape:
        raise ValueError(f"logp, mask: expected one [B, T] shape, got {tuple(logp.shape)}, {tuple(mask.shape)}")
    for name, t in others.items():
        if t.shape != logp.shape:
            raise ValueError(f"{name}: expected shape {tuple(logp.shape)}, got {tuple(t.shape)}")
    bad = f"advantages: expected [{logp.shape[0]}] or {tuple(logp.shape)}, got {tuple(advantages.shape)}"
    if advantages.dim() == 1:
        if advantages.shape[0] != logp.shape[0]:
            raise ValueError(bad)
        advantages = advantages[:, None].expand_as(logp)
    elif advantages.shape != logp.shape:
        raise ValueError(bad)
    return advantages.detach().to(logp.dtype)


def _ratio(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return torch.exp((logp - ref_logp.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))


def _frac(x: Tensor, mask: Tensor) -> float:
    return float(masked_mean(x.float().detach(), mask.float()))


def ppo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    loss_agg_mode: str = "token-mean",
    is_weights: Tensor | None = None,
    denom: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped surrogate (Schulman et al., 2017), as a loss to minimise.

        r_t    = pi_theta(a_t) / pi_old(a_t) = exp(logp_t - old_logp_t)
        l_t    = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))
        loss   = agg(l, mask)

    `clip_high` defaults to `clip_low`; a larger `clip_high` is DAPO's clip-higher. `w_t` are
    optional detached per-token importance weights (1 without them).

    Metrics: `pg_loss`, `pg_clipfrac` (share of tokens where the clipped term is active), `ratio_mean`.
    """
    advantages = _check(logp, mask, advantages, old_logp=old_logp)
    if clip_high is None:
        clip_high = clip_low
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low, clip_high: expected >= 0, got {clip_low}, {clip_high}")
    ratio = _ratio(logp, old_logp)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(pg1, pg2)
    if is_weights is not None:
        if is_weights.shape != logp.shape:
            raise ValueError(f"is_weights: expected shape {tuple(logp.shape)}, got {tuple(is_weights.shape)}")
        per_token = per_token * is_weights.detach()
    loss = agg_loss(per_token, mask, loss_agg_mode, denom)
    metrics = {
        "pg_loss": float(loss.detach()),
        "pg_clipfrac": _frac(pg2 > pg1, mask),
        "ratio_mean": _frac(ratio, mask),
    }
    return loss, metrics


def truncated_is_weights(
    old_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, cap: float = 2.0
) -> tuple[Tensor, dict[str, float]]:
    """Truncated importance-sampling weights (TIS), detached.

        w_t = min(pi_old(a_t) / pi_behav(a_t), C)

    Re-weights tokens sampled from pi_behav to PPO's expectation under pi_old; truncating at C
    bounds the variance at a small bias (Espeholt et al. 2018; Yao et al. 2025).

    Metrics: `is_weight_mean`, `is_truncated_frac` (share of tokens with ratio > C).
    """
    if cap <= 0:
        raise ValueError(f"cap: expected > 0, got {cap}")
    raw = _ratio(old_logp.detach(), behaviour_logp)
    w = raw.clamp(max=cap).detach()
    metrics = {"is_weight_mean": _frac(w, mask), "is_truncated_frac": _frac(raw > cap, mask)}
    return w, metrics


def tis_ppo_loss(
    logp: Tensor,
    old_logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    cap: float = 2.0,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    loss_agg_mode: str = "token-mean",
    denom: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO with truncated importance sampling for stale or mismatched samples.

        w_t  = sg(min(pi_old(a_t) / pi_behav(a_t), C))          (sg = stop-gradient)
        l_t  = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high)),  r_t = pi_theta / pi_old

    Metrics: those of `ppo_policy_loss` and `truncated_is_weights`.
    """
    w, w_metrics = truncated_is_weights(old_logp, behaviour_logp, mask, cap)
    loss, metrics = ppo_policy_loss(
        logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high,
        loss_agg_mode=loss_agg_mode, is_weights=w, denom=denom,
    )
    return loss, {**metrics, **w_metrics}


def decoupled_ppo_loss(
    logp: Tensor,
    prox_logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    cap: float | None = 2.0,
    cap_mode: str = "truncate",
    clip_low: float = 0.2,
    clip_high: float | None = None,
    loss_agg_mode: str = "token-mean",
    denom: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Decoupled PPO (Hilton et al. 2022; AReaL's asynchronous PPO).

        r_t  = pi_theta(a_t) / pi_prox(a_t)                      (trust region around pi_prox)
        w_t  = sg(pi_prox(a_t) / pi_behav(a_t))                  (off-policy correction)
        l_t  = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))

    pi_prox anchors the clip, so a stale batch still gets a full trust region; pi_behav only
    enters through the importance weight. `cap` bounds w: `cap_mode="truncate"` uses min(w, cap)
    (= `tis_ppo_loss` with pi_old = pi_prox); `cap_mode="mask"` drops tokens with w > cap (AReaL's
    `behav_imp_weight_cap`). `cap=None` keeps w untouched.

    Metrics: those of `ppo_policy_loss`, plus `is_weight_mean` and `is_truncated_frac`.
    """
    if cap_mode not in ("truncate", "mask"):
        raise ValueError(f"cap_mode: unknown mode {cap_mode!r}; accepted: truncate, mask")
    raw = _ratio(prox_logp.detach(), behaviour_logp)
    if cap is None:
        w, over = raw, torch.zeros_like(raw, dtype=torch.bool)
    else:
        if cap <= 0:
            raise ValueError(f"cap: expected > 0 or None, got {cap}")
        over = raw > cap
        w = raw.clamp(max=cap) if cap_mode == "truncate" else torch.where(over, torch.zeros_like(raw), raw)
    loss, metrics = ppo_policy_loss(
        logp, prox_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high,
        loss_agg_mode=loss_agg_mode, is_weights=w.detach(), denom=denom,
    )
    metrics.update(is_weight_mean=_frac(w, mask), is_truncated_frac=_frac(over, mask))
    return loss, metrics


def truncated_is_pg_loss(
    logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    cap: float = 2.0,
    loss_agg_mode: str = "token-mean",
    denom: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Importance-sampled policy gradient with the weight pi_theta / pi_behav truncated, no PPO clip.

        w_t  = sg(min(pi_theta(a_t) / pi_behav(a_t), C))
        l_t  = -w_t * A_t * log pi_theta(a_t)

    The gradient is exact while r <= C and bounded beyond; no token is ever silenced (V-trace /
    CISPO).

    Metrics: `pg_loss`, `is_weight_mean`, `is_truncated_frac`.
    """
    advantages = _check(logp, mask, advantages, behaviour_logp=behaviour_logp)
    if cap <= 0:
        raise ValueError(f"cap: expected > 0, got {cap}")
    raw = _ratio(logp.detach(), behaviour_logp)
    w = raw.clamp(max=cap)
    per_token = -w * advantages * logp
    loss = agg_loss(per_token, mask, loss_agg_mode, denom)
    metrics = {
        "pg_loss": float(loss.detach()),
        "is_weight_mean": _frac(w, mask),
        "is_truncated_frac": _frac(raw > cap, mask),
    }
    return loss, metrics


def double_side_mask(ratio: Tensor, mask: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """SAO's keep-mask: 1 where 1 - eps_low <= ratio <= 1 + eps_high and mask = 1, else 0.

    The band is closed; the advantage plays no part (contrast with PPO's one-sided clip).
    """
    if eps_low < 0 or eps_high < 0 or eps_low > 1:
        raise ValueError(f"eps_low, eps_high: expected 0 <= eps_low <= 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    inside = (ratio >= 1.0 - eps_low) & (ratio <= 1.0 + eps_high)
    return (inside & (mask > 0)).to(ratio.dtype).detach()


def sao_policy_loss(
    logp: Tensor,
    rollout_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    loss_agg_mode: str = "token-mean",
    denom: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """SAO's strict double-side token-level masking (single-rollout asynchronous optimisation).

        r_t  = pi_theta(a_t) / pi_rollout(a_t)
        M_t  = 1[1 - eps_low <= r_t <= 1 + eps_high]             (detached)
        l_t  = -A_t * r_t * M_t
        loss = agg(l, mask)                                       (masked tokens stay in the divisor)

    Unlike PPO's one-sided clip, every token whose ratio against pi_rollout leaves the band is
    zeroed whatever the sign of A, so staleness itself pushes tokens out of the band.

    Metrics: `pg_loss`, `masked_frac` (share of real tokens zeroed), `ratio_mean`.
    """
    advantages = _check(logp, mask, advantages, rollout_logp=rollout_logp)
    ratio = _ratio(logp, rollout_logp)
    keep = double_side_mask(ratio.detach(), mask, eps_low, eps_high)
    per_token = -advantages * ratio * keep
    loss = agg_loss(per_token, mask, loss_agg_mode, denom)
    metrics = {
        "pg_loss": float(loss.detach()),
        "masked_frac": _frac((mask > 0).float() - keep, mask),
        "ratio_mean": _frac(ratio, mask),
    }
    return loss, metrics


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at each position: H = logsumexp(z) - sum softmax(z) z."""
    logits = logits.float()
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimators of KL(pi_theta || pi_ref) from log-probs of sampled tokens (Schulman's k1-k3).

        k1 = log r                       (unbiased, can be negative)
        k2 = 0.5 (log r)^2
        k3 = exp(-log r) - 1 + log r     (unbiased, >= 0; GRPO's choice)
    with log r = logp - ref_logp.
    """
    log_r = logp - ref_logp
    if kind == "k1":
        return log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        neg = (-log_r).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return torch.exp(neg) - 1 + log_r
    raise ValueError(f"kind: unknown KL estimator {kind!r}; accepted: k1, k2, k3")
