"""`micro_batch_size="auto"`: the size it picks under a memory limit, the
peak it predicts, and the peaks measured apart from the search.

Each backend (TensorFlow, JAX; PyTorch refuses "auto" on a CPU) runs in
its own process. For each benchmark model at batch `--batch`, limits are
set between the peaks measured at two sizes (`--pairs`, e.g. 8 and 16:
halfway), then `AutoMicroBatch(memory_limit=limit, margin=0)` picks a
size. Reported per limit: the size picked, the peak it predicted, the
peaks measured at that size and the next one (the next should be above
the limit), the sizes the search measured, and the CPU seconds of the
first epoch (with the search) against the next. Every figure comes from
a fresh process; with `--in-process` (JAX only, for smoke runs), from the
script's own: JAX's figures are compiled analyses, the same in any
process, but the first epoch's CPU seconds then find some of JAX's caches
warm.

The measurements count what "auto" counts, the model's own memory: JAX,
the compiled train step's `memory_analysis()` (arguments + outputs not
aliased + temporaries); TensorFlow, the allocator's peak over `fit`'s
second step less the bytes in use when it began, plus the model's state
(`TF_CPU_ALLOCATOR_USE_BFC=true`).

    python benchmarks/bench_auto_micro_batch.py
    python benchmarks/bench_auto_micro_batch.py --backends=jax --models=mlp
    python benchmarks/bench_auto_micro_batch.py --backends=jax --in-process

Results go to benchmarks/results/auto_micro_batch.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _workers

ROOT = Path(__file__).resolve().parents[1]


def worker(args):
    """One task in a fresh process: `peak` (`--size`: the measured peak
    at that int size) or `auto` (`--limit`: the choice, and the first
    epoch's CPU seconds with the search and at the size chosen)."""
    _workers.without_tensorflow()
    import keras
    import numpy as np
    from _variants import MODELS

    import keras_accum
    from keras_accum import _sizing

    backend = keras.backend.backend()
    batch = args.batch
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    inputs, outputs, shape, classes = MODELS[args.models]()
    rng = np.random.default_rng(0)
    x = rng.random((3 * batch, *shape), dtype=np.float32)
    y = rng.integers(0, classes, size=3 * batch)

    def build(size):
        keras.utils.set_random_seed(0)
        model = keras_accum.AccumModel(inputs, outputs, micro_batch_size=size)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
        return model

    if args.task == "auto":
        auto = keras_accum.AutoMicroBatch(memory_limit=args.limit, margin=0.0)
        model = build(auto)
        start = time.process_time()
        try:
            model.fit(x, y, batch_size=batch, verbose=0)
        except RuntimeError as error:  # Not even 1 fits, by its figures.
            return [{"micro_batch_size": None, "error": str(error)}]
        with_search = time.process_time() - start
        start = time.process_time()
        model.fit(x, y, batch_size=batch, verbose=0)
        (choice,) = model.micro_batch_choices
        return [
            {
                **choice,
                "first_epoch_cpu_s": with_search,
                "next_epoch_cpu_s": time.process_time() - start,
            }
        ]
    model = build(args.size)
    if backend == "jax":
        import jax

        model.fit(x[:batch], y[:batch], batch_size=batch, verbose=0)
        state = model._get_jax_state(
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
        )
        step = jax.jit(model.train_step, donate_argnums=0)
        data = (x[:batch], y[:batch])
        found = step.lower(state, data).compile().memory_analysis()
        return [_sizing.compiled_peak(found)]
    import tensorflow as tf

    info = tf.config.experimental.get_memory_info

    class Second(keras.callbacks.Callback):
        """What the second step allocated above the bytes in use when it
        began (its batch arrives inside it), as the probes count it."""

        def on_train_batch_begin(self, index, logs=None):
            if index == 1:
                tf.config.experimental.reset_memory_stats("CPU:0")
                self.before = info("CPU:0")["current"]

        def on_train_batch_end(self, index, logs=None):
            if index == 1:
                self.peak = info("CPU:0")["peak"] - self.before

    second = Second()
    model.fit(x, y, batch_size=batch, verbose=0, callbacks=[second])
    # Plus the model's state, which "auto" counts too: its variables, the
    # optimizer's, the metrics', and the accumulators (one float32 copy
    # of the trainable weights).
    state = [*model.variables, *model.optimizer.variables]
    state += [*model.metrics_variables, *model.trainable_variables]
    held = sum(keras.ops.convert_to_numpy(v).nbytes for v in state)
    return [held + second.peak]


def _task(args, backend, model, task, **values):
    args = argparse.Namespace(
        **{**vars(args), "models": model, "task": task, **values}
    )
    if args.in_process:
        return worker(args)[0]
    options = ("models", "batch", "task", *values)
    return _workers.run_worker(__file__, backend, args, options)[0]


def _rows(args, backend):
    rows = []
    pairs = [tuple(int(s) for s in p.split(":")) for p in args.pairs.split(",")]
    for model in args.models.split(","):
        peaks = {}

        def peak(size, model=model, peaks=peaks):
            # One fresh process per size: a size measured for the limit
            # is not measured again for the choice.
            if size not in peaks:
                peaks[size] = _task(args, backend, model, "peak", size=size)
            return peaks[size]

        for low, high in pairs:
            limit = (peak(low) + peak(high)) // 2
            choice = _task(args, backend, model, "auto", limit=limit)
            chosen = choice["micro_batch_size"]
            row = {
                "backend": backend,
                "model": model,
                "batch": args.batch,
                "between": [low, high],
                "limit": limit,
                "chosen": chosen,
            }
            if chosen is None:
                rows.append({**row, "error": choice["error"]})
                continue
            above = peak(chosen + 1) if chosen < args.batch else None
            rows.append(
                {
                    **row,
                    "predicted_peak": choice["predicted_peak"],
                    "measured_at_chosen": peak(chosen),
                    "measured_at_next": above,
                    "probes": choice["probes"],
                    "measured_by": choice["measured_by"],
                    "first_epoch_cpu_s": choice["first_epoch_cpu_s"],
                    "next_epoch_cpu_s": choice["next_epoch_cpu_s"],
                }
            )
    return rows


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="tensorflow,jax")
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument(
        "--pairs",
        default="16:256,256:1024",
        help="sizes LOW:HIGH whose measured peaks the limit lies halfway "
        "between, comma-separated",
    )
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks/results/auto_micro_batch.json")
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run every task in this process, not a fresh one each (JAX "
        "only: a smoke run's shortcut)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--task", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=int, help=argparse.SUPPRESS)
    return parser


def main():
    args = _parser().parse_args()
    if args.worker:
        _workers.print_rows(worker(args))
        return
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    if args.in_process:
        if args.backends != "jax":
            raise SystemExit(
                "--in-process measures JAX only (compiled analyses); "
                f"received --backends={args.backends}"
            )
        # As `_workers.run_worker` sets up a worker's process.
        os.environ["KERAS_BACKEND"] = "jax"
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    rows = []
    for backend in args.backends.split(","):
        rows.extend(_rows(args, backend))
    _workers.write_report(
        args.out, rows, rounds=1, batch=args.batch, pairs=args.pairs
    )
    print(
        f"{'backend':11} {'model':5} {'limit MiB':>9} {'chosen':>6} "
        f"{'predicted':>9} {'at chosen':>9} {'at next':>8} {'probes':>6} "
        f"{'epoch CPU s: first / next':>26}"
    )
    for r in rows:
        mib = 2**20
        if r["chosen"] is None:
            print(
                f"{r['backend']:11} {r['model']:5} {r['limit'] / mib:9.2f}"
                f"  refused: {r['error'][:60]}"
            )
            continue
        nxt = r["measured_at_next"]
        print(
            f"{r['backend']:11} {r['model']:5} {r['limit'] / mib:9.2f} "
            f"{r['chosen']:6d} {r['predicted_peak'] / mib:9.2f} "
            f"{r['measured_at_chosen'] / mib:9.2f} "
            f"{(nxt or 0) / mib:8.2f} {r['probes']:6d} "
            f"{r['first_epoch_cpu_s']:13.2f} / {r['next_epoch_cpu_s']:.2f}"
        )


if __name__ == "__main__":
    main()
