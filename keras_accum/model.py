"""`AccumModel`: gradient accumulation inside `model.fit`."""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable
from typing import Any

import keras
from keras import ops
from keras.src import tree
from keras.src.backend.common.masking import get_keras_mask
from keras.src.losses import loss as loss_module
from keras.src.models import cloning
from keras.src.models.functional import Functional, functional_like_constructor
from keras.src.trainers import trainer as trainer_module
from keras.src.trainers.data_adapters import data_adapter_utils
from keras.src.utils.naming import auto_name

from keras_accum import _backend_support, _window_rules
from keras_accum._validation import (
    check_accum_schedule,
    check_partial_window,
    steps_for_epoch,
)
from keras_accum._window_log import MINIMIZED_LOG_KEYS, read_int
from keras_accum.layers import AccumBatchNormalization

_BACKEND = keras.backend.backend()
_SUPPORTED_BACKENDS = ("tensorflow", "jax", "torch")
# The step of each backend, the way Keras picks its trainer base class by
# backend; only the chosen backend's framework is imported.
if _BACKEND == "tensorflow":
    import tensorflow as tf

    _BACKEND_BASES = ()
elif _BACKEND == "jax":
    from keras_accum._jax_trainer import JaxAccumTrainer

    _BACKEND_BASES = (JaxAccumTrainer,)
elif _BACKEND == "torch":
    from keras_accum._torch_trainer import TorchAccumTrainer

    _BACKEND_BASES = (TorchAccumTrainer,)
else:
    _BACKEND_BASES = ()
# The dtype of the window's counters.
_COUNT_DTYPE = (
    "int64" if _BACKEND == "tensorflow" else _window_rules.COUNT_DTYPE
)

# An int, a schedule by epoch `{epoch: steps}`, or a callable of the update
# count.
AccumSteps = int | dict | Callable

_SUM_REDUCTIONS = ("sum", "none", None)


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


def _functional_init_arguments(args, kwargs) -> bool:
    # Keras's own test for "called like `Model(inputs, outputs)`".
    return (
        len(args) == 2
        or (len(args) == 1 and "outputs" in kwargs)
        or ("inputs" in kwargs and "outputs" in kwargs)
    )


def _inject_functional_accum_class(cls):
    """Makes the user's subclass `cls` functional, as Keras would.

    Keras's `inject_functional_model_class` rewrites `__bases__` up to
    `keras.Model`, which here would rewrite `AccumModel` itself, for the
    whole process. This stops one step earlier: `AccumModel` in the user's
    class chain becomes `_FunctionalAccumModel`, and neither class is
    touched.
    """
    if cls is AccumModel:
        return _FunctionalAccumModel
    if not issubclass(cls, AccumModel) or issubclass(cls, Functional):
        # Mixins and chains already functional stay as they are.
        return cls
    cls.__bases__ = tuple(
        _inject_functional_accum_class(base) for base in cls.__bases__
    )
    return cls


# The code of Keras 3.10-3.15's `clone_model` helper that rebuilds a
# functional model (None if a Keras release renames it: the clone tests
# then fail rather than settings dropping silently).
_CLONE_CODE = getattr(
    getattr(cloning, "_clone_functional_model", None), "__code__", None
)


def _cloning_caller(frame) -> bool:
    # `keras.models.clone_model` rebuilds a functional model inside
    # `_clone_functional_model`, as `model.__class__(inputs, outputs,
    # name=...)`: nothing in that call says what the source model was.
    return frame is not None and frame.f_code is _CLONE_CODE


def _clone_source(kwargs):
    """The `AccumModel` that `clone_model` is cloning, when it is
    `clone_model` that calls `AccumModel.__new__`, which calls this."""
    if "accum_steps" in kwargs or "partial_window" in kwargs:
        return None
    frame = sys._getframe(2)
    if not _cloning_caller(frame):
        return None
    source = frame.f_locals.get("model")
    return source if isinstance(source, AccumModel) else None


@keras.saving.register_keras_serializable(package="keras_accum")
class AccumModel(*_BACKEND_BASES, keras.Model):
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
    open when an epoch ends is applied on the epoch's last step, normalised
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
    on the same micro-batches. `evaluate` and `predict` are unchanged.

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

    A window whose gradient is not finite (NaN or inf) applies no update
    and is counted in `skipped_windows`; an epoch that skipped windows ends
    with a `UserWarning` (not under a `LossScaleOptimizer`, which skips
    such a step in plain Keras too). The epoch logs hold the same keys as
    `keras.Model`'s; `PseudoBatchLogger` adds the per-epoch count.

    Args:
        accum_steps: Integer >= 1, a dict `{epoch: steps}` or a callable
            of the update count. Micro-batches per optimizer update.
            Defaults to `1` (one update per batch, as `keras.Model`).
        partial_window: `"apply"` or `"carry"`. What happens to a window
            still open when an epoch ends: `"apply"` applies it then,
            `"carry"` continues it into the next epoch. Defaults to
            `"apply"`.
        *args: Passed to `keras.Model`, e.g. `inputs` and `outputs`.
        **kwargs: Passed to `keras.Model`, e.g. `name`.

    Raises:
        TypeError: If `accum_steps` is not an integer (a bool included), a
            dict or a callable.
        ValueError: If `accum_steps < 1`, an epoch schedule has no epoch 0
            or a bad entry, `partial_window` is unknown, or
            (at `compile`) the optimizer has its own
            `gradient_accumulation_steps`.
        RuntimeError: If Keras runs on a backend other than TensorFlow,
            JAX or PyTorch.
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
        if cls is AccumModel and _functional_init_arguments(args, kwargs):
            return keras.Model.__new__(_FunctionalAccumModel)
        instance = super().__new__(cls, *args, **kwargs)
        source = _clone_source(kwargs)
        if source is not None:
            # `clone_model` passes only `(inputs, outputs, name)`; without
            # this the clone would train with `accum_steps=1`. Read (and
            # dropped) by `__init__`; Keras's attribute tracking is not
            # needed for it.
            object.__setattr__(
                instance,
                "_cloned_settings",
                (source._accum_steps, source._partial_window),
            )
        return instance

    def __init__(
        self,
        *args: Any,
        accum_steps: AccumSteps = 1,
        partial_window: str = "apply",
        **kwargs: Any,
    ) -> None:
        _require_supported_backend()
        cloned = self.__dict__.pop("_cloned_settings", None)
        if cloned is not None:
            accum_steps, partial_window = cloned
        accum_steps = check_accum_schedule(accum_steps)
        partial_window = check_partial_window(partial_window)
        if not isinstance(self, Functional) and _functional_init_arguments(
            args, kwargs
        ):
            # A user subclass called with `(inputs, outputs)`, e.g. one that
            # builds its graph in `__init__`: made functional here, so that
            # `keras.Model.__init__` never rewrites `AccumModel`'s bases.
            _inject_functional_accum_class(type(self))
        if isinstance(self, Functional):
            if (
                kwargs.get("name") is None
                and type(self) is _FunctionalAccumModel
            ):
                # Not the private class's name: "accum_model", "accum_model_1".
                kwargs["name"] = auto_name("AccumModel")
            trainer_module.Trainer.__init__(self)
            Functional.__init__(self, *args, **kwargs)
        else:
            super().__init__(*args, **kwargs)
        self._accum_steps = accum_steps
        self._partial_window = partial_window
        self._noise_scale_every = 0
        self._epoch = 0
        # Windows skipped in the last finished epoch (`_WindowEpochs`).
        self._epoch_skipped_windows = 0
        self._reset_window_state()

    def _reset_window_state(self):
        self._window = None
        self._window_refs = None
        self._flush_function = None
        # Fixed when the train step is traced; the flush reuses it.
        self._window_none_grads = None
        self._steps_per_epoch = 0

    # -- Public surface ------------------------------------------------------

    @classmethod
    def from_model(
        cls,
        model: keras.Model,
        accum_steps: AccumSteps,
        partial_window: str = "apply",
    ) -> AccumModel:
        """Returns an `AccumModel` computing what `model` computes.

        The result shares `model`'s layers and weights (nothing is copied)
        and has the same weights in the same order, so `get_weights()` of
        either loads into the other. Compile the result before `fit`.

        Args:
            model: A built `keras.Model`: `Sequential`, functional or
                subclassed (e.g. a pretrained model).
            accum_steps: Integer >= 1, or a schedule, as for `AccumModel`.
                Micro-batches per optimizer update.
            partial_window: `"apply"` or `"carry"`, as for `AccumModel`.
                Defaults to `"apply"`.

        Returns:
            An `AccumModel` (uncompiled) computing what `model` computes.

        Raises:
            TypeError: If `model` is not a `keras.Model` or `accum_steps` is
                not an integer.
            ValueError: If `model` is not built, or `accum_steps` or
                `partial_window` is out of range.

        Example:

        ```python
        base = keras.applications.MobileNetV3Small(weights=None)
        model = keras_accum.AccumModel.from_model(base, accum_steps=4)
        ```
        """
        check_accum_schedule(accum_steps)
        check_partial_window(partial_window)
        if not isinstance(model, keras.Model):
            raise TypeError(
                "`model` must be a `keras.Model`. "
                f"Received: model={model!r} (of type {type(model).__name__})"
            )
        if isinstance(model, Functional):  # Sequential and functional.
            try:
                inputs, outputs = model.inputs, model.outputs
            except (AttributeError, ValueError):
                inputs = outputs = None
            if inputs is not None and outputs is not None:
                return AccumModel(
                    inputs,
                    outputs,
                    name=model.name,
                    accum_steps=accum_steps,
                    partial_window=partial_window,
                )
        if not model.built:
            raise ValueError(
                "`model` must be built (have its weights) before it is "
                "converted; call it on a batch of data or give its first "
                f"layer an input shape. Received: model={model.name!r}, "
                "which is not built."
            )
        return _WrappedAccumModel(
            model,
            name=f"{model.name}_accum",
            accum_steps=accum_steps,
            partial_window=partial_window,
        )

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
        value = check_accum_schedule(value)
        if callable(value) or callable(self._accum_steps):
            self.train_function = None
            self._flush_function = None
        self._accum_steps = value
        self._assign_target_length()

    @property
    def window_length(self) -> int:
        """Micro-batches the open window (or else the last one) closes at."""
        if self._window is None:
            return self._steps_for_now() or 1
        return read_int(self._window.window_length)

    def _steps_for_now(self) -> int | None:
        """The window length the configuration gives now, if static."""
        if isinstance(self._accum_steps, dict):
            return steps_for_epoch(self._accum_steps, self._epoch)
        if callable(self._accum_steps):
            return None
        return self._accum_steps

    def _assign_target_length(self):
        steps = self._steps_for_now()
        if self._window is not None and steps is not None:
            self._window.target_length.assign(steps)

    @property
    def partial_window(self) -> str:
        """`"apply"` or `"carry"`: what happens to a window at epoch end."""
        return self._partial_window

    @partial_window.setter
    def partial_window(self, value: str) -> None:
        value = check_partial_window(value)
        if value != self._partial_window:
            self._partial_window = value
            # The policy is part of the traced step.
            self.train_function = None
            self._flush_function = None

    @property
    def mini_step(self) -> int:
        """Micro-batches in the window now open; 0 right after an update."""
        if self._window is None:
            return 0
        return read_int(self._window.mini_step)

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
        return read_int(self._window.skipped_windows)

    @property
    def accumulators(self) -> list:
        """The gradient accumulators, one per trainable weight, same order.

        Empty until the model is first trained. Each holds the open
        window's gradient sum (weighted as described above), not yet
        divided. Between windows (`mini_step == 0`) they still hold the
        last window's sum, unused: a window's first micro-batch overwrites
        them, which costs less memory than clearing them after an update.
        """
        if self._window is None:
            return []
        return list(self._window.acc_grads)

    def apply_partial_window(self) -> bool:
        """Applies the open window now, if it holds any micro-batch.

        The window is normalised over what it holds, as a short last batch
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
        if self._flush_function is None:
            self._flush_function = self._make_flush_function()
        self._flush_function()
        return True

    # -- Compile, fit, evaluate ---------------------------------------------

    def make_train_function(self, force: bool = False):
        if self.train_function is not None and not force:
            return self.train_function
        _check_custom_train_step(self)
        # Set when the traced (or eager) step reaches `AccumModel.train_step`.
        self._window_stepped = False
        super().make_train_function(force=force)
        if _BACKEND == "tensorflow":
            self.train_function = _checked_train_function(
                self, self.train_function
            )
        return self.train_function

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

    def load_weights(self, filepath, *args: Any, **kwargs: Any) -> None:
        if getattr(self, "optimizer", None) is not None and self.built:
            # The accumulators must exist to receive a saved open window.
            self._ensure_window()
        return super().load_weights(filepath, *args, **kwargs)

    def fit(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        epochs: int = 1,
        verbose: Any = "auto",
        callbacks: Any = None,
        **kwargs: Any,
    ):
        epoch_callback = _WindowEpochs(self)
        listed = (
            callbacks.callbacks
            if isinstance(callbacks, keras.callbacks.CallbackList)
            else callbacks or []
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
        if isinstance(callbacks, keras.callbacks.CallbackList):
            epoch_callback.set_loggers(callbacks.callbacks)
            callbacks.callbacks.insert(0, epoch_callback)
            epoch_callback.set_model(self)
        else:
            epoch_callback.set_loggers(callbacks or [])
            # First, so that epoch-end callbacks see the applied window.
            callbacks = [epoch_callback, *(callbacks or [])]
        return super().fit(
            x=x,
            y=y,
            batch_size=batch_size,
            epochs=epochs,
            verbose=verbose,
            callbacks=callbacks,
            **kwargs,
        )

    def evaluate(self, *args: Any, **kwargs: Any):
        if kwargs.get("_use_cached_eval_dataset") and (
            self._partial_window == "apply"
        ):
            # `fit`'s validation: an epoch of unknown length may have left
            # its last window open.
            self.apply_partial_window()
        return super().evaluate(*args, **kwargs)

    def get_config(self) -> dict:
        config = {
            "accum_steps": _serialize_accum_steps(self._accum_steps),
            "partial_window": self._partial_window,
        }
        return {**super().get_config(), **config}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        accum_steps = _deserialize_accum_steps(
            config.pop("accum_steps", 1), custom_objects
        )
        partial_window = config.pop("partial_window", "apply")
        # Keras revives functional and subclassed models differently; both
        # paths get a model built with the defaults, set here after.
        model = super().from_config(config, custom_objects=custom_objects)
        model.accum_steps = accum_steps
        model.partial_window = partial_window
        return model

    # -- Building the window state before tracing ---------------------------

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # The accumulators must exist before the step is traced, so build
        # now. From the dataset's element spec when possible: no batch is
        # consumed, and Keras's own path (3.15) reduces a real batch with
        # `strategy.reduce`, which fails under MultiWorkerMirroredStrategy
        # (keras-team/keras#20585).
        if not self._all_built():
            spec = data_batch
            if spec is None and iterator is not None:
                spec = _element_spec(iterator)
            if spec is not None:
                try:
                    with self.distribute_strategy.scope():
                        self._symbolic_build(data_batch=spec)
                except Exception:  # noqa: BLE001
                    # Left to Keras: a strategy's batch, or the first trace.
                    pass
        if not self._all_built():
            super()._maybe_symbolic_build(
                iterator=iterator, data_batch=data_batch
            )
        self._ensure_window()

    def _all_built(self):
        optimizer = getattr(self, "optimizer", None)
        return (
            all(layer.built for layer in self._flatten_layers())
            and (optimizer is None or optimizer.built)
            and all(
                part is None or part.built
                for part in (
                    getattr(self, "_compile_loss", None),
                    getattr(self, "_compile_metrics", None),
                )
            )
        )

    def _ensure_window(self):
        if self._window is not None or getattr(self, "optimizer", None) is None:
            return
        if not all(layer.built for layer in self._flatten_layers()):
            return
        hooks = self._window_close_hooks()
        length = self._steps_for_now() or 1
        if _BACKEND == "tensorflow":
            from keras_accum._tf_window import WindowState

            strategy = self.distribute_strategy
            with strategy.scope():
                if not self.optimizer.built:
                    self.optimizer.build(self.trainable_variables)
            self._window = WindowState(
                self.trainable_weights, length, strategy, close_hooks=hooks
            )
        else:
            # JAX and PyTorch: variables that the shared rules advance.
            _backend_support.check_model(self)
            if not self.optimizer.built:
                self.optimizer.build(self.trainable_variables)
            self._window = _window_rules.WindowVariables(
                self.trainable_weights, length, close_hooks=hooks
            )
        self._window_refs = [id(v) for v in self.trainable_weights]
        self._window.steps_per_epoch.assign(self._steps_per_epoch)

    def _window_close_hooks(self):
        """`hook(applied, closing)` of each layer that follows the window."""
        batch_norms = [
            layer
            for layer in self._flatten_layers()
            if isinstance(layer, AccumBatchNormalization)
        ]
        for layer in batch_norms:
            layer._window_owned = True
        return [layer._close_window for layer in batch_norms]

    def _window_for_step(self):
        if self._window is None:
            # The model could not be built before tracing (e.g. its build
            # needs real data); create the state during the first trace.
            self._ensure_window()
        # Fixed per trace; `_set_noise_scale_every` retraces on change.
        self._window.noise_every = self._noise_scale_every
        self._window.xla = bool(self.jit_compile)
        if self._window_refs != [id(v) for v in self.trainable_weights]:
            raise ValueError(
                "The model's trainable weights changed since the "
                "accumulators were created. Call `compile()` again after "
                "changing `trainable`, as Keras requires."
            )
        return self._window

    # -- The train step -------------------------------------------------------

    def train_step(self, data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        window = self._window_for_step()
        self._window_stepped = True

        # Forward pass under the tape.
        with tf.GradientTape() as tape:
            if self._call_has_training_arg:
                y_pred = self(x, training=True)
            else:
                y_pred = self(x)
            loss = self._compute_loss(
                x=x,
                y=y,
                y_pred=y_pred,
                sample_weight=sample_weight,
                training=True,
            )
            batch_size = tf.shape(
                next(i for i in tree.flatten(x) if i is not None)
            )[0]
            self._loss_tracker.update_state(
                loss_module.unscale_loss_for_distribution(loss),
                sample_weight=batch_size,
            )

            # Weight the micro-batch by its share of the window's loss.
            objective, weight, normalizer, window_loss_term = (
                self._micro_batch_share(
                    loss, y, y_pred, sample_weight, batch_size, window
                )
            )

        if not self.trainable_weights:
            warnings.warn(
                "The model does not have any trainable weights.", stacklevel=2
            )
            return self.compute_metrics(
                x, y, y_pred, sample_weight=sample_weight
            )

        # Gradients.
        trainable_weights = self.trainable_weights
        gradients = tape.gradient(objective, trainable_weights)
        none_grads = self._window_none_grads = [g is None for g in gradients]

        # The window's writes wait for the micro-batch, its loss and every
        # gradient. Without that, ops that read no data (counters, a
        # constant batch size) still run when the step fails: on the call
        # that finds an input of unknown length exhausted, or on an error
        # in the forward pass, they would count a micro-batch whose
        # gradient never entered the window. On every gradient, not only the
        # loss: under MultiWorkerMirroredStrategy a narrower set let the
        # workers launch their gradient all-reduces in different orders.
        ready = [
            t
            for t in tf.nest.flatten(data, expand_composites=True)
            if tf.is_tensor(t)
        ]
        ready += [loss, *(_dense_part(g) for g in gradients if g is not None)]
        with tf.control_dependencies(ready):
            self._add_to_window(
                window,
                gradients,
                none_grads,
                weight,
                normalizer,
                window_loss_term,
                batch_size,
            )
        return self._logs_for_strategy(
            self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        )

    def _add_to_window(
        self,
        window,
        gradients,
        none_grads,
        weight,
        normalizer,
        window_loss_term,
        batch_size,
    ):
        """Adds a micro-batch to the window and applies a complete one."""
        trainable_weights = self.trainable_weights
        scheduled = self._scheduled_length(self.optimizer.iterations)

        def accumulate_then_maybe_apply():
            # Added to the window; applied once per window, in the step.
            window.accumulate(
                gradients,
                weight,
                normalizer,
                window_loss_term,
                batch_size,
                scheduled,
            )
            window.maybe_apply(
                self.optimizer,
                trainable_weights,
                window.window_is_complete(self._partial_window == "apply"),
                none_grads,
            )

        if self._accum_steps == 1 and window.supports_direct_apply():
            # A one-micro-batch window is the micro-batch: apply its
            # gradient as a plain step does, without the accumulators.
            # Traced only for `accum_steps=1`: the conditional holds the
            # micro-batch's gradients for its whole run, which would cost
            # a gradient-sized buffer during every longer window's apply.
            # The runtime check keeps a later `accum_steps` change exact.
            tf.cond(
                window.is_direct(),
                lambda: window.apply_direct(
                    self.optimizer,
                    trainable_weights,
                    gradients,
                    none_grads,
                    normalizer,
                    window_loss_term,
                    batch_size,
                ),
                accumulate_then_maybe_apply,
            )
        else:
            accumulate_then_maybe_apply()

    def _scheduled_length(self, updates):
        """The callable schedule's window length for `updates`, in the step.

        None unless `accum_steps` is a callable (the window then takes its
        length from `target_length`).
        """
        if not callable(self._accum_steps):
            return None
        length = ops.cast(self._accum_steps(updates), _COUNT_DTYPE)
        if len(length.shape) != 0:
            raise ValueError(
                "An `accum_steps` callable must return a scalar. Received: "
                f"accum_steps={self._accum_steps!r} returning shape "
                f"{length.shape}"
            )
        # Checked eagerly at the start of `fit`, but a later update count
        # may give less than 1. The step fails then wherever it can; a
        # compiled step that cannot (XLA, a jitted JAX step) clamps to 1,
        # which beats a window that never closes (documented).
        message = (
            "An `accum_steps` callable must return an integer >= 1. "
            f"Received: accum_steps={self._accum_steps!r} returning "
        )
        if _BACKEND == "jax":
            import jax

            eager = not isinstance(length, jax.core.Tracer)
        elif _BACKEND == "tensorflow":
            eager = tf.executing_eagerly()
        else:  # PyTorch's step is eager.
            eager = True
        if eager:
            if int(length) < 1:
                raise ValueError(
                    f"{message}{int(length)} at update {int(updates)}"
                )
        elif _BACKEND == "tensorflow" and not self.jit_compile:
            # A graph step. XLA would drop the assertion and has no string
            # ops: under `jit_compile=True` the clamp holds.
            text = tf.strings.join(
                [
                    message,
                    tf.strings.as_string(length),
                    " at update ",
                    tf.strings.as_string(ops.convert_to_tensor(updates)),
                ]
            )
            check = tf.debugging.Assert(length >= 1, [text])
            with tf.control_dependencies([check]):
                length = tf.identity(length)
        return ops.maximum(length, 1)

    def _check_schedule(self):
        """Evaluates a callable schedule once, eagerly, to fail early."""
        if not callable(self._accum_steps):
            return
        optimizer = self.optimizer
        updates = 0 if optimizer is None else int(optimizer.iterations)
        value = self._accum_steps(
            ops.convert_to_tensor(updates, dtype=_COUNT_DTYPE)
        )
        message = (
            "An `accum_steps` callable must return an integer >= 1. "
            f"Received: accum_steps={self._accum_steps!r} returning "
            f"{value!r} at update {updates}"
        )
        try:
            steps = float(value)
        except (TypeError, ValueError) as error:
            raise TypeError(message) from error
        if steps < 1 or steps != int(steps):
            raise ValueError(message)

    def _set_noise_scale_every(self, every: int) -> None:
        # Part of the traced step: a change retraces it once.
        if every != self._noise_scale_every:
            self._noise_scale_every = every
            self.train_function = None
            self._flush_function = None

    def test_step(self, *args):
        # TensorFlow and PyTorch pass `(data)`; JAX `(state, data)`.
        outputs = super().test_step(*args)
        if _BACKEND != "tensorflow":
            return outputs
        return self._logs_for_strategy(outputs)

    def _logs_for_strategy(self, logs):
        """Works around Keras 3.15 reducing scalar logs with `axis=0`.

        Under MultiWorkerMirroredStrategy Keras averages each replica's logs
        with `strategy.reduce("MEAN", value, axis=0)`, which fails for the
        scalars every metric returns; one-element vectors average to the
        same scalar.
        """
        if not _multi_worker(self.distribute_strategy):
            return logs
        return tree.map_structure(
            lambda v: tf.reshape(v, [1]) if v.shape.rank == 0 else v, logs
        )

    def _micro_batch_share(
        self, loss, y, y_pred, sample_weight, batch_size, window
    ):
        """What every backend's step differentiates and adds to the window.

        Returns:
            `(objective, weight, normaliser, window loss term)`: the
            micro-batch's share of the window's loss, loss-scaled for the
            optimizer; the weight its gradient gets in the accumulators;
            the normaliser it adds to the window's divisor; and its
            weighted loss, float32, for the pseudo-batch loss.
        """
        objective, weight, normalizer = self._window_objective(
            loss, y, y_pred, sample_weight, batch_size, window
        )
        term = ops.cast(ops.stop_gradient(objective), "float32") * weight
        if self.optimizer is not None:
            objective = self.optimizer.scale_loss(objective)
        return objective, weight, normalizer, term

    def _window_objective(self, loss, y, y_pred, sample_weight, batch_size, w):
        """Returns (what to differentiate, its weight, its normaliser).

        A mean-reduced micro-batch gradient is weighted by the entries the
        loss averaged over, which turns it back into a sum, and the window
        is divided by the total of those at apply time: the mean over the
        window, not a mean of means. The weight is applied to the float32
        gradient, not to the loss, so that backpropagation (float16 under
        mixed precision) sees the magnitudes a plain step sees.
        """
        reduction, normalizer = self._loss_normalizer(
            y, y_pred, sample_weight, batch_size
        )
        if reduction in _SUM_REDUCTIONS:
            # Summed micro-batch losses already add up to the window's,
            # except that each carries the regularization once: keep it on
            # the window's first micro-batch only.
            regularization = self._regularization_loss(loss.dtype)
            later = ops.cast(w.mini_step.value > 0, loss.dtype)
            zero, one = ops.zeros((), "float32"), ops.ones((), "float32")
            return loss - later * regularization, one, zero
        normalizer = ops.cast(normalizer, "float32")
        objective = loss_module.unscale_loss_for_distribution(loss)
        return objective, normalizer, normalizer

    def _regularization_loss(self, dtype):
        losses = [self._aggregate_additional_loss(v) for v in self.losses]
        if not losses:
            return ops.zeros((), dtype)
        total = losses[0]
        for value in losses[1:]:
            total = ops.add(total, value)
        return ops.cast(total, dtype)

    def _loss_normalizer(self, y, y_pred, sample_weight, batch_size):
        """The reduction in use and the divisor it applied to this batch.

        Only proportionality across micro-batches matters: the window is
        divided by the total of these.
        """
        compile_loss = self._compile_loss
        flat_losses = getattr(compile_loss, "_flat_losses", None) or []
        reductions = []
        for entry in flat_losses:
            reduction = getattr(entry.loss, "reduction", "sum_over_batch_size")
            reductions.append(
                "sum_over_batch_size" if reduction is None else reduction
            )
        if not reductions:
            # A custom `compute_loss`: assume the usual mean over the batch.
            return "sum_over_batch_size", batch_size
        if len(set(reductions)) > 1:
            warnings.warn(
                "The losses use different reductions "
                f"({sorted(set(map(str, reductions)))}); AccumModel weights "
                "every micro-batch by its number of samples, which equals "
                "large-batch training only when micro-batches are full.",
                stacklevel=2,
            )
            return "sum_over_batch_size", batch_size
        reduction = reductions[0]
        if reduction in _SUM_REDUCTIONS:
            return reduction, None
        flat_pred = tree.flatten(y_pred)
        if len(flat_losses) != 1 or len(flat_pred) != 1:
            # Several outputs share the batch: samples are the common unit.
            return reduction, batch_size
        pred = flat_pred[0]
        mask = get_keras_mask(pred)
        # Loss functions reduce the last axis; the entries left are what
        # "sum_over_batch_size" divides by. Dimensions are ints where known
        # and scalar tensors where dynamic (TensorFlow).
        rank = ops.ndim(pred)
        if rank is not None and rank > 1:
            entries = math.prod(ops.shape(pred)[:-1])
        else:
            entries = batch_size
        if reduction == "mean_with_sample_weight":
            weight = loss_module.apply_mask(
                _single(sample_weight), mask, "float32", reduction
            )
            if weight is not None:
                return reduction, ops.sum(ops.cast(weight, "float32"))
            return reduction, entries
        if mask is not None:
            return reduction, ops.sum(ops.cast(mask, "float32"))
        return reduction, entries

    def _make_flush_function(self):
        if _BACKEND != "tensorflow":
            return self._make_value_flush_function()
        window = self._window
        strategy = self.distribute_strategy
        variables = self.trainable_weights

        def replica_fn():
            window.maybe_apply(
                self.optimizer,
                variables,
                window.mini_step.value > 0,
                self._window_none_grads or [False] * len(variables),
            )

        @tf.function
        def flush():
            strategy.run(replica_fn)

        return flush

    def _set_steps_per_epoch(self, steps):
        self._steps_per_epoch = int(steps or 0)
        if self._window is not None:
            self._window.steps_per_epoch.assign(self._steps_per_epoch)

    def _start_epoch(self, epoch):
        self._epoch = epoch
        self._assign_target_length()
        if self._window is not None:
            self._window.epoch_step.assign(0)


def _serialize_accum_steps(accum_steps):
    if isinstance(accum_steps, dict):
        # JSON keys are strings; `check_accum_schedule` reads them back.
        return {str(epoch): steps for epoch, steps in accum_steps.items()}
    if callable(accum_steps):
        return keras.saving.serialize_keras_object(accum_steps)
    return accum_steps


def _deserialize_accum_steps(value, custom_objects=None):
    if isinstance(value, dict) and "class_name" in value:
        return keras.saving.deserialize_keras_object(
            value, custom_objects=custom_objects
        )
    return check_accum_schedule(value)


def _multi_worker(strategy) -> bool:
    return isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and bool(strategy.extended._in_multi_worker_mode())


def _element_spec(iterator):
    """The element spec of the data behind a Keras epoch iterator, if any.

    Read from the dataset that Keras's TensorFlow epoch iterator already
    made (under a strategy, the one it distributes). A new one from the
    data adapter (`get_tf_dataset()`) would convert in-memory arrays to
    tensors again: a transient copy of the whole training data, twice its
    size at peak.
    """
    # Keras 3.15 `TFEpochIterator._distributed_dataset`; TensorFlow's
    # `DistributedDataset._original_dataset`.
    dataset = getattr(iterator, "_distributed_dataset", None)
    dataset = getattr(dataset, "_original_dataset", dataset)
    return getattr(dataset, "element_spec", None)


def _check_custom_train_step(model) -> None:
    """Refuses a custom `train_step` where the step would never run it.

    The JAX and PyTorch steps are their trainers' own functions, and
    `AccumModel.train_step` is TensorFlow's: an override there would be
    silently ignored, or fail inside `super().train_step`.
    """
    if _BACKEND == "tensorflow":
        return
    if type(model).train_step is not AccumModel.train_step:
        raise _backend_support.unsupported(
            "A custom `train_step` on an `AccumModel`",
            f"{type(model).__name__}.train_step",
        )


def _checked_train_function(model, function):
    """`function`, failing loudly if its step bypassed the window.

    A subclass whose `train_step` never calls `super().train_step(data)`
    (e.g. a GAN with its own optimizers) applies its optimizer on every
    micro-batch: training would go on with no accumulation at all.
    """

    def train_function(iterator):
        logs = function(iterator)
        # With one micro-batch per window, a plain step is what
        # `keras.Model` runs: a drop-in with a custom step stays one.
        if not model._window_stepped and model.accum_steps != 1:
            updates = 0
            if getattr(model, "optimizer", None) is not None:
                updates = read_int(model.optimizer.iterations)
            raise RuntimeError(
                f"`{type(model).__name__}.train_step` does not call "
                "`super().train_step(data)`, so it never reaches the "
                f"accumulation window: with accum_steps={model.accum_steps!r} "
                "it would update the weights on every micro-batch, without "
                f"accumulating ({updates} optimizer update(s) so far). Call "
                "`super().train_step(data)` from a custom `train_step` (and "
                "change only what surrounds it), or subclass `keras.Model` "
                "for a step that updates on every batch, such as a GAN "
                "with its own optimizers."
            )
        return logs

    return train_function


def _dense_part(gradient):
    # `IndexedSlices` (embeddings) are no tensor; their values are.
    return getattr(gradient, "values", gradient)


def _single(sample_weight):
    flat = tree.flatten(sample_weight) if sample_weight is not None else []
    return flat[0] if len(flat) == 1 else None


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


class _WindowEpochs(keras.callbacks.Callback):
    """Tells the compiled step where epochs end; applies leftovers."""

    def __init__(self, model: AccumModel):
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
        self._accum_model._set_steps_per_epoch(self.params.get("steps"))
        self._accum_model._check_schedule()

    def on_epoch_begin(self, epoch, logs=None):
        self._accum_model._start_epoch(epoch)
        self._skipped_before = self._accum_model.skipped_windows

    def on_epoch_end(self, epoch, logs=None):
        if self._accum_model.partial_window == "apply":
            # Unknown epoch length: the step could not close the window.
            self._accum_model.apply_partial_window()
        self._count_skipped(epoch)
        for logger in self._loggers:
            logger._on_window_epoch_end(logs)

    def _count_skipped(self, epoch):
        # Not a log key: the default logs stay those of `keras.Model`, so
        # tooling that reads them sees no difference at `accum_steps=1`.
        # A skip is a divergence from plain training, though, so it is
        # never silent. The epoch's count is left on the model for
        # `PseudoBatchLogger`.
        model = self._accum_model
        total = model.skipped_windows
        # `compile()` rebuilds the window state, restarting the count.
        skipped = max(0, total - self._skipped_before)
        self._skipped_before = total
        model._epoch_skipped_windows = skipped
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
        self._accum_model._set_steps_per_epoch(0)


@keras.saving.register_keras_serializable(package="keras_accum")
class _FunctionalAccumModel(AccumModel, Functional):
    """What `AccumModel(inputs, outputs)` builds: functional and accumulating.

    Not instantiated directly; `isinstance(model, AccumModel)` holds. A user
    subclass of `AccumModel` called with `(inputs, outputs)` gets it as its
    base in place of `AccumModel`.
    """

    def _run_through_graph(self, *args, **kwargs):
        # Runs on every forward pass of a functional model: only a frame
        # check unless `clone_model` is the caller.
        cls = type(self)
        if _cloning_caller(sys._getframe(1)) and not (
            functional_like_constructor(cls)
        ):
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


@keras.saving.register_keras_serializable(package="keras_accum")
class _WrappedAccumModel(AccumModel):
    """An `AccumModel` around a built subclassed model (`from_model`)."""

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
            "accum_steps": _serialize_accum_steps(self._accum_steps),
            "partial_window": self._partial_window,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_model"), custom_objects=custom_objects
        )
        config["accum_steps"] = _deserialize_accum_steps(
            config.get("accum_steps", 1), custom_objects
        )
        return cls(inner, **config)
