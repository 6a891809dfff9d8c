"""SpecForge's EAGLE-3 model reads headway's ``eagle3-hf`` export and drafts what headway drafts.

SpecForge (PyPI ``specforge``, SGLang's drafter-training framework) defines the layout SGLang
serves as ``LlamaForCausalLMEagle3``; ``make setup`` installs it without its dependencies (it
pins torch 2.11, transformers 5.8.1 and sglang). Its model is built here from the export's
``config.json`` (``LlamaConfig``, as its ``config_class``) and the export's tensors loaded by
name, then driven through its own ``project_hidden_states`` / ``backbone`` / ``compute_logits``
with its test-time-training cache: three draft steps at every position must equal headway's
(:mod:`tests.engine_drafts`), for a trained tiny drafter and for the shipped one on SmolLM2.

Its training step (``OnlineEagle3Model``) computes the loss headway trains with, step by step,
and the same gradients (``test_specforge_computes_the_loss_headway_trains_with``).

Not through its ``from_pretrained``: under transformers 5.24 that leaves its own rotary
embedding's ``inv_freq`` buffer uninitialised (measured: -2.1e7 where 1.0 belongs), a
SpecForge/transformers mismatch, not a property of the checkpoint.

Skipped where SpecForge is not installed; an installed one that fails to import fails.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor
from transformers import LlamaConfig

from headway.heads.format_eagle3 import export_eagle3
from headway.heads.io import save_heads
from headway.heads.vocab import DraftVocab
from headway.target import Target, fingerprint
from tests.engine_drafts import (
    SHIPPED,
    STEPS,
    assert_same_drafts,
    assert_same_tensors,
    next_step_ids,
    question_ids,
    shipped_draft,
    tiny_ids,
)
from tests.installed import installed_modules
from tests.test_eagle3 import method_for, target_and_truth, trained

(llama3_eagle,) = installed_modules("specforge", "specforge.modeling.draft.llama3_eagle")


def _their_model(folder: Path, embedding: Tensor) -> Any:
    """SpecForge's ``LlamaForCausalLMEagle3`` for ``folder``, fp32, sdpa attention; the
    target's ``embedding`` stands in for the ``embed_tokens`` the export leaves out (SGLang
    shares the target's). Every tensor of the export must be one of its parameters."""
    model = llama3_eagle.LlamaForCausalLMEagle3(
        LlamaConfig.from_pretrained(str(folder)), attention_backend="sdpa"
    )
    missing, unexpected = model.load_state_dict(
        load_file(str(folder / "model.safetensors")), strict=False
    )
    assert (missing, unexpected) == (["embed_tokens.weight"], [])
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embedding)
    return model.float().eval()


def _their_export(folder: Path, model: Any, draft: Any) -> Any:
    """``draft`` saved as a tiny llama's run, exported as ``eagle3-hf`` under ``folder``, and
    read by SpecForge (:func:`_their_model`)."""
    run = save_heads(
        folder / "run",
        method="eagle3",
        head_config=draft.config.to_dict(),
        state_dict=draft.state_dict(),
        target_fingerprint=fingerprint(model),
        target_name="org/tiny-llama",
    )
    return _their_model(export_eagle3(run, folder / "export"), model.get_input_embeddings().weight)


def _drafts_of(model: Any) -> Any:
    """SpecForge's training step (``project_hidden_states``, then per step ``backbone`` over
    its ``cache_hidden`` and ``compute_logits``) as the comparison's ``theirs``."""

    def drafts(features: Tensor, next_ids: Tensor) -> list[Tensor]:
        length = next_ids.shape[1]
        cache: list[list[Tensor]] = [[], []]
        steps, ids = [], next_ids
        with torch.no_grad():
            states = model.project_hidden_states(features)
            mask = model.prepare_decoder_attention_mask(
                torch.ones(1, length, dtype=torch.bool), states, 1, length, 0
            )
            for _ in range(STEPS):
                states = model.backbone(
                    input_embeds=model.embed_input_ids(ids),
                    hidden_states=states,
                    cache_hidden=cache,
                    attention_mask=mask,
                    position_ids=torch.arange(length)[None],
                    use_cache=False,
                )
                steps.append(model.compute_logits(states).argmax(-1))
                ids = next_step_ids(ids)
        return steps

    return drafts


def test_specforge_reads_the_eagle3_hf_export(tmp_path: Path) -> None:
    model, _ = target_and_truth("llama")
    draft = trained("llama")
    theirs = _their_export(tmp_path, model, draft)
    assert theirs.draft_vocab_size == draft.config.draft_vocab_size
    assert_same_tensors(theirs.state_dict(), draft, "midlayer.")
    assert_same_drafts(_drafts_of(theirs), draft, model, tiny_ids())


@pytest.mark.slow  # loads SmolLM2
def test_specforge_reads_the_shipped_drafter(smollm2: Target) -> None:
    """The shipped binary (bf16) in fp32 on SmolLM2's features for a real question."""
    draft = shipped_draft()
    embedding = smollm2.model.get_input_embeddings().weight
    assert isinstance(embedding, Tensor)
    theirs = _their_model(SHIPPED, embedding)
    assert_same_tensors(theirs.state_dict(), draft.to(torch.bfloat16).float(), "midlayer.")
    assert_same_drafts(_drafts_of(theirs), draft, smollm2.model, question_ids(smollm2.tokenizer))


def _their_training() -> tuple[Any, Any]:
    """SpecForge's ``algorithms.eagle3.model`` (its ``OnlineEagle3Model``, the training step
    SGLang's drafters are trained with) and ``core.loss._compute_loss``, the plain-torch
    reference of its Triton soft cross-entropy. ``core.loss`` imports Triton, which a CPU torch
    lacks: a stand-in module is in place during that import only, after torch has resolved its
    compiler backends (and cached that no Triton is installed), so nothing else sees it."""
    import sys
    import types

    from torch.utils._triton import has_triton_package

    torch.compile(lambda x: x)  # the inductor backend's imports, before the stand-in
    installed = has_triton_package()
    stand_in, language = types.ModuleType("triton"), types.ModuleType("triton.language")
    stand_in.jit = lambda fn: fn  # type: ignore[attr-defined]
    stand_in.language = language  # type: ignore[attr-defined]
    language.constexpr = int  # type: ignore[attr-defined]
    if not installed:
        sys.modules["triton"], sys.modules["triton.language"] = stand_in, language
    try:
        import specforge.algorithms.eagle3.model as training
        import specforge.core.loss as loss
    finally:
        if not installed:
            del sys.modules["triton"], sys.modules["triton.language"]
    assert has_triton_package() == installed
    return training, loss._compute_loss


def _shift(tensor: Tensor, by: int = 1) -> Tensor:
    """``[B, T, ...]`` moved ``by`` positions left, zeros at the end (SpecForge's ``padding``)."""
    return torch.cat([tensor[:, by:], torch.zeros_like(tensor[:, :by])], dim=1)


@pytest.mark.parametrize("steps", [1, 3])
def test_specforge_computes_the_loss_headway_trains_with(
    steps: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the same draft weights, target states and trained tokens, SpecForge's EAGLE-3
    training step (``OnlineEagle3Model``, its loss the reference of its kernel) gives headway's
    loss of every test-time-training step, and the same gradient of every draft tensor.

    Two documented conventions differ (``headway/train/losses_eagle.py``): SpecForge counts row
    t of step j where ``loss_mask[t + j]``, headway where ``loss_mask[t + j + 2]`` (the drafted
    token is trained), so SpecForge is given the mask two positions earlier; and it divides each
    step's sum by all B·T rows where headway takes the mean over the step's counted rows, so its
    step j equals headway's ``ce_j · n_j / (B·T)``. The rows whose target argmax lies outside the
    draft vocabulary are left out by both (this draft vocabulary misses some)."""
    training, reference_loss = _their_training()
    monkeypatch.setattr(training, "LogSoftmaxLoss", SimpleNamespace(apply=reference_loss))
    model, _ = target_and_truth("llama")
    draft = trained("llama")
    ids = tiny_ids()
    length = ids.shape[1]
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :4] = loss_mask[:, 12:15] = 0  # a prompt, and a gap: rows either side differ
    vocab = DraftVocab.from_tensors(draft.d2t, draft.t2d)
    method = method_for(model, vocab, f"eagle3.ttt_steps={steps}")
    method.draft.load_state_dict(draft.state_dict())
    method.train()
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    hidden = {layer: states[layer] for layer in method.feature_layers}
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}

    ours: list[float] = []  # per step: ce_j · n_j / T, and its gradient
    grads: dict[str, Tensor] = {}
    earlier: dict[str, Tensor] | None = None
    for count in range(1, steps + 1):  # headway's total of the first `count` steps
        method.steps = count
        method.zero_grad()
        out = method(batch, hidden)
        out.loss.backward()
        now = {n: p.grad.clone() for n, p in method.draft.named_parameters() if p.grad is not None}
        share = out.metrics[f"depth{count}/tokens"] / length
        ours.append(out.metrics[f"depth{count}/ce"] * share)
        for name, grad in now.items():
            step_grad = grad - (earlier[name] if earlier else 0)  # decay^j · d ce_j
            grads[name] = grads.get(name, 0) + step_grad * share
        earlier = now
    assert min(out.metrics[f"depth{j + 1}/tokens"] for j in range(steps)) > 0
    assert out.metrics["in_vocab"] < 1.0  # some rows are left out for the vocabulary

    theirs = _their_export(tmp_path, model, draft).train()
    wrapper = training.OnlineEagle3Model(theirs, length=steps, attention_backend="sdpa")
    final = states[method.final_layer]
    with torch.compiler.set_stance("force_eager"):
        plosses = wrapper(
            input_ids=_shift(ids),
            attention_mask=torch.ones_like(ids),
            target=_shift(model.lm_head(final).detach()),
            loss_mask=_shift(loss_mask.float(), 2)[..., None],
            hidden_states=torch.cat([states[layer] for layer in draft.config.feature_layers], -1),
        )[0]
    assert [float(p.detach()) for p in plosses] == pytest.approx(ours, rel=1e-5)
    sum(0.8**j * p for j, p in enumerate(plosses)).backward()
    for name, param in theirs.named_parameters():
        if name == "embed_tokens.weight":
            continue
        assert param.grad is not None and name in grads, name
        assert torch.allclose(param.grad, grads[name], rtol=1e-4, atol=1e-7), name
