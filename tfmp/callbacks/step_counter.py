"""`StepCounter`: the training steps a run has taken, across resumptions (the number checkpoints carry), and
`CountingCallback`, the base of the callbacks that read it."""

from __future__ import annotations

import keras

from tfmp.callbacks.interfaces import StepCount


class StepCounter(keras.callbacks.Callback):
    """Training steps this run has taken, across resumptions (the number checkpoints carry).

    Counted from the batch indices `fit()` passes to callbacks, which also counts right with
    `steps_per_execution > 1`, rather than read from `model.optimizer.iterations`: a model whose
    `train_step` steps its own optimizers leaves that one at 0. It owns its fields: other
    callbacks read them and set them only through `start_at` and `rewind`
    (`tfmp.callbacks.interfaces.StepCount`). It runs before every callback that reads it.
    """

    def __init__(self):
        super().__init__()
        self._step = 0
        self._previous_step = 0  # the count before the last batch end: steps_per_execution steps ago
        self._epoch_start = 0
        self._batch = -1

    @property
    def step(self) -> int:
        return self._step

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = self._step
        self._batch = -1

    def on_train_batch_end(self, batch, logs=None):
        self._batch = batch
        self._previous_step, self._step = self._step, self._epoch_start + batch + 1

    @property
    def steps_into_epoch(self) -> int:
        """Steps of the current epoch done at the last batch end."""
        return self._batch + 1

    def crossed(self, every: int) -> bool:
        """Whether the last batch end passed a multiple of `every` steps (0: never). With
        `steps_per_execution > 1` callbacks see one batch end per execution, so "step % every == 0"
        would miss most multiples."""
        return bool(every) and self._step // every > self._previous_step // every

    def start_at(self, step: int) -> None:
        """The step a resumed run starts from (a checkpoint's), before its first batch."""
        self._step = self._previous_step = self._epoch_start = step

    def rewind(self, step: int) -> None:
        """Sets the count to `step` (a restored checkpoint's) at the current batch: the next batch is step + 1."""
        self._step = self._previous_step = step
        self._epoch_start = step - self._batch - 1


class CountingCallback(keras.callbacks.Callback):
    """A callback that reads the run's step count: the run's `StepCounter` when given (which runs before it and counts
    for everyone), else a counter of its own that it drives (a callback used on its own). Subclasses that override
    `on_epoch_begin` or `on_train_batch_end` call these first.

    Args:
        counter: the run's `StepCounter`, or None.
    """

    runs_after = (StepCounter,)

    def __init__(self, counter: StepCount | None = None):
        super().__init__()
        self._owns_counter = counter is None
        self.counter: StepCount = counter or StepCounter()

    def on_epoch_begin(self, epoch, logs=None):
        if self._owns_counter:
            self.counter.on_epoch_begin(epoch, logs)

    def on_train_batch_end(self, batch, logs=None):
        if self._owns_counter:
            self.counter.on_train_batch_end(batch, logs)
