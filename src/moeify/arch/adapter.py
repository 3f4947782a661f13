"""A loaded decoder-only model seen through its ``FamilySpec``: layers, MLPs and attention projections.

Methods above this layer (splitting, routing, parameter accounting) only talk to ``DecoderAdapter`` and
``MlpWeights``, so they never need to know that GPT-NeoX calls its MLP input projection ``dense_h_to_4h``
or that Phi-3 fuses gate and up into one matrix.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.activations import ACT2FN

from moeify.arch.families import FamilySpec, family_for
from moeify.arch.mlp import MlpWeights


class NotDenseMlpError(TypeError):
    """The MLP of a layer is not (any more) the family's dense MLP, e.g. it was replaced by an MoE layer."""


class DecoderAdapter:
    """Family-independent access to the decoder layers of ``model`` (a ``PreTrainedModel``).

    Works on the causal-LM model (``LlamaForCausalLM``, layers at ``model.layers``) and on the bare base
    model (``LlamaModel``, layers at ``layers``): the base-model prefix is dropped when the full path
    does not resolve. Raises ``UnsupportedFamilyError`` for families moeify does not know.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.config: PretrainedConfig = model.config
        self.family: FamilySpec = family_for(self.config)
        self._layers_path, self._layers = self._find_layers()

    def _find_layers(self) -> tuple[str, nn.ModuleList]:
        path = self.family.layers_path
        candidates = [path]
        prefix = getattr(self.model, "base_model_prefix", "")
        if prefix and path.startswith(prefix + "."):
            candidates.append(path[len(prefix) + 1 :])
        for candidate in candidates:
            try:
                layers = self.model.get_submodule(candidate)
            except AttributeError:
                continue
            if not isinstance(layers, nn.ModuleList):
                kind = type(layers).__name__
                raise TypeError(f"{candidate} of {type(self.model).__name__} is {kind}, not a ModuleList")
            return candidate, layers
        raise AttributeError(
            f"{type(self.model).__name__} ({self.family.name}) has no decoder layer list at {' or '.join(candidates)}"
        )

    # ---------------------------------------------------------------- layers

    @property
    def layers_path(self) -> str:
        """Dotted path of the decoder layer list from the model root, e.g. ``model.layers``."""
        return self._layers_path

    @property
    def layers(self) -> nn.ModuleList:
        return self._layers

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def layer(self, i: int) -> nn.Module:
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} out of range: the model has {self.num_layers} decoder layers")
        return self._layers[i]

    def uses_parallel_residual(self) -> bool:
        """Whether attention and MLP read the same layer input (GPT-NeoX by config, Phi always)."""
        return self.family.uses_parallel_residual(self.config)

    # ---------------------------------------------------------------- MLP

    def mlp_path(self, i: int) -> str:
        """Dotted path of layer ``i``'s MLP from the model root, e.g. ``model.layers.3.mlp``."""
        self.layer(i)
        return f"{self._layers_path}.{i}.{self.family.mlp_attr}"

    def mlp_module(self, i: int) -> nn.Module:
        """Whatever module sits in layer ``i``'s MLP slot now: the dense MLP or its replacement."""
        return getattr(self.layer(i), self.family.mlp_attr)

    def is_dense_mlp(self, i: int) -> bool:
        """True while layer ``i``'s MLP still has the family's dense projections as ``nn.Linear``."""
        module = self.mlp_module(i)
        return all(isinstance(getattr(module, n, None), nn.Linear) for n in self.family.mlp_linear_attrs)

    def mlp(self, i: int) -> MlpWeights:
        """The dense MLP of layer ``i`` as ``MlpWeights`` (detached views that share the parameters' storage).

        Phi-3's fused ``gate_up_proj`` is split into gate (first half of the rows) and up (second half),
        matching ``gate_up_proj(x).chunk(2, -1)``. The activation name is the one the MLP was built from
        (``config.hidden_act``), checked against the module's activation so ``ACT2FN[act]`` reproduces it.
        """
        if not self.is_dense_mlp(i):
            module = self.mlp_module(i)
            raise NotDenseMlpError(
                f"{self.mlp_path(i)} is {type(module).__name__}, not a dense {self.family.name} MLP with "
                f"nn.Linear {', '.join(self.family.mlp_linear_attrs)}; was it already replaced?"
            )
        fam = self.family
        module = self.mlp_module(i)
        lin = lambda name: getattr(module, name)  # noqa: E731
        view = lambda t: None if t is None else t.detach()  # noqa: E731

        down: nn.Linear = lin(fam.down_proj)
        gate_w = gate_b = None
        if fam.mlp_kind == "fused_gated":
            fused: nn.Linear = lin(fam.gate_up_proj)
            gate_w, up_w = fused.weight.detach().chunk(2, dim=0)
            gate_b, up_b = (None, None) if fused.bias is None else fused.bias.detach().chunk(2, dim=0)
        else:
            up: nn.Linear = lin(fam.up_proj)
            up_w, up_b = up.weight.detach(), view(up.bias)
            if fam.mlp_kind == "gated":
                gate: nn.Linear = lin(fam.gate_proj)
                gate_w, gate_b = gate.weight.detach(), view(gate.bias)

        return MlpWeights(
            up=up_w,
            down=down.weight.detach(),
            act=self._activation_name(i, module),
            gate=gate_w,
            up_bias=up_b,
            gate_bias=gate_b,
            down_bias=view(down.bias),
        )

    def _activation_name(self, i: int, module: nn.Module) -> str:
        # The MLP's own config (LLaMA, Phi, Phi-3 keep one) wins over the model's: it is what built the module.
        config = getattr(module, "config", None)
        if config is None:
            config = self.config
        key = self.family.act_config_key
        name = getattr(config, key, None)
        if not isinstance(name, str) or name not in ACT2FN:
            raise ValueError(f"{self.mlp_path(i)}: config.{key} = {name!r} is not a transformers ACT2FN key")
        # Guard against an activation swapped after construction (or one with trained parameters):
        # MlpWeights can only rebuild ACT2FN[name], so it must match the module's activation exactly.
        module_act = getattr(module, self.family.act_attr, None)
        if module_act is not None:
            ref = module.get_submodule(self.family.down_proj).weight
            device = torch.device("cpu") if ref.is_meta else ref.device  # a layer not read yet (moeify.offload)
            probe = torch.linspace(-8.0, 8.0, 257, device=device, dtype=ref.dtype)
            with torch.no_grad():
                fresh = ACT2FN[name].to(device=device, dtype=ref.dtype)
                if not torch.equal(fresh(probe), module_act(probe)):
                    raise ValueError(
                        f"{self.mlp_path(i)}.{self.family.act_attr} does not compute ACT2FN[{name!r}] "
                        f"(config.{key}); moeify cannot represent this activation"
                    )
        return name

    def replace_mlp_(self, i: int, module: nn.Module) -> None:
        """Put ``module`` in layer ``i``'s MLP slot; it is called exactly like the dense MLP, ``module(x)``."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"replacement for {self.mlp_path(i)} must be an nn.Module, got {type(module).__name__}")
        setattr(self.layer(i), self.family.mlp_attr, module)

    def dense_mlp_params(self, i: int) -> int:
        """Parameters of layer ``i``'s dense MLP projections (only while it is dense)."""
        return self.mlp(i).num_params

    # ---------------------------------------------------------------- attention

    def attention_module(self, i: int) -> nn.Module:
        return getattr(self.layer(i), self.family.attn_attr)

    def replace_attention_(self, i: int, module: nn.Module) -> None:
        """Put ``module`` in place of layer ``i``'s attention (e.g. a ``PrunedAttention``)."""
        setattr(self.layer(i), self.family.attn_attr, module)

    def attention_projections(self, i: int) -> dict[str, nn.Linear]:
        """Role -> projection: ``{"q", "k", "v", "o"}`` or, for fused input projections, ``{"qkv", "o"}``."""
        attn = self.attention_module(i)
        out: dict[str, nn.Linear] = {}
        for role, attr in self.family.attn_projections:
            proj = getattr(attn, attr, None)
            if not isinstance(proj, nn.Linear):
                raise TypeError(f"{self.layers_path}.{i}.{self.family.attn_attr}.{attr} is not an nn.Linear")
            out[role] = proj
        return out

    def attention_params(self, i: int) -> int:
        """P_attn of MoRE Eq. 16: weights and biases of layer ``i``'s attention projections.

        Norms inside attention (Qwen3 q_norm/k_norm, Phi qk_layernorm) are not projections and not counted.
        """
        return sum(p.numel() for proj in self.attention_projections(i).values() for p in proj.parameters())

    # ---------------------------------------------------------------- depth

    def mlp_norm_module(self, i: int) -> nn.Module:
        """The norm in front of layer ``i``'s MLP (in parallel-residual families, the norm the attention
        shares). Its input is the residual-stream vector the MLP branch reads (h of Dense2MoE Eq. 3). An
        ``nn.Identity`` where there is none (OLMo-2 normalises the MLP's output instead)."""
        if self.family.mlp_norm_attr is None:
            return nn.Identity()
        return getattr(self.layer(i), self.family.mlp_norm_attr)

    def mlp_input_module(self, i: int) -> nn.Module:
        """The first module of layer ``i`` that reads h: its MLP norm, or the MLP where there is none."""
        return self.mlp_module(i) if self.family.mlp_norm_attr is None else self.mlp_norm_module(i)

    def mlp_norm_affine(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(gamma, bias or None) of that norm's elementwise affine, detached: the effective gamma the
        normalised input is multiplied by (Gemma's RMSNorm stores w and computes x * (1 + w))."""
        if self.family.mlp_norm_attr is None:
            return torch.ones(self.config.hidden_size), None
        norm = self.mlp_norm_module(i)
        weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"{self.layers_path}.{i}.{self.family.mlp_norm_attr} has no affine weight")
        offset = self.family.norm_weight_offset
        gamma = weight.detach() + offset if offset else weight.detach()
        return gamma, None if bias is None else bias.detach()

    def remove_layers_(self, indices: list[int]) -> None:
        """Delete the decoder layers ``indices`` (a removed layer's attention and MLP go with it) and keep
        the model a plain, shorter model of its family: every remaining layer's ``layer_idx`` (its KV-cache
        slot, in the attention and wherever transformers keeps one) becomes its new position,
        ``config.num_hidden_layers`` the new count and per-layer config lists (``layer_types``) lose the
        removed entries. ``generate`` with a ``DynamicCache`` (sized from the config) and a save/reload
        then need nothing else. Heterogeneous configs (``per_layer_config``) are refused."""
        if getattr(self.config, "is_heterogeneous", False):
            raise ValueError("removing layers of a model with a per_layer_config is not supported")
        doomed = set(indices)
        for i in doomed:
            self.layer(i)  # range check before anything changes
        for i in sorted(doomed, reverse=True):
            del self._layers[i]  # ModuleList renumbers its keys: the checkpoint names stay contiguous
        for position, layer in enumerate(self._layers):
            for module in layer.modules():
                if hasattr(module, "layer_idx"):
                    module.layer_idx = position
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types is not None:
            self.config.layer_types = [t for i, t in enumerate(layer_types) if i not in doomed]
        self.config.num_hidden_layers = len(self._layers)
