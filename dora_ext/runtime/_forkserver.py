"""Imported once by the fork server that starts the worker processes (see `workers.process_context`).

It imports and warms up once what every worker would otherwise initialise lazily (torch, the
engine, the trainer, the meta device, the optimizer's first step), so a worker starts by a fork.
"""

import torch

from dora_ext.algo import Trainer, TrainerConfig, Trajectory
from dora_ext.engines import TorchEngine  # noqa: F401
from dora_ext.models.tiny import TinyConfig, TinyLM
from dora_ext.runtime import workers  # noqa: F401


def _warm_up() -> None:
    cfg = TinyConfig(vocab_size=8, d_model=8, n_layer=1, n_head=1, max_len=8)
    if hasattr(TinyLM, "empty"):
        TinyLM.empty(cfg)
    trainer = Trainer(TinyLM(cfg), TrainerConfig(lr=1e-3))
    trainer.add_group([Trajectory([1, 2], [3], [-1.0], float(r), 0) for r in range(2)])
    trainer.finish_step(0)


torch.set_num_threads(1)  # only this server process; workers set their own share
_warm_up()
