"""Test setup: TensorFlow backend, quiet logs, deterministic Keras."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import pytest


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    yield


_EQUIVALENCE = []


@pytest.fixture
def report_diff(request):
    """Records a measured max weight difference for the run's summary."""

    def record(value, label=None):
        _EQUIVALENCE.append((label or request.node.name, float(value)))

    return record


def pytest_terminal_summary(terminalreporter):
    if not _EQUIVALENCE:
        return
    terminalreporter.section(
        "equivalence with plain large-batch training: max |difference|"
    )
    for label, value in _EQUIVALENCE:
        terminalreporter.write_line(f"{value:10.3e}  {label}")
