"""What a person sees (issue 14): phase headers and quiet inner stages, one-line errors after
TensorFlow loads, the summary, the smoke variant of every preset, the library path's log lines."""

import csv
import glob
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO
from tfmp import report

DIGITS_PRESETS = sorted(os.path.basename(path)[:-4] for path in glob.glob(os.path.join(REPO, "experiments", "digits_*.cfg")))


def test_an_error_after_tensorflow_loaded_is_one_line_on_stderr(run_cli, tmp_path):
    """resnet50 on 8x8 digits is refused by the task's input check, which runs after TF loads."""
    result = run_cli("--model=resnet50", f"--workdir={tmp_path / 'run'}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "tfmp.train: error: model resnet50 needs images of at least 32px, got 8; set --image_size (digits has 8x8x1 images)"]
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def smoke_simclr(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("smoke") / "simclr"
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-m", "tfmp.train", "--flagfile=experiments/digits_simclr.cfg", "--smoke",
                             f"--workdir={workdir}"], cwd=REPO, env=environment, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return workdir, result


def test_the_smoke_run_s_stderr_holds_no_retracing_warning(smoke_simclr):
    """TensorFlow's multi-line "triggered tf.function retracing" warning was in the smoke run's stderr."""
    _, result = smoke_simclr
    assert "retracing" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.strip()] == [
        line for line in result.stderr.splitlines() if line.startswith("warning: small-data guard")]


def test_no_function_the_smoke_run_traces_is_traced_twice(tmp_path, monkeypatch):
    """What the retracing warning was about: no tf.function made during an SSL run (Keras' train, test and predict
    functions of each model, tfmp's own) traced again for another input. Before: the feature extraction retraced for
    the last, smaller batch, and the NaN guard's finite check was traced anew for each label draw's baseline (zero1's
    checkpoint gather once per save: tests/test_sharding.py)."""
    import tensorflow as tf

    from tfmp import train

    made = []
    original = tf.function

    def recording(*args, **kwargs):
        function = original(*args, **kwargs)
        if callable(function) and hasattr(function, "experimental_get_tracing_count"):
            made.append(function)
        elif callable(function):  # used as a decorator factory: tf.function(jit_compile=...)(f)
            return lambda inner: made.append(function(inner)) or made[-1]
        return function

    monkeypatch.setattr(tf, "function", recording)
    monkeypatch.chdir(REPO)
    assert train.main(["tfmp.train", "--flagfile=experiments/digits_simclr.cfg", "--smoke", "--strategy=off",
                       f"--workdir={tmp_path / 'run'}"]) == 0
    # A function whose first call creates variables is traced twice for the same inputs by TensorFlow's design: the
    # training step did, until the optimizer was built before fit() (tasks/stage.py). Traced once each, now.
    signatures = {function: {str(concrete.structured_input_signature) for concrete in function.list_concrete_functions()}
                  if hasattr(function, "list_concrete_functions") else set() for function in made}
    traced = [function for function in made if function.experimental_get_tracing_count()]
    retraced = [(function.python_function.__qualname__, sorted(signatures[function])) for function in traced
                if len(signatures[function]) > 1 or function.experimental_get_tracing_count() > 1]
    assert len(traced) >= 6 and retraced == []


def test_the_main_job_announces_its_phases_in_order_and_keeps_inner_stages_quiet(smoke_simclr):
    _, result = smoke_simclr
    lines = result.stdout.splitlines()
    headers = [line for line in lines if re.match(r"^\[\d+/\d+\] ", line)]
    assert [header.split(" ·")[0] for header in headers] == [
        "[1/4] pretrain simclr (small_cnn), 2 epochs", "[2/4] linear probe + kNN, 2 label draws of 2% of the labels",
        "[3/4] supervised baseline, label draw 1/2", "[4/4] supervised baseline, label draw 2/2"]
    assert "ETA after the first baseline draw" in headers[2] and re.search(r"ETA \d+:\d\d$", headers[3])
    pretraining = lines[lines.index(headers[0]) + 1:lines.index(headers[1])]
    assert len(pretraining) <= 2 * 2  # two epochs, at most "Epoch i/N" and its one line each
    after_pretraining = lines[lines.index(headers[1]):]
    assert not any(line.startswith("Epoch ") for line in after_pretraining), "the baseline's epochs are shown only with --verbose"


def test_the_run_ends_with_a_summary_table_and_its_picture(smoke_simclr):
    workdir, result = smoke_simclr
    table = result.stdout[result.stdout.index("simclr · small_cnn"):]
    assert re.search(r"^\s+mean\s+0\.\d{3} ± 0\.\d{3}\s+0\.\d{3} ± 0\.\d{3}\s+0\.\d{3} ± 0\.\d{3}\s+[+-]0\.\d{3}$", table, re.M)
    assert result.stdout.rstrip().endswith(f"done: {workdir}/metrics.json, {workdir}/summary.png")
    assert (workdir / "summary.png").stat().st_size > 10_000
    with open(workdir / "metrics.json", encoding="utf-8") as file:
        metrics = json.load(file)
    assert 0 < metrics["mfu"] and "GFLOP/s" in metrics["mfu_peak_formula"]  # the pretraining step's utilisation


def test_a_finished_run_redraws_its_summary_png_and_a_missing_run_is_one_line(smoke_simclr, tmp_path):
    workdir, result = smoke_simclr
    os.remove(workdir / "summary.png")
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    redrawn = subprocess.run([sys.executable, "-m", "tfmp.report", str(workdir)], cwd=REPO, env=environment, capture_output=True,
                             text=True, timeout=120)
    assert redrawn.returncode == 0, redrawn.stderr[-2000:]
    assert redrawn.stdout.splitlines()[-1] == f"drawn: {workdir}/summary.png" and (workdir / "summary.png").stat().st_size > 10_000
    assert "simclr · small_cnn" in redrawn.stdout
    missing = subprocess.run([sys.executable, "-m", "tfmp.report", str(tmp_path / "nothing")], cwd=REPO, env=environment,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert missing.stderr.startswith(f"tfmp.report: error: {tmp_path / 'nothing'}/metrics.json: no finished run's metrics there")


def test_history_csv_has_the_columns_the_task_logs(smoke_simclr):
    workdir, _ = smoke_simclr
    with open(workdir / "history.csv", encoding="utf-8", newline="") as file:
        rows = list(csv.DictReader(file))
    assert "knn_accuracy" in rows[0] and all(row["knn_accuracy"] not in ("", "NA") for row in rows)  # smoke: every epoch
    assert not [column for column in rows[0] if column.startswith("val_")], "pretraining has no validation data"
    with open(workdir / "baseline" / "draw0" / "history.csv", encoding="utf-8", newline="") as file:
        assert "val_accuracy" in next(csv.reader(file))  # the baseline validates (at its last epoch)


@pytest.mark.slow  # ~20 s each, the ViT presets' ~50-80 s; the SimCLR preset's smoke run above is in the default suite
@pytest.mark.parametrize("preset", [name for name in DIGITS_PRESETS if name != "digits_simclr"])
def test_the_smoke_variant_of_each_preset_runs_the_whole_pipeline_in_a_minute_or_two(run_cli, tmp_path, preset, smoke_simclr):
    # A ViT preset's phases each trace a transformer step (MAE's also fine-tunes every draw): 51 s for DINO's, 75 s
    # for MAE's on the 2-core Xeon with AMX; the CNN presets stay within a minute.
    with open(os.path.join(REPO, "experiments", f"{preset}.cfg"), encoding="utf-8") as file:
        vit_preset = "--model=vit_" in file.read()
    result = run_cli(f"--flagfile=experiments/{preset}.cfg", "--smoke", f"--workdir={tmp_path / 'run'}",
                     timeout=150 if vit_preset else 60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "done: " in result.stdout
    with open(tmp_path / "run" / "metrics.json", encoding="utf-8") as file:
        metrics = json.load(file)
    if "supervised_baseline_accuracy_per_draw" in metrics and metrics["model"] == "small_cnn":
        # every SSL preset of the same encoder compares with the very same baseline
        with open(smoke_simclr[0] / "metrics.json", encoding="utf-8") as file:
            simclr = json.load(file)
        assert metrics["supervised_baseline_accuracy_per_draw"] == simclr["supervised_baseline_accuracy_per_draw"]


def test_the_summary_table_of_a_supervised_run():
    table = report.summary_table({"task": "supervised", "model": "small_cnn", "precision": "float32", "strategy": "off",
                                  "num_replicas": 1, "eval_accuracy": 0.9833, "train_loss": 0.05, "steps": 165})
    assert table.splitlines() == ["supervised · small_cnn · float32 · off x1", "test accuracy: 0.9833", "final train loss: 0.05",
                                  "steps: 165"]


def test_the_summary_table_shows_the_fine_tuned_encoders_gain_beside_the_probes():
    table = report.summary_table({"task": "mae", "model": "vit_micro_p2", "precision": "float32", "strategy": "off",
                                  "num_replicas": 1, "linear_probe_accuracy": 0.55, "linear_probe_accuracy_per_draw": [0.5, 0.6],
                                  "finetune_accuracy": 0.65, "finetune_accuracy_per_draw": [0.7, 0.6],
                                  "supervised_baseline_accuracy": 0.5, "supervised_baseline_accuracy_per_draw": [0.45, 0.55]})
    lines = table.splitlines()
    assert lines[1].split() == ["label", "draw", "linear", "probe", "fine-tuned", "supervised", "baseline", "probe", "−",
                                "baseline", "fine-tuned", "−", "baseline"]
    assert lines[2].split() == ["1", "0.500", "0.700", "0.450", "+0.050", "+0.250"]
    assert lines[4].split()[-2:] == ["+0.050", "+0.150"]  # the means of the per-draw gains


LIBRARY_USE = """
import logging, sys
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.INFO, format="USER %(name)s %(message)s")
import tfmp
tfmp.precision.set_policy("float32")
tfmp.distribute.get_strategy("auto")
tfmp.distribute.get_strategy("auto")  # the same choice again: not a second line
"""


@pytest.mark.parametrize("setup", ["unconfigured", "configured"])
def test_the_library_path_logs_its_choices_once(setup):
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-c", LIBRARY_USE, setup], env=environment, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    mine = [line for line in result.stderr.splitlines() if "precision: float32" in line or "strategy: " in line]
    if setup == "unconfigured":  # nobody configured logging: tfmp writes its own short lines
        assert mine == ["tfmp: precision: float32 (explicit choice)", "tfmp: strategy: off (auto: one CPU device), 1 replica"]
    else:  # the user's handler gets them, in the user's format, once
        assert len(mine) == 2 and all(line.startswith("USER tfmp.") for line in mine)


def test_the_retracing_warning_is_dropped_for_functions_made_once_per_model_or_bucket_only():
    """Keras' per-model steps and zero3's per-bucket gathers are each traced once, but TensorFlow counts their traces
    together (one closure, one code object) and warns; any other function's retracing warning stays."""
    import logging

    from tfmp import logs

    logs.configure()
    tensorflow_logger = logging.getLogger("tensorflow")

    def kept(function: str) -> bool:
        message = (f"5 out of the last 5 calls to <function {function} at 0x7f0> triggered tf.function retracing. "
                   "Tracing is expensive")
        return bool(tensorflow_logger.filter(logging.LogRecord("tensorflow", logging.WARNING, __file__, 1, message, None, None)))

    assert not kept("whole_weights.<locals>.<lambda>")
    assert not kept("_save_through_the_chief.<locals>.<lambda>")
    assert not kept("TensorFlowTrainer._make_function.<locals>.one_step_on_data")
    assert kept("my_train_step") and kept("whole_weights_of_mine")
