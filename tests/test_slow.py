"""The long end-to-end claims, run with `pytest -m slow` (minutes each; not in the default suite)."""

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import REPO, wait_for_checkpoint


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("preset", ["digits_byol", "digits_vicreg", "digits_barlow_twins", "digits_mocov3", "digits_mae"])
@pytest.mark.parametrize("strategy", [["--strategy=off"], ["--strategy=mirrored", "--num_cpu_devices=2"]],
                         ids=["one_device", "two_replicas"])
def test_each_ssl_method_preset_beats_the_supervised_baseline(run_cli, tmp_path, preset, strategy):
    """Issue 12's claim: on digits with 30 labels, each new method's linear probe beats the same encoder (the CNN;
    MAE's ViT) trained from scratch on the same labels (mean of 5 draws), in float32, on one device and on 2 replicas;
    MAE's fine-tuned encoder too (issue 32)."""
    workdir = tmp_path / "run"
    result = run_cli(f"--flagfile=experiments/{preset}.cfg", f"--workdir={workdir}", "--precision=float32",
                     "--compare_supervised=true", *strategy, timeout=2000)
    assert result.returncode == 0, result.stderr[-2000:]
    with open(os.path.join(workdir, "metrics.json"), encoding="utf-8") as file:
        metrics = json.load(file)
    assert metrics["linear_probe_accuracy"] > metrics["supervised_baseline_accuracy"]
    if preset == "digits_mae":  # evaluated by fine-tuning too (--compare_finetune in the preset)
        assert metrics["finetune_accuracy"] > metrics["supervised_baseline_accuracy"]
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


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_the_main_job_stopped_by_ctrl_c_mid_run_ends_with_its_1100_steps(run_cli, tmp_path):
    """Issue 22's report: stopped by SIGINT around step 341 and rerun, the main job said 1111 steps; now 1100."""
    workdir = tmp_path / "run"
    args = ["--flagfile=experiments/digits_simclr.cfg", f"--workdir={workdir}", "--checkpoint_every_steps=17"]
    process = subprocess.Popen([sys.executable, "-m", "tfmp.train", *args], cwd=REPO, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_for_checkpoint(process, str(workdir), at_least=340)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=120) == 130, process.stderr.read()[-2000:]
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr[-2000:]
    with open(workdir / "metrics.json", encoding="utf-8") as file:
        metrics = json.load(file)
    assert metrics["steps"] == 1100 and 340 <= metrics["resumed_from_step"] < 1100
