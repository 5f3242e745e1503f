"""Where a window's CPU time goes, micro-batch by micro-batch (TensorFlow).

`bench_backends.py` times whole `fit` runs; this script calls each model's
train function itself and files the CPU time of every call under its
position in the window (the call's index modulo k), so that what a
micro-batch costs between updates and what the update costs show apart.
Variants, at micro-batch B, all from the same weights on the same data:

- `accum`: `AccumModel(B, k)`;
- `keras_ga`: `Model(B)` with Keras's `gradient_accumulation_steps=k`;
- `keras_ga_whole`: the same, its optimizer made to wait for the whole
  gradient before it starts. An `AccumModel` window must: a window whose
  gradient is not finite is skipped whole, so no weight may move before
  every accumulator is known to be finite. Keras's own update starts on
  each weight as soon as that weight's gradient exists, while the graph
  executor is still computing the others (backpropagation runs from the
  last layer to the first). Its distance from `keras_ga` is what that
  overlap is worth.

In each round every variant runs `--block` micro-batches, in a shuffled
order, until each has run `--windows` windows. Reported per variant: the
median CPU milliseconds per micro-batch at each position, the last one
being the update; against `keras_ga`, the mean difference over the other
positions (`between_ms`), the update's difference (`update_ms`) and the
ratio of the windows' sums of medians (`window_ratio`). TensorFlow only:
its graph executor is where the overlap exists (JAX's XLA schedules a
step as one program; Keras's PyTorch step applies after `backward()`).

    python benchmarks/bench_window_positions.py
    python benchmarks/bench_window_positions.py --models=mlp --windows=100

Results go to benchmarks/results/window_positions.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _tf_timing as bt
import tensorflow as tf

VARIANTS = ("accum", "keras_ga", "keras_ga_whole")


def _after_the_whole_gradient(optimizer) -> None:
    """Makes `optimizer` take its gradients only once all of them exist."""
    apply = optimizer.apply

    def apply_after_the_whole_gradient(grads, trainable_variables=None):
        grads = list(grads)
        with tf.control_dependencies([g for g in grads if g is not None]):
            grads = [None if g is None else tf.identity(g) for g in grads]
        return apply(grads, trainable_variables)

    # On the instance: Keras's step calls `self.optimizer.apply(...)`.
    object.__setattr__(optimizer, "apply", apply_after_the_whole_gradient)


def _prepared(model_name, variant, k, ds):
    """`(model, iterator)`, traced and warm, at a window's start."""
    model = bt.build(model_name, variant.removesuffix("_whole"), k, False, 1)
    if variant.endswith("_whole"):
        _after_the_whole_gradient(model.optimizer)
    model.fit(ds, epochs=1, steps_per_epoch=4 * k, shuffle=False, verbose=0)
    # Four whole windows, four updates (Keras's accumulation counts
    # updates too): the next call is a window's first micro-batch.
    updates = int(model.optimizer.iterations.numpy())
    if updates != 4 or getattr(model, "mini_step", 0) != 0:
        raise RuntimeError(f"{variant}: not at a window's start ({updates})")
    return model, iter(ds)


def run_setting(args, model_name, k):
    """Per-position CPU times of every variant, and their comparisons."""
    x, y = bt.data(model_name, 64 * args.micro_batch)
    ds = bt.dataset(x, y, args.micro_batch)
    prepared = {v: _prepared(model_name, v, k, ds) for v in VARIANTS}
    times = {v: [[] for _ in range(k)] for v in VARIANTS}
    calls = dict.fromkeys(VARIANTS, 0)
    shuffle = random.Random(0).shuffle
    order = list(VARIANTS)
    while min(calls.values()) < args.windows * k:
        shuffle(order)
        for variant in order:
            model, iterator = prepared[variant]
            for _ in range(args.block):
                start = time.process_time()
                model.train_function(iterator)
                spent = time.process_time() - start
                times[variant][calls[variant] % k].append(spent * 1e3)
                calls[variant] += 1
    for variant, (model, _) in prepared.items():
        # One update per k calls, at the last position: the positions are
        # the window's.
        updates = int(model.optimizer.iterations.numpy())
        if updates != 4 + calls[variant] // k:
            raise RuntimeError(f"{variant}: {updates} updates, not one per k")
    medians = {v: [statistics.median(at) for at in times[v]] for v in VARIANTS}
    return [_row(model_name, k, args, v, medians) for v in VARIANTS]


def _row(model_name, k, args, variant, medians):
    mine, keras_ga = medians[variant], medians["keras_ga"]
    return {
        "model": model_name,
        "k": k,
        "micro_batch": args.micro_batch,
        "variant": variant,
        "windows": args.windows,
        "position_ms": mine,
        "window_ms": sum(mine),
        "between_ms": statistics.mean(mine[:-1])
        - statistics.mean(keras_ga[:-1]),
        "update_ms": mine[-1] - keras_ga[-1],
        "window_ratio": sum(mine) / sum(keras_ga),
    }


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--ks", default="8")
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--windows", type=int, default=400)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument(
        "--out",
        default=str(bt.ROOT / "benchmarks/results/window_positions.json"),
    )
    return parser


def main(argv=None):
    args = _parser().parse_args(argv)
    rows = []
    for model_name in args.models.split(","):
        for k in (int(k) for k in args.ks.split(",")):
            new = run_setting(args, model_name, k)
            rows += new
            print(f"{model_name} k={k}, CPU ms per micro-batch:", flush=True)
            for row in new:
                positions = " ".join(f"{t:.2f}" for t in row["position_ms"])
                print(
                    f"  {row['variant']:<15} {positions}  "
                    f"between {row['between_ms']:+.3f}  "
                    f"update {row['update_ms']:+.3f}  "
                    f"window x{row['window_ratio']:.3f}",
                    flush=True,
                )
    result = {"machine": bt.machine(), "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
