"""The checkpoint taken on SIGTERM (a preemption notice) or Ctrl-C, and the `Preempted` stop that follows."""

from __future__ import annotations

import logging
import signal
import threading

import keras

from tfmp.callbacks.checkpointing import Checkpointing
from tfmp.callbacks.interfaces import SavesNow, StepCount
from tfmp.callbacks.step_counter import CountingCallback, StepCounter

logger = logging.getLogger(__name__)


class Preempted(SystemExit):
    """SIGTERM or Ctrl-C (SIGINT) arrived during training; the current step was checkpointed.

    A `SystemExit` with code 128 + the signal (143, 130), as a shell reports a process that signal
    stopped: uncaught, a user's script ends there with that code and no traceback, like the CLI
    (the one line saying what happened is logged before it is raised); `except Preempted` catches it.

    Attributes:
        signal_number: the signal that stopped training.
    """

    def __init__(self, message: str, signal_number: int):
        super().__init__(128 + signal_number)
        self.message = message
        self.signal_number = signal_number

    def __str__(self) -> str:
        return self.message


class PreemptionCheckpoint(CountingCallback):
    """On SIGTERM (the preemption notice of TPU VMs, spot GPUs, Kubernetes) or Ctrl-C, saves a
    checkpoint of the current step and stops with `Preempted`, wherever in `fit()` the signal lands.

    The handler only sets a flag, so the step in flight finishes cleanly; the stop comes at the
    next training batch end, validation batch end, epoch end, or at the end of `fit()` (a signal
    during the last epoch's validation or epoch-end callbacks still stops the process, as it would
    without tfmp). Rerunning the same command resumes from that checkpoint. A second Ctrl-C
    before then interrupts at once (Python's own KeyboardInterrupt), for a step that never ends.
    Ctrl-C is left alone where the process was told to ignore it (`nohup`, `SIG_IGN`). Installed
    for the duration of `fit()` when `fit()` runs in the main thread (Python delivers signals only
    there; elsewhere it says so once), the previous handlers restored afterwards. Single-process
    runs only: multi-worker runs need every worker to save at the same step, which is what TF's
    `PreemptionCheckpointHandler` coordinates (not wired in yet).

    Args:
        checkpointing: what saves the current step (`tfmp.callbacks.Checkpointing`).
        counter: the run's `StepCounter` (default: the checkpoints' own).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    runs_after = (StepCounter, Checkpointing)  # an epoch end's own checkpoint is taken before a stop there

    def __init__(self, checkpointing: SavesNow, counter: StepCount | None = None):
        super().__init__(counter or checkpointing.counter)
        self.checkpointing = checkpointing
        self.requested: int | None = None  # the signal received, if any
        self._previous: dict = {}

    def _request(self, signum, frame):
        if signum == signal.SIGINT and self.requested == signal.SIGINT:
            self._uninstall()  # the second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.requested = signum

    def _uninstall(self):
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def on_train_begin(self, logs=None):
        self.requested = None
        if threading.current_thread() is not threading.main_thread():
            logger.warning("PreemptionCheckpoint: fit() runs outside the main thread, where Python cannot receive SIGTERM or "
                           "Ctrl-C; a preempted run resumes from its last regular checkpoint")
            return
        for number in self.SIGNALS:
            if signal.getsignal(number) is not signal.SIG_IGN:
                self._previous[number] = signal.signal(number, self._request)

    def _stop_if_requested(self, logs) -> None:
        if self.requested is None:
            return
        self._uninstall()
        saved = self.checkpointing.save_now(logs)
        name = "SIGTERM" if self.requested == signal.SIGTERM else "Ctrl-C (SIGINT)"
        stopped = Preempted(f"stopped by {name} at step {self.counter.step}: "
                            + ("checkpoint saved" if saved else "state not saved, last good checkpoint kept")
                            + "; rerun the same command to resume", self.requested)
        logger.warning("%s", stopped)
        raise stopped

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        self._stop_if_requested(logs)

    def on_test_batch_end(self, batch, logs=None):
        self._stop_if_requested(None)  # validation inside fit(): the training state is the epoch's last step

    def on_epoch_end(self, epoch, logs=None):
        self._stop_if_requested(logs)

    def on_train_end(self, logs=None):
        self._uninstall()
        self._stop_if_requested(logs)
