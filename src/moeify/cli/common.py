"""Arguments several subcommands share."""

from __future__ import annotations

import argparse

DTYPE_CHOICES = ("float32", "bfloat16", "float16")


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype``: where the model runs and in which floating type."""
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="work device (default cpu)")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                        help="working dtype of the weights (default: the checkpoint's own; float32 for GGUF); "
                             "statistics accumulate in float32 whatever it is, and outputs are saved in it")


def add_layer_by_layer_argument(parser: argparse.ArgumentParser) -> None:
    """``--layer-by-layer``: hold the model one decoder layer at a time (models larger than memory)."""
    parser.add_argument("--layer-by-layer", action="store_true",
                        help="for models larger than memory: read the weights from the checkpoint's safetensors "
                             "files one decoder layer at a time, write each converted layer as it is done, and "
                             "compute both perplexities layer by layer; peak memory about the embeddings, one "
                             "layer and the activations (training-free methods without fine-tune; a local "
                             "safetensors checkpoint; no speed measurement)")
