"""tfmp.tf_environment: the variables set before TensorFlow loads, never over the user's."""

import os

import pytest

from tfmp import tf_environment


@pytest.fixture
def clean_environment(monkeypatch):
    for name in ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_on_x86_64_onednn_kernels_are_turned_on(clean_environment):
    clean_environment.setattr(tf_environment.platform, "machine", lambda: "x86_64")
    tf_environment.prepare()
    assert os.environ["TF_ENABLE_ONEDNN_OPTS"] == "1" and os.environ["TF_CPP_MIN_LOG_LEVEL"] == "2"


def test_on_arm_onednn_is_left_to_tensorflow(clean_environment):
    clean_environment.setattr(tf_environment.platform, "machine", lambda: "aarch64")
    tf_environment.prepare()
    assert "TF_ENABLE_ONEDNN_OPTS" not in os.environ


def test_the_users_choice_is_kept(clean_environment):
    clean_environment.setenv("TF_ENABLE_ONEDNN_OPTS", "0")
    clean_environment.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    clean_environment.setattr(tf_environment.platform, "machine", lambda: "x86_64")
    tf_environment.prepare()
    assert os.environ["TF_ENABLE_ONEDNN_OPTS"] == "0" and os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0"


def test_startup_lines_written_to_fd_2_are_captured_and_shown_only_when_asked_or_on_failure(capfd):
    with tf_environment.captured_stderr() as captured:
        os.write(2, b"E0000 failed call to cuInit\n")  # as TF's C++ side writes: to the descriptor, not sys.stderr
    assert captured == ["E0000 failed call to cuInit\n"] and capfd.readouterr().err == ""

    with tf_environment.captured_stderr(show=True):
        os.write(2, b"banner\n")
    assert capfd.readouterr().err == "banner\n"

    with pytest.raises(ImportError):
        with tf_environment.captured_stderr():
            os.write(2, b"why it failed\n")
            raise ImportError("no TensorFlow")
    assert capfd.readouterr().err == "why it failed\n"
