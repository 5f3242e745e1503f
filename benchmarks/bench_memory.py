"""Peak memory of AccumModel against plain Keras, each in a fresh process.

For two models, one whose memory is mostly parameters (a wide MLP,
1024-4096-4096-10) and one whose memory is mostly activations (a CNN on
64 x 64 images), it measures the growth of peak memory during `fit`:

- on CPU, the process's peak resident set (VmHWM, reset right before `fit`
  through /proc/self/clear_refs) minus its resident set before `fit`; on
  TensorFlow also TensorFlow's own count of tensor bytes
  (`tensor_peak_bytes`, the allocator's peak above what it held before);
- on GPU (TensorFlow), `tf.config.experimental.get_memory_info("GPU:0")`
  ["peak"]. JAX's and PyTorch's GPU allocators: `bench_gpu_memory.py`.

Variants: `Model(B)`, `AccumModel(B, k)`, `Model(B)` with Keras's
`gradient_accumulation_steps=k`, and `Model(B*k)` (`CONFIGS` in
`_memory.py`). Each runs `--repeats` times (3) in fresh processes; the
median is reported, with min and max. On JAX and PyTorch the batches come
from a Python generator instead of `tf.data`, and only the resident set is
measured.

    python benchmarks/bench_memory.py [--write-docs]
    python benchmarks/bench_memory.py --backend=torch   # or jax
    python benchmarks/bench_memory.py --models=cnn --configs=accum:4 \
        --repeats=1 --out=/tmp/memory.json              # a quick look

Results go to benchmarks/results/memory.json (memory_torch.json,
memory_jax.json); `--write-docs` also updates docs/benchmarks.md from the
TensorFlow results. `--child MODEL VARIANT B K` is one measured process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _memory


def child(model_name, variant, micro_batch, k, steps):
    """One variant's peak memory growth during `fit`, in this process."""
    _memory.child_env()
    import keras

    model, x, y, params = _memory.variant_model(
        model_name, variant, micro_batch, k, jit_compile=False
    )
    steps = steps if variant == "large" else steps * k
    if keras.backend.backend() == "tensorflow":
        result = _tensorflow_peak(model, x, y, steps)
    else:
        result = _generator_peak(model, x, y, steps)
    return {**result, "param_bytes": params}


def _tensorflow_peak(model, x, y, steps):
    """The GPU allocator's peak, or on CPU the resident set's growth."""
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensors((x, y)).repeat()
    if tf.config.list_physical_devices("GPU"):
        tf.config.experimental.reset_memory_stats("GPU:0")
        model.fit(ds, steps_per_epoch=steps, verbose=0)
        peak = tf.config.experimental.get_memory_info("GPU:0")["peak"]
        return {"peak_bytes": peak, "device": "GPU"}
    before = _memory.read_status("VmRSS")
    tf.config.experimental.reset_memory_stats("CPU:0")
    tensors_before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    _memory.reset_peak_rss()
    model.fit(ds, steps_per_epoch=steps, verbose=0)
    growth = _memory.read_status("VmHWM") - before
    # TensorFlow's own count of live tensor bytes: deterministic where the
    # resident set also moves with malloc's caching.
    tensors = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return {
        "peak_bytes": growth,
        "tensor_peak_bytes": tensors - tensors_before,
        "device": "CPU",
    }


def _generator_peak(model, x, y, steps):
    """Peak resident-set growth during `fit` on JAX or PyTorch (CPU)."""

    def fit():
        model.fit(_memory.forever(x, y), steps_per_epoch=steps, verbose=0)

    return {"peak_bytes": _memory.rss_growth(fit), "device": "CPU"}


def _row(args, model_name, variant, k):
    """One variant's median over `--repeats` fresh processes."""
    samples = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        child_args = ["--steps", args.steps, "--child", model_name]
        child_args += [variant, args.micro_batch, k]
        samples.append(
            _memory.measure_on_cpu(__file__, child_args, args.backend)
        )
        elapsed = time.perf_counter() - started
    row = {
        "model": model_name,
        "variant": variant,
        "k": k,
        "micro_batch": args.micro_batch,
        "device": samples[0]["device"],
        "param_bytes": samples[0]["param_bytes"],
        **_memory.spread("peak_bytes", (s["peak_bytes"] for s in samples)),
        # TensorFlow's allocator on CPU (None on GPU).
        "tensor_peak_bytes": statistics.median(
            s.get("tensor_peak_bytes") or 0 for s in samples
        )
        or None,
    }
    print(
        f"{model_name:<9} {variant:<9} k={k:<3} peak growth "
        f"{row['peak_bytes'] / 2**20:8.1f} MiB "
        f"(params {row['param_bytes'] / 2**20:.1f} MiB, "
        f"{elapsed:.0f}s a run)",
        flush=True,
    )
    return row


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--child", nargs=4, metavar=("MODEL", "VARIANT", "B", "K")
    )
    parser.add_argument("--models", default="wide_mlp,cnn")
    parser.add_argument(
        "--configs", help="e.g. plain:1,accum:4 (default: all CONFIGS)"
    )
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", help="default: results/memory[_BACKEND].json")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument(
        "--backend",
        default="tensorflow",
        help="Keras backend of the measured processes",
    )
    return parser


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    if args.child:
        name, variant, b, k = args.child
        print(json.dumps(child(name, variant, int(b), int(k), args.steps)))
        return 0
    if args.write_docs and args.backend != "tensorflow":
        parser.error("--write-docs reports the TensorFlow run only")
    rows = [
        _row(args, model_name, variant, k)
        for model_name in args.models.split(",")
        for variant, k in _memory.parse_configs(args.configs)
    ]
    out = args.out or _memory.results_path("memory", args.backend)
    _memory.write_results(out, args.backend, args.repeats, rows)
    if args.write_docs:
        from report import write_docs

        write_docs(_memory.ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
