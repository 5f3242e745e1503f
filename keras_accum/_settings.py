"""The model's settings, each declared once.

`SETTINGS` holds one `Setting` per setting of `AccumModel` (`accum_steps`,
`partial_window`, `micro_batch_size`, `accumulator_dtype`, and the internal
`noise_scale_every`), and `RULES` the checks across settings. Every way a
setting comes in, is kept, saved or copied derives from them: the
constructor's and `from_model`'s validation (`checked`), the constructor's
keyword arguments (a test checks that the explicit signature matches the
table), `get_config`/`from_config` (`to_config`, `from_config`),
`clone_model` and wrapped models (the values the model keeps, passed on),
and the property setters with their "refused while a window is open" rules
(`AccumTrainer._change_settings`). A new setting is a row here, a keyword
of the constructor and `from_model`, and a property.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras

from keras_accum._schedules import (
    deserialize_accum_steps,
    serialize_accum_steps,
)
from keras_accum._validation import (
    check_accum_schedule,
    check_accumulator_dtype,
    check_micro_batch_size,
    check_partial_window,
    check_split_mode,
    check_whole_batch_loss,
    check_whole_batch_loss_mode,
)
from keras_accum.auto import AutoAccumSteps, AutoMicroBatch


def _as_is(value, custom_objects=None):
    del custom_objects  # Only for the signature `from_config` shares.
    return value


def _traced_schedule(old, new) -> bool:
    # A callable schedule and `"auto"`'s controller are traced into the
    # step; an int or an epoch schedule is a variable's value.
    return any(callable(v) or isinstance(v, AutoAccumSteps) for v in (old, new))


def _micro_batch_size_to_config(value):
    if isinstance(value, AutoMicroBatch):
        return keras.saving.serialize_keras_object(value)
    return value


def _micro_batch_size_from_config(value, custom_objects=None):
    if isinstance(value, dict):
        return keras.saving.deserialize_keras_object(
            value, custom_objects=custom_objects
        )
    return value


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting of `AccumModel`.

    Attributes:
        name: The keyword argument, the property and the config key. The
            model keeps the value as `_<name>` (`attribute`).
        default: The constructor's default; also a config's that lacks the
            key (one saved before the setting existed).
        check: `check(value)` returns the value as the model keeps it
            (`"auto"` becomes an object, a dtype object its name), or
            raises naming the setting and the value.
        public: A keyword argument of the constructor and `from_model`, a
            property with a setter, a config entry, and copied by
            `clone_model`. An internal setting is none of these: the
            package sets it, and a new model starts at `default`.
        traced: Whether the compiled train step (and the flush) read the
            setting, so that a change drops them to be traced anew; or
            `traced(old, new)`, for the values where they do.
        split: Whether the compiled test and predict steps read it too
            (they split the batch): a change drops them and the sizes
            chosen so far.
        while_open: None where a change may come with a window open (it
            applies from the next window); else what the open window
            holds that the change would lose, for the refusal's message.
        changed: The name of the model's method (no arguments) that a
            change calls, after the new value is kept; or None.
        every_set: Whether a value equal to the one kept still counts as
            a change (`changed` re-reads it).
        to_config: The kept value as a plain (JSON) config value.
        from_config: `from_config(value, custom_objects)`: the value a
            config entry holds, as `check` takes it.
    """

    name: str
    default: Any
    check: Callable[[Any], Any]
    public: bool = True
    traced: bool | Callable[[Any, Any], bool] = True
    split: bool = False
    while_open: str | None = None
    changed: str | None = None
    every_set: bool = False
    to_config: Callable[[Any], Any] = _as_is
    from_config: Callable[..., Any] = _as_is

    @property
    def attribute(self) -> str:
        return f"_{self.name}"

    def retraces(self, old, new) -> bool:
        if callable(self.traced):
            return self.traced(old, new)
        return self.traced


@dataclasses.dataclass(frozen=True)
class Rule:
    """A check across settings: `check(*values)`, the values of `names` in
    order, raises naming them where they do not go together."""

    names: tuple[str, ...]
    check: Callable[..., None]


SETTINGS = (
    Setting(
        "accum_steps",
        default=1,
        check=check_accum_schedule,
        traced=_traced_schedule,
        changed="_assign_target_length",
        every_set=True,
        to_config=serialize_accum_steps,
        from_config=deserialize_accum_steps,
    ),
    # The policy is part of the traced step.
    Setting("partial_window", default="apply", check=check_partial_window),
    Setting(
        "micro_batch_size",
        default=None,
        check=check_micro_batch_size,
        split=True,
        while_open="in it",
        to_config=_micro_batch_size_to_config,
        from_config=_micro_batch_size_from_config,
    ),
    Setting(
        "accumulator_dtype",
        default=None,
        check=check_accumulator_dtype,
        # Read when the window is created: where it exists it is made anew.
        while_open="summed in the current accumulators",
        changed="_remake_accumulators",
    ),
    Setting(
        "whole_batch_loss",
        default=False,
        check=check_whole_batch_loss,
        # The test step computes its loss on the whole batch too.
        split=True,
        while_open="in it",
    ),
    # How often the step estimates the noise scale: set by `fit` from its
    # callbacks (`PseudoBatchLogger`), 0 when none asks.
    Setting("noise_scale_every", default=0, check=int, public=False),
)

RULES = (
    Rule(("accum_steps", "micro_batch_size"), check_split_mode),
    Rule(("micro_batch_size", "whole_batch_loss"), check_whole_batch_loss_mode),
)

BY_NAME = {setting.name: setting for setting in SETTINGS}
PUBLIC = tuple(setting for setting in SETTINGS if setting.public)
# The constructor's own keyword arguments, named in its errors.
PUBLIC_NAMES = tuple(setting.name for setting in PUBLIC)


def given(namespace: dict) -> dict:
    """The public settings in `namespace` (a constructor's `locals()`)."""
    return {name: namespace[name] for name in PUBLIC_NAMES}


def checked(values: dict, kept: dict | None = None) -> dict:
    """`values` as the model keeps them, checked each and with the rules
    that read any of them (the others' values from `kept`, else their
    defaults); or raises."""
    values = {name: BY_NAME[name].check(v) for name, v in values.items()}
    every = with_defaults({**(kept or {}), **values})
    for rule in RULES:
        if any(name in values for name in rule.names):
            rule.check(*(every[name] for name in rule.names))
    return values


def with_defaults(values: dict) -> dict:
    """Every setting: those in `values`, the others at their defaults."""
    return {s.name: values.get(s.name, s.default) for s in SETTINGS}


def to_config(values: dict) -> dict:
    """The config entries of the public settings among `values`."""
    return {s.name: s.to_config(values[s.name]) for s in PUBLIC}


def from_config(config: dict, custom_objects=None) -> dict:
    """Takes the public settings out of `config` (changed in place), as
    `check` takes them; a missing one at its default."""
    return {
        s.name: s.from_config(config.pop(s.name, s.default), custom_objects)
        for s in PUBLIC
    }
