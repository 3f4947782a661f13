"""The few-pairs kernels (``runtime.few_pairs``) against the grouped path: on a CPU through triton's
interpreter (where triton is installed), and on a CUDA device through an MoE layer, eager and compiled."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moeify.runtime import few_pairs
from moeify.runtime.experts import ExpertMLP
from moeify.runtime.moe import MoeMLP
from moeify.runtime.routers import RepresentativeRouter

needs_triton = pytest.mark.skipif(few_pairs.triton is None, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

INTERPRETED = textwrap.dedent("""
    import torch
    from transformers.activations import ACT2FN
    from moeify.runtime import few_pairs
    g = torch.Generator().manual_seed(0)
    E, W, d = 5, 40, 300  # widths that are no multiple of the kernels' blocks
    for act in few_pairs.ACTIVATIONS:
        first, down = 0.1 * torch.randn(E, 2 * W, d, generator=g), 0.1 * torch.randn(E, d, W, generator=g)
        x, weight = torch.randn(3, d, generator=g), torch.rand(4, generator=g)
        token, expert = torch.tensor([0, 2, 1, 2]), torch.tensor([4, 0, 4, 1])
        y = few_pairs.routed_output(x, token, expert, weight, first, down, act)
        gate, up = (first.double()[expert] @ x.double()[token][:, :, None]).squeeze(-1).chunk(2, dim=-1)
        h = ACT2FN[act](gate) * up
        reference = (down.double()[expert] @ h[:, :, None]).squeeze(-1) * weight.double()[:, None]
        torch.testing.assert_close(y.double(), reference, atol=2e-5, rtol=1e-5)
    print("ok")
""")


@needs_triton
def test_the_kernels_compute_each_pairs_weighted_expert_output_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def cmoe_like_layer(d: int = 256, width: int = 96, experts: int = 8) -> MoeMLP:
    torch.manual_seed(0)
    parts = [ExpertMLP(d, width, "silu", True, False) for _ in range(experts + 1)]
    for part in parts:
        for p in part.parameters():
            torch.nn.init.normal_(p, std=d ** -0.5)
    router = RepresentativeRouter(d, experts, 1, "silu", True, False)
    for p in router.neurons.parameters():
        torch.nn.init.normal_(p, std=d ** -0.5)
    return MoeMLP(parts[1:], router, parts[0]).eval()


@needs_cuda
@needs_triton
@pytest.mark.parametrize("tokens", [1, 4, 8, 9])
def test_a_decoding_step_on_cuda_runs_the_kernels_and_gives_the_grouped_paths_output(tokens, monkeypatch):
    layer = cmoe_like_layer().to("cuda", torch.bfloat16)
    x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
    assert few_pairs.applies(x, tokens, 8, "silu", True, False) == (tokens <= 8)
    with torch.no_grad():
        fast = layer(x)
        compiled = torch.compile(layer, fullgraph=True, dynamic=False)(x)
        monkeypatch.setattr(few_pairs, "applies", lambda *args: False)
        grouped = layer(x)
    torch.testing.assert_close(fast, grouped, atol=2e-2, rtol=2e-2)  # one rounding of h fewer
    torch.testing.assert_close(compiled, fast, atol=2e-2, rtol=2e-2)
