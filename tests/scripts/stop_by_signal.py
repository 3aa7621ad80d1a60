"""A user's own script with tfmp's callbacks, stopped by a signal it sends itself mid-training (as a scheduler's
SIGTERM would arrive): the script is left to end as Python ends it, with no handling of its own.

    python tests/scripts/stop_by_signal.py WORKDIR SIGNAL_NAME
"""

import os
import signal
import sys

import keras
import numpy as np

from tfmp import callbacks


class SendAtStep(keras.callbacks.Callback):
    def __init__(self, signal_number, step):
        super().__init__()
        self.signal_number, self.step = signal_number, step

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == self.step:
            os.kill(os.getpid(), self.signal_number)


workdir, name = sys.argv[1], sys.argv[2]
signal.signal(signal.SIGINT, signal.default_int_handler)  # as an interactive shell starts it (a background job ignores it)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
model.fit(np.ones((64, 4), np.float32), np.zeros((64, 1), np.float32), batch_size=8, epochs=2, verbose=0,
          callbacks=[*callbacks.default_callbacks(workdir), SendAtStep(getattr(signal, name), 3)])
print("not reached")
