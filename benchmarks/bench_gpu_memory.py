"""GPU memory of AccumModel against plain Keras: JAX and PyTorch allocators.

The models and variants of `bench_memory.py` (wide MLP and CNN; `CONFIGS`
in `_memory.py`), each in a fresh process, `--jobs` processes at once:
each reads only its own allocator, so they do not disturb each other's
figures. The allocators: PyTorch's caching allocator
(`torch.cuda.memory_allocated` / `max_memory_allocated`, the peak reset
right before each reading window) and JAX's (`Device.memory_stats()`:
`bytes_in_use` / `peak_bytes_in_use`; its peak cannot be reset, so it is
the peak since the process started; the processes run with
XLA_PYTHON_CLIENT_PREALLOCATE=false, so that `bytes_in_use` is what is
allocated, not a preallocated pool).

What is fair: each process builds the model, reads the allocator
(`built`), runs a warm-up `fit` of one accumulation window (k micro-batches
for `accum` and `keras_ga`, one step otherwise), which builds the optimizer
slots, the accumulators (AccumModel's and Keras's) and the compiled step,
reads again (`before`), then runs the measured `fit` (`--steps` windows).
Reported, in bytes (median, min and max over `--repeats`):

- `state_bytes` = before - built: what the first `fit` left allocated
  (optimizer slots, accumulators, metrics, library workspaces);
- `peak_bytes` = peak during the measured `fit` - before: the transient
  memory of steady-state training (gradients, activations, temporaries);
  on JAX the peak since the process started, warm-up `fit` included;
- `total_peak_bytes` = highest peak of either `fit` - built: the growth of
  peak memory over a freshly built model, what `bench_memory.py` measures
  with the resident set; compare an `AccumModel` with `Model(B)` + 1.1 P,
  P = `param_bytes` (its accumulators are P, float32).

On JAX the processes use Keras's default `jit_compile` (XLA), and XLA's
autotuner is switched off (`--xla_gpu_autotune_level=0`, unless
`--jax-autotune`): it allocates scratch buffers while compiling, which the
unresettable peak would keep. The flag is tried first and left out if that
JAX rejects it. PyTorch runs eagerly, as Keras's default there. Without a
GPU the allocator figures are null and everything else still runs.
`--with-sweep` adds `bench_data_memory.py`'s measurement (`fit` on
in-memory arrays of growing size) as `sweep_rows`.

    python benchmarks/bench_gpu_memory.py --backend=jax --jobs=4 \
        --with-sweep
    python benchmarks/bench_gpu_memory.py --backend=torch --models=cnn \
        --configs=accum:4 --repeats=1 --out=/tmp/gpu.json   # a quick look

Results go to benchmarks/results/gpu_memory_<backend>.json, written again
after each process, so that a run stopped by `--budget-s` or killed keeps
what finished. `benchmarks/gpu_memory.sh` runs it on a GPU machine and
`gpu_memory_table.py` tabulates it. `--child MODEL VARIANT B K` and
`--sweep-child VARIANT N` are one measured process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _memory

GPU_MEASURES = ("peak_bytes", "state_bytes", "total_peak_bytes")
JAX_NO_AUTOTUNE = "--xla_gpu_autotune_level=0"
VERSIONS = ("keras", "jax", "torch", "keras_accum")


# -- A measured process -------------------------------------------------------


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
            raise ValueError(f"the GPU allocator of JAX or PyTorch: {backend}")

    def read(self, model):
        """(bytes in use, peak bytes in use) once `model`'s work is done."""
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
        return {**result, **dict.fromkeys(GPU_MEASURES), "raw": None}
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


def _versions(keras):
    import keras_accum

    backend = keras.backend.backend()
    module = __import__("jax" if backend == "jax" else "torch")
    return {
        "keras": keras.__version__,
        backend: module.__version__,
        # Which checkout was measured, relative to this one's root: no
        # machine's absolute path in a results file.
        "keras_accum": os.path.relpath(
            Path(keras_accum.__file__).resolve().parent,
            Path(__file__).resolve().parents[1],
        ),
        "tensorflow_imported": sys.modules.get("tensorflow") is not None,
    }


def child(model_name, variant, micro_batch, k, steps):
    """One variant's GPU allocator growth during `fit` (JAX, PyTorch)."""
    import keras

    allocator = _Allocator(keras.backend.backend())
    # Keras's default `jit_compile`: XLA on JAX, eager on PyTorch.
    model, x, y, params = _memory.variant_model(
        model_name, variant, micro_batch, k
    )

    def fit(n):
        model.fit(_memory.forever(x, y), steps_per_epoch=n, verbose=0)

    window = k if variant in ("accum", "keras_ga") else 1
    steps = steps if variant == "large" else steps * k
    result = _measure_fit(allocator, model, fit, window, steps)
    return {**result, "param_bytes": params, **_versions(keras)}


def sweep_child(variant, samples):
    """GPU allocator growth of `fit` on `samples` in-memory images."""
    import keras

    allocator = _Allocator(keras.backend.backend())
    model, x, y = _memory.data_model(variant, samples)

    def fit(n):
        _memory.fit_arrays(model, x, y, steps=n)

    k = _memory.DATA_K
    result = _measure_fit(allocator, model, fit, k, 2 * k)
    return {
        **result,
        "data_bytes": x.nbytes + y.nbytes,
        **_versions(keras),
    }


# -- Running them -------------------------------------------------------------


def _env(backend, jax_autotune):
    """The measured processes' environment (XLA's autotuner off on JAX)."""
    env = {
        **os.environ,
        "KERAS_BACKEND": backend,
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    if backend != "jax" or jax_autotune:
        return env
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


def _tasks(args):
    """(kind, key, child args) of every run, one repeat after another."""
    tasks = []
    for _ in range(args.repeats):
        for model_name in args.models.split(","):
            for variant, k in _memory.parse_configs(args.configs):
                key = (
                    ("model", model_name),
                    ("variant", variant),
                    ("k", k),
                    ("micro_batch", args.micro_batch),
                )
                child_args = ["--steps", args.steps, "--child", model_name]
                child_args += [variant, args.micro_batch, k]
                tasks.append(("rows", key, child_args))
    for _ in range(args.sweep_repeats if args.with_sweep else 0):
        for samples in _memory.DATA_SAMPLES:
            for variant in _memory.DATA_VARIANTS:
                k = _memory.DATA_K if variant == "accum" else 1
                key = (("variant", variant), ("k", k), ("samples", samples))
                child_args = ["--sweep-child", variant, samples]
                tasks.append(("sweep_rows", key, child_args))
    return tasks


def _row(key, runs):
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
        row.update(_memory.spread(name, values))
    row["fit_s"] = statistics.median(r["fit_s"] for r in ok)
    row["wall_s"] = statistics.median(r["wall_s"] for r in ok)
    row["raw"] = [r["raw"] for r in ok]
    return row


def _summary(key, result, elapsed):
    """One finished process, as a line of the log."""
    label = " ".join(f"{value}" for _, value in key)
    if "error" in result:
        return f"{label}: FAILED {result['error'][-300:]}"
    figures = " ".join(
        f"{name.replace('_bytes', '')} "
        + ("null" if result[name] is None else f"{result[name] / 2**20:.1f}")
        for name in GPU_MEASURES
    )
    return (
        f"{label}: {figures} MiB ({result['wall_s']:.0f}s run, "
        f"{result['fit_s']:.1f}s fit, {elapsed:.0f}s elapsed)"
    )


class _Session:
    """Every measured process of one run, and the report they make."""

    def __init__(self, args, tasks):
        self.args = args
        self.env = _env(args.backend, args.jax_autotune)
        self.deadline = time.monotonic() + (args.budget_s or float("inf"))
        self.started = time.perf_counter()
        # (kind, key) -> results, in the order of the tasks.
        self.runs = {(kind, key): [] for kind, key, _ in tasks}
        self.versions = {}
        self.skipped = 0

    def run(self, child_args):
        """One measured process; {"skipped": ...} past `--budget-s`."""
        # Past `--budget-s`, runs not yet started are skipped and a running
        # one is stopped, so that what finished is written in time.
        began = time.monotonic()
        left = self.deadline - began
        if left < 10:
            return {"skipped": "budget"}
        timeout = min(left, self.args.child_timeout)
        result = _memory.run_child(__file__, child_args, self.env, timeout)
        timed_out = "timed out" in result.get("error", "")
        if left < self.args.child_timeout and timed_out:
            return {"skipped": "budget"}
        return {**result, "wall_s": round(time.monotonic() - began, 1)}

    def record(self, kind, key, result):
        if "skipped" in result:
            self.skipped += 1
            return
        self.runs[(kind, key)].append(result)
        if "error" not in result:
            self.versions.update(
                (name, result[name]) for name in VERSIONS if name in result
            )
            self.versions["tensorflow_imported"] = (
                self.versions.get("tensorflow_imported")
                or result["tensorflow_imported"]
            )
        elapsed = time.perf_counter() - self.started
        print(_summary(key, result, elapsed), flush=True)
        self.write()

    def write(self):
        """Writes the report whole, even if the run is killed meanwhile."""
        report = {
            "backend": self.args.backend,
            "device_mode": "gpu",
            "repeats": self.args.repeats,
            "steps": self.args.steps,
            "xla_flags": self.env.get("XLA_FLAGS"),
            "versions": self.versions,
            "elapsed_s": round(time.perf_counter() - self.started, 1),
            "rows": [],
            "sweep_rows": [],
        }
        for (kind, key), results in self.runs.items():
            if results:
                report[kind].append(_row(key, results))
        report["skipped_runs"] = self.skipped
        path = Path(self.args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(json.dumps(report, indent=1))
        os.replace(partial, path)

    def failed(self):
        return sum("error" in r for runs in self.runs.values() for r in runs)


def measure(args):
    """Runs every configuration's processes, `--jobs` at a time."""
    tasks = _tasks(args)
    session = _Session(args, tasks)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {
            pool.submit(session.run, child_args): (kind, key)
            for kind, key, child_args in tasks
        }
        for future in as_completed(futures):
            session.record(*futures[future], future.result())
    session.write()
    print(f"wrote {args.out}; {session.skipped} runs skipped (--budget-s)")
    return 1 if session.failed() else 0


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--child", nargs=4, metavar=("MODEL", "VARIANT", "B", "K"))
    add("--sweep-child", nargs=2, metavar=("VARIANT", "N"))
    add("--backend", choices=("jax", "torch"), help="required")
    add("--models", default="wide_mlp,cnn")
    add("--configs", help="e.g. plain:1,accum:4 (default: all CONFIGS)")
    add("--micro-batch", type=int, default=32)
    add("--repeats", type=int, default=3)
    add("--steps", type=int, default=2)
    add("--jobs", type=int, default=1, help="processes at once")
    add(
        "--with-sweep",
        action="store_true",
        help="also fit on arrays of n images",
    )
    add("--sweep-repeats", type=int, default=1)
    add("--child-timeout", type=int, default=600)
    add("--budget-s", type=float, help="start no run after this many s")
    add("--jax-autotune", action="store_true", help="leave XLA's on")
    add("--out", help="default: results/gpu_memory_<backend>.json")
    return parser


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    if args.child:
        name, variant, b, k = args.child
        print(json.dumps(child(name, variant, int(b), int(k), args.steps)))
        return 0
    if args.sweep_child:
        variant, samples = args.sweep_child
        print(json.dumps(sweep_child(variant, int(samples))))
        return 0
    if args.backend is None:
        parser.error("--backend=jax or --backend=torch")
    if args.out is None:
        args.out = str(_memory.RESULTS / f"gpu_memory_{args.backend}.json")
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())
