"""The tasks of `python -m tfmp.train --task=NAME`, one module per kind of task.

    stage.py       what every training stage shares: `fit_stage` (fit with tfmp's callbacks and
                   collect the results), input checks, the synchronized-BatchNorm rule
    supervised.py  `supervised`, and the classifier stage fine-tuning and the baseline reuse
    pretrain.py    pretraining with any SSL method of `tfmp.registry.SSL_METHODS`
    evaluation.py  label draws, probes over them, `linear_eval`, `finetune`

Each module defines a `Task`, registered by name in `tfmp.registry`. `check_inputs(config, data)`
runs before anything is written (every error a user's input can cause is raised there), then
`run(config, data, runtime, directory, extra_callbacks, progress)` returns the task's metrics,
announcing its `phases(config)` as it goes (`tfmp.report.Phases`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from tfmp import registry
from tfmp.tasks.stage import TrainingFailed


@dataclasses.dataclass(frozen=True)
class Task:
    run: Callable[..., dict]  # (config, data, runtime, directory, extra_callbacks, progress) -> metrics
    check_inputs: Callable[..., None]  # (config, data); raises UsageError
    phases: Callable[..., list]  # (config) -> the `tfmp.report.Phase`s `run` announces, in order
    # (config, image shape) -> full-size images per example in a step, for the memory estimate (a pretraining
    # task asks its method: two views, or DINO's crops by their pixels)
    views: Callable[..., float] = lambda config, image_shape: 1.0


def get(name: str) -> Task:
    """The task `--task=name` runs (every SSL method's name gives the pretraining task)."""
    return registry.task_entry(name).load()


__all__ = ["Task", "TrainingFailed", "get"]
