"""STAND-IN for an SGLang server (no GPU inference server can run on a CPU machine).

It speaks the part of SGLang's HTTP API that slime (`slime/rollout/sglang_rollout.py`,
`slime/backends/sglang_utils/sglang_engine.py`, `external.py`), slime's router and dora-ext use,
and serves the tiny torch model of `model.py` for real: every token is sampled from the model.

  POST /generate                 {input_ids, sampling_params{temperature, top_p, top_k,
                                  max_new_tokens, sampling_seed, stop_token_ids, ...},
                                  return_logprob} -> {text, output_ids, meta_info{finish_reason,
                                  weight_version, output_token_logprobs, prompt_tokens, ...}}
  GET  /health /health_generate  liveness (slime's router checks it before listing a worker)
  GET  /server_info /get_server_info /model_info /get_model_info /get_weight_version
       (as SGLang 0.5.23's, with one tokenizer worker: `/model_info` reports the loaded
       `weight_version`; `/server_info` the launch one on top and the loaded one in its
       scheduler's `internal_states`)
  GET|POST /flush_cache, POST /pause_generation /continue_generation /abort_request
  POST /update_weights_from_disk {model_path, weight_version}: loads `model.safetensors`

Every /generate is logged (JSON lines) with the weight version at its start and end, so a test
can check C1 from what the engine itself reported. Fault injection: `--die-after N` ends the
process when the N-th request starts (requests in flight die with it); prompts containing the
symbol `zz` are aborted every time (SGLang's finish_reason "abort"). `--gated`: requests to
/generate and /update_weights_from_disk wait until `POST /standin/open` (not SGLang's: the harness
opens it once slime's router lists this server, to force that order) or GATE_LIMIT_S passed.

    python -m slime_cpu.server --port P --model-path DIR --log FILE [--die-after N]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from . import model as tiny

LAUNCH_VERSION = "default"  # SGLang's --weight-version default

FAIL_SYMBOL = "zz"
GATE_LIMIT_S = 120.0  # an injected delay, never a hang


class Engine:
    def __init__(self, model_path: str, log: str, die_after: int | None, port: int, gated: bool = False) -> None:
        torch.set_num_threads(1)
        self.gate = threading.Event()
        if not gated:
            self.gate.set()
        self.model = tiny.new_model().eval()
        tiny.load_into(self.model, Path(model_path))
        self.model_path = model_path
        self.version = LAUNCH_VERSION
        self.lock = threading.Lock()
        self.state = threading.Lock()
        self.running = 0
        self.started = 0
        self.die_after = die_after
        self.log = open(log, "a", buffering=1)
        self.port = port
        self.vocab = tiny.SYMBOLS
        self.fail_id = None

    def record(self, **entry) -> None:
        entry["port"] = self.port
        with self.state:
            self.log.write(json.dumps(entry) + "\n")

    def generate(self, body: dict) -> dict:
        self.gate.wait(GATE_LIMIT_S)
        with self.state:
            self.started += 1
            self.running += 1
            n = self.started
        if self.die_after is not None and n >= self.die_after:
            self.log.flush()
            os._exit(17)  # killed mid-rollout: every request in flight dies with the process
        t0 = time.time()
        v0 = self.version
        try:
            ids = list(body.get("input_ids") or [])
            if not ids and body.get("text") is not None:
                ids = [self.vocab.index(s) for s in str(body["text"]).split()]
            sp = body.get("sampling_params") or {}
            max_new = int(sp.get("max_new_tokens") or 16)
            temp = float(sp.get("temperature", 1.0) or 1.0)
            stops = set(sp.get("stop_token_ids") or []) | {tiny.EOS_ID}
            gen = torch.Generator()
            seed = sp.get("sampling_seed")
            gen.manual_seed(int(seed) + 7919 * len(ids) if seed is not None else int.from_bytes(os.urandom(4), "little"))
            out, lps = [], []
            finish = {"type": "length", "length": max_new}
            if FAIL_SYMBOL in [self.vocab[i] for i in ids if i < len(self.vocab)]:
                finish = {"type": "abort", "message": "injected: this request fails on every attempt"}
                max_new = 0
            for _ in range(max_new):
                x = torch.tensor([ids + out[-tiny.CONFIG.max_len + len(ids):]])
                with self.lock, torch.no_grad():
                    logits = self.model(x)[0][0, -1].float()
                logp = torch.log_softmax(logits / temp, dim=-1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                out.append(tok)
                lps.append(float(logp[tok]))
                if tok in stops:
                    finish = {"type": "stop", "matched": tok}
                    break
            v1 = self.version
            self.record(kind="generate", t0=t0, t1=time.time(), version_start=v0, version_end=v1,
                        input_ids=ids, output_ids=out, finish=finish["type"])
            meta = {
                "id": uuid.uuid4().hex, "finish_reason": finish, "prompt_tokens": len(ids),
                "completion_tokens": len(out), "cached_tokens": 0, "weight_version": v1,
                "e2e_latency": time.time() - t0,
            }
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, out)]
            return {"text": " ".join(self.vocab[t] for t in out), "output_ids": out, "meta_info": meta}
        finally:
            with self.state:
                self.running -= 1

    def load(self, body: dict) -> dict:
        self.gate.wait(GATE_LIMIT_S)
        path = Path(body["model_path"])
        with self.state:
            running = self.running
        if running:
            self.record(kind="violation", what=f"loaded {path} with {running} requests running")
        with self.lock:
            tiny.load_into(self.model, path)
            if body.get("weight_version") is not None:
                self.version = str(body["weight_version"])
        self.record(kind="load", t=time.time(), path=str(path), version=self.version)
        return {"success": True, "message": f"loaded {path}", "num_paused_requests": 0}

    def info(self) -> dict:
        return {
            "model_path": self.model_path, "tokenizer_path": self.model_path, "tp_size": 1, "pp_size": 1,
            "dp_size": 1, "ep_size": 1, "num_gpus": 1, "weight_version": self.version,
            "disaggregation_mode": "null", "is_generation": True, "enable_memory_saver": False, "version": "0.5.23-cpu-standin",
        }

    def server_info(self) -> dict:
        """SGLang 0.5.23's `/server_info`: the launch config on top (its `weight_version` is the
        launch one), the scheduler's state (with the version it holds) in `internal_states`."""
        return {**self.info(), "weight_version": LAUNCH_VERSION, "tokenizer_worker_num": 1,
                "internal_states": [{"weight_version": self.version}]}


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

        def _body(self) -> dict:
            n = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(n) or b"{}") if n else {}

        def do_GET(self) -> None:
            p = self.path.split("?")[0]
            if p in ("/health", "/health_generate", "/flush_cache"):
                return self._reply({})
            if p in ("/server_info", "/get_server_info"):
                return self._reply(engine.server_info())
            if p in ("/model_info", "/get_model_info"):
                return self._reply(engine.info())
            if p == "/get_weight_version":
                return self._reply({"weight_version": engine.version})
            return self._reply({"error": f"no GET {p}"}, 404)

        def do_POST(self) -> None:
            p = self.path.split("?")[0]
            body = self._body()
            if p == "/generate":
                return self._reply(engine.generate(body))
            if p == "/update_weights_from_disk":
                return self._reply(engine.load(body))
            if p == "/standin/open":
                engine.gate.set()
                return self._reply({"success": True})
            if p in ("/flush_cache", "/pause_generation", "/continue_generation", "/abort_request"):
                engine.record(kind=p.strip("/"), t=time.time())
                return self._reply({"success": True})
            return self._reply({"error": f"no POST {p}"}, 404)

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--die-after", type=int, default=None)
    ap.add_argument("--gated", action="store_true")
    a = ap.parse_args()
    engine = Engine(a.model_path, a.log, a.die_after, a.port, a.gated)
    server = ThreadingHTTPServer(("127.0.0.1", a.port), make_handler(engine))
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
