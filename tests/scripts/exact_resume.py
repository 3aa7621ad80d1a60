"""Exact resume, measured: a run stopped by a signal at a step and rerun against the same run never stopped.

    python tests/scripts/exact_resume.py '{"task": "supervised", "epochs": 4}' 3,17,40 [--deterministic] [--signal=KILL]

Every run is `tfmp.training.run` with the given `Config` fields. A stop is the run's process sending itself a signal
after the given training step (counted over every stage of the run: pretraining, then each baseline draw):
SIGTERM (the default) or SIGINT, which tfmp's `PreemptionCheckpoint` answers by checkpointing the next step and
stopping; or SIGKILL (kill -9), which ends a child process at once, so the rerun resumes from the newest checkpoint
written before it (set `checkpoint_every_steps` to have some inside an epoch). The rerun finishes the run in this
process. Prints one JSON line: per stop, how it stopped, the steps of the resumed run, and the largest difference
of any checkpointed value (weights, optimizer state, BatchNorm statistics) and of any metric from the run never
stopped. `--deterministic` turns on TensorFlow's deterministic ops first.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile

from tfmp import tf_environment

tf_environment.prepare()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmp import training  # noqa: E402
from tfmp.tasks import pretrain, stage, supervised  # noqa: E402
from tfmp.callbacks import find_checkpoints  # noqa: E402
from tfmp.config import Config  # noqa: E402


class SignalAfterStep(keras.callbacks.Callback):
    """Sends `signal_number` to this process once `step` training steps of the run (all its stages) have ended."""

    taken = 0

    def __init__(self, step, signal_number=signal.SIGTERM):
        super().__init__()
        self.step, self.signal_number = step, signal_number

    def on_train_batch_end(self, batch, logs=None):
        SignalAfterStep.taken += 1
        if SignalAfterStep.taken == self.step:
            os.kill(os.getpid(), self.signal_number)


@contextlib.contextmanager
def in_every_stage(callback):
    """Adds `callback` to every fit() of the run: pretraining and each baseline draw (`training.run`'s own
    `extra_callbacks` reach the task's main stage only)."""
    def fit_stage(*arguments, extra_callbacks=(), **keywords):
        return stage.fit_stage(*arguments, extra_callbacks=(*extra_callbacks, callback), **keywords)
    pretrain.fit_stage = supervised.fit_stage = fit_stage
    try:
        yield
    finally:
        pretrain.fit_stage = supervised.fit_stage = stage.fit_stage


def checkpointed_values(workdir):
    """Every value of the newest checkpoint of every stage below `workdir`, by stage and name."""
    values = {}
    for folder, names, _ in os.walk(workdir):
        if os.path.basename(folder) == "checkpoints" and find_checkpoints(folder):
            reader = tf.train.load_checkpoint(find_checkpoints(folder)[-1][1])
            stage_name = os.path.relpath(folder, workdir)
            values.update({f"{stage_name}:{name}": reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
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


def stop_run(config, workdir, stop: int, signal_name: str, options: list[str]) -> str | None:
    """Runs `config` in `workdir` until the signal after step `stop` ends it; returns how it ended."""
    if signal_name == "KILL":  # kill -9 leaves no Python behind to see it: the run is a child process
        child = subprocess.run([sys.executable, __file__, "--child", json.dumps(config.to_dict()), workdir, str(stop), *options])
        assert child.returncode == -signal.SIGKILL, f"the child ended with {child.returncode}, not by SIGKILL"
        return f"killed (SIGKILL) after step {stop}"
    SignalAfterStep.taken = 0
    try:
        with in_every_stage(SignalAfterStep(stop, getattr(signal, "SIG" + signal_name))):
            training.run(config, workdir)
    except SystemExit as preempted:
        return str(preempted)
    raise SystemExit(f"the run ended before step {stop}, where it was to be stopped")


def child(config_json: str, workdir: str, stop: int) -> None:
    with in_every_stage(SignalAfterStep(stop, signal.SIGKILL)):
        training.run(Config(**json.loads(config_json)), workdir)
    raise SystemExit(f"the run ended before step {stop}, where it was to be killed")


def main():
    options = [argument for argument in sys.argv[1:] if argument.startswith("--")]
    arguments = [argument for argument in sys.argv[1:] if not argument.startswith("--")]
    if "--deterministic" in options:
        tf.config.experimental.enable_op_determinism()
    if "--child" in options:
        return child(*arguments[:2], int(arguments[2]))
    signal_name = next((option.split("=", 1)[1] for option in options if option.startswith("--signal=")), "TERM")
    # Ctrl-C as in a terminal, even where this process was started with SIGINT ignored (a background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    overrides, stops = json.loads(arguments[0]), [int(step) for step in arguments[1].split(",")]
    config = Config(**{"precision": "float32", "strategy": "off", "steps_per_execution": 1, **overrides})
    root = tempfile.mkdtemp(prefix="tfmp-exact-resume-")
    never_stopped = training.run(config, os.path.join(root, "never_stopped"))
    reference = checkpointed_values(os.path.join(root, "never_stopped"))
    report = {"steps": never_stopped["steps"], "stops": []}
    for stop in stops:
        workdir = os.path.join(root, f"stopped_at_{stop}")
        # A stop after step 0 is no stop: the same run twice, to see that the run is deterministic.
        stopped = stop_run(config, workdir, stop, signal_name, options) if stop else None
        resumed = training.run(config, workdir)
        metrics = numeric_metrics(resumed)
        expected = numeric_metrics(never_stopped)
        report["stops"].append({
            "after_step": stop, "stopped": stopped, "steps": resumed["steps"], "resumed_from_step": resumed.get("resumed_from_step"),
            "checkpoint_difference": largest_difference(reference, checkpointed_values(workdir)),
            "metric_differences": {key: [value, expected.get(key)] for key, value in metrics.items() if value != expected.get(key)},
        })
    print(json.dumps(report))


if __name__ == "__main__":
    main()
