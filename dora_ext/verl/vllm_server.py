"""verl's vLLM replica with a per-request abort that works on vLLM >= 0.16 (R5's moves need it).

verl 0.9.1's ``vLLMHttpServer.abort_request(request_id)`` looks the id up in
``engine.output_processor.request_states``. Since vLLM 0.16 (verl 0.9.1 pins 0.24) that table is
keyed by *internal* ids (``f"{external}-{8 random chars}"``, ``InputProcessor.assign_request_id``);
the id verl's client sends is the external one, mapped to its internal ids in
``output_processor.external_req_ids``. So verl's lookup always misses ("not found"), the
coordinator re-sends it until the request ends on its own, and the move never lands.

``DoraVLLMHttpServer.abort_request`` finds the external id in ``external_req_ids`` and calls
``AsyncLLM.abort(request_id)`` (external ids; it emits the request's final ABORT output and aborts
its internal ids in the engine core). An engine without that map (vLLM < 0.16, ``request_states``
keyed by the external id) gets verl's own method, which works there.

``dora_ext.verl.plugin`` registers ``DoraVLLMReplica`` as the ``vllm`` rollout in verl's
``RolloutReplicaRegistry``; the registry imports this module (and with it vLLM) only when verl
builds a vLLM replica. It differs from verl's only in this method, so runs of verl's own trainers
get the working abort too.
"""

from __future__ import annotations

from typing import Any

import ray
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica


class DoraVLLMHttpServer(vLLMHttpServer):
    """verl's vLLM server; ``abort_request`` takes the external request id (see the module docstring)."""

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        """Abort one request; answers as verl's does: ``{"aborted", "request_id"[, "error"]}``.
        An id the engine does not hold (not arrived yet, or finished) is "not found"."""
        processor = self.engine.output_processor if self.node_rank == 0 else None
        external = getattr(processor, "external_req_ids", None)
        if processor is None or external is None:
            return await super().abort_request(request_id, reset_prefix_cache=reset_prefix_cache)
        if request_id not in external:  # (a defaultdict: `in` adds no entry)
            return {"aborted": False, "request_id": request_id, "error": f"Request {request_id} not found"}
        try:
            # No await between the check and abort()'s own synchronous output-processor step: the
            # request cannot finish in between (one event loop).
            await self.engine.abort(request_id)
            if reset_prefix_cache:
                await self.clear_kv_cache()
        except Exception as exc:
            return {"aborted": False, "request_id": request_id, "error": str(exc)}
        return {"aborted": True, "request_id": request_id}


class DoraVLLMReplica(vLLMReplica):
    """verl's ``vLLMReplica`` whose server actors are ``DoraVLLMHttpServer``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(DoraVLLMHttpServer)
