"""PseudoBatchLogger: each update's loss equals the plain large-batch step's."""

import csv
import functools

import keras
import numpy as np
import pytest
from _helpers import (
    UpdateRecorder,
    accum_mlp,
    assert_equivalent,
    float64,
    mlp,
    regression_data,
    tensorboard_scalars,
)

import keras_accum

BACKEND = keras.backend.backend()
B, K = 8, 4
# Keras's PyTorch trainer runs one step per call (tests/test_model.py).
STEPS_PER_EXECUTION = [1] if BACKEND == "torch" else [1, 3]


def plain_step_losses(x, y, sample_weight=None, epochs=2, weights=None):
    """A plain model's per-step loss at batch B*K: each batch's loss at the
    weights before its update, evaluated independently of Keras's logs.

    `weights`: the initial weights, if not `mlp`'s (in float64, whose
    initializers draw other values).
    """
    model = mlp(
        layer_kwargs={"kernel_regularizer": keras.regularizers.L2(0.01)}
    )
    if weights is not None:
        model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    probe = mlp(
        layer_kwargs={"kernel_regularizer": keras.regularizers.L2(0.01)}
    )
    probe.compile(loss="mse")
    before = [model.get_weights()]
    recorder = UpdateRecorder()
    model.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=B * K,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[recorder],
    )
    before += [w for _, w in recorder.updates]
    losses, per_epoch = [], int(np.ceil(len(x) / (B * K)))
    for step in range(len(recorder.updates)):
        start = (step % per_epoch) * B * K
        stop = min(start + B * K, len(x))
        probe.set_weights(before[step])
        sw = None if sample_weight is None else sample_weight[start:stop]
        losses.append(
            probe.evaluate(
                x[start:stop],
                y[start:stop],
                sample_weight=sw,
                batch_size=B * K,
                verbose=0,
            )
        )
    return np.array(losses).reshape(epochs, per_epoch)


def accum_logged(x, y, sample_weight=None, epochs=2, **compile_kwargs):
    model = accum_mlp(
        K, layer_kwargs={"kernel_regularizer": keras.regularizers.L2(0.01)}
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01), loss="mse", **compile_kwargs
    )
    logger = keras_accum.PseudoBatchLogger()
    history = model.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=B,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[logger],
    )
    return logger, history.history


@pytest.mark.parametrize("steps_per_execution", STEPS_PER_EXECUTION)
@pytest.mark.parametrize("weighted", [False, True])
def test_pseudo_batch_losses_equal_plain_large_batch_steps(
    steps_per_execution, weighted, report_diff
):
    # 70 samples: each epoch ends with a partial window of 6 samples.
    x, y = regression_data(n=70)
    sw = None
    if weighted:
        sw = np.random.default_rng(2).uniform(0, 2, len(x)).astype("float32")
    expected = plain_step_losses(x, y, sample_weight=sw)

    @functools.cache
    def exact():
        # The same losses of the training in float64, where the platform's
        # float32 rounding of the plain model is what differs.
        weights = mlp().get_weights()
        with float64():
            return plain_step_losses(x, y, sample_weight=sw, weights=weights)

    logger, history = accum_logged(
        x, y, sample_weight=sw, steps_per_execution=steps_per_execution
    )
    got = np.array([u.loss for u in logger.updates]).reshape(expected.shape)
    diff = assert_equivalent(
        [got], [expected], atol=1e-7, exact=lambda: [exact()]
    )
    report_diff(
        diff,
        "pseudo-batch loss, "
        + (f"steps_per_execution={steps_per_execution}, weighted={weighted}"),
    )
    assert [u.update for u in logger.updates] == list(range(1, 7))
    assert [u.samples for u in logger.updates] == [32, 32, 6] * 2
    for key, statistic, rtol in (
        ("pseudo_batch_loss_mean", np.mean, 1e-5),
        ("pseudo_batch_loss_std", np.std, 1e-4),
    ):
        assert_equivalent(
            [history[key]],
            [statistic(expected, axis=1)],
            atol=0,
            rtol=rtol,
            exact=lambda statistic=statistic: [statistic(exact(), axis=1)],
        )


def test_keys_reach_callbacks_listed_before_the_logger(tmp_path):
    x, y = regression_data(n=64)
    model = accum_mlp(K)
    model.compile(optimizer="sgd", loss="mse")
    path = tmp_path / "log.csv"
    seen = {}
    spy = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: seen.update(logs)
    )
    logger = keras_accum.PseudoBatchLogger()
    model.fit(
        x,
        y,
        batch_size=B,
        epochs=2,
        verbose=0,
        callbacks=[keras.callbacks.CSVLogger(str(path)), spy, logger],
    )
    assert "pseudo_batch_loss_mean" in seen and "pseudo_batch_loss_std" in seen
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    epoch_two = [u.loss for u in logger.updates[2:]]
    np.testing.assert_allclose(
        float(rows[1]["pseudo_batch_loss_mean"]), np.mean(epoch_two), rtol=1e-6
    )


def test_accum_steps_one_logs_every_batch():
    x, y = regression_data(n=64)
    model = accum_mlp(1)
    model.compile(optimizer="sgd", loss="mse")
    logger = keras_accum.PseudoBatchLogger()
    model.fit(x, y, batch_size=B, verbose=0, callbacks=[logger])
    assert [u.update for u in logger.updates] == list(range(1, 9))
    assert all(u.samples == B for u in logger.updates)


def test_plain_model_is_refused():
    x, y = regression_data(n=16)
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(TypeError, match="AccumModel"):
        model.fit(x, y, callbacks=[keras_accum.PseudoBatchLogger()], verbose=0)


def test_long_epochs_do_not_lose_updates():
    # More updates per epoch than the in-graph ring holds (256).
    x, y = regression_data(n=700)
    model = accum_mlp(1)
    model.compile(
        optimizer="sgd", loss="mse", steps_per_execution=STEPS_PER_EXECUTION[-1]
    )
    logger = keras_accum.PseudoBatchLogger()
    model.fit(x, y, batch_size=2, verbose=0, callbacks=[logger])
    assert [u.update for u in logger.updates] == list(range(1, 351))


def test_tensorboard_scalars_per_update(tmp_path):
    x, y = regression_data(n=64)
    model = accum_mlp(K)
    model.compile(optimizer="sgd", loss="mse")
    logger = keras_accum.PseudoBatchLogger(log_dir=str(tmp_path))
    model.fit(x, y, batch_size=B, epochs=2, verbose=0, callbacks=[logger])
    events = tensorboard_scalars(tmp_path, "pseudo_batch_loss")
    assert events == [(u.update, pytest.approx(u.loss)) for u in logger.updates]
    assert len(events) == 4
    # Each window's length and samples too (the second epoch's last
    # window is 8 micro-batches in, 64 samples in all).
    lengths = tensorboard_scalars(tmp_path, "pseudo_batch_window_length")
    sizes = tensorboard_scalars(tmp_path, "pseudo_batch_size")
    assert lengths == [(u.update, u.micro_batches) for u in logger.updates]
    assert sizes == [(u.update, u.samples) for u in logger.updates]
    assert {v for _, v in lengths} == {K}


def test_a_callback_list_of_the_callers_own_is_left_as_it_was():
    """Before: `fit` inserted its epoch callback into a `CallbackList` the
    caller passed, and never took it out (one more per `fit`)."""
    x, y = regression_data(n=64)
    model = accum_mlp(K)
    model.compile(optimizer="sgd", loss="mse")
    seen = []
    spy = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: seen.append(model.mini_step)
    )
    history = keras.callbacks.History()
    callbacks = keras.callbacks.CallbackList(
        [spy, history], model=model, epochs=1, steps=8, verbose=0
    )
    before = list(callbacks.callbacks)
    for _ in range(2):
        model.fit(x, y, batch_size=B, verbose=0, callbacks=callbacks)
    assert callbacks.callbacks == before
    assert int(model.optimizer.iterations) == 4
    # The caller's callbacks ran, after the window closed at each epoch end.
    assert seen == [0, 0]
    assert len(history.history["loss"]) == 2
