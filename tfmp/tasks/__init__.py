"""The tasks of `python -m tfmp.train --task=NAME`, one registry and one module per kind of task.

    stage.py       what every training stage shares: `fit_stage` (fit with tfmp's callbacks and
                   collect the results), input checks, the synchronized-BatchNorm rule
    supervised.py  `supervised`, and the classifier stage fine-tuning and the baseline reuse
    pretrain.py    `simclr`, `byol`, `vicreg`, `barlow_twins`, `mocov3` (`tfmp.ssl.METHODS`)
    evaluation.py  label draws, probes over them, `linear_eval`, `finetune`

`TASKS[name]` is a `Task`: `check_inputs(config, data)` runs before anything is written (every
error a user's input can cause is raised there), then `run(config, data, strategy, directory,
extra_callbacks, progress)` returns the task's metrics, announcing its `phases(config)` as it goes
(`tfmp.report.Phases`). Adding a task is a module and an entry here.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from tfmp import ssl
from tfmp.config import SSL_METHODS, TASKS as TASK_NAMES
from tfmp.tasks import evaluation, pretrain, supervised
from tfmp.tasks.stage import TrainingFailed


@dataclasses.dataclass(frozen=True)
class Task:
    run: Callable[..., dict]  # (config, data, strategy, directory, extra_callbacks, progress) -> metrics
    check_inputs: Callable[..., None]  # (config, data); raises UsageError
    phases: Callable[..., list]  # (config) -> the `tfmp.report.Phase`s `run` announces, in order
    views: int = 1  # images per example in a step (two for the SSL methods; the memory estimate uses it)


TASKS = {
    "supervised": Task(supervised.run, supervised.check_inputs, supervised.phases),
    **{name: Task(pretrain.run, pretrain.check_inputs, pretrain.phases, views=2) for name in ssl.METHODS},
    "linear_eval": Task(evaluation.linear_eval, evaluation.check_encoder_inputs, evaluation.phases),
    "finetune": Task(evaluation.finetune, evaluation.check_encoder_inputs, evaluation.phases),
}
assert set(TASKS) == set(TASK_NAMES) and tuple(ssl.METHODS) == SSL_METHODS, "tfmp.config must list exactly the tasks registered here"

__all__ = ["TASKS", "Task", "TrainingFailed", "evaluation", "pretrain", "supervised"]
