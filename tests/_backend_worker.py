"""Runs the equivalence cases on one backend; prints the results as JSON.

Started in a fresh process per backend by `test_backends.py`, because Keras
fixes its backend when it is first imported:

    KERAS_BACKEND=jax python _backend_worker.py
    KERAS_BACKEND=torch python _backend_worker.py

Each equivalence case trains a plain `keras.Model` at batch B * k and an
`AccumModel` at batch B with `accum_steps=k`, from the same initial weights
on the same data in the same order (`shuffle=False`), records both models'
weights after every optimizer update, and reports the largest difference
over all updates and both update counts. The other cases report what a
save and load, `PseudoBatchLogger`, or an unsupported feature, did. The
test asserts on the results; this script only measures.
"""

import contextlib
import json
import os
import sys
import tempfile
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _helpers import (
    UpdateRecorder,
    accum_mlp,
    batch_norm_data,
    batch_norm_model,
    classification_data,
    continue_one_epoch,
    log_noise_scale,
    log_pseudo_batches,
    max_weight_diff,
    mlp,
    numpy_weights,
    regression_data,
    tensorboard_scalars,
    train_to_an_open_window,
)

import keras_accum

# Before any case runs: on JAX and PyTorch neither Keras nor the package
# imports TensorFlow.
TENSORFLOW_AT_IMPORT = "tensorflow" in sys.modules
B, K = 8, 4
BACKEND = keras.backend.backend()


def optimizer(name):
    return {
        "sgd": lambda: keras.optimizers.SGD(0.1),
        "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(0.01),
        # Decoupled weight decay and clipping see the window's gradient.
        "adamw_clipped": lambda: keras.optimizers.AdamW(
            0.01, weight_decay=0.05, global_clipnorm=0.5
        ),
        # Summed losses make gradients B times larger: a smaller rate.
        "sgd_sum": lambda: keras.optimizers.SGD(0.001, momentum=0.5),
        "sgd_mean": lambda: keras.optimizers.SGD(0.05, momentum=0.5),
        # The rate halves every update: it must see updates, not
        # micro-batches.
        "sgd_schedule": lambda: keras.optimizers.SGD(
            keras.optimizers.schedules.ExponentialDecay(
                0.2, decay_steps=1, decay_rate=0.5
            ),
            momentum=0.9,
        ),
        # Thresholds that bite on the window's gradient.
        "sgd_clipnorm": lambda: keras.optimizers.SGD(
            0.5, momentum=0.5, clipnorm=0.05
        ),
        "sgd_clipvalue": lambda: keras.optimizers.SGD(
            0.5, momentum=0.5, clipvalue=0.01
        ),
    }[name]()


def _pair(opt="adam", accum_steps=K):
    """A plain MLP and an `AccumModel` MLP with its weights, compiled alike
    (`opt`: a name for `optimizer`, or an optimizer factory)."""
    plain = mlp()
    accum = accum_mlp(accum_steps)
    accum.set_weights(plain.get_weights())
    for model in (plain, accum):
        model.compile(
            optimizer=optimizer(opt) if isinstance(opt, str) else opt(),
            loss="mse",
        )
    return plain, accum


def _diff_over_updates(plain_rec, accum_rec):
    """The largest weight difference at the updates both models recorded.

    With `steps_per_execution > 1` callbacks see the `AccumModel` only
    every few micro-batches, so it records a subset of the updates; any
    update it records that the plain model did not is a mismatch (inf).
    """
    plain = dict(plain_rec.updates)
    if not accum_rec.updates or any(
        i not in plain for i, _ in accum_rec.updates
    ):
        return float("inf")
    worst = 0.0
    for step, weights in accum_rec.updates:
        for u, v in zip(weights, plain[step], strict=True):
            worst = max(worst, float(np.max(np.abs(u - v))))
    return worst


def equivalence(
    name,
    opt="adam",
    n=64,
    epochs=2,
    reduction="sum_over_batch_size",
    weighted=False,
    unknown_length=False,
    layer_kwargs=None,
    data="regression",
    class_weight=None,
    **compile_kwargs,
):
    x, y = regression_data(n=n)
    sw = None
    if weighted:
        sw = np.random.default_rng(3).uniform(0, 2, n).astype("float32")
    loss = _mse(reduction)
    if data == "classes":
        # Class weights become sample weights inside `fit`.
        x, y = classification_data(n=n)
        loss = "sparse_categorical_crossentropy"
        model_kwargs = {"features": 6, "outputs": 4, "activation": "softmax"}
        plain = mlp(**model_kwargs)
        accum = accum_mlp(K, **model_kwargs)
    elif data == "two_outputs":
        y = {"reg": y, "cls": (y[:, :1] > 0).astype("float32")}
        loss = {"reg": "mse", "cls": "binary_crossentropy"}
        compile_kwargs["loss_weights"] = {"reg": 0.3, "cls": 2.0}
        plain = _two_outputs(keras.Model)
        accum = _two_outputs(keras_accum.AccumModel, accum_steps=K)
    else:
        model_kwargs = {"layer_kwargs": layer_kwargs} if layer_kwargs else {}
        plain = mlp(**model_kwargs)
        accum = accum_mlp(K, **model_kwargs)
    accum.set_weights(plain.get_weights())
    loss_weights = compile_kwargs.pop("loss_weights", None)
    plain.compile(
        optimizer=optimizer(opt), loss=loss, loss_weights=loss_weights
    )
    accum.compile(
        optimizer=optimizer(opt),
        loss=loss,
        loss_weights=loss_weights,
        **compile_kwargs,
    )
    plain_rec, accum_rec = UpdateRecorder(), UpdateRecorder()
    plain.fit(
        x,
        y,
        sample_weight=sw,
        class_weight=class_weight,
        batch_size=B * K,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[plain_rec],
    )
    if unknown_length:
        # The step cannot know an epoch's last batch, so the open window
        # is applied after it.
        accum.fit(
            _unknown_length(x, y),
            epochs=epochs,
            verbose=0,
            callbacks=[accum_rec],
        )
    else:
        accum.fit(
            x,
            y,
            sample_weight=sw,
            class_weight=class_weight,
            batch_size=B,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=[accum_rec],
        )
    return {
        "case": name,
        "max_weight_diff": max(
            _diff_over_updates(plain_rec, accum_rec),
            max_weight_diff(plain, accum),
        ),
        "compared_updates": len(accum_rec.updates),
        "updates": int(accum.optimizer.iterations.numpy()),
        "plain_updates": int(plain.optimizer.iterations.numpy()),
        "micro_batches": -(-n // B) * epochs,
        "open_window": accum.mini_step,
        "weights": len(accum.weights),
        "plain_weights": len(plain.weights),
    }


def _two_outputs(model_cls, **kwargs):
    """A regression head and a classification head on one trunk."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    reg = keras.layers.Dense(3, name="reg")(hidden)
    cls = keras.layers.Dense(1, activation="sigmoid", name="cls")(hidden)
    return model_cls(inputs, {"reg": reg, "cls": cls}, **kwargs)


def _unknown_length(x, y):
    """Batches of `B` in order, in the backend's own kind of input, with
    no length."""
    if BACKEND == "torch":
        import torch

        class Batches(torch.utils.data.IterableDataset):
            def __iter__(self):
                for start in range(0, len(x), B):
                    yield x[start : start + B], y[start : start + B]

        return torch.utils.data.DataLoader(Batches(), batch_size=None)
    import tensorflow as tf

    # `filter` hides the cardinality.
    data = tf.data.Dataset.from_tensor_slices((x, y))
    return data.filter(lambda a, b: True).batch(B)


def non_finite_window():
    """A NaN in the first window's data: that window is skipped, whole.

    Nothing of it reaches the weights or the optimizer (Adam's step count
    included), so the run equals a plain model trained on the second
    window's samples alone.
    """
    x, y = regression_data(n=64)
    x[10, 0] = np.nan
    plain, accum = _pair()
    plain.fit(x[32:], y[32:], batch_size=B * K, shuffle=False, verbose=0)
    accum.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    return {
        "case": "non_finite_window",
        "max_weight_diff": max_weight_diff(plain, accum),
        "updates": int(accum.optimizer.iterations.numpy()),
        "plain_updates": int(plain.optimizer.iterations.numpy()),
        "skipped_windows": accum.skipped_windows,
        "weights_finite": all(
            bool(np.all(np.isfinite(w))) for w in accum.get_weights()
        ),
    }


@contextlib.contextmanager
def _global_policy(name):
    keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def mixed_precision(policy):
    """Under `policy`, against a plain model under the same policy."""
    with _global_policy(policy):
        x, y = regression_data(n=70)
        plain, accum = _pair()
        plain.fit(x, y, batch_size=B * K, epochs=2, shuffle=False, verbose=0)
        accum.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
        return {
            "case": policy,
            "max_weight_diff": max_weight_diff(plain, accum),
            "optimizer": type(accum.optimizer).__name__,
            "compute_dtype": accum.layers[1].compute_dtype,
            "accumulator_dtype": str(accum.accumulators[0].dtype),
            "updates": int(accum.optimizer.iterations.numpy()),
            "plain_updates": int(plain.optimizer.iterations.numpy()),
            "skipped_windows": accum.skipped_windows,
        }


def nan_under_loss_scaling():
    """A NaN in the second window under `mixed_float16`: the window goes
    to the `LossScaleOptimizer`, which skips it and halves its scale, as
    for the large batch that holds the NaN."""
    with _global_policy("mixed_float16"):
        x, y = regression_data(n=64)
        x[40, 0] = np.nan
        plain, accum = _pair(lambda: keras.optimizers.SGD(0.1))
        plain.fit(x, y, batch_size=B * K, shuffle=False, verbose=0)
        accum.fit(x, y, batch_size=B, shuffle=False, verbose=0)
        return {
            "case": "nan_under_loss_scaling",
            "max_weight_diff": max_weight_diff(plain, accum),
            "scales": [
                float(m.optimizer.dynamic_scale.numpy()) for m in (plain, accum)
            ],
            "updates": int(accum.optimizer.iterations.numpy()),
            "plain_updates": int(plain.optimizer.iterations.numpy()),
            "skipped_windows": accum.skipped_windows,
        }


def unused_weights():
    """A trainable layer the loss never reaches, under AdamW with weight
    decay: a plain step gives it no gradient, so no decay and no moments;
    neither may the window."""

    def build(model_cls, **kwargs):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((5,))
        model = model_cls(inputs, keras.layers.Dense(3)(inputs), **kwargs)
        model.unused = keras.layers.Dense(2)
        model.unused.build((None, 5))
        model.compile(
            optimizer=keras.optimizers.AdamW(0.01, weight_decay=0.1),
            loss="mse",
        )
        return model

    x, y = regression_data(n=64)
    plain = build(keras.Model)
    accum = build(keras_accum.AccumModel, accum_steps=K)
    accum.set_weights(plain.get_weights())
    unused_before = [w.copy() for w in plain.unused.get_weights()]
    plain.fit(x, y, batch_size=B * K, epochs=2, shuffle=False, verbose=0)
    accum.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    return {
        "case": "unused_weights",
        "trainable_weights": len(accum.trainable_weights),
        "max_weight_diff": max_weight_diff(plain, accum),
        "plain_unused_moved": max(
            float(np.max(np.abs(u - v)))
            for u, v in zip(
                plain.unused.get_weights(), unused_before, strict=True
            )
        ),
        "updates": int(accum.optimizer.iterations.numpy()),
        "plain_updates": int(plain.optimizer.iterations.numpy()),
    }


def data_parallel():
    """`keras.distribution.DataParallel` over the process's devices (two
    CPU devices: the test sets XLA's host device count), uneven last batch
    included, against a plain model under the same distribution."""
    import jax

    devices = jax.devices()
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=devices)
    )
    try:
        # The last micro-batch holds 6 samples, 3 per device.
        x, y = regression_data(n=70)
        plain, accum = _pair()
        plain.fit(x, y, batch_size=B * K, epochs=2, shuffle=False, verbose=0)
        accum.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
        return {
            "case": "data_parallel",
            "devices": len(devices),
            "max_weight_diff": max_weight_diff(plain, accum),
            "updates": int(accum.optimizer.iterations.numpy()),
            "plain_updates": int(plain.optimizer.iterations.numpy()),
            # The accumulators are laid out like the weights they sum.
            "same_layouts": all(
                str(a.value.sharding) == str(v.value.sharding)
                for a, v in zip(
                    accum.accumulators, accum.trainable_variables, strict=True
                )
            ),
        }
    finally:
        keras.distribution.set_distribution(None)


def _mse(reduction):
    return keras.losses.MeanSquaredError(reduction=reduction)


def epoch_schedule():
    """`accum_steps={0: 2, 1: 4}` against batch 16, then batch 32."""
    x, y = regression_data(n=70)
    plain, accum = _pair(accum_steps={0: 2, 1: 4})
    for batch_size in (B * 2, B * 4):
        plain.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    accum.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    return {
        "case": "epoch_schedule",
        "max_weight_diff": max_weight_diff(plain, accum),
        "updates": int(accum.optimizer.iterations.numpy()),
        "plain_updates": int(plain.optimizer.iterations.numpy()),
    }


def schedule_by_update_count():
    """`accum_steps=lambda u: where(u < 3, 1, 4)` (traced into the step)
    against 3 updates at batch 8, then batch 32."""
    x, y = regression_data(n=88)
    plain, accum = _pair(accum_steps=lambda u: keras.ops.where(u < 3, 1, 4))
    plain.fit(x[:24], y[:24], batch_size=B, shuffle=False, verbose=0)
    plain.fit(x[24:], y[24:], batch_size=4 * B, shuffle=False, verbose=0)
    accum.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    return {
        "case": "schedule_by_update_count",
        "max_weight_diff": max_weight_diff(plain, accum),
        "updates": int(accum.optimizer.iterations.numpy()),
        "plain_updates": int(plain.optimizer.iterations.numpy()),
        "window_length": accum.window_length,
    }


def save_and_load():
    """A `.keras` round trip, with a window open at the save."""
    x, y = regression_data(n=70)
    model = accum_mlp(K, partial_window="carry")
    model.compile(optimizer=optimizer("adam"), loss="mse")
    # 9 micro-batches: 2 updates and one micro-batch left open.
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "model.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
    result = {
        "case": "save_and_load",
        "loaded_class": type(loaded).__name__,
        "is_accum_model": isinstance(loaded, keras_accum.AccumModel),
        "accum_steps": loaded.accum_steps,
        "partial_window": loaded.partial_window,
        "weights_diff": max_weight_diff(model, loaded),
        "predict_diff": float(
            np.max(
                np.abs(
                    loaded.predict(x, verbose=0) - model.predict(x, verbose=0)
                )
            )
        ),
        "open_window": [model.mini_step, loaded.mini_step],
        "accumulators_diff": max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(
                model.accumulators, loaded.accumulators, strict=True
            )
        ),
        "updates": [
            int(model.optimizer.iterations.numpy()),
            int(loaded.optimizer.iterations.numpy()),
        ],
    }
    # The open window and the optimizer state came back: both continue
    # identically.
    for m in (model, loaded):
        m.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    result["continued_diff"] = max_weight_diff(model, loaded)
    result["continued_updates"] = [
        int(model.optimizer.iterations.numpy()),
        int(loaded.optimizer.iterations.numpy()),
    ]
    loss = model.evaluate(x, y, verbose=0)
    result["evaluate_finite"] = bool(np.isfinite(loss))
    return result


def across_backends(directory):
    """Loads the TensorFlow-saved model; saves one for TensorFlow to load."""
    x, y = regression_data(n=70)
    loaded = keras.saving.load_model(
        os.path.join(directory, "tensorflow.keras")
    )
    result = {
        "case": "across_backends",
        "loaded_is_accum_model": isinstance(loaded, keras_accum.AccumModel),
        "loaded_open_window": loaded.mini_step,
        "loaded_updates": int(loaded.optimizer.iterations.numpy()),
        "loaded_predictions": loaded.predict(x, verbose=0).tolist(),
        "loaded_continued": continue_one_epoch(loaded, x, y, B),
    }
    model = accum_mlp(K, partial_window="carry")
    train_to_an_open_window(model, x, y, B)
    model.save(os.path.join(directory, f"{BACKEND}.keras"))
    result["saved_predictions"] = model.predict(x, verbose=0).tolist()
    result["saved_continued"] = continue_one_epoch(model, x, y, B)
    return result


def pseudo_batch_logger():
    """`PseudoBatchLogger()` over 70 samples, 2 epochs; the test compares
    what it logged with TensorFlow's on the same weights and data."""
    x, y = regression_data(n=70)
    model = accum_mlp(K)
    numpy_weights(model)
    return {"case": "pseudo_batch_logger", **log_pseudo_batches(model, x, y, B)}


def _gradient_is_the_input(accum_steps):
    """A model whose per-sample gradient (w.r.t. its one weight) is x."""
    inputs = keras.Input((1,))
    outputs = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")(
        inputs
    )
    model = keras_accum.AccumModel(inputs, outputs, accum_steps=accum_steps)
    model.compile(
        optimizer=keras.optimizers.SGD(0.0),
        loss=lambda y_true, y_pred: keras.ops.squeeze(y_pred, -1),
    )
    return model


def noise_scale_by_hand():
    """The hand-computed cases of tests/test_noise_scale.py."""
    result = {"case": "noise_scale_by_hand"}
    # Gradients 1, 2, 3, 4, one sample each; then [1, 2], [3, 4], [5].
    for name, accum_steps, batch_size, n in (
        ("equal", 4, 1, 4),
        ("uneven", 3, 2, 5),
    ):
        model = _gradient_is_the_input(accum_steps)
        logger = keras_accum.PseudoBatchLogger(noise_scale=True)
        x = np.arange(1, n + 1, dtype="float32")[:, None]
        history = model.fit(
            x,
            x,
            batch_size=batch_size,
            shuffle=False,
            verbose=0,
            callbacks=[logger],
        )
        (update,) = logger.updates
        result[name] = {
            "samples": update.samples,
            "micro_batches": update.micro_batches,
            "trace": update.trace,
            "grad_sq": update.grad_sq,
            "estimate": logger.noise_scale_estimate,
            "logged": history.history["pseudo_batch_noise_scale"],
        }
    return result


def noise_scale_like_tensorflow():
    """`PseudoBatchLogger(noise_scale=True, noise_scale_every=2)`; the test
    compares it with TensorFlow's on the same weights and data."""
    x, y = regression_data(n=70)
    model = accum_mlp(K)
    numpy_weights(model)
    return {
        "case": "noise_scale_like_tensorflow",
        **log_noise_scale(model, x, y, B),
    }


def tensorboard():
    """`PseudoBatchLogger(log_dir=...)`: the scalars it wrote, and what it
    logged."""
    x, y = regression_data(n=64)
    model = accum_mlp(K)
    model.compile(optimizer="sgd", loss="mse")
    with tempfile.TemporaryDirectory() as directory:
        logger = keras_accum.PseudoBatchLogger(log_dir=directory)
        model.fit(x, y, batch_size=B, epochs=2, verbose=0, callbacks=[logger])
        # Written when training ends.
        scalars = tensorboard_scalars(directory, "pseudo_batch_loss")
    return {
        "case": "tensorboard",
        "scalars": scalars,
        "logged": [[u.update, u.loss] for u in logger.updates],
    }


def refusal(name, build):
    """Runs `build`; reports the error an unsupported feature raised."""
    try:
        build()
    except Exception as error:  # noqa: BLE001 (the refusal is the result)
        return {
            "case": name,
            "error": type(error).__name__,
            "message": str(error),
        }
    return {"case": name, "error": None, "message": ""}


def _fit_small(model, **fit_kwargs):
    x, y = regression_data(n=16)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=B, verbose=0, **fit_kwargs)


def batch_normalization(shape):
    """`AccumBatchNormalization`'s moving statistics against
    `BatchNormalization`'s in a plain model at the large batch, as in
    tests/test_layers.py: one layer on the inputs, one on a dense layer's
    activations, weights held fixed (learning rate 0)."""
    x, y = batch_norm_data(shape)
    plain = batch_norm_model(
        keras.Model, keras.layers.BatchNormalization, shape
    )
    accum = batch_norm_model(
        keras_accum.AccumModel,
        keras_accum.AccumBatchNormalization,
        shape,
        accum_steps=K,
    )
    # The layer has window weights besides BatchNormalization's.
    for mine, theirs in zip(
        accum.trainable_weights, plain.trainable_weights, strict=True
    ):
        mine.assign(theirs.numpy())
    plain.fit(x, y, batch_size=B * K, epochs=2, shuffle=False, verbose=0)
    accum.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)

    def statistics(model):
        return [
            np.concatenate(
                [layer.moving_mean.numpy(), layer.moving_variance.numpy()]
            )
            for layer in model.layers
            if isinstance(layer, keras.layers.BatchNormalization)
        ]

    pairs = list(zip(statistics(plain), statistics(accum), strict=True))
    return {
        "case": f"batch_normalization_{len(shape)}d",
        "layers": len(pairs),
        "max_abs_diff": max(float(np.max(np.abs(p - a))) for p, a in pairs),
        "max_rel_diff": max(
            float(np.max(np.abs(p - a) / np.abs(p))) for p, a in pairs
        ),
        "moved": min(float(np.max(np.abs(p - 1.0))) for p, _ in pairs),
        "open_counts": [
            float(layer.window_count.numpy())
            for layer in accum.layers
            if isinstance(layer, keras_accum.AccumBatchNormalization)
        ],
    }


def main():
    started = time.perf_counter()
    cases = [
        lambda: equivalence("sgd", "sgd"),
        lambda: equivalence("adam", "adam"),
        lambda: equivalence("adamw_clipped", "adamw_clipped"),
        lambda: equivalence("uneven_last_batch", "adam", n=70),
        lambda: equivalence("lr_schedule", "sgd_schedule"),
        lambda: equivalence("clipnorm", "sgd_clipnorm"),
        lambda: equivalence("clipvalue", "sgd_clipvalue"),
        lambda: equivalence(
            "class_weight",
            "adam",
            n=70,
            data="classes",
            class_weight={0: 1.0, 1: 3.0, 2: 0.5, 3: 2.0},
        ),
        lambda: equivalence(
            "multi_output_loss_weights", "adam", n=70, data="two_outputs"
        ),
        lambda: equivalence(
            "unknown_length_dataset", "sgd_momentum", n=70, unknown_length=True
        ),
        *(
            # Uneven last batch, sample weights and a weight regularizer
            # (counted once per window) under each reduction.
            (
                lambda reduction=reduction: equivalence(
                    f"reduction_{reduction}",
                    "sgd_sum" if reduction == "sum" else "sgd_mean",
                    n=70,
                    reduction=reduction,
                    weighted=True,
                    layer_kwargs={
                        "kernel_regularizer": keras.regularizers.L2(0.01)
                    },
                )
            )
            for reduction in (
                "sum_over_batch_size",
                "sum",
                "mean_with_sample_weight",
            )
        ),
        *([data_parallel] if BACKEND == "jax" else []),
        unused_weights,
        *(
            # Keras's PyTorch trainer runs one step per call; its
            # `jit_compile=True` is `torch.compile` (one shape: n=64).
            [
                lambda: equivalence(
                    "jit_compile", "adam", epochs=1, jit_compile=True
                )
            ]
            if BACKEND == "torch"
            else [
                lambda: equivalence(
                    "steps_per_execution_3", "adam", n=70, steps_per_execution=3
                )
            ]
        ),
        lambda: equivalence("run_eagerly", "adam", epochs=1, run_eagerly=True),
        epoch_schedule,
        schedule_by_update_count,
        non_finite_window,
        lambda: mixed_precision("mixed_float16"),
        lambda: mixed_precision("mixed_bfloat16"),
        nan_under_loss_scaling,
        save_and_load,
        pseudo_batch_logger,
        noise_scale_by_hand,
        noise_scale_like_tensorflow,
        tensorboard,
        lambda: batch_normalization((4,)),
        lambda: batch_normalization((5, 5, 3)),
        lambda: refusal(
            "schedule_returning_zero",
            lambda: _fit_small(
                accum_mlp(lambda u: keras.ops.where(u < 10, 0, 4))
            ),
        ),
    ]
    exchange = os.environ.get("KERAS_ACCUM_EXCHANGE_DIR")
    if exchange:
        cases.append(lambda: across_backends(exchange))
    results = {
        "backend": BACKEND,
        "tensorflow_at_import": TENSORFLOW_AT_IMPORT,
        "cases": [],
    }
    for index, run in enumerate(cases):
        try:
            results["cases"].append(run())
        except Exception:  # noqa: BLE001
            # Reported, not raised: the other cases still run.
            results["cases"].append(
                {
                    "case": f"crashed_{index}",
                    "traceback": traceback.format_exc(),
                }
            )
    results["seconds"] = time.perf_counter() - started
    print("RESULTS " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
