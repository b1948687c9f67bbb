"""Advantage estimators and the value loss against values computed by hand (written out below)."""

import math

import pytest
import torch

from dora_ext.algo.advantages import gae, grpo_advantages, masked_whiten, token_rewards, value_loss


def test_grpo_two_groups_hand_values():
    # Group 0: [1, 0, 1, 0]: mean 0.5, unbiased std sqrt(1/3) = 0.5773503 -> +-0.8660254.
    # Group 1: [1, 2, 3, 6]: mean 3, deviations [-2, -1, 0, 3], var 14/3, std 2.1602469.
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 2.0, 3.0, 6.0]])
    adv = grpo_advantages(rewards)
    expected = torch.tensor([[0.8660254, -0.8660254, 0.8660254, -0.8660254], [-0.9258201, -0.4629100, 0.0, 1.3887301]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_dr_grpo_only_centres():
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 2.0, 3.0, 6.0]])
    adv = grpo_advantages(rewards, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([[0.5, -0.5, 0.5, -0.5], [-2.0, -1.0, 0.0, 3.0]]))


def test_grpo_equal_rewards_give_zero_and_n1_is_refused():
    assert torch.equal(grpo_advantages(torch.full((1, 4), 0.7)), torch.zeros(1, 4))
    with pytest.raises(ValueError, match="n >= 2"):
        grpo_advantages(torch.tensor([[1.0]]))
    with pytest.raises(ValueError, match="rewards"):
        grpo_advantages(torch.tensor([1.0, 2.0]))


def test_token_rewards_on_last_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    out = token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    assert torch.equal(out, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]]))


def test_gae_three_tokens_hand_values():
    # gamma 0.9, lam 0.8 (gamma*lam = 0.72), reward 1 on the last token, V = [0.5, 0.6, 0.8]:
    # delta_2 = 1 - 0.8 = 0.2 ; delta_1 = 0.9*0.8 - 0.6 = 0.12 ; delta_0 = 0.9*0.6 - 0.5 = 0.04
    # A_2 = 0.2 ; A_1 = 0.12 + 0.72*0.2 = 0.264 ; A_0 = 0.04 + 0.72*0.264 = 0.23008
    # R = A + V = [0.73008, 0.864, 1.0]
    adv, ret = gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.8]]), torch.ones(1, 3), 0.9, 0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.23008, 0.264, 0.2]]))
    torch.testing.assert_close(ret, torch.tensor([[0.73008, 0.864, 1.0]]))


def test_gae_skips_masked_positions():
    # The same trajectory with a masked position (value 9, ignored) inside and padding after.
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 9.0, 0.8, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0]])
    adv, ret = gae(rewards, values, mask, 0.9, 0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.23008, 0.264, 0.0, 0.2, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.73008, 0.864, 0.0, 1.0, 0.0]]))


def test_gae_gamma_lam_one_is_return_minus_value():
    adv, _ = gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.8]]), torch.ones(1, 3))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.4, 0.2]]))


def test_gae_rejects_bad_input():
    with pytest.raises(ValueError, match="gamma"):
        gae(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), gamma=1.5)
    with pytest.raises(ValueError, match="shape"):
        gae(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))


def test_value_loss_clipped_hand_values():
    # Token 0: V=1, V_old=0.5 -> V_clip=0.7; (1-1)^2=0, (0.7-1)^2=0.09 -> 0.09 (clipped term active)
    # Token 1: V=0, V_old=0.5 -> V_clip=0.3; (0-1)^2=1, (0.3-1)^2=0.49 -> 1
    # loss = 0.5 * (0.09 + 1) / 2 = 0.2725 ; d/dV = [0 (clip saturated), (0 - 1) / 2 = -0.5]
    values = torch.tensor([[1.0, 0.0]], requires_grad=True)
    loss, m = value_loss(values, torch.tensor([[0.5, 0.5]]), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), 0.2)
    assert math.isclose(loss.item(), 0.2725, rel_tol=1e-6)
    assert m["value_clipfrac"] == 0.5
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.5]]))
    unclipped, _ = value_loss(values, torch.tensor([[0.5, 0.5]]), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), None)
    assert math.isclose(unclipped.item(), 0.25, rel_tol=1e-6)  # 0.5 * (0 + 1) / 2


def test_masked_whiten_ignores_masked_values():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    out = masked_whiten(x, torch.tensor([[1.0, 1.0, 0.0]]))
    # mean 2, population std 1 over the two real entries
    torch.testing.assert_close(out, torch.tensor([[-1.0, 1.0, 0.0]]), atol=1e-6, rtol=0)
