"""An MoE layer on a few tokens, as a decoding step has them, in Triton kernels that read only the chosen
experts' rows. Part of the runtime copied into every converted folder (imports torch, and triton where it is
installed).

A grouped matmul serves many tokens per expert well; at a decoding step each expert has a token or none, the
grouped matmul's row tiles are nearly empty, and the launches around it (the dispatch that sorts and counts
the pairs, the shared part's matmuls, the gather and the scatter of rows) cost as much as the products: on a
GPU each is a kernel, and in eager mode each is an operator the host issues. Here a layer's experts take two
kernels: ``_first`` computes, for each (token, slot) pair of the routers' (tokens, k) choice and for each
token's shared part, a block of hidden rows as matrix-vector products with the activation and the gate/up
product; ``_down`` computes each token's output rows: the shared part's down rows plus each chosen expert's
times its routing weight, written in place of the token's MLP output (no scatter). CMoE's router, whose
scores are hidden values of representative neurons, is one more kernel (``_representative``). Sums run in
float32 and are rounded once, where the grouped path rounds each product to the working dtype: the results
agree within that dtype's rounding. Pairs beyond the expert count would read experts once per pair, so the
grouped path runs there (``applies``); on a CPU, or without triton, it always does.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the grouped path runs
    triton = None

ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_pytorch_tanh": 2}  # ACT2FN names the kernels compute
FIRST_ROWS, FIRST_COLUMNS = 8, 512   # a program's block of one pair's gate/up rows, and its step over d
DOWN_ROWS, DOWN_COLUMNS = 16, 256    # ... of a token's output rows (d of them), and its step over the widths
ROUTER_COLUMNS = 256                 # the representative router's step over d
DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what they sum in float32 without losing precision
DEVICES = ("cuda",)  # where they run (tests add "cpu" under triton's interpreter)


def applies(x: Tensor, pairs: int, num_experts: int, act_name: str, gated: bool, biased: bool) -> bool:
    """Whether the kernels compute this forward: a tensor on a device above, of a dtype above, at most one
    pair per expert on average, a gated MLP without biases whose activation they know, triton installed."""
    return (triton is not None and x.device.type in DEVICES and x.dtype in DTYPES and pairs <= num_experts
            and gated and not biased and act_name in ACTIVATIONS)


def moe_output(x: Tensor, choice: Tensor, weight: Tensor, first: Tensor, down: Tensor,
               shared: tuple[Tensor, Tensor, Tensor] | None, act_name: str) -> Tensor:
    """The layer's output (tokens, d): each token's shared part plus its ``choice`` (tokens, k) experts times
    ``weight`` (tokens, k). ``first`` (E, 2W, d) holds each expert's W gate rows then its W up rows, ``down``
    (E, d, W); ``shared``: its (gate (S, d), up (S, d), down (d, S)) or None; ``x`` (tokens, d)."""
    tokens, k = choice.shape
    d, width = x.shape[1], first.shape[1] // 2
    shared_width = 0 if shared is None else shared[0].shape[0]
    gate_s, up_s, down_s = shared if shared is not None else (first, first, down)  # the packed copy's: contiguous
    x = x.contiguous()
    h = x.new_empty(tokens * k, width)
    h_shared = x.new_empty(tokens, max(shared_width, 1))
    programs = tokens * k + (tokens if shared is not None else 0)
    _first[(programs, triton.cdiv(max(width, shared_width), FIRST_ROWS))](
        x, choice, first, gate_s, up_s, h, h_shared, d, width, shared_width, tokens * k, K=k,
        ACT=ACTIVATIONS[act_name], ROWS=FIRST_ROWS, COLUMNS=FIRST_COLUMNS)
    out = torch.empty_like(x)
    _down[(tokens, triton.cdiv(d, DOWN_ROWS))](h, h_shared, choice, weight, down, down_s, out, d, width, shared_width,
                                               K=k, ROWS=DOWN_ROWS, COLUMNS=DOWN_COLUMNS)
    return out


def representative_choice(x: Tensor, gate: Tensor, up: Tensor, bias: Tensor, u: Tensor, k: int, act_name: str,
                          signed: bool) -> tuple[Tensor, Tensor]:
    """CMoE's routing (Eq. 24-32) in one kernel: s = |act(x W_gate^R) * (x W_up^R)| (or signed) in float32,
    s' = softmax(s), the k experts of largest s' + b, each weighing 1 + s'_i u_i: (tokens, k) ids and
    weights in x's dtype, ids in descending order of s' + b."""
    tokens, d = x.shape
    experts = gate.shape[0]
    choice = torch.empty(tokens, k, dtype=torch.long, device=x.device)
    weight = x.new_empty(tokens, k)
    _representative[(tokens,)](x.contiguous(), gate, up, bias, u, choice, weight, d, experts, K=k,
                               BLOCK_E=triton.next_power_of_2(experts), ACT=ACTIVATIONS[act_name], SIGNED=signed,
                               COLUMNS=ROUTER_COLUMNS)
    return choice, weight


if triton is not None:
    @triton.jit
    def _activation(g, ACT: tl.constexpr):
        if ACT == 0:  # silu
            return g * tl.sigmoid(g)
        elif ACT == 1:  # gelu (erf)
            return 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
        else:  # gelu, tanh approximation: 0.5 g (1 + tanh(v)) = g sigmoid(2 v)
            return g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))

    @triton.jit
    def _first(x_ptr, choice_ptr, first_ptr, gate_s_ptr, up_s_ptr, h_ptr, hs_ptr, d, width, shared_width, pairs,
               K: tl.constexpr, ACT: tl.constexpr, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
        """A block of hidden rows act(x[token] . gate rows) * (x[token] . up rows) of one pair (programs below
        ``pairs``: pair p is token p // K's slot p % K) or of one token's shared part (the programs after)."""
        program, block = tl.program_id(0), tl.program_id(1)
        rows = block * ROWS + tl.arange(0, ROWS)
        if program < pairs:
            token = program // K
            expert = tl.load(choice_ptr + program).to(tl.int64)
            rows_of = width
            gate_rows = first_ptr + expert * 2 * width * d
            up_rows = gate_rows + width * d
            out = h_ptr + program * width
        else:
            token = program - pairs
            rows_of = shared_width
            gate_rows = gate_s_ptr
            up_rows = up_s_ptr
            out = hs_ptr + token * shared_width
        live = rows < rows_of
        gate = _rows_times(gate_rows, x_ptr + token * d, rows, live, d, COLUMNS)
        up = _rows_times(up_rows, x_ptr + token * d, rows, live, d, COLUMNS)
        tl.store(out + rows, (_activation(gate, ACT) * up).to(h_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _rows_times(w_ptr, v_ptr, rows, live, n, COLUMNS: tl.constexpr):
        """(rows of an (., n) matrix at w_ptr) . v (n,), in float32."""
        acc = tl.zeros(rows.shape, dtype=tl.float32)
        offsets = rows.to(tl.int64)[:, None] * n
        for start in range(0, n, COLUMNS):
            columns = start + tl.arange(0, COLUMNS)
            inside = columns < n
            vs = tl.load(v_ptr + columns, mask=inside, other=0.0).to(tl.float32)[None, :]
            ws = tl.load(w_ptr + offsets + columns[None, :], mask=live[:, None] & inside[None, :], other=0.0)
            acc += tl.sum(ws.to(tl.float32) * vs, axis=1)
        return acc

    @triton.jit
    def _down(h_ptr, hs_ptr, choice_ptr, weight_ptr, down_ptr, down_s_ptr, out_ptr, d, width, shared_width,
              K: tl.constexpr, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
        """A block of token t's output rows: its shared part's down rows . its shared hidden values, plus
        each slot's weight times its expert's down rows . the slot's hidden values."""
        token, block = tl.program_id(0), tl.program_id(1)
        rows = block * ROWS + tl.arange(0, ROWS)
        live = rows < d
        acc = tl.zeros((ROWS,), dtype=tl.float32)
        if shared_width > 0:
            acc = _rows_times(down_s_ptr, hs_ptr + token * shared_width, rows, live, shared_width, COLUMNS)
        for slot in tl.static_range(K):
            pair = token * K + slot
            expert = tl.load(choice_ptr + pair).to(tl.int64)
            part = _rows_times(down_ptr + expert * d * width, h_ptr + pair * width, rows, live, width, COLUMNS)
            acc += tl.load(weight_ptr + pair).to(tl.float32) * part
        tl.store(out_ptr + token * d + rows, acc.to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _representative(x_ptr, gate_ptr, up_ptr, bias_ptr, u_ptr, choice_ptr, weight_ptr, d, experts,
                        K: tl.constexpr, BLOCK_E: tl.constexpr, ACT: tl.constexpr, SIGNED: tl.constexpr,
                        COLUMNS: tl.constexpr):
        """One token's CMoE routing: scores, softmax, the top K of s' + b (the largest first), weights."""
        token = tl.program_id(0)
        ids = tl.arange(0, BLOCK_E)
        live = ids < experts
        gate = _rows_times(gate_ptr, x_ptr + token * d, ids, live, d, COLUMNS)
        up = _rows_times(up_ptr, x_ptr + token * d, ids, live, d, COLUMNS)
        s = _activation(gate, ACT) * up
        if not SIGNED:
            s = tl.abs(s)
        s = tl.where(live, s, float("-inf"))
        e = tl.exp(s - tl.max(s, axis=0))
        p = e / tl.sum(e, axis=0)  # s'; Eq. 29
        key = tl.where(live, p + tl.load(bias_ptr + ids, mask=live, other=0.0).to(tl.float32), float("-inf"))
        u = tl.load(u_ptr + ids, mask=live, other=0.0).to(tl.float32)
        for slot in tl.static_range(K):  # Eq. 32, one expert at a time
            best = tl.argmax(key, axis=0)
            picked = ids == best
            tl.store(choice_ptr + token * K + slot, best.to(tl.int64))
            g = 1.0 + tl.sum(tl.where(picked, p * u, 0.0), axis=0)  # Eq. 28
            tl.store(weight_ptr + token * K + slot, g.to(weight_ptr.dtype.element_ty))
            key = tl.where(picked, float("-inf"), key)
