"""The optimizers' update rules, written once: what one step does to one variable, as a function of its weight, its
(reduced, unscaled) gradient and its state.

tfmp's LARS steps with them, and so does `tfmp.sharding`, which updates each replica's share of the variables with
the rule of the optimizer it wraps. For Keras' AdamW/Adam and SGD the functions are Keras 3.15's own `update_step`
written out (`keras/src/optimizers/adam.py`, `sgd.py`, and the decoupled weight decay of `base_optimizer.py`): where
Keras' optimizer runs unsharded it keeps its own code, and tests/test_update_rules.py holds the two equal within
float32 rounding. An option a rule does not implement is refused by `check_supported` in one line, never ignored.

Functions of tensors (`keras.ops`), TensorFlow-free in form: they run inside a traced step, under XLA too.
"""

from __future__ import annotations

import keras
from keras import ops

from tfmp import keras_internals

# Options of keras.optimizers.Optimizer the rules here do not implement, by their Keras names.
UNSUPPORTED_OPTIONS = ("clipnorm", "clipvalue", "global_clipnorm", "gradient_accumulation_steps", "ema_overwrite_frequency",
                       "loss_scale_factor")


def adam(weight, gradient, momentum, velocity, *, learning_rate, step, beta_1: float, beta_2: float, epsilon: float):
    """Adam (Kingma & Ba) as Keras computes it: `step` counts from 1. Returns (weight, momentum, velocity)."""
    powers = ops.power(ops.cast(beta_2, weight.dtype), step), ops.power(ops.cast(beta_1, weight.dtype), step)
    alpha = learning_rate * ops.sqrt(1 - powers[0]) / (1 - powers[1])
    # `1 - beta` in Python, as Keras writes it: float32(0.1), where 1 - float32(0.9) is 2.4e-7 off and moved every
    # step's moments a few roundings from Keras' (found on an AVX2 CPU, where 20 AdamW steps left 1.3e-6 between them).
    momentum = momentum + (gradient - momentum) * (1 - beta_1)
    velocity = velocity + (ops.square(gradient) - velocity) * (1 - beta_2)
    return weight - (momentum * alpha) / (ops.sqrt(velocity) + epsilon), momentum, velocity


def sgd(weight, gradient, momentum, *, learning_rate, coefficient: float, nesterov: bool):
    """SGD with heavy-ball or Nesterov momentum as Keras computes it (`coefficient` 0: plain SGD, `momentum` unused and
    returned as it is). Returns (weight, momentum)."""
    if not coefficient:
        return weight - gradient * learning_rate, momentum
    coefficient = ops.cast(coefficient, weight.dtype)
    momentum = momentum * coefficient - gradient * learning_rate
    if nesterov:
        return weight + (momentum * coefficient - gradient * learning_rate), momentum
    return weight + momentum, momentum


def lars_gradient(weight, gradient, *, weight_decay: float):
    """The gradient LARS scales: L2 decay folded in (for an adapted variable)."""
    return gradient + weight_decay * weight


def lars(weight, gradient, momentum, *, learning_rate, coefficient: float, weight_decay: float, eta: float, adapts: bool,
         norms=None):
    """LARS (You et al. 2017) as SimCLR's reference computes it: for an adapted variable the gradient with L2 decay
    folded in is scaled by the trust ratio `eta * |w| / |g + decay * w|`; then heavy-ball momentum.
    `norms`: `(|w|, |g + decay * w|)` of the whole variable when `weight` and `gradient` are a shard of it (the
    sharded step sums the squares across replicas). Returns (weight, momentum)."""
    if adapts:
        gradient = lars_gradient(weight, gradient, weight_decay=weight_decay)
        if norms is None:
            norms = ops.norm(ops.reshape(weight, [-1])), ops.norm(ops.reshape(gradient, [-1]))
        weight_norm, gradient_norm = norms
        trust = ops.where(ops.logical_and(weight_norm > 0, gradient_norm > 0), eta * weight_norm / gradient_norm,
                          ops.ones_like(weight_norm))
        gradient = gradient * trust
    momentum = momentum * coefficient + learning_rate * gradient
    return weight - momentum, momentum


def moving_average(average, weight, *, momentum: float, step):
    """Keras' `use_ema` average after a step (`step` counts from 1; the first step copies the weight)."""
    momentum = ops.where(step > 1, ops.cast(momentum, weight.dtype), ops.zeros((), weight.dtype))
    return momentum * average + (1 - momentum) * weight


def decoupled_weight_decay(weight, *, learning_rate, weight_decay: float):
    """Keras' decoupled weight decay (AdamW, and SGD's `weight_decay`), applied before the update."""
    return weight - weight * ops.cast(weight_decay, weight.dtype) * learning_rate


def is_lars(optimizer) -> bool:
    return getattr(optimizer, "update_rule", None) == "lars"


def slot_names(optimizer) -> tuple[str, ...]:
    """The per-variable state the optimizer's rule keeps, by name (after `check_supported`): the rule's slots, then
    the moving average of the weights where the optimizer keeps one (`use_ema`)."""
    if isinstance(optimizer, keras.optimizers.Adam):  # AdamW is an Adam
        names = ("momentum", "velocity")
    elif is_lars(optimizer):
        names = ("momentum",)
    else:
        names = ("momentum",) if optimizer.momentum else ()
    return (*names, "average") if getattr(optimizer, "use_ema", False) else names


def check_supported(optimizer, what: str) -> None:
    """Raises ValueError (one line, naming `what` asked for it) when the rules here do not compute what `optimizer`
    would: another optimizer, or an option they do not implement (AMSGrad, clipping, EMA, accumulation, ...)."""
    if not (isinstance(optimizer, (keras.optimizers.Adam, keras.optimizers.SGD)) or is_lars(optimizer)):
        raise ValueError(f"{what} supports AdamW, Adam, SGD and LARS, not {type(optimizer).__name__}")
    for option in UNSUPPORTED_OPTIONS:
        if getattr(optimizer, option, None):
            raise ValueError(f"{what} does not support {option} (set on {type(optimizer).__name__})")
    if getattr(optimizer, "amsgrad", False):
        raise ValueError(f"{what} does not support amsgrad=True ({type(optimizer).__name__}); use amsgrad=False")


def update(optimizer, variable, weight, gradient, slots: dict, learning_rate, step, norms=None, decays: bool | None = None,
           learning_rate_factor: float = 1.0):
    """One step of `optimizer`'s rule for `variable`: (new weight, new slots by `slot_names`). `step` counts from 1;
    weight decay is Keras' (its exclusions decided by `uses_weight_decay`, from `tfmp.keras_internals`, unless `decays`
    says it: decided before a variable's storage became chunks). `weight`, `gradient` and the slots may be a shard of
    the variable (flat); LARS then takes the whole variable's `norms`. `learning_rate_factor` scales the rule's
    learning rate, not the decoupled weight decay's (`tfmp.optimizers.decay_learning_rate_by_layer`, as unsharded)."""
    if not is_lars(optimizer) and getattr(optimizer, "weight_decay", None) and (
            decays if decays is not None else keras_internals.uses_weight_decay(optimizer, variable)):
        weight = decoupled_weight_decay(weight, learning_rate=learning_rate, weight_decay=optimizer.weight_decay)
    if learning_rate_factor != 1.0:
        learning_rate = learning_rate * learning_rate_factor
    if isinstance(optimizer, keras.optimizers.Adam):
        weight, momentum, velocity = adam(weight, gradient, slots["momentum"], slots["velocity"], learning_rate=learning_rate,
                                          step=step, beta_1=optimizer.beta_1, beta_2=optimizer.beta_2, epsilon=optimizer.epsilon)
        return weight, {"momentum": momentum, "velocity": velocity}
    if is_lars(optimizer):
        weight, momentum = lars(weight, gradient, slots["momentum"], learning_rate=learning_rate, coefficient=optimizer.momentum,
                                weight_decay=optimizer.lars_weight_decay, eta=optimizer.eta, adapts=optimizer.adapts(variable),
                                norms=norms)
        return weight, {"momentum": momentum}
    weight, momentum = sgd(weight, gradient, slots.get("momentum"), learning_rate=learning_rate, coefficient=optimizer.momentum,
                           nesterov=optimizer.nesterov)
    return weight, ({"momentum": momentum} if optimizer.momentum else {})
