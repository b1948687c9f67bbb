"""Shared fixtures for the verl integration tests (real verl 0.9.1, real Ray and TransferQueue).

TransferQueue's wheel installs top-level packages named ``tests`` and ``recipe``; the project's
pytest settings use ``--import-mode=importlib`` so this folder never imports through them.
"""

from __future__ import annotations

import sys
import types

import pytest

verl = pytest.importorskip("verl", reason="verl is not installed (pip install 'dora-ext[verl]')")


@pytest.fixture(scope="session")
def ray_tq():
    """A local Ray (4 logical CPUs: TransferQueue's controller and storage each take one) and TQ.

    Shut down in teardown, so no Ray process outlives the test session.
    """
    ray = pytest.importorskip("ray")
    tq = pytest.importorskip("transfer_queue")
    from omegaconf import OmegaConf

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        storage = {"num_data_storage_units": 1, "total_storage_size": 4096}
        tq.init(OmegaConf.create({"backend": {"SimpleStorage": storage}}))
        yield tq
    finally:
        try:
            tq.close()
        finally:
            ray.shutdown()


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """A tiny Hugging Face model directory made here (no download): the word-level tokenizer with a
    chat template and the Llama-architecture model of ``dora_ext.verl.cpu.tiny`` (1 layer, hidden
    16). verl's ``HFModelConfig`` loads it like a real one."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    from dora_ext.verl.cpu.tiny import build_model

    return build_model(str(tmp_path_factory.mktemp("tiny_hf")), hidden=16, layers=1)


@pytest.fixture
def vllm_extension_stub(monkeypatch):
    """verl's ``verl.workers.rollout.vllm_rollout.utils`` imports vLLM, which is not installed here:
    a stub module under that name stands in, holding an empty ``vLLMColocateWorkerExtension`` (the
    base dora's worker extension must extend). ``dora_ext.verl.vllm_worker`` is imported afresh on
    it and dropped afterwards. Yields the stand-in base class."""
    stub = types.ModuleType("verl.workers.rollout.vllm_rollout.utils")
    stub.vLLMColocateWorkerExtension = type("vLLMColocateWorkerExtension", (), {})
    monkeypatch.setitem(sys.modules, stub.__name__, stub)
    sys.modules.pop("dora_ext.verl.vllm_worker", None)
    yield stub.vLLMColocateWorkerExtension
    sys.modules.pop("dora_ext.verl.vllm_worker", None)
