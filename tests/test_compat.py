"""The tested Keras range: declared once, checked at import, and honest."""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import keras
import pytest

from keras_accum import _compat, _settings

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version", ["3.9.2", "3.16.0", "4.0.0", "2.15.0"])
def test_an_untested_keras_warns_naming_the_range_and_the_version(version):
    with pytest.warns(UserWarning) as record:
        _compat.warn_if_untested(version)
    message = str(record[0].message)
    assert "keras>=3.10,<3.16" in message
    assert f"Keras {version}." in message


@pytest.mark.parametrize(
    "version", ["3.10.0", "3.12.4", "3.15.1", "3.15.2.dev2026010203"]
)
def test_a_tested_keras_does_not_warn(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compat.warn_if_untested(version)


def test_a_version_it_cannot_read_warns():
    with pytest.warns(UserWarning, match="this is Keras nightly"):
        _compat.warn_if_untested("nightly")


def test_import_warns_on_an_untested_keras():
    # The warning must come at `import keras_accum`, before any of its
    # modules touch Keras internals: a fresh interpreter, Keras's version
    # faked before the import.
    code = (
        "import warnings, keras\n"
        "keras.__version__ = '3.9.2'\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    import keras_accum\n"
        "print([str(w.message) for w in caught\n"
        "       if issubclass(w.category, UserWarning)])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "keras-accum was tested with keras>=3.10,<3.16" in result.stdout
    assert "this is Keras 3.9.2" in result.stdout


def test_the_keras_under_test_is_in_the_tested_range():
    # CI runs the newest set (constraints.txt) and the oldest (.ci/compat):
    # a pin moved outside the range without widening it fails here.
    found = _compat._major_minor(keras.__version__)
    assert _compat.OLDEST_TESTED <= found <= _compat.NEWEST_TESTED, (
        f"Keras {keras.__version__} is outside {_compat.TESTED_RANGE}"
    )


def test_pyproject_declares_the_range_the_package_checks():
    pyproject = (ROOT / "pyproject.toml").read_text()
    declared = re.search(r'^\s*"(keras[<>=].*?)",?$', pyproject, re.M)
    assert declared, "pyproject.toml declares no keras dependency"
    assert declared[1] == _compat.TESTED_RANGE
    oldest = ".".join(map(str, _compat.OLDEST_TESTED))
    newest_excluded = (
        f"{_compat.NEWEST_TESTED[0]}.{_compat.NEWEST_TESTED[1] + 1}"
    )
    assert _compat.TESTED_RANGE == f"keras>={oldest},<{newest_excluded}"


# Python's own, not Keras's: `sys._getframe`, `NamedTuple._fields` and
# `_replace`.
_STANDARD_LIBRARY = {"_getframe", "_fields", "_replace", "_asdict"}


def _private_names_in_the_package():
    """`(read, defined)`: the private attribute names the package reads,
    and those it assigns or defines (functions, classes, methods)."""
    import ast

    read, defined = set(), set()
    for path in sorted((ROOT / "keras_accum").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                target = defined if isinstance(node.ctx, ast.Store) else read
                target.add(node.attr)
            elif isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
            ):
                defined.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) in ("getattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
            ):
                read.add(node.args[1].value)

    # The settings' attributes, set by name from their table.
    defined |= {setting.attribute for setting in _settings.SETTINGS}

    def private(name):
        dunder = name.startswith("__") and name.endswith("__")
        return name.startswith("_") and (name == "__internal__" or not dunder)

    return {n for n in read if private(n)}, {n for n in defined if private(n)}


def _keras_names():
    """Every attribute name of the Keras objects the package builds on, on
    all three backends' trainers."""
    from keras.src.backend.jax.trainer import JAXTrainer
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    from keras.src.backend.torch.trainer import TorchTrainer

    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="adam", loss="mse")
    objects = [
        model,
        TensorFlowTrainer,
        JAXTrainer,
        TorchTrainer,
        keras.layers.BatchNormalization(),
        keras.callbacks.BackupAndRestore("backup"),
        keras.Variable(1.0),
        keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()),
    ]
    return set().union(*(dir(o) for o in objects))


@pytest.mark.tensorflow_only(
    reason="reads the package's source; imports every backend's trainer"
)
def test_the_private_members_used_are_those_compat_lists():
    # Every backend's trainer is read: the oldest set (.ci/compat), which
    # installs TensorFlow alone, leaves this to the main run.
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    read, defined = _private_names_in_the_package()
    # Read and never defined here, or defined here over Keras's own.
    used = (read - defined - _STANDARD_LIBRARY) | (defined & _keras_names())
    assert used == set(_compat.PRIVATE_MEMBERS), (
        f"not listed in _compat.PRIVATE_MEMBERS: "
        f"{sorted(used - set(_compat.PRIVATE_MEMBERS))}; listed, not used: "
        f"{sorted(set(_compat.PRIVATE_MEMBERS) - used)}"
    )


def test_every_keras_src_import_is_in_compat():
    for path in sorted((ROOT / "keras_accum").glob("*.py")):
        if path.name == "_compat.py":
            continue
        imports = re.findall(
            r"^\s*(?:from|import) keras\.src", path.read_text(), re.M
        )
        assert not imports, path.name


def test_the_keras_hooks_the_package_relies_on_are_there():
    # Each fails when a Keras release moves what the package reaches into,
    # rather than a setting dropping silently (see `_compat`).
    assert _compat.CLONE_FUNCTIONAL_CODE is not None
    assert _compat.functional_init_arguments((1, 2), {})
    assert not _compat.functional_init_arguments((1,), {})

    # Keras still makes a subclass functional by rewriting its bases, which
    # `make_functional` does for `AccumModel` subclasses instead.
    class Sub(keras.Model):
        pass

    inputs = keras.Input((2,))
    Sub(inputs, keras.layers.Dense(1)(inputs))
    assert issubclass(Sub, _compat.Functional)

    # What `AccumModel` passes on to Keras: the two names `Layer.__init__`
    # reads from its `**kwargs` are still read there (another is refused).
    keywords = _compat.model_keywords()
    assert {"name", "trainable", "dtype", "input_dim"} <= set(keywords)
    with pytest.warns(UserWarning, match="input_shape"):
        keras.layers.Layer(input_dim=3)
        keras.layers.Layer(input_shape=(3,))
    with pytest.raises(ValueError, match="Unrecognized keyword"):
        keras.layers.Layer(input_dims=3)


def _functions_of_the_package():
    """`(where, parameters, lines of code)` of every function in the
    package: parameters besides `self` and `cls`, lines that are not
    blank, comments or the docstring."""
    import ast

    for path in sorted((ROOT / "keras_accum").glob("*.py")):
        source = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(source))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = node.args
            names = [a.arg for a in args.posonlyargs + args.args]
            names += [a.arg for a in args.kwonlyargs]
            names += [a.arg for a in (args.vararg, args.kwarg) if a]
            body = node.body
            if isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant
            ):
                body = body[1:]
            lines = {
                line
                for statement in body
                for line in range(statement.lineno, statement.end_lineno + 1)
            }
            code = [
                n
                for n in lines
                if source[n - 1].strip()
                and not source[n - 1].strip().startswith("#")
            ]
            parameters = [n for n in names if n not in ("self", "cls")]
            yield f"{path.name}:{node.lineno} {node.name}", parameters, code


@pytest.mark.tensorflow_only(reason="reads the package's source")
def test_every_function_is_short_and_takes_few_parameters():
    # A core a newcomer can change: no function over 60 lines of code or 6
    # parameters (docstrings and comments aside). The settings' keywords of
    # the constructor and `from_model` are the settings table's, held to it
    # by tests/test_construction.py, not parameters of their own.
    found = list(_functions_of_the_package())
    long = [(w, len(c)) for w, _, c in found if len(c) > 60]
    own = [
        (w, [n for n in p if n not in _settings.PUBLIC_NAMES])
        for w, p, _ in found
    ]
    many = [(w, len(p)) for w, p in own if len(p) > 6]
    assert not long and not many, (long, many)


def _package_imports():
    """`{module: {modules of the package it imports}}`, every import in
    the module counted, at its top or inside a function."""
    import ast

    graph = {}
    for path in sorted((ROOT / "keras_accum").glob("*.py")):
        name = "keras_accum" if path.stem == "__init__" else path.stem
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "keras_accum":
                    found |= {alias.name for alias in node.names}
                elif node.module.startswith("keras_accum."):
                    found.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("keras_accum."):
                        found.add(alias.name.split(".")[1])
        graph[name] = found - {name}
    return graph


@pytest.mark.tensorflow_only(reason="reads the package's source")
def test_imports_run_one_way():
    # Before: `_trainer` -> `layers` -> `model` (a lazy import) -> the
    # backend trainers -> `_trainer`, and the core imported the public
    # `auto` for its in-step rules.
    graph = _package_imports()
    modules = set(graph)
    done, path = set(), []

    def visit(module):
        if module in path:
            cycle = path[path.index(module) :] + [module]
            raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
        if module in done or module not in modules:
            return
        path.append(module)
        for imported in sorted(graph[module]):
            visit(imported)
        path.pop()
        done.add(module)

    for module in sorted(modules):
        visit(module)
    # The public modules are imported by `__init__` and `model` only; the
    # core reaches the controller's rules through `_auto_rules`.
    public = {"model", "callbacks", "layers"}
    for module, imported in graph.items():
        if module not in ("keras_accum", "model", "callbacks"):
            assert not imported & public, (module, imported & public)


@pytest.mark.tensorflow_only(reason="reads the package's source")
def test_the_package_sets_attributes_on_the_model_in_one_module():
    # Before: `model.py`, `_trainer.py` and the backend trainers each set
    # the model's attributes, and callbacks set some from outside. Now
    # `_trainer.AccumTrainer` sets them (`_configure`, `_reset_window_state`,
    # `_ensure_window`); the others call its methods, and `_compat` sets
    # Keras's own `_initial_epoch`.
    import ast

    found = []
    for path in sorted((ROOT / "keras_accum").glob("*.py")):
        if path.name in ("_trainer.py", "_compat.py"):
            continue
        in_model = path.name in (
            "model.py",
            "_tf_trainer.py",
            "_jax_trainer.py",
            "_torch_trainer.py",
        )
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for target in targets:
                # The package's state is private: a wrapper's public
                # `inner_model`, Keras's `built` and a class's `__name__`
                # are not.
                if not isinstance(target, ast.Attribute):
                    continue
                name = target.attr
                if not name.startswith("_") or name.startswith("__"):
                    continue
                owner = ast.unparse(target.value)
                if "model" in owner.lower() or (in_model and owner == "self"):
                    found.append(f"{path.name}:{node.lineno} {owner}")
    assert not found, found


def _private_accesses(path, names):
    """`(line, name)` of each read or write of a private member in `names`
    in `path`: an attribute, or a `getattr`/`hasattr`/`setattr` string. A
    method that overrides a Keras hook (`def _symbolic_build`) and its own
    `super()._symbolic_build(...)` are not accesses."""
    import ast

    found = []

    def visit(node, function=None):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Attribute) and node.attr in names:
            is_super = (
                isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", None) == "super"
            )
            if not (is_super and node.attr == function):
                found.append((node.lineno, node.attr))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None)
            in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in names
        ):
            found.append((node.lineno, node.args[1].value))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(path.read_text()))
    return found


def test_private_keras_members_are_reached_only_through_compat():
    # Before: 40 private names read in 10 files, 4 through `_compat`. Now
    # every read or write is a `_compat` function; PyTorch's own
    # `torch._foreach_*` are torch's, not Keras's.
    names = {
        name
        for name in _compat.PRIVATE_MEMBERS
        if not name.startswith("_foreach_")
    }
    outside = {}
    for path in sorted((ROOT / "keras_accum").glob("*.py")):
        if path.name == "_compat.py":
            continue
        found = _private_accesses(path, names)
        if found:
            outside[path.name] = found
    assert outside == {}
