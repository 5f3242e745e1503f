"""The split mode (`micro_batch_size`) against the classic mode, side by side.

Each backend runs in its own process (this script with `--worker BACKEND`).
In each, for every model, four variants train on the same data, one update
per `m·k` samples, built and warmed up once, then timed in interleaved
rounds:

- `split`: `AccumModel(micro_batch_size=m)`, fed batches of `m·k`;
- `accum`: `AccumModel(accum_steps=k)`, fed micro-batches of `m`;
- `keras_ga`: `keras.Model` with `gradient_accumulation_steps=k`, fed `m`;
- `large`: `keras.Model`, fed batches of `m·k` (more memory).

Reported per backend and model: the median over rounds of each round's
ratio of CPU time per sample to the classic mode's (`accum`) in the same
round, with the quartiles. On JAX, `--memory` also reads each variant's
compiled train step (`memory_analysis()`): its temporaries, in units of
the trainable weights' float32 size.

    python benchmarks/bench_micro_batch.py                  # all three
    python benchmarks/bench_micro_batch.py --backends=jax --memory

Results go to benchmarks/results/micro_batch.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _workers

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("accum", "split", "keras_ga", "large")


def worker(args):
    """Times the variants on the backend Keras was imported with."""
    _workers.without_tensorflow()
    import keras
    import numpy as np
    from _variants import MODELS, compiled

    import keras_accum

    m, k = args.micro_batch, args.accum_steps
    batch = {"accum": m, "keras_ga": m, "split": m * k, "large": m * k}

    def build(name, variant):
        keras.utils.set_random_seed(0)
        inputs, outputs, _, _ = MODELS[name]()
        if variant == "split":
            model = keras_accum.AccumModel(inputs, outputs, micro_batch_size=m)
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
            return model
        return compiled(
            inputs, outputs, "plain" if variant == "large" else variant, k
        )

    rows = []
    rng = np.random.default_rng(0)
    for name in args.models.split(","):
        shape = MODELS[name]()[2]
        samples = max(1, args.samples_per_run // (m * k)) * m * k
        x = rng.normal(size=(samples, *shape)).astype("float32")
        y = rng.integers(0, 10, size=samples).astype("int32")
        built = {v: build(name, v) for v in VARIANTS}
        times = _workers.time_rounds(built, x, y, batch, args.rounds)
        memory = _memory(built, batch, x, y) if args.memory else {}
        for variant in VARIANTS[1:]:
            rows.append(
                {
                    "backend": keras.backend.backend(),
                    "model": name,
                    "variant": variant,
                    "baseline": "accum",
                    "micro_batch": m,
                    "accum_steps": k,
                    **_workers.paired_ratios(times, variant, "accum"),
                    "temp_p": memory.get(variant),
                    "accum_temp_p": memory.get("accum"),
                }
            )
    _workers.print_rows(rows)


def _memory(built, batch, x, y):
    """JAX: each variant's compiled train step's temporaries, in P."""
    import keras

    if keras.backend.backend() != "jax":
        return {}
    import jax
    import numpy as np

    found = {}
    for variant, model in built.items():
        state = model._get_jax_state(
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
        )
        size = batch[variant]
        step = jax.jit(model.train_step, donate_argnums=0)
        analysis = step.lower(state, (x[:size], y[:size])).compile()
        p = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_weights)
        found[variant] = analysis.memory_analysis().temp_size_in_bytes / p
    return found


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="tensorflow,jax,torch")
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--accum-steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--samples-per-run", type=int, default=4096)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks/results/micro_batch.json")
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


# What the parent passes on to each worker: as `--name=value`, and (where
# set) as `--name`.
WORKER_OPTIONS = (
    "models",
    "micro_batch",
    "accum_steps",
    "rounds",
    "samples_per_run",
)
WORKER_FLAGS = ("memory",)


def main():
    args = _parser().parse_args()
    if args.worker:
        return worker(args)
    rows = _workers.run_workers(__file__, args, WORKER_OPTIONS, WORKER_FLAGS)
    _workers.write_report(args.out, rows, args.rounds)
    print(
        f"{'backend':<11} {'model':<5} {'variant':<9} vs accum  "
        "median  (q1-q3) of CPU time/sample   temporaries (P)"
    )
    for r in rows:
        memory = ""
        if r["temp_p"] is not None:
            memory = f"{r['temp_p']:.2f} (accum {r['accum_temp_p']:.2f})"
        print(
            f"{r['backend']:<11} {r['model']:<5} {r['variant']:<9} "
            f"{r['ratio_median']:.3f}  ({r['ratio_q1']:.3f}-"
            f"{r['ratio_q3']:.3f})   {memory}"
        )


if __name__ == "__main__":
    main()
