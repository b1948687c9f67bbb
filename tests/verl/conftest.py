"""Shared fixtures for the verl integration tests (real verl 0.9.1, real Ray and TransferQueue).

TransferQueue's wheel installs top-level packages named ``tests`` and ``recipe``; the project's
pytest settings use ``--import-mode=importlib`` so this folder never imports through them.
"""

from __future__ import annotations

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
    """A tiny Hugging Face model directory made here (no download): a word-level tokenizer with a
    chat template and a 1-layer Llama config. verl's ``HFModelConfig`` loads it like a real one."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("tiny_hf")
    words = "system user assistant what is one two three four five plus minus equals answer the a of and , . ? ! :"
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for w in words.split() + [str(i) for i in range(10)]:
        vocab.setdefault(w, len(vocab))
    while len(vocab) < 64:
        vocab[f"t{len(vocab)}"] = len(vocab)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} \n{% endfor %}"
                          "{% if add_generation_prompt %}assistant : {% endif %}")
    fast.save_pretrained(out)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(out)
    return str(out)
