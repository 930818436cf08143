"""`import engine` makes torch's OpenMP threads sleep between parallel regions (OMP_WAIT_POLICY
PASSIVE, unless the user set a policy), before torch loads libgomp. Checked in fresh processes
through libgomp's own report of its settings (OMP_DISPLAY_ENV=VERBOSE): PASSIVE spins 0 times;
the default spins 300000 times before sleeping."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def spin_count(code: str, wait_policy: str | None) -> int:
    """libgomp's GOMP_SPINCOUNT in a fresh interpreter running `code` (then a torch matmul)."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    if wait_policy is not None:
        env["OMP_WAIT_POLICY"] = wait_policy
    run = subprocess.run([sys.executable, "-c", code + "; torch.ones(64, 64) @ torch.ones(64, 64)"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    match = re.search(r"GOMP_SPINCOUNT = '(\d+)'", run.stderr)
    if match is None:
        pytest.fail(f"libgomp printed no GOMP_SPINCOUNT: {run.stderr[-2000:]}")
    return int(match.group(1))


def test_engine_makes_openmp_threads_sleep() -> None:
    assert spin_count("import torch", None) > 0                 # torch alone: libgomp spins
    assert spin_count("import engine, torch", None) == 0


def test_a_policy_the_user_set_is_kept() -> None:
    assert spin_count("import engine, torch", "ACTIVE") > 0
