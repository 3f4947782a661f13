"""Inference-time modules, self-contained (torch + transformers) and copied next to exported models."""
