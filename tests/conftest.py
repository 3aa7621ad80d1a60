"""Test setup: the CPU is split into 2 logical devices before TensorFlow starts, so
multi-replica behaviour (MirroredStrategy) can be tested on a machine without GPUs.

The suite runs in the environment tfmp's entry points set (`tfmp/tf_environment.py`),
subprocesses included: in particular oneDNN's CPU kernels on every x86-64 CPU. TF turns them
on by default only on CPUs with AVX512_VNNI / AVX512_BF16 / AMX, and without them its CPU
allocator keeps no statistics, so the memory tests could not measure.
"""

import os
import re
import subprocess
import sys
import time

from tfmp import tf_environment

tf_environment.prepare()

import keras  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmp import distribute, hardware, precision  # noqa: E402

NUM_TEST_DEVICES = 2
distribute.split_cpu(NUM_TEST_DEVICES)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_device_and_two_replicas(loss_and_gradients, single, mirrored, strategy, *batch):
    """`loss_and_gradients(model, *batch, replicas)` on `single` (one device, the whole batch) and on `mirrored` under
    `strategy`'s 2 replicas, each given its half of every tensor of `batch`: ((loss, gradients), (the replicas' losses,
    their gradients summed over the replicas, None where a variable gets none))."""
    whole = tf.function(lambda: loss_and_gradients(single, *batch, 1))()
    half = batch[0].shape[0] // 2

    def replica_step():
        rows = tf.range(half) + half * tf.distribute.get_replica_context().replica_id_in_sync_group
        return loss_and_gradients(mirrored, *(tf.gather(tensor, rows) for tensor in batch), 2)

    losses, gradients = tf.function(lambda: strategy.run(replica_step))()
    summed = [None if gradient is None else strategy.reduce("SUM", gradient, axis=None) for gradient in gradients]
    return whole, ([float(loss) for loss in strategy.experimental_local_results(losses)], summed)

# Tests whose subject is not bf16 itself (multi-worker, fault tolerance, the SSL CLI) run
# at the precision `auto` picks: bf16 where the CPU has bf16 units, float32 where bf16
# would be emulated (several times slower there).
AUTO_PRECISION = precision.resolve("auto")[0]


def pytest_collection_modifyitems(config, items):
    has_gpu = bool(tf.config.list_physical_devices("GPU"))
    has_tpu = hardware.tpu_present()
    has_bf16_cpu = hardware.cpu_has_bf16_units()
    for item in items:
        if "requires_gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU; none visible"))
        if "requires_tpu" in item.keywords and not has_tpu:
            item.add_marker(pytest.mark.skip(reason="needs a TPU; none visible"))
        if "requires_bf16_cpu" in item.keywords and not has_bf16_cpu:
            item.add_marker(pytest.mark.skip(reason="needs a CPU with AVX512_BF16 or AMX; this one emulates bf16"))


@pytest.fixture(autouse=True)
def restore_global_policy():
    """Tests set the Keras global dtype policy; put float32 back afterwards."""
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture
def new_process(monkeypatch):
    """Makes the next fit() behave as in a new process: tfmp forgets the fits this process trained (a second fit in
    one process that would train nothing is refused; a rerun in a new process resumes)."""
    from tfmp.callbacks import checkpointing

    return lambda: monkeypatch.setattr(checkpointing, "_TRAINED_IN_THIS_PROCESS", {})


@pytest.fixture
def run_cli():
    """Runs `python -m tfmp.train ARGS` in a fresh process; returns the CompletedProcess."""

    def run(*args, cwd=REPO, timeout=600):
        environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        return subprocess.run([sys.executable, "-m", "tfmp.train", *args], cwd=cwd, env=environment,
                              capture_output=True, text=True, timeout=timeout)

    return run


# ------------------------------------------------------------------ helpers shared by test modules

def checkpoint_steps(workdir):
    """Steps of the checkpoints the run has registered (TF's `checkpoint` state file).

    Not the files on disk: a kill between writing `ckpt-N.index` and updating the
    state file leaves a checkpoint that resuming rightly does not know about."""
    state = os.path.join(workdir, "checkpoints", "checkpoint")
    if not os.path.exists(state):
        return []
    with open(state, encoding="utf-8") as file:
        text = file.read()
    return sorted(int(step) for step in re.findall(r'^all_model_checkpoint_paths: ".*?ckpt-(\d+)"$', text, re.M))


def checkpoint_steps_on_disk(workdir):
    """Steps of the complete checkpoints on disk (TF writes `ckpt-N.index` last, when merging a save).

    These can be newer than the state file's: the kill may land between a save and the state update."""
    directory = os.path.join(workdir, "checkpoints")
    return sorted(int(match.group(1)) for name in os.listdir(directory) if (match := re.fullmatch(r"ckpt-(\d+)\.index", name)))


def wait_for_checkpoint(process, workdir, at_least, timeout=300):
    """Polls (does not guess a sleep) until a checkpoint of step >= at_least exists."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = checkpoint_steps(workdir)
        if steps and steps[-1] >= at_least:
            return steps[-1]
        assert process.poll() is None, f"training ended early: {process.stderr.read()[-2000:]}"
        time.sleep(0.1)
    raise AssertionError(f"no checkpoint of step >= {at_least} within {timeout}s")
