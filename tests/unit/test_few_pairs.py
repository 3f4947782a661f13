"""The few-pairs kernels (``runtime.few_pairs``) against the grouped path and the torch router, through an
MoE layer: on a CPU in triton's interpreter (where triton is installed), and on a CUDA device, eager and
compiled."""

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
    from moeify.runtime import few_pairs
    from tests.unit.test_few_pairs import cmoe_like_layer
    torch.manual_seed(1)
    for act in few_pairs.ACTIVATIONS:
        for top_k, shared, score in ((1, True, "abs"), (2, True, "signed"), (3, False, "abs")):
            layer = cmoe_like_layer(d=72, width=40, experts=5, act=act, top_k=top_k, shared=shared, score=score)
            torch.nn.init.normal_(layer.router.u)
            torch.nn.init.normal_(layer.router.bias, std=0.01)
            x = torch.randn(1, 3 - top_k // 2, 72)  # widths and d no multiple of the kernels' blocks
            with torch.no_grad():
                few_pairs.DEVICES = ("cpu",)
                fast, choice = layer(x), layer.router.choose(x[0])
                few_pairs.DEVICES = ()
                reference, expected = layer(x), layer.router.choose(x[0])
            assert torch.equal(choice[0], expected[0]), (act, top_k)
            torch.testing.assert_close(choice[1], expected[1], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(fast, reference, atol=1e-5, rtol=1e-5)
    print("ok")
""")


@needs_triton
def test_the_kernels_compute_the_layer_and_its_routing_in_the_interpreter():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{root / 'src'}:{root}"}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def cmoe_like_layer(d: int = 256, width: int = 96, experts: int = 8, act: str = "silu", top_k: int = 1,
                    shared: bool = True, score: str = "abs") -> MoeMLP:
    """A random CMoE-like layer: ``experts`` routed experts, a shared part of the same width or none."""
    torch.manual_seed(0)
    parts = [ExpertMLP(d, width, act, True, False) for _ in range(experts + 1)]
    router = RepresentativeRouter(d, experts, top_k, act, True, False, score=score)
    for p in [*(p for part in parts for p in part.parameters()), *router.neurons.parameters()]:
        torch.nn.init.normal_(p, std=d ** -0.5)
    return MoeMLP(parts[1:], router, parts[0] if shared else None).eval()


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
        monkeypatch.setattr(few_pairs, "DEVICES", ())
        grouped = layer(x)
    torch.testing.assert_close(fast, grouped, atol=2e-2, rtol=2e-2)  # one rounding of h fewer
    torch.testing.assert_close(compiled, fast, atol=2e-2, rtol=2e-2)


POINTER_TYPES = {"choice_ptr": "*i64", "bias_ptr": "*fp32", "u_ptr": "*fp32"}  # the others: the working dtype


@needs_triton
@pytest.mark.parametrize("top_k", [1, 2])
def test_the_kernels_compile_for_a_hopper_gpu_without_one(top_k):
    """What the interpreter does not check: that triton's compiler takes the kernels (types of both branches,
    constexpr arguments), for sm_90 in bfloat16, without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constants = {"K": top_k, "ACT": 0, "ROWS": 16, "COLUMNS": 256, "BLOCK_E": 8, "SIGNED": False}
    for kernel in (few_pairs._first, few_pairs._down, few_pairs._representative):
        names = kernel.arg_names
        signature = {n: "constexpr" if n.isupper() else POINTER_TYPES.get(n, "*bf16") if n.endswith("_ptr") else "i32"
                     for n in names}
        source = ASTSource(fn=kernel, signature=signature, constexprs={n: constants[n] for n in names if n.isupper()})
        assert "ld.global" in few_pairs.triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
