"""The ``dora_cpu`` replica's continuous batching is real and exact: a decode step is one batched
forward of the model over all running requests, and a request computes in a batch what it
computes alone.

Real: the replica's ``ServerCore`` and a tiny random-weight Llama model, or a Mistral one whose
attention window (4) is shorter than the requests (transformers' own model code, ``sdpa``). The
model's ``forward`` is wrapped only to record the shape of each call's ``input_ids`` (rows =
requests in that forward). Join steps are forced by awaiting the loop's own
state, not by time.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

# id: (prompt, sampling params, joins once request "a" has this many tokens)
REQUESTS = {
    "a": ([1, 5, 6, 7, 8, 9, 10], {"max_tokens": 8, "temperature": 0}, 0),
    "b": ([4, 5], {"max_tokens": 5, "temperature": 0}, 0),
    "c": ([11, 12, 13, 14], {"max_tokens": 6, "temperature": 0}, 2),
    "d": ([20, 21, 22], {"max_tokens": 4, "temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 7}, 3),
}


def _sliding_window_model(out: str) -> str:
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=128, sliding_window=4)).save_pretrained(out)
    return out


@pytest.fixture(params=["llama", "sliding_window"])
def core(request, tmp_path_factory, monkeypatch):
    """A replica with no step floor and no straggler, its forwards' ``input_ids`` shapes in ``shapes``."""
    from dora_ext.verl.cpu.rollout import ServerCore
    from dora_ext.verl.cpu.tiny import build_model

    monkeypatch.delenv("DORA_CPU_STEP_S", raising=False)
    monkeypatch.delenv("DORA_CPU_SLOW_REPLICAS", raising=False)
    core = ServerCore()
    build = build_model if request.param == "llama" else _sliding_window_model
    core._init_server(type("ModelConfig", (), {"local_path": build(str(tmp_path_factory.mktemp("m")))})(), 0)
    core.eos_ids = set()  # random tiny weights: each request runs to its own max_tokens
    core.shapes, forward = [], core.model.forward

    def recording(*args, **kwargs):
        core.shapes.append(tuple(kwargs["input_ids"].shape))
        return forward(*args, **kwargs)

    monkeypatch.setattr(core.model, "forward", recording)
    return core


def test_a_request_gets_in_a_batch_what_it_gets_alone(core):
    """Prompts of different lengths joining at different steps and leaving at different lengths;
    one of them sampled with its own seed, top_k and top_p. Each gets the tokens (exactly) and
    logprobs (within 1e-4) it gets when it runs alone."""

    async def batched():
        tasks = {}
        for rid, (prompt, params, after) in REQUESTS.items():
            while next((len(r.tokens) for r in core._running if r.id == "a"), 0) < after:
                await asyncio.sleep(0)
            tasks[rid] = asyncio.ensure_future(core.generate(rid, prompt, params))
        return {rid: await task for rid, task in tasks.items()}

    async def alone():
        return {rid: await core.generate(rid, prompt, params) for rid, (prompt, params, _) in REQUESTS.items()}

    together = asyncio.run(batched())
    shapes = list(core.shapes)
    assert shapes[0] == (2, 7), shapes  # a and b prefilled in one forward
    assert (3, 4) in shapes and (4, 3) in shapes, shapes  # c's, then d's, prefill beside the decoding ones
    single = asyncio.run(alone())
    for rid, (_, params, _) in REQUESTS.items():
        got, want = together[rid], single[rid]
        assert got.stop_reason == want.stop_reason == "length" and len(want.token_ids) == params["max_tokens"]
        assert got.token_ids == want.token_ids, rid
        assert max(abs(x - y) for x, y in zip(got.log_probs, want.log_probs)) < 1e-4, rid
    assert len({tuple(out.token_ids) for out in single.values()}) == len(REQUESTS)  # the prompts matter


def test_a_decode_step_of_n_running_requests_is_one_forward(core):
    """Three requests admitted together: one forward prefills all three, then each decode step
    is one forward with three rows (not one forward per request)."""

    async def run():
        params = {"max_tokens": 5, "temperature": 0}
        return await asyncio.gather(*(core.generate(f"r{i}", [1 + i] * (i + 1), params) for i in range(3)))

    outs = asyncio.run(run())
    assert [len(out.token_ids) for out in outs] == [5, 5, 5]
    assert core.shapes == [(3, 3)] + [(3, 1)] * 4, core.shapes


def test_a_prompt_the_model_cannot_take_is_refused_and_the_requests_beside_it_run_on(core):
    """An empty prompt or a token id outside the vocabulary fails its own generate() (vLLM's input
    processor refuses both); in the batched forward it would stop the decode loop for all."""

    async def run():
        good = asyncio.ensure_future(core.generate("good", [1, 5, 6], {"max_tokens": 4, "temperature": 0}))
        for rid, prompt in (("oov", [1, 999]), ("empty", [])):
            with pytest.raises(ValueError, match=rf"request {rid}: the prompt must be 1 or more token ids"):
                await asyncio.wait_for(core.generate(rid, prompt, {"max_tokens": 4}), 60)  # (a hang guard)
        return await asyncio.wait_for(good, 60)

    assert len(asyncio.run(run()).token_ids) == 4
