"""Gradient accumulation inside one optimizer step (`--gradient_accumulation_steps=K`), and gradient caching.

**One `fit()` step is still one optimizer step over the whole global batch.** Inside the step each replica's batch is
cut into K equal micro-batches that run one after another (a `tf.while_loop` with `parallel_iterations=1`; on several
replicas of a strategy whose collectives need `merge_call`, which TensorFlow refuses inside control flow —
MirroredStrategy off XLA-GPU, with synchronized BatchNorm or a loss's all-gather in the loop — K copies chained by
control dependencies: either way only one micro-batch's activations are alive), and their gradients are summed in the
variables' dtype (float32 under the mixed policies). The optimizer then sees the summed gradient once. So the data
order, the augmentation draws (drawn for the whole batch before it is cut), the learning-rate schedule, the step count
and the checkpoints are those of the run without accumulation — a checkpoint can only fall between optimizer steps,
and a stop anywhere resumes exactly as any tfmp run does. Under fp16 the loss scale multiplies every micro-batch's
loss alike and the `LossScaleOptimizer` decides about overflow once, on the accumulated gradient (an inf in any
micro-batch on any replica skips the step on all), and moves the scale once; clipping (`tfmp.clipping`) and sharding
(`tfmp.sharding`) see the accumulated, reduced gradient.

Keras' own `gradient_accumulation_steps` (an optimizer option) works the other way round: each `fit()` step is a
micro-batch, so epochs, schedules and checkpoints count micro-batches, a checkpoint can fall between them, and a
`LossScaleOptimizer` checks and updates its scale on every micro-batch. tfmp refuses it under sharding
(`tfmp.update_rules.UNSUPPORTED_OPTIONS`).

**Losses that couple the examples of a batch** (SimCLR's and MoCo v3's negatives, VICReg's and Barlow Twins'
statistics) are not the sum of per-micro-batch losses. For them `cached_gradients` is gradient caching (Gao et al.
2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup"): embed every micro-batch without a
tape, compute the loss and its gradient with respect to the embeddings on the whole batch (the heads' gradients too),
then run each micro-batch again under a tape and back-propagate its slice of that embedding gradient. The result is
the whole batch's gradient (tests/test_accumulation.py checks it against one big batch). The encoder's non-trainable
state (BatchNorm's moving statistics, random-seed state for dropout and drop path) is put back before the second pass,
so the second pass draws the same random numbers and the state moves once per step.

Under `--sharding=zero2` (`tfmp.sharding`) each micro-batch's gradients are reduced to the replicas that own their
chunks as soon as they exist, and each replica sums only its own chunks: the running sum is 1/N of a gradient
(`gradient_owner` finds the sharded optimizer, `apply_gradients` hands it the summed chunks). The sum is the same;
the step pays K reductions instead of one.

BatchNorm layers normalise each micro-batch with its own statistics (as unsynchronised BatchNorm does on each
replica), so a network with BatchNorm in the accumulated part trains close to, not exactly as, the one big batch.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmp import averaging, keras_internals, sharding


def check_steps(per_replica_batch: int, steps: int) -> None:
    """Raises ValueError, naming the valid choices, unless `steps` micro-batches cut `per_replica_batch` evenly."""
    if steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be at least 1, got {steps}")
    if per_replica_batch % steps:
        divisors = [d for d in range(1, per_replica_batch + 1) if per_replica_batch % d == 0]
        raise ValueError(f"gradient_accumulation_steps {steps} does not divide the per-replica batch of {per_replica_batch} "
                         f"examples into equal micro-batches; use one of {', '.join(map(str, divisors))}")


def padded_rows(batch, steps: int):
    """The rows of a batch of `batch` examples padded up to a multiple of `steps` (the same when it divides)."""
    return (batch + steps - 1) // steps * steps


def pad_rows(tensor, rows, value=None):
    """`tensor` with rows added up to `rows`: copies of its last row, or `value` (a batch that `steps` does not divide,
    e.g. an epoch's last from arrays, becomes equal micro-batches; the added rows carry no weight where the loss
    takes weights). None stays None."""
    if tensor is None:
        return None
    tensor = tf.convert_to_tensor(tensor)
    batch = tf.shape(tensor)[0]
    if value is not None:
        filler = tf.fill(tf.concat([[rows - batch], tf.shape(tensor)[1:]], axis=0), tf.cast(value, tensor.dtype))
        return tf.concat([tensor, filler], axis=0)
    return tf.gather(tensor, tf.minimum(tf.range(rows), batch - 1))


def pad_view_rows(tensor, views: int, batch, rows):
    """`[view 1; view 2; ...]` of `batch` examples each, each view padded to `rows` (copies of its last row): a batch the
    micro-batches do not divide, as `view_micro_batches` cuts it."""
    return tf.concat([pad_rows(tensor[view * batch:(view + 1) * batch], rows) for view in range(views)], axis=0)


def micro_batches(tree, steps: int):
    """Every tensor of `tree`, `[batch, ...]`, as `[steps, batch / steps, ...]` (micro-batch i is row i; None stays None)."""
    def cut(tensor):
        if tensor is None:
            return None
        tensor = tf.convert_to_tensor(tensor)
        return tf.reshape(tensor, tf.concat([[steps, -1], tf.shape(tensor)[1:]], axis=0))
    return tf.nest.map_structure(cut, tree)


def two_view_micro_batches(tensor: tf.Tensor, steps: int) -> tf.Tensor:
    """`[first view; second view]` of a batch, `[2 * batch, ...]`, as `[steps, 2 * batch / steps, ...]` where micro-batch i
    is `[first view of its examples; second view of its examples]`: the layout a two-view loss reads."""
    return view_micro_batches(tensor, steps, views=2)


def view_micro_batches(tensor: tf.Tensor, steps: int, views: int) -> tf.Tensor:
    """`two_view_micro_batches` for `views` views of each example, `[view 1; view 2; ...]` (DINO's crops)."""
    rest = tf.shape(tensor)[1:]
    by_view = tf.reshape(tensor, tf.concat([[views, steps, -1], rest], axis=0))  # [view, micro-batch, example, ...]
    by_micro_batch = tf.transpose(by_view, tf.concat([[1, 0], tf.range(2, tf.rank(by_view))], axis=0))
    return tf.reshape(by_micro_batch, tf.concat([[steps, -1], rest], axis=0))


def two_view_batch(micro: tf.Tensor, steps: int) -> tf.Tensor:
    """The inverse of `two_view_micro_batches`: `[steps, 2 * m, ...]` back to `[first view; second view]` of the batch."""
    rest = tf.shape(micro)[2:]
    by_micro_batch = tf.reshape(micro, tf.concat([[steps, 2, -1], rest], axis=0))
    by_view = tf.transpose(by_micro_batch, tf.concat([[1, 0], tf.range(2, tf.rank(by_micro_batch))], axis=0))
    return tf.reshape(by_view, tf.concat([[-1], rest], axis=0))


def gradient_owner(optimizer, steps: int, variables: list | None = None):
    """The `tfmp.sharding.ShardedOptimizer` whose chunks the micro-batches' gradients are summed as — zero2 on several
    replicas with more than one micro-batch, or zero3 (its gradients are chunks already) — or None: whole gradients are
    summed. Given every trainable variable (`variables`), an unbuilt `optimizer` is built from them (a step that
    reduces some of them first needs the layout of all)."""
    sharded = averaging.innermost(optimizer)
    if steps == 1 or not isinstance(sharded, sharding.ShardedOptimizer) or not sharded.shards_gradients:
        return None
    if variables is not None and not optimizer.built:
        optimizer.build(list(variables))
    return sharded


def apply_gradients(optimizer, gradients: list, variables: list, owner=None) -> None:
    """`optimizer.apply(gradients, variables)`, telling the sharded optimizer `owner` (from `gradient_owner`) that the
    gradients are its chunks, reduced already."""
    if owner is None:
        optimizer.apply(gradients, variables)
        return
    with owner.receiving_owned():
        optimizer.apply(gradients, variables)


class _Reached:
    """Which variables the micro-batches' losses reach, seen as the step is traced. A variable none of them reaches
    gets None, as without accumulation (Keras' optimizers leave it untouched), not a zero gradient (which AdamW would
    still decay and its momentum still move)."""

    def __init__(self, variables, owner=None):
        self.given = variables  # or a function returning them: read after the first micro-batch built the model
        self.reached = None
        self.owner = owner  # zero2: gradients reduced to this replica's chunks before they are summed

    @property
    def variables(self) -> list:
        if self.reached is None:
            self.given = list(self.given() if callable(self.given) else self.given)
            self.reached = [False] * len(self.given)
        return self.given

    def dense(self, gradients) -> list[tf.Tensor]:
        variables = self.variables
        for position, gradient in enumerate(gradients):
            self.reached[position] = self.reached[position] or gradient is not None
        if self.owner is not None:
            gradients = self.owner.owned_gradients(list(gradients), variables)
        return [self.zeros(variable) if gradient is None else tf.convert_to_tensor(gradient)
                for gradient, variable in zip(gradients, variables)]

    def zeros(self, variable) -> tf.Tensor:
        """A zero gradient of `variable` as it is summed: whole in its dtype, or its chunk (zero2)."""
        return tf.zeros(variable.shape, variable.dtype) if self.owner is None else self.owner.owned_zeros(variable)

    def kept(self, total) -> list:
        return [sum_ if reached else None for sum_, reached in zip(total, self.reached)]


def _in_a_loop() -> bool:
    """Whether the micro-batches may run in a `tf.while_loop`: not on several replicas whose collectives (synchronized
    BatchNorm, a loss's all-gather) go through `merge_call`, which TensorFlow refuses inside control flow."""
    context = tf.distribute.get_replica_context()
    return context is None or context.num_replicas_in_sync == 1 or keras_internals.strategy_supports_no_merge_call()


def _chained(function, steps: int, combine):
    """`function(i)` for i = 0 .. steps - 1 as Python-unrolled copies, each starting after the previous one's result
    (a control dependency), so one micro-batch is alive at a time; folded with `combine(previous, result)` (previous
    None at the first)."""
    folded = None
    for index in range(steps):
        with tf.control_dependencies(tf.nest.flatten(folded) if folded is not None else []):
            result = function(tf.constant(index))
            folded = combine(folded, result)
    return folded


def sum_gradients(gradients_of, steps: int, variables: list, owner=None) -> list[tf.Tensor]:
    """`sum_i gradients_of(i)` for micro-batches i = 0 .. steps - 1, one after another.

    Args:
        gradients_of: micro-batch index (a scalar tensor) -> gradients of `variables` (None for one it does not reach).
        steps: the number of micro-batches.
        variables: what the gradients are taken with respect to.
        owner: `gradient_owner(optimizer, steps)`: under zero2, each micro-batch's gradients are reduced to their
            owners and this replica's chunks summed (apply them with `apply_gradients`).
    """
    if steps == 1 or not _in_a_loop():
        return sum_gradients_keeping_outputs(lambda index: (gradients_of(index), ()), steps, variables, owner)[0]
    reached = _Reached(variables, owner)

    def body(index, total):
        return index + 1, [sum_ + gradient for sum_, gradient in zip(total, reached.dense(gradients_of(index)))]

    zeros = [reached.zeros(variable) for variable in variables]
    _, total = tf.while_loop(lambda index, _: index < steps, body, (tf.constant(0), zeros), parallel_iterations=1)
    return reached.kept(total)


def sum_gradients_keeping_outputs(step_of, steps: int, variables: list, owner=None):
    """`sum_gradients` where each micro-batch also returns outputs to keep (e.g. its predictions, for metrics over the
    whole batch): `step_of(i)` -> (gradients, a tree of tensors); returns (summed gradients, each output stacked over
    the micro-batches, `[steps, ...]`). `variables` may be a function returning them, called after the first
    micro-batch ran (a lazily built model has its variables only then)."""
    reached = _Reached(variables, owner)
    dense = reached.dense
    if steps == 1:
        gradients, outputs = step_of(tf.constant(0))
        return reached.kept(dense(gradients)), tf.nest.map_structure(lambda output: output[None], outputs)
    if not _in_a_loop():
        def combine(folded, result):
            gradients, outputs = result
            if folded is None:
                return dense(gradients), [outputs]
            return [sum_ + gradient for sum_, gradient in zip(folded[0], dense(gradients))], [*folded[1], outputs]

        total, outputs = _chained(step_of, steps, combine)
        return reached.kept(total), tf.nest.map_structure(lambda *each: tf.stack(each), *outputs)

    # The first micro-batch runs before the loop: its outputs give the kept arrays their dtypes and shapes (one more
    # traced copy of the step than `sum_gradients`' loop).
    first_gradients, first_outputs = step_of(tf.constant(0))
    flat = tf.nest.flatten(first_outputs)
    arrays = [tf.TensorArray(output.dtype, size=steps, element_shape=output.shape).write(0, output) for output in flat]

    def body(index, total, arrays):
        gradients, outputs = step_of(index)
        total = [sum_ + gradient for sum_, gradient in zip(total, dense(gradients))]
        return index + 1, total, [array.write(index, output) for array, output in zip(arrays, tf.nest.flatten(outputs))]

    _, total, arrays = tf.while_loop(lambda index, *_: index < steps, body, (tf.constant(1), dense(first_gradients), arrays),
                                     parallel_iterations=1)
    return reached.kept(total), tf.nest.pack_sequence_as(first_outputs, [array.stack() for array in arrays])


def map_micro_batches(function, micro: tf.Tensor, steps: int) -> tf.Tensor:
    """`function` on each micro-batch of `micro` (`[steps, m, ...]`), one after another, stacked: `[steps, m', ...]`."""
    if not _in_a_loop():
        outputs = _chained(lambda index: function(micro[index]), steps,
                           lambda outputs, output: [output] if outputs is None else [*outputs, output])
        return tf.stack(outputs)

    def body(index, outputs):
        return index + 1, outputs.write(index, function(micro[index]))

    first = function(micro[0])
    outputs = tf.TensorArray(first.dtype, size=steps, element_shape=first.shape).write(0, first)
    _, outputs = tf.while_loop(lambda index, _: index < steps, body, (tf.constant(1), outputs), parallel_iterations=1)
    return outputs.stack()


class StateReplay:
    """Reads a network's non-trainable state (BatchNorm statistics, random-seed state) and puts it back, so that a
    second pass over the same inputs computes what the first did and leaves the state as one pass would."""

    def __init__(self, network: keras.layers.Layer):
        self.variables = list(network.non_trainable_variables)
        self.saved = [tf.identity(variable.value) for variable in self.variables]

    def restore(self, after) -> None:
        """Puts the saved state back once `after` (tensors of the first pass) is computed."""
        with tf.control_dependencies(tf.nest.flatten(after)):
            for variable, value in zip(self.variables, self.saved):
                variable.assign(value)


def cached_gradients(embed, micro_inputs: tf.Tensor, steps: int, embedding_loss, encoder_variables: list,
                     other_variables: list, replay: keras.layers.Layer | None = None, *, two_views: bool = False,
                     owner=None):
    """Gradient caching: the gradient of `embedding_loss(embed(whole batch))` with micro-batches of `embed` in memory.

    Args:
        embed: micro-batch inputs -> embeddings (the encoder, in training mode).
        micro_inputs: `[steps, m, ...]`, from `micro_batches` or `two_view_micro_batches`.
        steps: the number of micro-batches.
        embedding_loss: embeddings of the whole batch, in the layout `micro_inputs` was cut from -> (loss to
            differentiate, anything else to return). Its heads' variables are `other_variables`.
        encoder_variables: the variables `embed` uses.
        other_variables: the variables only `embedding_loss` uses (heads, probes).
        replay: the network whose non-trainable state the second pass replays (see `StateReplay`).
        two_views: `micro_inputs` came from `two_view_micro_batches` (the loss reads `[first; second]`).
        owner: `gradient_owner(optimizer, steps)` (zero2): the encoder's chunks summed over the micro-batches, the
            heads' gradients reduced once; both returned as this replica's chunks (apply with `apply_gradients`).

    Returns:
        (gradients of `encoder_variables`, gradients of `other_variables` — None for one the loss does not reach —,
        the loss's extra outputs).
    """
    state = StateReplay(replay) if replay is not None else None
    micro_embeddings = map_micro_batches(embed, micro_inputs, steps)
    if state is not None:
        state.restore(after=micro_embeddings)
    whole = two_view_batch if two_views else _merge_micro_batches
    with tf.GradientTape() as tape:
        embeddings = whole(micro_embeddings, steps)
        tape.watch(embeddings)
        loss, extra = embedding_loss(embeddings)
    embedding_gradient, *other_gradients = tape.gradient(loss, [embeddings, *other_variables])
    micro_gradient = (two_view_micro_batches if two_views else micro_batches)(embedding_gradient, steps)

    def gradients_of(index):
        with tf.GradientTape() as tape:
            micro_embedding = embed(micro_inputs[index])
            # The surrogate's gradient with respect to the encoder is the cached embedding gradient, back-propagated.
            surrogate = tf.reduce_sum(tf.cast(micro_embedding, tf.float32) * tf.cast(micro_gradient[index], tf.float32))
        with tf.control_dependencies([surrogate]):
            return tape.gradient(surrogate, encoder_variables)

    encoder_gradients = sum_gradients(gradients_of, steps, encoder_variables, owner)
    if owner is not None:
        other_gradients = owner.owned_gradients(other_gradients, other_variables)
    return encoder_gradients, other_gradients, extra


def _merge_micro_batches(micro: tf.Tensor, steps: int) -> tf.Tensor:
    return tf.reshape(micro, tf.concat([[-1], tf.shape(micro)[2:]], axis=0))


def accumulating_train_step(model: keras.Model, steps: int):
    """Keras' default `train_step` for a compiled `model`, taking each replica's batch in `steps` micro-batches.

    The loss of each micro-batch of m examples (Keras' `compute_loss`: a sum over the micro-batch divided by m) is
    multiplied by m / batch, so the summed gradient is the whole batch's for losses that average over examples; the
    loss tracker is updated per micro-batch (its mean is the batch's), the metrics once on the whole batch's
    predictions (kept per micro-batch: the outputs, not the activations). A batch `steps` does not
    divide (an epoch's last, from arrays) is padded to equal micro-batches with rows of weight 0: the loss and the
    metrics are the real rows'; BatchNorm's statistics see the copies. Use through `accumulate_gradients`.
    """
    def train_step(data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        batch = tf.shape(tf.nest.flatten(x)[0])[0]
        rows = padded_rows(batch, steps)
        data_weights = sample_weight
        if sample_weight is None:
            sample_weight = tf.ones([batch])
        micro = micro_batches((tf.nest.map_structure(lambda tensor: pad_rows(tensor, rows), (x, y)),
                               tf.nest.map_structure(lambda weight: pad_rows(weight, rows, value=0), sample_weight)), steps)
        micro_rows = rows // steps
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        owner = gradient_owner(model.optimizer, steps)

        def step_of(index):
            (x_i, y_i), weight_i = tf.nest.map_structure(lambda tensor: None if tensor is None else tensor[index], micro)
            real = tf.clip_by_value(batch - index * micro_rows, 0, micro_rows)  # rows of this micro-batch that are data
            with tf.GradientTape() as tape:
                y_pred = model(x_i, training=True)
                loss = keras_internals.compute_loss(model, x_i, y_i, y_pred, weight_i)
                share = tf.cast(micro_rows, loss.dtype) / tf.cast(batch, loss.dtype)
                # compute_loss divided by the replicas (Keras sums their gradients); the tracker shows the undivided
                # loss, the mean over the real rows.
                keras_internals.loss_tracker(model).update_state(
                    loss * tf.cast(replicas * micro_rows, loss.dtype) / tf.cast(tf.maximum(real, 1), loss.dtype),
                    sample_weight=real)
                loss = model.optimizer.scale_loss(loss * share)
            # Read after the call: a lazily built model creates its variables in the first one (as Keras' step does).
            return tape.gradient(loss, model.trainable_variables), y_pred

        gradients, micro_predictions = sum_gradients_keeping_outputs(step_of, steps, lambda: model.trainable_variables,
                                                                     owner)
        apply_gradients(model.optimizer, gradients, model.trainable_variables, owner)
        # Metrics once, on the batch's real rows (Keras' unweighted metrics would count the padding rows).
        predictions = tf.nest.map_structure(lambda micro_prediction: _merge_micro_batches(micro_prediction, steps)[:batch],
                                            micro_predictions)
        return model.compute_metrics(x, y, predictions, sample_weight=data_weights)

    train_step.accumulation_steps = steps
    return train_step


def accumulate_gradients(model: keras.Model, steps: int) -> keras.Model:
    """Makes `model.fit()` take each step's batch in `steps` micro-batches (library use of the CLI's
    `--gradient_accumulation_steps`); returns `model`. Call before `compile()` or after; `steps=1` restores the
    plain step.

    A model whose class defines its own `train_step` is refused: its step is the user's, and accumulating means
    running its loss in micro-batches — `sum_gradients` (and `cached_gradients` for batch-coupled losses) are the
    pieces to write it with.
    """
    if type(model).train_step is not keras.Model.train_step:
        raise ValueError(f"{type(model).__name__} defines its own train_step; accumulate inside it with "
                         "tfmp.accumulation.sum_gradients (or cached_gradients for a loss that couples the batch)")
    if getattr(vars(model).get("train_step"), "accumulation_steps", 1) == steps:
        return model  # as asked already: the traced step function stays
    if steps == 1:
        vars(model).pop("train_step", None)  # the class's own step again
    else:
        model.train_step = accumulating_train_step(model, steps)
    model.train_function = None  # Keras traces its step function again at the next fit()
    return model
