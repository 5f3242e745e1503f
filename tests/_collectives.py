"""Collective bytes of a compiled JAX step, read from its HLO text.

Shared by the tests (`test_jax_devices.py`, `test_sharding.py`'s worker,
`test_benchmarks.py`) and `benchmarks/bench_communication.py`, which
imports it from here: the bytes a step all-reduces or reduce-scatters,
apart for those inside a conditional's branches (run only when the branch
is taken: an `AccumModel` window's close) and those outside (run on every
micro-batch).
"""

from __future__ import annotations

import re

_BYTES = {"f64": 8, "s64": 8, "f32": 4, "s32": 4, "u32": 4, "f16": 2}
_BYTES.update({"bf16": 2, "pred": 1, "s8": 1, "u8": 1})
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?%?[\w.\-]+ = (.*?) "
    r"(all-reduce|all-reduce-start|reduce-scatter)\("
)
_CALLED = re.compile(
    r"(?:to_apply|calls|body|condition|true_computation|false_computation)"
    r"=%?([\w.\-]+)"
)


def shape_bytes(text: str) -> int:
    """Bytes of the array shapes in an HLO result type (tuples summed)."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        count = 1
        for dim in filter(None, dims.split(",")):
            count *= int(dim)
        total += count * _BYTES[dtype]
    return total


def computations(hlo: str) -> dict:
    """Each computation's name and its lines."""
    found, current = {}, None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            name = (
                line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            )
            current = name.lstrip("%")
            found[current] = []
        elif current is not None:
            found[current].append(line)
    return found


def branch_computations(found: dict) -> set:
    """The computations a conditional's branches run, and what they call."""
    todo = []
    for lines in found.values():
        for line in lines:
            if " conditional(" not in line:
                continue
            match = re.search(r"branch_computations=\{([^}]*)\}", line)
            names = match.group(1).split(",") if match else []
            names += re.findall(
                r"(?:true|false)_computation=%?([\w.\-]+)", line
            )
            todo += [n.strip().lstrip("%") for n in names]
    inside = set()
    while todo:
        name = todo.pop()
        if name in inside:
            continue
        inside.add(name)
        for line in found.get(name, []):
            todo += _CALLED.findall(line)
    return inside


def collective_bytes(hlo: str) -> dict:
    """`{"every_step": bytes, "in_branches": bytes}` of the collectives."""
    found = computations(hlo)
    inside = branch_computations(found)
    totals = {"every_step": 0, "in_branches": 0}
    for name, lines in found.items():
        for line in lines:
            match = _COLLECTIVE.match(line)
            if match:
                key = "in_branches" if name in inside else "every_step"
                totals[key] += shape_bytes(match.group(1))
    return totals


def compiled_step(model, x, y, donate: bool = False):
    """`model`'s train step (built, under the current `keras.distribution`
    or on one device) jitted and compiled as `fit` compiles it, on
    `(x, y)`; with `donate`, the state's buffers donated, as `fit` does."""
    import jax
    import keras

    state = model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
    )
    distribution = keras.distribution.distribution()
    if distribution is None:  # One device: as `fit` jits it there.
        step = jax.jit(model.train_step, donate_argnums=0 if donate else ())
        return step.lower(state, (x, y)).compile()
    layout = distribution.get_data_layout
    data = tuple(
        jax.device_put(a, layout(a.shape).backend_layout) for a in (x, y)
    )
    step = jax.jit(
        model.train_step,
        donate_argnums=0 if donate else (),
        out_shardings=(None, model._get_state_sharding_spec()),
    )
    return step.lower(state, data).compile()


def step_bytes(model, x, y) -> dict:
    """`collective_bytes` of `model`'s compiled train step on `(x, y)`."""
    return collective_bytes(compiled_step(model, x, y).as_text())
