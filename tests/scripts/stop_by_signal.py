"""A user's own script with tfmp's callbacks, stopped by a signal it sends itself during training (as a scheduler's
SIGTERM would arrive): the script is left to end as Python ends it, with no handling of its own.

    python tests/scripts/stop_by_signal.py WORKDIR SIGNAL_NAME [WHERE]

WHERE: `step` (after the 3rd training step, the default), `last_validation` (the last validation batch of the last
epoch: no training batch end follows), `last_epoch_end` (the last epoch's end, after tfmp's own epoch-end callbacks).
"""

import os
import signal
import sys

import keras
import numpy as np

from tfmp import callbacks


EPOCHS, EXAMPLES, BATCH = 2, 64, 8


class Send(keras.callbacks.Callback):
    def __init__(self, signal_number, where):
        super().__init__()
        self.signal_number, self.where, self.epoch = signal_number, where, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.where == "step" and batch + 1 == 3:
            os.kill(os.getpid(), self.signal_number)

    def on_test_batch_end(self, batch, logs=None):
        if self.where == "last_validation" and self.epoch + 1 == EPOCHS and batch + 1 == EXAMPLES // BATCH:
            os.kill(os.getpid(), self.signal_number)

    def on_epoch_end(self, epoch, logs=None):
        if self.where == "last_epoch_end" and epoch + 1 == EPOCHS:
            os.kill(os.getpid(), self.signal_number)


workdir, name = sys.argv[1], sys.argv[2]
where = sys.argv[3] if len(sys.argv) > 3 else "step"
signal.signal(signal.SIGINT, signal.default_int_handler)  # as an interactive shell starts it (a background job ignores it)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
data = (np.ones((EXAMPLES, 4), np.float32), np.zeros((EXAMPLES, 1), np.float32))
model.fit(*data, batch_size=BATCH, epochs=EPOCHS, verbose=0, validation_data=data,
          callbacks=callbacks.default_callbacks(workdir) + [Send(getattr(signal, name), where)])
print("not reached")
