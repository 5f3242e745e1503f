"""The tested Keras range: declared once, checked at import, and honest."""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import keras
import pytest

from keras_accum import _compat

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
