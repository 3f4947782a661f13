"""A converted model's parameters by part, for a recovery that trains the parts a user picks.

Parts (``PARTS``): ``routers`` (every MoE layer's router), ``experts`` (the routed experts' weights),
``shared`` (what every token runs of an MLP: an MoE layer's shared part and output bias, and the MLPs a
conversion left dense), ``attention`` (each decoder layer's attention module, whatever it became) and
``norms`` (every other parameter of the decoder: layer norms and the final norm). The embeddings and the
output head are never trained: the teacher of a distillation reads its logits through the same head.

The part of a parameter follows from where it sits (``arch.DecoderAdapter`` paths), so any family and any
method's layers are covered: a parameter inside layer i's MLP slot is ``routers``/``experts``/``shared`` by
its place in the ``MoeMLP`` (or ``shared`` in a dense MLP), inside its attention slot ``attention``.
"""

from __future__ import annotations

from torch import nn

from moeify.arch import DecoderAdapter
from moeify.runtime.experts import SharedNeuronExperts
from moeify.runtime.moe import MoeMLP
from moeify.runtime.sparse_inputs import ThresholdedLinear
from moeify.training.recovery_options import PARTS

LINEAR_PARTS = ("experts", "shared", "attention")  # the parts whose projections an adapter (LoRA) can wrap

def _mlp_part(layer: nn.Module, name: str) -> str:
    """The part of parameter ``name`` (relative to layer i's MLP slot)."""
    if not isinstance(layer, MoeMLP):
        return "shared"
    head = name.split(".", 1)[0]
    return {"router": "routers", "experts": "experts"}.get(head, "shared")


def parameter_parts(model: nn.Module) -> dict[str, dict[str, nn.Parameter]]:
    """Part -> {full name: parameter} for every trainable-by-recovery parameter of ``model`` (tied
    parameters once, under their first name; embeddings and output head left out)."""
    adapter = DecoderAdapter(model)
    frozen = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
              for p in m.parameters()}
    slots: dict[str, tuple[str, nn.Module]] = {}  # module path -> (kind, module)
    for i in range(adapter.num_layers):
        slots[adapter.mlp_path(i)] = ("mlp", adapter.mlp_module(i))
        slots[adapter.mlp_path(i).rsplit(".", 1)[0] + "." + adapter.family.attn_attr] = ("attention", None)
    parts: dict[str, dict[str, nn.Parameter]] = {part: {} for part in PARTS}
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if id(param) in frozen or id(param) in seen:
            continue
        seen.add(id(param))
        part = "norms"
        for path, (kind, module) in slots.items():
            if name.startswith(path + "."):
                part = "attention" if kind == "attention" else _mlp_part(module, name[len(path) + 1:])
                break
        parts[part][name] = param
    return parts


def lora_targets(model: nn.Module, parts: tuple[str, ...]) -> list[str]:
    """Full names of the ``nn.Linear`` projections of ``parts`` (among ``LINEAR_PARTS``) that LoRA wraps.
    Refused where an adapter's output would not be what the layer computes: experts stored once (gathered
    by rows, not run as modules) and thresholded inputs (the adapter would read the unthresholded input)."""
    chosen = {name.rsplit(".", 1)[0] for part, params in parameter_parts(model).items()
              if part in parts and part in LINEAR_PARTS for name in params}
    targets = []
    for name, module in model.named_modules():
        if name not in chosen or not isinstance(module, nn.Linear):
            continue
        if isinstance(module, ThresholdedLinear):
            raise ValueError(f"{name} thresholds its inputs (TEAL): a LoRA adapter would read them unthresholded; "
                             "train its weights directly (recover_lora_rank=0)")
        targets.append(name)
    shared_neurons = [name for name, module in model.named_modules() if isinstance(module, SharedNeuronExperts)]
    if "experts" in parts and shared_neurons:
        raise ValueError(f"{shared_neurons[0]} stores overlapping experts once and runs them by gathered rows, "
                         "which a LoRA adapter does not see: train them directly (recover_lora_rank=0) or leave "
                         "experts out of recover_parts")
    return targets
