"""What `fit` tells the window at epoch boundaries, as callbacks.

`AccumModel.fit` puts `WindowEpochs` first among the callbacks: it tells the
step how many steps an epoch has and where one starts and ends, applies a
window an epoch of unknown length left open, warns about skipped windows,
and runs the loggers that add to the epoch logs before any other callback
sees them. `WindowResume` comes last: once `BackupAndRestore` has
restored a backup, it makes `fit` resume at the epoch the restored
weights belong to.
"""

from __future__ import annotations

import warnings

import keras

from keras_accum import _compat, _trainer
from keras_accum._window_log import MINIMIZED_LOG_KEYS


def _set_monitor_modes(callbacks) -> None:
    """Gives monitors of a minimised `PseudoBatchLogger` key `mode="min"`.

    Keras's `mode="auto"` knows only `"loss"` and compiled metrics, and
    raises for any other key at the first epoch end. For keys whose
    direction is certain, `"auto"` then means `"min"`: Keras reads `mode`
    lazily, at that first epoch end. Other keys keep Keras's error.
    """
    for cb in callbacks:
        if (
            getattr(cb, "mode", None) == "auto"
            and getattr(cb, "monitor", None) in MINIMIZED_LOG_KEYS
            and getattr(cb, "monitor_op", None) is None
        ):
            cb.mode = "min"


class WindowEpochs(keras.callbacks.Callback):
    """Tells the compiled step where epochs end; applies leftovers."""

    def __init__(self, model):
        super().__init__()
        self._accum_model = model
        self._loggers = []
        self._skipped_before = 0

    def set_loggers(self, callbacks):
        # Callbacks that add to the epoch logs (`PseudoBatchLogger`): run
        # here, first of all, so every later callback sees their keys.
        self._loggers = [
            cb for cb in callbacks if hasattr(cb, "_on_window_epoch_end")
        ]
        _set_monitor_modes(callbacks)

    def on_train_begin(self, logs=None):
        model = self._accum_model
        _trainer.set_steps_per_epoch(model, self.params.get("steps"))
        model._check_schedule()
        if model._window is not None:
            # Only a window the other callbacks load from here on counts
            # for `WindowResume`.
            model._window.take_loaded_position()

    def on_epoch_begin(self, epoch, logs=None):
        _trainer.set_epoch(self._accum_model, epoch, starts=True)
        self._skipped_before = self._accum_model.skipped_windows

    def on_epoch_end(self, epoch, logs=None):
        if self._accum_model.partial_window == "apply":
            # Unknown epoch length: the step could not close the window.
            self._accum_model.apply_partial_window()
        # What a backup taken now belongs to: the start of the next epoch.
        _trainer.set_epoch(self._accum_model, epoch + 1)
        self._count_skipped(epoch)
        for logger in self._loggers:
            logger._on_window_epoch_end(logs)

    def _count_skipped(self, epoch):
        # Not a log key: the default logs stay those of `keras.Model`, so
        # tooling that reads them sees no difference at `accum_steps=1`.
        # A skip is a divergence from plain training, though, so it is
        # never silent (`PseudoBatchLogger` counts it too, for its logs).
        model = self._accum_model
        total = model.skipped_windows
        # `compile()` rebuilds the window state, restarting the count.
        skipped = max(0, total - self._skipped_before)
        self._skipped_before = total
        if skipped == 0 or isinstance(
            model.optimizer, keras.optimizers.LossScaleOptimizer
        ):
            # A loss-scale optimizer skips such a step in plain Keras too
            # (and lowers its scale), so the window does what it would.
            return
        windows = "window" if skipped == 1 else "windows"
        warnings.warn(
            f"Epoch {epoch + 1}: AccumModel skipped {skipped} {windows} "
            "because the accumulated gradient was not finite (NaN or inf): "
            f"{'it' if skipped == 1 else 'they'} applied no update, where a "
            "plain `keras.Model` would have written the non-finite "
            f"gradient into the weights. {total} over the model's life "
            "(`model.skipped_windows`). Check the data, the loss and the "
            "learning rate for what produces NaN or inf; "
            "`PseudoBatchLogger` logs the count per epoch as "
            "`pseudo_batch_skipped_windows`.",
            stacklevel=2,
        )

    def on_train_end(self, logs=None):
        _trainer.set_steps_per_epoch(self._accum_model, 0)


class WindowResume(keras.callbacks.Callback):
    """Resumes `fit` at the epoch the restored weights belong to.

    `keras.callbacks.BackupAndRestore` writes the weights file, then
    `training_metadata.json` with the epoch to resume at. A process killed
    between the two leaves new weights beside the old epoch: Keras would
    train that epoch again on weights that already saw it. The window
    saved in the weights file records its own epoch (`counters.epoch`),
    so after the callbacks' `on_train_begin` (this one is last) `fit`
    starts at that epoch, with a warning naming both. A backup taken in
    the middle of an epoch (`save_freq` in batches) cannot resume exactly:
    Keras restarts the epoch from its first batch; that is warned about.
    """

    def __init__(self, model, callbacks):
        super().__init__()
        self._accum_model = model
        self._backups = [
            cb
            for cb in callbacks
            if isinstance(cb, keras.callbacks.BackupAndRestore)
        ]

    def on_train_begin(self, logs=None):
        model = self._accum_model
        window = model._window
        if not self._backups or window is None:
            return
        position = window.take_loaded_position()
        if position is None:  # No backup was restored.
            return
        epoch, epoch_step = position
        # Where `BackupAndRestore` says to resume (Keras 3.10-3.15 keep it
        # as `_initial_epoch`, which `fit` reads after this).
        keras_epoch = _compat.initial_epoch(model)
        files, metadata = _compat.backup_files(self._backups[0])
        updates = int(model.optimizer.iterations.numpy())
        if epoch_step > 0:
            warnings.warn(
                f"The backup restored from {files} was taken during epoch "
                f"{epoch + 1}, after {epoch_step} of its micro-batches "
                f"({updates} optimizer updates): `BackupAndRestore` "
                "restarts an epoch from its first batch, so those "
                "micro-batches are trained twice (a `keras.Model` does the "
                'same). Back up at epoch ends (`save_freq="epoch"`) '
                "to resume exactly.",
                stacklevel=2,
            )
        elif epoch != keras_epoch:
            warnings.warn(
                f"{metadata} says to resume at epoch {keras_epoch + 1}, "
                f"but the weights restored from {files} were saved at the "
                f"end of epoch {epoch} ({updates} optimizer updates): the "
                "process was stopped between writing the two files. "
                f"Resuming at epoch {epoch + 1}, where the weights belong "
                f"(Keras would train epoch {keras_epoch + 1} again).",
                stacklevel=2,
            )
        _compat.set_initial_epoch(model, epoch)
