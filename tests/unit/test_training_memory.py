"""Training memory: the chunked losses are the plain losses, recomputed layers give the same gradients
while keeping far fewer activations, and an MoE layer's activations do not grow with its expert count."""

from __future__ import annotations

import pytest
import torch

from moeify.methods import get_method
from moeify.options import build_config
from moeify.training import losses
from moeify.training.losses import distillation_kl, final_hidden_states, lm_loss
from moeify.training.recompute import recomputed_layers
from tests.helpers.conversion import clone, conversion_context
from tests.helpers.tiny_models import STORIES_VOCAB, tiny_model


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(losses, "CHUNK_TOKENS", 7)  # several chunks, the last one partial


def batch(vocab: int, shape: tuple[int, int] = (3, 20), seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def saved_bytes(run, model: torch.nn.Module) -> int:
    """Activation bytes: the distinct storages autograd keeps for the backward pass while ``run()`` builds
    the graph, less the model's own parameters and buffers (which it saves by reference)."""
    owned = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in owned:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values())


@pytest.mark.parametrize("family", ["llama", "phi", "gpt_neox"])  # tied/untied heads, a head bias, other layouts
def test_chunked_cross_entropy_is_the_model_loss_with_its_gradients(family):
    model = tiny_model(family).train()
    ids = batch(model.config.vocab_size)
    reference = model(input_ids=ids, labels=ids, use_cache=False).loss
    reference.backward()
    expected = gradients(model)
    model.zero_grad()
    loss = lm_loss(model, ids)["loss"]
    loss.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    for name, grad in gradients(model).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7)


def test_no_tensor_as_large_as_the_full_logits_is_kept_for_the_backward_pass():
    """Each chunk of logits is recomputed in the backward pass, so autograd never holds (tokens x vocab)."""
    model = tiny_model("llama").train()
    ids = batch(model.config.vocab_size, (3, 40))
    vocab = model.config.vocab_size
    full = (ids.numel() - ids.shape[0]) * vocab
    logits: list[int] = []  # sizes of the saved tensors with a vocabulary axis

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() and t.shape[-1] == vocab and t.numel() != vocab * model.config.hidden_size:  # not the head
            logits.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm_loss(model, ids)["loss"].backward()
    assert max(logits, default=0) <= losses.CHUNK_TOKENS * vocab < full
    logits.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert max(logits) >= full  # what the plain loss keeps, for comparison


def test_chunked_distillation_is_the_kl_of_the_full_logits():
    """ToMoE's teacher is the same model with its masks off: both sides go through the model's one head."""
    teacher, student = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    ids = batch(teacher.config.vocab_size)
    with torch.no_grad():
        hidden = final_hidden_states(teacher, ids)
        t = torch.log_softmax(student.get_output_embeddings()(hidden).float(), dim=-1).flatten(0, 1)
    s = torch.log_softmax(student(input_ids=ids).logits.float(), dim=-1).flatten(0, 1)
    expected = torch.nn.functional.kl_div(s, t, log_target=True, reduction="batchmean")
    got = distillation_kl(student, hidden, final_hidden_states(student, ids))
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)


def test_recomputed_layers_give_the_same_gradients_and_keep_fewer_activations():
    model = tiny_model("llama").train()
    ids = batch(model.config.vocab_size, (4, 32))
    plain = saved_bytes(lambda: lm_loss(model, ids)["loss"].backward(), model)
    expected = gradients(model)
    model.zero_grad()
    with recomputed_layers(model):
        recomputed = saved_bytes(lambda: lm_loss(model, ids)["loss"].backward(), model)
    for name, grad in gradients(model).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7)
    assert recomputed < 0.5 * plain
    assert "forward" not in vars(model.model.layers[0])  # the block restored the layers


def moe_activation_bytes(num_experts: int, tokenizer, calib_text) -> int:
    """What one training forward + loss keeps for the backward pass (layers not recomputed, so the MoE
    layers' own activations are all there) of a tiny model carved into one shared and ``num_experts`` - 1
    routed experts of 64 neurons each, one routed expert per token: the same computation per token
    whatever ``num_experts``, only the experts' weights (and the router's scores) grow with it."""
    model = tiny_model("llama", intermediate_size=64 * num_experts, **STORIES_VOCAB)
    method = get_method("random_split")
    ctx = conversion_context(clone(model), tokenizer, calib_text)
    method.run(ctx, build_config(method.config_cls, {"spec": f"S1A1E{num_experts}", "calib_samples": 2,
                                                     "seq_len": 64}))
    ctx.model.train()
    ids = batch(model.config.vocab_size, (4, 64))
    return saved_bytes(lambda: lm_loss(ctx.model, ids)["loss"], ctx.model)


def test_moe_activations_do_not_grow_with_the_expert_count(tokenizer, calib_text):
    eight, sixteen = (moe_activation_bytes(n, tokenizer, calib_text) for n in (8, 16))
    assert abs(sixteen - eight) <= 0.10 * eight, (eight, sixteen)
