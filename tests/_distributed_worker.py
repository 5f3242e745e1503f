"""Runs equivalence cases under a tf.distribute strategy; prints JSON.

Started in a fresh process by `test_distribute.py`, because logical devices
and multi-worker collectives must be configured before TensorFlow starts:

    python _distributed_worker.py mirrored
    python _distributed_worker.py mirrored all
    python _distributed_worker.py mirrored auto
    python _distributed_worker.py mirrored low_precision
    TF_CONFIG=... python _distributed_worker.py multi_worker OUT.json
    python _distributed_worker.py built_outside_the_scope

Each case (across workers, those of `MULTI_WORKER_CASES`) trains an
`AccumModel` under the strategy (global micro-batch B = 8, accum_steps =
4) and a plain `keras.Model` on one device at batch 32, from the same
initial weights on the same 70 samples, asserts that their weights are
equal (`_helpers.assert_equivalent`), and reports the max weight
difference and both update counts.

Not run: `jit_compile=True` and `steps_per_execution > 1`, which plain
Keras 3.15 models also fail under `MirroredStrategy` on CPU devices
(InvalidArgumentError, "You must feed a value for placeholder tensor").
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf

MODE = sys.argv[1]
if MODE in ("mirrored", "built_outside_the_scope"):
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    STRATEGY = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
else:
    STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402

keras.config.disable_traceback_filtering()
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _helpers import (  # noqa: E402
    LargeBatch,
    accum_mlp,
    assert_equivalent,
    mlp,
    regression_data,
    replay_windows,
)

import keras_accum  # noqa: E402

B, K = 8, 4


def optimizer(name):
    return {
        "adam": lambda: keras.optimizers.Adam(0.01),
        "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        "adamw_clip": lambda: keras.optimizers.AdamW(
            0.01, weight_decay=0.1, global_clipnorm=0.1
        ),
    }[name]()


def case(name, opt="adam", weighted=False, unknown_length=False, **compile):
    x, y = regression_data(n=70)
    sw = None
    if weighted:
        sw = np.random.default_rng(3).uniform(0, 2, len(x)).astype("float32")
    plain = mlp()
    plain.compile(optimizer=optimizer(opt), loss="mse")
    plain = LargeBatch(plain)
    plain.fit(
        x,
        y,
        sample_weight=sw,
        batch_size=B * K,
        epochs=2,
        shuffle=False,
        verbose=0,
    )
    with STRATEGY.scope():
        accum = accum_mlp(K)
        accum.compile(optimizer=optimizer(opt), loss="mse", **compile)
    logger = keras_accum.PseudoBatchLogger()
    if unknown_length:
        data = tf.data.Dataset.from_tensor_slices((x, y))
        data = data.filter(lambda a, b: True).batch(B)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA
        )
        accum.fit(
            data.with_options(options), epochs=2, verbose=0, callbacks=[logger]
        )
    else:
        accum.fit(
            x,
            y,
            sample_weight=sw,
            batch_size=B,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[logger],
        )
    # Equal to the single-device large batch (on any CPU: see `_helpers`).
    diff = assert_equivalent(accum, plain)
    return {
        "case": name,
        "max_weight_diff": diff,
        "updates": int(accum.optimizer.iterations.numpy()),
        "plain_updates": int(plain.model.optimizer.iterations.numpy()),
        "open_window": accum.mini_step,
        # Summed over replicas: 32 per full window if the replicas split
        # each global micro-batch, twice that if each saw all of it.
        "window_samples": [u.samples for u in logger.updates],
        # Accumulators are per replica: nothing crosses devices per step.
        "accumulator_kind": type(accum.accumulators[0]._value).__name__,
    }


def auto_case():
    """`accum_steps="auto"` under the strategy: the lengths it chose,
    replayed window by window on a single-device plain model."""
    x, y = regression_data(n=196)
    config = keras_accum.AutoAccumSteps(
        min_steps=2, max_steps=8, warmup=2, smoothing=0.5, batch_fraction=4.0
    )
    with STRATEGY.scope():
        accum = accum_mlp(config)
        accum.compile(optimizer=optimizer("adam"), loss="mse")
    logger = keras_accum.PseudoBatchLogger()
    accum.fit(
        x,
        y,
        batch_size=B,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[logger],
    )
    plain = mlp()
    plain.compile(optimizer=optimizer("adam"), loss="mse")
    plain = LargeBatch(plain)
    replay_windows(plain, x, y, logger.updates, 3, B)
    diff = assert_equivalent(accum, plain)
    counters = accum._window.counters
    return {
        "case": "auto",
        "max_weight_diff": diff,
        "lengths": [u.micro_batches for u in logger.updates],
        "estimates": int(counters.auto.estimates.numpy()),
        "trace": float(counters.auto.trace.numpy()),
        "grad_sq": float(counters.auto.grad_sq.numpy()),
        "updates": int(accum.optimizer.iterations.numpy()),
        "plain_updates": int(plain.model.optimizer.iterations.numpy()),
    }


# Ops that exchange a tensor between replicas (or workers): TensorFlow's
# collectives, which `MirroredStrategy` on CPU devices and
# `MultiWorkerMirroredStrategy` all-reduce with.
COLLECTIVES = ("CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3")
CALLS = ("PartitionedCall", "StatefulPartitionedCall")


def collective_bytes(graph, in_branch=False, found=None):
    """`{"every_step": bytes, "in_branches": bytes}` all-reduced by `graph`.

    Every collective op's operand, in bytes, sorted by whether it runs on
    every execution of the traced step (the step's own graph, and the
    functions it calls unconditionally) or only inside a conditional's
    branch (`tf.cond`, such as the window's close). Each replica issues
    its own op: summed over them.
    """
    found = found or {"every_step": 0, "in_branches": 0, "ops": []}
    functions = graph._functions
    for op in graph.get_operations():
        if op.type in COLLECTIVES:
            operand = op.inputs[0]
            size = operand.shape.num_elements() * operand.dtype.size
            found["in_branches" if in_branch else "every_step"] += size
            found["ops"].append([op.name, size, in_branch])
        if op.type in ("If", "StatelessIf"):
            names = [
                op.get_attr(a).name for a in ("then_branch", "else_branch")
            ]
            for name in names:
                collective_bytes(functions[name].graph, True, found)
        elif op.type in CALLS:
            name = op.get_attr("f").name
            collective_bytes(functions[name].graph, in_branch, found)
    return found


def _traced_step(model):
    """The concrete function of the step Keras traced for `fit`."""
    pending, seen = [model.train_function], set()
    while pending:
        function = pending.pop()
        if id(function) in seen:
            continue
        seen.add(id(function))
        if hasattr(function, "_list_all_concrete_functions"):
            return function._list_all_concrete_functions()[-1]
        for cell in getattr(function, "__closure__", None) or []:
            pending.append(cell.cell_contents)
    raise RuntimeError("no traced step found")


def communication():
    """What the plain step and `AccumModel`'s all-reduce, from the graph
    each traced under the strategy."""
    x, y = regression_data(n=64)
    results = {}
    # Keras 3.15's own `fit` fails under MultiWorkerMirroredStrategy
    # (keras-team/keras#20585; `AccumModel` works around it): the plain
    # step is read under `MirroredStrategy` only.
    names = ("plain", "accum") if MODE == "mirrored" else ("accum",)
    for name in names:
        with STRATEGY.scope():
            model = accum_mlp(K) if name == "accum" else mlp()
            model.compile(optimizer=optimizer("adam"), loss="mse")
        model.fit(x, y, batch_size=B, verbose=0)
        found = collective_bytes(_traced_step(model).graph)
        gradient = sum(
            4 * int(np.prod(w.shape)) for w in model.trainable_weights
        )
        # Per replica: each of this worker's replicas issues its own op,
        # which carries its whole operand.
        local = len(STRATEGY.extended.worker_devices)
        ops = found.pop("ops")
        results[name] = {key: value / local for key, value in found.items()}
        results[name]["ops"] = ops
        results[name]["gradient"] = gradient
    return results


def built_outside_the_scope():
    """A model built before the strategy's scope, compiled inside it."""
    x, y = regression_data(n=64)
    model = accum_mlp(K)
    with STRATEGY.scope():
        model.compile(optimizer="adam", loss="mse")
    try:
        model.fit(x, y, batch_size=B, verbose=0)
    except Exception as error:  # noqa: BLE001 (reported to the test)
        return {"error": type(error).__name__, "message": str(error)}
    return {"error": None, "message": ""}


def wide(model_cls, seed=1, **kwargs):
    """128 -> 128 -> 3: the first kernel (16384 weights) gets a bfloat16
    accumulator, the rest float32 ones."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((128,))
    hidden = keras.layers.Dense(128, activation="tanh")(inputs)
    return model_cls(inputs, keras.layers.Dense(3)(hidden), **kwargs)


def low_precision_case():
    """`accumulator_dtype="bfloat16"` under the strategy: each replica's
    large accumulators bfloat16, rounded in its own XLA kernels inside
    the graph step; near the plain model (not equal: it rounds)."""
    x, y = regression_data(n=70, features=128)
    plain = wide(keras.Model)
    start = [w.copy() for w in plain.get_weights()]
    plain.compile(optimizer=optimizer("sgd_momentum"), loss="mse")
    plain.fit(x, y, batch_size=B * K, epochs=2, shuffle=False, verbose=0)
    with STRATEGY.scope():
        model = wide(
            keras_accum.AccumModel, accum_steps=K, accumulator_dtype="bfloat16"
        )
        model.compile(optimizer=optimizer("sgd_momentum"), loss="mse")
    model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    moved = float(np.abs(plain.get_weights()[0] - start[0]).max())
    return {
        "dtypes": [str(a.dtype) for a in model._window.acc_grads],
        "accumulator_kind": type(model._window.acc_grads[0].value).__name__,
        "updates": int(model.optimizer.iterations.numpy()),
        "plain_updates": int(plain.optimizer.iterations.numpy()),
        "max_weight_diff": max(
            float(np.abs(a - b).max())
            for a, b in zip(
                model.get_weights(), plain.get_weights(), strict=True
            )
        ),
        "moved": moved,
        "windows": low_precision_windows(),
    }


def low_precision_windows():
    """Models traced after `low_precision_case`'s: a second one, a third,
    and the second recompiled (a fine-tuning's freeze, fit, unfreeze,
    compile). Each one's window of bfloat16 accumulators against a twin
    with float32 ones, from the same weights on the same micro-batches,
    and the update it closes with against the plain model at batch
    B * K. Before the fix, the XLA kernels kept the first model's
    accumulators, and added every later model's micro-batches to them."""
    x, y = regression_data(n=B * K, features=128)
    carry = dict(accum_steps=K, partial_window="carry")
    with STRATEGY.scope():
        models = {
            "second": wide(
                keras_accum.AccumModel,
                seed=2,
                accumulator_dtype="bfloat16",
                **carry,
            ),
            "third": wide(
                keras_accum.AccumModel,
                seed=3,
                accumulator_dtype="bfloat16",
                **carry,
            ),
            "twin": wide(keras_accum.AccumModel, **carry),
        }
        for model in models.values():
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    plain = wide(keras.Model)
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    twin = models["twin"]
    results = []
    for label in ("second", "third", "second, recompiled"):
        model = models[label.split(",")[0]]
        if label.endswith("recompiled"):
            with STRATEGY.scope():
                model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        start = model.get_weights()
        twin.set_weights(start)
        plain.set_weights(start)
        # K - 1 micro-batches: a window left open in both.
        opened = slice(0, B * (K - 1))
        for each in (model, twin):
            each.fit(x[opened], y[opened], batch_size=B, verbose=0)
        low = model.accumulators[0].numpy().astype("float32")
        exact = twin.accumulators[0].numpy()
        opened = [model.mini_step, twin.mini_step]
        # The last micro-batch closes the window: one update.
        last = slice(B * (K - 1), B * K)
        for each in (model, twin):
            each.fit(x[last], y[last], batch_size=B, verbose=0)
        plain.fit(x, y, batch_size=B * K, verbose=0)
        expected = plain.get_weights()[0]
        results.append(
            {
                "model": label,
                "open": opened,
                "window_norm": float(np.linalg.norm(exact)),
                "window_error": float(
                    np.linalg.norm(low - exact) / np.linalg.norm(exact)
                ),
                "updates": int(model.optimizer.iterations.numpy()),
                "moved": float(np.linalg.norm(expected - start[0])),
                "update_error": float(
                    np.linalg.norm(model.get_weights()[0] - expected)
                ),
                "twin_update_error": float(
                    np.linalg.norm(twin.get_weights()[0] - expected)
                ),
            }
        )
    return results


def every_mirrored_case():
    """Each `MirroredStrategy` run of one process, by name: the
    bfloat16 accumulators first (its first model, as on its own), the
    equivalence cases, "auto", and last the model built outside the
    scope (its `fit` fails). A case that raises reports its traceback,
    so that the others still report and only its test fails."""
    import traceback

    runs = {
        "low_precision": low_precision_case,
        "cases": equivalence_cases,
        "auto": auto_case,
        "built_outside_the_scope": built_outside_the_scope,
    }
    results = {}
    for name, run in runs.items():
        try:
            results[name] = run()
        except Exception:  # noqa: BLE001 (reported to the test)
            results[name] = {"traceback": traceback.format_exc()}
    return results


EQUIVALENCE_CASES = {
    "adam": lambda: case("adam"),
    "sgd_momentum_sample_weight": lambda: case(
        "sgd_momentum_sample_weight", "sgd_momentum", weighted=True
    ),
    "adamw_weight_decay_global_clipnorm": lambda: case(
        "adamw_weight_decay_global_clipnorm", "adamw_clip"
    ),
    "unknown_length_dataset": lambda: case(
        "unknown_length_dataset", "sgd_momentum", unknown_length=True
    ),
    # Across workers (`MULTI_WORKER_CASES`), what depends on what crosses
    # them, in one case: the data of unknown length sharded between them
    # (each worker's windows close together), and the clip, which reads
    # the norm of the gradient summed over every worker. Adam and the
    # sample weights take the cross-replica path of `MirroredStrategy`,
    # where they run.
    "unknown_length_dataset_global_clipnorm": lambda: case(
        "unknown_length_dataset_global_clipnorm",
        "adamw_clip",
        unknown_length=True,
    ),
}
MIRRORED_CASES = (
    "adam",
    "sgd_momentum_sample_weight",
    "adamw_weight_decay_global_clipnorm",
    "unknown_length_dataset",
)
MULTI_WORKER_CASES = ("unknown_length_dataset_global_clipnorm",)


def equivalence_cases(names=MIRRORED_CASES):
    """The equivalence cases `names`, and what the traced steps exchange."""
    return {
        "replicas": STRATEGY.num_replicas_in_sync,
        "cases": [EQUIVALENCE_CASES[name]() for name in names],
        "communication": communication(),
    }


def main():
    if len(sys.argv) > 2 and sys.argv[2] == "all":
        print("RESULTS " + json.dumps(every_mirrored_case()), flush=True)
        return
    if len(sys.argv) > 2 and sys.argv[2] == "low_precision":
        print("RESULTS " + json.dumps(low_precision_case()), flush=True)
        return
    if MODE == "built_outside_the_scope":
        print("RESULTS " + json.dumps(built_outside_the_scope()), flush=True)
        return
    if len(sys.argv) > 2 and sys.argv[2] == "auto":
        print("RESULTS " + json.dumps(auto_case()), flush=True)
        return
    if MODE == "multi_worker":
        results = equivalence_cases(MULTI_WORKER_CASES)
    else:
        results = equivalence_cases()
    text = json.dumps(results)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            f.write(text)
    print("RESULTS " + text, flush=True)


if __name__ == "__main__":
    main()
