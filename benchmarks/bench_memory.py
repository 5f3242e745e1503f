"""Peak memory of AccumModel against plain Keras, each in a fresh process.

For two models, one whose memory is mostly parameters (a wide MLP) and one
whose memory is mostly activations (a CNN on 64 x 64 images), it measures
the growth of peak memory during `fit`:

- on CPU, the process's peak resident set (VmHWM, reset right before `fit`
  through /proc/self/clear_refs) minus its resident set before `fit`;
- on GPU, `tf.config.experimental.get_memory_info("GPU:0")["peak"]`.

Variants: `Model(B)`, `AccumModel(B, k)`, `Model(B)` with Keras's
`gradient_accumulation_steps=k`, and `Model(B*k)`. Each runs 3 times in
fresh processes; the median is reported.

    python benchmarks/bench_memory.py [--write-docs]
    python benchmarks/bench_memory.py --backend=torch   # or jax (CPU RSS)
    python benchmarks/bench_memory.py --sweep [--backend=jax]

`--sweep` measures what `fit` on in-memory NumPy arrays adds as the data
grows: the CNN, `Model(32)` and `AccumModel(32, 4)`, for n = 1024, 4096 and
16384 images (48 to 768 MiB); the growth should not depend on the variant.

Results go to benchmarks/results/memory.json (memory_torch.json, ...). On
JAX and PyTorch the batches come from a Python generator instead of
`tf.data`, and only the resident set is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _read_status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(model_name, variant, micro_batch, k, steps):
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _variants import compiled

    keras.utils.set_random_seed(0)
    if model_name == "wide_mlp":
        inputs = keras.Input((1024,))
        x = keras.layers.Dense(4096, activation="relu")(inputs)
        x = keras.layers.Dense(4096, activation="relu")(x)
        outputs = keras.layers.Dense(10)(x)
        shape = (1024,)
    else:
        inputs, outputs, shape = _cnn(keras)
    model = compiled(inputs, outputs, variant, k, jit_compile=False)
    batch = micro_batch * (k if variant == "large" else 1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, *shape)).astype("float32")
    y = rng.integers(0, 10, size=batch).astype("int32")
    params = sum(int(np.prod(w.shape)) for w in model.trainable_weights) * 4
    steps = steps if variant == "large" else steps * k
    if keras.backend.backend() != "tensorflow":
        return _other_backend_child(model, x, y, steps, params)
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensors((x, y)).repeat()
    gpu = bool(tf.config.list_physical_devices("GPU"))
    if gpu:
        tf.config.experimental.reset_memory_stats("GPU:0")
        model.fit(ds, steps_per_epoch=steps, verbose=0)
        peak = tf.config.experimental.get_memory_info("GPU:0")["peak"]
        return {"peak_bytes": peak, "device": "GPU", "param_bytes": params}
    before = _read_status("VmRSS")
    tf.config.experimental.reset_memory_stats("CPU:0")
    tensors_before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Resets VmHWM, the peak resident set, to now.
    model.fit(ds, steps_per_epoch=steps, verbose=0)
    growth = _read_status("VmHWM") - before
    # TensorFlow's own count of live tensor bytes: deterministic where the
    # resident set also moves with malloc's caching.
    tensors = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return {
        "peak_bytes": growth,
        "tensor_peak_bytes": tensors - tensors_before,
        "device": "CPU",
        "param_bytes": params,
    }


def _cnn(keras):
    inputs = keras.Input((64, 64, 3))
    x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(128, 3, padding="same", activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return inputs, keras.layers.Dense(10)(x), (64, 64, 3)


def sweep_child(variant, samples):
    """Peak resident-set growth of `fit` on `samples` in-memory images."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _variants import compiled

    keras.utils.set_random_seed(0)
    inputs, outputs, shape = _cnn(keras)
    model = compiled(inputs, outputs, variant, SWEEP_K, jit_compile=False)
    rng = np.random.default_rng(0)
    x = rng.random((samples, *shape), dtype=np.float32)
    y = rng.integers(0, 10, size=samples).astype("int32")
    before = _read_status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Resets VmHWM, the peak resident set, to now.
    model.fit(x, y, batch_size=32, steps_per_epoch=2 * SWEEP_K, verbose=0)
    return {
        "peak_bytes": _read_status("VmHWM") - before,
        "data_bytes": x.nbytes + y.nbytes,
    }


SWEEP_K = 4
SWEEP_SAMPLES = (1024, 4096, 16384)


def _run_child(args, backend):
    out = subprocess.run(
        [sys.executable, __file__, *map(str, args)],
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
        env={**os.environ, "KERAS_BACKEND": backend, "JAX_PLATFORMS": "cpu"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def sweep(args):
    """Runs the dataset-size sweep; writes memory_sweep[_backend].json."""
    rows = []
    for samples in SWEEP_SAMPLES:
        for variant in ("plain", "accum"):
            runs = [
                _run_child(["--sweep-child", variant, samples], args.backend)
                for _ in range(args.repeats)
            ]
            peaks = [r["peak_bytes"] for r in runs]
            row = {
                "variant": variant,
                "k": SWEEP_K if variant == "accum" else 1,
                "samples": samples,
                "data_bytes": runs[0]["data_bytes"],
                "peak_bytes": statistics.median(peaks),
                "peak_bytes_min": min(peaks),
                "peak_bytes_max": max(peaks),
            }
            rows.append(row)
            print(
                f"n={samples:<6} data {row['data_bytes'] / 2**20:6.0f} MiB "
                f"{variant:<6} peak growth {row['peak_bytes'] / 2**20:7.1f} "
                f"MiB ({min(peaks) / 2**20:.0f}-{max(peaks) / 2**20:.0f})",
                flush=True,
            )
    suffix = "" if args.backend == "tensorflow" else f"_{args.backend}"
    _write_results(
        ROOT / f"benchmarks/results/memory_sweep{suffix}.json", args, rows
    )
    return 0


def _write_results(path, args, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {"backend": args.backend, "repeats": args.repeats, "rows": rows},
            indent=1,
        )
    )
    print(f"wrote {path}")


def _other_backend_child(model, x, y, steps, params):
    """Peak resident-set growth during `fit` on JAX or PyTorch (CPU)."""

    def batches():
        while True:
            yield x, y

    before = _read_status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Resets VmHWM, the peak resident set, to now.
    model.fit(batches(), steps_per_epoch=steps, verbose=0)
    return {
        "peak_bytes": _read_status("VmHWM") - before,
        "device": "CPU",
        "param_bytes": params,
    }


CONFIGS = [
    ("plain", 1),
    ("accum", 4),
    ("accum", 16),
    ("accum", 64),
    ("keras_ga", 16),
    ("large", 4),
    ("large", 16),
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--child", nargs=4, metavar=("MODEL", "VARIANT", "B", "K")
    )
    parser.add_argument("--sweep-child", nargs=2, metavar=("VARIANT", "N"))
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="fit on in-memory arrays of growing size instead",
    )
    parser.add_argument("--models", default="wide_mlp,cnn")
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks/results/memory.json")
    )
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument(
        "--backend",
        default="tensorflow",
        help="Keras backend of the measured processes",
    )
    args = parser.parse_args(argv)
    if args.backend != "tensorflow":
        if args.write_docs:
            parser.error("--write-docs reports the TensorFlow run only")
        if args.out == parser.get_default("out"):
            args.out = str(
                ROOT / f"benchmarks/results/memory_{args.backend}.json"
            )
    if args.sweep_child:
        variant, samples = args.sweep_child
        print(json.dumps(sweep_child(variant, int(samples))))
        return 0
    if args.sweep:
        return sweep(args)
    if args.child:
        name, variant, b, k = args.child
        print(json.dumps(child(name, variant, int(b), int(k), args.steps)))
        return 0

    rows = []
    for model_name in args.models.split(","):
        for variant, k in CONFIGS:
            samples = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                child_args = ["--steps", args.steps, "--child", model_name]
                child_args += [variant, args.micro_batch, k]
                samples.append(_run_child(child_args, args.backend))
                elapsed = time.perf_counter() - started
            peaks = [s["peak_bytes"] for s in samples]
            row = {
                "model": model_name,
                "variant": variant,
                "k": k,
                "micro_batch": args.micro_batch,
                "device": samples[0]["device"],
                "param_bytes": samples[0]["param_bytes"],
                "peak_bytes": statistics.median(peaks),
                "peak_bytes_min": min(peaks),
                "peak_bytes_max": max(peaks),
                # TensorFlow's allocator on CPU (None on GPU).
                "tensor_peak_bytes": statistics.median(
                    s.get("tensor_peak_bytes") or 0 for s in samples
                )
                or None,
            }
            rows.append(row)
            print(
                f"{model_name:<9} {variant:<9} k={k:<3} peak growth "
                f"{row['peak_bytes'] / 2**20:8.1f} MiB "
                f"(params {row['param_bytes'] / 2**20:.1f} MiB, "
                f"{elapsed:.0f}s a run)",
                flush=True,
            )
    _write_results(Path(args.out), args, rows)
    if args.write_docs:
        sys.path.insert(0, str(Path(__file__).parent))
        from report import write_docs

        write_docs(ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
