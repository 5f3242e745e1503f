"""What accumulation costs on each Keras backend, side by side.

Keras fixes its backend at import, so each backend runs in its own process
(this script with `--worker BACKEND`). In each, for every model and k, three
variants are built and warmed up once, then timed in interleaved rounds:

- `Model(B)`: plain Keras at the micro-batch, the limit (same compute, no
  accumulation);
- `AccumModel(B, k)`: this library;
- `Model(B) + optimizer(gradient_accumulation_steps=k)`: Keras's built-in.

Reported per backend, model and k: the median over rounds of each round's
ratio of CPU time per sample to `Model(B)`'s in the same round (paired, so
that a machine slowed for a while slows both), with the first and third
quartiles; and, paired the same way, `AccumModel`'s CPU time against
Keras's built-in (`accum` vs `keras_ga`). Each backend runs its default
step (`jit_compile="auto"`; `--jit-compile` sets it): TensorFlow's
`tf.function` graph (Keras turns XLA off on a CPU-only machine), JAX's
`jax.jit`, PyTorch's eager step.

    python benchmarks/bench_backends.py                 # all three
    python benchmarks/bench_backends.py --backends=torch --rounds=3
    python benchmarks/bench_backends.py --backends=tensorflow --jit-compile=true

Results go to benchmarks/results/backends.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _workers

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("plain", "accum", "keras_ga")


def worker(args):
    """Times the variants on the backend Keras was imported with."""
    _workers.without_tensorflow()
    import keras
    import numpy as np
    from _variants import MODELS, compiled

    def build(name, variant, k):
        keras.utils.set_random_seed(0)
        inputs, outputs, _, _ = MODELS[name]()
        jit = {"auto": "auto", "true": True, "false": False}
        return compiled(
            inputs, outputs, variant, k, jit_compile=jit[args.jit_compile]
        )

    rows = []
    rng = np.random.default_rng(0)
    for name in args.models.split(","):
        shape = MODELS[name]()[2]
        for k in (int(k) for k in args.ks.split(",")):
            # Whole windows only.
            samples = args.samples_per_run // (args.micro_batch * k)
            samples = max(1, samples) * args.micro_batch * k
            x = rng.normal(size=(samples, *shape)).astype("float32")
            y = rng.integers(0, 10, size=samples).astype("int32")
            # Keras accumulates from 2 steps on: at k = 1 only ours.
            variants = VARIANTS if k > 1 else VARIANTS[:2]
            built = {v: build(name, v, k) for v in variants}
            times = _workers.time_rounds(
                built, x, y, args.micro_batch, args.rounds
            )
            # Against Model(B), and (paired in the same round) ours against
            # Keras's own accumulation.
            pairs = [(v, "plain") for v in variants[1:]]
            if k > 1:
                pairs.append(("accum", "keras_ga"))
            for variant, baseline in pairs:
                rows.append(
                    {
                        "backend": keras.backend.backend(),
                        "model": name,
                        "k": k,
                        "variant": variant,
                        "baseline": baseline,
                        "micro_batch": args.micro_batch,
                        "samples_per_run": samples,
                        **_workers.paired_ratios(times, variant, baseline),
                        "plain_samples_per_cpu_s": 1.0
                        / statistics.median(times["plain"]),
                    }
                )
    _workers.print_rows(rows)


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="tensorflow,jax,torch")
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--ks", default="4,16")
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--jit-compile", choices=("auto", "true", "false"), default="auto"
    )
    parser.add_argument("--samples-per-run", type=int, default=4096)
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks/results/backends.json")
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


# What the parent passes on to each worker, as `--name=value`.
WORKER_OPTIONS = (
    "models",
    "ks",
    "micro_batch",
    "rounds",
    "jit_compile",
    "samples_per_run",
)


def main():
    args = _parser().parse_args()
    if args.worker:
        return worker(args)
    rows = _workers.run_workers(__file__, args, WORKER_OPTIONS)
    _workers.write_report(
        args.out, rows, args.rounds, jit_compile=args.jit_compile
    )
    print(
        f"{'backend':<11} {'model':<5} {'k':>3}  {'variant':<9} "
        "vs baseline  median  (q1-q3) of CPU time/sample"
    )
    for r in rows:
        print(
            f"{r['backend']:<11} {r['model']:<5} {r['k']:>3}  "
            f"{r['variant']:<9} {r['baseline']:<11} {r['ratio_median']:.3f}  "
            f"({r['ratio_q1']:.3f}-{r['ratio_q3']:.3f})"
        )


if __name__ == "__main__":
    main()
