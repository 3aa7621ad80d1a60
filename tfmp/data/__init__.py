"""Data: the dataset registry and input pipelines (see `datasets.py`, `pipeline.py`)."""

from tfmp.data.datasets import DATASETS, ImageData, Split, balanced_subset, load
from tfmp.data.pipeline import classification_pipeline

__all__ = ["DATASETS", "ImageData", "Split", "balanced_subset", "load", "classification_pipeline"]
