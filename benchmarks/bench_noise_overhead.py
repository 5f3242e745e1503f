"""What estimating the gradient noise scale costs, measured in pairs.

Timing the variants in rounds, as `bench_throughput.py` does, gives a
ratio of two medians that carries a shared machine's round-to-round
spread, too coarse for a 2% question. Here each round times the variants back to
back, in rotating order, and keeps each one's ratio to the reference; the
median of many such paired ratios cancels the slow drifts that a shared
machine has:

- `AccumModel(B, k)` with `PseudoBatchLogger()`, the reference;
- the same with `PseudoBatchLogger(noise_scale=True, noise_scale_every=n)`
  for each `n` of `--every` (1: every window estimates);
- a control: a second, identical reference (`noise_scale_every` 0 in the
  results). Its ratio would be 1 on a quiet machine; how far it lands
  from 1 is the resolution of the run.

Both models start from the same weights and see the same data. The clock
is the process's CPU time on a CPU-only machine (it counts work, not the
hypervisor's stalls) and the wall clock on a GPU.

    python benchmarks/bench_noise_overhead.py              # the full run
    python benchmarks/bench_noise_overhead.py --rounds 5   # a quick look

Results go to benchmarks/results/noise_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _tf_timing as bt
import keras
import numpy as np
import tensorflow as tf

import keras_accum


def _quartiles(values):
    q1, q2, q3 = np.percentile(values, [25, 50, 75])
    return float(q1), float(q2), float(q3)


def run_setting(args, model_name, k, jit):
    """Each `--every` and the control against the reference, in pairs."""
    everies = [int(e) for e in args.every.split(",")]
    micro_batch, rounds = args.micro_batch, args.rounds
    samples = args.samples_per_run
    x, y = bt.data(model_name, samples + micro_batch)
    steps = max(k, samples // micro_batch // k * k)
    ds = bt.dataset(x, y, micro_batch)
    runs = {}
    for every in ["reference", 0, *everies]:
        model = bt.build(model_name, "accum", k, jit, 1)
        if every not in ("reference", 0):
            logger = keras_accum.PseudoBatchLogger(
                noise_scale=True, noise_scale_every=every
            )
        else:
            logger = keras_accum.PseudoBatchLogger()
        # Trace, compile, warm caches.
        bt.time_fit(model, ds, steps, [logger])
        runs[every] = (model, logger, [])
    which = 0 if tf.config.list_physical_devices("GPU") else 1
    order = list(runs)
    for r in range(rounds):
        # Rotate the order, so that no variant always runs first.
        for every in order[r % len(order) :] + order[: r % len(order)]:
            model, logger, times = runs[every]
            times.append(bt.time_fit(model, ds, steps, [logger])[which])
    base = runs["reference"][2]
    rows = []
    for every in [0, *everies]:
        ratios = [t / b for t, b in zip(runs[every][2], base, strict=True)]
        q1, median, q3 = _quartiles(ratios)
        rows.append(
            {
                "model": model_name,
                "k": k,
                "noise_scale_every": every,
                "micro_batch": micro_batch,
                "jit_compile": jit,
                "steps_timed": steps,
                "rounds": rounds,
                "clock": "wall" if which == 0 else "cpu",
                "ratio_median": median,
                "ratio_q1": q1,
                "ratio_q3": q3,
                "ratios": ratios,
                "seconds_per_run_logger": statistics.median(base),
            }
        )
    return rows


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,cnn,transformer")
    parser.add_argument("--ks", default="4,16")
    parser.add_argument("--jit", default="off,on")
    parser.add_argument("--every", default="1,4")
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--samples-per-run", type=int, default=2048)
    parser.add_argument(
        "--out",
        default=str(bt.ROOT / "benchmarks/results/noise_overhead.json"),
    )
    return parser


def _print_setting(label, started, rows):
    print(f"{label}: {time.perf_counter() - started:.0f}s", flush=True)
    for row in rows:
        every = row["noise_scale_every"]
        name = f"every={every}" if every else "control"
        print(
            f"  {name:<9} "
            f"ratio to reference {row['ratio_median']:.4f} "
            f"(quartiles {row['ratio_q1']:.4f}-"
            f"{row['ratio_q3']:.4f})",
            flush=True,
        )


def _median_over_settings(rows):
    """Each `noise_scale_every`'s median ratio over the settings."""
    summary = {}
    for every in sorted({row["noise_scale_every"] for row in rows}):
        medians = [
            row["ratio_median"]
            for row in rows
            if row["noise_scale_every"] == every
        ]
        summary[str(every)] = statistics.median(medians)
        label = f"every={every}" if every else "control"
        print(
            f"{label}: median over settings {summary[str(every)]:.4f}"
            f" (range {min(medians):.4f}-{max(medians):.4f})"
        )
    return summary


def main(argv=None):
    args = _parser().parse_args(argv)
    rows = []
    for model_name in args.models.split(","):
        for jit in [j == "on" for j in args.jit.split(",")]:
            for k in [int(k) for k in args.ks.split(",")]:
                started = time.perf_counter()
                new = run_setting(args, model_name, k, jit)
                rows += new
                label = f"{model_name} jit={'on' if jit else 'off'} k={k}"
                _print_setting(label, started, new)
                keras.backend.clear_session()
    summary = _median_over_settings(rows)
    result = {
        "machine": bt.machine(),
        "rounds": args.rounds,
        "median_over_settings": summary,
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
