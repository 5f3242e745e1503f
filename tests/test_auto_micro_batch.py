"""`micro_batch_size="auto"` (`AutoMicroBatch`): the size that fits a
memory limit, found before the first step; and the shrink that redoes a
batch after the backend's own out-of-memory error, exactly."""

import contextlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest
from _helpers import (
    LargeBatch,
    UpdateRecorder,
    assert_equivalent,
    mlp,
    regression_data,
)

import keras_accum
from keras_accum import _sizing

BACKEND = keras.backend.backend()


# -- The search, on hand-computed peaks ----------------------------------------


def _counted(peak):
    calls = []

    def measure(size):
        calls.append(size)
        return peak(size)

    return measure, calls


@pytest.mark.parametrize("exact", [True, False])
def test_search_finds_the_largest_size_under_a_linear_peak(exact):
    # 1000 + 100 m <= 2350: m = 13 (2300); 14 needs 2400.
    measure, calls = _counted(lambda m: 1000 + 100 * m)
    size, peak, peaks = _sizing.search(measure, 64, 2350, exact)
    assert (size, peak) == (13, 2300)
    assert peaks[14] == 2400 if exact else 14 not in peaks
    # The line through two sizes lands on it: no bisection of 64 sizes.
    assert len(calls) <= 5
    assert len(set(calls)) == len(calls)


def test_search_covers_every_size_under_a_curved_peak():
    # m**2 + 10 <= 59: m = 7, not a power of 2.
    size, peak, _ = _sizing.search(lambda m: m * m + 10, 100, 59, True)
    assert (size, peak) == (7, 59)
    size, _, _ = _sizing.search(lambda m: m * m + 10, 100, 58, True)
    assert size == 6


def test_search_stops_at_the_batch_and_counts_a_failed_probe_as_too_big():
    assert _sizing.search(lambda m: m, 48, 10**9, True)[0] == 48
    assert _sizing.search(lambda m: m, 48, 10**9, False)[0] == 48
    # A probe that ran out of memory (None) does not fit.
    size, _, _ = _sizing.search(
        lambda m: None if m > 5 else 100 * m, 48, 10**9, False
    )
    assert size == 5
    with pytest.raises(_sizing.OutOfMemoryAtOne):
        _sizing.search(lambda m: 1000 + m, 48, 999, False)


# -- The setting ---------------------------------------------------------------


def _model(micro_batch_size, **kwargs):
    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(3)(inputs)
    return keras_accum.AccumModel(
        inputs, outputs, micro_batch_size=micro_batch_size, **kwargs
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"memory_limit": 0}, r"`memory_limit` .* Received: memory_limit=0"),
        ({"memory_limit": -5}, r"Received: memory_limit=-5"),
        ({"memory_limit": 2.5e9}, r"Received: memory_limit=2500000000.0"),
        ({"memory_limit": True}, r"Received: memory_limit=True"),
        ({"margin": 1.0}, r"`margin` must be a number in \[0, 1\). "),
        ({"margin": -0.1}, r"Received: margin=-0.1"),
        ({"margin": "big"}, r"Received: margin='big'"),
    ],
)
def test_bad_limits_are_refused_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        keras_accum.AutoMicroBatch(**kwargs)


def test_auto_is_an_auto_micro_batch_and_refused_beside_accum_steps():
    assert _model("auto").micro_batch_size == keras_accum.AutoMicroBatch()
    match = r"Received: accum_steps=4, micro_batch_size=AutoMicroBatch\("
    with pytest.raises(ValueError, match=match):
        _model("auto", accum_steps=4)
    with pytest.raises(ValueError, match=r"accum_steps='auto', micro_batch"):
        _model(keras_accum.AutoMicroBatch(), accum_steps="auto")
    with pytest.raises(TypeError, match=r"Received: micro_batch_size='Auto'"):
        _model("Auto")


def test_the_setting_survives_config_clone_conversion_and_saving(tmp_path):
    auto = keras_accum.AutoMicroBatch(memory_limit=3 * 2**30, margin=0.25)
    model = _model(auto)
    config = model.get_config()
    json.dumps(config)  # Plain values.
    assert model.from_config(config).micro_batch_size == auto
    assert keras.models.clone_model(model).micro_batch_size == auto
    plain = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    converted = keras_accum.AccumModel.from_model(plain, micro_batch_size=auto)
    assert converted.micro_batch_size == auto
    model.compile(optimizer="sgd", loss="mse")
    path = tmp_path / "auto.keras"
    model.save(path)
    assert keras.saving.load_model(path).micro_batch_size == auto


# -- "auto" against a memory limit --------------------------------------------
#
# A model whose activations dwarf its weights (256 KiB a sample), so that
# one sample more moves the step's peak far beyond the figures' noise.

B_AUTO = 32


def _wide_activations(model_cls, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(128, activation="relu")(inputs)
    hidden = keras.layers.Reshape((1, 128))(hidden)
    hidden = keras.layers.UpSampling1D(512)(hidden)
    hidden = keras.layers.Dense(4)(hidden)
    outputs = keras.layers.GlobalAveragePooling1D()(hidden)
    return model_cls(inputs, outputs, **kwargs)


def _auto_data(samples=2 * B_AUTO):
    rng = np.random.default_rng(0)
    x = rng.random((samples, 64), dtype=np.float32)
    return x, rng.random((samples, 4), dtype=np.float32)


def _jax_peak(size, x, y):
    """XLA's figures for the train step at an int `size`, as Keras jits it:
    arguments + outputs not aliased + temporaries."""
    import jax

    model = _wide_activations(keras_accum.AccumModel, micro_batch_size=size)
    model.compile(optimizer="adam", loss="mse")
    data = (x[:B_AUTO], y[:B_AUTO])
    # Built as `fit` builds it before its first step (the optimizer's
    # slots, the window): the figures depend on the state's shapes only,
    # and a step of `fit` would compile the step once more.
    model._symbolic_build(data_batch=data)
    state = model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
    )
    step = jax.jit(model.train_step, donate_argnums=0)
    # The library's formula: the test checks the search, not the sum.
    return _sizing.compiled_peak(
        step.lower(state, data).compile().memory_analysis()
    )


class _PeakOfSecondStep(keras.callbacks.Callback):
    """TensorFlow's allocator peak over `fit`'s second step (the first
    holds one-time buffers)."""

    def on_train_batch_begin(self, batch, logs=None):
        import tensorflow as tf

        if batch == 1:
            tf.config.experimental.reset_memory_stats("CPU:0")

    def on_train_batch_end(self, batch, logs=None):
        import tensorflow as tf

        if batch == 1:
            self.peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]


def _tensorflow_peak(size, x, y, jit_compile=False):
    model = _wide_activations(keras_accum.AccumModel, micro_batch_size=size)
    model.compile(optimizer="adam", loss="mse", jit_compile=jit_compile)
    peak = _PeakOfSecondStep()
    model.fit(x, y, batch_size=B_AUTO, verbose=0, callbacks=[peak])
    return peak.peak


@pytest.mark.skipif(
    BACKEND == "torch", reason="PyTorch on a CPU has no figures (below)"
)
@pytest.mark.parametrize(
    "jit_compile", [False, True], ids=["graph_or_jax", "xla"]
)
def test_auto_picks_the_largest_size_under_the_limit(jit_compile):
    """A limit between the peaks at 8 and 16 (measured here, apart from
    the search): the size "auto" picks is under it, every size from 1 to
    32 a candidate (on JAX, whose figures are exact, it fits and the next
    does not); and it trains to what `Model(32)` trains to."""
    if BACKEND == "jax" and jit_compile:
        pytest.skip("JAX's step is always compiled: the first case")
    x, y = _auto_data()
    if BACKEND == "jax":

        def peak(size):
            return _jax_peak(size, x, y)

    else:

        def peak(size):
            return _tensorflow_peak(size, x, y, jit_compile)

    limit = (peak(8) + peak(16)) // 2
    auto = keras_accum.AutoMicroBatch(memory_limit=limit, margin=0.0)
    model = _wide_activations(keras_accum.AccumModel, micro_batch_size=auto)
    model.compile(optimizer="adam", loss="mse", jit_compile=jit_compile)
    plain = _wide_activations(keras.Model)
    plain.compile(optimizer="adam", loss="mse", jit_compile=jit_compile)
    reference = LargeBatch(plain)
    recorder = UpdateRecorder()
    common = {"batch_size": B_AUTO, "shuffle": False, "verbose": 0}
    reference.fit(x, y, **common)
    model.fit(x, y, callbacks=[recorder], **common)
    (choice,) = model.micro_batch_choices
    chosen = choice["micro_batch_size"]
    assert choice["step"] == "train" and choice["reason"] == "auto"
    assert choice["budget"] == limit
    assert choice["predicted_peak"] <= limit
    assert 1 <= chosen <= B_AUTO
    if BACKEND == "jax":
        # Measured apart from the search: it fits, the next size does not,
        # and the prediction is the figure.
        at, above = peak(chosen), peak(chosen + 1)
        assert at <= limit < above
        assert choice["predicted_peak"] == at
    # TensorFlow's peaks move between runs by more than a size's worth
    # (here 6.4 against 8.9 MiB for the same step; the benchmark's CNN 174
    # against 192-256 MiB: docs/guides/batches-that-fit.md), so a second
    # measurement cannot confirm the size there; its exactness can.
    assert len(recorder.updates) == 2
    for index, (_, weights) in enumerate(recorder.updates):
        assert_equivalent(weights, reference, update=index)


@pytest.mark.skipif(BACKEND == "torch", reason="refused on a CPU (below)")
def test_auto_sizes_evaluate_and_predict_run_first():
    x, y = _auto_data()
    peak = (_jax_peak if BACKEND == "jax" else _tensorflow_peak)(4, x, y)
    auto = keras_accum.AutoMicroBatch(memory_limit=peak, margin=0.0)
    model = _wide_activations(keras_accum.AccumModel, micro_batch_size=auto)
    model.compile(optimizer="adam", loss="mse")
    plain = _wide_activations(keras.Model)
    plain.compile(optimizer="adam", loss="mse")
    np.testing.assert_allclose(
        model.evaluate(x, y, batch_size=B_AUTO, verbose=0),
        plain.evaluate(x, y, batch_size=B_AUTO, verbose=0),
        rtol=1e-6,
    )
    # Micro-batches of another shape than the batch's run kernels that
    # sum in another order (the 512-step mean): up to 1e-6 apart here.
    np.testing.assert_allclose(
        model.predict(x, batch_size=B_AUTO, verbose=0),
        plain.predict(x, batch_size=B_AUTO, verbose=0),
        rtol=1e-5,
        atol=2e-6,
    )
    steps = [c["step"] for c in model.micro_batch_choices]
    assert steps == ["test", "predict"]
    for choice in model.micro_batch_choices:
        assert choice["predicted_peak"] <= choice["budget"] == peak
        if BACKEND == "jax":
            # Evaluation keeps no gradients: at least the train step's
            # size fits. (TensorFlow's limit here is a `fit` step's
            # allocator peak, which counts the whole process; its probes
            # count the model's own memory: no size follows from it.)
            assert choice["micro_batch_size"] >= 4


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch on a CPU only")
def test_auto_is_refused_on_a_cpu_without_allocator_figures():
    x, y = _auto_data()
    model = _model("auto")
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"on a CPU give an int"):
        model.fit(x[:, :6], y[:, :3], batch_size=8, verbose=0)
    model = _model(keras_accum.AutoMicroBatch(memory_limit=2**30))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"CUDA devices only"):
        model.fit(x[:, :6], y[:, :3], batch_size=8, verbose=0)


# -- Which size each step takes ----------------------------------------------
#
# The step's peak given as a line in the size in place of the backend's
# figures (`_LinearPeaks`): what the rules decide, the same on every
# backend (PyTorch on a CPU has none). A train step needs 1000 + 100 m
# bytes, an evaluation or a prediction 1000 + 50 m: under a budget of
# 2350 bytes, 13 and 27.

LINEAR_SLOPES = {"train": 100, "test": 50, "predict": 50}
LINEAR_AUTO = keras_accum.AutoMicroBatch(memory_limit=2350, margin=0.0)


class _LinearPeaks(keras_accum.AccumModel):
    class _batch_ops_class(keras_accum.AccumModel._batch_ops_class):
        @contextlib.contextmanager
        def probing(self, kind, batch, state):
            yield lambda size: 1000 + LINEAR_SLOPES[kind] * size


def _chosen(model, batch_size=None):
    return [
        (c["step"], c["batch_size"], c["micro_batch_size"])
        for c in model.micro_batch_choices
        if batch_size is None or c["batch_size"] == batch_size
    ]


def test_a_size_chosen_on_a_smaller_batch_is_searched_again_on_a_larger():
    """A first batch of 4 fits whole; it is no bound for the batches of 64
    after it (which it made run as 16 micro-batches of 4)."""
    x, y = regression_data(n=68)
    model = mlp(_LinearPeaks, micro_batch_size=LINEAR_AUTO)
    model.compile(optimizer="adam", loss="mse")
    plain = mlp(keras.Model)
    plain.compile(optimizer="adam", loss="mse")
    reference = LargeBatch(plain)
    recorder = UpdateRecorder()
    for start, stop, batch_size in [(0, 4, 4), (4, 68, 64)]:
        common = {"batch_size": batch_size, "shuffle": False, "verbose": 0}
        reference.fit(x[start:stop], y[start:stop], **common)
        model.fit(x[start:stop], y[start:stop], callbacks=[recorder], **common)
    assert _chosen(model) == [("train", 4, 4), ("train", 64, 13)]
    assert len(recorder.updates) == 2
    for index, (_, weights) in enumerate(recorder.updates):
        assert_equivalent(weights, reference, update=index)


def test_evaluation_and_prediction_are_sized_for_their_own_steps():
    """Validation, `evaluate` and `predict` search their own step's size
    (27: no gradients), not the size of the last train batch (1 sample
    here, which made every evaluation after it run one sample at a
    time)."""
    x, y = regression_data(n=65)
    model = mlp(_LinearPeaks, micro_batch_size=LINEAR_AUTO)
    model.compile(optimizer="adam", loss="mse")
    model.fit(
        x,
        y,
        batch_size=64,
        validation_data=(x[:64], y[:64]),
        validation_batch_size=64,
        shuffle=False,
        verbose=0,
    )
    loss = model.evaluate(x[:64], y[:64], batch_size=64, verbose=0)
    predicted = model.predict(x[:64], batch_size=64, verbose=0)
    assert _chosen(model, 64) == [
        ("train", 64, 13),
        ("test", 64, 27),
        ("predict", 64, 27),
    ]
    # The last train batch's one sample: sized on its own on JAX (each
    # shape is compiled on its own), within the batch's size elsewhere.
    assert _chosen(model, 1) == ([("train", 1, 1)] if BACKEND == "jax" else [])
    plain = mlp(keras.Model)
    plain.compile(optimizer="adam", loss="mse")
    plain.set_weights(model.get_weights())
    np.testing.assert_allclose(
        loss,
        plain.evaluate(x[:64], y[:64], batch_size=64, verbose=0),
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        predicted,
        plain.predict(x[:64], batch_size=64, verbose=0),
        rtol=1e-5,
        atol=1e-7,
    )


@pytest.mark.full_run_only(
    reason="JAX's compiled figures are the step's own by construction, "
    "checked against the compiled step by "
    "test_auto_picks_the_largest_size_under_the_limit; PyTorch on a CPU "
    "refuses 'auto' (test_auto_is_refused_on_a_cpu_without_allocator_"
    "figures)"
)
def test_auto_counts_only_its_own_model_s_memory():
    """Another model alive in the process (48 MiB of weights and Adam
    state, 6 times the limit) is no part of the step's peak: the limit
    still holds a micro-batch of several samples, fewer than the batch.
    (TensorFlow's allocator peak counted it: "even a micro-batch of 1
    sample needs 0.048 GiB".)"""
    x, y = _auto_data(B_AUTO)
    other = keras.Sequential([keras.Input((2048,)), keras.layers.Dense(2048)])
    other.compile(optimizer="adam", loss="mse")
    other.fit(np.ones((4, 2048)), np.ones((4, 2048)), verbose=0)
    limit = 8 * 2**20
    held = [*other.variables, *other.optimizer.variables]
    assert sum(keras.ops.size(v) * 4 for v in held) > 6 * limit
    auto = keras_accum.AutoMicroBatch(memory_limit=limit, margin=0.0)
    model = _wide_activations(keras_accum.AccumModel, micro_batch_size=auto)
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=B_AUTO, verbose=0)
    (choice,) = model.micro_batch_choices
    assert choice["predicted_peak"] <= limit
    # About 0.5 MiB a sample in this step; 32 samples are over the limit.
    assert 2 <= choice["micro_batch_size"] < B_AUTO
    del other


@pytest.mark.tensorflow_only(
    reason="TensorFlow's CPU allocator keeps no figures by default"
)
def test_auto_without_allocator_figures_names_the_environment_variable():
    """Without `TF_CPU_ALLOCATOR_USE_BFC` (which the suite sets), the
    refusal says what to set, and when. In a fresh process: TensorFlow
    reads it when it starts. Where the CPU allocator keeps figures
    anyway (oneDNN's operations on), `"auto"` chooses."""
    script = """
import keras, numpy as np, tensorflow as tf
import keras_accum
try:
    tf.config.experimental.get_memory_info("CPU:0")
    print("FIGURES")
except ValueError:
    print("NO FIGURES")
inputs = keras.Input((6,))
model = keras_accum.AccumModel(
    inputs, keras.layers.Dense(3)(inputs), micro_batch_size="auto"
)
model.compile(optimizer="sgd", loss="mse")
try:
    model.fit(np.ones((8, 6)), np.ones((8, 3)), batch_size=8, verbose=0)
    print("CHOSE", model.micro_batch_choices[0]["micro_batch_size"])
except ValueError as error:
    print("REFUSED", error)
"""
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "0"}
    env.pop("TF_CPU_ALLOCATOR_USE_BFC")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(keras_accum.__file__).parents[1]), env.get("PYTHONPATH", "")]
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    figures, outcome = result.stdout.strip().splitlines()[-2:]
    if figures == "FIGURES":
        assert outcome.startswith("CHOSE ")
    else:
        assert figures == "NO FIGURES"
        assert outcome.startswith("REFUSED ")
        for words in (
            "`TF_CPU_ALLOCATOR_USE_BFC=true`",
            "before TensorFlow is imported",
            "give an int",
            "Received: micro_batch_size=AutoMicroBatch(",
        ):
            assert words in outcome


# -- Out of memory: shrink, and redo the batch from its start ----------------


@keras.saving.register_keras_serializable(package="keras_accum_tests")
class OutOfMemoryAbove(keras.layers.Layer):
    """The identity, except that it runs out of memory, with the backend's
    own error, on a micro-batch whose cost (the sum of feature 0 over its
    samples; on JAX its size, which is all a compiled step knows) is above
    `limit`: as a batch of long sequences would.

    TensorFlow: inside the graph at run time, after the micro-batches
    before it wrote their part, its `ResourceExhaustedError` (a Python
    `MemoryError` in a `tf.py_function`); with `allocate=True`, a real
    allocation of 2**46 floats, refused by the allocator, which first
    waits 10 s for memory to be freed (so only where that matters).
    PyTorch: `torch.OutOfMemoryError`, raised eagerly at the same point.
    JAX: `JaxRuntimeError("RESOURCE_EXHAUSTED: ...")` when the step is
    compiled.

    Armed by `_Arm` when training begins: Keras's build from the first
    batch runs the layer on it too.
    """

    def __init__(self, limit=None, allocate=False, **kwargs):
        super().__init__(**kwargs)
        self.limit = limit
        self.allocate = allocate
        # Set by `_Arm` once `fit` has built the model from a batch.
        self.armed = False

    def call(self, x):
        if self.limit is None or not self.armed:
            return x
        if BACKEND == "tensorflow":
            import tensorflow as tf

            cost = tf.reduce_sum(x[:, 0])
            if self.allocate:
                size = tf.where(cost > self.limit, 2**46, 1)
                waste = tf.random.uniform(tf.reshape(size, [1]))
                return x + 0.0 * tf.reduce_sum(waste)
            waste = tf.py_function(self._refuse, [cost], tf.float32)
            waste.set_shape([])
            return x + 0.0 * tf.cast(waste, x.dtype)
        if BACKEND == "jax":
            import jax

            if x.shape[0] > self.limit:
                raise jax.errors.JaxRuntimeError(
                    f"RESOURCE_EXHAUSTED: a micro-batch of {x.shape[0]}"
                )
            return x
        import torch

        if float(x[:, 0].sum()) > self.limit:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory: a micro-batch of cost {x[:, 0].sum()}"
            )
        return x

    def _refuse(self, cost):
        # TensorFlow turns a `MemoryError` in the graph into its
        # `ResourceExhaustedError`, as it does a refused allocation.
        if float(cost) > self.limit:
            raise MemoryError(f"a micro-batch of cost {float(cost)}")
        return 0.0

    def compute_output_shape(self, input_shape):
        # Keras's symbolic pass must not run the check on stand-in data.
        return input_shape

    def get_config(self):
        config = {"limit": self.limit, "allocate": self.allocate}
        return {**super().get_config(), **config}


class _Arm(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        for layer in self.model.layers:
            if isinstance(layer, OutOfMemoryAbove):
                layer.armed = True


def _oom_model(model_cls, limit, allocate=False, **kwargs):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,))
    hidden = OutOfMemoryAbove(limit, allocate)(inputs)
    hidden = keras.layers.Dense(16, activation="tanh")(hidden)
    return model_cls(inputs, keras.layers.Dense(3)(hidden), **kwargs)


def _oom_data():
    # The costs of the first batch's samples: 8 of 0, then 8 of 1; with
    # micro-batches of 8 the first fits and the second (cost 8) does not:
    # the failure comes after a micro-batch was added to the window.
    rng = np.random.default_rng(5)
    x = rng.random((32, 5), dtype=np.float32)
    y = rng.random((32, 3), dtype=np.float32)
    x[:, 0] = np.tile(np.repeat([0.0, 1.0], 8), 2)
    return x, y


def _fit_against_model_16(model, costs=None):
    """Fits `model` and `Model(16)` (without the failures) on `_oom_data`
    (every sample's cost `costs` if given); asserts one update per batch,
    each equal, and equal logs. Returns the warnings `fit` gave."""
    x, y = _oom_data()
    if costs is not None:
        x[:, 0] = costs
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    recorder = UpdateRecorder()
    reference, expected, history, messages, _ = _armed_fit(
        model, x, y, epochs=2, callbacks=[recorder]
    )
    # Nothing of a failed attempt stays: one update per batch, each equal
    # to `Model(16)`'s, and the same logged loss and metric.
    assert int(model.optimizer.iterations) == 4
    assert len(recorder.updates) == 4
    for index, (_, weights) in enumerate(recorder.updates):
        assert_equivalent(weights, reference, update=index)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(
            history.history[key], expected.history[key], rtol=1e-5
        )
    return messages


def _armed_fit(model, x, y, epochs=1, callbacks=(), during=None):
    """Fits a plain `Model(16)` on `x`, `y` in batches of 16, then `model`
    with its out-of-memory layer armed (`_Arm`), inside the context
    manager `during` where given. Returns `(reference, its history,
    model's history, the messages of the warnings model's fit gave, what
    `during` yielded)`."""
    plain = _oom_model(keras.Model, None)
    plain.compile(optimizer="adam", loss="mse", metrics=["mae"])
    reference = LargeBatch(plain)
    common = {"batch_size": 16, "epochs": epochs, "shuffle": False}
    expected = reference.fit(x, y, verbose=0, **common)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with during or contextlib.nullcontext() as seen:
            history = model.fit(
                x, y, callbacks=[_Arm(), *callbacks], verbose=0, **common
            )
    messages = [str(w.message) for w in caught]
    return reference, expected, history, messages, seen


# JAX sees sizes only: above 4 samples. Elsewhere a cost above 4.5.
LIMIT = 4 if BACKEND == "jax" else 4.5


def test_out_of_memory_shrinks_and_redoes_the_batch_exactly():
    # On TensorFlow a real allocation, refused (the other tests raise its
    # error without the allocator's wait).
    model = _oom_model(
        keras_accum.AccumModel, LIMIT, allocate=True, micro_batch_size=8
    )
    caught = _fit_against_model_16(model)
    shrinks = [m for m in caught if "ran out of memory" in m]
    assert shrinks, caught
    assert "micro_batch_size=8" in shrinks[0]
    assert "micro_batch_size=4" in shrinks[0]
    assert len(shrinks) == 1  # Once shrunk, the size stays.
    (choice,) = model.micro_batch_choices
    assert choice["reason"] == "out of memory"
    assert choice["micro_batch_size"] == 4
    # The shrink holds for every batch of the train step (on JAX a batch
    # of another shape too, which ran out again at 8), into the next
    # `fit`; the setting still reads 8.
    x, y = _oom_data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x[8:16], y[8:16], batch_size=8, verbose=0)
    assert not [w for w in caught if "ran out of memory" in str(w.message)]
    assert int(model.optimizer.iterations) == 5
    assert model.micro_batch_size == 8
    assert len(model.micro_batch_choices) == 1
    # Until `compile()`: the size is the setting again.
    model.compile(optimizer="adam", loss="mse")
    assert model.micro_batch_choices == []


@pytest.mark.skipif(
    BACKEND == "torch", reason="PyTorch runs one step per execution"
)
def test_out_of_memory_inside_an_execution_loses_no_batch():
    """With `steps_per_execution=3`, the second step of a call runs out of
    memory (on TensorFlow inside the graph, which took its batch): it is
    undone and redone, and the third step runs after it in the same call:
    three updates, each `Model(16)`'s."""
    x, y = _oom_data()
    x, y = np.concatenate([x, x[:16]]), np.concatenate([y, y[:16]])
    # The costs: 16 of 0, then 8 of 0 and 8 of 1, then 16 of 0; only the
    # second batch's second micro-batch of 8 (cost 8) fails.
    x[:, 0] = np.repeat([0.0, 0.0, 0.0, 1.0, 0.0, 0.0], 8)
    model = _oom_model(keras_accum.AccumModel, LIMIT, micro_batch_size=8)
    model.compile(
        optimizer="adam", loss="mse", metrics=["mae"], steps_per_execution=3
    )
    reference, expected, history, messages, _ = _armed_fit(model, x, y)
    shrinks = [m for m in messages if "ran out of memory" in m]
    assert len(shrinks) == 1, messages
    assert int(model.optimizer.iterations) == 3
    assert_equivalent(model, reference, update=2)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(
            history.history[key], expected.history[key], rtol=1e-5
        )


class _CountsTraces(keras_accum.AccumModel):
    """Counts the calls of its train step: on JAX and TensorFlow, its
    traces (a compiled step runs without calling it)."""

    def train_step(self, *args):
        self.traces = getattr(self, "traces", 0) + 1
        return super().train_step(*args)


@pytest.mark.skipif(
    BACKEND == "torch",
    reason="PyTorch's step is eager: nothing compiled for a shrink to drop",
)
def test_a_shrink_retraces_its_own_model_only():
    """A model's out-of-memory shrink retraces its own step and leaves
    another model's compiled step cached (on JAX it once called
    `jax.clear_caches()`, which drops every compiled function in the
    process)."""
    x, y = _oom_data()
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    other = _CountsTraces(
        inputs, keras.layers.Dense(3)(hidden), micro_batch_size=8
    )
    other.compile(optimizer="adam", loss="mse")
    common = {"batch_size": 16, "shuffle": False, "verbose": 0}
    other.fit(x, y, **common)
    traced = other.traces
    other.fit(x, y, **common)
    assert other.traces == traced  # Compiled once, then cached.
    model = _oom_model(keras_accum.AccumModel, LIMIT, micro_batch_size=8)
    caught = _fit_against_model_16(model)
    assert [m for m in caught if "ran out of memory" in m]
    other.fit(x, y, **common)
    assert other.traces == traced
    assert int(other.optimizer.iterations) == 6


@pytest.mark.skipif(
    BACKEND == "jax",
    reason="JAX's step is a function of its state argument, which the "
    "redo passes again (the seed generators' among it): no attempt "
    "changes it; the shrink test above covers JAX's redo",
)
def test_a_redone_step_draws_the_same_dropout_masks():
    """An unseeded `Dropout` (PyTorch's global generator; a Keras
    `SeedGenerator` elsewhere) draws in the failed attempt: the redo
    restores the draws, and trains as a run that never failed."""
    x, y = _oom_data()

    def run(limit, size):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((5,))
        hidden = OutOfMemoryAbove(limit)(inputs)
        hidden = keras.layers.Dense(16, activation="tanh")(hidden)
        hidden = keras.layers.Dropout(0.5)(hidden)
        outputs = keras.layers.Dense(3)(hidden)
        model = keras_accum.AccumModel(inputs, outputs, micro_batch_size=size)
        model.compile(optimizer="adam", loss="mse")
        keras.utils.set_random_seed(7)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(
                x,
                y,
                batch_size=16,
                shuffle=False,
                verbose=0,
                callbacks=[_Arm()],
            )
        shrinks = [w for w in caught if "ran out of memory" in str(w.message)]
        return model, shrinks

    # The first batch's first micro-batch of 8 trains (and draws its
    # masks), the second runs out of memory: all is redone at 4.
    redone, shrinks = run(LIMIT, 8)
    assert len(shrinks) == 1, shrinks
    whole, shrinks = run(None, 4)
    assert not shrinks
    assert int(redone.optimizer.iterations) == 2
    for a, b in zip(redone.get_weights(), whole.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-7)


@pytest.mark.skipif(
    BACKEND == "torch", reason="'auto' is refused on a CPU (above)"
)
def test_auto_steps_around_sizes_whose_probe_runs_out_of_memory():
    """A probe (or compilation) that runs out of memory counts as too big,
    and is undone: "auto" picks a size that trains without failing."""
    auto = keras_accum.AutoMicroBatch(memory_limit=2**40, margin=0.0)
    model = _oom_model(keras_accum.AccumModel, LIMIT, micro_batch_size=auto)
    caught = _fit_against_model_16(model)
    assert not [m for m in caught if "ran out of memory" in m]
    (choice,) = model.micro_batch_choices
    assert choice["reason"] == "auto"
    assert 1 <= choice["micro_batch_size"] < 16


def test_out_of_memory_at_one_sample_is_raised():
    x, y = _oom_data()
    model = _oom_model(keras_accum.AccumModel, -1.0, micro_batch_size=1)
    model.compile(optimizer="sgd", loss="mse")
    errors = {
        "tensorflow": "ResourceExhaustedError",
        "jax": "JaxRuntimeError",
        "torch": "OutOfMemoryError",
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception) as raised:
            model.fit(x + 1.0, y, batch_size=16, verbose=0, callbacks=[_Arm()])
    assert type(raised.value).__name__ == errors[BACKEND]
    assert int(model.optimizer.iterations) == 0
