"""dora-ext driven by slime's OWN loops on CPU: `train.py` and `train_async.py` from a slime
checkout (`DORA_SLIME_PATH`, slime 624b824) with `patches/slime` applied, through the harness in
`tests/slime/harness/slime_cpu` (its `run.py` docstring lists what is slime's and what stands in:
the SGLang servers, the Megatron train actor, Megatron-LM's argument parser and the GPU).

Each test launches one slime job in a subprocess (Ray, slime's router, CPU SGLang servers) and
checks the evidence the job leaves: what every engine generated and at which weight version it
reported (engine logs), what slime handed to the trainer (rollout log hook), what the trainer
trained on (train log), and what eval ran on (eval log hook).

  C1: every trained sample was produced by one engine request at one version, that version is
      the one the engine reported in the sample, and a group never mixes versions;
  C2: every group that started generating was trained exactly once or reported failed;
  C3: 0 <= rollout_id - version <= K.

Skipped with the reason when slime or its client-side dependencies are absent (slime is not on
PyPI; `scripts/test.sh` unpacks the snapshot and installs them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
from slime_helpers import harness_env

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "slime" / "harness"
pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 600


def run_job(patched: Path, work: Path, *flags: str) -> "Evidence":
    env = dict(harness_env(patched), PYTHONFAULTHANDLER="1")  # SIGABRT dumps each process's stacks
    proc = subprocess.Popen([sys.executable, "-m", "slime_cpu.run", "--workdir", str(work), *flags],
                            env=env, stdout=open(work.parent / f"{work.name}.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        rc = proc.wait(RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        rc = None
        os.killpg(proc.pid, signal.SIGABRT)  # where a hang waits: the driver's stacks in the log, Ray workers' in theirs
        time.sleep(5)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # Ray, router and servers the job may have left
        except ProcessLookupError:
            pass
    log = (work.parent / f"{work.name}.log").read_text()[-3000:]
    assert rc == 0, f"harness exited {rc}:\n{log}"
    return Evidence(work, log)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class Evidence:
    def __init__(self, work: Path, log: str) -> None:
        self.work, self.log = work, log
        self.result = json.loads((work / "result.json").read_text())
        self.requests = [e for p in sorted(work.glob("engine*.jsonl")) for e in _lines(p) if e["kind"] == "generate"]
        self.loads = [e for p in sorted(work.glob("engine*.jsonl")) for e in _lines(p) if e["kind"] == "load"]
        self.violations = [e for p in sorted(work.glob("engine*.jsonl")) for e in _lines(p) if e["kind"] == "violation"]
        rollouts: dict[int, dict] = {}
        for e in _lines(work / "rollouts.jsonl"):
            rollouts[e["rollout_id"]] = e  # a rollout re-generated after a resume: the last one
        self.rollouts = rollouts
        self.trained = {e["rollout_id"]: e for e in _lines(work / "train.jsonl")}
        self.evals = _lines(work / "evals.jsonl")
        self.eval_prompts = {json.loads(line)["text"] for line in (work / "eval.jsonl").read_text().splitlines()}

    def produced(self) -> dict[tuple, set]:
        """token sequence -> versions of the requests that produced it (start and end)."""
        out: dict[tuple, set] = defaultdict(set)
        for r in self.requests:
            out[tuple(r["input_ids"] + r["output_ids"])].add((r["version_start"], r["version_end"]))
        return out

    def trained_groups(self, k: int) -> dict[int, tuple[str, str]]:
        """Check C1 and C3 for every trained rollout; returns group prompt -> (rollout id, version)."""
        produced = self.produced()
        groups: dict[str, tuple[int, str]] = {}
        assert self.trained, f"nothing was trained:\n{self.log}"
        for rid, t in self.trained.items():
            r = self.rollouts[rid]
            assert sorted(map(tuple, t["tokens"])) == sorted(tuple(s["tokens"]) for s in r["samples"]), \
                f"rollout {rid}: the trainer did not get what the engines produced"
            by_group: dict[str, set] = defaultdict(set)
            for s in r["samples"]:
                assert s["status"] in ("completed", "truncated")
                assert len(s["weight_versions"]) == 1, f"sample spans versions {s['weight_versions']}"
                (v,) = s["weight_versions"]
                made = produced[tuple(s["tokens"])]
                assert made == {(v, v)}, f"rollout {rid}: sample reported version {v}, engines produced it at {made}"
                by_group[s["prompt"]].add(v)
            for prompt, versions in by_group.items():
                assert len(versions) == 1, f"rollout {rid}: group {prompt!r} mixes versions {versions}"  # C1
                (v,) = versions
                assert 0 <= rid - int(v) <= k, f"rollout {rid} trained version {v} (K={k})"  # C3
                assert prompt not in groups, f"group {prompt!r} trained twice"  # C2
                groups[prompt] = (rid, v)
        return groups

    def started_prompts(self, token_to_text) -> set[str]:
        return {token_to_text(r["input_ids"]) for r in self.requests} - self.eval_prompts

    def failed(self) -> set[str]:
        return {g for e in self.rollouts.values() for g in e["failed_groups"]}

    def versions_live_at_once(self) -> bool:
        """Two engines held different versions at the same moment (from their load logs)."""
        events = sorted((e["t"], e["port"], e["version"]) for e in self.loads)
        current: dict[int, str] = {}
        for _, port, version in events:
            current[port] = version
            if len(set(current.values())) > 1:
                return True
        return False


def detok(ids: list[int]) -> str:
    sys.path.insert(0, str(HARNESS))
    from slime_cpu.model import SYMBOLS

    return " ".join(SYMBOLS[i] for i in ids)


def check_run(ev: Evidence, *, k: int, num_rollout: int, dora: bool, eval_before: bool, failed_ok: int = 0) -> dict:
    assert ev.result["status"] == "finished", ev.result.get("error", "")[-2000:]
    assert sorted(ev.trained) == list(range(num_rollout))
    groups = ev.trained_groups(k)
    started = ev.started_prompts(detok)
    failed = {p for p in started if p.startswith("zz")}
    assert set(groups) | failed == started, "a group that started generating was neither trained nor reported"  # C2
    assert len(failed) <= failed_ok
    assert ev.violations == [], ev.violations  # no engine loaded weights with requests running (R4)
    # eval (train.py also before training, on version 0), then after every 2nd rollout, each on
    # one version: the newest published one.
    assert len(ev.evals) == int(eval_before) + num_rollout // 2
    for i, e in enumerate(ev.evals):
        versions = {v for d in e["datasets"].values() for s in d for v in s["weight_versions"]}
        expected = "0" if eval_before and i == 0 else str(e["rollout_id"] + 1)
        assert versions == {expected}, f"eval at rollout {e['rollout_id']} ran on {versions}, expected {expected}"
        assert e["metrics"]["dora/eval_version"] == int(expected)
    if dora:
        assert ev.versions_live_at_once(), "mode dora never had two versions live at once"
    return groups


# (slime loop, mode, K, loss): SAO's custom loss, or slime's policy loss + our TIS hook. train.py
# with dora at K=1 and SAO's loss is test_our_rollout_function_generates_real_tokens_through_slime's run.
LOOPS = [
    ("train", "pipeline", 0, "sao"),
    ("train", "dora", 2, "slime"),
    ("train_async", "dora", 1, "sao"),
    ("train_async", "dora", 2, "slime"),
]


@pytest.mark.parametrize("loop, mode, k, loss", LOOPS, ids=[f"{l}-{m}-K{k}-{s}" for l, m, k, s in LOOPS])
def test_slime_loop_drives_dora(patched_slime, tmp_path, loop, mode, k, loss):
    ev = run_job(patched_slime, tmp_path / "job", "--loop", loop, "--mode", mode, "--k", str(k), "--num-rollout", "6",
                 "--loss", loss)
    groups = check_run(ev, k=k, num_rollout=6, dora=mode == "dora", eval_before=loop == "train")
    stale = [int(rid) - int(v) for rid, v in groups.values()]
    assert len(groups) == 6 * 2
    if mode == "pipeline":
        assert set(stale) == {0}
    # the trainer ran slime's loss plumbing with dora-ext's loss or TIS hook: their metrics are in its log
    key = "sao_masked_frac" if loss == "sao" else "tis"  # slime's own TIS (--use-tis)
    assert all(key in t["metrics"] for t in ev.trained.values()), [sorted(t["metrics"]) for t in ev.trained.values()]


def test_our_rollout_function_generates_real_tokens_through_slime(patched_slime, tmp_path):
    """Not the `args=None` pass-through: slime's RolloutManager calls generate_rollout with its
    real args; every trained token came from the CPU engine's model, with the rollout log-probs
    the engine returned, and slime's loss plumbing ran dora-ext's SAO loss on them."""
    ev = run_job(patched_slime, tmp_path / "job", "--loop", "train", "--mode", "dora", "--k", "1",
                 "--num-rollout", "2", "--eval-interval", "100")
    assert ev.result["status"] == "finished", ev.result.get("error")
    produced = ev.produced()
    samples = [s for r in ev.rollouts.values() for s in r["samples"]]
    assert samples and all(s["response_length"] > 0 for s in samples)
    assert all(tuple(s["tokens"]) in produced for s in samples)
    assert all(any(k.startswith("dora/") for k in r["metrics"]) for r in ev.rollouts.values())
    assert all(t["custom_loss"] == "custom_loss" and "sao_ratio" in t["metrics"] for t in ev.trained.values())


@pytest.mark.parametrize("fault_tolerance", [False, True], ids=["ft-off", "ft-on"])
def test_engine_killed_mid_rollout(patched_slime, tmp_path, fault_tolerance):
    """Engine 0 dies as its 3rd request starts (requests in flight die with it). Off: its
    trajectories go back to their version on the other engine. On (`--use-fault-tolerance`): the
    engine is relaunched and registered with slime's router, and the worker rediscovers it."""
    flags = ["--loop", "train_async", "--mode", "dora", "--k", "1", "--num-rollout", "6", "--kill-engine-after", "3"]
    if fault_tolerance:
        flags += ["--fault-tolerance", "--restart-engines"]
    ev = run_job(patched_slime, tmp_path / "job", *flags)
    check_run(ev, k=1, num_rollout=6, dora=False, eval_before=False)
    events = [e["event"] for e in ev.result["engine_events"]]
    assert events == (["died", "restarted"] if fault_tolerance else ["died"])
    assert max(r["metrics"].get("dora/redispatched", 0) for r in ev.rollouts.values()) >= 1
    if fault_tolerance:
        port = ev.result["engine_events"][1]["port"]
        assert any(r["port"] == port for r in ev.requests), "the relaunched engine was never used"
        assert any(e["port"] == port for e in ev.loads), "the relaunched engine never loaded a version"


@pytest.mark.parametrize("registration", ["reregister", "keep"])
def test_engine_restarted_at_the_same_address(patched_slime, tmp_path, registration):
    """slime's fault tolerance relaunches a dead engine at the address it had (its port scan starts from 15000 again).
    Engine 0 dies as its 3rd request starts and comes back at its port; the periodic refresh is pushed out of the run
    (600 s), so none falls between the death and the restart. slime's HTTP client retries the dead engine's requests at
    the same URL, and the successor answers them with its launch weight version: the worker must retire the old instance
    id and take the successor in under a fresh one (told by the router's new registration id, or with the old
    registration kept, by the weight version it reports), never fail trajectories for it (the old adapter kept the id
    and failed them until their retries ran out)."""
    flags = ["--loop", "train_async", "--mode", "dora", "--k", "1", "--num-rollout", "6", "--kill-engine-after", "3",
             "--fault-tolerance", "--restart-engines", "--restart-same-port", registration,
             "--engine-check-interval", "600"]
    ev = run_job(patched_slime, tmp_path / "job", *flags)
    check_run(ev, k=1, num_rollout=6, dora=False, eval_before=False)
    died, restarted = ev.result["engine_events"]
    assert (died["event"], restarted["event"]) == ("died", "restarted") and died["port"] == restarted["port"]
    old_ids, new_ids = restarted["router_ids"]
    assert (old_ids != new_ids) if registration == "reregister" else (old_ids == new_ids)
    metrics = [r["metrics"] for r in ev.rollouts.values()]
    assert max(m["dora/redispatched"] for m in metrics) >= 1
    assert max(m["dora/retries"] for m in metrics) == 0, "trajectories were failed for the restarted engine"
    assert max(m["dora/failed_groups"] for m in metrics) == 0
    successor = _lines(ev.work / restarted["log"])
    served = [e for e in successor if e["kind"] == "generate"]
    # The successor answered a request of its predecessor with its launch version (what told the
    # worker), then loaded a version and served the scheduler's requests at it.
    assert any(e["version_start"] == "default" for e in served)
    assert any(e["kind"] == "load" for e in successor)
    assert any(e["version_start"] == e["version_end"] != "default" for e in served)


def test_request_failing_every_retry_is_reported_and_training_goes_on(patched_slime, tmp_path):
    """Prompt 1 is aborted by the engine on every attempt: its group is reported, never trained,
    and the run trains every step."""
    ev = run_job(patched_slime, tmp_path / "job", "--loop", "train_async", "--mode", "dora", "--k", "1",
                 "--num-rollout", "6", "--fail-prompt", "--eval-interval", "100")
    assert ev.result["status"] == "finished", ev.result.get("error")
    groups = ev.trained_groups(1)
    started = ev.started_prompts(detok)
    failed = {p for p in started if p.startswith("zz")}
    assert len(failed) == 1 and not failed & set(groups)
    assert set(groups) | failed == started
    assert len(ev.failed()) == 1
    assert {p for r in ev.rollouts.values() for p in r["failed_prompts"]} == failed  # the group slime was told of
    assert max(r["metrics"]["dora/failed_groups"] for r in ev.rollouts.values()) == 1
    assert sorted(ev.trained) == list(range(6))


def test_kill_and_resume_from_slimes_checkpoint_loses_and_repeats_nothing(patched_slime, tmp_path):
    """The job dies while generating rollout 4 (after slime's checkpoint of rollout 3); a new job
    resumes from that checkpoint (`--load`)."""
    common = ["--loop", "train", "--mode", "dora", "--k", "2", "--num-rollout", "6", "--save-interval", "2",
              "--eval-interval", "100"]
    ev1 = run_job(patched_slime, tmp_path / "run1", *common, "--crash-at-rollout", "4")
    assert ev1.result["status"] == "crashed"
    assert sorted(ev1.trained) == [0, 1, 2, 3]
    ev2 = run_job(patched_slime, tmp_path / "run2", *common, "--load-from", str(tmp_path / "run1" / "ckpt"))
    assert ev2.result["status"] == "finished", ev2.result.get("error")
    assert sorted(ev2.trained) == [4, 5]
    g1, g2 = ev1.trained_groups(2), ev2.trained_groups(2)
    assert not set(g1) & set(g2), f"trained twice across the resume: {set(g1) & set(g2)}"
    lost = ev1.started_prompts(detok) - set(g1) - set(g2)
    assert not lost, f"groups that started before the crash were never trained: {lost}"
    assert ev2.started_prompts(detok) == set(g2)


SCALE = ["--loop", "train_async", "--mode", "dora", "--k", "1", "--engines", "3", "--capacity", "24",
         "--batch", "16", "--n", "6", "--num-rollout", "3", "--response-len", "200", "--step-s", "0.03",
         "--cheap-tokens", "--eval-interval", "1", "--eval-prompts", "24"]


def test_recipe_scale_run_retires_no_healthy_engine(patched_slime, tmp_path):
    """Recipe-scale concurrency: 3 engines of 24 slots (slime's pool then has exactly the 3 x 24 connections generation
    holds; 16 groups of 6 per step keep every slot busy), 6 s responses (200 tokens at a 30 ms batched decode step), an
    evaluation after every step adding 24 requests on top. No engine dies, so none may be retired, in training or in
    any evaluation (the last one included).

    Not here: `--use-fault-tolerance`. slime builds its health monitors only for the server groups it launches; the
    engines of this harness are external (`--rollout-external-engine-addrs`, slime cannot launch SGLang on a CPU), for
    which slime starts none, so no monitor would run. slime's own `RolloutHealthMonitor` against engines dora loads is
    `test_slime_gpu_limits.py::test_slimes_health_monitor_does_not_kill_an_engine_dora_loads`."""
    ev = run_job(patched_slime, tmp_path / "job", *SCALE)
    assert ev.result["status"] == "finished", ev.result.get("error", "")[-2000:]
    assert sorted(ev.trained) == [0, 1, 2]
    assert ev.result["engine_events"] == []  # no engine process died
    retired = [e["metrics"].get("dora/engines_retired") for e in [*ev.rollouts.values(), *ev.evals]]
    assert [e["metrics"]["dora/redispatched"] for e in ev.rollouts.values()] == [0, 0, 0]  # nothing taken away
    assert len(retired) == 6 and set(retired) == {0}, retired
    by_engine: dict = defaultdict(list)
    for e in ev.loads:
        by_engine[e["port"]].append(e["version"])
    assert all(len(v) == len(set(v)) for v in by_engine.values()), by_engine  # no engine rejoined and reloaded
    assert len(ev.evals) == 3 and all(e["metrics"]["dora/eval_version"] == e["rollout_id"] + 1 for e in ev.evals)
    if any(e["metrics"]["dora/eval_engines"] > 1 for e in ev.evals):  # slime's own eval_rollout, spread
        assert len({r["port"] for r in ev.requests if detok(r["input_ids"]) in ev.eval_prompts}) > 1
    ev.trained_groups(1)  # C1, C2 (nothing twice), C3
    assert ev.violations == []
    assert max(len(r["output_ids"]) for r in ev.requests) == 200
