"""SAO's double-side masked loss and the staleness correction, in slime's loss plug points.

    --loss-type custom_loss --custom-loss-function-path dora_ext.slime.loss.sao_loss
    --use-tis --custom-tis-function-path dora_ext.slime.loss.staleness_tis   (staleness_correction: mask)

Correction `tis` is slime's own `--use-tis` (`vanilla_tis_function`); `mask` keeps in-band tokens at
weight 1 (unlike slime's `icepop_function`, which weighs them by w). The maths is
`dora_ext.algo.losses` (`double_side_mask`, `kl_penalty`); this module adapts slime's `[sum_i T_i]`
tensors and `sum_of_sample_mean`, and reads `--eps-clip`/`--eps-clip-high` and `dora_slime.is_cap`.
Only `sao_loss`'s first line needs Megatron (current log-probs); `sao_loss_from_log_probs` does not.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from ..algo.losses import double_side_mask, kl_penalty
from .settings import slime_settings


def sao_loss(
    args: Any, batch: dict, logits: Tensor, sum_of_sample_mean: Callable[[Tensor], Tensor]
) -> tuple[Tensor, dict[str, Tensor]]:
    """slime's custom-loss signature: `func(args, batch, logits, sum_of_sample_mean) -> (loss, log)`."""
    from slime.backends.megatron_utils.loss import get_log_probs_and_entropy, get_rollout_top_p_logprob_kwargs

    with_entropy = float(getattr(args, "entropy_coef", 0.0) or 0.0) != 0.0
    _, out = get_log_probs_and_entropy(
        logits,
        args=args,
        unconcat_tokens=batch["unconcat_tokens"],
        total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"],
        with_entropy=with_entropy,
        **get_rollout_top_p_logprob_kwargs(args, batch),
    )
    loss, log = sao_loss_from_log_probs(args, batch, out["log_probs"], sum_of_sample_mean,
                                        entropy=out.get("entropy") if with_entropy else None)
    if not out["log_probs"] or sum(lp.numel() for lp in out["log_probs"]) == 0:
        loss = loss + 0 * logits.sum()  # keep every rank in the backward graph, as slime does
    return loss, log


def sao_loss_from_log_probs(
    args: Any,
    batch: dict,
    log_probs: list[Tensor],
    sum_of_sample_mean: Callable[[Tensor], Tensor],
    *,
    entropy: list[Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAO's loss on slime's per-sample tensors.

        r_t  = pi_theta(a_t) / pi_rollout(a_t)
        M_t  = 1[1 - eps_low <= r_t <= 1 + eps_high]     (detached; eps = --eps-clip, --eps-clip-high)
        loss = sum_of_sample_mean(-A_t r_t M_t)
               - entropy_coef * sum_of_sample_mean(H_t M_t)        (slime's --entropy-coef)
               + kl_loss_coef * sum_of_sample_mean(KL_t)           (slime's --use-kl-loss)

    The entropy bonus acts on kept tokens only, as in `dora_ext.algo`; KL_t is slime's
    `--kl-loss-type` estimator (k1, k2, k3, low_var_kl) of pi_theta against `ref_log_probs`,
    times pi_theta / pi_old with `--use-unbiased-kl`.

    `batch` needs `advantages`, `rollout_log_probs` and `loss_masks` (slime fills them; SGLang
    returns the rollout log-probs with every sample).
    """
    if "rollout_log_probs" not in batch or not batch["rollout_log_probs"]:
        raise ValueError("batch['rollout_log_probs']: SAO's ratio is against the rollout policy; none in the batch")
    logp = torch.cat(log_probs, dim=0)
    rollout_logp = torch.cat(batch["rollout_log_probs"], dim=0).to(logp.dtype)
    adv = torch.cat(batch["advantages"], dim=0).to(logp.dtype).detach()
    mask = torch.cat(batch["loss_masks"], dim=0).to(logp.dtype)
    if not (logp.shape == rollout_logp.shape == adv.shape):
        raise ValueError(
            f"log_probs {tuple(logp.shape)}, rollout_log_probs {tuple(rollout_logp.shape)} and advantages "
            f"{tuple(adv.shape)} must line up token by token"
        )
    eps_low = float(getattr(args, "eps_clip", 0.2))
    eps_high = getattr(args, "eps_clip_high", None)
    eps_high = eps_low if eps_high is None else float(eps_high)
    ratio = torch.exp((logp - rollout_logp.detach()).clamp(-20.0, 20.0))
    keep = double_side_mask(ratio.detach(), mask if mask.shape == ratio.shape else torch.ones_like(ratio),
                            eps_low, eps_high)
    pg_loss = sum_of_sample_mean(-adv * ratio * keep)
    loss = pg_loss
    log = {
        "pg_loss": pg_loss.clone().detach(),
        "sao_masked_frac": sum_of_sample_mean(1.0 - keep).detach(),
        "sao_ratio": sum_of_sample_mean(ratio.detach()),
    }
    entropy_coef = float(getattr(args, "entropy_coef", 0.0) or 0.0)
    if entropy_coef != 0.0:
        if entropy is None:
            raise ValueError("entropy: --entropy-coef is set but no per-token entropy was computed")
        entropy_loss = sum_of_sample_mean(torch.cat(entropy, dim=0).to(logp.dtype) * keep)
        loss = loss - entropy_coef * entropy_loss
        log["entropy_loss"] = entropy_loss.clone().detach()
    if getattr(args, "use_kl_loss", False):
        if not batch.get("ref_log_probs"):
            raise ValueError("batch['ref_log_probs']: --use-kl-loss needs the reference model's log-probs")
        ref = torch.cat(batch["ref_log_probs"], dim=0).to(logp.dtype).detach()
        kind = getattr(args, "kl_loss_type", "k1")
        if kind in ("k1", "k2", "k3", "low_var_kl"):
            kl = kl_penalty(logp, ref, "k3" if kind == "low_var_kl" else kind)
        else:
            raise ValueError(f"kl_loss_type: unknown KL estimator {kind!r}; accepted: k1, k2, k3, low_var_kl")
        if getattr(args, "use_unbiased_kl", False):
            old = batch["rollout_log_probs"] if getattr(args, "use_rollout_logprobs", False) else batch.get("log_probs")
            old_t = torch.cat(old, dim=0).to(logp.dtype).detach() if old else rollout_logp.detach()
            kl = torch.exp(logp - old_t) * kl
        if kind == "low_var_kl":
            # slime's compute_approx_kl clamps the estimate after the importance ratio.
            kl = kl.clamp(-10.0, 10.0)
        kl_loss = sum_of_sample_mean(kl)
        loss = loss + float(getattr(args, "kl_loss_coef", 0.0)) * kl_loss
        log["kl_loss"] = kl_loss.clone().detach()
    log = {"loss": loss.clone().detach(), **log}
    return loss, log


def staleness_tis(
    args: Any,
    *,
    pg_loss: Tensor,
    train_log_probs: list[Tensor],
    rollout_log_probs: list[Tensor],
    loss_masks: list[Tensor],
    total_lengths: list[int] | None = None,
    response_lengths: list[int] | None = None,
    **kwargs: Any,
) -> tuple[Tensor, list[Tensor], dict[str, Tensor]]:
    """slime's TIS signature: `fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks,
    total_lengths, response_lengths) -> (pg_loss, masks, metrics)`.

    Tokens of a stale group were sampled by version v_group, the trainer's PPO anchor is pi_old;
    with w_t = pi_old(a_t) / pi_rollout(a_t), tokens with w_t outside [1/C, C] leave the loss
    (their mask is zeroed), C = `dora_slime.is_cap`. Metrics are per-token tensors, reduced by slime.
    """
    settings = slime_settings(args)
    if settings.staleness_correction != "mask":
        raise ValueError(f"staleness_tis is staleness_correction 'mask', got {settings.staleness_correction!r}: "
                         "'tis' is slime's own --use-tis (as dora-ext slime-args prints it)")
    cap = settings.is_cap
    old = torch.cat(train_log_probs, dim=0).detach()
    behav = torch.cat(rollout_log_probs, dim=0).to(old.dtype).detach()
    if old.shape != behav.shape or old.shape != pg_loss.shape:
        raise ValueError(
            f"train_log_probs {tuple(old.shape)}, rollout_log_probs {tuple(behav.shape)} and pg_loss "
            f"{tuple(pg_loss.shape)} must line up token by token"
        )
    ones = torch.ones_like(old)
    raw = torch.exp((old - behav).clamp(-20.0, 20.0))
    metrics = {"dora_is_weight": raw.clone(), "dora_is_over_cap": (raw > cap).to(old.dtype)}
    keep = double_side_mask(raw, ones, 1.0 - 1.0 / cap, cap - 1.0)
    metrics["dora_is_masked"] = 1.0 - keep
    masks = []
    offset = 0
    for m in loss_masks:
        k = keep[offset: offset + m.numel()]
        offset += m.numel()
        masks.append(m * k.to(m.dtype).reshape(m.shape))
    if offset != keep.numel():
        raise ValueError(
            f"loss_masks cover {offset} tokens, log-probs {keep.numel()}: staleness_correction 'mask' "
            "needs per-sample masks aligned with the log-probs (context-parallel size 1)"
        )
    return pg_loss * keep.to(pg_loss.dtype), masks, metrics
