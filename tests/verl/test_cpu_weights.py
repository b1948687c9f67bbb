"""The ``dora_store`` weight path (on Ray only for a store's lifetime): the weight store's ordering, the replica's checksum
of what it really holds after a load, and the evidence check that compares it with the publisher's.

Real: the ``dora_cpu`` replica's ``ServerCore`` with a tiny Llama model built here (transformers'
own model code), ``WeightStore``, ``DoraStoreCheckpointEngine``, ``evidence.checksum_check`` and
``reference_checksum``. Injected on purpose: a load that silently skips one sampled tensor
(``torch.Tensor.copy_`` patched for that tensor).
"""

from __future__ import annotations

import asyncio
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dora_ext.verl.weights import DoraChecksumMixin  # noqa: E402


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
    from dora_ext.verl.weights import checksum

    core, _ = server
    v1 = _shifted(core, 0.01)
    got1 = asyncio.run(core.load_named_weights(v1, 1))
    assert got1 == checksum(v1) and core.version == 1

    v2 = _shifted(core, 0.02)
    skip = core.model.get_parameter("model.layers.1.post_attention_layernorm.weight")  # sampled
    real_copy = torch.Tensor.copy_

    def lossy_copy(self, src, *args, **kwargs):  # the injected fault: this tensor is not written
        if self.data_ptr() == skip.data_ptr():
            return self
        return real_copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", lossy_copy)
    got2 = asyncio.run(core.load_named_weights(v2, 2))
    monkeypatch.undo()
    # The engine-side checksum (what the coordinator compares after a load) reads the model back.
    from dora_ext.verl.weights import sample_names

    assert asyncio.run(core.weights_checksum(sample_names(v2))) == got2 != checksum(v2)
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


def test_checksum_covers_every_tensor_and_all_of_each_on_the_cpu_replica(server):
    """The checksum sampled only ``*norm.weight`` (their first 4096 values): a weight matrix the
    load left stale, or changed past its head, passed. Every tensor is now sampled across its
    whole length; vLLM and SGLang keep the norms (the tensors they hold as published)."""
    from dora_ext.verl.weights import checksum, sample_names

    core, _ = server
    held = {n: p.detach().clone() for n, p in core.model.named_parameters()}
    matrix = max((n for n in held if not n.endswith("norm.weight")), key=lambda n: held[n].numel())
    assert checksum(dict(held, **{matrix: held[matrix] + 0.5})) != checksum(held)
    tail = torch.zeros(3 * 4096)
    tail[4096:] = 1.0
    assert checksum({"w": tail}) != checksum({"w": torch.zeros(3 * 4096)})
    assert sample_names(held, "dora_cpu") == sorted(held)
    assert all(n.endswith("norm.weight") for n in sample_names(held, "vllm"))


def test_reference_checksum_of_the_model_on_disk(server):
    from dora_ext.verl.cpu.evidence import reference_checksum
    from dora_ext.verl.weights import checksum
    from transformers import AutoModelForCausalLM

    _, path = server
    fresh = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    assert reference_checksum(path) == checksum(dict(fresh.named_parameters()))
    with pytest.raises(FileNotFoundError):
        reference_checksum(os.path.dirname(path))


@pytest.mark.parametrize("publish_first", [True, False])
def test_store_load_waits_for_publication_in_both_orders_and_first_publication_wins(publish_first):
    from dora_ext.verl.weights import WeightStore

    store = WeightStore(keep_versions=3)
    w = {"x": torch.ones(2)}

    async def run():
        if publish_first:
            assert await store.publish(5, [w], "a")
            fetch = asyncio.create_task(store.fetch(5))
        else:
            fetch = asyncio.create_task(store.fetch(5))
            for _ in range(5):  # let the fetch reach its wait: it must not complete unpublished
                await asyncio.sleep(0)
            assert not fetch.done()
            assert await store.publish(5, [w], "a")
        version, named, digest = await fetch
        # A later send labelled 5 (other weights) cannot change what version 5 is.
        assert not await store.publish(5, [{"x": torch.zeros(2)}], "b")
        again = await store.fetch(5)
        return version, digest, again[2], torch.equal(again[1][0]["x"], w["x"])

    assert asyncio.run(run()) == (5, "a", "a", True)


def _no_stores():
    """Kill every weight store an earlier test left (or whose owner it killed) and wait until they are gone."""
    import time

    import ray

    from dora_ext.verl.weights import STORE_PREFIX

    for name in [n for n in ray.util.list_named_actors() if n.startswith(STORE_PREFIX)]:
        ray.kill(ray.get_actor(name))
    deadline = time.monotonic() + 60
    while any(n.startswith(STORE_PREFIX) for n in ray.util.list_named_actors()):
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_store_its_publisher_created_outlives_the_publish_call(ray_tq):
    """verl's own trainers publish before any store exists, so ``send_weights`` creates this node's
    store. Ray ends a named actor once its creator's handles are gone, whatever handles others took
    by name: a publisher that dropped its handle took version 1 away from the worker fetching it."""
    import gc
    import time

    import ray

    from dora_ext.verl.weights import DoraStoreCheckpointEngine

    _no_stores()  # this one must be created by the publish

    @ray.remote(num_cpus=0)
    class Worker:  # an actor rank (publishes) or a rollout worker (fetches), alive for the run
        def publish(self):
            async def weights():
                yield "x", torch.ones(2)

            asyncio.run(DoraStoreCheckpointEngine(is_master=True).send_weights(weights(), global_steps=1))
            gc.collect()

        def fetch(self):
            async def load():
                engine = DoraStoreCheckpointEngine(fetch_timeout_s=5)
                return [(n, t.tolist()) async for n, t in engine.receive_weights(global_steps=1)]

            return asyncio.run(load())

    actor, rollout = Worker.remote(), Worker.remote()
    ray.get(actor.publish.remote())
    time.sleep(2)  # Ray ends an actor nobody owns within milliseconds: let that happen before the fetch
    assert ray.get(rollout.fetch.remote()) == [("x", [1.0, 1.0])]
    ray.kill(actor), ray.kill(rollout)


def test_a_publication_is_one_shared_read_only_copy_per_node_and_loads_bit_exactly(ray_tq):
    """Each rollout worker that loads deserialises the published object. A dict of torch tensors
    (Ray serialises them in-band) gave each worker a private host copy of the whole model for the
    whole load: at verl's first sync, where every worker of every replica loads at once, 8 copies
    on an 8-GPU node. Numpy arrays come back as read-only views of the node's object store, one
    copy for all of its workers. Real Ray, the real publisher, store and receiver: every published
    array is such a view, and a bf16 and an int64 tensor (with values past float64's 2**53) load back
    bit-exactly, into memory of their own."""
    import numpy as np
    import ray

    from dora_ext.verl.weights import DoraStoreCheckpointEngine, node_store

    gen = torch.Generator().manual_seed(0)
    weights = {"w.bf16": torch.randn(64, 32, generator=gen).to(torch.bfloat16),
               "w.int64": torch.arange(2**60, 2**60 + 512, dtype=torch.int64).reshape(2, 256)}
    _no_stores()  # the publish creates this node's store
    publisher = DoraStoreCheckpointEngine(is_master=True, dtype="bfloat16")
    asyncio.run(publisher.send_weights(iter(weights.items()), global_steps=3))

    got, boxed, _ = ray.get(node_store().fetch.remote(3))
    packed = ray.get(boxed[0])  # what a worker's load deserialises (``_yield``'s ``await boxed[0]``)
    assert got == 3 and set(packed) == set(weights)
    # Each entry's bytes are the store's memory (a read-only numpy view), not a private copy.
    assert all(isinstance(e[0], np.ndarray) and not e[0].flags.writeable for e in packed.values()), {
        n: type(e).__name__ for n, e in packed.items()}
    assert {n: e[1:] for n, e in packed.items()} == {n: (t.dtype, tuple(t.shape)) for n, t in weights.items()}

    async def load():
        engine = DoraStoreCheckpointEngine(fetch_timeout_s=30)
        return {n: t async for n, t in engine.receive_weights(global_steps=3)}

    loaded = asyncio.run(load())
    assert set(loaded) == set(weights)
    for name, t in loaded.items():
        assert t.dtype == weights[name].dtype and torch.equal(t.view(torch.uint8), weights[name].view(torch.uint8))
        assert t.data_ptr() != packed[name][0].ctypes.data  # a private copy: nothing aliases the shared memory


def _store_with(versions, keep):
    """A store (real ``WeightStore``) that published `versions`, each ``{"x": full(v)}``."""
    from dora_ext.verl.weights import WeightStore

    store = WeightStore(keep_versions=keep)

    async def run():
        for v in versions:
            await store.publish(v, [{"x": torch.full((2,), float(v))}], f"c{v}")

    asyncio.run(run())
    return store


def test_a_load_of_a_version_the_store_does_not_hold_raises_naming_it_and_never_gets_other_weights():
    """Tries every way a load could get weights other than the version it names: a version evicted
    (older than the kept ones), a version never published below the newest, no version (None, which
    before took the newest held while the sender published under -1), a non-integer version. Each
    raises at once (no wait for a publication that cannot come), naming the version and what is
    held; a kept version answers with its own weights."""
    store = _store_with([0, 1, 2, 3, 4, 5], keep=3)
    assert sorted(store.versions) == [3, 4, 5]

    async def fetch(v):
        return await asyncio.wait_for(store.fetch(v), 5)  # a bound on a failure (a hang), not timing

    with pytest.raises(KeyError, match=r"version 1 is no longer kept \(held: \[3, 4, 5\]"):
        asyncio.run(fetch(1))
    gap = _store_with([0, 1, 4], keep=8)  # 2 and 3 never published (a gap below the newest)
    with pytest.raises(KeyError, match=r"version 2 was never published and is older than the newest published, 4 "
                                       r"\(held: \[0, 1, 4\]\)"):
        asyncio.run(asyncio.wait_for(gap.fetch(2), 5))
    for bad in (None, "4", 4.0, True):
        with pytest.raises(ValueError, match=r"must name the version it loads .*held: \[3, 4, 5\]"):
            asyncio.run(fetch(bad))
    version, named, digest = asyncio.run(fetch(4))
    assert (version, digest, named[0]["x"].tolist()) == (4, "c4", [4.0, 4.0])


def test_a_load_of_a_version_never_published_on_its_node_fails_after_the_timeout_naming_it():
    """A fresh store (a restarted node's) never receives a version published before it existed: the
    load waited forever. It now fails after ``fetch_timeout_s``, naming the version, node and key."""
    from dora_ext.verl.weights import WeightStore

    store = WeightStore(keep_versions=3, node_id="node-b", timeout_s=0.01)
    with pytest.raises(TimeoutError, match=r"node node-b: version 4 was not published within 0.01 s \(held: \[\]"
                                           r".*engine_kwargs\.dora_store\.fetch_timeout_s"):
        asyncio.run(asyncio.wait_for(store.fetch(4), 30))  # the outer bound catches a hang, not timing


def test_a_version_evicted_while_its_load_waits_raises():
    """A load waiting for version 7 (not published yet) when 7 is published and, before the load
    resumes, evicted by newer ones (keep 1): it raises, it does not take the newest weights."""
    store = _store_with([5, 6], keep=1)

    async def run():
        load = asyncio.ensure_future(store.fetch(7))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not load.done()
        # Published and evicted with no await in between: the load resumes after both.
        await store.publish(7, [{"x": torch.zeros(2)}], "c7")
        await store.publish(8, [{"x": torch.ones(2)}], "c8")
        return await load

    with pytest.raises(KeyError, match=r"version 7 is no longer kept \(held: \[8\]"):
        asyncio.run(run())


class _Answering:
    """Stands in for the weight store's actor handle: ``fetch.remote(v)`` answers `answer` (a
    version other than the one asked for: what the check after a fetch must refuse)."""

    def __init__(self, answer):
        self.answer = answer
        self.asked = []
        self.fetch = self

    def remote(self, version):
        self.asked.append(version)

        async def out():
            from dora_ext.verl.weights import pack_tensor

            return self.answer, [{"x": pack_tensor(torch.zeros(2))}], "c"

        return out()


def test_receive_weights_checks_the_version_it_got_and_refuses_none():
    """The checkpoint engine's receive (real ``DoraStoreCheckpointEngine``): the version the store
    answered with must be the one asked for, else nothing is yielded; a receive or a send without a
    version raises (before: the send published under -1, the receive took the newest held)."""
    from dora_ext.verl.weights import DoraStoreCheckpointEngine

    async def drain(engine, steps):
        return [name async for name, _ in engine.receive_weights(global_steps=steps)]

    engine = DoraStoreCheckpointEngine(is_master=True)
    engine._store = _Answering(3)
    with pytest.raises(RuntimeError, match="asked the weight store for version 4, it answered with version 3"):
        asyncio.run(drain(engine, 4))
    assert asyncio.run(drain(engine, 3)) == ["x"]
    assert engine._store.asked == [4, 3]
    with pytest.raises(ValueError, match="receive_weights needs the version it loads"):
        asyncio.run(drain(engine, None))
    assert engine._store.asked == [4, 3]  # the store was not asked

    async def send(steps):
        return await engine.send_weights(iter([("x", torch.ones(2))]), global_steps=steps)

    with pytest.raises(ValueError, match="send_weights needs the version it publishes"):
        asyncio.run(send(None))


def test_replica_batches_concurrent_requests_aborts_one_and_reads_the_version_at_completion(server):
    """The ``dora_cpu`` replica shaped like vLLM: two requests run in the same decode steps (both
    admitted before either finished), ``abort_request`` ends one with its partial tokens while the
    other runs to its length, and each reports the version held when it *completed*. The order is
    forced by awaiting the loop's own state, not by time."""
    core, _ = server
    core.eos_ids = set()  # random tiny weights: no early stop
    core.version = 3

    async def run():
        params = {"max_tokens": 6, "temperature": 0}
        a = asyncio.ensure_future(core.generate("a", [1, 2, 3], params))
        b = asyncio.ensure_future(core.generate("b", [4, 5], params))
        while len(core._running) < 2 or not core._running[0].tokens:
            await asyncio.sleep(0)
        assert {r.id for r in core._running} == {"a", "b"}  # one batch
        assert (await core.abort_request("a"))["aborted"]
        assert not (await core.abort_request("nope"))["aborted"]
        out_a = await a
        core.version = 4  # a load between steps (the coordinator never does so under a request)
        out_b = await b
        return out_a, out_b

    out_a, out_b = asyncio.run(run())
    assert out_a.stop_reason == "aborted" and 0 < len(out_a.token_ids) < 6
    assert out_a.extra_fields["global_steps"] == 3
    assert out_b.stop_reason == "length" and len(out_b.token_ids) == 6
    assert out_b.extra_fields["global_steps"] == 4  # read at completion


def test_a_held_replica_advances_no_request_it_shares_until_one_is_aborted(server, monkeypatch):
    """``DORA_CPU_SLOW_REPLICAS=<rank>:hold``: a lone request decodes; once a second one runs beside
    it neither advances (however many loop iterations pass), until ``abort_request`` ends one with
    its partial tokens and the other then runs alone to its length."""
    from dora_ext.verl.cpu.rollout import ServerCore

    monkeypatch.setenv("DORA_CPU_SLOW_REPLICAS", "1:3,0:hold")
    monkeypatch.setenv("DORA_CPU_STEP_S", "0")
    core = ServerCore()
    core._init_server(type("ModelConfig", (), {"local_path": server[1]})(), 0)
    assert core.hold and core.step_s == 0
    core.eos_ids = set()

    async def run():
        params = {"max_tokens": 6, "temperature": 0}
        a = asyncio.ensure_future(core.generate("a", [1, 2, 3], params))
        while not core._running or not core._running[0].tokens:
            await asyncio.sleep(0)
        b = asyncio.ensure_future(core.generate("b", [4, 5], params))
        while len(core._running) < 2:
            await asyncio.sleep(0)
        held = [len(r.tokens) for r in core._running]
        for _ in range(50):  # the decode loop yields once per step (its step time is 0)
            await asyncio.sleep(0)
        assert [len(r.tokens) for r in core._running] == held and held[0] < 6, held
        assert (await core.abort_request("b"))["aborted"]
        return await a, await b

    out_a, out_b = asyncio.run(run())
    assert out_b.stop_reason == "aborted" and out_b.token_ids == []
    assert out_a.stop_reason == "length" and len(out_a.token_ids) == 6


class _LocalStore:
    """A ``WeightStore`` behind ``.publish.remote`` / ``.read_text.remote`` (its actor handle's shape)."""

    def __init__(self, store):
        self.store = store
        self.publish = type("M", (), {"remote": lambda _, *a: store.publish(*a)})()
        self.read_text = type("M", (), {"remote": lambda _, *a: asyncio.sleep(0, store.read_text(*a))})()


class _VllmWorker(DoraChecksumMixin):
    """vLLM's GPU worker with dora's extension mixed in (vLLM appends the extension to its bases)."""

    def __init__(self, rank, held):
        self.rank = rank
        self.model_runner = type("R", (), {"model": type("M", (), {"named_parameters": lambda _: iter(held.items())})()})()


def _vllm_server(workers: list, calls: list):
    """verl's ``vLLMHttpServer.collective_rpc`` in front of vLLM, with vLLM's limits: the call
    reaches the engine-core process through msgpack (vLLM's ``MsgpackEncoder`` refuses a function
    unless ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which verl never sets; msgspec's encoder without
    an enc_hook refuses it the same way), then every worker runs the method named,
    ``getattr(worker, method)(*args)`` (vLLM's ``run_method``). `calls` records what went over."""
    import msgspec

    async def rpc(method, timeout=None, args=(), kwargs=None):
        calls.append(msgspec.msgpack.decode(msgspec.msgpack.Encoder().encode([method, args, kwargs])))
        method, args, kwargs = calls[-1]
        for worker in workers:
            getattr(worker, method)(*args, **(kwargs or {}))

    return type("Server", (), {"collective_rpc": type("M", (), {"remote": lambda _, *a, **k: rpc(*a, **k)})()})()


@pytest.mark.parametrize("engine", ["rounded_like_the_engine", "other_weights"])
def test_a_bf16_vllm_engine_holding_the_fp32_publication_passes_its_checksum(engine, tmp_path, monkeypatch):
    """An FSDP actor hands float32 master weights; a vLLM/SGLang engine (rollout.dtype bfloat16)
    holds them rounded. Both checksums round to the engine's dtype (``served_dtype``, set by
    ``configure``), so the real publisher (``send_weights``) and the real vLLM-worker method
    (``dora_checksum``, called by name through ``collective_rpc`` in both workers of a TP=2 engine)
    agree on correct weights and still differ on wrong ones. Before, every load of a bf16 engine was
    refused; and the call passed a function, which vLLM's msgpack encoder refuses."""
    import ray
    from omegaconf import OmegaConf

    from dora_ext.verl import weights as W

    store = W.WeightStore()
    monkeypatch.setattr(W, "all_stores", lambda *_: [_LocalStore(store)])
    monkeypatch.setattr(ray, "put", lambda x: x)
    dtype = W.served_dtype(OmegaConf.create({"name": "vllm", "dtype": "bfloat16"}))
    assert dtype == "bfloat16" and W.served_dtype(OmegaConf.create({"name": "dora_cpu"})) == "float32"
    gen = torch.Generator().manual_seed(0)
    fp32 = {n: 1 + torch.randn(64, generator=gen) * 1e-3 for n in ("model.norm.weight", "model.layers.0.input_layernorm.weight")}
    publisher = W.DoraStoreCheckpointEngine(is_master=True, dtype=dtype)
    asyncio.run(publisher.send_weights(iter(fp32.items()), global_steps=1))
    published, names = store.evidence(1)
    held = {n: t.to(torch.bfloat16) for n, t in fp32.items()}  # what vLLM copies into its bf16 parameters
    if engine == "other_weights":
        held["model.norm.weight"] = (fp32["model.norm.weight"] + 0.05).to(torch.bfloat16)
    assert W.checksum(held, names) != W.checksum(fp32, names)  # without rounding they never agree

    calls = []
    server = _vllm_server([_VllmWorker(0, held), _VllmWorker(1, held)], calls)
    monkeypatch.setenv("DORA_CHECKSUM_DIR", str(tmp_path))
    got = asyncio.run(W.engine_checksum("vllm", server, "addr", names, _LocalStore(store), "1_1", dtype))
    assert (got == published) == (engine == "rounded_like_the_engine")
    assert [c[0] for c in calls] == ["dora_checksum"] and calls[0][1][0] == names


def test_the_vllm_worker_extension_is_verls_with_the_checksum_method(vllm_extension_stub):
    """The class DoraTrainer names for vLLM composes with verl's: importing it on the stand-in
    ``vLLMColocateWorkerExtension`` (``vllm_extension_stub``: vLLM is not installed) yields a
    subclass of it that has the method ``engine_checksum`` calls. vLLM refuses an extension with
    an attribute its worker already has: dora's adds only that one."""
    from verl.utils.import_utils import load_class_from_fqn

    from dora_ext.verl.weights import METHOD, VLLM_EXTENSION

    cls = load_class_from_fqn(VLLM_EXTENSION)
    assert issubclass(cls, vllm_extension_stub) and issubclass(cls, DoraChecksumMixin)
    added = {a for a in set(dir(cls)) - set(dir(vllm_extension_stub)) if not a.startswith("__")}
    assert added == {METHOD} == {"dora_checksum"}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_publication_is_in_the_engine_dtype_and_the_load_reads_back_its_checksum(dtype, monkeypatch):
    """An FSDP actor hands float32 tensors; a bfloat16 engine holds them rounded, so they are
    published rounded (at 7B a float32 copy is ~30 GB that every rollout worker rebuilds per load),
    integer buffers as they are. The checksum, over what is published, is the one the actor's
    float32 tensors gave before and the one the engine reads back after the load (the receiver's
    own ``_yield``). A float32 engine (``dora_cpu``) gets the tensors unchanged."""
    import ray

    from dora_ext.verl import weights as W

    store = W.WeightStore()
    monkeypatch.setattr(W, "all_stores", lambda *_: [_LocalStore(store)])
    monkeypatch.setattr(ray, "put", lambda x: x)
    gen = torch.Generator().manual_seed(0)
    actor = {"model.norm.weight": 1 + torch.randn(64, generator=gen) * 1e-3,
             "model.layers.0.mlp.up_proj.weight": torch.randn(8, 8, generator=gen), "model.position_ids": torch.arange(16)}
    publisher = W.DoraStoreCheckpointEngine(is_master=True, dtype=dtype, rollout="vllm")
    asyncio.run(publisher.send_weights(iter(actor.items()), global_steps=1))
    (boxed, digest), served = store.versions[1], getattr(torch, dtype)
    published = {n: W.unpack_tensor(entry) for n, entry in boxed[0].items()}
    assert {n: t.dtype for n, t in published.items()} == {
        "model.norm.weight": served, "model.layers.0.mlp.up_proj.weight": served, "model.position_ids": torch.int64}
    assert all(t.shape == actor[n].shape and torch.equal(t, actor[n].to(t.dtype)) and t.data_ptr() != actor[n].data_ptr()
               for n, t in published.items())

    async def load():  # into an engine of that dtype, as vLLM copies into its parameters
        return {n: torch.empty(t.shape, dtype=served if t.is_floating_point() else t.dtype).copy_(t)
                async for n, t in publisher._yield(boxed)}

    held, (published, names) = asyncio.run(load()), store.evidence(1)
    assert W.checksum(held, names, dtype) == published == digest == W.checksum(actor, names, dtype)


def test_an_engine_dtype_that_is_no_torch_float_dtype_is_refused_naming_the_key():
    """The weights are published and checked in the engine's dtype: ``auto`` names none, ``int8`` no float."""
    from omegaconf import OmegaConf

    from dora_ext.config import ConfigError
    from dora_ext.verl.weights import served_dtype

    for name in ("auto", "int8"):  # (int8 is a torch dtype: send_weights would cast the weights to it)
        with pytest.raises(ConfigError, match=rf"actor_rollout_ref\.rollout\.dtype: '{name}'.*accepted: bfloat16"):
            served_dtype(OmegaConf.create({"name": "vllm", "dtype": name}))
    assert served_dtype(OmegaConf.create({"name": "sglang", "dtype": "float16"})) == "float16"


def test_a_vllm_per_request_abort_keeps_the_prefix_cache_of_the_requests_left_running():
    """verl 0.9.1's ``vLLMHttpServer.abort_request(request_id, reset_prefix_cache=True)`` resets the
    replica's whole prefix cache unless told not to; an R5 move aborts one request and must not."""
    from dora_ext.verl.weights import abort_request

    calls = []

    async def remote(request_id, reset_prefix_cache=True):
        calls.append((request_id, reset_prefix_cache))
        return {"aborted": True, "request_id": request_id}

    server = type("Server", (), {"abort_request": type("M", (), {"remote": lambda _, *a, **k: remote(*a, **k)})()})()
    assert asyncio.run(abort_request("vllm", server, "addr", "r1"))["aborted"]
    assert calls == [("r1", False)]


def test_a_vllm_check_whose_workers_write_nothing_fails_and_never_reads_an_earlier_checksum(tmp_path, monkeypatch):
    """The vLLM checksum comes back through a file the rank-0 worker writes on its node. A check
    whose workers write nothing (no rank 0 answered) must fail, also when an earlier check of the
    same instance and version left its file there; before, that earlier checksum passed it."""
    from dora_ext.verl import weights as W

    held = {"model.norm.weight": torch.ones(8)}
    workers = [_VllmWorker(0, held)]
    server = _vllm_server(workers, [])
    monkeypatch.setenv("DORA_CHECKSUM_DIR", str(tmp_path))
    store = _LocalStore(W.WeightStore())
    names = ["model.norm.weight"]
    assert asyncio.run(W.engine_checksum("vllm", server, "a", names, store, "1_3")) == W.checksum(held, names)
    workers[:] = [_VllmWorker(1, held)]  # the same check again, answered by no rank 0
    with pytest.raises(W.WeightsMismatch, match="vLLM worker wrote no checksum"):
        asyncio.run(W.engine_checksum("vllm", server, "a", names, store, "1_3"))


def test_an_sglang_model_without_get_weights_by_name_fails_the_check_naming_what_to_change(monkeypatch):
    """SGLang answers ``/get_weights_by_name`` with HTTP 400 for a model class that does not implement
    it (sglang 0.5.23's Qwen2/Qwen3): the check fails naming the rollout key, not with a bare HTTPError."""
    import io
    import urllib.error

    from dora_ext.verl import weights as W

    def refuse(req, timeout=None):
        raise urllib.error.HTTPError(req.full_url, 400, "Bad Request", {}, io.BytesIO(b'{"error": "failed"}'))

    monkeypatch.setattr(W, "_urlopen", refuse)
    with pytest.raises(W.WeightsMismatch, match=r"model.norm.weight .*HTTP 400.*rollout.name=vllm"):
        asyncio.run(W.engine_checksum("sglang", None, "127.0.0.1:1", ["model.norm.weight"], None, "t", "bfloat16"))


def test_an_sglang_engine_answering_its_bf16_tensor_as_json_matches_the_fp32_publication(monkeypatch):
    """``/get_weights_by_name`` answers ``param.cpu()[:truncate_size].to(float32).tolist()`` (JSON): the
    round trip is exact, so a bf16 SGLang engine holding the publication passes."""
    import io
    import json

    from dora_ext.verl import weights as W

    fp32 = {"model.norm.weight": 1 + torch.randn(64, generator=torch.Generator().manual_seed(1)) * 1e-3}
    asked = []

    def answer(req, timeout=None):
        body = json.loads(req.data)
        asked.append(body)
        held = fp32[body["name"]].to(torch.bfloat16)
        return io.BytesIO(json.dumps(held[: body["truncate_size"]].to(torch.float32).tolist()).encode())

    monkeypatch.setattr(W, "_urlopen", answer)
    got = asyncio.run(W.engine_checksum("sglang", None, "h:1", ["model.norm.weight"], None, "t", "bfloat16"))
    assert got == W.checksum(fp32, ["model.norm.weight"], "bfloat16") != W.checksum(fp32, ["model.norm.weight"])
    assert asked == [{"name": "model.norm.weight", "truncate_size": 1 << 20}]


def test_sglang_checks_and_aborts_go_straight_to_the_server_whatever_http_proxy_says(monkeypatch):
    """A cluster exporting ``http_proxy`` / ``HTTP_PROXY`` without its own addresses in ``no_proxy``:
    ``urllib.request.urlopen`` sent ``/get_weights_by_name`` and ``/abort_request`` through the proxy and
    the first load check failed with a URLError (the run stopped at init). They now ignore proxies, as
    verl's SGLang HTTP client does. Stand-ins: a loopback HTTP server answering both routes as SGLang
    does, and a proxy address where nothing listens."""
    import json
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from dora_ext.verl import weights as W

    norm = torch.ones(8)
    asked = []

    class SGLang(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            asked.append((self.path, body))
            out = json.dumps(norm.tolist() if self.path == "/get_weights_by_name" else {}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *_):
            pass

    with socket.socket() as s:  # a loopback port where nothing listens: the proxy
        s.bind(("127.0.0.1", 0))
        proxy = f"http://127.0.0.1:{s.getsockname()[1]}"
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(var, proxy)
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    server = HTTPServer(("127.0.0.1", 0), SGLang)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        names = ["model.norm.weight"]
        got = asyncio.run(W.engine_checksum("sglang", None, address, names, None, "t", "bfloat16"))
        assert got == W.checksum({"model.norm.weight": norm}, names, "bfloat16")
        assert asyncio.run(W.abort_request("sglang", None, address, "r1")) == {"aborted": True, "confirmed": False}
    finally:
        server.shutdown()
        server.server_close()
    assert [p for p, _ in asked] == ["/get_weights_by_name", "/abort_request"] and asked[1][1] == {"rid": "r1"}
