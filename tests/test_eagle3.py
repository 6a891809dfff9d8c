"""EAGLE-3: the draft model on every tiny family, training-time test against a slow per-row
recompute, the loss against its slow reference and on hand-made states whose right answer is
known, training through the real loop, and the drafter: greedy output equal to transformers',
draft ids mapped to target ids, KV rollback equal to a fresh drafter, sampling that keeps the
target's distribution. Targets have 4 layers so that three distinct feature layers exist."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor
from transformers import AutoModelForCausalLM

from headway.config import load_config
from headway.decode.generate import generate
from headway.decode.sampling import SamplingParams
from headway.errors import ConfigError
from headway.heads.drafter_eagle3 import Eagle3Drafter
from headway.heads.eagle import TargetHead
from headway.heads.eagle3 import Eagle3Config, Eagle3Model, default_feature_layers
from headway.heads.vocab import DraftVocab, choose_vocab, token_counts
from headway.run_config import RunConfig
from headway.target import Target, load_target
from headway.train import loop
from headway.train.batching import document_attention_mask
from headway.train.data import build_dataset, pad_collate
from headway.train.features import (
    CachedFeatureDataset,
    OnlineFeatures,
    cache_features,
    cached_hidden,
    collate_cached,
)
from headway.train.losses_eagle import eagle3_loss, eagle3_loss_reference
from headway.train.method_eagle3 import Eagle3, ttt_attention_mask, ttt_unroll, ttt_unroll_reference
from headway.train.methods import build_method
from tests.drafting import heads_drafter as load_drafter
from tests.test_eagle_drafter import Recorder
from tests.test_generate import chi_square, exact_two_token_probs, hf_greedy
from tests.tiny import TINY_FAMILIES, TINY_VOCAB, tiny_config
from tests.tokenizers_fixture import smollm2_tokenizer

PROMPT = torch.tensor([1, 5, 17, 33, 8, 40, 41, 9])
NEW_TOKENS = 32
TAPS = (1, 2, 3)  # default_feature_layers(4)
CHAIN = {"top_k": 1, "depth": 4, "total_tokens": 5}
TREE = {"top_k": 4, "depth": 4, "total_tokens": 12}
ENGINE_NAMES = sorted(
    [
        "fc.weight",
        "midlayer.input_layernorm.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.post_attention_layernorm.weight",
        *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    ]
)


def tiny4(family: str, *, seed: int = 0, vocab_size: int = TINY_VOCAB) -> Any:
    """A tiny random 4-layer target of ``family`` (tests/tiny.py's config, two more layers)."""
    config = tiny_config(family, vocab_size=vocab_size)
    config.num_hidden_layers = 4
    if getattr(config, "layer_types", None) is not None:  # Qwen2 lists one type per layer
        config.layer_types = [config.layer_types[0]] * 4
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa", dtype=torch.float32
    )
    return model.eval()


def hidden_states(model: Any, ids: Tensor) -> tuple[Tensor, ...]:
    with torch.no_grad():
        return tuple(model(ids, output_hidden_states=True).hidden_states)


def method_for(model: Any, vocab: DraftVocab, *overrides: str) -> Eagle3:
    config = load_config(RunConfig, None, [f"eagle3.draft_vocab_size={vocab.size}", *overrides])
    return Eagle3(config, Target(model, None, "tiny"), vocab=vocab)  # type: ignore[arg-type]


def fit_method(model: Any, sequences: Tensor, *, steps: int = 150, size: int = 64) -> Eagle3:
    """Briefly train an EAGLE-3 method on ``sequences`` ``[B, T]`` (every token trained)."""
    torch.manual_seed(0)
    vocab = choose_vocab(
        token_counts([(s, torch.ones_like(s)) for s in sequences], TINY_VOCAB), size
    )
    method = method_for(model, vocab, "eagle3.ttt_steps=3")
    batch = {
        "input_ids": sequences,
        "attention_mask": torch.ones_like(sequences),
        "loss_mask": torch.ones_like(sequences),
    }
    states = hidden_states(model, sequences)
    hidden = {layer: states[layer] for layer in method.feature_layers}
    optimizer = torch.optim.Adam(method.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = method(batch, hidden).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return method.eval()


@cache
def target_and_truth(family: str) -> tuple[Any, list[int]]:
    model = tiny4(family)
    return model, hf_greedy(model, PROMPT, NEW_TOKENS, eos=None)


@cache
def trained(family: str) -> Eagle3Model:
    model, truth = target_and_truth(family)
    return fit_method(model, torch.cat([PROMPT, torch.tensor(truth)])[None]).draft


def random_draft(model: Any, vocab: DraftVocab | None = None, seed: int = 1) -> Eagle3Model:
    torch.manual_seed(seed)
    vocab = vocab or DraftVocab.identity(64, TINY_VOCAB)
    draft = Eagle3Model(Eagle3Config.from_target(model, draft_vocab_size=vocab.size))
    draft.set_vocab(vocab)
    return draft.eval()


# ------------------------------------------------------------------------------ draft model


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_forward_shapes_and_loss_on_every_family(family: str) -> None:
    model = tiny4(family)
    method = method_for(model, DraftVocab.from_target_ids(range(10, 74), TINY_VOCAB))
    config = method.head_config
    assert config.feature_layers == TAPS and method.feature_layers == (*TAPS, 4)
    assert (config.hidden_size, config.vocab_size, config.draft_vocab_size) == (32, 96, 64)
    shapes = {k: tuple(v.shape) for k, v in method.draft.state_dict().items()}
    assert sorted(shapes) == ENGINE_NAMES
    assert shapes["fc.weight"] == (32, 96) and shapes["lm_head.weight"] == (64, 32)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (32, 64)  # 4 heads x 8, input 2H
    assert shapes["midlayer.self_attn.k_proj.weight"][1] == 64
    assert shapes["d2t"] == (64,) and shapes["t2d"] == (96,)
    ids = torch.randint(3, TINY_VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    states = hidden_states(model, ids)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": ids >= 0}
    output = method(batch, {layer: states[layer] for layer in method.feature_layers})
    assert output.loss.ndim == 0 and torch.isfinite(output.loss)
    assert output.metrics["depth1/tokens"] + output.metrics["depth7/tokens"] > 0
    output.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in method.draft.parameters())
    rows = model.get_output_embeddings().weight.detach()[10:74]  # the head starts from the
    assert torch.equal(method_for(model, method.draft.vocab).draft.lm_head.weight, rows)  # target's
    random_head = method_for(model, method.draft.vocab, "eagle3.lm_head_init=random")
    assert not torch.equal(random_head.draft.lm_head.weight, rows)


def test_feature_layers_and_config_validation() -> None:
    assert default_feature_layers(30) == (2, 15, 27)  # SmolLM2: the reference's 2, L//2, L-3
    assert default_feature_layers(7) == (2, 3, 4) and default_feature_layers(4) == TAPS
    with pytest.raises(ValueError, match="at least 4 layers"):
        default_feature_layers(3)
    config = Eagle3Config.from_target(tiny4("gpt2"), draft_vocab_size=500)
    assert config.draft_vocab_size == TINY_VOCAB  # capped at the target vocabulary
    assert config.intermediate_size == 4 * 32  # GPT-2's MLP width
    assert Eagle3Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    for bad in [(3, 2, 1), (0, 1, 2), (1, 1, 2), (1, 2)]:
        with pytest.raises(ValueError, match="feature_layers"):
            Eagle3Config.from_dict({**config.to_dict(), "feature_layers": list(bad)})
    with pytest.raises(ValueError, match="inputs of the target's layers"):
        Eagle3Config.from_target(tiny4("llama"), draft_vocab_size=8, feature_layers=(1, 2, 4))
    with pytest.raises(ValueError, match="unknown keys"):
        Eagle3Config.from_dict({**config.to_dict(), "typo": 1})
    with pytest.raises(ConfigError, match="three increasing"):
        load_config(RunConfig, None, ["eagle3.feature_layers=1,2"])


# ------------------------------------------------------------------------------ training-time test


def test_ttt_mask_is_the_documented_pattern() -> None:
    visible = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
    mask = ttt_attention_mask(visible, 2, torch.float32)[0, 0] == 0
    expected = [
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ]
    assert mask.int().tolist() == expected
    assert ttt_attention_mask(visible, 0, torch.float32).shape == (1, 1, 3, 3)


def test_ttt_unroll_equals_decoding_every_row_from_scratch() -> None:
    draft = random_draft(tiny4("llama"))
    generator = torch.Generator().manual_seed(3)
    fused, embeddings = (
        torch.randn(1, 9, 32, generator=generator),
        torch.randn(1, 9, 32, generator=generator),
    )
    visible = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        fast = ttt_unroll(
            draft, fused, embeddings, positions=torch.arange(9)[None], visible=visible, steps=4
        )
        slow = ttt_unroll_reference(draft, fused, embeddings, 4)
    for step, (got, want) in enumerate(zip(fast, slow, strict=True)):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5, msg=f"step {step}")
    assert not torch.allclose(fast[1], fast[0])  # the steps really differ


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_ttt_rows_of_a_batch_equal_each_sample_alone(layout: str) -> None:
    """Padding and packed samples never leak into a row whose inputs lie inside its sample."""
    draft = random_draft(tiny4("qwen2"))
    generator = torch.Generator().manual_seed(4)
    fused, embeddings = (
        torch.randn(2, 9, 32, generator=generator),
        torch.randn(2, 9, 32, generator=generator),
    )
    if layout == "padded":
        documents = torch.tensor([[0] * 9, [0] * 6 + [-1] * 3])
        positions = torch.arange(9)[None]
        samples = [(0, 0, 9), (1, 0, 6)]  # (batch row, start, length)
    else:
        documents = torch.tensor([[0] * 5 + [1] * 4, [0] * 9])
        positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3], list(range(9))])
        samples = [(0, 0, 5), (0, 5, 4), (1, 0, 9)]
    visible = document_attention_mask(documents)
    with torch.no_grad():
        fast = ttt_unroll(draft, fused, embeddings, positions=positions, visible=visible, steps=3)
        for row, start, length in samples:
            part = slice(start, start + length)
            alone = ttt_unroll_reference(
                draft, fused[row : row + 1, part], embeddings[row : row + 1, part], 3
            )
            for step in range(3):
                inside = length - step - 1  # rows whose tokens x_{t+1 .. t+step+1} are inside
                torch.testing.assert_close(
                    fast[step][row, start : start + inside],
                    alone[step][0, :inside],
                    atol=2e-6,
                    rtol=1e-5,
                )


# ------------------------------------------------------------------------------ the loss

HIDDEN, VOCAB = 8, 12


def sharp_head(scale: float = 50.0) -> Any:
    """A fixed target LM head ``[V, H]``; large logits make its distribution almost one-hot."""
    weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(3)) * scale
    return lambda features: features @ weight.T


def shifted(features: Tensor, offset: int) -> Tensor:
    """Row t = ``features[:, t + offset]`` (zeros past the end)."""
    pad = features.new_zeros(features.shape[0], offset, features.shape[2])
    return torch.cat([features[:, offset:], pad], dim=1)


def test_a_perfect_drafter_scores_the_entropy_and_an_off_by_one_scores_high() -> None:
    """Step j at row t must be scored against the target's distribution at t + j + 1."""
    features = torch.randn(2, 10, HIDDEN, generator=torch.Generator().manual_seed(1))
    head, full = sharp_head(), torch.arange(VOCAB)
    draft_head = head  # draft states are target features, so the draft head is the target's

    def loss(offset: int, target_ids: Tensor = full) -> Any:
        states = [shifted(features, step + offset) for step in range(4)]
        mask = torch.ones(2, 10)
        return eagle3_loss(
            states,
            features,
            mask,
            draft_logits=lambda s: draft_head(s)[:, target_ids],
            target_logits=head,
            target_ids=target_ids,
        )

    right = loss(1)
    assert right.loss.item() == pytest.approx(0.0, abs=1e-3)  # entropy of a sharp head ~ 0
    for step in range(4):
        assert right.metrics[f"depth{step + 1}/top1"] == 1.0
        assert right.metrics[f"depth{step + 1}/tokens"] == 2 * (10 - step - 2)
    for wrong in (loss(0), loss(2)):
        assert wrong.loss.item() > 10.0 and wrong.metrics["depth1/top1"] < 0.5
    subset = torch.tensor([0, 2, 3, 5, 7, 11])  # rows whose target argmax is not drafted drop out
    partial = loss(1, subset)
    argmax = head(features[:, 1:9]).argmax(-1)
    assert partial.metrics["depth1/tokens"] == int(torch.isin(argmax, subset).sum())
    assert partial.metrics["in_vocab"] == pytest.approx(
        float(torch.isin(argmax, subset).float().mean())
    )
    assert partial.loss.item() == pytest.approx(0.0, abs=1e-3)


@pytest.mark.parametrize("packed", [False, True])
def test_fast_loss_and_gradients_equal_the_reference(packed: bool) -> None:
    generator = torch.Generator().manual_seed(7)
    target = torch.randn(3, 11, HIDDEN, generator=generator)
    states = [torch.randn(3, 11, HIDDEN, generator=generator, requires_grad=True) for _ in range(5)]
    mask = torch.randint(0, 2, (3, 11), generator=generator)
    documents = torch.tensor([[0] * 4 + [1] * 7, [0] * 11, [0] * 6 + [-1] * 5]) if packed else None
    target_ids = torch.tensor([1, 2, 4, 5, 6, 8, 9, 10])
    draft_weight = torch.randn(8, HIDDEN, generator=generator)
    settings: dict[str, Any] = {
        "draft_logits": lambda s: s @ draft_weight.T,
        "target_logits": sharp_head(scale=1.0),
        "target_ids": target_ids,
        "decay": 0.7,
        "document_ids": documents,
    }
    fast = eagle3_loss(states, target, mask, **settings)
    slow = eagle3_loss_reference(states, target, mask, **settings)
    torch.testing.assert_close(fast.loss, slow.loss, rtol=1e-5, atol=1e-6)
    assert fast.metrics.keys() == slow.metrics.keys()
    for name, value in fast.metrics.items():
        assert value == pytest.approx(slow.metrics[name], rel=1e-5, abs=1e-6), name
    assert fast.metrics["depth1/tokens"] > 0
    fast_grads = torch.autograd.grad(fast.loss, states, allow_unused=True, materialize_grads=True)
    slow_grads = torch.autograd.grad(slow.loss, states, allow_unused=True, materialize_grads=True)
    for got, want in zip(fast_grads, slow_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ the loop

REPLIES = ("It is four.", "Hello! How can I help you today?", "The quick brown fox.", "I am fine.")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny 4-layer Llama target folder (vocab 400, ChatML) and a 24-conversation data file.
    Its LM head is scaled x30: the random target's own distributions are then peaked, so a
    drafter that learns them can bring the soft cross-entropy well below log(draft vocab)."""
    root = tmp_path_factory.mktemp("eagle3")
    target = tiny4("llama", vocab_size=400)
    target.lm_head.weight = torch.nn.Parameter(target.lm_head.weight.detach() * 30.0)
    target.save_pretrained(root / "target")
    smollm2_tokenizer().save_pretrained(root / "target")
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}: what is two plus two?"},
                {"role": "assistant", "content": REPLIES[i % len(REPLIES)] * (1 + i % 3)},
            ]
        }
        for i in range(24)
    ]
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), "utf-8")
    return root


def test_training_through_the_loop_lowers_the_eval_loss(workspace: Path) -> None:
    config = load_config(
        RunConfig,
        None,
        [
            f"target.name={workspace / 'target'}",
            "target.device=cpu",
            f"data.sources={workspace / 'chat.jsonl'}",
            "data.max_length=64",
            "data.eval_fraction=0.2",
            "train.method=eagle3",
            f"train.output_dir={workspace / 'run'}",
            "train.lr=1e-2",
            "train.warmup_steps=2",
            "train.max_steps=24",
            "train.batch_size=4",
            "train.eval_every=4",
            "train.save_every=24",
            "eagle3.draft_vocab_size=256",
            "eagle3.ttt_steps=3",
        ],
    )
    run_dir = loop.train(config)
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    first, last = evals[0], evals[-1]
    assert last["eval/loss"] < 0.8 * first["eval/loss"]
    assert last["eval/depth1/top1"] > first["eval/depth1/top1"] + 0.2
    assert last["eval/depth3/top1"] > first["eval/depth3/top1"]  # deeper steps learn too
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["method"] == "eagle3"
    assert saved["head_config"]["feature_layers"] == list(TAPS)
    assert saved["head_config"]["draft_vocab_size"] == 256
    target = load_target(workspace / "target", device="cpu")
    dataset, _ = build_dataset(target.tokenizer, workspace / "chat.jsonl", max_length=64)
    counts = token_counts(zip(dataset["input_ids"], dataset["loss_mask"], strict=True), 400)
    weights = load_file(str(run_dir / "model.safetensors"))
    assert weights["d2t"].tolist() == choose_vocab(counts, 256).d2t.tolist()  # most frequent
    assert bool(weights["t2d"][torch.nonzero(counts.trained)[:, 0]].all())  # all trained tokens
    drafter = load_drafter(run_dir, target.model, **TREE)
    assert isinstance(drafter, Eagle3Drafter) and drafter.hidden_layers == TAPS
    prompt = torch.tensor(dataset[0]["input_ids"][:12])
    truth = hf_greedy(target.model, prompt, 16, eos=None)
    result = generate(target.model, prompt, drafter=drafter, max_new_tokens=16, eos_token_ids=())
    assert result.tokens == truth


def test_offline_features_give_the_online_vocabulary_and_loss(
    workspace: Path, tmp_path: Path
) -> None:
    overrides = [
        f"target.name={workspace / 'target'}",
        f"data.sources={workspace / 'chat.jsonl'}",
        "data.max_length=64",
        "train.method=eagle3",
        "eagle3.draft_vocab_size=64",
    ]
    target = load_target(workspace / "target", device="cpu")
    torch.manual_seed(0)
    online = build_method(load_config(RunConfig, None, overrides), target)
    dataset, _ = build_dataset(target.tokenizer, workspace / "chat.jsonl", max_length=64)
    dataset = dataset.select_columns(["input_ids", "loss_mask"])
    cache_features(
        target.model,
        dataset,
        tmp_path / "cache",
        layers=online.feature_layers,
        dtype=torch.float32,
        shard_samples=10,
    )
    offline_config = [
        *overrides,
        "data.features=offline",
        f"data.features_dir={tmp_path / 'cache'}",
    ]
    torch.manual_seed(0)
    offline = build_method(load_config(RunConfig, None, offline_config), target)
    assert torch.equal(offline.draft.d2t, online.draft.d2t)
    batch = pad_collate([dataset[i] for i in range(5)], pad_token_id=0)
    cached = CachedFeatureDataset(tmp_path / "cache")
    offline_batch = collate_cached([cached[i] for i in range(5)], pad_token_id=0)
    layers = online.feature_layers
    with torch.no_grad():
        from_online = online(batch, OnlineFeatures(target.model, layers)(batch))
        from_offline = offline(offline_batch, cached_hidden(offline_batch, layers))
    torch.testing.assert_close(from_offline.loss, from_online.loss, rtol=1e-5, atol=1e-6)
    cache_features(target.model, dataset, tmp_path / "last", layers=(4,), shard_samples=30)
    last_only = [*overrides, "data.features=offline", f"data.features_dir={tmp_path / 'last'}"]
    with pytest.raises(ConfigError, match="--layers 1,2,3,4"):
        build_method(load_config(RunConfig, None, last_only), target)


# ------------------------------------------------------------------------------ the drafter


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("kind", ["random", "trained"])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_greedy_output_equals_transformers(family: str, kind: str, shape: str) -> None:
    model, truth = target_and_truth(family)
    settings = CHAIN if shape == "chain" else TREE
    draft = random_draft(model) if kind == "random" else trained(family)
    drafter = Eagle3Drafter(draft, TargetHead.of(model), **settings)
    result = generate(model, PROMPT, drafter=drafter, max_new_tokens=NEW_TOKENS, eos_token_ids=())
    assert result.tokens == truth
    if kind == "trained":  # drafts line up with what training taught: most steps accept a lot
        assert result.tau > 2.5, result.accept_lengths


def fed(drafter: Eagle3Drafter, model: Any, sequence: Tensor) -> Eagle3Drafter:
    """``drafter`` after begin + one observe of every pair of ``sequence`` (true features)."""
    states = hidden_states(model, sequence[None])
    drafter.begin(sequence[:1])
    drafter.observe(sequence[1:], tuple(states[layer][0, :-1] for layer in TAPS))
    return drafter


def test_draft_ids_are_mapped_to_target_ids() -> None:
    """A vocabulary of target ids 60..91 only: every proposed token is one of them, and the
    proposals are the draft head's top-k shifted by d2t."""
    model, truth = target_and_truth("llama")
    vocab = DraftVocab.from_target_ids(range(60, 92), TINY_VOCAB)
    drafter = Eagle3Drafter(random_draft(model, vocab), TargetHead.of(model), **TREE)
    sequence = torch.cat([PROMPT, torch.tensor(truth[:4])])
    tree = fed(drafter, model, sequence).propose(sequence)
    assert tree.size == TREE["total_tokens"] - 1
    assert all(60 <= token < 92 for token in tree.tokens.tolist())
    with torch.no_grad():
        root_logits = drafter.draft3.logits(drafter._root_feature)  # type: ignore[arg-type]
    best_draft_ids = root_logits.topk(TREE["top_k"]).indices
    first_level = tree.tokens[tree.parents == -1].tolist()
    assert set(first_level) <= set((best_draft_ids + 60).tolist())


def test_the_drafter_reads_what_training_fed_and_drafts_its_argmax() -> None:
    """After observing a sequence, the root state is TTT step 0 at the last committed row (same
    feature layers, same order, same fc), and the chain drafter proposes the argmax chain of a
    from-scratch causal decode that feeds each drafted token and state back in."""
    model, truth = target_and_truth("gpt2")
    draft, head = trained("gpt2"), TargetHead.of(model)
    sequence = torch.cat([PROMPT, torch.tensor(truth[:6])])
    drafter = fed(Eagle3Drafter(draft, head, **CHAIN), model, sequence)
    states = hidden_states(model, sequence[None])
    with torch.no_grad():
        features = draft.fuse(torch.cat([states[layer] for layer in TAPS], dim=-1))[0, :-1]
        tokens = sequence[1:]  # committed pairs (g_t, x_{t+1}), t < n - 1
        state = draft(features[None], head.embed_tokens(tokens, torch.float32)[None])[0, -1]
        torch.testing.assert_close(drafter._root_feature, state, atol=1e-5, rtol=1e-5)
        chain = []
        for _ in range(CHAIN["depth"]):
            chain.append(int(draft.vocab.to_target(draft.logits(state).argmax())))
            features = torch.cat([features, state[None]])
            tokens = torch.cat([tokens, torch.tensor(chain[-1:])])
            embedded = head.embed_tokens(tokens, torch.float32)[None]
            state = draft(features[None], embedded)[0, -1]
    assert drafter.propose(sequence).tokens.tolist() == chain


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_kv_rollback_gives_the_drafts_of_a_fresh_drafter(family: str) -> None:
    model, _ = target_and_truth(family)
    recorder = Recorder(Eagle3Drafter(trained(family), TargetHead.of(model), **TREE))  # type: ignore[arg-type]
    generate(model, PROMPT, drafter=recorder, max_new_tokens=20, eos_token_ids=())
    assert len(recorder.proposals) > 3
    fresh = Eagle3Drafter(trained(family), TargetHead.of(model), **TREE)
    for sequence, tree in recorder.proposals:
        again = fed(fresh, model, sequence).propose(sequence)
        assert again.tokens.tolist() == tree.tokens.tolist()
        assert again.parents.tolist() == tree.parents.tolist()


SAMPLES = 1500


def test_sampling_follows_the_target_distribution() -> None:
    """The first two sampled tokens follow the target's exact two-token distribution, with a
    drafter trained on (PROMPT, t1, greedy t2) for every t1 so that drafts are often accepted."""
    model = tiny4("gpt2")
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 5.0)
    params = SamplingParams(temperature=1.0)
    first, second = exact_two_token_probs(model, params)
    extended = torch.cat(
        [
            PROMPT.expand(TINY_VOCAB, -1),
            torch.arange(TINY_VOCAB)[:, None],
            second.argmax(-1)[:, None],
        ],
        dim=1,
    )
    draft = fit_method(model, extended, steps=120, size=TINY_VOCAB).draft
    drafter = Recorder(Eagle3Drafter(draft, TargetHead.of(model), top_k=3, depth=2, total_tokens=7))  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(5)
    counts = torch.zeros(TINY_VOCAB * TINY_VOCAB)
    accepted = 0
    for _ in range(SAMPLES):
        result = generate(
            model,
            PROMPT,
            drafter=drafter,
            max_new_tokens=2,
            sampling=params,
            eos_token_ids=(),
            generator=generator,
        )
        counts[result.tokens[0] * TINY_VOCAB + result.tokens[1]] += 1
        tree = drafter.proposals[-1][1]
        accepted += result.tokens[1] in tree.tokens[tree.parents == -1].tolist()
    exact = (first[:, None] * second).flatten()
    assert not bool(counts[exact == 0].any())
    statistic, bound = chi_square(counts, exact)
    assert statistic < bound, (statistic, bound)
    assert accepted > SAMPLES / 3


def test_one_token_follows_the_reference_formula() -> None:
    """With one pair, attention is the value of that pair, so the layer must equal
    ``g + o(v([norm_in(e); norm_h(g)]))`` then ``+ mlp(norm_post(.))`` (reference
    ``LlamaDecoderLayeremb``: embedding first, residual = the un-normed fused feature)."""
    draft = random_draft(tiny4("llama"))
    for module in (draft.midlayer.input_layernorm, draft.midlayer.hidden_norm, draft.norm):
        torch.nn.init.uniform_(module.weight, 0.5, 1.5)  # distinguishable norms
    layer = draft.midlayer
    generator = torch.Generator().manual_seed(9)
    fused, embedding = (
        torch.randn(1, 1, 32, generator=generator),
        torch.randn(1, 1, 32, generator=generator),
    )
    with torch.no_grad():
        joint = torch.cat([layer.input_layernorm(embedding), layer.hidden_norm(fused)], dim=-1)
        values = layer.self_attn.v_proj(joint).view(1, 2, 8).repeat_interleave(2, dim=1)
        hidden = fused + layer.self_attn.o_proj(values.reshape(1, 1, 32))
        expected = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        torch.testing.assert_close(draft(fused, embedding), expected, atol=1e-6, rtol=1e-5)
        logits = draft.lm_head(draft.norm(expected))
        torch.testing.assert_close(draft.logits(expected), logits)
