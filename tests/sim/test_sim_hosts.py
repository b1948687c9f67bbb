"""Host profiles (`--host`): `ideal` is today's model byte for byte, and each cost a host adds
appears in the simulated timeline exactly as modelled (a load charged to the trainer, a migration
that re-prefills, a KV budget that preempts)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dora_ext.cli import main
from dora_ext.sim import PRESETS, EngineCost, TrainerCost, Workload, WorkloadError
from dora_ext.sim.engine import SimInstance
from dora_ext.sim.hosts import HOSTS, get_host
from dora_ext.sim.runner import Simulation

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("extra", [[], ["--host", "ideal"]])
def test_ideal_host_reproduces_the_output_from_before_hosts(capsys, extra):
    # The expected file was written by the simulator before host profiles and admission policies
    # existed: with the admission of that time (`fill`) the output is the same, less the staleness
    # histogram added since.
    rc = main(["simulate", "--preset", "rolloutpipe-8k", "--steps", "10", "--seed", "1", "--json",
               "--admission", "fill", *extra])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for row in out["modes"].values() if "modes" in out else out.values():
        assert isinstance(row.pop("staleness_hist"), dict)
    # (stored on one line: JSON gives the same floats back, so this compares the printed text)
    expected = json.dumps(json.loads((DATA / "rolloutpipe-8k-steps10-seed1.json").read_text()), indent=2)
    assert json.dumps(out, indent=2) == expected


def _tiny(**engine) -> object:
    """2 accelerators (1 instance + 1 trainer), one group of 2 trajectories of 100 tokens a step."""
    ec = dict(decode_a_s=1e-3, decode_b_s=0.0, decode_c_s=0.0, prefill_s_per_token=1e-4, weight_load_s=0.5,
              kv_bytes_per_token=1.0, migrate_bytes_per_s=1e6, capacity=4, weight_bytes=1e9, kv_budget_tokens=0)
    ec.update(engine)
    return dataclasses.replace(
        PRESETS["rolloutpipe-8k"], name="tiny", accelerators=2, engine=EngineCost(**ec),
        trainer=TrainerCost(train_acc_s_per_token=1e-3, optimizer_acc_s=0.2, broadcast_s=0.1),
        workload=Workload(response_median=100, response_cv=0.0, response_cap=100, prompt_median=10,
                          prompt_cv=0.0, prompt_cap=10, group_size=2, difficulty_share=0.0),
        batch_size=1, default_split=(1, 1), sync_colocated=False)


def test_a_load_charged_to_the_trainer_blocks_its_step():
    # The step of the tiny preset: rollout 0.102 s, training 0.22 s + optimizer 0.2 s, a load 0.2 s.
    gather = get_host("verl-gather:load_fixed_s=0.2,load_bytes_per_s=0")
    apart = dataclasses.replace(gather, load_on_trainer=False)  # the same load, paid by the instance
    for mode, extra in (("one_step_off", 0.2), ("dora", 0.2), ("sync", 0.0)):
        on, off = (Simulation(_tiny(), mode, steps=8, host=h).run() for h in (gather, apart))
        loads = [(a, b) for (a, b), k in zip(on.trainer_busy, on.trainer_kinds) if k == "load"]
        assert len(loads) == 8 and all(b - a == pytest.approx(0.2) for a, b in loads)
        assert "load" not in off.trainer_kinds
        spans = sorted(on.trainer_busy)  # the trainer runs nothing else meanwhile
        assert all(b0 <= a1 + 1e-12 for (_, b0), (a1, _) in zip(spans, spans[1:]))
        assert on.metrics["trainer_weight_sync_s_per_step"] == pytest.approx(0.2)
        # trainer-bound asynchronous modes: every step is longer by exactly the load it ran (0.62
        # s against 0.42 s); in sync the load was on the critical path already (rollout, train, load)
        d_on = [b - a for a, b in zip(on.step_end, on.step_end[1:])]
        d_off = [b - a for a, b in zip(off.step_end, off.step_end[1:])]
        assert d_on == pytest.approx([x + extra for x in d_off], abs=1e-9), mode


def test_a_migration_without_kv_transfer_re_prefills_the_context(monkeypatch):
    preset = PRESETS["rolloutpipe-8k"]
    sim = Simulation(preset, "dora", steps=4, host="verl")
    seen = []
    orig = Simulation._migrate

    def spy(self, act):
        src, dst = self.inst[act.src], self.inst[act.dst]
        key = (act.group_id, act.index)
        if src.holds(key):
            _, prompt, lengths = self.groups[act.group_id]
            dst.advance(self.now)
            start = max(self.now, dst.busy_until)
            before = self.migration_reprefill
            orig(self, act)
            context = self.migration_reprefill - before
            # the context is the prompt and what was generated, re-prefilled on the destination
            assert prompt <= context <= prompt + lengths[act.index]
            if dst.holds(key) and key in dst.seqs:
                assert dst.busy_until - start == pytest.approx(context * preset.engine.prefill_s_per_token)
                seen.append(context)
        else:
            orig(self, act)

    monkeypatch.setattr(Simulation, "_migrate", spy)
    res = sim.run()
    assert seen and res.metrics["reprefilled_tokens"] == round(sim.migration_reprefill) > 0
    assert res.metrics["migrations"] >= len(seen)


def test_a_kv_budget_below_the_running_contexts_preempts():
    # Two sequences, prompt 10, 100 tokens each; the budget holds 160 tokens. They run together
    # until the next iteration would not fit (20 + 2m + 2 > 160 - 0.5: m = 69), the newest is
    # preempted with its context of 79, the first finishes alone after 31 more iterations, then the
    # second re-prefills its 79 tokens and decodes its last 31.
    preset = _tiny(kv_budget_tokens=160)
    si = SimInstance(0, preset.engine, 160)
    si.add("a", 100, 10, 0.0, 10)
    si.add("b", 100, 10, 0.0, 10)
    t = si.next_finish()
    assert si.kv_due and t == pytest.approx(2e-3 + 69 * 1e-3)
    assert si.pop_finished(t) == [] and si.preemptions == 1 and list(si.waiting)[0][:3] == ("b", 31, 79)
    t = si.next_finish()
    assert si.pop_finished(t) == ["a"] and t == pytest.approx(2e-3 + 100e-3)
    assert si.recomputed == 79 and si.r == 1
    t = si.next_finish()
    assert si.pop_finished(t) == ["b"] and t == pytest.approx(2e-3 + 100e-3 + 79e-4 + 31e-3)
    # and in a run (sync: one rollout per step): with KV memory each step preempts once and is
    # longer by exactly the 79-token re-prefill and the 31 iterations b runs alone; without,
    # nothing is preempted
    kv, ideal = (Simulation(_tiny(kv_budget_tokens=160), "sync", steps=3, host=h).run()
                 for h in ("ideal:kv_memory=true", "ideal"))
    assert kv.metrics["preemptions"] == 3 and ideal.metrics["preemptions"] == 0
    assert kv.metrics["preemption_recomputed_tokens"] == 3 * 79
    assert [b - a for a, b in zip(ideal.step_end, kv.step_end)] == pytest.approx([k * (79e-4 + 31e-3) for k in (1, 2, 3)])


def test_host_profiles_and_errors(capsys):
    assert set(HOSTS) >= {"ideal", "verl", "slime", "embedded"}
    assert get_host("slime:publish_bytes_per_s=4e9").publish_bytes_per_s == 4e9
    for bad in ("nope", "slime:x=1", "slime:publish_bytes_per_s=fast"):
        with pytest.raises(WorkloadError, match="host"):
            get_host(bad)
    assert main(["simulate", "--preset", "rolloutpipe-8k", "--host", "nope"]) == 2
    with pytest.raises(WorkloadError, match="kv_budget_tokens"):
        Simulation(_tiny(kv_budget_tokens=50), "sync", steps=2, host="verl")
    rc = main(["simulate", "--preset", "rolloutpipe-8k", "--modes", "sync,dora", "--steps", "3", "--host", "slime", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["host"] == "slime"
    for m in out["modes"].values():
        assert {"trainer_weight_sync_s_per_step", "reprefilled_tokens", "preemptions"} <= set(m)
        assert m["trainer_weight_sync_s_per_step"] > 0


def test_instances_sharing_a_core_decode_at_a_share_of_its_speed():
    # One group of 2 x 100 tokens: on one instance both decode together (100 iterations of 1 ms);
    # on two instances time-sharing the rollout accelerator each decodes alone, at half speed.
    alone = _tiny(prefill_s_per_token=0.0)
    shared = dataclasses.replace(alone, instances=2)
    a, b = (Simulation(p, "sync", steps=3).run() for p in (alone, shared))
    assert (a.layout.instances, b.layout.instances, b.layout.share, b.layout.rollout_accelerators) == (1, 2, 2, 1)
    assert [y - x for x, y in zip(a.step_end, b.step_end)] == pytest.approx([0.1, 0.2, 0.3])


def test_the_cpu_long_tail_preset_is_trainer_bound():
    # With `fill` admission the embedded runtime's main job trains nearly every group at staleness
    # exactly K; the default admission (adaptive) spends less of it at the same throughput.
    p = PRESETS["cpu-long-tail"]
    for k in (1, 2):
        m = Simulation(p, "dora", steps=30, max_staleness=k, host="embedded", config={"admission": "fill"}).run().metrics
        # every group after the first K steps (which cannot be older) at staleness K
        assert m["staleness_hist"][k] == (30 - k) * p.batch_size and m["split"] == "1:1"
        adaptive = Simulation(p, "dora", steps=30, max_staleness=k, host="embedded").run().metrics
        # (at K=1 its look-ahead range [B, K*B] is one batch: nothing to save); at K=2 about half
        assert adaptive["staleness_mean"] < 0.65 * m["staleness_mean"] if k > 1 else adaptive["staleness_mean"] <= m["staleness_mean"]
        # at the same throughput, the trainer waiting only for the coordinator hop (~0.086), C1-C3 kept
        assert adaptive["throughput_tokens_per_s"] >= 0.99 * m["throughput_tokens_per_s"]
        assert all(r["trainer_wait_ratio"] < 0.1 and r["c1_ok"] and r["c2_ok"] and r["c3_ok"] for r in (m, adaptive))
    # without the hop neither policy leaves the trainer waiting (pipeline's would: ~0.06)
    p0 = dataclasses.replace(p, trainer=dataclasses.replace(p.trainer, report_s=0.0))
    for adm in ("fill", "adaptive"):
        m = Simulation(p0, "dora", steps=30, max_staleness=2, host="embedded", config={"admission": adm}).run().metrics
        assert m["trainer_wait_ratio"] < 0.01, adm
    sync = Simulation(p, "sync", steps=30, host="embedded").run()
    assert sync.layout.colocated and sync.layout.instances == 2 and sync.layout.share == 1


def test_recommend_says_what_each_weight_path_costs(capsys):
    rc = main(["simulate", "--preset", "rolloutpipe-8k", "--recommend", "--modes", "dora", "--max-staleness", "1",
               "--host", "slime", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["host"] == "slime" and set(out["weight_paths"]) == set(HOSTS)
    slime, ideal = out["weight_paths"]["slime"], out["weight_paths"]["ideal"]
    p = PRESETS["rolloutpipe-8k"]
    assert slime["trainer_s_per_step"] == pytest.approx(2.0 + p.engine.weight_bytes / 1.5e9)
    assert ideal["trainer_s_per_step"] == p.trainer.broadcast_s and ideal["load_s"] == p.engine.weight_load_s
