"""The shared core of every method: partitions (pure functions of tensors), building MoE layers from them,
channel and head-dimension importance, depth changes and activated-parameter accounting."""
