"""The packed layout an MoE layer runs at inference: every expert's gate and up rows stacked in one
(E, 2W, d) tensor zero-padded to one aligned width W, down projections (E, d, W), one grouped matmul per
projection over the tokens sorted by expert, the shared part padded to an aligned width S. This is how
transformers 5 and serving engines hold MoE experts, so a ``moeify export`` of the model computes the
same float32 sums. Part of the runtime copied into every converted folder (imports torch only)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from .few_pairs import applies as kernels_apply, moe_output
from .experts import ExpertMLP, SharedNeuronExperts
from .dispatch import Dispatch


def aligned_width(width: int) -> int:
    """A width rounded up to a multiple of 8 (rows of 16 bytes in 2-byte dtypes: what grouped_mm needs),
    or of 64 where that is cheap, adding at most 1/16 of the width (the padding is computed, here and
    in an export: 352 stays 352 rather than 384; 1376 becomes 1408)."""
    by64 = -(-width // 64) * 64
    return by64 if by64 - width <= width / 16 else -(-max(width, 1) // 8) * 8


def packed_widths(expert_widths: list[int], shared_widths: list[int]) -> tuple[int, int]:
    """(W, S) for all routed layers of one model: every routed expert is zero-padded to W, the shared
    part to S (0: no shared part). The standard exports are sized by the same two numbers, so native
    and exported layers compute alike."""
    return aligned_width(max(expert_widths, default=1)), \
        aligned_width(max(shared_widths)) if max(shared_widths, default=0) else 0


GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# what torch.compile traces grouped_mm in (its meta kernel, torch 2.13); other dtypes take the per-expert loop,
# a graph break
COMPILED_GROUPED_MM_DTYPES = (torch.bfloat16,)


def grouped_linear(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """``x`` (rows sorted by expert; expert e's rows end at ``offsets[e]``) times ``weight[e].T``
    (weight: (experts, out, in)) -> (rows, out): torch's grouped_mm, as transformers' experts run it,
    or one matmul per expert where grouped_mm has no kernel (float64; older torch or GPUs; a compiled
    graph in float32)."""
    grouped = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    dtypes = COMPILED_GROUPED_MM_DTYPES if torch.compiler.is_compiling() else GROUPED_MM_DTYPES
    if grouped is not None and x.dtype in dtypes:
        try:
            return grouped(x, weight.transpose(-2, -1), offs=offsets)
        except (RuntimeError, NotImplementedError):  # e.g. a GPU without a grouped_mm kernel
            pass
    out = x.new_zeros(x.shape[0], weight.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(x[start:end], weight[e].T, out=out[start:end])
        start = end
    return out


def _padded_rows(weight: Tensor, width: int) -> Tensor:
    """``weight`` with zero rows appended up to ``width`` rows."""
    return F.pad(weight, (0, 0) * (weight.dim() - 1) + (0, width - weight.shape[0]))


def _packed_shared(shared: ExpertMLP | None, width: int) -> tuple | None:
    """The shared part's (gate, up, gate bias, up bias, down) zero-padded to ``width`` neurons, or None."""
    if shared is None:
        return None
    n, pad = shared.neurons, lambda t: None if t is None else _padded_rows(t, width)
    return (None if n.gate is None else pad(n.gate.weight), pad(n.up.weight),
            None if n.gate is None else pad(n.gate.bias), pad(n.up.bias),
            F.pad(shared.down.weight, (0, width - shared.width)))


@dataclass
class PackedExperts:
    """A layer's MLP weights for inference, laid out as transformers 5 holds MoE experts (see the module
    docstring): ``first`` (E, 2W, d), each expert's gate rows then its up rows (two-layer MLPs: (E, W, d),
    up rows), ``first_bias`` likewise or None, ``down`` (E, d, W) times the router's ``expert_scale``,
    all zero-padded to W; ``shared``: the shared part's (gate, up, gate bias, up bias, down) zero-padded
    to S (gate and biases may be None), or None. Built from per-expert modules (``from_experts``) or
    gathered from experts stored once (``gathered``)."""

    act: Callable[[Tensor], Tensor]
    act_name: str
    gated: bool
    first: Tensor
    first_bias: Tensor | None
    down: Tensor
    shared: tuple[Tensor | None, Tensor, Tensor | None, Tensor | None, Tensor] | None = None

    @classmethod
    def from_experts(cls, experts: list[ExpertMLP], shared: ExpertMLP | None, expert_scale: float,
                     widths: tuple[int, int]) -> PackedExperts:
        """Disjoint experts (one module each) and their shared part, copied into the packed layout."""
        width, shared_width = widths
        neurons = [e.neurons for e in experts]
        gated = neurons[0].gated

        def stacked_first(part: str) -> Tensor:  # part: "weight" or "bias"
            rows = [[getattr(n.gate, part), getattr(n.up, part)] if gated else [getattr(n.up, part)]
                    for n in neurons]
            return torch.stack([torch.cat([_padded_rows(t, width) for t in pair]) for pair in rows])

        with torch.no_grad():
            scale = float(expert_scale)
            downs = [e.down.weight * scale if scale != 1.0 else e.down.weight for e in experts]
            return cls(act=neurons[0].act, act_name=neurons[0].act_name, gated=gated,
                       first=stacked_first("weight"),
                       first_bias=None if neurons[0].up.bias is None else stacked_first("bias"),
                       down=torch.stack([F.pad(d, (0, width - d.shape[1])) for d in downs]),
                       shared=_packed_shared(shared, shared_width))

    @classmethod
    def gathered(cls, experts: SharedNeuronExperts, shared: ExpertMLP | None, expert_scale: float,
                 widths: tuple[int, int]) -> PackedExperts:
        """Experts stored once (as index lists into their union) and their shared part in the packed layout:
        one gather per weight, rows zero-padded to W."""
        width, shared_width = widths
        neurons, index = experts.neurons, experts.index.long()  # (E, w): positions in the union
        num, w = index.shape

        def first(part: str) -> Tensor | None:  # "weight" or "bias": (union, ...) -> (E, [2] width, ...)
            tensors = [getattr(n, part) for n in (neurons.gate, neurons.up) if n is not None]
            if tensors[-1] is None:
                return None
            out = tensors[-1].new_empty(num, len(tensors) * width, *tensors[-1].shape[1:])
            for k, t in enumerate(tensors):  # gathered into its block of one buffer: no padded or concatenated copies
                out[:, k * width:k * width + w] = t.index_select(0, index.flatten()).view(num, w, *t.shape[1:])
                out[:, k * width + w:(k + 1) * width] = 0
            return out

        with torch.no_grad():
            union_down = experts.down.weight  # (d, union)
            d = union_down.shape[0]
            columns = (union_down.expand(num, d, -1), 2, index[:, None, :].expand(-1, d, w))
            if torch.compiler.is_compiling():  # a graph takes no strided out=; the compiler fuses the padding
                down = F.pad(torch.gather(*columns), (0, width - w))
            else:
                # columns picked by one gather straight into their block (an index_select along dim 1 and a
                # permuted copy measured slower, several times so in bfloat16)
                down = union_down.new_empty(num, d, width)
                torch.gather(*columns, out=down[..., :w])
                down[..., w:] = 0
            if expert_scale != 1.0:
                down[..., :w] *= float(expert_scale)
            return cls(act=neurons.act, act_name=neurons.act_name, gated=neurons.gated, first=first("weight"),
                       first_bias=first("bias"), down=down, shared=_packed_shared(shared, shared_width))

    def shared_output(self, x: Tensor) -> Tensor:
        gate, up, gate_bias, up_bias, down = self.shared
        h = F.linear(x, up, up_bias)
        h = self.act(F.linear(x, gate, gate_bias)) * h if gate is not None else self.act(h)
        return F.linear(h, down)

    def runs_few_pairs(self, x: Tensor, pairs: int) -> bool:
        """Whether ``few_pairs_output`` computes a forward of ``pairs`` (token, expert) pairs on ``x``."""
        return kernels_apply(x, pairs, self.first.shape[0], self.act_name, self.gated, self.first_bias is not None)

    def few_pairs_output(self, x: Tensor, choice: Tensor, weight: Tensor) -> Tensor:
        """The layer's output for a top-k router's ``choice`` and ``weight`` (tokens, k), shared part included:
        ``few_pairs``' kernels (a decoding step on a GPU)."""
        shared = None
        if self.shared is not None:
            gate, up, _, _, down = self.shared  # no biases where the kernels run
            shared = (gate, up, down)
        return moe_output(x, choice, weight, self.first, self.down, shared, self.act_name)

    def routed_output(self, x: Tensor, dispatch: Dispatch) -> Tensor:
        """Every (token, expert) pair's weighted expert output, (pairs, d), in the dispatch's order. The
        (pairs, d) tensors are the layer's largest: one ``index_select`` gathers the rows and the weights
        multiply in place: the same values as indexing and a new product, without allocating and faulting
        in another such tensor (what a CPU's memory bandwidth pays for)."""
        offsets = torch.cumsum(dispatch.counts, 0, dtype=torch.int32)
        h = grouped_linear(x.index_select(0, dispatch.token), self.first, offsets)
        if self.first_bias is not None:
            h = h + self.first_bias[dispatch.expert]
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        y = grouped_linear(h, self.down, offsets)
        if dispatch.real is not None:  # rows past the last group were not computed: whatever they hold, 0
            return torch.where(dispatch.real[:, None], y * dispatch.weight[:, None], 0)
        return y.mul_(dispatch.weight[:, None])

