"""Shared builders for the equivalence tests.

Every equivalence test trains two models from the same initial weights on
the same data in the same order: a plain `keras.Model` at batch `B * k` and
an `AccumModel` at batch `B` with `accum_steps=k`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np

import keras_accum


def regression_data(n=70, features=5, outputs=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features, outputs)).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * rng.normal(size=(n, outputs))).astype("float32")
    return x, y


def classification_data(n=70, features=6, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features, classes)).astype("float32")
    y = np.argmax(x @ w + 0.5 * rng.normal(size=(n, classes)), axis=1)
    return x, y.astype("int32")


def batch_norm_data(shape, n=70, seed=0):
    rng = np.random.default_rng(seed)
    # Far from the initial moving statistics (0 and 1), unevenly scaled.
    x = 3.0 + rng.normal(size=(n, *shape)) * np.arange(1, shape[-1] + 1)
    y = rng.normal(size=(n, 1))
    return x.astype("float32"), y.astype("float32")


def batch_norm_model(model_cls, norm_cls, shape, **kwargs):
    """Two `norm_cls` layers: on the inputs, and on a dense layer's
    activations; compiled with learning rate 0."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input(shape)
    normalized = keras.layers.Flatten()(norm_cls(momentum=0.5)(inputs))
    # The second one is not after the first: micro-batch normalization
    # would change its inputs (see the layer's docstring).
    hidden = keras.layers.Dense(6, activation="tanh")(
        keras.layers.Flatten()(inputs)
    )
    hidden = norm_cls(momentum=0.8)(hidden)
    x = keras.layers.Concatenate()([normalized, hidden])
    outputs = keras.layers.Dense(1)(x)
    model = model_cls(inputs, outputs, **kwargs)
    # Weights fixed, so the second layer's inputs are too: the moving
    # statistics can then be compared exactly.
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    return model


def moving_statistics(model):
    """`(moving_mean, moving_variance)` of each `BatchNormalization` layer
    of `model` (`AccumBatchNormalization` too), as numpy arrays, in the
    order of `model.layers`."""
    return [
        (layer.moving_mean.numpy(), layer.moving_variance.numpy())
        for layer in model.layers
        if isinstance(layer, keras.layers.BatchNormalization)
    ]


def mlp(model_cls=keras.Model, features=5, outputs=3, seed=1, **kwargs):
    """A small MLP, identical weights for the same `seed`."""
    keras.utils.set_random_seed(seed)
    layer_kwargs = kwargs.pop("layer_kwargs", {})
    activation = kwargs.pop("activation", None)
    inputs = keras.Input((features,))
    hidden = keras.layers.Dense(8, activation="tanh", **layer_kwargs)(inputs)
    outputs = keras.layers.Dense(
        outputs, activation=activation, **layer_kwargs
    )(hidden)
    return model_cls(inputs, outputs, **kwargs)


def accum_mlp(accum_steps, **kwargs):
    return mlp(keras_accum.AccumModel, accum_steps=accum_steps, **kwargs)


def activation_mlp(model_cls, **kwargs):
    """An MLP whose activations are large against its weights: 2 x 1024
    floats a sample (64-1024-1024-10); for the memory of a split step."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(1024, activation="relu")(inputs)
    hidden = keras.layers.Dense(1024, activation="relu")(hidden)
    outputs = keras.layers.Dense(10)(hidden)
    return model_cls(inputs, outputs, **kwargs)


def activation_data(samples):
    """`samples` inputs for `activation_mlp`, and labels of 10 classes."""
    rng = np.random.default_rng(0)
    x = rng.random((samples, 64), dtype=np.float32)
    return x, rng.integers(0, 10, size=(samples,))


class UpdateRecorder(keras.callbacks.Callback):
    """Records the weights after every optimizer update.

    For an `AccumModel` only batches that end a window change
    `optimizer.iterations`; those are the updates to compare.
    """

    def __init__(self):
        super().__init__()
        self.updates = []
        self._last = 0

    def on_train_batch_end(self, batch, logs=None):
        self._record()

    def on_epoch_end(self, epoch, logs=None):
        self._record()

    def _record(self):
        iterations = int(self.model.optimizer.iterations.numpy())
        if iterations != self._last:
            self._last = iterations
            self.updates.append(
                (iterations, [w.copy() for w in self.model.get_weights()])
            )


class LoggingRecorder(UpdateRecorder):
    """The weights after every update, and the logs at each batch."""

    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        self.logs.append({k: float(v) for k, v in logs.items()})


def fit_recording(model, x, y, batch_size=8):
    """One epoch of `fit` in order (under a `tf.distribute` strategy `fit`
    splits each batch over the replicas; `train_on_batch` would give each
    replica all of it): its `LoggingRecorder`."""
    recorder = LoggingRecorder()
    model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[recorder],
    )
    return recorder


def overflow_prone(model_cls, **kwargs):
    """`(model, x, y)`: targets of size ~6, at which float16
    backpropagation of a batch of 64 at a loss scale of 2^16 is near its
    overflow (benchmarks/bench_loss_scale.py)."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((32,))
    hidden = keras.layers.Dense(64, activation="tanh")(inputs)
    hidden = keras.layers.Dense(64, activation="tanh")(hidden)
    model = model_cls(inputs, keras.layers.Dense(4)(hidden), **kwargs)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 32)).astype("float32")
    y = x @ rng.normal(size=(32, 4)).astype("float32")
    return model, x, y


class Killed(Exception):
    """What `KillAt` raises unless told otherwise."""


class KillAt(keras.callbacks.Callback):
    """Stops `fit` as a kill would, for a run to resume from a backup.

    After batch `batch` of epoch `epoch` (both from 0), or, where `batch`
    is None, at the start of `epoch`. Raises `error`: an exception or its
    class, `Killed` unless given.
    """

    def __init__(self, epoch, batch=None, error=Killed):
        super().__init__()
        self.at = (epoch, batch)
        self.error = error
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        if self.at == (epoch, None):
            raise self.error

    def on_train_batch_end(self, batch, logs=None):
        if self.at == (self.epoch, batch):
            raise self.error


def max_weight_diff(a, b):
    """The largest |difference| between two models' (or lists') weights."""
    return _distance(_arrays(a), _arrays(b))


# -- Equivalence on any CPU ----------------------------------------------------
#
# The promise is "equal to the plain large batch, to float32 rounding". How
# far float32 rounding takes a model differs by platform: on CPUs with
# AVX-512/AMX, PyTorch's plain model at batch 32 was seen 8.1e-6 from
# exact arithmetic where `AccumModel` at batch 8 was 5.9e-7 (on other
# CPUs both are near 1e-8), so a fixed tolerance between the two failed
# there. The rule, used by every equivalence test:
#
# 1. `AccumModel` and the plain model agree within `atol` (and `rtol`):
#    equal to float32 rounding on this platform. Otherwise
# 2. the plain model's training is replayed in float64 (`LargeBatch`), the
#    exact arithmetic both approximate, and `AccumModel` must be no further
#    from it than `FLOAT64_FACTOR` times the plain model is (or than
#    `atol` times the weights' scale): the difference is then the
#    platform's rounding of the reference, not the window's.
#
# A real error in the window (a sign, a weighting, a skipped micro-batch)
# fails both: it moves `AccumModel` away from the exact run, not only from
# the plain one (tests/test_equivalence.py shows one that still fails).

FLOAT64_FACTOR = 4.0
# `ACCUM_TESTS_FLOAT64=1` applies rule 2 to every comparison, also those
# rule 1 passes: every replay then runs, as on a platform where the plain
# model rounds coarsely (`ACCUM_TESTS_FLOAT64=1 bash .ci/test`).
ALWAYS_FLOAT64 = os.environ.get("ACCUM_TESTS_FLOAT64") == "1"
# What the float64 replays decided, for the run's summary (conftest.py).
FLOAT64_VERDICTS = []


@contextlib.contextmanager
def float64():
    """Keras creates float64 models, optimizers and losses inside.

    Models, layers, optimizers and losses take their dtype from `floatx()`
    and the dtype policy when they are created; JAX computes in 64 bits
    only with x64 enabled.
    """
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    x64 = contextlib.nullcontext()
    if keras.backend.backend() == "jax":
        import jax

        x64 = jax.enable_x64(True)
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        with x64:
            yield
    finally:
        keras.config.set_dtype_policy(policy)
        keras.config.set_floatx(floatx)


def build_optimizer(model):
    """Builds a compiled, built model's optimizer before its first step.

    Keras on TensorFlow builds it inside the first trace of the train
    function (without a distribution strategy), and a stateful
    optimizer's new variables make TensorFlow trace the step twice: a
    plain MLP's first `fit` under Adam took 0.70-0.86 CPU-s, 0.45-0.47
    with the optimizer built first. Built here, as Keras builds it on JAX
    and PyTorch before their first step, its variables start from the
    same values and the training is the same. A no-op elsewhere.
    """
    optimizer = getattr(model, "optimizer", None)
    if (
        keras.backend.backend() != "tensorflow"
        # `AccumModel` builds its optimizer itself, before its step.
        or isinstance(model, keras_accum.AccumModel)
        or optimizer is None
        or optimizer.built
        or not model.built
        or getattr(model, "_distribute_strategy", None) is not None
        or not model.trainable_variables
    ):
        return
    optimizer.build(model.trainable_variables)


class LargeBatch:
    """The plain model of an equivalence test, replayable in float64.

    Wrap the compiled plain model before it trains and train it through
    this object: `fit` and `train_on_batch` run on `model` and are recorded
    (with `updates`, the weights after each optimizer update, and the
    logs), so that `float64()` can run the same training on a float64 copy:
    the same weights and optimizer state to start with, the same optimizer,
    loss and data. The copy is made only when a comparison needs it.

    Args:
        model: The compiled plain model, before the training to compare.
        rebuild: For a model Keras cannot rebuild from its config, a
            function that returns it built and uncompiled; called inside
            `float64()`.
    """

    def __init__(self, model, rebuild=None):
        self.model = model
        self.updates = UpdateRecorder()
        self.logs = {}
        self._rebuild = rebuild
        self._config = None
        if rebuild is None:
            try:
                self._config = model.get_config()
            except NotImplementedError:  # Then `float64()` says so.
                pass
        self._weights = [w.copy() for w in model.get_weights()]
        optimizer = model.optimizer
        self._optimizer_values = None
        if optimizer is not None and optimizer.built:
            self._optimizer_values = [
                keras.ops.convert_to_numpy(v) for v in optimizer.variables
            ]
        self._calls = []
        self._twin = None

    def fit(self, *args, callbacks=None, **kwargs):
        # At the first step, where Keras would build it (in the trace).
        build_optimizer(self.model)
        self._calls.append(("fit", args, kwargs))
        callbacks = [self.updates, *(callbacks or [])]
        history = self.model.fit(*args, callbacks=callbacks, **kwargs)
        _extend_logs(self.logs, history.history)
        return history

    def train_on_batch(self, *args, **kwargs):
        build_optimizer(self.model)
        self._calls.append(("train_on_batch", args, kwargs))
        logs = self.model.train_on_batch(*args, **kwargs)
        self.updates.set_model(self.model)
        self.updates._record()
        return logs

    def float64(self):
        """`(weights, updates, logs)` of the same training in float64.

        `updates` as `self.updates.updates`, `logs` as `self.logs`. The
        float64 model is kept, and trains on the calls made since.
        """
        if self._twin is None:
            with float64():
                self._twin = self._float64_model(), UpdateRecorder(), {}, 0
        twin, updates, logs, done = self._twin
        with float64():
            for method, args, kwargs in self._calls[done:]:
                # Float data in float64 too: a layer that computes in its
                # input's dtype (BatchNormalization) would stay float32.
                args, kwargs = keras.tree.map_structure(
                    _as_float64, (args, kwargs)
                )
                if method == "fit":
                    kwargs = {**kwargs, "verbose": 0}
                    history = twin.fit(*args, callbacks=[updates], **kwargs)
                    _extend_logs(logs, history.history)
                else:
                    twin.train_on_batch(*args, **kwargs)
                    updates.set_model(twin)
                    updates._record()
        self._twin = twin, updates, logs, len(self._calls)
        return twin.get_weights(), updates.updates, logs

    def _float64_model(self):
        plain = self.model
        if self._rebuild is not None:
            twin = self._rebuild()
        elif self._config is None:
            raise AssertionError(
                f"No float64 replay of {type(plain).__name__}: it has no "
                "config; pass `LargeBatch(model, rebuild=...)`."
            )
        else:
            twin = type(plain).from_config(_float64_config(self._config))
            if len(twin.weights) != len(self._weights):
                # A subclassed model builds its weights on its first call.
                twin(_first_input(self._calls))
        twin.set_weights(self._weights)
        given = plain._compile_config.config
        optimizer = getattr(plain.optimizer, "inner_optimizer", None)
        optimizer = optimizer or plain.optimizer
        twin.compile(
            optimizer=type(optimizer).from_config(optimizer.get_config()),
            loss=_fresh_losses(given.get("loss")),
            loss_weights=given.get("loss_weights"),
        )
        if self._optimizer_values is not None:
            twin.optimizer.build(twin.trainable_variables)
            for variable, value in zip(
                twin.optimizer.variables, self._optimizer_values, strict=True
            ):
                variable.assign(value)
        return twin


def _as_float64(value):
    if isinstance(value, np.ndarray) and value.dtype == np.float32:
        return value.astype("float64")
    return value


def _extend_logs(logs, history):
    for key, values in history.items():
        logs.setdefault(key, []).extend(values)


def _first_input(calls):
    """One sample of the first input a recorded call trained on."""
    _, args, kwargs = calls[0]
    x = args[0] if args else kwargs["x"]
    return keras.tree.map_structure(lambda a: np.asarray(a)[:1], x)


def _float64_config(config):
    """A model config whose float layers compute in float64."""
    if isinstance(config, dict):
        if config.get("class_name") == "DTypePolicy":
            inner = config.get("config", {})
            if "float" in inner.get("name", ""):
                return {**config, "config": {**inner, "name": "float64"}}
        return {
            key: (
                "float64"
                if key == "dtype"
                and isinstance(value, str)
                and "float" in value
                else _float64_config(value)
            )
            for key, value in config.items()
        }
    if isinstance(config, list):
        return [_float64_config(value) for value in config]
    return config


def _fresh_losses(loss):
    """`loss` as given to `compile`, each loss object made again (in the
    current `floatx()`: a loss computes in the dtype it was created with)."""
    if isinstance(loss, keras.losses.Loss):
        return type(loss).from_config(loss.get_config())
    if isinstance(loss, dict):
        return {key: _fresh_losses(value) for key, value in loss.items()}
    if isinstance(loss, (list, tuple)):
        return type(loss)(_fresh_losses(value) for value in loss)
    return loss


def _arrays(weights):
    if isinstance(weights, keras.Model):
        return weights.get_weights()
    return [np.asarray(w, "float64") for w in weights]


def _distance(a, b):
    return max(
        (
            float(np.max(np.abs(u - v), initial=0.0))
            for u, v in zip(a, b, strict=True)
        ),
        default=0.0,
    )


def assert_equivalent(
    accum, plain, atol=1e-6, rtol=1e-5, update=None, key=None, exact=None
):
    """Asserts that `accum` equals the plain large batch on any CPU.

    `accum` and `plain` are models or lists of arrays; `plain` may be a
    `LargeBatch`, whose float64 replay decides where the float32 values
    differ by more than `atol` and `rtol` (the rule above). With a
    `LargeBatch`, `update` compares the weights after its `update`-th
    update (an index into `updates.updates`) and `key` its logged values
    of `key` (`accum`: the same values of the `AccumModel`'s fits).
    `exact`: for a `plain` given as arrays, the float64 run's (made in
    another process, say), or a function that returns them when needed.
    Returns the largest |difference| between the two.
    """
    reference = plain if isinstance(plain, LargeBatch) else None
    if reference is not None:
        plain = _pick(reference.model.get_weights(), reference, update, key)
    if key is not None:
        accum = [accum]
    a, p = _arrays(accum), _arrays(plain)
    diff = _distance(a, p)
    agree = all(
        np.allclose(u, v, atol=atol, rtol=rtol)
        for u, v in zip(a, p, strict=True)
    )
    replayable = reference is not None or exact is not None
    if agree and not (ALWAYS_FLOAT64 and replayable):
        return diff
    what = "" if update is None else f" at update {update + 1}"
    what += "" if key is None else f" in {key!r}"
    if not replayable:
        raise AssertionError(
            f"AccumModel is {diff:.3g} from the plain model{what} "
            f"(atol={atol}, rtol={rtol}), and no float64 replay was given"
        )
    if exact is None:
        weights, updates, logs = reference.float64()
        exact = _pick(weights, (updates, logs), update, key)
    elif callable(exact):
        exact = exact()
    exact = _arrays(exact)
    plain_error, accum_error = _distance(p, exact), _distance(a, exact)
    size = max(float(np.max(np.abs(e), initial=0.0)) for e in exact)
    # The tolerance's own floor, in the values' units.
    floor = max(atol * max(1.0, size), rtol * size)
    # A replay that trained otherwise than the plain model would make any
    # difference look small.
    assert plain_error <= 1000 * max(floor, atol), (
        f"The float64 replay is {plain_error:.3g} from the plain model{what}: "
        "it does not repeat the plain model's training"
    )
    bound = max(FLOAT64_FACTOR * plain_error, floor)
    verdict = (
        f"{accum_error:.3g} from float64 (plain: {plain_error:.3g}, "
        f"{diff:.3g} apart){what}"
    )
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    FLOAT64_VERDICTS.append(f"{verdict}  {test}")
    assert accum_error <= bound, (
        f"AccumModel is {verdict}: more than {FLOAT64_FACTOR:g} times the "
        f"plain model's own float32 error, or the tolerance ({floor:.3g})"
    )
    return diff


def _pick(weights, source, update, key):
    """What `assert_equivalent` compares, of one run."""
    if isinstance(source, LargeBatch):
        updates, logs = source.updates.updates, source.logs
    else:
        updates, logs = source
    if key is not None:
        return [logs[key]]
    if update is not None:
        return updates[update][1]
    return weights


def assert_same_weights(a, b, atol=1e-6, rtol=1e-5):
    """`assert_equivalent` under the name the tests read it by: `b` is the
    reference (a `LargeBatch` where it is a plain large-batch model)."""
    assert_equivalent(a, b, atol=atol, rtol=rtol)


def train_pair(
    plain,
    accum,
    x,
    y,
    batch_size,
    accum_steps,
    epochs=2,
    compare_each_update=True,
    atol=1e-6,
    **fit_kwargs,
):
    """Fits both models; asserts equal updates; returns the max diff.

    `plain` (a model, or a `LargeBatch` around one) trains at
    `batch_size * accum_steps`, `accum` at `batch_size`; each update and
    the final weights are compared by `assert_equivalent`.
    """
    reference = plain if isinstance(plain, LargeBatch) else LargeBatch(plain)
    accum_rec = UpdateRecorder()
    common = {"epochs": epochs, "shuffle": False, "verbose": 0, **fit_kwargs}
    plain_hist = reference.fit(
        x, y, batch_size=batch_size * accum_steps, **common
    )
    accum_hist = accum.fit(
        x, y, batch_size=batch_size, callbacks=[accum_rec], **common
    )
    plain = reference.model
    assert int(accum.optimizer.iterations) == int(plain.optimizer.iterations)
    if compare_each_update:
        plain_updates = reference.updates.updates
        assert [i for i, _ in accum_rec.updates] == [
            i for i, _ in plain_updates
        ]
        for index, (_, weights) in enumerate(accum_rec.updates):
            assert_equivalent(weights, reference, atol=atol, update=index)
    diff = assert_equivalent(accum, reference, atol=atol)
    return diff, plain_hist, accum_hist


def train_to_an_open_window(model, x, y, batch_size):
    """Adam on 70 samples, `accum_steps=4`, "carry": 2 updates, 1 open.

    What each backend does before saving a model for another one
    (test_backends.py).
    """
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)


def continue_one_epoch(model, x, y, batch_size):
    """The weights after one more epoch."""
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    return model.get_weights()


def numpy_weights(model, seed=1):
    """Sets the weights from numpy's generator: the same on every backend.

    Keras's initialisers draw from the backend's own generator, so `mlp`'s
    weights for one seed differ between backends.
    """
    rng = np.random.default_rng(seed)
    model.set_weights(
        [
            rng.normal(scale=0.5, size=w.shape).astype("float32")
            for w in model.get_weights()
        ]
    )


def replay_windows(plain, x, y, updates, epochs, batch_size, **kwargs):
    """Trains `plain` on each recorded update's window as one batch.

    `updates` are `PseudoBatchLogger.updates` of an `AccumModel` that ran
    `epochs` epochs of `fit(x, y, batch_size=batch_size, shuffle=False)`;
    each takes its next `micro_batches` micro-batches, in order, as one
    `train_on_batch`. `sample_weight` (an array over `x`) gives each
    sample its weight; `lr_scaled=True` also multiplies it by the update's
    `lr_scale` (for SGD the same as scaling its learning rate). Returns
    the micro-batches left over (an open window).
    """
    sample_weight = kwargs.pop("sample_weight", None)
    lr_scaled = kwargs.pop("lr_scaled", False)
    n = len(x)
    starts = [i for _ in range(epochs) for i in range(0, n, batch_size)]
    position = 0
    for update in updates:
        parts = starts[position : position + update.micro_batches]
        position += update.micro_batches
        rows = np.concatenate(
            [np.arange(i, min(i + batch_size, n)) for i in parts]
        )
        weights = None if sample_weight is None else sample_weight[rows]
        if lr_scaled:
            scale = np.full(len(rows), update.lr_scale, "float32")
            weights = scale if weights is None else weights * scale
        plain.train_on_batch(x[rows], y[rows], sample_weight=weights)
    return len(starts) - position


def tensorboard_scalars(directory, tag):
    """`(step, value)` of the scalars `tag` in the event files there."""
    import tensorflow as tf

    scalars = []
    for path in sorted(Path(directory).glob("events.out.tfevents.*")):
        for record in tf.data.TFRecordDataset(str(path)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                if value.tag == tag:
                    number = tf.make_ndarray(value.tensor)
                    scalars.append((int(event.step), float(number)))
    return scalars


@contextlib.contextmanager
def batches_taken_eagerly():
    """Within the block, the batches taken out of an iterator in Python
    (eagerly), not inside a traced function: a `tf.data` iterator's, or a
    `tf.distribute` strategy's distributed iterator's. Yields a list that
    gets one entry per batch so taken."""
    import tensorflow as tf
    from tensorflow.python.data.ops import iterator_ops
    from tensorflow.python.distribute import input_lib

    get_next = {
        iterator_ops.OwnedIterator._next_internal.__code__,
        input_lib.DistributedIteratorBase.get_next.__code__,
    }
    taken = []

    def outermost(frame):
        # A distributed iterator's batch is taken from its replicas'
        # iterators: one batch.
        caller = frame.f_back
        while caller is not None:
            if caller.f_code in get_next:
                return False
            caller = caller.f_back
        return True

    def profile(frame, event, arg):
        if (
            event == "call"
            and frame.f_code in get_next
            and tf.executing_eagerly()
            and outermost(frame)
        ):
            taken.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        yield taken
    finally:
        sys.setprofile(None)


def eager_batches(model, data, **kwargs) -> int:
    """The batches `model.fit(data)` takes out of its iterator eagerly
    (`batches_taken_eagerly`)."""
    with batches_taken_eagerly() as taken:
        model.fit(data, verbose=0, **kwargs)
    return len(taken)


def suite_xla_flags(*leaving_out):
    """The suite's `XLA_FLAGS` (tests/conftest.py: XLA's quicker compiles;
    on JAX two CPU devices) without the flags named: for a process that
    sets up its own devices, or whose steps are big enough to want LLVM's
    optimizations."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return " ".join(
        flag for flag in flags if not any(name in flag for name in leaving_out)
    )


def run_in_fresh_process(args, env):
    """Runs `python *args` in a fresh process; returns its RESULTS JSON.

    For what one process cannot hold: `tf.distribute`'s logical devices
    and workers (test_distribute.py), Keras on JAX beside TensorFlow
    (test_embeddings.py). The script prints one line `RESULTS {...}`.
    """
    result = subprocess.run(
        [sys.executable, *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(
        (x for x in result.stdout.splitlines() if x.startswith("RESULTS ")),
        None,
    )
    assert line is not None, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(line[len("RESULTS ") :])


def free_ports(n):
    """`n` free TCP ports on 127.0.0.1."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def run_processes(runs, directory, timeout=600):
    """Runs `python *args` for each `(args, env)` of `runs` at once, for
    the processes of one distributed job; returns the seconds they took.

    Each process's output goes to `directory/process{i}.log`; all must
    exit with 0 within `timeout` seconds, and are killed otherwise.
    """
    processes, logs = [], []
    started = time.perf_counter()
    try:
        for index, (args, env) in enumerate(runs):
            log = open(Path(directory) / f"process{index}.log", "w")
            logs.append(log)
            processes.append(
                subprocess.Popen(
                    [sys.executable, *map(str, args)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        deadline = started + timeout
        for process in processes:
            process.wait(timeout=max(1, deadline - time.perf_counter()))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for log in logs:
            log.close()
    for index, process in enumerate(processes):
        text = (Path(directory) / f"process{index}.log").read_text()
        assert process.returncode == 0, text[-3000:]
    return time.perf_counter() - started
