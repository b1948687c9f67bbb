"""The core scheduler's source as it was at a git commit, loaded for a twin test.

Read with `git show` at test time (never copied into the repository) and run against today's
actions, events and config. Skips the calling test, naming the reason, where git or the commit is
not available (a source tarball, a shallow clone)."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def scheduler_module_at(rev: str, name: str):
    """`dora_ext/core/scheduler.py` at commit `rev`, as a module named `name`."""
    try:
        src = subprocess.run(["git", "show", f"{rev}:dora_ext/core/scheduler.py"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"git is not available to read the reference scheduler at {rev}: {exc}")
    if src.returncode != 0:
        pytest.skip(f"the reference scheduler at commit {rev} is not in this checkout: {src.stderr.strip()}")
    spec = importlib.util.spec_from_loader(name, loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "dora_ext.core"  # its relative imports: today's actions, events, config
    sys.modules[name] = mod
    try:
        exec(compile(src.stdout, f"<git show {rev}:dora_ext/core/scheduler.py>", "exec"), mod.__dict__)
    finally:
        sys.modules.pop(name, None)
    return mod
