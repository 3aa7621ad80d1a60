"""Data: the dataset registry, input pipelines and SimCLR augmentations (`datasets.py`, `pipeline.py`, `augment.py`)."""

from tfmp.data import augment, datasets, pipeline
from tfmp.data.datasets import DATASETS, ImageData, Split, balanced_subset, load
from tfmp.data.pipeline import classification_pipeline

__all__ = ["augment", "datasets", "pipeline", "DATASETS", "ImageData", "Split", "balanced_subset", "load", "classification_pipeline"]
