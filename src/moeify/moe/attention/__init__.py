"""Attention narrowed by head dimension: which q/k (RoPE pairs) and v/o dimensions matter, measured on
calibration tokens, and the pruned attention module that keeps them."""
