"""The streaming trainer on a real (tiny, random-initialised) torch language model.

The model is defined here on purpose, independent of `dora_ext.models`, so that these tests
exercise only the trainer. Rollouts are either fixed responses with log-probs recomputed by an
independent per-sequence loop, or real samples drawn from the model.
"""

import copy

import pytest
import torch
from torch import nn

from dora_ext.algo.trainer import Trainer, TrainerConfig, Trajectory
from dora_ext.config import ConfigError

VOCAB = 8


class TinyLM(nn.Module):
    """Embedding -> GRU -> vocabulary logits: causal, so right padding never changes real positions."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16, out: int | None = None):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, out or vocab)

    def forward(self, ids):
        h, _ = self.rnn(self.emb(ids))
        return self.head(h)


class TinyValue(TinyLM):
    def __init__(self):
        super().__init__(out=1)


def make(seed: int = 0, value: bool = False):
    torch.manual_seed(seed)
    policy = TinyLM()
    return (policy, TinyValue()) if value else (policy, None)


@torch.no_grad()
def seq_logprobs(model, prompt, response, temperature=1.0):
    """log pi(response | prompt), one unpadded sequence at a time (independent of the trainer's gather)."""
    ids = torch.tensor([prompt + response])
    logits = model(ids)[0] / temperature
    lp = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(response)], dim=-1)
    return lp.gather(1, torch.tensor(response)[:, None]).squeeze(1).tolist()


def traj(model, prompt, response, reward, version, noise=0.0, gen=None):
    lps = seq_logprobs(model, prompt, response)
    if noise:
        lps = [x + noise * float(torch.randn((), generator=gen)) for x in lps]
    return Trajectory(prompt, response, lps, reward, version)


def mixed_groups(model, n: int, seed: int = 0):
    """Groups of varied prompt/response lengths, rewards, and versions 0..2; rollout log-probs are
    perturbed so that PPO clipping, IS truncation and SAO masking all engage."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(4):
        rows = []
        prompt = [int(x) for x in torch.randint(1, VOCAB, (1 + g,), generator=gen)]
        for i in range(n):
            length = 1 + (3 * g + 2 * i) % 5
            response = [int(x) for x in torch.randint(0, VOCAB, (length,), generator=gen)]
            reward = float(torch.rand((), generator=gen))
            rows.append(traj(model, prompt, response, reward, version=g % 3, noise=0.4, gen=gen))
        groups.append(rows)
    return groups


CASES = [
    dict(algorithm="grpo", correction="tis"),
    dict(algorithm="grpo", correction="decoupled", is_cap_mode="mask", loss_agg_mode="seq-mean-token-mean"),
    dict(algorithm="grpo", correction="none", norm_adv_by_std=False),
    dict(algorithm="sao"),
    dict(algorithm="sao", loss_agg_mode="seq-mean-token-mean", entropy_coef=0.01),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_streaming_gradient_equals_whole_batch_gradient(case):
    cfg = TrainerConfig(**case)
    policy, value = make(1, value=cfg.algorithm == "sao")
    n = 1 if cfg.algorithm == "sao" else 3
    groups = mixed_groups(policy, n)
    streamed = Trainer(copy.deepcopy(policy), cfg, value_head=copy.deepcopy(value), version=2)
    for g in groups:
        streamed.add_group(g)
    got = streamed.batch_gradients()

    ref = Trainer(copy.deepcopy(policy), cfg, value_head=copy.deepcopy(value), version=2)
    loss, metrics = ref.batch_loss(groups)
    loss.backward()
    # The reference really exercises the non-trivial branches.
    assert (metrics.get("pg_clipfrac", 0) > 0 or metrics.get("masked_frac", 0) > 0
            or metrics.get("is_truncated_frac", 0) > 0)
    want = ref.batch_gradients()  # nothing streamed into ref: divisor 1, its grads are the batch mean's
    assert got.keys() == want.keys() and len(got) > 0
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    assert any(float(g.abs().sum()) > 0 for g in got.values())

    # The step's metrics are the batch means too, and it clips the batch-mean gradient.
    norm = torch.sqrt(sum((g**2).sum() for k, g in got.items() if k.startswith("policy.")))
    step = streamed.finish_step(2)
    assert step["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    assert step["loss"] == pytest.approx(metrics["loss"], rel=1e-5, abs=1e-7)
    for key in ("pg_clipfrac", "masked_frac", "value_loss", "entropy"):
        if key in metrics:
            assert step[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key


def test_grouping_does_not_change_the_gradient():
    """The order in which groups stream in does not change the step's gradient."""
    cfg = TrainerConfig(algorithm="grpo")
    policy, _ = make(2)
    groups = mixed_groups(policy, 2, seed=3)
    a = Trainer(copy.deepcopy(policy), cfg, version=2)
    for g in reversed(groups):
        a.add_group(g)
    b = Trainer(copy.deepcopy(policy), cfg, version=2)
    for g in groups:
        b.add_group(g)
    for name, grad in a.batch_gradients().items():
        torch.testing.assert_close(grad, b.batch_gradients()[name], rtol=1e-5, atol=1e-7)


A, B, C = [1, 2, 3], [4, 4, 5], [6, 7, 1]
PROMPTS = ([1, 2], [3])


def logp_sum(model, prompt, response):
    return sum(seq_logprobs(model, prompt, response))


def test_grpo_learns_from_rewards():
    """On-policy GRPO steps raise the log-prob of the rewarded response and lower the others."""
    policy, _ = make(4)
    trainer = Trainer(policy, TrainerConfig(algorithm="grpo", lr=1e-2))
    rewards = {tuple(A): 1.0, tuple(B): 0.0, tuple(C): 0.0}
    before = {(tuple(p), tuple(r)): logp_sum(policy, p, r) for p in PROMPTS for r in (A, B, C)}
    for step in range(6):
        for p in PROMPTS:
            trainer.add_group([traj(policy, p, r, rewards[tuple(r)], trainer.version) for r in (A, B, C)])
        m = trainer.finish_step(step)
        assert m["version"] == step + 1 and m["batch_staleness_max"] == 0
    after = {k: logp_sum(policy, *k) for k in before}
    for p in PROMPTS:
        key = lambda r: (tuple(p), tuple(r))  # noqa: E731
        assert after[key(A)] > before[key(A)] + 0.5
        assert after[key(B)] < before[key(B)]
        assert after[key(C)] < before[key(C)]
    weighted = lambda d: sum(rewards[k[1]] * v for k, v in d.items())  # noqa: E731
    assert weighted(after) > weighted(before)


def test_sao_learns_from_rewards_with_value_head():
    """SAO (n=1 groups, GAE over a value head, double-side mask) raises the rewarded response's
    log-prob, and the value head moves toward the returns."""
    policy, value = make(5, value=True)
    trainer = Trainer(policy, TrainerConfig(algorithm="sao", lr=1e-2, value_lr=1e-2), value_head=value)
    before_a = logp_sum(policy, PROMPTS[0], A)
    first = None
    for step in range(8):
        trainer.add_group([traj(policy, PROMPTS[0], A, 1.0, trainer.version)])
        trainer.add_group([traj(policy, PROMPTS[0], B, 0.0, trainer.version)])
        m = trainer.finish_step(step)
        first = first or m
        assert m["masked_frac"] == 0.0  # on-policy: every ratio is 1
    assert logp_sum(policy, PROMPTS[0], A) > before_a + 0.5
    assert m["value_loss"] < first["value_loss"]


def test_grpo_on_sampled_rollouts_raises_reward():
    """Real sampling from the model: reward = share of response tokens equal to 3. After a few
    steps the policy samples token 3 more often than at the start (expectation, not a sample)."""
    policy, _ = make(6)
    trainer = Trainer(policy, TrainerConfig(algorithm="grpo", lr=3e-2))
    gen = torch.Generator().manual_seed(0)

    @torch.no_grad()
    def p_target():
        return float(torch.softmax(policy(torch.tensor([[1, 2]]))[0, -1], -1)[3])

    @torch.no_grad()
    def sample(prompt, length=4):
        ids, lps = list(prompt), []
        for _ in range(length):
            lp = torch.log_softmax(policy(torch.tensor([ids]))[0, -1], -1)
            tok = int(torch.multinomial(lp.exp(), 1, generator=gen))
            ids.append(tok)
            lps.append(float(lp[tok]))
        return ids[len(prompt):], lps

    start = p_target()
    for step in range(8):
        for _ in range(2):
            rows = []
            for _ in range(6):
                resp, lps = sample([1, 2])
                rows.append(Trajectory([1, 2], resp, lps, resp.count(3) / len(resp), trainer.version))
            trainer.add_group(rows)
        trainer.finish_step(step)
    assert p_target() > start + 0.2


def test_deterministic_for_a_seed():
    def run():
        policy, value = make(7, value=True)
        t = Trainer(policy, TrainerConfig(algorithm="sao"), value_head=value)
        groups = [[g[0]] for g in mixed_groups(policy, 1, seed=9)]
        metrics = t.train_batch(0, [g for g in groups if g[0].version == 0])
        return t.publish(), metrics

    (w1, m1), (w2, m2) = run(), run()
    assert m1 == m2
    assert all(torch.equal(w1[k], w2[k]) for k in w1)


def test_publish_is_a_copy_and_versions_advance():
    policy, _ = make(8)
    t = Trainer(policy, TrainerConfig(lr=1e-2))
    v0 = t.publish()
    groups = [g for g in mixed_groups(policy, 2) if g[0].version == 0]
    m = t.train_batch(0, groups)
    assert t.version == 1 and m["version"] == 1.0
    v1 = t.publish()
    assert any(not torch.equal(v0[k], v1[k]) for k in v0)  # the step changed weights ...
    assert all(torch.equal(v0[k], make(8)[0].state_dict()[k]) for k in v0)  # ... not the old copy
    for key in ("loss", "pg_clipfrac", "reward_mean", "grad_norm", "tokens", "is_weight_mean"):
        assert key in m
    assert m["tokens"] == sum(len(t.response_ids) for g in groups for t in g)


def test_adapts_tuple_outputs_and_custom_logits_fn():
    class WithPast(TinyLM):
        def forward(self, ids):
            return super().forward(ids), None

    torch.manual_seed(0)
    model = WithPast()
    rows = [Trajectory([1], [2, 3], [-2.0, -2.0], 1.0, 0), Trajectory([1], [4], [-2.0], 0.0, 0)]
    assert Trainer(model).add_group(rows)["tokens"] == 3.0
    calls = []

    def logits_fn(m, ids):
        calls.append(ids.shape)
        return m(ids)[0]

    Trainer(model, logits_fn=logits_fn).add_group([dict(t.__dict__) for t in rows])  # mappings accepted
    assert calls == [(2, 3)]


def test_bad_input_is_refused_with_the_field_named():
    policy, value = make(9, value=True)
    t = Trainer(policy, version=1)
    good = Trajectory([1], [2, 3], [-1.0, -1.0], 1.0, 1)
    with pytest.raises(ValueError, match=r"rollout_logprobs"):
        t.add_group([good, Trajectory([1], [2, 3], [-1.0], 0.0, 1)])
    with pytest.raises(ValueError, match=r"version: 2 is newer"):
        t.add_group([good, Trajectory([1], [2], [-1.0], 0.0, 2)])
    with pytest.raises(ValueError, match=r"prompt_ids"):
        t.add_group([good, Trajectory([], [2], [-1.0], 0.0, 1)])
    with pytest.raises(ValueError, match=r"needs >= 2 trajectories"):
        t.add_group([good])
    with pytest.raises(ValueError, match=r"reward"):
        t.add_group([good, dict(prompt_ids=[1], response_ids=[2], rollout_logprobs=[-1.0], version=1)])
    with pytest.raises(ValueError, match=r"no group was added"):
        t.finish_step(1)
    t.add_group([good, good])
    with pytest.raises(ValueError, match=r"step: expected 1"):
        t.finish_step(0)
    with pytest.raises(ConfigError, match="value_head"):
        Trainer(policy, TrainerConfig(algorithm="sao"))
    with pytest.raises(ConfigError, match="algorithm"):
        TrainerConfig(algorithm="ppo")
    with pytest.raises(ConfigError, match="trainer.clip_low"):
        TrainerConfig.from_dict({"clip_low": 2.0}, where="trainer")
    with pytest.raises(ConfigError, match="trainer.lr_warmup"):
        TrainerConfig.from_dict({"lr_warmup": 3}, where="trainer")
    bad_value = Trainer(policy, TrainerConfig(algorithm="sao"), value_head=lambda ids: ids.float()[:, :1])
    with pytest.raises(ValueError, match="value_head"):
        bad_value.add_group([Trajectory([1], [2], [-1.0], 1.0, 0)])


def test_pi_prox_is_the_pre_update_pass_and_behaviour_enters_by_weight():
    """pi_prox = the trainer's weights before the update (this forward with one update per batch);
    pi_behav = the engine's log-probs, which only enter through the correction.

    The group's rollout log-probs are the model's own minus log 3 (pi_theta / pi_behav = 3 on
    every token). Under "tis" the ratio against pi_prox is 1 (nothing clipped) and the weight
    min(3, C=2) = 2 on every token, whatever the version, so the gradient is exactly 2x that of the
    same group with exact log-probs. Under "none" (the clip anchored at pi_behav) every token with
    A > 0 is clipped. Decoupled with cap_mode "mask" drops every token (weight 3 > 2): zero
    gradient. "sao" masks every token (ratio 3 is outside [0.8, 1.2]): zero gradient.
    """
    import math

    policy, _ = make(10)
    prompt, responses, rewards = [1, 2], [A, B, C], [1.0, 0.0, 0.5]
    exact = [traj(policy, prompt, r, w, version=0) for r, w in zip(responses, rewards)]
    shifted = [Trajectory(t.prompt_ids, t.response_ids, [x - math.log(3) for x in t.rollout_logprobs],
                          t.reward, 0) for t in exact]

    def grads(cfg, rows, version):
        tr = Trainer(copy.deepcopy(policy), cfg, version=version)
        m = tr.add_group(rows)
        return tr.batch_gradients(), m

    on, _ = grads(TrainerConfig(correction="tis", is_cap=2.0), exact, version=0)
    for version in (0, 1):
        stale, m = grads(TrainerConfig(correction="tis", is_cap=2.0), shifted, version=version)
        assert m["pg_clipfrac"] == 0.0 and m["is_truncated_frac"] == 1.0
        assert m["is_weight_mean"] == pytest.approx(2.0)
        for k in on:
            torch.testing.assert_close(stale[k], 2 * on[k], rtol=1e-4, atol=1e-7)

    _, m = grads(TrainerConfig(correction="none"), shifted, version=1)
    # A > 0 for the reward-1 response only (3 of 9 tokens): clipped at 1 + 0.2.
    assert m["pg_clipfrac"] == pytest.approx(3 / 9)

    masked, _ = grads(TrainerConfig(correction="decoupled", is_cap=2.0, is_cap_mode="mask"), shifted, version=1)
    assert all(float(g.abs().max()) == 0.0 for g in masked.values())
    sao, m = grads(TrainerConfig(correction="sao"), shifted, version=1)
    assert m["masked_frac"] == 1.0 and all(float(g.abs().max()) == 0.0 for g in sao.values())
    sao, m = grads(TrainerConfig(correction="sao"), exact, version=1)
    assert m["masked_frac"] == 0.0 and any(float(g.abs().max()) > 0.0 for g in sao.values())


def test_inner_loop_first_update_is_the_single_update_and_later_ones_clip():
    """ppo_minibatches=2: the first optimizer step is exactly the one-update trainer's step on the
    first chunk (ratio 1 against pi_prox); the second chunk is scored against the *pre-update*
    pi_prox, so with a large learning rate its ratios leave the clip range and the clip acts."""
    policy, _ = make(4)
    groups = mixed_groups(policy, 3, seed=5)
    cfg = dict(algorithm="grpo", correction="tis", lr=0.05)
    multi = Trainer(copy.deepcopy(policy), TrainerConfig(ppo_minibatches=2, **cfg), version=2)
    for g in groups:
        multi.add_group(g)
    seen = []
    real_apply = multi._apply

    def spy(units):
        out = real_apply(units)
        seen.append({k: v.detach().clone() for k, v in multi.policy.state_dict().items()})
        return out

    multi._apply = spy
    m = multi.finish_step(2)
    assert m["updates"] == 2.0 and len(seen) == 2 and multi.version == 3
    assert m["pg_clipfrac"] > 0 and m["ratio_mean"] != pytest.approx(1.0)

    single = Trainer(copy.deepcopy(policy), TrainerConfig(**cfg), version=2)
    for g in groups[:2]:
        single.add_group(g)
    single.finish_step(2)
    for k, v in single.policy.state_dict().items():
        torch.testing.assert_close(seen[0][k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_epochs_reuse_the_batch_and_kl_pulls_towards_the_reference():
    policy, _ = make(6)
    groups = mixed_groups(policy, 3, seed=6)
    tr = Trainer(copy.deepcopy(policy), TrainerConfig(ppo_epochs=3, ppo_minibatches=2, lr=0.02, kl_coef=0.5), version=2)
    for g in groups:
        tr.add_group(g)
    m = tr.finish_step(2)
    assert m["updates"] == 6.0 and "kl_ref" in m
    assert tr.ref_policy is not None
    for (k, ref), p in zip(tr.ref_policy.state_dict().items(), policy.state_dict().values()):
        torch.testing.assert_close(ref, p, msg=k)  # the reference stays the initial policy
    # After the step the policy differs from the reference, and the KL term is positive.
    tr.add_group(groups[0])
    assert tr._sums["kl_ref"] > 0
    with pytest.raises(ConfigError, match="trainer.ppo_epochs"):
        TrainerConfig.from_dict({"ppo_epochs": 0}, where="trainer")


def test_sao_critic_warmup_moves_only_the_value_head():
    policy, value = make(7, value=True)
    groups = mixed_groups(policy, 1, seed=7)
    tr = Trainer(copy.deepcopy(policy), TrainerConfig(algorithm="sao", critic_warmup=1, lr=0.01),
                 value_head=copy.deepcopy(value), version=0)
    for g in groups:
        tr.add_group([dataclasses_replace_version(t, 0) for t in g])
    m = tr.finish_step(0)
    assert m["critic_warmup"] == 1.0
    for k, v in policy.state_dict().items():
        torch.testing.assert_close(tr.policy.state_dict()[k], v, msg=k)
    assert any(not torch.equal(a, b) for a, b in zip(tr.value_head.state_dict().values(), value.state_dict().values()))
    for g in groups:  # step 1: warm-up over, the policy moves
        tr.add_group([dataclasses_replace_version(t, 1) for t in g])
    tr.finish_step(1)
    assert any(not torch.equal(tr.policy.state_dict()[k], v) for k, v in policy.state_dict().items())


def dataclasses_replace_version(t, version):
    import dataclasses

    return dataclasses.replace(t, version=version)


def test_critic_warmup_without_a_critic_is_refused():
    """A setting that would silently do nothing is an error naming the field."""
    with pytest.raises(ConfigError, match=r"trainer\.critic_warmup: only algorithm 'sao'"):
        TrainerConfig.from_dict({"algorithm": "grpo", "critic_warmup": 5}, where="trainer")
    assert TrainerConfig.from_dict({"algorithm": "sao", "critic_warmup": 5}, where="trainer").critic_warmup == 5


MICRO_CASES = [(CASES[1], dict()), (CASES[1], dict(ppo_minibatches=2, kl_coef=0.1)),
               (CASES[1], dict(ppo_epochs=2, ppo_minibatches=2, loss_agg_mode="token-mean")),
               (CASES[3], dict()), (CASES[3], dict(ppo_minibatches=2)), (CASES[3], dict(kl_coef=0.1)),
               # review: every correction, both aggregations, the entropy bonus, a critic with GAE
               (CASES[0], dict(ppo_minibatches=2, entropy_coef=0.01)), (CASES[2], dict(entropy_coef=0.01)),
               (CASES[4], dict()), (CASES[4], dict(kl_coef=0.1)),  # one update: SAO's mask cannot flip (docstring)
               (dict(algorithm="grpo", correction="sao", loss_agg_mode="seq-mean-token-mean"), dict(entropy_coef=0.01)),
               (dict(algorithm="grpo", correction="decoupled", is_cap_mode="truncate"), dict(ppo_epochs=2, entropy_coef=0.01))]


@pytest.mark.parametrize("case, extra", MICRO_CASES)
def test_length_sorted_micro_batches_take_the_same_step(case, extra):
    """micro_tokens > 0 regroups a batch's rows by length into several forwards (less padding);
    every loss is a sum over tokens or sequences, so the step is the same as one forward per group.
    (SAO with several updates and a KL term is left out: its hard mask on pi_theta / pi_behav flips
    for a token on the band's edge under float rounding, a discrete difference of the order of lr.)"""
    policy, value = make(8, value=case["algorithm"] == "sao")
    groups = mixed_groups(policy, 5, seed=8)
    after, forwards = [], []
    for micro in (0, 12):
        tr = Trainer(copy.deepcopy(policy), TrainerConfig(**{"lr": 0.02, "micro_tokens": micro, **case, **extra}),
                     value_head=copy.deepcopy(value), version=2)
        calls = [0]
        real = tr.logits_fn
        tr.logits_fn = lambda m, ids, real=real, calls=calls: (calls.__setitem__(0, calls[0] + 1), real(m, ids))[1]
        for g in groups:
            tr.add_group(g)
        m = tr.finish_step(2)
        after.append((tr.policy.state_dict(), m))
        forwards.append(calls[0])
    assert forwards[1] > forwards[0]  # the micro-batches really were more, smaller forwards
    (p0, m0), (p1, m1) = after
    for k in p0:
        torch.testing.assert_close(p1[k], p0[k], rtol=1e-5, atol=1e-5)  # float summation order (the step is ~lr = 0.02)
    for k in ("loss", "entropy", "reward_mean", "tokens", "grad_norm"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-6), k


def test_micro_split_sorts_by_length_within_the_budget():
    policy, _ = make(9)
    tr = Trainer(policy, TrainerConfig(micro_tokens=10))
    rows = [Trajectory([1], [2] * n, [-1.0] * n, 0.0, 0) for n in (7, 1, 3, 12, 2)]
    parts = tr._micro_split(rows)
    assert sorted(i for p in parts for i in p) == list(range(5))
    lens = [1 + len(r.response_ids) for r in rows]
    flat = [lens[i] for p in parts for i in p]
    assert flat == sorted(flat)
    assert all(len(p) == 1 or len(p) * max(lens[i] for i in p) <= 10 for p in parts)
    assert [len(p) for p in parts] == [2, 1, 1, 1]  # [2, 3] (6 padded tokens), [4], [8], [13] (over budget: alone)
    with pytest.raises(ConfigError, match="micro_tokens"):
        TrainerConfig(micro_tokens=-1)


@pytest.mark.parametrize("algorithm, extra", [("grpo", dict(correction="sao")), ("sao", dict()),
                                              ("grpo", dict(correction="sao", ppo_minibatches=2)),
                                              ("sao", dict(ppo_minibatches=2, micro_tokens=8))])
def test_sao_mask_in_the_trainer_is_on_pi_theta_over_pi_rollout_of_stale_tokens(algorithm, extra):
    """Review of the SAO wiring, a hand-computed case: stale trajectories (version 0, trainer at
    version 2) whose rollout log-probs sit at known ratios pi_theta / pi_rollout = 1.0, 1.3, 0.7,
    1.1 from the current policy. The band [0.8, 1.2] keeps tokens 0 and 3 only, whatever the
    advantage's sign, and the update's gradient is -A r dlogp / units over the kept tokens. A mask
    inverted, on pi_prox (which equals pi_theta on the first update: nothing masked) or on the
    wrong log-probs gives another masked_frac or gradient."""
    policy, value = make(11, value=algorithm == "sao")
    ratios = torch.tensor([1.0, 1.3, 0.7, 1.1])
    keep = torch.tensor([1.0, 0.0, 0.0, 1.0])
    prompts = [[1, 2], [3, 4, 5]]
    group = []
    for i, (p, reward) in enumerate(zip(prompts, (1.0, 0.0))):
        r = [4 + i, 6, 7, 3]
        lp = torch.tensor(seq_logprobs(policy, p, r)) - ratios.log()
        group.append(Trajectory(p, r, lp.tolist(), reward, 0))
    tr = Trainer(copy.deepcopy(policy), TrainerConfig(algorithm=algorithm, lr=0.01, grad_clip=None, **extra),
                 value_head=copy.deepcopy(value), version=2)
    tr.add_group(group)
    # The hand-computed gradient of the first update, before the trainer's step.
    ref = copy.deepcopy(policy)
    if algorithm == "grpo":
        from dora_ext.algo.advantages import grpo_advantages

        seq = grpo_advantages(torch.tensor([[1.0, 0.0]]), norm_by_std=tr.config.norm_adv_by_std,
                              eps=tr.config.adv_eps)[0]
        adv = [torch.full((4,), float(a)) for a in seq]
        assert float(seq[0]) > 0 > float(seq[1])
    else:
        with torch.no_grad():
            adv = []
            for t in group:
                ids = torch.tensor([t.prompt_ids + t.response_ids])
                v = value(ids)[0, len(t.prompt_ids) - 1 : len(t.prompt_ids) + 3, 0]
                adv.append(t.reward - v)  # gamma = lam = 1, outcome reward: A_t = R - V_t
    total = 0.0
    for t, a in zip(group, adv):
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        lp = torch.log_softmax(ref(ids)[0][len(t.prompt_ids) - 1 : len(t.prompt_ids) + 3], -1)
        lp = lp.gather(1, torch.tensor(t.response_ids)[:, None]).squeeze(1)
        total = total + (-a * lp.detach().exp() / torch.tensor(t.rollout_logprobs).exp() * keep * lp).sum()
    (total / 8).backward()  # token-mean over the step's 8 tokens
    want = {k: p.grad.clone() for k, p in ref.named_parameters()}
    before = {k: p.detach().clone() for k, p in tr.policy.named_parameters()}
    captured = {}
    real_apply = tr._apply

    def spy(units, merged=False):
        if not captured:
            captured.update({k: p.grad.clone() / max(units, 1.0) for k, p in tr.policy.named_parameters()
                             if p.grad is not None})
        return real_apply(units, merged)

    tr._apply = spy
    m = tr.finish_step(2)
    assert m["masked_frac"] == pytest.approx(0.5)  # one group: one update (one chunk) either way
    for k, g in want.items():
        torch.testing.assert_close(captured[k], g, rtol=1e-4, atol=1e-6)
    assert any(not torch.equal(before[k], p) for k, p in tr.policy.named_parameters())


@pytest.mark.parametrize("algorithm, extra", [("grpo", dict(correction="sao")), ("sao", dict()),
                                              ("sao", dict(loss_agg_mode="seq-mean-token-mean"))])
def test_sao_entropy_bonus_acts_only_on_the_tokens_its_mask_keeps(algorithm, extra):
    """A token outside SAO's band gets no gradient at all: with the entropy bonus on it, it would be the only force on
    that token and push the policy towards uniform (the collapse at lr 1e-3). The ratios pi_theta / pi_rollout are 1.0,
    1.3, 0.7, 1.1 (tokens 0 and 3 kept): the bonus's gradient (coef 0.1 minus coef 0) is that of -0.1 * the entropy of
    the kept tokens over the step's divisor; with every token outside the band the policy's gradient is zero."""
    from dora_ext.algo.losses import agg_loss, entropy_from_logits

    policy, value = make(12, value=algorithm == "sao")
    prompts = [[1, 2], [3, 4, 5]]

    def group(ratios):
        rows = []
        for i, (p, reward) in enumerate(zip(prompts, (1.0, 0.0))):
            r = [4 + i, 6, 7, 3]
            lp = torch.tensor(seq_logprobs(policy, p, r)) - torch.tensor(ratios).log()
            rows.append(Trajectory(p, r, lp.tolist(), reward, 0))
        return rows

    def grads(rows, coef):
        tr = Trainer(copy.deepcopy(policy), TrainerConfig(algorithm=algorithm, entropy_coef=coef, **extra),
                     value_head=copy.deepcopy(value), version=2)
        tr.add_group(rows)
        return {k: g for k, g in tr.batch_gradients().items() if k.startswith("policy.")}

    rows = group([1.0, 1.3, 0.7, 1.1])
    with_bonus, without = grads(rows, 0.1), grads(rows, 0.0)
    ref = copy.deepcopy(policy)
    keep = torch.tensor([[1.0, 0.0, 0.0, 1.0]] * 2)
    ids = torch.tensor([[1, 2, 4, 6, 7, 3, 0], [3, 4, 5, 5, 6, 7, 3]])
    logits = torch.stack([ref(ids[0:1])[0, 1:5], ref(ids[1:2])[0, 2:6]])
    (-0.1 * agg_loss(entropy_from_logits(logits) * keep, torch.ones(2, 4),
                       extra.get("loss_agg_mode", "token-mean"))).backward()
    for k, p in ref.named_parameters():
        torch.testing.assert_close(with_bonus[f"policy.{k}"] - without[f"policy.{k}"], p.grad, rtol=1e-4, atol=1e-7)
    outside = grads(group([1.5, 1.3, 0.7, 0.5]), 0.1)
    assert all(float(g.abs().max()) == 0.0 for g in outside.values())


def test_without_micro_tokens_every_update_forward_is_one_group():
    """micro_tokens = 0 is documented as one forward per group; the inner loop (PPO minibatches)
    must not pad a whole chunk of groups into one forward (on a GPU, a chunk of a large batch)."""
    policy, _ = make(12)
    groups = mixed_groups(policy, 5, seed=12)
    tr = Trainer(copy.deepcopy(policy), TrainerConfig(lr=0.01, ppo_minibatches=2, correction="tis"), version=2)
    rows = []
    real = tr.logits_fn
    tr.logits_fn = lambda m, ids: (rows.append(ids.shape[0]), real(m, ids))[1]
    for g in groups:
        tr.add_group(g)
    tr.finish_step(2)
    sizes = [len(g) for g in groups]
    assert rows == sizes + sizes  # the pre-update pass, then the updates: one forward per group each
