"""SAO's loss and the staleness correction in slime's loss plug points. slime is ABSENT in CI.

slime's tensors are per-sample 1-D lists, concatenated along tokens and reduced by the
`sum_of_sample_mean` slime builds; `slime_sum_of_sample_mean` below is that reduction as slime
documents it for context-parallel size 1 (sum over samples of each sample's masked token mean).
The maths is checked against `dora_ext.algo.losses`, which the adapter reuses.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dora_ext.algo.losses import sao_policy_loss
from dora_ext.slime.loss import sao_loss_from_log_probs, staleness_tis


def slime_sum_of_sample_mean(lengths, masks):
    def reduce(x):
        return sum((xi * mi).sum() / mi.sum().clamp(min=1) for xi, mi in zip(x.split(lengths), masks))

    return reduce


def _batch(B=3, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (torch.randn(B, T, generator=g) * 0.3 - 1.0).requires_grad_(True)
    rollout = (logp.detach() + torch.randn(B, T, generator=g) * 0.4)
    adv = torch.randn(B, generator=g)
    masks = [torch.ones(T) for _ in range(B)]
    masks[1][-2:] = 0
    batch = {
        "advantages": [adv[i].expand(T).clone() for i in range(B)],
        "rollout_log_probs": list(rollout.unbind(0)),
        "loss_masks": masks,
    }
    return logp, rollout, adv, torch.stack(masks), batch


def test_sao_loss_matches_the_algo_loss_summed_over_samples():
    logp, rollout, adv, mask, batch = _batch()
    args = SimpleNamespace(eps_clip=0.2, eps_clip_high=0.28)
    reduce = slime_sum_of_sample_mean([5, 5, 5], batch["loss_masks"])
    loss, log = sao_loss_from_log_probs(args, batch, list(logp.unbind(0)), reduce)
    ref, _ = sao_policy_loss(logp, rollout, adv, mask, eps_low=0.2, eps_high=0.28, loss_agg_mode="seq-mean-token-mean")
    assert torch.allclose(loss, ref * 3, atol=1e-6)
    assert 0.0 < float(log["sao_masked_frac"]) < 3.0  # some tokens left the band in this batch


def test_sao_loss_gives_no_gradient_to_tokens_outside_the_band():
    logp, rollout, adv, mask, batch = _batch(seed=1)
    args = SimpleNamespace(eps_clip=0.1, eps_clip_high=None)
    loss, _ = sao_loss_from_log_probs(args, batch, list(logp.unbind(0)),
                                      slime_sum_of_sample_mean([5, 5, 5], batch["loss_masks"]))
    loss.backward()
    ratio = torch.exp(logp.detach() - rollout)
    outside = (ratio < 0.9) | (ratio > 1.1)
    assert outside.any() and (~outside).any()
    assert torch.all(logp.grad[outside] == 0)
    assert torch.all(logp.grad[~outside & (mask > 0)] != 0)


def test_sao_loss_needs_rollout_log_probs():
    logp, _, _, _, batch = _batch()
    batch["rollout_log_probs"] = []
    with pytest.raises(ValueError, match="rollout_log_probs"):
        sao_loss_from_log_probs(SimpleNamespace(), batch, list(logp.unbind(0)), lambda x: x.sum())


def _tis_inputs():
    old = [torch.tensor([-1.0, -1.0, -1.0]), torch.tensor([-2.0, -0.5])]
    behav = [torch.tensor([-1.0, -2.0, -0.2]), torch.tensor([-2.0, -0.5])]
    pg = torch.ones(5)
    masks = [torch.ones(3), torch.ones(2)]
    return old, behav, pg, masks


def test_staleness_correction_mask():
    old, behav, pg, masks = _tis_inputs()
    args = SimpleNamespace(dora_slime={"staleness_correction": "mask", "is_cap": 2.0})
    out, new_masks, metrics = staleness_tis(args, pg_loss=pg, train_log_probs=old, rollout_log_probs=behav,
                                            loss_masks=masks, total_lengths=[6, 4], response_lengths=[3, 2])
    w = torch.exp(torch.cat(old) - torch.cat(behav))  # [1, e, e^-0.8, 1, 1]
    assert torch.allclose(metrics["dora_is_weight"], w)
    keep = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])  # e > 2 and e^-0.8 < 1/2 leave [1/2, 2]
    assert torch.equal(out, keep)
    assert torch.equal(torch.cat(new_masks), keep)


def test_correction_tis_is_slimes_own_truncated_is():
    """Correction `tis` prints slime's `--use-tis` with the cap as `--tis-clip` (slime's `vanilla_tis_function`: pg_loss
    * clamp(w, 0, C)); with a slime checkout, that function gives min(w, C) on the same tensors."""
    from dora_ext.slime.cli import slime_flags

    flags = slime_flags({"dora": {"mode": "dora", "max_staleness": 2}, "dora_slime": {"is_cap": 3.0},
                         "custom_rollout_weight_reload_path": "dora_ext.slime.weights.publish_weights"}, None, "/w")
    assert "--custom-tis-function-path" not in flags
    assert flags[flags.index("--tis-clip") + 1] == "3.0" and flags[flags.index("--tis-clip-low") + 1] == "0"
    with pytest.raises(ValueError, match="slime's own --use-tis"):
        staleness_tis(SimpleNamespace(), pg_loss=torch.ones(1), train_log_probs=[torch.zeros(1)],
                      rollout_log_probs=[torch.zeros(1)], loss_masks=[torch.ones(1)])
    slime_loss = pytest.importorskip("slime.backends.megatron_utils.loss", reason="needs slime and Megatron")
    old, behav, pg, masks = _tis_inputs()
    out, _, _ = slime_loss.vanilla_tis_function(SimpleNamespace(tis_clip=2.0, tis_clip_low=0.0), pg_loss=pg,
                                                train_log_probs=old, rollout_log_probs=behav, loss_masks=masks)
    assert torch.allclose(out, torch.exp(torch.cat(old) - torch.cat(behav)).clamp(max=2.0))


def test_staleness_correction_rejects_misaligned_tensors():
    old, behav, pg, masks = _tis_inputs()
    with pytest.raises(ValueError, match="line up"):
        staleness_tis(SimpleNamespace(dora_slime={"staleness_correction": "mask"}), pg_loss=torch.ones(4),
                      train_log_probs=old, rollout_log_probs=behav, loss_masks=masks)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_sao_loss_adds_slimes_kl_and_entropy_terms(kind):
    """Defect 7: `--use-kl-loss` and `--entropy-coef` were silently dropped by `sao_loss`. The
    entropy bonus acts on the tokens SAO's mask keeps only, as `dora_ext.algo`'s trainer applies it
    (`agg_loss(H * keep, mask)`): no entropy gradient reaches a dropped token (issue 22)."""
    from dora_ext.algo.losses import agg_loss, double_side_mask, kl_penalty

    logp, rollout, adv, mask, batch = _batch(seed=2)
    g = torch.Generator().manual_seed(3)
    ref = logp.detach() + torch.randn(logp.shape, generator=g) * 0.3
    ent = torch.rand(logp.shape, generator=g).requires_grad_(True)
    batch["ref_log_probs"] = list(ref.unbind(0))
    reduce = slime_sum_of_sample_mean([5, 5, 5], batch["loss_masks"])
    base, _ = sao_loss_from_log_probs(SimpleNamespace(eps_clip=0.2), batch, list(logp.unbind(0)), reduce)
    args = SimpleNamespace(eps_clip=0.2, use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type=kind, entropy_coef=0.01)
    loss, log = sao_loss_from_log_probs(args, batch, list(logp.unbind(0)), reduce, entropy=list(ent.unbind(0)))
    kl = kl_penalty(logp.detach(), ref, "k3" if kind == "low_var_kl" else kind)
    if kind == "low_var_kl":
        kl = kl.clamp(-10, 10)
    keep = double_side_mask(torch.exp(logp.detach() - rollout), mask, 0.2, 0.2)
    bonus = agg_loss(ent.detach() * keep, mask, "seq-mean-token-mean") * 3
    assert 0 < keep.sum() < mask.sum() and torch.allclose(log["entropy_loss"], bonus, atol=1e-6)
    expected = base - 0.01 * bonus + 0.5 * reduce(kl.reshape(-1))
    assert torch.allclose(loss, expected, atol=1e-6)
    loss.backward()
    assert torch.all(ent.grad[keep == 0] == 0) and torch.all(ent.grad[keep > 0] != 0)
    assert torch.allclose(log["kl_loss"], reduce(kl.reshape(-1)), atol=1e-6)
    assert "entropy_loss" in log and torch.allclose(log["loss"], loss.detach())
    with pytest.raises(ValueError, match="ref_log_probs"):
        del batch["ref_log_probs"]
        sao_loss_from_log_probs(args, batch, list(logp.unbind(0)), reduce, entropy=list(ent.unbind(0)))
