"""Memory planner: does the run fit one device, and if not, what is the cheapest change that makes it fit?

Given a device's memory (`--device_memory=16GiB`, read by `tfmp.config.parse_memory_size`, or the GPU's own where
`nvidia-smi` reports it), the planner estimates each activation-checkpointing mode (`tfmp.diagnostics.memory`) in
the order of its cost in step time — `none`, then `blocks` (one extra forward pass of each block), then `full` — and
names the first that fits, the largest per-replica batch that fits with the run's own mode, and the fewest
micro-batches (`--gradient_accumulation_steps`, the same global batch in one optimizer step) that fit with it:
activations scale with the micro-batch, and accumulating adds two gradient sizes (the running sum and the next). A configuration
*fits* when its estimate is at most `USABLE_FRACTION` of the device: the estimate leaves out framework workspace
(cuDNN, XLA, allocator fragmentation). How close the estimate comes to the allocator's peak, and what remat costs
in step time, is measured in BUILD_NOTES.md, "Memory planner".

On several replicas of an unsharded run it also names the sharding stages that fit: `--sharding=zero1` (the optimizer
state split over the replicas: no measurable step-time cost, BUILD_NOTES.md) first when it alone makes the run fit,
and `--sharding=zero2` with the fewest micro-batches when that needs fewer than accumulating unsharded (the running
sum of the gradients split too). `--sharding=zero3` (the weights and gradients
split too) where zero1 is not enough; and where the weights, gradients and optimizer state alone do not fit, on how
many replicas zero3 would hold them.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from typing import Callable

USABLE_FRACTION = 0.75
MAX_REPLICAS_NAMED = 1024  # the most replicas a plan names for zero3
REMAT_BY_COST = ("none", "blocks", "full")


BYTE_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB")


def readable_bytes(count: int) -> str:
    """`count` bytes in the largest binary unit that keeps the figure at least 1 (three significant digits)."""
    value, unit = float(count), 0
    while abs(value) >= 1024 and unit < len(BYTE_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{int(value)} bytes" if unit == 0 else f"{value:.3g} {BYTE_UNITS[unit]}"


def gpu_memory_bytes() -> int | None:
    """The first GPU's memory as `nvidia-smi` reports it; None without one. Untested here (no GPU): BUILD_NOTES."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=20, check=True)
        return int(result.stdout.split()[0]) * 2 ** 20  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


@dataclasses.dataclass(frozen=True)
class Plan:
    """What fits in `device_bytes`: the run's own estimate, every remat mode's, and the verdict."""

    device_bytes: int
    remat: str
    per_replica_batch: int
    totals: dict[str, int]  # remat mode -> estimated bytes per replica at the run's batch (the modes `plan` needed)
    state_bytes: int  # weights + gradients + optimizer state: what no remat mode changes
    largest_batch: int  # the largest per-replica batch that fits with the run's own remat mode (0: none)
    zero1_state_bytes: int = 0  # the state with the optimizer's sharded over the replicas (`--sharding=zero1`)
    accumulation_steps: int = 1  # the run's `--gradient_accumulation_steps`
    accumulation_totals: dict[int, int] = dataclasses.field(default_factory=dict)  # steps -> bytes, the run's remat mode
    replicas: int = 1  # replicas an unsharded run could shard over (1: already sharded, or one replica)
    zero1_total: int = 0  # the run's total with --sharding=zero1 (0: not offered)
    zero2_accumulation_totals: dict[int, int] = dataclasses.field(default_factory=dict)  # steps -> bytes under zero2
    zero3_total: int = 0  # the run's total with --sharding=zero3 on its replicas (0: not offered)
    zero3_replicas: int = 0  # the fewest replicas whose zero3 state (weights, gradients, optimizer) fits (0: none)

    @property
    def smallest_fitting_accumulation(self) -> int:
        """The fewest micro-batches that fit with the run's remat mode (0: none does, even one example each)."""
        return next((steps for steps, total in sorted(self.accumulation_totals.items()) if total <= self.usable_bytes), 0)

    @property
    def usable_bytes(self) -> int:
        return int(self.device_bytes * USABLE_FRACTION)

    @property
    def fits(self) -> bool:
        return self.totals[self.remat] <= self.usable_bytes

    @property
    def cheapest_fitting(self) -> str | None:
        """The cheapest remat mode that fits at the run's batch (None: none does)."""
        return next((mode for mode in REMAT_BY_COST if mode in self.totals and self.totals[mode] <= self.usable_bytes), None)

    def summary(self) -> str:
        """One line: fits, or what would."""
        budget = f"{readable_bytes(self.usable_bytes)} usable of {readable_bytes(self.device_bytes)}"
        own = f"--remat={self.remat} at {self.per_replica_batch} images/replica: {readable_bytes(self.totals[self.remat])}"
        if self.fits:
            cheaper = self.cheapest_fitting
            hint = f"; --remat={cheaper} also fits ({readable_bytes(self.totals[cheaper])}) and is faster" if (
                REMAT_BY_COST.index(cheaper) < REMAT_BY_COST.index(self.remat)) else ""
            steps = self.smallest_fitting_accumulation
            if steps < self.accumulation_steps:
                hint += (f"; --gradient_accumulation_steps={steps} also fits "
                         f"({readable_bytes(self.accumulation_totals[steps])}) and is faster")
            return f"memory plan: fits: {own} ({budget}){hint}"
        if self.state_bytes > self.usable_bytes:
            if self.zero3_total and self.zero3_total <= self.usable_bytes:
                needs = (f"; needs --sharding=zero3 ({readable_bytes(self.zero3_total)}, weights, gradients and optimizer "
                         f"state split over {self.replicas} replicas)")
            elif self.zero3_replicas:
                needs = (f"; needs --sharding=zero3 on at least {self.zero3_replicas} replicas for the state alone "
                         f"(then add --remat or smaller batches as the activations need)")
            else:
                needs = "; too large even split over every replica: a smaller model"
            return (f"memory plan: does not fit: weights, gradients and optimizer state alone take {readable_bytes(self.state_bytes)} "
                    f"({budget}){needs}")
        cheaper = self.cheapest_fitting
        options = []
        if self.zero1_total and self.zero1_total <= self.usable_bytes:  # no extra compute: named first
            options.append(f"--sharding=zero1 ({readable_bytes(self.zero1_total)}, the optimizer state split over "
                           f"{self.replicas} replicas)")
        if cheaper:
            options.append(f"--remat={cheaper} ({readable_bytes(self.totals[cheaper])})")
        steps = self.smallest_fitting_accumulation
        if steps:
            options.append(f"--gradient_accumulation_steps={steps} with --remat={self.remat} "
                           f"({readable_bytes(self.accumulation_totals[steps])}, the same global batch)")
        sharded_steps = next((count for count, total in sorted(self.zero2_accumulation_totals.items())
                              if total <= self.usable_bytes), 0)
        if sharded_steps > 1 and (not steps or sharded_steps < steps):
            options.append(f"--sharding=zero2 with --gradient_accumulation_steps={sharded_steps} "
                           f"({readable_bytes(self.zero2_accumulation_totals[sharded_steps])})")
        if self.zero3_total and self.zero3_total <= self.usable_bytes and not (self.zero1_total and self.zero1_total <= self.usable_bytes):
            options.append(f"--sharding=zero3 ({readable_bytes(self.zero3_total)}, weights, gradients and optimizer state "
                           f"split over {self.replicas} replicas)")
        if self.largest_batch:
            options.append(f"at most {self.largest_batch} images/replica with --remat={self.remat}")
        return f"memory plan: does not fit: {own} ({budget}); needs {' or '.join(options) or 'a smaller model'}"


def plan(estimate: Callable[[str], object], device_bytes: int, remat: str, per_replica_batch: int, replicas: int = 1,
         accumulation_steps: int = 1) -> Plan:
    """Plans from `estimate(remat_mode) -> MemoryEstimate` (built at the run's per-replica batch, sharding and
    micro-batches).

    Each estimate builds and traces the model, so modes are estimated only as far as the verdict needs: the run's
    own, then in order of cost until one fits (none when the state alone does not fit). Micro-batch counts are
    scaled from the run's own estimate: every divisor of the per-replica batch from the run's count up."""
    own = estimate(remat)
    totals = {remat: own.total_bytes}
    state = own.params_bytes + own.gradients_bytes + own.optimizer_bytes
    usable = int(device_bytes * USABLE_FRACTION)
    if state <= usable:
        for mode in REMAT_BY_COST:
            if mode not in totals:
                totals[mode] = estimate(mode).total_bytes
            if totals[mode] <= usable:
                break
    micro_batch = max(per_replica_batch // accumulation_steps, 1)
    per_example = own.activations_bytes / micro_batch  # the fixed part counted per example too: errs on the safe side
    # The running sum and the next, with more than one micro-batch (each replica's chunks under zero2).
    accumulator = 2 * -(-own.gradients_bytes // own.gradient_shards)
    room = usable - state - (accumulator if accumulation_steps > 1 else 0)
    largest = int(room // per_example) * accumulation_steps if per_example and room > 0 else 0
    saved_state = own.optimizer_bytes - -(-own.optimizer_bytes // replicas)  # what zero1 and zero2 leave out
    zero1_state = state - saved_state
    # Other micro-batch counts from the run's estimate: its per-example activations scaled, the fixed part kept.
    fixed = own.fixed_activations_bytes
    per_micro_example = (own.activations_bytes - fixed) / micro_batch
    without_activations = own.total_bytes - own.activations_bytes - own.accumulator_bytes
    accumulation_totals = {steps: without_activations + (accumulator if steps > 1 else 0) + fixed
                           + int(per_micro_example * per_replica_batch / steps)
                           for steps in range(1, per_replica_batch + 1) if per_replica_batch % steps == 0}
    sharded_accumulator = 2 * -(-own.gradients_bytes // replicas)
    zero2_totals = {steps: total - saved_state - (accumulator - sharded_accumulator if steps > 1 else 0)
                    for steps, total in accumulation_totals.items()} if replicas > 1 else {}
    # zero3: the trainable weights and their gradients split too; in float32 the gathered weights a backward pass
    # needs are held until it runs (under a mixed policy the 16-bit copies are counted already: `estimate_memory`).
    trainable = own.gradients_bytes
    gathered = trainable if own.precision == "float32" else 0
    zero3_total = (own.total_bytes - saved_state - 2 * (trainable - -(-trainable // replicas)) + gathered) if replicas > 1 else 0
    non_trainable = own.params_bytes - trainable
    zero3_replicas = next((count for count in range(2, MAX_REPLICAS_NAMED + 1)
                           if non_trainable + 2 * -(-trainable // count) + -(-own.optimizer_bytes // count) <= usable), 0)
    return Plan(device_bytes, remat, per_replica_batch, totals, state, max(0, largest), zero1_state, accumulation_steps,
                accumulation_totals, replicas, own.total_bytes - saved_state if replicas > 1 else 0, zero2_totals,
                zero3_total, zero3_replicas)
