"""Routed experts on a few (token, expert) pairs, as a decoding step has them: one Triton kernel per
projection that reads only the chosen experts' rows. Part of the runtime copied into every converted folder
(imports torch, and triton where it is installed).

A grouped matmul serves many tokens per expert well; at a decoding step each expert has a token or none,
and the grouped matmul's row tiles are nearly empty while its launches (and those of the dispatch that sorts
and counts the pairs for it) cost as much as the product. Here each program computes a block of one pair's
output rows as a matrix-vector product, so a step reads each chosen expert's weights once, needs the pairs
in no particular order, and runs two kernels: the gate and up rows with the activation and their product
(``first``), then the down rows times the pair's routing weight (``down``). The sums run in float32 and
are rounded once, where the grouped path rounds each product to the working dtype first: within that
dtype's rounding of it. Where a pair count exceeds the expert count, experts would be read once per pair,
so the grouped path runs (``applies``); on a CPU, or without triton, it always does.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the grouped path runs
    triton = None

ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_pytorch_tanh": 2}  # ACT2FN names the kernel computes
FIRST_ROWS, FIRST_COLUMNS = 8, 512   # a program's block of one pair's gate/up rows, and its step over d
DOWN_ROWS, DOWN_COLUMNS = 16, 256    # ... of the down projection's rows (d of them), and its step over W


def applies(x: Tensor, pairs: int, num_experts: int, act_name: str, gated: bool, biased: bool) -> bool:
    """Whether the kernels compute this forward: a CUDA tensor, at most one pair per expert on average,
    a gated MLP without biases whose activation they know, triton installed."""
    return (triton is not None and x.is_cuda and pairs <= num_experts and gated and not biased
            and act_name in ACTIVATIONS)


def routed_output(x: Tensor, token: Tensor, expert: Tensor, weight: Tensor, first: Tensor, down: Tensor,
                  act_name: str) -> Tensor:
    """Each pair's weighted expert output, (pairs, d), in the pairs' order: ``first`` (E, 2W, d) holds each
    expert's W gate rows then its W up rows, ``down`` (E, d, W); ``x`` (tokens, d)."""
    pairs, (num, double_width, d) = token.shape[0], first.shape
    width = double_width // 2
    x, first, down = x.contiguous(), first.contiguous(), down.contiguous()
    h = x.new_empty(pairs, width)
    _first[(pairs, triton.cdiv(width, FIRST_ROWS))](
        x, token, expert, first, h, d, width, ACT=ACTIVATIONS[act_name], ROWS=FIRST_ROWS, COLUMNS=FIRST_COLUMNS)
    y = x.new_empty(pairs, d)
    _down[(pairs, triton.cdiv(d, DOWN_ROWS))](h, expert, weight, down, y, d, width, ROWS=DOWN_ROWS,
                                              COLUMNS=DOWN_COLUMNS)
    return y


if triton is not None:
    @triton.jit
    def _first(x_ptr, token_ptr, expert_ptr, w_ptr, h_ptr, d, width, ACT: tl.constexpr, ROWS: tl.constexpr,
               COLUMNS: tl.constexpr):
        """h[pair, rows] = act(x[token] . gate rows) * (x[token] . up rows), in float32, stored rounded."""
        pair, block = tl.program_id(0), tl.program_id(1)
        token = tl.load(token_ptr + pair).to(tl.int64)
        expert = tl.load(expert_ptr + pair).to(tl.int64)
        rows = block * ROWS + tl.arange(0, ROWS)
        live = rows < width
        gate_rows = w_ptr + expert * 2 * width * d + rows.to(tl.int64)[:, None] * d
        up_rows = gate_rows + width * d
        gate = tl.zeros((ROWS,), dtype=tl.float32)
        up = tl.zeros((ROWS,), dtype=tl.float32)
        for start in range(0, d, COLUMNS):
            columns = start + tl.arange(0, COLUMNS)
            inside = columns < d
            xs = tl.load(x_ptr + token * d + columns, mask=inside, other=0.0).to(tl.float32)[None, :]
            both = live[:, None] & inside[None, :]
            gate += tl.sum(tl.load(gate_rows + columns[None, :], mask=both, other=0.0).to(tl.float32) * xs, axis=1)
            up += tl.sum(tl.load(up_rows + columns[None, :], mask=both, other=0.0).to(tl.float32) * xs, axis=1)
        if ACT == 0:  # silu
            gate = gate * tl.sigmoid(gate)
        elif ACT == 1:  # gelu (erf)
            gate = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
        else:  # gelu, tanh approximation: 0.5 g (1 + tanh(u)) = g sigmoid(2 u)
            gate = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate))
        tl.store(h_ptr + pair * width + rows, (gate * up).to(h_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _down(h_ptr, expert_ptr, weight_ptr, w_ptr, y_ptr, d, width, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
        """y[pair, rows] = weight[pair] (h[pair] . down rows), in float32, stored rounded."""
        pair, block = tl.program_id(0), tl.program_id(1)
        expert = tl.load(expert_ptr + pair).to(tl.int64)
        rows = block * ROWS + tl.arange(0, ROWS)
        live = rows < d
        down_rows = w_ptr + expert * d * width + rows.to(tl.int64)[:, None] * width
        acc = tl.zeros((ROWS,), dtype=tl.float32)
        for start in range(0, width, COLUMNS):
            columns = start + tl.arange(0, COLUMNS)
            inside = columns < width
            hs = tl.load(h_ptr + pair * width + columns, mask=inside, other=0.0).to(tl.float32)[None, :]
            both = live[:, None] & inside[None, :]
            acc += tl.sum(tl.load(down_rows + columns[None, :], mask=both, other=0.0).to(tl.float32) * hs, axis=1)
        acc = acc * tl.load(weight_ptr + pair).to(tl.float32)
        tl.store(y_ptr + pair * d + rows, acc.to(y_ptr.dtype.element_ty), mask=live)
