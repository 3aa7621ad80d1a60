"""`python -m tfmp.doctor --flagfile=experiments/X.cfg` — which precision, which float32 layers, which loss scale.

Builds the configured model in float32 — the classifier, or with `--task=<an SSL method>` the method
with its heads, decoder and targets — runs `--steps` batches of the configured data through it (forward
and backward of its loss, no update), prints the per-layer report of
`tfmp.diagnostics.precision_report`, and recommends: a precision for this hardware,
float32 overrides (`--float32_layers`) for layers that would overflow in float16, and a
loss-scale range. Takes the same flags as `tfmp.train` (unused ones are ignored).

With `--sharding=zero3` (a model whose weights need not fit one device) the model is built under the configured
strategy (`--strategy`, `--num_cpu_devices`) with its weights sharded as training shards them, and each batch is
split over the replicas; the report is the same (`tfmp.diagnostics.precision_doctor`). zero1 and zero2 shard what the
doctor never makes (optimizer state, weight gradients): it runs on one device for them, as unsharded. One machine's
replicas: under several workers each would report its own replicas only (refused).
Exit codes: 0 report printed; 2 usage or input error.
"""

from __future__ import annotations

import re
import sys

from tfmp import logs, tf_environment

tf_environment.prepare()  # before TensorFlow loads: log level, oneDNN kernels

from absl import flags  # noqa: E402

from tfmp import config as tfmp_config  # noqa: E402

FLAGS = flags.FlagValues()
tfmp_config.define_flags(FLAGS)
flags.DEFINE_integer("steps", 2, "Batches to analyse.", flag_values=FLAGS)
flags.DEFINE_string("workdir", "", "Ignored (accepted so train command lines can be reused).", flag_values=FLAGS)

PROGRAM = "tfmp.doctor"


def recommendations(report, hardware_policy: str, hardware_reason: str) -> list[str]:
    """What to change, from a report and what `auto` picks on this machine."""
    advice = [f"precision: --precision={hardware_policy} on this machine ({hardware_reason})"]
    overflowing = report.overflowing_layers("float16")
    if overflowing:
        pattern = "^(" + "|".join(re.escape(name) for name in overflowing) + ")$"
        advice.append(f"float16 would overflow in {len(overflowing)} layer(s): {', '.join(overflowing)}; "
                      f"under mixed_float16 keep them in float32: --float32_layers='{pattern}' (bfloat16 has float32's range)")
    else:
        advice.append("no layer overflows float16's range on these batches")
    bf16_overflowing = report.overflowing_layers("bfloat16")
    if bf16_overflowing:
        advice.append(f"even bfloat16 overflows in {', '.join(bf16_overflowing)}: check the model's scale (normalisation, init)")
    lowest, highest = report.loss_scale_range()
    default = tfmp_config.Config().initial_loss_scale
    start = f"the default --initial_loss_scale={default:g} is inside it" if lowest <= default <= highest else \
        f"start there with --initial_loss_scale={highest:g}"
    advice.append(f"mixed_float16 loss scale: between {lowest:g} and {highest:g}; {start}")
    underflowing = report.underflowing_layers("float16")
    if underflowing:
        advice.append(f"without loss scaling, >1% of gradients would flush to zero in float16 in: {', '.join(underflowing)}")
    return advice


def main(argv: list[str]) -> int:
    logs.configure()  # first: absl's own logging.info would otherwise install Python's default format
    if any(arg in ("-h", "--help", "--helpfull") for arg in argv[1:]):
        print(__doc__ + "\n" + FLAGS.get_help())
        return 0
    try:
        leftover = FLAGS(argv)
    except flags.Error as error:
        print(f"{PROGRAM}: error: {tfmp_config.flag_error_message(error)}", file=sys.stderr)
        return 2
    config, steps = tfmp_config.from_flags(FLAGS), FLAGS.steps
    FLAGS.unparse_flags()
    try:
        if len(leftover) > 1:
            raise tfmp_config.UsageError(f"unexpected arguments {' '.join(leftover[1:])}")
        if steps < 1:
            raise tfmp_config.UsageError(f"steps must be a positive integer, got {steps}")
        config = tfmp_config.validate(config)
    except tfmp_config.UsageError as error:
        print(f"{PROGRAM}: error: {error}", file=sys.stderr)
        return 2

    logs.configure(verbose=config.verbose)
    tf_environment.load_tensorflow(verbose=config.verbose)  # its start-up lines kept off the terminal
    import keras
    import tensorflow as tf

    from tfmp import data as tfmp_data, distribute, models, precision, registry, sharding
    from tfmp.diagnostics import precision_report
    from tfmp.runtime import Runtime
    from tfmp.tasks import pretrain
    from tfmp.tasks.stage import build_encoder

    try:
        data = tfmp_data.load_for(config)
        precision.set_policy("float32")  # measured in float32: what each low precision would do to these values
        strategy = tf.distribute.get_strategy()
        if config.sharding == "zero3":  # the weights sharded over the replicas, as training holds them
            if config.strategy == "multi_worker_mirrored":
                raise ValueError("tfmp.doctor runs on one machine's replicas; --strategy=multi_worker_mirrored would "
                                 "make each worker report its own replicas only")
            strategy = distribute.get_strategy(config.strategy, num_cpu_devices=config.num_cpu_devices or None,
                                               tpu=config.tpu or None)
        runtime = Runtime.for_strategy(strategy, jit_compile="false", conv_weight_gradient=config.conv_weight_gradient)
        batch = min(config.global_batch_size, len(data.train))
        batch -= batch % strategy.num_replicas_in_sync  # an equal share for every replica
        with strategy.scope():
            if config.task in registry.SSL_METHODS:  # the method's own step: views, heads or decoder, targets, its loss
                pretrain.check_inputs(config, data)
                model = pretrain.build_method(config, data, runtime, total_steps=config.epochs * (len(data.train) // batch))
                what, batch_loss = f"--task={config.task} with {config.model}", model.batch_loss
            else:
                model = models.build_classifier(build_encoder(config, runtime, data.image_shape), data.num_classes)
                what, batch_loss = f"{config.model} as a classifier", None
            if strategy.num_replicas_in_sync > 1:  # no update is made: the optimizer only shards the weights
                sharding.ShardedOptimizer(keras.optimizers.SGD(), stage="zero3", units=models.block_of).build(
                    model.trainable_variables)
    except ValueError as error:  # a UsageError too
        print(f"{PROGRAM}: error: {error}", file=sys.stderr)
        return 2
    batches = tfmp_data.classification_pipeline(data.train, batch, training=True, seed=config.seed)
    report = precision_report(model, batches, steps=steps, batch_loss=batch_loss, strategy=strategy)
    hardware_policy, reason = precision.resolve("auto")
    where = f", weights sharded (zero3) over {strategy.num_replicas_in_sync} replicas" if strategy.num_replicas_in_sync > 1 else ""
    print(f"precision doctor: {what} on {data.name}, {steps} batch(es) of {batch}{where}, measured in float32\n")
    print(report.table())
    print("\nrecommendations:")
    for line in recommendations(report, hardware_policy, reason):
        print(f"- {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
