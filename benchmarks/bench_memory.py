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
        inputs = keras.Input((64, 64, 3))
        x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(
            inputs
        )
        x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(x)
        x = keras.layers.MaxPooling2D()(x)
        x = keras.layers.Conv2D(128, 3, padding="same", activation="relu")(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        outputs = keras.layers.Dense(10)(x)
        shape = (64, 64, 3)
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
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--steps",
                        str(args.steps),
                        "--child",
                        model_name,
                        variant,
                        str(args.micro_batch),
                        str(k),
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                    timeout=900,
                    env={
                        **os.environ,
                        "KERAS_BACKEND": args.backend,
                        "JAX_PLATFORMS": "cpu",
                    },
                )
                samples.append(json.loads(out.stdout.strip().splitlines()[-1]))
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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"backend": args.backend, "repeats": args.repeats, "rows": rows},
            indent=1,
        )
    )
    print(f"wrote {out}")
    if args.write_docs:
        sys.path.insert(0, str(Path(__file__).parent))
        from report import write_docs

        write_docs(ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
