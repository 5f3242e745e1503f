"""Sharded accumulators under `keras.distribution.ModelParallel` (JAX).

Started in a fresh process by `test_sharding.py`: XLA's simulated host
devices must be set before JAX starts, and the rest of the JAX run has two
(tests/conftest.py). Here there are 8, in a 2 x 4 mesh (`batch`, `model`):

    KERAS_BACKEND=jax python _sharding_worker.py

It trains a plain `keras.Model` at batch B * K and an `AccumModel` at batch
B with `accum_steps=K` from the same weights on the same data, both under
the same `ModelParallel`, and prints (`RESULTS {...}`) their weights after
every update, each accumulator's sharding and its weight's, and the
memory analysis and the bytes all-reduced (outside and inside
conditionals' branches, `benchmarks/bench_communication.py`) of both
compiled train steps. The test asserts, except for
the weights' equivalence, judged here by `_helpers.assert_equivalent` (its
float64 replay, if needed, runs under the same distribution).
"""

import json
import os
import re
import sys

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = " ".join(
    [
        flag
        for flag in os.environ.get("XLA_FLAGS", "").split()
        if "xla_force_host_platform_device_count" not in flag
    ]
    + ["--xla_force_host_platform_device_count=8"]
)

import jax
import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _collectives import collective_bytes, compiled_step
from _helpers import LargeBatch, UpdateRecorder, assert_equivalent

import keras_accum

# Micro-batch, window length, samples: windows of 4, 4 and 1 micro-batches
# per epoch, the last one 6 samples (3 on each `batch` row of the mesh).
B, K, N = 8, 4, 70
EPOCHS = 2
VOCAB, DIM, LENGTH, HIDDEN, OUTPUTS = 64, 32, 8, 1024, 16
MESH = (2, 4)


def distribution():
    mesh = keras.distribution.DeviceMesh(
        MESH, ["batch", "model"], jax.devices()
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    # Megatron-style: the first kernel split by columns, the second by
    # rows; the embedding table along its features. Biases replicated.
    layout_map["tokens/embeddings"] = (None, "model")
    layout_map["up/kernel"] = (None, "model")
    layout_map["down/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


def model(model_cls, **kwargs):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, DIM, name="tokens")(inputs)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(HIDDEN, activation="tanh", name="up")(x)
    outputs = keras.layers.Dense(OUTPUTS, name="down")(x)
    return model_cls(inputs, outputs, **kwargs)


def data():
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(N, LENGTH)).astype("int32")
    y = rng.normal(size=(N, OUTPUTS)).astype("float32")
    return x, y


def fit(model, x, y, batch_size):
    """`model`'s updates, `(iterations, weights)` each; `model` may be a
    `LargeBatch`."""
    recorder = UpdateRecorder()
    model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[recorder],
    )
    return recorder.updates


def low_precision(plain, x, y):
    """`accumulator_dtype="bfloat16"` under the same distribution: each
    large accumulator bfloat16 and sharded like its weight, the step's
    state and temporaries, and how far its weights end from the plain
    model's (`plain`, already trained)."""
    low = model(keras_accum.AccumModel, accum_steps=K)
    low.accumulator_dtype = "bfloat16"
    low.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    fit(low, x, y, B)
    analysis = compiled_step(low, x[:B], y[:B], donate=True).memory_analysis()
    return {
        "accumulators": [
            {
                "path": weight.path,
                "dtype": str(acc.value.dtype),
                "spec": list(acc.value.sharding.spec),
                "shard_shape": list(
                    acc.value.sharding.shard_shape(acc.value.shape)
                ),
            }
            for weight, acc in zip(
                low.trainable_variables, low.accumulators, strict=True
            )
        ],
        "memory": {
            field: int(getattr(analysis, f"{field}_size_in_bytes"))
            for field in ("argument", "output", "alias", "temp")
        },
        "max_weight_diff": max(
            float(np.abs(a - b).max())
            for a, b in zip(low.get_weights(), plain.get_weights(), strict=True)
        ),
    }


def main():
    keras.distribution.set_distribution(distribution())
    x, y = data()
    plain = model(keras.Model)
    accum = model(keras_accum.AccumModel, accum_steps=K)
    accum.set_weights(plain.get_weights())
    for m in (plain, accum):
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    reference = LargeBatch(plain)
    updates = {
        "plain": fit(reference, x, y, B * K),
        "accum": fit(accum, x, y, B),
    }
    diffs = [
        assert_equivalent(weights, reference, update=index)
        for index, (_, weights) in enumerate(updates["accum"])
    ]
    iterations = {name: [i for i, _ in u] for name, u in updates.items()}
    shardings = [
        {
            "path": weight.path,
            "spec": str(weight.value.sharding.spec),
            "weight": str(weight.value.sharding),
            "accumulator_spec": [
                axis for axis in accumulator.value.sharding.spec
            ],
            "weight_spec": [axis for axis in weight.value.sharding.spec],
            "weight_shard_shape": list(
                weight.value.sharding.shard_shape(weight.value.shape)
            ),
            "accumulator_shard_shape": list(
                accumulator.value.sharding.shard_shape(accumulator.value.shape)
            ),
        }
        for weight, accumulator in zip(
            accum.trainable_variables, accum.accumulators, strict=True
        )
    ]
    counters = [
        str(v.value.sharding.spec) for v in accum._window.counters.flat()
    ]
    memory, collectives, communication = {}, {}, {}
    for name, m, batch in (("plain", plain, B * K), ("accum", accum, B)):
        compiled = compiled_step(m, x[:batch], y[:batch], donate=True)
        analysis = compiled.memory_analysis()
        memory[name] = {
            field: int(getattr(analysis, f"{field}_size_in_bytes"))
            for field in ("argument", "output", "alias", "temp")
        }
        communication[name] = collective_bytes(compiled.as_text())
        # The shapes each all-gather assembles (one per device).
        collectives[name] = [
            [int(d) for d in dims.split(",") if d]
            for dims in re.findall(
                r"= f32\[([\d,]*)\]\S* all-gather(?:-start)?\(",
                compiled.as_text(),
            )
        ]
    low = low_precision(plain, x, y)
    parameters = [
        {
            "bytes": int(np.prod(w.shape)) * 4,
            "shards": int(np.prod(w.shape))
            // int(np.prod(w.value.sharding.shard_shape(w.value.shape))),
        }
        for w in accum.trainable_variables
    ]
    results = {
        "devices": len(jax.devices()),
        "iterations": iterations,
        "max_weight_diff": max(diffs),
        "shardings": shardings,
        "counters": counters,
        "memory": memory,
        "collectives": collectives,
        "communication": communication,
        "parameters": parameters,
        "low_precision": low,
    }
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
