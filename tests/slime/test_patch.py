"""The slime patch is well-formed and minimal. slime is ABSENT in CI.

Without a slime checkout, the patch is applied to a file rebuilt from its own pre-image (the
context and removed lines of its hunks) with `git apply --check`; this proves it parses and is
self-consistent. Applying to real slime is `test_slime_real.py` (needs DORA_SLIME_PATH).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

PATCHES = Path(__file__).resolve().parents[2] / "patches" / "slime"
BASE = "624b824a898ab0ec1fcb4d373004c7f3852bf515"


def _patch() -> str:
    files = sorted(PATCHES.glob("*.patch"))
    assert [f.name for f in files] == ["0001-rollout-weight-reload-hook.patch"]
    return files[0].read_text()


def test_patch_names_its_base_commit_and_touches_one_file():
    text = _patch()
    assert BASE in text
    assert BASE in (PATCHES / "check.sh").read_text()
    touched = [line.split(" b/")[1] for line in text.splitlines() if line.startswith("diff --git")]
    assert touched == ["slime/ray/actor_group.py"]
    added = [l for l in text.splitlines() if l.startswith("+") and not l.startswith("+++")]
    removed = [l for l in text.splitlines() if l.startswith("-") and not l.startswith("---")]
    assert removed == [] and len(added) <= 10  # a plug point, not a rewrite
    assert any("custom_rollout_weight_reload_path" in l for l in added)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_patch_applies_to_its_own_pre_image(tmp_path):
    text = _patch()
    body = text[text.index("diff --git"):]
    pre = []
    in_hunk = False
    for line in body.splitlines():
        if line.startswith("@@"):
            in_hunk = True
            continue
        if in_hunk and (line.startswith(" ") or line.startswith("-")):
            pre.append(line[1:])
    target = tmp_path / "slime" / "ray" / "actor_group.py"
    target.parent.mkdir(parents=True)
    target.write_text("\n".join(pre) + "\n")
    (tmp_path / "p.patch").write_text(body)
    r = subprocess.run(["git", "apply", "--check", "--unidiff-zero", "p.patch"], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
