"""MNIST: micro-batch 1 x 64 accumulation steps trains exactly like batch 64.

The experiment this project grew from, run with the real library. One
784-100-ReLU-10 network, initialised uniform(-0.025, 0.025) from a fixed
seed, trained with mean squared error on one-hot labels for 50 updates on
the first 3,200 MNIST training images in order (no shuffling), three ways:

- `AccumModel`, micro-batch 64, `accum_steps=1`;
- `AccumModel`, micro-batch 1, `accum_steps=64`;
- a plain `keras.Model` at batch 64, the reference.

For each run it prints the test accuracy on the first 1,280 test images,
the pseudo-batch loss mean and standard deviation (from `PseudoBatchLogger`;
for the plain model, each step's loss evaluated at the weights before the
step), the sum of all input pixels the run was fed (a simple data hash) and
the largest weight difference from the reference. It does this for SGD
(learning rate 1e-2) and for Adam, a stateful optimizer.

    python examples/mnist_equivalence.py [--plot mnist.png]

Data comes from `tensorflow-datasets` (`tfds.load("mnist")`): downloaded
once into tfds's default directory on a connected machine, or read offline
from `--data-dir` or the `TFDS_DATA_DIR` environment variable (a directory
named so is only read, never downloaded into).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

import keras_accum

SEED = 1234
LEARNING_RATES = {"sgd": 1e-2, "adam": 1e-3}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--updates", type=int, default=50, help="optimizer updates per run"
    )
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=1,
        help="micro-batch size of the accumulating run (default 1)",
    )
    parser.add_argument(
        "--accum-steps",
        type=int,
        default=64,
        help="accumulation steps of the accumulating run (default 64)",
    )
    parser.add_argument(
        "--optimizer",
        choices=["sgd", "adam", "both"],
        default="both",
        help="optimizer(s) to compare (default both)",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="tensorflow-datasets data directory (default: $TFDS_DATA_DIR, "
        "else tfds's own, downloading MNIST once)",
    )
    parser.add_argument(
        "--plot", default=None, metavar="PATH", help="write a PNG figure here"
    )
    args = parser.parse_args(argv)
    for name in ("updates", "micro_batch", "accum_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# -- Data ----------------------------------------------------------------------


def load_mnist(n_train, n_test, data_dir):
    """The first `n_train` training and `n_test` test images, in order."""
    import tensorflow_datasets as tfds

    data_dir = data_dir or os.environ.get("TFDS_DATA_DIR")
    splits = [f"train[:{n_train}]", f"test[:{n_test}]"]
    kwargs = dict(
        split=splits,
        data_dir=data_dir,
        as_supervised=True,
        batch_size=-1,
        shuffle_files=False,
    )
    try:
        # A data directory named by the user is read, never downloaded
        # into: offline runs fail fast instead of waiting on the network.
        train, test = tfds.load("mnist", download=data_dir is None, **kwargs)
    except Exception as error:  # noqa: BLE001 (any failure: one message)
        if data_dir:
            problem = f"MNIST is not prepared in {data_dir}"
        else:
            problem = "MNIST could not be downloaded"
        raise SystemExit(
            f"{problem} ({type(error).__name__}). Run once on a connected "
            "machine without --data-dir and TFDS_DATA_DIR to download it, "
            "or point --data-dir (or TFDS_DATA_DIR) at a directory holding "
            "a prepared tensorflow-datasets `mnist`."
        ) from None
    (x_train, y_train), (x_test, y_test) = (
        tfds.as_numpy(train),
        tfds.as_numpy(test),
    )
    if len(x_train) < n_train:
        raise SystemExit(
            f"--updates x batch needs {n_train} training images; MNIST has "
            f"{len(x_train)}."
        )
    return x_train, y_train, x_test, y_test


def prepare(images, labels):
    x = images.reshape(len(images), -1).astype("float32") / 255.0
    y = keras.utils.to_categorical(labels, 10).astype("float32")
    return x, y


# -- Model ---------------------------------------------------------------------


def build(model_cls, optimizer, **kwargs):
    init = keras.initializers.RandomUniform(-0.025, 0.025, seed=SEED)
    inputs = keras.Input((784,))
    hidden = keras.layers.Dense(
        100, activation="relu", kernel_initializer=init, bias_initializer=init
    )(inputs)
    outputs = keras.layers.Dense(
        10, activation="softmax", kernel_initializer=init, bias_initializer=init
    )(hidden)
    model = model_cls(inputs, outputs, **kwargs)
    learning_rate = LEARNING_RATES[optimizer]
    model.compile(
        optimizer=(
            keras.optimizers.SGD(learning_rate)
            if optimizer == "sgd"
            else keras.optimizers.Adam(learning_rate)
        ),
        loss="mean_squared_error",
        metrics=["accuracy"],
    )
    return model


class WeightsPerUpdate(keras.callbacks.Callback):
    """The weights after each optimizer update, for the difference plot."""

    def __init__(self):
        super().__init__()
        self.weights = []
        self._seen = 0

    def _record(self):
        iterations = int(self.model.optimizer.iterations.numpy())
        if iterations != self._seen:
            self._seen = iterations
            self.weights.append([w.copy() for w in self.model.get_weights()])

    def on_train_batch_end(self, batch, logs=None):
        self._record()

    def on_epoch_end(self, epoch, logs=None):
        self._record()


def run(label, optimizer, x, y, x_test, y_test, batch, accum_steps, plain):
    started = time.perf_counter()
    print(
        f"[{optimizer}] {label}: {len(x) // (batch * accum_steps)} updates, "
        f"{len(x) // batch} steps ...",
        flush=True,
    )
    keras.utils.set_random_seed(SEED)
    if plain:
        model = build(keras.Model, optimizer)
    else:
        model = build(
            keras_accum.AccumModel, optimizer, accum_steps=accum_steps
        )
    initial = model.get_weights()
    weights = WeightsPerUpdate()
    callbacks = [weights]
    logger = None
    if not plain:
        logger = keras_accum.PseudoBatchLogger()
        callbacks.append(logger)
    model.fit(
        x,
        y,
        batch_size=batch,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    if logger is not None:
        losses = np.array([u.loss for u in logger.updates])
    else:
        # A plain model logs running means; evaluate each step's batch at
        # the weights it was computed with instead.
        losses = step_losses(model, initial, weights.weights, x, y, batch)
    _, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    print(
        f"[{optimizer}] {label}: done in {time.perf_counter() - started:.1f}s",
        flush=True,
    )
    return {
        "label": label,
        "updates": int(model.optimizer.iterations),
        "accuracy": accuracy,
        "losses": losses,
        "pixel_sum": pixel_sum(x),
        "weights": weights.weights,
        "final": model.get_weights(),
    }


def step_losses(model, initial, after_each, x, y, batch):
    final = model.get_weights()
    losses = []
    for step, weights in enumerate([initial, *after_each[:-1]]):
        model.set_weights(weights)
        window = slice(step * batch, (step + 1) * batch)
        losses.append(model.test_on_batch(x[window], y[window])[0])
    model.set_weights(final)
    return np.array(losses)


def pixel_sum(x):
    # The images were scaled from uint8 by 1/255: undo it exactly.
    return int(np.rint(x * 255.0).astype(np.int64).sum())


def max_diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b, strict=True))


# -- Main ----------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    window = args.micro_batch * args.accum_steps
    n_train, n_test = args.updates * window, 1280
    x_train, y_train, x_test, y_test = load_mnist(
        n_train, n_test, args.data_dir
    )
    x, y = prepare(x_train[:n_train], y_train[:n_train])
    x_test, y_test = prepare(x_test, y_test)

    optimizers = (
        ["sgd", "adam"] if args.optimizer == "both" else [args.optimizer]
    )
    results = {}
    for optimizer in optimizers:
        common = (optimizer, x, y, x_test, y_test)
        runs = [
            run(f"micro-batch {window} x 1", *common, window, 1, plain=False),
            run(
                f"micro-batch {args.micro_batch} x {args.accum_steps}",
                *common,
                args.micro_batch,
                args.accum_steps,
                plain=False,
            ),
            run(f"keras.Model batch {window}", *common, window, 1, plain=True),
        ]
        results[optimizer] = runs

    print()
    header = (
        f"{'optimizer':<9} {'run':<24} {'updates':>7} {'test acc':>9} "
        f"{'loss mean':>11} {'loss std':>11} {'pixel sum':>11} "
        f"{'max|dw| vs plain':>17}"
    )
    print(header)
    print("-" * len(header))
    worst = 0.0
    for optimizer, runs in results.items():
        reference = runs[-1]
        for result in runs:
            diff = max_diff(result["final"], reference["final"])
            worst = max(worst, diff)
            print(
                f"{optimizer:<9} {result['label']:<24} {result['updates']:>7} "
                f"{result['accuracy']:>9.4f} {result['losses'].mean():>11.7f} "
                f"{result['losses'].std():>11.7f} {result['pixel_sum']:>11} "
                f"{diff:>17.2e}"
            )
    print(f"\nlargest weight difference from large-batch training: {worst:.2e}")

    if args.plot:
        plot(results, args.plot)
        print(f"figure written to {args.plot}")
    if worst > 1e-4:
        print("runs differ more than float32 rounding allows", file=sys.stderr)
        return 1
    return 0


def plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib: pip install 'keras-accum[examples]'"
        ) from None
    fig, axes = plt.subplots(
        2, len(results), figsize=(6 * len(results), 7), squeeze=False
    )
    styles = ["-", "--", ":"]
    for column, (optimizer, runs) in enumerate(results.items()):
        top, bottom = axes[0][column], axes[1][column]
        for style, result in zip(styles, runs, strict=True):
            updates = np.arange(1, len(result["losses"]) + 1)
            top.plot(updates, result["losses"], style, label=result["label"])
        top.set_title(f"{optimizer}: pseudo-batch loss per update")
        top.set_xlabel("update")
        top.set_ylabel("MSE")
        top.legend()
        reference = runs[-1]["weights"]
        for style, result in zip(styles[:-1], runs[:-1], strict=True):
            diffs = [
                max(max_diff(a, b), 1e-12)
                for a, b in zip(result["weights"], reference, strict=True)
            ]
            label = result["label"]
            if max(diffs) <= 1e-12:
                label += " (identical: drawn at 1e-12)"
            bottom.semilogy(
                np.arange(1, len(diffs) + 1), diffs, style, label=label
            )
        bottom.axhline(1.19e-7, color="grey", lw=0.8)
        bottom.text(1, 1.4e-7, "float32 epsilon", color="grey")
        bottom.set_ylim(1e-12, 1e-3)
        bottom.set_title(f"{optimizer}: max |weight difference| from batch 64")
        bottom.set_xlabel("update")
        bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
