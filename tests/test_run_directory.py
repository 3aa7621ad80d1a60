"""`tfmp.run_directory`: where a run's files go, for stages and for non-chief workers."""

import os

import pytest

from tfmp.config import UsageError
from tfmp.run_directory import RunDirectory


def test_stages_keep_their_files_apart_and_their_curves_in_the_run_logdir(tmp_path):
    run = RunDirectory(str(tmp_path))
    baseline = run.stage("baseline", "draw2")
    assert baseline.checkpoints == str(tmp_path / "baseline" / "draw2" / "checkpoints")
    assert baseline.history_file == str(tmp_path / "baseline" / "draw2" / "history.csv")
    assert run.tensorboard == str(tmp_path / "tensorboard")
    assert baseline.tensorboard == str(tmp_path / "tensorboard" / "baseline" / "draw2")  # one --logdir shows every stage


def test_a_non_chief_worker_reads_the_chiefs_files_and_writes_to_scratch(tmp_path):
    worker = RunDirectory(str(tmp_path)).for_worker(chief=False)
    assert worker.checkpoints == str(tmp_path / "checkpoints")
    assert worker.is_scratch and not worker.checkpoints_to_write.startswith(str(tmp_path) + os.sep)
    assert worker.tensorboard.startswith(worker.write_path) and worker.stage("baseline").tensorboard.startswith(worker.write_path)
    assert RunDirectory(str(tmp_path)).for_worker(chief=True) == RunDirectory(str(tmp_path))


def test_the_writable_check_creates_no_folder_even_for_a_moment(tmp_path, monkeypatch):
    """Two workers check one new workdir at once: if the check created and removed it, one worker's
    removal could pull the folder from under the other's probe file (seen in test_launch)."""
    def refuse(*args, **kwargs):
        raise AssertionError("check_writable created a folder")
    monkeypatch.setattr(os, "makedirs", refuse)
    monkeypatch.setattr(os, "mkdir", refuse)
    RunDirectory(str(tmp_path / "new" / "run")).check_writable()
    assert os.listdir(tmp_path) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is not writable"):
        RunDirectory(str(tmp_path / "file" / "run")).check_writable()


def test_the_writable_check_leaves_no_folder_behind(tmp_path):
    RunDirectory(str(tmp_path / "a" / "b" / "run")).check_writable()
    assert os.listdir(tmp_path) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is a file, not a directory"):
        RunDirectory(str(tmp_path / "file")).check_writable()
