"""Checkpoint discovery that survives damage: each way a checkpoint folder gets damaged (a crash
mid-write, a full disk, a bad copy), then a rerun with `default_callbacks`.

The rerun restores the newest checkpoint that reads completely, warns in one line naming what
it skipped, and never restores part of one; when checkpoint files exist but none reads, it
refuses (UsageError: the CLI's exit 2) rather than silently start over.
"""

import logging
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmp import callbacks
from tfmp.config import UsageError

EPOCHS = 2
EVERY = 4


def _digits():
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    return (images / 16.0).astype(np.float32), labels.astype(np.int32)


def _model():
    inputs = keras.Input((64,))
    outputs = keras.layers.Dense(10)(keras.layers.Dense(32, activation="relu")(inputs))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _train(workdir, epochs=EPOCHS):
    images, labels = _digits()
    model = _model()
    run_callbacks = callbacks.default_callbacks(str(workdir), checkpoint_every_steps=EVERY)
    model.fit(images, labels, batch_size=256, epochs=epochs, verbose=0, callbacks=run_callbacks)
    return model, run_callbacks.checkpointing


def _overwrite(path, content: bytes):
    with open(path, "wb") as file:
        file.write(content)


def _garbage(path):
    _overwrite(path, os.urandom(max(64, os.path.getsize(path))))


def _truncate(path):
    with open(path, "r+b") as file:
        file.truncate(os.path.getsize(path) // 2)


DAMAGE = {  # how the newest checkpoint is damaged
    "garbage index": lambda prefix: _garbage(f"{prefix}.index"),
    "empty index": lambda prefix: _overwrite(f"{prefix}.index", b""),
    "garbage data": lambda prefix: _garbage(f"{prefix}.data-00000-of-00001"),
    "truncated shard": lambda prefix: _truncate(f"{prefix}.data-00000-of-00001"),
    "missing shard": lambda prefix: os.remove(f"{prefix}.data-00000-of-00001"),
}


@pytest.mark.parametrize("garbage_state_file", [False, True], ids=["state_file_intact", "state_file_garbage"])
@pytest.mark.parametrize("damage", DAMAGE)
def test_the_rerun_resumes_from_the_newest_complete_checkpoint(damage, garbage_state_file, tmp_path, caplog):
    _train(tmp_path)
    directory = os.path.join(tmp_path, "checkpoints")
    found = callbacks.find_checkpoints(directory)
    assert len(found) >= 2
    (older_step, older), (newest_step, newest) = found[-2], found[-1]
    DAMAGE[damage](newest)
    if garbage_state_file:
        _garbage(os.path.join(directory, "checkpoint"))
    older_weights = _restored_weights(older)

    with caplog.at_level(logging.WARNING, logger="tfmp"):
        model, checkpointing = _train(tmp_path, epochs=EPOCHS + 1)

    assert checkpointing.restored_step == older_step > 0
    assert checkpointing.restored_path == older
    skipped = [record.getMessage() for record in caplog.records if "skipped" in record.getMessage()]
    assert len(skipped) == 1 and f"skipped ckpt-{newest_step} (" in skipped[0] and f"resuming from ckpt-{older_step}" in skipped[0]
    assert "\n" not in skipped[0]
    if garbage_state_file:
        assert os.path.exists(os.path.join(directory, "checkpoint.unreadable"))  # kept for inspection, then rebuilt
    # Training went on from the older checkpoint's weights, and saved new, readable checkpoints after it.
    newest_now = checkpointing.last_good_checkpoint
    assert callbacks.find_checkpoints(directory)[-1][1] == newest_now
    assert int(newest_now.rsplit("-", 1)[1]) > newest_step
    assert not all(np.array_equal(a, b) for a, b in zip(older_weights, model.get_weights()))


def _restored_weights(path):
    """The model weights stored in checkpoint `path`, read with tf.train alone."""
    model = _model()
    tf.train.Checkpoint(model=model).read(path).expect_partial()
    return model.get_weights()


def test_a_restore_never_mixes_checkpoints(tmp_path):
    _train(tmp_path)
    directory = os.path.join(tmp_path, "checkpoints")
    (_, older), (_, newest) = callbacks.find_checkpoints(directory)[-2:]
    expected = _restored_weights(older)
    DAMAGE["truncated shard"](newest)

    model = _model()
    checkpointing = callbacks.Checkpointing(directory)
    checkpointing.set_model(model)
    assert checkpointing.restore_last_good()
    for restored, wanted in zip(model.get_weights(), expected):
        np.testing.assert_array_equal(restored, wanted)


def test_nothing_readable_refuses_with_the_path_and_what_to_do(tmp_path):
    _train(tmp_path)
    directory = os.path.join(tmp_path, "checkpoints")
    for _, prefix in callbacks.find_checkpoints(directory):
        DAMAGE["garbage index"](prefix)
    with pytest.raises(UsageError) as refused:
        _train(tmp_path, epochs=EPOCHS + 1)
    message = str(refused.value)
    assert "\n" not in message and directory in message and "none restores completely" in message
    assert "move that folder aside" in message


def test_a_garbage_state_file_alone_starts_over_with_a_warning(tmp_path, caplog):
    """Nothing of the run's state could be lost: no checkpoint was ever written beside it."""
    directory = os.path.join(tmp_path, "checkpoints")
    os.makedirs(directory)
    _overwrite(os.path.join(directory, "checkpoint"), os.urandom(200))
    with caplog.at_level(logging.WARNING, logger="tfmp"):
        _, checkpointing = _train(tmp_path, epochs=1)
    assert checkpointing.restored_step == 0
    assert any("was unreadable" in record.getMessage() for record in caplog.records)
    assert callbacks.find_checkpoints(directory)  # and it checkpoints as usual
