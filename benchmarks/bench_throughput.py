"""Throughput of AccumModel against plain Keras, side by side in one process.

For each model (an MLP, a small CNN, a small transformer block) and each
setting (`jit_compile`, `steps_per_execution`), every variant is built and
warmed up once, then timed in interleaved rounds (variant 1, 2, ..., then
again), so that a noisy machine slows all variants alike. Reported: the
median samples per second over rounds, with min and max, and the ratio of
each variant's time per sample to the limit, `keras.Model` at the same
micro-batch B (same compute, no accumulation):

- `Model(B)`: the limit;
- `AccumModel(B, k)`: this library;
- `Model(B) + optimizer(gradient_accumulation_steps=k)`: Keras's built-in;
- `Model(B*k)`: the large batch itself, where it fits in memory.

What estimating the gradient noise scale costs is measured by
`bench_noise_overhead.py`, in paired rounds.

    python benchmarks/bench_throughput.py                # full grid
    python benchmarks/bench_throughput.py --quick        # a smaller grid
    python benchmarks/bench_throughput.py --write-docs   # also update docs

Results go to benchmarks/results/throughput.json (and with --write-docs the
table in docs/benchmarks.md and docs/images/throughput.png).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tf_timing import ROOT, build, data, dataset, machine, time_fit


def variants(k, include_large):
    yield "plain", 1
    yield "accum", k
    if k > 1:
        yield "keras_ga", k
        if include_large:
            yield "large", k


def run_setting(args, model_name, jit, spe):
    """Every variant and k of `--ks` in one setting, timed in rounds."""
    ks = [int(k) for k in args.ks.split(",")]
    micro_batch, samples_per_run = args.micro_batch, args.samples_per_run
    x, y = data(model_name, samples_per_run * max(ks) // 4 + micro_batch)
    configs = {}
    for k in ks:
        for variant, kk in variants(k, include_large=True):
            key = (variant, kk)
            if key in configs:
                continue
            batch = micro_batch * (kk if variant == "large" else 1)
            steps = max(
                samples_per_run // batch, kk if variant != "large" else 1
            )
            # Whole windows and whole executions only.
            windowed = variant.startswith("accum") or variant == "keras_ga"
            unit = np.lcm(kk if windowed else 1, spe)
            steps = int(max(unit, steps // unit * unit))
            model = build(model_name, variant, kk, jit, spe)
            ds = dataset(x, y, batch)
            # Trace, compile, warm caches.
            time_fit(model, ds, steps)
            configs[key] = (model, ds, steps, batch, [])
    for _ in range(args.rounds):
        for model, ds, steps, batch, times in configs.values():
            wall, cpu = time_fit(model, ds, steps)
            times.append((wall / (steps * batch), cpu / (steps * batch)))
    # On a GPU the wall clock is the cost. On a shared CPU machine it is
    # not: the hypervisor stalls the process in coarse slices, so compare
    # the CPU time the process used; it counts work, not waiting.
    which = 0 if tf.config.list_physical_devices("GPU") else 1
    rows = []
    limit = statistics.median(t[which] for t in configs[("plain", 1)][4])
    for (variant, k), (_, _, steps, _batch, runs) in configs.items():
        times = [t[which] for t in runs]
        walls = [t[0] for t in runs]
        per_sample = statistics.median(times)
        rows.append(
            {
                "model": model_name,
                "variant": variant,
                "k": k,
                "micro_batch": micro_batch,
                "jit_compile": jit,
                "steps_per_execution": spe,
                "samples_per_s": 1.0 / per_sample,
                "samples_per_s_min": 1.0 / max(times),
                "samples_per_s_max": 1.0 / min(times),
                "time_ratio_to_plain": per_sample / limit,
                "clock": "wall" if which == 0 else "cpu",
                "wall_samples_per_s": 1.0 / statistics.median(walls),
                "steps_timed": steps,
            }
        )
    return rows


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,cnn,transformer")
    parser.add_argument("--ks", default="1,4,16,64")
    parser.add_argument("--jit", default="off,on")
    parser.add_argument("--spe", default="1,8")
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples-per-run", type=int, default=4096)
    parser.add_argument("--quick", action="store_true", help="smaller grid")
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks/results/throughput.json")
    )
    parser.add_argument("--write-docs", action="store_true")
    return parser


def main(argv=None):
    args = _parser().parse_args(argv)
    if args.quick:
        args.ks, args.spe, args.rounds = "1,16", "1", 3
    jits = [j == "on" for j in args.jit.split(",")]
    spes = [int(s) for s in args.spe.split(",")]

    rows = []
    for model_name in args.models.split(","):
        for jit in jits:
            for spe in spes:
                started = time.perf_counter()
                new = run_setting(args, model_name, jit, spe)
                rows += new
                print(
                    f"{model_name} jit={'on' if jit else 'off'} spe={spe}: "
                    f"{time.perf_counter() - started:.0f}s",
                    flush=True,
                )
                for row in new:
                    print(
                        f"  {row['variant']:<9} k={row['k']:<3} "
                        f"{row['samples_per_s']:>10.0f} samples/s  "
                        f"time ratio {row['time_ratio_to_plain']:.3f}",
                        flush=True,
                    )
                keras.backend.clear_session()
    result = {"machine": machine(), "rounds": args.rounds, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    if args.write_docs:
        from report import write_docs

        write_docs(ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
