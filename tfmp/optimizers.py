"""Optimizers and learning-rate schedules.

`make_optimizer` builds the configured optimizer (`adamw`, `sgd`, `lars`) with linear
warmup and cosine decay (Keras' own `CosineDecay` with `warmup_steps`), scales the
learning rate with the global batch (`linear`: x B/256, `sqrt`: x sqrt(B)), keeps
biases and BatchNorm parameters out of weight decay, and wraps the optimizer for
loss scaling under `mixed_float16`.

LARS is written here because no maintained Keras 3 implementation exists; it follows
the SimCLR reference (google-research/simclr `lars_optimizer.py`).
"""

from __future__ import annotations

import math
import re

import keras
from keras import ops

from tfmp import averaging, clipping, keras_internals, models, precision, update_rules
from tfmp.sharding import ShardedOptimizer
from tfmp.config import LEARNING_RATE_SCALINGS

# Variables whose names contain these are excluded from weight decay (and LARS adaptation).
NO_DECAY_NAMES = ("bias", "gamma", "beta")


@keras.saving.register_keras_serializable(package="tfmp")
class LARS(keras.optimizers.Optimizer):
    """Layer-wise adaptive rate scaling with momentum (You et al. 2017, as used by SimCLR).

    For each weight matrix the update is `trust * (g + weight_decay * w)` with
    `trust = eta * ||w|| / ||g + weight_decay * w||`; biases and BatchNorm parameters
    (1-D variables, or names in `exclude_names`) get plain momentum SGD with no decay.

    Args:
        learning_rate: float or schedule.
        momentum: heavy-ball momentum.
        weight_decay: L2 coefficient folded into the gradient before adaptation
            (not Keras' decoupled decay, which stays off).
        eta: trust coefficient.
        exclude_names: name fragments of variables excluded from decay and adaptation.
    """

    update_rule = "lars"  # its step is `tfmp.update_rules.lars`, which `tfmp.sharding` runs on shards too

    def __init__(self, learning_rate=0.1, momentum=0.9, weight_decay=1e-6, eta=1e-3, exclude_names=NO_DECAY_NAMES, name="lars",
                 **kwargs):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.momentum = momentum
        self.lars_weight_decay = weight_decay
        self.eta = eta
        self.exclude_names = tuple(exclude_names)

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self.momentums = self.add_optimizer_variables(variables, "momentum")

    def adapts(self, variable) -> bool:
        """Whether `variable` gets the trust ratio and weight decay (matrices and kernels not named in `exclude_names`)."""
        return len(variable.shape) > 1 and not any(fragment in getattr(variable, "path", variable.name) for fragment in self.exclude_names)

    def update_step(self, gradient, variable, learning_rate):
        momentum = self.momentums[keras_internals.variable_index(self, variable)]
        weight, new_momentum = update_rules.lars(
            ops.convert_to_tensor(variable), ops.cast(gradient, variable.dtype), ops.convert_to_tensor(momentum),
            learning_rate=ops.cast(learning_rate, variable.dtype), coefficient=self.momentum, weight_decay=self.lars_weight_decay,
            eta=self.eta, adapts=self.adapts(variable))
        self.assign(momentum, new_momentum)
        self.assign(variable, weight)

    def get_config(self):
        config = super().get_config()
        config.update(momentum=self.momentum, weight_decay=self.lars_weight_decay, eta=self.eta, exclude_names=list(self.exclude_names))
        return config


def scaled_learning_rate(base_learning_rate: float, global_batch_size: int, scaling: str) -> float:
    """`linear`: base x B / 256 (Goyal et al.); `sqrt`: base x sqrt(B) (SimCLR, small batches); `none`: base."""
    if scaling == "linear":
        return base_learning_rate * global_batch_size / 256
    if scaling == "sqrt":
        return base_learning_rate * math.sqrt(global_batch_size)
    if scaling == "none":
        return base_learning_rate
    raise ValueError(f"unknown learning_rate_scaling {scaling!r}; valid: {', '.join(LEARNING_RATE_SCALINGS)}")


def warmup_cosine(peak_learning_rate: float, total_steps: int, warmup_steps: int) -> keras.optimizers.schedules.LearningRateSchedule:
    """Linear warmup from 0 to `peak_learning_rate`, then cosine decay to 0 at `total_steps`."""
    warmup_steps = min(warmup_steps, total_steps - 1)
    if warmup_steps <= 0:
        return keras.optimizers.schedules.CosineDecay(peak_learning_rate, decay_steps=max(total_steps, 1))
    return keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0,
        decay_steps=total_steps - warmup_steps,
        warmup_target=peak_learning_rate,
        warmup_steps=warmup_steps,
    )


def make_optimizer(config, steps_per_epoch: int) -> keras.optimizers.Optimizer:
    """The optimizer a `tfmp.config.Config` asks for, loss-scaled where the policy needs it.

    A stage that trains differently (e.g. the supervised baseline of an SSL run)
    passes `config.replace(...)` with its own optimizer, learning rate and epochs.
    Call inside the strategy scope, after `precision.set_policy`.

    Args:
        config: optimizer, learning rate and its scaling, epochs, warmup, weight decay, loss scale,
            `global_clipnorm` or `clipnorm` (`tfmp.clipping`: after the replicas' sum), `ema_momentum` (`tfmp.averaging`) and
            `sharding` (`zero1`, `zero2`, `zero3`: `tfmp.sharding.ShardedOptimizer` inside the loss scaling; zero3 gathers
            each block of tfmp's encoders as one unit, `tfmp.models.block_of`).
        steps_per_epoch: optimizer steps per epoch.
    """
    peak = scaled_learning_rate(config.learning_rate, config.global_batch_size, config.learning_rate_scaling)
    total_steps = steps_per_epoch * config.epochs
    schedule = warmup_cosine(peak, total_steps, round(config.warmup_epochs * steps_per_epoch))
    if config.optimizer == "lars":
        optimizer = LARS(schedule, momentum=0.9, weight_decay=config.weight_decay)
    elif config.optimizer == "sgd":
        optimizer = keras.optimizers.SGD(schedule, momentum=0.9, nesterov=True, weight_decay=config.weight_decay or None)
    else:
        optimizer = keras.optimizers.AdamW(schedule, weight_decay=config.weight_decay)
    if config.weight_decay and config.optimizer != "lars":
        optimizer.exclude_from_weight_decay(var_names=list(NO_DECAY_NAMES))
    if config.ema_momentum:
        averaging.average_weights(optimizer, config.ema_momentum)
    if config.sharding != "none":
        # zero3's FSDP units: tfmp's encoders' blocks (the rest — stem, heads — grouped by size).
        optimizer = ShardedOptimizer(optimizer, global_clipnorm=config.global_clipnorm or None, clipnorm=config.clipnorm or None,
                                     stage=config.sharding, units=models.block_of if config.sharding == "zero3" else None)
    elif config.global_clipnorm:
        optimizer = clipping.clip_after_reduction(optimizer, config.global_clipnorm)
    elif config.clipnorm:
        optimizer = clipping.clip_after_reduction(optimizer, config.clipnorm, per_tensor=True)
    return precision.wrap_optimizer(
        optimizer,
        loss_scale=config.loss_scale,
        initial_loss_scale=config.initial_loss_scale,
        loss_scale_growth_steps=config.loss_scale_growth_steps,
    )


# A ViT's layers by name (tfmp.models.vit): the patch embedding, then block0, block1, ...; anything else is above them.
_PATCH_EMBEDDING = re.compile(r"(^|/)patch_embedding/")
_BLOCK = re.compile(r"(^|/)block(\d+)_")


def layer_decay_factors(variables: list, decay: float) -> list[float]:
    """Layer-wise learning-rate decay (BEiT, MAE's fine-tuning): with a ViT of `depth` blocks, the patch embedding's
    variables learn at `decay ** (depth + 1)`, block i's at `decay ** (depth - i)`, the rest (the final norm, the
    head) at 1 — the layers nearest the input, most general, move least.

    Raises:
        ValueError: no variable belongs to a ViT block.
    """
    blocks = [int(match.group(2)) for variable in variables if (match := _BLOCK.search(variable.path))]
    if not blocks:
        raise ValueError("--layer_decay is for ViT encoders (blocks named block0, block1, ...); this model has none")
    depth = max(blocks) + 1

    def layer(path: str) -> int:
        if _PATCH_EMBEDDING.search(path):
            return 0
        match = _BLOCK.search(path)
        return int(match.group(2)) + 1 if match else depth + 1

    return [decay ** (depth + 1 - layer(variable.path)) for variable in variables]


def decay_learning_rate_by_layer(optimizer: keras.optimizers.Optimizer, variables: list, decay: float):
    """Makes `optimizer` (Keras' or tfmp's LARS, sharded or not, inside any loss scaling) update each of `variables` with
    its learning rate times `layer_decay_factors`; returns it. Keras' decoupled weight decay runs outside the update
    and keeps the schedule's learning rate (timm's and BEiT's groups scale it too: a smaller decay on low layers)."""
    inner = averaging.innermost(optimizer)
    if getattr(inner, "layer_decay", None) is not None:  # a compiled model trained again (`CompiledOnce`): decayed already
        if inner.layer_decay != decay:
            raise ValueError(f"this optimizer decays its learning rate by layer at {inner.layer_decay} already, not {decay}")
        return optimizer
    factor_of = {variable.path: factor for variable, factor in zip(variables, layer_decay_factors(variables, decay))}
    if isinstance(inner, ShardedOptimizer):
        # On several replicas the sharded step gives each variable's rule its factor (`update_rules.update`); on one
        # it runs the optimizer it wraps, whose own step is decayed below.
        inner.held.learning_rate_factors = factor_of
        inner.layer_decay = decay
        inner = inner.inner
    update_step = inner.update_step

    def decayed_update_step(gradient, variable, learning_rate):
        # Called per variable while the step is traced (for each replica's copy under tf.distribute): the factor is a
        # Python number found through the optimizer's own index of its variables.
        path = keras_internals.optimizer_trainable_variables(inner)[keras_internals.variable_index(inner, variable)].path
        return update_step(gradient, variable, learning_rate * factor_of.get(path, 1.0))

    inner.update_step = decayed_update_step
    inner.layer_decay = decay
    return optimizer
