"""The examples run end to end, as a user would run them."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _helpers import suite_xla_flags

# The KerasHub example's --distribute run starts its own JAX process.
pytestmark = pytest.mark.tensorflow_only(
    reason="the examples run on TensorFlow (tf.data, tensorflow-datasets)"
)

ROOT = Path(__file__).resolve().parents[1]


def run_example(name, *args, timeout=600, backend=None, xla_flags=None):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    if backend is not None:
        # The example's own devices (not the suite's XLA flags).
        env.pop("XLA_FLAGS", None)
        env["KERAS_BACKEND"] = backend
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
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
    assert "optimizer updates: accumulated 24, large batch 24" in result.stdout
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


def test_auto_window_example_draws_the_window_and_noise_scale(tmp_path):
    if not _mnist_dir():
        pytest.skip("real MNIST needs TFDS_DATA_DIR (.ci/run sets it)")
    plot = tmp_path / "auto.png"
    result = run_example(
        "auto_window.py", "--epochs=1", "--train-images=3200", f"--plot={plot}"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    epoch = next(line for line in lines if line.startswith("epoch 1:"))
    # 100 micro-batches in windows of 2 (the shortest, before any change).
    assert epoch.startswith("epoch 1: 50 updates, window 2 micro-batches")
    noise = float(epoch.split("B_simple ")[1].split()[0])
    assert 10 < noise < 10_000, epoch
    assert "window lengths: first 2" in result.stdout
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


def test_sparse_adam_repro_shows_keras_sparse_and_dense_steps_differ():
    result = run_example("sparse_adam_repro.py")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {
        line.split(":")[0]: [float(v) for v in line.split("[")[1][:-1].split()]
        for line in result.stdout.splitlines()
        if line.startswith(("sparse:", "dense:"))
    }
    # Adam's first step from zeros is lr * m_hat / sqrt(v_hat) with the
    # gradient 2: m_hat = 2 either way; v_hat = 2 * 1**2 when each
    # occurrence is squared, 2**2 when the repeats are summed first.
    np.testing.assert_allclose(rows["sparse"], -0.1 * 2 / np.sqrt(2), rtol=1e-4)
    np.testing.assert_allclose(rows["dense"], -0.1 * 2 / np.sqrt(4), rtol=1e-4)


def test_keras_hub_finetune_distributed_matches_large_batch():
    # On JAX under ModelParallel (8 simulated devices, the example sets
    # them): the KerasHub task converted with from_model, and the large
    # batch under the same distribution.
    # Compiled as the JAX run compiles (tests/conftest.py): XLA's compiles
    # are most of this run's CPU time (37 CPU-s with XLA's defaults, 22
    # without LLVM's optimizations), and the check below holds. The example
    # sets its devices.
    result = run_example(
        "keras_hub_finetune.py",
        "--distribute",
        backend="jax",
        xla_flags=suite_xla_flags("xla_force_host_platform_device_count"),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "backend: jax" in out
    assert "devices: 8, sharded weights: 10" in out
    assert "the task's logits for two raw reviews" in out
    assert "accumulators hold their weights' shards: True" in out
    assert "optimizer updates: accumulated 8, large batch 8" in out
    diff = float(out.split("vs batch 32:")[1].split()[0])
    assert diff < 1e-6


def _mnist_npz():
    # The offline copy beside the checkout (as `.ci/run` finds tfds's), else
    # the one `keras.datasets.mnist` downloaded before.
    for path in (
        ROOT.parent / "shared" / "data" / "mnist" / "mnist.npz",
        Path.home() / ".keras" / "datasets" / "mnist.npz",
    ):
        if path.exists():
            return path
    pytest.skip("no mnist.npz beside the checkout or in ~/.keras/datasets")


# `--quick`: 3 epochs of 8 x 1,024 pairs, 24 updates each way; top-5 about
# 0.3 each way on JAX (chance 0.005).
QUICK_UPDATES = "24"
QUICK_TOP5 = 0.1


def test_contrastive_retrieval_quick_trains_as_the_large_batch():
    # The smoke run of the in-batch negatives example on JAX (its backend):
    # `whole_batch_loss` at 1024 by 64 (A) retrieves exactly as
    # `keras.Model` at 1024 (K); the classic accumulation 64 x 16 (B) makes
    # the same optimizer updates; all learn to retrieve (chance: top-5 5 in
    # 1,000).
    result = run_example(
        "contrastive_retrieval.py",
        "--quick",
        "--runs=A,K,B",
        f"--data={_mnist_npz()}",
        backend="jax",
        # The suite's quicker XLA compiles (tests/conftest.py), but LLVM's
        # optimizations: its steps at batch 1,024 are most of the run.
        xla_flags=suite_xla_flags(
            "xla_force_host_platform_device_count",
            "xla_backend_optimization_level",
        ),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {
        line.split()[1]: line.split()
        for line in result.stdout.splitlines()
        if line.startswith("run ")
    }
    assert sorted(rows) == ["A", "B", "K"]
    for row in rows.values():
        assert row[row.index("updates") + 1] == QUICK_UPDATES
        assert float(row[row.index("top5") + 1]) > QUICK_TOP5
    # Top-1, top-5 and the learned temperature, as printed.
    cpu = rows["A"].index("cpu")
    assert rows["A"][2:cpu] == rows["K"][2:cpu]
