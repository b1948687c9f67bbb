"""Helpers for the slime adapter tests: slime's args and slime's driver loop, simulated.

slime is absent in CI; see `slime_standins.py` for what stands in for it and why.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dora_ext.slime import rollout as slime_rollout
from dora_ext.slime import weights
from dora_ext.slime.settings import WEIGHT_RELOAD_HOOK_PATH


def make_args(tmp_path: Path, *, mode: str = "dora", k: int | None = 2, batch: int = 4, n: int = 2,
              num_rollout: int = 6, capacity: int = 4, **extra: Any) -> SimpleNamespace:
    """slime's args as `parse_args` + `--custom-config-path` would leave them, for the adapter."""
    wd = tmp_path / "weights"
    dora = {"mode": mode}
    if k is not None:
        dora["max_staleness"] = k
    args = SimpleNamespace(
        dora=dora,
        dora_slime={"weights_dir": str(wd), "capacity": capacity, "poll_interval_s": 0.001,
                    "base_data_source_path": "slime_standins.StandinBaseDataSource"},
        custom_rollout_weight_reload_path=WEIGHT_RELOAD_HOOK_PATH,
        rollout_batch_size=batch, n_samples_per_prompt=n, num_rollout=num_rollout,
        sglang_router_ip="127.0.0.1", sglang_router_port=30999, sglang_server_concurrency=capacity,
        custom_generate_function_path="slime_standins.generate",
        update_weight_transport="disk", update_weight_disk_dir=str(wd), update_weights_interval=1,
        save=str(tmp_path / "ckpt"), load=None, group_rm=False, reward_key=None,
        colocate=False, offload_rollout=False, rollout_temperature=1.0, rollout_max_response_len=64,
        standin_capacity=capacity, partial_rollout=False, mask_offpolicy_in_partial_rollout=False,
    )
    for key, value in extra.items():
        setattr(args, key, value)
    return args


class SimulatedSlimeDriver:
    """slime's driver loop around the rollout function, in `train_async.py` or `train.py` order.

    Weight pushes do what patched slime's disk sync does: write `weight_v{n}` under
    `--update-weight-disk-dir`, then call the hook named by `custom_rollout_weight_reload_path`.
    """

    def __init__(self, args: SimpleNamespace, data_source: Any) -> None:
        self.args = args
        self.data_source = data_source
        self.pushes = 0

    def push_weights(self) -> None:
        self.pushes += 1
        d = Path(self.args.update_weight_disk_dir) / f"weight_v{self.pushes:06d}"
        shutil.rmtree(d, ignore_errors=True)  # slime's disk sync clears a version dir before writing
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        weights.publish_weights(self.args, str(d), str(self.pushes), None)

    def generate(self, rollout_id: int) -> Any:
        return slime_rollout.generate_rollout(self.args, rollout_id, self.data_source)

    def run_async(self, first: int, last: int, save_at: int | None = None) -> dict[int, Any]:
        """train_async.py: batch k+1 is requested before step k trains; weights after the get."""
        self.push_weights()
        out: dict[int, Any] = {}
        nxt = self.generate(first)
        for k in range(first, last):
            out[k] = nxt
            nxt = self.generate(k + 1) if k + 1 < last else None
            if save_at == k:
                self.data_source.save(k)
                return out
            self.push_weights()
        return out

    def run_sync(self, first: int, last: int) -> dict[int, Any]:
        """train.py: generate k, train k, push weights k+1."""
        self.push_weights()
        out = {}
        for k in range(first, last):
            out[k] = self.generate(k)
            self.push_weights()
        return out


def install_fleet_session(args: SimpleNamespace, data_source: Any, fleet: Any, first_step: int) -> Any:
    """The session `RolloutSession.for_slime` builds, with the fake fleet as its HTTP client
    (`data_source` None: a fresh `DoraDataSource`, the session's `data_source`)."""
    from dora_ext.slime.data_source import DoraDataSource
    from dora_ext.slime.engines import SglangEngines
    from dora_ext.slime.settings import slime_settings

    engines = SglangEngines(args, slime_settings(args), http=fleet, control=fleet)
    data_source = DoraDataSource(args) if data_source is None else data_source
    session = slime_rollout.RolloutSession.for_slime(args, data_source, first_step, engines=engines)
    slime_rollout.install_session(session)
    return session


def fleet_engines(standins: Any, tmp_path: Path, port: int, n: int = 2) -> tuple[Any, Any]:
    """`n` stand-in engines of capacity 2 and the adapter's `SglangEngines` over them (no session);
    `tmp_path / "w"` is a checkpoint directory to load."""
    from dora_ext.slime.engines import SglangEngines
    from dora_ext.slime.settings import slime_settings

    args = make_args(tmp_path, capacity=2)
    fleet = standins.FakeSglangFleet(n, capacity=2, base_port=port)
    (tmp_path / "w").mkdir(exist_ok=True)
    return fleet, SglangEngines(args, slime_settings(args), http=fleet, control=fleet)


# ---------------------------------------------------------------- slime's evaluation between rollouts
def install_eval_rollout(monkeypatch: Any, fn: Any) -> None:
    """slime's `eval_rollout(args, rollout_id)` (slime/rollout/sglang_rollout.py) replaced by `fn`:
    slime's own sends its eval requests to the engine `args` names, as `fn` does."""
    import sys
    import types

    try:
        import slime.rollout.sglang_rollout as mod  # a real checkout (DORA_SLIME_PATH)
    except ImportError:
        mod = types.ModuleType("slime.rollout.sglang_rollout")
        monkeypatch.setitem(sys.modules, "slime", types.ModuleType("slime"))
        monkeypatch.setitem(sys.modules, "slime.rollout", types.ModuleType("slime.rollout"))
        monkeypatch.setitem(sys.modules, "slime.rollout.sglang_rollout", mod)
    monkeypatch.setattr(mod, "eval_rollout", fn, raising=False)


def eval_fleet_session(tmp_path: Path, standins: Any, port: int, *, check_interval_s: float, **settings: Any) -> tuple:
    """(args, fleet, data source, session): mode dora, K = 1, batches of 2 groups of 2, two
    engines of capacity 2, each with room for one eval request beside the scheduler's 2;
    `check_interval_s` is the periodic engine refresh (600: none during the run); `settings`:
    more of `dora_slime`."""
    from dora_ext.slime.data_source import DoraDataSource

    args = make_args(tmp_path, mode="dora", k=1, batch=2, n=2, num_rollout=6, capacity=2)
    args.dora_slime.update(engine_check_interval_s=check_interval_s, **settings)
    args.standin_capacity = 2 + 1  # the scheduler's 2 per engine, plus the eval's one request
    # The fleet's capacity check (at each load) allows the eval's request too, as the requests' own check does.
    fleet = standins.FakeSglangFleet(2, capacity=args.standin_capacity, base_port=port)
    ds = DoraDataSource(args)
    return args, fleet, ds, install_fleet_session(args, ds, fleet, first_step=0)


def record_probes(session: Any, signal: str) -> tuple[list, Any]:
    """Record the session's probes as (name, value); the event returned is set (on the worker's
    loop) the first time the probe `signal` fires, for a test that holds something until then."""
    import asyncio

    probes: list = []
    fired = asyncio.Event()

    def probe(name: str, value: Any) -> None:
        probes.append((name, value))
        if name == signal:
            fired.set()

    session.probe = probe
    return probes, fired


async def probe_eval(standins: Any, eval_args: Any, n: int = 1) -> Any:
    """What slime's `eval_rollout` returns for one eval prompt generated on the engine `eval_args`
    names: (RolloutFnEvalOutput with the dataset "probe", its raw data). `n` > 1: n prompts, each
    in a task of its own, as slime's per-sample tasks (spread over the eval's engines)."""
    import asyncio

    from dora_ext.slime._compat import RolloutFnEvalOutput

    async def one(i: int) -> Any:
        return await standins.generate(eval_args, standins.Sample(prompt=f"eval{i or ''}", index=i, tokens=[1]), {})

    samples = [await one(0)] if n == 1 else await asyncio.gather(*(one(i) for i in range(n)))
    return RolloutFnEvalOutput(data={"probe": {"samples": samples, "rewards": [s.reward for s in samples]}}), []


def train_eval_train(args: SimpleNamespace, data_source: Any, standins: Any) -> tuple[dict[int, Any], Any]:
    """slime's loop around one evaluation, in `train_async.py` order: rollout 0 (version 0),
    version 1 published, slime's evaluation (after rollout 0, on version 1), then rollouts 1 and
    2, weights pushed after each. Returns ({rollout id: train output}, eval output). Requests
    the test held (`standins.HOLD`) are released at the end, whatever happened."""
    try:
        driver = SimulatedSlimeDriver(args, data_source)
        driver.push_weights()
        outs = {0: driver.generate(0)}
        driver.push_weights()
        ev = slime_rollout.generate_rollout(args, 0, data_source, evaluation=True)
        for k in (1, 2):
            outs[k] = driver.generate(k)
            driver.push_weights()
    finally:
        standins.HOLD.clear()
    return outs, ev


def check_train_eval_train(outs: dict[int, Any], ev: Any, fleet: Any) -> list[str]:
    """What every train-eval-train run must show: the eval ran on version 1 only; no engine loaded
    weights under a request or exceeded its capacity; every group trained once (C2), from one
    version (C1), at most K = 1 behind (C3). Returns the trained prompts."""
    assert [s.weight_versions for s in ev.data["probe"]["samples"]] == [["1"]]
    assert ev.metrics["dora/eval_version"] == 1
    assert fleet.violations == [], fleet.violations
    return check_trained(outs, 3 * 2, k=1)


def check_trained(outs: dict[int, Any], groups: int, k: int | None = None) -> list[str]:
    """Each of `groups` groups trained once (C2), all from one version (C1), at most `k` steps
    behind (C3, when given). Returns the trained prompts."""
    prompts = [g[0].prompt for out in outs.values() for g in out.samples]
    assert len(prompts) == len(set(prompts)) == groups, prompts
    for step, out in outs.items():
        for group in out.samples:
            (v,) = {v for s in group for v in s.weight_versions or [None]}  # a sample without one fails
            assert v is not None and (k is None or 0 <= step - int(v) <= k), (step, v)
    return prompts


# ---------------------------------------------------------------- slime checkout (DORA_SLIME_PATH)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HARNESS = os.path.join(ROOT, "tests", "slime", "harness")


def slime_checkout_or_skip() -> str:
    import importlib.util
    import shutil

    path = os.environ.get("DORA_SLIME_PATH")
    if not path or not os.path.isfile(os.path.join(path, "train_async.py")):
        pytest.skip("DORA_SLIME_PATH does not name a slime checkout (slime is not on PyPI; scripts/test.sh unpacks it)")
    missing = [m for m in ("ray", "sglang", "sglang_router", "megatron", "safetensors", "tokenizers")
               if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"slime's client-side dependencies are missing: {missing} (scripts/test.sh installs them)")
    if shutil.which("git") is None:
        pytest.skip("git is needed to apply patches/slime")
    return path


def patched_slime_copy(dst):
    """Copy the slime checkout to `dst` and apply patches/slime (the checkout stays untouched)."""
    import shutil
    import subprocess
    from pathlib import Path

    src = slime_checkout_or_skip()
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".git", "docs", "imgs", "examples"))
    for patch in sorted((Path(ROOT) / "patches" / "slime").glob("*.patch")):
        subprocess.run(["git", "apply", str(patch)], cwd=dst, check=True)
    return dst


def harness_env(patched) -> dict:
    """Environment for a process that imports the patched slime and the harness."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [os.path.join(HARNESS, "no_torchcodec"), str(patched), HARNESS, ROOT]))
    env.pop("SLIME_ACCELERATOR", None)
    return env
