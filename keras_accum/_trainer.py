"""What every backend's accumulating trainer shares.

`AccumTrainer` is the base of the three backend trainers
(`_tf_trainer.TensorFlowAccumTrainer`, `_jax_trainer.JaxAccumTrainer`,
`_torch_trainer.TorchAccumTrainer`), one of which `AccumModel` inherits,
the way Keras picks its own trainer by backend. Each overrides Keras's
`train_step` in its backend's signature and runs the window rules
(`_window.py`); this class holds the rest they have in common: the window
state's life, the micro-batch's share of the window's loss, schedules, the
check that a custom `train_step` reaches the window, and what `fit` tells
the window at epoch boundaries.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import keras
from keras import ops

from keras_accum import _batch_ops, _compat, _settings, _sizing, _window
from keras_accum import _normalizer as normalizers
from keras_accum._backend_support import check_model
from keras_accum._compat import Functional
from keras_accum._validation import steps_for_epoch
from keras_accum._window import COUNT_DTYPE, WindowState
from keras_accum._window_fields import FIELDS
from keras_accum._window_log import read_array, read_int
from keras_accum._window_saving import (
    WindowRules,
    saved_for_other_weights,
    saved_optimizer_shapes,
    warn_if_lora_reset,
)
from keras_accum.auto import MAX_STEPS, AutoAccumSteps

# What a recompile keeps of `"auto"`'s controller.
KEPT_CONTROLLER = (
    "auto_trace",
    "auto_grad_sq",
    "auto_estimates",
    "target_length",
)


@dataclasses.dataclass
class WindowLife:
    """What a model keeps of its window besides the window's variables.

    Attributes:
        refs: The ids of the trainable weights the accumulators were made
            for, in order; None before the window exists.
        unbuilt: The ids of layers left unbuilt when it was made (see
            `forward_layers`), for the message if one builds later.
        none_grads: Which gradients are None, fixed when the step is
            traced; the flush reuses it. None until then.
        stepped: The traced (or eager) step reached the window; read by
            `_checked_train_function`.
        flush_function: The compiled `apply_partial_window`, made once.
        kept_controller: `"auto"`'s controller, read before a recompile
            dropped the window and set on the next one; None otherwise.
        epoch, steps_per_epoch: Where `fit` is, told before the window
            exists; once it exists its counters hold them instead
            (`counters.epoch`, `counters.steps_per_epoch`) and these are
            None.
        split: With `micro_batch_size`, the sizes in force and the
            choices made (`_sizing.SplitSizes`).
        batch_metrics_checked: Whether the split step looked for
            metrics of one value per batch (`_batch_ops`),
            once after `compile`.
    """

    refs: list | None = None
    unbuilt: set = dataclasses.field(default_factory=set)
    none_grads: list | None = None
    stepped: bool = False
    flush_function: Any = None
    kept_controller: dict | None = None
    epoch: int | None = 0
    steps_per_epoch: int | None = 0
    split: _sizing.SplitSizes = dataclasses.field(
        default_factory=_sizing.SplitSizes
    )
    batch_metrics_checked: bool = False


class AccumTrainer:
    """The backend-neutral half of `AccumModel`'s training.

    Backends provide `train_step`, `test_step` and `predict_step` (the
    split ones through `_batch_ops`), `_micro_batch_step(...)`,
    `_make_flush_function()` and `_batch_ops_class` (their
    `_batch_ops.BatchOps`), and may override `_create_window(length,
    hooks)` (TensorFlow's is per replica) and `_check_length_in_step`.

    The package's state on the model is set here and nowhere else: the
    settings (`_accum_steps` and the others of `_settings.SETTINGS`,
    through `_configure`), the
    window (`_window`: its variables, under the saved format's name
    `_window_fields.SAVED_UNDER`) and the rest of its life (`_life`, a
    `WindowLife`).
    """

    # The arguments of the backend's `train_step`, for error messages.
    _TRAIN_STEP_ARGS = "data"
    # What modules that `model.py` imports test for instead of importing
    # `AccumModel` (`layers.py`).
    _accumulates_gradients = True

    def _configure(self, values: dict) -> None:
        """Sets the settings in `values` (checked by the caller; see
        `_settings.SETTINGS`), and drops the compiled steps that read the
        ones that change."""
        life = getattr(self, "_life", None)
        for name, value in values.items():
            setting = _settings.BY_NAME[name]
            old = getattr(self, setting.attribute, setting.default)
            setattr(self, setting.attribute, value)
            if setting.split:
                # `evaluate` and `predict` split the batch too.
                self.test_function = None
                self.predict_function = None
                if life is not None:
                    life.split = _sizing.SplitSizes()
            if setting.retraces(old, value):
                self.train_function = None
                if life is not None:
                    life.flush_function = None

    def _setting_values(self) -> dict:
        """Every setting's value as the model keeps it."""
        return {s.name: getattr(self, s.attribute) for s in _settings.SETTINGS}

    def _change_settings(self, values: dict) -> None:
        """Sets the settings in `values` as their property setters do:
        checked, each and with the rules across settings; one that may
        not change with a window open is refused then; and each change
        does what `_settings.SETTINGS` says."""
        kept = self._setting_values()
        for name, value in _settings.checked(values, kept).items():
            setting = _settings.BY_NAME[name]
            if value == kept[name] and not setting.every_set:
                continue
            window = self._window
            if setting.while_open is not None and window is not None:
                open_steps = read_int(window.counters.mini_step)
                if open_steps > 0:
                    raise ValueError(
                        f"`{name}` cannot change while a window is open "
                        f"({open_steps} micro-batch(es) "
                        f"{setting.while_open}): call "
                        "`apply_partial_window()` first. Received: "
                        f"{name}={value!r}"
                    )
            self._configure({name: value})
            if setting.changed is not None:
                getattr(self, setting.changed)()

    def _remake_accumulators(self) -> None:
        """After `accumulator_dtype` changed: a window state that exists
        (made by `fit`, `evaluate` or `load_weights`) gets new
        accumulators in the new dtype and keeps its counters."""
        if self._window is not None:
            self._remake_window(self._window)

    def _remake_window(self, old) -> None:
        """A new window state in place of `old`, whose window is closed:
        new accumulators, `old`'s counters (the window's totals are zero
        between windows; a new rounding seed where the new one rounds)."""
        counters = {
            field.name: read_array(old.counters.get(field.name))
            for field in FIELDS
            if not field.summed
        }
        life = self._life
        life.epoch = int(counters["epoch"])
        life.steps_per_epoch = int(counters["steps_per_epoch"])
        self._window = None
        self._ensure_window()
        new = self._window
        if new.rounds:
            del counters["rounding_seed"]
        for name, value in counters.items():
            new.counters.get(name).assign(value)

    def _reset_window_state(self):
        old = getattr(self, "_life", None)
        window = getattr(self, "_window", None)
        life = WindowLife()
        if old is not None:
            # `"auto"`'s controller outlives a recompile (freeze, fit,
            # unfreeze, compile): what it learnt of the noise scale is the
            # task's, not the optimizer's. Read before the window goes; set
            # on the next one.
            life.kept_controller = self._controller_values()
            if window is None:
                life.epoch = old.epoch
            else:
                life.epoch = read_int(window.counters.epoch)
        self._life = life
        self._window = None

    # -- The window state's life ----------------------------------------------

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
                        _compat.symbolic_build(self, spec)
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
            all(layer.built for layer in forward_layers(self))
            and (optimizer is None or optimizer.built)
            and all(
                part is None or part.built
                for part in _compat.compiled_parts(self)
            )
        )

    def _ensure_window(self):
        if self._window is not None or getattr(self, "optimizer", None) is None:
            return
        if not all(layer.built for layer in forward_layers(self)):
            return
        self._window = self._create_window(
            self._steps_for_now() or self._first_length(),
            self._window_close_hooks(),
        )
        life = self._life
        life.refs = [id(v) for v in self.trainable_weights]
        # Layers outside the forward pass, left unbuilt (see
        # `forward_layers`), for the message if one builds later.
        life.unbuilt = {
            id(layer) for layer in _compat.sublayers(self) if not layer.built
        }
        # From here on the counters hold `fit`'s position.
        self._window.counters.steps_per_epoch.assign(life.steps_per_epoch)
        self._window.counters.epoch.assign(life.epoch)
        life.epoch = life.steps_per_epoch = None
        self._restore_controller()
        self._window.connect(
            self._saved_window_rules,
            self._assign_target_length,
            self._check_window_load,
        )

    def _create_window(self, length, close_hooks, make_variable=None):
        check_model(self)
        if not self.optimizer.built:
            self.optimizer.build(self.trainable_variables)
        return WindowState(
            self.trainable_weights,
            length,
            make_variable or _window._plain_variable,
            close_hooks,
            self._accumulator_dtype,
        )

    def _window_close_hooks(self):
        """`hook(applied, closing)` of each layer that follows the window:
        a layer declares `_follow_window()`, which returns its hook
        (`AccumBatchNormalization`)."""
        return [
            layer._follow_window()
            for layer in _compat.sublayers(self)
            if callable(getattr(layer, "_follow_window", None))
        ]

    def _window_for_step(self, variables=None):
        """The window state, checked, for a step being traced or run;
        `variables`: the trainable weights, where the step has them."""
        if self._window is None:
            # The model could not be built before tracing (e.g. its build
            # needs real data); create the state during the first trace.
            self._ensure_window()
        if variables is None:
            variables = self.trainable_weights
        if self._life.refs != [id(v) for v in variables]:
            raise ValueError(changed_weights_message(self))
        self._life.stepped = True
        return self._window

    def _steps_for_now(self) -> int | None:
        """The window length the configuration gives now, if static (not
        a callable schedule's, nor `"auto"`'s)."""
        if isinstance(self._accum_steps, dict):
            return steps_for_epoch(self._accum_steps, fit_epoch(self))
        if callable(self._accum_steps) or self._auto() is not None:
            return None
        return self._accum_steps

    def _auto(self) -> AutoAccumSteps | None:
        """The controller of `accum_steps="auto"`, else None."""
        steps = self._accum_steps
        return steps if isinstance(steps, AutoAccumSteps) else None

    def _controller_values(self) -> dict | None:
        """`"auto"`'s moving averages, its windows measured since the last
        change and the length it reached; None without a controller."""
        window = getattr(self, "_window", None)
        if window is None or self._auto() is None:
            return self._life.kept_controller
        counters = window.counters
        return {
            name: read_array(counters.get(name)) for name in KEPT_CONTROLLER
        }

    def _restore_controller(self) -> None:
        """Sets a new window's controller to the one a recompile dropped
        (AdaScale's progress restarts with the optimizer's update count).
        """
        life = self._life
        kept, life.kept_controller = life.kept_controller, None
        auto = self._auto()
        if kept is None or auto is None:
            return
        counters = self._window.counters
        for name, value in kept.items():
            counters.get(name).assign(value)
        length = _first_length_of(kept, auto)
        counters.target_length.assign(length)
        counters.window_length.assign(length)

    def _first_length(self) -> int:
        """A new window state's first length where `_steps_for_now` has
        none: `"auto"`'s shortest, else 1 (a callable's is set in the
        step)."""
        auto = self._auto()
        if auto is None:
            return 1
        kept = self._life.kept_controller
        if kept is None:
            return auto.min_steps
        return _first_length_of(kept, auto)

    def _loads_as_plain_keras(self, filepath) -> bool:
        """Whether `load_weights(filepath)` leaves the optimizer and the
        window unbuilt, and warns why.

        Where neither is built yet (right after `compile()`) and the file's
        window was saved by a model with other trainable weights (LoRA of
        another rank, layers frozen or unfrozen since), building them to
        receive the file would receive optimizer variables of other
        weights too, which Keras refuses after the layers have loaded.
        Plain Keras skips an unbuilt optimizer's saved variables instead;
        so does this, and the window starts afresh with it. An open window
        of other weights raises here, before anything loads.
        """
        optimizer = getattr(self, "optimizer", None)
        if self._window is not None or optimizer is None or optimizer.built:
            return False
        shapes = [tuple(v.shape) for v in self.trainable_weights]
        with warnings.catch_warnings():
            # Given again by the window's own check of the file, which
            # follows where this returns False.
            warnings.simplefilter("ignore")
            mismatch = saved_for_other_weights(
                filepath, shapes, self._saved_window_rules()
            )
        if not mismatch:
            return False
        lora = _lora_layers_text(
            self,
            "a LoRA model rebuilt with another rank loads each kernel with "
            "the saved LoRA update folded in and its new factors at zero.",
        )
        warnings.warn(
            f"The accumulation window saved in {os.fspath(filepath)} holds "
            f"{mismatch}: the file was saved by a model with other "
            "trainable weights. Its window was closed (no micro-batch "
            "waiting to be applied). As a plain `keras.Model` does with an "
            "optimizer not built yet, the layers' weights load and the "
            "optimizer starts afresh: Keras skips its saved variables, "
            "which belong to the other weights. The window starts afresh "
            f"with it, its counters not loaded.{lora}",
            stacklevel=3,
        )
        return True

    def _check_saved_optimizer(self, filepath) -> None:
        """Raises, before anything loads, where Keras would fail on the
        optimizer variables saved in `filepath` after loading the layers'
        weights: as many as this model's built optimizer has, one of
        another shape (a LoRA model of another rank, say). Keras skips a
        saved optimizer of another count itself, with a warning."""
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None or not optimizer.built:
            return
        method = getattr(type(optimizer).load_own_variables, "__qualname__", "")
        if method != "BaseOptimizer.load_own_variables":
            return  # Stores its variables otherwise (a loss-scale wrapper).
        saved = saved_optimizer_shapes(filepath)
        variables = optimizer.variables
        if saved is None or len(saved) != len(variables):
            return
        for variable, shape in zip(variables, saved, strict=True):
            if tuple(variable.shape) == shape:
                continue
            lora = _lora_layers_text(
                self,
                "a LoRA model rebuilt with another rank has factors of "
                "other shapes.",
            )
            raise ValueError(
                f"The optimizer state saved in {os.fspath(filepath)} is "
                f"for other trainable weights: this model's optimizer "
                f"variable `{variable.path}` has shape "
                f"{tuple(variable.shape)}, the saved one {shape}. Keras "
                "would load the layers' weights and then fail on it; "
                f"nothing was loaded.{lora} To load the file's weights into "
                "this model, `compile()` it with a new optimizer and call "
                "`load_weights()` before training: Keras then skips the "
                "saved optimizer state, as for a plain `keras.Model`."
            )

    def _check_window_load(self, values):
        warn_if_lora_reset(
            _compat.sublayers(self), self.trainable_variables, values
        )

    def _assign_target_length(self):
        if self._window is None:
            return
        target = self._window.counters.target_length
        steps = self._steps_for_now()
        auto = self._auto()
        if auto is not None:
            # The controller goes on from the length it has, within its
            # bounds.
            now = read_int(target)
            steps = min(max(now, auto.min_steps), auto.max_steps)
        if steps is not None:
            target.assign(steps)

    def _flush(self):
        """Applies the open window outside the step."""
        life = self._life
        if life.flush_function is None:
            life.flush_function = self._make_flush_function()
        life.flush_function()

    # -- The train function ---------------------------------------------------

    def make_train_function(self, force: bool = False):
        if self.train_function is not None and not force:
            return self.train_function
        check_model(self)
        self.train_function = self._step_function("train")
        return self.train_function

    def make_test_function(self, force: bool = False):
        if self.test_function is not None and not force:
            return self.test_function
        self.test_function = self._step_function("test")
        return self.test_function

    def make_predict_function(self, force: bool = False):
        if self.predict_function is not None and not force:
            return self.predict_function
        self.predict_function = self._step_function("predict")
        return self.predict_function

    def _step_function(self, kind):
        """Keras's function of `kind`, made anew; with `micro_batch_size`,
        through a `_sizing.SplitFunction` that sizes the pieces."""
        function = self._keras_function(kind)
        if self._micro_batch_size is None:
            return function
        return _sizing.SplitFunction(
            self._batch_ops_class(self), kind, function
        )

    def _keras_function(self, kind):
        """Keras's own function of `kind` (made anew), the train function
        checked to reach the window."""
        if kind == "train":
            # Set when the traced (or eager) step reaches the window.
            self._life.stepped = False
        getattr(super(), f"make_{kind}_function")(force=True)
        function = getattr(self, f"{kind}_function")
        if kind == "train":
            function = _checked_train_function(self, function)
        return function

    # -- A batch split into micro-batches (`micro_batch_size`) ---------------

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        logs = super().compute_metrics(x, y, y_pred, sample_weight)
        if (
            self._micro_batch_size is not None
            and not self._life.batch_metrics_checked
        ):
            _batch_ops.warn_of_batch_metrics(self, y, y_pred)
        return logs

    # -- The micro-batch's share of the window --------------------------------

    def _micro_batch_share(
        self, loss, y_pred, sample_weight, batch_size, device=None, length=None
    ):
        """What every backend's step differentiates and adds to the window.

        A mean-reduced micro-batch counts as its normalizer (samples, loss
        entries or sample-weight total) times its mean, which turns it back
        into a sum; the window is divided by the total of those at apply
        time: the mean over the window, not a mean of means. The factor is
        folded into the objective, so that backpropagation makes the
        weighted gradient (no pass over the gradients after it), except
        under loss scaling (below).

        `device` is the index of the device whose shard of the micro-batch
        this is, where each device computes its own gradient (JAX's
        partial sums, `_jax_devices`); None elsewhere. `length` is the
        window's length where the step splits a batch (its pieces: an
        int, or a scalar tensor), else None.

        Returns:
            `(objective, share)`: the micro-batch's share of the window's
            loss, loss-scaled for the optimizer, to differentiate; and its
            `_window.Share`.
        """
        found = normalizers.reductions(self)
        rule = normalizers.rule(found, len(keras.tree.flatten(y_pred)))
        if len(set(found)) > 1:
            shown = sorted(map(str, set(found)))
            warnings.warn(
                f"The losses use different reductions ({shown}); "
                "AccumModel weights every micro-batch by its number of "
                "samples, which equals large-batch training only when "
                "micro-batches are full.",
                stacklevel=2,
            )
        normalizer = normalizers.normalizer(
            rule.kind, y_pred, sample_weight, batch_size
        )
        if normalizer is None:
            objective = self._summed_objective(loss, device)
            share = _window.Share(None, 0.0, _stopped(objective), batch_size)
        else:
            objective, share = self._averaged_objective(
                loss, normalizer, batch_size, length
            )
        if self.optimizer is not None:
            objective = self.optimizer.scale_loss(objective)
        return objective, share

    def _summed_objective(self, loss, device=None):
        """A summed micro-batch loss: the micro-batch losses add up to the
        window's, except that each carries the regularization once: it is
        kept on the window's first micro-batch only (and there on the
        first `device` only)."""
        regularization = self._regularization_loss(loss.dtype)
        later = self._window.counters.mini_step.value > 0
        if device is not None:
            later = ops.logical_or(later, device != 0)
        return loss - ops.cast(later, loss.dtype) * regularization

    def _averaged_objective(self, loss, normalizer, batch_size, length=None):
        """A mean-reduced micro-batch loss, weighted by `normalizer`."""
        mean = _compat.unscale_loss_for_distribution(loss)
        if isinstance(normalizer, int):
            # A static count (JAX's and PyTorch's shapes) multiplies as a
            # constant. (Under `torch.compile` a loss times a tensor 1 came
            # out without a gradient: torch 2.13.)
            factor = float(normalizer)
        else:
            factor = ops.cast(normalizer, mean.dtype)
        normalizer = ops.cast(normalizer, "float32")
        term = _stopped(mean) * normalizer
        if not isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            share = _window.Share(None, normalizer, term, batch_size)
            return mean * factor, share
        # Under loss scaling float16 backpropagation must carry the large
        # batch's magnitudes: a summed objective would overflow at scales
        # the large batch applies. Its mean divides each sample's gradient
        # by the window's size, about `length` times the micro-batch's; the
        # float32 weight gives the factor back.
        # The length of the window this micro-batch belongs to.
        counters = self._window.read()
        scheduled = self._scheduled_length(self.optimizer.iterations, length)
        length = _window.next_window_length(counters, scheduled)
        length = ops.cast(length, mean.dtype)
        weight = normalizer * ops.cast(length, "float32")
        return mean / length, _window.Share(
            weight, normalizer, term, batch_size
        )

    def _regularization_loss(self, dtype):
        losses = [
            _compat.aggregate_additional_loss(self, v) for v in self.losses
        ]
        if not losses:
            return ops.zeros((), dtype)
        total = losses[0]
        for value in losses[1:]:
            total = ops.add(total, value)
        return ops.cast(total, dtype)

    def _plan(self, updates, length=None) -> _window.Plan:
        """How this step adds its micro-batch to the window; `length`: the
        pieces of a split batch, which make its window, else None."""
        return _window.Plan(
            scheduled=self._scheduled_length(updates, length),
            noise_every=self._noise_every(),
            # A split batch's window closes with the batch, always.
            close_at_epoch_end=self._partial_window == "apply"
            and length is None,
            rounds=self._window.rounds,
        )

    def _close_policy(self, loss_scale) -> _window.ClosePolicy:
        """What closing a window does besides applying it; `loss_scale` is
        the scale the window's gradients carry."""
        return _window.ClosePolicy(
            scales_loss=isinstance(
                self.optimizer, keras.optimizers.LossScaleOptimizer
            ),
            noise_every=self._noise_every(),
            loss_scale=loss_scale,
            auto=self._auto(),
            optimizer=self.optimizer,
        )

    def _noise_every(self) -> int:
        """Every how many windows the noise scale is estimated: each one
        under `"auto"`, which steers by it; else as `PseudoBatchLogger`
        asks (0: never)."""
        return 1 if self._auto() is not None else self._noise_scale_every

    def _saved_window_rules(self) -> WindowRules:
        """What a window loaded into this model may hold.

        The step's own rule (`_normalizer.rule`), from the configuration:
        where it leaves the normalizer open (a subclassed model's outputs,
        a layer that may mask), the rule is the looser one that holds in
        every case. Called before the compiled loss may be built (a
        `.keras` file loads its weights right after compiling).
        """
        steps = self._accum_steps
        if isinstance(steps, dict):
            lengths = tuple(steps.values())
        elif callable(steps) or isinstance(steps, AutoAccumSteps):
            lengths = None
        else:
            lengths = (steps,)
        shown = getattr(steps, "__name__", None) if callable(steps) else None
        outputs = getattr(self, "outputs", None)
        entries, maskable = normalizers.static_entries(self)
        rule = normalizers.rule(
            normalizers.reductions(self),
            None if outputs is None else len(outputs),
            entries,
            maskable,
        )
        return WindowRules(shown or repr(steps), lengths, rule)

    # -- Schedules ------------------------------------------------------------

    def _scheduled_length(self, updates, length=None):
        """The window length for `updates`, in the step: a split batch's
        `length` (its pieces), else the callable schedule's.

        None unless one of them is given (the window then takes its length
        from `target_length`).
        """
        if length is not None:
            return ops.cast(length, COUNT_DTYPE)
        if not callable(self._accum_steps):
            return None
        length = ops.cast(self._accum_steps(updates), COUNT_DTYPE)
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
        length = self._check_length_in_step(length, updates, message)
        return ops.maximum(length, 1)

    def _check_length_in_step(self, length, updates, message):
        """Fails for a scheduled `length` < 1 where the step can fail.

        Here for an eager step (PyTorch's); the TensorFlow and JAX trainers
        add their compiled steps.
        """
        if int(length) < 1:
            raise ValueError(f"{message}{int(length)} at update {int(updates)}")
        return length

    def _check_schedule(self):
        """Evaluates a callable schedule once, eagerly, to fail early."""
        if not callable(self._accum_steps):
            return
        optimizer = self.optimizer
        updates = 0 if optimizer is None else int(optimizer.iterations)
        value = self._accum_steps(
            ops.convert_to_tensor(updates, dtype=COUNT_DTYPE)
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
        if steps > MAX_STEPS:
            raise ValueError(
                f"An `accum_steps` callable must return at most {MAX_STEPS} "
                "(2**31 - 1: the window counts in int32). Received: "
                f"accum_steps={self._accum_steps!r} returning {value!r} at "
                f"update {updates}"
            )

    def _set_noise_scale_every(self, every: int) -> None:
        # Part of the traced step: a change retraces it once.
        self._change_settings({"noise_scale_every": every})


# -- Epoch boundaries (told by `_window_epochs.WindowEpochs`) -----------------

# `fit`'s position lives in the window's counters once it exists, in the
# model's `_life` before: one place at a time.


def fit_epoch(model) -> int:
    """The epoch in progress, or once one has ended the next one."""
    if model._window is None:
        return model._life.epoch
    return read_int(model._window.counters.epoch)


def set_steps_per_epoch(model, steps) -> None:
    """Tells the model `fit`'s steps per epoch (0: unknown, or not fitting)."""
    steps = int(steps or 0)
    if model._window is None:
        model._life.steps_per_epoch = steps
    else:
        model._window.counters.steps_per_epoch.assign(steps)


def set_epoch(model, epoch, starts: bool = False) -> None:
    """Tells the model the epoch `fit` is at; where it `starts`, the
    window's target length follows the configuration for it."""
    if model._window is None:
        model._life.epoch = epoch
    else:
        model._window.counters.epoch.assign(epoch)
        model._window.counters.epoch_step.assign(0)
    if starts:
        model._assign_target_length()


def changed_weights_message(model) -> str:
    """Why the step refuses `model`: its trainable weights are not those
    the accumulators were made for."""
    before = set(model._life.refs)
    now = {id(v): v for v in model.trainable_weights}
    added = [v.path for key, v in now.items() if key not in before]
    removed = len(before - set(now))
    unbuilt = [
        layer.name
        for layer in _compat.sublayers(model)
        if layer.built and id(layer) in model._life.unbuilt
    ]
    message = (
        "The model's trainable weights changed since the accumulators "
        f"were created ({len(added)} added: {added}; {removed} removed)."
    )
    if unbuilt:
        return message + (
            f" Layer(s) {unbuilt} were built after training started, "
            "outside the model's forward pass; build them before `fit` "
            "(e.g. call them on a batch), or do not hold them in the "
            "model."
        )
    return message + (
        " Call `compile()` again after changing `trainable`, as Keras requires."
    )


def forward_layers(model) -> list:
    """`model` and the layers its forward pass runs.

    A functional model's are its graph's layers (and theirs, recursively);
    any other layer's, every layer it holds. A functional model may also
    hold layers its graph never calls, such as a KerasHub task's
    `preprocessor` (applied to the data before the model): those may stay
    unbuilt, and hold no weight the step trains, so the window does not
    wait for them.
    """
    if isinstance(model, Functional):
        children = model.layers
    else:
        children = _compat.sublayers(model, include_self=False, recursive=False)
    found = [model]
    for child in children:
        found.extend(forward_layers(child))
    return found


def _stopped(value):
    """`value` as the window's loss term: float32, without gradient."""
    return ops.cast(ops.stop_gradient(value), "float32")


def _element_spec(iterator):
    """The element spec of the data behind a Keras epoch iterator, if any.

    Read from the dataset that Keras's TensorFlow epoch iterator already
    made (under a strategy, the one it distributes). A new one from the
    data adapter (`get_tf_dataset()`) would convert in-memory arrays to
    tensors again: a transient copy of the whole training data, twice its
    size at peak.
    """
    dataset = _compat.source_dataset(iterator)
    return getattr(dataset, "element_spec", None)


def _checked_train_function(model, function):
    """`function`, failing loudly if its step bypassed the window.

    A subclass whose `train_step` never calls `super().train_step(...)`
    (e.g. a GAN with its own optimizers) applies its optimizer on every
    micro-batch: training would go on with no accumulation at all. The
    flag is set when the step is traced (or, eagerly, run), so the check
    costs nothing per step.
    """

    def train_function(*args, **kwargs):
        outputs = function(*args, **kwargs)
        # With one micro-batch per window, a plain step is what
        # `keras.Model` runs: a drop-in with a custom step stays one.
        if not model._life.stepped and model.accum_steps != 1:
            call = f"super().train_step({model._TRAIN_STEP_ARGS})"
            updates = 0
            if getattr(model, "optimizer", None) is not None:
                updates = read_int(model.optimizer.iterations)
            raise RuntimeError(
                f"`{type(model).__name__}.train_step` does not call "
                f"`{call}`, so it never reaches the "
                f"accumulation window: with accum_steps={model.accum_steps!r} "
                "it would update the weights on every micro-batch, without "
                f"accumulating ({updates} optimizer update(s) so far). Call "
                f"`{call}` from a custom `train_step` (and "
                "change only what surrounds it), or subclass `keras.Model` "
                "for a step that updates on every batch, such as a GAN "
                "with its own optimizers."
            )
        return outputs

    return train_function


def _first_length_of(kept: dict, auto: AutoAccumSteps) -> int:
    """The length a recompile's controller goes on from: the one it
    reached, within the (possibly new) bounds."""
    reached = int(kept["target_length"])
    return min(max(reached, auto.min_steps), auto.max_steps)


def _lora_layers_text(model, then: str) -> str:
    """` This model's LoRA layers: 'path' (rank r), ...; <then>` for
    messages; empty without LoRA."""
    lora = [
        f"{layer.path!r} (rank {getattr(layer, 'lora_rank', '?')})"
        for layer in _compat.sublayers(model)
        if getattr(layer, "lora_enabled", False)
    ]
    if not lora:
        return ""
    return f" This model's LoRA layers: {', '.join(lora)}; {then}"
