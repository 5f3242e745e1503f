"""How an accumulation window is saved: one format on every backend.

A model saved with a window open (between two updates) keeps the window:
`.keras` files, `save_weights` and `BackupAndRestore` carry the
accumulators and counters, under the same keys whichever backend wrote
them, so a file saved on TensorFlow resumes on JAX and the other way round.

Loading checks the whole saved window before it assigns anything: every
entry present and known, of the dtype and shape this release writes, and
every counter and total within what training can produce, given the
loading model's loss (`WindowRules`). A damaged file, or one written by an
incompatible release, fails there with the entry, its value and the file,
instead of resuming into a window that trains differently.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
import zipfile
from typing import NamedTuple

import numpy as np

from keras_accum import _codecs
from keras_accum._compat import KerasSaveable
from keras_accum._normalizer import LossRule
from keras_accum._window_fields import (
    ACC_DTYPE,
    COUNT_DTYPE,
    FORMAT_VERSION,
    INT_MAX,
    SAVED,
    SAVED_UNDER,
    accumulator_key,
    is_accumulator_key,
)
from keras_accum._window_log import read_array

# Saved besides the accumulators (`acc_grad_0`, `acc_grad_1`, ...): the
# fields `_window_fields.FIELDS` marks saved (the window's float32 totals,
# 0 between windows, its int32 counters, and `accum_steps="auto"`'s
# controller, 0 without one), and the layout's `format_version`.
SAVED_COUNTERS = tuple(field.name for field in SAVED)
SAVED_INTS = tuple(f.name for f in SAVED if f.dtype == COUNT_DTYPE)
SAVED_FLOATS = tuple(f.name for f in SAVED if f.dtype == ACC_DTYPE)
SAVED_TOTALS = tuple(f.name for f in SAVED if f.summed)
SAVED_INT_DTYPES = (COUNT_DTYPE,)
# An accumulator's: each codec's dtype (`_codecs`: float32, bfloat16);
# any loads into any.
ACC_DTYPES = _codecs.DTYPES
VERSION_KEY = "format_version"
# Float32 sums of whole numbers are exact below 2**24; above, a window's
# two sums of the same counts may round differently.
_COUNT_RTOL = 1e-5

_REMEDY = (
    "The file is damaged, or was not written by this version of "
    "keras-accum. To keep the weights and drop the window, load the file "
    "into the equivalent plain `keras.Model` with `load_weights()`."
)


class WindowRules(NamedTuple):
    """What the loading model allows in a saved window.

    Attributes:
        accum_steps: The model's `accum_steps`, as messages show it.
        lengths: The lengths an open window may have: `accum_steps`, or
            its schedule's values; None for any (a callable schedule).
        rule: How an open window's normalizer total relates to its
            samples: the loading model's `_normalizer.LossRule`, the one
            its step computes normalizers by.
    """

    accum_steps: str = "?"
    lengths: tuple | None = None
    rule: LossRule = LossRule("weights")


class SavedWindow(KerasSaveable):
    """The saving half of a backend's window state.

    Subclasses hold `acc_grads` (one accumulator per trainable weight),
    `codecs` (each one's `_codecs.AccumulatorCodec`) and `counters`, with
    a variable for each name in `SAVED_COUNTERS`. The model tells it
    `load_rules`, a callable returning its `WindowRules`, `check_load`
    and `after_load` (`connect`); other modules reach it
    through the methods below, never by setting its attributes.

    Where `partial_sums` is set (JAX under a `keras.distribution`), each
    accumulator has a leading axis of devices, each holding its partial
    sum of the window, and `partial_sums(accumulator)` is their sum as a
    NumPy array. The file holds that sum, the weight's shape, so that it
    loads on any number of devices; a load puts it on the first device
    and zeros on the others.
    """

    load_rules = None
    partial_sums = None
    # Called with the checked entries of a saved window (as
    # `check_saved_window` returns them) before any is assigned: the
    # model's own checks, which may warn or raise and leave the window as
    # it was.
    check_load = None
    # Called with no arguments once a saved window has loaded: the model
    # sets the length of the windows to come from its own `accum_steps`
    # (kept from the file only under `accum_steps="auto"`).
    after_load = None
    # Set by `check_file` for the load that follows it, whose own check
    # then keeps quiet: the warning it would repeat was given already.
    _checked_file = False
    # `(epoch, epoch_step)` of the last window loaded, for a restart's check
    # of the epoch it resumes (`_window_epochs.WindowResume`); None until
    # one loads.
    loaded_position = None

    # -- What other modules tell or ask the saved window -------------------

    def connect(self, load_rules, after_load, check_load=None) -> None:
        """The owning model's `load_rules`, `after_load` and `check_load`
        (above), told once when it creates the window."""
        self.load_rules, self.after_load = load_rules, after_load
        self.check_load = check_load

    def hold_partial_sums(self, summed) -> None:
        """Marks the accumulators as per-device partial sums (JAX under a
        `keras.distribution`); `summed(accumulator)` adds them up."""
        self.partial_sums = summed

    def take_loaded_position(self):
        """`loaded_position`, once: None again until the next load."""
        position, self.loaded_position = self.loaded_position, None
        return position

    def end_load(self) -> None:
        """Ends a load `check_file` checked: the next one checks again."""
        self._checked_file = False

    def _obj_type(self):
        # Keras accepts only its own kinds here; it decides which attributes
        # the saver skips when walking for children, and this has none.
        return "Loss"

    def save_own_variables(self, store):
        for i, (acc, codec) in enumerate(
            zip(self.acc_grads, self.codecs, strict=True)
        ):
            if self.partial_sums:
                acc = self.partial_sums(acc)
            store[accumulator_key(i)] = codec.saved(acc)
        for name in SAVED_COUNTERS:
            store[name] = self.counters.get(name)
        store[VERSION_KEY] = np.asarray(FORMAT_VERSION, COUNT_DTYPE)

    def load_own_variables(self, store):
        if not list(store.keys()):
            # Saved before any training, or by a plain model: start fresh.
            return
        checked, self._checked_file = self._checked_file, False
        with warnings.catch_warnings():
            if checked:
                warnings.simplefilter("ignore")
            values = check_saved_window(store, self._shapes(), self._rules())
        if self.check_load is not None:
            self.check_load(values)
        # Only once every check passed: no half-loaded window.
        for i, (acc, codec) in enumerate(
            zip(self.acc_grads, self.codecs, strict=True)
        ):
            if accumulator_key(i) not in values:
                break  # a closed window of another trainable set
            # As the accumulator's codec stores it: a file of float32
            # accumulators loads into bfloat16 ones (rounded to nearest,
            # once) and back.
            value = codec.loaded(values[accumulator_key(i)])
            if self.partial_sums:
                value = np.concatenate(
                    [value[None], np.zeros((acc.shape[0] - 1, *value.shape))]
                ).astype(value.dtype)
            acc.assign(value)
        for name in SAVED_COUNTERS:
            if name in values:  # Else a field newer than the file's layout.
                self.counters.get(name).assign(values[name])
        self.loaded_position = (
            int(values["epoch"]),
            int(values["epoch_step"]),
        )
        if self.after_load is not None:
            self.after_load()

    def check_file(self, filepath) -> None:
        """Checks the window saved in a weights or `.keras` file.

        Run by `AccumModel.load_weights` before Keras assigns anything: Keras
        loads the layers' weights before the window, so a window that fails
        only there would leave the model half loaded. Reads the entries'
        dtypes and shapes and the scalars, not the accumulators' values.
        Formats it does not read (sharded or NumPy weights) are checked as
        the window loads.
        """
        if check_window_file(filepath, self._shapes(), self._rules()):
            self._checked_file = True

    def _shapes(self):
        first = 1 if self.partial_sums else 0
        return [tuple(acc.shape)[first:] for acc in self.acc_grads]

    def _rules(self):
        return self.load_rules() if self.load_rules else WindowRules()


def check_window_file(
    filepath, shapes, rules: WindowRules, changed=None
) -> dict | None:
    """The window saved in a weights or `.keras` file, checked
    (`check_saved_window`, with `changed`); None where the file holds
    none, or has a format this does not read (sharded or NumPy weights:
    checked as the window loads)."""
    where = f" in {os.fspath(filepath)}"
    with _weights_h5(filepath) as h5:
        if h5 is None:
            return None
        return _check_group(h5, shapes, rules, where, changed)


def saved_optimizer_shapes(filepath) -> list | None:
    """The shapes of the optimizer variables saved in a weights or
    `.keras` file, in Keras's order; None where it holds none or has a
    format this does not read."""
    with _weights_h5(filepath) as h5:
        group = None if h5 is None else h5.get("optimizer/vars")
        if group is None:
            return None
        keys = sorted(group.keys(), key=lambda key: int(key))
        return [tuple(group[key].shape) for key in keys]


@contextlib.contextmanager
def _weights_h5(filepath):
    """The H5 file of a `.weights.h5` or `.keras` file, open; None for
    other formats."""
    path = os.fspath(filepath)
    try:
        import h5py
    except ImportError:  # Keras reads H5 with it; nothing to check.
        yield None
        return
    if path.endswith(".weights.h5"):
        with h5py.File(path, "r") as h5:
            yield h5
        return
    if path.endswith(".keras") and zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            if "model.weights.h5" in archive.namelist():
                with archive.open("model.weights.h5") as member:
                    with h5py.File(member, "r") as h5:
                        yield h5
                return
    yield None


def _check_group(h5, shapes, rules, where, changed):
    # Keras's layout: each object's entries under `<path>/vars`.
    group = h5.get(f"{SAVED_UNDER}/vars")
    if group is None or not list(group.keys()):
        return None
    return check_saved_window(group, shapes, rules, where, changed)


def saved_for_other_weights(filepath, shapes, rules: WindowRules) -> str:
    """How the trainable weights of the model that saved the window in
    `filepath` differ from `shapes` (this model's); empty where they do
    not, or the file holds no window. Raises as `check_saved_window`,
    also where that window is open and was saved for other weights."""
    found = []

    def changed(mismatch, mini_step, where):
        if mini_step:
            _trainable_set_changed(mismatch, mini_step, where)  # raises
        found.append(mismatch)

    check_window_file(filepath, shapes, rules, changed)
    return found[0] if found else ""


def check_saved_window(
    store, shapes, rules: WindowRules, where=None, changed=None
) -> dict:
    """The saved window's entries, each checked.

    Args:
        store: What Keras passes to `load_own_variables` (an H5 group or a
            dict of arrays).
        shapes: The accumulators' shapes, one per trainable weight.
        rules: The loading model's `WindowRules`.
        where: ` in <file>` for messages; by default what `store` tells.
        changed: Called as `changed(mismatch, mini_step, where)` where the
            accumulators do not match the trainable weights, instead of
            the warning or error below; by default those.

    Returns:
        A dict from entry name to its value: the accumulators as `store`
        gives them (an H5 dataset is not read), the rest as NumPy arrays.
        Where the accumulators do not match the loading model's trainable
        weights and the window was closed, without the accumulators (and
        with a `UserWarning`).

    Raises:
        ValueError: if an entry is missing or unknown, has another dtype or
            shape than this release saves, or a value training cannot
            produce; or the window was open and its accumulators do not
            match the trainable weights. The message names the entry, its
            value and, where Keras tells, the file.
    """
    if where is None:
        where = _where(store)
    keys = [str(key) for key in store.keys()]
    version = _check_version(store, keys, where)
    saved = [key for key in keys if is_accumulator_key(key)]
    _check_keys(
        [key for key in keys if key not in saved and key != VERSION_KEY],
        where,
        version,
    )
    values = {}
    for name in SAVED_FLOATS:
        values[name] = _read(store, name, (ACC_DTYPE,), (), where)
    for name in SAVED_INTS:
        if name in keys:
            values[name] = _read(store, name, SAVED_INT_DTYPES, (), where)
    _check_values(values, rules, where)
    expected = [accumulator_key(i) for i in range(len(shapes))]
    mismatch = _trainable_mismatch(store, saved, expected, shapes)
    if mismatch:
        changed = changed or _trainable_set_changed
        changed(mismatch, int(values["mini_step"]), where)
        # A closed window: the next micro-batch overwrites the
        # accumulators, which are left as they are.
        return values
    for name, shape in zip(expected, shapes, strict=True):
        values[name] = _read(store, name, ACC_DTYPES, shape, where)
    return values


def _check_version(store, keys, where):
    """The file's layout is one this release reads: `format_version` from
    1 to `FORMAT_VERSION`, or absent (files written before it was
    recorded, whose layout is version 1's). Returns the version."""
    if VERSION_KEY not in keys:
        return 1
    value = _read(store, VERSION_KEY, SAVED_INT_DTYPES, (), where)
    version = int(value)
    if version > FORMAT_VERSION:
        raise ValueError(
            f"The saved accumulation window{where} has `{VERSION_KEY}` = "
            f"{version}, a layout newer than this release of keras-accum "
            f"reads (versions 1 to {FORMAT_VERSION}). Upgrade keras-accum "
            "to load it, or, to keep the weights and drop the window, load "
            "the file into the equivalent plain `keras.Model` with "
            "`load_weights()`."
        )
    if version < 1:
        raise ValueError(
            f"The saved accumulation window entry `{VERSION_KEY}` = "
            f"{version} is outside 1..{FORMAT_VERSION}{where}. {_REMEDY}"
        )
    return version


def _check_keys(keys, where, version):
    """The saved counters of the file's `version`, each present, and no
    entry this release does not write."""
    missing = [
        f.name for f in SAVED if f.since <= version and f.name not in keys
    ]
    unknown = sorted(key for key in keys if key not in SAVED_COUNTERS)
    if not missing and not unknown:
        return
    parts = []
    if missing:
        parts.append(f"missing {_names(missing)}")
    if unknown:
        parts.append(f"unknown {_names(unknown)}")
    raise ValueError(
        f"The saved accumulation window{where} does not have the entries "
        f"this version of keras-accum saves: {', '.join(parts)}. {_REMEDY}"
    )


def _trainable_mismatch(store, saved, expected, shapes):
    """How the saved accumulators differ from the loading model's
    trainable weights, for messages; empty where they match."""
    parts = []
    missing = [key for key in expected if key not in saved]
    unknown = sorted(key for key in saved if key not in expected)
    if missing:
        parts.append(f"missing {_names(missing)}")
    if unknown:
        parts.append(f"unknown {_names(unknown)}")
    for name, shape in zip(expected, shapes, strict=True):
        if name in saved:
            found = tuple(getattr(store[name], "shape", np.shape(store[name])))
            if found != tuple(shape):
                parts.append(
                    f"`{name}` of shape {found} where this model's is "
                    f"{tuple(shape)}"
                )
    if not parts:
        return ""
    if len(parts) > 3:
        parts[3:] = [f"{len(parts) - 3} more differences"]
    return (
        f"{len(saved)} gradient accumulators where this model has "
        f"{len(expected)} trainable weights ({'; '.join(parts)})"
    )


def _trainable_set_changed(mismatch, mini_step, where):
    """Warns where the window was closed (its accumulators are stale: the
    next micro-batch overwrites them); raises where it was open."""
    causes = (
        "A KerasHub backbone with LoRA enabled (`enable_lora`) reloads "
        "without LoRA, since its config does not record it: Keras folded "
        "the LoRA update into each kernel when it saved, so the loaded "
        "model computes what the saved one did, with its whole kernels "
        "trainable. Layers frozen or unfrozen since the save, or a model "
        "of another architecture, change the trainable set too."
    )
    if mini_step == 0:
        warnings.warn(
            f"The saved accumulation window{where} holds {mismatch}: the "
            "trainable weights changed since the file was saved. The "
            "window was closed (no micro-batch waiting to be applied), so "
            "nothing is lost: its counters load and the next window "
            f"starts afresh. {causes} To train LoRA only again, call "
            "`enable_lora(rank)` on the loaded backbone and compile.",
            stacklevel=5,
        )
        return
    raise ValueError(
        f"The saved accumulation window{where} is open ({mini_step} "
        f"micro-batch{'' if mini_step == 1 else 'es'} not yet applied) and "
        f"holds {mismatch}: the "
        "trainable weights changed since the file was saved, so its "
        f"gradients cannot be matched to this model's weights. {causes} "
        "Ways on: rebuild the model as it was trained (`enable_lora(rank)` "
        "on the backbone, the same `trainable` flags), compile it and "
        "`load_weights()` the file into it; or, in the run that saves, "
        "call `apply_partial_window()` before saving, so that the file "
        "holds no open window. To keep the weights and drop the window, "
        "load the file into the equivalent plain `keras.Model` with "
        "`load_weights()`."
    )


def _names(keys):
    return ", ".join(f"`{key}`" for key in keys)


def _read(store, name, dtypes, shape, where):
    value = store[name]
    if shape != ():
        # Dtype and shape only: an H5 dataset's values stay on disk.
        value = value if hasattr(value, "dtype") else np.asarray(value)
    else:
        value = np.asarray(value)
    if _dtype_name(value) not in dtypes:
        raise ValueError(
            f"The saved accumulation window entry `{name}` = "
            f"{_show(value)}{where} has dtype {_dtype_name(value)}; "
            f"keras-accum saves it as {' or '.join(dtypes)}. {_REMEDY}"
        )
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"The saved accumulation window entry `{name}`{where} has shape "
            f"{value.shape}, where this model's is {tuple(shape)}; load it "
            "into the same architecture."
        )
    return value


def _dtype_name(value) -> str:
    # Keras writes a bfloat16 array to H5 as raw 16-bit values marked by
    # a `dtype` attribute (`saving_lib.H5IOStore`).
    attrs = getattr(value, "attrs", None)
    if attrs is not None and attrs.get("dtype") == "bfloat16":
        return "bfloat16"
    return value.dtype.name


def warn_if_lora_reset(layers, trainable_variables, values) -> None:
    """Warns where a load leaves LoRA factors at zero while the open window
    it restores holds gradients for them.

    Keras saves a LoRA layer's kernel with the LoRA update folded in and,
    on loading, sets the factors to zero (`Dense.load_own_variables`): the
    window's gradients then belong to factors that no longer exist, and
    training goes on differently from an uninterrupted run, as a plain
    model resumed the same way does. Keras loads the layers before the
    window: run on the window's checked `values` (`check_saved_window`),
    before any of them is assigned, so that a warning turned into an
    error (`-W error`) leaves the window as it was.
    """
    mini_step = int(values["mini_step"])
    if mini_step == 0:
        return
    index = {id(v): i for i, v in enumerate(trainable_variables)}
    reset = []
    for layer in layers:
        if not getattr(layer, "lora_enabled", False):
            continue
        factors = [
            v
            for v in layer.trainable_weights
            if v.name.startswith("lora_") and id(v) in index
        ]
        if not factors or any(np.any(read_array(v)) for v in factors):
            continue
        held = [values.get(accumulator_key(index[id(v)])) for v in factors]
        if any(h is not None and np.any(np.asarray(h)) for h in held):
            reset.append(layer.path)
    if reset:
        warnings.warn(
            f"The LoRA factors of {', '.join(map(repr, reset))} are zero "
            "after loading, while the accumulation window loaded with them "
            f"is open ({mini_step} micro-batch{'' if mini_step == 1 else 'es'} "
            "not yet applied) and holds "
            "their gradients: Keras folds the LoRA update into the kernel "
            "when it saves weights and sets the factors to zero when it "
            "loads them. Training from here differs from an uninterrupted "
            "run (as a plain `keras.Model` resumed this way does), and the "
            "factors, both zero, get no gradient again. Checkpoint LoRA "
            "training at window ends (`apply_partial_window()` before "
            "saving) and keep the adapters with KerasHub's "
            "`save_lora_weights()`; see the fine-tuning guide.",
            stacklevel=2,
        )


def _check_values(values, rules, where):
    ints = {name: int(values[name]) for name in SAVED_INTS if name in values}
    totals = {name: float(values[name]) for name in SAVED_TOTALS}
    context = f"accum_steps={rules.accum_steps}"

    def fail(name, value, allowed, why="", exact=False):
        expected = f"not {allowed}" if exact else f"outside {allowed}"
        raise ValueError(
            f"The saved accumulation window entry `{name}` = {value!r} is "
            f"{expected} ({why or context}){where}. {_REMEDY}"
        )

    # A window's length is at least 1: a schedule's values are checked,
    # and a callable's are clamped to 1 in the step.
    length = ints["window_length"]
    if not 1 <= length <= INT_MAX:
        fail("window_length", length, f"1..{INT_MAX}")
    if ints["mini_step"] > 0 and rules.lengths and length not in rules.lengths:
        # An open window's length was fixed when it started, by
        # `accum_steps` then. A run that changed `accum_steps` mid-window
        # (a callback, then a backup) saves such a window legitimately, and
        # a restart builds the model with the first value: loaded as saved,
        # said aloud in case the file is damaged instead. (Between windows
        # the next one takes the length from the model: harmless there.)
        allowed = " or ".join(str(n) for n in sorted(set(rules.lengths)))
        warnings.warn(
            f"The saved accumulation window entry `window_length` = {length} "
            f"is not {allowed} ({context}){where}: the open window "
            f"({ints['mini_step']} micro-batches in) closes after {length} "
            "micro-batches, the length it started with; the next windows "
            "take `accum_steps`. Expected when `accum_steps` changed in the "
            "middle of a window before the file was saved; otherwise the "
            "file is damaged.",
            stacklevel=4,
        )
    mini_step = ints["mini_step"]
    if not 0 <= mini_step < length:
        # A window closes when `mini_step` reaches its length.
        fail(
            "mini_step",
            mini_step,
            f"0..{length - 1}",
            f"window_length={length}, {context}",
        )
    _check_ranges(values, fail)
    if mini_step == 0:
        # An empty window: closing one resets its totals to 0.
        for name, value in totals.items():
            if value != 0.0:
                fail(name, value, "0", "an empty window: mini_step=0", True)
        return
    samples = totals["acc_samples"]
    if not (math.isfinite(samples) and samples >= 0 and samples.is_integer()):
        fail("acc_samples", samples, "the whole numbers >= 0")
    if totals["acc_grad_sq"] < 0:
        # A sum of squares; NaN or inf where gradients overflowed.
        fail("acc_grad_sq", totals["acc_grad_sq"], "the numbers >= 0")
    _check_normalizer(totals["acc_normalizer"], samples, rules, fail)


def _check_ranges(values, fail):
    """Each saved field within the range `_window_fields.FIELDS` gives it.

    `auto_trace` and `auto_grad_sq`, moving averages of unbiased
    estimates, may be negative but not infinite; `auto_progress`, a sum of
    gains >= 1, is finite and not negative.
    """
    for field in SAVED:
        if field.low is None and field.high is None and not field.finite:
            continue
        if field.name not in values:  # Newer than the file's layout.
            continue
        value = values[field.name]
        value = int(value) if field.dtype == COUNT_DTYPE else float(value)
        low = -math.inf if field.low is None else field.low
        high = math.inf if field.high is None else field.high
        if math.isfinite(value) and low <= value <= high:
            continue
        if field.dtype == COUNT_DTYPE:
            allowed = f"{field.low}..{field.high}"
        elif field.low is None:
            allowed = "the finite numbers"
        else:
            allowed = f"the finite numbers >= {field.low:g}"
        fail(field.name, value, allowed, field.why)


def _check_normalizer(normalizer, samples, rules, fail):
    rule = rules.rule
    if rule.kind == "weights":
        return
    why = f"acc_samples={samples:g}, {_describe(rules)}"
    if rule.kind == "zero":
        if normalizer != 0.0:
            fail("acc_normalizer", normalizer, "0", why, exact=True)
        return
    if rule.kind in ("samples", "entries"):
        per_sample = 1 if rule.kind == "samples" else rule.entries
        target = samples * per_sample
        if not math.isclose(normalizer, target, rel_tol=_COUNT_RTOL):
            fail("acc_normalizer", normalizer, f"{target:g}", why, exact=True)
        return
    # "counted": entries the loss averaged over, fewer where masked.
    upper = math.inf if rule.entries is None else samples * rule.entries
    lower = 0.0
    if not rule.maskable and samples > 0:
        lower = math.nextafter(0.0, 1.0)
    if not (lower <= normalizer <= upper * (1 + _COUNT_RTOL)):
        allowed = f"{lower:g}..{upper:g}" if lower == 0 else f"(0, {upper:g}]"
        fail("acc_normalizer", normalizer, allowed, why)


def _describe(rules):
    """Why the normalizer has the range it has, for messages."""
    rule = rules.rule
    return {
        "zero": "the loss sums, so a window adds no normalizer",
        "samples": "the normalizer counts samples",
        "entries": (
            f"the loss averages {rule.entries} "
            f"{'entry' if rule.entries == 1 else 'entries'} per sample and "
            "no layer masks"
        ),
        "counted": "the normalizer counts the entries the loss averages",
    }[rule.kind] + f"; accum_steps={rules.accum_steps}"


def _show(value):
    if len(value.shape) == 0:
        value = np.asarray(value)
        item = value.item()
        if isinstance(item, bytes):
            item = item.decode(errors="replace")
        return repr(item)
    return f"<array of shape {value.shape}>"


def _where(store):
    """` in <file>` where Keras's store tells which file it reads.

    A `.keras` file's weights are read from memory or from a temporary
    copy of its `model.weights.h5`: neither names the file.
    """
    archive = getattr(store, "archive", None)
    name = getattr(archive, "filename", None)
    if name:
        return f" in {name}"
    path = getattr(store, "path_or_io", None)
    if path is None:
        path = getattr(getattr(store, "h5_file", None), "filename", None)
    if isinstance(path, (str, os.PathLike)):
        path = os.fspath(path)
        if os.path.basename(path) != "model.weights.h5" and os.path.exists(
            path
        ):
            return f" in {path}"
    return ""
