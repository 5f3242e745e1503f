"""`accum_steps` schedules in a model's config: saved and loaded.

An int is saved as it is, an epoch schedule as a dict with string keys
(JSON), an `AutoAccumSteps` as Keras saves objects, and a callable as
Keras saves functions: a registered function by name, a lambda as its code
(loaded only with `safe_mode=False`).
"""

from __future__ import annotations

import builtins
import dis
import types

import keras

from keras_accum._validation import check_accum_schedule
from keras_accum.auto import AutoAccumSteps

# What a saved lambda may use besides Python's builtins without being given
# it: the schedules guide writes them with `keras.ops`.
_LAMBDA_GLOBALS = {"keras": keras}


def serialize_accum_steps(accum_steps):
    """`accum_steps` as a plain config value."""
    if isinstance(accum_steps, dict):
        # JSON keys are strings; `check_accum_schedule` reads them back.
        return {str(epoch): steps for epoch, steps in accum_steps.items()}
    if callable(accum_steps) or isinstance(accum_steps, AutoAccumSteps):
        return keras.saving.serialize_keras_object(accum_steps)
    return accum_steps


def deserialize_accum_steps(value, custom_objects=None):
    """The schedule a config value saved by `serialize_accum_steps` holds.

    Raises:
        ValueError: If a saved lambda uses a global name that is neither
            `keras`, a builtin nor given in `custom_objects` (or
            registered): it would fail with a `NameError` in the first
            `fit` otherwise.
    """
    if not (isinstance(value, dict) and "class_name" in value):
        return check_accum_schedule(value)
    steps = keras.saving.deserialize_keras_object(
        value, custom_objects=custom_objects
    )
    if value["class_name"] == "__lambda__":
        steps = _with_its_globals(steps, custom_objects)
    return steps


def _with_its_globals(function, custom_objects):
    """A loaded lambda, with the global names its code uses.

    Keras loads a lambda's code with the globals of its own loader module,
    where the names of the module that defined it (`keras`, `np`, ...) do
    not exist.
    """
    found = dict(_LAMBDA_GLOBALS)
    missing = []
    for name in sorted(_global_names(function.__code__)):
        if name in found or hasattr(builtins, name):
            continue
        given = (custom_objects or {}).get(name)
        if given is None:
            given = keras.saving.get_registered_object(name)
        if given is None:
            missing.append(name)
        else:
            found[name] = given
    if missing:
        raise ValueError(
            "The saved `accum_steps` lambda uses "
            f"{', '.join(f'`{name}`' for name in missing)}, which a loaded "
            "lambda does not have: Keras saves a lambda's code, not the "
            "module it was written in (only `keras` and Python's builtins "
            "are provided). Pass the object(s) when loading, e.g. "
            f"`load_model(path, safe_mode=False, custom_objects={{"
            f"{missing[0]!r}: ...}})`, or schedule with a function "
            "registered with `@keras.saving.register_keras_serializable()` "
            "or an epoch schedule (a dict), which save by name. Received: "
            f"accum_steps={function!r}"
        )
    return types.FunctionType(
        function.__code__,
        {"__builtins__": builtins, **found},
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )


def _global_names(code) -> set:
    """The global names `code` (and code nested in it) reads."""
    names = {
        instruction.argval
        for instruction in dis.get_instructions(code)
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME")
    }
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _global_names(constant)
    return names
