"""Faults and bad input: mixed precision, non-finite gradients, saving and
resuming mid-window, refusals, and a property test of the promise."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from _helpers import (
    KillAt,
    LargeBatch,
    accum_mlp,
    assert_equivalent,
    assert_same_weights,
    max_weight_diff,
    mlp,
    overflow_prone,
    regression_data,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import keras_accum

BACKEND = keras.backend.backend()
B, K = 8, 4


@pytest.fixture
def policy():
    yield keras.mixed_precision.set_global_policy
    keras.mixed_precision.set_global_policy("float32")


# -- Mixed precision ----------------------------------------------------------


@pytest.mark.parametrize(
    "name, atol", [("mixed_float16", 1e-4), ("mixed_bfloat16", 2e-3)]
)
def test_mixed_precision_tracks_plain_large_batch(
    name, atol, policy, report_diff
):
    policy(name)
    x, y = regression_data()
    plain, accum = mlp(), accum_mlp(K)
    for model in (plain, accum):
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    # Float16 compute, float32 accumulators and weights.
    assert accum.layers[1].compute_dtype == name.split("_")[1]
    if name == "mixed_float16":
        assert isinstance(accum.optimizer, keras.optimizers.LossScaleOptimizer)
    plain = LargeBatch(plain)
    plain.fit(x, y, batch_size=B * K, epochs=2, shuffle=False, verbose=0)
    accum.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    assert accum.accumulators[0].dtype == "float32"
    assert int(accum.optimizer.iterations) == int(
        plain.model.optimizer.iterations
    )
    # Where the half-precision rounding of the two differs by more than
    # `atol`, both are measured against the float64 run.
    diff = assert_equivalent(accum, plain, atol=atol, rtol=0)
    report_diff(diff, f"{name} vs plain under the same policy")
    assert accum.skipped_windows == 0


# -- Non-finite gradients -----------------------------------------------------


def _with_nan(x, index=10):
    x = x.copy()
    x[index, 0] = np.nan
    return x


def test_nan_sample_skips_its_window_and_training_goes_on(report_diff):
    x, y = regression_data(n=128)
    bad = _with_nan(x, index=10)  # In the first window (samples 0-31).
    accum = accum_mlp(K)
    accum.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    with pytest.warns(UserWarning, match="not finite") as caught:
        history = accum.fit(
            bad, y, batch_size=B, epochs=2, shuffle=False, verbose=0
        )
    assert accum.skipped_windows == 2  # Once per epoch.
    assert len([w for w in caught if "not finite" in str(w.message)]) == 2
    # The logs stay those of a plain model (tests/test_dropin.py).
    assert set(history.history) == {"loss"}
    assert accum.mini_step == 0
    # The skipped window's NaNs were overwritten by the windows after it.
    assert all(np.all(np.isfinite(a.numpy())) for a in accum.accumulators)
    assert all(np.all(np.isfinite(w)) for w in accum.get_weights())
    # Exactly large-batch training that never saw the first window: weights,
    # Adam's slots and `iterations` untouched by it.
    plain = mlp()
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    plain = LargeBatch(plain)
    for _ in range(2):
        plain.fit(x[32:], y[32:], batch_size=B * K, shuffle=False, verbose=0)
    assert int(accum.optimizer.iterations) == 6
    assert int(plain.model.optimizer.iterations) == 6
    diff = assert_equivalent(accum, plain)
    report_diff(diff, "NaN sample: window skipped")


def test_nan_under_loss_scaling_lowers_the_scale_like_a_large_batch(policy):
    policy("mixed_float16")
    x, y = regression_data(n=64)
    bad = _with_nan(x, index=40)  # Second window.
    plain, accum = mlp(), accum_mlp(K)
    for model in (plain, accum):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    plain.fit(bad, y, batch_size=B * K, shuffle=False, verbose=0)
    accum.fit(bad, y, batch_size=B, shuffle=False, verbose=0)
    # The large batch overflowed once: its update was skipped and the
    # dynamic loss scale halved. The window does the same.
    assert float(accum.optimizer.dynamic_scale.numpy()) == float(
        plain.optimizer.dynamic_scale.numpy()
    )
    assert float(plain.optimizer.dynamic_scale.numpy()) == 2.0**14
    assert int(accum.optimizer.iterations) == int(plain.optimizer.iterations)
    assert accum.skipped_windows == 1
    assert_same_weights(plain, accum, atol=1e-4)


@pytest.mark.parametrize("log2_scale", [16, 18])
def test_loss_scale_overflows_where_the_large_batch_does(policy, log2_scale):
    """Before: each micro-batch was backpropagated as the mean over itself,
    so float16 carried k times the large batch's per-sample magnitudes; at
    2^16 the window overflowed (update skipped, scale halved) where the
    large batch applied its update, on every backend. At 2^18 both skip."""
    policy("mixed_float16")
    runs = {}
    for name, cls, kwargs, batch in (
        ("plain", keras.Model, {}, 64),
        ("accum", keras_accum.AccumModel, {"accum_steps": 8}, 8),
    ):
        model, x, y = overflow_prone(cls, **kwargs)
        model.compile(
            optimizer=keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(0.01),
                initial_scale=2.0**log2_scale,
                dynamic_growth_steps=1000,
            ),
            loss="mse",
        )
        model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
        runs[name] = model
    plain, accum = runs["plain"], runs["accum"]
    applied = int(plain.optimizer.iterations)
    assert applied == (1 if log2_scale == 16 else 0)
    assert int(accum.optimizer.iterations) == applied
    assert float(accum.optimizer.dynamic_scale.numpy()) == float(
        plain.optimizer.dynamic_scale.numpy()
    )
    assert accum.skipped_windows == 1 - applied
    assert_same_weights(plain, accum, atol=1e-3)


# -- Saving and resuming mid-window ------------------------------------------


def _batches(x, y):
    return [(x[i : i + B], y[i : i + B]) for i in range(0, len(x), B)]


def _uninterrupted(x, y):
    model = accum_mlp(K)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    for xb, yb in _batches(x, y):
        model.train_on_batch(xb, yb)
    return model


@pytest.mark.parametrize("how", ["keras_file", "weights_file"])
def test_save_after_2_of_4_micro_batches_and_resume(how, tmp_path, report_diff):
    x, y = regression_data(n=64)
    batches = _batches(x, y)
    model = accum_mlp(K)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    for xb, yb in batches[:6]:  # One update, then half a window.
        model.train_on_batch(xb, yb)
    assert model.mini_step == 2
    if how == "keras_file":
        model.save(tmp_path / "m.keras")
        restored = keras.saving.load_model(tmp_path / "m.keras")
    else:
        model.save_weights(tmp_path / "m.weights.h5")
        restored = accum_mlp(K)
        restored.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        restored.load_weights(tmp_path / "m.weights.h5")
    assert restored.mini_step == 2
    for xb, yb in batches[6:]:
        restored.train_on_batch(xb, yb)
    reference = _uninterrupted(x, y)
    assert int(restored.optimizer.iterations) == 2
    assert_same_weights(reference, restored, atol=1e-7)
    # And both equal large-batch training.
    plain = mlp()
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    plain = LargeBatch(plain)
    plain.fit(x, y, batch_size=B * K, shuffle=False, verbose=0)
    diff = assert_equivalent(restored, plain)
    report_diff(diff, f"resumed mid-window ({how})")


def test_weights_files_move_between_accum_and_plain_models(tmp_path):
    x, y = regression_data(n=40)
    accum = accum_mlp(K)
    accum.compile(optimizer="adam", loss="mse")
    accum.fit(x, y, batch_size=B, verbose=0)  # Leaves no open window...
    accum.partial_window = "carry"
    accum.fit(x[:16], y[:16], batch_size=B, verbose=0)  # ...this does.
    assert accum.mini_step == 2
    accum.save_weights(tmp_path / "accum.weights.h5")
    plain = mlp(seed=9)
    plain.load_weights(tmp_path / "accum.weights.h5")
    assert_same_weights(plain, accum, atol=0)
    plain.save_weights(tmp_path / "plain.weights.h5")
    fresh = accum_mlp(K, seed=5)
    fresh.compile(optimizer="adam", loss="mse")
    fresh.load_weights(tmp_path / "plain.weights.h5")
    assert_same_weights(fresh, plain, atol=0)


def _interrupt(epoch, batch):
    """Pre-empts `fit` after `batch` of `epoch`: a `RuntimeError`."""
    return KillAt(epoch, batch, error=RuntimeError("pre-empted"))


def test_backup_and_restore_resumes_an_open_window(tmp_path, report_diff):
    # "carry": windows cross epoch ends, so each backup holds an open one.
    x, y = regression_data(n=70)  # 9 micro-batches an epoch.

    def model():
        m = accum_mlp(K, partial_window="carry")
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return m

    def fit(m, callbacks):
        m.fit(
            x,
            y,
            batch_size=B,
            epochs=3,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )

    reference = model()
    fit(reference, [])
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    first = model()
    with pytest.raises(RuntimeError, match="pre-empted"):
        fit(first, [backup, _interrupt(epoch=1, batch=4)])
    # A new process would build a new model: the backup holds the window.
    second = model()
    fit(second, [keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))])
    assert second.mini_step == reference.mini_step == 3  # 27 = 6 * 4 + 3.
    assert int(second.optimizer.iterations) == 6
    assert_same_weights(reference, second, atol=1e-7)
    np.testing.assert_allclose(
        second.accumulators[0].numpy(),
        reference.accumulators[0].numpy(),
        rtol=1e-6,
    )
    report_diff(max_weight_diff(reference, second), "BackupAndRestore resume")


# The killed runs, by name: their flags (`_backup_kill_worker.py`), each
# killed at its third backup (the end of epoch 3 of 4).
KILLED_RUNS = {
    "during": "-",
    "between": "between",
    "between_double": "between+double",
}
if BACKEND == "tensorflow":
    # The plain model's (`tensorflow_only` tests below).
    KILLED_RUNS.update(
        plain_during="plain",
        plain_during_double="plain+double",
        plain_between="plain+between",
    )


@pytest.fixture(scope="module")
def killed_backups(tmp_path_factory):
    """Every killed run's backup folder as the kill left it, from one
    worker process (`--snapshots`: Keras's start once, not once a run)."""
    worker = Path(__file__).with_name("_backup_kill_worker.py")
    out = tmp_path_factory.mktemp("killed")
    runs = [f"{name}={flags}" for name, flags in KILLED_RUNS.items()]
    result = subprocess.run(
        [sys.executable, worker, "--snapshots", out, *runs],
        cwd=worker.parent,
        env={**os.environ, "KERAS_BACKEND": BACKEND},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"SNAPSHOTS {len(runs)}" in result.stdout, result.stdout
    return out


def _killed_during_backup(killed_backups, name, tmp_path):
    """A copy of the killed run `name`'s backup folder, to resume from."""
    backup = tmp_path / "backup"
    shutil.copytree(killed_backups / name, backup)
    return backup


def _resume_and_compare(backup, plain=False, double_checkpoint=False):
    import _backup_kill_worker as worker

    resumed = worker.build(plain=plain)
    history = worker.fit(
        resumed,
        [
            keras.callbacks.BackupAndRestore(
                backup, double_checkpoint=double_checkpoint
            )
        ],
    )
    reference = worker.build(plain=plain)
    worker.fit(reference, [])
    assert int(resumed.optimizer.iterations) == int(
        reference.optimizer.iterations
    )
    for a, b in zip(
        resumed.get_weights(), reference.get_weights(), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    return resumed, reference, len(history.history["loss"])


def test_killed_during_a_backup_write_resumes_exactly(tmp_path, killed_backups):
    """Before: the kill tore `latest.weights.h5` (Keras writes it in
    place), and every restart failed with `OSError: Unable to
    synchronously open file`. `AccumModel` writes the file beside it and
    renames it when complete: the previous backup (epoch 2's) survives, and
    the restart replays epochs 3 and 4 exactly."""
    backup = _killed_during_backup(killed_backups, "during", tmp_path)
    resumed, reference, epochs_run = _resume_and_compare(backup)
    assert epochs_run == 2
    assert resumed.mini_step == reference.mini_step


@pytest.mark.parametrize("double_checkpoint", [False, True])
def test_killed_between_the_backup_files_resumes_exactly(
    tmp_path, killed_backups, double_checkpoint
):
    """Before: killed after `BackupAndRestore` wrote the weights of epoch 3
    and before it wrote the epoch to `training_metadata.json`, the restart
    trained epoch 3 again on weights that had seen it (15 updates, not
    12), silently. The weights' own record of their epoch now decides."""
    name = "between_double" if double_checkpoint else "between"
    backup = _killed_during_backup(killed_backups, name, tmp_path)
    with pytest.warns(UserWarning, match="stopped between writing the two"):
        resumed, reference, epochs_run = _resume_and_compare(
            backup, double_checkpoint=double_checkpoint
        )
    assert epochs_run == 1
    assert int(resumed.optimizer.iterations) == 12


@pytest.mark.tensorflow_only(
    reason="Keras's own BackupAndRestore files, the same on every backend"
)
def test_plain_model_killed_between_the_backup_files_replays_an_epoch(
    tmp_path, killed_backups
):
    """What docs/guides/robustness.md says of `keras.Model` there."""
    import _backup_kill_worker as worker

    backup = _killed_during_backup(killed_backups, "plain_between", tmp_path)
    resumed = worker.build(plain=True)
    history = worker.fit(
        resumed, [keras.callbacks.BackupAndRestore(str(backup))]
    )
    # Epochs 3 and 4 on weights that had seen epoch 3: 9 updates too many.
    assert len(history.history["loss"]) == 2
    assert int(resumed.optimizer.iterations) == 5 * 9


def test_a_backup_taken_mid_epoch_warns_that_keras_replays_it(tmp_path):
    """`save_freq` in batches: Keras restarts the epoch from its first
    batch, so what the backup saw of it is trained twice; not silently."""
    x, y = regression_data(n=64)

    def model():
        m = accum_mlp(K)
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return m

    backup = keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=6)
    first = model()
    with pytest.raises(RuntimeError, match="pre-empted"):
        first.fit(
            x,
            y,
            batch_size=B,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[backup, _interrupt(epoch=0, batch=7)],
        )
    again = keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=6)
    with pytest.warns(UserWarning, match="during epoch 1, after 6 of its"):
        model().fit(
            x, y, batch_size=B, shuffle=False, verbose=0, callbacks=[again]
        )


@pytest.mark.tensorflow_only(
    reason="Keras's own BackupAndRestore files, the same on every backend"
)
@pytest.mark.parametrize("double_checkpoint", [False, True])
def test_plain_model_killed_during_a_backup_write(
    tmp_path, killed_backups, double_checkpoint
):
    """What docs/guides/robustness.md says of `keras.Model`: a torn backup
    fails every restart, unless `double_checkpoint=True` (then Keras falls
    back to the previous backup and the run resumes exactly)."""
    name = "plain_during_double" if double_checkpoint else "plain_during"
    backup = _killed_during_backup(killed_backups, name, tmp_path)
    if not double_checkpoint:
        with pytest.raises(OSError, match="Unable to"):
            _resume_and_compare(backup, plain=True)
        return
    _, _, epochs_run = _resume_and_compare(
        backup, plain=True, double_checkpoint=True
    )
    assert epochs_run == 2


# -- Bad input ----------------------------------------------------------------


@pytest.mark.parametrize("log_dir", [3, ["logs"]])
def test_logger_refuses_a_bad_log_dir(log_dir):
    with pytest.raises(TypeError, match=r"`log_dir`.*Received: log_dir="):
        keras_accum.PseudoBatchLogger(log_dir=log_dir)


def test_mismatched_sample_weight_length_is_keras_error():
    x, y = regression_data(n=32)
    model = accum_mlp(K)
    model.compile(optimizer="sgd", loss="mse")
    before = model.get_weights()
    with pytest.raises(ValueError):
        model.fit(x, y, sample_weight=np.ones(31), batch_size=B, verbose=0)
    assert_same_weights(model, before, atol=0)


def test_empty_dataset_is_what_keras_makes_of_it():
    # Each backend's Keras answers an empty `tf.data` pipeline its own way,
    # as for a plain model: a warning and no steps on TensorFlow, an error
    # before any step elsewhere. (On TensorFlow a plain model also counts
    # one optimizer iteration for the call that finds no data; the window
    # counts only updates.)
    import tensorflow as tf

    x, y = regression_data(n=32)
    model = accum_mlp(K)
    model.compile(optimizer="sgd", loss="mse")
    before = model.get_weights()
    empty = tf.data.Dataset.from_tensor_slices((x[:0], y[:0])).batch(B)
    if BACKEND == "tensorflow":
        with pytest.warns(UserWarning, match="ran out of data"):
            model.fit(empty, epochs=1, verbose=0)
    elif BACKEND == "jax":
        with pytest.raises(StopIteration):
            model.fit(empty, epochs=1, verbose=0)
    else:
        with pytest.raises(ValueError, match="is not optional, but None"):
            model.fit(empty, epochs=1, verbose=0)
    assert_same_weights(model, before, atol=0)
    assert int(model.optimizer.iterations) == 0


def test_generator_changing_structure_mid_epoch_raises():
    x, y = regression_data(n=32)

    def batches():
        yield x[:8], y[:8]
        yield x[8:16], y[8:16]
        yield x[16:24], y[16:24], np.ones(8, "float32")

    model = accum_mlp(K)
    model.compile(optimizer="sgd", loss="mse")
    if BACKEND == "tensorflow":
        # The generator's `tf.data` spec comes from its first batch.
        import tensorflow as tf

        with pytest.raises(
            tf.errors.InvalidArgumentError, match="tuple arity mismatch"
        ):
            model.fit(batches(), epochs=1, verbose=0)
        assert int(model.optimizer.iterations) == 0
        return
    # JAX's and PyTorch's Keras take each batch as it comes, for a plain
    # model too: the third micro-batch brings sample weights (all 1), and
    # the one window, closed at the epoch's end, is the plain step on the
    # 24 samples.
    model.fit(batches(), epochs=1, verbose=0)
    assert int(model.optimizer.iterations) == 1
    plain = mlp()
    plain.compile(optimizer="sgd", loss="mse")
    plain = LargeBatch(plain)
    plain.train_on_batch(x[:24], y[:24])
    assert_equivalent(model, plain)


def test_model_without_trainable_weights_warns_as_keras_does():
    x, y = regression_data(n=16, outputs=5)
    inputs = keras.Input((5,))
    layer = keras.layers.Dense(5, trainable=False)
    model = keras_accum.AccumModel(inputs, layer(inputs), accum_steps=2)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.warns(UserWarning, match="does not have any trainable weights"):
        model.fit(x, y, batch_size=B, verbose=0)


# -- The promise, for random shapes -------------------------------------------


@settings(
    # Each example builds, traces and fits two models (~2 CPU-s on
    # TensorFlow): fewer on JAX and PyTorch, which compile new shapes.
    # Derandomized, TensorFlow's 6 draw windows of 1 to 5 micro-batches
    # of 1 to 9 samples, uneven last windows, one epoch each; the
    # explicit example, on every backend, two epochs of 16 samples in
    # windows of 2 micro-batches of 3, the last one short (3 + 1).
    max_examples=6 if BACKEND == "tensorflow" else 2,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@example(accum_steps=2, micro_batch=3, samples=16, epochs=2)
@given(
    accum_steps=st.integers(1, 6),
    micro_batch=st.integers(1, 9),
    samples=st.integers(1, 60),
    epochs=st.integers(1, 2),
)
def test_property_equal_to_plain_large_batch(
    accum_steps, micro_batch, samples, epochs
):
    keras.backend.clear_session()
    x, y = regression_data(n=samples)
    plain = mlp()
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    plain = LargeBatch(plain)
    accum = accum_mlp(accum_steps)
    accum.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    plain.fit(
        x,
        y,
        batch_size=micro_batch * accum_steps,
        epochs=epochs,
        shuffle=False,
        verbose=0,
    )
    accum.fit(
        x, y, batch_size=micro_batch, epochs=epochs, shuffle=False, verbose=0
    )
    updates = epochs * -(-samples // (micro_batch * accum_steps))
    assert int(accum.optimizer.iterations) == updates
    assert accum.mini_step == 0
    assert_equivalent(accum, plain)
