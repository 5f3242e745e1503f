"""Embeddings: `AccumModel` trains on the true large-batch gradient.

An `Embedding`'s gradient on TensorFlow is a `tf.IndexedSlices` with one
row per token occurrence, repeats included. Keras 3's TensorFlow
optimizers (Adam, RMSprop, Adagrad, ...) square or clip those rows before
the repeats are summed, so plain Keras on TensorFlow trains differently
from the same gradient fed dense, and from plain Keras on JAX and PyTorch,
whose gradients are dense. The contract: `AccumModel` trains on the
mathematically true gradient, repeats summed first, with any
`accum_steps`. The reference here is therefore plain Keras fed dense
gradients: `keras.Model` on JAX and PyTorch, `DenseGradientModel` on
TensorFlow, and plain Keras on JAX for `AccumModel` on TensorFlow.

Backend-neutral: runs under every `KERAS_BACKEND`; the TensorFlow-only
cases say so.
"""

import os
from pathlib import Path

import keras
import numpy as np
import pytest
from _embedding_worker import (
    DIM,
    OPTIMIZERS,
    B,
    K,
    embedding_model,
    token_data,
)
from _helpers import (
    UpdateRecorder,
    assert_equivalent,
    numpy_weights,
    run_in_fresh_process,
    train_pair,
)

import keras_accum

BACKEND = keras.backend.backend()
WORKER = Path(__file__).with_name("_embedding_worker.py")
ON_TENSORFLOW = pytest.mark.tensorflow_only(
    reason="only TensorFlow gives `IndexedSlices` gradients"
)


# --8<-- [start:dense_gradient_model]
class DenseGradientModel(keras.Model):
    """Plain Keras on TensorFlow, fed each gradient as a dense tensor.

    Keras's TensorFlow step, less its loss tracking and loss scaling, with
    one change: an `IndexedSlices` gradient becomes the dense tensor it
    stands for (repeated rows summed) before the optimizer sees it, which
    is what Keras on JAX and PyTorch computes.
    """

    def train_step(self, data):
        import tensorflow as tf

        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight
            )
        gradients = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply(
            [None if g is None else tf.convert_to_tensor(g) for g in gradients],
            self.trainable_weights,
        )
        return self.compute_metrics(x, y, y_pred, sample_weight)


# --8<-- [end:dense_gradient_model]


def reference_cls():
    """Plain Keras at the large batch, on the true gradient."""
    return DenseGradientModel if BACKEND == "tensorflow" else keras.Model


def _pair(name, accum_steps, head=True, **compile_kwargs):
    """The reference and an `AccumModel`, same weights and optimizer."""
    reference = embedding_model(reference_cls(), head=head)
    accum = embedding_model(
        keras_accum.AccumModel, head=head, accum_steps=accum_steps
    )
    for model in (reference, accum):
        model.compile(
            optimizer=OPTIMIZERS[name](), loss="mse", **compile_kwargs
        )
    return reference, accum


# JAX's and PyTorch's embedding gradients are dense, as every other
# gradient (tests/test_model.py runs the optimizers there): a few here.
EVERY_BACKEND = ["adagrad", "adam", "adam_clipnorm"]


@pytest.mark.parametrize(
    "name", sorted(OPTIMIZERS) if BACKEND == "tensorflow" else EVERY_BACKEND
)
def test_equals_large_batch_on_the_true_gradient(name, report_diff):
    x, y = token_data()
    reference, accum = _pair(name, K)
    diff, _, _ = train_pair(reference, accum, x, y, B, K)
    report_diff(diff)


# Those whose sparse path Keras computes differently from the dense one.
DIRECT = ["adagrad", "adam", "adam_clipnorm", "ftrl", "rmsprop"]


@pytest.mark.parametrize(
    "name", DIRECT if BACKEND == "tensorflow" else ["adam"]
)
def test_one_micro_batch_window_equals_the_true_gradient(name, report_diff):
    # `accum_steps=1` applies the step's gradient without accumulating it:
    # it must not fall back to Keras's per-occurrence sparse updates.
    x, y = token_data()
    reference, accum = _pair(name, 1)
    diff, _, _ = train_pair(reference, accum, x, y, B * K, 1)
    report_diff(diff)


@ON_TENSORFLOW
def test_one_micro_batch_window_under_xla(report_diff):
    x, y = token_data()
    reference, accum = _pair("adam", 1, jit_compile=True)
    diff, _, _ = train_pair(reference, accum, x, y, B * K, 1)
    report_diff(diff)


@pytest.mark.parametrize("accum_steps", [1, K])
def test_non_finite_embedding_gradient_skips_the_window(accum_steps):
    # No head: the embedding's gradient is the only one, so the finiteness
    # check must find the NaN in it. The same windows are skipped at any
    # `accum_steps`, so a one-micro-batch run and a longer one stay equal.
    x, y = token_data(outputs=DIM)
    y[40, 0] = np.nan  # The second large batch of each epoch.
    one = embedding_model(keras_accum.AccumModel, head=False, accum_steps=1)
    many = embedding_model(
        keras_accum.AccumModel, head=False, accum_steps=accum_steps
    )
    for model in (one, many):
        model.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    batch = B * K // accum_steps
    with pytest.warns(UserWarning, match="not finite"):
        train_pair(one, many, x, y, batch, accum_steps)
    assert one.skipped_windows == many.skipped_windows == 2
    assert int(one.optimizer.iterations) == 4
    assert np.all(np.isfinite(one.get_weights()[0]))


@ON_TENSORFLOW
@pytest.mark.parametrize("name", ["adam", "rmsprop", "adagrad"])
def test_plain_keras_on_tensorflow_differs_sparse_from_dense(name, report_diff):
    # Keras's own inconsistency, which the docs describe: the same gradient
    # moves the weights differently when given as `IndexedSlices` (Keras's
    # default step) and as a dense tensor. If Keras ever fixes it, this
    # fails and the docs' section on it must go.
    x, y = token_data()
    sparse = embedding_model()
    dense = embedding_model(DenseGradientModel)
    for model in (sparse, dense):
        model.compile(optimizer=OPTIMIZERS[name](), loss="mse")
        model.fit(x, y, batch_size=B * K, epochs=2, shuffle=False, verbose=0)
    diff = float(
        np.max(np.abs(sparse.get_weights()[0] - dense.get_weights()[0]))
    )
    report_diff(diff, f"plain Keras sparse vs dense ({name}, not a bound)")
    assert diff > 1e-3


ACROSS = ["adam", "adagrad"]


@pytest.fixture(scope="module")
def jax_runs():
    env = {
        **os.environ,
        "KERAS_BACKEND": "jax",
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "JAX_PLATFORMS": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
    }
    results = run_in_fresh_process([WORKER, *ACROSS], env)
    assert results["backend"] == "jax"
    return results["runs"]


@ON_TENSORFLOW
@pytest.mark.parametrize("name", ACROSS)
def test_tensorflow_equals_plain_keras_on_jax(name, jax_runs, report_diff):
    x, y = token_data()
    accum = embedding_model(keras_accum.AccumModel, accum_steps=K)
    numpy_weights(accum)
    accum.compile(optimizer=OPTIMIZERS[name](), loss="mse")
    recorder = UpdateRecorder()
    accum.fit(
        x,
        y,
        batch_size=B,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[recorder],
    )
    jax_updates = jax_runs[name]["float32"]
    exact = jax_runs[name]["float64"]
    assert [s for s, _ in recorder.updates] == [s for s, _ in jax_updates]
    assert len(jax_updates) == 6
    diff = max(
        assert_equivalent(ours, theirs, atol=2e-6, exact=float64_weights)
        for (_, ours), (_, theirs), (_, float64_weights) in zip(
            recorder.updates, jax_updates, exact, strict=True
        )
    )
    report_diff(diff, f"AccumModel on TensorFlow vs Keras on JAX ({name})")
