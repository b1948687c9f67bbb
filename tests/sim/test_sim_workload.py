"""Workloads: log-normal draws keyed by (seed, group), replay files and their errors."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from dora_ext.sim import LengthSampler, Workload, WorkloadError, load_lengths, simulate
from dora_ext.sim.presets import PRESETS, get_preset
from dora_ext.sim.runner import Simulation


def test_draws_depend_only_on_seed_and_group():
    w = Workload(response_median=1000, response_cv=1.0, group_size=4)
    a, b = LengthSampler(w, 5), LengthSampler(w, 5)
    forward = [a.draw(g) for g in range(20)]
    backward = [b.draw(g) for g in reversed(range(20))][::-1]
    assert forward == backward
    assert LengthSampler(w, 6).draw(0) != forward[0]


def test_lognormal_median_cv_and_cap():
    w = Workload(response_median=1000, response_cv=1.0, response_cap=10**9, group_size=8, difficulty_share=0.0)
    s = LengthSampler(w, 0)
    xs = [x for g in range(3000) for x in s.draw(g).response_tokens]
    assert statistics.median(xs) == pytest.approx(1000, rel=0.05)
    cv = statistics.pstdev(xs) / statistics.fmean(xs)
    assert cv == pytest.approx(1.0, rel=0.15)
    capped = LengthSampler(Workload(response_median=1000, response_cv=1.0, response_cap=1500), 0)
    assert max(x for g in range(200) for x in capped.draw(g).response_tokens) == 1500


def test_difficulty_correlates_samples_of_a_group():
    def within_share(share: float) -> float:
        s = LengthSampler(Workload(response_median=1000, response_cv=1.0, response_cap=10**9,
                                   group_size=8, difficulty_share=share), 1)
        logs = [[math.log(x) for x in s.draw(g).response_tokens] for g in range(800)]
        within = statistics.fmean(statistics.pvariance(g) for g in logs)
        total = statistics.pvariance([x for g in logs for x in g])
        return within / total

    assert within_share(0.0) > 0.8
    assert within_share(0.8) < 0.35


def test_replay_plain_and_jsonl(tmp_path):
    plain = tmp_path / "lengths.txt"
    plain.write_text("# a comment\n100\n\n200\n300\n")
    assert load_lengths(plain) == [(100, None), (200, None), (300, None)]
    js = tmp_path / "lengths.jsonl"
    js.write_text("\n".join(json.dumps(d) for d in [
        {"response_length": 50, "prompt_length": 10}, {"response_length": 70, "other": 1}]))
    assert load_lengths(js) == [(50, 10), (70, None)]
    recs = load_lengths(plain)
    s = LengthSampler(Workload(group_size=2), 0, recs)
    assert s.draw(0).response_tokens == (100, 200)
    assert s.draw(1).response_tokens == (300, 100)  # wraps around


def test_replayed_lengths_drive_the_simulation(tmp_path, tiny):
    f = tmp_path / "l.txt"
    f.write_text("\n".join(["40", "400"] * 4))
    p = tiny(batch=2, n=2, capacity=4)
    res = simulate(p, "sync", steps=2, seed=0, records=load_lengths(f))
    assert res.core_metrics["tokens_trained"] == 2 * 2 * (40 + 400)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("100\n-5\n", "line 2"),
        ("100\n200\nabc\n", "line 3"),
        ('{"response_length": 10}\n{"prompt_length": 3}\n', "line 2: JSON object has no 'response_length'"),
        ('{"response_length": 1.5}\n', "line 1: response_length"),
        ('{"response_length": 10,\n', "line 1: invalid JSON"),
        ("\n# only comments\n", "no lengths found"),
        ('{"response_length": 10, "prompt_length": 0}\n', "line 1: prompt_length"),
    ],
)
def test_bad_files_name_the_line(tmp_path, text, fragment):
    f = tmp_path / "bad.txt"
    f.write_text(text)
    with pytest.raises(WorkloadError) as info:
        load_lengths(f)
    assert fragment in str(info.value)
    assert "bad.txt" in str(info.value)


def test_missing_file_and_bad_settings(tmp_path):
    with pytest.raises(WorkloadError, match="cannot read"):
        load_lengths(tmp_path / "nope.txt")
    with pytest.raises(WorkloadError, match="response_cv"):
        Workload(response_cv=-1)
    with pytest.raises(WorkloadError, match="group_size"):
        Workload(group_size=0)
    with pytest.raises(WorkloadError, match="difficulty_share"):
        Workload(difficulty_share=2.0)
    with pytest.raises(WorkloadError, match="accepted: dapo-28k"):
        get_preset("nope")


def test_presets_name_their_sources():
    assert {"dapo-28k", "rolloutpipe-8k", "agentic-long-tail"} <= set(PRESETS)
    for p in PRESETS.values():
        assert p.sources and all(isinstance(s, str) and s for s in p.sources)



def _capped(preset, cap):
    w = Workload(response_median=100, response_cv=1.0, response_cap=cap, prompt_median=20, prompt_cv=0.0,
                 prompt_cap=200, group_size=2, difficulty_share=0.0)
    return type(preset)(**{**preset.__dict__, "workload": w})


def test_truncated_counts_responses_cut_at_the_cap(tiny):
    # cv 1.0 with the cap at the median: about half the draws exceed it and are cut there.
    preset = _capped(tiny(), 100)
    res = simulate(preset, "sync", steps=4, seed=3)
    sampler = LengthSampler(preset.workload, 3)
    draws = [sampler.draw(g) for g in range(4 * preset.batch_size)]  # sync trains exactly these
    at_cap = sum(1 for d in draws for x in d.response_tokens if x == 100)
    assert res.metrics["truncated"] == sum(d.truncated for d in draws)
    assert 0.25 * 2 * len(draws) < res.metrics["truncated"] <= at_cap
    # Not a constant: with a cap far above every draw nothing is cut.
    assert simulate(_capped(tiny(), 10**7), "sync", steps=4, seed=3).metrics["truncated"] == 0
    # Replayed lengths at or above the cap count as cut there.
    recs = [(100, None), (50, None), (150, None), (20, None)]
    assert LengthSampler(preset.workload, 0, recs).draw(0).truncated == 1
    assert LengthSampler(preset.workload, 0, recs).draw(1).truncated == 1
    # ... and one above it is cut to it: it ran 150 tokens under a cap of 100 while counted as cut.
    assert LengthSampler(preset.workload, 0, recs).draw(1).response_tokens == (100, 20)


def test_replayed_lengths_above_the_cap_run_at_the_cap_and_count_as_truncated(tiny):
    preset = _capped(tiny(batch=2, n=2, capacity=4), 100)
    recs = [(400, None), (30, None), (100, None), (99, None)]  # two of four at or above the cap
    res = simulate(preset, "sync", steps=4, seed=0, records=recs)
    # sync trains exactly the first 4 * B groups: 8 groups of 2, half of the responses cut.
    assert res.metrics["truncated"] == 8
    sim = Simulation(preset, "sync", steps=4, seed=0, records=recs)
    sim.run()
    assert max(x for _, _, lengths in sim.groups.values() for x in lengths) == 100
