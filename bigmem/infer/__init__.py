"""Using a trained model: whole-volume and sliding-window prediction, the source geometry, evaluation."""
