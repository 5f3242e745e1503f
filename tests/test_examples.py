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


def _mnist_dir():
    return os.environ.get("TFDS_DATA_DIR")


def test_mnist_equivalence_small_on_real_mnist(tmp_path):
    if not _mnist_dir():
        import pytest

        pytest.skip("real MNIST needs TFDS_DATA_DIR (.ci/run sets it)")
    plot = tmp_path / "mnist.png"
    result = run_example(
        "mnist_equivalence.py",
        "--updates=4",
        "--micro-batch=2",
        "--accum-steps=8",
        f"--plot={plot}",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [
        line.split()
        for line in result.stdout.splitlines()
        if line.startswith(("sgd ", "adam "))
    ]
    assert len(rows) == 6
    # Same accuracy, loss mean, loss std and pixel sum in every run of an
    # optimizer; weight differences at float32 rounding.
    for optimizer in ("sgd", "adam"):
        runs = [r for r in rows if r[0] == optimizer]
        figures = {tuple(r[-5:-1]) for r in runs}
        assert len(figures) == 1, runs
        assert all(float(r[-1]) < 1e-6 for r in runs)
        assert all(r[-6] == "4" for r in runs)  # Updates.
    # 4 updates x 16 images, the same for every run.
    assert plot.stat().st_size > 10_000


def test_mnist_equivalence_missing_data_is_one_clear_line(tmp_path):
    env_dir = tmp_path / "empty"
    env_dir.mkdir()
    result = run_example("mnist_equivalence.py", f"--data-dir={env_dir}")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert f"MNIST is not prepared in {env_dir}" in last
    assert "--data-dir" in last


def test_distribute_mirrored_example():
    result = run_example("distribute_mirrored.py")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "replicas: 2" in result.stdout
    diff = float(result.stdout.split("one device:")[1].split()[0])
    assert diff < 1e-5
