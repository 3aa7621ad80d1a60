"""Exact resume: a run stopped at any step and rerun ends as the run never stopped — the same steps, the same
checkpointed weights, optimizer state and BatchNorm statistics (tests/scripts/exact_resume.py measures it).

Bit-identical on one device in float32 and in bf16 with TensorFlow's deterministic ops, stopped by SIGTERM, Ctrl-C
(SIGINT) or kill -9; the stops land in the first epoch, mid-run and in the last epoch, and for an SSL run in
pretraining and inside a supervised baseline draw (a label draw). On 2 replicas: the same steps, results within a
stated tolerance."""

import json
import os
import subprocess
import sys

import pytest

from conftest import AUTO_PRECISION, REPO

SCRIPT = os.path.join(REPO, "tests", "scripts", "exact_resume.py")


def _measure(overrides: dict, stops: list[int], *extra) -> dict:
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, SCRIPT, json.dumps(overrides), ",".join(map(str, stops)), *extra], cwd=REPO,
                            env=environment, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _killed_on_two_replicas(overrides: dict, workdir, after_step: int) -> None:
    """Runs `overrides` on 2 CPU replicas in a child process, killed with SIGKILL after `after_step`."""
    from tfmp.config import Config

    config = Config(**overrides, strategy="mirrored", num_cpu_devices=2)
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    killed = subprocess.run([sys.executable, SCRIPT, "--child", json.dumps(config.to_dict()), str(workdir), str(after_step)],
                            cwd=REPO, env=environment, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]


def test_a_supervised_run_stopped_in_its_first_and_last_epoch_resumes_bit_for_bit():
    report = _measure({"task": "supervised", "epochs": 4}, [3, 40], "--deterministic")  # 11 steps an epoch
    assert report["steps"] == 44
    for stop in report["stops"]:
        assert stop["stopped"].startswith(f"stopped by SIGTERM at step {stop['after_step'] + 1}: checkpoint saved"), stop
        assert stop["steps"] == 44 and stop["checkpoint_difference"][0] == 0.0, stop
    first, last = report["stops"]
    assert set(first["metric_differences"]) <= {"achieved_gflops_per_second"}, first  # eval figures equal too
    # Stopped inside the last epoch, the resumed run logs that epoch's loss over the steps after the resume.
    assert set(last["metric_differences"]) <= {"achieved_gflops_per_second", "train_loss"}, last


@pytest.mark.slow  # ~40 s
@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_a_run_stopped_by_ctrl_c_or_killed_resumes_bit_for_bit(precision):
    """Ctrl-C checkpoints the next step; kill -9 leaves the newest checkpoint written before it (every 5 steps here),
    so the rerun repeats the steps after it — the same ones, as the run never stopped had them."""
    overrides = {"task": "supervised", "epochs": 4, "precision": precision, "checkpoint_every_steps": 5}
    [interrupted] = _measure(overrides, [25], "--deterministic", "--signal=INT")["stops"]
    assert interrupted["stopped"].startswith("stopped by Ctrl-C (SIGINT) at step 26: checkpoint saved"), interrupted
    killed = _measure(overrides, [17, 40], "--deterministic", "--signal=KILL")["stops"]
    assert [stop["resumed_from_step"] for stop in killed] == [15, 40]  # inside epoch 2; inside the last epoch
    for stop in [interrupted, *killed]:
        assert stop["steps"] == 44 and stop["checkpoint_difference"][0] == 0.0, stop


@pytest.mark.slow  # ~10 s; the default suite's stops are mid-epoch
def test_a_stop_at_the_batch_end_that_ends_an_epoch_resumes_at_the_next_epoch():
    """With one execution per epoch (steps_per_execution=11) the only batch end is the epoch's last: the stop's
    checkpoint counts that epoch as done, so the rerun does not train it again (the main job said 1111 steps)."""
    report = _measure({"task": "supervised", "epochs": 4, "steps_per_execution": 11}, [1], "--deterministic")
    [stop] = report["stops"]
    # The signal arrives at the first batch end (step 11, after tfmp's own check of it) and is acted on at that epoch's
    # end, the same step (before issue 29, at the next batch end: step 22).
    assert stop["stopped"].startswith("stopped by SIGTERM at step 11: checkpoint saved"), stop
    assert stop["steps"] == report["steps"] == 44 and stop["checkpoint_difference"][0] == 0.0, stop


@pytest.mark.slow  # ~3 min: pretraining, probes and two baseline draws, five times
@pytest.mark.parametrize("stop_signal", ["TERM", "KILL"])
def test_an_ssl_run_stopped_in_pretraining_and_in_a_baseline_draw_resumes_bit_for_bit(stop_signal):
    simclr = {"task": "simclr", "epochs": 3, "global_batch_size": 256, "label_fraction": 0.05, "label_draws": 2,
              "compare_supervised": True, "baseline_epochs": 10, "probe_epochs": 10, "knn_every_epochs": 1, "flip": False,
              "checkpoint_every_steps": 3}
    # 5 pretraining steps an epoch (15), then each baseline draw's 10: step 21 is the 6th of the first draw.
    report = _measure(simclr, [7, 21], "--deterministic", f"--signal={stop_signal}")
    if stop_signal == "TERM":
        assert [stop["stopped"].split(":")[0] for stop in report["stops"]] == ["stopped by SIGTERM at step 8",
                                                                              "stopped by SIGTERM at step 7"]
    for stop in report["stops"]:
        assert stop["steps"] == report["steps"] and stop["checkpoint_difference"][0] == 0.0, stop
        assert not {"linear_probe_accuracy", "knn_accuracy", "supervised_baseline_accuracy"} & set(stop["metric_differences"]), stop


@pytest.mark.slow  # ~60 s
def test_two_replicas_resume_with_the_same_steps_and_close_results():
    """2 replicas: the same steps and data order, but not bit-for-bit: measured, the checkpointed BatchNorm statistics
    drift from the second epoch after the resume on (0.12 at most after 33 steps; eval accuracy 0.861 vs 0.878, float32
    and bf16 alike), the cause not found yet (BUILD_NOTES.md, "Exact resume")."""
    report = _measure({"task": "supervised", "epochs": 3, "strategy": "mirrored", "num_cpu_devices": 2,
                       "precision": AUTO_PRECISION}, [5])
    for stop in report["stops"]:
        assert stop["steps"] == report["steps"] == 33, stop
        accuracy = stop["metric_differences"].get("eval_accuracy")
        assert accuracy is None or abs(accuracy[0] - accuracy[1]) <= 0.05, stop


@pytest.mark.slow  # ~40 s each
@pytest.mark.parametrize("stage", ["zero1", "zero3"])
def test_a_sharded_run_on_two_replicas_killed_and_rerun_ends_like_the_run_never_stopped(stage):
    """kill -9 after step 13 (checkpoints every 4 steps): the rerun restores the sharded optimizer state (and under
    zero3 each replica's chunks of the weights) from the checkpoint and ends with the same steps; results within the
    2-replica tolerance above (measured for zero1: eval 0.869 vs 0.878, the same BatchNorm drift as unsharded). zero1
    is spelled by its old name, `--optimizer_sharding`, which still resumes."""
    setting = {"optimizer_sharding": "zero1"} if stage == "zero1" else {"sharding": stage}
    report = _measure({"task": "supervised", "epochs": 3, "strategy": "mirrored", "num_cpu_devices": 2, "precision": "float32",
                       **setting, "checkpoint_every_steps": 4}, [13], "--signal=KILL")
    [stop] = report["stops"]
    assert stop["stopped"] == "killed (SIGKILL) after step 13" and stop["resumed_from_step"] == 12, stop
    assert stop["steps"] == report["steps"] == 33
    accuracy = stop["metric_differences"].get("eval_accuracy")
    assert accuracy is None or abs(accuracy[0] - accuracy[1]) <= 0.05, stop


@pytest.mark.slow  # ~40 s each
@pytest.mark.parametrize("stage, resumed_stage", [("zero1", "zero1"), ("zero3", "zero3"), ("zero3", "zero1")])
def test_a_sharded_cli_run_killed_on_two_replicas_resumes_on_one_device(tmp_path, run_cli, stage, resumed_stage):
    """The device count may change on resume, and the stage among zero1-zero3 (their checkpoints hold the same state):
    a run on 2 replicas killed after step 13 is finished by the CLI on one device, from the sharded checkpoint of step
    12 (optimizer state and zero3's weight chunks laid out anew), with a warning."""
    overrides = {"task": "supervised", "epochs": 3, "precision": "float32", "sharding": stage,
                 "checkpoint_every_steps": 4, "steps_per_execution": 1}
    workdir = tmp_path / "run"
    _killed_on_two_replicas(overrides, workdir, after_step=13)
    overrides["sharding"] = resumed_stage
    resumed = run_cli(f"--workdir={workdir}", "--strategy=off", *(f"--{key}={value}" for key, value in overrides.items()))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming on 1 replica(s) from a checkpoint written on 2" in resumed.stderr, resumed.stderr[-3000:]
    metrics = json.loads((workdir / "metrics.json").read_text())
    assert metrics["num_replicas"] == 1 and metrics["resumed_from_step"] == 12 and metrics["steps"] == 33, metrics
    assert metrics["eval_accuracy"] >= 0.8, metrics  # the 2-replica run never stopped: 0.878 (test above)


@pytest.mark.parametrize("saved, plan", [
    ((0, 0), [(10, 11, 0)]),                      # a new run: one fit() from the start
    ((3, 33), [(10, 11, 33)]),                    # stopped at an epoch's end: the next epoch
    ((3, 38), [(4, 6, 38), (10, 11, 44)]),        # stopped inside epoch 4: its 6 remaining steps, then the rest
    ((9, 104), [(10, 6, 104)]),                   # inside the last epoch: only its remaining steps
    ((10, 110), [(10, 11, 110)]),                 # finished: one fit() with nothing to train, where the model is restored
])
def test_the_resume_plan_keeps_the_epochs_and_steps_of_a_run_never_stopped(saved, plan):
    from tfmp.tasks.stage import resume_plan

    assert resume_plan(saved, epochs=10, steps_per_epoch=11) == plan
    fits = resume_plan(saved, epochs=10, steps_per_epoch=11)
    steps = sum(steps * (epochs - (saved[0] if index == 0 else fits[index - 1][0])) for index, (epochs, steps, _) in enumerate(fits))
    assert saved[1] + steps == 110  # the resumed fits take exactly the steps left


@pytest.mark.slow  # ~30 s; accumulation adds no state to resume (tests/test_accumulation.py), resume is tested above
def test_a_run_taking_its_batches_in_micro_batches_stopped_mid_epoch_resumes_bit_for_bit():
    """--gradient_accumulation_steps=4: a step is still one optimizer step over the whole batch, so a checkpoint falls
    only between optimizer steps and the rerun ends as the run never stopped."""
    report = _measure({"task": "supervised", "epochs": 2, "gradient_accumulation_steps": 4}, [15], "--deterministic")
    assert report["steps"] == 22
    [stop] = report["stops"]
    assert stop["stopped"].startswith("stopped by SIGTERM at step 16: checkpoint saved"), stop
    assert stop["steps"] == 22 and stop["checkpoint_difference"][0] == 0.0, stop
    assert set(stop["metric_differences"]) <= {"achieved_gflops_per_second", "train_loss"}, stop


@pytest.mark.slow  # ~25 s
def test_a_run_killed_with_sigkill_restores_its_moving_average_exactly():
    """--ema_momentum: the average is optimizer state, in every checkpoint; the rerun after kill -9 ends with the
    average (and everything else) of the run never stopped."""
    overrides = {"task": "supervised", "epochs": 2, "ema_momentum": 0.9, "checkpoint_every_steps": 5}
    [killed] = _measure(overrides, [13], "--deterministic", "--signal=KILL")["stops"]  # after the epoch-end checkpoint (11)
    assert killed["resumed_from_step"] == 11 and killed["steps"] == 22 and killed["checkpoint_difference"][0] == 0.0, killed
    assert "ema_eval_accuracy" not in killed["metric_differences"], killed


@pytest.mark.slow  # ~1 min: a DINO run (ViT, multi-crop) killed twice, each rerun to the end
def test_a_dino_run_killed_with_sigkill_resumes_bit_for_bit():
    """The teacher, its centre, the momentum and temperature schedules and the frozen last layer are all step state:
    a kill -9 in the frozen first epoch and one after it end where the run that never stopped does."""
    dino = {"task": "dino", "model": "vit_micro_p2", "epochs": 3, "global_batch_size": 256, "label_fraction": 0.05,
            "label_draws": 1, "compare_supervised": False, "probe_epochs": 5, "knn_every_epochs": 1, "flip": False,
            "checkpoint_every_steps": 2, "prototypes": 64, "projection_dim": 16, "local_crops": 2, "crop_min_scale": 0.4,
            "freeze_last_layer_epochs": 1.0, "warmup_teacher_temperature": 0.02, "warmup_teacher_temperature_epochs": 2.0}
    report = _measure(dino, [3, 11], "--deterministic", "--signal=KILL")  # 5 steps an epoch: the first, the third
    for stop in report["stops"]:
        assert stop["steps"] == report["steps"] and stop["checkpoint_difference"][0] == 0.0, stop
        assert not {"linear_probe_accuracy", "knn_accuracy"} & set(stop["metric_differences"]), stop


@pytest.mark.slow  # ~1 min: an MAE run killed twice, each rerun to the end
def test_an_mae_run_killed_with_sigkill_resumes_bit_for_bit():
    """The masks and views come from the step's seed, the rest is weights and optimizer state: a kill -9 in the first
    epoch and one in the last end where the run that never stopped does."""
    overrides = {"task": "mae", "model": "vit_micro_p2", "epochs": 3, "global_batch_size": 256, "label_fraction": 0.05,
                 "label_draws": 1, "compare_supervised": False, "probe_epochs": 5, "knn_every_epochs": 1, "flip": False,
                 "checkpoint_every_steps": 2, "decoder_width": 32, "decoder_depth": 1, "decoder_heads": 4,
                 "color_jitter": 0.0, "blur_probability": 0.0}
    report = _measure(overrides, [3, 11], "--deterministic", "--signal=KILL")  # 5 steps an epoch: the first, the third
    for stop in report["stops"]:
        assert stop["steps"] == report["steps"] and stop["checkpoint_difference"][0] == 0.0, stop
        assert not {"linear_probe_accuracy", "knn_accuracy"} & set(stop["metric_differences"]), stop


@pytest.mark.slow  # ~60 s: a killed 2-replica run, then two worker processes
def test_a_zero3_run_killed_on_two_replicas_resumes_on_two_workers(tmp_path):
    """zero3's checkpoint (each weight's slices under Keras' own key, the optimizer state per variable) written by two
    replicas of one process is read by two worker processes, each taking its own chunks: the relaunch resumes at the
    checkpoint of step 12 and ends with the run's 33 steps."""
    overrides = {"task": "supervised", "epochs": 3, "precision": "float32", "sharding": "zero3",
                 "checkpoint_every_steps": 4, "steps_per_execution": 1}
    workdir = tmp_path / "run"
    _killed_on_two_replicas(overrides, workdir, after_step=13)
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    resumed = subprocess.run([sys.executable, "-m", "tfmp.launch", "--num_workers=2", f"--workdir={workdir}",
                              *(f"--{key}={value}" for key, value in overrides.items())], cwd=REPO, env=environment,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    metrics = json.loads((workdir / "metrics.json").read_text())
    assert metrics["strategy"] == "multi_worker_mirrored" and metrics["num_replicas"] == 2, metrics
    assert metrics["resumed_from_step"] == 12 and metrics["steps"] == 33, metrics
    assert metrics["eval_accuracy"] >= 0.8, metrics  # never stopped, on 2 replicas: 0.878
