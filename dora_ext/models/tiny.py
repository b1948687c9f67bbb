"""A small causal transformer with an incremental-decoding KV cache, readable in one sitting.

`TinyConfig.arch` picks one of two flavours on one code path: ``"gpt"`` (nanoGPT: LayerNorm,
learned positions, GELU; the CPU recipes' policy) or ``"llama"`` (RMSNorm, rotary, SwiGLU,
grouped-query attention; runs SmolLM2-135M's converted weights, `dora_ext.models.smollm2`).

``past_kv`` / ``new_kv`` is either a tuple of per-layer ``(k, v)`` ``[B, n_kv_head, T, head_dim]``
(equal lengths; ``forward`` returns longer tuples) or a `SlotKV`, the engine's preallocated
per-sequence slots written in place, so joining or leaving the batch copies no other cache.
No global state: several models may run in one process, in different threads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn as nn
import torch.nn.functional as F

ARCHS = ("gpt", "llama")


@dataclass(frozen=True)
class TinyConfig:
    """Model shape. `seed` fixes the initial weights (version 0). `n_kv_head` (llama) defaults to
    `n_head`, `d_ff` to 4 * d_model; `value_head` adds the scalar head of value-based algorithms."""

    vocab_size: int = 64
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    max_len: int = 256
    seed: int = 0
    value_head: bool = False
    arch: str = "gpt"
    n_kv_head: int | None = None
    d_ff: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise ValueError(f"TinyConfig.{name}: {what}, got {getattr(self, name)!r}")

        for name in ("vocab_size", "d_model", "n_layer", "n_head", "max_len"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, name, "an integer >= 1")
        need(self.arch in ARCHS, "arch", f"one of {ARCHS}")
        need(self.d_model % self.n_head == 0, "d_model", f"a multiple of n_head={self.n_head}")
        need(self.n_head % self.kv_heads == 0, "n_kv_head", f"a divisor of n_head={self.n_head}")
        need(self.arch == "llama" or self.kv_heads == self.n_head, "n_kv_head", "equal to n_head for arch 'gpt'")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


class SlotKV:
    """Preallocated KV cache: `capacity` slots of up to `max_len` positions, per layer.

    `bind` maps input row `b` to slot `start + b`, which holds `lengths[b]` positions; the forward
    appends and attends over `[0, lengths[b] + t]`. Only contiguous slots are read, hence the
    engine's slots `0..n-1`."""

    def __init__(self, config: TinyConfig, capacity: int, device: torch.device | str, dtype: torch.dtype):
        shape = (capacity, config.kv_heads, config.max_len, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.capacity = capacity
        self.max_len = config.max_len
        self.device = torch.device(device)
        self.start, self.max_past = 0, 0
        self.lengths = torch.zeros(0, dtype=torch.long, device=device)

    def bind(self, start: int, lengths: list[int]) -> "SlotKV":
        """Point the next forward pass at slots `start..start+len(lengths)-1`. Lengths come as
        Python ints so that no device value is read back during the pass (no CUDA syncs)."""
        if start < 0 or start + len(lengths) > self.capacity:
            raise ValueError(f"SlotKV.bind: slots {start}..{start + len(lengths) - 1} outside capacity {self.capacity}")
        self.start, self.max_past = start, max(lengths)
        self.lengths = torch.tensor(lengths, dtype=torch.long, device=self.device)
        return self

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `[B, H, Tq, D]` new keys/values after each row's cached ones; return the views to attend."""
        B, _, Tq, _ = k_new.shape
        s0, kb, vb = self.start, self.k[layer], self.v[layer]
        if Tq == 1:
            rows = torch.arange(s0, s0 + B, device=kb.device)
            kb[rows, :, self.lengths] = k_new[:, :, 0]
            vb[rows, :, self.lengths] = v_new[:, :, 0]
        else:
            if B != 1 and bool((self.lengths != self.max_past).any()):
                raise ValueError("SlotKV: a multi-token (prefill) pass over several rows needs equal cached lengths")
            start = self.max_past
            kb[s0 : s0 + B, :, start : start + Tq] = k_new
            vb[s0 : s0 + B, :, start : start + Tq] = v_new
        total = self.max_past + Tq
        return kb[s0 : s0 + B, :, :total], vb[s0 : s0 + B, :, :total]

    def read(self, slot: int, length: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Copies of one slot's first `length` positions, per layer `(k, v)` each `[H, T, D]`."""
        return tuple((k[slot, :, :length].clone(), v[slot, :, :length].clone()) for k, v in zip(self.k, self.v))

    def write(self, slot: int, kv: tuple[tuple[torch.Tensor, torch.Tensor], ...]) -> None:
        """Fill a slot from `read`'s format (used by same-version migration)."""
        for layer, (k, v) in enumerate(kv):
            T = k.shape[1]
            self.k[layer][slot, :, :T] = k
            self.v[layer][slot, :, :T] = v

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot `src` into slot `dst` (keeps running sequences contiguous when one leaves)."""
        for k, v in zip(self.k, self.v):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]


TupleKV = tuple[tuple[torch.Tensor, torch.Tensor], ...]
PastKV = Union[SlotKV, TupleKV, None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding in the "rotate half" layout (Llama/HF). x: [B, H, T, D], positions: [B, T]."""
    D = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D))
    ang = positions.to(torch.float32)[:, None, :, None] * inv  # [B, 1, T, D/2]
    cos, sin = torch.cat([ang, ang], -1).cos().to(x.dtype), torch.cat([ang, ang], -1).sin().to(x.dtype)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        bias = cfg.arch == "gpt"
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_head * hd, bias=bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(cfg.n_head * hd, cfg.d_model, bias=bias)

    def forward(self, x, positions, mask, layer: int, past: PastKV):
        cfg, (B, T, _) = self.cfg, x.shape
        q = self.q_proj(x).view(B, T, cfg.n_head, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        if cfg.arch == "llama":
            q, k = _rope(q, positions, cfg.rope_theta), _rope(k, positions, cfg.rope_theta)
        if isinstance(past, SlotKV):
            k_all, v_all = past.update(layer, k, v)
            new = None
        else:
            if past is not None:
                k_all, v_all = torch.cat([past[layer][0], k], 2), torch.cat([past[layer][1], v], 2)
            else:
                k_all, v_all = k, v
            new = (k_all, v_all)
        if cfg.kv_heads != cfg.n_head:
            rep = cfg.n_head // cfg.kv_heads
            k_all, v_all = k_all.repeat_interleave(rep, 1), v_all.repeat_interleave(rep, 1)
        y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1)), new


class MLP(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        d_ff = cfg.d_ff or 4 * cfg.d_model
        self.llama = cfg.arch == "llama"
        if self.llama:
            self.gate_proj = nn.Linear(cfg.d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, d_ff, bias=not self.llama)
        self.down_proj = nn.Linear(d_ff, cfg.d_model, bias=not self.llama)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.llama:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x)))


def _norm(cfg: TinyConfig) -> nn.Module:
    return RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.arch == "llama" else nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.attn_norm, self.attn = _norm(cfg), Attention(cfg)
        self.mlp_norm, self.mlp = _norm(cfg), MLP(cfg)

    def forward(self, x, positions, mask, layer, past):
        a, new = self.attn(self.attn_norm(x), positions, mask, layer, past)
        x = x + a
        return x + self.mlp(self.mlp_norm(x)), new


class TinyLM(nn.Module):
    """Causal LM: `forward(input_ids, past_kv) -> (logits, new_kv)`; optional value head."""

    def __init__(self, config: TinyConfig, init_weights: bool = True):
        super().__init__()
        self.config = cfg = config
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.arch == "gpt":
            self.pos_embed = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = _norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.value_head = nn.Linear(cfg.d_model, 1) if cfg.value_head else None
        if init_weights:
            self._init_weights(cfg.seed)

    @classmethod
    def empty(cls, config: TinyConfig, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> "TinyLM":
        """A model with uninitialised weights, to be filled by `load_state_dict` (a rollout
        engine before its first version, or a pretrained model): skips drawing random weights,
        which costs seconds at SmolLM2's size."""
        with torch.device("meta"):
            model = cls(config, init_weights=False)
        model = model.to_empty(device=device).to(dtype)
        if config.tie_embeddings:  # to_empty gives each module its own tensor; tie them again
            model.lm_head.weight = model.embed.weight
        return model

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        """nanoGPT's init (N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer)), drawn from
        a private generator so that the same seed gives the same weights whatever else ran before."""
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # norm weights
                p.fill_(1.0)
            else:
                std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    # ------------------------------------------------------------------ forward
    def hidden(self, input_ids: torch.Tensor, past_kv: PastKV = None) -> tuple[torch.Tensor, PastKV]:
        """Final normalised hidden states `[B, T, d_model]` and the updated cache."""
        B, T = input_ids.shape
        dev = input_ids.device
        if isinstance(past_kv, SlotKV):
            past_len, max_past = past_kv.lengths.to(dev), past_kv.max_past
        else:
            max_past = past_kv[0][0].shape[2] if past_kv is not None else 0
            past_len = torch.full((B,), max_past, dtype=torch.long, device=dev)
        total = max_past + T
        if total > self.config.max_len:
            raise ValueError(f"sequence longer than TinyConfig.max_len={self.config.max_len}")
        positions = past_len[:, None] + torch.arange(T, device=dev)[None, :]  # [B, T]
        # query t of row b sees keys 0..past_len[b]+t (causal, and nothing past its own length)
        mask = torch.arange(total, device=dev)[None, None, :] <= positions[:, :, None]  # [B, T, total]
        x = self.embed(input_ids)
        if self.config.arch == "gpt":
            x = x + self.pos_embed(positions)
        new_layers = []
        for i, block in enumerate(self.blocks):
            x, new = block(x, positions, mask[:, None], i, past_kv)
            new_layers.append(new)
        new_kv = past_kv if isinstance(past_kv, SlotKV) else tuple(new_layers)
        return self.norm(x), new_kv

    def forward(self, input_ids: torch.Tensor, past_kv: PastKV = None) -> tuple[torch.Tensor, PastKV]:
        """Logits `[B, T, vocab]` for every input position, and the cache extended by `input_ids`.

        Without a cache this is an ordinary full causal pass (what the trainer uses; right-padding
        is harmless because no position attends forward).
        """
        h, new_kv = self.hidden(input_ids, past_kv)
        return self.lm_head(h), new_kv

    def logits_and_values(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One full pass giving logits `[B, T, V]` and values `[B, T]` (needs `value_head=True`)."""
        if self.value_head is None:
            raise ValueError("TinyConfig.value_head: this model was built without a value head")
        h, _ = self.hidden(input_ids)
        return self.lm_head(h), self.value_head(h).squeeze(-1)

    def values(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Scalar value estimate per position `[B, T]` (for GAE)."""
        return self.logits_and_values(input_ids)[1]


def policy_state(model: nn.Module, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Detached copies of the weights a rollout engine needs (value head left out): what a trainer
    publishes as a version. Copies, so later optimizer steps cannot change a published version."""
    return {k: v.detach().to(device, copy=True) for k, v in model.state_dict().items()
            if not k.startswith("value_head.")}
