"""Momentum (EMA) target networks, for BYOL and MoCo v3.

The target is a copy of the online encoder and projector whose weights follow the online
ones as an exponential moving average, `target <- m * target + (1 - m) * online`, with `m`
rising from `target_momentum` to 1 on a cosine over the run (Grill et al. 2020, eq. 6).

Numerics and replicas, the two places this goes wrong:

* the update reads the float32 master weights (Keras keeps variables float32 under a mixed
  policy) and computes in float32 — an fp16 EMA with m = 0.996 would round (1 - m) * online
  away;
* it runs like an optimizer update (`tf.distribute` merge call, then `extended.update` per
  device), so every replica's copy receives the same value and the copies never drift.

Under `--sharding=zero3` the target's weights follow the online ones' layout
(`tfmp.sharding.weights.follow`): each replica holds the same 1/N chunk of both, the update
averages those chunks in place with no collective, and the target's forward pass gathers its
weights as the online one does — a replica holds W/N of the target, not W.

The target's variables are part of the model (checkpointed with it: a resumed run continues
the same trajectory) but not of `trainable_variables`, so the optimizer keeps no slots for them.
The target runs in training mode (batch statistics), as in BYOL and MoCo v3.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from tfmp import keras_internals
from tfmp.sharding import weights as sharded_weights
from tfmp.ssl.two_view import TwoViewModel


def momentum_at(step: tf.Tensor, total_steps: int, target_momentum: float) -> tf.Tensor:
    """Cosine schedule from `target_momentum` at step 0 to 1 at `total_steps` (and after)."""
    progress = tf.minimum(tf.cast(step, tf.float32) / float(max(total_steps, 1)), 1.0)
    return 1.0 - (1.0 - target_momentum) * (tf.cos(math.pi * progress) + 1.0) / 2.0


def update_target(target_variables: list, online_variables: list, momentum: tf.Tensor) -> None:
    """`target <- momentum * target + (1 - momentum) * online` in float32, on every replica's copy (or, under zero3,
    on every replica's chunk: `sharded_weights.average_chunks`)."""
    momentum = tf.cast(momentum, tf.float32)
    whole = []
    for target, online in zip(target_variables, online_variables):
        if sharded_weights.is_sharded(target):
            sharded_weights.average_chunks(target, online, momentum)
        else:
            whole.append((target.value, online.value))

    def update(distribution, pairs, momentum):
        for target, online in pairs:
            distribution.extended.update(
                target, lambda t, o, m: t.assign(m * t + (1.0 - m) * tf.cast(o, t.dtype)), args=(online, momentum), group=False)

    if whole:
        keras_internals.maybe_merge_call(update, tf.distribute.get_strategy(), whole, momentum)


def copy_network(network: keras.Model, name: str) -> keras.Model:
    """A new network with `network`'s architecture and weights (built under the active strategy scope)."""
    copy = keras.models.clone_model(network)
    copy.name = name
    copy.set_weights(network.get_weights())
    return copy


class MomentumTwoViewModel(TwoViewModel):
    """A `TwoViewModel` with a momentum target of its encoder and projector.

    Subclasses set `self.projector` (and their predictor) before calling `make_target()`.

    Args:
        target_momentum: the target's momentum at step 0 (it rises to 1 on a cosine).
        target_encoder: the target's encoder; default a copy of `encoder` (`keras.models.clone_model`,
            so functional and Sequential encoders; pass one for a subclassed encoder).
        **kwargs: `TwoViewModel`'s arguments (its `total_steps` is the schedule's length).
    """

    def __init__(self, encoder: keras.Model, *, target_momentum: float = 0.99, target_encoder: keras.Model | None = None, **kwargs):
        super().__init__(encoder, **kwargs)
        self.target_momentum = target_momentum
        self._given_target_encoder = target_encoder

    def make_target(self) -> None:
        """Creates the target encoder and projector as copies of the online ones."""
        self.target_encoder = self._given_target_encoder or copy_network(self.encoder, "target_encoder")
        if self._given_target_encoder is not None:
            self.target_encoder.set_weights(self.encoder.get_weights())
        self.target_projector = copy_network(self.projector, "target_projector")
        # Checks that the target matches the online weights; under zero3 the target is sharded as they are.
        sharded_weights.follow(self.target_weights(), self.online_target_weights())

    def online_target_weights(self) -> list:
        """The online weights the target follows: encoder and projector, trainable ones."""
        return [*self.encoder.trainable_weights, *self.projector.trainable_weights]

    def target_weights(self) -> list:
        return [*self.target_encoder.trainable_weights, *self.target_projector.trainable_weights]

    # The target's weights are the model's state but no optimizer's business.
    @property
    def trainable_weights(self):
        target = {id(weight) for weight in self.target_weights()}
        return [weight for weight in super().trainable_weights if id(weight) not in target]

    @property
    def trainable_variables(self):
        return self.trainable_weights

    @property
    def non_trainable_weights(self):
        return [*super().non_trainable_weights, *self.target_weights()]

    @property
    def non_trainable_variables(self):
        return [*super().non_trainable_variables, *self.target_weights()]

    def target_outputs(self, first: tf.Tensor, second: tf.Tensor) -> tf.Tensor:
        """The target projector's outputs for both views, `[first; second]`, float32, no gradient."""
        features = self.target_encoder(tf.concat([first, second], axis=0), training=True)
        return tf.stop_gradient(tf.cast(self.target_projector(features, training=True), tf.float32))

    def momentum(self) -> tf.Tensor:
        """The momentum of the update after the step just taken (step count before it)."""
        return momentum_at(self.optimizer.iterations - 1, self.total_steps, self.target_momentum)

    def after_update(self) -> None:
        update_target(self.target_weights(), self.online_target_weights(), self.momentum())
