"""Regression tests for defects found reviewing issue 11 (slime's loops driving dora-ext).

slime is ABSENT here (CI): like `test_slime_defects.py` these run the adapter against the
stand-ins of `slime_standins.py` (fake SGLang fleet, custom generate function with slime's
signature). Event orders are forced with held requests and the session's probe, never by timing.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from slime_helpers import (
    SimulatedSlimeDriver, check_train_eval_train, check_trained, eval_fleet_session, install_eval_rollout, install_fleet_session,
    make_args, probe_eval, record_probes, train_eval_train,
)

from dora_ext.slime import rollout as slime_rollout


def test_engine_reassigned_to_an_older_version_waits_for_the_eval_running_on_it(tmp_path, standins, monkeypatch):
    """Eval runs on engine E holding the newest version (1). The other engine, holding version 0 with a straggler
    running (held), dies during the eval: the straggler goes back to version 0, which no engine holds, and the
    scheduler, which does not see eval requests, sends the idle-looking E back to version 0. That load used to run under
    the eval request (R4; the eval saw two versions and slime's job died); it now waits until the eval is over."""
    args, fleet, ds, session = eval_fleet_session(tmp_path, standins, 31300, check_interval_s=0.02)
    probes, release_eval = record_probes(session, "load_waits_for_eval")
    post = fleet.post
    seen: dict = {}

    async def watched_post(url, payload):
        reply = await post(url, payload)
        if seen.get("eval_url") and url.startswith(seen["eval_url"]):
            release_eval.set()  # a load on the eval's engine went through (the defect)
        return reply

    fleet.post = watched_post
    straggler = asyncio.Event()

    async def eval_rollout(eval_args, rollout_id):
        port = int(eval_args.sglang_router_port)
        engine = standins.ENGINES[port]
        seen["eval_url"] = engine.url
        seen["at_start"] = {i: (inst.version, len(inst.running)) for i, inst in session.sched.instances.items()}
        for other in fleet.engines:
            if other is not engine:
                other.alive = False  # dies with the straggler running
        standins.HOLD[("eval", 0)] = release_eval
        try:
            return await probe_eval(standins, eval_args)
        finally:
            straggler.set()

    install_eval_rollout(monkeypatch, eval_rollout)
    standins.HOLD[("p2", 4)] = straggler  # p2's first sample: dispatched at version 0, kept running
    outs, ev = train_eval_train(args, ds, standins)
    # the forced state: eval on version 1 while the other engine held version 0 with work running
    (old_version, old_running), (new_version, _) = sorted(seen["at_start"].values())
    assert (old_version, new_version) == (0, 1) and old_running >= 1, seen
    assert any(n == "load_waits_for_eval" for n, _ in probes), f"no load was sent to the eval's engine: {probes}"
    prompts = check_train_eval_train(outs, ev, fleet)
    assert "p2" in prompts  # the straggler's group was trained


@pytest.mark.parametrize("death", ["request_fails", "request_hangs"])
def test_eval_engine_dying_during_the_eval_evaluates_again_on_another_engine(tmp_path, standins, monkeypatch, death):
    """The engine slime's eval is pinned to dies under it. Its requests either fail at once, or hang (slime's `post`
    retries a dead engine for a minute; held here until the engine is declared gone, 30 s at most). The eval used to
    fail and end slime's job; it now runs again on another engine holding the newest version, and training goes on."""
    args, fleet, ds, session = eval_fleet_session(tmp_path, standins, 31400, check_interval_s=0.02)
    probes, engine_gone = record_probes(session, "engine_failed")
    calls: list = []

    async def eval_rollout(eval_args, rollout_id):
        engine = standins.ENGINES[int(eval_args.sglang_router_port)]
        calls.append(engine.port)

        async def dies_under_the_request():  # the request runs (and hangs) when the engine dies
            engine.alive = False
            await engine_gone.wait()

        if len(calls) == 1 and death == "request_fails":
            engine.alive = False
        elif len(calls) == 1:
            standins.HOLD[("eval", 0)] = SimpleNamespace(wait=dies_under_the_request)
        return await probe_eval(standins, eval_args)

    install_eval_rollout(monkeypatch, eval_rollout)
    outs, ev = train_eval_train(args, ds, standins)
    assert len(calls) == 2 and calls[0] != calls[1], calls
    dead = [v for n, v in probes if n == "engine_failed"]
    assert len(dead) == 1 and ev.metrics["dora/eval_instance"] != dead[0]
    assert ev.metrics["dora/engines_retired"] == 1  # the eval's own metrics count it (after a last step, only they do)
    check_train_eval_train(outs, ev, fleet)


@pytest.mark.parametrize("order", ["answer_then_close", "close_then_answer"])
def test_a_closed_session_starts_nothing_on_the_loop_it_leaves_running(tmp_path, standins, monkeypatch, order):
    """slime's background loop outlives a session (`close()`: a new session, or exit). A request
    answered in the loop turn in which `close()` cancelled it returned its answer anyway (Python
    3.11's `asyncio.wait_for`): its trajectory finished, and the scheduler's next dispatch started
    a request nobody cancelled. The closed session kept driving the engines (in CI the next test's,
    at the same ports: R4 and capacity violations there). Forced: with 4 requests running, the
    first one's answer is held, then given either before `close()` or as `close()` cancels it."""
    shared = slime_rollout._LoopThread()  # slime's loop (`get_async_loop`), which close() leaves running
    monkeypatch.setattr(slime_rollout, "_event_loop", lambda: (shared.loop, None))
    args = make_args(tmp_path, mode="dora", k=1, batch=2, n=2, num_rollout=4, capacity=2)
    session = install_fleet_session(args, None, standins.FakeSglangFleet(2, capacity=2, base_port=31600), 0)
    generate, calls, release = session.engines.generate, [], asyncio.Event()
    answered, busy, next_started = threading.Event(), threading.Event(), threading.Event()

    async def first_answer_held(iid, sample, params):
        calls.append(sample.index)
        if len(calls) >= 4:
            (busy if len(calls) == 4 else next_started).set()
        if len(calls) > 1:
            await asyncio.Event().wait()  # runs until cancelled
        out = await generate(iid, sample, params)
        answered.set()
        try:
            await release.wait()
        except asyncio.CancelledError:
            pass  # cancelled as the answer came: 3.11's wait_for returns the answer
        return out

    session.engines.generate = first_answer_held
    SimulatedSlimeDriver(args, session.data_source).push_weights()
    try:
        asyncio.run_coroutine_threadsafe(session._ensure_started(), shared.loop).result(30)
        assert busy.wait(30) and answered.wait(30), calls
        if order == "answer_then_close":
            shared.loop.call_soon_threadsafe(release.set)
            assert next_started.wait(30), calls  # the freed slot's next trajectory, cancelled by close()
        slime_rollout.close_session()
        assert [t for t in session._tasks if not t.done()] == [], f"the closed session still runs: {calls}"
        assert len(calls) == (5 if order == "answer_then_close" else 4), calls
    finally:
        shared.stop()


def _kl_batch():
    import torch

    g = torch.Generator().manual_seed(5)
    logp = (torch.randn(2, 6, generator=g) * 0.3 - 1.0).requires_grad_(True)
    rollout = logp.detach() + torch.randn(2, 6, generator=g) * 0.4
    ref = logp.detach() + 4.0 + torch.randn(2, 6, generator=g)  # far away: k3 estimates well above 10
    masks = [torch.ones(6), torch.ones(6)]
    batch = {"advantages": [torch.full((6,), 0.5), torch.full((6,), -0.5)],
             "rollout_log_probs": list(rollout.unbind(0)), "loss_masks": masks,
             "ref_log_probs": list(ref.unbind(0))}

    def reduce(x):
        return sum((xi * mi).sum() / mi.sum() for xi, mi in zip(x.split([6, 6]), masks))

    return logp, rollout, ref, batch, reduce


def test_sao_low_var_kl_with_unbiased_kl_clamps_after_the_importance_ratio_as_slime_does():
    """`sao_loss` with `--kl-loss-type low_var_kl --use-unbiased-kl` clamped the k3 estimate to
    [-10, 10] before multiplying by pi_theta / pi_old; slime's `compute_approx_kl`
    (slime/utils/ppo_utils.py) multiplies first and clamps the product."""
    import torch

    from dora_ext.slime.loss import sao_loss_from_log_probs

    logp, rollout, ref, batch, reduce = _kl_batch()
    args = SimpleNamespace(eps_clip=0.2, use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="low_var_kl",
                           use_unbiased_kl=True, use_rollout_logprobs=True)
    _, log = sao_loss_from_log_probs(args, batch, list(logp.unbind(0)), reduce)
    lr = -(logp.detach() - ref).reshape(-1)
    k3 = lr.exp() - 1 - lr
    ratio = torch.exp(logp.detach() - rollout).reshape(-1)
    assert (k3 > 10).any() and ((ratio * k3).clamp(-10, 10) != ratio * k3.clamp(-10, 10)).any()  # the case bites
    assert torch.allclose(log["kl_loss"], reduce((ratio * k3).clamp(-10, 10)), atol=1e-5)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
@pytest.mark.parametrize("unbiased", [False, True])
def test_sao_kl_term_is_slimes_compute_approx_kl(kind, unbiased):
    """With a slime checkout (DORA_SLIME_PATH): the KL term equals slime's own estimator."""
    import torch

    ppo_utils = pytest.importorskip("slime.utils.ppo_utils", reason="needs a slime checkout (DORA_SLIME_PATH)")
    from dora_ext.slime.loss import sao_loss_from_log_probs

    logp, rollout, ref, batch, reduce = _kl_batch()
    args = SimpleNamespace(eps_clip=0.2, use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type=kind,
                           use_unbiased_kl=unbiased, use_rollout_logprobs=True)
    _, log = sao_loss_from_log_probs(args, batch, list(logp.unbind(0)), reduce)
    ratio = torch.exp(logp.detach() - rollout).reshape(-1) if unbiased else None
    expected = ppo_utils.compute_approx_kl(logp.detach().reshape(-1), ref.reshape(-1), kind, importance_ratio=ratio)
    assert torch.allclose(log["kl_loss"], reduce(expected), atol=1e-5)


def test_an_engine_loading_weights_is_not_declared_dead_by_the_health_check(tmp_path, standins):
    """While `/update_weights_from_disk` holds SGLang's writer lock, `/health_generate` answers only after the load, and
    a real checkpoint loads for longer than the health timeout: the watcher declared every loading engine dead; it
    rejoined, loaded again, and never served. Here the first two loads of the one engine (the run needs it) each last
    until the watcher read the router twice during it (bounded: a broken watcher cannot hang the test)."""
    args = make_args(tmp_path, mode="dora", k=1, batch=2, n=2, num_rollout=4, capacity=2)
    args.dora_slime["engine_check_interval_s"] = 0.02
    fleet = standins.FakeSglangFleet(1, capacity=2, base_port=31500)
    slow = fleet.engines[0]
    session = install_fleet_session(args, None, fleet, first_step=0)
    session.engines.health_timeout_s = 0.05
    probes, _ = record_probes(session, "engine_failed")
    holds = [asyncio.Event(), asyncio.Event()]
    slow.load_hold, reads, get = {"1": (holds[0], 5.0), "2": (holds[1], 5.0)}, [], fleet.get

    async def sglang_get(url):
        if url.endswith("/workers") and slow.load_done is not None:
            reads.append(slow.load_done)
            if reads.count(slow.load_done) == 2:
                next(e for e in holds if not e.is_set()).set()
        return await get(url)

    fleet.get = sglang_get
    outs = SimulatedSlimeDriver(args, session.data_source).run_async(0, 4)
    assert slow.loads and slow.load_hold == {} and all(e.is_set() for e in holds), (probes, slow.loads)
    assert [v for n, v in probes if n == "engine_failed"] == [], "a loading engine was declared dead"
    assert len(slow.loads) == len(set(slow.loads)), f"engine 0 loaded a version twice: {slow.loads}"
    assert fleet.violations == []
    check_trained(outs, 4 * 2)
