"""Run reports as JSON lines (``DORA_CPU_REPORT_DIR``): evidence for tests and benchmarks.

Written by the processes that see the facts: a replica for each weight load (version, checksum
of the weights now in its model) and each request (the version that generated it), the weight
store for each published version, the coordinator for each admitted or failed group, the
sampler for each trained batch. One file per process; nothing is written when the variable is
unset.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

REPORT_ENV = "DORA_CPU_REPORT_DIR"


def report(kind: str, **fields: Any) -> None:
    """Append one JSON line to this process's report file (when ``DORA_CPU_REPORT_DIR`` is set)."""
    directory = os.environ.get(REPORT_ENV)
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    rec = {"kind": kind, "time": time.time(), "pid": os.getpid(), **fields}
    with open(os.path.join(directory, f"report-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")


def read_reports(directory: str) -> list[dict]:
    """All records under `directory`, in time order."""
    out: list[dict] = []
    if not os.path.isdir(directory):
        return out
    for name in sorted(os.listdir(directory)):
        if name.endswith(".jsonl"):
            with open(os.path.join(directory, name)) as f:
                out.extend(json.loads(line) for line in f if line.strip())
    out.sort(key=lambda r: r.get("time", 0.0))
    return out
