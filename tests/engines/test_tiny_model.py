"""TinyLM: the incremental KV cache computes what a full causal pass computes, in both caches and
both architectures; initialisation is a function of the seed alone."""

import pytest
import torch

from dora_ext.models import SlotKV, TinyConfig, TinyLM, policy_state

GPT = TinyConfig(vocab_size=29, d_model=32, n_layer=2, n_head=4, max_len=64, seed=5)
LLAMA = TinyConfig(vocab_size=29, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_len=64, seed=5,
                   arch="llama", d_ff=48, tie_embeddings=False)


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama"])
def test_tuple_cache_decoding_matches_full_pass(cfg):
    model = TinyLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, _ = model(ids)
        logits, kv = model(ids[:, :5])
        steps = [logits]
        for t in range(5, 12):
            logits, kv = model(ids[:, t : t + 1], kv)
            steps.append(logits)
    assert kv[0][0].shape == (2, cfg.kv_heads, 12, cfg.head_dim)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama"])
def test_slot_cache_rows_at_different_lengths_match_their_own_full_pass(cfg):
    model = TinyLM(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (3, 9, 6)]
    cache = SlotKV(cfg, capacity=3, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        for slot, s in enumerate(seqs):  # prefill all but the last token, one slot each
            model(s[:-1][None], cache.bind(slot, [0]))
        lengths = [len(s) - 1 for s in seqs]
        last = torch.stack([s[-1] for s in seqs])[:, None]
        batched, _ = model(last, cache.bind(0, lengths))
        for row, s in enumerate(seqs):
            alone, _ = model(s[None])
            torch.testing.assert_close(batched[row, -1], alone[0, -1], atol=1e-5, rtol=1e-5)


def test_init_depends_on_seed_only_and_value_head():
    a, b = TinyLM(GPT), TinyLM(GPT)
    torch.manual_seed(123)  # global RNG state must not matter
    c = TinyLM(GPT)
    d = TinyLM(TinyConfig(**{**GPT.__dict__, "seed": 6}))
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]) and torch.equal(v, c.state_dict()[k])
    assert not torch.equal(a.state_dict()["blocks.0.attn.q_proj.weight"], d.state_dict()["blocks.0.attn.q_proj.weight"])
    with_value = TinyLM(TinyConfig(**{**GPT.__dict__, "value_head": True}))
    ids = torch.randint(0, GPT.vocab_size, (3, 7))
    logits, values = with_value.logits_and_values(ids)
    assert logits.shape == (3, 7, GPT.vocab_size) and values.shape == (3, 7)
    assert not any(k.startswith("value_head") for k in policy_state(with_value))
    with pytest.raises(ValueError, match="value_head"):
        a.values(ids)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="TinyConfig.arch"):
        TinyConfig(arch="rnn")
    with pytest.raises(ValueError, match="TinyConfig.d_model"):
        TinyConfig(d_model=30, n_head=4)
    with pytest.raises(ValueError, match="max_len"):
        TinyLM(GPT)(torch.zeros(1, GPT.max_len + 1, dtype=torch.long))
