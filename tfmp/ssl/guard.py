"""The small-data guard: says, with numbers, when SSL pretraining is not paying off.

Three looks, each from what tfmp can know at that moment:

* before training, `check` reads the plan (unlabeled images, optimizer steps, encoder size per
  image) — the only look possible before any compute is spent;
* during pretraining, `PlateauWatch` reads the kNN monitor: when kNN accuracy has stopped
  rising while a good share of the epochs is still ahead, it says so (and with
  `--stop_on_plateau` stops pretraining there: the rest of the compute buys nothing the
  monitor can see);
* after evaluation, `verdict` compares the linear probe with the supervised baseline trained
  on the same labels: SSL that does not beat it was not worth its cost.

The thresholds come from a measured sweep over digits subsets (BUILD_NOTES.md "Small-data
guard"), not from judgement.
"""

from __future__ import annotations

import keras

from tfmp.ssl.probes import KNNMonitor

# Fewer unlabeled images than this: below the smallest set measured to pay off (SimCLR on 200 digits images,
# 1,100 steps: probe +4.4 points over the baseline; smaller sets were not measured).
MIN_UNLABELED_IMAGES = 200
# Fewer optimizer steps than this: every measured kNN curve (200 to 1,437 images) was within 0.01 of its best
# only from step ~220 on; stopping earlier stops while it still rises.
MIN_PRETRAINING_STEPS = 250
# More encoder parameters per unlabeled image than this: the encoder memorises (a judgement: the digits encoder has
# 65 per image and works; no larger ratio was measured).
MAX_PARAMETERS_PER_IMAGE = 1000
# The kNN monitor counts as plateaued when its best accuracy rose by less than this ...
PLATEAU_MIN_GAIN = 0.01
# ... over this many consecutive measurements ...
PLATEAU_MEASUREMENTS = 3
# ... with at least this share of the epochs still to run.
PLATEAU_REMAINING_SHARE = 0.25
# The linear probe must beat the supervised baseline on the same labels by this much.
MIN_PROBE_GAIN_OVER_BASELINE = 0.0


def check(num_unlabeled: int, epochs: int, global_batch_size: int, encoder_parameters: int) -> list[str]:
    """Returns one warning per threshold the planned pretraining falls short of (empty: none)."""
    warnings = []
    if num_unlabeled < MIN_UNLABELED_IMAGES:
        warnings.append(
            f"only {num_unlabeled} unlabeled images (guard: >= {MIN_UNLABELED_IMAGES}, the smallest set measured to pay off); "
            "add unlabeled data (e.g. --unlabeled_split) or compare against the supervised baseline (--compare_supervised)"
        )
    steps = epochs * (num_unlabeled // global_batch_size)
    if steps < MIN_PRETRAINING_STEPS:
        warnings.append(
            f"{steps} pretraining steps ({epochs} epochs x {num_unlabeled // global_batch_size} steps; guard: >= "
            f"{MIN_PRETRAINING_STEPS}); raise --epochs or lower --global_batch_size"
        )
    per_image = encoder_parameters / max(num_unlabeled, 1)
    if per_image > MAX_PARAMETERS_PER_IMAGE:
        warnings.append(
            f"{encoder_parameters:,} encoder parameters for {num_unlabeled} images = {per_image:,.0f} per image (guard: <= "
            f"{MAX_PARAMETERS_PER_IMAGE}); use a smaller --model or more unlabeled images"
        )
    return warnings


class PlateauWatch(keras.callbacks.Callback):
    """Watches the kNN monitor's `knn_accuracy` in the epoch logs for a plateau.

    Plateau: over the last `measurements` kNN measurements the best accuracy rose by less than
    `min_gain`, while at least `remaining_share` of the epochs are still to run. Runs after the
    kNN monitor (it reads the value the monitor wrote; `runs_after`, checked by `tfmp.callbacks.interfaces`).

    Attributes:
        plateau: None, or `{"epoch", "knn_accuracy", "epochs", "gain"}` where the plateau was seen.
        curve: `(epoch, knn_accuracy)` of every measurement this fit made.
    """

    runs_after = (KNNMonitor,)

    def __init__(self, *, stop: bool = False, min_gain: float = PLATEAU_MIN_GAIN,
                 measurements: int = PLATEAU_MEASUREMENTS, remaining_share: float = PLATEAU_REMAINING_SHARE):
        super().__init__()
        self.stop, self.min_gain, self.measurements, self.remaining_share = stop, min_gain, measurements, remaining_share
        self.curve: list[tuple[int, float]] = []
        self.plateau: dict | None = None

    def on_epoch_end(self, epoch, logs=None):
        if not logs or "knn_accuracy" not in logs:
            return
        self.curve.append((epoch + 1, float(logs["knn_accuracy"])))
        if self.plateau is not None or len(self.curve) <= self.measurements:
            return
        epochs = self.params.get("epochs", epoch + 1)
        if (epochs - (epoch + 1)) < self.remaining_share * epochs:
            return
        best_before = max(accuracy for _, accuracy in self.curve[:-self.measurements])
        best_now = max(accuracy for _, accuracy in self.curve)
        if best_now - best_before < self.min_gain:
            self.plateau = {"epoch": epoch + 1, "knn_accuracy": best_now, "epochs": epochs, "gain": best_now - best_before}
            if self.stop:
                self.model.stop_training = True

    def describe(self) -> str | None:
        if self.plateau is None:
            return None
        plateau = self.plateau
        action = "stopped there (--stop_on_plateau)" if self.stop else "the rest of pretraining bought nothing it measures " \
                 "(--stop_on_plateau stops there)"
        return (f"kNN accuracy plateaued at {plateau['knn_accuracy']:.3f} by epoch {plateau['epoch']} of {plateau['epochs']} "
                f"(+{plateau['gain']:.3f} over the last {self.measurements} measurements, guard: >= {self.min_gain}); {action}")


def verdict(metrics: dict, plateau: PlateauWatch | None = None) -> list[str]:
    """What the finished run shows: a kNN plateau, and a linear probe that failed to beat the baseline."""
    warnings = []
    if plateau is not None and plateau.describe():
        warnings.append(plateau.describe())
    probe, baseline = metrics.get("linear_probe_accuracy"), metrics.get("supervised_baseline_accuracy")
    if probe is not None and baseline is not None and probe - baseline < MIN_PROBE_GAIN_OVER_BASELINE:
        draws = len(metrics.get("linear_probe_accuracy_per_draw", [probe]))
        warnings.append(
            f"pretraining did not pay off: linear probe {probe:.3f} vs supervised baseline {baseline:.3f} on the same "
            f"{metrics.get('labeled_examples', '?')} labels (mean of {draws} draw{'s' if draws > 1 else ''}) after "
            f"{metrics.get('unlabeled_examples', '?')} unlabeled images; train the supervised model, or add unlabeled data"
        )
    return warnings
