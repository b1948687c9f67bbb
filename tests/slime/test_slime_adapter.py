"""The slime adapter's logic, without slime: slime is ABSENT in CI (it is not on PyPI).

The adapter runs here against `slime_standins.py`: a Sample with slime's documented fields, a
data source with slime's interface, and a fake SGLang fleet behind a fake router, because no GPU
inference server can exist on this machine. Generation goes through a custom generate function
with slime's real signature (`async def generate(args, sample, sampling_params) -> Sample`).
What is checked is the adapter's own behaviour: batches and their order (R3), versions (C1, C3),
only drained engines loading (R4), engine capacity, data integrity and resume (C2).
"""

from __future__ import annotations

import pytest

from slime_helpers import SimulatedSlimeDriver, install_fleet_session, make_args

from dora_ext.config import ConfigError
from dora_ext.slime import _compat
from dora_ext.slime.data_source import DoraDataSource
from dora_ext.slime.engines import AdapterError


def _fleet(standins, args, engines=3):
    return standins.FakeSglangFleet(engines, capacity=args.dora_slime["capacity"])


def _check_batches(outs, args, k_bound):
    """Shape, C1 and C3 of every batch; returns prompts trained per step."""
    trained = {}
    for step, out in outs.items():
        assert isinstance(out, _compat.RolloutFnTrainOutput)
        assert len(out.samples) == args.rollout_batch_size
        prompts = []
        for group in out.samples:
            assert len(group) == args.n_samples_per_prompt
            versions = {v for s in group for v in s.weight_versions}
            assert len(versions) == 1, f"group mixes versions {versions}"  # C1, no mixed group
            (v,) = versions
            assert all(s.metadata["dora_version"] == int(v) for s in group)
            assert 0 <= step - int(v) <= k_bound  # C3
            assert all(s.status.value == "completed" and s.reward is not None for s in group)
            assert len({s.prompt for s in group}) == 1
            prompts.append(group[0].prompt)
        trained[step] = prompts
        assert out.metrics["dora/c1_ok"] == 1 and out.metrics["dora/c2_ok"] == 1 and out.metrics["dora/c3_ok"] == 1
    return trained


def test_dora_mode_streams_batches_within_staleness_and_loads_only_drained_engines(tmp_path, standins):
    args = make_args(tmp_path, mode="dora", k=2, batch=4, n=2, num_rollout=8, capacity=3)
    fleet = _fleet(standins, args)
    ds = install_fleet_session(args, None, fleet, first_step=0).data_source
    outs = SimulatedSlimeDriver(args, ds).run_async(0, 8)

    trained = _check_batches(outs, args, k_bound=2)
    flat = [p for k in sorted(trained) for p in trained[k]]
    assert len(flat) == len(set(flat)) == 8 * 4  # C2: nothing trained twice
    assert fleet.violations == []  # no load with requests running (R4), capacity kept
    assert max(e.max_running for e in fleet.engines) <= 3
    # Several versions were live at once (the point of mode dora), and batches took stale groups.
    assert any(len(s) > 1 for s in fleet.live_version_sets)
    assert any(outs[k].metrics["dora/batch_staleness_max"] > 0 for k in outs)
    # R2 + max_steps: admission stops where training stops; every admitted group was trained.
    assert ds.pending_count() == 0
    # Versions no engine can need again were deleted, as slime's own sync deletes them.
    left = sorted(p.name for p in (tmp_path / "weights").glob("weight_v*"))
    assert "weight_v000001" not in left and len(left) < 9


def test_pipeline_mode_is_on_policy_with_train_py_order(tmp_path, standins):
    args = make_args(tmp_path, mode="pipeline", k=0, batch=3, n=2, num_rollout=4)
    fleet = _fleet(standins, args, engines=2)
    ds = install_fleet_session(args, None, fleet, first_step=0).data_source
    outs = SimulatedSlimeDriver(args, ds).run_sync(0, 4)
    trained = _check_batches(outs, args, k_bound=0)
    assert sorted(p for k in trained for p in trained[k]) == sorted(f"p{i}" for i in range(12))
    for k, out in outs.items():
        assert {s.weight_versions[0] for g in out.samples for s in g} == {str(k)}
        assert out.metrics["dora/delivered_groups"] >= (k + 1) * 3  # CGP deliveries reported
    assert fleet.violations == []


def test_batches_take_oldest_versions_first(tmp_path, standins):
    # R3: a batch never takes a newer group while a complete older one waits.
    args = make_args(tmp_path, mode="dora", k=1, batch=4, n=2, num_rollout=6, capacity=4)
    fleet = _fleet(standins, args)
    ds = install_fleet_session(args, None, fleet, first_step=0).data_source
    outs = SimulatedSlimeDriver(args, ds).run_async(0, 6)
    _check_batches(outs, args, k_bound=1)
    for k in sorted(outs):
        versions = [int(g[0].weight_versions[0]) for g in outs[k].samples]
        assert versions == sorted(versions)  # oldest first within the batch


def test_dispatch_is_group_major_and_batches_follow_completion_order(tmp_path, standins):
    # FGD (R6): free slots go to the admitted group closest to completion, so a group's
    # trajectories all start before the next group's. CGP (R7): in mode pipeline a batch lists
    # its groups in the order they completed.
    standins.STARTS.clear()
    standins.FINISHES.clear()
    args = make_args(tmp_path, mode="pipeline", k=0, batch=3, n=4, num_rollout=3, capacity=2)
    fleet = _fleet(standins, args, engines=1)
    ds = install_fleet_session(args, None, fleet, first_step=0).data_source
    outs = SimulatedSlimeDriver(args, ds).run_sync(0, 3)
    _check_batches(outs, args, k_bound=0)
    order = [p for p, _ in standins.STARTS]
    first_start = {p: order.index(p) for p in set(order)}
    last_start = {p: len(order) - 1 - order[::-1].index(p) for p in set(order)}
    groups = sorted(first_start, key=first_start.get)
    for a, b in zip(groups, groups[1:]):
        assert last_start[a] < first_start[b], f"{b} started before all of {a} had"
    done_at = {}
    for i, (p, _) in enumerate(standins.FINISHES):
        done_at[p] = i  # the group completes with its last trajectory
    for out in outs.values():
        prompts = [g[0].prompt for g in out.samples]
        assert prompts == sorted(prompts, key=done_at.get)


def test_engine_reporting_another_version_is_retried_not_trained(tmp_path, standins):
    args = make_args(tmp_path, mode="dora", k=1, batch=2, n=2, num_rollout=3)
    fleet = _fleet(standins, args, engines=2)
    fleet.engines[0].wrong_version_once = True
    ds = install_fleet_session(args, None, fleet, first_step=0).data_source
    outs = SimulatedSlimeDriver(args, ds).run_async(0, 3)
    _check_batches(outs, args, k_bound=1)
    assert all(s.weight_versions != ["999"] for o in outs.values() for g in o.samples for s in g)
    assert outs[2].metrics["dora/retries"] >= 1


def test_resume_from_checkpoint_loses_and_repeats_nothing(tmp_path, standins):
    # Run 1 checkpoints after step 2 (train_async: batch 3 was already handed out), then dies.
    args = make_args(tmp_path, mode="dora", k=2, batch=3, n=2, num_rollout=7)
    fleet = _fleet(standins, args)
    ds = install_fleet_session(args, None, fleet, first_step=0).data_source
    run1 = SimulatedSlimeDriver(args, ds).run_async(0, 7, save_at=2)
    trained1 = _check_batches({k: v for k, v in run1.items() if k <= 2}, args, k_bound=2)
    from dora_ext.slime import rollout as slime_rollout

    slime_rollout.close_session()

    # Run 2: slime loads the step-2 checkpoint and starts at rollout id 3 (a new driver process).
    import uuid

    from dora_ext.slime import weights

    weights._RUN, weights._count = uuid.uuid4().hex, 0
    args2 = make_args(tmp_path, mode="dora", k=2, batch=3, n=2, num_rollout=7, load=str(tmp_path / "ckpt"))
    ds2 = DoraDataSource(args2)
    ds2.load(2)
    fleet2 = _fleet(standins, args2)
    install_fleet_session(args2, ds2, fleet2, first_step=3)
    run2 = SimulatedSlimeDriver(args2, ds2).run_async(3, 7)
    trained2 = _check_batches(run2, args2, k_bound=2)

    flat = [p for k in sorted(trained1) for p in trained1[k]] + [p for k in sorted(trained2) for p in trained2[k]]
    assert len(flat) == len(set(flat)), "a prompt was trained twice across the resume"
    n = len(flat)
    # Every prompt handed out is trained exactly once: the trained set is a prefix of the dataset
    # up to what the last batches still had in flight at the end.
    assert set(flat) >= {f"p{i}" for i in range(n - 3 * 2)}
    assert fleet2.violations == []


def test_failed_groups_are_reported_and_not_requeued(tmp_path, standins):
    args = make_args(tmp_path)
    ds = DoraDataSource(args)
    groups = ds.get_samples(3)
    ids = [g[0].metadata["dora_ledger"] for g in groups]
    ds.dora_assign([ids[0]], 5)
    ds.dora_fail(ids[1])
    ds.save(4)
    ds2 = DoraDataSource(make_args(tmp_path, load=str(tmp_path / "ckpt")))
    ds2.load(4)
    requeued = ds2.get_samples(2)
    # id0 goes to step 5 (> 4: not trained at checkpoint 4), id2 never assigned; id1 failed.
    assert [g[0].prompt for g in requeued] == [groups[0][0].prompt, groups[2][0].prompt]
    assert all(s.response == "" and s.status.value == "pending" for g in requeued for s in g)
    ds.dora_forget_before(6)
    assert ds.pending_count() == 1


def test_out_of_order_rollout_id_is_an_error(tmp_path, standins):
    args = make_args(tmp_path, num_rollout=4)
    fleet = _fleet(standins, args)
    ds = install_fleet_session(args, None, fleet, first_step=0).data_source
    driver = SimulatedSlimeDriver(args, ds)
    driver.push_weights()
    driver.generate(0)
    with pytest.raises(AdapterError, match="rollout 2"):
        driver.generate(2)


def test_args_none_passes_finished_samples_through_and_refuses_pending_ones(standins):
    # slime's contract harness calls the rollout function with args=None: no engines exist.
    from dora_ext.slime.rollout import generate_rollout

    class Finished:
        def __init__(self):
            self.i = 0

        def get_samples(self, k):
            out = []
            for _ in range(k):
                g = [standins.Sample(index=self.i + j, prompt=f"q{self.i}", reward=0.0,
                                     status=standins.Sample.Status.COMPLETED) for j in range(2)]
                self.i += 2
                out.append(g)
            return out

    out = generate_rollout(None, 2, Finished())
    assert isinstance(out, _compat.RolloutFnTrainOutput) and out.samples
    assert all(len(g) == 2 for g in out.samples)
    ev = generate_rollout(None, 2, Finished(), evaluation=True)
    assert isinstance(ev, _compat.RolloutFnEvalOutput) and ev.data["data_source"]["samples"]

    class Pending(Finished):
        def get_samples(self, k):
            groups = super().get_samples(k)
            groups[0][0].status = standins.Sample.Status.PENDING
            return groups

    with pytest.raises(AdapterError, match="no engines"):
        generate_rollout(None, 0, Pending())


# ---------------------------------------------------------------------------- settings and CLI
@pytest.mark.parametrize(
    "change, key",
    [
        ({"dora": {"mode": "dora", "max_staleness": 1, "batch_size": 99}}, "dora.batch_size"),
        ({"dora": {"mode": "dora", "migrate": True}}, "dora.migrate"),
        ({"dora": {"mode": "dora", "max_staleness": 1, "elastic": True}}, "dora.elastic"),
        ({"dora": {"mode": "partial"}}, "dora.mode"),
        ({"dora": {"mode": "dora", "max_staleness": 0}}, "dora.max_staleness"),
        ({"dora_slime": {"capacity": 0}}, "dora_slime.capacity"),
        ({"dora_slime": {"loss": "ppo2"}}, "dora_slime.loss"),
        ({"dora_slime": {"load_timeout_s": 0}}, "dora_slime.load_timeout_s"),
        ({"dora_slime": {"typo": 1}}, "dora_slime.typo"),
        ({"colocate": True}, "colocate"),
        ({"update_weights_interval": 2}, "update_weights_interval"),
        ({"update_weight_transport": "nccl"}, "update_weight_transport"),
        ({"custom_rollout_weight_reload_path": None}, "custom_rollout_weight_reload_path"),
        ({"dynamic_sampling_filter_path": "x.check"}, "dynamic_sampling_filter_path"),
        ({"partial_rollout": True}, "partial_rollout"),
    ],
)
def test_bad_settings_name_the_key(tmp_path, change, key):
    from dora_ext.slime.settings import check_launch, dora_config, slime_settings

    args = make_args(tmp_path)
    for k, v in change.items():
        setattr(args, k, v)
    with pytest.raises(ConfigError) as err:
        check_launch(args)
        slime_settings(args)
        dora_config(args, instances=[4])
    assert err.value.field == key


def test_slime_args_prints_flags_for_a_valid_file(tmp_path, capsys):
    from dora_ext.cli import main

    cfg = tmp_path / "dora.yaml"
    cfg.write_text(
        "dora: {mode: dora, max_staleness: 2}\n"
        "dora_slime: {weights_dir: /shared/w, loss: sao, staleness_correction: mask}\n"
        "custom_rollout_weight_reload_path: dora_ext.slime.weights.publish_weights\n"
    )
    assert main(["slime-args", "--config", str(cfg)]) == 0
    words = capsys.readouterr().out.split()
    pairs = dict(zip(words[::1], words[1::1]))
    assert pairs["--rollout-function-path"] == "dora_ext.slime.rollout.generate_rollout"
    assert pairs["--data-source-path"] == "dora_ext.slime.data_source.DoraDataSource"
    assert pairs["--custom-config-path"] == str(cfg)
    assert pairs["--update-weight-transport"] == "disk" and pairs["--update-weight-disk-dir"] == "/shared/w"
    assert pairs["--custom-loss-function-path"] == "dora_ext.slime.loss.sao_loss"
    assert pairs["--loss-type"] == "custom_loss"
    # slime applies the TIS hook inside its own policy loss only, which SAO replaces.
    assert "--use-tis" not in words
    cfg.write_text(cfg.read_text().replace("loss: sao", "loss: slime"))
    assert main(["slime-args", "--config", str(cfg)]) == 0
    words = capsys.readouterr().out.split()
    assert words[words.index("--custom-tis-function-path") + 1] == "dora_ext.slime.loss.staleness_tis"
    assert "--use-tis" in words and "--loss-type" not in words


def test_slime_args_rejects_a_file_without_the_weight_hook(tmp_path, capsys):
    from dora_ext.cli import main

    cfg = tmp_path / "dora.yaml"
    cfg.write_text("dora: {mode: dora}\ndora_slime: {weights_dir: /w}\n")
    assert main(["slime-args", "--config", str(cfg)]) == 2
    assert "custom_rollout_weight_reload_path" in capsys.readouterr().err


def test_example_config_is_valid(tmp_path, capsys):
    from dora_ext.cli import main

    assert main(["slime-args", "--example-config"]) == 0
    cfg = tmp_path / "x.yaml"
    cfg.write_text(capsys.readouterr().out)
    assert main(["slime-args", "--config", str(cfg), "--format", "array"]) == 0
    assert capsys.readouterr().out.startswith("DORA_ARGS=(")


def test_slime_args_imports_neither_slime_nor_torch():
    import subprocess
    import sys

    code = ("import sys; before = set(sys.modules)\n"
            "from dora_ext.cli import main; main(['slime-args', '--example-config'])\n"
            "print(' '.join(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in ('torch', 'slime', 'ray'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip().splitlines()[-1] == "custom_rollout_weight_reload_path: dora_ext.slime.weights.publish_weights"
