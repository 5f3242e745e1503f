"""The examples run end to end, as a user would run them."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_example(name, *args, timeout=600):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_quickstart_matches_large_batch():
    result = run_example("quickstart.py")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "optimizer updates: accumulated 48, large batch 48" in result.stdout
    diff = float(result.stdout.split("after 3 epochs:")[1].split()[0])
    assert diff < 1e-5
