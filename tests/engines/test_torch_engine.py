"""TorchEngine specifications: continuous batching, log-probs, migration, version loads.

All engines run the real TinyLM on CPU (or CUDA when present); nothing is faked.
"""

import math
import threading

import pytest
import torch

from dora_ext.engines import GREEDY, EngineError, SamplingParams, TorchEngine, default_device
from dora_ext.models import TinyConfig, TinyLM, policy_state

CFG = TinyConfig(vocab_size=32, d_model=32, n_layer=2, n_head=4, max_len=96, seed=11)
PROMPTS = {f"r{i}": [1, *[(3 + 5 * i + j) % 32 for j in range(1 + i % 5)]] for i in range(7)}
BUDGET = {rid: 6 + 5 * i for i, rid in enumerate(PROMPTS)}  # different lengths: sequences leave at different steps


@pytest.fixture(scope="module")
def weights():
    return policy_state(TinyLM(CFG))


def perturbed(weights, scale=0.05, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in weights.items()}


def engine(weights, capacity=3, version=0, stop=None):
    e = TorchEngine(CFG, capacity, stop, device=default_device())
    e.load_version(weights, version)
    return e


def run_alone(weights, rid, prompt, budget, sampling=GREEDY, seed=0, version=0, stop=None):
    e = engine(weights, capacity=1, version=version, stop=stop)
    e.submit(rid, prompt, budget, sampling, seed)
    (f,) = e.run_until_done()
    return f


def test_continuous_batching_returns_the_tokens_of_one_at_a_time_decoding(weights):
    e = engine(weights, capacity=3)
    for rid, prompt in PROMPTS.items():
        e.submit(rid, prompt, BUDGET[rid], GREEDY)
    finished, joined_while_running, widths = {}, 0, []
    while e.has_work:
        before = set(e.running)
        done = e.step()
        widths.append(len(before | {f.request_id for f in done} | set(e.running)))
        joined_while_running += bool(before) and bool(set(e.running) - before)
        finished.update({f.request_id: f for f in done})
    # the batch really was continuous: full width, and sequences joined while others ran
    assert max(widths) == 3 and joined_while_running >= 2
    for rid, prompt in PROMPTS.items():
        ref = run_alone(weights, rid, prompt, BUDGET[rid])
        got = finished[rid]
        assert got.response_ids == ref.response_ids
        assert got.finish_reason == "length" and len(got.response_ids) == BUDGET[rid]
        assert got.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
        assert got.prompt_ids == tuple(prompt) and got.versions == (0,) * BUDGET[rid] and got.prefills == 1


def truncated_logprob(logits: torch.Tensor, token: int, temperature: float, top_p: float) -> float:
    """log p(token) under the top-p distribution, computed plainly: keep the most likely tokens in
    order until their mass reaches top_p (the token that crosses it included), renormalise."""
    probs = torch.softmax(logits.double() / temperature, -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p and top_p < 1:
            break
        kept.append(i)
        mass += probs[i]
    assert token in kept, "a top-p draw returned a token outside the nucleus"
    return float(torch.tensor(probs[token] / mass).log())


def _record_prefills(e) -> list:
    """A list that gets the (rows, tokens) shape of every prefill forward `e`'s model runs."""
    calls: list = []
    real = e.model.forward

    def spy(ids, past=None):
        if ids.shape[1] > 1:
            calls.append(tuple(ids.shape))
        return real(ids, past)

    e.model.forward = spy
    return calls


def test_prompts_of_one_length_admitted_together_prefill_in_one_batched_pass(weights):
    """Equal-length prompts admitted in the same step share one prefill forward (consecutive slots); a different length
    starts a new one. The tokens and log-probs are those of one-at-a-time decoding."""
    e = engine(weights, capacity=6)
    calls = _record_prefills(e)
    prompts = {"a": [1, 2, 3], "b": [1, 4, 5], "c": [1, 6, 7], "d": [1, 2, 3, 4], "e": [1, 3, 3, 4], "f": [2, 2, 2]}
    for rid, p in prompts.items():
        e.submit(rid, p, 5, GREEDY)
    got = {f.request_id: f for f in e.run_until_done()}
    assert calls == [(3, 2), (2, 3), (1, 2)]  # a b c | d e | f (contexts: the prompt but its last token)
    assert e.stats.prefills == 6 and e.stats.prefill_tokens == 2 + 2 + 2 + 3 + 3 + 2
    for rid, p in prompts.items():
        ref = run_alone(weights, rid, p, 5)
        assert got[rid].response_ids == ref.response_ids
        assert got[rid].logprobs == pytest.approx(ref.logprobs, abs=1e-5)


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(0.7, 0.9), SamplingParams(1.3, 1.0), SamplingParams(1.0, 0.5)],
                         ids=["greedy", "t0.7-p0.9", "t1.3", "t1-p0.5"])
def test_logprobs_match_a_fresh_full_forward_pass(weights, sampling):
    """Behaviour log-probs are those of the distribution each token was drawn from: after
    temperature and after top-p truncation (renormalised over the nucleus)."""
    e = engine(weights, capacity=4)
    for i, (rid, prompt) in enumerate(PROMPTS.items()):
        e.submit(rid, prompt, BUDGET[rid], sampling, seed=i)
    model = TinyLM(CFG)
    model.load_state_dict(weights)
    temperature = sampling.temperature or 1.0
    truncated = 0
    for f in e.run_until_done():
        ids = torch.tensor([[*f.prompt_ids, *f.response_ids]])
        with torch.no_grad():
            logits = model(ids)[0][0]
        P = len(f.prompt_ids)
        if sampling.greedy:
            logp = torch.log_softmax(logits / temperature, -1)
            ref = [logp[P - 1 + j, tok].item() for j, tok in enumerate(f.response_ids)]
        else:
            ref = [truncated_logprob(logits[P - 1 + j], tok, temperature, sampling.top_p)
                   for j, tok in enumerate(f.response_ids)]
            full = torch.log_softmax(logits / temperature, -1)
            truncated += sum(abs(r - full[P - 1 + j, tok].item()) > 1e-3 for j, (r, tok) in
                             enumerate(zip(ref, f.response_ids)))
        assert f.logprobs == pytest.approx(ref, abs=1e-4)
    if not sampling.greedy and sampling.top_p < 1:
        assert truncated > 0  # the truncation really changed the probabilities checked


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampled_first_tokens_follow_the_model_distribution(weights, top_p):
    """Frequencies of 3,000 first tokens (one seed each) against the softmax (top_p = 1: no sort,
    the CDF in vocabulary order) or the truncated, renormalised nucleus (top_p < 1)."""
    prompt, n = PROMPTS["r3"], 3000
    model = TinyLM(CFG)
    model.load_state_dict(perturbed(weights, scale=1.0, seed=3))  # a peaked, non-uniform distribution
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0][0, -1]
    want = torch.tensor([math.exp(truncated_logprob(logits, t, 1.0, top_p)) if t in nucleus(logits, top_p) else 0.0
                         for t in range(CFG.vocab_size)])
    e = engine(model.state_dict(), capacity=64)
    for i in range(n):
        e.submit(f"s{i}", prompt, 1, SamplingParams(1.0, top_p), seed=i)
    counts = torch.zeros(CFG.vocab_size)
    for f in e.run_until_done():
        counts[f.response_ids[0]] += 1
    assert float(want.max()) > 0.2  # peaked enough that a wrong mapping shows
    assert float((counts / n - want).abs().max()) < 0.03


def nucleus(logits: torch.Tensor, top_p: float) -> set:
    probs = torch.softmax(logits.double(), -1).tolist()
    kept, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        if mass >= top_p and top_p < 1:
            break
        kept.add(i)
        mass += probs[i]
    return kept


def test_sampling_is_reproducible_per_request_whatever_the_batch(weights):
    sampling = SamplingParams(1.0, 0.95)
    alone = run_alone(weights, "x", PROMPTS["r2"], 30, sampling, seed=7)
    e = engine(weights, capacity=4)
    for i, (rid, prompt) in enumerate(PROMPTS.items()):
        e.submit(rid, prompt, BUDGET[rid], sampling, seed=100 + i)
    e.step()
    e.submit("x", PROMPTS["r2"], 30, sampling, seed=7)
    batched = {f.request_id: f for f in e.run_until_done()}["x"]
    assert batched.response_ids == alone.response_ids
    other_seed = run_alone(weights, "x", PROMPTS["r2"], 30, sampling, seed=8)
    assert other_seed.response_ids != alone.response_ids


def test_tiny_top_p_keeps_only_the_most_likely_token(weights):
    greedy = run_alone(weights, "g", PROMPTS["r3"], 20)
    nucleus = run_alone(weights, "g", PROMPTS["r3"], 20, SamplingParams(1.0, 1e-6), seed=3)
    assert nucleus.response_ids == greedy.response_ids
    # the truncated distribution holds one token: each draw had probability 1
    assert nucleus.logprobs == pytest.approx([0.0] * len(nucleus.logprobs), abs=1e-5)
    assert max(greedy.logprobs) < -0.01


def test_stop_token_and_max_length(weights):
    free = run_alone(weights, "s", PROMPTS["r4"], 40)
    stop = free.response_ids[5]
    first = free.response_ids.index(stop)
    stopped = run_alone(weights, "s", PROMPTS["r4"], 40, stop=stop)
    assert stopped.finish_reason == "stop"
    assert stopped.response_ids == free.response_ids[: first + 1]  # the stop token is kept (it was sampled)
    short = run_alone(weights, "s", PROMPTS["r4"], 3, stop=stop) if first >= 3 else None
    if short is not None:
        assert short.finish_reason == "length" and len(short.response_ids) == 3


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(1.0, 1.0)], ids=["greedy", "sampled"])
def test_same_version_migration_continues_token_identically_without_prefill(weights, sampling):
    ref = run_alone(weights, "m", PROMPTS["r5"], 40, sampling, seed=4, version=3)
    a, b = engine(weights, capacity=3, version=3), engine(weights, capacity=2, version=3)
    a.submit("other", PROMPTS["r1"], 30, sampling, seed=1)
    a.submit("m", PROMPTS["r5"], 40, sampling, seed=4)
    b.submit("busy", PROMPTS["r2"], 12, sampling, seed=2)
    for _ in range(9):
        a.step()
        b.step()
    state = a.export_sequence("m")
    assert len(state.response_ids) == 9 and state.kv is not None
    assert "m" not in a.running and a.running == ("other",)
    b.import_sequence(state)
    prefills_before = b.stats.prefills
    done = {f.request_id: f for f in b.run_until_done()}
    assert b.stats.prefills == prefills_before  # the KV moved; nothing was re-prefilled
    got = done["m"]
    assert got.response_ids == ref.response_ids and got.prefills == 1
    assert got.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert {f.request_id for f in a.run_until_done()} == {"other"}


def test_migration_is_same_version_only_and_reprefill_is_counted(weights):
    ref = run_alone(weights, "m", PROMPTS["r5"], 30, version=3)
    a = engine(weights, version=3)
    a.submit("m", PROMPTS["r5"], 30, GREEDY)
    for _ in range(5):
        a.step()
    other = engine(weights, version=4)
    state = a.export_sequence("m")
    with pytest.raises(EngineError, match="same-version"):
        other.import_sequence(state)
    same = engine(weights, version=3)
    a.import_sequence(state)  # the refused sequence is not lost: take it back, then move it without KV
    same.import_sequence(a.export_sequence("m", include_kv=False))
    (got,) = same.run_until_done()
    assert same.stats.prefills == 1 and got.prefills == 2 and got.response_ids == ref.response_ids
    with pytest.raises(EngineError, match="unknown request_id"):
        a.export_sequence("m")


def test_loading_a_version_changes_outputs_exactly_when_weights_change(weights):
    e = engine(weights, capacity=2)
    e.submit("a", PROMPTS["r6"], 25, GREEDY)
    (v0,) = e.run_until_done()
    seconds = e.load_version(weights, 1)
    assert isinstance(seconds, float) and seconds > 0 and e.stats.weight_loads == 2
    e.submit("a", PROMPTS["r6"], 25, GREEDY)
    (v1,) = e.run_until_done()
    assert v1.response_ids == v0.response_ids and v1.logprobs == v0.logprobs
    assert v1.version == 1 and set(v1.versions) == {1}
    e.load_version(perturbed(weights), 2)
    e.submit("a", PROMPTS["r6"], 25, GREEDY)
    (v2,) = e.run_until_done()
    assert max(abs(x - y) for x, y in zip(v2.logprobs, v0.logprobs)) > 1e-3
    assert v2.response_ids != v0.response_ids


def test_load_is_refused_while_sequences_hold_kv(weights):
    e = engine(weights)
    e.submit("a", PROMPTS["r0"], 20, GREEDY)
    e.step()
    with pytest.raises(EngineError, match="pause_all"):
        e.load_version(weights, 1)


def test_two_versions_live_on_two_instances_in_two_threads(weights):
    new = perturbed(weights, seed=1)
    jobs = {0: (weights, ["r0", "r1", "r2", "r3"]), 1: (new, ["r3", "r4", "r5", "r6"])}
    engines, results = {}, {}
    for version, (w, rids) in jobs.items():
        engines[version] = engine(w, capacity=2, version=version)
        for rid in rids:
            engines[version].submit(rid, PROMPTS[rid], BUDGET[rid], GREEDY)

    def drive(version):
        results[version] = engines[version].run_until_done()

    threads = [threading.Thread(target=drive, args=(v,)) for v in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for version, (w, rids) in jobs.items():
        assert sorted(f.request_id for f in results[version]) == sorted(rids)
        for f in results[version]:
            assert set(f.versions) == {version}
            ref = run_alone(w, f.request_id, PROMPTS[f.request_id], BUDGET[f.request_id])
            assert f.response_ids == ref.response_ids
    # the shared request r3 was generated by both versions, and they disagree
    r3 = {v: next(f for f in results[v] if f.request_id == "r3") for v in jobs}
    assert r3[0].logprobs != r3[1].logprobs


def test_partial_mode_pause_load_resume_records_per_token_versions(weights):
    new = perturbed(weights, seed=2)
    e = engine(weights, capacity=2)
    e.submit("r2", PROMPTS["r2"], 20, GREEDY)
    e.submit("r3", PROMPTS["r3"], 20, GREEDY)
    for _ in range(6):
        e.step()
    assert sorted(e.pause_all()) == ["r2", "r3"] and e.running == () and not e.has_work
    assert e.step() == []  # paused sequences do not advance
    e.load_version(new, 1)
    assert sorted(e.resume()) == ["r2", "r3"]
    done = {f.request_id: f for f in e.run_until_done()}
    for rid in ("r2", "r3"):
        f = done[rid]
        assert f.versions == (0,) * 6 + (1,) * 14 and f.prefills == 2 and f.version == 1
        head = run_alone(weights, rid, PROMPTS[rid], 6)
        assert f.response_ids[:6] == head.response_ids
        # the tail is what version 1 says after the version-0 head: a re-prefill, not stale KV
        tail = run_alone(new, rid, [*PROMPTS[rid], *head.response_ids], 14)
        assert f.response_ids[6:] == tail.response_ids
        assert f.logprobs[6:] == pytest.approx(tail.logprobs, abs=1e-5)


def test_bad_requests_raise_clear_errors(weights):
    e = TorchEngine(CFG, 2, None, device="cpu")
    e.submit("a", [1, 2], 5)
    with pytest.raises(EngineError, match="no version loaded"):
        e.step()
    with pytest.raises(EngineError, match="already held"):
        e.submit("a", [1], 5)
    with pytest.raises(ValueError, match="prompt_ids must lie"):
        e.submit("b", [1, 99], 5)
    with pytest.raises(ValueError, match="max_len"):
        e.submit("b", [1], CFG.max_len)
    with pytest.raises(ValueError, match="max_new_tokens"):
        e.submit("b", [1], 0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(1.0, 0.0)
    with pytest.raises(ValueError, match="capacity"):
        TorchEngine(CFG, 0, None)
    assert e.abort("a") and not e.abort("a") and not e.has_work


def test_device_is_chosen_automatically_and_overridable(monkeypatch):
    monkeypatch.delenv("DORA_EXT_DEVICE", raising=False)
    assert default_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert default_device("cpu").type == "cpu"
    monkeypatch.setenv("DORA_EXT_DEVICE", "cpu")
    assert default_device().type == "cpu"
    assert TorchEngine(CFG, 1, None).device.type == "cpu"


@pytest.fixture(scope="module")
def trained():
    """A confident model: a tiny transformer warm-started on the long-tail task, whose greedy answer
    depends on the prompt (the pattern letters and the length), i.e. on the KV cache."""
    from dora_ext.tasks.long_tail import LongTailConfig, LongTailTask, warm_start

    task = LongTailTask(LongTailConfig(median=5, cap=10, cv=0.6, style="count_up"))
    model = TinyLM(task.model_config(d_model=48, n_layer=2, n_head=4, seed=3))
    warm_start(model, task, 250, seed=0, batch_size=16, lr=3e-3)
    prompts = [p for _, p in zip(range(40), task.prompts(seed=5)) if p.length >= 6][:3]
    return task, model.config, policy_state(model), prompts


def _migrate_greedy(task, config, weights, prompt, corrupt=None):
    """Decode `prompt` greedily on engine a for 5 tokens, move it with its cache to engine b
    (optionally corrupting the cache on the way), finish there."""
    a = TorchEngine(config, 2, task.stop_id, device=default_device())
    b = TorchEngine(config, 2, task.stop_id, device=default_device())
    a.load_version(weights, 1)
    b.load_version(weights, 1)
    a.submit("m", prompt.ids, task.max_new_tokens, GREEDY)
    for _ in range(5):
        a.step()
    state = a.export_sequence("m")
    if corrupt is not None:
        state.kv = tuple((corrupt(k), corrupt(v)) for k, v in state.kv)
    b.import_sequence(state)
    (f,) = b.run_until_done()
    return f


@pytest.mark.parametrize("corruption", ["none", "never-copied", "other-sequence"])
def test_token_identity_after_migration_catches_a_corrupted_cache(trained, corruption):
    """With a confident model the token check alone decides: an intact cache continues exactly as if never moved; a
    cache that was never copied, or another prompt's cache, changes the greedy tokens (a random near-uniform model would
    not show it: its argmax hardly depends on the context)."""
    task, config, weights, prompts = trained
    diffs = 0
    for i, prompt in enumerate(prompts):
        ref = run_alone_cfg(task, config, weights, prompt)
        assert task.reward(prompt, ref.response_ids) == 1.0  # really confident and right
        if corruption == "none":
            corrupt = None
        elif corruption == "never-copied":
            corrupt = torch.zeros_like  # a slot allocated but never copied into
        else:
            other = prompts[(i + 1) % len(prompts)]
            e = TorchEngine(config, 1, task.stop_id, device=default_device())
            e.load_version(weights, 1)
            e.submit("o", other.ids, task.max_new_tokens, GREEDY)
            for _ in range(5):
                e.step()
            other_kv = iter([t for kv in e.export_sequence("o").kv for t in kv])
            corrupt = lambda t, it=other_kv: next(it)  # noqa: E731  (another sequence's slot)
        got = _migrate_greedy(task, config, weights, prompt, corrupt)
        diffs += got.response_ids != ref.response_ids
    if corruption == "none":
        assert diffs == 0
    else:
        assert diffs == len(prompts)


def run_alone_cfg(task, config, weights, prompt):
    e = TorchEngine(config, 1, task.stop_id, device=default_device())
    e.load_version(weights, 1)
    e.submit("m", prompt.ids, task.max_new_tokens, GREEDY)
    (f,) = e.run_until_done()
    return f


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_zero_uniform_draw_never_picks_a_zero_probability_token(weights, monkeypatch, top_p):
    """Inverse-CDF sampling with u = 0 (torch.rand's range is [0, 1): about one draw in 2^24)
    must return a token of positive probability. In vocabulary order (top_p = 1, no sort) token 0
    comes first whatever its probability, so the search must take the first CDF value above u,
    not the first one equal to it (that token would come back with log-prob -inf)."""
    from dora_ext.engines.torch_engine import _Seq

    e = engine(weights)
    logits = torch.zeros(1, CFG.vocab_size)
    logits[0, 0] = -math.inf  # probability exactly 0
    logits[0, 5] = 2.0
    seq = _Seq("z", (1,), 1, SamplingParams(1.0, top_p), torch.Generator().manual_seed(0))
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.zeros(1, device=k.get("device")))
    tokens, logprobs = e._sample(logits, [seq])
    assert tokens[0] != 0 and math.isfinite(logprobs[0])
    if top_p < 1:
        assert tokens == [5]  # sorted: u = 0 is the most likely token


def test_batched_prefill_around_imported_sequences_keeps_every_output(weights):
    """Review of the batched prefill next to migrations: the queue holds a re-prefill import (context 3), a KV import
    (no prefill), then two fresh prompts of context 3. The KV import ends the run, so the prefills are [n] and [a, b]
    (never one batch across the imported cache's slot), and every sequence, sampled at t = 0.7, top_p = 0.9, is
    token-identical to decoding it alone with log-probs equal."""
    sampling = SamplingParams(0.7, 0.9)
    seeds = {"n": 5, "m": 6, "a": 7, "b": 8}
    prompts = {"n": PROMPTS["r0"], "m": PROMPTS["r5"], "a": [1, 2, 3, 4], "b": [2, 4, 6, 8]}
    assert len(prompts["n"]) == 2 and len(prompts["a"]) == len(prompts["b"]) == 4
    src = engine(weights, capacity=2, version=3)
    src.submit("n", prompts["n"], 12, sampling, seed=seeds["n"])
    src.submit("m", prompts["m"], 12, sampling, seed=seeds["m"])
    for _ in range(2):
        src.step()
    m_state, n_state = src.export_sequence("m"), src.export_sequence("n", include_kv=False)
    assert len(n_state.response_ids) == 2  # n's context: 2 + 2 - 1 = 3 tokens, as a's and b's
    dst = engine(weights, capacity=4, version=3)
    dst.submit("a", prompts["a"], 12, sampling, seed=seeds["a"])
    dst.submit("b", prompts["b"], 12, sampling, seed=seeds["b"])
    dst.import_sequence(m_state)
    dst.import_sequence(n_state)  # the queue: n, m, a, b
    calls = _record_prefills(dst)
    got = {f.request_id: f for f in dst.run_until_done()}
    assert calls == [(1, 3), (2, 3)]
    for rid, p in prompts.items():
        ref = run_alone(weights, rid, p, 12, sampling, seed=seeds[rid], version=3)
        assert got[rid].response_ids == ref.response_ids, rid
        assert got[rid].logprobs == pytest.approx(ref.logprobs, abs=1e-5), rid
