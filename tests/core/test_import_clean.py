"""The core is a pure state machine: importing it pulls in no threads, sockets, clocks or hosts."""

import subprocess
import sys

FORBIDDEN = ["torch", "ray", "verl", "slime", "sglang", "vllm", "numpy", "threading", "socket",
             "asyncio", "time", "transfer_queue", "dora_ext.engines", "dora_ext.sim", "dora_ext.runtime"]


def test_core_import_is_clean():
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import dora_ext.core, dora_ext.config, dora_ext.plugins\n"
        "print('\\n'.join(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run([sys.executable, "-X", "frozen_modules=off", "-c", code], capture_output=True,
                         text=True, check=True).stdout.split()
    leaked = [m for m in out if m.split(".")[0] in FORBIDDEN or any(m.startswith(f + ".") or m == f for f in FORBIDDEN)]
    assert leaked == [], f"dora_ext.core imported {leaked}"
