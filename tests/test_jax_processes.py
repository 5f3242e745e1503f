"""`AccumModel` on JAX across two processes, against one process.

Two processes on this machine (`jax.distributed` through
`keras.distribution.initialize`, a coordinator on localhost, JAX's CPU
collectives), `DataParallel` over their two devices: `AccumModel` at a
global micro-batch B with `accum_steps=K` equals a plain `keras.Model`
trained in one process on the same windows as batches of B * K, including
a window left open by the first epoch (`partial_window="carry"`), saved
with the model and finished by the model loaded from that file
(`_jax_processes_worker.py`). JAX only: Keras's multi-process training is
JAX's (TensorFlow's is `MultiWorkerMirroredStrategy`, test_distribute.py).
"""

import os
from pathlib import Path

import _jax_processes_case as case
import keras
import numpy as np
import pytest
from _helpers import LargeBatch, assert_equivalent, free_ports, run_processes

WORKER = Path(__file__).with_name("_jax_processes_worker.py")

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="multi-process training in Keras is JAX's (jax.distributed)",
)


def _run_two_processes(out_dir: Path) -> float:
    (port,) = free_ports(1)
    env = {
        **os.environ,
        "KERAS_BACKEND": "jax",
        "JAX_PLATFORMS": "cpu",
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "CUDA_VISIBLE_DEVICES": "",
    }
    runs = [([WORKER, port, process, out_dir], env) for process in range(2)]
    return run_processes(runs, out_dir)


def test_two_processes_equal_one_process_large_batch(tmp_path, report_diff):
    elapsed = _run_two_processes(tmp_path)
    results = np.load(tmp_path / "results.npz")
    # 3 updates and 2 micro-batches open after the first epoch; the loaded
    # model has the open window and closes it with the second epoch's
    # first micro-batch: 7 updates, 1 micro-batch open.
    assert list(results["iterations"]) == [3, 7]
    assert list(results["mini_step"]) == [2, 2]

    plain = LargeBatch(case.build())
    plain.model.set_weights(case.initial_weights())
    x, y = case.data()
    # The same stream of global micro-batches, two epochs, in windows of K.
    stream = np.concatenate([np.arange(case.N)] * 2)
    window = case.B * case.K
    for start in range(0, 7 * window, window):
        rows = stream[start : start + window]
        plain.train_on_batch(x[rows], y[rows])
    accum = [results[f"arr_{i}"] for i in range(4)]
    diff = assert_equivalent(accum, plain)
    report_diff(diff, f"JAX, 2 processes, DataParallel ({elapsed:.0f}s)")
