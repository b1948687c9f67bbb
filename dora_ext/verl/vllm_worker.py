"""``DoraWorkerExtension``: verl's vLLM worker extension plus dora's engine-side checksum.

verl launches vLLM with ``worker_extension_cls=verl.workers.rollout.vllm_rollout.utils.
vLLMColocateWorkerExtension`` unless ``actor_rollout_ref.rollout.engine_kwargs.vllm.
worker_extension_cls`` says otherwise; ``DoraTrainer`` sets it to this class on vLLM (a user's own
class must extend it). vLLM mixes it into each GPU worker, so ``engine_checksum`` reaches
``dora_checksum`` by name through ``collective_rpc``. Imported only in vLLM's worker processes
(verl's base class imports vLLM).
"""

from __future__ import annotations

from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from .weights import DoraChecksumMixin


class DoraWorkerExtension(DoraChecksumMixin, vLLMColocateWorkerExtension):
    """verl's extension (LoRA, FP8, weight updates over IPC) and ``dora_checksum``."""
