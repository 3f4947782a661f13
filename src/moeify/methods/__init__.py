"""The registry of conversion methods: every method listed once, with its paper. A method is a package
here (``methods/<name>/``) that owns everything about it; registering it is one line in ``METHODS``."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from moeify.methods.base import Analysis, Conversion, ConversionContext, Method
from moeify.methods.cmoe import CMOE
from moeify.methods.dense2moe import DENSE2MOE
from moeify.methods.dsmoe import DSMOE
from moeify.methods.more import MORE
from moeify.methods.random_split import RANDOM_SPLIT
from moeify.methods.static_prune import STATIC_PRUNE
from moeify.methods.teal import TEAL
from moeify.methods.teal.config import ATTENTION_KEYS, AttentionSparsityOptions, attention_options
from moeify.methods.teal.memory import attention_memory
from moeify.methods.tomoe import TOMOE
from moeify.options import OptionError, build_config
from moeify.training.recovery_options import RecoveryOptions, split_recovery_options

METHODS: tuple[Method, ...] = (CMOE, MORE, TOMOE, DSMOE, DENSE2MOE, STATIC_PRUNE, RANDOM_SPLIT, TEAL)  # baselines last
DEFAULT_METHOD = METHODS[0].name


def get_method(name: str) -> Method:
    for method in METHODS:
        if method.name == name:
            return method
    raise ValueError(f"unknown method {name!r}; available: {', '.join(m.name for m in METHODS)}")


def method_configs(name: str, options: dict[str, Any] | None
                   ) -> tuple[Method, Any, RecoveryOptions, AttentionSparsityOptions]:
    """The method ``name``, its config, the recovery's and the attention thresholds' from one ``--set``
    dictionary, validated; it imports nothing heavy, so a command refuses a bad option at once."""
    method = get_method(name)
    method_options, recovery_options = split_recovery_options(options or {})
    config = build_config(method.config_cls, {k: v for k, v in method_options.items() if k not in ATTENTION_KEYS})
    attention = attention_options(method_options)
    if attention.enabled and not method.keeps_attention(config):
        fix = " (attention=off keeps it whole)" if "attention" in {f.name for f in fields(config)} else ""
        raise OptionError(f"attention_sparsity={attention.attention_sparsity}: {name} prunes or thresholds the "
                          f"attention itself with these options{fix}; attention_sparsity thresholds a whole one")
    return method, config, build_config(RecoveryOptions, recovery_options), attention


__all__ = ["DEFAULT_METHOD", "METHODS", "Analysis", "AttentionSparsityOptions", "Conversion", "ConversionContext",
           "Method", "attention_memory", "get_method", "method_configs"]
