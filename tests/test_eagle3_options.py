"""EAGLE-3 training options (issue 33): EAGLE-3.1's ``eagle3.fc_norm`` / ``eagle3.norm_output``
and the LK losses (``eagle3.loss``). The draft model against the same weights with the norms
applied by hand, training-time test and the drafter handing the normed state on, a few training
steps with each option, a run through the real loop, the speculators round trip (identical
tensors, identical fp32 greedy output), eagle3-hf's refusal, and the default path unchanged."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor

from headway.config import load_config
from headway.decode.generate import generate
from headway.drafters.eagle3_drafter import Eagle3Drafter
from headway.heads.eagle import TargetHead
from headway.heads.eagle3 import Eagle3Config, Eagle3Model
from headway.heads.format_eagle3 import export_eagle3, import_eagle3
from headway.heads.format_speculators import (
    export_speculators,
    import_speculators,
    speculators_tensor_names,
)
from headway.heads.io import HeadsError, load_heads, save_heads
from headway.heads.vocab import choose_vocab, token_counts
from headway.run_config import RunConfig
from headway.target import fingerprint
from headway.train import loop
from headway.train.method_eagle3 import Eagle3, ttt_unroll, ttt_unroll_reference
from tests.drafting import heads_drafter as load_drafter
from tests.test_eagle3 import (
    CHAIN,
    ENGINE_NAMES,
    PROMPT,
    TAPS,
    TREE,
    hidden_states,
    method_for,
    target_and_truth,
    tiny4,
)
from tests.test_generate import hf_greedy
from tests.tiny import TINY_VOCAB
from tests.tokenizers_fixture import smollm2_tokenizer

FC_NORM_NAMES = ["fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"]
HEAD_CONFIG_KEYS = sorted(  # Eagle3Config.to_dict() of every run before the options existed
    [
        *("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"),
        *("head_dim", "vocab_size", "draft_vocab_size", "feature_layers", "hidden_act"),
        *("rms_norm_eps", "rope_theta", "max_position_embeddings", "rope_scaling"),
    ]
)
OPTIONS = {
    "fc_norm": ["eagle3.fc_norm=true"],
    "norm_output": ["eagle3.norm_output=true"],
    "lk_alpha": ["eagle3.loss=lk_alpha"],
    "lk_lambda": ["eagle3.loss=lk_lambda"],
}


@cache
def sharp_target() -> tuple[Any, list[int]]:
    """A tiny target whose LM head is scaled x30 (peaked distributions, so a drafter that learns
    them brings the loss well down) and its greedy continuation of ``PROMPT``."""
    model = tiny4("llama")
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 30.0)
    return model, hf_greedy(model, PROMPT, 32, eos=None)


def option_draft(model: Any, *, fc_norm: bool = False, norm_output: bool = False) -> Eagle3Model:
    """A random draft model with the options, its norm weights away from 1."""
    torch.manual_seed(1)
    config = Eagle3Config.from_target(
        model, draft_vocab_size=64, fc_norm=fc_norm, norm_output=norm_output
    )
    draft = Eagle3Model(config)
    with torch.no_grad():
        for name, weight in draft.named_parameters():
            if name.endswith("norm.weight") or name.startswith("fc_norm."):
                weight.uniform_(0.5, 1.5)
    return draft.eval()


def without_options(draft: Eagle3Model) -> Eagle3Model:
    """The same weights in a model without the options (their norms are applied by hand)."""
    plain = Eagle3Model(replace(draft.config, fc_norm=False, norm_output=False))
    state = {k: v for k, v in draft.state_dict().items() if not k.startswith("fc_norm.")}
    plain.load_state_dict(state)
    return plain.eval()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


# ------------------------------------------------------------------------------ the draft model


def test_fc_norm_normalises_each_feature_layer_before_fc() -> None:
    draft = option_draft(tiny4("llama"), fc_norm=True)
    assert sorted(draft.state_dict()) == sorted([*ENGINE_NAMES, *FC_NORM_NAMES])
    assert all(draft.state_dict()[name].shape == (32,) for name in FC_NORM_NAMES)
    generator = torch.Generator().manual_seed(0)
    scales = torch.tensor([1.0, 10.0, 100.0]).repeat_interleave(32)  # layers of unlike scales
    features = torch.randn(2, 5, 96, generator=generator) * scales
    eps = draft.config.rms_norm_eps
    assert draft.fc_norm is not None
    weights = [draft.state_dict()[name] for name in FC_NORM_NAMES]
    slices = [rms_norm(features[..., 32 * i : 32 * (i + 1)], weights[i], eps) for i in range(3)]
    with torch.no_grad():
        by_hand = torch.cat(slices, dim=-1) @ draft.fc.weight.T
        torch.testing.assert_close(draft.fuse(features), by_hand)
        louder = features * torch.tensor([7.0, 1.0, 1.0]).repeat_interleave(32)
        torch.testing.assert_close(draft.fuse(louder), by_hand, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(without_options(draft).fuse(features), by_hand)


def test_norm_output_hands_the_normed_state_on() -> None:
    """The LM head reads norm(s) either way; the next step reads norm(s), not s."""
    draft = option_draft(tiny4("llama"), norm_output=True)
    plain = without_options(draft)
    assert sorted(draft.state_dict()) == ENGINE_NAMES  # no weight of its own
    generator = torch.Generator().manual_seed(0)
    fused, embedded = torch.randn(1, 4, 32, generator=generator), torch.randn(1, 5, 32)
    with torch.no_grad():
        states = plain(fused, embedded[:, :4])
        handed = draft(fused, embedded[:, :4])
        torch.testing.assert_close(handed, plain.norm(states))
        torch.testing.assert_close(draft.logits(handed), plain.logits(states))
        after = draft(torch.cat([fused, handed[:, -1:]], dim=1), embedded)
        normed = plain.norm(states)[:, -1:]
        want = plain.norm(plain(torch.cat([fused, normed], dim=1), embedded))
        torch.testing.assert_close(after, want)
        raw = plain.norm(plain(torch.cat([fused, states[:, -1:]], dim=1), embedded))
        assert not torch.allclose(raw[:, -1], want[:, -1], atol=1e-3)  # s would differ


@pytest.mark.parametrize(("fc_norm", "norm_output"), [(True, False), (False, True), (True, True)])
def test_ttt_unroll_equals_decoding_from_scratch_with_the_options(
    fc_norm: bool, norm_output: bool
) -> None:
    draft = option_draft(tiny4("llama"), fc_norm=fc_norm, norm_output=norm_output)
    generator = torch.Generator().manual_seed(3)
    taps, embedded = torch.randn(1, 9, 96, generator=generator), torch.randn(1, 9, 32)
    visible = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        fused = draft.fuse(taps)
        positions = torch.arange(9)[None]
        fast = ttt_unroll(draft, fused, embedded, positions=positions, visible=visible, steps=4)
        slow = ttt_unroll_reference(draft, fused, embedded, 4)
    for step, (got, want) in enumerate(zip(fast, slow, strict=True)):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5, msg=f"step {step}")


def test_the_drafter_chains_the_normed_states_training_fed() -> None:
    """A chain drafter with norm_output proposes the argmax chain of a decode by the model
    without the option that applies the final norm to each state it hands on by hand."""
    model, truth = target_and_truth("llama")
    draft = option_draft(model, fc_norm=True, norm_output=True)
    plain, head = without_options(draft), TargetHead.of(model)
    sequence = torch.cat([PROMPT, torch.tensor(truth[:6])])
    states = hidden_states(model, sequence[None])
    drafter = Eagle3Drafter(draft, head, **CHAIN)
    drafter.begin(sequence[:1])
    drafter.observe(sequence[1:], tuple(states[layer][0, :-1] for layer in TAPS))
    with torch.no_grad():
        features = draft.fuse(torch.cat([states[layer] for layer in TAPS], dim=-1))[0, :-1]
        tokens = sequence[1:]
        state = plain.norm(plain(features[None], head.embed_tokens(tokens, torch.float32)[None]))
        chain = []
        for _ in range(CHAIN["depth"]):
            last = state[0, -1]
            chain.append(int(draft.vocab.to_target(plain.lm_head(last).argmax())))
            features = torch.cat([features, last[None]])
            tokens = torch.cat([tokens, torch.tensor(chain[-1:])])
            embedded = head.embed_tokens(tokens, torch.float32)[None]
            state = plain.norm(plain(features[None], embedded))
    assert drafter.propose(sequence).tokens.tolist() == chain


# ------------------------------------------------------------------------------ training


def fit(model: Any, sequence: Tensor, overrides: list[str], steps: int) -> tuple[Eagle3, list[Any]]:
    """Train an EAGLE-3 method with ``overrides`` on one repeated batch; its outputs per step."""
    torch.manual_seed(0)
    vocab = choose_vocab(token_counts([(sequence, torch.ones_like(sequence))], TINY_VOCAB), 64)
    method = method_for(model, vocab, "eagle3.ttt_steps=3", *overrides)
    batch = {
        "input_ids": sequence[None],
        "attention_mask": torch.ones_like(sequence)[None],
        "loss_mask": torch.ones_like(sequence)[None],
    }
    found = hidden_states(model, sequence[None])
    hidden = {layer: found[layer] for layer in method.feature_layers}
    optimizer = torch.optim.Adam(method.parameters(), lr=1e-2)
    outputs = []
    for _ in range(steps):
        output = method(batch, hidden)
        optimizer.zero_grad()
        output.loss.backward()
        optimizer.step()
        outputs.append(output)
    return method.eval(), outputs


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_each_option_trains_on_a_repeated_batch(option: str) -> None:
    model, truth = sharp_target()
    method, outputs = fit(model, torch.cat([PROMPT, torch.tensor(truth)]), OPTIONS[option], 30)
    losses = [float(output.loss.detach()) for output in outputs]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.7 * losses[0], losses
    assert outputs[-1].metrics["depth3/top1"] > outputs[0].metrics["depth3/top1"]
    config = method.head_config
    assert (config.fc_norm, config.norm_output) == (option == "fc_norm", option == "norm_output")
    names = sorted(method.export()[1])
    assert names == sorted([*ENGINE_NAMES, *(FC_NORM_NAMES if option == "fc_norm" else [])])
    if option.startswith("lk_"):  # the acceptance rate it optimises rises
        assert outputs[-1].metrics["depth1/alpha"] > outputs[0].metrics["depth1/alpha"] + 0.2
    else:
        assert "depth1/alpha" not in outputs[-1].metrics


def test_a_run_with_every_option_through_the_loop(tmp_path: Path) -> None:
    """The options reach the run's head config and the drafter that reads it back is lossless."""
    target = tiny4("llama", vocab_size=400)
    target.save_pretrained(tmp_path / "target")
    smollm2_tokenizer().save_pretrained(tmp_path / "target")
    turns = [(f"q{i}", "ok " * (i % 5 + 2)) for i in range(12)]
    rows = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        for q, a in turns
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), "utf-8")
    options = ["eagle3.fc_norm=true", "eagle3.norm_output=true", "eagle3.loss=lk_lambda"]
    settings = [f"target.name={tmp_path / 'target'}", f"data.sources={tmp_path / 'chat.jsonl'}"]
    config = load_config(
        RunConfig,
        None,
        [
            *settings,
            *options,
            "target.device=cpu",
            "data.max_length=64",
            "train.method=eagle3",
            f"train.output_dir={tmp_path / 'run'}",
            "train.max_steps=4",
            "train.warmup_steps=1",
            "train.eval_every=4",
            "train.save_every=4",
            "eagle3.draft_vocab_size=128",
            "eagle3.ttt_steps=2",
        ],
    )
    run_dir = loop.train(config)
    head_config = json.loads((run_dir / "config.json").read_text())["head_config"]
    assert head_config["fc_norm"] is True and head_config["norm_output"] is True
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert 0 < evals[-1]["eval/depth1/alpha"] <= 1
    assert set(FC_NORM_NAMES) <= set(load_file(run_dir / "model.safetensors"))
    prompt = torch.tensor([1, 5, 17, 33, 8, 40])
    drafter = load_drafter(run_dir, target, **TREE)
    result = generate(target, prompt, drafter=drafter, max_new_tokens=12, eos_token_ids=())
    assert result.tokens == hf_greedy(target, prompt, 12, eos=None)


# ------------------------------------------------------------------------------ exports


@pytest.fixture(scope="module")
def option_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of an EAGLE-3.1 drafter (both norms, LK loss) trained on the target's greedy text."""
    model, truth = target_and_truth("llama")
    options = [*OPTIONS["fc_norm"], *OPTIONS["norm_output"], *OPTIONS["lk_lambda"]]
    method, _ = fit(model, torch.cat([PROMPT, torch.tensor(truth)]), options, 120)
    head_config, state = method.export()
    return save_heads(
        tmp_path_factory.mktemp("eagle31") / "run",
        method="eagle3",
        head_config=head_config,
        state_dict=state,
        target_fingerprint=fingerprint(model),
        target_name="org/tiny-llama",
    )


def test_speculators_round_trip_keeps_tensors_and_greedy_output(
    option_run: Path, tmp_path: Path
) -> None:
    model, truth = target_and_truth("llama")
    out = export_speculators(option_run, tmp_path / "export")
    engine = json.loads((out / "config.json").read_text())
    assert engine["fc_norm"] is True and engine["norm_output"] is True
    assert engine["norm_before_fc"] is False and engine["norm_before_residual"] is False
    tensors = load_file(out / "model.safetensors")
    native, imported = load_heads(option_run), import_speculators(out)
    assert isinstance(imported.config, Eagle3Config)
    assert sorted(tensors) == speculators_tensor_names(imported.config)
    assert set(FC_NORM_NAMES) <= set(tensors)  # the names vLLM loads (model.fc_norm.{i})
    assert imported.config == Eagle3Config.from_dict(native.head_config)
    assert imported.state_dict.keys() == native.state_dict.keys()
    for name, tensor in native.state_dict.items():
        assert torch.equal(imported.state_dict[name], tensor), name
    from_run, from_export = (load_drafter(path, model, **TREE) for path in (option_run, out))
    results = [
        generate(model, PROMPT, drafter=drafter, max_new_tokens=24, eos_token_ids=())
        for drafter in (from_run, from_export)
    ]
    assert results[0].tokens == results[1].tokens == truth[:24]  # fp32 greedy: lossless
    assert results[0].accept_lengths == results[1].accept_lengths
    assert results[0].tau > 2.0


def test_eagle3_hf_refuses_the_options_in_one_line(option_run: Path, tmp_path: Path) -> None:
    with pytest.raises(HeadsError) as error:
        export_eagle3(option_run, tmp_path / "hf")
    assert "\n" not in str(error.value) and "use --format speculators" in str(error.value)
    assert "fc_norm, norm_output" in str(error.value) and not (tmp_path / "hf").exists()
    plain = tiny4("llama")
    config = Eagle3Config.from_target(plain, draft_vocab_size=64)
    run = save_heads(
        tmp_path / "plain",
        method="eagle3",
        head_config=config.to_dict(),
        state_dict=Eagle3Model(config).state_dict(),
        target_fingerprint=fingerprint(plain),
        target_name="t",
    )
    folder = export_eagle3(run, tmp_path / "flagged")
    engine = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**engine, "norm_output": True}))
    with pytest.raises(HeadsError, match=r"sets norm_output \(EAGLE-3.1\).*speculators format"):
        import_eagle3(folder)


def test_the_default_path_is_unchanged(tmp_path: Path) -> None:
    """No option: the old head config keys and state dict keys, and exports byte for byte those
    of a run that spells the options out as false."""
    model: Any = tiny4("llama")
    config = Eagle3Config.from_target(model, draft_vocab_size=64)
    assert sorted(config.to_dict()) == HEAD_CONFIG_KEYS
    method = method_for(model, option_draft(model).vocab)
    assert sorted(method.export()[0]) == HEAD_CONFIG_KEYS
    assert sorted(method.export()[1]) == ENGINE_NAMES and method.lk is None
    torch.manual_seed(0)
    state = Eagle3Model(config).state_dict()
    spelled = {**config.to_dict(), "fc_norm": False, "norm_output": False}
    exports = []
    for name, head_config in (("implicit", config.to_dict()), ("spelled", spelled)):
        run = save_heads(
            tmp_path / name,
            method="eagle3",
            head_config=head_config,
            state_dict=state,
            target_fingerprint=fingerprint(model),
            target_name="t",
        )
        assert Eagle3Config.from_dict(load_heads(run).head_config) == config
        writers = (export_speculators, export_eagle3)
        exports.append([write(run, tmp_path / f"{name}-{write.__name__}") for write in writers])
    for first, second in zip(*exports, strict=True):
        for file in ("config.json", "model.safetensors"):
            assert (first / file).read_bytes() == (second / file).read_bytes()
    engine = json.loads((exports[0][0] / "config.json").read_text())
    assert (engine["fc_norm"], engine["norm_output"]) == (False, False)
    assert "fc_norm" not in json.loads((exports[0][1] / "config.json").read_text())
