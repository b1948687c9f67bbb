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


def test_core_modules_import_no_circle_and_nothing_above_them():
    """The core's modules form a DAG (the `Scheduler` facade on top), and none imports a layer above
    the core (runtime, sim, adapters)."""
    import ast
    import pathlib

    core = pathlib.Path(__file__).parents[2] / "dora_ext" / "core"
    deps = {}
    for f in core.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names |= {node.module} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 2:
                assert node.module in ("config", None), (f.name, node.module)  # `..config`, `..defaults`
        deps[f.stem] = {n for n in names if (core / f"{n}.py").exists()}
    done: set = set()

    def visit(m, path):
        assert m not in path, f"import circle: {' -> '.join(path + [m])}"
        if m not in done:
            for d in deps[m]:
                visit(d, path + [m])
            done.add(m)

    for m in deps:
        visit(m, [])
    assert "scheduler" in deps["__init__"] and not any("scheduler" in d for m, d in deps.items() if m != "__init__")
