"""`RunLock`: the run directory's lock held for the length of `fit()`, so library users get one run per workdir too."""

from __future__ import annotations

import keras

from tfmp.workdir_lock import WorkdirLock


class RunLock(keras.callbacks.Callback):
    """Takes `directory`'s lock at train begin (`tfmp.workdir_lock`; refused with `WorkdirInUse` while another
    process holds it) and gives it back at train end; None locks nothing (a non-chief worker's scratch)."""

    def __init__(self, directory: str | None):
        super().__init__()
        self.lock = WorkdirLock(directory) if directory else None

    def on_train_begin(self, logs=None):
        if self.lock is not None:
            self.lock.acquire()

    def on_train_end(self, logs=None):
        if self.lock is not None:
            self.lock.release()
