"""Which replica holds what: every variable cut into equal chunks, one per replica (FSDP's flat sharding).

Replica r holds elements `[r * chunk, (r + 1) * chunk)` of each variable, flattened (the last chunk padded with
zeros when the size is not a multiple of the replica count). Equal chunks make every collective balanced: a
bucket's gradients are reduced to their holders with one reduce-scatter of N equal parts, and its updated weights
come back with one all-gather — the same shape that gathers a unit's weights for ZeRO-3. Per-layer rules (LARS'
trust ratio) need whole-variable norms: the step sums each chunk's squares across replicas (one small all-reduce per
bucket).

Variables are taken in buckets of at most `BUCKET_BYTES` of float32 gradients (a larger variable alone), so no
collective and no packed copy holds more than one bucket, and the step takes one bucket after another (the sharded
optimizer orders each after the one before): its transient memory is bounded by a bucket, not by the model.
"""

from __future__ import annotations

import dataclasses
import functools

BUCKET_BYTES = 32 * 2**20


@dataclasses.dataclass(frozen=True)
class Layout:
    """The chunks of variables of `sizes` elements over `replicas` replicas."""

    sizes: tuple[int, ...]
    replicas: int
    bucket_bytes: int = BUCKET_BYTES

    @functools.cached_property
    def chunks(self) -> tuple[int, ...]:
        """Elements of each variable a replica holds (the chunk length, padding included)."""
        return tuple(-(-size // self.replicas) for size in self.sizes)

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """Where each variable's chunk starts when a replica's chunks are laid end to end (a bucket packed for one
        collective, the whole state gathered)."""
        offsets, total = [], 0
        for chunk in self.chunks:
            offsets.append(total)
            total += chunk
        return tuple(offsets)

    @property
    def elements(self) -> int:
        """Elements a replica holds of every variable: its chunks end to end."""
        return sum(self.chunks)

    @functools.cached_property
    def buckets(self) -> tuple[tuple[int, ...], ...]:
        """Variable indices in order, cut where a bucket would exceed `bucket_bytes` of float32 gradients."""
        buckets, current, size = [], [], 0
        for index, elements in enumerate(self.sizes):
            if current and size + elements * 4 > self.bucket_bytes:
                buckets.append(tuple(current))
                current, size = [], 0
            current.append(index)
            size += elements * 4
        return tuple(buckets + ([tuple(current)] if current else []))

    def held_range(self, index: int, replica: int) -> tuple[int, int]:
        """The elements `[start, stop)` of variable `index` (flattened) that `replica` holds, padding excluded
        (empty when the variable has fewer elements than replicas)."""
        chunk, size = self.chunks[index], self.sizes[index]
        return min(replica * chunk, size), min((replica + 1) * chunk, size)
