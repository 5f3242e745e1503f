"""How an accumulation window is saved: one format on every backend.

A model saved with a window open (between two updates) keeps the window:
`.keras` files, `save_weights` and `BackupAndRestore` carry the
accumulators and counters, under the same keys whichever backend wrote
them, so a file saved on TensorFlow resumes on JAX and the other way round.
"""

from __future__ import annotations

from keras_accum._compat import KerasSaveable

# Saved besides the accumulators (`acc_grad_0`, `acc_grad_1`, ...).
SAVED_COUNTERS = (
    "acc_normalizer",
    "acc_loss",
    "acc_samples",
    "acc_grad_sq",
    "mini_step",
    "epoch_step",
    "window_length",
    "skipped_windows",
)


class SavedWindow(KerasSaveable):
    """The saving half of a backend's window state.

    Subclasses hold `acc_grads` (one accumulator per trainable weight) and
    a variable for each name in `SAVED_COUNTERS`.
    """

    def _obj_type(self):
        # Keras accepts only its own kinds here; it decides which attributes
        # the saver skips when walking for children, and this has none.
        return "Loss"

    def save_own_variables(self, store):
        for i, acc in enumerate(self.acc_grads):
            store[f"acc_grad_{i}"] = acc
        for name in SAVED_COUNTERS:
            store[name] = getattr(self, name)

    def load_own_variables(self, store):
        keys = list(store.keys())
        if not keys:
            # Saved before any training, or by a plain model: start fresh.
            return
        saved = sum(
            key.startswith("acc_grad_") and key[len("acc_grad_") :].isdigit()
            for key in keys
        )
        if saved != len(self.acc_grads):
            raise ValueError(
                f"The saved accumulation window holds {saved} gradient "
                f"accumulators but this model has {len(self.acc_grads)} "
                "trainable weights; load it into the same architecture."
            )
        for i, acc in enumerate(self.acc_grads):
            acc.assign(store[f"acc_grad_{i}"])
        for name in SAVED_COUNTERS:
            if name in keys:
                getattr(self, name).assign(store[name])
