"""Memory `AccumModel` adds to plain Keras `fit`.

Peak memory itself is measured by `benchmarks/bench_memory.py` (resident
set growth, each variant in a fresh process); tests here check what can be
checked deterministically.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from _helpers import activation_data, activation_mlp
from keras.src.trainers.data_adapters import array_data_adapter

import keras_accum


@pytest.fixture
def pipelines_built(monkeypatch):
    """Counts the `tf.data` pipelines Keras builds from in-memory arrays.

    Each one serialises the arrays into its graph: a transient copy of the
    whole training data (measured: `AccumModel` +392 MiB over plain Keras
    for 192 MiB of images before the fix, in `bench_data_memory.py`).
    The count wraps Keras's own method, which still runs.
    """
    calls = []
    original = array_data_adapter.ArrayDataAdapter.get_tf_dataset

    def counted(self):
        calls.append(self)
        return original(self)

    monkeypatch.setattr(
        array_data_adapter.ArrayDataAdapter, "get_tf_dataset", counted
    )
    return calls


def _fit(model):
    rng = np.random.default_rng(0)
    x = rng.random((256, 16), dtype=np.float32)
    y = rng.random((256, 4), dtype=np.float32)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)


def _linear(model_cls, **kwargs):
    inputs = keras.Input((16,))
    return model_cls(inputs, keras.layers.Dense(4)(inputs), **kwargs)


@pytest.mark.tensorflow_only(
    reason="counts the tf.data pipelines Keras's TensorFlow trainer builds"
)
def test_fit_on_arrays_builds_no_second_pipeline(pipelines_built):
    """Before: the window was built from the spec of a second pipeline of
    the arrays (2 per `fit` where plain Keras builds 1)."""
    _fit(_linear(keras.Model))
    plain = len(pipelines_built)
    _fit(_linear(keras_accum.AccumModel, accum_steps=4))
    assert len(pipelines_built) - plain == plain == 1


# -- The update's peak: the accumulators and nothing more ---------------------
#
# Where weights dominate, what a window adds over `Model(B)` should be its
# accumulators (P, the trainable weights' float32 size) and no other copy
# of the weights. Two shapes of model: a wide one, whose largest kernel
# dominates every step, and a deep one of equal layers, where a plain step
# holds about one layer's gradient at a time, so that holding every
# gradient (or every quotient of the window's) at once shows. Measured
# where the figures are deterministic: JAX's compiled step (XLA's buffer
# assignment), TensorFlow's allocator events (graph step) and allocator
# peak (XLA). PyTorch's CPU allocator gives no such figure;
# `benchmarks/bench_memory.py` measures it (and `bench_gpu_memory.py` JAX
# and PyTorch on a GPU, docs/benchmarks.md).


def _wide_mlp(model_cls, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((256,))
    hidden = keras.layers.Dense(1024, activation="relu")(inputs)
    hidden = keras.layers.Dense(1024, activation="relu")(hidden)
    outputs = keras.layers.Dense(10)(hidden)
    return model_cls(inputs, outputs, **kwargs)


def _deep_mlp(model_cls, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((256,))
    hidden = keras.layers.Dense(512, activation="relu")(inputs)
    for _ in range(5):
        hidden = keras.layers.Dense(512, activation="relu")(hidden)
    outputs = keras.layers.Dense(10)(hidden)
    return model_cls(inputs, outputs, **kwargs)


def _wide_data(samples):
    rng = np.random.default_rng(0)
    x = rng.random((samples, 256), dtype=np.float32)
    return x, rng.integers(0, 10, size=(samples,))


def _compile(model, **kwargs):
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **kwargs,
    )


def _parameter_bytes(model):
    return sum(int(np.prod(v.shape)) * 4 for v in model.trainable_weights)


@pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="JAX's compiled step; TensorFlow's below, PyTorch on a GPU",
)
@pytest.mark.parametrize("build", [_wide_mlp, _deep_mlp], ids=["wide", "deep"])
def test_jax_step_holds_only_the_accumulators_beyond_a_plain_step(build):
    """Deep, before: the window's quotients were all alive before the
    apply (temporaries 1.0 P, against 0.36 P for a plain step)."""
    import jax

    x, y = _wide_data(64)
    analyses = {}
    for name, model in (
        ("plain", build(keras.Model)),
        ("accum", build(keras_accum.AccumModel, accum_steps=4)),
    ):
        _compile(model)
        model.fit(x, y, batch_size=16, verbose=0)
        state = model._get_jax_state(
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
        )
        # As Keras compiles the step (`donate_argnums=0`).
        step = jax.jit(model.train_step, donate_argnums=0)
        compiled = step.lower(state, (x[:16], y[:16])).compile()
        analyses[name] = compiled.memory_analysis()
        p = _parameter_bytes(model)
    plain, accum = analyses["plain"], analyses["accum"]
    # The state grows by the accumulators (and the window's few scalars and
    # rings), all donated: the new state reuses their buffers.
    extra_state = accum.argument_size_in_bytes - plain.argument_size_in_bytes
    assert p <= extra_state <= p + 64 * 1024
    assert accum.output_size_in_bytes - accum.alias_size_in_bytes < 4096
    # The step's own buffers: no copy of the weights beyond a plain step's.
    assert accum.temp_size_in_bytes <= plain.temp_size_in_bytes + 0.1 * p
    peak_accum = accum.argument_size_in_bytes + accum.temp_size_in_bytes
    peak_plain = plain.argument_size_in_bytes + plain.temp_size_in_bytes
    assert peak_accum <= peak_plain + 1.1 * p


@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="TensorFlow's allocator statistics; JAX's compiled step above",
)
@pytest.mark.parametrize("mlp", [_wide_mlp, _deep_mlp], ids=["wide", "deep"])
def test_tensorflow_xla_step_holds_only_the_accumulators_beyond_a_plain_step(
    mlp,
):
    """Deep, before: XLA made every quotient of the window's gradient
    before the update (1.0 P above the state, against 0.36 P for a plain
    step)."""
    import tensorflow as tf

    x, y = _wide_data(16 * 4 * 2)
    measured = {}
    for name, build in (
        ("plain", lambda: mlp(keras.Model)),
        ("accum", lambda: mlp(keras_accum.AccumModel, accum_steps=4)),
    ):
        info = tf.config.experimental.get_memory_info
        before = info("CPU:0")["current"]
        model = build()
        _compile(model, jit_compile=True)
        # A first window: optimizer slots, accumulators, the traced step.
        model.fit(x[:64], y[:64], batch_size=16, verbose=0)
        tf.config.experimental.reset_memory_stats("CPU:0")
        held = info("CPU:0")["current"]
        model.fit(x, y, batch_size=16, verbose=0)
        measured[name] = (held - before, info("CPU:0")["peak"] - held)
        p = _parameter_bytes(model)
        del model
    plain_step, accum_step = measured["plain"][1], measured["accum"][1]
    # The step's transient peak: what a plain step needs, no more.
    assert accum_step <= plain_step + 0.1 * p


@pytest.mark.tensorflow_only(reason="TensorFlow's graph executor")
def test_tensorflow_graph_step_holds_only_the_accumulators_more(tmp_path):
    """What the step's tensors request beyond the state, from TensorFlow's
    allocator events (`benchmarks/bench_step_memory.py`, one executor
    thread, a fresh process). Deep, before: every gradient alive until all
    were made, then the optimizer's temporaries of several weights at once
    (1.0 P, against 0.34 P for a plain step); wide, before: the same,
    hidden by the largest kernel's own."""
    out = tmp_path / "step_memory.json"
    script = Path(__file__).parents[1] / "benchmarks" / "bench_step_memory.py"
    result = subprocess.run(
        [sys.executable, str(script), "--kinds=graph", f"--json={out}"],
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["graph"]
    assert {key.split("/")[0] for key in rows} == {"wide", "deep"}
    for model in ("wide", "deep"):
        # In units of P, the trainable weights' float32 size.
        plain = rows[f"{model}/plain"]["requested"]
        accum = rows[f"{model}/accum"]["requested"]
        assert rows[f"{model}/accum"]["p"] > 20 * 2**20
        # A plain step needs at least one layer's gradient.
        assert plain > 0.1
        assert accum <= plain + 0.1


@pytest.mark.skipif(
    keras.backend.backend() != "torch",
    reason="PyTorch's in-place update; TensorFlow and JAX above",
)
def test_torch_update_hands_the_accumulators_to_the_optimizer():
    """The window's gradient is divided in place: the optimizer gets the
    accumulators' own storage, no second copy of the weights (on a GPU:
    `Model(B)` + 2.0 P before, + 1.0 P after; docs/benchmarks.md)."""
    x, y = _wide_data(64)
    model = _wide_mlp(keras_accum.AccumModel, accum_steps=2)
    _compile(model)
    handed = []
    original = model.optimizer.apply

    def apply(grads, trainable_variables=None):
        handed.append([g.data_ptr() for g in grads])
        return original(grads, trainable_variables)

    # A spy: Keras's own apply still runs.
    model.optimizer.apply = apply
    model.fit(x, y, batch_size=16, verbose=0)
    storage = [acc.value.data_ptr() for acc in model.accumulators]
    assert len(handed) == 2
    assert all(pointers == storage for pointers in handed)


# -- A batch split inside the step (`micro_batch_size`) -----------------------


@pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="JAX's compiled step; TensorFlow's allocator below",
)
def test_jax_split_step_holds_a_micro_batch_not_the_batch():
    """`micro_batch_size=16` at batch 1024: the step's buffers are those of
    `Model(16)`, not `Model(1024)`'s; the state grows by the
    accumulators and the batch is an argument."""
    import jax

    x, y = activation_data(1024)
    analyses = {}
    for name, model, batch in (
        ("small", activation_mlp(keras.Model), 16),
        ("large", activation_mlp(keras.Model), 1024),
        (
            "split",
            activation_mlp(keras_accum.AccumModel, micro_batch_size=16),
            1024,
        ),
    ):
        _compile(model)
        model.fit(x[:batch], y[:batch], batch_size=batch, verbose=0)
        state = model._get_jax_state(
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
        )
        step = jax.jit(model.train_step, donate_argnums=0)
        data = (x[:batch], y[:batch])
        analyses[name] = step.lower(state, data).compile().memory_analysis()
        p = _parameter_bytes(model)
    small, large, split = (analyses[k] for k in ("small", "large", "split"))
    # Measured: small 1.01 P, split 0.99 P, large 4.68 P.
    assert split.temp_size_in_bytes <= small.temp_size_in_bytes + 0.1 * p
    assert large.temp_size_in_bytes > 4 * split.temp_size_in_bytes
    # The state: the accumulators more, donated; the batch itself.
    batch_bytes = x.nbytes + y[:1024].astype("int32").nbytes
    extra = split.argument_size_in_bytes - large.argument_size_in_bytes
    assert p <= extra <= p + 64 * 1024 + batch_bytes
    assert split.output_size_in_bytes - split.alias_size_in_bytes < 4096


@pytest.mark.tensorflow_only(reason="TensorFlow's allocator statistics")
@pytest.mark.parametrize(
    "jit_compile, more", [(False, 0.5), (True, 1.25)], ids=["graph", "xla"]
)
def test_tensorflow_split_step_holds_a_micro_batch_not_the_batch(
    jit_compile, more
):
    """The same on TensorFlow's step, from the allocator's peak over a
    `fit`. Graph (measured): small 2.8 P, split 2.0 P, large 3.9-4.8 P;
    the `tf.while_loop` frees each micro-batch's activations. XLA: small
    1.0 P, split 2.1 P (XLA carries the accumulators through the loop as
    values: about one copy more), large 4.9 P. XLA before the loop ran
    one micro-batch at a time, the last after it: split 4.6 P."""
    import tensorflow as tf

    x, y = activation_data(2048)
    info = tf.config.experimental.get_memory_info
    measured = {}
    for name, build, batch in (
        ("small", lambda: activation_mlp(keras.Model), 16),
        ("large", lambda: activation_mlp(keras.Model), 1024),
        (
            "split",
            lambda: activation_mlp(keras_accum.AccumModel, micro_batch_size=16),
            1024,
        ),
    ):
        model = build()
        _compile(model, jit_compile=jit_compile)
        model.fit(x[:batch], y[:batch], batch_size=batch, verbose=0)
        peaks = []
        # The graph executor's order moves a step's peak between runs of
        # the same step (small 2.0-2.8 P, split 2.0-2.9 P over CI runs,
        # once above the bound): the least of three.
        for _ in range(3):
            tf.config.experimental.reset_memory_stats("CPU:0")
            held = info("CPU:0")["current"]
            model.fit(
                x[: 2 * batch], y[: 2 * batch], batch_size=batch, verbose=0
            )
            peaks.append(info("CPU:0")["peak"] - held)
        measured[name] = min(peaks)
        p = _parameter_bytes(model)
        del model
    assert measured["split"] <= measured["small"] + more * p, (measured, p)
    assert measured["large"] >= 1.5 * measured["split"]


# -- bfloat16 accumulators (`accumulator_dtype="bfloat16"`) --------------------


def _bfloat16_models(policy="bfloat16", **compile_kwargs):
    """The deep MLP under the `policy` (bfloat16 weights by default):
    `keras.Model`, `AccumModel` with float32 accumulators and with
    bfloat16 ones, trained one epoch."""
    x, y = _wide_data(64)
    keras.config.set_dtype_policy(policy)
    try:
        models = {
            "plain": _deep_mlp(keras.Model),
            "accum": _deep_mlp(keras_accum.AccumModel, accum_steps=4),
            "low": _deep_mlp(
                keras_accum.AccumModel,
                accum_steps=4,
                accumulator_dtype="bfloat16",
            ),
        }
    finally:
        keras.config.set_dtype_policy("float32")
    for model in models.values():
        _compile(model, **compile_kwargs)
        model.fit(x, y, batch_size=16, verbose=0)
    return models, x, y


def _large_small(model):
    """Parameters in weights with bfloat16 accumulators, and in the rest."""
    sizes = [int(np.prod(v.shape)) for v in model.trainable_weights]
    large = sum(n for n in sizes if n >= 2**14)
    return large, sum(sizes) - large


@pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="JAX's compiled step; TensorFlow's and PyTorch's below",
)
def test_jax_bfloat16_accumulators_add_two_bytes_a_parameter_and_no_temporary():
    """Before: the rounding's random bits, independent of the gradient,
    were made for every weight at the step's start (temporaries 13.7 bytes
    a parameter against 4.0 for a plain step, a 1024-wide MLP)."""
    from _collectives import compiled_step

    models, x, y = _bfloat16_models()
    analyses = {
        name: compiled_step(
            model, x[:16], y[:16], donate=True
        ).memory_analysis()
        for name, model in models.items()
    }
    large, small = _large_small(models["low"])
    window = {
        name: analyses[name].argument_size_in_bytes
        - analyses["plain"].argument_size_in_bytes
        for name in ("accum", "low")
    }
    # The window's counters and rings: a few KiB in both.
    counters = window["accum"] - 4 * (large + small)
    assert 0 <= counters <= 64 * 1024
    # Exactly 2 bytes per parameter of the large weights, 4 of the rest.
    assert window["low"] == 2 * large + 4 * small + counters
    # No temporary beyond the float32 window's, itself a plain step's.
    plain_temp = analyses["plain"].temp_size_in_bytes
    assert analyses["low"].temp_size_in_bytes <= plain_temp + 0.01 * large
    assert analyses["accum"].temp_size_in_bytes <= plain_temp + 0.01 * large


def _step_bytes(analysis):
    """A compiled step's memory: its arguments, temporaries and outputs,
    less what the outputs reuse of the (donated) arguments."""
    return (
        analysis.argument_size_in_bytes
        + analysis.temp_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
    )


@pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="JAX's compiled step (its memory analysis is exact)",
)
def test_jax_bfloat16_accumulators_of_float32_weights_save_memory_with_adam():
    """float32 weights, Adam. Before: the close handed the optimizer a
    float32 quotient of every large weight, all alive until the apply
    (temporaries 4.0 bytes a parameter), and the step held 1 byte a
    parameter more than with float32 accumulators (+4.46 against +3.46 on
    the deep MLP of `bench_low_precision.py --memory`): the accumulators'
    saving undone."""
    from _collectives import compiled_step

    models, x, y = _bfloat16_models(policy="float32")
    total = {
        name: _step_bytes(
            compiled_step(model, x[:16], y[:16], donate=True).memory_analysis()
        )
        for name, model in models.items()
    }
    large, small = _large_small(models["low"])
    over = {name: total[name] - total["plain"] for name in ("accum", "low")}
    # The bfloat16 accumulators are 2 bytes a large parameter, 4 a small
    # one; the window's counters a few KiB; nothing else beyond a plain
    # step (+4.46 bytes a parameter before).
    assert over["low"] <= 2 * large + 4 * small + 64 * 1024, (over, large)
    # Half the float32 accumulators' 4 bytes saved, at least.
    assert over["low"] <= over["accum"] - 1.5 * large, (over, large)


@pytest.mark.tensorflow_only(reason="TensorFlow's allocator events")
def test_tensorflow_bfloat16_accumulators_make_no_float32_copy(tmp_path):
    """The step's requests beyond the state (`bench_step_memory.py`, one
    executor thread), deep MLP under the bfloat16 policy, in P (the
    weights' float32 size). Before: 1.08 P, a float32 cast of every
    large weight alive at once (a cast left unused, then the close's
    quotients); a plain step: 0.18 P, float32 accumulators 0.27-0.5 P."""
    script = Path(__file__).parents[1] / "benchmarks" / "bench_step_memory.py"

    def measured(kind, variants):
        # Only the variants read below: each model built costs a trace and
        # a compile, in a process that starts TensorFlow anyway.
        out = tmp_path / f"{kind}.json"
        result = subprocess.run(
            [
                sys.executable,
                str(script),
                f"--kinds={kind}",
                "--models=deep",
                "--low-precision",
                f"--variants={variants}",
                f"--json={out}",
            ],
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(out.read_text())[kind]

    graph = measured("graph", "plain_bf16,low_bf16")
    xla = measured("xla", "accum_bf16,low_bf16")
    plain = graph["deep/plain_bf16"]["requested"]
    assert plain > 0.05  # at least a layer's gradient: the reading works
    # Never a float32 copy of the weights (1 P; 1.08 P measured before).
    # What it holds instead is the model's bfloat16 gradients (0.5 P), as
    # float32 accumulators may, plus what the executor's order adds: 0.50
    # to 0.59 P measured over CI runs.
    assert graph["deep/low_bf16"]["requested"] <= 0.8
    assert (
        xla["deep/low_bf16"]["in_use"] <= xla["deep/accum_bf16"]["in_use"] + 0.1
    )


@pytest.mark.skipif(
    keras.backend.backend() != "torch",
    reason="PyTorch's in-place update; TensorFlow and JAX above",
)
def test_torch_bfloat16_window_is_divided_in_its_accumulators():
    """Under the bfloat16 policy the optimizer takes the quotient in the
    weight's dtype: divided in float32 one weight at a time and rounded
    into the accumulator, it is handed the accumulators' own storage, as
    float32 accumulators are."""
    models, x, y = _bfloat16_models()
    model = models["low"]
    handed = []
    original = model.optimizer.apply

    def apply(grads, trainable_variables=None):
        handed.append([(g.data_ptr(), str(g.dtype)) for g in grads])
        return original(grads, trainable_variables)

    # A spy: Keras's own apply still runs.
    model.optimizer.apply = apply
    model.fit(x, y, batch_size=16, verbose=0)
    storage = [
        (acc.value.data_ptr(), str(acc.value.dtype))
        for acc in model.accumulators
    ]
    assert len(handed) == 1
    low = [i for i, (_, dtype) in enumerate(storage) if "bfloat16" in dtype]
    # The six 512 x 512 kernels (the biases and the 512 x 10 kernel keep
    # float32 accumulators, cast to the weights' bfloat16 when handed).
    assert len(low) == 6
    for i in low:
        assert handed[0][i] == storage[i]
