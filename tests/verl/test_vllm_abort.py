"""R5's per-request abort on a vLLM replica (``dora_ext.verl.vllm_server``), run on CPU.

vLLM is not installed here, so three things are stood in for, in this process only (restored
after each test):

* ``vllm``: only ``vllm.v1.engine.FinishReason``, which verl's method imports;
* verl's ``verl.workers.rollout.vllm_rollout.vllm_async_server`` (it imports vLLM at its top): its
  ``vLLMHttpServer`` is a bare class carrying verl 0.9.1's real ``abort_request``, compiled from the
  installed verl source, and its ``vLLMReplica`` sets ``server_class`` as verl's does;
* the engine (``AsyncLLM``) as vLLM >= 0.16 has it (vllm/v1/engine/async_llm.py,
  output_processor.py): ``request_states`` keyed by internal ids (``f"{external}-{8 hex}"``),
  ``external_req_ids`` mapping external ids to them, and ``abort(external_id)`` emitting each
  request's final ABORT output and aborting its internal ids in the engine core; and as vLLM < 0.16
  had it (``request_states`` keyed by the external id, no map, an ``abort_requests`` that emits
  nothing).

Real: dora's server and replica subclasses and the plugin's registration of the ``vllm`` rollout.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import logging
import os
import secrets
import sys
import types
from collections import defaultdict
from typing import Any

import pytest

HOST = "verl.workers.rollout.vllm_rollout.vllm_async_server"


def _verl_method(name: str):
    """``vLLMHttpServer.<name>`` of the installed verl, compiled from its source (the module itself
    cannot be imported without vLLM)."""
    path = os.path.join(os.path.dirname(importlib.util.find_spec("verl.workers.rollout").origin),
                        "vllm_rollout", "vllm_async_server.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "vLLMHttpServer")
    fn = next(n for n in cls.body if isinstance(n, ast.AsyncFunctionDef) and n.name == name)
    ns: dict[str, Any] = {"Any": Any, "logger": logging.getLogger("verl-vllm-stand-in")}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), path, "exec"), ns)
    return ns[name]


@pytest.fixture
def host(monkeypatch):
    """The stand-ins above in ``sys.modules``; dora's module imported fresh against them."""
    import ray

    class FinishReason:
        ABORT = "abort"

    class vLLMHttpServer:  # noqa: N801 - verl's name
        abort_request = _verl_method("abort_request")

        def __init__(self, engine, node_rank=0):
            self.engine, self.node_rank, self.cache_resets = engine, node_rank, 0

        async def clear_kv_cache(self):
            self.cache_resets += 1

    class vLLMReplica:  # noqa: N801
        def __init__(self, *args, **kwargs):
            self.server_class = ray.remote(vLLMHttpServer)

    mods = {name: types.ModuleType(name) for name in ("vllm", "vllm.v1", "vllm.v1.engine",
                                                      "verl.workers.rollout.vllm_rollout", HOST)}
    mods["vllm.v1.engine"].FinishReason = FinishReason
    mods[HOST].vLLMHttpServer, mods[HOST].vLLMReplica = vLLMHttpServer, vLLMReplica
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    import dora_ext.verl

    # Imported against the stand-ins, and forgotten after the test (also as the package's attribute).
    monkeypatch.delitem(sys.modules, "dora_ext.verl.vllm_server", raising=False)
    monkeypatch.delattr(dora_ext.verl, "vllm_server", raising=False)
    vllm_server = importlib.import_module("dora_ext.verl.vllm_server")
    yield types.SimpleNamespace(verl=vLLMHttpServer, dora=vllm_server.DoraVLLMHttpServer, module=vllm_server)
    sys.modules.pop("dora_ext.verl.vllm_server", None)
    vars(dora_ext.verl).pop("vllm_server", None)


class _Queue(list):  # a request's output collector: what its generate() reads
    put = list.append


class _State:
    def __init__(self, request_id: str, external: str):
        self.request_id, self.external_req_id, self.queue = request_id, external, _Queue()

    def make_request_output(self, new_token_ids, pooling_output, finish_reason, stop_reason, **_):
        return {"request_id": self.external_req_id, "finish_reason": finish_reason}


class _Core:
    def __init__(self):
        self.aborted: list[str] = []

    async def abort_requests_async(self, ids):
        self.aborted += list(ids)


class _Processor:
    """vLLM >= 0.16's output processor (``internal=True``), or vLLM < 0.16's."""

    def __init__(self, internal: bool):
        self.request_states: dict[str, _State] = {}
        if internal:
            self.external_req_ids: defaultdict[str, list[str]] = defaultdict(list)

    def add(self, external: str) -> _State:
        if not hasattr(self, "external_req_ids"):
            self.request_states[external] = _State(external, external)
            return self.request_states[external]
        internal = f"{external}-{secrets.token_hex(4)}"  # InputProcessor.assign_request_id
        self.request_states[internal] = _State(internal, external)
        self.external_req_ids[external].append(internal)
        return self.request_states[internal]

    def abort_requests(self, ids, internal: bool = False):
        if not hasattr(self, "external_req_ids"):  # vLLM < 0.16: drops the state, emits nothing
            for i in ids:
                self.request_states.pop(i, None)
            return None
        assert not internal
        out = []
        for i in [n for e in ids for n in self.external_req_ids.pop(e, [])]:
            state = self.request_states.pop(i)
            state.queue.put(state.make_request_output([], None, "abort", None))  # the final ABORT output
            out.append(i)
        return out


class _Engine:
    def __init__(self, internal: bool = True):
        self.output_processor, self.engine_core = _Processor(internal), _Core()

    async def abort(self, request_id, internal: bool = False):  # AsyncLLM.abort
        await self.engine_core.abort_requests_async(self.output_processor.abort_requests([request_id], internal))


def _abort(server, request_id, **kw):
    return asyncio.run(type(server).abort_request(server, request_id, **kw))


def test_verl_s_abort_misses_every_request_of_a_vllm_0_16_engine_and_dora_s_aborts_just_that_one(host):
    engine = _Engine()
    moved, other = engine.output_processor.add("traj-1"), engine.output_processor.add("traj-2")
    out = _abort(host.verl(engine), "traj-1", reset_prefix_cache=False)
    assert out == {"aborted": False, "error": "Request traj-1 not found"} and not moved.queue  # the host bug

    server = host.dora(engine)
    assert _abort(server, "traj-1", reset_prefix_cache=False) == {"aborted": True, "request_id": "traj-1"}
    assert moved.queue == [{"request_id": "traj-1", "finish_reason": "abort"}]  # its generate() returns
    assert engine.engine_core.aborted == [moved.request_id] and server.cache_resets == 0
    assert list(engine.output_processor.request_states) == [other.request_id] and not other.queue
    assert _abort(server, "traj-2") == {"aborted": True, "request_id": "traj-2"} and server.cache_resets == 1


def test_an_abort_that_reaches_the_engine_before_its_request_is_not_found_and_its_resend_aborts_it(host):
    """The coordinator re-sends an abort until it is confirmed: the first one may come first."""
    engine = _Engine()
    server = host.dora(engine)
    assert _abort(server, "traj-1") == {"aborted": False, "request_id": "traj-1", "error": "Request traj-1 not found"}
    assert dict(engine.output_processor.external_req_ids) == {} and engine.engine_core.aborted == []
    state = engine.output_processor.add("traj-1")
    assert _abort(server, "traj-1")["aborted"] and state.queue[-1]["finish_reason"] == "abort"
    assert not _abort(server, "traj-1")["aborted"]  # gone: a later send finds nothing


def test_an_engine_without_the_external_id_map_gets_verl_s_own_abort_and_other_nodes_abort_nothing(host):
    engine = _Engine(internal=False)
    state = engine.output_processor.add("traj-1")
    assert _abort(host.dora(engine), "traj-1", reset_prefix_cache=False) == {"aborted": True, "request_id": "traj-1"}
    assert state.queue == [{"request_id": "traj-1", "finish_reason": "abort"}]
    assert engine.engine_core.aborted == ["traj-1"]
    engine = _Engine()
    engine.output_processor.add("traj-1")
    assert _abort(host.dora(engine, node_rank=1), "traj-1") == {"aborted": False, "request_id": "traj-1"}


def test_the_plugin_serves_verl_s_vllm_rollout_with_dora_s_server(host):
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    import dora_ext.verl.plugin  # noqa: F401 - registers (verl imports it too)

    cls = RolloutReplicaRegistry.get("vllm")
    assert cls is host.module.DoraVLLMReplica and issubclass(cls, sys.modules[HOST].vLLMReplica)
    assert cls(0, None, None).server_class.__ray_metadata__.modified_class.__mro__[1] is host.dora
