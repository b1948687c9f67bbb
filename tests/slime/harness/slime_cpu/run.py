"""Run slime's own `train.py` or `train_async.py` loop on CPU, with dora-ext applied as a user
applies it (the flags `dora-ext slime-args` prints, the `--custom-config-path` YAML, and
`patches/slime` applied to the slime checkout this process imports).

slime's code that runs unchanged: the loop (`train()` of train.py / train_async.py), argument
parsing and validation (`slime.utils.arguments.parse_args`, with the sglang and router flags of
sglang 0.5.23 / sglang-router), Ray placement groups, `RolloutManager` (data-source and
rollout-function loading, sample -> train-data conversion, DP split, eval, checkpoint of the data
source), external-engine discovery (`--rollout-external-engine-addrs`) and its `SGLangEngine`
actors registering with a real sglang-router (the Rust router from PyPI, launched with slime's
`run_router`), `RayTrainGroup` and its patched disk weight-update path, slime's generate /
reward / eval code, its loss plumbing (`loss_function`, `compute_advantages_and_returns`,
`get_log_probs_and_entropy` on megatron-core over gloo).

What stands in, because it cannot exist on a CPU machine (each module says so):
* `server.py`: an SGLang server (CPU, tiny torch model, SGLang's HTTP API);
* `train_actor.py`: the Megatron train actor (created by slime's `RayTrainGroup` through its
  `actor_cls` argument; `create_training_models` is called with it, the only change to slime's
  loop, besides timing the train group's `update_weights` for `result.json`);
* `megatron_args.py`: Megatron-LM's argument parser (Megatron-LM is not on PyPI);
* the harness relaunches a killed engine when `--restart-engines` is given: slime relaunches
  engines it started itself, but its `recover()` is a no-op for external engines, so the harness
  starts a new server and registers it with the router as slime's `SGLangEngine` does. By default
  at a new port; `--restart-same-port reregister` does what slime does for the engines it
  launched (`ServerGroup.start_engines` scans for a free port from 15000 again, so a dead
  engine's port comes back): the dead engine's registration is deleted from the router (slime's
  `SGLangEngine.shutdown`), the new server starts at the same port and registers anew (it answers
  requests once the router lists it: `server.py --gated`, to force that order);
  `--restart-same-port keep` leaves the old registration (slime's shutdown could not run), and
  the router refuses the new one as a duplicate.

    python -m slime_cpu.run --workdir W --loop train|train_async --mode M --k K [options]
writes W/result.json; the logs in W (engine*.jsonl, rollouts.jsonl, evals.jsonl, train.jsonl)
are the evidence the tests check.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 60.0) -> None:
    import requests

    t = time.monotonic()
    while True:
        try:
            requests.get(url, timeout=2).raise_for_status()
            return
        except Exception:
            if time.monotonic() - t > timeout:
                raise
            time.sleep(0.2)


class Engines:
    """The CPU SGLang servers: started, watched, relaunched (when asked), stopped."""

    def __init__(self, work: Path, hf: Path, n: int, die_after: dict[int, int], restart: bool,
                 same_port: str | None = None, server_flags: list[str] | None = None,
                 stuck_after: dict[int, int] | None = None) -> None:
        self.work, self.hf, self.restart, self.same_port = work, hf, restart, same_port
        self.server_flags = server_flags or []
        self.stuck_after = stuck_after or {}
        self.procs: dict[int, subprocess.Popen] = {}
        self.router: str | None = None
        self.events: list[dict] = []
        self._stop = threading.Event()
        for i in range(n):
            self.start(i, die_after.get(i))

    def start(self, i: int, die_after: int | None = None, port: int | None = None, gated: bool = False) -> int:
        port = port or free_port()
        cmd = [sys.executable, "-m", "slime_cpu.server", "--port", str(port), "--model-path", str(self.hf),
               "--log", str(self.work / f"engine{i}.jsonl"), *self.server_flags]
        if i in self.stuck_after:
            cmd += ["--stuck-after", str(self.stuck_after[i])]
        if die_after:
            cmd += ["--die-after", str(die_after)]
        if gated:
            cmd += ["--gated"]
        self.procs[port] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.work / f"engine{i}.err", "a"))
        wait_http(f"http://127.0.0.1:{port}/health")
        return port

    @property
    def addrs(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.procs]

    def watch(self) -> None:
        def loop() -> None:
            import requests

            while not self._stop.wait(0.2):
                for port, p in list(self.procs.items()):
                    if p.poll() is None or port not in self.procs:
                        continue
                    del self.procs[port]
                    self.events.append({"t": time.time(), "event": "died", "port": port, "rc": p.returncode})
                    if self.restart and self.router and self.same_port:
                        self.restart_same_port(port)
                    elif self.restart and self.router:
                        new = self.start(len(self.events) + 10)
                        requests.post(f"{self.router}/workers",
                                      json={"url": f"http://127.0.0.1:{new}", "worker_type": "regular"}).raise_for_status()
                        self.events.append({"t": time.time(), "event": "restarted", "port": new})

        threading.Thread(target=loop, daemon=True).start()

    def _router_ids(self, url: str) -> list[str]:
        import requests

        return [w["id"] for w in requests.get(f"{self.router}/workers", timeout=5).json()["workers"] if w["url"] == url]

    def _wait_router(self, url: str, until, limit_s: float = 60.0) -> list[str]:
        """The router adds and removes workers in the background: wait until its listing agrees."""
        t = time.monotonic()
        while not until(ids := self._router_ids(url)):
            if time.monotonic() - t > limit_s:
                raise RuntimeError(f"slime's router never listed {url} as expected: {ids}")
            time.sleep(0.05)
        return ids

    def restart_same_port(self, port: int) -> None:
        import requests

        url = f"http://127.0.0.1:{port}"
        reregister = self.same_port == "reregister"
        old = self._router_ids(url)
        if reregister:
            for wid in old:  # slime's SGLangEngine.shutdown, called by its health monitor
                requests.delete(f"{self.router}/workers/{wid}", timeout=5).raise_for_status()
            self._wait_router(url, lambda ids: not ids)
        n = len(self.events) + 10
        self.start(n, port=port, gated=reregister)
        requests.post(f"{self.router}/workers", json={"url": url, "worker_type": "regular"},
                      timeout=5).raise_for_status()  # slime's SGLangEngine._register_to_router
        if reregister:
            new = self._wait_router(url, lambda ids: len(ids) == 1)
            requests.post(f"{url}/standin/open", json={}, timeout=5).raise_for_status()
        else:
            new = self._router_ids(url)
        self.events.append({"t": time.time(), "event": "restarted", "port": port, "log": f"engine{n}.jsonl",
                            "router_ids": [old, new]})

    def stop(self) -> None:
        self._stop.set()
        for p in self.procs.values():
            p.kill()
        for p in self.procs.values():
            p.wait()


def start_router(args_ns) -> tuple[multiprocessing.Process, int]:
    """slime's own router launch (`slime.utils.http_utils.run_router` with slime's RouterArgs
    handling from `_start_router`), owned by this process so that it is stopped with it."""
    from sglang_router.launch_router import RouterArgs

    from slime.utils.http_utils import run_router

    port = free_port()
    ra = RouterArgs.from_cli_args(args_ns, use_router_prefix=True)
    ra.host, ra.port, ra.prometheus_port = "127.0.0.1", port, free_port()
    ra.request_timeout_secs = args_ns.sglang_router_request_timeout_secs
    ra.disable_circuit_breaker = True
    if hasattr(ra, "disable_health_check"):
        ra.disable_health_check = True
    proc = multiprocessing.Process(target=run_router, args=(ra,), daemon=True)
    proc.start()
    return proc, port


def write_data(work: Path, n_prompts: int, fail_prompt: bool, n_eval: int = 2) -> tuple[Path, Path]:
    rng = random.Random(0)
    letters = "abcdefghij"
    prompts = work / "prompts.jsonl"
    with open(prompts, "w") as fh:
        for i in range(n_prompts):
            text = f"{letters[i // 10 % 10]} {letters[i % 10]} {rng.choice(letters)} ="  # unique per prompt
            if i >= 100:
                text = f"{i // 100} " + text
            if fail_prompt and i == 1:
                text = "zz " + text  # the engine aborts this request on every attempt
            fh.write(json.dumps({"text": text, "label": rng.choice(letters), "pid": i}) + "\n")
    evals = work / "eval.jsonl"
    with open(evals, "w") as fh:
        for i in range(n_eval):
            fh.write(json.dumps({"text": f"{letters[i % 10]} {letters[i // 10 % 10]} =", "label": letters[i % 10]}) + "\n")
    return prompts, evals


#: The flags of `dora-ext slime-args` that choose the algorithm (loss, staleness correction), with
#: how many values each takes; the rest choose the rollout, the data source and the weight path.
ALGORITHM_FLAGS = {"--loss-type": 1, "--custom-loss-function-path": 1, "--use-tis": 0, "--tis-clip": 1,
                   "--tis-clip-low": 1, "--custom-tis-function-path": 1}


def algorithm_flags(flags: list[str]) -> list[str]:
    """The loss and correction flags among `flags`, in their order, each with its values."""
    out, i = [], 0
    while i < len(flags):
        n = ALGORITHM_FLAGS.get(flags[i])
        if n is None:
            i += 1
            continue
        out += flags[i:i + 1 + n]
        i += 1 + n
    return out


def algorithm_settings(args) -> str:
    """What slime parsed for those flags (its defaults where a job passed none), `name=value`
    sorted: the evidence that two jobs train one algorithm, whatever argv they were given."""
    names = sorted(flag[2:].replace("-", "_") for flag in ALGORITHM_FLAGS)
    return " ".join(f"{name}={getattr(args, name, None)}" for name in names)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--loop", choices=("train", "train_async"), required=True)
    ap.add_argument("--mode", default="dora")
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--num-rollout", type=int, default=6)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--capacity", type=int, default=2)
    ap.add_argument("--eval-interval", type=int, default=2)
    ap.add_argument("--loss", default="sao")
    ap.add_argument("--fault-tolerance", action="store_true")
    ap.add_argument("--restart-engines", action="store_true")
    ap.add_argument("--restart-same-port", choices=("reregister", "keep"), default=None,
                    help="relaunch a killed engine at its port (with --restart-engines), see the docstring")
    ap.add_argument("--engine-check-interval", type=float, default=0.5,
                    help="dora_slime.engine_check_interval_s (600: no periodic refresh within a run)")
    ap.add_argument("--kill-engine-after", type=int, default=None, help="engine 0 dies as its N-th request starts")
    ap.add_argument("--stick-engine-after", type=int, default=None, help="engine 1 gets stuck as its N-th request starts")
    ap.add_argument("--response-len", type=int, default=6)
    ap.add_argument("--eval-prompts", type=int, default=2)
    ap.add_argument("--step-s", type=float, default=0.0, help="the stand-in's decode step of a whole batch")
    ap.add_argument("--load-s", type=float, default=0.0, help="how long a weight load holds the writer lock")
    ap.add_argument("--cheap-tokens", action="store_true", help="the stand-in's token generator, not the model")
    ap.add_argument("--no-dora", action="store_true",
                    help="slime alone: its own rollout and disk weight sync, with the loss and correction flags "
                         "`dora-ext slime-args` prints for this --loss and --k (the twins train one algorithm)")
    ap.add_argument("--probe-timeout", type=float, default=None, help="dora_slime.probe_timeout_s")
    ap.add_argument("--fail-prompt", action="store_true")
    ap.add_argument("--crash-at-rollout", type=int, default=None)
    ap.add_argument("--load-from", default=None, help="resume from this slime checkpoint directory (--load)")
    ap.add_argument("--save-interval", type=int, default=2)
    ap.add_argument("--weights-dir", default=None, help="--update-weight-disk-dir (default WORKDIR/weights)")
    ap.add_argument("--checkpoint-mb", type=int, default=0, help="MB of padding per version's checkpoint")
    ap.add_argument("--slime-args-only", action="store_true", help="parse slime's args and exit")
    o = ap.parse_args()
    work = Path(o.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)

    os.environ["SLIME_ACCELERATOR"] = "cpu"
    from slime_cpu import accel, megatron_args, model as tiny

    megatron_args.install()
    accel.setup()
    from slime_cpu.train_actor import CpuTrainRayActor

    hf = work / "hf"
    if not hf.exists():
        tiny.make_hf_checkpoint(hf)
    prompts, evals = write_data(work, max(64, o.batch * (o.num_rollout + o.k + 2)), o.fail_prompt, o.eval_prompts)

    import yaml

    from dora_ext.slime.cli import slime_flags

    cfg = {
        "dora": {"mode": o.mode, "max_staleness": o.k},
        "dora_slime": {"capacity": o.capacity, "poll_interval_s": 0.05,
                       "engine_check_interval_s": o.engine_check_interval,
                       "loss": o.loss, "staleness_correction": "tis" if o.k else "none"},
        "custom_rollout_weight_reload_path": "dora_ext.slime.weights.publish_weights",
        "harness_dir": str(work), "harness_checkpoint_mb": o.checkpoint_mb,
    }
    if o.probe_timeout is not None:
        cfg["dora_slime"]["probe_timeout_s"] = o.probe_timeout
    if o.crash_at_rollout is not None:
        cfg["harness_crash_at_rollout"] = o.crash_at_rollout
    cfg_path = work / "dora.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    weights = o.weights_dir or str(work / "weights")
    dora_flags = slime_flags(cfg, str(cfg_path), weights)
    algorithm = algorithm_flags(dora_flags)
    if o.no_dora:  # slime's own rollout; its disk weight sync reloads every engine at once
        plain = work / "slime.yaml"
        plain.write_text(yaml.safe_dump({"harness_dir": str(work), "harness_checkpoint_mb": o.checkpoint_mb}))
        dora_flags = ["--update-weight-transport", "disk", "--update-weight-disk-dir", weights,
                      "--custom-config-path", str(plain), *algorithm]
    server_flags = ["--step-s", str(o.step_s), "--load-s", str(o.load_s)] + (["--cheap-tokens"] if o.cheap_tokens else [])

    engines = Engines(work, hf, o.engines, {0: o.kill_engine_after} if o.kill_engine_after else {}, o.restart_engines,
                      o.restart_same_port, server_flags, {1: o.stick_engine_after} if o.stick_engine_after else {})
    router_proc = None
    try:
        argv = [
            "--hf-checkpoint", str(hf), "--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64",
            "--num-attention-heads", "4", "--rotary-base", "10000", "--norm-epsilon", "1e-5", "--vocab-size", "64",
            "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--distributed-backend", "gloo",
            "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
            "--rollout-external-engine-addrs", *engines.addrs,
            "--prompt-data", str(prompts), "--input-key", "text", "--label-key", "label",
            "--rollout-batch-size", str(o.batch), "--n-samples-per-prompt", str(o.n), "--num-rollout", str(o.num_rollout),
            "--global-batch-size", str(o.batch * o.n), "--rollout-max-response-len", str(o.response_len), "--rollout-temperature", "1.0",
            "--sglang-server-concurrency", str(o.capacity),
            "--custom-rm-path", "slime_cpu.hooks.reward", "--advantage-estimator", "grpo", "--lr", "1e-3",
            "--eps-clip", "0.2", "--eps-clip-high", "0.28",
            "--custom-rollout-log-function-path", "slime_cpu.hooks.log_rollout",
            "--custom-eval-rollout-log-function-path", "slime_cpu.hooks.log_eval",
            "--eval-prompt-data", "probe", str(evals), "--eval-interval", str(o.eval_interval),
            "--n-samples-per-eval-prompt", "1", "--eval-max-response-len", str(o.response_len),
            "--save", str(work / "ckpt"), "--save-interval", str(o.save_interval), "--seed", "1",
            *dora_flags,
        ]
        if o.load_from:
            argv += ["--load", o.load_from]
        if o.fault_tolerance:  # slime's recovery call before each weight push; no health monitor (external engines)
            argv += ["--use-fault-tolerance"]
        import ray

        from slime.utils.arguments import parse_args

        sys.argv = [f"{o.loop}.py", *argv]
        args = parse_args()
        result = {"unknown_megatron_flags": list(megatron_args.UNKNOWN), "algorithm_flags": algorithm,
                  "algorithm": algorithm_settings(args)}
        if o.slime_args_only:
            (work / "result.json").write_text(json.dumps(result))
            return 0
        router_proc, port = start_router(args)
        args.sglang_router_ip, args.sglang_router_port = "127.0.0.1", port
        engines.router = f"http://127.0.0.1:{port}"
        wait_http(f"{engines.router}/workers")
        engines.watch()

        ray.init(num_cpus=8, num_gpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
                                           "SLIME_ACCELERATOR": "cpu"},
                              "worker_process_setup_hook": "slime_cpu.accel.setup"})
        import slime

        loop_file = Path(slime.__file__).resolve().parent.parent / f"{o.loop}.py"
        spec = importlib.util.spec_from_file_location(f"slime_{o.loop}_loop", loop_file)
        loop = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loop)
        # The one change to slime's loop: the train group gets the CPU actor (RayTrainGroup's actor_cls).
        syncs: list[float] = []
        create = loop.create_training_models

        def create_training_models(*a, **kw):
            models = create(*a, **kw, actor_cls=CpuTrainRayActor)
            update = models[0].update_weights

            def timed_update(*ua, **ukw):  # the trainer's weight sync, as the driver waits for it
                t = time.time()
                try:
                    return update(*ua, **ukw)
                finally:
                    syncs.append(time.time() - t)

            models[0].update_weights = timed_update
            return models

        loop.create_training_models = create_training_models
        t0 = time.time()
        try:
            loop.train(args)
            result["status"] = "finished"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            result["status"] = "crashed"
            result["error"] = repr(exc)[:2000]
        result["wall_s"] = time.time() - t0
        result["engine_events"] = engines.events
        result["weight_sync_s"] = syncs
        ray.shutdown()
        (work / "result.json").write_text(json.dumps(result))
        return 0
    finally:
        engines.stop()
        if router_proc is not None:
            router_proc.kill()
            router_proc.join(5)


if __name__ == "__main__":
    sys.exit(main())
