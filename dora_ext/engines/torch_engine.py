"""`TorchEngine`: one rollout instance of the embedded runtime.

It holds one policy version and decodes many sequences with continuous batching: each `step()`
admits queued sequences into free slots (prefilling them), then advances every running sequence
by one token; finished sequences leave at once and free their slot.

KV cache (`models.tiny.SlotKV`): running sequences occupy slots ``0..n-1`` (a leaver's slot takes
the last one), so a decode step costs in proportion to the running sequences, not the capacity. A
cache covers all tokens but the last, so prefill is "cache ``tokens[:-1]``" for a fresh prompt and
a resumed one alike, and a same-version migration (R5) carries its cache and needs no prefill.

Each sequence samples from its own seeded `torch.Generator`, so its tokens do not depend on its
batch or instance (up to float rounding). An engine touches no global torch setting, so several
can run in one process, one thread each.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Mapping, Sequence

import torch

from dora_ext.models.tiny import SlotKV, TinyConfig, TinyLM

FINISH_REASONS = ("stop", "length")
KV = tuple[tuple[torch.Tensor, torch.Tensor], ...]


class EngineError(RuntimeError):
    """The engine was asked for something its state does not allow (the message says what)."""


def default_device(device: str | torch.device | None = None) -> torch.device:
    """`device` if given, else the environment variable `DORA_EXT_DEVICE`, else CUDA when present, else CPU."""
    choice = device if device is not None else os.environ.get("DORA_EXT_DEVICE") or None
    if choice is None:
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


@dataclass(frozen=True)
class SamplingParams:
    """`temperature` 0 means greedy. `top_p` < 1 samples from the smallest set of tokens whose
    probability reaches `top_p` (nucleus sampling)."""

    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"SamplingParams.temperature: a number >= 0 (0 = greedy), got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"SamplingParams.top_p: a number in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class Finished:
    """A completed trajectory.

    `logprobs[i]`: log pi(response_ids[i]) under the generating weights, temperature-scaled, before
    top-p truncation (the behaviour log-prob off-policy corrections need). `versions[i]`: the
    version that produced token i (they differ only after a ``partial`` resume). `prefills`: how
    often its context was prefilled (0 if it arrived by migration with its cache).
    """

    request_id: Hashable
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: str
    version: int
    prefills: int


@dataclass
class SequenceState:
    """A sequence taken out of an engine (`export_sequence`), to be continued elsewhere. `kv` (per
    layer `(k, v)`, `[n_kv_head, T, head_dim]`, all tokens but the last) is valid only under
    `version`; None means the importer must prefill."""

    request_id: Hashable
    prompt_ids: tuple[int, ...]
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    rng_state: torch.Tensor
    version: int | None
    kv: KV | None
    prefills: int


@dataclass
class EngineStats:
    """Counters of work done, for metrics and for tests that check what did (not) happen."""

    prefills: int = 0
    prefill_tokens: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    imports: int = 0
    exports: int = 0
    weight_loads: int = 0
    load_seconds: float = 0.0


@dataclass(eq=False)
class _Seq:
    request_id: Hashable
    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    gen: torch.Generator
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kv_len: int = 0  # positions held in the cache (all tokens but the last once running)
    pending_kv: KV | None = None  # imported cache, written into a slot on admission
    prefills: int = 0

    @property
    def last_token(self) -> int:
        return self.response[-1] if self.response else self.prompt[-1]


class TorchEngine:
    """One rollout instance: a `TinyLM` holding one version, a slot KV cache of `capacity` sequences.

    `submit(...)` requests and call `step()` for `Finished` records. Switch weights with
    `load_version` once nothing runs (R4), or `pause_all()` / `load_version` / `resume()` (``partial``)."""

    def __init__(
        self,
        model_config: TinyConfig,
        capacity: int,
        stop_token_id: int | None,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        instance_id: int = 0,
    ):
        if not (isinstance(capacity, int) and capacity >= 1):
            raise ValueError(f"TorchEngine.capacity: an integer >= 1, got {capacity!r}")
        if stop_token_id is not None and not 0 <= stop_token_id < model_config.vocab_size:
            raise ValueError(f"TorchEngine.stop_token_id: in [0, {model_config.vocab_size}) or None, "
                             f"got {stop_token_id!r}")
        self.instance_id = instance_id
        self.capacity = capacity
        self.stop_token_id = stop_token_id
        self.device = default_device(device)
        self.config = dataclasses.replace(model_config, value_head=False)
        self.model = TinyLM.empty(self.config, self.device, dtype).eval()  # weights come with load_version
        self.model.requires_grad_(False)
        self.version: int | None = None
        self.stats = EngineStats()
        self._kv = SlotKV(self.config, capacity, self.device, dtype)
        self._slots: list[_Seq] = []  # running, slot i = index i
        self._queue: deque[_Seq] = deque()
        self._paused: list[_Seq] = []

    # ------------------------------------------------------------------ inspection
    @property
    def running(self) -> tuple[Hashable, ...]:
        return tuple(s.request_id for s in self._slots)

    @property
    def queued(self) -> tuple[Hashable, ...]:
        return tuple(s.request_id for s in self._queue)

    @property
    def paused(self) -> tuple[Hashable, ...]:
        return tuple(s.request_id for s in self._paused)

    @property
    def has_work(self) -> bool:
        """True while `step()` would advance something."""
        return bool(self._slots or self._queue)

    def progress(self) -> dict[Hashable, int]:
        """Response tokens generated so far for every sequence the engine holds."""
        return {s.request_id: len(s.response) for s in (*self._slots, *self._queue, *self._paused)}

    # ------------------------------------------------------------------ weights
    def load_version(self, state_dict: Mapping[str, torch.Tensor], version: int) -> float:
        """Copy published weights into the model; return the seconds the copy took. Refused while a
        sequence holds KV of the current weights: finish it (R4) or `pause_all()` first (``partial``)."""
        holding = [s.request_id for s in self._slots] + [s.request_id for s in self._queue if s.pending_kv is not None]
        if holding:
            raise EngineError(f"instance {self.instance_id}: cannot load version {version} while "
                              f"{len(holding)} sequences hold KV of version {self.version} "
                              f"(e.g. {holding[0]!r}); let them finish or pause_all() first")
        weights = {k: v for k, v in state_dict.items() if not k.startswith("value_head.")}
        start = time.perf_counter()
        with torch.no_grad():
            self.model.load_state_dict(weights, strict=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        self.version = version
        self.stats.weight_loads += 1
        self.stats.load_seconds += seconds
        return seconds

    # ------------------------------------------------------------------ requests
    def submit(
        self,
        request_id: Hashable,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        seed: int = 0,
    ) -> None:
        """Queue a request; it joins the batch at the next `step()` with a free slot."""
        if request_id in self.progress():
            raise EngineError(f"instance {self.instance_id}: request_id {request_id!r} is already held")
        prompt = tuple(int(t) for t in prompt_ids)
        if not prompt:
            raise ValueError("submit: prompt_ids must hold at least one token")
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"submit: prompt_ids must lie in [0, {self.config.vocab_size}), got {bad[0]}")
        if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
            raise ValueError(f"submit: max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if len(prompt) + max_new_tokens > self.config.max_len:
            raise ValueError(f"submit: prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"the model's max_len {self.config.max_len}")
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"submit: sampling must be a SamplingParams, got {type(sampling).__name__}")
        gen = torch.Generator(device=self.device).manual_seed(int(seed))
        self._queue.append(_Seq(request_id, prompt, max_new_tokens, sampling, gen))

    def abort(self, request_id: Hashable) -> bool:
        """Drop a sequence wherever it is; False if the engine does not hold it."""
        try:
            self._take(request_id)
        except KeyError:
            return False
        return True

    # ------------------------------------------------------------------ decoding
    def step(self) -> list[Finished]:
        """Admit queued sequences into free slots, then advance every running sequence by one token."""
        if not self.has_work:
            return []
        if self.version is None:
            raise EngineError(f"instance {self.instance_id}: no version loaded; call load_version first")
        with torch.inference_mode():
            self._admit()
            seqs = self._slots
            last = torch.tensor([[s.last_token] for s in seqs], device=self.device)
            logits, _ = self.model(last, self._kv.bind(0, [s.kv_len for s in seqs]))
            tokens, logps = self._sample(logits[:, -1].float(), seqs)
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(seqs)
        done: list[tuple[int, str]] = []
        for i, (s, tok, lp) in enumerate(zip(seqs, tokens, logps)):
            s.kv_len += 1
            s.response.append(tok)
            s.logprobs.append(lp)
            s.versions.append(self.version)
            if tok == self.stop_token_id:
                done.append((i, "stop"))
            elif len(s.response) >= s.max_new_tokens:
                done.append((i, "length"))
        finished = [self._finished(seqs[i], reason) for i, reason in done]
        self._release([i for i, _ in done])
        return finished

    def run_until_done(self) -> list[Finished]:
        """Step until nothing is queued or running (convenience for evaluation and tests)."""
        out: list[Finished] = []
        while self.has_work:
            out.extend(self.step())
        return out

    def _admit(self) -> None:
        # Prefills of consecutive admitted sequences with equal context lengths run as one batched
        # forward (their slots are consecutive), as a serving engine batches its prefills.
        run: list[tuple[int, list[int]]] = []  # (slot, context) waiting for one batched prefill

        def prefill() -> None:
            if run:
                ids = torch.tensor([c for _, c in run], device=self.device)
                self.model(ids, self._kv.bind(run[0][0], [0] * len(run)))
                run.clear()

        while self._queue and len(self._slots) < self.capacity:
            s = self._queue.popleft()
            slot = len(self._slots)
            context = [*s.prompt, *s.response][:-1] if s.pending_kv is None else []
            if not context or (run and len(run[0][1]) != len(context)):
                prefill()  # the batch is consecutive slots of one context length
            if s.pending_kv is not None:
                self._kv.write(slot, s.pending_kv)
                s.pending_kv = None
            else:
                if context:
                    run.append((slot, context))
                s.kv_len = len(context)
                s.prefills += 1
                self.stats.prefills += 1
                self.stats.prefill_tokens += len(context)
            self._slots.append(s)
        prefill()

    def _sample(self, logits: torch.Tensor, seqs: list[_Seq]) -> tuple[list[int], list[float]]:
        """Greedy rows take the argmax; the others draw one uniform number from their own
        generator and invert the (top-p truncated) CDF, so the draw does not depend on the batch."""
        temps = torch.tensor([s.sampling.temperature or 1.0 for s in seqs], device=logits.device)
        logp = torch.log_softmax(logits / temps[:, None], dim=-1)
        tokens = logp.argmax(-1)
        rows = [i for i, s in enumerate(seqs) if not s.sampling.greedy]
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            probs = logp[idx].exp()
            top_p = torch.tensor([seqs[i].sampling.top_p for i in rows], device=logits.device)
            u = torch.cat([torch.rand(1, generator=seqs[i].gen, device=logits.device) for i in rows])
            if bool((top_p < 1).any()):
                sorted_p, order = probs.sort(-1, descending=True)
                before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
                sorted_p = sorted_p.masked_fill((before >= top_p[:, None]) & (top_p[:, None] < 1), 0.0)
                cdf = sorted_p.cumsum(-1)
                j = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_(max=cdf.shape[1] - 1)
                tokens[idx] = order.gather(1, j).squeeze(1)
            else:  # nothing truncated: the CDF in vocabulary order, no sort (the same distribution)
                cdf = probs.cumsum(-1)
                # u = 0 would stop on token 0 whatever its probability (nothing sorted first): a
                # target above 0 lands on a token of positive probability (its CDF step is > 0)
                v = (u * cdf[:, -1]).clamp(min=torch.finfo(cdf.dtype).tiny)
                j = torch.searchsorted(cdf, v[:, None]).clamp_(max=cdf.shape[1] - 1)
                tokens[idx] = j.squeeze(1)
        chosen = logp.gather(1, tokens[:, None]).squeeze(1)
        if rows:
            # The behaviour probability of a top-p draw is that of the truncated, renormalised
            # distribution it came from: p(token) / (mass kept), not p(token).
            truncated = top_p < 1
            if bool(truncated.any()):
                kept = cdf[:, -1].clamp(min=1e-30)
                renorm = chosen[idx] - torch.log(kept)
                chosen[idx] = torch.where(truncated, renorm, chosen[idx])
        return tokens.tolist(), chosen.tolist()

    def _finished(self, s: _Seq, reason: str) -> Finished:
        return Finished(s.request_id, s.prompt, tuple(s.response), tuple(s.logprobs), tuple(s.versions),
                        reason, self.version, s.prefills)

    def _release(self, slots: Iterable[int]) -> None:
        """Remove running sequences, keeping the others in slots 0..n-1 (descending order makes
        the moved last sequence always a survivor)."""
        for i in sorted(slots, reverse=True):
            last = len(self._slots) - 1
            if i != last:
                moved = self._slots[last]
                self._kv.move(last, i, moved.kv_len)
                self._slots[i] = moved
            self._slots.pop()

    # ------------------------------------------------------------------ migration and preemption
    def _take(self, request_id: Hashable) -> tuple[_Seq, KV | None]:
        for i, s in enumerate(self._slots):
            if s.request_id == request_id:
                kv = self._kv.read(i, s.kv_len)
                self._release([i])
                return s, kv
        for s in self._queue:
            if s.request_id == request_id:
                self._queue.remove(s)
                return s, s.pending_kv
        for s in self._paused:
            if s.request_id == request_id:
                self._paused.remove(s)
                return s, None
        raise KeyError(request_id)

    def export_sequence(self, request_id: Hashable, include_kv: bool = True) -> SequenceState:
        """Take a sequence out with its tokens, log-probs, cache and sampler state (`include_kv=False`:
        the importer re-prefills)."""
        try:
            s, kv = self._take(request_id)
        except KeyError:
            raise EngineError(f"instance {self.instance_id}: export_sequence: "
                              f"unknown request_id {request_id!r}") from None
        self.stats.exports += 1
        return SequenceState(s.request_id, s.prompt, list(s.response), list(s.logprobs), list(s.versions),
                             s.max_new_tokens, s.sampling, s.gen.get_state(),
                             self.version, kv if include_kv else None, s.prefills)

    def import_sequence(self, state: SequenceState) -> None:
        """Queue an exported sequence at the front. With a cache the engine must hold the same
        version (no prefill then); without one it is prefilled under this engine's version.
        """
        if state.kv is not None and state.version != self.version:
            raise EngineError(f"instance {self.instance_id}: import_sequence {state.request_id!r}: its KV is of "
                              f"version {state.version} but this instance holds {self.version}; "
                              "same-version migration only (export with include_kv=False to re-prefill)")
        if state.request_id in self.progress():
            raise EngineError(f"instance {self.instance_id}: request_id {state.request_id!r} is already held")
        gen = torch.Generator(device=self.device)
        gen.set_state(state.rng_state)
        s = _Seq(state.request_id, tuple(state.prompt_ids), state.max_new_tokens, state.sampling, gen,
                 list(state.response_ids), list(state.logprobs), list(state.versions), prefills=state.prefills)
        if state.kv is not None:
            s.pending_kv = tuple((k.to(self.device), v.to(self.device)) for k, v in state.kv)
            s.kv_len = state.kv[0][0].shape[1]
        self._queue.appendleft(s)
        self.stats.imports += 1

    def pause_all(self) -> list[Hashable]:
        """Park every running sequence until `resume()` and drop all KV (mode ``partial``, before a
        weight load); imported queued ones will be prefilled. Returns the parked ids.
        """
        parked = [s.request_id for s in self._slots]
        for s in self._slots:
            s.kv_len = 0
        self._paused.extend(self._slots)
        self._slots.clear()
        for s in self._queue:
            s.pending_kv, s.kv_len = None, 0
        return parked

    def resume(self) -> list[Hashable]:
        """Put parked sequences back at the front of the queue; they re-prefill under the loaded version."""
        ids = [s.request_id for s in self._paused]
        self._queue.extendleft(reversed(self._paused))
        self._paused.clear()
        return ids
