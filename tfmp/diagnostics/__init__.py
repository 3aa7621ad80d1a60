"""Diagnostics: the precision doctor (`precision_doctor.py`)."""

from tfmp.diagnostics.precision_doctor import LayerStats, PrecisionReport, precision_report

__all__ = ["LayerStats", "PrecisionReport", "precision_report"]
