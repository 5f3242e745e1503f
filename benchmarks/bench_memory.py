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

`--device=gpu` (JAX or PyTorch) measures the backend's own GPU allocator
instead, each variant in a fresh process (see `gpu_child`), and writes
`--out` (and, with `--with-sweep`, the dataset-size sweep into the same
file); `benchmarks/gpu_memory.sh` runs it on a GPU machine:

    python benchmarks/bench_memory.py --device=gpu --backend=jax \
        --jobs=4 --with-sweep --out=/tmp/gpu_memory_jax.json
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
    # Allocator statistics on every CPU (TensorFlow keeps them only as the
    # BFC allocator, its default only where it enables oneDNN).
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
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
    # Allocator statistics on every CPU (TensorFlow keeps them only as the
    # BFC allocator, its default only where it enables oneDNN).
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
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


# -- GPU: the backend's own allocator (JAX and PyTorch) ----------------------
#
# `--device=gpu` measures, in each fresh process, what the backend's own GPU
# allocator reports around `fit`: PyTorch's caching allocator
# (`torch.cuda.memory_allocated` / `max_memory_allocated`, the peak reset
# right before each reading window) and JAX's allocator
# (`Device.memory_stats()`: `bytes_in_use` / `peak_bytes_in_use`; its peak
# cannot be reset, so it is the peak since the process started; children
# run with XLA_PYTHON_CLIENT_PREALLOCATE=false, so that `bytes_in_use` is
# what is allocated, not a preallocated pool).
#
# What is fair: each process builds the model, reads the allocator
# (`built`), runs a warm-up `fit` of one accumulation window (k micro-batches
# for `accum` and `keras_ga`, one step otherwise), which builds the optimizer
# slots, the accumulators (AccumModel's and Keras's) and the compiled step,
# reads again (`before`), then runs the measured `fit` (`--steps` windows).
# Reported, in bytes:
#
# - `state_bytes` = before - built: what the first `fit` left allocated
#   (optimizer slots, accumulators, metrics, library workspaces);
# - `peak_bytes` = peak during the measured `fit` - before: the transient
#   memory of steady-state training (gradients, activations, temporaries);
#   on JAX the peak since the process started, warm-up `fit` included;
# - `total_peak_bytes` = highest peak of either `fit` - built: the growth of
#   peak memory over a freshly built model, what the CPU benchmark measures
#   with the resident set; compare an `AccumModel` with `Model(B)` + 1.1 P,
#   P = `param_bytes` (its accumulators are P, float32).
#
# On JAX the children use Keras's default `jit_compile` (XLA), and XLA's
# autotuner is switched off (`--xla_gpu_autotune_level=0`, unless
# `--jax-autotune`): it allocates scratch buffers while compiling, which the
# unresettable peak would keep. The flag is tried first and left out if that
# JAX rejects it. PyTorch runs eagerly, as Keras's default there. Without a
# GPU the allocator figures are null and everything else still runs.

GPU_MEASURES = ("peak_bytes", "state_bytes", "total_peak_bytes")
JAX_NO_AUTOTUNE = "--xla_gpu_autotune_level=0"


class _Allocator:
    """The backend's own GPU allocator; `name` is None without a GPU."""

    def __init__(self, backend):
        self.backend = backend
        self.name = None
        if backend == "torch":
            import torch

            self._torch = torch
            if torch.cuda.is_available():
                self.name = torch.cuda.get_device_name(0)
        elif backend == "jax":
            import jax

            self._jax = jax
            device = jax.devices()[0]
            if device.platform != "cpu" and device.memory_stats():
                self._device = device
                self.name = device.device_kind
        else:
            raise ValueError(f"--device=gpu measures JAX or PyTorch: {backend}")

    def read(self, model):
        """(bytes in use, peak bytes in use) once `model`'s work is done."""
        import gc

        gc.collect()
        if self.backend == "jax":
            variables = list(model.variables)
            if model.optimizer is not None and model.optimizer.built:
                variables += list(model.optimizer.variables)
            values = [getattr(v, "_value", None) for v in variables]
            self._jax.block_until_ready(self._jax.tree.leaves(values))
        if self.name is None:
            return None, None
        if self.backend == "torch":
            self._torch.cuda.synchronize()
            return (
                self._torch.cuda.memory_allocated(),
                self._torch.cuda.max_memory_allocated(),
            )
        stats = self._device.memory_stats()
        return stats["bytes_in_use"], stats["peak_bytes_in_use"]

    def reset_peak(self):
        if self.name is not None and self.backend == "torch":
            self._torch.cuda.reset_peak_memory_stats()
        # JAX's allocator has no reset: its peak is the process's.


def _measure_fit(allocator, model, fit, warmup_steps, steps):
    """Allocator readings around a warm-up `fit` and the measured one."""
    built, built_peak = allocator.read(model)
    allocator.reset_peak()
    started = time.perf_counter()
    fit(warmup_steps)
    warmup_s = time.perf_counter() - started
    before, first_peak = allocator.read(model)
    allocator.reset_peak()
    started = time.perf_counter()
    fit(steps)
    fit_s = time.perf_counter() - started
    after, peak = allocator.read(model)
    result = {
        "device": allocator.name or "CPU (no GPU: allocator figures null)",
        "warmup_s": round(warmup_s, 2),
        "fit_s": round(fit_s, 2),
        "peak_resettable": allocator.backend == "torch",
    }
    if before is None:
        return {
            **result,
            **dict.fromkeys(GPU_MEASURES, None),
            "raw": None,
        }
    return {
        **result,
        "peak_bytes": peak - before,
        "state_bytes": before - built,
        "total_peak_bytes": max(first_peak, peak) - built,
        "raw": {
            "built": built,
            "built_peak": built_peak,
            "before": before,
            "first_fit_peak": first_peak,
            "peak": peak,
            "after": after,
        },
    }


def _gpu_versions(keras):
    import keras_accum

    backend = keras.backend.backend()
    module = __import__("jax" if backend == "jax" else "torch")
    return {
        "keras": keras.__version__,
        backend: module.__version__,
        "keras_accum": str(Path(keras_accum.__file__).resolve().parent),
        "tensorflow_imported": sys.modules.get("tensorflow") is not None,
    }


def gpu_child(model_name, variant, micro_batch, k, steps):
    """One variant's GPU allocator growth during `fit` (JAX, PyTorch)."""
    import keras
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _variants import compiled

    keras.utils.set_random_seed(0)
    allocator = _Allocator(keras.backend.backend())
    if model_name == "wide_mlp":
        inputs = keras.Input((1024,))
        x = keras.layers.Dense(4096, activation="relu")(inputs)
        x = keras.layers.Dense(4096, activation="relu")(x)
        outputs = keras.layers.Dense(10)(x)
        shape = (1024,)
    else:
        inputs, outputs, shape = _cnn(keras)
    # Keras's default `jit_compile`: XLA on JAX, eager on PyTorch.
    model = compiled(inputs, outputs, variant, k)
    batch = micro_batch * (k if variant == "large" else 1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, *shape)).astype("float32")
    y = rng.integers(0, 10, size=batch).astype("int32")
    params = sum(int(np.prod(w.shape)) for w in model.trainable_weights) * 4

    def fit(n):
        def batches():
            while True:
                yield x, y

        model.fit(batches(), steps_per_epoch=n, verbose=0)

    window = k if variant in ("accum", "keras_ga") else 1
    result = _measure_fit(
        allocator,
        model,
        fit,
        warmup_steps=window,
        steps=steps if variant == "large" else steps * k,
    )
    return {**result, "param_bytes": params, **_gpu_versions(keras)}


def gpu_sweep_child(variant, samples):
    """GPU allocator growth of `fit` on `samples` in-memory images."""
    import keras
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _variants import compiled

    keras.utils.set_random_seed(0)
    allocator = _Allocator(keras.backend.backend())
    inputs, outputs, shape = _cnn(keras)
    model = compiled(inputs, outputs, variant, SWEEP_K)
    rng = np.random.default_rng(0)
    x = rng.random((samples, *shape), dtype=np.float32)
    y = rng.integers(0, 10, size=samples).astype("int32")

    def fit(n):
        model.fit(x, y, batch_size=32, steps_per_epoch=n, verbose=0)

    result = _measure_fit(
        allocator, model, fit, warmup_steps=SWEEP_K, steps=2 * SWEEP_K
    )
    return {
        **result,
        "data_bytes": x.nbytes + y.nbytes,
        **_gpu_versions(keras),
    }


def _gpu_env(args):
    env = {
        **os.environ,
        "KERAS_BACKEND": args.backend,
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    if args.backend == "jax" and not args.jax_autotune:
        flags = f"{env.get('XLA_FLAGS', '')} {JAX_NO_AUTOTUNE}".strip()
        probe = subprocess.run(
            [sys.executable, "-c", "import jax; jax.numpy.ones(2).sum()"],
            env={**env, "XLA_FLAGS": flags},
            capture_output=True,
            text=True,
            check=False,
        )
        if probe.returncode == 0:
            env["XLA_FLAGS"] = flags
        else:
            print(f"XLA rejects {JAX_NO_AUTOTUNE}; autotuning stays on:")
            print(probe.stderr.strip()[-1000:])
    return env


def _run_gpu_child(child_args, env, timeout):
    """One measured process; its JSON, or {"error": ...} if it failed."""
    try:
        out = subprocess.run(
            [sys.executable, __file__, *map(str, child_args)],
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if out.returncode != 0:
        return {"error": out.stderr.strip()[-3000:] or f"rc {out.returncode}"}
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"no JSON: {out.stdout[-500:]} {out.stderr[-2000:]}"}


def _gpu_row(key, runs):
    """The median row of one configuration's successful runs."""
    ok = [r for r in runs if "error" not in r]
    row = dict(key)
    row["runs"] = len(ok)
    row["errors"] = [r["error"] for r in runs if "error" in r]
    if not ok:
        return row
    first = ok[0]
    for name in ("device", "param_bytes", "data_bytes", "peak_resettable"):
        if name in first:
            row[name] = first[name]
    for name in GPU_MEASURES:
        values = [r[name] for r in ok if r.get(name) is not None]
        row[name] = statistics.median(values) if values else None
        row[name + "_min"] = min(values) if values else None
        row[name + "_max"] = max(values) if values else None
    row["fit_s"] = statistics.median(r["fit_s"] for r in ok)
    row["wall_s"] = statistics.median(r["wall_s"] for r in ok)
    row["raw"] = [r["raw"] for r in ok]
    return row


def _gpu_tasks(args):
    """(kind, key, child args) of every run, one repeat after another."""
    configs = CONFIGS
    if args.configs:
        configs = [
            (variant, int(k))
            for variant, k in (c.split(":") for c in args.configs.split(","))
        ]
    tasks = []
    for _ in range(args.repeats):
        for model_name in args.models.split(","):
            for variant, k in configs:
                key = (
                    ("model", model_name),
                    ("variant", variant),
                    ("k", k),
                    ("micro_batch", args.micro_batch),
                )
                child_args = ["--device=gpu", "--steps", args.steps]
                child_args += ["--child", model_name, variant]
                tasks.append(("rows", key, child_args + [args.micro_batch, k]))
    if args.with_sweep:
        for _ in range(args.sweep_repeats):
            for samples in SWEEP_SAMPLES:
                for variant in ("plain", "accum"):
                    key = (
                        ("variant", variant),
                        ("k", SWEEP_K if variant == "accum" else 1),
                        ("samples", samples),
                    )
                    child_args = ["--device=gpu", "--sweep-child"]
                    tasks.append(
                        ("sweep_rows", key, child_args + [variant, samples])
                    )
    return tasks


def gpu_main(args):
    """Runs every configuration's processes, `--jobs` at a time."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    deadline = time.monotonic() + (args.budget_s or float("inf"))
    env = _gpu_env(args)
    tasks = _gpu_tasks(args)

    def run(child_args):
        # Past `--budget-s`, runs not yet started are skipped and a running
        # one is stopped, so that what finished is written in time.
        began = time.monotonic()
        left = deadline - began
        if left < 10:
            return {"skipped": "budget"}
        result = _run_gpu_child(child_args, env, min(left, args.child_timeout))
        if left < args.child_timeout and "timed out" in result.get("error", ""):
            return {"skipped": "budget"}
        return {**result, "wall_s": round(time.monotonic() - began, 1)}

    runs = {}  # (kind, key) -> results, in the order of `tasks`
    for kind, key, _ in tasks:
        runs.setdefault((kind, key), [])
    versions = {}
    skipped = 0
    started = time.perf_counter()

    def write():
        report = {
            "backend": args.backend,
            "device_mode": "gpu",
            "repeats": args.repeats,
            "steps": args.steps,
            "xla_flags": env.get("XLA_FLAGS"),
            "versions": versions,
            "elapsed_s": round(time.perf_counter() - started, 1),
            "rows": [],
            "sweep_rows": [],
        }
        for (kind, key), results in runs.items():
            if results:
                report[kind].append(_gpu_row(key, results))
        report["skipped_runs"] = skipped
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(json.dumps(report, indent=1))
        os.replace(partial, path)  # Whole, even if the run is killed.

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {
            pool.submit(run, child_args): (kind, key)
            for kind, key, child_args in tasks
        }
        for future in as_completed(futures):
            kind, key = futures[future]
            result = future.result()
            if "skipped" in result:
                skipped += 1
                continue
            runs[(kind, key)].append(result)
            if "error" not in result:
                versions.update(
                    (name, result[name])
                    for name in ("keras", "jax", "torch", "keras_accum")
                    if name in result
                )
                versions["tensorflow_imported"] = (
                    versions.get("tensorflow_imported")
                    or result["tensorflow_imported"]
                )
            label = " ".join(f"{value}" for _, value in key)
            if "error" in result:
                print(f"{label}: FAILED {result['error'][-300:]}", flush=True)
            else:
                figures = " ".join(
                    f"{name.replace('_bytes', '')} "
                    + (
                        "null"
                        if result[name] is None
                        else f"{result[name] / 2**20:.1f}"
                    )
                    for name in GPU_MEASURES
                )
                print(
                    f"{label}: {figures} MiB ({result['wall_s']:.0f}s run, "
                    f"{result['fit_s']:.1f}s fit, "
                    f"{time.perf_counter() - started:.0f}s elapsed)",
                    flush=True,
                )
            write()
    write()
    print(f"wrote {args.out}; {skipped} runs skipped (--budget-s)")
    failed = sum("error" in r for results in runs.values() for r in results)
    return 1 if failed else 0


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
    parser.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        default="cpu",
        help="gpu: the JAX or PyTorch GPU allocator instead of the RSS",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="--device=gpu: processes at once"
    )
    parser.add_argument(
        "--configs",
        help="--device=gpu: e.g. plain:1,accum:4 (default: all CONFIGS)",
    )
    parser.add_argument(
        "--with-sweep",
        action="store_true",
        help="--device=gpu: the dataset-size sweep too, into --out",
    )
    parser.add_argument("--sweep-repeats", type=int, default=1)
    parser.add_argument("--child-timeout", type=int, default=600)
    parser.add_argument(
        "--budget-s",
        type=float,
        help="--device=gpu: start no run after this many seconds",
    )
    parser.add_argument(
        "--jax-autotune",
        action="store_true",
        help="--device=gpu: leave XLA's GPU autotuner on",
    )
    args = parser.parse_args(argv)
    if args.device == "gpu" and not (args.child or args.sweep_child):
        if args.backend not in ("jax", "torch"):
            parser.error("--device=gpu measures --backend=jax or torch")
        if args.sweep or args.write_docs:
            parser.error("--device=gpu: use --with-sweep; no --write-docs")
        if args.out == parser.get_default("out"):
            args.out = str(
                ROOT / f"benchmarks/results/memory_gpu_{args.backend}.json"
            )
        return gpu_main(args)
    if args.device == "gpu" and args.sweep_child:
        variant, samples = args.sweep_child
        print(json.dumps(gpu_sweep_child(variant, int(samples))))
        return 0
    if args.device == "gpu" and args.child:
        name, variant, b, k = args.child
        print(json.dumps(gpu_child(name, variant, int(b), int(k), args.steps)))
        return 0
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
