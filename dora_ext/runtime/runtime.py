"""The embedded runtime: the real scheduler driving real torch engines and a real trainer.

    prepared = prepare(recipe)                      # task, tokenizer, warm-started version 0
    result = run(recipe.with_mode("dora"), prepared)  # -> RunResult (design.md metrics)

Workers (`workers.py`): one per rollout instance and one for the trainer. Only the coordinator,
the thread that calls `run`, touches the `Scheduler`: it feeds each worker report to
`Scheduler.handle` and executes the returned actions as worker commands. It also plays the prompt
source and the reward function, and keeps its own ledger (which version generated each token,
which step trained each group) from which C1-C3 are measured independently of the scheduler.

Faults: a dead worker's complete reports are taken first (`_drain`). A dead instance is reported
(`InstanceFailed`) and replaced under a new id while `max_instance_restarts` allows; a dead
trainer, or no instance left, ends the run with `WorkerDied` naming `--resume`. With
`checkpoint_dir`/`checkpoint_every` the trainer and coordinator save every N steps; `resume=True`
continues from the newest complete checkpoint.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import queue
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, Sequence

import torch

from ..config import ConfigError, DoraConfig
from ..core import actions as A
from ..core import events as E
from ..core.scheduler import Scheduler
from .recipe import Recipe
from .workers import trainer_name

SEED_STRIDE = 1_000_003
# The coordinator's books a checkpoint saves and a resume restores (attributes of `Runtime`).
_LEDGER = ("prompts", "group_version", "results", "token_versions", "finish_reasons", "dispatch",
           "dispatch_versions", "first_dispatch", "step_groups", "trained", "step_end", "step_records",
           "failed_groups", "errors", "tokens_trained", "load_seconds", "loads", "migrations", "migration_log",
           "migrations_landed", "landings_sent", "served_by", "next_instance_id", "step_order", "rank_speed",
           "rank_tokens", "rank_seconds")


class RuntimeStall(RuntimeError):
    """No worker reported anything for `runtime.stall_timeout_s` although the run is not done."""


class WorkerDied(RuntimeError):
    """The trainer process (or the last rollout instance) exited during the run. The message names
    the last checkpoint and the `--resume` command that continues from it."""


# ---------------------------------------------------------------------------------- preparation
@dataclass
class Prepared:
    """What every mode of one seed shares (task, version 0, held-out prompts and their initial
    score), built once per seed so that modes start from identical weights."""

    task: Any
    model_config: Any
    weights: dict[str, torch.Tensor]
    eval_prompts: list
    initial_reward: float
    warm_start_s: float
    warm_start_loss: float | None
    seed: int


_PREPARED: dict[str, Prepared] = {}


def _prepare_key(recipe: Recipe) -> str:
    d = recipe.to_dict()
    return json.dumps({k: d[k] for k in ("seed", "task", "model", "warm_start", "eval", "engine")}, sort_keys=True)


def prepare(recipe: Recipe, *, device: torch.device | None = None) -> Prepared:
    """Build the task and version 0 (random init + supervised warm start), cached per seed."""
    from ..engines import default_device

    key = _prepare_key(recipe)
    if key in _PREPARED:
        return _PREPARED[key]
    dev = device or default_device(recipe.engine.device)
    with torch_threads(recipe.runtime.threads(recipe.runtime.cores)):
        prepared = _prepare(recipe, dev)
    _PREPARED[key] = prepared
    return prepared


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run a block with `n` torch intra-op threads in the calling thread."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _prepare(recipe: Recipe, dev: torch.device) -> Prepared:
    t0 = time.perf_counter()
    loss = None
    if recipe.model.type == "smollm2":
        from ..models.smollm2 import load_smollm2, load_tokenizer
        from ..tasks.count import CountConfig, CountTask

        task = CountTask(CountConfig(**recipe.task), tokenizer=load_tokenizer())
        model = load_smollm2(max_len=recipe.model.max_len)
    else:
        from ..models.tiny import TinyLM
        from ..tasks.long_tail import LongTailConfig, LongTailTask, warm_start

        task = LongTailTask(LongTailConfig(**recipe.task))
        model = TinyLM(task.model_config(**recipe.model.shape, seed=recipe.seed)).to(dev)
        if recipe.warm_start.steps:
            losses = warm_start(model, task, recipe.warm_start.steps, recipe.seed,
                                batch_size=recipe.warm_start.batch_size, lr=recipe.warm_start.lr)
            loss = losses[-1]
    if hasattr(task, "max_prompt_len"):
        _check_fits(model.config.max_len, task.max_prompt_len, task.max_new_tokens)
    from ..models.tiny import policy_state

    weights = policy_state(model, "cpu" if dev.type == "cpu" else dev)
    warm_s = time.perf_counter() - t0
    prompts = list(itertools.islice(task.prompts(seed=777_777), recipe.eval.prompts))
    initial = evaluate_policy(task, model.config, weights, prompts, recipe, dev)
    return Prepared(task, model.config, weights, prompts, initial, warm_s, loss, recipe.seed)


def _check_fits(max_len: int, prompt_len: int, new_tokens: int) -> None:
    if prompt_len + new_tokens > max_len:
        raise ValueError(f"model.max_len {max_len} < prompt {prompt_len} + max_new_tokens {new_tokens}")


def evaluate_policy(task: Any, model_config: Any, weights: dict, prompts: list, recipe: Recipe,
                    device: torch.device, seed_offset: int = 0) -> float:
    """Mean reward of `weights` on `prompts`, `recipe.eval.samples` sampled answers each, fixed seeds
    (`seed_offset` draws other ones: repeated evaluations of one policy measure the noise)."""
    from ..engines import SamplingParams, TorchEngine

    if not prompts:
        return float("nan")
    engine = TorchEngine(model_config, min(64, len(prompts) * recipe.eval.samples), task.stop_id, device=device)
    engine.load_version(weights, 0)
    sampling = SamplingParams(recipe.engine.temperature, recipe.engine.top_p)
    for p in prompts:
        for s in range(recipe.eval.samples):
            engine.submit((p.id, s), p.ids, task.max_new_tokens, sampling, seed=p.id * 131 + s + seed_offset)
    total = 0.0
    by_id = {p.id: p for p in prompts}
    for f in engine.run_until_done():
        total += task.reward(by_id[f.request_id[0]], f.response_ids)
    return total / (len(prompts) * recipe.eval.samples)


# ---------------------------------------------------------------------------------- results
@dataclass
class RunResult:
    """One mode, one seed. `metrics` uses design.md's names; `steps` has one dict per trainer step
    (the JSONL lines); the rest is what plots and tests need."""

    mode: str
    seed: int
    metrics: dict[str, Any]
    steps: list[dict[str, Any]]
    core_metrics: dict[str, Any]
    checks: dict[str, Any]
    t_end: float
    step_end: list[float]
    trainer_busy: list[tuple[float, float]]
    instance_logs: list[list[tuple[float, int]]]
    max_staleness: int
    split: str
    ledger: dict[str, Any] = field(default_factory=dict)
    versions: dict[int, dict[str, torch.Tensor]] | None = None

    def summary(self) -> dict[str, Any]:
        """JSON-able summary (no per-trajectory ledger, no weights)."""
        return {"mode": self.mode, "seed": self.seed, "split": self.split, "max_staleness": self.max_staleness,
                "metrics": self.metrics, "core_metrics": self.core_metrics, "checks": self.checks,
                "t_end": self.t_end}


# ---------------------------------------------------------------------------------- the runtime
class Runtime:
    """Run one mode of `recipe` from `prepared` (see the module docstring). Use `run()`.

    on_step(record): called with each trainer step's metrics line. keep_versions: keep every
    published version's weights. checkpoint_dir/checkpoint_every/resume: see the module docstring.
    instance_loops / trainer_loop: loop subclasses for tests (`runtime/faults.py`)."""

    def __init__(self, recipe: Recipe, prepared: Prepared, *, on_step: Callable[[dict], None] | None = None,
                 keep_versions: bool = False, device: torch.device | None = None,
                 checkpoint_dir: str | None = None, checkpoint_every: int = 0, resume: bool = False,
                 on_checkpoint: Callable[[int], None] | None = None,
                 instance_loops: dict[int, Any] | None = None, trainer_loop: Any = None) -> None:
        from ..engines import SamplingParams, default_device

        self.recipe = recipe
        self.config: DoraConfig = recipe.dora
        self.mode = self.config.mode
        self.prepared = prepared
        self.task = prepared.task
        response_s = recipe.engine.step_s * self.task.max_new_tokens
        if response_s >= recipe.runtime.stall_timeout_s:  # an instance reports once a sequence ends
            from ..config import ConfigError

            raise ConfigError("engine.step_s", f"{recipe.engine.step_s} s a decode step x max_new_tokens "
                              f"{self.task.max_new_tokens} = {response_s:g} s for one response, not below "
                              f"runtime.stall_timeout_s ({recipe.runtime.stall_timeout_s:g} s): a healthy run "
                              f"would be declared stuck; lower engine.step_s or raise runtime.stall_timeout_s")
        self.device = device or default_device(recipe.engine.device)
        self.sampling = SamplingParams(recipe.engine.temperature, recipe.engine.top_p)
        self.on_step = on_step
        self.keep_versions = keep_versions
        self.sched = Scheduler(self.config)
        self.t0 = time.perf_counter()
        self._outgoing: dict[int, list] = {}
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.colocated = self.mode == "sync"
        self.trainer_config = recipe.trainer_config()
        self.rank_speed: list[float | None] = [None]  # tokens per compute second of each trainer rank
        self.rank_tokens: list[int] = [0]  # tokens each trainer rank trained
        self.rank_seconds: list[list[float]] = [[0.0, 0.0]]  # per rank: [computing, in collectives]
        self._position = 0  # the next group's place in the trainer's current batch
        self._order: list = []  # the current batch's groups by position
        self.step_order: list[list] = []  # per step handed to the trainer: its groups by position
        self._rank_load: dict[int, list[float]] = {}  # minibatch -> tokens given to each rank this step
        self.versions: dict[int, dict[str, torch.Tensor]] = {0: prepared.weights}
        self._stream = self.task.prompts(seed=recipe.seed)
        # ledger
        self.prompts: dict[Hashable, Any] = {}
        self.group_version: dict[Hashable, int] = {}
        self.results: dict[Hashable, list] = {}
        self.token_versions: dict[tuple, tuple[int, ...]] = {}
        self.finish_reasons: dict[tuple, str] = {}
        self.dispatch: dict[tuple, list] = {}  # (gid, idx) -> [instance, version, attempt]
        self.dispatch_versions: dict[tuple, int] = {}
        self.first_dispatch: dict[Hashable, float] = {}
        self.delivered: set = set()
        self.step_groups: list[tuple] = []
        self.trained: dict[Hashable, list[int]] = {}
        self.step_end: list[float] = []
        self.step_records: list[dict[str, Any]] = []
        self.failed_groups: list[tuple[Hashable, str]] = []
        self.errors: list[str] = []
        self.load_seconds = 0.0
        self.loads = 0
        self.tokens_trained = 0
        self.migrations = 0
        # The runtime's own record of every move: ("move", gid, idx, attempt, src, dst) when a
        # `Migrate` is executed, ("imported", gid, idx, attempt, instance, outcome) for each
        # "imported" report read (outcome "landed": `MigrationLanded` fed to the scheduler; else
        # why not, see `_on_imported`).
        self.migration_log: list[tuple] = []
        self.migrations_landed = 0  # "imported" reports read: sequences a destination took in
        self.landings_sent = 0  # of those, answered to the scheduler with `MigrationLanded`
        self.failed_instances: dict[int, Any] = {}  # instance id -> exit code
        self.in_transit: dict[tuple, int] = {}  # (gid, idx) -> the instance exporting it
        self.instance_pids: dict[int, Any] = {}
        self.trainer_pid: Any = None
        self.instance_loops = dict(instance_loops or {})
        self.trainer_loop = trainer_loop
        self.trainer_handles: list[Any] = []
        self.instance_handles: dict[int, Any] = {}
        self.capacity_of = {s.id: s.capacity for s in self.config.instances}
        # Replacement instances join under ids never used before (nor by elastic spares).
        self.next_instance_id = (max(s.id for s in self.config.instances) + 1
                                 + (self.config.elastic_spare if self.config.elastic else 0))
        self.instance_restarts: list[tuple[int, int]] = []  # (dead instance, its replacement)
        self.restarts_left = recipe.runtime.max_instance_restarts
        self.starting: dict[int, tuple[Any, Any]] = {}  # replacement id -> (inbox, handle) until "ready"
        self.served_by: dict[tuple, int] = {}  # (gid, idx) -> the instance that reported it finished
        self.exports_dropped = 0  # exported sequences whose attempt was over when they reached us
        self.reports_lost: list[tuple[str, str]] = []  # (worker, why): complete reports that could not be read
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = checkpoint_every
        self.on_checkpoint = on_checkpoint
        self.t_offset = 0.0  # wall time of the run before a resume
        self.resumed_from: int | None = None
        self._trainer_resume: str | None = None
        if resume:
            if not checkpoint_dir:
                raise ValueError("resume: needs checkpoint_dir")
            self._load_checkpoint()
        elif checkpoint_dir:
            # A fresh run owns its checkpoint folder: a checkpoint left there by an earlier run
            # must never be what a later `--resume` of this run picks up.
            self._clear_checkpoints()

    # ------------------------------------------------------------------ cores
    @property
    def backend(self) -> str:
        b = self.recipe.runtime.backend
        if b == "auto":
            return "process" if self.device.type == "cpu" else "thread"
        return b

    def _layout(self) -> tuple[list[int], list[int], int, int]:
        """(rollout cpus, trainer cpus, threads per instance, trainer threads)."""
        import os

        rt = self.recipe.runtime
        n_inst = len(self.config.instances)
        cpus = sorted(os.sched_getaffinity(0))[: rt.cores] if hasattr(os, "sched_getaffinity") else []
        if self.colocated or rt.cores < 2:
            roll = train = cpus
            per_inst, t_threads = rt.threads(rt.cores // n_inst), rt.threads(rt.cores)
        else:
            roll, train = cpus[: rt.rollout_cores], cpus[rt.rollout_cores:]
            per_inst, t_threads = rt.threads(rt.rollout_cores // n_inst), rt.threads(rt.trainer_cores)
        if not rt.pin or self.device.type != "cpu":
            roll = train = []
        return roll, train, per_inst, t_threads

    @property
    def borrowing(self) -> bool:
        """Whether an asynchronous mode's trainer has a second, low-priority rank on the rollout
        cores (`runtime.trainer_borrow`; CPU, process backend, at least 2 cores)."""
        rt = self.recipe.runtime
        return (rt.trainer_borrow and not self.colocated and rt.cores >= 2 and self.backend == "process"
                and self.device.type == "cpu")

    @property
    def trainer_ranks(self) -> int:
        """Data-parallel trainer processes: several for colocated sync on the process backend (one
        per core by default), two for an asynchronous mode that borrows (`borrowing`)."""
        rt = self.recipe.runtime
        if self.borrowing:
            return 2
        if not self.colocated or self.backend != "process" or self.device.type != "cpu":
            return 1
        return rt.sync_trainer_ranks or rt.cores

    @property
    def split(self) -> str:
        rt = self.recipe.runtime
        if self.colocated or rt.cores < 2:
            return f"colocated:{rt.cores}"
        return f"{rt.rollout_cores}:{rt.trainer_cores}"

    def core_assignment(self) -> str:
        """What each worker ran on (reported affinity, nice when not 0, trainer ranks rank 0 first),
        e.g. `trainer 2 rank(s) @1 @0(nice 19)`."""
        def fmt(cpus: list[int]) -> str:
            return ",".join(map(str, cpus)) if cpus else "?"

        def nice(name: str) -> str:
            n = self.nice.get(name, 0)
            return f"(nice {n})" if n else ""

        inst = sorted((k, v) for k, v in self.affinity.items() if k.startswith("instance"))
        train = sorted((k, v) for k, v in self.affinity.items() if k.startswith("trainer"))
        pinned = "pinned" if self.recipe.runtime.pin and self.device.type == "cpu" else "unpinned"
        return (f"{pinned}; instances " + " ".join(f"{k.split('-')[-1]}@{fmt(v)}{nice(k)}" for k, v in inst)
                + f"; trainer {len(train)} rank(s) " + " ".join(f"@{fmt(v)}{nice(k)}" for k, v in train))

    # ------------------------------------------------------------------ main loop
    def run(self) -> RunResult:
        from .workers import (EngineRecipe, PackedWeights, PipeHub, TrainerRecipe, process_context, start_instances,
                              start_trainer)

        roll, train, per_inst, t_threads = self._layout()
        procs = self.backend == "process"
        self.outbox = PipeHub(process_context()) if procs else queue.SimpleQueue()
        if procs:
            self.versions = {v: w if isinstance(w, PackedWeights) else PackedWeights.pack(w, shared=True)
                             for v, w in self.versions.items()}
        dev = str(self.device)
        specs = {s.id: EngineRecipe(self.prepared.model_config, s.capacity, self.task.stop_id, dev,
                                    self.instance_loops.get(s.id), self.recipe.engine.step_s)
                 for s in self.config.instances}
        self._respawn = (per_inst, roll)  # a replacement instance gets the original's share
        v0 = self.versions.get(0)
        if v0 is None:  # a resumed run: version 0 (the KL reference) from the deterministic preparation
            v0 = PackedWeights.pack(self.prepared.weights, shared=True) if procs else self.prepared.weights
        trainer_spec = TrainerRecipe(self.prepared.model_config, dict(self.recipe.trainer), v0, dev,
                                     resume=self._trainer_resume, loop=self.trainer_loop)
        self.inboxes: dict[int, Any] = {}
        self._handles = handles = []
        self.trainer_inbox: Any = None
        self.trainer_inboxes: list[Any] = []
        self.affinity: dict[str, list[int]] = {}
        self.nice: dict[str, int] = {}
        self.instance_stats: dict[Any, dict] = {}
        self.torch_threads: dict[str, int] = {}
        ok = False
        import os

        pinned = bool(roll) and hasattr(os, "sched_setaffinity")
        old_affinity = os.sched_getaffinity(0) if pinned else None
        try:
            if pinned:
                # The coordinator (prompts, rewards, scheduling) is rollout-side work: it runs on the
                # rollout cores, never on the trainer's.
                os.sched_setaffinity(0, set(roll))
            ranks = self.trainer_ranks
            if len(self.rank_tokens) != ranks or self.resumed_from is None:  # a resume keeps the checkpoint's
                self.rank_speed = [None] * ranks
                self.rank_tokens = [0] * ranks
                self.rank_seconds = [[0.0, 0.0] for _ in range(ranks)]
            rank_threads = rank_nice = None
            if self.borrowing:
                # rank 0 on the trainer's cores; rank 1 on the rollout cores, below the instances' priority
                rt = self.recipe.runtime
                rank_cpus = [train, roll]
                rank_threads = [t_threads, rt.threads(rt.rollout_cores)]
                rank_nice = [0, rt.trainer_borrow_nice]
            else:
                rank_cpus = [[train[r % len(train)]] for r in range(ranks)] if (ranks > 1 and train) else None
            self.trainer_inboxes, ths = start_trainer(trainer_spec, 1 if ranks > 1 else t_threads, train, self.outbox,
                                                      self.backend, ranks, rank_cpus, rank_threads, rank_nice)
            self.trainer_inbox, th = self.trainer_inboxes[0], ths[0]
            self.trainer_handles = ths
            handles.extend(ths)
            self.inboxes, ih = start_instances(specs, per_inst, roll, self.outbox, self.backend)
            handles.extend(ih)
            self.instance_handles = dict(zip(specs, ih))
            self.instance_pids = {iid: getattr(h, "pid", None) for iid, h in self.instance_handles.items()}
            self.trainer_pid = getattr(th, "pid", None)
            self._wait_ready(len(specs) + len(ths), handles)
            self.t0 = time.perf_counter() - self.t_offset  # setup is not part of the run
            if self.resumed_from is None:
                self._execute(self.sched.start())
            else:
                self._restart_from_checkpoint()
            self._flush()
            stall = self.recipe.runtime.stall_timeout_s
            last_msg = last_check = time.perf_counter()
            while not self.sched.done:
                try:
                    msg = self.outbox.get(timeout=min(stall, 1.0))
                except queue.Empty:
                    msg = None
                now = time.perf_counter()
                if procs and (msg is None or now - last_check > 0.5):
                    last_check = now
                    self._watch(ths)
                if msg is None:
                    if now - last_msg > stall:
                        raise RuntimeStall(self._stall_report(stall))
                    self._flush()
                    continue
                last_msg = now
                self._on_message(msg)
                self._flush()
            t_end = self.step_end[-1] if self.step_end else self._now()
            ok = True
        finally:
            if pinned:
                os.sched_setaffinity(0, old_affinity)
            starting = list(self.starting.values())
            handles.extend(h for _, h in starting if h is not None)
            # Counted before "stop": a worker that reports and exits at once still has a report to read.
            reporting = sum(1 for h in handles if h.is_alive())
            for q in [*self.trainer_inboxes, *self.inboxes.values(), *(q for q, _ in starting)]:
                if q is not None:
                    q.put(("stop",))
            if ok:
                self._collect_stats(reporting, handles)
            for h in handles:
                h.join(timeout=10 if ok else 2)
                if h.is_alive() and hasattr(h, "terminate"):
                    h.terminate()
                    h.join(timeout=10)
            for q in [*self.trainer_inboxes, *self.inboxes.values(), *(q for q, _ in self.starting.values())]:
                if hasattr(q, "cancel_join_thread"):
                    q.cancel_join_thread()  # never block interpreter exit on a queue nobody reads
        return self._result(t_end)

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    def _watch(self, trainer: list) -> None:
        """Find worker processes that exited: take what they left (`_drain`), then report a dead
        instance (`InstanceFailed`) and restart it while restarts are left; a dead trainer, or no
        instance left, ends the run with `WorkerDied`."""
        if len(trainer) > 1 and any(not t.is_alive() for t in trainer):
            self._ranks_failed({})  # which rank died, and which only failed with it
        for t in trainer:
            if not t.is_alive():
                rank = int(t.name.rsplit("-", 1)[1])
                tname = trainer_name(rank)
                lost = [why for n, why in self.reports_lost if n == tname]
                errors = self._drain(tname, fatal=False)
                what = f"the trainer process exited (exit code {t.exitcode})"
                if errors:
                    what += f" after reporting: {errors[0]}"
                elif lost:
                    what += f", ended by the coordinator: a report of it could not be read ({lost[0]})"
                raise WorkerDied(self._died_message(what))
        for iid, (inbox, h) in list(self.starting.items()):
            if not h.is_alive():  # died before it was ready: it never joined the scheduler
                del self.starting[iid]
                self._drain(f"instance-{iid}")
                self.failed_instances[iid] = h.exitcode
                self._close_inbox(inbox)
                self._restart(iid)
        for iid, h in list(self.instance_handles.items()):
            if h.is_alive():
                continue
            self.failed_instances[iid] = h.exitcode  # first: what `_drain` takes knows it is dead
            self._drain(f"instance-{iid}")
            del self.instance_handles[iid]
            self._close_inbox(self.inboxes.pop(iid, None))
            self._outgoing.pop(iid, None)
            self._execute(self.sched.handle(E.InstanceFailed(iid, f"process exited with code {h.exitcode}")))
            # A sequence it was exporting when it died never reached its destination: retry it there.
            for key, src in list(self.in_transit.items()):
                if src == iid:
                    del self.in_transit[key]
                    rec = self.dispatch[key]
                    if rec[0] != iid and not self._finished(key):
                        self._execute(self.sched.handle(E.TrajectoryFailed(
                            key[0], key[1], f"lost in a migration from failed instance {iid}", rec[2])))
            self._restart(iid)
        if not self.instance_handles and not self.starting:
            gone = ", ".join(f"{i} (exit code {c})" for i, c in self.failed_instances.items())
            limit = self.recipe.runtime.max_instance_restarts
            raise WorkerDied(self._died_message(
                f"no rollout instance is left: instance processes exited: {gone}; "
                f"runtime.max_instance_restarts ({limit}) used up" if limit else
                f"no rollout instance is left: instance processes exited: {gone} "
                f"(runtime.max_instance_restarts is 0: none is restarted)"))

    def _drain(self, name: str, fatal: bool = True) -> list[str]:
        """Take every complete report a dead worker left on its pipe, in order, before it is
        declared failed. An "error" report ends the run (`fatal`) or is returned (with lost ones)."""
        if not hasattr(self.outbox, "drain"):
            return []
        errors = []
        for msg in self.outbox.drain(name):
            if msg[0] == "error" and not fatal:
                errors.append(f"{msg[1]}: {msg[2]}")
            elif msg[0] == "lost" and not fatal:
                self.reports_lost.append((msg[1], msg[2]))
                errors.append(f"{msg[1]}: a report that could not be read ({msg[2]})")
            elif msg[0] != "stats":
                self._on_message(msg)
        return errors

    @staticmethod
    def _close_inbox(inbox: Any) -> None:
        if hasattr(inbox, "cancel_join_thread"):
            inbox.cancel_join_thread()  # its reader is gone: never block on what it did not read
            inbox.close()

    def _restart(self, dead: int) -> None:
        """Start a fresh process in place of instance `dead` while restarts are left: same capacity
        and core share, a new id; it joins the scheduler when it reports ready (`_on_ready`)."""
        from .workers import EngineRecipe, start_instances

        if self.restarts_left <= 0:
            return
        self.restarts_left -= 1
        new = self.next_instance_id
        self.next_instance_id += 1
        cap = self.capacity_of[dead]
        self.capacity_of[new] = cap
        self.instance_restarts.append((dead, new))
        spec = EngineRecipe(self.prepared.model_config, cap, self.task.stop_id, str(self.device),
                            step_s=self.recipe.engine.step_s)
        per_inst, roll = self._respawn
        inboxes, (h,) = start_instances({new: spec}, per_inst, roll, self.outbox, self.backend)
        self.starting[new] = (inboxes[new], h)

    def _on_ready(self, name: str, threads: int, affinity: list | None, nice: int = 0) -> None:
        """A replacement instance process is up: it joins the scheduler, which asks it to load a version."""
        iid = int(name.rsplit("-", 1)[1])
        entry = self.starting.pop(iid, None)
        if entry is None:  # it died before the report was read: it never joins (see `_watch`)
            return
        inbox, h = entry
        self.torch_threads[name] = threads
        if affinity is not None:
            self.affinity[name] = affinity
        self.nice[name] = nice
        self.inboxes[iid] = inbox
        self.instance_handles[iid] = h
        self.instance_pids[iid] = h.pid
        self._handles.append(h)
        self._execute(self.sched.handle(E.InstanceReady(iid, self.capacity_of[iid])))

    # ------------------------------------------------------------------ checkpoints
    def _ckpt_path(self, version: int, kind: str) -> str:
        import os

        return os.path.join(self.checkpoint_dir, f"{kind}-{version:06d}.pt")

    def _save_state(self, version: int) -> None:
        """The coordinator's half of checkpoint `version` (snapshot, ledger, prompt position, pinned
        weights); `latest` points at it only once the trainer reports "checkpointed"."""
        import os

        os.makedirs(self.checkpoint_dir, exist_ok=True)
        keep = {v: (w.unpack() if hasattr(w, "unpack") else w) for v, w in self.versions.items()
                if v >= version - self.config.max_staleness - 1}
        state = {
            "format": 1, "version": version, "mode": self.mode, "recipe": self.recipe.to_dict(),
            "scheduler": self.sched.snapshot(),
            "next_prompt": max(self.prompts) + 1 if self.prompts else 0,
            "ledger": {k: getattr(self, k) for k in _LEDGER},
            "versions": keep,
        }
        tmp = self._ckpt_path(version, "state") + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, self._ckpt_path(version, "state"))

    def _checkpoint_complete(self, version: int) -> None:
        import os

        if not os.path.exists(self._ckpt_path(version, "state")):
            raise RuntimeError(f"checkpoint {version}: the trainer saved its half, the coordinator's is missing")
        tmp = os.path.join(self.checkpoint_dir, "latest.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(f"{version}\n")
        os.replace(tmp, os.path.join(self.checkpoint_dir, "latest"))
        for old in os.listdir(self.checkpoint_dir):  # keep the newest complete checkpoint only
            if old.endswith(".pt") and old[:-3].split("-")[-1].isdigit() and int(old[:-3].split("-")[-1]) < version:
                os.remove(os.path.join(self.checkpoint_dir, old))
        if self.on_checkpoint is not None:
            self.on_checkpoint(version)

    def _load_checkpoint(self) -> None:
        import os

        latest = os.path.join(self.checkpoint_dir, "latest")
        if not os.path.exists(latest):
            raise FileNotFoundError(f"{self.checkpoint_dir}: no complete checkpoint (no 'latest' file)")
        with open(latest, encoding="utf-8") as fh:
            version = int(fh.read().strip())
        state = torch.load(self._ckpt_path(version, "state"), weights_only=False)
        if state.get("format") != 1 or state["mode"] != self.mode:
            raise ValueError(f"checkpoint {version}: format {state.get('format')!r}, mode {state['mode']!r}; "
                             f"expected format 1, mode {self.mode!r}")
        self._check_recipe(state.get("recipe"), version)
        self.sched = Scheduler.restore(state["scheduler"])
        for k, v in state["ledger"].items():
            setattr(self, k, v)
        self.versions = dict(state["versions"])
        self._stream = self.task.prompts(seed=self.recipe.seed, start=state["next_prompt"])
        self.t_offset = self.step_end[-1] if self.step_end else 0.0
        self.resumed_from = version
        self._trainer_resume = self._ckpt_path(version, "trainer")
        self._clear_checkpoints(keep=version)

    def _clear_checkpoints(self, keep: int | None = None) -> None:
        """Remove an earlier run's checkpoint files (and only those) from `checkpoint_dir`; with `keep`,
        all but checkpoint `keep` (what a killed run left half-written)."""
        import os
        import re

        if not os.path.isdir(self.checkpoint_dir):
            return
        ours = re.compile(r"^(latest|latest\.tmp|(state|trainer)-(\d+)\.pt(\.tmp)?)$")
        for name in os.listdir(self.checkpoint_dir):
            m = ours.match(name)
            if not m or (keep is not None and (name == "latest" or (m.group(3) and int(m.group(3)) == keep
                                                                   and not m.group(4)))):
                continue
            os.remove(os.path.join(self.checkpoint_dir, name))

    def _check_recipe(self, saved: dict | None, version: int) -> None:
        """A checkpoint continues only the run that wrote it: every recipe field must be the same
        (the restored scheduler keeps the run's own configuration). The first difference is named."""
        if saved is None:
            return

        def flat(d: dict, pre: str = "") -> dict[str, Any]:
            out: dict[str, Any] = {}
            for k, v in d.items():
                if isinstance(v, dict) and v:
                    out.update(flat(v, f"{pre}{k}."))
                else:
                    out[f"{pre}{k}"] = v
            return out

        old, new = flat(saved), flat(self.recipe.to_dict())
        for key in sorted(old.keys() | new.keys()):
            if old.get(key) == new.get(key):
                continue
            raise ConfigError(key, f"the checkpoint (version {version}) in {self.checkpoint_dir} was written by a run "
                                   f"with {key}={old.get(key)!r}, this recipe has {new.get(key)!r}; resume with the "
                                   f"recipe the run started with")

    def _restart_from_checkpoint(self) -> None:
        """Fresh processes hold nothing: fail every snapshot instance (re-queueing its trajectories)
        and register it again; a started step goes to the trainer again in full. All failures go in
        one batch first, so actions aimed at the old instances are void and dropped."""
        failed = set(self.sched.instances)
        out = self.sched.handle_many([E.InstanceFailed(iid, "resumed from a checkpoint") for iid in failed])
        # Every configured instance has a fresh process now, also one that had failed before the
        # checkpoint (the snapshot no longer lists it): all of them are registered again.
        out = A.without_failed(out, failed) + self.sched.handle_many(
            [E.InstanceReady(spec.id, spec.capacity) for spec in self.config.instances])
        self._execute(out)
        busy = self.sched.trainer_busy
        if busy is not None:
            gids = self.step_groups[busy]
            self.delivered.update(gids)
            self._send_step(busy, [(g, self._group(g)) for g in gids])

    def _died_message(self, what: str) -> str:
        import os

        ckpt = self.checkpoint_dir
        step = len(self.step_end)
        if ckpt and os.path.exists(os.path.join(ckpt, "latest")):
            run_dir = os.path.dirname(os.path.abspath(ckpt))
            how = (f"dora-ext train --resume {run_dir}" if os.path.exists(os.path.join(run_dir, "run.json"))
                   else f"Runtime(recipe, prepared, checkpoint_dir={ckpt!r}, resume=True).run()")
            return f"{what} at step {step}. The run can continue from its last checkpoint: {how}"
        return (f"{what} at step {step}. No checkpoint was completed yet (dora-ext train writes one every "
                f"--checkpoint-every N steps; a broken run then continues with dora-ext train --resume DIR)")

    def _wait_ready(self, count: int, handles: list) -> None:
        ready = 0
        deadline = time.perf_counter() + max(120.0, self.recipe.runtime.stall_timeout_s)
        while ready < count:
            try:
                msg = self.outbox.get(timeout=1.0)
            except queue.Empty:
                dead = [h.name for h in handles if not h.is_alive()]
                if dead or time.perf_counter() > deadline:
                    raise RuntimeError(f"workers did not start in time; exited: {dead}")
                continue
            if msg[0] == "error":
                raise RuntimeError(f"{msg[1]} failed during setup: {msg[2]}\n{msg[3]}")
            if msg[0] != "ready":
                raise RuntimeError(f"unexpected report {msg[0]!r} during setup")
            self.torch_threads[msg[1]] = msg[2]
            if len(msg) > 3:
                self.affinity[msg[1]] = msg[3]
            if len(msg) > 4:
                self.nice[msg[1]] = msg[4]
            ready += 1

    def _collect_stats(self, count: int, handles: Sequence) -> None:
        """After "stop", each worker sends its logs; late reports of the run are ignored. Gives up after
        60 s, or at once when every worker has exited and nothing is left to read (a worker that died
        after "stop" sends nothing)."""
        deadline = time.perf_counter() + 60.0
        while len(self.instance_stats) < count and time.perf_counter() < deadline:
            try:
                msg = self.outbox.get(timeout=1.0)
            except queue.Empty:
                alive = [h for h in handles if h.is_alive()]
                if alive:
                    # Every pipe may be closed already (the read then returns at once): wait for an exit.
                    alive[0].join(timeout=1.0)
                    continue
                # An exited process has flushed what it put; one empty read after that ends it.
                try:
                    msg = self.outbox.get(timeout=0.1)
                except queue.Empty:
                    return
            if msg[0] == "stats":
                self.instance_stats[msg[1]] = msg[2]
            elif msg[0] == "error":
                raise RuntimeError(f"{msg[1]} failed: {msg[2]}\n{msg[3]}")

    def _stall_report(self, stall: float) -> str:
        s = self.sched
        running = {iid: sorted(k for k, r in self.dispatch.items() if r[0] == iid and not self._finished(k))
                   for iid in self.inboxes}
        return (f"mode {self.mode}: no report from any worker for {stall:.0f}s at step {s.step}, newest version "
                f"{s.newest_version}, trainer step running {s.trainer_busy}, unfinished trajectories by "
                f"instance {running}")

    def _finished(self, key: tuple) -> bool:
        return key in self.token_versions

    # ------------------------------------------------------------------ events in
    def _on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "finished":
            for f in msg[2]:
                self._on_finished(msg[1], f, msg[3])
        elif kind == "loaded":
            _, iid, version, seconds = msg
            self.load_seconds += seconds
            self.loads += 1
            self._execute(self.sched.handle(E.InstanceLoaded(iid, version)))
        elif kind == "step_done":
            self._on_step_done(*msg[1:])
        elif kind == "checkpointed":
            self._checkpoint_complete(msg[1])
        elif kind == "imported":
            self._on_imported(msg[1], tuple(msg[2]))
        elif kind == "export":
            self._on_export(*msg[1:])
        elif kind == "lost":
            self._on_lost(msg[1], msg[2])
        elif kind == "ready":  # a replacement instance (the first ones report in `_wait_ready`)
            self._on_ready(msg[1], msg[2], msg[3] if len(msg) > 3 else None, msg[4] if len(msg) > 4 else 0)
        elif kind == "error":
            if msg[1].startswith("trainer") and len(self.trainer_handles) > 1:
                rank = 0 if msg[1] == "trainer" else int(msg[1].rsplit("-", 1)[1])
                self._ranks_failed({rank: [f"{msg[1]}: {msg[2]}"]}, msg[3])
            raise RuntimeError(f"{msg[1]} failed: {msg[2]}\n{msg[3]}")
        else:
            raise RuntimeError(f"unknown worker report {kind!r}")

    def _ranks_failed(self, reports: dict[int, list[str]], traceback: str = "", wait_s: float = 5.0) -> None:
        """Data parallel: a rank reported an error or exited (`reports`: rank -> its reports so far).
        Peers of a killed rank fail their collective too, so after `wait_s` a rank that exited
        without reporting ends the run as a dead trainer (`WorkerDied`); otherwise the ranks' own
        errors end it (`RuntimeError`)."""
        handles = self.trainer_handles
        drained: set[int] = set()
        deadline = time.perf_counter() + wait_s
        while True:
            for r, h in enumerate(handles):
                if r not in drained and not h.is_alive():
                    drained.add(r)
                    name = trainer_name(r)
                    reports.setdefault(r, []).extend(self._drain(name, fatal=False))
            killed = [r for r in sorted(drained) if not reports.get(r)]
            if killed or len(drained) == len(handles) or time.perf_counter() > deadline:
                break
            time.sleep(0.05)  # polling the processes' states, not synchronising with them
        said = "; ".join(f"rank {r} reported: {' / '.join(e)[:300]}" for r, e in sorted(reports.items()) if e)
        if killed:
            r = killed[0]
            name = trainer_name(r)
            lost = [why for n, why in self.reports_lost if n == name]
            what = f"the trainer process exited (rank {r}, exit code {handles[r].exitcode})"
            if lost:
                what += f", ended by the coordinator: a report of it could not be read ({lost[0]})"
            raise WorkerDied(self._died_message(what + (f"; {said}" if said else "")))
        raise RuntimeError(f"trainer failed (data-parallel ranks): {said}\n{traceback}")

    def _on_lost(self, name: str, why: str) -> None:
        """A report of worker `name` could not be read (e.g. an export whose source died): kill the
        worker if it still lives, so `_watch` handles it as dead."""
        self.reports_lost.append((name, why))
        if name.startswith("instance-"):
            iid = int(name.rsplit("-", 1)[1])
            h = self.instance_handles.get(iid) or self.starting.get(iid, (None, None))[1]
        else:
            rank = 0 if name == "trainer" else int(name.rsplit("-", 1)[1])
            h = self.trainer_handles[rank] if rank < len(self.trainer_handles) else None
        if h is not None and h.is_alive() and hasattr(h, "kill"):
            h.kill()

    def _on_export(self, src: int, dst: int, state: Any) -> None:
        """A migrating sequence left `src`: pass it on to `dst`'s inbox (the coordinator writes every
        inbox), or drop it if its attempt is over."""
        gid, idx, attempt = state.request_id
        self.in_transit.pop((gid, idx), None)  # out of `src`: its death can no longer lose it
        if self.dispatch[(gid, idx)][2] != attempt or dst not in self.inboxes:
            self.exports_dropped += 1
            return
        self._send(dst, ("import", state))

    def _on_imported(self, iid: int, rid: tuple) -> None:
        """Instance `iid` took in a migrated sequence: answer the scheduler's `Migrate` with
        `MigrationLanded` (R5 may then move it again).

        Only for the trajectory's current attempt, still on `iid`, not finished, and on an instance
        not declared dead: a dead instance's re-dispatch already handles it, and a landing would
        only let R5 move it off a dead engine."""
        gid, idx, attempt = rid
        key = (gid, idx)
        self.migrations_landed += 1
        rec = self.dispatch.get(key)
        if rec is None or rec[2] != attempt:
            outcome = "attempt over"
        else:
            self.in_transit.pop(key, None)  # on its destination: its source's death can no longer lose it
            if iid in self.failed_instances:
                outcome = "instance failed"
            elif rec[0] != iid:
                outcome = "elsewhere"  # (a move the scheduler made before it landed: never, kept safe)
            elif self._finished(key):
                outcome = "finished"
            else:
                outcome = "landed"
        self.migration_log.append(("imported", gid, idx, attempt, iid, outcome))
        if outcome == "landed":
            self.landings_sent += 1
            self._execute(self.sched.handle(E.MigrationLanded(gid, idx, attempt)))

    def _on_finished(self, iid: int, f: Any, t: float) -> None:
        gid, idx, attempt = f.request_id
        if self.dispatch[(gid, idx)][2] != attempt:
            return  # an earlier attempt (never happens without failures; kept for safety)
        self.served_by[(gid, idx)] = iid
        prompt = self.prompts[gid]
        reward = float(self.task.reward(prompt, f.response_ids))
        from ..algo import Trajectory

        # The oldest version that produced a token: the one the trainer must correct for.
        self.results[gid][idx] = Trajectory(prompt.ids, f.response_ids, f.logprobs, reward, min(f.versions))
        self.token_versions[(gid, idx)] = tuple(f.versions)
        self.finish_reasons[(gid, idx)] = f.finish_reason
        ev = E.TrajectoryFinished(gid, idx, tokens=len(f.response_ids), reward=reward, attempt=attempt)
        self._execute(self.sched.handle(ev))

    def _on_step_done(self, step: int, metrics: dict, gids: list, t: float, weights: Any) -> None:
        v = step + 1
        checkpoint = bool(self.checkpoint_dir and self.checkpoint_every and v % self.checkpoint_every == 0
                          and v < self.recipe.steps)
        if checkpoint:  # first in the trainer's inbox: it saves version v before any later step starts
            import os

            os.makedirs(self.checkpoint_dir, exist_ok=True)
            self.trainer_inbox.put(("checkpoint", self._ckpt_path(v, "trainer")))
        t -= self.t0
        self.step_end.append(t)
        expected = self.step_groups[step]
        if sorted(map(str, gids)) != sorted(map(str, expected)):
            raise RuntimeError(f"trainer step {step} trained {gids}, but the scheduler asked for {expected}")
        tokens = 0
        for gid in gids:
            self.trained.setdefault(gid, []).append(step)
            tokens += sum(len(tr.response_ids) for tr in self.results[gid])
        self.tokens_trained += tokens
        work = metrics.pop("rank_work", None)
        if work:
            self._update_speeds(work)
            metrics["rank_tokens"] = [w[0] for w in work]
        self.versions[v] = weights
        if not self.keep_versions:
            # Older versions can still be loaded for queued work of their groups (an instance may be
            # switched to an orphaned version), but never beyond the staleness bound.
            for old in [x for x in self.versions if x < v - self.config.max_staleness - 1]:
                del self.versions[old]
        self._execute(self.sched.handle(E.TrainerStepFinished(step)))
        self._execute(self.sched.handle(E.VersionPublished(v)))
        stale = [step - self.group_version[g] for g in gids]
        core = self.sched.metrics()
        record = {
            "step": step, "time_s": t, "reward_mean": metrics.get("reward_mean"), "tokens": tokens,
            "throughput_tokens_per_s": self.tokens_trained / t if t > 0 else 0.0,
            "staleness_mean": sum(stale) / len(stale), "staleness_max": max(stale),
            "live_versions": core["live_versions"], "newest_version": v,
            "weight_loads": core["weight_loads"], "migrations": core["migrations"],
            "multi_version_trajectory_share": core["multi_version_trajectory_share"],
            "c1_ok": core["c1_ok"], "c2_ok": core["c2_ok"], "c3_ok": core["c3_ok"],
            "loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm"), "entropy": metrics.get("entropy"),
        }
        for k in ("pg_clipfrac", "is_weight_mean", "masked_frac", "value_loss", "rank_tokens"):
            if k in metrics:
                record[k] = metrics[k]
        self.step_records.append(record)
        if checkpoint:
            self._save_state(v)
        if self.on_step is not None:
            self.on_step(record)

    # ------------------------------------------------------------------ actions out
    def _send(self, iid: int, cmd: tuple) -> None:
        self._outgoing.setdefault(iid, []).append(cmd)

    def _flush(self) -> None:
        """One message per instance per coordinator turn: fewer wake-ups, same order."""
        out, self._outgoing = self._outgoing, {}
        for iid, cmds in out.items():
            self.inboxes[iid].put(cmds[0] if len(cmds) == 1 else ("batch", cmds))

    def _execute(self, actions: list) -> None:
        """Execute actions (and the actions their answers produce); instance commands are queued
        and sent by `_flush` when the coordinator's turn ends."""
        todo = deque(actions)
        while todo:
            act = todo.popleft()
            if isinstance(act, A.Dispatch):
                self._dispatch(act)
            elif isinstance(act, A.RequestGroups):
                for _ in range(act.count):
                    prompt = next(self._stream)
                    gid = prompt.id
                    self.prompts[gid] = prompt
                    self.group_version[gid] = self.sched.newest_version
                    self.results[gid] = [None] * self.config.group_size
                    todo.extend(self.sched.handle(E.GroupAdmitted(gid, {"length": prompt.length})))
            elif isinstance(act, A.LoadVersion):
                weights = self.versions[act.version]
                self._send(act.instance_id, ("load", act.version, weights, bool(act.preempt)))
            elif isinstance(act, A.Migrate):
                rec = self.dispatch[(act.group_id, act.index)]
                if rec[0] != act.src or rec[1] != act.version:
                    raise RuntimeError(f"migration of {act} but the ledger has it on instance {rec[0]} (version {rec[1]})")
                rec[0] = act.dst
                self.in_transit.setdefault((act.group_id, act.index), act.src)
                self.migrations += 1
                rid = (act.group_id, act.index, rec[2])
                self.migration_log.append(("move", *rid, act.src, act.dst))
                self._send(act.src, ("migrate", rid, act.dst))
            elif isinstance(act, A.DeliverGroup):
                if act.step != len(self.step_groups):  # its position counts in the batch being formed
                    raise RuntimeError(f"scheduler delivered group {act.group_id!r} for step {act.step} while "
                                       f"forming step {len(self.step_groups)}")
                self.delivered.add(act.group_id)
                group = self._group(act.group_id)
                rank, position = self._assign(act.group_id, group)
                self.trainer_inboxes[rank].put(("group", act.group_id, group, position))
            elif isinstance(act, A.StartStep):
                if act.step != len(self.step_groups):
                    raise RuntimeError(f"scheduler started step {act.step}, expected {len(self.step_groups)}")
                self.step_groups.append(tuple(act.group_ids))
                rest = [(g, self._group(g)) for g in act.group_ids if g not in self.delivered]
                self.delivered.update(act.group_ids)
                self._send_step(act.step, rest)
            elif isinstance(act, A.ReportGroupFailed):
                self.failed_groups.append((act.group_id, act.reason))
            elif isinstance(act, A.ReportError):
                self.errors.append(act.message)
            else:
                raise RuntimeError(f"unknown action {act!r}")

    def _send_step(self, step: int, rest: list) -> None:
        """The groups of `step` not streamed yet, shared out after the streamed ones (`_assign`),
        and the step command to every trainer rank."""
        n = len(self.trainer_inboxes)
        shares: list[list] = [[] for _ in range(n)]
        for gid, group in rest:
            rank, position = self._assign(gid, group)
            shares[rank].append((gid, group, position))
        if step < len(self.step_order):  # a resumed run hands the checkpoint's started step over again
            self.step_order[step] = self._order
        elif step == len(self.step_order):
            self.step_order.append(self._order)
        else:
            raise RuntimeError(f"step {step} handed to the trainer, but the ledger's step order has "
                               f"{len(self.step_order)} steps")
        self._order = []
        self._position = 0
        self._rank_load = {}
        for inbox, share in zip(self.trainer_inboxes, shares):
            inbox.put(("step", step, share))

    def _assign(self, gid: Hashable, group: list) -> tuple[int, int]:
        """(trainer rank, position in the batch) for the next group of the current step.

        Positions follow hand-out order, the order a single trainer would use, so data parallelism
        never changes a minibatch. The rank is the one that would finish its share first at its
        measured tokens per compute second (equal until every rank was measured)."""
        position = self._position
        self._position += 1
        self._order.append(gid)
        n = len(self.trainer_inboxes)
        if n == 1:
            return 0, position
        from ..algo.trainer import minibatch_of

        tc = self.trainer_config
        minibatches = tc.ppo_minibatches if tc.ppo_epochs * tc.ppo_minibatches > 1 else 1
        mb = minibatch_of(position, self.config.batch_size, minibatches)
        work = float(sum(len(t.prompt_ids) + len(t.response_ids) for t in group))
        speed = self.rank_speed if all(s is not None for s in self.rank_speed) else [1.0] * n
        load = self._rank_load.setdefault(mb, [0.0] * n)
        rank = min(range(n), key=lambda r: ((load[r] + work) / speed[r], r))
        load[rank] += work
        return rank, position

    def _update_speeds(self, work: list) -> None:
        """Each rank's tokens per compute second, averaged with the previous estimate; a rank that got
        nothing looks 25% faster each step, so it is tried again."""
        for r, (tokens, seconds, *comm) in enumerate(work):
            self.rank_tokens[r] += tokens
            self.rank_seconds[r][0] += seconds
            self.rank_seconds[r][1] += comm[0] if comm else 0.0
            old = self.rank_speed[r]
            if tokens > 0 and seconds > 0:
                new = tokens / seconds
                self.rank_speed[r] = new if old is None else 0.5 * old + 0.5 * new
            elif old is not None:
                self.rank_speed[r] = old * 1.25

    def _dispatch(self, act: A.Dispatch) -> None:
        key = (act.group_id, act.index)
        prompt = self.prompts[act.group_id]
        self.dispatch[key] = [act.instance_id, act.version, act.attempt]
        self.in_transit.pop(key, None)
        self.dispatch_versions[key] = act.version
        self.first_dispatch.setdefault(act.group_id, self._now())
        seed = (self.recipe.seed * SEED_STRIDE + int(act.group_id) * 1009 + act.index * 31 + act.attempt) % (2**62)
        rid = (act.group_id, act.index, act.attempt)
        self._send(act.instance_id, ("submit", rid, prompt.ids, self.task.max_new_tokens, self.sampling, seed))

    def _group(self, gid: Hashable) -> list:
        trajs = self.results[gid]
        if any(t is None for t in trajs):
            raise RuntimeError(f"group {gid} handed to the trainer with missing trajectories")
        return list(trajs)

    # ------------------------------------------------------------------ results
    def _checks(self) -> dict[str, Any]:
        """C1-C3 from the runtime's own ledger (what the engines and the trainer actually did)."""
        hist: dict[int, int] = {}
        c3 = 0
        duplicated = sum(len(s) - 1 for s in self.trained.values() if len(s) > 1)
        for gid, steps in self.trained.items():
            s = steps[0] - self.group_version[gid]
            hist[s] = hist.get(s, 0) + 1
            if s < 0 or s > self.config.max_staleness:
                c3 += 1
        failed = {g for g, _ in self.failed_groups}
        dropped = sum(1 for g in self.prompts if g not in self.trained and g not in failed)
        truncated = sum(1 for r in self.finish_reasons.values() if r not in ("stop", "length"))
        multi = mismatched = trained_traj = 0
        for gid in self.trained:
            for idx in range(self.config.group_size):
                vs = self.token_versions[(gid, idx)]
                trained_traj += 1
                if len(set(vs)) > 1:
                    multi += 1
                elif vs[0] != self.group_version[gid] or self.dispatch_versions[(gid, idx)] != vs[0]:
                    mismatched += 1  # one version, but not the group's: a pinning bug
        return {
            "admitted_groups": len(self.prompts), "trained_groups": len(self.trained),
            "failed_groups": len(failed), "dropped": dropped, "truncated": truncated, "duplicated": duplicated,
            "staleness_hist": dict(sorted(hist.items())), "c3_violations": c3,
            "multi_version_trajectories": multi, "version_mismatches": mismatched,
            "multi_version_trajectory_share": multi / trained_traj if trained_traj else 0.0,
            "c1_ok": multi == 0 and mismatched == 0,
            "c2_ok": dropped == 0 and truncated == 0 and duplicated == 0 and not failed,
            "c3_ok": c3 == 0,
        }

    def _result(self, t_end: float) -> RunResult:
        from ..sim.runner import window

        core = self.sched.metrics()
        checks = self._checks()
        steps = len(self.step_end)
        w, e = window(steps)
        t0 = self.step_end[w - 1] if w > 0 else 0.0
        t1 = self.step_end[e - 1] if steps else t_end
        span = max(t1 - t0, 1e-9)
        tokens = sum(len(tr.response_ids) for k in range(w, e) for g in self.step_groups[k] for tr in self.results[g])
        z = self.t0
        tstats = self.instance_stats.get("trainer", {})
        trainer_busy = [(a - z, b - z) for a, b in tstats.get("busy", ()) if b >= z]
        busy = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in trainer_busy)
        cap = self.config.total_capacity
        slot_s = 0.0
        stats = [self.instance_stats.get(iid, {}) for iid in sorted(self.inboxes)]  # by instance id
        for st in stats:
            for a, b, n in st.get("steps", ()):
                ov = min(b - z, t1) - max(a - z, t0)
                if ov > 0:
                    slot_s += n * ov
        r2t = [self.step_end[k] - min(self.first_dispatch[g] for g in self.step_groups[k]) for k in range(w, e)]
        hist = checks["staleness_hist"]
        n_hist = sum(hist.values())
        final = self.versions[steps] if steps else self.prepared.weights
        if not isinstance(final, dict):
            final = final.unpack()
        with torch_threads(self.recipe.runtime.threads(self.recipe.runtime.cores)):
            final_reward = evaluate_policy(self.task, self.prepared.model_config, final, self.prepared.eval_prompts,
                                           self.recipe, self.device)
        rewards = [r["reward_mean"] for r in self.step_records]
        tail = rewards[-max(1, len(rewards) // 5):]
        metrics = {
            "throughput_tokens_per_s": tokens / span,
            "speedup_vs_sync": None,
            "trainer_wait_ratio": 1.0 - busy / span,
            "rollout_bubble_ratio": 1.0 - slot_s / (cap * span),
            "rollout_to_train_end_s": sum(r2t) / len(r2t) if r2t else None,
            "step_time_s": span / max(e - w, 1),
            "wall_s": t_end,
            "staleness_hist": hist,
            "staleness_max": max(hist) if hist else 0,
            "staleness_mean": sum(k * v for k, v in hist.items()) / n_hist if n_hist else 0.0,
            "multi_version_trajectory_share": checks["multi_version_trajectory_share"],
            "dropped": checks["dropped"], "truncated": checks["truncated"], "duplicated": checks["duplicated"],
            "c1_ok": bool(checks["c1_ok"] and core["c1_ok"]),
            "c2_ok": bool(checks["c2_ok"] and core["c2_ok"]),
            "c3_ok": bool(checks["c3_ok"] and core["c3_ok"]),
            "live_versions_max": core["live_versions_max"],
            "migrations": core["migrations"],
            # moved sequences their destination took in ("imported" reports read)
            "migrations_landed": self.migrations_landed,
            "weight_loads": core["weight_loads"],
            "weight_load_s": self.load_seconds,
            "initial_reward": self.prepared.initial_reward,
            "final_reward": final_reward,
            "train_reward_last": sum(tail) / len(tail) if tail else None,
            "steps": steps,
            "window_steps": [w, e],
            "max_staleness": self.config.max_staleness,
            "split": self.split,
            "core_assignment": self.core_assignment(),
            # data parallel: the share of the trained tokens (prompt + response) each rank trained
            "trainer_rank_token_share": ([t / sum(self.rank_tokens) for t in self.rank_tokens]
                                         if len(self.rank_tokens) > 1 and sum(self.rank_tokens) else None),
            # data parallel: per rank, wall seconds computing and in collectives (waiting for the others)
            "trainer_rank_seconds": ([[round(a, 3), round(b, 3)] for a, b in self.rank_seconds]
                                     if len(self.rank_tokens) > 1 else None),
        }
        instance_logs = [[(max(0.0, t - z), c) for t, c in st.get("log", ())] for st in stats]
        ledger = {
            "prompts": self.prompts, "group_version": self.group_version, "results": self.results,
            "token_versions": self.token_versions, "dispatch_versions": self.dispatch_versions,
            "trained": self.trained, "step_groups": self.step_groups, "dispatch": self.dispatch,
            "step_order": self.step_order,
            "migrations_executed": sum(st.get("migrations_out", 0) for st in stats),
            "migrations_missed": sum(st.get("migrations_missed", 0) for st in stats),
            "migrations_forwarded": sum(st.get("migrations_forwarded", 0) for st in stats),
            "migrations_landed": self.migrations_landed, "landings_sent": self.landings_sent,
            "migration_log": list(self.migration_log),
            "engine_stats": {iid: self.instance_stats[iid]["engine"] for iid in sorted(self.inboxes)
                             if iid in self.instance_stats},
            # per instance: its shortest decode iteration, and (GPU shape) the share of iterations whose
            # CPU work alone took longer than engine.step_s, so that the floor did not shape them
            "decode_step_min_s": {iid: min(t1 - t0 for t0, t1, _ in self.instance_stats[iid]["steps"])
                                  for iid in sorted(self.inboxes) if self.instance_stats.get(iid, {}).get("steps")},
            "decode_over_floor_share": {iid: st["over_floor"] / len(st["steps"]) for iid in sorted(self.inboxes)
                                        if (st := self.instance_stats.get(iid, {})).get("steps")
                                        and self.recipe.engine.step_s > 0},
            "decode_shape": self.recipe.engine.decode_shape,
            "torch_threads": dict(self.torch_threads),
            "backend": self.backend,
            "served_by": self.served_by, "failed_instances": dict(self.failed_instances),
            "instance_restarts": list(self.instance_restarts), "exports_dropped": self.exports_dropped,
            "reports_lost": list(self.reports_lost),
            "trainer_cpu_s": tstats.get("cpu"),
        }
        return RunResult(
            mode=self.mode, seed=self.recipe.seed, metrics=metrics, steps=self.step_records, core_metrics=core,
            checks=checks, t_end=t_end, step_end=list(self.step_end), trainer_busy=trainer_busy,
            instance_logs=instance_logs, max_staleness=self.config.max_staleness, split=self.split,
            ledger=ledger,
            versions={v: (w if isinstance(w, dict) else w.unpack()) for v, w in self.versions.items()}
            if self.keep_versions else None,
        )


def run(recipe: Recipe, prepared: Prepared | None = None, **kwargs: Any) -> RunResult:
    """Prepare (cached per seed) and run `recipe` in its mode; see `Runtime`."""
    return Runtime(recipe, prepared or prepare(recipe), **kwargs).run()
