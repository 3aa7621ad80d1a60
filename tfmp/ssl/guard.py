"""The small-data guard: says, with numbers, when SSL pretraining is unlikely to pay off.

Self-supervised pretraining earns its cost when there are many more unlabeled
images than labels, enough optimisation steps to learn invariances, and an encoder
the unlabeled set can constrain. Below these thresholds a supervised model (or a
smaller encoder, or more data) is the better use of the time. The thresholds and the
measurements behind them are in BUILD_NOTES.md ("Small-data guard").
"""

from __future__ import annotations

# Fewer unlabeled images than this: too few distinct negatives and views to learn from.
MIN_UNLABELED_IMAGES = 1000
# Fewer optimizer steps than this: the contrastive task is not learned yet.
MIN_PRETRAINING_STEPS = 500
# More encoder parameters per unlabeled image than this: the encoder memorises.
MAX_PARAMETERS_PER_IMAGE = 1000


def check(num_unlabeled: int, epochs: int, global_batch_size: int, encoder_parameters: int) -> list[str]:
    """Returns one warning per threshold the planned pretraining falls short of (empty: none)."""
    warnings = []
    if num_unlabeled < MIN_UNLABELED_IMAGES:
        warnings.append(
            f"only {num_unlabeled} unlabeled images (guard: >= {MIN_UNLABELED_IMAGES}); add unlabeled data "
            "(e.g. --unlabeled_split) or compare against the supervised baseline (--compare_supervised)"
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
