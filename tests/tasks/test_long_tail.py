"""The default long-tail task: tokenizer, prompts, rewards, length distribution, warm start."""

import statistics

import pytest
import torch

from dora_ext.config import ConfigError
from dora_ext.models import TinyLM
from dora_ext.tasks import LongTailConfig, LongTailTask, Tokenizer, count_reward, evaluate, warm_start

SMALL = LongTailConfig(median=3, cv=1.0, cap=12, alphabet=4, pattern_max=2)


def test_tokenizer_round_trip_and_errors():
    tok = Tokenizer(["a", "b", "#12", "|"])
    text = "<bos> #12 | a b a <eos>"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and ids[-1] == tok.stop_id and tok.decode(ids) == text
    assert tok.encode(tok.decode(ids)) == ids
    assert tok.decode(ids, skip_special=True) == "#12 | a b a"
    assert tok.vocab_size == 7
    with pytest.raises(ValueError, match="unknown symbol 'z'"):
        tok.encode("a z")
    with pytest.raises(ValueError, match="whitespace"):
        Tokenizer(["a b"])
    with pytest.raises(ValueError, match="twice"):
        Tokenizer(["a", "a"])
    with pytest.raises(ValueError, match="outside"):
        tok.decode([99])


def test_answer_layout_in_both_styles():
    counter = LongTailTask(LongTailConfig())
    p = counter.make_prompt(0, 3, ["a", "c"])
    assert counter.tokenizer.decode(p.ids) == "<pad> <bos> #3 | a c ="  # padded to pattern_max=3
    assert counter.tokenizer.decode(p.target) == "#3 a #2 c #1 a <eos>"
    plain = LongTailTask(LongTailConfig(style="plain"))
    assert plain.tokenizer.decode(plain.make_prompt(0, 5, ["b"]).target) == "b b b b b <eos>"
    # every prompt has the same width, so every answer starts at the same position
    assert {len(q.ids) for _, q in zip(range(50), counter.prompts(0))} == {counter.max_prompt_len}


def test_rewards_on_hand_made_answers():
    task = LongTailTask(LongTailConfig(style="plain", length_weight=0.5))
    tok = task.tokenizer
    p = task.make_prompt(0, 4, ["a", "b"])  # answer: a b a b <eos>
    r = lambda text: task.reward(p, tok.encode(text))  # noqa: E731
    assert r("a b a b <eos>") == 1.0
    assert r("a b a b <eos> a a") == 1.0  # whatever follows the stop token is not part of the answer
    assert r("a b b b <eos>") == pytest.approx(0.5 * 2 / 4 + 0.5 * 1.0)  # right length, wrong 3rd token
    assert r("a b <eos>") == pytest.approx(0.5 * 2 / 4 + 0.5 * (1 - 2 / 4))  # stopped too early
    assert r("a b a b a b <eos>") == pytest.approx(0.5 * 1.0 + 0.5 * (1 - 2 / 4))  # too long
    assert r("a b a b a b a b a b") == pytest.approx(0.5 * 1.0)  # never stopped: no length credit
    assert r("b") == 0.0 and r("<eos>") == pytest.approx(0.0)
    counter = LongTailTask(LongTailConfig())
    q = counter.make_prompt(0, 2, ["c"])  # #2 c #1 c <eos>
    assert counter.reward(q, q.target) == 1.0
    assert counter.reward(q, counter.tokenizer.encode("#2 c #2 c <eos>")) == pytest.approx(0.5 * 2 / 4 + 0.5)


def test_lengths_are_long_tailed_by_construction():
    cfg = LongTailConfig(median=8, cv=1.2, cap=96)
    lengths = sorted(p.length for _, p in zip(range(5000), LongTailTask(cfg).prompts(seed=3)))
    median, p99 = statistics.median(lengths), lengths[int(0.99 * len(lengths))]
    assert 7 <= median <= 9
    assert p99 / median >= 6  # design.md: p99 about 10x the median in reasoning RL
    assert lengths[0] >= cfg.min_len and lengths[-1] <= cfg.cap
    assert statistics.mean(lengths) > median  # right-skewed


def test_prompt_stream_is_reproducible_and_resumable():
    task = LongTailTask(SMALL)
    first = [p for _, p in zip(range(20), task.prompts(seed=5))]
    again = [p for _, p in zip(range(20), task.prompts(seed=5))]
    other = [p for _, p in zip(range(20), task.prompts(seed=6))]
    resumed = [p for _, p in zip(range(5), task.prompts(seed=5, start=15))]
    assert first == again and first != other
    assert resumed == first[15:] and [p.id for p in first] == list(range(20))


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="task.cv"):
        LongTailConfig(cv=0)
    with pytest.raises(ConfigError, match="task.cap"):
        LongTailConfig(median=20, cap=10)
    with pytest.raises(ConfigError, match="task.style"):
        LongTailConfig(style="fancy")
    with pytest.raises(ConfigError, match="task.colour"):
        LongTailConfig.from_dict({"colour": 1})
    assert LongTailConfig.from_dict({"median": 5}).median == 5


def test_warm_start_improves_reward_and_is_deterministic():
    task = LongTailTask(SMALL)
    prompts = [p for _, p in zip(range(32), task.prompts(seed=99))]
    cfg = task.model_config(d_model=32, n_layer=2, n_head=4, seed=0)
    base = evaluate(TinyLM(cfg), task, prompts)
    tuned = TinyLM(cfg)
    losses = warm_start(tuned, task, 60, seed=0)
    after = evaluate(tuned, task, prompts)
    assert losses[-1] < losses[0] / 2
    assert after["reward_mean"] > base["reward_mean"] + 0.2
    twin = TinyLM(cfg)
    warm_start(twin, task, 60, seed=0)
    assert all(torch.equal(v, twin.state_dict()[k]) for k, v in tuned.state_dict().items())
    other = TinyLM(cfg)
    warm_start(other, task, 60, seed=1)
    assert not torch.equal(other.state_dict()["embed.weight"], tuned.state_dict()["embed.weight"])


def test_count_reward_on_hand_made_answers():
    assert count_reward(3, "1, 2, 3", ended=True) == 1.0
    assert count_reward(3, "1, 2, 4", ended=True) == pytest.approx(0.5 * 2 / 3 + 0.5)
    assert count_reward(4, "1, 2", ended=True) == pytest.approx(0.5 * 2 / 4 + 0.5 * (1 - 2 / 4))
    assert count_reward(3, "1, 2, 3, 4, 5", ended=False) == pytest.approx(0.5)
    # SmolLM2's greedy habit: a numbered list repeats each number, so only "1" counts as a prefix
    assert count_reward(3, "1. 1\n2. 2", ended=True) == pytest.approx(0.5 * 1 / 3 + 0.5 * (1 - 1 / 3))
