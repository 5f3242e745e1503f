"""`PseudoBatchLogger`: the loss of what each update saw."""

from __future__ import annotations

import importlib.util
import math
import os
import warnings
from typing import NamedTuple

import keras
import numpy as np

from keras_accum import _window_log as window_log
from keras_accum._window_log import LOG_CAPACITY


class PseudoBatch(NamedTuple):
    """One optimizer update of an `AccumModel`, as `PseudoBatchLogger` saw it.

    Attributes:
        update: `optimizer.iterations` right after the update (1 for the
            first update of a fresh optimizer).
        loss: The pseudo-batch loss: the loss of the window's samples at the
            weights before the update, reduced as the compiled loss reduces
            a batch (regularization included).
        samples: Samples in the window.
        micro_batches: Micro-batches in the window.
        trace: With `noise_scale=True`, this window's unbiased estimate of
            tr(Σ), the summed per-sample gradient variance; NaN otherwise
            and for one-micro-batch windows. Where the loss averages over
            other units than samples (timesteps, pixels, sample weights),
            it is rescaled by units per sample, so that
            `trace / grad_sq` is a batch size in samples.
        grad_sq: With `noise_scale=True`, this window's unbiased estimate
            of |G|², the squared norm of the true gradient; else NaN.
            (Under `accum_steps="auto"` every window has both.)
        lr_scale: The factor `AutoAccumSteps(lr_scaling=...)` put on the
            optimizer's learning rate for this update; 1 without one.
    """

    update: int
    loss: float
    samples: int
    micro_batches: int = 1
    trace: float = float("nan")
    grad_sq: float = float("nan")
    lr_scale: float = 1.0


class PseudoBatchLogger(keras.callbacks.Callback):
    """Logs pseudo-batch loss statistics of an `AccumModel`'s training.

    A *pseudo-batch* is one accumulation window: the `accum_steps`
    micro-batches one optimizer update sees. Its loss is computed inside the
    compiled train step, from the same micro-batch losses the gradients
    come from, weighted as the gradients are, and published once per
    update. It equals the per-step loss that a plain `keras.Model` training
    on the equivalent large batches computes, which Keras's running-mean
    `logs["loss"]` does not show. Epoch-end partial windows, sample weights
    and `steps_per_execution > 1` (callbacks firing once per several
    updates) are all counted exactly.

    At each epoch end the callback adds to the epoch's logs:

    - `pseudo_batch_loss_mean`: the mean pseudo-batch loss of the epoch's
      updates;
    - `pseudo_batch_loss_std`: their population standard deviation;
    - `pseudo_batch_skipped_windows`: windows skipped in the epoch because
      their gradient was not finite (no update; `model.skipped_windows`
      counts them over the model's life);
    - `pseudo_batch_window_length`: the length, in micro-batches, of the
      windows that start next (`accum_steps`, its schedule's, or what
      `accum_steps="auto"` chose);
    - `pseudo_batch_size`: the effective batch of those windows, in
      samples: their length times the epoch's mean micro-batch (NaN for an
      epoch without updates).

    With `micro_batch_size` (each batch one window, split in the step),
    the last two are the epoch's largest batch's: the micro-batches it
    split into and its samples (the epoch's shorter last batch is left
    out, as Keras's `batch_size` leaves it out).

    The first two are NaN for an epoch without updates (possible only with
    `partial_window="carry"`). The keys are added before any other callback
    sees the epoch's logs, wherever this callback sits in the `callbacks`
    list, so `History`, `CSVLogger`, `TensorBoard`, `EarlyStopping` and the
    progress bar all receive them. Without this callback the logs hold
    exactly the keys a `keras.Model` logs.

    Monitoring: `EarlyStopping`, `ModelCheckpoint` and `ReduceLROnPlateau`
    with `monitor="pseudo_batch_loss_mean"` work in their default
    `mode="auto"`, which `AccumModel.fit` sets to `"min"` for this key
    (Keras's own auto mode knows only `"loss"` and compiled metrics). Every
    other `pseudo_batch_` key needs an explicit `mode="min"` or
    `mode="max"`; Keras raises a `ValueError` at the first epoch end
    otherwise.

    The per-update series is kept in `updates`, a list of `PseudoBatch`
    `(update, loss, samples, micro_batches, trace, grad_sq, lr_scale)`,
    across epochs and `fit` calls. With `log_dir`, each update's loss,
    window length and samples are also written as the TensorBoard scalars
    `pseudo_batch_loss`, `pseudo_batch_window_length` and
    `pseudo_batch_size` at step `update`.

    Gradient noise scale (`noise_scale=True`): every window holds
    `accum_steps` micro-batch gradients and their mean, which is what the
    simple noise scale B_simple = tr(Σ) / |G|² of McCandlish et al. (2018),
    "An Empirical Model of Large-Batch Training", needs. Each sampled
    window (every `noise_scale_every`-th, by default every fourth) gives
    unbiased estimates of tr(Σ) and |G|² (from the squared gradient norms
    at the micro-batch and at the window size: one extra reduction per
    micro-batch, no extra gradient buffer); the callback smooths each with
    an exponential moving average over those windows (`smoothing`) and
    divides.
    B_simple estimates the critical batch size, past which larger batches
    stop paying for themselves. Epoch logs then also get:

    - `pseudo_batch_noise_scale`: the smoothed B_simple, in samples;
    - `pseudo_batch_critical_batch_size`: the batch size it implies,
      B_simple rounded to a whole number of samples;
    - `pseudo_batch_suggested_accum_steps`: the `accum_steps` that reaches
      it at the current micro-batch size, at least 1.

    All three are NaN until an estimate exists (windows of at least two
    micro-batches; the estimate of |G|² must be positive). Under a
    distribution strategy the estimates come from the first replica's
    micro-batches. Turning it on or off retraces the train step once.

    With `accum_steps=1` every batch is a pseudo-batch. A plain
    `keras.Model` computes no pseudo-batch loss: using this callback with
    one raises a `TypeError` at the start of `fit` (use
    `AccumModel(..., accum_steps=1)` or `AccumModel.from_model` to log a
    plain training run).

    Args:
        log_dir: String or `None`. Directory for TensorBoard event files of
            the per-update losses (and noise scale). Defaults to `None` (no
            files).
        noise_scale: Bool. Whether to estimate the gradient noise scale.
            Defaults to `False`.
        smoothing: Float in [0, 1). Decay of the moving averages of the
            noise-scale estimates, per estimate. Defaults to `0.95`.
        noise_scale_every: Integer >= 1. Estimate the noise scale in every
            `noise_scale_every`-th window (windows 0, n, 2n, ... counted
            from 0 since `compile()`: for a logger there from the first
            `fit`, `updates[0]`, `updates[n]`, ..., whose `update` is 1,
            n + 1, ...); the others cost nothing and carry NaN. `1`
            estimates in every window. Defaults to `4`.

    Raises:
        TypeError: If `log_dir` is not a path or `None`, `noise_scale` is
            not a bool, or (at the start of `fit`) the model is not an
            `AccumModel`.
        ValueError: If `smoothing` is outside [0, 1) or
            `noise_scale_every` is not an integer >= 1.
        ImportError: If `log_dir` is given and `tensorboard` or
            `tensorflow` is missing (it writes with `tf.summary`).

    Example:

    ```python
    model = keras_accum.AccumModel(inputs, outputs, accum_steps=64)
    model.compile(optimizer="sgd", loss="mse")
    logger = keras_accum.PseudoBatchLogger()
    history = model.fit(x, y, batch_size=1, callbacks=[logger])
    history.history["pseudo_batch_loss_mean"]  # One value per epoch.
    [u.loss for u in logger.updates]  # One value per update.
    ```
    """

    def __init__(
        self,
        log_dir: str | None = None,
        noise_scale: bool = False,
        smoothing: float = 0.95,
        noise_scale_every: int = 4,
    ) -> None:
        super().__init__()
        if not isinstance(noise_scale, bool):
            raise TypeError(
                "`noise_scale` must be a bool. "
                f"Received: noise_scale={noise_scale!r} "
                f"(of type {type(noise_scale).__name__})"
            )
        if (
            isinstance(smoothing, bool)
            or not isinstance(smoothing, (int, float))
            or not 0 <= smoothing < 1
        ):
            raise ValueError(
                "`smoothing` must be a number in [0, 1). "
                f"Received: smoothing={smoothing!r}"
            )
        if (
            isinstance(noise_scale_every, bool)
            or not isinstance(noise_scale_every, int)
            or noise_scale_every < 1
        ):
            raise ValueError(
                "`noise_scale_every` must be an integer >= 1. "
                f"Received: noise_scale_every={noise_scale_every!r}"
            )
        self.noise_scale = noise_scale
        self.smoothing = float(smoothing)
        self.noise_scale_every = noise_scale_every
        self._ema_trace = 0.0
        self._ema_grad_sq = 0.0
        self._micro_batch = float("nan")
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(
                "`log_dir` must be a path (a string or `os.PathLike`) or "
                f"None. Received: log_dir={log_dir!r} (of type "
                f"{type(log_dir).__name__})"
            )
        if log_dir is not None:
            # Written with `tf.summary`, as Keras's own TensorBoard callback
            # does on every backend.
            for package in ("tensorboard", "tensorflow"):
                if importlib.util.find_spec(package) is None:
                    raise ImportError(
                        "`PseudoBatchLogger(log_dir=...)` writes TensorBoard "
                        "event files with `tf.summary` and needs the "
                        f"`{package}` package: pip install {package}. "
                        f"Received: log_dir={log_dir!r}"
                    )
        self.log_dir = log_dir
        self.updates: list[PseudoBatch] = []
        self._read = 0
        self._epoch_start = 0
        self._skipped_start = 0
        self._batches_since_read = 0
        self._read_every = 1
        self._writer = None

    def set_model(self, model):
        from keras_accum.model import AccumModel

        if not isinstance(model, AccumModel):
            raise TypeError(
                "`PseudoBatchLogger` needs a `keras_accum.AccumModel`, whose "
                "train step computes the pseudo-batch loss; for one update "
                "per batch use `AccumModel(..., accum_steps=1)` or "
                "`AccumModel.from_model(model, accum_steps=1)`. Received: "
                f"model of type {type(model).__name__}."
            )
        super().set_model(model)

    # -- Callback hooks -------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._read = window_log.published_count(self.model)
        # Read the ring before it can wrap: a callback fires after at most
        # `steps_per_execution` steps, each closing at most one window.
        steps = self.model.accum_steps
        # A schedule may shorten windows to one micro-batch.
        shortest = steps if isinstance(steps, int) else 1
        shortest = getattr(steps, "min_steps", shortest)
        per_callback = math.ceil(self.model.steps_per_execution / shortest) + 1
        self._read_every = max(1, (LOG_CAPACITY // 2) // per_callback)
        self._batches_since_read = 0
        if self.log_dir is not None and self._writer is None:
            import tensorflow as tf

            self._writer = tf.summary.create_file_writer(str(self.log_dir))

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = len(self.updates)
        self._skipped_start = self.model.skipped_windows

    def on_train_batch_end(self, batch, logs=None):
        self._batches_since_read += 1
        if self._batches_since_read >= self._read_every:
            self._drain()

    def on_epoch_end(self, epoch, logs=None):
        # Normally done already, first of all callbacks, by the model.
        self._on_window_epoch_end(logs)

    def on_train_end(self, logs=None):
        self._drain()
        if self._writer is not None:
            self._writer.flush()

    # -- Called by AccumModel before every other epoch-end callback -----------

    def _on_window_epoch_end(self, logs):
        self._drain()
        if logs is None:
            return
        losses = np.array(
            [u.loss for u in self.updates[self._epoch_start :]], "float64"
        )
        if losses.size:
            logs["pseudo_batch_loss_mean"] = float(losses.mean())
            logs["pseudo_batch_loss_std"] = float(losses.std())
        else:
            logs["pseudo_batch_loss_mean"] = float("nan")
            logs["pseudo_batch_loss_std"] = float("nan")
        # The epoch's last window has closed by now (`WindowEpochs`);
        # `compile()` restarts the model's count.
        logs["pseudo_batch_skipped_windows"] = max(
            0, self.model.skipped_windows - self._skipped_start
        )
        epoch_updates = self.updates[self._epoch_start :]
        if self.model.micro_batch_size is not None and epoch_updates:
            # Split batches: each batch `fit` is given is a window, its
            # length the micro-batches it split into. The epoch's largest
            # batch is the one `fit` was given (a shorter last batch is
            # the exception, as for `batch_size`).
            full = max(epoch_updates, key=lambda u: u.samples)
            logs["pseudo_batch_window_length"] = full.micro_batches
            logs["pseudo_batch_size"] = float(full.samples)
        else:
            length = self._next_window_length()
            logs["pseudo_batch_window_length"] = length
            # The effective batch of the windows to come: their length
            # times the epoch's mean micro-batch.
            micro = sum(u.micro_batches for u in epoch_updates)
            logs["pseudo_batch_size"] = (
                length * sum(u.samples for u in epoch_updates) / micro
                if micro
                else float("nan")
            )
        if self.noise_scale:
            logs["pseudo_batch_noise_scale"] = self.noise_scale_estimate
            logs["pseudo_batch_critical_batch_size"] = self.critical_batch_size
            logs["pseudo_batch_suggested_accum_steps"] = (
                self.suggested_accum_steps
            )

    def _next_window_length(self) -> int:
        return window_log.next_length(self.model)

    # -- Noise scale ----------------------------------------------------------

    @property
    def noise_scale_estimate(self) -> float:
        """The smoothed B_simple = tr(Σ) / |G|², in samples; NaN if none.

        Under `accum_steps="auto"`, the controller's own (the one its
        window lengths follow)."""
        if not self.noise_scale:
            return float("nan")
        trace, grad_sq = self._ema_trace, self._ema_grad_sq
        averages = None
        if self.model is not None:
            averages = window_log.controller_averages(self.model)
        if averages is not None:
            trace, grad_sq = averages
        if grad_sq <= 0:
            return float("nan")
        # The bias corrections of the two averages cancel in the ratio.
        return trace / grad_sq

    @property
    def critical_batch_size(self) -> float:
        """The batch size B_simple implies, in whole samples; NaN if none."""
        scale = self.noise_scale_estimate
        if not math.isfinite(scale) or scale <= 0:
            return float("nan")
        return float(max(1, round(scale)))

    @property
    def suggested_accum_steps(self) -> float:
        """`accum_steps` reaching the critical batch size; NaN if none."""
        critical = self.critical_batch_size
        if not (math.isfinite(critical) and self._micro_batch > 0):
            return float("nan")
        return float(max(1, math.ceil(critical / self._micro_batch - 1e-9)))

    def _observe_noise(self, item: PseudoBatch) -> None:
        if not (math.isfinite(item.trace) and math.isfinite(item.grad_sq)):
            return
        decay = self.smoothing
        self._ema_trace = decay * self._ema_trace + (1 - decay) * item.trace
        self._ema_grad_sq = (
            decay * self._ema_grad_sq + (1 - decay) * item.grad_sq
        )
        self._micro_batch = item.samples / max(item.micro_batches, 1)

    def _drain(self):
        """Moves the updates published in the graph into `updates`."""
        self._batches_since_read = 0
        count = window_log.published_count(self.model)
        if count < self._read:  # The state was rebuilt by `compile()`.
            self._read = 0
        if count == self._read:
            return
        first = max(self._read, count - LOG_CAPACITY)
        if first > self._read:
            warnings.warn(
                f"PseudoBatchLogger missed {first - self._read} updates.",
                stacklevel=2,
            )
        new = []
        for values in window_log.read_published(self.model, first, count):
            item = PseudoBatch(*values)
            new.append(item)
            if self.noise_scale:
                self._observe_noise(item)
        self.updates.extend(new)
        self._read = count
        if self._writer is not None:
            import tensorflow as tf

            with self._writer.as_default():
                for item in new:
                    for name, value in (
                        ("pseudo_batch_loss", item.loss),
                        ("pseudo_batch_window_length", item.micro_batches),
                        ("pseudo_batch_size", item.samples),
                    ):
                        tf.summary.scalar(name, value, step=item.update)
                if self.noise_scale and math.isfinite(
                    self.noise_scale_estimate
                ):
                    tf.summary.scalar(
                        "pseudo_batch_noise_scale",
                        self.noise_scale_estimate,
                        step=new[-1].update,
                    )
