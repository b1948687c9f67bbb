"""Policy losses against values computed by hand (the numbers are written out in the comments)."""

import math

import pytest
import torch

from dora_ext.algo.losses import (
    agg_loss,
    decoupled_ppo_loss,
    double_side_mask,
    entropy_from_logits,
    kl_penalty,
    ppo_policy_loss,
    sao_policy_loss,
    tis_ppo_loss,
    truncated_is_pg_loss,
    truncated_is_weights,
)

RATIOS = [1.5, 0.5, 1.0, 1.1]


def _logp(ratios):
    """Leaf log-probs whose ratio against old_logp = 0 is `ratios`."""
    return torch.log(torch.tensor([ratios])).requires_grad_(True)


def test_agg_modes():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert agg_loss(per_token, mask, "token-mean").item() == 2.5  # (1+2+3+4)/4
    assert agg_loss(per_token, mask, "seq-mean-token-mean").item() == 3.0  # (2 + 4)/2, empty row skipped
    assert agg_loss(per_token, mask, "token-mean", denom=1.0).item() == 10.0
    assert agg_loss(per_token, mask, "seq-mean-token-mean", denom=1.0).item() == 6.0
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(per_token, mask, "seq-sum")


def test_ppo_clip_positive_advantage():
    # A = +1: l = max(-r, -clip(r, 0.8, 1.2)) = [-1.2 (clipped), -0.5, -1.0, -1.1]; mean = -0.95.
    # Gradient d l / d logp = -r where the unclipped term is active, 0 where clipped; / 4 tokens.
    logp = _logp(RATIOS)
    loss, m = ppo_policy_loss(logp, torch.zeros(1, 4), torch.tensor([1.0]), torch.ones(1, 4), clip_low=0.2)
    assert math.isclose(loss.item(), -0.95, rel_tol=1e-6)
    assert m["pg_clipfrac"] == 0.25
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.125, -0.25, -0.275]]))


def test_ppo_clip_negative_advantage():
    # A = -1: l = max(r, clip(r, 0.8, 1.2)) = [1.5, 0.8 (clipped), 1.0, 1.1]; mean = 1.1.
    logp = _logp(RATIOS)
    loss, m = ppo_policy_loss(logp, torch.zeros(1, 4), torch.tensor([-1.0]), torch.ones(1, 4), clip_low=0.2)
    assert math.isclose(loss.item(), 1.1, rel_tol=1e-6)
    assert m["pg_clipfrac"] == 0.25
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.375, 0.0, 0.25, 0.275]]))


def test_ppo_clip_higher_and_padding():
    # clip_high 0.28: r = 1.25 is inside (-1.25), r = 1.5 is clipped to 1.28; the padded token
    # (ratio 9) is ignored. mean = -(1.25 + 1.28)/2 = -1.265
    logp = _logp([1.25, 1.5, 9.0])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = ppo_policy_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.28)
    assert math.isclose(loss.item(), -1.265, rel_tol=1e-6)
    assert m["pg_clipfrac"] == 0.5


def test_truncated_is_weights():
    # pi_old / pi_behav = [0.5, 1, 3] with C = 2 -> w = [0.5, 1, 2]; one token of three truncated.
    old = torch.log(torch.tensor([[0.5, 1.0, 3.0]]))
    w, m = truncated_is_weights(old, torch.zeros(1, 3), torch.ones(1, 3), cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0, 2.0]]))
    assert not w.requires_grad
    assert math.isclose(m["is_truncated_frac"], 1 / 3, rel_tol=1e-6)
    assert math.isclose(m["is_weight_mean"], 3.5 / 3, rel_tol=1e-6)


def test_tis_ppo_loss_weights_and_detaches():
    # pi_theta = pi_old (ratio 1), A = +1: l = -w = [-0.5, -1, -2]; loss = -3.5/3; grad = -w/3.
    old = torch.log(torch.tensor([[0.2, 0.3, 0.6]]))
    behav = torch.log(torch.tensor([[0.4, 0.3, 0.2]]))  # pi_old/pi_behav = [0.5, 1, 3]
    old.requires_grad_(True)
    logp = old.detach().clone().requires_grad_(True)
    loss, m = tis_ppo_loss(logp, old, behav, torch.tensor([1.0]), torch.ones(1, 3), cap=2.0)
    assert math.isclose(loss.item(), -3.5 / 3, rel_tol=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5 / 3, -1.0 / 3, -2.0 / 3]]))
    assert old.grad is None  # the weight and the anchor are constants
    assert math.isclose(m["is_truncated_frac"], 1 / 3, rel_tol=1e-6)


def test_decoupled_ppo_truncate_mask_and_uncapped():
    # Token 0: pi_theta/pi_prox = 1.5 (clipped to 1.2 for A=+1), pi_prox/pi_behav = 0.5 -> 0.5 * -1.2 = -0.6
    # Token 1: pi_theta/pi_prox = 1, pi_prox/pi_behav = 4:
    #   truncate at 2 -> -2 ; mask -> 0 ; uncapped -> -4
    prox = torch.log(torch.tensor([[0.2, 0.4]]))
    behav = torch.log(torch.tensor([[0.4, 0.1]]))
    logp = torch.log(torch.tensor([[0.3, 0.4]]))
    args = (logp, prox, behav, torch.tensor([1.0]), torch.ones(1, 2))
    loss, m = decoupled_ppo_loss(*args, cap=2.0, cap_mode="truncate")
    assert math.isclose(loss.item(), (-0.6 - 2.0) / 2, rel_tol=1e-6)
    assert m["pg_clipfrac"] == 0.5 and m["is_truncated_frac"] == 0.5
    loss, m = decoupled_ppo_loss(*args, cap=2.0, cap_mode="mask")
    assert math.isclose(loss.item(), -0.6 / 2, rel_tol=1e-6)
    assert math.isclose(m["is_weight_mean"], 0.25, rel_tol=1e-6)  # (0.5 + 0) / 2
    loss, _ = decoupled_ppo_loss(*args, cap=None)
    assert math.isclose(loss.item(), (-0.6 - 4.0) / 2, rel_tol=1e-6)
    with pytest.raises(ValueError, match="cap_mode"):
        decoupled_ppo_loss(*args, cap_mode="drop")


def test_truncated_is_pg_loss():
    # r = pi_theta/pi_behav = [0.25/0.5, 0.3/0.1] = [0.5, 3] -> w = [0.5, 2]; A = [1, -1]
    # loss = mean(-w A logp) = (-0.5 log 0.25 + 2 log 0.3) / 2 = -0.8573992 ; grad = -w A / 2 = [-0.25, 1]
    logp = torch.log(torch.tensor([[0.25, 0.3]])).requires_grad_(True)
    behav = torch.log(torch.tensor([[0.5, 0.1]]))
    loss, m = truncated_is_pg_loss(logp, behav, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), cap=2.0)
    assert math.isclose(loss.item(), -0.8573992, rel_tol=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, 1.0]]))
    assert m["is_truncated_frac"] == 0.5


SAO_RATIOS = [0.7, 0.9, 1.0, 1.25, 1.5]  # band [0.8, 1.2]: keep 0.9 and 1.0, zero the other three


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_sao_mask_zeroes_tokens_outside_band_for_both_signs(sign):
    # l = -A r M: A=+1 -> [0, -0.9, -1, 0, 0], mean -0.38 ; A=-1 -> +0.38. Grad = -A r M / 5.
    logp = _logp(SAO_RATIOS)
    loss, m = sao_policy_loss(logp, torch.zeros(1, 5), torch.tensor([sign]), torch.ones(1, 5),
                              eps_low=0.2, eps_high=0.2)
    assert math.isclose(loss.item(), -sign * 0.38, rel_tol=1e-6)
    assert math.isclose(m["masked_frac"], 0.6, rel_tol=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, -sign * torch.tensor([[0.0, 0.18, 0.2, 0.0, 0.0]]))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_ppo_clip_depends_on_sign_unlike_sao(sign):
    # The same ratios under PPO: A=+1 keeps a gradient at r=0.7 (and drops 1.25, 1.5);
    # A=-1 keeps 1.25 and 1.5 (and drops 0.7). SAO drops all three either way (test above).
    logp = _logp(SAO_RATIOS)
    loss, _ = ppo_policy_loss(logp, torch.zeros(1, 5), torch.tensor([sign]), torch.ones(1, 5), clip_low=0.2)
    loss.backward()
    alive = (logp.grad != 0).squeeze(0).tolist()
    assert alive == ([True, True, True, False, False] if sign > 0 else [False, True, True, True, True])


def test_sao_asymmetric_band_and_padding():
    # eps_high 0.3: 1.25 now kept; padded token (ratio 0.1) does not count as masked.
    logp = _logp([0.7, 1.25, 1.5, 0.1])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, m = sao_policy_loss(logp, torch.zeros(1, 4), torch.tensor([1.0]), mask, eps_low=0.2, eps_high=0.3)
    assert math.isclose(loss.item(), -1.25 / 3, rel_tol=1e-6)
    assert math.isclose(m["masked_frac"], 2 / 3, rel_tol=1e-6)


def test_double_side_mask_direct():
    keep = double_side_mask(torch.tensor([[0.5, 0.85, 1.1, 1.3]]), torch.tensor([[1, 1, 1, 0]]), 0.2, 0.2)
    assert keep.tolist() == [[0.0, 1.0, 1.0, 0.0]]
    with pytest.raises(ValueError, match="eps_low"):
        double_side_mask(torch.ones(1, 1), torch.ones(1, 1), -0.1, 0.2)


def test_entropy_and_kl():
    ent = entropy_from_logits(torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, -1e9, -1e9, -1e9]]))
    torch.testing.assert_close(ent, torch.tensor([1.3862944, 0.0]))  # log 4, 0
    logp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))  # log r = log 2
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([0.6931472]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([0.2402265]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([0.1931472]))  # 0.5 - 1 + log 2
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(logp, ref, "k4")


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match="advantages"):
        ppo_policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="old_logp"):
        ppo_policy_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
