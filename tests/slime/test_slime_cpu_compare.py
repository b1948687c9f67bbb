"""The checks of `benchmarks/slime_cpu_compare.py` can fail: each is fed a record that holds and
the same record with one violation in it.

The records have the shape of the harness's logs (`tests/slime/harness/slime_cpu`): the stand-in
server's generate and load entries, the rollout and eval log hooks' entries, the train actor's.
No slime job runs here; `test_slime_loops.py` runs them.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "slime" / "harness"))
from slime_cpu.model import SYMBOLS  # noqa: E402 - the stand-in's vocabulary: token id i is SYMBOLS[i]

spec = importlib.util.spec_from_file_location("slime_cpu_compare_under_test", ROOT / "benchmarks" / "slime_cpu_compare.py")
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench  # its dataclass looks its module up
spec.loader.exec_module(bench)

N = 2  # samples per group
PROMPTS = [["a b c =", "b c d ="], ["c d e =", "d e f ="]]  # the first and the second step's groups


def _evidence(versions: dict[int, str]) -> dict:
    """Two steps (the keys of `versions`) of two groups of N samples; the groups of step s generated
    at versions[s] (a tag), each sample by one request on port 1 (the first step) or 2 (the
    second), trained by the trainer as handed."""
    ev: dict = {"requests": [], "eval_requests": [], "loads": [], "rollouts": {}, "evals": [], "trained": {}}
    index = 0
    for step, prompts in zip(versions, PROMPTS):
        samples = []
        for g, prompt in enumerate(prompts):
            for i in range(N):
                prompt_ids, out_ids = [SYMBOLS.index(x) for x in prompt.split()], [10 + index, 11]
                samples.append({"prompt": prompt, "weight_versions": [versions[step]], "tokens": prompt_ids + out_ids,
                                "response_length": 2, "index": index})
                ev["requests"].append({"port": 1 + len(ev["rollouts"]), "prompt": prompt, "input_ids": prompt_ids, "output_ids": out_ids,
                                       "version_start": versions[step], "version_end": versions[step],
                                       "t0": float(index), "t1": index + 0.5, "finish": "length"})
                index += 1
        ev["rollouts"][step] = {"rollout_id": step, "samples": samples, "failed_prompts": [],
                                "metrics": {"dora/engines_retired": 0}}
        ev["trained"][step] = {"rollout_id": step, "tokens": [s["tokens"] for s in samples],
                               "sample_indices": [s["index"] for s in samples], "custom_loss": "policy_loss",
                               "metrics": {"tis": 1.0}, "t_end": 10.0 + step}
    return ev


ON_TIME = {0: "0", 1: "0"}  # dora's tags (the launch checkpoint is 0): step 1 trains version 0, 1 behind


def test_the_evidence_of_a_correct_run_passes_every_check():
    ev = _evidence(ON_TIME)
    assert bench.c1_violations(ev) == []
    assert bench.c2_violations(ev, N) == []
    assert bench.c3_violations(ev, k=1, first_version=0) == []


# ------------------------------------------------------------------ C1
def test_c1_fails_for_a_sample_whose_request_spanned_two_versions():
    ev = _evidence(ON_TIME)
    ev["requests"][0]["version_end"] = "1"  # the engine loaded version 1 under the request
    assert len(bench.c1_violations(ev)) == 1


def test_c1_fails_for_a_group_that_mixes_versions():
    ev = _evidence({0: "0", 1: "1"})
    sample, request = ev["rollouts"][1]["samples"][0], ev["requests"][N * 2]
    sample["weight_versions"] = ["0"]
    request["version_start"] = request["version_end"] = "0"  # produced and reported at 0, its sibling at 1
    assert [v for v in bench.c1_violations(ev) if "mixes versions" in v]


def test_c1_fails_for_a_trained_sample_no_engine_produced():
    ev = _evidence(ON_TIME)
    ev["requests"].pop()
    assert len(bench.c1_violations(ev)) == 1


def test_c1_fails_for_a_sample_that_reports_two_versions():
    """A sample whose versions say it spans two loads fails, even where the one request on record
    with its tokens ran at its first version."""
    ev = _evidence(ON_TIME)
    ev["rollouts"][0]["samples"][0]["weight_versions"] = ["0", "1"]
    assert f"step 0: a sample of {PROMPTS[0][0]!r} reports ['0', '1'], engines produced it at [('0', '0')]" \
        in bench.c1_violations(ev)


# ------------------------------------------------------------------ C2
def test_c2_fails_for_a_group_that_started_generating_and_was_dropped():
    ev = _evidence(ON_TIME)
    ev["requests"].append({**ev["requests"][0], "prompt": "e f g ="})  # admitted, never trained nor reported
    assert bench.c2_violations(ev, N) == ["group 'e f g =' started generating, was neither trained nor reported failed"]
    ev["rollouts"][1]["failed_prompts"] = ["e f g ="]  # reported failed: accounted for
    assert bench.c2_violations(ev, N) == []


def test_c2_fails_for_a_group_trained_and_reported_failed():
    ev = _evidence(ON_TIME)
    ev["rollouts"][1]["failed_prompts"] = [PROMPTS[0][0]]
    assert len(bench.c2_violations(ev, N)) == 1


def test_c2_fails_for_a_truncated_group():
    ev = _evidence(ON_TIME)
    ev["rollouts"][0]["samples"].pop()
    ev["trained"][0]["tokens"].pop()
    ev["trained"][0]["sample_indices"].pop()
    assert bench.c2_violations(ev, N) == [f"step 0: group {PROMPTS[0][1]!r} trained 1 samples of {N}"]


def test_c2_fails_when_the_trainer_did_not_train_what_slime_handed_over():
    ev = _evidence(ON_TIME)
    ev["trained"][1]["tokens"].pop()  # one sample lost between the hand-over and the trainer
    assert bench.c2_violations(ev, N) == ["step 1: the trainer did not train what slime handed over"]


def test_c2_fails_for_a_sample_or_a_group_trained_twice():
    ev = _evidence(ON_TIME)
    ev["trained"][1]["sample_indices"][0] = 0
    assert bench.c2_violations(ev, N) == ["sample 0 trained 2 times"]
    ev = _evidence(ON_TIME)
    twice = copy.deepcopy(ev["rollouts"][0]["samples"][:N])  # step 0's first group again in step 1
    ev["rollouts"][1]["samples"][:N] = twice
    ev["trained"][1]["tokens"][:N] = [s["tokens"] for s in twice]
    assert f"group {PROMPTS[0][0]!r} trained in steps [0, 1]" in bench.c2_violations(ev, N)


def test_c2_fails_for_a_trained_sample_its_engine_aborted():
    """A truncated trajectory: the engine aborted the request (SGLang's finish_reason "abort",
    its partial output returned) and that partial response was trained as if it had finished.
    The tokens and the version match the engine's record: only the finish tells it."""
    ev = _evidence(ON_TIME)
    ev["requests"][0]["finish"] = "abort"
    assert bench.c2_violations(ev, N) == [f"step 0: a sample of {PROMPTS[0][0]!r} trained from a request its engine "
                                          "aborted (a truncated trajectory)"]
    ev["requests"].append({**ev["requests"][0], "finish": "length"})  # the same tokens also came out whole
    assert bench.c2_violations(ev, N) == []


def _write_job(ev: dict, work: Path, eval_text: str = "a a =") -> None:
    """`ev` as the files a harness job leaves (what `read_evidence` reads), with one evaluation
    request on engine 1."""
    work.mkdir()
    by_port: dict = {}
    ids = [SYMBOLS.index(x) for x in eval_text.split()]
    evals = [{"kind": "generate", "port": 1, "input_ids": ids, "output_ids": [12], "version_start": "0",
              "version_end": "0", "t0": 0.0, "t1": 9.0, "finish": "length"}]
    for r in [*({k: v for k, v in r.items() if k != "prompt"} | {"kind": "generate"} for r in ev["requests"]), *evals]:
        by_port.setdefault(r["port"], []).append(r)
    for port, records in by_port.items():
        (work / f"engine{port}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (work / "eval.jsonl").write_text(json.dumps({"text": eval_text, "label": "a"}) + "\n")
    (work / "rollouts.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev["rollouts"].values()))
    (work / "train.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev["trained"].values()))


def test_read_evidence_keeps_every_entry_of_the_train_log(tmp_path):
    """The train actor logs one entry per train call: a step trained twice leaves two entries with
    one rollout id, and the second must not hide the first (C2: each sample trained once)."""
    _write_job(_evidence(ON_TIME), tmp_path / "job")
    ev = bench.read_evidence(tmp_path / "job")
    assert len(ev["requests"]) == 4 * N and [r["prompt"] for r in ev["eval_requests"]] == ["a a ="]
    assert (bench.c1_violations(ev), bench.c2_violations(ev, N), bench.c3_violations(ev, 1, 0)) == ([], [], [])
    with open(tmp_path / "job" / "train.jsonl", "a") as fh:  # the trainer trained step 1 a second time
        fh.write(json.dumps(_evidence(ON_TIME)["trained"][1]) + "\n")
    twice = bench.c2_violations(bench.read_evidence(tmp_path / "job"), N)
    assert [f"sample {i} trained 2 times" for i in range(2 * N, 4 * N)] == [v for v in twice if v.startswith("sample")]


# ------------------------------------------------------------------ C3
def test_c3_fails_for_a_uniformly_too_stale_run():
    """Steps 5 and 6 both trained samples 2 versions behind, with K = 1: the spread of
    step - version over the run is 0 (what the benchmark checked before), the staleness is not."""
    ev = _evidence({5: "3", 6: "4"})
    offsets = {rid - int(v) for rid, e in ev["rollouts"].items() for s in e["samples"] for v in s["weight_versions"]}
    assert max(offsets) - min(offsets) <= 1  # the old check passed
    assert bench.c3_violations(ev, k=1, first_version=0) == [
        f"step {step}: a sample of {p!r} at version {v}: 2 steps behind (K=1)"
        for step, v, prompts in ((5, 3, PROMPTS[0]), (6, 4, PROMPTS[1])) for p in prompts for _ in range(N)]
    assert bench.c3_violations(_evidence({5: "4", 6: "6"}), k=1, first_version=0) == []


def test_c3_counts_versions_as_each_loop_tags_them():
    """train.py on slime: step s trains the weights of s steps, tagged s + 1 (slime tags its first
    push, the loaded checkpoint, 1). Read as dora's tags (the checkpoint is 0) they would be from
    the future."""
    ev = _evidence({0: "1", 1: "2"})
    assert bench.c3_violations(ev, k=0, first_version=1) == []
    assert len(bench.c3_violations(ev, k=1, first_version=0)) == 2 * N * 2
    assert len(bench.c3_violations(_evidence({0: "1", 1: "1"}), k=0, first_version=1)) == 2 * N  # one behind


def test_c3_fails_for_a_sample_at_no_trainers_version():
    ev = _evidence({0: "default", 1: "0"})  # SGLang's launch tag: weights the trainer never pushed
    assert len(bench.c3_violations(ev, k=1, first_version=0)) == 2 * N
    ev["rollouts"][1]["samples"][0]["weight_versions"] = []
    assert len(bench.c3_violations(ev, k=1, first_version=0)) == 2 * N + 1


# ------------------------------------------------------------------ what the run observed
def test_engines_retired_counts_the_final_evaluation():
    ev = _evidence(ON_TIME)
    assert bench.engines_retired(ev, []) == 0
    ev["evals"].append({"rollout_id": 1, "metrics": {"dora/engines_retired": 1}})  # retired during the last eval
    assert bench.engines_retired(ev, []) == 1
    assert bench.engines_retired(ev, [{"event": "died"}]) is None  # an engine died: not told apart
    for e in [*ev["rollouts"].values(), *ev["evals"]]:
        e["metrics"].pop("dora/engines_retired")
    assert bench.engines_retired(ev, []) is None  # slime alone: no count of its own


def test_engines_and_concurrency_are_what_the_servers_saw():
    ev = _evidence(ON_TIME)
    assert bench.engines_served(ev) == 2
    assert bench.peak_concurrency(ev) == {1: 1, 2: 1}  # one request at a time
    ev["eval_requests"] = [{"port": 3, "t0": 0.0, "t1": 9.0}]  # an engine that served only the evaluation
    ev["requests"][1].update(t0=0.2, t1=0.7)  # overlaps the first
    assert bench.engines_served(ev) == 2
    assert bench.peak_concurrency(ev) == {1: 2, 2: 1, 3: 1}


def test_concurrency_does_not_count_a_request_that_starts_as_another_ends():
    """Back-to-back requests (one's start time is the other's end) never ran at once; a third one
    overlapping both makes two."""
    ev = _evidence(ON_TIME)
    ev["eval_requests"] = []
    ev["requests"] = [dict(ev["requests"][0], t0=float(i), t1=i + 1.0) for i in range(3)]
    assert bench.peak_concurrency(ev) == {1: 1}
    ev["requests"].append(dict(ev["requests"][0], t0=0.5, t1=2.5))
    assert bench.peak_concurrency(ev) == {1: 2}


def test_weight_transport_is_the_endpoints_the_loads_came_through():
    ev = _evidence(ON_TIME)
    assert bench.weight_transport(ev) == "none"
    ev["loads"].append({"endpoint": "update_weight_version", "version": "0"})  # a tag, no weights moved
    assert bench.weight_transport(ev) == "none"
    ev["loads"].append({"endpoint": "update_weights_from_disk", "version": "1", "path": "w/weight_v000001"})
    assert bench.weight_transport(ev) == "disk"
    ev["loads"].append({"endpoint": "update_weights_from_distributed", "version": "2"})
    assert bench.weight_transport(ev) == "disk+nccl"


def test_trained_loss_reports_tis_only_where_the_trainer_ran_it():
    ev = _evidence(ON_TIME)
    assert bench.trained_loss(ev) == "policy_loss+tis"
    ev["trained"][1]["metrics"] = {}
    assert bench.trained_loss(ev) == "policy_loss/policy_loss+tis"


@pytest.mark.parametrize("loss, k, expected", [
    ("slime", 1, ["--use-tis", "--tis-clip", "2.0", "--tis-clip-low", "0"]),
    ("sao", 1, ["--loss-type", "custom_loss", "--custom-loss-function-path", "dora_ext.slime.loss.sao_loss"]),
])
def test_slime_alone_gets_the_algorithm_flags_of_the_dora_twin(loss, k, expected):
    """The harness's `--no-dora` passes slime the loss and correction flags `dora-ext slime-args`
    prints for the dora twin, and none of the rest."""
    from slime_cpu.run import algorithm_flags

    from dora_ext.slime.cli import slime_flags
    from dora_ext.slime.settings import WEIGHT_RELOAD_HOOK_PATH

    cfg = {"dora": {"mode": "dora", "max_staleness": k}, "dora_slime": {"loss": loss, "staleness_correction": "tis"},
           "custom_rollout_weight_reload_path": WEIGHT_RELOAD_HOOK_PATH}
    flags = slime_flags(cfg, "dora.yaml", "w")
    assert algorithm_flags(flags) == expected
    assert set(expected) <= set(flags)


@pytest.mark.slow
@pytest.mark.parametrize("loss, expected", [
    ("slime", "custom_loss_function_path=None custom_tis_function_path=None loss_type=policy_loss tis_clip=2.0 "
              "tis_clip_low=0.0 use_tis=True"),
    ("sao", "custom_loss_function_path=dora_ext.slime.loss.sao_loss custom_tis_function_path=None "
            "loss_type=custom_loss tis_clip=2.0 tis_clip_low=0 use_tis=False"),  # slime's defaults: no TIS flags
])
def test_each_mode_reports_the_algorithm_slime_parsed(patched_slime, tmp_path, loss, expected):
    """What `same_algorithm` compares is read from slime's parsed arguments in each job (the
    harness's `--slime-args-only`: slime's own `parse_args` on the job's argv, then exit), not
    from the flags the harness meant to pass: the dora twin (train_async.py) and slime alone
    (train.py, `--no-dora`) parse to the same loss and correction settings."""
    import subprocess

    from slime_helpers import harness_env

    parsed = {}
    for name, extra in (("dora", ["--loop", "train_async"]), ("slime", ["--loop", "train", "--no-dora"])):
        work = tmp_path / name
        subprocess.run([sys.executable, "-m", "slime_cpu.run", "--workdir", str(work), "--loss", loss, "--k", "1",
                        "--engines", "1", "--cheap-tokens", "--slime-args-only", *extra],
                       env=harness_env(patched_slime), check=True, capture_output=True, timeout=300)
        parsed[name] = json.loads((work / "result.json").read_text())["algorithm"]
    assert parsed == {"dora": expected, "slime": expected}


def test_same_algorithm_compares_what_each_job_parsed_and_trained():
    modes = {m: {"algorithm": "loss_type=policy_loss tis_clip=2.0 use_tis=True", "loss": "policy_loss+tis"}
             for m in bench.MODES}
    assert bench.same_algorithm(modes)
    modes["slime_sync"]["algorithm"] = "loss_type=policy_loss tis_clip=3.0 use_tis=True"  # another cap, same loss
    assert not bench.same_algorithm(modes)
    modes["slime_sync"]["algorithm"] = None  # a job that reported nothing: not shown equal
    assert not bench.same_algorithm(modes)
