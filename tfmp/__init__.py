"""tfmp: mixed-precision, data-parallel Keras training, with the usual failures caught.

Where things live:
    tfmp.precision   policies, `auto` from hardware, loss scaling
    tfmp.hardware    what the machine has: CPU flags, bf16 units, GPUs, TPUs
    tfmp.compilation XLA: `--jit_compile=auto|true|false` and what it compiles per strategy
    tfmp.distribute  tf.distribute strategies by name, CPU splitting, seeds
    tfmp.data        dataset sources and input pipelines
    tfmp.models      encoders and classifiers
    tfmp.optimizers  optimizers and learning-rate schedules
    tfmp.update_rules  each optimizer's step written once (LARS and the sharded step run it)
    tfmp.clipping    gradient clipping by the global norm of the replicas' summed, unscaled gradient
    tfmp.accumulation  micro-batches inside one optimizer step, gradient caching for batch-coupled losses
    tfmp.averaging   the moving average of the weights, kept beside them, evaluated and exported
    tfmp.sharding    ZeRO: optimizer state sharded across replicas, its layout, collectives and checkpoints
    tfmp.callbacks   checkpoints/resume, telemetry, TensorBoard
    tfmp.config      the config schema, each setting's check, and its flags
    tfmp.registry    plug-ins by name: tasks, SSL methods, encoders, dataset sources
    tfmp.runtime     a run's decisions made once: strategy, policy, XLA, chief, conv weight gradient
    tfmp.tf_environment  what TensorFlow reads when it loads, and its start-up lines kept off the terminal
    tfmp.logs        how tfmp's messages look, in the CLI and in library use
    tfmp.ssl         SSL methods on one two-view base, their losses, probes, the small-data guard
    tfmp.tasks       the tasks of `--task=NAME`, and what their training stages share
    tfmp.training    `run(config, workdir)`, used by the CLI `python -m tfmp.train`
    tfmp.run_directory  every path and file name of a run (config.json, checkpoints/, encoder.keras, ...)
    tfmp.workdir_lock   one run per workdir: the lock file, its holder, a stale lock taken over
    tfmp.diagnostics precision doctor, memory estimate
    tfmp.keras_internals, tfmp.upstream   private Keras hooks (fenced, version-checked) and upstream workarounds

Submodules import on first use, so `import tfmp` alone does not start TensorFlow.
"""

import importlib

from tfmp import logs as _logs

__version__ = "0.1.0"
_logs.install_library_default()  # tfmp's choices are seen once even where nobody configured logging

_SUBMODULES = ("accumulation", "averaging", "bench", "callbacks", "clipping", "compilation", "config", "data",
               "diagnostics", "distribute", "doctor", "hardware", "keras_internals", "launch", "logs", "models",
               "optimizers", "precision", "registry", "report", "run_directory", "runtime", "sharding", "ssl",
               "tasks", "tf_environment", "train", "training", "update_rules", "upstream", "workdir_lock")


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"tfmp.{name}")
    raise AttributeError(f"module 'tfmp' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_SUBMODULES))
