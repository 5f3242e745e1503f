"""What `fit` on in-memory arrays adds to peak memory as the data grows.

The CNN of `bench_memory.py` (64 x 64 images) as `Model(32)` and as
`AccumModel(32, 4)`, fitting two windows from NumPy arrays of n = 1024,
4096 and 16384 images (48 to 768 MiB). Measured, each in a fresh process:
the growth of the process's peak resident set during `fit` (VmHWM, reset
right before `fit` through /proc/self/clear_refs, minus the resident set
before `fit`); the median over `--repeats` processes (3), with min and
max. A library that copies no data grows as plain Keras does at every n.

    python benchmarks/bench_data_memory.py
    python benchmarks/bench_data_memory.py --backend=jax    # or torch
    python benchmarks/bench_data_memory.py --samples=64 --repeats=1 \
        --out=/tmp/data_memory.json                       # a quick look

Results go to benchmarks/results/data_memory.json (data_memory_jax.json,
data_memory_torch.json); `python benchmarks/report.py` puts them in
docs/benchmarks.md. `--child VARIANT N` is one measured process. On a GPU,
`bench_gpu_memory.py --with-sweep` measures the same with JAX's and
PyTorch's allocators.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _memory


def child(variant, samples):
    """Peak resident-set growth of `fit` on `samples` in-memory images."""
    _memory.child_env()
    model, x, y = _memory.data_model(variant, samples, jit_compile=False)

    def fit():
        _memory.fit_arrays(model, x, y, steps=2 * _memory.DATA_K)

    return {
        "peak_bytes": _memory.rss_growth(fit),
        "data_bytes": x.nbytes + y.nbytes,
    }


def _row(args, variant, samples):
    """One variant and data size: the median over `--repeats` processes."""
    runs = [
        _memory.measure_on_cpu(
            __file__, ["--child", variant, samples], args.backend
        )
        for _ in range(args.repeats)
    ]
    peaks = [r["peak_bytes"] for r in runs]
    row = {
        "variant": variant,
        "k": _memory.DATA_K if variant == "accum" else 1,
        "samples": samples,
        "data_bytes": runs[0]["data_bytes"],
        **_memory.spread("peak_bytes", peaks),
    }
    print(
        f"n={samples:<6} data {row['data_bytes'] / 2**20:6.0f} MiB "
        f"{variant:<6} peak growth {row['peak_bytes'] / 2**20:7.1f} "
        f"MiB ({min(peaks) / 2**20:.0f}-{max(peaks) / 2**20:.0f})",
        flush=True,
    )
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "N"))
    parser.add_argument(
        "--samples",
        default=",".join(map(str, _memory.DATA_SAMPLES)),
        help="the data sizes n, in images",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--backend",
        default="tensorflow",
        help="Keras backend of the measured processes",
    )
    parser.add_argument("--out", help="default: data_memory[_BACKEND].json")
    args = parser.parse_args(argv)
    if args.child:
        variant, samples = args.child
        print(json.dumps(child(variant, int(samples))))
        return 0
    rows = [
        _row(args, variant, int(samples))
        for samples in args.samples.split(",")
        for variant in _memory.DATA_VARIANTS
    ]
    out = args.out or _memory.results_path("data_memory", args.backend)
    _memory.write_results(out, args.backend, args.repeats, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
