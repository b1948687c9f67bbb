"""A small streaming RL trainer: complete groups in, one (or, PPO-style, several) optimizer steps per
batch, weights out.

    trainer = Trainer(policy, TrainerConfig(algorithm="grpo"))
    for group in groups_of_step_k:            # as the core delivers them (DeliverGroup, R7)
        trainer.add_group(group)              # forward + backward now, gradients accumulate
    metrics = trainer.finish_step(k)          # AdamW step on the batch-mean gradient -> version k+1
    weights = trainer.publish()               # a copy of the new weights for the engines

Streaming is exact: every loss is a token (or sequence) sum divided by the batch's count;
`add_group` back-propagates its own sum and `finish_step` divides the accumulated gradient by the
batch total, which equals the batch-mean gradient however the batch was split (tested against
`batch_loss`). Advantages need only the group (GRPO) or trajectory (SAO), so no batch whitening.

Policies (see `losses.py`): pi_behav (pi_rollout, the engine's `rollout_logprobs`); pi_prox
(PPO's pi_old, scored by a no-grad pass when the group arrives; with one update per batch the
ratio pi_theta / pi_prox is exactly 1); pi_theta (the weights being updated). `correction`:
"none" anchors the clip at pi_behav; "tis"/"decoupled" anchor it at pi_prox and weight tokens by
pi_prox / pi_behav, truncated at `is_cap` (or masked, `is_cap_mode="mask"`); "sao" drops tokens
whose pi_theta / pi_behav leaves [1 - sao_eps_low, 1 + sao_eps_high], with no PPO clip.
`kl_coef` > 0 adds a k3 KL penalty to a frozen copy of the initial policy.

Several updates per batch (`ppo_epochs` x `ppo_minibatches`): `add_group` stores groups and
`finish_step` steps once per consecutive chunk of groups, `ppo_epochs` times; the version advances
once per batch. `micro_tokens` > 0 forwards length-sorted micro-batches instead of one padded
forward per group (same sums, less padding). Data parallel, `add_group(group, position=p)` makes
minibatch i the single trainer's i-th chunk however the groups were shared between ranks.

Rollout log-probs must come from the temperature-scaled distribution the engine sampled;
`TrainerConfig.temperature` scales the trainer's logits the same. The policy's train/eval mode is
left as the caller set it (dropout would make pi_theta differ from pi_rollout).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn

from dora_ext.algo.advantages import gae, grpo_advantages, token_rewards, value_loss
from dora_ext.algo.losses import (
    LOSS_AGG_MODES,
    agg_loss,
    decoupled_ppo_loss,
    double_side_mask,
    entropy_from_logits,
    kl_penalty,
    ppo_policy_loss,
    sao_policy_loss,
    tis_ppo_loss,
)
from dora_ext.config import ConfigError

__all__ = ["ALGORITHMS", "CORRECTIONS", "Trajectory", "TrainerConfig", "Trainer", "default_logits_fn",
           "minibatch_bounds", "minibatch_of"]

ALGORITHMS = ("grpo", "sao")
CORRECTIONS = ("none", "tis", "decoupled", "sao")


@dataclass(frozen=True)
class Trajectory:
    """One generated response, as the rollout engine reports it.

    `rollout_logprobs[i]` is log pi_rollout(response_ids[i] | prompt, response[:i]) under the
    version that generated it (`version`), after temperature scaling.
    """

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    rollout_logprobs: Sequence[float]
    reward: float
    version: int


@dataclass(frozen=True)
class TrainerConfig:
    """Trainer settings (plain values, nanoGPT style). Invalid values raise `ConfigError`.

    algorithm: "grpo" (group-normalised advantages, PPO clip) or "sao" (single rollout with a
      value head, GAE, double-side mask; any n is accepted).
    lr, value_lr (default lr), weight_decay, betas: AdamW; policy and value head get one group each.
    grad_clip: max global L2 norm, applied separately to the policy and the value head; None = off.
    clip_low, clip_high: PPO clip range [1 - clip_low, 1 + clip_high] (clip_high None = clip_low).
    loss_agg_mode: "token-mean" or "seq-mean-token-mean".
    norm_adv_by_std: GRPO divides by the group std; False gives Dr.GRPO. adv_eps: the std's epsilon.
    correction: off-policy correction for stale GRPO groups: "none", "tis", "decoupled", "sao"
      (the module docstring says what each does).
    is_cap: C of the importance weight. is_cap_mode: "truncate" or "mask" (decoupled only).
    ppo_epochs, ppo_minibatches: optimizer steps per batch = epochs x minibatches (consecutive
      chunks of groups; data parallel, by the positions given to `add_group`, else per rank).
    kl_coef: weight of the k3 KL penalty to the initial policy (0 = no reference model).
    critic_warmup: SAO: the first steps train only the value head (the policy is published unchanged).
    sao_eps_low, sao_eps_high: SAO's band [1 - eps_low, 1 + eps_high] on pi_theta / pi_rollout.
    gamma, lam: GAE. value_coef: weight of the value loss. value_clip: value clip range (None = off).
    entropy_coef: entropy bonus (0 = only reported); under SAO's mask only on the tokens it keeps.
    temperature: the engine's sampling temperature.
    pad_id: the token used to pad batches (any valid id; padded positions are masked).
    micro_tokens: forward in length-sorted micro-batches of at most this many padded tokens (rows x
      longest row; a longer row goes alone): same sums, less padding. 0 = one forward per group.
    """

    algorithm: str = "grpo"
    lr: float = 1e-4
    value_lr: float | None = None
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float | None = 1.0
    clip_low: float = 0.2
    clip_high: float | None = None
    loss_agg_mode: str = "token-mean"
    norm_adv_by_std: bool = True
    adv_eps: float = 1e-6
    correction: str = "tis"
    is_cap: float = 2.0
    is_cap_mode: str = "truncate"
    sao_eps_low: float = 0.2
    sao_eps_high: float = 0.2
    gamma: float = 1.0
    lam: float = 1.0
    value_coef: float = 0.5
    value_clip: float | None = 0.2
    entropy_coef: float = 0.0
    temperature: float = 1.0
    pad_id: int = 0
    ppo_epochs: int = 1
    ppo_minibatches: int = 1
    kl_coef: float = 0.0
    critic_warmup: int = 0
    micro_tokens: int = 0

    def __post_init__(self) -> None:
        def choice(name: str, accepted: Sequence[str]) -> None:
            if getattr(self, name) not in accepted:
                raise ConfigError(name, f"unknown value {getattr(self, name)!r}; accepted: {', '.join(accepted)}")

        def number(
            name: str, lo: float, hi: float = math.inf, *, optional: bool = False, open_lo: bool = False
        ) -> None:
            v = getattr(self, name)
            if v is None and optional:
                return
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            ok = ok and (v > lo if open_lo else v >= lo) and v <= hi
            if not ok:
                left = "(" if open_lo else "["
                right = "]" if math.isfinite(hi) else ")"
                none = " or null" if optional else ""
                raise ConfigError(name, f"expected a number in {left}{lo}, {hi}{right}{none}, got {v!r}")

        choice("algorithm", ALGORITHMS)
        choice("loss_agg_mode", LOSS_AGG_MODES)
        choice("correction", CORRECTIONS)
        choice("is_cap_mode", ("truncate", "mask"))
        number("lr", 0.0, open_lo=True)
        number("value_lr", 0.0, open_lo=True, optional=True)
        number("weight_decay", 0.0)
        number("grad_clip", 0.0, open_lo=True, optional=True)
        number("clip_low", 0.0, 1.0)
        number("clip_high", 0.0, optional=True)
        number("adv_eps", 0.0, open_lo=True)
        number("is_cap", 0.0, open_lo=True)
        number("sao_eps_low", 0.0, 1.0)
        number("sao_eps_high", 0.0)
        number("gamma", 0.0, 1.0)
        number("lam", 0.0, 1.0)
        number("value_coef", 0.0)
        number("value_clip", 0.0, open_lo=True, optional=True)
        number("entropy_coef", 0.0)
        number("temperature", 0.0, open_lo=True)
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2
                and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in self.betas)):
            raise ConfigError("betas", f"expected two numbers in [0, 1), got {self.betas!r}")
        if not isinstance(self.norm_adv_by_std, bool):
            raise ConfigError("norm_adv_by_std", f"expected true or false, got {self.norm_adv_by_std!r}")
        for name, lo in (("pad_id", 0), ("ppo_epochs", 1), ("ppo_minibatches", 1), ("critic_warmup", 0),
                         ("micro_tokens", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(name, f"expected an integer >= {lo}, got {v!r}")
        number("kl_coef", 0.0)
        if self.critic_warmup and self.algorithm != "sao":
            raise ConfigError("critic_warmup", f"only algorithm 'sao' has a critic to warm up; got "
                                               f"{self.critic_warmup} with algorithm {self.algorithm!r} (use 0)")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "") -> "TrainerConfig":
        """Build from a mapping (a recipe's `trainer:` section). Unknown keys are errors."""
        pre = f"{where}." if where else ""
        if not isinstance(data, Mapping):
            raise ConfigError(where or "trainer", f"expected a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise ConfigError(f"{pre}{key}", f"unknown key; accepted keys are {', '.join(sorted(known))}")
        values = dict(data)
        if "betas" in values and isinstance(values["betas"], list):
            values["betas"] = tuple(values["betas"])
        try:
            return cls(**values)
        except ConfigError as e:
            raise ConfigError(f"{pre}{e.field}", str(e).split(": ", 1)[1]) from None


def minibatch_bounds(n: int, m: int) -> list[int]:
    """The PPO minibatch boundaries of a batch of `n` groups split into `m` consecutive chunks:
    minibatch i is groups bounds[i] .. bounds[i+1] - 1 (in arrival order, or by data-parallel
    position)."""
    return [round(i * n / m) for i in range(m + 1)]


def minibatch_of(position: int, n: int, m: int) -> int:
    """The minibatch of the group at `position` in a batch of `n` groups split into `m` chunks."""
    m = max(1, min(m, n))
    bounds = minibatch_bounds(n, m)
    for i in range(m):
        if position < bounds[i + 1]:
            return i
    return m - 1


def default_logits_fn(model: nn.Module, input_ids: Tensor) -> Tensor:
    """`model(input_ids)` -> logits `[B, L, V]`; accepts a bare tensor, `(logits, past)` or an
    object with `.logits` (a transformers `CausalLMOutput`)."""
    out = model(input_ids)
    if isinstance(out, (tuple, list)):
        out = out[0]
    if hasattr(out, "logits"):
        out = out.logits
    return out


def _get(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        if name not in obj:
            raise ValueError(f"trajectory.{name}: missing")
        return obj[name]
    if not hasattr(obj, name):
        raise ValueError(f"trajectory.{name}: missing on {type(obj).__name__}")
    return getattr(obj, name)


def _as_trajectories(group: Any) -> list[Trajectory]:
    """A group is a sequence of trajectories (dataclass, any object with the fields, or mapping),
    or an object whose `.trajectories` is one."""
    items = getattr(group, "trajectories", group)
    if isinstance(items, Mapping) or not isinstance(items, Iterable):
        raise ValueError(f"group: expected a sequence of trajectories, got {type(group).__name__}")
    out = []
    for i, t in enumerate(items):
        if isinstance(t, Trajectory):
            out.append(t)
            continue
        try:
            out.append(Trajectory(**{f.name: _get(t, f.name) for f in dataclasses.fields(Trajectory)}))
        except ValueError as e:
            raise ValueError(f"group[{i}].{str(e).split('.', 1)[1]}") from None
    if not out:
        raise ValueError("group: expected at least one trajectory, got none")
    return out


@dataclass
class _Batch:
    """Right-padded tensors for a list of trajectories."""

    input_ids: Tensor  # [N, L] prompt + response, padded
    positions: Tensor  # [N, T] index into L of the logits that predict response token t
    response: Tensor  # [N, T] response ids (pad where mask = 0)
    mask: Tensor  # [N, T] float 0/1
    rollout_logp: Tensor  # [N, T]
    rewards: Tensor  # [N]
    versions: Tensor  # [N] long


class Trainer:
    """Streaming GRPO / SAO trainer for a causal LM `policy` (see the module docstring).

    Args:
      policy: the model to train. Its forward is adapted by `logits_fn(policy, input_ids)`.
      config: `TrainerConfig`.
      value_head: for SAO, a callable `value_head(input_ids) -> [B, L]` (or `[B, L, 1]`) giving
        V of the state ending at each position. If it is an `nn.Module`, its parameters that are
        not also the policy's are trained by their own AdamW group.
      logits_fn: `(model, input_ids) -> logits [B, L, V]`; default `default_logits_fn`.
      version: the version the policy's current weights are (0 at the start of training).
    """

    def __init__(
        self,
        policy: nn.Module,
        config: TrainerConfig | None = None,
        *,
        value_head: Callable[[Tensor], Tensor] | None = None,
        logits_fn: Callable[[nn.Module, Tensor], Tensor] | None = None,
        version: int = 0,
    ) -> None:
        self.config = config or TrainerConfig()
        if self.config.algorithm == "sao" and value_head is None:
            raise ConfigError(
                "value_head", "algorithm 'sao' needs a value head (a callable input_ids -> [B, L] values)"
            )
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version: expected an integer >= 0, got {version!r}")
        self.policy = policy
        self.value_head = value_head
        self.logits_fn = logits_fn or default_logits_fn
        self.version = version
        self.policy_params = [p for p in policy.parameters() if p.requires_grad]
        if not self.policy_params:
            raise ValueError("policy: has no trainable parameters")
        seen = {id(p) for p in self.policy_params}
        self.value_params = []
        if isinstance(value_head, nn.Module):
            self.value_params = [p for p in value_head.parameters() if p.requires_grad and id(p) not in seen]
        c = self.config
        groups = [{"params": self.policy_params, "lr": c.lr}]
        if self.value_params:
            groups.append({"params": self.value_params, "lr": c.value_lr or c.lr})
        self.optimizer = torch.optim.AdamW(groups, lr=c.lr, betas=tuple(c.betas), weight_decay=c.weight_decay)
        self.device = self.policy_params[0].device
        # Wall seconds computing and in collectives since construction (to share a batch by speed).
        self.compute_s = 0.0
        self.comm_s = 0.0
        self.ref_policy: nn.Module | None = None
        if c.kl_coef > 0:
            import copy

            self.ref_policy = copy.deepcopy(policy)
            for p in self.ref_policy.parameters():
                p.requires_grad_(False)
        self._reset_step()

    @property
    def _world(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def _merge_ranks(self) -> None:
        """Data parallel: every rank streamed its own share; after this every rank holds the whole
        batch's bookkeeping, so the step is the same on every rank (gradients summed in `_apply`)."""
        import torch.distributed as dist

        mine = (self._groups, self._units_total, self._tokens, self._rewards, self._staleness, self._sums,
                self._positions)
        parts: list = [None] * dist.get_world_size()
        t0 = time.perf_counter()
        dist.all_gather_object(parts, mine)
        self.comm_s += time.perf_counter() - t0
        positions = [x for p in parts for x in p[6]]
        if positions and (sorted(positions) != list(range(sum(p[0] for p in parts)))
                          or any(p[0] and not p[6] for p in parts)):
            raise ValueError(f"data parallel: the groups' positions must be 0..n-1 over all ranks, got "
                             f"{sorted(positions)}")
        self._batch_groups = sum(p[0] for p in parts) if positions else None
        self._groups = sum(p[0] for p in parts)
        self._units_total = sum(p[1] for p in parts)
        self._tokens = sum(p[2] for p in parts)
        self._rewards = [r for p in parts for r in p[3]]
        self._staleness = [x for p in parts for x in p[4]]
        sums: dict[str, float] = {}
        for p in parts:
            for k, v in p[5].items():
                sums[k] = sums.get(k, 0.0) + v
        self._sums = sums

    def _allreduce(self, units: float) -> float:
        """Sum the gradients (and the divisor) over data-parallel ranks; returns the total divisor.

        A parameter with no gradient on any rank keeps none, as on a single trainer, so AdamW
        skips it (a summed zero gradient would move it by weight decay)."""
        import torch.distributed as dist

        params = self.policy_params + self.value_params
        dtype = params[0].dtype
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                         + [torch.tensor([float(p.grad is not None) for p in params], dtype=dtype, device=self.device),
                            torch.tensor([units], dtype=dtype, device=self.device)])
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        self.comm_s += time.perf_counter() - t0
        has_grad = flat[-1 - len(params):-1].tolist()
        off = 0
        for p, has in zip(params, has_grad):
            n = p.numel()
            p.grad = flat[off:off + n].view_as(p).clone() if has > 0 else None
            off += n
        return float(flat[-1])

    @property
    def updates_per_step(self) -> int:
        """Optimizer steps per batch (PPO's inner loop): ppo_epochs x ppo_minibatches."""
        return self.config.ppo_epochs * self.config.ppo_minibatches

    # ------------------------------------------------------------------ streaming API
    @property
    def pending_groups(self) -> int:
        """Groups added since the last `finish_step`."""
        return self._groups

    def add_group(self, group: Any, position: int | None = None) -> dict[str, float]:
        """Forward and backward one complete group now; gradients accumulate until `finish_step`.

        `position`: data parallel, the group's place in the whole batch (0, 1, ... over every
        rank), which decides its PPO minibatch (`_inner_loop`); every group of a step gives one, or
        none does. Returns the group's own metrics (per-token means).
        """
        t_start = time.perf_counter()
        if position is not None and (isinstance(position, bool) or not isinstance(position, int) or position < 0):
            raise ValueError(f"position: expected an integer >= 0 or None, got {position!r}")
        if self._groups and (position is None) != (not self._positions):
            raise ValueError("position: give one for every group of a step or for none")
        trajectories = _as_trajectories(group)
        meta = self._collate(trajectories, meta_only=True)  # validates; rewards, versions
        seq_adv = self._group_advantages(meta)
        units = 0.0
        tokens = 0.0
        part_sums: dict[str, float] = {}
        rows: list[Any] = [None] * len(trajectories)  # per row: pi_prox log-probs, old values, reference
        for idx in self._micro_split(trajectories):
            batch = self._collate([trajectories[i] for i in idx])
            adv = seq_adv[idx] if seq_adv is not None else None
            if self.updates_per_step == 1:
                loss, m, _ = self._loss(batch, adv, denom=1.0)
                loss.backward()
            else:  # the pre-update pass: pi_prox (and the critic's old values, the reference's log-probs)
                with torch.no_grad():
                    _, m, aux = self._loss(batch, adv, denom=1.0)
                lengths = batch.mask.sum(dim=1).long().tolist()
                for j, (i, k) in enumerate(zip(idx, lengths)):
                    rows[i] = tuple(None if aux.get(key) is None else aux[key][j, :k]
                                    for key in ("logp", "values", "ref"))
            t = float(batch.mask.sum())
            units += self._units(batch.mask)
            tokens += t
            for k, v in m.items():
                part_sums[k] = part_sums.get(k, 0.0) + (v if k in _SUM_METRICS else v * t)
        if self.updates_per_step > 1:
            self._stored.append((trajectories, seq_adv, rows, units))
        if position is not None:
            self._positions.append(position)
        # Bookkeeping in "sum" form so that the step's metrics are batch means.
        self._groups += 1
        self._units_total += units
        self._tokens += tokens
        self._rewards.extend(float(r) for r in meta.rewards)
        self._staleness.extend(self.version - int(v) for v in meta.versions)
        for k, v in part_sums.items():
            self._sums[k] = self._sums.get(k, 0.0) + v
        out = {k: (v / max(units, 1.0) if k in _SUM_METRICS else v / max(tokens, 1.0)) for k, v in part_sums.items()}
        out["loss"] = out.pop("total_loss")
        self.compute_s += time.perf_counter() - t_start
        return {**out, "tokens": tokens, "reward_mean": float(meta.rewards.mean())}

    def _micro_split(self, trajectories: Sequence[Trajectory]) -> list[list[int]]:
        """Row indices of the forward passes over `trajectories`: all in one, or (micro_tokens > 0)
        sorted by length into micro-batches of at most micro_tokens padded tokens each."""
        n = len(trajectories)
        budget = self.config.micro_tokens
        if budget <= 0 or n <= 1:
            return [list(range(n))]
        lens = [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]
        parts: list[list[int]] = []
        cur: list[int] = []
        for i in sorted(range(n), key=lens.__getitem__):  # ascending: the newest row is the longest
            if cur and (len(cur) + 1) * lens[i] > budget:
                parts.append(cur)
                cur = []
            cur.append(i)
        parts.append(cur)
        return parts

    def batch_gradients(self) -> dict[str, Tensor]:
        """The batch-mean gradient accumulated so far (what `finish_step` applies, before clipping).

        Keys are `policy.<name>` and `value.<name>`; a parameter without gradient gets zeros.
        """
        d = max(self._units_total, 1.0)
        out = {}
        named = [("policy", self.policy)] + ([("value", self.value_head)] if self.value_params else [])
        value_ids = {id(p) for p in self.value_params}
        for prefix, module in named:
            for name, p in module.named_parameters():
                if prefix == "value" and id(p) not in value_ids:
                    continue
                if p.requires_grad:
                    out[f"{prefix}.{name}"] = (p.grad / d) if p.grad is not None else torch.zeros_like(p)
        return out

    def finish_step(self, step: int) -> dict[str, float]:
        """Optimizer step on the groups added since the last step; the policy becomes version step+1.

        `step` must equal the current version (step k consumes a batch and publishes k + 1).
        Returns the step's metrics: loss, pg_loss, pg_clipfrac, masked_frac (SAO), is_weight_mean
        and is_truncated_frac (corrections), value_loss (SAO), entropy, reward_mean, grad_norm
        (policy, before clipping), value_grad_norm (SAO), tokens, groups, trajectories,
        batch_staleness_mean, batch_staleness_max, version (the new one).
        """
        if step != self.version:
            raise ValueError(f"step: expected {self.version} (the current version), got {step}")
        if self._world > 1:
            self._merge_ranks()
        elif self._positions:
            if sorted(self._positions) != list(range(self._groups)):
                raise ValueError(f"position: expected the groups' positions to be 0..{self._groups - 1}, got "
                                 f"{sorted(self._positions)}")
            self._batch_groups = self._groups
        if self._groups == 0:
            raise ValueError(f"step {step}: no group was added; call add_group before finish_step")
        if self.updates_per_step == 1:
            grad_norm, value_grad_norm = self._apply(self._units_total, merged=True)
            update_metrics: dict[str, float] = {}
        else:
            grad_norm, value_grad_norm, update_metrics = self._inner_loop()
        self.version += 1
        d = max(self._units_total, 1.0)
        tokens = max(self._tokens, 1.0)
        metrics = {k: (v / d if k in _SUM_METRICS else v / tokens) for k, v in self._sums.items()}
        metrics["loss"] = metrics.pop("total_loss")
        metrics.update(update_metrics)  # ratios and clipping as the updates saw them
        metrics.update(
            reward_mean=sum(self._rewards) / len(self._rewards),
            grad_norm=grad_norm,
            tokens=self._tokens,
            groups=float(self._groups),
            trajectories=float(len(self._rewards)),
            batch_staleness_mean=sum(self._staleness) / len(self._staleness),
            batch_staleness_max=float(max(self._staleness)),
            version=float(self.version),
        )
        if self.value_params:
            metrics["value_grad_norm"] = value_grad_norm
        self._reset_step()
        return metrics

    def _apply(self, units: float, merged: bool = False) -> tuple[float, float]:
        """One optimizer step on the accumulated gradient sum divided by `units` (this rank's part
        of the divisor unless `merged`); returns the policy's and the value head's gradient norms
        before clipping. Data parallel: gradients and divisor are summed over ranks first."""
        if self._world > 1:
            total = self._allreduce(0.0 if merged else units)
            units = units if merged else total
        units = max(units, 1.0)
        for p in self.policy_params + self.value_params:
            if p.grad is not None:
                p.grad.div_(units)
        clip = self.config.grad_clip if self.config.grad_clip is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.policy_params, clip))
        value_grad_norm = float(torch.nn.utils.clip_grad_norm_(self.value_params, clip)) if self.value_params else 0.0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, value_grad_norm

    def _inner_loop(self) -> tuple[float, float, dict[str, float]]:
        """PPO's inner loop over the stored groups: `ppo_epochs` passes, each one optimizer step per
        chunk of `ppo_minibatches` consecutive chunks. Returns mean gradient norms and the
        token-weighted means of the per-update ratio metrics."""
        c = self.config
        items = self._stored
        if self._batch_groups is not None:
            # Data parallel with positions: minibatch i is the groups at positions bounds[i] ..
            # bounds[i+1] - 1 of the whole batch, the single trainer's i-th chunk.
            n = self._batch_groups
            m = min(c.ppo_minibatches, n)
            bounds = minibatch_bounds(n, m)
            chunks = [[it for it, pos in zip(items, self._positions) if bounds[i] <= pos < bounds[i + 1]]
                      for i in range(m)]
        else:
            # Every data-parallel rank takes the same number of optimizer steps (some chunks may be empty).
            m = c.ppo_minibatches if self._world > 1 else min(c.ppo_minibatches, len(items))
            bounds = minibatch_bounds(len(items), m)
            chunks = [items[bounds[i]:bounds[i + 1]] for i in range(m)]
        norms, vnorms = [], []
        sums: dict[str, float] = {}
        weight = 0.0
        for _ in range(c.ppo_epochs):
            for chunk in chunks:
                rows = [(t, None if adv is None else adv[i], aux[i])
                        for trajectories, adv, aux, _ in chunk for i, t in enumerate(trajectories)]
                trajs = [r[0] for r in rows]
                if c.micro_tokens > 0:
                    parts = self._micro_split(trajs) if rows else []
                else:  # one forward per group, as documented (not the whole chunk padded at once)
                    sizes = [len(trajectories) for trajectories, *_ in chunk]
                    starts = [sum(sizes[:g]) for g in range(len(sizes))]
                    parts = [list(range(a, a + n)) for a, n in zip(starts, sizes)]
                for idx in parts:
                    t_fwd = time.perf_counter()
                    batch = self._collate([trajs[i] for i in idx])
                    seq_adv = torch.stack([rows[i][1] for i in idx]) if c.algorithm == "grpo" else None
                    T = batch.mask.shape[1]
                    pre = {key: (None if rows[idx[0]][2][n] is None else
                                 torch.stack([torch.nn.functional.pad(rows[i][2][n], (0, T - rows[i][2][n].shape[0]))
                                              for i in idx]))
                           for n, key in enumerate(("logp", "values", "ref"))}
                    loss, metrics, _ = self._loss(batch, seq_adv, denom=1.0, pre=pre)
                    loss.backward()
                    tokens = float(batch.mask.sum())
                    weight += tokens
                    for k in _UPDATE_METRICS & metrics.keys():
                        sums[k] = sums.get(k, 0.0) + metrics[k] * tokens
                    self.compute_s += time.perf_counter() - t_fwd
                g, v = self._apply(sum(u for *_, u in chunk))
                norms.append(g)
                vnorms.append(v)
        if self._world > 1:
            import torch.distributed as dist

            parts: list = [None] * dist.get_world_size()
            t0 = time.perf_counter()
            dist.all_gather_object(parts, (weight, sums))
            self.comm_s += time.perf_counter() - t0
            weight = sum(p[0] for p in parts)
            keys = set().union(*(p[1] for p in parts))
            sums = {k: sum(p[1].get(k, 0.0) for p in parts) for k in keys}
        out = {k: v / max(weight, 1.0) for k, v in sums.items()}
        out["updates"] = float(len(norms))
        return sum(norms) / len(norms), sum(vnorms) / len(vnorms), out

    def train_batch(self, step: int, groups: Iterable[Any]) -> dict[str, float]:
        """`add_group` for each group, then `finish_step(step)`."""
        for g in groups:
            self.add_group(g)
        return self.finish_step(step)

    @torch.no_grad()
    def publish(self) -> dict[str, Tensor]:
        """A copy of the policy's weights (the current version's state_dict), safe to hand to engines
        while training continues."""
        return {k: v.detach().clone() for k, v in self.policy.state_dict().items()}

    # ------------------------------------------------------------------ reference path
    def batch_loss(self, groups: Iterable[Any]) -> tuple[Tensor, dict[str, float]]:
        """The whole batch at once: one padded forward, the losses' own batch means.

        It does not touch the accumulated gradients or the optimizer; call `.backward()` yourself.
        The reference the streaming path is tested against.
        """
        all_traj: list[Trajectory] = []
        adv_parts = []
        for g in groups:
            trajectories = _as_trajectories(g)
            adv_parts.append(self._group_advantages(self._collate(trajectories, meta_only=True)))
            all_traj.extend(trajectories)
        if not all_traj:
            raise ValueError("groups: expected at least one group, got none")
        batch = self._collate(all_traj)
        seq_adv = torch.cat(adv_parts) if self.config.algorithm == "grpo" else None
        loss, metrics, _ = self._loss(batch, seq_adv, denom=None)
        metrics["loss"] = metrics.pop("total_loss")
        return loss, metrics

    # ------------------------------------------------------------------ internals
    def _reset_step(self) -> None:
        self._groups = 0
        self._units_total = 0.0
        self._tokens = 0.0
        self._rewards: list[float] = []
        self._staleness: list[int] = []
        self._sums: dict[str, float] = {}
        self._stored: list[tuple] = []  # (batch, advantages, pre-update pass, units) when updates_per_step > 1
        self._positions: list[int] = []  # data parallel: each added group's place in the whole batch
        self._batch_groups: int | None = None  # data parallel with positions: the whole batch's groups

    def _units(self, mask: Tensor) -> float:
        """The batch-mean divisor this part of the batch contributes: tokens, or sequences with a token."""
        if self.config.loss_agg_mode == "token-mean":
            return float(mask.sum())
        return float((mask.sum(dim=1) > 0).sum())

    def _collate(self, trajectories: list[Trajectory], *, meta_only: bool = False) -> _Batch:
        rows = []
        for i, t in enumerate(trajectories):
            prompt, response, logps = list(t.prompt_ids), list(t.response_ids), list(t.rollout_logprobs)
            if len(prompt) < 1:
                raise ValueError(f"trajectory[{i}].prompt_ids: expected at least one token")
            if len(logps) != len(response):
                raise ValueError(
                    f"trajectory[{i}].rollout_logprobs: expected one per response token "
                    f"({len(response)}), got {len(logps)}"
                )
            if isinstance(t.version, bool) or not isinstance(t.version, int) or t.version < 0:
                raise ValueError(f"trajectory[{i}].version: expected an integer >= 0, got {t.version!r}")
            if t.version > self.version:
                raise ValueError(
                    f"trajectory[{i}].version: {t.version} is newer than the trainer's version {self.version}"
                )
            if not math.isfinite(float(t.reward)):
                raise ValueError(f"trajectory[{i}].reward: expected a finite number, got {t.reward!r}")
            rows.append((prompt, response, logps))
        n = len(rows)
        rewards = torch.tensor([float(t.reward) for t in trajectories], device=self.device)
        versions = torch.tensor([t.version for t in trajectories], dtype=torch.long, device=self.device)
        if meta_only:
            empty = torch.zeros(n, 0, device=self.device)
            return _Batch(empty.long(), empty.long(), empty.long(), empty, empty, rewards, versions)
        L = max(len(p) + len(r) for p, r, _ in rows)
        T = max(max(len(r) for _, r, _ in rows), 1)
        pad = self.config.pad_id
        input_ids = torch.full((n, L), pad, dtype=torch.long)
        positions = torch.zeros((n, T), dtype=torch.long)
        response = torch.full((n, T), pad, dtype=torch.long)
        mask = torch.zeros((n, T))
        rollout_logp = torch.zeros((n, T))
        for b, (p, r, lp) in enumerate(rows):
            seq = p + r
            input_ids[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            k = len(r)
            if k:
                # Logits at position j predict token j + 1: response token t sits at len(p) + t.
                positions[b, :k] = torch.arange(len(p) - 1, len(p) - 1 + k)
                response[b, :k] = torch.tensor(r, dtype=torch.long)
                mask[b, :k] = 1.0
                rollout_logp[b, :k] = torch.tensor(lp, dtype=torch.float32)
        to = lambda x: x.to(self.device)  # noqa: E731
        return _Batch(to(input_ids), to(positions), to(response), to(mask), to(rollout_logp), rewards, versions)

    def _group_advantages(self, batch: _Batch) -> Tensor | None:
        """GRPO: one advantage per trajectory, from its group. SAO: None (GAE needs the values)."""
        if self.config.algorithm != "grpo":
            return None
        if batch.rewards.shape[0] < 2:
            raise ValueError(
                f"group: algorithm 'grpo' needs >= 2 trajectories per group, got {batch.rewards.shape[0]} "
                "(use algorithm 'sao' with a value head for single rollouts)"
            )
        return grpo_advantages(
            batch.rewards[None, :], norm_by_std=self.config.norm_adv_by_std, eps=self.config.adv_eps
        )[0]

    def _loss(self, batch: _Batch, seq_adv: Tensor | None, denom: float | None,
              pre: dict[str, Tensor | None] | None = None) -> tuple[Tensor, dict[str, float], dict[str, Tensor | None]]:
        """(loss, metrics, aux). `pre` is the pre-update pass's `aux` (pi_prox log-probs `logp`, the
        critic's `values`, the reference's `ref`); without it this forward is the pre-update pass."""
        c = self.config
        logits = self.logits_fn(self.policy, batch.input_ids)
        if logits.dim() != 3 or logits.shape[:2] != batch.input_ids.shape:
            raise ValueError(
                f"logits_fn: expected logits of shape [{batch.input_ids.shape[0]}, {batch.input_ids.shape[1]}, V], "
                f"got {tuple(logits.shape)}"
            )
        resp_logits, logp = self._response_logp(logits, batch)
        prox = pre["logp"] if pre is not None else logp.detach()
        mask = batch.mask
        kw = dict(loss_agg_mode=c.loss_agg_mode, denom=denom)
        metrics: dict[str, float] = {}
        values_old = None
        ent_keep = mask  # the tokens the entropy bonus acts on (SAO: those its mask keeps)

        if c.algorithm == "grpo":
            assert seq_adv is not None
            if c.correction == "none":
                pg, m = ppo_policy_loss(logp, batch.rollout_logp, seq_adv, mask,
                                        clip_low=c.clip_low, clip_high=c.clip_high, **kw)
            elif c.correction == "tis":
                pg, m = tis_ppo_loss(logp, prox, batch.rollout_logp, seq_adv, mask, cap=c.is_cap,
                                     clip_low=c.clip_low, clip_high=c.clip_high, **kw)
            elif c.correction == "decoupled":
                pg, m = decoupled_ppo_loss(logp, prox, batch.rollout_logp, seq_adv, mask, cap=c.is_cap,
                                           cap_mode=c.is_cap_mode, clip_low=c.clip_low,
                                           clip_high=c.clip_high, **kw)
            else:  # "sao": the double-side mask on pi_theta / pi_behav, no clip
                pg, m = sao_policy_loss(logp, batch.rollout_logp, seq_adv, mask,
                                        eps_low=c.sao_eps_low, eps_high=c.sao_eps_high, **kw)
                ent_keep = self._sao_keep(logp, batch)
            total = pg
            metrics.update(m)
        else:
            assert self.value_head is not None
            values = self.value_head(batch.input_ids)
            if values.dim() == 3 and values.shape[-1] == 1:
                values = values.squeeze(-1)
            if values.shape != batch.input_ids.shape:
                raise ValueError(
                    f"value_head: expected values of shape {tuple(batch.input_ids.shape)} (or [..., 1]), "
                    f"got {tuple(values.shape)}"
                )
            values = values.gather(1, batch.positions).float()  # V of the state before token t
            values_old = pre["values"] if pre is not None else values.detach()
            adv, returns = gae(token_rewards(batch.rewards, mask), values_old, mask, c.gamma, c.lam)
            pg, m = sao_policy_loss(logp, batch.rollout_logp, adv, mask,
                                    eps_low=c.sao_eps_low, eps_high=c.sao_eps_high, **kw)
            ent_keep = self._sao_keep(logp, batch)
            # Old values: the pre-update pass's, so the clip bounds the whole step's move.
            vf, vm = value_loss(values, values_old, returns, mask, c.value_clip, **kw)
            warming = self.version < c.critic_warmup
            total = c.value_coef * vf if warming else pg + c.value_coef * vf
            metrics.update(m)
            metrics.update(vm)
            metrics["advantage_mean"] = float((adv * mask).sum() / mask.sum().clamp(min=1.0))
            metrics["critic_warmup"] = float(warming)

        policy_moves = not (c.algorithm == "sao" and self.version < c.critic_warmup)
        ref = None
        if self.ref_policy is not None:
            if pre is not None and pre.get("ref") is not None:
                ref = pre["ref"]
            else:
                with torch.no_grad():
                    ref = self._response_logp(self.logits_fn(self.ref_policy, batch.input_ids), batch)[1]
            kl_tok = kl_penalty(logp, ref, "k3")
            if policy_moves:
                total = total + c.kl_coef * agg_loss(kl_tok, mask, c.loss_agg_mode, denom)
            metrics["kl_ref"] = float((kl_tok.detach() * mask).sum() / mask.sum().clamp(min=1.0))

        ent_tok = entropy_from_logits(resp_logits if c.entropy_coef > 0 else resp_logits.detach())
        if c.entropy_coef > 0 and policy_moves:
            ent = agg_loss(ent_tok * ent_keep, mask, c.loss_agg_mode, denom)
            total = total - c.entropy_coef * ent
        metrics["entropy"] = float((ent_tok.detach() * mask).sum() / mask.sum().clamp(min=1.0))
        metrics["total_loss"] = float(total.detach())
        return total, metrics, {"logp": logp.detach(), "values": values_old, "ref": ref}

    def _sao_keep(self, logp: Tensor, batch: _Batch) -> Tensor:
        """SAO's keep-mask of this forward's tokens (pi_theta / pi_rollout inside the band). The
        entropy bonus acts on these tokens only: on a dropped token it would be the only force,
        pushing the policy towards uniform."""
        c = self.config
        ratio = torch.exp((logp.detach() - batch.rollout_logp).clamp(max=20.0))
        return double_side_mask(ratio, batch.mask, c.sao_eps_low, c.sao_eps_high)

    def _response_logp(self, logits: Tensor, batch: _Batch) -> tuple[Tensor, Tensor]:
        """(temperature-scaled response logits [N, T, V], log-probs of the response tokens [N, T])."""
        idx = batch.positions[:, :, None].expand(-1, -1, logits.shape[-1])
        resp_logits = logits.gather(1, idx).float() / self.config.temperature
        logp = torch.log_softmax(resp_logits, dim=-1).gather(2, batch.response[:, :, None]).squeeze(2)
        return resp_logits, logp


#: Metrics that are sums over the batch divisor (losses); the others are per-token means.
_SUM_METRICS = frozenset({"pg_loss", "value_loss", "total_loss"})
#: Per-token metrics that the inner loop's updates report instead of the pre-update pass.
_UPDATE_METRICS = frozenset({"pg_clipfrac", "ratio_mean", "is_weight_mean", "is_truncated_frac", "masked_frac"})
