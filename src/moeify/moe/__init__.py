"""The shared core of every method, by concern: ``experts`` (partitions of an MLP's neurons, pure functions of
tensors, and the MoE layers built from them), ``attention`` (head-dimension importance and pruning),
``depth`` (removing decoder layers), and the measurements of a converted model: ``accounting`` (activated
parameters, as each paper counts them) and ``routing`` (where the tokens went)."""
