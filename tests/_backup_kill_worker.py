"""Trains under `BackupAndRestore` and is killed during a backup.

    python _backup_kill_worker.py BACKUP_DIR KILL_AT_SAVE [plain] [double]
        [between]

Exits with status 17 (`os._exit`, as a pre-empted process stops: no
cleanup) from inside the KILL_AT_SAVE-th weights write (a layer's
`save_own_variables`: the file half written), or with `between` right
after that weights file is complete, before `BackupAndRestore` writes
`training_metadata.json`. `build` and `DATA` are shared with the test that
resumes the run (tests/test_robustness.py). `plain` trains a `keras.Model`
instead, `double` passes `double_checkpoint=True` (the figures in
docs/guides/robustness.md).

    python _backup_kill_worker.py --snapshots OUT_DIR NAME=FLAGS...

The runs of one process, one after another (TensorFlow's or JAX's start
once, not once per run), each killed at the third save: `FLAGS` are the
flags above joined by `+` (or `-` for none). At the point where the
process would end, the run's backup folder is copied to `OUT_DIR/NAME`:
the bytes the kill leaves on disk (it flushes nothing of the process's
own, and neither does a copy, which reads what the operating system
holds); then the run is abandoned and the next one starts.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import keras
from _helpers import regression_data

import keras_accum

DATA = regression_data(n=70)
B, K, EPOCHS = 8, 4, 4


class Killed(BaseException):
    """Abandons a run in `--snapshots` mode (no `except Exception` in
    Keras or the library stops it)."""


# `--snapshots` mode: `(backup_dir, out_dir)` of the run in progress.
SNAPSHOT = []


def kill():
    """Ends the process, or in `--snapshots` mode copies the backup folder
    as the kill leaves it and abandons the run."""
    sys.stdout.flush()
    if not SNAPSHOT:
        os._exit(17)
    backup_dir, out_dir = SNAPSHOT.pop()
    shutil.copytree(backup_dir, out_dir)
    raise Killed()


class SaveTripwire(keras.layers.Layer):
    """The identity; ends the process during its `exit_on_save`-th save."""

    def __init__(self, exit_on_save=0, **kwargs):
        super().__init__(**kwargs)
        self.exit_on_save = exit_on_save
        self.saves = 0

    def call(self, x):
        return x

    def save_own_variables(self, store):
        self.saves += 1
        if self.saves == self.exit_on_save:
            kill()


def build(plain=False, exit_on_save=0):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    # Between two layers with weights: the first is already in the file
    # when the process dies.
    hidden = SaveTripwire(exit_on_save)(hidden)
    outputs = keras.layers.Dense(3)(hidden)
    if plain:
        model = keras.Model(inputs, outputs)
    else:
        model = keras_accum.AccumModel(inputs, outputs, accum_steps=K)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def fit(model, callbacks):
    x, y = DATA
    return model.fit(
        x,
        y,
        batch_size=B,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )


def exit_after_save(model, at):
    """Ends the process when `model`'s `at`-th `save_weights` returns."""
    save = model.save_weights
    saves = []

    def save_then_exit(*args, **kwargs):
        save(*args, **kwargs)
        saves.append(args)
        if len(saves) == at:
            kill()

    model.save_weights = save_then_exit


def killed_run(backup_dir, kill_at, flags):
    """Trains until killed at the `kill_at`-th save (see the module)."""
    between = "between" in flags
    model = build(
        plain="plain" in flags, exit_on_save=0 if between else kill_at
    )
    if between:
        exit_after_save(model, kill_at)
    backup = keras.callbacks.BackupAndRestore(
        backup_dir, double_checkpoint="double" in flags
    )
    fit(model, [backup])
    sys.exit("the run was not killed")


def snapshots(out_dir, runs):
    for run in runs:
        name, flags = run.split("=")
        with tempfile.TemporaryDirectory() as work:
            backup_dir = os.path.join(work, "backup")
            SNAPSHOT.append((backup_dir, os.path.join(out_dir, name)))
            try:
                killed_run(backup_dir, 3, flags.split("+"))
            except Killed:
                pass
    print("SNAPSHOTS", len(os.listdir(out_dir)), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--snapshots":
        snapshots(sys.argv[2], sys.argv[3:])
    else:
        killed_run(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
