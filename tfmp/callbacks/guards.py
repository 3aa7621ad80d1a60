"""Guards that stop a run from silently going wrong: divergence (NaN/inf/exploding losses, non-finite
weights, endless fp16 skips) and replicas whose copies of the model drift apart."""

from __future__ import annotations

import logging
import math
import weakref

import keras
import tensorflow as tf

from tfmp import distribute, precision
from tfmp.callbacks.interfaces import RestorePoint, StepCount
from tfmp.callbacks.model_state import first_non_finite, learning_rate, logged_losses, optimizer_steps, owned_optimizers
from tfmp.callbacks.step_counter import CountingCallback

logger = logging.getLogger(__name__)

# Model -> (ids of the variables it reads, a traced all-finite reduction over them): traced once per model and variables.
_FINITE_CHECKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class NaNGuard(CountingCallback):
    """Catches divergence: restores the last good checkpoint and retries, then stops with a diagnosis.

    Watches every loss the model logs (`loss`, or a custom model's `c_loss`, `p_loss`, ...) and
    triggers on one that is not finite, on one `loss_explosion_factor` times its best finished
    epoch (Keras' per-batch logs are the epoch's running means, so one noisy batch does not
    trigger it), on non-finite weights or optimizer state (a BatchNorm model can diverge with a
    huge but finite loss), or on more than `max_skipped_steps` steps in a row skipped by fp16
    loss scaling once a loss scale is at its floor. Each trigger restores the newest checkpoint
    and goes on, up to `nan_retries` times; then training stops and `diagnosis` names the step,
    the loss, the optimizers' learning rates and the likely cause (the CLI's exit code 1).

    It is also the checkpoints' save gate (`save_veto`): a state whose losses, weights or
    optimizer slots are not finite, or any state once training has failed, is never saved, so
    the newest checkpoint is always the last good one. It runs after the step counter it reads.

    Args:
        checkpointing: the run's checkpoints (`tfmp.callbacks.Checkpointing`): what the guard restores, and gates.
        counter: the run's `StepCounter` (default: the checkpoints' own, which a restore rewinds).
        nan_retries: restores before giving up.
        max_skipped_steps: fp16 steps skipped in a row that count as a failure once the loss scale is at its floor.
        loss_explosion_factor: loss / its best epoch value that counts as divergence (0: off).
    """

    def __init__(self, checkpointing: RestorePoint, nan_retries: int = 2, max_skipped_steps: int = 20,
                 loss_explosion_factor: float = 1000.0, counter: StepCount | None = None):
        super().__init__(counter or checkpointing.counter)
        self.checkpointing = checkpointing
        checkpointing.set_save_gate(self)
        self.nan_retries = nan_retries
        self.max_skipped_steps = max_skipped_steps
        self.loss_explosion_factor = loss_explosion_factor
        self._best_epoch_losses: dict[str, float] = {}  # this process's epochs; a resumed run starts afresh
        self.retries = 0
        self.events: list[str] = []
        self.diagnosis: str | None = None
        self._skip_streak = 0
        self._skipped = 0
        self._warned_no_loss = False
        self._nonfinite_state_step: int | None = None  # seen by a vetoed save, not yet acted on
        self._watched: dict | None = None  # the model's optimizers, found at train begin

    @property
    def _optimizers(self) -> dict:
        # Found once per fit() (read at every batch end): a model's optimizers do not change during training.
        if self._watched is None:
            self._watched = owned_optimizers(self.model)
        return self._watched

    def _loss_scale_at_its_floor(self) -> bool:
        """Whether some loss-scaling optimizer can lower its scale no further: only then are skipped steps a failure
        (while the scale can still halve, skipping is the loss scaling finding its scale)."""
        for optimizer in self._optimizers.values():
            scale = precision.current_loss_scale(optimizer)
            if scale is not None and (not getattr(optimizer, "dynamic", True) or scale <= getattr(optimizer, "min_scale", 1.0)):
                return True
        return False

    def _total_skipped(self) -> int:
        return sum(precision.skipped_steps(optimizer) or 0 for optimizer in self._optimizers.values())

    # ------------------------------------------------------------------ the save gate

    def save_veto(self, logs) -> str | None:
        """Why the current state must not be saved, or None (`tfmp.callbacks.checkpointing.SaveGate`)."""
        if self.diagnosis is not None:
            return "training failed"
        losses = logged_losses(logs)
        bad = first_non_finite(losses)
        if bad:
            return f"non-finite {bad} {losses[bad]}"
        if not self._state_is_finite():
            self._nonfinite_state_step = self.counter.step
            return "non-finite weights"
        return None

    def _state_is_finite(self) -> bool:
        # A step's loss is computed before its update: the weights can be non-finite while the
        # logged loss is not, so the weights, BatchNorm statistics and optimizer slots are read too,
        # in one traced reduction (traced again only when the variables change).
        variables = [variable for variable in [*self.model.weights, *(variable for optimizer in self._optimizers.values()
                                                                       if optimizer.built for variable in optimizer.variables)]
                     if "float" in str(variable.dtype)]
        key = [id(variable) for variable in variables]
        known = _FINITE_CHECKS.get(self.model)  # shared by every guard of this model (an SSL run's baseline draws)
        if known is None or known[0] != key:
            check = tf.function(lambda: tf.reduce_all([tf.reduce_all(tf.math.is_finite(value)) for variable in variables
                                                       for value in _held_values(variable)]))
            known = _FINITE_CHECKS[self.model] = (key, check)
        return bool(known[1]())

    def _take_nonfinite_state_step(self) -> int | None:
        step, self._nonfinite_state_step = self._nonfinite_state_step, None
        return step

    # ------------------------------------------------------------------ watching

    def on_train_begin(self, logs=None):
        self._watched = None
        self._skipped = self._total_skipped()

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        losses = logged_losses(logs)
        if not losses and not self._warned_no_loss:
            self._warned_no_loss = True
            logger.warning("NaNGuard: %s logs no loss (logged: %s); it watches the weights at each checkpoint only",
                           self.model.name, ", ".join(sorted(logs or {})) or "nothing")
        # Skipped steps since the last batch end (one step, or an execution of several with
        # steps_per_execution): a streak grows while every batch end brings new skips.
        skipped = self._total_skipped()
        self._skip_streak = self._skip_streak + skipped - self._skipped if skipped > self._skipped else 0
        self._skipped = skipped
        step = self.counter.step
        nonfinite_state_step = self._take_nonfinite_state_step()
        bad = first_non_finite(losses)
        exploded = self._exploded(losses)
        if bad:
            self._recover(f"step {step}: {bad} {losses[bad]}")
        elif nonfinite_state_step is not None:
            self._recover(f"step {nonfinite_state_step}: non-finite weights ({self._describe(losses)})")
        elif exploded:
            self._recover(f"step {step}: {exploded} {losses[exploded]:.3g}, {losses[exploded] / self._best_epoch_losses[exploded]:.3g}x "
                          f"the best epoch's {self._best_epoch_losses[exploded]:.3g}")
        elif self._skip_streak > self.max_skipped_steps and self._loss_scale_at_its_floor():
            self._recover(f"step {step}: {self._skip_streak} fp16 steps skipped in a row")

    @staticmethod
    def _describe(losses: dict[str, float]) -> str:
        return ", ".join(f"{name} {value:.3g}" for name, value in losses.items()) or "no loss logged"

    def _exploded(self, losses: dict[str, float]) -> str | None:
        if not self.loss_explosion_factor:
            return None
        return next((name for name, value in losses.items()
                     if self._best_epoch_losses.get(name) and value > self.loss_explosion_factor * self._best_epoch_losses[name]), None)

    def on_epoch_end(self, epoch, logs=None):
        nonfinite_state_step = self._take_nonfinite_state_step()
        if nonfinite_state_step is not None and not self.model.stop_training:
            self._recover(f"step {nonfinite_state_step}: non-finite weights in epoch {epoch + 1}")
        elif not self.model.stop_training and not self._state_is_finite():
            self._nonfinite_state_step = self.counter.step  # restored at the next batch end; at the last epoch, a failure
        if self.model.stop_training:
            return
        losses = logged_losses(logs)
        if self._exploded(losses):
            return
        for name, value in losses.items():
            if math.isfinite(value) and value > 0:
                self._best_epoch_losses[name] = min(value, self._best_epoch_losses.get(name, math.inf))

    def on_train_end(self, logs=None):
        nonfinite_state_step = self._take_nonfinite_state_step()
        if nonfinite_state_step is not None and self.diagnosis is None:
            self._fail(f"step {nonfinite_state_step}: non-finite weights at the end of training")

    def _recover(self, event: str) -> None:
        """Restores the last good checkpoint, or stops with a diagnosis when retries are used up."""
        if self.retries < self.nan_retries and self.checkpointing.restore_last_good():
            self.events.append(event)
            self.retries += 1
            self.model.reset_metrics()
            self._skip_streak = 0
            logger.warning("%s; restored the last good checkpoint (retry %d of %d)", event, self.retries, self.nan_retries)
            return
        self._fail(event)

    def _fail(self, event: str) -> None:
        self.events.append(event)
        self.diagnosis = self.diagnose()
        logger.error("%s", self.diagnosis)
        self.model.stop_training = True

    def diagnose(self) -> str:
        """One paragraph: what happened, the likely cause, what to change."""
        policy = precision.global_policy_name()
        stepping = {name: optimizer for name, optimizer in self._optimizers.items() if optimizer_steps(optimizer) > 0} or self._optimizers
        rates = ", ".join(f"{learning_rate(optimizer):.3g} ({name})" for name, optimizer in stepping.items()) or "no optimizer"
        what = f"training diverged ({'; '.join(self.events)}) after {self.retries} restore(s) of the last good checkpoint"
        scaled = {name: optimizer for name, optimizer in stepping.items() if precision.current_loss_scale(optimizer) is not None}
        if policy == precision.MIXED_FLOAT16 and scaled:
            scales = ", ".join(f"{precision.current_loss_scale(optimizer):g} ({name}, {precision.skipped_steps(optimizer)} steps skipped)"
                               for name, optimizer in scaled.items())
            cause = (f"likely fp16 overflow (loss scale now {scales}; learning rate {rates}): use --precision=mixed_bfloat16 "
                     "(float32's range) where the hardware has it, keep overflowing layers in float32 (see `python -m tfmp.doctor`), "
                     "or lower --learning_rate")
        else:
            cause = (f"under {policy} this is not a precision problem but divergence: lower --learning_rate "
                     f"(learning rate now {rates}) or lengthen --warmup_epochs")
        latest = self.checkpointing.last_good_checkpoint
        where = f"the last good checkpoint is {latest}" if latest else "no good checkpoint was written before it"
        return f"{what}; {cause}; {where}"


class ReplicaDivergenceError(RuntimeError):
    """Per-replica copies of some variables differ; the message names them."""


class ReplicaConsistencyCheck(CountingCallback):
    """Every `replica_check_every_steps` steps (and at each epoch end), checks that all replicas
    hold the same variables (`tfmp.distribute.check_replica_consistency`) and stops training with
    `ReplicaDivergenceError` naming the ones that do not. Does nothing on one replica.

    The moving statistics of Keras' own non-synchronized BatchNormalization differ across replicas
    by Keras' design (`tfmp.distribute.replica_local_statistics`): they do not stop training; the
    first time they differ, one warning names their layers and the fix.

    Args:
        replica_check_every_steps: steps between checks (0: epoch ends only).
        atol: allowed absolute difference.
        counter: the run's `StepCounter` (one is made and driven here when not given).
    """

    def __init__(self, replica_check_every_steps: int = 100, atol: float = 0.0, counter: StepCount | None = None):
        super().__init__(counter)
        self.replica_check_every_steps = replica_check_every_steps
        self.atol = atol
        self._active = False
        self._warned = False

    def on_train_begin(self, logs=None):
        self._active = self.model.distribute_strategy.num_replicas_in_sync > 1
        self._warned = False

    def _check(self):
        if self.model.distribute_strategy.num_replicas_in_sync < 2:
            return
        local = distribute.replica_local_statistics(self.model)
        local_ids = {id(variable) for variable in local}
        checked = [variable for variable in self.model.variables if id(variable) not in local_ids]
        differing = distribute.check_replica_consistency(self.model, self.atol, checked)
        if differing:
            raise ReplicaDivergenceError(f"replicas disagree at step {self.counter.step} on {len(differing)} variable(s): "
                                         f"{', '.join(differing)}")
        drifting = distribute.check_replica_consistency(self.model, self.atol, local) if local and not self._warned else []
        if drifting:
            self._warned = True
            layers = sorted({path.rsplit("/", 1)[0] for path in drifting})
            logger.warning("replicas hold different BatchNorm moving statistics at step %d in %d layer(s) (%s): Keras' "
                           "BatchNormalization without synchronized=True updates each replica's copy from its own part "
                           "of the batch, and a saved model keeps the first replica's; build it with synchronized=True "
                           "(or tfmp.models.layers.BatchNormalization) to keep them equal", self.counter.step, len(layers),
                           ", ".join(layers))

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        if self._active and self.counter.crossed(self.replica_check_every_steps):
            self._check()

    def on_epoch_end(self, epoch, logs=None):
        self._check()


def _held_values(variable) -> list:
    """What this process holds of a variable: its value, or a sharded weight's local chunks (`--sharding=zero3`: each
    worker checks its own; a non-finite chunk makes the next loss non-finite on every worker)."""
    if getattr(variable, "sharded_storage", False):
        return [tf.convert_to_tensor(chunk) for chunk in variable.sharded.local_chunks()]
    return [variable.value]
