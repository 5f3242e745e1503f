"""`accum_steps="auto"` against fixed windows and a hand-written ramp.

MNIST through TFDS, micro-batch 32, Adam at one learning rate for every
run, the same number of epochs and the same seeds: each model (an MLP and
a small CNN) trains with

- `accum_steps` fixed at each of `--fixed` (1, 2, 4, 8, 16, 32);
- a ramp a user could write without the controller: an epoch schedule
  that doubles the window every `--ramp-every` epochs from 1;
- `"auto"` (`AutoAccumSteps` with the library's defaults, or the
  `--batch-fraction` / `--max-steps` / `--lr-scaling` given).

Per run it records the updates and samples, the test accuracy and loss
after every epoch, and the updates and samples at the first epoch end
that reached `--target` test accuracy. `--report` prints the table (mean
of seeds) and `--plot` draws updates against final accuracy, one point per
run.

    python benchmarks/bench_auto_accum.py                  # the full run
    python benchmarks/bench_auto_accum.py --models mlp --seeds 1 --epochs 2
    python benchmarks/bench_auto_accum.py --report --plot docs/images/auto.png
    python benchmarks/bench_auto_accum.py --models mlp --lr-scaling sqrt \
        --auto-label "auto lr=sqrt" --only "auto lr=sqrt"  # one more run

Results go to benchmarks/results/auto_accum.json (`--out`); a run adds to
what is there, so models or seeds can be run apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

import keras_accum

RESULTS = Path(__file__).resolve().parent / "results" / "auto_accum.json"
MICRO_BATCH = 32


def load_mnist(train_images=None, test_images=None):
    """MNIST's train and test splits through TFDS, as float32 arrays (the
    first `train_images` and `test_images` of each, if given)."""
    import tensorflow_datasets as tfds

    train = "train" if train_images is None else f"train[:{train_images}]"
    test = "test" if test_images is None else f"test[:{test_images}]"
    splits = tfds.load(
        "mnist",
        split=[train, test],
        batch_size=-1,
        as_supervised=True,
        data_dir=os.environ.get("TFDS_DATA_DIR"),
    )
    (x, y), (x_test, y_test) = tfds.as_numpy(splits)
    scale = np.float32(1 / 255)
    return (
        (x.astype("float32") * scale, y.astype("int32")),
        (x_test.astype("float32") * scale, y_test.astype("int32")),
    )


def build(name, accum_steps):
    inputs = keras.Input((28, 28, 1))
    if name == "mlp":
        h = keras.layers.Flatten()(inputs)
        h = keras.layers.Dense(256, activation="relu")(h)
    else:
        h = keras.layers.Conv2D(16, 3, activation="relu")(inputs)
        h = keras.layers.MaxPooling2D()(h)
        h = keras.layers.Conv2D(32, 3, activation="relu")(h)
        h = keras.layers.MaxPooling2D()(h)
        h = keras.layers.Flatten()(h)
    outputs = keras.layers.Dense(10, activation="softmax")(h)
    return keras_accum.AccumModel(inputs, outputs, accum_steps=accum_steps)


def variants(args):
    """`(label, accum_steps)` of every run of a model and seed."""
    runs = [(f"fixed {k}", k) for k in args.fixed]
    ramp = {
        epoch: 2 ** (epoch // args.ramp_every)
        for epoch in range(0, args.epochs, args.ramp_every)
    }
    runs.append(("ramp", ramp))
    auto = keras_accum.AutoAccumSteps(
        **{
            key: value
            for key, value in {
                "batch_fraction": args.batch_fraction,
                "max_steps": args.max_steps,
                "min_steps": args.min_steps,
                "lr_scaling": args.lr_scaling,
                "smoothing": args.smoothing,
                "warmup": args.warmup,
            }.items()
            if value is not None
        }
    )
    runs.append((args.auto_label, auto))
    return runs


class EpochTests(keras.callbacks.Callback):
    """The test accuracy and loss, and updates so far, at each epoch end."""

    def __init__(self, test):
        super().__init__()
        self.test = test
        self.rows = []

    def on_epoch_end(self, epoch, logs=None):
        loss, accuracy = self.model.evaluate(
            *self.test, batch_size=1000, verbose=0
        )
        self.rows.append(
            {
                "epoch": epoch + 1,
                "updates": int(self.model.optimizer.iterations.numpy()),
                "test_accuracy": float(accuracy),
                "test_loss": float(loss),
            }
        )


def run_one(model_name, label, accum_steps, seed, data, args):
    (x, y), test = data
    keras.utils.set_random_seed(seed)
    model = build(model_name, accum_steps)
    model.compile(
        optimizer=keras.optimizers.Adam(args.learning_rate),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    tests = EpochTests(test)
    logger = keras_accum.PseudoBatchLogger()
    start = time.process_time()
    model.fit(
        x,
        y,
        batch_size=MICRO_BATCH,
        epochs=args.epochs,
        shuffle=True,
        callbacks=[logger, tests],
        verbose=0,
    )
    cpu = time.process_time() - start
    samples_per_epoch = len(x)
    for row in tests.rows:
        row["samples"] = row["epoch"] * samples_per_epoch
    reached = next(
        (r for r in tests.rows if r["test_accuracy"] >= args.target), None
    )
    lengths = [u.micro_batches for u in logger.updates]
    return {
        "model": model_name,
        "run": label,
        "accum_steps": repr(accum_steps),
        "seed": seed,
        "epochs": args.epochs,
        "updates": tests.rows[-1]["updates"],
        "samples": tests.rows[-1]["samples"],
        "final_accuracy": tests.rows[-1]["test_accuracy"],
        "final_loss": tests.rows[-1]["test_loss"],
        "target": args.target,
        "updates_to_target": reached and reached["updates"],
        "samples_to_target": reached and reached["samples"],
        "per_epoch": tests.rows,
        "window_lengths": _sampled(lengths),
        "lr_scales": _sampled([u.lr_scale for u in logger.updates]),
        "cpu_seconds": cpu,
        "backend": keras.backend.backend(),
    }


def _sampled(values, points=64):
    """At most `points` values spread over `values` (for plots)."""
    if len(values) <= points:
        return list(values)
    step = len(values) / points
    return [values[int(i * step)] for i in range(points)] + [values[-1]]


def summary(results):
    """Mean over seeds of each (model, run)."""
    groups = {}
    for r in results:
        groups.setdefault((r["model"], r["run"]), []).append(r)
    rows = []
    for (model, run), group in groups.items():

        def mean(key, group=group):
            values = [g[key] for g in group if g[key] is not None]
            return statistics.fmean(values) if values else None

        rows.append(
            {
                "model": model,
                "run": run,
                "seeds": len(group),
                "updates": mean("updates"),
                "samples": mean("samples"),
                "final_accuracy": mean("final_accuracy"),
                "final_loss": mean("final_loss"),
                "updates_to_target": mean("updates_to_target"),
                "samples_to_target": mean("samples_to_target"),
                "reached": sum(
                    g["updates_to_target"] is not None for g in group
                ),
            }
        )
    return rows


def verdict(rows, auto_label):
    """Whether `auto_label` meets the issue's target, per model."""
    lines = []
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        auto = next((r for r in mine if r["run"] == auto_label), None)
        fixed = [r for r in mine if r["run"].startswith("fixed")]
        if auto is None or not fixed:
            continue
        best = max(fixed, key=lambda r: r["final_accuracy"])
        gap = (auto["final_accuracy"] - best["final_accuracy"]) * 100
        saved = 1 - auto["updates"] / best["updates"]
        dominated = [
            r["run"]
            for r in mine
            if r["run"] != auto_label
            and r["updates"] <= auto["updates"]
            and r["final_accuracy"] >= auto["final_accuracy"]
        ]
        lines.append(
            f"{model}: best fixed is {best['run']} "
            f"({best['final_accuracy'] * 100:.2f}%, {best['updates']:.0f} "
            f"updates); {auto_label}: {auto['final_accuracy'] * 100:.2f}% "
            f"({gap:+.2f} pp), {auto['updates']:.0f} updates "
            f"({saved:.0%} fewer); better on both updates and accuracy: "
            f"{', '.join(dominated) or 'none'}"
        )
    return lines


def report(results, auto_label):
    rows = summary(results)
    header = (
        "| model | run | updates | final test acc. | final test loss | "
        "updates to target | samples to target |"
    )
    print(header)
    print("|" + "---|" * 7)
    for r in rows:
        to_target = (
            f"{r['updates_to_target']:.0f} ({r['reached']}/{r['seeds']})"
            if r["updates_to_target"] is not None
            else f"not reached (0/{r['seeds']})"
        )
        samples = (
            f"{r['samples_to_target']:,.0f}"
            if r["samples_to_target"] is not None
            else "-"
        )
        print(
            f"| {r['model']} | {r['run']} | {r['updates']:,.0f} | "
            f"{r['final_accuracy'] * 100:.2f}% | {r['final_loss']:.4f} | "
            f"{to_target} | {samples} |"
        )
    print()
    for line in verdict(rows, auto_label):
        print(line)


def plot(results, path, auto_label):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in results))
    runs = list(dict.fromkeys(r["run"] for r in results))
    colors = {run: plt.cm.tab10(i % 10) for i, run in enumerate(runs)}
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5))
    axes = np.atleast_1d(axes)
    for ax, model in zip(axes, models, strict=True):
        mine = [r for r in results if r["model"] == model]
        for run in dict.fromkeys(r["run"] for r in mine):
            points = [r for r in mine if r["run"] == run]
            if run == auto_label:
                marker = "*"
            elif run == "ramp":
                marker = "s"
            else:
                marker = "o" if run.startswith("fixed") else "^"
            size = 160 if run == auto_label else 50
            ax.scatter(
                [p["updates"] for p in points],
                [p["final_accuracy"] * 100 for p in points],
                label=run,
                marker=marker,
                s=size,
                color=colors[run],
            )
        ax.set_xscale("log")
        ax.set_xlabel("optimizer updates (log)")
        ax.set_ylabel("final test accuracy (%)")
        ax.set_title(f"MNIST {model.upper()}, micro-batch {MICRO_BATCH}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--fixed", default="1,2,4,8,16,32")
    parser.add_argument("--ramp-every", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--target", type=float, default=0.97)
    parser.add_argument("--batch-fraction", type=float, default=None)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--min-steps", type=int, default=None)
    parser.add_argument("--lr-scaling", default=None)
    parser.add_argument("--smoothing", type=float, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--auto-label", default="auto")
    parser.add_argument(
        "--only",
        action="append",
        default=None,
        help="a run to do, by its label (repeat for several)",
    )
    parser.add_argument(
        "--train-images", type=int, default=None, help="a smaller run"
    )
    parser.add_argument("--test-images", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    args.fixed = [int(k) for k in args.fixed.split(",") if k]
    results = json.loads(args.out.read_text()) if args.out.exists() else []
    if not (args.report or args.plot):
        only = args.only
        labels = [label for label, _ in variants(args)]
        unknown = [label for label in only or () if label not in labels]
        if unknown:
            raise SystemExit(
                f"--only {unknown[0]!r} names no run; the runs are: "
                f"{', '.join(repr(label) for label in labels)}"
            )
        data = load_mnist(args.train_images, args.test_images)
        for model_name in args.models.split(","):
            for seed in range(args.seeds):
                for label, steps in variants(args):
                    if only is not None and label not in only:
                        continue
                    row = run_one(model_name, label, steps, seed, data, args)
                    results = [
                        r
                        for r in results
                        if (r["model"], r["run"], r["seed"])
                        != (model_name, label, seed)
                    ]
                    results.append(row)
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(results, indent=1))
                    print(
                        f"{model_name} seed {seed} {label}: "
                        f"{row['updates']} updates, "
                        f"{row['final_accuracy'] * 100:.2f}% "
                        f"({row['cpu_seconds']:.0f} s CPU)",
                        flush=True,
                    )
    if args.report or not args.plot:
        report(results, args.auto_label)
    if args.plot:
        plot(results, args.plot, args.auto_label)


if __name__ == "__main__":
    main()
