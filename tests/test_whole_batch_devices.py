"""`whole_batch_loss=True` on several devices (issue 52, point 6): the loss
sees the global batch, and training equals one device at the batch.

- JAX, `keras.distribution.DataParallel` over the two simulated CPU
  devices (tests/conftest.py), in this process: the step sees global
  arrays; each piece takes every device's rows in place.
- TensorFlow, `MirroredStrategy` over two logical CPUs, in a fresh process
  (`_whole_batch_devices_worker.py`): each replica gathers the outputs,
  computes the loss on the global batch and carries its own rows of the
  output gradient back.

Each case (a CLIP model whose temperature is an output's; a dual encoder
whose temperature only the loss reads, with weight regularization; Adam,
and on TensorFlow SGD with momentum for CLIP; batches of 8, on TensorFlow
the dual encoder's last one 5, uneven over the replicas) is compared
with a plain `keras.Model` on one device at the batch, update by update,
with its logs (the loss, and a metric that reads the whole batch) and its
`evaluate`.
"""

import os
from pathlib import Path

import keras
import numpy as np
import pytest
from _contrastive import CASES, DualEncoder, compiled_case
from _helpers import (
    assert_same_weights,
    fit_recording,
    max_weight_diff,
    run_in_fresh_process,
)

import keras_accum

WORKER = Path(__file__).with_name("_whole_batch_devices_worker.py")
NAMES = ("clip", "dual_encoder")
ON_JAX = pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="keras.distribution.DataParallel is JAX's",
)


def _check(found, report_diff, label):
    assert "traceback" not in found, found.get("traceback")
    # The worker (or `_fit_side_by_side`) asserted the weights after every
    # update.
    report_diff(found["max_weight_diff"], f"{label}: {found['case']}")
    assert found["moved"] > 1e-2, found  # The models trained.
    for accum_logs, plain_logs in [*found["logs"], found["evaluated"]]:
        # The loss, and for CLIP a metric that reads the whole batch.
        expected = {"loss"} | (
            {"in_batch_accuracy"} if found["case"] == "clip" else set()
        )
        assert set(accum_logs) == set(plain_logs) == expected
        for key, value in plain_logs.items():
            np.testing.assert_allclose(accum_logs[key], value, rtol=1e-5)


# -- TensorFlow: MirroredStrategy ---------------------------------------------


@pytest.fixture(scope="module")
def mirrored():
    """Every case from one worker process (TensorFlow's start and the
    strategy's set-up once)."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("TF_CONFIG", None)
    found = run_in_fresh_process([WORKER], env)
    return {case["case"]: case for case in found["cases"]}, found


@pytest.mark.tensorflow_only(reason="tf.distribute strategies")
@pytest.mark.parametrize("name", NAMES)
def test_mirrored_strategy_equals_one_device_at_the_batch(
    mirrored, name, report_diff
):
    cases, _ = mirrored
    _check(cases[name], report_diff, "MirroredStrategy, 2 replicas")
    assert cases[name]["replicas"] == 2


@pytest.mark.tensorflow_only(reason="tf.distribute strategies")
def test_another_strategy_is_refused_naming_it(mirrored):
    # `CentralStorageStrategy`, two replicas; MultiWorkerMirroredStrategy
    # is refused by the same rule (only `MirroredStrategy` is made exact).
    _, found = mirrored
    message = found["other_strategy"]
    assert "under CentralStorageStrategy (2 replicas)" in message, message
    assert "whole_batch_loss=True" in message, message


# -- JAX: DataParallel ---------------------------------------------------------

# Three updates; 4 rows a device in pieces of 3 and 1. (An uneven last
# batch is TensorFlow's case: JAX's compiles another step, at another
# shape.)
SIZES = (8, 8, 8)


def _build(name, model_cls, **kwargs):
    optimizer = keras.optimizers.Adam(0.05)
    return compiled_case(name, model_cls, DualEncoder, optimizer, **kwargs)


def _fit_side_by_side(name):
    x, y = CASES["clip"][1](sum(SIZES))
    plain = _build(name, keras.Model)
    start = plain.get_weights()
    # The plain model on one device; `AccumModel` under `DataParallel`.
    with keras.distribution.DataParallel().scope():
        accum = _build(
            name,
            keras_accum.AccumModel,
            micro_batch_size=3,
            whole_batch_loss=True,
        )
        accum.set_weights(start)
        accum_run = fit_recording(accum, x, y)
        accum_evaluated = accum.evaluate(
            x, y, batch_size=8, verbose=0, return_dict=True
        )
    plain_run = fit_recording(plain, x, y)
    assert len(accum_run.updates) == len(plain_run.updates) == len(SIZES)
    diffs = []
    for (_, found), (_, expected) in zip(
        accum_run.updates, plain_run.updates, strict=True
    ):
        assert_same_weights(found, expected)
        diffs.append(max_weight_diff(found, expected))
    return {
        "case": name,
        "max_weight_diff": max(diffs),
        "moved": max_weight_diff(plain, start),
        "logs": list(zip(accum_run.logs, plain_run.logs, strict=True)),
        "evaluated": [
            accum_evaluated,
            plain.evaluate(x, y, batch_size=8, verbose=0, return_dict=True),
        ],
    }


@ON_JAX
@pytest.mark.parametrize("name", NAMES)
def test_data_parallel_equals_one_device_at_the_batch(name, report_diff):
    _check(_fit_side_by_side(name), report_diff, "JAX DataParallel, 2 devices")


@ON_JAX
def test_model_parallel_over_the_batch_axis_is_refused_naming_it():
    import jax

    mesh = keras.distribution.DeviceMesh(
        (2, 1), ["batch", "model"], devices=jax.devices()
    )
    layouts = keras.distribution.LayoutMap(mesh)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layouts, batch_dim_name="batch"
        )
    )
    try:
        model = _build(
            "clip",
            keras_accum.AccumModel,
            micro_batch_size=3,
            whole_batch_loss=True,
        )
        x, y = CASES["clip"][1](8)
        with pytest.raises(NotImplementedError, match="under ModelParallel"):
            model.fit(x, y, batch_size=8, verbose=0)
    finally:
        keras.distribution.set_distribution(None)
