"""`TwoViewModel`: what every two-view self-supervised method shares, as a `keras.Model` for `fit()`.

A method is a subclass that builds its heads, names the `Config` settings it takes (`settings`) and
defines `ssl_loss`; everything else is here, written once:

* two augmented views per image, drawn in the step from a seed that folds in the run seed,
  the optimizer step and the replica id (`tfmp.data.augment.step_seed`): distinct streams per
  replica, reproducible runs; under `jit_compile=True` on several mirrored replicas the views
  alone compile with XLA (`tfmp.compilation`);
* both views go through the encoder as one batch, in the policy dtype;
* the loss is float32, divided by the number of replicas (Keras sums gradients over
  replicas) and, under `mixed_float16`, scaled by the `LossScaleOptimizer`;
* an online linear probe on stop-gradient features reports `probe_accuracy` from the labels
  a run may see (-1 marks an unlabeled image) without influencing the encoder;
* `loss` and each method's own terms (`metric_names`) are tracked as Keras metrics.

Methods with a momentum (EMA) target network build on `MomentumTwoViewModel`
(`tfmp.ssl.momentum`).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmp import accumulation, compilation
from tfmp.data import augment
from tfmp.models.layers import NormSettings, batch_norm


def mlp_head(hidden_dim: int, output_dim: int, norm: NormSettings, name: str, input_dim: int) -> keras.Sequential:
    """Dense -> BatchNorm -> ReLU -> Dense, the last layer float32 (the losses are float32), built for `input_dim`."""
    head = keras.Sequential([
        keras.layers.Dense(hidden_dim, use_bias=False, name=f"{name}_hidden"),
        batch_norm(norm, name=f"{name}_bn"),
        keras.layers.ReLU(name=f"{name}_relu"),
        keras.layers.Dense(output_dim, dtype="float32", name=f"{name}_out"),
    ], name=name)
    head.build((None, input_dim))
    return head


class TwoViewModel(keras.Model):
    """Base class of the two-view SSL methods around any encoder that maps images to a feature vector.

    Subclasses build their heads in `__init__` and implement `ssl_loss`; those with a target
    network also `target_outputs` (computed outside the gradient tape) and `after_update`.

    Args:
        encoder: a Keras model, images -> [batch, features].
        num_classes: size of the online linear probe (0: no probe).
        augment_config: augmentation strengths of the views.
        seed: the run seed augmentation streams derive from.
        total_steps: the run's optimizer steps (the length of a method's schedules).
        gradient_accumulation_steps: micro-batches per replica and step (`tfmp.accumulation`): a loss that couples
            the batch (`batch_coupled_loss`) gets the whole batch's gradient by gradient caching, any other the sum
            of its micro-batches' losses.
    """

    metric_names: tuple[str, ...] = ()  # the method's own loss terms, tracked as metrics beside `loss`
    # Whether the loss couples a batch's examples (negatives, batch statistics): accumulation then caches gradients.
    batch_coupled_loss: bool = True
    settings: tuple[str, ...] = ()  # the `Config` fields the method reads: constructor arguments of the same names
    vit_only: bool = False  # the method needs a ViT encoder's tokens (MAE); the others take any encoder

    def __init__(self, encoder: keras.Model, *, num_classes: int = 0, augment_config: augment.AugmentConfig = augment.AugmentConfig(),
                 seed: int = 0, total_steps: int = 1000, gradient_accumulation_steps: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.total_steps = total_steps
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.encoder = encoder
        self.feature_dim = encoder.output_shape[-1]
        self.probe = keras.layers.Dense(num_classes, dtype="float32", name="online_probe") if num_classes else None
        if self.probe is not None:
            self.probe.build((None, self.feature_dim))
        self.augment_config = augment_config
        self.seed = seed
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.term_trackers = {name: keras.metrics.Mean(name=name) for name in self.metric_names}
        self.probe_loss_tracker = keras.metrics.Mean(name="probe_loss")
        self.probe_accuracy = keras.metrics.SparseCategoricalAccuracy(name="probe_accuracy")
        self._compiled_views = None  # set by compile(jit_compile=True) on several mirrored replicas

    @classmethod
    def check_inputs(cls, config, image_shape: tuple[int, int, int]) -> None:
        """Raises `tfmp.config.UsageError` (one line) for a run this method cannot take; checked before anything is
        written. Every method here takes what the CLI checks for all of them."""

    @classmethod
    def views_per_example(cls, config, image_shape: tuple[int, int, int]) -> float:
        """Forward passes through the encoder per image in a step, in full-size images (the memory estimate's)."""
        return 2.0

    @classmethod
    def from_run_config(cls, encoder: keras.Model, config, **common) -> "TwoViewModel":
        """The method with a run's settings (`settings`, by name); `common` are `TwoViewModel`'s arguments."""
        return cls(encoder, **{name: getattr(config, name) for name in cls.settings}, **common)

    # ------------------------------------------------------------------ what a method defines

    def ssl_loss(self, features: tf.Tensor, batch_size: tf.Tensor, targets) -> tuple[tf.Tensor, dict]:
        """The method's loss (float32 scalar, this replica's share of the global-batch loss) and its terms.

        Args:
            features: encoder outputs of both views, `[first view; second view]`.
            batch_size: this replica's images per view.
            targets: what `target_outputs` returned (None without a target network).
        """
        raise NotImplementedError

    def target_outputs(self, first: tf.Tensor, second: tf.Tensor):
        """What the loss compares against that takes no gradient (e.g. a momentum network's outputs)."""
        return None

    def after_update(self) -> None:
        """Runs after the optimizer step (e.g. the momentum target's update)."""

    def batch_loss(self, images: tf.Tensor) -> tf.Tensor:
        """The method's loss of one batch at the current step (its views drawn, its targets computed), float32, the
        probe's excluded, nothing updated: what `train_step` differentiates (the precision doctor measures it)."""
        first, second = self.views(images)
        targets = self.target_outputs(first, second)
        features = self.encoder(tf.concat([first, second], axis=0), training=True)
        return self.ssl_loss(features, tf.shape(first)[0], targets)[0]

    # ------------------------------------------------------------------ shared

    def compile(self, optimizer=None, *, jit_compile="auto", **kwargs):
        """Keras' `compile`; `jit_compile=True` on several mirrored replicas compiles each replica's
        augmentations with XLA instead of the whole step, which XLA cannot (`tfmp.compilation`)."""
        per_replica = compilation.scope(jit_compile is True, self.distribute_strategy) == compilation.REPLICA_AUGMENTATIONS
        self._compiled_views = tf.function(self._draw_views, jit_compile=True) if per_replica else None
        super().compile(optimizer=optimizer, jit_compile=compilation.for_keras(jit_compile, self.distribute_strategy), **kwargs)
        compilation.build_optimizer_before_tracing(self)  # the encoder and heads are built in __init__

    def build(self, input_shape):
        self.built = True  # the heads are built in __init__, for the encoder's feature size

    def call(self, images, training=False):
        return self.encoder(images, training=training)

    @property
    def metrics(self):
        tracked = [self.loss_tracker, *self.term_trackers.values()]
        if self.probe is not None:
            tracked += [self.probe_loss_tracker, self.probe_accuracy]
        return tracked

    def views(self, images: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """The two augmented views of this replica's batch at the current step."""
        context = tf.distribute.get_replica_context()
        replica_id = context.replica_id_in_sync_group if context is not None else 0
        seed = augment.step_seed(self.seed, self.optimizer.iterations, replica_id)
        return (self._compiled_views or self._draw_views)(images, seed)

    def _draw_views(self, images: tf.Tensor, seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        first_seed, second_seed = augment.split_seed(seed, 2)
        return (augment.simclr_augment(images, first_seed, self.augment_config),
                augment.simclr_augment(images, second_seed, self.augment_config))

    def _probe_loss(self, features: tf.Tensor, labels: tf.Tensor):
        logits = self.probe(tf.stop_gradient(tf.cast(features, tf.float32)))
        weights = tf.cast(labels >= 0, tf.float32)  # -1 marks unlabeled images
        per_example = keras.losses.sparse_categorical_crossentropy(tf.maximum(labels, 0), logits, from_logits=True)
        return tf.reduce_sum(per_example * weights) / tf.maximum(tf.reduce_sum(weights), 1.0), logits, weights

    def _images_and_labels(self, data) -> tuple[tf.Tensor, tf.Tensor | None]:
        """A `fit()` batch's images, and its labels where the online probe reads them (None otherwise)."""
        images, labels = (data[0], data[1]) if isinstance(data, (tuple, list)) else (data, None)
        return images, labels if self.probe is not None else None

    def train_step(self, data):
        images, labels = self._images_and_labels(data)
        first, second = self.views(images)
        batch = tf.shape(first)[0]
        targets = self.target_outputs(first, second)
        views = tf.concat([first, second], axis=0)
        variables = self.trainable_variables
        steps = self.gradient_accumulation_steps
        if steps > 1:  # a batch the micro-batches do not divide (an epoch's last, from arrays) becomes equal ones
            rows = accumulation.padded_rows(batch, steps)
            views = accumulation.pad_view_rows(views, 2, batch, rows)
            if not self.batch_coupled_loss:  # gradient caching computes the loss on the real rows only
                targets = None if targets is None else tf.nest.map_structure(
                    lambda tensor: accumulation.pad_view_rows(tensor, 2, batch, rows), targets)
                labels = None if labels is None else accumulation.pad_rows(labels, rows, value=-1)  # -1: unlabeled
        owner = accumulation.gradient_owner(self.optimizer, steps, variables)  # zero2: gradients summed as this replica's chunks
        if self.gradient_accumulation_steps > 1 and self.batch_coupled_loss:
            gradients = self._cached_gradients(views, batch, targets, labels, variables, owner)
        else:
            gradients = self._accumulated_gradients(views, batch, targets, labels, variables, owner)
        accumulation.apply_gradients(self.optimizer, gradients, variables, owner)
        self.after_update()
        return {metric.name: metric.result() for metric in self.metrics}

    def _tracked_loss(self, features, batch, targets, labels) -> tf.Tensor:
        """The method's loss plus the probe's on `features` (`[first; second]` of `batch` images), its metrics updated."""
        loss, terms = self.ssl_loss(features, batch, targets)
        self.loss_tracker.update_state(loss)
        for name, value in terms.items():
            self.term_trackers[name].update_state(value)
        if labels is None:
            return loss
        probe_loss, logits, weights = self._probe_loss(features[:batch], labels)
        self.probe_loss_tracker.update_state(probe_loss)
        self.probe_accuracy.update_state(tf.maximum(labels, 0), logits, sample_weight=weights)
        return loss + probe_loss

    def _for_optimizer(self, loss: tf.Tensor) -> tf.Tensor:
        """A replica's loss as the optimizer takes it: divided by the replicas (Keras sums their gradients), and scaled
        under `mixed_float16`."""
        context = tf.distribute.get_replica_context()
        loss = loss / tf.cast(context.num_replicas_in_sync if context is not None else 1, loss.dtype)
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            loss = self.optimizer.scale_loss(loss)
        return loss

    def _accumulated_gradients(self, views, batch, targets, labels, variables, owner=None) -> list:
        """The gradient of the loss over `gradient_accumulation_steps` micro-batches, each with its own loss (the whole
        batch's for a loss that is a mean over examples; `steps == 1`: the one batch). A padded batch's copied rows
        count in their micro-batch's mean (the last batch of an epoch from arrays only)."""
        steps = self.gradient_accumulation_steps
        if steps == 1:
            with tf.GradientTape() as tape:
                features = self.encoder(views, training=True)
                loss = self._for_optimizer(self._tracked_loss(features, batch, targets, labels))
            return tape.gradient(loss, variables)
        micro_views = accumulation.two_view_micro_batches(views, steps)
        micro_targets = None if targets is None else tf.nest.map_structure(
            lambda tensor: accumulation.two_view_micro_batches(tensor, steps), targets)
        micro_labels = None if labels is None else accumulation.micro_batches(labels, steps)

        def gradients_of(index):
            micro_target = None if micro_targets is None else tf.nest.map_structure(lambda tensor: tensor[index], micro_targets)
            with tf.GradientTape() as tape:
                features = self.encoder(micro_views[index], training=True)
                loss = self._tracked_loss(features, tf.shape(features)[0] // 2, micro_target,
                                          None if micro_labels is None else micro_labels[index])
                loss = self._for_optimizer(loss / steps)
            return tape.gradient(loss, variables)

        return accumulation.sum_gradients(gradients_of, steps, variables, owner)

    def _cached_gradients(self, views, batch, targets, labels, variables, owner=None) -> list:
        """The whole batch's gradient by gradient caching (`tfmp.accumulation.cached_gradients`): the encoder in
        micro-batches (`views` padded to a multiple of them), the heads and the loss on the whole batch's real rows."""
        steps = self.gradient_accumulation_steps
        encoder_variables = self.encoder.trainable_variables
        in_encoder = {id(variable) for variable in encoder_variables}
        head_variables = [variable for variable in variables if id(variable) not in in_encoder]
        rows = tf.shape(views)[0] // 2  # padded to a multiple of the micro-batches: the loss takes the real rows only

        def loss(features):
            real = tf.concat([features[:batch], features[rows:rows + batch]], axis=0)
            return self._for_optimizer(self._tracked_loss(real, batch, targets, labels)), None

        encoder_gradients, head_gradients, _ = accumulation.cached_gradients(
            lambda images: self.encoder(images, training=True), accumulation.two_view_micro_batches(views, steps), steps,
            loss, encoder_variables, head_variables, replay=self.encoder, two_views=True, owner=owner)
        by_variable = {id(variable): gradient for variable, gradient in
                       zip([*encoder_variables, *head_variables], [*encoder_gradients, *head_gradients])}
        return [by_variable[id(variable)] for variable in variables]
