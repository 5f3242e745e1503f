"""Accumulators laid out like their weights under `keras.distribution`.

On JAX, under `ModelParallel` with a `LayoutMap`, every accumulator takes
its weight's sharding (as Keras's optimizer slots do), behind a leading
axis of the `batch` axis's devices (each keeps its own partial sum), so
that a device holds the accumulator of the shard it holds, not of the
whole weight. The
case runs in a fresh process with 8 simulated CPU devices in a 2 x 4 mesh
(`_sharding_worker.py`). `keras.distribution` on TensorFlow and PyTorch,
which Keras 3.15 accepts there but ignores, is refused.
"""

import os
from pathlib import Path

import keras
import numpy as np
import pytest
from _helpers import LargeBatch, assert_equivalent, run_in_fresh_process

import keras_accum

BACKEND = keras.backend.backend()
WORKER = Path(__file__).with_name("_sharding_worker.py")


@pytest.fixture(scope="module")
def model_parallel():
    env = {
        **os.environ,
        "KERAS_BACKEND": "jax",
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "JAX_PLATFORMS": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
    }
    results = run_in_fresh_process([WORKER], env)
    assert results["devices"] == 8
    return results


ON_JAX = pytest.mark.skipif(
    BACKEND != "jax", reason="keras.distribution is implemented on JAX only"
)


@ON_JAX
def test_model_parallel_equals_plain_keras_update_by_update(
    model_parallel, report_diff
):
    # 70 samples, windows of 4, 4 and 1 micro-batches (the last one of 6
    # samples), over 2 epochs. The worker asserted each update's weights
    # (`_helpers.assert_equivalent`).
    iterations = model_parallel["iterations"]
    assert iterations["accum"] == iterations["plain"] == [1, 2, 3, 4, 5, 6]
    diff = model_parallel["max_weight_diff"]
    report_diff(diff, "JAX ModelParallel, 2 x 4 mesh, 8 devices")


@ON_JAX
def test_each_accumulator_is_sharded_like_its_weight(model_parallel):
    shardings = {s["path"]: s for s in model_parallel["shardings"]}
    assert set(shardings) == {
        "tokens/embeddings",
        "up/kernel",
        "up/bias",
        "down/kernel",
        "down/bias",
    }
    for path, sharding in shardings.items():
        # A leading axis of the `batch` row's devices, each holding its
        # partial sum, then the weight's own layout.
        spec = sharding["weight_spec"]
        spec += [None] * (len(sharding["weight_shard_shape"]) - len(spec))
        assert sharding["accumulator_spec"] == ["batch", *spec], path
        assert sharding["accumulator_shard_shape"] == [
            1,
            *sharding["weight_shard_shape"],
        ], path
    # The LayoutMap's shards: a quarter of each sharded weight per device.
    shapes = {p: s["accumulator_shard_shape"] for p, s in shardings.items()}
    assert shapes["tokens/embeddings"] == [1, 64, 8]
    assert shapes["up/kernel"] == [1, 256, 256]
    assert shapes["down/kernel"] == [1, 256, 16]
    assert shapes["up/bias"] == [1, 1024]
    # The window's counters, totals and rings: replicated.
    assert model_parallel["counters"]
    for spec in model_parallel["counters"]:
        assert "model" not in spec and "batch" not in spec, spec


@ON_JAX
def test_accumulators_add_their_shard_per_device_not_the_weights(
    model_parallel,
):
    parameters = model_parallel["parameters"]
    whole = sum(p["bytes"] for p in parameters)
    per_device = sum(p["bytes"] // p["shards"] for p in parameters)
    assert per_device < 0.3 * whole
    plain = model_parallel["memory"]["plain"]
    accum = model_parallel["memory"]["accum"]
    # The step's state, per device, grows by the accumulators' shards (and
    # the window's scalars and rings, a few KiB); all of it donated.
    extra = accum["argument"] - plain["argument"]
    assert per_device <= extra <= per_device + 16 * 1024, (extra, per_device)
    assert accum["output"] - accum["alias"] < 4096
    # No transient copy of an accumulator or weight beyond a plain step's
    # (replicated accumulators measured +0.7 P here: gathered gradients).
    assert accum["temp"] <= plain["temp"] + 0.05 * per_device


@ON_JAX
def test_gradient_crosses_the_batch_axis_once_per_window(model_parallel):
    """Bytes all-reduced by the compiled steps, per device, outside and
    inside conditionals' branches (`bench_communication.collective_bytes`)."""
    per_device = sum(
        p["bytes"] // p["shards"] for p in model_parallel["parameters"]
    )
    plain = model_parallel["communication"]["plain"]
    accum = model_parallel["communication"]["accum"]
    # At the close, the devices' partial sums once: each weight's shard
    # (XLA may split a replicated bias further), and finiteness flags.
    assert 0.9 * per_device <= accum["in_branches"] <= per_device + 64
    # The plain step exchanges that on every step: the reading finds it.
    assert plain["every_step"] >= accum["in_branches"]
    # On every micro-batch, no gradient: what is left is the forward
    # pass's reductions of activations over the model axis (the plain
    # step's too) and the loss's share of the window (16 B).
    assert accum["every_step"] < 0.02 * per_device, accum


@ON_JAX
def test_no_sharded_weight_or_accumulator_is_gathered(model_parallel):
    whole = {
        "tokens/embeddings": (64, 32),
        "up/kernel": (256, 1024),
        "down/kernel": (1024, 16),
    }
    sharded = {
        s["path"] for s in model_parallel["shardings"] if "model" in s["spec"]
    }
    assert sharded == set(whole)
    gathered = {
        name: [tuple(shape) for shape in shapes]
        for name, shapes in model_parallel["collectives"].items()
    }
    for name, shapes in gathered.items():
        assert not set(shapes) & set(whole.values()), (name, shapes)
    # What the step gathers: activations and replicated values, no more
    # than a plain step's plus a replicated accumulator (the bias's, added
    # on its shards, then gathered).

    def size(shapes):
        return sum(4 * int(np.prod(s)) for s in shapes)

    assert size(gathered["accum"]) <= size(gathered["plain"]) + 4 * 1024


@ON_JAX
def test_bfloat16_accumulators_are_sharded_and_half_the_size(model_parallel):
    low = model_parallel["low_precision"]
    plain = {s["path"]: s for s in model_parallel["shardings"]}
    dtypes = {a["path"]: a["dtype"] for a in low["accumulators"]}
    # At least 2**14 elements: bfloat16 (up 256 x 1024, down 1024 x 16);
    # the embedding table (64 x 32) and the biases keep float32.
    assert dtypes == {
        "tokens/embeddings": "float32",
        "up/kernel": "bfloat16",
        "up/bias": "float32",
        "down/kernel": "bfloat16",
        "down/bias": "float32",
    }
    for acc in low["accumulators"]:
        # Laid out as the float32 ones are: the same shards.
        assert acc["spec"] == plain[acc["path"]]["accumulator_spec"]
        assert (
            acc["shard_shape"] == plain[acc["path"]]["accumulator_shard_shape"]
        )
    # Per device, the state is the float32 window's less half of each
    # bfloat16 accumulator's shard; no temporary beyond a plain step's.
    saved = sum(
        2 * int(np.prod(a["shard_shape"]))
        for a in low["accumulators"]
        if a["dtype"] == "bfloat16"
    )
    accum = model_parallel["memory"]["accum"]
    plain_step = model_parallel["memory"]["plain"]
    assert low["memory"]["argument"] == accum["argument"] - saved
    per_device = sum(
        p["bytes"] // p["shards"] for p in model_parallel["parameters"]
    )
    assert low["memory"]["temp"] <= plain_step["temp"] + 0.05 * per_device
    # Trained 6 updates: close to the plain model, not equal to it.
    assert 0 < low["max_weight_diff"] < 2e-2


# -- TensorFlow and PyTorch: warned, trained as plain Keras trains ------------


@pytest.mark.skipif(
    BACKEND == "jax", reason="JAX implements keras.distribution (above)"
)
@pytest.mark.parametrize("kind", ["model_parallel", "data_parallel"])
def test_keras_distribution_warns_where_keras_ignores_it(kind):
    mesh = keras.distribution.DeviceMesh((1, 1), ["batch", "model"], ["cpu:0"])
    if kind == "model_parallel":
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map["dense.*kernel"] = (None, "model")
        distribution = keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    else:
        distribution = keras.distribution.DataParallel(devices=["cpu:0"])
    x = np.ones((16, 5), "float32")
    y = np.ones((16, 3), "float32")
    keras.distribution.set_distribution(distribution)
    try:
        models = []
        for cls, kwargs in (
            (keras.Model, {}),
            (keras_accum.AccumModel, {"accum_steps": 2}),
        ):
            keras.utils.set_random_seed(0)
            inputs = keras.Input((5,))
            model = cls(inputs, keras.layers.Dense(3)(inputs), **kwargs)
            model.compile(optimizer="sgd", loss="mse")
            models.append(model)
        plain, accum = models
        plain = LargeBatch(plain)
        plain.fit(x, y, batch_size=8, verbose=0)
        with pytest.warns(UserWarning, match="implemented only") as caught:
            accum.fit(x, y, batch_size=4, verbose=0)
    finally:
        keras.distribution.set_distribution(None)
    message = str(caught[0].message)
    assert f"on the {BACKEND} backend" in message
    assert "KERAS_BACKEND=jax" in message
    assert f"distribution={distribution!r}" in message
    # Trained as the plain model trains under the same (ignored) setting.
    assert int(accum.optimizer.iterations) == 2
    assert_equivalent(accum, plain)
