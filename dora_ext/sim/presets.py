"""Cost models and calibrated presets of the simulator.

One `Preset` = hardware (`accelerators` G, accelerators per rollout instance), an engine cost
model, a trainer cost model, a workload and a batch. Every mode of a comparison runs with the
same preset, so modes differ only in what the real `dora_ext.core.Scheduler` decides.

Where a constant comes from is said next to it: [paper] a figure quoted in design.md; [hw]
derived from public hardware/model sizes (H100-class) at a stated utilisation; [calib] chosen so
that a simulated figure matches a [paper] one (`calibration()` measures it, the tests check it).

A trained token costs 12*N FLOP for an N-parameter model: 2N for the old-policy log-probs, 2N for
the reference log-probs, 8N for forward + backward with activation recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .workload import Workload, WorkloadError

# H100-class accelerator, the reference of every [hw] constant below.
_FLOPS = 989e12  # dense bf16 FLOP/s
_HBM = 3.35e12  # bytes/s


@dataclass(frozen=True)
class EngineCost:
    """Cost model of one rollout instance (an inference engine replica with continuous batching).

    One decode iteration advances every running sequence by one token and takes
    `decode_a_s + decode_b_s * running + decode_c_s * total_context` seconds: `a` is reading the
    weights once (memory bound), `b` the per-sequence matmul work, `c` reading each context
    token's KV cache. Prefill costs `prefill_s_per_token` per prompt token and stalls decoding
    (no chunked prefill). `capacity` bounds the running sequences.

    Moving a running trajectory between instances (R5) costs `context * kv_bytes_per_token /
    migrate_bytes_per_s` seconds during which it does not advance; with `migrate_bytes_per_s = 0`
    the engine cannot move KV and the destination re-prefills the context instead.
    `resume_reprefill`: after a weight update preempts trajectories (mode `partial`), the old KV
    is dropped and the context re-prefilled (AReaL, verl fully_async partial rollout).

    MoE expert-load imbalance: with `moe_imbalance = m > 0` every instance's iteration cost is
    multiplied by `1 + m * |z|` (z standard normal), drawn per instance and per `moe_period_s`
    period, keyed by seed so every mode sees the same speeds. Factor 1 is the best case, so the
    ideal is unchanged; the mean factor is `1 + 0.8 m`.

    `kv_budget_tokens` (hosts with `kv_memory`): the running contexts must fit it; otherwise the
    newest sequence is preempted and later re-prefilled, as vLLM does by default.
    """

    decode_a_s: float
    decode_b_s: float
    decode_c_s: float
    prefill_s_per_token: float
    weight_load_s: float
    kv_bytes_per_token: float
    migrate_bytes_per_s: float
    capacity: int
    accelerators: int = 1
    resume_reprefill: bool = True
    moe_imbalance: float = 0.0
    moe_period_s: float = 30.0
    weight_bytes: float = 0.0  # the served weights (bf16): what a host's weight path moves
    kv_budget_tokens: int = 0  # KV tokens one instance holds (0: unbounded); used by hosts with KV memory

    def __post_init__(self) -> None:
        if not self.moe_imbalance >= 0:
            raise WorkloadError(f"moe_imbalance: expected a number >= 0, got {self.moe_imbalance!r}")
        if not self.moe_period_s > 0:
            raise WorkloadError(f"moe_period_s: expected a number > 0, got {self.moe_period_s!r}")


@dataclass(frozen=True)
class TrainerCost:
    """Cost model of the trainer (FSDP/Megatron), work expressed in accelerator-seconds.

    A trained token (prompt + response, forward + backward + log-prob recomputation) costs
    `train_acc_s_per_token`; the optimizer step costs `optimizer_acc_s` per step. Both divide by
    the trainer's accelerator count (perfect scaling favours no mode). Publishing a version takes
    `broadcast_s` of trainer time. Elastic colocation: joining the trainer costs `join_s`, leaving
    it `leave_s` (then the rollout weights load, `weight_load_s`).
    """

    train_acc_s_per_token: float
    optimizer_acc_s: float
    broadcast_s: float
    join_s: float = 5.0
    leave_s: float = 5.0
    step_acc_s_per_token: float = 0.0  # work at the optimizer step per batch token (not streamed)
    dp_comm_s: float = 0.0  # per step, data-parallel collectives when the trainer has > 1 accelerator
    report_s: float = 0.0  # the coordinator hop: a step report -> the next command, a finished group -> the trainer


@dataclass(frozen=True)
class Preset:
    """A calibrated scenario. `sources` says where each figure comes from (shown by --list-presets)."""

    name: str
    summary: str
    accelerators: int
    engine: EngineCost
    trainer: TrainerCost
    workload: Workload
    batch_size: int
    default_split: tuple[int, int]  # rollout:trainer accelerators (a ratio when not summing to G)
    sync_colocated: bool = True
    default_steps: int = 20
    sources: tuple[str, ...] = field(default=())
    targets: dict = field(default_factory=dict)
    instances: int = 0  # > 0: this many instances whatever the split, time-sharing the rollout side
    coordinator_share: float = 0.0  # of a shared rollout accelerator, taken by the host's coordinator

    def __post_init__(self) -> None:
        r, t = self.default_split
        if r < 1 or t < 1:
            raise WorkloadError(f"{self.name}: default_split {r}:{t} must give both sides >= 1 accelerator")


# --------------------------------------------------------------------------- dapo-28k
# Qwen2.5-7B class (Qwen2.5-Math-7B, the verl fully_async DAPO figure): 7.6e9 parameters,
# 28 layers, 4 KV heads x 128 dims -> 28*4*128*2 (K,V) * 2 bytes = 57,344 KV bytes per token.
_P7 = 7.6e9
_KV7 = 28 * 4 * 128 * 2 * 2

DAPO_28K = Preset(
    name="dapo-28k",
    summary="DAPO-style math reasoning, Qwen2.5-7B class, 28K response cap, 128 accelerators, colocated sync",
    accelerators=128,
    engine=EngineCost(
        decode_a_s=8e-3,  # [hw] 15.2 GB of weights read per iteration at ~60% of 3.35 TB/s (+launch)
        decode_b_s=4e-5,  # [hw] 2*7.6e9 FLOP per token at ~40% of 989 TFLOP/s
        decode_c_s=_KV7 / (0.7 * _HBM),  # [hw] 57 KB of KV read per context token at 70% HBM
        prefill_s_per_token=2 * _P7 / (0.5 * _FLOPS),  # [hw] prefill at 50% MFU
        weight_load_s=3.0,  # [hw] 15 GB of bf16 weights resharded/received at ~5 GB/s
        kv_bytes_per_token=_KV7,
        migrate_bytes_per_s=25e9,  # [hw] 200 Gb/s RDMA between instances
        capacity=128,  # [hw] ~55 GB KV budget / 57 KB / ~5K mean in-flight context ~ 190; vLLM-style 128
        accelerators=1,  # [hw] a 7B model fits one 80 GB accelerator
        weight_bytes=2 * _P7,
        kv_budget_tokens=55_000_000_000 // _KV7,  # [hw] 80 GB - 15 GB weights - ~10 GB activations = 55 GB / 57 KB: 959K tokens
    ),
    trainer=TrainerCost(
        # [calib] sync rollout share ~70% of the step (verl docs, DAPO-32B); above the [hw]
        # estimate (2.6e-4 at 35% MFU), which leaves out attention over 28K contexts and FSDP comms.
        train_acc_s_per_token=5.8e-4,
        optimizer_acc_s=128.0,  # [hw] ~1 s FSDP AdamW step at 128 accelerators
        broadcast_s=2.0,  # [hw] gather + NCCL broadcast of 15 GB
        # [hw] 16 B/param of AdamW state resharded at ~5 GB/s per accelerator plus a communicator
        # rebuild; leaving offloads the shard the same way
        join_s=5.0,
        leave_s=5.0,
    ),
    workload=Workload(
        response_median=3000.0,  # [paper] DAPO responses of a few thousand tokens (mean ~4K)
        response_cv=1.0,  # [paper] design.md: log-normal with CV ~1 -> longest of 16 ~5x mean
        response_cap=28672,  # [paper] the 28K cap of the verl fully_async DAPO run
        prompt_median=256.0,
        prompt_cv=0.5,
        prompt_cap=2048,
        group_size=16,  # [paper] DAPO: 16 responses per prompt
        difficulty_share=0.3,  # [calib] towards 'longest of 16 ~5x the mean' (design.md)
    ),
    batch_size=512,  # [paper] DAPO: 512 prompts per step
    default_split=(48, 80),
    sync_colocated=True,  # [paper] verl/slime colocated default (design.md, Equal hardware)
    default_steps=20,
    sources=(
        "verl fully_async, Qwen2.5-Math-7B DAPO 28K cap at 128 GPUs (design.md): G=128, cap 28672",
        "verl docs DAPO-32B / issue 3: rollout ~70% of a sync step (trainer constant calibrated to it)",
        "design.md: log-normal CV ~1 capped at the max length; DAPO recipe: 512 prompts x 16",
        "engine constants from H100 bandwidth/FLOPs and the Qwen2.5-7B KV layout (see module)",
    ),
    targets={"rollout_share_sync": 0.70},
)

# --------------------------------------------------------------------------- rolloutpipe-8k
# Qwen3-1.7B: 1.7e9 parameters, 28 layers, 8 KV heads x 128 dims -> 114,688 KV bytes per token.
_P17 = 1.7e9
_KV17 = 28 * 8 * 128 * 2 * 2

ROLLOUTPIPE_8K = Preset(
    name="rolloutpipe-8k",
    summary="RolloutPipe-style on-policy GRPO, Qwen3-1.7B class, 8K cap, 4 rollout + 4 trainer accelerators (disaggregated)",
    accelerators=8,
    engine=EngineCost(
        decode_a_s=3e-3,  # [hw] 3.4 GB weights at 60% HBM (~1.7 ms) + per-iteration launch overhead
        decode_b_s=1e-5,  # [hw] 2*1.7e9 FLOP per token at ~35% MFU
        decode_c_s=_KV17 / (0.7 * _HBM),  # [hw] 115 KB of KV per context token at 70% HBM
        prefill_s_per_token=2 * _P17 / (0.5 * _FLOPS),
        weight_load_s=1.0,  # [hw] 3.4 GB at ~5 GB/s
        kv_bytes_per_token=_KV17,
        migrate_bytes_per_s=25e9,
        capacity=256,  # [hw] vLLM/SGLang default max running requests; ~60 GB KV / 115 KB fits it
        accelerators=1,
        weight_bytes=2 * _P17,
        kv_budget_tokens=60_000_000_000 // _KV17,  # [hw] 80 GB - 3.4 GB weights - activations = ~60 GB / 115 KB: 523K tokens
    ),
    trainer=TrainerCost(
        # [hw] 12*N FLOP per trained token (module doc) at 25% MFU: small models with 8K
        # sequences are attention- and launch-bound
        train_acc_s_per_token=12 * _P17 / (0.25 * _FLOPS),
        optimizer_acc_s=2.0,  # [hw] ~0.5 s AdamW step on 4 accelerators
        broadcast_s=0.5,  # [hw] 3.4 GB broadcast
        join_s=4.0,  # [hw] 27 GB of AdamW state over ~4 accelerators at ~5 GB/s (+ rebuild)
        leave_s=4.0,
    ),
    workload=Workload(
        response_median=1500.0,  # [paper] Qwen3-1.7B reasoning under an 8K cap, long-tailed
        response_cv=1.0,  # [paper] design.md log-normal CV ~1
        response_cap=8192,  # [paper] RolloutPipe: 8K cap
        prompt_median=200.0,
        prompt_cv=0.5,
        prompt_cap=1024,
        group_size=8,  # [paper] slime GRPO default n_samples_per_prompt = 8
        difficulty_share=0.5,
    ),
    batch_size=128,
    default_split=(4, 4),
    sync_colocated=False,  # [paper] RolloutPipe compares against slime with separate pools
    default_steps=20,
    sources=(
        "RolloutPipe (arXiv 2606.26997): Qwen3-1.7B, 8K cap, disaggregated slime baseline (sync on split pools)",
        "design.md: log-normal CV ~1; slime: 8 samples per prompt",
        "engine and trainer constants from H100 bandwidth/FLOPs and the Qwen3-1.7B KV layout",
    ),
)

# --------------------------------------------------------------------------- agentic-long-tail
# Qwen3-32B class: 32e9 parameters, 64 layers, 8 KV heads x 128 dims -> 262,144 KV bytes per
# token; tensor parallel 4, so per-accelerator traffic is a quarter.
_P32 = 32e9
_KV32 = 64 * 8 * 128 * 2 * 2

AGENTIC_LONG_TAIL = Preset(
    name="agentic-long-tail",
    summary="Agentic multi-turn episodes, Qwen3-32B class (TP4), single rollout per prompt (SAO), 64K cap, very long tail",
    accelerators=64,
    engine=EngineCost(
        decode_a_s=12e-3,  # [hw] 64 GB weights over 4 accelerators at 60% HBM + all-reduce per layer
        decode_b_s=2 * _P32 / (4 * 0.4 * _FLOPS),  # [hw] 40% MFU over 4 accelerators
        decode_c_s=_KV32 / (4 * 0.7 * _HBM),
        prefill_s_per_token=2 * _P32 / (4 * 0.5 * _FLOPS),
        weight_load_s=8.0,  # [hw] 64 GB at ~8 GB/s
        kv_bytes_per_token=_KV32,
        migrate_bytes_per_s=25e9,
        capacity=64,  # [hw] ~216 GB KV on 4 accelerators / 262 KB / ~12K context
        accelerators=4,
        weight_bytes=2 * _P32,
        kv_budget_tokens=216_000_000_000 // _KV32,  # [hw] 4 x 80 GB - 64 GB weights - activations = ~216 GB / 262 KB: 824K tokens
    ),
    trainer=TrainerCost(
        train_acc_s_per_token=12 * _P32 / (0.35 * _FLOPS),  # [hw] 12*N FLOP/token at 35% MFU
        optimizer_acc_s=64.0,  # [hw] ~1 s sharded AdamW step at 64 accelerators
        broadcast_s=6.0,  # [hw] 64 GB gather + broadcast
        # [hw] 512 GB of AdamW state over ~24-40 trainer accelerators: ~15 GB per accelerator
        # at ~5 GB/s, plus the communicator rebuild
        join_s=10.0,
        leave_s=10.0,
    ),
    workload=Workload(
        # Multi-turn episodes: a heavier tail than one answer (p99 ~ 20x the median, Seer) and
        # long accumulated contexts (tool outputs) as the prompt.
        response_median=4000.0,
        response_cv=2.0,
        response_cap=65536,
        prompt_median=4000.0,
        prompt_cv=0.8,
        prompt_cap=32768,
        group_size=1,  # [paper] SAO: one rollout per prompt for agentic RL
        difficulty_share=0.0,
    ),
    batch_size=256,
    default_split=(40, 24),
    sync_colocated=True,
    default_steps=20,
    sources=(
        "SAO (arXiv 2607.07508): single rollout per prompt (n=1) for agentic RL",
        "Seer (design.md): last 10% of requests up to 50% of rollout time; rollout 63-84% of a sync step",
        "engine and trainer constants from H100 bandwidth/FLOPs and the Qwen3-32B KV layout, TP 4",
    ),
)

# --------------------------------------------------------------------------- moe-imbalance
# Qwen3-30B-A3B class MoE: 30.5e9 parameters, 3.3e9 active per token, 48 layers, 4 KV heads x 128
# dims -> 48*4*128*2*2 = 98,304 KV bytes per token; expert parallel over 2 accelerators.
_P30, _A3 = 30.5e9, 3.3e9
_KV30 = 48 * 4 * 128 * 2 * 2

MOE_IMBALANCE = Preset(
    name="moe-imbalance",
    summary="MoE reasoning RL, Qwen3-30B-A3B class (EP2), 16K cap, 32 accelerators; instances' decode speed varies with expert load",
    accelerators=32,
    engine=EngineCost(
        decode_a_s=2 * _P30 / (2 * 0.6 * _HBM),  # [hw] a large batch touches every expert: 61 GB over 2 accelerators at 60% HBM
        decode_b_s=2 * _A3 / (2 * 0.3 * _FLOPS),  # [hw] active parameters only, 30% MFU (grouped GEMMs)
        decode_c_s=_KV30 / (2 * 0.7 * _HBM),
        prefill_s_per_token=2 * _A3 / (2 * 0.4 * _FLOPS),
        weight_load_s=8.0,  # [hw] 61 GB at ~8 GB/s
        kv_bytes_per_token=_KV30,
        migrate_bytes_per_s=25e9,
        capacity=128,  # [hw] vLLM-style 128 running requests per instance (~100 GB KV on 2 accelerators)
        accelerators=2,
        weight_bytes=2 * _P30,
        kv_budget_tokens=100_000_000_000 // _KV30,  # [hw] 2 x 80 GB - 61 GB weights - activations = ~100 GB / 98 KB: 1.02M tokens
        # [assumed] expert-load skew (an EP iteration waits for the most loaded expert): factor
        # 1 + 0.3 |z| (mean 1.24), redrawn every 30 s per instance.
        moe_imbalance=0.3,
        moe_period_s=30.0,
    ),
    trainer=TrainerCost(
        # [hw] 12 * active parameters FLOP per token at 20% MFU (all-to-all, grouped GEMMs)
        train_acc_s_per_token=12 * _A3 / (0.2 * _FLOPS),
        optimizer_acc_s=32.0,  # [hw] ~1 s AdamW over 30.5e9 parameters sharded over 32 accelerators
        broadcast_s=8.0,  # [hw] 61 GB gather + broadcast
        join_s=8.0,  # [hw] 488 GB of AdamW state over ~16 accelerators: ~30 GB each, partly NVLink
        leave_s=8.0,
    ),
    workload=Workload(
        response_median=3000.0,  # [paper] DAPO-like reasoning, log-normal CV ~1 (design.md)
        response_cv=1.0,
        response_cap=16384,
        prompt_median=256.0,
        prompt_cv=0.5,
        prompt_cap=2048,
        group_size=16,
        difficulty_share=0.3,
    ),
    batch_size=256,
    default_split=(16, 16),
    sync_colocated=True,
    default_steps=20,
    sources=(
        "DORA (design.md): long tails are worse with MoE; expert-load imbalance slows instances unevenly",
        "engine constants from H100 bandwidth/FLOPs and the Qwen3-30B-A3B layout (3.3e9 active, EP 2)",
        "moe_imbalance 0.3 per 30 s is an assumption (stated, not calibrated); compare with moe_imbalance=0 for the effect",
    ),
)

# --------------------------------------------------------------------------- cpu-long-tail
# The embedded runtime's main job (recipes/cpu/long-tail.yaml) on 2 cores: the tiny model (d_model
# 64, 2 layers, fp32), 2 instances of 64 sequences, batch 8 x 16. [meas] constants come from
# benchmarks/sim_vs_runtime.py, which re-measures them (`calibrate`) before it compares.
_KVT = 2 * 64 * 2 * 4  # 2 layers x d_model 64 x (K, V) x fp32

CPU_LONG_TAIL = Preset(
    name="cpu-long-tail",
    summary="The embedded runtime's CPU main job (long-tail recipe): 2 cores, 2 instances time-sharing the rollout core, trainer-bound",
    accelerators=2,
    engine=EngineCost(
        decode_a_s=0.42e-3,  # [meas] a decode step of one instance on its own core: 0.42 ms + 0.061 ms
        decode_b_s=0.061e-3,  # per running sequence (the sync run's step log; the contexts, < 110 tokens, folded in)
        decode_c_s=0.0,
        prefill_s_per_token=2e-5,  # [meas] short prompts (7 tokens) prefilled at admission
        weight_load_s=0.8e-3,  # [meas] a copy of the published tensors into an engine
        kv_bytes_per_token=_KVT,
        migrate_bytes_per_s=1e8,  # [assumed] the exported KV goes through the coordinator's pipes
        capacity=64,  # [recipe] dora.capacity
        accelerators=1,
    ),
    trainer=TrainerCost(
        train_acc_s_per_token=1.6e-4,  # [meas] a streamed group's forward/backward, per token
        optimizer_acc_s=0.0,
        broadcast_s=1e-3,  # [meas] publishing: state_dict copy and packing into shared memory
        step_acc_s_per_token=2.3e-4,  # [meas] finish_step: pi_prox pass, second minibatch, 2 AdamW steps
        dp_comm_s=0.1,  # [meas] colocated sync's 2 gloo ranks: time in collectives per step
        report_s=0.043,  # [meas] step done -> coordinator (on the busy rollout core) -> next trainer command
    ),
    workload=Workload(  # [recipe] responses 2L+1 tokens, L log-normal median 4 cv 1.2 cap 40; replay a run's lengths for more
        response_median=9.0, response_cv=0.9, response_cap=81, prompt_median=7.0, prompt_cv=0.0, prompt_cap=7,
        group_size=16, difficulty_share=0.9),
    batch_size=8,
    default_split=(1, 1),
    sync_colocated=True,  # [recipe] sync: both instances generate, then the trainer trains on both cores
    default_steps=20,
    instances=2,  # [recipe] dora.instances: both on the rollout core in the asynchronous modes
    coordinator_share=0.3,  # [meas] the coordinator (prompts, rewards, scheduling) runs on the rollout core too
    sources=(
        "recipes/cpu/long-tail.yaml: 2 cores, 2 instances x 64, batch 8 x 16, trainer_cores 1, sync colocated",
        "benchmarks/sim_vs_runtime.py: decode, prefill, trainer, load and collective costs measured on the embedded runtime",
    ),
)

PRESETS: dict[str, Preset] = {
    p.name: p for p in (DAPO_28K, ROLLOUTPIPE_8K, AGENTIC_LONG_TAIL, MOE_IMBALANCE, CPU_LONG_TAIL)
}


def get_preset(name: str) -> Preset:
    """The preset called `name`; an unknown name is an error listing the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise WorkloadError(f"preset: unknown preset {name!r}; accepted: {', '.join(PRESETS)}") from None
