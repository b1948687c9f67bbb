"""Regression tests for defects found by driving the adapter with slime's real loops (issue 11).

slime is ABSENT here (CI); like `test_slime_adapter.py` these run the adapter against the
stand-ins of `slime_standins.py` (fake SGLang fleet, custom generate function with slime's
signature). Event orders are forced with the session's probe and a gated weight board (injected
delays on each side), never by hoping for timing.
"""

from __future__ import annotations

import collections
import threading
import uuid
from pathlib import Path

import pytest

from slime_helpers import SimulatedSlimeDriver, check_trained, install_fleet_session, make_args

from dora_ext.config import ConfigError
from dora_ext.slime import rollout as slime_rollout
from dora_ext.slime import weights
from dora_ext.slime.data_source import DoraDataSource

WAIT_S = 60


class GatedBoard:
    """The worker's view of the weight board, holding back publications until `allowed`."""

    def __init__(self, board):
        self.board = board
        self.allowed = 0

    def poll(self):
        return min(self.board.poll(), self.allowed)

    def path(self, version):
        return self.board.path(version)

    def release(self, version):
        self.board.release(version)


def _fresh_run():
    weights._RUN, weights._count = uuid.uuid4().hex, 0


def _run_train_py_order(tmp_path: Path, standins, mode: str, k: int, orders: list[str]) -> dict:
    """slime's train.py order (generate k, train k, push weights k+1, generate k+1), with the order
    of "slime asks for k+1" and "the worker sees version k+1" forced per step."""
    _fresh_run()
    num = len(orders) + 1
    args = make_args(tmp_path, mode=mode, k=k, batch=2, n=2, num_rollout=num, capacity=2)
    fleet = standins.FakeSglangFleet(2, capacity=2)
    session = install_fleet_session(args, None, fleet, first_step=0)
    gate = GatedBoard(session.board)
    session.board = gate
    events = collections.defaultdict(threading.Event)
    session.probe = lambda name, value: events[(name, value)].set()
    driver = SimulatedSlimeDriver(args, session.data_source)
    driver.push_weights()
    gate.allowed = 1
    outs = {0: driver.generate(0)}
    for step, order in enumerate(orders, start=1):
        driver.push_weights()  # version `step` is on disk; the worker does not see it yet
        if order == "request_first":
            result: dict = {}

            def ask(step=step, result=result):
                try:
                    result["out"] = driver.generate(step)
                except BaseException as exc:  # noqa: BLE001 - re-raised below
                    result["err"] = exc

            t = threading.Thread(target=ask)
            t.start()
            assert events[("request", step)].wait(WAIT_S), f"rollout {step} was never requested"
            gate.allowed = step + 1
            t.join(WAIT_S)
            assert not t.is_alive()
            if "err" in result:
                raise result["err"]
            outs[step] = result["out"]
        else:
            gate.allowed = step + 1
            assert events[("published", step)].wait(WAIT_S)
            assert events[("batch", step)].wait(WAIT_S), f"batch {step} was never formed"
            outs[step] = driver.generate(step)
    assert fleet.violations == []
    slime_rollout.close_session()
    return outs


def test_train_py_order_race_both_orders_20_times(tmp_path, standins):
    """Defect 1: with the weight push first, the scheduler forms batch k+1 before slime asks for it."""
    configs = [("pipeline", 0), ("dora", 1), ("dora", 2)]
    for i in range(20):
        mode, k = configs[i % 3]
        orders = ["publish_first" if (i + s) % 2 == 0 else "request_first" for s in range(3)]
        outs = _run_train_py_order(tmp_path / f"run{i}", standins, mode, k, orders)
        check_trained(outs, 4 * 2, k)


def test_sibling_of_a_failed_group_finishing_later_does_not_kill_the_worker(tmp_path, standins):
    """Defect 2: a request fails on every retry; its sibling, still running when the group is
    reported failed, finishes afterwards. The group is reported and training goes on."""
    import asyncio

    args = make_args(tmp_path, mode="dora", k=1, batch=2, n=2, num_rollout=4, capacity=2)
    fleet = standins.FakeSglangFleet(2, capacity=2)
    ds = install_fleet_session(args, None, fleet, first_step=0).data_source
    assert ds.base.offset == 0  # the stand-in base: group p0 is next, its samples are indices 0 and 1
    standins.FAIL_ALWAYS.add(("p0", 0))
    held = asyncio.Event()
    standins.HOLD[("p0", 1)] = held
    failed = []
    report = ds.dora_fail

    def dora_fail(ledger_id):  # the rollout worker reports the group: only now let the sibling finish
        failed.append(ledger_id)
        report(ledger_id)
        held.set()

    ds.dora_fail = dora_fail
    try:
        outs = SimulatedSlimeDriver(args, ds).run_async(0, 4)
    finally:
        standins.FAIL_ALWAYS.clear()
        standins.HOLD.clear()
    assert failed, "the group was never reported failed"
    trained = [g[0].prompt for out in outs.values() for g in out.samples]
    assert "p0" not in trained and len(trained) == len(set(trained)) == 4 * 2
    assert outs[3].metrics["dora/failed_groups"] == 1
    assert ds._ledger and all(step != "failed" for _, (g, step) in ds._ledger.items() if g[0].prompt != "p0")
    assert any(step == "failed" for _, (g, step) in ds._ledger.items() if g[0].prompt == "p0")


def test_checkpoint_taken_while_the_worker_takes_prompts_resumes_each_group_once(tmp_path, standins):
    """Defect 5: slime's cursor and the ledger are saved atomically. The worker asks for a prompt while slime's base
    `save` is writing (forced: the base holds until that call returned, or 2 s when the call is correctly blocked)."""
    standins.SAVE_IN.clear()
    standins.SAVE_GO.clear()
    args = make_args(tmp_path)
    args.dora_slime["base_data_source_path"] = "slime_standins.HoldingSaveBaseDataSource"
    ds = DoraDataSource(args)
    before = ds.get_samples(2)
    ds.dora_assign([g[0].metadata["dora_ledger"] for g in before], 2)  # trained by step 2
    saver = threading.Thread(target=ds.save, args=(2,))
    saver.start()
    assert standins.SAVE_IN.wait(WAIT_S)
    taken: list = []

    def take():
        taken.extend(ds.get_samples(1))
        standins.SAVE_GO.set()

    worker = threading.Thread(target=take)
    worker.start()
    saver.join(WAIT_S)
    worker.join(WAIT_S)
    assert not saver.is_alive() and not worker.is_alive() and len(taken) == 1

    args2 = make_args(tmp_path, load=str(tmp_path / "ckpt"))
    args2.dora_slime["base_data_source_path"] = "slime_standins.StandinBaseDataSource"
    ds2 = DoraDataSource(args2)
    ds2.load(2)
    resumed = [g[0].prompt for g in ds2.get_samples(3)]
    assert len(resumed) == len(set(resumed)), f"a group comes back twice after the resume: {resumed}"
    assert resumed == ["p2", "p3", "p4"]


@pytest.mark.parametrize(
    "flag, value",
    [("update_weight_mode", "delta"), ("update_weight_local_checkpoint_dir", "/nvme/ckpt")],
)
def test_weight_sync_settings_dora_cannot_honour_are_refused_by_name(tmp_path, standins, flag, value):
    """Defects 3 and 7: `--update-weight-mode delta` skipped the patched hook and the worker
    waited forever for a version; `--update-weight-local-checkpoint-dir` was bypassed."""
    args = make_args(tmp_path, num_rollout=2, **{flag: value})
    ds = DoraDataSource(args)
    with pytest.raises(ConfigError) as err:
        install_fleet_session(args, ds, standins.FakeSglangFleet(1, capacity=4), first_step=0)
    assert err.value.field == flag


@pytest.mark.parametrize("keep", [False, True])
def test_disk_keep_files_keeps_every_version(tmp_path, standins, keep):
    """Defect 7: `--update-weight-disk-keep-files` was ignored (old versions deleted anyway)."""
    args = make_args(tmp_path, mode="dora", k=1, batch=2, n=2, num_rollout=5, update_weight_disk_keep_files=keep)
    ds = install_fleet_session(args, None, standins.FakeSglangFleet(2, capacity=2), first_step=0).data_source
    driver = SimulatedSlimeDriver(args, ds)
    driver.run_async(0, 5)
    left = sorted(p.name for p in (tmp_path / "weights").glob("weight_v*"))
    if keep:
        assert left == [f"weight_v{i:06d}" for i in range(1, driver.pushes + 1)]
    else:
        assert "weight_v000001" not in left


def test_deterministic_inference_sends_slimes_per_sample_seed(tmp_path, standins):
    """Defect 7: with `--sglang-enable-deterministic-inference` slime seeds each sample with
    `rollout_seed + its index in the group`; the adapter dropped the seed."""
    standins.PARAMS.clear()
    args = make_args(tmp_path, mode="dora", k=1, batch=2, n=3, num_rollout=2,
                     sglang_enable_deterministic_inference=True, rollout_seed=42)
    ds = install_fleet_session(args, None, standins.FakeSglangFleet(2, capacity=3), first_step=0).data_source
    outs = SimulatedSlimeDriver(args, ds).run_async(0, 2)
    for out in outs.values():
        for group in out.samples:
            for pos, s in enumerate(group):
                assert standins.PARAMS[(s.prompt, s.index)]["sampling_seed"] == 42 + pos


def test_all_samples_process_hook_gets_every_batch(tmp_path, standins):
    """Defect 7: `--rollout-all-samples-process-path` was ignored."""
    standins.ALL_SAMPLES_CALLS.clear()
    args = make_args(tmp_path, mode="dora", k=1, batch=2, n=2, num_rollout=3,
                     rollout_all_samples_process_path="slime_standins.record_all_samples")
    ds = install_fleet_session(args, None, standins.FakeSglangFleet(2, capacity=2), first_step=0).data_source
    outs = SimulatedSlimeDriver(args, ds).run_async(0, 3)
    assert len(standins.ALL_SAMPLES_CALLS) == 3
    for (a, samples, source), k in zip(standins.ALL_SAMPLES_CALLS, sorted(outs)):
        assert a is args and source is ds and samples is outs[k].samples


@pytest.mark.parametrize("name", ["dora-k2.yaml", "dora-pipeline.yaml"])
def test_slime_args_on_a_shipped_recipe_as_a_user_runs_it(name):
    """Defect 8: `dora-ext slime-args --config recipes/slime/dora-k2.yaml` exited 2 (weights_dir required). Without a
    weights directory the flags leave slime's own --update-weight-disk-dir to the launch script, and say so."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "dora_ext.cli", "slime-args", "--config", f"recipes/slime/{name}"],
                       cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    words = r.stdout.split()
    assert words[words.index("--rollout-function-path") + 1] == "dora_ext.slime.rollout.generate_rollout"
    assert words[words.index("--update-weight-transport") + 1] == "disk"
    assert "--update-weight-disk-dir" not in words
    assert "--update-weight-disk-dir" in r.stderr
    r2 = subprocess.run([sys.executable, "-m", "dora_ext.cli", "slime-args", "--config", f"recipes/slime/{name}",
                         "--weights-dir", "shared/w"], cwd=root, capture_output=True, text=True, timeout=60)
    words = r2.stdout.split()
    assert r2.returncode == 0 and words[words.index("--update-weight-disk-dir") + 1] == "shared/w"


def test_weights_dir_contradicting_slimes_disk_dir_is_refused(tmp_path, standins):
    args = make_args(tmp_path)
    args.dora_slime["weights_dir"] = str(tmp_path / "elsewhere")
    with pytest.raises(ConfigError) as err:
        install_fleet_session(args, DoraDataSource(args), standins.FakeSglangFleet(1, capacity=4), first_step=0)
    assert err.value.field == "dora_slime.weights_dir"


@pytest.mark.parametrize("fault_tolerance", [False, True])
def test_engine_killed_mid_rollout(tmp_path, standins, fault_tolerance):
    """Defect 4: engine URLs were read once. An engine dies with requests running (forced: it
    dies as its 3rd request starts). Without fault tolerance its trajectories go back to the same
    version on the other engines; with it, slime restarts the engine and registers it with the
    router again (here: a new engine at a new port), and the worker rediscovers it."""
    if fault_tolerance:
        pytest.importorskip("slime.utils.health_monitor", reason="needs a slime checkout (DORA_SLIME_PATH)")
    args = make_args(tmp_path, mode="dora", k=1, batch=2, n=2, num_rollout=6, capacity=2,
                     use_fault_tolerance=fault_tolerance)
    args.dora_slime["engine_check_interval_s"] = 0.02
    fleet = standins.FakeSglangFleet(2, capacity=2, base_port=31100)
    victim = fleet.engines[0]
    died_at = {}

    def on_start(engine):
        if engine is victim and engine.started == 3:
            engine.alive = False
            died_at["started"] = engine.started

    session = install_fleet_session(args, None, fleet, first_step=0)
    seen = collections.defaultdict(list)

    def probe(name, value):
        seen[name].append(value)
        if name == "engine_failed" and fault_tolerance and len(fleet.engines) == 2:
            fleet.add_engine(31102)  # slime's fault tolerance: relaunched and registered again

    session.probe = probe
    standins.ON_START = on_start
    try:
        outs = SimulatedSlimeDriver(args, session.data_source).run_async(0, 6)
    finally:
        standins.ON_START = None
    assert died_at and seen["engine_failed"] == [0]
    check_trained(outs, 6 * 2, k=1)  # C1 despite the re-dispatch
    assert outs[5].metrics["dora/redispatched"] >= 1
    assert victim.started == died_at["started"]  # nothing was sent to the dead engine
    if fault_tolerance:
        assert seen["engine_joined"] == [2]
        newcomer = fleet.engines[2]
        assert newcomer.loads and newcomer.started > 0
    else:
        assert not seen["engine_joined"]


def test_slime_args_routes_evaluation_through_the_adapter(tmp_path):
    """Defect 6: slime-args pointed --eval-function-path at slime's own rollout, which evaluates
    through the router on engines holding mixed versions."""
    from dora_ext.slime.cli import slime_flags

    flags = slime_flags({"dora": {"mode": "dora", "max_staleness": 1},
                         "custom_rollout_weight_reload_path": "dora_ext.slime.weights.publish_weights"}, None, "w")
    assert flags[flags.index("--eval-function-path") + 1] == "dora_ext.slime.rollout.generate_rollout"


def test_tis_with_sao_loss_is_refused_by_name(tmp_path, standins):
    """Found with slime's loop: --use-tis with SAO's custom loss was silently ignored by slime
    (its TIS hook runs inside slime's own policy loss, which a custom loss replaces)."""
    args = make_args(tmp_path, loss_type="custom_loss", custom_loss_function_path="dora_ext.slime.loss.sao_loss",
                     use_tis=True)
    with pytest.raises(ConfigError) as err:
        install_fleet_session(args, DoraDataSource(args), standins.FakeSglangFleet(1, capacity=4), first_step=0)
    assert err.value.field == "use_tis"
