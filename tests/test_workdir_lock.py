"""One run per workdir: a second process is refused in one line naming the holder; a killed holder's
lock is taken over with a warning; library use (`default_callbacks`) gets the same protection."""

import json
import logging
import os
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest

from conftest import REPO
from tfmp import callbacks
from tfmp.workdir_lock import LOCK_FILE, WorkdirInUse, WorkdirLock

HOLD_LOCK = """
import sys, time
from tfmp.workdir_lock import WorkdirLock
lock = WorkdirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


def _holder(workdir):
    """A process holding `workdir`'s lock, returned once it holds it (it prints "held")."""
    process = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(workdir)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_second_process_is_refused_naming_the_holder_and_a_killed_holders_lock_is_taken_over(tmp_path, caplog):
    holder = _holder(tmp_path)
    try:
        with pytest.raises(WorkdirInUse, match=rf"workdir {tmp_path} is in use by pid {holder.pid} \(since 20\d\d-"):
            WorkdirLock(str(tmp_path)).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with caplog.at_level(logging.WARNING, logger="tfmp"):
        lock = WorkdirLock(str(tmp_path)).acquire()
    assert f"the run holding it (pid {holder.pid}" in caplog.text and "taking it over" in caplog.text
    with open(tmp_path / LOCK_FILE, encoding="utf-8") as file:
        assert json.load(file)["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_the_cli_refuses_a_workdir_in_use_in_one_line_and_writes_nothing(run_cli, tmp_path):
    workdir = tmp_path / "run"
    holder = _holder(workdir)
    try:
        result = run_cli("--epochs=1", "--precision=float32", "--strategy=off", f"--workdir={workdir}")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"tfmp.train: error: workdir {workdir} is in use by pid {holder.pid} (since ")
    assert line.endswith("); wait for that run to end, or choose another --workdir")
    assert sorted(os.listdir(workdir)) == [LOCK_FILE]  # the holder's; nothing of the refused run
    rerun = run_cli("--epochs=1", "--precision=float32", "--strategy=off", f"--workdir={workdir}")
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "is gone; taking it over" in rerun.stderr and not (workdir / LOCK_FILE).exists()


@pytest.mark.slow  # ~20 s: two CLI runs side by side on 2 cores
def test_two_cli_runs_started_together_one_trains_the_other_is_refused(tmp_path):
    workdir = tmp_path / "run"
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    command = [sys.executable, "-m", "tfmp.train", "--epochs=6", "--precision=float32", "--strategy=off", f"--workdir={workdir}"]
    first, second = (subprocess.Popen(command, cwd=REPO, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for _ in range(2))
    results = [(process.wait(timeout=600), process.stderr.read()) for process in (first, second)]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    refused = next(stderr for code, stderr in results if code == 2)
    assert "is in use by pid" in refused.strip().splitlines()[-1]
    with open(workdir / "history.csv", encoding="utf-8") as file:
        assert len(file.read().strip().splitlines()) == 1 + 6  # a header and the six epochs, once


def test_library_use_is_protected_too(tmp_path):
    holder = _holder(tmp_path)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    try:
        with pytest.raises(WorkdirInUse, match=f"in use by pid {holder.pid}"):
            model.fit(np.zeros((4, 2)), np.zeros((4, 1)), epochs=1, verbose=0, callbacks=callbacks.default_callbacks(str(tmp_path)))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    run_callbacks = callbacks.default_callbacks(str(tmp_path))
    model.fit(np.zeros((4, 2)), np.zeros((4, 1)), epochs=1, verbose=0, callbacks=run_callbacks)
    assert not (tmp_path / LOCK_FILE).exists()  # released at the end of fit()
    assert run_callbacks.checkpointing.last_good_checkpoint is not None
