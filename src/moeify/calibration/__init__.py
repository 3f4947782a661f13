"""Calibration: text -> token batches, hooks that always come off, and one-layer-at-a-time streaming."""
