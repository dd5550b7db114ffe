"""Offline prediction: the service's answers for a folder, a CSV or a million files (``capserve predict``), and the
``Predictor`` behind it (also a Ray Data callable class)."""

from capserve.predict.predictor import Predictor

__all__ = ["Predictor"]
