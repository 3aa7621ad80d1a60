"""The long end-to-end claims, run with `pytest -m slow` (minutes each; not in the default suite)."""

import json
import os

import pytest


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("preset", ["digits_byol", "digits_vicreg", "digits_barlow_twins", "digits_mocov3"])
@pytest.mark.parametrize("strategy", [["--strategy=off"], ["--strategy=mirrored", "--num_cpu_devices=2"]],
                         ids=["one_device", "two_replicas"])
def test_each_ssl_method_preset_beats_the_supervised_baseline(run_cli, tmp_path, preset, strategy):
    """Issue 12's claim: on digits with 30 labels, each new method's linear probe beats the same CNN
    trained from scratch on the same labels (mean of 5 draws), in float32, on one device and on 2 replicas."""
    workdir = tmp_path / "run"
    result = run_cli(f"--flagfile=experiments/{preset}.cfg", f"--workdir={workdir}", "--precision=float32",
                     "--compare_supervised=true", *strategy, timeout=2000)
    assert result.returncode == 0, result.stderr[-2000:]
    with open(os.path.join(workdir, "metrics.json"), encoding="utf-8") as file:
        metrics = json.load(file)
    assert metrics["linear_probe_accuracy"] > metrics["supervised_baseline_accuracy"]
    assert len(metrics["linear_probe_accuracy_per_draw"]) == 5


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("precision", ["mixed_bfloat16", "float32"])
def test_digits_simclr_preset_beats_the_supervised_baseline(run_cli, tmp_path, precision):
    """The main job's claim: with 30 labels, the SimCLR probe beats the same CNN trained from
    scratch, on average over the preset's 5 label draws, by more than 3 points."""
    workdir = tmp_path / "run"
    result = run_cli("--flagfile=experiments/digits_simclr.cfg", f"--workdir={workdir}", f"--precision={precision}",
                     "--strategy=off", timeout=1800)
    assert result.returncode == 0, result.stderr[-2000:]
    with open(os.path.join(workdir, "metrics.json"), encoding="utf-8") as file:
        metrics = json.load(file)
    assert metrics["linear_probe_accuracy"] > metrics["supervised_baseline_accuracy"] + 0.03
    assert len(metrics["linear_probe_accuracy_per_draw"]) == 5
