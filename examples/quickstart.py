"""Quick start: batch 32 x 8 accumulation steps equals batch 256.

Trains the same small classifier twice from the same initial weights on
the same data: a plain `keras.Model` at batch 256, and an `AccumModel` at
batch 32 with `accum_steps=8`. Prints both histories and the largest
weight difference, which is float32 rounding.

    python examples/quickstart.py
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# --8<-- [start:data]
import keras
import numpy as np

import keras_accum


def make_data(n=2048, features=32, classes=5, seed=0):
    """Synthetic classification data: features and labels 0-4."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features, classes))
    y = np.argmax(x @ w + rng.normal(size=(n, classes)), axis=1)
    return x, y


# --8<-- [end:data]
# --8<-- [start:build]
def build(model_cls, **kwargs):
    keras.utils.set_random_seed(42)  # Same initial weights for both runs.
    inputs = keras.Input(shape=(32,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    outputs = keras.layers.Dense(5, activation="softmax")(hidden)
    model = model_cls(inputs, outputs, **kwargs)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


# --8<-- [end:build]


def main():
    # --8<-- [start:accum]
    x, y = make_data()
    model = build(keras_accum.AccumModel, accum_steps=8)
    # 32 samples per step, one Adam update per 8 steps: batch 256.
    model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=2)
    # --8<-- [end:accum]

    reference = build(keras.Model)
    reference.fit(x, y, batch_size=256, epochs=3, shuffle=False, verbose=2)

    diff = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(
            model.get_weights(), reference.get_weights(), strict=True
        )
    )
    print(
        f"optimizer updates: accumulated {int(model.optimizer.iterations)}, "
        f"large batch {int(reference.optimizer.iterations)}"
    )
    print(f"max |weight difference| after 3 epochs: {diff:.3e}")
    if diff > 1e-5:
        raise SystemExit("accumulated training diverged from large-batch")


if __name__ == "__main__":
    main()
