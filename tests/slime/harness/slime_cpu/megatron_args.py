"""STAND-IN for Megatron-LM's argument parser (`megatron.training.arguments`).

slime's `parse_args` (slime/utils/arguments.py) runs for real; it hands its own arguments to
Megatron-LM's parser as `extra_args_provider` and validates the result with Megatron-LM's
`validate_args`. Megatron-LM (`megatron.training`) is not on PyPI (megatron-core, which is, has
no `training` package), so this module provides `megatron.training.arguments.parse_args` with the
Megatron flags slime's loop and the recipes use, defaults as Megatron-LM has them. Flags it does
not know are collected in `UNKNOWN` (Megatron-LM's own parser, called with
`ignore_unknown_args=True`, drops them silently; the recipe test asserts there are none).
"""

from __future__ import annotations

import argparse
import sys
import types

UNKNOWN: list[str] = []

_FLAGS: list[tuple[str, dict]] = [
    ("--num-layers", dict(type=int)), ("--hidden-size", dict(type=int)), ("--ffn-hidden-size", dict(type=int)),
    ("--num-attention-heads", dict(type=int)), ("--num-query-groups", dict(type=int, default=1)),
    ("--kv-channels", dict(type=int)), ("--seq-length", dict(type=int)),
    ("--max-position-embeddings", dict(type=int)), ("--vocab-size", dict(type=int)),
    ("--padded-vocab-size", dict(type=int)), ("--make-vocab-size-divisible-by", dict(type=int, default=128)),
    ("--norm-epsilon", dict(type=float, default=1e-5)), ("--rotary-base", dict(type=int, default=10000)),
    ("--normalization", dict(default="LayerNorm")), ("--rope-type", dict(default=None)),
    ("--micro-batch-size", dict(type=int, default=1)), ("--global-batch-size", dict(type=int)),
    ("--lr", dict(type=float)), ("--min-lr", dict(type=float, default=0.0)),
    ("--lr-decay-style", dict(default="linear")), ("--lr-warmup-iters", dict(type=int, default=0)),
    ("--weight-decay", dict(type=float, default=0.01)), ("--adam-beta1", dict(type=float, default=0.9)),
    ("--adam-beta2", dict(type=float, default=0.999)), ("--adam-eps", dict(type=float, default=1e-8)),
    ("--clip-grad", dict(type=float, default=1.0)), ("--optimizer", dict(default="adam")),
    ("--seed", dict(type=int, default=1234)), ("--save", dict()), ("--load", dict()),
    ("--save-interval", dict(type=int)), ("--ckpt-step", dict(type=int)), ("--ckpt-format", dict(default="torch_dist")),
    ("--tensor-model-parallel-size", dict(type=int, default=1)),
    ("--pipeline-model-parallel-size", dict(type=int, default=1)),
    ("--context-parallel-size", dict(type=int, default=1)),
    ("--expert-model-parallel-size", dict(type=int, default=1)),
    ("--expert-tensor-parallel-size", dict(type=int, default=None)),
    ("--decoder-first-pipeline-num-layers", dict(type=int)), ("--decoder-last-pipeline-num-layers", dict(type=int)),
    ("--distributed-backend", dict(default="nccl")), ("--distributed-timeout-minutes", dict(type=int, default=10)),
    ("--tokenizer-model", dict()), ("--tokenizer-type", dict()), ("--attention-backend", dict(default="auto")),
    ("--attention-dropout", dict(type=float, default=0.1)), ("--hidden-dropout", dict(type=float, default=0.1)),
    ("--recompute-granularity", dict()), ("--recompute-method", dict()), ("--recompute-num-layers", dict(type=int)),
    ("--moe-layer-freq", dict(default=1)), ("--moe-ffn-hidden-size", dict(type=int)),
    ("--moe-shared-expert-intermediate-size", dict(type=int)), ("--moe-token-dispatcher-type", dict(default="allgather")),
    ("--moe-router-topk", dict(type=int, default=2)), ("--num-experts", dict(type=int)),
]
_SWITCHES = [
    "--swiglu", "--group-query-attention", "--use-rotary-position-embeddings", "--disable-bias-linear",
    "--qk-layernorm", "--untie-embeddings-and-output-weights", "--bf16", "--fp16", "--sequence-parallel",
    "--use-distributed-optimizer", "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32",
    "--no-load-optim", "--no-load-rng", "--no-save-optim", "--finetune", "--calculate-per-token-loss",
    "--multi-latent-attention", "--no-rope-fusion", "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
    "--use-precision-aware-optimizer", "--async-save", "--no-gradient-accumulation-fusion",
]


def parse_args(extra_args_provider=None, ignore_unknown_args: bool = False):
    parser = argparse.ArgumentParser(description="Megatron-LM arguments (CPU harness stand-in)", allow_abbrev=False)
    for flag, kw in _FLAGS:
        parser.add_argument(flag, **kw)
    for flag in _SWITCHES:
        parser.add_argument(flag, action="store_true", default=False)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    args, unknown = parser.parse_known_args()
    # --sglang-* / --router-* flags belong to slime's first parse phase (sglang's own parser).
    UNKNOWN[:] = [u for u in unknown if u.startswith("--") and not u.startswith(("--sglang-", "--router-"))]
    if UNKNOWN and not ignore_unknown_args:
        parser.error(f"unrecognized arguments: {' '.join(UNKNOWN)}")
    if args.ffn_hidden_size is None and args.hidden_size:
        args.ffn_hidden_size = 4 * args.hidden_size
    args.layernorm_epsilon = args.norm_epsilon
    args.virtual_pipeline_model_parallel_size = None
    args.data_parallel_size = None
    return args


def validate_args(args, defaults=None):
    return args


def _vocab_size_with_padding(orig_vocab_size, args, logging_enabled=True):
    m = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return ((orig_vocab_size + m - 1) // m) * m


def install() -> None:
    """Make `megatron.training.arguments` importable (megatron-core provides `megatron.core`)."""
    import megatron  # the real namespace package from megatron-core

    training = types.ModuleType("megatron.training")
    arguments = types.ModuleType("megatron.training.arguments")
    arguments.parse_args, arguments.validate_args = parse_args, validate_args
    tokenizer_pkg = types.ModuleType("megatron.training.tokenizer")
    tokenizer = types.ModuleType("megatron.training.tokenizer.tokenizer")
    tokenizer._vocab_size_with_padding = _vocab_size_with_padding
    training.arguments, training.tokenizer, tokenizer_pkg.tokenizer = arguments, tokenizer_pkg, tokenizer
    megatron.training = training
    sys.modules.update({
        "megatron.training": training, "megatron.training.arguments": arguments,
        "megatron.training.tokenizer": tokenizer_pkg, "megatron.training.tokenizer.tokenizer": tokenizer,
    })
