"""Precision: `auto` resolution from the hardware, the Keras global policy, and loss scaling.

Everything tfmp knows about numeric precision lives here:

* `resolve` / `set_policy`: the three policies tfmp supports (`tfmp.config.Precision`:
  `float32`, `mixed_float16`, `mixed_bfloat16`, with aliases), and `auto`, which picks
  one from the hardware (`tfmp.hardware`) and says why;
* `global_policy_name`: the one reader of the Keras global policy in tfmp;
* `wrap_optimizer` and `LossScaleOptimizer`, Keras' loss-scale optimizer with a floor
  (`min_scale`), hysteresis, a fixed-scale mode, an overflow decision taken over all
  replicas at once (`tfmp/upstream.py`), and a warning when a custom `train_step`
  forgets `optimizer.scale_loss`;
* `current_loss_scale` / `skipped_steps`, readable also under `MirroredStrategy`.

Under a mixed policy Keras keeps variables in float32 and computes in the low
precision; tfmp's models add a float32 output layer so logits and losses stay float32.
"""

from __future__ import annotations

import logging
import re
import threading

import keras
import tensorflow as tf

from tfmp import hardware, keras_internals, logs, upstream
from tfmp.config import Precision, canonical_precision as canonical_name

FLOAT32, MIXED_FLOAT16, MIXED_BFLOAT16, AUTO = (member.value for member in Precision)

logger = logging.getLogger(__name__)


def resolve(name: str = AUTO) -> tuple[str, str]:
    """Resolves a precision name for this machine.

    Args:
        name: a precision name or alias, or `auto`.

    Returns:
        `(policy_name, reason)`: the canonical policy and a one-line reason.

    Raises:
        ValueError: unknown name, or a choice this hardware cannot run
            (bf16 on a GPU below compute capability 8.0).
    """
    name = canonical_name(name)
    gpus = hardware.gpu_compute_capabilities()
    tpu = hardware.tpu_present()
    if name == AUTO:
        if tpu:
            return MIXED_BFLOAT16, "TPU found: TPUs compute natively in bfloat16"
        if gpus:
            lowest = min(gpus)
            if lowest >= (8, 0):
                return MIXED_BFLOAT16, f"GPU compute capability {lowest[0]}.{lowest[1]} >= 8.0 has bf16 tensor cores"
            if lowest >= (7, 0):
                return MIXED_FLOAT16, f"GPU compute capability {lowest[0]}.{lowest[1]} has fp16 tensor cores but no bf16"
            return FLOAT32, f"GPU compute capability {lowest[0]}.{lowest[1]} < 7.0 has no fast low-precision units"
        if hardware.cpu_has_bf16_units():
            flag = "amx_bf16" if "amx_bf16" in hardware.cpu_flags() else "avx512_bf16"
            return MIXED_BFLOAT16, f"CPU has {flag}: oneDNN runs bf16 matmuls/convs natively"
        return FLOAT32, "CPU without AVX512_BF16 or AMX: no fast low-precision units (fp16 is never chosen on a CPU)"

    if name == MIXED_BFLOAT16 and gpus and min(gpus) < (8, 0):
        major, minor = min(gpus)
        raise ValueError(
            f"precision mixed_bfloat16 needs a GPU with compute capability >= 8.0, found {major}.{minor}; "
            "valid here: mixed_float16, float32"
        )
    if name == MIXED_FLOAT16 and not gpus and not tpu:
        logs.once(logger, logging.WARNING, "mixed_float16 on a CPU is slower than float32 (no fp16 arithmetic units); "
                  "use mixed_bfloat16 where the CPU has AVX512_BF16/AMX, else float32")
        return name, "explicit choice (slow on CPU)"
    if name == MIXED_BFLOAT16 and not gpus and not tpu and not hardware.cpu_has_bf16_units():
        # Measured on a Zen 3 EPYC (AVX2 only): bf16 digits training ~7x slower than float32
        # (BUILD_NOTES.md, "Machine and versions").
        logs.once(logger, logging.WARNING, "mixed_bfloat16 on a CPU without AVX512_BF16/AMX is emulated through float32: "
                  "several times slower than float32, which is what --precision=auto picks here")
        return name, "explicit choice (emulated on this CPU)"
    return name, "explicit choice"


def set_policy(name: str = AUTO) -> str:
    """Sets the Keras global dtype policy and returns the resolved policy name.

    The choice and its reason are logged in one line.
    """
    policy_name, reason = resolve(name)
    keras.mixed_precision.set_global_policy(policy_name)
    logger.info("precision: %s (%s)", policy_name, reason)
    return policy_name


def global_policy_name() -> str:
    """The name of the Keras global dtype policy now in force (tfmp reads it nowhere else)."""
    return keras.mixed_precision.global_policy().name


# ----------------------------------------------------------------------- loss scaling


@keras.saving.register_keras_serializable(package="tfmp")
class LossScaleOptimizer(keras_internals.LossScaleOptimizerHooks):
    """Keras' dynamic `LossScaleOptimizer`, with a floor, hysteresis, a fixed mode, and an
    overflow decision that holds across replicas.

    Keras halves the scale on every overflow with no lower bound, so a stretch of
    overflowing steps drives it toward zero and every later gradient underflows.
    This subclass (as DeepSpeed does) halves only after `hysteresis` consecutive
    overflowing steps, never below `min_scale`, and counts the skipped steps; before its
    first applied step it halves on every overflow, as Keras does, to find a usable scale fast.

    Under `tf.distribute`, a step is skipped on every replica when any replica's
    gradients are non-finite, and the scale changes once per step: Keras 3.15 decides
    per replica before the all-reduce and takes replica 0's answer, which applies a
    step that overflowed on replica 1 and turns every weight NaN (`tfmp/upstream.py`).

    A step whose loss never went through `scale_loss` (a custom `train_step` that
    forgot it) gets its gradients divided by the scale; `apply` logs one warning
    with the fix when it sees that.

    Args:
        inner_optimizer: the optimizer to wrap.
        initial_scale: the starting loss scale.
        dynamic_growth_steps: finite steps after which the scale doubles.
        min_scale: the scale never goes below this.
        hysteresis: consecutive overflowing steps before the scale halves.
        dynamic: False keeps the scale fixed at `initial_scale` (steps with
            non-finite gradients are still skipped).
    """

    def __init__(
        self,
        inner_optimizer,
        initial_scale=2.0**15,
        dynamic_growth_steps=2000,
        min_scale=1.0,
        hysteresis=2,
        dynamic=True,
        name=None,
        **kwargs,
    ):
        if min_scale <= 0 or initial_scale < min_scale:
            raise ValueError(f"need 0 < min_scale <= initial_scale, got min_scale={min_scale}, initial_scale={initial_scale}")
        if hysteresis < 1 or dynamic_growth_steps < 1:
            raise ValueError(f"hysteresis and dynamic_growth_steps must be >= 1, got {hysteresis}, {dynamic_growth_steps}")
        super().__init__(inner_optimizer, initial_scale=initial_scale, dynamic_growth_steps=dynamic_growth_steps, name=name, **kwargs)
        self.min_scale = float(min_scale)
        self.hysteresis = int(hysteresis)
        self.dynamic = bool(dynamic)
        # Per thread: MirroredStrategy traces each replica's step in a thread of its own.
        self._loss_scaled = threading.local()
        self._warned_unscaled_loss = False

    def build(self, var_list):
        super().build(var_list)
        # Created after Keras' own variables so `_variables` keeps their order first.
        with keras.name_scope(self.name, caller=self):
            self.overflow_streak = self.add_variable(shape=(), dtype="int", initializer="zeros", aggregation="none", name="overflow_streak")
            self.skipped_steps = self.add_variable(shape=(), dtype="int", initializer="zeros", aggregation="none", name="skipped_steps")

    def scale_loss(self, loss):
        self._loss_scaled.seen = True
        return super().scale_loss(loss)

    def apply(self, grads, trainable_variables=None):
        if not getattr(self._loss_scaled, "seen", False) and not self._warned_unscaled_loss:
            self._warned_unscaled_loss = True
            logger.warning(
                "LossScaleOptimizer.apply() ran in a step whose loss never went through optimizer.scale_loss(): its "
                "gradients are divided by the loss scale (%g) and training barely moves; in a custom train_step write "
                "`loss = self.optimizer.scale_loss(loss)` before `tape.gradient`", float(self.initial_scale))
        self._loss_scaled.seen = False
        super().apply(grads, trainable_variables)

    def apply_scaled_step(self, grads, trainable_variables=None):
        upstream.apply_loss_scaled_step(self, grads, trainable_variables)

    def on_finite_gradients(self, grads, trainable_variables):
        self.overflow_streak.assign(0)
        if self.dynamic:
            super().on_finite_gradients(grads, trainable_variables)
            return
        variables = self.stepped_variables(trainable_variables)
        unscaled = [g if g is None or self.overwrites_with_gradient(v) else g / self.dynamic_scale for g, v in zip(grads, variables)]
        self.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables)

    def on_non_finite_gradients(self):
        self.skipped_steps.assign_add(1)
        self.step_counter.assign(0)
        if not self.dynamic:
            return
        self.overflow_streak.assign_add(1)
        # Until a step has gone through, the scale is still being found: halve on every overflow (as Keras
        # does), so a run skips no more steps at its start than with Keras' optimizer; hysteresis after that.
        searching = tf.equal(self.iterations, 0)
        halve = tf.logical_or(searching, tf.greater_equal(self.overflow_streak, self.hysteresis))
        halved = tf.maximum(self.dynamic_scale * 0.5, self.min_scale)
        self.dynamic_scale.assign(tf.where(halve, halved, self.dynamic_scale))
        self.overflow_streak.assign(tf.where(halve, tf.zeros_like(self.overflow_streak), self.overflow_streak))

    def get_config(self):
        config = super().get_config()
        config.update(min_scale=self.min_scale, hysteresis=self.hysteresis, dynamic=self.dynamic)
        return config


def wrap_optimizer(
    optimizer: keras.optimizers.Optimizer,
    *,
    loss_scale: str | float = "dynamic",
    initial_loss_scale: float = 2.0**15,
    loss_scale_growth_steps: int = 2000,
    min_scale: float = 1.0,
    hysteresis: int = 2,
    policy: str | None = None,
) -> keras.optimizers.Optimizer:
    """Wraps `optimizer` for loss scaling when the policy is `mixed_float16`.

    bfloat16 has float32's exponent range and needs no loss scaling, so under any
    other policy the optimizer is returned unchanged.

    Args:
        optimizer: a Keras optimizer.
        loss_scale: "dynamic", or a number for a fixed scale.
        initial_loss_scale: starting scale of the dynamic mode (`LossScaleOptimizer`'s `initial_scale`).
        loss_scale_growth_steps: finite steps after which the dynamic scale doubles (its `dynamic_growth_steps`).
        min_scale: floor of the dynamic scale.
        hysteresis: consecutive overflows before the dynamic scale halves.
        policy: the policy to wrap for; the Keras global policy by default.

    Returns:
        A tfmp `LossScaleOptimizer` under `mixed_float16`, else `optimizer` itself.
    """
    policy = policy or global_policy_name()
    if policy != MIXED_FLOAT16 or isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer
    if loss_scale == "dynamic":
        return LossScaleOptimizer(optimizer, initial_scale=initial_loss_scale, dynamic_growth_steps=loss_scale_growth_steps,
                                  min_scale=min_scale, hysteresis=hysteresis)
    try:
        fixed = float(loss_scale)
    except (TypeError, ValueError):
        raise ValueError(f"loss_scale must be 'dynamic' or a positive number, got {loss_scale!r}") from None
    if fixed <= 0:
        raise ValueError(f"loss_scale must be 'dynamic' or a positive number, got {loss_scale!r}")
    return LossScaleOptimizer(optimizer, initial_scale=fixed, min_scale=fixed, dynamic=False)


def _read(variable) -> float:
    # `float(MirroredVariable)` raises TypeError; `.numpy()` reads the primary copy.
    return float(variable.numpy())


def current_loss_scale(optimizer) -> float | None:
    """The optimizer's current loss scale, or None where it does not scale the loss."""
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return None
    return _read(optimizer.dynamic_scale) if optimizer.built else float(optimizer.initial_scale)


def skipped_steps(optimizer) -> int | None:
    """Steps skipped for non-finite gradients, or None where the optimizer does not count them."""
    counter = getattr(optimizer, "skipped_steps", None)
    if counter is None or not getattr(optimizer, "built", False):
        return None
    return int(_read(counter))



def keep_float32(model: keras.Model, pattern: str) -> list[str]:
    """Gives every leaf layer whose name matches the regular expression `pattern` a float32
    policy (compute and variables), e.g. layers the precision doctor found overflowing.

    Call right after building the model, before training. Keras casts a layer's inputs
    to its compute dtype, so the float32 layers sit transparently in a mixed network.

    Returns:
        The names of the layers changed.

    Raises:
        ValueError: `pattern` is not a valid regular expression, or matches no layer.
    """
    try:
        regex = re.compile(pattern)
    except re.error as error:
        raise ValueError(f"--float32_layers={pattern!r} is not a valid regular expression: {error}") from None
    changed = []
    for layer in keras_internals.leaf_layers(model):
        if regex.search(layer.name):
            layer.dtype_policy = FLOAT32
            changed.append(layer.name)
    if not changed:
        raise ValueError(f"--float32_layers={pattern!r} matches no layer of {model.name}")
    return changed
