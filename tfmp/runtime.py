"""A run's decisions, made once: `prepare(config)` returns the frozen `Runtime` every stage reads.

The strategy, the precision policy, whether and where XLA compiles, whether this process is
the chief, and the convolution weight-gradient mode are decided here, logged once with their
reasons, and passed down: tasks, stages, the bench and the doctor read them from the `Runtime`
instead of deriving them again, and layers get what concerns them as constructor arguments.
"""

from __future__ import annotations

import dataclasses
import logging

import tensorflow as tf

from tfmp import accumulation, compilation, distribute, precision
from tfmp.config import Config, UsageError
from tfmp.models import conv

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Runtime:
    """What one run decided about where and how it computes.

    Attributes:
        strategy: the `tf.distribute` strategy every model is built under.
        precision: the Keras global policy set for the run (`mixed_bfloat16`, ...).
        jit_compile: whether the steps compile with XLA (`--jit_compile` resolved here), and
            `jit_compile_reason`, why; `xla_scope`, what XLA compiles under the strategy.
        chief: whether this process writes the run's files.
        conv_weight_gradient: `--conv_weight_gradient`, given to every tfmp `Conv2D`.
    """

    strategy: tf.distribute.Strategy
    precision: str
    jit_compile: bool
    jit_compile_reason: str
    xla_scope: str
    chief: bool
    conv_weight_gradient: str = "auto"

    @property
    def num_replicas(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def keras_jit_compile(self) -> bool:
        """What `model.compile(jit_compile=...)` gets: True only where Keras compiles the whole step."""
        return compilation.for_keras(self.jit_compile, self.strategy)

    @classmethod
    def for_strategy(cls, strategy: tf.distribute.Strategy, *, jit_compile: str | bool = "auto",
                     conv_weight_gradient: str = "auto") -> "Runtime":
        """A runtime around an existing strategy and the policy in force (library code, tests, the bench)."""
        decided, reason = compilation.resolve(jit_compile, strategy.num_replicas_in_sync)
        return cls(strategy=strategy, precision=precision.global_policy_name(), jit_compile=decided, jit_compile_reason=reason,
                   xla_scope=compilation.scope(decided, strategy), chief=distribute.is_chief(strategy),
                   conv_weight_gradient=conv_weight_gradient)


def prepare(config: Config) -> Runtime:
    """Creates the strategy, sets the seed and the precision policy, and decides XLA; user errors become UsageError.

    Args:
        config: a config that passed `validate`.
    """
    try:
        # The strategy first: MultiWorkerMirroredStrategy must configure TF before anything else runs.
        hosts = config.worker_hosts.split(",") if config.worker_hosts else None
        strategy = distribute.get_strategy(config.strategy, num_cpu_devices=config.num_cpu_devices or None, tpu=config.tpu or None,
                                           worker_hosts=hosts, task_index=config.task_index)
        precision.set_policy(config.precision)
        per_replica = distribute.per_replica_batch_size(config.global_batch_size, strategy.num_replicas_in_sync)
        accumulation.check_steps(per_replica, config.gradient_accumulation_steps)
        runtime = Runtime.for_strategy(strategy, jit_compile=config.jit_compile, conv_weight_gradient=config.conv_weight_gradient)
    except (ValueError, RuntimeError) as error:
        raise UsageError(str(error)) from None
    logger.info("jit_compile: %s (%s); XLA compiles: %s", runtime.jit_compile, runtime.jit_compile_reason, runtime.xla_scope)
    if runtime.precision == precision.MIXED_BFLOAT16:
        logger.info("conv weight gradient: %s", conv.describe_weight_gradient(runtime.conv_weight_gradient))
    distribute.set_seed(config.seed)
    return runtime
