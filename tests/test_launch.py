"""`python -m tfmp.launch`: workers on 127.0.0.1 with TF's multi-worker runtime."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from conftest import checkpoint_steps, wait_for_checkpoint

from conftest import AUTO_PRECISION, REPO
from tfmp import launch


def _launch(*args, timeout=600):
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "-m", "tfmp.launch", *args], cwd=REPO, env=environment, capture_output=True, text=True,
                          timeout=timeout)


def test_free_ports_are_distinct_loopback_ports():
    ports = launch.free_ports(3)
    assert len(set(ports)) == 3 and all(1024 <= port < 65536 for port in ports)


def test_exit_code_of_a_signalled_process():
    assert launch.exit_code(-9) == 137 and launch.exit_code(2) == 2 and launch.exit_code(0) == 0


def test_a_failing_worker_fails_the_launch_with_its_code_and_prefixed_output(tmp_path):
    """A refusal only the workers can make (the images' size, known once the data is loaded; a bad flag is refused
    by the launcher itself, below)."""
    result = _launch("--num_workers=2", f"--workdir={tmp_path / 'run'}", "--model=resnet50", "--image_size=16")
    assert result.returncode == 2
    refusal = "tfmp.train: error: model resnet50 needs images of at least 32px, got 16; set --image_size"
    assert f"[worker 0] {refusal}" in result.stdout or f"[worker 1] {refusal}" in result.stdout, result.stdout[-2000:]
    # The first worker to fail stops the others (a dead peer would leave them blocked in a collective): the slower one
    # may be stopped before it prints its own refusal (seen under load), but no worker says anything else went wrong.
    errors = [line for line in result.stdout.splitlines() if line.startswith("[worker ") and "error" in line.lower()]
    assert errors and all(refusal in line for line in errors), errors
    assert "Traceback" not in result.stdout and not (tmp_path / "run" / "config.json").exists()


def test_flags_the_launcher_owns_are_refused(tmp_path):
    result = _launch("--num_workers=2", "--strategy=mirrored", f"--workdir={tmp_path}")
    assert result.returncode == 2 and "--strategy=mirrored is set by the launcher" in result.stderr


@pytest.mark.parametrize("flag, said", [("--epochs=0", "epochs must be a positive integer, got 0"),
                                         ("--no_such_flag=1", "Unknown command line flag 'no_such_flag'")])
def test_a_bad_flag_is_said_once_by_the_launcher_before_any_worker_starts(tmp_path, flag, said):
    """Each worker printed the same error after TensorFlow had started (twice with 2 workers)."""
    result = _launch("--num_workers=2", flag, f"--workdir={tmp_path / 'run'}", timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [f"tfmp.launch: error: {result.stderr.split('error: ', 1)[1].strip()}"]
    assert said in result.stderr and "[worker" not in result.stdout and not (tmp_path / "run").exists()


DIGITS = ["--flagfile=experiments/digits_supervised.cfg", "--epochs=6", f"--precision={AUTO_PRECISION}"]


def _metrics(workdir):
    with open(os.path.join(workdir, "metrics.json"), encoding="utf-8") as file:
        return json.load(file)


@pytest.mark.slow  # ~30 s
def test_two_workers_train_with_zero1_like_without(tmp_path):
    result = _launch("--num_workers=2", *DIGITS, "--sharding=zero1", f"--workdir={tmp_path / 'zero1'}")
    assert result.returncode == 0, result.stdout[-3000:]
    sharded = _metrics(tmp_path / "zero1")
    result = _launch("--num_workers=2", *DIGITS, f"--workdir={tmp_path / 'none'}")
    assert result.returncode == 0, result.stdout[-3000:]
    plain = _metrics(tmp_path / "none")
    assert sharded["num_replicas"] == plain["num_replicas"] == 2 and sharded["steps"] == plain["steps"]
    assert sharded["eval_accuracy"] >= 0.9 and abs(sharded["eval_accuracy"] - plain["eval_accuracy"]) <= 0.02
    assert sharded["train_loss"] == pytest.approx(plain["train_loss"], rel=0.02)


@pytest.mark.slow  # ~25 s
def test_two_workers_pretrain_under_zero3_and_the_chief_exports_the_encoder(tmp_path):
    """SSL pretraining ends by exporting `encoder.keras`, written by the chief alone; under zero3 on several workers
    reading the sharded weights is a collective, so every worker builds the export (before: the chief's gathers met
    the other worker's evaluation, which ended first, and the chief failed). The file loads without tfmp."""
    import keras
    import numpy as np

    workdir = tmp_path / "simclr"
    result = _launch("--num_workers=2", "--flagfile=experiments/digits_simclr.cfg", "--smoke", "--compare_supervised=false",
                     f"--precision={AUTO_PRECISION}", "--sharding=zero3", "--ema_momentum=0.9", f"--workdir={workdir}")
    assert result.returncode == 0, result.stdout[-3000:]
    metrics = _metrics(workdir)
    assert metrics["num_replicas"] == 2 and metrics["linear_probe_accuracy"] > 0.3 and "ema_linear_probe_accuracy" in metrics
    for name in ("encoder.keras", "encoder_ema.keras"):
        encoder = keras.saving.load_model(str(workdir / name))
        assert np.isfinite(encoder(np.zeros((1, 8, 8, 1), np.float32))).all()


def test_two_workers_train_digits_like_one_process(tmp_path, run_cli):
    """Real gRPC collectives between two processes on 127.0.0.1 (needs tfmp/upstream.py's Keras fixes)."""
    two = tmp_path / "two_workers"
    result = _launch("--num_workers=2", *DIGITS, f"--workdir={two}")
    assert result.returncode == 0, result.stdout[-3000:]
    # The largest worker's peak memory, read from the reaped workers (a TensorFlow worker needs well over 100 MiB).
    peak = re.search(r"^tfmp.launch: the largest worker's peak RSS: [0-9.]+ GiB \((\d+) bytes\)$", result.stdout, re.M)
    assert peak and int(peak.group(1)) > 100 * 2**20, result.stdout[-1000:]
    metrics = _metrics(two)
    assert metrics["strategy"] == "multi_worker_mirrored" and metrics["num_replicas"] == 2

    one = tmp_path / "one_process"
    single = run_cli(*DIGITS, "--strategy=off", f"--workdir={one}")
    assert single.returncode == 0, single.stderr[-2000:]
    assert metrics["eval_accuracy"] >= 0.9
    assert abs(metrics["eval_accuracy"] - _metrics(one)["eval_accuracy"]) <= 0.03


def _worker_pid(workdir, task_index):
    """The pid of the `tfmp.train` worker with this workdir and task index (from /proc)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                arguments = file.read().split(b"\0")
        except OSError:
            continue
        if f"--workdir={workdir}".encode() in arguments and f"--task_index={task_index}".encode() in arguments:
            return int(pid)
    raise AssertionError(f"no worker {task_index} for {workdir}")


@pytest.mark.slow  # 44 s each; the two-worker run itself is in the default suite
@pytest.mark.parametrize("stage", ["none", "zero1", "zero3"])
def test_a_killed_worker_stops_the_job_and_the_relaunch_resumes(tmp_path, stage):
    """With zero1 the relaunch scatters the state both workers all-gathered into the checkpoint (tfmp.sharding); with
    zero3 each relaunched worker reads only its own slices of the weights the chief's checkpoint holds whole."""
    workdir = str(tmp_path / "run")
    settings = [*DIGITS, "--checkpoint_every_steps=5", f"--sharding={stage}"]
    command = [sys.executable, "-m", "tfmp.launch", "--num_workers=2", *settings, f"--workdir={workdir}"]
    launcher = subprocess.Popen(command, cwd=REPO, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    reached = wait_for_checkpoint(launcher, workdir, at_least=10)
    os.kill(_worker_pid(workdir, 1), signal.SIGKILL)
    assert launcher.wait(timeout=120) != 0  # the launcher stops the chief instead of hanging
    assert not os.path.exists(os.path.join(workdir, "metrics.json"))

    result = _launch("--num_workers=2", *settings, f"--workdir={workdir}")
    assert result.returncode == 0, result.stdout[-3000:]
    assert _metrics(workdir)["resumed_from_step"] >= reached > 0
    assert checkpoint_steps(workdir)[-1] >= 6 * (1437 // 128)
    assert _metrics(workdir)["eval_accuracy"] >= 0.9


@pytest.mark.slow  # ~45 s: two workers stopped, then relaunched to the end
def test_sigterm_to_the_launcher_stops_every_worker_and_the_relaunch_resumes(tmp_path):
    """A scheduler stops the launcher with SIGTERM: it passes the signal on, waits for its workers (none outlives it)
    and exits 143; launching again resumes from the chief's last checkpoint."""
    workdir = str(tmp_path / "run")
    settings = [*DIGITS, "--checkpoint_every_steps=5"]
    command = [sys.executable, "-m", "tfmp.launch", "--num_workers=2", *settings, f"--workdir={workdir}"]
    launcher = subprocess.Popen(command, cwd=REPO, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    reached = wait_for_checkpoint(launcher, workdir, at_least=10)
    workers = [_worker_pid(workdir, index) for index in (0, 1)]
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=120) == 128 + signal.SIGTERM
    for pid in workers:  # reaped by the launcher: gone, not orphaned and still training
        assert not os.path.exists(f"/proc/{pid}"), pid
    assert not os.path.exists(os.path.join(workdir, "metrics.json"))

    result = _launch("--num_workers=2", *settings, f"--workdir={workdir}")
    assert result.returncode == 0, result.stdout[-3000:]
    assert _metrics(workdir)["resumed_from_step"] >= reached > 0
