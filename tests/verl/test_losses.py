"""dora-ext's losses, looked up through verl's own registry, give the right numbers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def _config(**kw):
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    args = dict(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
        clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean",
        policy_loss=PolicyLossConfig(loss_mode="dora_sao"),
    )
    args.update(kw)
    return ActorConfig(**args)


def _lookup(name):
    import dora_ext.verl.plugin  # noqa: F401  (verl loads it too; explicit for -p no:... runs)
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    return get_policy_loss_fn(name)


def test_sao_double_side_mask_by_hand():
    """Ratios 1.1 (inside), 1.5 (above 1+0.28), 0.7 (below 1-0.2), and a padding token."""
    fn = _lookup("dora_sao")
    rollout = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.1, 1.5, 0.7, 1.0]])).requires_grad_(True)
    adv = torch.tensor([[2.0, 2.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    loss, metrics = fn(old_log_prob=rollout, log_prob=logp, advantages=adv, response_mask=mask,
                       loss_agg_mode="token-mean", config=_config(), rollout_is_weights=None)
    # Only the first token keeps a gradient; masked tokens stay in the divisor (3 real tokens).
    assert loss.item() == pytest.approx(-(2.0 * 1.1) / 3, rel=1e-6)
    loss.backward()
    assert logp.grad[0, 1].item() == 0.0 and logp.grad[0, 2].item() == 0.0
    assert logp.grad[0, 0].item() == pytest.approx(-2.0 * 1.1 / 3, rel=1e-5)
    assert metrics["actor/sao_masked_frac"] == pytest.approx(2 / 3)


def test_sao_matches_algo_module_and_global_normalisation():
    from dora_ext.algo.losses import sao_policy_loss

    fn = _lookup("dora_sao")
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=g)
    logp = old + 0.3 * torch.randn(3, 5, generator=g)
    adv = torch.randn(3, 5, generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.2
    cfg = _config()
    ref, _ = sao_policy_loss(logp, old, adv, mask.float(), eps_low=0.2, eps_high=0.28)
    got, _ = fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask,
                loss_agg_mode="token-mean", config=cfg, rollout_is_weights=None)
    torch.testing.assert_close(got, ref)
    # With verl's global batch info (2 DP ranks, 40 tokens in the global batch) the divisor is 40/2.
    cfg.global_batch_info.update(dp_size=2, batch_num_tokens=40, global_batch_size=None)
    got, _ = fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask,
                loss_agg_mode="token-mean", config=cfg, rollout_is_weights=None)
    ref_sum, _ = sao_policy_loss(logp, old, adv, mask.float(), eps_low=0.2, eps_high=0.28, denom=1.0)
    torch.testing.assert_close(got, ref_sum / 20.0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_decoupled_equals_verl_vanilla_where_they_agree(mode):
    """Without dual-clip activity (ratios < clip_ratio_c = 3), decoupled PPO with weights w equals
    verl's own ``vanilla`` loss given the same ``rollout_is_weights``."""
    fn = _lookup("dora_decoupled")
    vanilla = _lookup("vanilla")
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 6, generator=g)
    logp = old + 0.2 * torch.randn(4, 6, generator=g)
    adv = torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.25
    w = torch.rand(4, 6, generator=g) * 2
    cfg = _config(loss_agg_mode=mode)
    ours, m = fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask,
                 loss_agg_mode=mode, config=cfg, rollout_is_weights=w)
    theirs, _ = vanilla(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask.float(),
                        loss_agg_mode=mode, config=cfg, rollout_is_weights=w)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert m["actor/dora_is_weighted"] == 1.0


def test_unsupported_aggregation_names_the_key():
    from dora_ext.config import ConfigError

    fn = _lookup("dora_sao")
    x = torch.zeros(1, 2)
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.loss_agg_mode"):
        fn(old_log_prob=x, log_prob=x, advantages=x, response_mask=x > -1, loss_agg_mode="token-sum",
           config=_config(), rollout_is_weights=None)
