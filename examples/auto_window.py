"""MNIST with `accum_steps="auto"`: the window grows with the noise scale.

A 784-256-10 MLP trains with Adam (learning rate 1e-3) at micro-batch 32
on MNIST, with the window length chosen in the train step by
`keras_accum.AutoAccumSteps` from the gradient noise scale each window
measures. The example prints, per epoch, the updates so far, the window
length the controller has reached, the smoothed noise scale B_simple and
the test accuracy; `--plot` draws the window length and B_simple against
the samples seen.

    python examples/auto_window.py [--epochs 6] [--plot auto_window.png]

Data comes from `tensorflow-datasets` (`tfds.load("mnist")`): downloaded
once into tfds's default directory on a connected machine, or read offline
from the `TFDS_DATA_DIR` environment variable.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

import keras_accum

MICRO_BATCH = 32


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument(
        "--train-images",
        type=int,
        default=60_000,
        help="the first N training images (default all 60,000)",
    )
    parser.add_argument(
        "--plot", default=None, metavar="PATH", help="write a PNG figure here"
    )
    return parser.parse_args(argv)


def load_mnist(n_train):
    import tensorflow_datasets as tfds

    data_dir = os.environ.get("TFDS_DATA_DIR")
    train, test = tfds.load(
        "mnist",
        split=[f"train[:{n_train}]", "test"],
        as_supervised=True,
        batch_size=-1,
        data_dir=data_dir,
        download=data_dir is None,
    )
    (x, y), (x_test, y_test) = tfds.as_numpy(train), tfds.as_numpy(test)
    scale = np.float32(1 / 255)
    return (
        (x.reshape(len(x), -1) * scale, y),
        (x_test.reshape(len(x_test), -1) * scale, y_test),
    )


class EpochReport(keras.callbacks.Callback):
    """Prints the controller's progress and the test accuracy per epoch."""

    def __init__(self, test):
        super().__init__()
        self.test = test

    def on_epoch_end(self, epoch, logs=None):
        _, accuracy = self.model.evaluate(*self.test, verbose=0)
        print(
            f"epoch {epoch + 1}: {int(self.model.optimizer.iterations)} "
            f"updates, window {logs['pseudo_batch_window_length']:.0f} "
            f"micro-batches, B_simple {logs['pseudo_batch_noise_scale']:.0f} "
            f"samples, test accuracy {accuracy:.4f}",
            flush=True,
        )


def smoothed_noise_scale(updates, smoothing):
    """B_simple after each update, smoothed as the controller smooths it:
    moving averages of tr(Σ) and |G|² decayed by `smoothing` per
    micro-batch."""
    trace = grad_sq = 0.0
    found = []
    for update in updates:
        if np.isfinite(update.trace) and np.isfinite(update.grad_sq):
            decay = smoothing**update.micro_batches
            trace = decay * trace + (1 - decay) * update.trace
            grad_sq = decay * grad_sq + (1 - decay) * update.grad_sq
        found.append(trace / grad_sq if grad_sq > 0 else np.nan)
    return np.array(found)


def plot(updates, config, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = np.cumsum([u.samples for u in updates])
    lengths = [u.micro_batches for u in updates]
    noise = smoothed_noise_scale(updates, config.smoothing)
    fig, left = plt.subplots(figsize=(7, 4))
    left.step(samples, lengths, where="post", color="C0")
    left.set_xlabel("samples seen")
    left.set_ylabel("window length (micro-batches)", color="C0")
    right = left.twinx()
    right.plot(samples, noise, color="C1", alpha=0.8)
    right.set_ylabel("smoothed B_simple (samples)", color="C1")
    left.set_title(
        f'MNIST MLP, micro-batch {MICRO_BATCH}, accum_steps="auto" '
        f"({len(updates)} updates)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None):
    args = parse_args(argv)
    (x, y), test = load_mnist(args.train_images)
    keras.utils.set_random_seed(0)
    # --8<-- [start:auto]
    inputs = keras.Input((784,))
    hidden = keras.layers.Dense(256, activation="relu")(inputs)
    outputs = keras.layers.Dense(10, activation="softmax")(hidden)
    model = keras_accum.AccumModel(inputs, outputs, accum_steps="auto")
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    # Every window measures the noise scale under "auto"; the logger
    # reads each window's estimates and logs the length it reached.
    logger = keras_accum.PseudoBatchLogger(noise_scale=True)
    # --8<-- [end:auto]
    model.fit(
        x,
        y,
        batch_size=MICRO_BATCH,
        epochs=args.epochs,
        callbacks=[logger, EpochReport(test)],
        verbose=0,
    )
    lengths = [u.micro_batches for u in logger.updates]
    print(
        f"window lengths: first {lengths[0]}, last {lengths[-1]}, "
        f"longest {max(lengths)}; {len(lengths)} updates for "
        f"{args.epochs * len(x)} samples"
    )
    if args.plot:
        plot(logger.updates, model.accum_steps, args.plot)


if __name__ == "__main__":
    main()
