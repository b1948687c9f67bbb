"""STAND-IN for slime's Megatron train actor (`MegatronTrainRayActor`): no GPU, no Megatron-LM.

It has the interface `RayTrainGroup` (slime/ray/actor_group.py) calls -- constructor
`(world_size, rank, master_addr, master_port)`, `get_master_addr_and_port`, `init`,
`set_rollout_manager`, `train`, `save_model`, `update_weights`, `clear_memory`, `sleep`,
`wake_up` -- and is created by slime's own `RayTrainGroup` (its `actor_cls` argument). What runs
inside is slime's code where it exists without Megatron-LM:

* the rollout data arrives through slime's `process_rollout_data` (slime/utils/data.py);
* megatron-core's `parallel_state` is initialised over gloo (world size 1: TP = PP = CP = DP = 1);
* old-policy log-probs come from slime's `get_log_probs_and_entropy`, advantages from slime's
  `compute_advantages_and_returns`, and the loss from slime's `loss_function`
  (slime/backends/megatron_utils/loss.py), which calls dora-ext's `sao_loss` / `staleness_tis`
  through `--custom-loss-function-path` / `--custom-tis-function-path` exactly as on GPUs;
* a real Adam step on the tiny model replaces Megatron's distributed optimizer;
* `update_weights` writes the HF checkpoint where slime's disk transport
  (`UpdateWeightFromDisk`) writes it: `--update-weight-disk-dir/weight_v{n:06d}`; with
  `--use-fault-tolerance` it first asks the rollout manager to recover engines, as slime's does
  (`harness_checkpoint_mb` in the YAML: that many MB more per version, a model-sized write);
* `save_model` writes a Megatron-style tracker (`latest_checkpointed_iteration.txt`) and the
  state under `--save`, and `init` resumes from `--load` the way slime's actor reports it
  (the returned start rollout id is the loaded one + 1).

Every trained sample is logged (`train.jsonl` in the harness directory) for the C1/C2 checks.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from slime.ray.ray_actor import RayActor

from . import model as tiny


class CpuTrainRayActor(RayActor):
    def __init__(self, world_size, rank, master_addr, master_port):
        self._world_size, self._rank = world_size, rank
        if master_addr:
            self.master_addr, self.master_port = master_addr, master_port
        else:
            self.master_addr, self.master_port = self._get_current_node_ip_and_free_port(
                start_port=random.randint(20000, 21000))

    def init(self, args, role, with_ref=False, with_opd_teacher=False):
        torch.set_num_threads(1)
        self.args, self.role = args, role
        dist.init_process_group("gloo", init_method=f"tcp://{self.master_addr}:{self.master_port}",
                                rank=self._rank, world_size=self._world_size)
        from megatron.core import parallel_state as mpu

        mpu.initialize_model_parallel(1, 1)
        args.rank, args.world_size = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(args.seed)
        self.model = tiny.new_model()
        tiny.load_into(self.model, Path(args.hf_checkpoint))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=args.lr)
        loaded = -1
        if args.load and (Path(args.load) / "latest_checkpointed_iteration.txt").exists():
            loaded = int((Path(args.load) / "latest_checkpointed_iteration.txt").read_text())
            state = torch.load(Path(args.load) / f"iter_{loaded:07d}" / "state.pt", weights_only=True)
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["opt"])
        self.weight_version = getattr(args, "update_weight_start_version", 0)
        self.train_parallel_config = {"dp_size": 1, "cp_size": 1, "vpp_size": 1,
                                      "microbatch_group_size_per_vp_stage": 1}
        self.log = Path(args.harness_dir) / "train.jsonl"
        return loaded + 1

    def set_rollout_manager(self, rollout_manager):
        self.rollout_manager = rollout_manager
        if self._rank == 0:
            ray.get(self.rollout_manager.set_train_parallel_config.remote(self.train_parallel_config))

    def clear_memory(self):
        return None

    def sleep(self, tags=None):
        return None

    def wake_up(self, tags=None):
        return None

    def _logits(self, tokens: list[torch.Tensor]) -> torch.Tensor:
        # Packed like slime's THD format: one sequence of all samples, each attending to itself.
        return torch.cat([self.model(t[None])[0][0] for t in tokens], dim=0)[None]

    def train(self, rollout_id, rollout_data_ref, external_data=None):
        from slime.backends.megatron_utils.loss import (
            compute_advantages_and_returns, get_log_probs_and_entropy, loss_function,
        )
        from slime.utils.data import process_rollout_data

        data = process_rollout_data(self.args, rollout_data_ref, 0, 1)
        tokens = [torch.tensor(t, dtype=torch.long) for t in data["tokens"]]
        data["tokens"] = tokens
        data["unconcat_tokens"] = tokens
        data["loss_masks"] = [torch.tensor(m, dtype=torch.int) for m in data["loss_masks"]]
        data["rollout_mask_sums"] = torch.tensor(data["rollout_mask_sums"], dtype=torch.float32)
        if "rollout_log_probs" in data:
            data["rollout_log_probs"] = [torch.tensor(lp, dtype=torch.float32) for lp in data["rollout_log_probs"]]
        with torch.no_grad():
            _, out = get_log_probs_and_entropy(self._logits(tokens), args=self.args, unconcat_tokens=tokens,
                                               total_lengths=data["total_lengths"],
                                               response_lengths=data["response_lengths"], with_entropy=False)
        data["log_probs"] = out["log_probs"]
        compute_advantages_and_returns(self.args, data)
        self.model.train()
        self.opt.zero_grad()
        loss, _, log = loss_function(self.args, data, 1, len(tokens), self._logits(tokens))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip_grad)
        self.opt.step()
        self.model.eval()
        with open(self.log, "a") as fh:
            fh.write(json.dumps({
                "rollout_id": rollout_id, "sample_indices": list(data["sample_indices"]),
                "tokens": [t.tolist() for t in tokens], "loss": float(loss.detach()),
                "metrics": dict(zip(log["keys"], [float(v) for v in log["values"][1:]])),
                "custom_loss": self.args.loss_type, "t_end": time.time(),
            }) + "\n")

    def save_model(self, rollout_id, force_sync=False):
        d = Path(self.args.save) / f"iter_{rollout_id:07d}"
        d.mkdir(parents=True, exist_ok=True)
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict()}, d / "state.pt")
        (Path(self.args.save) / "latest_checkpointed_iteration.txt").write_text(str(rollout_id))

    def _wait_for_recovered_engines(self, timeout_s: float = 180.0) -> None:
        """slime recovers dead engines synchronously here (`recover_updatable_engines` relaunches the engines it
        launched). For external engines that call is a no-op and the harness relaunches them (run.py); wait, as slime's
        recovery does, until every engine is back in the router and healthy."""
        import requests

        router = f"http://{self.args.sglang_router_ip}:{self.args.sglang_router_port}"
        deadline = time.monotonic() + timeout_s
        while True:
            healthy = 0
            try:
                for w in requests.get(f"{router}/workers", timeout=5).json().get("workers", []):
                    try:
                        requests.get(f"{w['url']}/health", timeout=2).raise_for_status()
                        healthy += 1
                    except requests.RequestException:
                        pass
            except requests.RequestException:
                pass
            if healthy >= self.args.rollout_num_engines:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {healthy} of {self.args.rollout_num_engines} engines came back")
            time.sleep(0.5)

    def update_weights(self):
        if self.args.use_fault_tolerance and self._rank == 0:
            ray.get(self.rollout_manager.recover_updatable_engines.remote())
            self._wait_for_recovered_engines()
        engines, *_ = ray.get(self.rollout_manager.get_updatable_engines_and_lock.remote())
        if not engines:
            return
        self.weight_version += 1
        d = Path(self.args.update_weight_disk_dir) / f"weight_v{self.weight_version:06d}"
        if self._rank == 0:
            shutil.rmtree(d, ignore_errors=True)
            tiny.save(self.model, d)
            tiny.pad(d, getattr(self.args, "harness_checkpoint_mb", 0))
        os.sync()
