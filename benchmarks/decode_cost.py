"""CPU decode cost of the default recipe's model against the number of running sequences.

    python benchmarks/decode_cost.py [--batches 1,8,32,64,128] [--repeats 3] [--json OUT]

One TorchEngine on one thread, the long-tail recipe's tiny model, every sequence decoding: the
time of one decode step (best of `repeats`), per step and per running sequence. On a GPU a decode
step is memory bound and costs about the same for 8 or 64 sequences; on a CPU it grows with the
batch, which is what decides how much a long tail wastes (see recipes/cpu/long-tail.yaml).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,32,64,128")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--json", metavar="OUT", help="also write the table to this file")
    args = p.parse_args(argv)

    import torch

    from dora_ext.engines import SamplingParams, TorchEngine
    from dora_ext.models.tiny import TinyLM, policy_state
    from dora_ext.tasks.long_tail import LongTailConfig, LongTailTask

    torch.set_num_threads(1)
    task = LongTailTask(LongTailConfig(median=6, cv=1.2, cap=32, style="count_up"))
    model = TinyLM(task.model_config(d_model=64, n_layer=2, n_head=4, seed=0))
    weights = policy_state(model)
    batches = [int(b) for b in args.batches.split(",")]
    best: dict[int, float] = {}
    for _ in range(args.repeats):  # interleaved: a load change weighs on every batch size alike
        for b in batches:
            engine = TorchEngine(model.config, b, None)
            engine.load_version(weights, 0)
            for i in range(b):
                engine.submit(i, [1, 2, 3, 4, 5, 6, 7], args.steps + 10, SamplingParams(1.0, 1.0), seed=i)
            for _ in range(5):
                engine.step()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            dt = (time.perf_counter() - t0) / args.steps
            best[b] = min(best.get(b, float("inf")), dt)
    base = best[batches[0]]
    for b in batches:
        print(f"{b:4d} sequences: {best[b] * 1e3:6.2f} ms/step, {best[b] / b * 1e3:6.3f} ms per sequence, "
              f"{best[b] / base:4.1f}x the {batches[0]}-sequence step")
    if args.json:
        rows = [{"sequences": b, "ms_per_step": round(best[b] * 1e3, 3), "ms_per_sequence": round(best[b] / b * 1e3, 4),
                 "vs_smallest": round(best[b] / base, 2)} for b in batches]
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"steps": args.steps, "repeats": args.repeats, "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
