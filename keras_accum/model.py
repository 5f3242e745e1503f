"""`AccumModel`: gradient accumulation inside `model.fit`.

The public model: construction (functional, subclassing, `from_model`,
`clone_model`), its settings and state, `compile`/`fit`/`evaluate`, and
saving. How it trains is its backend's trainer, one of its bases, chosen as
Keras chooses its own: `_tf_trainer.py`, `_jax_trainer.py` or
`_torch_trainer.py`, over the shared `_trainer.py` and the window rules in
`_window.py`.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import keras

from keras_accum import _settings
from keras_accum._compat import (
    Functional,
    Trainer,
    auto_name,
    called_by_clone_model,
    functional_init_arguments,
    functional_like_constructor,
    make_functional,
    model_being_cloned,
    model_keywords,
)
from keras_accum._files import replaced_whole
from keras_accum._validation import check_keywords
from keras_accum._window_epochs import WindowEpochs, WindowResume
from keras_accum._window_log import read_int
from keras_accum.auto import AutoAccumSteps, AutoMicroBatch

_SUPPORTED_BACKENDS = ("tensorflow", "jax", "torch")


def _require_supported_backend() -> None:
    backend = keras.backend.backend()
    if backend not in _SUPPORTED_BACKENDS:
        raise RuntimeError(
            "keras_accum.AccumModel supports the TensorFlow, JAX and "
            f"PyTorch backends. Received: backend={backend!r}. Select one "
            "with e.g. `export KERAS_BACKEND=tensorflow` before Python "
            'imports Keras, or set `"backend": "tensorflow"` in '
            "~/.keras/keras.json."
        )


# The trainer of each backend, the way Keras picks its trainer base class
# by backend; only the chosen backend's framework is imported.
_require_supported_backend()
if keras.backend.backend() == "tensorflow":
    from keras_accum._tf_trainer import TensorFlowAccumTrainer as _Trainer
elif keras.backend.backend() == "jax":
    from keras_accum._jax_trainer import JaxAccumTrainer as _Trainer
else:
    from keras_accum._torch_trainer import TorchAccumTrainer as _Trainer


def _refusing_unknown_keywords(method):
    """`method` (`from_model`), refusing a keyword it does not take as the
    constructor does: naming it and the nearest it takes."""
    parameters = tuple(inspect.signature(method).parameters)[1:]

    @functools.wraps(method)
    def checked(cls, *args, **kwargs):
        check_keywords(f"AccumModel.{method.__name__}", kwargs, parameters)
        return method(cls, *args, **kwargs)

    return checked


# A dtype's name, or an object Keras reads as one (`np.float32`,
# `tf.bfloat16`, `torch.bfloat16`, `ml_dtypes.bfloat16`).
DTypeLike = str | Any

# An int, a schedule by epoch `{epoch: steps}`, a callable of the update
# count, or `"auto"` / an `AutoAccumSteps`.
AccumSteps = int | dict | Callable | str | AutoAccumSteps


@keras.saving.register_keras_serializable(package="keras_accum")
class AccumModel(_Trainer, keras.Model):
    """A `keras.Model` that accumulates gradients over `accum_steps` batches.

    Each batch that `fit` feeds a step is a *micro-batch*. `AccumModel`
    adds every micro-batch's gradient into non-trainable accumulators and
    applies the optimizer once per *window* (or *pseudo-batch*) of
    `accum_steps` micro-batches, with one conditional inside the compiled
    train step. Training with batch size `B` and `accum_steps=k` equals
    training a plain `keras.Model` with batch size `B * k` on the same data
    in the same order, update by update, to float32 rounding:

    - The accumulated gradient is the gradient of the window's loss, with
      the window reduced the way the loss reduces a batch: for
      `"sum_over_batch_size"` each micro-batch is weighted by its number of
      loss entries (samples, or unmasked timesteps), for
      `"mean_with_sample_weight"` by its sample-weight total, and for
      `"sum"` the micro-batch losses add up. A short last micro-batch
      therefore counts exactly as much as it would inside a large batch.
    - The optimizer runs once per window, so `optimizer.iterations` counts
      updates: learning-rate schedules, Adam's bias correction, weight
      decay, momentum and gradient clipping (`clipnorm`, `clipvalue`,
      `global_clipnorm`) all see the window's gradient, as they would see
      a large batch's.
    - Regularization losses from weight regularizers count once per
      window, as in a large batch.

    Epoch ends: with `partial_window="apply"` (the default) a window still
    open when an epoch ends is applied on the epoch's last step, normalized
    over what it holds, before validation and epoch-end callbacks, exactly
    as a large-batch epoch ends with a short batch. When the number of
    steps per epoch is unknown (a dataset of unknown cardinality and no
    `steps_per_epoch`), the step cannot know it is the last one; the open
    window is then applied right after the epoch's last step, still before
    validation and epoch-end callbacks, by one extra call. With
    `partial_window="carry"` windows ignore epoch boundaries and a window
    open at the end of an epoch, or of `fit`, continues with the next
    batches; `apply_partial_window()` applies it on demand.

    The `loss` and metrics in `fit`'s logs are what a plain model reports
    on the same micro-batches. `evaluate` and `predict` are Keras's own,
    except that with `micro_batch_size` they split each batch too (the
    loss and outputs are the batch's, in its order).

    The class is the same on Keras's TensorFlow, JAX and PyTorch backends
    (chosen by `KERAS_BACKEND`), with the same guarantees; a model saved on
    one loads and resumes on another, an open window included.

    `AccumModel` is used like `keras.Model`, three ways:

    - functional: `AccumModel(inputs, outputs, accum_steps=4)`;
    - subclassing: a subclass whose `__init__` calls
      `super().__init__(accum_steps=4)` and defines `call`;
    - an existing built model (e.g. a pretrained one):
      `AccumModel.from_model(model, accum_steps=4)`.

    A subclass may also be called functionally, as with `keras.Model`:
    `CustomModel(inputs, outputs, accum_steps=4)` for a subclass that only
    overrides `train_step` (calling `super().train_step(data)`), or a
    subclass whose `__init__` builds its graph and calls
    `super().__init__(inputs, outputs, accum_steps=4)` (the KerasHub
    style). Keras makes such a subclass functional by rewriting its bases;
    only the subclass's own bases are rewritten, never `AccumModel`'s, so
    other models in the process are unaffected.

    `keras.models.clone_model(model)` returns a model of the same class
    with the same `accum_steps` and `partial_window`, and, as for any model
    it clones, fresh weights: the window starts empty (an open window of
    `model` is not copied). A subclass whose constructor does not take
    `(inputs, outputs)` (the KerasHub style) cannot be rebuilt by
    `clone_model`, which would return a plain `Functional` that does not
    accumulate; it raises a `TypeError` instead: clone it with
    `type(model).from_config(model.get_config())`.

    Accumulation schedules: `accum_steps` may also be a dict mapping
    epochs to window lengths, e.g. `{0: 1, 3: 4, 6: 16}` (epoch 0 must be
    given; each entry holds until the next), or a callable taking the
    update count (`optimizer.iterations`, as a scalar integer tensor) and
    returning the window length, traced into the step like a learning-rate
    schedule (write it with `keras.ops`, e.g.
    `lambda u: keras.ops.where(u < 100, 1, 4)`). A window's length is fixed
    when it starts; the length is a variable, so a schedule never retraces
    the step, and the equivalence with a plain model holds inside each
    phase (a plain model trained with the phase's large batch). Schedules
    are saved with the model (a callable as Keras serializes functions: a
    registered function, or a lambda loaded with `safe_mode=False`).
    A callable must return an integer >= 1: it is checked eagerly at the
    start of `fit`, and a later value below 1 fails the step that reads it
    with an error naming `accum_steps` and the value (a `ValueError` in an
    eager step: PyTorch, `run_eagerly=True`, JAX with `jit_compile=False`;
    TensorFlow's `InvalidArgumentError` in a graph step). A step compiled
    by XLA (`jit_compile=True` on TensorFlow or JAX, the default on JAX and
    on TensorFlow with a GPU) cannot raise there: such a value is clamped
    to 1.

    Automatic windows: `accum_steps="auto"` (or an `AutoAccumSteps` to
    configure it) lets the window grow with the critical batch size,
    measured in the step from each window's micro-batches; each window
    still equals a plain model trained on its samples as one batch. See
    `AutoAccumSteps` and the guide "Choosing the window automatically".

    A window whose gradient is not finite (NaN or inf) applies no update
    and is counted in `skipped_windows`; an epoch that skipped windows ends
    with a `UserWarning` (not under a `LossScaleOptimizer`, which skips
    such a step in plain Keras too). The epoch logs hold the same keys as
    `keras.Model`'s; `PseudoBatchLogger` adds the per-epoch count.

    Args:
        accum_steps: Integer from 1 to 2**31 - 1 (the window counts in
            int32), a dict `{epoch: steps}`, a callable of the update
            count, or `"auto"` / an `AutoAccumSteps`. Micro-batches per
            optimizer update. Defaults to `1` (one update per batch, as
            `keras.Model`).
        partial_window: `"apply"` or `"carry"`. What happens to a window
            still open when an epoch ends: `"apply"` applies it then,
            `"carry"` continues it into the next epoch. Defaults to
            `"apply"`.
        micro_batch_size: None, an integer from 1 to 2**31 - 1, or
            `"auto"` / an `AutoMicroBatch`. With it, each batch `fit` is
            given is one update, split inside the train step into
            micro-batches of at most this many samples (`evaluate` and
            `predict` split the same way); `fit` then equals
            `keras.Model.fit` at that batch. The size is per device: each
            replica or device splits its own part of the batch.
            `"auto"` picks the largest
            size whose step fits the device's memory (see
            `AutoMicroBatch`), for the train, test (`evaluate`,
            validation) and predict steps each on its own. With either, a
            train step that runs out of memory (TensorFlow's
            `ResourceExhaustedError`, JAX's `RESOURCE_EXHAUSTED`,
            `torch.OutOfMemoryError`) is undone and its batch redone at
            half the micro-batch, with a warning naming both sizes: the
            update is the same, only slower. The halved size holds for
            every later train batch until `compile()` or a new
            `micro_batch_size` (this attribute still reads the setting;
            `micro_batch_choices` records it); `evaluate` and `predict`
            keep theirs. Not with an `accum_steps` other than 1. See the
            guide "Batches that fit".
            Defaults to `None` (each batch a micro-batch).
        accumulator_dtype: None, `"float32"` or `"bfloat16"` (or a dtype
            object `keras.backend.standardize_dtype` reads as one of them,
            e.g. `np.float32`, `tf.bfloat16`, `torch.bfloat16`). The dtype the
            gradients are summed in. None (or `"float32"`) keeps float32
            accumulators: exact, whatever the weights' dtype.
            `"bfloat16"` halves their memory for every weight of at least
            16384 elements (`2**14`; smaller ones, biases and
            normalization scales, stay float32): each micro-batch's
            gradient is added in float32 and the sum stochastically
            rounded to bfloat16: unbiased, but no longer exact (each
            addition's error is random with mean zero; over a window of
            `k` micro-batches about 2**-9 * sqrt(k) of the sum's
            magnitude). The close divides in float32. See the guide
            "Low-precision models". Defaults to `None`.
        whole_batch_loss: Boolean. Whether the loss (and the compiled
            metrics) see the whole batch at once rather than each
            micro-batch: for losses that compare the samples of a batch
            (contrastive losses, in-batch negatives). Each piece of
            `micro_batch_size` rows runs forward twice, its random draws
            replayed: once for the batch's outputs, once to carry the
            loss's gradient back; `evaluate` computes the loss on the
            whole batch too. Only with `micro_batch_size` (an int, or
            `"auto"`, whose search measures this step: the batch's
            outputs and their gradient included); on one device, and
            under JAX's `DataParallel` and TensorFlow's
            `MirroredStrategy`, the loss seeing the global batch. Loss
            scaling scales the loss before its output gradient is taken.
            Layers that mix the samples of a batch (a training
            `BatchNormalization`) and activity regularizers are refused.
            Defaults to `False`.
        *args: Passed to `keras.Model`, e.g. `inputs` and `outputs`.
        **kwargs: Passed to `keras.Model`: those it takes (`name`,
            `trainable`, `dtype`, ...); any other is refused.

    Raises:
        TypeError: If `accum_steps` is not an integer (a bool included), a
            dict, a callable, `"auto"` or an `AutoAccumSteps`,
            `micro_batch_size` is neither None, an integer, `"auto"` nor
            an `AutoMicroBatch`, or `accumulator_dtype` is neither None,
            a string nor a dtype.
        ValueError: If a keyword argument is neither one of the above
            nor one `keras.Model` takes (the message names the nearest:
            `accum_step=8` would otherwise be ignored by a functional
            model), or `accum_steps < 1` or `accum_steps >= 2**31`,
            `micro_batch_size` is out of range or set beside an
            `accum_steps` other than 1, `accumulator_dtype` is a string
            other than `"float32"` and `"bfloat16"`, an epoch schedule has
            no epoch 0
            or a bad entry, `partial_window` is unknown, or
            (at `compile`) the optimizer has its own
            `gradient_accumulation_steps`.
        RuntimeError: At `import keras_accum`, if Keras runs on a backend
            other than TensorFlow, JAX or PyTorch.
        NotImplementedError: On JAX with Flax NNX mode enabled.

    Example:

    ```python
    inputs = keras.Input(shape=(784,))
    outputs = keras.layers.Dense(10, activation="softmax")(inputs)
    model = keras_accum.AccumModel(inputs, outputs, accum_steps=8)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    # One update per 8 batches of 32: large-batch training at batch 256.
    model.fit(x, y, batch_size=32, epochs=3)
    ```
    """

    def __new__(cls, *args, **kwargs):
        # Keras makes `Model(inputs, outputs)` a `Functional` by rewriting the
        # subclass's bases in place; that would turn every later subclass
        # of `AccumModel` functional too. A fixed functional subclass
        # avoids it.
        if cls is AccumModel and functional_init_arguments(args, kwargs):
            return keras.Model.__new__(_FunctionalAccumModel)
        return super().__new__(cls, *args, **kwargs)

    def __init__(
        self,
        *args: Any,
        accum_steps: AccumSteps = 1,
        partial_window: str = "apply",
        micro_batch_size: int | str | AutoMicroBatch | None = None,
        accumulator_dtype: DTypeLike | None = None,
        whole_batch_loss: bool = False,
        **kwargs: Any,
    ) -> None:
        # Before Keras sees them: a functional model ignores keywords it
        # does not know, so a misspelt setting would train without it.
        check_keywords(
            _shown_name(type(self)),
            kwargs,
            _settings.PUBLIC_NAMES,
            model_keywords(),
        )
        given = _settings.given(locals())
        source = model_being_cloned()
        if isinstance(source, AccumModel):
            # `clone_model` passes only `(inputs, outputs, name)`: without
            # this the clone would train with `accum_steps=1`.
            given = _settings.given(source._setting_values())
        settings = _settings.checked(given)
        if not isinstance(self, Functional) and functional_init_arguments(
            args, kwargs
        ):
            # A user subclass called with `(inputs, outputs)`, e.g. one that
            # builds its graph in `__init__`: made functional here, so that
            # `keras.Model.__init__` never rewrites `AccumModel`'s bases.
            make_functional(type(self), AccumModel, _FunctionalAccumModel)
        if isinstance(self, Functional):
            if (
                kwargs.get("name") is None
                and type(self) is _FunctionalAccumModel
            ):
                # Not the private class's name: "accum_model", "accum_model_1".
                kwargs["name"] = auto_name("AccumModel")
            Trainer.__init__(self)
            Functional.__init__(self, *args, **kwargs)
        else:
            super().__init__(*args, **kwargs)
        self._configure(_settings.with_defaults(settings))
        self._reset_window_state()

    # -- Public surface -------------------------------------------------------

    @classmethod
    @_refusing_unknown_keywords
    def from_model(
        cls,
        model: keras.Model,
        accum_steps: AccumSteps = 1,
        partial_window: str = "apply",
        micro_batch_size: int | str | AutoMicroBatch | None = None,
        accumulator_dtype: DTypeLike | None = None,
        whole_batch_loss: bool = False,
    ) -> AccumModel:
        """Returns an `AccumModel` computing what `model` computes.

        The result shares `model`'s layers and weights (nothing is copied)
        and has the same weights in the same order, so `get_weights()` of
        either loads into the other. A `Sequential` or functional model is
        rebuilt from its graph; any other model, including a functional
        subclass that saves its own config (a KerasHub task), is wrapped
        whole and saved with its own config.

        Only the computation carries over: the result is uncompiled (compile
        it before `fit`; a KerasHub task's compile defaults are not kept),
        and `model`'s own methods and attributes, such as a KerasHub task's
        `preprocessor` and `generate()`, stay on `model`. Use `model` for
        them: it holds the trained weights.

        Args:
            model: A built `keras.Model`: `Sequential`, functional or
                subclassed (e.g. a pretrained model).
            accum_steps: Integer >= 1, or a schedule, as for `AccumModel`.
                Micro-batches per optimizer update. Defaults to `1`.
            partial_window: `"apply"` or `"carry"`, as for `AccumModel`.
                Defaults to `"apply"`.
            micro_batch_size: None, an integer >= 1, `"auto"` or an
                `AutoMicroBatch`, as for `AccumModel`. Defaults to `None`.
            accumulator_dtype: None, `"float32"` or `"bfloat16"`, as for
                `AccumModel`. Defaults to `None`.
            whole_batch_loss: Boolean, as for `AccumModel`. Defaults to
                `False`.

        Returns:
            An `AccumModel` (uncompiled) computing what `model` computes.

        Raises:
            TypeError: If `model` is not a `keras.Model` or `accum_steps` is
                not an integer (a bool included), a dict or a callable.
            ValueError: If `model` is not built, `accum_steps` or
                `partial_window` is out of range, or a keyword argument is
                not one of the above (the message names the nearest).

        Example:

        ```python
        base = keras.Sequential(
            [
                keras.Input((32, 32, 3)),
                keras.layers.Conv2D(16, 3, activation="relu"),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(10),
            ]
        )
        model = keras_accum.AccumModel.from_model(base, accum_steps=4)
        ```
        """
        settings = _settings.given(locals())
        _settings.checked(settings)
        if not isinstance(model, keras.Model):
            raise TypeError(
                "`model` must be a `keras.Model`. "
                f"Received: model={model!r} (of type {type(model).__name__})"
            )
        if isinstance(model, Functional) and not _serializes_itself(model):
            # Sequential and functional: rebuilt from the same graph.
            try:
                inputs, outputs = model.inputs, model.outputs
            except (AttributeError, ValueError):
                inputs = outputs = None
            if inputs is not None and outputs is not None:
                return AccumModel(inputs, outputs, name=model.name, **settings)
        if not model.built:
            raise ValueError(
                "`model` must be built (have its weights) before it is "
                "converted; call it on a batch of data or give its first "
                f"layer an input shape. Received: model={model.name!r}, "
                "which is not built."
            )
        return _WrappedAccumModel(model, name=f"{model.name}_accum", **settings)

    @property
    def accum_steps(self) -> AccumSteps:
        """Micro-batches per update: an int, or the schedule as given.

        Setting it applies from the next window. Changing an int or an
        epoch schedule never retraces the step; setting or replacing a
        callable schedule (traced into the step) retraces it once.
        """
        return self._accum_steps

    @accum_steps.setter
    def accum_steps(self, value: AccumSteps) -> None:
        self._change_settings({"accum_steps": value})

    @property
    def window_length(self) -> int:
        """Micro-batches the open window (or else the last one) closes at."""
        if self._window is None:
            return self._steps_for_now() or self._first_length()
        return read_int(self._window.counters.window_length)

    @property
    def micro_batch_size(self) -> int | AutoMicroBatch | None:
        """The size each batch `fit` is given is split into, or None.

        With it, each batch is one update (one window), split inside the
        train step into micro-batches of at most this many samples; an
        `AutoMicroBatch` where it is chosen (`"auto"`). Setting it applies
        from the next step (and retraces the step)."""
        return self._micro_batch_size

    @micro_batch_size.setter
    def micro_batch_size(
        self, value: int | str | AutoMicroBatch | None
    ) -> None:
        self._change_settings({"micro_batch_size": value})

    @property
    def accumulator_dtype(self) -> str | None:
        """The dtype the gradients are summed in: None (float32) or
        `"bfloat16"` (weights of at least 16384 elements; see
        `AccumModel`).

        Set it to None, `"float32"` or `"bfloat16"`, or a dtype object
        `keras.backend.standardize_dtype` reads as one of them
        (`np.float32`, `tf.bfloat16`, `torch.bfloat16`, `jnp.bfloat16`);
        it keeps the name. It applies from the next window: where the
        accumulators exist (since a `fit`, `evaluate` or `load_weights`)
        they are made anew in the new dtype, and the window's counters
        (epoch, `skipped_windows`, `"auto"`'s controller, the log) are
        kept. Between windows only: a window still open
        (`mini_step > 0`) is refused (apply it first with
        `apply_partial_window()`)."""
        return self._accumulator_dtype

    @accumulator_dtype.setter
    def accumulator_dtype(self, value: Any) -> None:
        self._change_settings({"accumulator_dtype": value})

    @property
    def whole_batch_loss(self) -> bool:
        """Whether the loss sees the whole batch (with `micro_batch_size`).

        Setting it applies from the next step (and retraces the step);
        refused while a window is open."""
        return self._whole_batch_loss

    @whole_batch_loss.setter
    def whole_batch_loss(self, value: bool) -> None:
        self._change_settings({"whole_batch_loss": value})

    @property
    def micro_batch_choices(self) -> list[dict]:
        """The micro-batch sizes chosen since `compile`, oldest first.

        One dict per choice: `"step"` (`"train"`, `"test"` or
        `"predict"`), `"batch_size"`, `"micro_batch_size"`, `"reason"`
        (`"auto"`, or `"out of memory"` for a shrink after an
        out-of-memory error), `"predicted_peak"` and `"budget"` (bytes;
        None where not predicted), `"measured_by"` (the figures the peak
        comes from) and `"probes"` (the sizes measured). Empty with an int
        `micro_batch_size` that never ran out of memory."""
        return [dict(c) for c in self._life.split.choices]

    @property
    def partial_window(self) -> str:
        """`"apply"` or `"carry"`: what happens to a window at epoch end."""
        return self._partial_window

    @partial_window.setter
    def partial_window(self, value: str) -> None:
        self._change_settings({"partial_window": value})

    @property
    def mini_step(self) -> int:
        """Micro-batches in the window now open; 0 right after an update."""
        if self._window is None:
            return 0
        return read_int(self._window.counters.mini_step)

    @property
    def skipped_windows(self) -> int:
        """Windows not applied because their gradient was not finite.

        Counted over the model's life (from its last `compile()`), like
        `optimizer.iterations`. Not in the epoch logs, which stay those of
        `keras.Model`: an epoch that skips windows warns instead, and
        `PseudoBatchLogger` logs each epoch's count as
        `pseudo_batch_skipped_windows`.
        """
        if self._window is None:
            return 0
        return read_int(self._window.counters.skipped_windows)

    @property
    def accumulators(self) -> list:
        """The gradient accumulators, one per trainable weight, same order.

        Empty until the model is first trained. Each holds the open
        window's gradient sum (weighted as described above), not yet
        divided. Between windows (`mini_step == 0`) they still hold what
        the last window left, unused (its sum, or, where the update divides
        it in place to save memory, the gradient the optimizer applied;
        see the backends guide): a window's first
        micro-batch overwrites them, which costs less memory than clearing
        them after an update. On JAX under a `keras.distribution` whose
        batch axis spans several devices, each has a leading axis of those
        devices, each holding its own partial sum: the window's sum is
        their sum over it (saved files hold that sum).
        """
        if self._window is None:
            return []
        return list(self._window.acc_grads)

    def apply_partial_window(self) -> bool:
        """Applies the open window now, if it holds any micro-batch.

        The window is normalized over what it holds, as a short last batch
        is. Useful with `partial_window="carry"`, e.g. at the end of
        training.

        Returns:
            Whether the window held micro-batches and was closed (a window
            whose gradient is not finite is closed without an update and
            counted in `skipped_windows`).

        Example:

        ```python
        model.fit(x, y, batch_size=8, epochs=3)  # partial_window="carry"
        model.apply_partial_window()  # The leftover micro-batches.
        ```
        """
        if self._window is None or self.mini_step == 0:
            return False
        self._flush()
        return True

    # -- Compile, fit, evaluate -----------------------------------------------

    def compile(self, *args: Any, **kwargs: Any) -> None:
        super().compile(*args, **kwargs)
        optimizer = getattr(self.optimizer, "inner_optimizer", self.optimizer)
        steps = getattr(optimizer, "gradient_accumulation_steps", None)
        if steps:
            raise ValueError(
                "The optimizer passed to `AccumModel.compile()` accumulates "
                "gradients itself, which would accumulate them twice. Use "
                "`accum_steps` on the model only. Received: "
                f"gradient_accumulation_steps={steps} on optimizer "
                f"{optimizer.name!r}."
            )
        if self._window is not None and self.mini_step > 0:
            warnings.warn(
                f"`compile()` discards an open window of {self.mini_step} "
                "micro-batches that was never applied; call "
                "`apply_partial_window()` before recompiling to keep it.",
                stacklevel=2,
            )
        # The optimizer, the trainable set or the loss may have changed.
        self._reset_window_state()

    def compile_from_config(self, config: dict) -> None:
        # Keras skips compiling a loaded model whose class overrides
        # `compile`; this override takes Keras's arguments unchanged.
        if type(self).compile is not AccumModel.compile:
            return super().compile_from_config(config)
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built:
            self.optimizer.build(self.trainable_variables)
            # Before the weights load, so that an open window loads too.
            self._ensure_window()

    def save(self, filepath, overwrite: bool = True, **kwargs: Any) -> None:
        if (
            str(filepath).endswith((".h5", ".hdf5"))
            and self._window is not None
            and self.mini_step > 0
        ):
            # The legacy format saves the layers' weights only.
            warnings.warn(
                f"Saving to the legacy H5 format ({str(filepath)!r}) keeps "
                "the model, its weights, `accum_steps` and `partial_window`, "
                f"but not the open accumulation window ({self.mini_step} "
                "micro-batches not yet applied): a model loaded from it "
                "starts a new window. Save to a `.keras` file to keep the "
                "window, or call `apply_partial_window()` before saving.",
                stacklevel=2,
            )
        # Whole or not at all (`_files.py`): a process killed during the
        # write leaves the previous file, not a torn one.
        if kwargs.get("zipped") is False:
            return super().save(filepath, overwrite=overwrite, **kwargs)
        with replaced_whole(filepath, ".keras", overwrite) as path:
            return super().save(path, overwrite=overwrite, **kwargs)

    def save_weights(
        self, filepath, overwrite: bool = True, **kwargs: Any
    ) -> None:
        # As `save`; `BackupAndRestore` keeps its only backup this way.
        if kwargs.get("max_shard_size") is not None:
            # Several files, written in place as Keras writes them.
            return super().save_weights(filepath, overwrite, **kwargs)
        with replaced_whole(filepath, ".weights.h5", overwrite) as path:
            return super().save_weights(path, overwrite, **kwargs)

    def load_weights(self, filepath, *args: Any, **kwargs: Any) -> None:
        skip_mismatch = kwargs.get("skip_mismatch", args[0] if args else False)
        if (
            getattr(self, "optimizer", None) is not None
            and self.built
            and (skip_mismatch or not self._loads_as_plain_keras(filepath))
        ):
            # The accumulators must exist to receive a saved open window.
            self._ensure_window()
        if self._window is not None and not skip_mismatch:
            # Keras assigns the layers' weights before the optimizer's and
            # the window's: a bad optimizer state or window must fail
            # before either. (With `skip_mismatch`, Keras warns and leaves
            # them as they are.)
            self._check_saved_optimizer(filepath)
            self._window.check_file(filepath)
        try:
            return super().load_weights(filepath, *args, **kwargs)
        finally:
            if self._window is not None:
                # Only for this load, even one Keras gave up on.
                self._window.end_load()

    def fit(self, *args: Any, **kwargs: Any):
        arguments = inspect.signature(keras.Model.fit).bind(
            self, *args, **kwargs
        )
        given = arguments.arguments.get("callbacks")
        listed = (
            given.callbacks
            if isinstance(given, keras.callbacks.CallbackList)
            else list(given or [])
        )
        # Estimated in the step only while a callback asks for it, as
        # often as the most frequent asker wants.
        self._set_noise_scale_every(
            min(
                (
                    cb.noise_scale_every
                    for cb in listed
                    if getattr(cb, "noise_scale", False) is True
                ),
                default=0,
            )
        )
        epoch_callback = WindowEpochs(self)
        epoch_callback.set_loggers(listed)
        # First, so that epoch-end callbacks see the applied window; last,
        # what reads the backups the others restored.
        ours = [epoch_callback, *listed, WindowResume(self, listed)]
        if isinstance(given, keras.callbacks.CallbackList):
            # A list of the caller's own, not the caller's list changed.
            ours = keras.callbacks.CallbackList(
                ours, model=self, **given.params
            )
        arguments.arguments["callbacks"] = ours
        return super().fit(*arguments.args[1:], **arguments.kwargs)

    def evaluate(self, *args: Any, **kwargs: Any):
        if kwargs.get("_use_cached_eval_dataset") and (
            self._partial_window == "apply"
        ):
            # `fit`'s validation: an epoch of unknown length may have left
            # its last window open.
            self.apply_partial_window()
        return super().evaluate(*args, **kwargs)

    def get_config(self) -> dict:
        return {**super().get_config(), **self._accumulation_config()}

    def _accumulation_config(self) -> dict:
        """The settings' config entries (`accum_steps` and the rest)."""
        return _settings.to_config(self._setting_values())

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        settings = _settings.from_config(config, custom_objects)
        # Keras revives functional and subclassed models differently; both
        # paths get a model built with the defaults, set here after.
        model = super().from_config(config, custom_objects=custom_objects)
        model._change_settings(settings)
        return model


@keras.saving.register_keras_serializable(package="keras_accum")
class _FunctionalAccumModel(AccumModel, Functional):
    """What `AccumModel(inputs, outputs)` builds: functional and accumulating.

    Not instantiated directly; `isinstance(model, AccumModel)` holds. A user
    subclass of `AccumModel` called with `(inputs, outputs)` gets it as its
    base in place of `AccumModel`.
    """

    def _run_through_graph(self, *args, **kwargs):
        # Runs on every forward pass of a functional model; only a class
        # whose constructor `clone_model` cannot call checks its caller.
        cls = type(self)
        if not _takes_inputs_and_outputs(cls) and called_by_clone_model():
            # Keras would go on to return a plain `Functional`, which trains
            # without accumulation: fail rather than diverge silently.
            raise TypeError(
                f"`keras.models.clone_model` cannot rebuild a "
                f"`{cls.__name__}`: its constructor does not take "
                "`(inputs, outputs, name)`, so Keras would return a plain "
                "`Functional` model, which does not accumulate gradients. "
                "Clone it from its config instead: "
                f"`{cls.__name__}.from_config(model.get_config())` (fresh "
                "weights, as `clone_model` gives)."
            )
        return super()._run_through_graph(*args, **kwargs)


def _shown_name(cls) -> str:
    """`cls`'s name in messages: `AccumModel` for the package's own
    classes (`_FunctionalAccumModel`, `_WrappedAccumModel`)."""
    return "AccumModel" if cls.__module__ == __name__ else cls.__name__


@functools.cache
def _takes_inputs_and_outputs(cls) -> bool:
    return functional_like_constructor(cls)


def _serializes_itself(model) -> bool:
    """Whether a functional `model` is of a class with its own config.

    Such a class (a KerasHub task, say) builds its graph in `__init__` and
    saves its constructor's arguments, not the graph. `from_model` wraps
    it rather than rebuilding the graph: the class, its config and its
    own loading survive, where a rebuilt graph may not load again (a layer
    that a nested model shares with the outer graph, such as GPT-2's tied
    embedding, comes back as two layers in Keras 3.15).
    """
    get_config = getattr(type(model), "get_config", None)
    return get_config not in (
        Functional.get_config,
        keras.Sequential.get_config,
    )


@keras.saving.register_keras_serializable(package="keras_accum")
class _WrappedAccumModel(AccumModel):
    """An `AccumModel` around a built model (`from_model`): a subclassed
    model, or a functional one whose class saves its own config."""

    def __init__(self, inner_model, **kwargs):
        super().__init__(**kwargs)
        self.inner_model = inner_model
        self.built = inner_model.built

    def call(self, inputs, training=None):
        return self.inner_model(inputs, training=training)

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "inner_model": keras.saving.serialize_keras_object(
                self.inner_model
            ),
            **self._accumulation_config(),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_model"), custom_objects=custom_objects
        )
        settings = _settings.from_config(config, custom_objects)
        return cls(inner, **config, **settings)


# What files call the classes. `.keras` files look a class up by its
# registered name ("keras_accum>_FunctionalAccumModel") and show its
# `__name__` as `class_name`. Loading without `import keras_accum` then fails
# with Keras's "Could not locate class 'keras_accum.AccumModel' ... make sure
# [custom classes] are all imported", which names the package to import.
# The legacy H5 format looks classes up by `class_name` alone, hence the
# entries by those names.
_FunctionalAccumModel.__name__ = "keras_accum.AccumModel"
_WrappedAccumModel.__name__ = "keras_accum.AccumModel.from_model"
for _cls in (_FunctionalAccumModel, _WrappedAccumModel):
    keras.saving.get_custom_objects().setdefault(_cls.__name__, _cls)
del _cls
