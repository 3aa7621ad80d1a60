"""What one tfmp callback may ask of another: the narrow interfaces, and the order they run in.

A callback that needs another one's help (the NaN guard restoring the last good checkpoint, the
preemption handler saving the current step) takes it as one of these `Protocol`s and uses nothing
else of it; `tests/test_callback_contracts.py` reads the callbacks' source and fails on any other
attribute one callback reads of another. The order is declared the same way: a callback class
names the classes that must run before it (`runs_after`) or after it (`runs_before`) in the list
`fit()` gets, and `check_order` refuses a list that breaks it — no order lives in a comment.
"""

from __future__ import annotations

from typing import Protocol, Sequence


class StepCount(Protocol):
    """The run's step count (`tfmp.callbacks.StepCounter`)."""

    @property
    def step(self) -> int:
        """Steps the run has taken, across resumptions."""

    @property
    def steps_into_epoch(self) -> int:
        """Steps of the current epoch done at the last batch end."""

    def crossed(self, every: int) -> bool:
        """Whether the last batch end passed a multiple of `every` steps."""

    def rewind(self, step: int) -> None:
        """A restored checkpoint's step, at the current batch."""

    def start_at(self, step: int) -> None:
        """The step a resumed run starts from, before its first batch."""

    # A callback made without the run's counter makes its own and drives it with these hooks.
    def on_epoch_begin(self, epoch, logs=None) -> None: ...

    def on_train_batch_end(self, batch, logs=None) -> None: ...


class SaveGate(Protocol):
    """Whoever decides that a state must not be saved (`tfmp.callbacks.NaNGuard`)."""

    def save_veto(self, logs: dict | None) -> str | None:
        """Why the current state must not be saved (e.g. "non-finite weights"), or None when it may be."""


class RestorePoint(Protocol):
    """What the NaN guard needs of the checkpoints (`tfmp.callbacks.Checkpointing`)."""

    counter: StepCount  # the count the checkpoints carry and a restore rewinds

    @property
    def last_good_checkpoint(self) -> str | None:
        """The newest checkpoint that reads completely, or None."""

    def restore_last_good(self) -> bool:
        """Restores the newest complete checkpoint; False when there is none."""

    def set_save_gate(self, gate: SaveGate) -> None:
        """Every save asks `gate.save_veto(logs)` first."""


class SavesNow(Protocol):
    """What the preemption handler needs of the checkpoints (`tfmp.callbacks.Checkpointing`)."""

    counter: StepCount  # the count the checkpoints carry

    def save_now(self, logs=None) -> bool:
        """Saves the current step; whether it was saved (not vetoed)."""


class CallbackOrderError(ValueError):
    """A callback list breaks an order its callbacks declare (`runs_after`, `runs_before`)."""


def check_order(callbacks: Sequence) -> None:
    """Raises `CallbackOrderError` naming the first pair of `callbacks` out of the order their classes declare.

    A class's `runs_after` names the classes whose instances must come before its own in the list, `runs_before`
    those that must come after; classes absent from the list impose nothing."""
    for position, callback in enumerate(callbacks):
        for other_position, other in enumerate(callbacks):
            after = isinstance(other, tuple(getattr(callback, "runs_after", ()))) and other_position > position
            before = isinstance(other, tuple(getattr(callback, "runs_before", ()))) and other_position < position
            if after or before:
                first, second = (other, callback) if after else (callback, other)
                raise CallbackOrderError(f"callback order: {type(first).__name__} must run before {type(second).__name__} "
                                         f"(positions {min(position, other_position)} and {max(position, other_position)} "
                                         "are the other way round)")
