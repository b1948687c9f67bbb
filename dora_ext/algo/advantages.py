"""Advantage estimators and the value loss, as plain tensor functions.

Shapes: `[G, n]` for per-trajectory rewards (G groups of n trajectories), `[B, T]` for per-token
quantities of B sequences right-padded to T response tokens, with a 0/1 `mask` of the same shape
(1 = a real response token). Nothing here reads a config or owns state: the trainer passes numbers.

GRPO (n > 1, no critic) standardises each reward within its group (Dr.GRPO skips the division by
the std); SAO (n = 1) takes its baseline from a learned value V(s_t) and advantages from GAE.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dora_ext.algo.losses import agg_loss

__all__ = ["grpo_advantages", "token_rewards", "gae", "masked_whiten", "value_loss"]


def grpo_advantages(rewards: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-normalised advantages of GRPO (and Dr.GRPO with `norm_by_std=False`).

        A[g, i] = (r[g, i] - mean_j r[g, j]) / (std_j r[g, j] + eps)     (GRPO)
        A[g, i] =  r[g, i] - mean_j r[g, j]                              (Dr.GRPO)

    `std` is the unbiased sample std (divisor n - 1), as in verl's `grpo` estimator. A group of
    equal rewards gets advantages of exactly 0 (`eps` keeps the division finite).

    Args:
      rewards: `[G, n]` scalar rewards, one row per group, n >= 2.
    Returns:
      `[G, n]` advantages (broadcast them over a trajectory's tokens).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards: expected shape [groups, n], got {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        raise ValueError(
            f"rewards: GRPO needs n >= 2 trajectories per group, got n={rewards.shape[1]} "
            "(use the SAO estimator `gae` with a value model for n = 1)"
        )
    rewards = rewards.float()
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not norm_by_std:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Place each sequence's scalar reward on its last response token (outcome reward).

        out[b, t] = rewards[b]  if t is the last position with mask[b, t] = 1, else 0

    A sequence with no response token gets no reward anywhere (its row is all zeros).
    """
    if rewards.dim() != 1 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(
            f"rewards: expected shape [{mask.shape[0]}] to match mask {tuple(mask.shape)}, "
            f"got {tuple(rewards.shape)}"
        )
    mask = mask.float()
    t = mask.shape[1]
    # Index of the last 1 in each row: the largest position whose mask is set.
    positions = torch.arange(t, device=mask.device, dtype=mask.dtype).expand_as(mask)
    last = (positions * mask).argmax(dim=1)
    out = torch.zeros_like(mask)
    has_tokens = mask.sum(dim=1) > 0
    out[has_tokens, last[has_tokens]] = rewards.float()[has_tokens]
    return out


@torch.no_grad()
def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over response tokens (Schulman et al., 2016).

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t                       (the value target, "returns")

    where t runs over the positions with mask = 1 only: masked positions (padding, tool outputs)
    are skipped, carrying the next real token's value and advantage across, and get A = R = 0.
    After the last real token V_{t+1} = A_{t+1} = 0. With gamma = lam = 1 and an outcome reward
    this is A_t = R - V_t.

    Args:
      rewards, values, mask: `[B, T]`. `values[b, t]` is V of the state before response token t.
    Returns:
      (advantages, returns), both `[B, T]`, detached.
    """
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 2:
        raise ValueError(
            "gae: rewards, values and mask must share one [B, T] shape, got "
            f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
        )
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gae: gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")
    rewards, values, mask = rewards.float(), values.float(), mask.float()
    b, t = rewards.shape
    next_value = torch.zeros(b, device=rewards.device)
    next_adv = torch.zeros(b, device=rewards.device)
    adv = torch.zeros_like(rewards)
    for i in reversed(range(t)):
        m = mask[:, i]
        delta = rewards[:, i] + gamma * next_value - values[:, i]
        a = delta + gamma * lam * next_adv
        adv[:, i] = a * m
        # Carry the successor across masked positions unchanged.
        next_value = m * values[:, i] + (1 - m) * next_value
        next_adv = m * a + (1 - m) * next_adv
    returns = (adv + values) * mask
    return adv, returns


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / (std + eps) over the positions where mask = 1; zero elsewhere.

    It needs the whole batch, so the streaming trainer (R7) does not apply it.
    """
    mask = mask.float()
    count = mask.sum().clamp(min=1.0)
    mean = (x * mask).sum() / count
    var = (((x - mean) * mask) ** 2).sum() / count
    return (x - mean) / (var.sqrt() + eps) * mask


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_range: float | None = 0.2,
    *,
    loss_agg_mode: str = "token-mean",
    denom: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss of PPO.

        V_clip = V_old + clip(V - V_old, -c, c)
        loss_t = 0.5 * max((V - R)^2, (V_clip - R)^2)
        loss   = agg(loss_t, mask)            (`loss_agg_mode` and `denom` as in `losses.agg_loss`)

    `clip_range=None` gives the plain squared error.

    Returns:
      (loss, {"value_loss", "value_clipfrac", "value_mean"}).
    """
    mask = mask.float()
    err = (values - returns) ** 2
    if clip_range is None:
        per_token = 0.5 * err
        clipped = torch.zeros_like(err)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip_range, clip_range)
        err_clip = (v_clip - returns) ** 2
        per_token = 0.5 * torch.maximum(err, err_clip)
        clipped = (err_clip > err).float()
    loss = agg_loss(per_token, mask, loss_agg_mode, denom)
    n = max(float(mask.sum()), 1.0)
    metrics = {
        "value_loss": float(loss.detach()),
        "value_clipfrac": float((clipped * mask).sum()) / n,
        "value_mean": float((values.detach() * mask).sum()) / n,
    }
    return loss, metrics
