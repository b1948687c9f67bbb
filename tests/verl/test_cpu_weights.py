"""The ``dora_cpu`` weight path without Ray: the weight store's ordering, the replica's checksum of
what it really holds after a load, and the evidence check that compares it with the publisher's.

Real: the ``dora_cpu`` replica's ``ServerCore`` with a tiny Llama model built here (transformers'
own model code), ``WeightStore``, ``evidence.checksum_check`` and ``reference_checksum``. Injected
on purpose: a load that silently skips one tensor (``torch.Tensor.copy_`` patched for that tensor).
"""

from __future__ import annotations

import asyncio
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from dora_ext.verl.cpu.rollout import ServerCore
    from dora_ext.verl.cpu.tiny import build_model

    path = build_model(str(tmp_path_factory.mktemp("tiny") / "model"))

    class ModelConfig:
        local_path = path

    core = ServerCore()
    core._init_server(ModelConfig(), 0)
    return core, path


def _shifted(core, delta):
    return {n: p.detach().clone() + delta for n, p in core.model.named_parameters()}


def test_replica_checksum_is_read_back_and_catches_a_corrupted_load(server, monkeypatch):
    from dora_ext.verl.cpu.evidence import checksum_check
    from dora_ext.verl.cpu.weights import checksum

    core, _ = server
    v1 = _shifted(core, 0.01)
    got1 = asyncio.run(core.load_named_weights(v1, 1))
    assert got1 == checksum(v1) and core.version == 1

    v2 = _shifted(core, 0.02)
    skip = core.model.get_parameter("model.layers.1.mlp.up_proj.weight")
    real_copy = torch.Tensor.copy_

    def lossy_copy(self, src, *args, **kwargs):  # the injected fault: this tensor is not written
        if self.data_ptr() == skip.data_ptr():
            return self
        return real_copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", lossy_copy)
    got2 = asyncio.run(core.load_named_weights(v2, 2))
    monkeypatch.undo()
    reports = [
        {"kind": "publish", "version": 1, "checksum": checksum(v1)},
        {"kind": "publish", "version": 2, "checksum": checksum(v2)},
        {"kind": "load", "replica": 0, "version": 1, "checksum": got1},
        {"kind": "load", "replica": 0, "version": 2, "checksum": got2},
    ]
    ok, problems = checksum_check(reports)
    assert not ok and problems == [f"replica 0 version 2: checksum {got2} != published {checksum(v2)}"]
    # Without the fault the same reports pass.
    got2 = asyncio.run(core.load_named_weights(v2, 2))
    reports[-1]["checksum"] = got2
    assert checksum_check(reports) == (True, [])


def test_reference_checksum_of_the_model_on_disk(server):
    from dora_ext.verl.cpu.evidence import reference_checksum
    from dora_ext.verl.cpu.weights import checksum
    from transformers import AutoModelForCausalLM

    _, path = server
    fresh = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    assert reference_checksum(path) == checksum(dict(fresh.named_parameters()))
    with pytest.raises(FileNotFoundError):
        reference_checksum(os.path.dirname(path))


@pytest.mark.parametrize("publish_first", [True, False])
def test_store_load_waits_for_publication_in_both_orders_and_first_publication_wins(publish_first):
    from dora_ext.verl.cpu.weights import WeightStore

    store = WeightStore(keep_versions=3)
    w = {"x": torch.ones(2)}

    async def run():
        if publish_first:
            assert await store.publish(5, w, "a")
            fetch = asyncio.create_task(store.fetch(5))
        else:
            fetch = asyncio.create_task(store.fetch(5))
            for _ in range(5):  # let the fetch reach its wait: it must not complete unpublished
                await asyncio.sleep(0)
            assert not fetch.done()
            assert await store.publish(5, w, "a")
        version, named, digest = await fetch
        # A later send labelled 5 (other weights) cannot change what version 5 is.
        assert not await store.publish(5, {"x": torch.zeros(2)}, "b")
        again = await store.fetch(5)
        return version, digest, again[2], torch.equal(again[1]["x"], w["x"])

    assert asyncio.run(run()) == (5, "a", "a", True)
