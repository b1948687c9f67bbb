"""STAND-IN for an SGLang server (no GPU inference server can run on a CPU machine).

It speaks the part of SGLang's HTTP API that slime (`slime/rollout/sglang_rollout.py`,
`slime/backends/sglang_utils/sglang_engine.py`, `external.py`), slime's router and dora-ext use,
with the limits of the real server that matter to them:

* a batching decode loop: one step every `--step-s` (a GPU-shaped decode step cost) advances
  EVERY running request by one token, as SGLang's scheduler does with its running batch, so tens
  of concurrent requests per engine cost about as much wall time as one;
* tokens from the tiny torch model of `model.py` (default: sampled for real), or with
  `--cheap-tokens` from a seeded RNG (a token generator for runs with responses of hundreds of
  tokens; the log-probs it reports are the RNG's);
* SGLang's weight-update lock (`TokenizerManager.model_update_lock`, a reader-writer lock with
  writer preference): every generation holds it as a reader for its whole life, and
  `/update_weights_from_disk` takes it as the writer, so a load waits for the requests in flight,
  new requests wait for the load, and the load itself takes `--load-s`;
* a client that hangs up: SGLang sees it within `--disconnect-check-s` (its
  SGLANG_REQUEST_STATE_WAIT_TIMEOUT, 4 s), lets go of the reader lock at once, and its scheduler
  drops the request at the next decode step (`--hold-aborted`: only after `POST
  /standin/release_aborted`, to force an order); a load that takes the lock in between swaps the
  weights, then cannot flush the cache and answers 400 (SGLang 0.5.23's message);
* `/flush_cache` as SGLang answers it: 200 (text) only when no request runs, else 400;
  a load that fails answers 400 with `{"success": false, "message": ...}`;
* `/health` as slime launches SGLang (`SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false`): 200
  without touching the decode loop; `/health_generate` sends a one-token request through it
  (so it waits behind a load, and never answers on a stuck engine);
* `/server_info` as SGLang 0.5.15 with slime's patch answers it: the launch config on top (its
  `weight_version` is the launch one) and the scheduler's state in `internal_states`, read back
  from the decode loop; when that takes more than SGLANG_SERVER_INFO_TIMEOUT (2 s:
  `--server-info-delay-s` makes it slow), `internal_states` is empty;
* `POST /standin/release_aborted`: requests whose client hung up leave the batch (`--hold-aborted`);
* `POST /standin/stick`: the engine gets stuck (accepts connections, never answers a generation
  nor `/health_generate`; `/health` still says 200, as a real stuck SGLang's does).

  POST /generate                 {input_ids, sampling_params{temperature, max_new_tokens,
                                  sampling_seed, stop_token_ids, ...}, return_logprob}
                                  -> {text, output_ids, meta_info{finish_reason, weight_version,
                                  output_token_logprobs, prompt_tokens, ...}}
  GET  /health /health_generate /server_info /get_server_info /model_info /get_model_info
       /get_weight_version
  GET|POST /flush_cache (200 only when idle, else 400), POST /pause_generation /continue_generation
       /abort_request (recorded, no effect)
  POST /update_weights_from_disk {model_path, weight_version}: loads `model.safetensors` (and
                                  reads `padding.bin`, a model-sized checkpoint's bytes, if any)
  POST /update_weight_version {new_version}: only the tag (logged as a load with `relabel`)

Every /generate is logged (JSON lines) with the weight version at its start and end, so a test
can check C1 from what the engine itself reported; every load with its start, end and endpoint. Fault
injection: `--die-after N` ends the process when the N-th request starts (requests in flight die
with it); prompts containing the symbol `zz` are aborted every time (SGLang's finish_reason
"abort"); `--stuck-after N` sticks the engine when its N-th request starts. `--gated`: requests
to /generate and /update_weights_from_disk wait until `POST /standin/open` (not SGLang's: the
harness opens it once slime's router lists this server, to force that order) or GATE_LIMIT_S.

    python -m slime_cpu.server --port P --model-path DIR --log FILE [options]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

LAUNCH_VERSION = "default"  # SGLang's --weight-version default
SERVER_INFO_TIMEOUT_S = 2.0  # slime's 0.5.15 patch: SGLANG_SERVER_INFO_TIMEOUT
FAIL_SYMBOL = "zz"
GATE_LIMIT_S = 120.0  # an injected delay, never a hang


class RWLock:
    """SGLang's `aio_rwlock.RWLock` semantics (writer preference), for threads."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.readers = 0
        self.writer = False
        self.writers_waiting = 0

    def acquire_read(self) -> None:
        with self._cond:
            while self.writer or self.writers_waiting:
                self._cond.wait()
            self.readers += 1

    def release_read(self) -> None:
        with self._cond:
            self.readers -= 1
            self._cond.notify_all()

    def acquire_write(self) -> None:
        with self._cond:
            self.writers_waiting += 1
            while self.writer or self.readers:
                self._cond.wait()
            self.writers_waiting -= 1
            self.writer = True

    def release_write(self) -> None:
        with self._cond:
            self.writer = False
            self._cond.notify_all()


class Request:
    def __init__(self, ids: list[int], max_new: int, temp: float, stops: set[int], seed: int) -> None:
        self.ids, self.max_new, self.temp, self.stops = ids, max_new, temp, stops
        self.rng = random.Random(seed)
        self.out: list[int] = []
        self.lps: list[float] = []
        self.finish: dict | None = None if max_new > 0 else {"type": "length", "length": 0}
        self.aborted = False  # its client hung up: the scheduler drops it at its next step
        self.done = threading.Event()
        if self.finish is not None:
            self.done.set()


class Engine:
    def __init__(self, model_path: str, log: str, die_after: int | None, port: int, gated: bool = False, *,
                 step_s: float = 0.0, load_s: float = 0.0, cheap: bool = False, stuck_after: int | None = None,
                 server_info_delay_s: float = 0.0, disconnect_check_s: float = 4.0, hold_aborted: bool = False) -> None:
        self.gate, self.load_hold = threading.Event(), threading.Event()  # load_hold: set, a load ends early
        if not gated:
            self.gate.set()
        self.cheap = cheap
        self.model = None
        if not cheap:
            import torch

            from . import model as tiny

            torch.set_num_threads(1)
            self.model = tiny.new_model().eval()
            tiny.load_into(self.model, Path(model_path))
        from .model import EOS_ID, SYMBOLS

        self.eos, self.vocab = EOS_ID, SYMBOLS
        self.model_path = model_path
        self.version = LAUNCH_VERSION  # the scheduler's (/server_info's internal_states, responses)
        self.tokenizer_version = LAUNCH_VERSION  # the tokenizer's (/model_info): not moved by a failed load
        self.update_lock = RWLock()
        self.state = threading.Lock()
        self.running: list[Request] = []
        self.wake = threading.Condition(self.state)
        self.started = 0
        self.die_after, self.stuck_after = die_after, stuck_after
        self.stuck = False
        self.step_s, self.load_s, self.server_info_delay_s = step_s, load_s, server_info_delay_s
        self.disconnect_check_s = disconnect_check_s
        self.release_aborted = threading.Event()  # set: requests whose client hung up leave the batch
        if not hold_aborted:
            self.release_aborted.set()
        self.log = open(log, "a", buffering=1)
        self.port = port
        threading.Thread(target=self._decode_loop, daemon=True).start()

    def record(self, **entry) -> None:
        entry["port"] = self.port
        with self.state:
            self.log.write(json.dumps(entry) + "\n")

    # ------------------------------------------------------------------ the scheduler's batch
    def _runnable(self) -> bool:
        return not self.stuck and any(not r.aborted or self.release_aborted.is_set() for r in self.running)

    def _decode_loop(self) -> None:
        while True:
            with self.wake:
                while not self._runnable():
                    self.wake.wait()
                batch = list(self.running)
            if self.step_s:
                time.sleep(self.step_s)  # one decode step of the whole running batch
            self._step(batch)
            with self.state:
                self.running = [r for r in self.running if not r.done.is_set()]

    def _step(self, batch: list[Request]) -> None:
        for r in batch:
            if r.aborted:
                if self.release_aborted.is_set():
                    r.finish = {"type": "abort", "message": "the client disconnected"}
                    r.done.set()
                continue
            if self.cheap:
                tok = r.rng.randrange(3, len(self.vocab))
                lp = -1.0
            else:
                import torch

                from .model import CONFIG

                x = torch.tensor([r.ids + r.out[-CONFIG.max_len + len(r.ids):]])
                with torch.no_grad():
                    logits = self.model(x)[0][0, -1].float()
                logp = torch.log_softmax(logits / r.temp, dim=-1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=torch.Generator().manual_seed(r.rng.getrandbits(31))))
                lp = float(logp[tok])
            r.out.append(tok)
            r.lps.append(lp)
            if tok in r.stops:
                r.finish = {"type": "stop", "matched": tok}
            elif len(r.out) >= r.max_new:
                r.finish = {"type": "length", "length": r.max_new}
            if r.finish is not None:
                r.done.set()

    def _run(self, r: Request, gone: Any = None) -> bool:
        """Run `r` in the batch until it finishes (True) or `gone()` says its client hung up
        (False: it stays in the batch until the next step drops it)."""
        with self.wake:
            self.running.append(r)
            self.wake.notify_all()
        while not r.done.wait(self.disconnect_check_s if gone is not None else None):
            if gone():
                with self.wake:
                    r.aborted = True
                    self.wake.notify_all()
                return False
        return True

    def busy(self) -> int:
        """Requests in the batch (SGLang's scheduler: running or waiting), those whose client
        hung up included until a step drops them."""
        with self.state:
            return sum(1 for r in self.running if not r.done.is_set())

    def flush(self) -> tuple[int, str]:
        """SGLang's `/flush_cache`: only when the scheduler is idle (a stuck one never answers)."""
        if self.stuck:
            threading.Event().wait()
        busy = self.busy()
        self.record(kind="flush_cache", flushed=not busy, t=time.time())
        if busy:
            return 400, f"Cache not flushed because there are pending requests. #queue-req: 0, #running-req: {busy}"
        return 200, "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n"

    def release(self) -> None:
        with self.wake:
            self.release_aborted.set()
            self.wake.notify_all()

    # ------------------------------------------------------------------ endpoints
    def generate(self, body: dict, gone: Any = None) -> dict | None:
        """One `/generate`; None if `gone()` said its client hung up (nothing to answer)."""
        self.gate.wait(GATE_LIMIT_S)
        self.update_lock.acquire_read()  # SGLang: generate_request holds model_update_lock.reader_lock
        try:
            with self.state:
                self.started += 1
                n = self.started
                if self.stuck_after is not None and n >= self.stuck_after:
                    self.stuck = True
            if self.die_after is not None and n >= self.die_after:
                self.log.flush()
                os._exit(17)  # killed mid-rollout: every request in flight dies with the process
            t0, v0 = time.time(), self.version
            ids = list(body.get("input_ids") or [])
            if not ids and body.get("text") is not None:
                ids = [self.vocab.index(s) for s in str(body["text"]).split()]
            sp = body.get("sampling_params") or {}
            max_new = int(sp.get("max_new_tokens") or 16)
            stops = set(sp.get("stop_token_ids") or []) | ({self.eos} if not self.cheap else set())
            seed = sp.get("sampling_seed")
            seed = int(seed) + 7919 * len(ids) if seed is not None else int.from_bytes(os.urandom(4), "little")
            if FAIL_SYMBOL in [self.vocab[i] for i in ids if i < len(self.vocab)]:
                r = Request(ids, 0, 1.0, stops, seed)
                r.finish = {"type": "abort", "message": "injected: this request fails on every attempt"}
            else:
                r = Request(ids, max_new, float(sp.get("temperature", 1.0) or 1.0), stops, seed)
                if not self._run(r, gone):
                    self.record(kind="disconnect", t0=t0, t1=time.time(), version_start=v0, input_ids=ids)
                    return None
            v1 = self.version
        finally:
            self.update_lock.release_read()
        self.record(kind="generate", t0=t0, t1=time.time(), version_start=v0, version_end=v1,
                    input_ids=ids, output_ids=r.out, finish=r.finish["type"])
        meta = {"id": uuid.uuid4().hex, "finish_reason": r.finish, "prompt_tokens": len(ids),
                "completion_tokens": len(r.out), "cached_tokens": 0, "weight_version": v1,
                "e2e_latency": time.time() - t0}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.lps, r.out)]
        return {"text": " ".join(self.vocab[t] for t in r.out), "output_ids": r.out, "meta_info": meta}

    def finish_all(self) -> None:
        """End every running request (SGLang's abort of all requests; tests clean up with it)."""
        with self.state:
            for r in self.running:
                r.finish = r.finish or {"type": "abort", "message": "aborted"}
                r.done.set()

    def health_generate(self) -> None:
        self.update_lock.acquire_read()
        try:
            self._run(Request([0], 1, 1.0, set(), 0))
        finally:
            self.update_lock.release_read()

    def load(self, body: dict) -> tuple[int, dict]:
        """`/update_weights_from_disk`: (HTTP status, reply)."""
        self.gate.wait(GATE_LIMIT_S)
        path = Path(body["model_path"])
        t0 = time.time()
        self.update_lock.acquire_write()  # waits for the requests in flight; new ones wait for it
        try:
            with self.state:
                running = sum(1 for r in self.running if not r.done.is_set() and not r.aborted)
                hung_up = sum(1 for r in self.running if not r.done.is_set() and r.aborted)
            if running:
                self.record(kind="violation", what=f"loaded {path} with {running} requests running")
            if self.load_s:
                self.load_hold.wait(self.load_s)
            t_read = time.time()
            if (path / "padding.bin").exists():  # a model-sized checkpoint: read as SGLang reads its weights
                with open(path / "padding.bin", "rb") as fh:
                    while fh.read(1 << 24):
                        pass
            read_s = time.time() - t_read
            if self.model is not None:
                from . import model as tiny

                tiny.load_into(self.model, path)
            elif not (path / "config.json").exists():
                return 400, {"success": False, "message": f"no checkpoint at {path}", "num_paused_requests": 0}
            if body.get("weight_version") is not None:
                self.version = str(body["weight_version"])
            # SGLang flushes the cache after the swap, which it refuses while the batch holds a request
            # (one whose client hung up stays there until the next decode step)
            flushed = not (running or hung_up)
        finally:
            self.update_lock.release_write()
        self.record(kind="load", endpoint="update_weights_from_disk", t0=t0, t=time.time(), read_s=read_s,
                    path=str(path), version=self.version, flushed=flushed)
        if not flushed:
            return 400, {"success": False, "num_paused_requests": 0, "message": (
                "Weights were updated, but the cache was not flushed because requests are still running or "
                "queued. Retract or finish them, then call /flush_cache.")}
        self.tokenizer_version = self.version
        return 200, {"success": True, "message": f"loaded {path}", "num_paused_requests": 0}

    def info(self) -> dict:
        return {
            "model_path": self.model_path, "tokenizer_path": self.model_path, "tp_size": 1, "pp_size": 1,
            "dp_size": 1, "ep_size": 1, "num_gpus": 1, "weight_version": self.tokenizer_version,
            "disaggregation_mode": "null", "is_generation": True, "enable_memory_saver": False,
            "version": "0.5.15-cpu-standin",
        }

    def server_info(self) -> dict:
        """The launch config on top, the scheduler's state in `internal_states` (empty when the
        scheduler does not answer within SERVER_INFO_TIMEOUT_S: slime's 0.5.15 patch)."""
        delay = self.server_info_delay_s if not self.stuck else float("inf")
        time.sleep(min(delay, SERVER_INFO_TIMEOUT_S))
        states = [{"weight_version": self.version}] if delay <= SERVER_INFO_TIMEOUT_S else []
        return {**self.info(), "weight_version": LAUNCH_VERSION, "tokenizer_worker_num": 1, "internal_states": states}


def make_handler(engine: Engine):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a) -> None:  # quiet
            return

        def _reply(self, obj, code: int = 200) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _reply_text(self, text: str, code: int = 200) -> None:
            data = text.encode()  # no content type: SGLang's plain `Response`
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _flush(self) -> None:
            code, text = engine.flush()
            self._reply_text(text, code)

        def _gone(self) -> bool:
            """Did the client hang up? (its socket reads as closed)"""
            try:
                ready, _, _ = select.select([self.connection], [], [], 0)
                return bool(ready) and self.connection.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                return True

        def _body(self) -> dict:
            n = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(n) or b"{}") if n else {}

        def do_GET(self) -> None:
            p = self.path.split("?")[0]
            if p == "/health":
                return self._reply({})
            if p == "/flush_cache":
                return self._flush()
            if p == "/health_generate":
                engine.health_generate()
                return self._reply({})
            if p in ("/server_info", "/get_server_info"):
                return self._reply(engine.server_info())
            if p in ("/model_info", "/get_model_info"):
                return self._reply(engine.info())
            if p == "/get_weight_version":
                return self._reply({"weight_version": engine.tokenizer_version})
            return self._reply({"error": f"no GET {p}"}, 404)

        def do_POST(self) -> None:
            p = self.path.split("?")[0]
            body = self._body()
            if p == "/generate":
                out = engine.generate(body, self._gone)
                if out is None:  # the client hung up: nothing to answer
                    self.close_connection = True
                    return None
                return self._reply(out)
            if p == "/update_weights_from_disk":
                code, reply = engine.load(body)
                return self._reply(reply, code)
            if p == "/update_weight_version":  # a new tag, no load
                engine.version = engine.tokenizer_version = str(body["new_version"])
                engine.record(kind="load", endpoint="update_weight_version", t0=time.time(), t=time.time(), path=None,
                              version=engine.version, relabel=True)
                return self._reply({"success": True, "new_version": engine.version})
            if p == "/standin/open":
                engine.gate.set()
                return self._reply({"success": True})
            if p == "/standin/stick":
                engine.stuck = True
                return self._reply({"success": True})
            if p == "/standin/release_aborted":
                engine.release()
                return self._reply({"success": True})
            if p == "/flush_cache":
                return self._flush()
            if p in ("/pause_generation", "/continue_generation", "/abort_request"):
                engine.record(kind=p.strip("/"), t=time.time())
                return self._reply({"success": True})
            return self._reply({"error": f"no POST {p}"}, 404)

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # SGLang's uvicorn accepts hundreds of connections at once


def serve(engine: Engine, port: int) -> ThreadingHTTPServer:
    return _Server(("127.0.0.1", port), make_handler(engine))


def serve_router(urls: list[str], port: int) -> ThreadingHTTPServer:
    """STAND-IN for slime's router, only its `GET /workers` listing (sglang-router's shape)."""

    class Router(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a) -> None:
            return

        def do_GET(self) -> None:
            body = {"workers": [{"id": f"w{i}", "url": u, "worker_type": "regular"} for i, u in enumerate(urls)]}
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return _Server(("127.0.0.1", port), Router)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--die-after", type=int, default=None)
    ap.add_argument("--stuck-after", type=int, default=None)
    ap.add_argument("--gated", action="store_true")
    ap.add_argument("--step-s", type=float, default=0.0, help="one decode step of the running batch")
    ap.add_argument("--load-s", type=float, default=0.0, help="how long a weight load holds the writer lock")
    ap.add_argument("--server-info-delay-s", type=float, default=0.0)
    ap.add_argument("--disconnect-check-s", type=float, default=4.0,
                    help="how soon a client that hung up is seen (SGLANG_REQUEST_STATE_WAIT_TIMEOUT)")
    ap.add_argument("--hold-aborted", action="store_true",
                    help="requests whose client hung up stay in the batch until POST /standin/release_aborted")
    ap.add_argument("--cheap-tokens", action="store_true")
    a = ap.parse_args()
    engine = Engine(a.model_path, a.log, a.die_after, a.port, a.gated, step_s=a.step_s, load_s=a.load_s,
                    cheap=a.cheap_tokens, stuck_after=a.stuck_after, server_info_delay_s=a.server_info_delay_s,
                    disconnect_check_s=a.disconnect_check_s, hold_aborted=a.hold_aborted)
    serve(engine, a.port).serve_forever()


if __name__ == "__main__":
    main()
