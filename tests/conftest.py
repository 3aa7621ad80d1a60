"""Test setup: the CPU is split into 2 logical devices before TensorFlow starts, so
multi-replica behaviour (MirroredStrategy) can be tested on a machine without GPUs."""

import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmp import distribute  # noqa: E402

NUM_TEST_DEVICES = 2
distribute.split_cpu(NUM_TEST_DEVICES)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
    has_gpu = bool(tf.config.list_physical_devices("GPU"))
    from tfmp import precision

    has_tpu = precision.tpu_present()
    for item in items:
        if "requires_gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU; none visible"))
        if "requires_tpu" in item.keywords and not has_tpu:
            item.add_marker(pytest.mark.skip(reason="needs a TPU; none visible"))


@pytest.fixture(autouse=True)
def restore_global_policy():
    """Tests set the Keras global dtype policy; put float32 back afterwards."""
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture
def run_cli():
    """Runs `python -m tfmp.train ARGS` in a fresh process; returns the CompletedProcess."""

    def run(*args, cwd=REPO, timeout=600):
        environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        return subprocess.run([sys.executable, "-m", "tfmp.train", *args], cwd=cwd, env=environment,
                              capture_output=True, text=True, timeout=timeout)

    return run
