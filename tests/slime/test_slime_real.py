"""The adapter against a REAL slime checkout: runs only when DORA_SLIME_PATH names one.

    DORA_SLIME_PATH=/path/to/slime pytest tests/slime

slime is not on PyPI and CI has none, so every test here is skipped there, with the reason.
With a checkout, this module checks what CI cannot:

* the patch applies to the checkout (`patches/slime/check.sh`);
* slime's own plugin contract tests (`tests/plugin_contracts/`) pass with our rollout function
  and data source given as `--rollout-function-path` / `--data-source-path`;
* the rollout function, loaded with slime's `load_function` and called through slime's
  `call_rollout_fn`, returns slime's `RolloutFnTrainOutput` of slime's `Sample`s, produced by
  slime's own `generate_and_rm` and data source, and the ledger round-trips slime's Samples.

Still stood in, because it cannot exist here: SGLang servers (the fake fleet and the custom
generate function with slime's real signature in `slime_standins.py`) and slime's tokenizer-
loading `GenerateState` (replaced as slime's own contract tests replace it).
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SLIME = os.environ.get("DORA_SLIME_PATH")
pytestmark = pytest.mark.skipif(
    not SLIME or not os.path.isfile(os.path.join(SLIME or "", "slime", "utils", "types.py")),
    reason="DORA_SLIME_PATH does not name a slime checkout (slime is not on PyPI; CI has none)",
)

ROOT = Path(__file__).resolve().parents[2]

CONTRACTS = [
    ("test_plugin_rollout_contracts.py", ["--rollout-function-path", "dora_ext.slime.rollout.generate_rollout"]),
    ("test_plugin_path_loading_contracts.py", ["--data-source-path", "dora_ext.slime.data_source.DoraDataSource"]),
    ("test_plugin_generate_contracts.py", []),
    ("test_plugin_runtime_hook_contracts.py", []),
]


def test_patch_applies_to_the_checkout():
    r = subprocess.run(["bash", str(ROOT / "patches" / "slime" / "check.sh"), SLIME], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "applies" in r.stdout or "already applied" in r.stdout


@pytest.mark.parametrize("name, flags", CONTRACTS, ids=[c[0] for c in CONTRACTS])
def test_slimes_own_plugin_contracts_pass_with_our_paths(name, flags):
    # Run as slime documents it: `python tests/plugin_contracts/<file> --<kind>-path <ours>`.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SLIME, str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(
        [sys.executable, f"tests/plugin_contracts/{name}", *flags, "-q", "-p", "no:cacheprovider"],
        cwd=SLIME, env=env, capture_output=True, text=True, timeout=300,
    )
    tail = r.stdout[-2000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert re.search(r"\d+ passed", r.stdout), tail


def test_signature_is_slimes():
    from slime.rollout.sglang_rollout import generate_rollout as default
    from slime.utils.misc import load_function

    ours = load_function("dora_ext.slime.rollout.generate_rollout")
    assert inspect.signature(ours).parameters.keys() == inspect.signature(default).parameters.keys()
    assert inspect.signature(ours).parameters["evaluation"].default is False


def test_rollout_with_slimes_sample_data_source_and_generate_and_rm(tmp_path):
    from slime.rollout.base_types import RolloutFnTrainOutput, call_rollout_fn
    from slime.utils.misc import load_function
    from slime.utils.types import Sample
    from slime_helpers import SimulatedSlimeDriver, install_fleet_session, make_args

    import slime_standins
    from dora_ext.slime import _compat

    assert _compat.SLIME_PRESENT and _compat.RolloutFnTrainOutput is RolloutFnTrainOutput
    # slime's own RolloutDataSourceWithBuffer under ours (its default), with no dataset: slime
    # then hands out empty Samples of its own class, numbered by its own counters.
    args = make_args(tmp_path, mode="dora", k=1, batch=3, n=2, num_rollout=4, rollout_global_dataset=False,
                     buffer_filter_path=None)
    del args.dora_slime["base_data_source_path"]
    ds = load_function("dora_ext.slime.data_source.DoraDataSource")(args)
    fleet = slime_standins.FakeSglangFleet(2, capacity=4)
    install_fleet_session(args, ds, fleet, first_step=0)  # SglangEngines with slime's generate_and_rm
    fn = load_function("dora_ext.slime.rollout.generate_rollout")

    driver = SimulatedSlimeDriver(args, ds)
    driver.generate = lambda k: call_rollout_fn(fn, args, k, ds, evaluation=False)
    outs = driver.run_async(0, 4)
    seen = set()
    for k, out in outs.items():
        assert type(out) is RolloutFnTrainOutput
        assert len(out.samples) == 3
        for group in out.samples:
            assert all(type(s) is Sample and s.status == Sample.Status.COMPLETED for s in group)
            assert len({s.weight_versions[0] for s in group}) == 1
            assert 0 <= k - int(group[0].weight_versions[0]) <= 1
            assert group[0].group_index not in seen
            seen.add(group[0].group_index)
    assert fleet.violations == []

    # The ledger round-trips slime's Samples through a checkpoint.
    more = ds.get_samples(2)
    ds.save(3)
    args2 = make_args(tmp_path, load=str(tmp_path / "ckpt"), rollout_global_dataset=False, buffer_filter_path=None)
    del args2.dora_slime["base_data_source_path"]
    ds2 = load_function("dora_ext.slime.data_source.DoraDataSource")(args2)
    ds2.load(3)
    back = ds2.get_samples(2)
    assert [g[0].group_index for g in back] == [g[0].group_index for g in more]
    assert all(type(s) is Sample and s.status == Sample.Status.PENDING for g in back for s in g)


def test_requests_run_through_slimes_generate_and_rm(tmp_path, monkeypatch):
    """Issue 22 point 7: a request to one engine is slime's own `generate_and_rm`, so slime's
    semaphore and dp-rank context hold while it runs and slime's abort flag stops it before it
    reaches the engine (the adapter's former copy had none of the three)."""
    import asyncio
    import contextlib

    from slime.rollout import sglang_rollout
    from slime.utils.types import Sample
    from slime_helpers import fleet_engines

    import slime_standins

    state = slime_standins.StandinGenerateState(None)
    ranks: list[int] = []

    @contextlib.contextmanager
    def dp_rank_context():
        ranks.append(0)
        yield 0

    state.dp_rank_context = dp_rank_context
    monkeypatch.setattr(sglang_rollout, "GenerateState", lambda args: state)
    seen = []
    monkeypatch.setattr(slime_standins, "ON_START", lambda e: seen.append((state.semaphore.locked(), len(ranks))))
    fleet, engines = fleet_engines(slime_standins, tmp_path, port=31840, n=1)

    async def go():
        state.semaphore = asyncio.Semaphore(1)
        await engines.discover()
        done = await engines.generate(0, Sample(prompt="p", index=0, tokens=[1]), {"max_new_tokens": 64})
        state.aborted = True
        stopped = await engines.generate(0, Sample(prompt="q", index=1, tokens=[1]), {"max_new_tokens": 64})
        return done, stopped

    done, stopped = asyncio.run(go())
    assert done.status == Sample.Status.COMPLETED and seen == [(True, 1)]
    assert stopped.status == Sample.Status.ABORTED and fleet.engines[0].started == 1
