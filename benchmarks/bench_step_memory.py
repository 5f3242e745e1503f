"""The train step's own memory beyond the state, by allocator, per backend.

    python benchmarks/bench_step_memory.py [--json=PATH]
        [--models=wide,deep] [--kinds=graph,xla,jax] [--low-precision]
        [--variants=plain,accum,...]

What `AccumModel(B, k=4)` needs beyond what it holds between steps,
against `keras.Model(B)`, in units of P (the trainable weights' float32
size), for two MLPs: "wide" (2048-4096-4096-10, one kernel dominates) and
"deep" (six 1024-wide layers, as a stack of equal blocks). Deterministic
figures, each backend in a fresh process:

- TensorFlow graph step: the peak of the running sum of the bytes its
  tensors request, from the profiler's allocator events (one executor
  thread), and the allocator's own in-use peak
  (`tf.config.experimental.get_memory_info`), which adds the unused tail
  of blocks handed out whole and so varies by process;
- TensorFlow under XLA: the allocator's in-use peak;
- JAX: XLA's compiled memory analysis of the step (temporaries).

The state itself differs by the accumulators (P) and the window's few
scalars. Takes about 3 minutes on a 2-core CPU.

With `--low-precision`, each model is measured under the `bfloat16` dtype
policy too: `keras.Model` (`plain_bf16`), `AccumModel` with float32
accumulators (`accum_bf16`) and with `accumulator_dtype="bfloat16"`
(`low_bf16`), P still the weights' float32 size.

`--variants` builds and measures only the variants named, and prints
their figures (JSON) in place of the tables: tests/test_memory.py
measures the two bfloat16 ones it compares per kind, not all five.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

B = 16
K = 4


def _models():
    import keras

    def wide(model_cls, **kwargs):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((2048,))
        hidden = keras.layers.Dense(4096, activation="relu")(inputs)
        hidden = keras.layers.Dense(4096, activation="relu")(hidden)
        return model_cls(inputs, keras.layers.Dense(10)(hidden), **kwargs)

    def deep(model_cls, **kwargs):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((1024,))
        hidden = inputs
        for _ in range(6):
            hidden = keras.layers.Dense(1024, activation="relu")(hidden)
        return model_cls(inputs, keras.layers.Dense(10)(hidden), **kwargs)

    return {"wide": (wide, 2048), "deep": (deep, 1024)}


def _data(features):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.random((B * K, features), dtype=np.float32)
    return x, rng.integers(0, 10, size=(B * K,))


FLOAT32_VARIANTS = ("plain", "accum")
BFLOAT16_VARIANTS = ("plain_bf16", "accum_bf16", "low_bf16")


def _variants(models, low_precision=False, only=None):
    """`(name, variant, model, x, y)`: plain and `AccumModel`, per model
    (and under a bfloat16 policy, with `low_precision`); of the variants
    `only` if given."""
    for name in models:
        build, features = _models()[name]
        x, y = _data(features)
        for variant, model in _built(build, low_precision, only):
            yield name, variant, model, x, y


def _built(build, low_precision, only=None):
    import keras

    import keras_accum

    def accum(**kwargs):
        return build(keras_accum.AccumModel, accum_steps=K, **kwargs)

    makers = {
        "plain": lambda: build(keras.Model),
        "accum": accum,
        "plain_bf16": lambda: build(keras.Model),
        "accum_bf16": accum,
        "low_bf16": lambda: accum(accumulator_dtype="bfloat16"),
    }
    wanted = [
        *FLOAT32_VARIANTS,
        *(BFLOAT16_VARIANTS if low_precision else ()),
    ]
    wanted = [v for v in wanted if only is None or v in only]
    # All built before any is measured: an allocator's peak depends on
    # what was allocated and freed before (docs/benchmarks.md).
    built = []
    for variant in wanted:
        if variant in BFLOAT16_VARIANTS:
            keras.config.set_dtype_policy("bfloat16")
        try:
            built.append((variant, makers[variant]()))
        finally:
            keras.config.set_dtype_policy("float32")
    return built


def _compile(model, **kwargs):
    import keras

    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **kwargs,
    )


def _param_bytes(model):
    import numpy as np

    return sum(int(np.prod(v.shape)) * 4 for v in model.trainable_weights)


def _requested_peak(logdir):
    import glob

    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    (path,) = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        stats = {k: v.name for k, v in plane.stat_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                name = names[event.metadata_id]
                if name not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                size = next(
                    s.int64_value or s.uint64_value
                    for s in event.stats
                    if stats.get(s.metadata_id) == "requested_bytes"
                )
                sign = 1 if name == "MemoryAllocation" else -1
                events.append(
                    (line.timestamp_ns * 1000 + event.offset_ps, sign * size)
                )
    running = peak = 0
    for _, change in sorted(events):
        running += change
        peak = max(peak, running)
    return peak


def _tensorflow(xla, models, low_precision=False, only=None):
    import tensorflow as tf

    if not xla:
        tf.config.threading.set_inter_op_parallelism_threads(1)
        tf.config.threading.set_intra_op_parallelism_threads(1)
    info = tf.config.experimental.get_memory_info
    results = {}
    for name, variant, model, x, y in _variants(models, low_precision, only):
        _compile(model, jit_compile=xla)
        for _ in range(2):  # Slots, accumulators, the traced step.
            model.fit(x, y, batch_size=B, verbose=0)
        tf.config.experimental.reset_memory_stats("CPU:0")
        held = info("CPU:0")["current"]
        with tempfile.TemporaryDirectory() as logdir:
            if not xla:
                tf.profiler.experimental.start(logdir)
            model.fit(x, y, batch_size=B, verbose=0)
            if not xla:
                tf.profiler.experimental.stop()
                requested = _requested_peak(logdir)
        p = _param_bytes(model)
        row = {"p": p, "in_use": (info("CPU:0")["peak"] - held) / p}
        if not xla:
            row["requested"] = requested / p
        results[f"{name}/{variant}"] = row
        del model
    return results


def _jax(models, low_precision=False, only=None):
    import jax

    results = {}
    for name, variant, model, x, y in _variants(models, low_precision, only):
        _compile(model)
        model.fit(x, y, batch_size=B, verbose=0)
        state = model._get_jax_state(
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
        )
        # As Keras compiles the step (`donate_argnums=0`).
        step = jax.jit(model.train_step, donate_argnums=0)
        analysis = step.lower(state, (x[:B], y[:B])).compile().memory_analysis()
        p = _param_bytes(model)
        results[f"{name}/{variant}"] = {
            "temp": analysis.temp_size_in_bytes / p,
            "state": analysis.argument_size_in_bytes / p,
        }
    return results


def _child(kind, models, low_precision, only=None):
    if kind == "jax":
        results = _jax(models, low_precision, only)
    else:
        results = _tensorflow(kind == "xla", models, low_precision, only)
    print("RESULTS " + json.dumps(results))


def _run(kind, models, low_precision=False, only=None):
    backend = "jax" if kind == "jax" else "tensorflow"
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    # TensorFlow's CPU allocator keeps statistics only as the BFC allocator,
    # TensorFlow's default only where it enables oneDNN (Intel CPUs).
    env.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            f"--child={kind}",
            f"--models={','.join(models)}",
            *(["--low-precision"] if low_precision else []),
            *([f"--variants={','.join(only)}"] if only else []),
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("RESULTS "))
    return json.loads(line[len("RESULTS ") :])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--models", default="wide,deep", help="of wide, deep (comma-separated)"
    )
    parser.add_argument(
        "--kinds", default="graph,xla,jax", help="of graph, xla, jax"
    )
    parser.add_argument(
        "--low-precision",
        action="store_true",
        help="also under the bfloat16 policy, with bfloat16 accumulators",
    )
    parser.add_argument(
        "--variants",
        help="only these of plain, accum (and with --low-precision "
        "plain_bf16, accum_bf16, low_bf16), comma-separated; no tables",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    models = args.models.split(",")
    unknown = set(models) - {"wide", "deep"}
    if unknown:
        parser.error(f"--models: unknown {sorted(unknown)}")
    kinds = args.kinds.split(",")
    unknown = set(kinds) - {"graph", "xla", "jax"}
    if unknown:
        parser.error(f"--kinds: unknown {sorted(unknown)}")
    only = args.variants.split(",") if args.variants else None
    known = FLOAT32_VARIANTS + (BFLOAT16_VARIANTS if args.low_precision else ())
    unknown = set(only or ()) - set(known)
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}")
    if args.child:
        _child(args.child, models, args.low_precision, only)
        return
    results = {
        kind: _run(kind, models, args.low_precision, only) for kind in kinds
    }
    if only:
        print(json.dumps(results, indent=1))
    else:
        _print_tables(results, models, args.low_precision)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def _print_tables(results, models, low_precision):
    print("step memory beyond the state, in P (trainable weights' size)")
    print(
        f"{'backend':<8} {'model':<5} {'figure':<10} {'Model(B)':>9} "
        f"{'AccumModel':>11} {'difference':>11}"
    )
    for kind, rows in results.items():
        figures = sorted(
            {f for row in rows.values() for f in row} - {"state", "p"}
        )
        for model in models:
            for figure in figures:
                plain = rows[f"{model}/plain"][figure]
                accum = rows[f"{model}/accum"][figure]
                print(
                    f"{kind:<8} {model:<5} {figure:<10} {plain:>9.3f} "
                    f"{accum:>11.3f} {accum - plain:>+11.3f}"
                )
    if low_precision:
        _print_low_precision(results, models)


def _print_low_precision(results, models):
    print("under the bfloat16 policy, in P (the weights' float32 size)")
    variants = ("plain_bf16", "accum_bf16", "low_bf16")
    print(
        f"{'backend':<8} {'model':<5} {'figure':<10} "
        + " ".join(f"{v:>11}" for v in variants)
    )
    for kind, rows in results.items():
        figures = sorted({f for row in rows.values() for f in row} - {"p"})
        for model in models:
            for figure in figures:
                values = " ".join(
                    f"{rows[f'{model}/{v}'][figure]:>11.3f}" for v in variants
                )
                print(f"{kind:<8} {model:<5} {figure:<10} {values}")


if __name__ == "__main__":
    main()
