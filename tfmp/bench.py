"""`python -m tfmp.bench` — throughput and memory of the training step tfmp runs.

    python -m tfmp.bench --model=resnet18_cifar --method=simclr --batch=64 --steps=20 --precision=float32,mixed_bfloat16

For each precision (and --remat mode), a fresh process (clean peak RSS, its own dtype policy) builds the
model as tfmp trains it — `SimCLR` (two augmented views per image, NT-Xent) or the
supervised classifier — on synthetic images, compiles Keras' own train function, runs
`--warmup` steps, then `--repeats` timed runs of `--steps` steps, and prints one JSON line:

    images_per_second   batch / median step time (images, not views)
    step_time_ms        median over repeats of (run time / steps); step_time_spread = (max-min)/median
    peak_rss_mb         the process's peak resident memory (TensorFlow runtime included)
    peak_tensor_mb      peak bytes held by TensorFlow's CPU allocator during the timed steps
                        (tensors only: activations, gradients, weights, optimizer state;
                        null where TF keeps no CPU allocation statistics, i.e. oneDNN off)
    gflops_per_second   training FLOPs per step / median step time
    mfu                 gflops_per_second / this CPU's peak for the precision (`mfu_peak_formula` says how the
                        peak was derived; tfmp/diagnostics/flops.py)

FLOP source ("analytic"): 2 x multiply-accumulates of every Conv2D and Dense layer in the
forward pass (from the layers' actual output shapes), x 3 for forward + backward, x 2
views for SimCLR. Element-wise ops, BatchNorm and the loss are not counted.
"""

from __future__ import annotations

import argparse
import glob
import json
import resource
import statistics
import subprocess
import sys
import time

from tfmp import hardware, report, tf_environment
from tfmp.config import CONV_WEIGHT_GRADIENTS

tf_environment.prepare()  # the environment tfmp.train runs in (log level, oneDNN kernels)

METHODS = ("simclr", "supervised")


def forward_flops_per_example(model, input_shape) -> int:
    """`tfmp.diagnostics.flops.forward_flops_per_example` (imported on use: the parent process loads no TensorFlow)."""
    from tfmp.diagnostics import flops as flop_counting

    return flop_counting.forward_flops_per_example(model, input_shape)


def run_one(args: argparse.Namespace, precision_name: str, remat: str) -> dict:
    """Measures one configuration (`args` as parsed, one precision and remat mode) in this process."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tfmp.diagnostics import flops as flop_counting

    # Thread pools must be set before TensorFlow runs anything; 0 leaves TF's default (one per core)
    # and is not set at all, so a caller that already ran TensorFlow can measure with the defaults.
    if args.intra_op_threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)
    if args.inter_op_threads:
        tf.config.threading.set_inter_op_parallelism_threads(args.inter_op_threads)

    from tfmp import accumulation, keras_internals, models, precision
    from tfmp.diagnostics import memory
    from tfmp.data.augment import AugmentConfig
    from tfmp.data.pipeline import in_memory_options
    from tfmp.models import conv
    from tfmp.runtime import Runtime
    from tfmp.ssl.simclr import SimCLR

    policy = precision.set_policy(precision_name)
    # Plain Keras' network has Keras' Conv2D, i.e. TensorFlow's weight gradient everywhere.
    runtime = Runtime.for_strategy(tf.distribute.get_strategy(), jit_compile=args.jit_compile,
                                   conv_weight_gradient="tf" if args.keras_batchnorm else args.conv_weight_gradient)
    batch = args.batch
    keras.utils.set_random_seed(args.seed)
    shape = (args.image_size, args.image_size, 3)
    # --keras_batchnorm: the same network as plain Keras builds it (Keras' own BatchNormalization),
    # the baseline tfmp's own changes are measured against.
    encoder = models.build_encoder(args.model, shape, models.NormSettings(fused=not args.keras_batchnorm), remat=remat,
                                   conv_weight_gradient=runtime.conv_weight_gradient)
    if args.method == "simclr":
        model = SimCLR(encoder, projection_dim=128, temperature=0.5, augment_config=AugmentConfig(blur_probability=0.0),
                       gradient_accumulation_steps=args.gradient_accumulation_steps)
        model.build((None, *shape))
        # The PyTorch peer's optimizer: SGD with momentum and weight decay.
        model.compile(optimizer=precision.wrap_optimizer(keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=5e-4)),
                      jit_compile=runtime.jit_compile)
        views = 2
    else:
        model = models.build_classifier(encoder, 10)
        model.compile(optimizer=precision.wrap_optimizer(keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=5e-4)),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=runtime.keras_jit_compile)
        accumulation.accumulate_gradients(model, args.gradient_accumulation_steps)
        views = 1
    rng = np.random.default_rng(args.seed)
    images = rng.random((batch, *shape), dtype=np.float32)
    labels = rng.integers(0, 10, batch).astype(np.int32)
    dataset = tf.data.Dataset.from_tensors((images, labels)).repeat().with_options(in_memory_options())
    iterator = iter(dataset)
    model.make_train_function()
    train_function = model.train_function

    def run_steps(count):
        logs = None
        for _ in range(count):
            logs = train_function(iterator)
        float(logs["loss"])  # wait for the last step to finish

    run_steps(args.warmup)
    counts_tensors = memory.reset_peak_memory("CPU:0")
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        run_steps(args.steps)
        times.append((time.perf_counter() - start) / args.steps)
    median = statistics.median(times)
    flops = 3 * views * batch * forward_flops_per_example(encoder if args.method == "simclr" else model, shape)
    return {
        "framework": f"{'plain keras' if args.keras_batchnorm else 'tfmp'} (keras {keras.__version__}, tensorflow {tf.__version__})",
        "model": args.model,
        "method": args.method,
        "precision": policy,
        "remat": remat,
        "conv_weight_gradient": runtime.conv_weight_gradient,
        "tap_matmul_layers": sum(isinstance(layer, conv.Conv2D) and layer.tap_matmul_weight_gradient
                                 for layer in keras_internals.nested_layers(encoder)),
        "jit_compile": runtime.jit_compile,
        "threads": {"intra_op": args.intra_op_threads, "inter_op": args.inter_op_threads},
        "batch": batch,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "steps": args.steps,
        "repeats": args.repeats,
        "step_time_ms": round(1000 * median, 2),
        "step_time_spread": round((max(times) - min(times)) / median, 3),
        "images_per_second": round(batch / median, 2),
        "gflops_per_second": round(flops / median / 1e9, 1),
        "flop_source": ("analytic: 2 x MACs of Conv2D/Dense/EinsumDense and attention forward, x3 for training"
                        + (", x2 views" if views == 2 else "")),
        **{key: value for key, value in flop_counting.utilisation(flops / batch, batch / median, policy).items()
           if key in ("mfu", "mfu_peak_formula")},
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        # None where TF keeps no CPU allocation statistics (oneDNN off; see memory.reset_peak_memory)
        "peak_tensor_mb": round(tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20, 1) if counts_tensors else None,
    }


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m tfmp.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18_cifar")
    parser.add_argument("--method", default="simclr", choices=METHODS)
    parser.add_argument("--batch", type=int, default=64, help="images per step (SimCLR: two views each)")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1,
                        help="micro-batches per step (tfmp.accumulation; SimCLR: gradient caching)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--precision", default="float32,mixed_bfloat16", help="comma-separated precisions")
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--keras_batchnorm", action="store_true",
                        help="build with Keras' own BatchNormalization (the plain-Keras baseline)")
    parser.add_argument("--conv_weight_gradient", default="auto", choices=CONV_WEIGHT_GRADIENTS,
                        help="auto: tap matmuls where measured faster, on CPUs with bf16 units (what tfmp trains with); "
                             "tf: TensorFlow's kernel everywhere; tap_matmul: tap matmuls wherever the rule holds "
                             "(tfmp.models.conv)")
    parser.add_argument("--jit_compile", action="store_true", help="compile the train step with XLA")
    parser.add_argument("--intra_op_threads", type=int, default=0, help="TF intra-op threads (0: TF's default)")
    parser.add_argument("--inter_op_threads", type=int, default=0, help="TF inter-op threads (0: TF's default)")
    parser.add_argument("--remat", default="none", help="comma-separated activation checkpointing modes: none, blocks, full")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--allow_emulated_bf16", action="store_true",
                        help="measure mixed_bfloat16 even on a CPU without bf16 units (emulated: several times slower than float32)")
    parser.add_argument("--verbose", action="store_true", help="show TensorFlow's start-up lines")
    parser.add_argument("--in_process", action="store_true", help="measure one precision in this process (used internally)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv[1:])
    from tfmp import config, registry

    try:
        precisions = [config.canonical_precision(name) for name in args.precision.split(",")]
        remats = args.remat.split(",")
        for remat in remats:
            if remat not in config.REMAT_MODES:
                raise config.UsageError(f"unknown remat mode {remat!r}; valid: {', '.join(config.REMAT_MODES)}")
        if args.model not in registry.ENCODERS:
            raise config.UsageError(f"unknown model {args.model!r}; valid: {', '.join(registry.ENCODERS.names())}")
        for name in ("batch", "steps", "repeats", "gradient_accumulation_steps"):
            if getattr(args, name) < 1:
                raise config.UsageError(f"{name} must be a positive integer, got {getattr(args, name)}")
        if args.batch % args.gradient_accumulation_steps:
            raise config.UsageError(f"gradient_accumulation_steps {args.gradient_accumulation_steps} does not divide batch "
                                    f"{args.batch}")
    except config.UsageError as error:
        print(f"tfmp.bench: error: {error}", file=sys.stderr)
        return 2
    if args.in_process:
        tf_environment.load_tensorflow(verbose=args.verbose)  # TF's start-up lines off the terminal
        result = run_one(args, precisions[0], remats[0])
        print(json.dumps(result), flush=True)
        return 0
    if "mixed_bfloat16" in precisions and bf16_emulated() and not args.allow_emulated_bf16:
        print("tfmp.bench: error: mixed_bfloat16 is emulated on this CPU (no AVX512_BF16 or AMX): a ResNet step takes many times "
              "float32's (17x measured on a Zen 3), so this could run for an hour; drop it from --precision, or pass "
              "--allow_emulated_bf16", file=sys.stderr)
        return 2
    configurations = [(precision_name, remat) for precision_name in precisions for remat in remats]
    timed = args.warmup + args.steps * args.repeats
    print(f"tfmp.bench: {len(configurations)} configuration(s), each a fresh process: build, {args.warmup} warm-up + "
          f"{args.repeats} x {args.steps} timed steps ({timed} steps) of {args.model} {args.method} at batch {args.batch}",
          file=sys.stderr, flush=True)
    # Progress on stderr (stdout carries the JSON lines); the ETA comes from configurations already measured.
    progress = report.Phases([report.Phase(f"{precision_name}, remat {remat}", "configuration")
                              for precision_name, remat in configurations], stream=sys.stderr)
    code = 0
    for index, (precision_name, remat) in enumerate(configurations):
        progress.start(index)
        command = [sys.executable, "-m", "tfmp.bench", *argv[1:], f"--precision={precision_name}", f"--remat={remat}",
                   "--in_process"]
        result = subprocess.run(command, stdout=subprocess.PIPE, text=True)
        sys.stdout.write(result.stdout)
        sys.stdout.flush()
        if result.returncode != 0:  # negative when a signal ended it (an abort, the OOM killer)
            ended = f"signal {-result.returncode}" if result.returncode < 0 else f"exit code {result.returncode}"
            print(f"tfmp.bench: error: {precision_name}, remat {remat} failed ({ended}); no measurement for it",
                  file=sys.stderr, flush=True)
            code = 1
    print(f"tfmp.bench: done in {report.clock(progress.finish())}", file=sys.stderr, flush=True)
    return code


def bf16_emulated() -> bool:
    """No bf16 units on the CPU and no GPU (device nodes; TensorFlow is not loaded in the parent process)."""
    return not hardware.cpu_has_bf16_units() and not glob.glob("/dev/nvidia[0-9]*") and not hardware.tpu_present()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
