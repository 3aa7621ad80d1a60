"""Exact resume, measured: a run stopped by SIGTERM at a step and rerun against the same run never stopped.

    python tests/scripts/exact_resume.py '{"task": "supervised", "epochs": 4}' 3,17,40 [--deterministic]

Every run is `tfmp.training.run` in this process with the given `Config` fields. A stop is this process sending
itself SIGTERM after the given training step (counted over every stage of the run: pretraining, then each
baseline draw); tfmp's `PreemptionCheckpoint` checkpoints the next step and stops, and the rerun finishes the
run. Prints one JSON line: per stop, where it stopped, the steps of the resumed run, and the largest difference
of any checkpointed value (weights, optimizer state, BatchNorm statistics) and of any metric from the run never
stopped. `--deterministic` turns on TensorFlow's deterministic ops first.
"""

import json
import os
import signal
import sys
import tempfile

from tfmp import tf_environment

tf_environment.prepare()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmp import training  # noqa: E402
from tfmp.callbacks import find_checkpoints  # noqa: E402
from tfmp.config import Config  # noqa: E402


class SignalAfterStep(keras.callbacks.Callback):
    """Sends SIGTERM to this process once `step` training steps of the run (all its stages) have ended."""

    taken = 0

    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        SignalAfterStep.taken += 1
        if SignalAfterStep.taken == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def checkpointed_values(workdir):
    """Every value of the newest checkpoint of every stage below `workdir`, by stage and name."""
    values = {}
    for folder, names, _ in os.walk(workdir):
        if os.path.basename(folder) == "checkpoints" and find_checkpoints(folder):
            reader = tf.train.load_checkpoint(find_checkpoints(folder)[-1][1])
            stage = os.path.relpath(folder, workdir)
            values.update({f"{stage}:{name}": reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
                           if not name.startswith("_CHECKPOINTABLE_OBJECT_GRAPH")})
    return values


BOOKKEEPING = ("save_counter",)  # how many saves a run made: a stopped run makes more


def largest_difference(first: dict, second: dict) -> tuple[float, str]:
    """The largest difference between the values of two checkpoints, and where it is."""
    assert first.keys() == second.keys(), sorted(set(first) ^ set(second))[:5]
    worst, where = 0.0, ""
    for key in first:
        a, b = np.asarray(first[key]), np.asarray(second[key])
        if a.dtype.kind in "fiu" and a.size and not any(name in key for name in BOOKKEEPING):
            difference = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
            if difference > worst:
                worst, where = difference, key
    return worst, where


def numeric_metrics(metrics: dict) -> dict:
    skip = ("wall_seconds", "examples_per_second", "mfu", "pretrain_seconds", "evaluation_seconds", "baseline_seconds",
            "resumed_from_epoch", "resumed_from_step")
    return {key: value for key, value in metrics.items() if key not in skip and isinstance(value, (int, float, list))
            and not isinstance(value, bool)}


def main():
    overrides, stops = json.loads(sys.argv[1]), [int(step) for step in sys.argv[2].split(",")]
    if "--deterministic" in sys.argv[3:]:
        tf.config.experimental.enable_op_determinism()
    config = Config(**{"precision": "float32", "strategy": "off", "steps_per_execution": 1, **overrides})
    root = tempfile.mkdtemp(prefix="tfmp-exact-resume-")
    never_stopped = training.run(config, os.path.join(root, "never_stopped"))
    reference = checkpointed_values(os.path.join(root, "never_stopped"))
    report = {"steps": never_stopped["steps"], "stops": []}
    for stop in stops:
        workdir = os.path.join(root, f"stopped_at_{stop}")
        SignalAfterStep.taken = 0
        try:  # a stop after step 0 is no stop: the same run twice, to see that the run is deterministic
            resumed = training.run(config, workdir, extra_callbacks=[SignalAfterStep(stop)] if stop else [])
            stopped = None
        except SystemExit as preempted:
            stopped = str(preempted)
            resumed = training.run(config, workdir)
        metrics = numeric_metrics(resumed)
        expected = numeric_metrics(never_stopped)
        report["stops"].append({
            "after_step": stop, "stopped": stopped, "steps": resumed["steps"],
            "checkpoint_difference": largest_difference(reference, checkpointed_values(workdir)),
            "metric_differences": {key: [value, expected.get(key)] for key, value in metrics.items() if value != expected.get(key)},
        })
    print(json.dumps(report))


if __name__ == "__main__":
    main()
