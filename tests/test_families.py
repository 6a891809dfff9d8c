"""Any causal LM as target (issue #16): the popular families beyond tests/tiny.py decode with
prompt lookup and a tree drafter exactly as transformers' greedy decoding does (fp32); a model
without sdpa is loaded with eager attention; decoding past a sliding window, and past a chunk of
chunked attention (Llama 4), is exact; a target with recurrent layers is refused in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from headway.decode.generate import Decoder, Drafter, generate
from headway.decode.local_attention import sliding_window
from headway.decode.options import DecodeOptions
from headway.drafters.eagle3_drafter import Eagle3Drafter
from headway.drafters.lookup import PromptLookupDrafter
from headway.drafters.medusa_drafter import MedusaDrafter
from headway.drafters.oracle import OracleDrafter
from headway.errors import HeadwayError, SlidingWindowError, TargetError
from headway.heads.eagle import TargetHead
from headway.heads.eagle3 import Eagle3Config, Eagle3Model
from headway.heads.hidden_states import check_final_hidden, final_hidden_layer
from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.heads.vocab import DraftVocab
from headway.target import load_target
from tests.families import FAMILIES, RECURRENT, VOCAB, family_config, family_model
from tests.test_eagle3 import TREE as EAGLE3_TREE
from tests.test_generate import PROMPT, hf_greedy
from tests.tokenizers_fixture import smollm2_tokenizer

NEW_TOKENS = 30


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_equals_transformers(family: str) -> None:
    model = family_model(family)
    truth = hf_greedy(model, PROMPT, NEW_TOKENS, eos=None)
    assert len(set(truth)) > 3  # a model that repeats one token would prove nothing
    drafters: dict[str, Drafter] = {
        "prompt-lookup": PromptLookupDrafter(num_draft_tokens=5, max_nodes=12),
        "oracle-tree": OracleDrafter(truth, 4, width=3),
    }
    for name, drafter in drafters.items():
        result = generate(
            model, PROMPT, drafter=drafter, max_new_tokens=NEW_TOKENS, eos_token_ids=()
        )
        assert result.tokens == truth, name
    assert result.tau > 4  # the oracle tree was verified several tokens at a time


@pytest.mark.parametrize("family", FAMILIES)
def test_the_static_verify_path_is_exact_for_every_family(family: str) -> None:
    """``--verify auto`` takes the static path (captured) on CUDA for any target: plain decoding
    and an oracle tree over the static cache (uncaptured here, the same buffers and masks a CUDA
    graph replays) give transformers' greedy output for every family."""
    model = family_model(family)
    truth = hf_greedy(model, PROMPT, NEW_TOKENS, eos=None)
    for drafter in (None, OracleDrafter(truth, 4, width=3)):
        decoder = Decoder(model, drafter, DecodeOptions(verify="captured"))
        result = decoder.generate(PROMPT, max_new_tokens=NEW_TOKENS, eos_token_ids=())
        assert result.tokens == truth, drafter


@pytest.mark.parametrize("family", FAMILIES)
def test_trained_drafter_kinds_are_exact_or_refused_in_one_line(family: str) -> None:
    """Medusa heads and an EAGLE-3 draft model (random weights) on a 4-layer target of each
    family: the output is the target's own greedy output, or the drafter is refused at build
    time with one of headway's one-line errors (Gemma 3n: its hidden states carry its AltUp
    streams, which the build's probe of the hidden states, ``check_final_hidden``, refuses)."""
    model = family_model(family, layers=4)
    truth = hf_greedy(model, PROMPT, NEW_TOKENS, eos=None)
    try:
        check_final_hidden(model, final_hidden_layer(model))  # as drafters/build.py does
    except TargetError as error:
        assert "\n" not in str(error) and family == "gemma3n-text", error
        return
    built: dict[str, Any] = {}
    try:
        hidden = int(model.config.get_text_config().hidden_size)
        torch.manual_seed(1)
        heads = MedusaHeads(MedusaConfig(2, 1, hidden, VOCAB), model.get_output_embeddings().weight)
        built["medusa"] = MedusaDrafter(heads.eval(), hidden_layer=final_hidden_layer(model))
    except HeadwayError as error:
        assert "\n" not in str(error)
    torch.manual_seed(1)
    vocab = DraftVocab.identity(64, VOCAB)
    draft = Eagle3Model(Eagle3Config.from_target(model, draft_vocab_size=vocab.size))
    draft.set_vocab(vocab)
    built["eagle3"] = Eagle3Drafter(draft.eval(), TargetHead.of(model), **EAGLE3_TREE)
    for name, drafter in built.items():
        result = generate(
            model, PROMPT, drafter=drafter, max_new_tokens=NEW_TOKENS, eos_token_ids=()
        )
        assert result.tokens == truth, name


def test_a_model_without_sdpa_loads_with_eager_attention(tmp_path: Path) -> None:
    family_model("gemma2").save_pretrained(tmp_path / "gemma2")
    smollm2_tokenizer().save_pretrained(tmp_path / "gemma2")
    target = load_target(tmp_path / "gemma2", device="cpu")  # "auto"
    assert target.model.config._attn_implementation == "eager"
    with pytest.raises(TargetError, match="does not support attn_implementation='sdpa'"):
        load_target(tmp_path / "gemma2", device="cpu", attn_implementation="sdpa")


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3-text"])
def test_decoding_past_a_sliding_window_is_exact(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An 8-token window, a 9-token prompt and 30 new tokens: every tree reaches past the
    window, and the output is still transformers' own greedy output (whose cache drops what
    slid out). Mistral and a 4-layer Gemma 3 slide on every layer; Gemma 2 alternates sliding
    and full layers (one mask per layer type)."""
    from headway.decode import kv

    windowed: list[object] = []

    def spy(model: Any, mask: Any, positions: Any, prefix_len: int) -> Any:
        masks = kv_windowed_masks(model, mask, positions, prefix_len)
        if masks is not mask:
            windowed.append(type(masks))
        return masks

    kv_windowed_masks = kv.windowed_masks
    monkeypatch.setattr(kv, "windowed_masks", spy)
    config = family_config(family, layers=4)
    config.sliding_window = 8
    torch.manual_seed(0)
    model = type(family_model(family))(config).eval()
    assert sliding_window(model)[0] == 8
    truth = hf_greedy(model, PROMPT, NEW_TOKENS, eos=None)
    assert len(set(truth)) > 3
    torch.manual_seed(1)
    vocab = DraftVocab.identity(64, VOCAB)
    draft = Eagle3Model(Eagle3Config.from_target(model, draft_vocab_size=vocab.size))
    draft.set_vocab(vocab)
    drafters: dict[str, Drafter] = {
        "prompt-lookup": PromptLookupDrafter(num_draft_tokens=5, max_nodes=12),
        "oracle-tree": OracleDrafter(truth, 4, width=3),
        "eagle3": Eagle3Drafter(draft.eval(), TargetHead.of(model), **EAGLE3_TREE),
    }
    for name, drafter in drafters.items():
        result = generate(
            model, PROMPT, drafter=drafter, max_new_tokens=NEW_TOKENS, eos_token_ids=()
        )
        assert result.tokens == truth, name
    assert set(windowed) == {dict if family == "gemma2" else torch.Tensor}


def test_a_mixed_model_that_takes_one_mask_is_refused_past_the_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from headway.decode import local_attention

    config = family_config("gemma2", layers=4)
    config.sliding_window = 8
    model = type(family_model("gemma2"))(config).eval()
    monkeypatch.setattr(local_attention, "takes_mask_mapping", lambda model: False)
    truth = hf_greedy(model, PROMPT, NEW_TOKENS, eos=None)
    with pytest.raises(SlidingWindowError, match=r"sliding-window \(8 tokens\) and full"):
        generate(
            model,
            PROMPT,
            drafter=OracleDrafter(truth, 4, width=3),
            max_new_tokens=4,
            eos_token_ids=(),
        )


def test_decoding_past_a_chunk_of_chunked_attention_is_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Llama 4's RoPE layers attend within chunks (16 tokens here, 8,192 in the released
    models), its NoPE layers to everything: trees past the first chunk get one mask per layer
    type, the chunked layers' closed to the keys of other chunks, and the output, eager or over
    the static cache, is transformers' own (the tree masks ignored it before: a different
    token at the 11th, fp32)."""
    from headway.decode import kv

    mapped: list[tuple[str, ...]] = []

    def spy(model: Any, mask: Any, positions: Any, prefix_len: int) -> Any:
        masks = kv_windowed_masks(model, mask, positions, prefix_len)
        if isinstance(masks, dict):
            mapped.append(tuple(masks))
        return masks

    kv_windowed_masks = kv.windowed_masks
    monkeypatch.setattr(kv, "windowed_masks", spy)
    model = family_model("llama4-text", layers=4)
    assert model.config.attention_chunk_size == 16 and 0 in model.config.no_rope_layers
    truth = hf_greedy(model, PROMPT, 40, eos=None)
    for verify in ("eager", "captured"):
        decoder = Decoder(model, OracleDrafter(truth, 4, width=3), DecodeOptions(verify=verify))
        result = decoder.generate(PROMPT, max_new_tokens=40, eos_token_ids=())
        assert result.tokens == truth, verify
    assert set(mapped) == {("chunked_attention", "full_attention")}


@pytest.mark.parametrize("family", RECURRENT)
def test_a_target_with_recurrent_layers_is_refused_in_one_line(
    family: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Qwen3-Next's gated DeltaNet layers and Falcon-Mamba's state-space layers keep a running
    state a tree's branches would share: decoding (eager, static or batched), the batch
    regeneration engine and the command line refuse them in one line, before any forward;
    ``headway data regenerate`` answers with them through HF generate (``--engine auto``)."""
    from headway.cli import main
    from headway.decode.batch_step import BatchVerify
    from headway.decode.captured import StaticForward

    model = family_model(family)
    for verify in ("eager", "captured"):
        with pytest.raises(TargetError, match="cannot be tree-decoded") as refused:
            Decoder(model, None, DecodeOptions(verify=verify))
        assert "\n" not in str(refused.value) and "keeps a" in str(refused.value)
    with pytest.raises(TargetError, match="cannot be tree-decoded"):
        BatchVerify(StaticForward(model, batch=2), max_depth=1)
    tokenizer = smollm2_tokenizer()
    config = family_config(family)
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    type(model)(config).save_pretrained(tmp_path / family)
    tokenizer.save_pretrained(tmp_path / family)
    command = ["generate", "--target", str(tmp_path / family), "--max-new-tokens", "4", "hi"]
    assert main(command) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("headway generate: error: this ") and "cannot be tree-decoded" in error
    # regeneration answers with HF generate (--engine auto), and the batch engine refuses
    regenerate = ["data", "regenerate", "--target", str(tmp_path / family), "--mix", "chitchat:2"]
    regenerate += ["--max-new-tokens", "4", "--dtype", "float32"]
    assert main([*regenerate, "--out", str(tmp_path / "answers")]) == 0
    assert len(list((tmp_path / "answers" / "data").glob("part-*.jsonl.gz"))) == 1
    capsys.readouterr()
    assert main([*regenerate, "--out", str(tmp_path / "no"), "--engine", "batch"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "cannot be tree-decoded" in line and "--engine auto or generate" in line


@pytest.mark.parametrize("method", ["medusa1", "eagle1", "eagle3"])
def test_training_on_hidden_states_that_are_not_batch_tokens_hidden_is_refused(method: str) -> None:
    """Gemma 3n's hidden states carry its AltUp streams (``[2, B, T, H]``): every method reads
    them, so a run is refused in one line before any step."""
    from headway.config import load_config
    from headway.run_config import RunConfig
    from headway.target import Target
    from headway.train.methods import build_method

    model = family_model("gemma3n-text", layers=4)
    config = load_config(RunConfig, None, [f"train.method={method}"])
    with pytest.raises(TargetError, match="AltUp streams") as refused:
        build_method(config, Target(model, None, "tiny"), from_init=False)  # type: ignore[arg-type]
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_tree_logits_equal_each_path_for_every_family(family: str) -> None:
    """Not only the argmax: every tree position's logits equal that path decoded alone (fp32),
    what sampling's losslessness rests on; a 13-token prompt and a tree 4 deep cross Llama 4's
    16-token chunk and Gemma 3n's 8-token window."""
    from headway.decode.kv import new_cache, prefill, tree_forward
    from headway.decode.tree import root_to_leaf_paths

    model = family_model(family)
    prompt = torch.tensor([1, 7, 23, 45, 12, 9, 60, 8, 14, 3, 70, 33, 5])
    parents = torch.tensor([-1, -1, 0, 0, 2, 1, 4, -1])
    tokens = torch.tensor([30, 31, 32, 33, 34, 35, 36, 37])
    cache = new_cache(model)
    prefill(model, cache, prompt[None])
    block = torch.cat([torch.tensor([50]), tokens])[None]
    logits, _ = tree_forward(model, cache, block, parents, prompt.numel())
    for path in root_to_leaf_paths(parents):
        ids = torch.cat([prompt, block[0, torch.tensor(path)]])
        plain = model(ids[None]).logits[0, prompt.numel() :]
        scale = max(1.0, float(plain.abs().max()))  # Gemma's sharpened heads: logits ~100
        torch.testing.assert_close(logits[path], plain, atol=1e-5 * scale + 1e-4, rtol=0)


def test_a_chunked_model_that_takes_one_mask_decodes_until_its_first_chunk_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Llama 4 as if its forward took a single mask: within the first 16-token chunk nothing is
    closed (the static cache's later columns, of later chunks, do not count), and a tree past it
    is refused in one line."""
    from headway.decode import local_attention

    model = family_model("llama4-text")
    monkeypatch.setattr(local_attention, "takes_mask_mapping", lambda model: False)
    truth = hf_greedy(model, PROMPT, 6, eos=None)  # 8 + 6 tokens: one chunk
    for verify in ("eager", "captured"):
        decoder = Decoder(model, OracleDrafter(truth, 4, width=3), DecodeOptions(verify=verify))
        assert decoder.generate(PROMPT, max_new_tokens=6, eos_token_ids=()).tokens == truth
    longer = hf_greedy(model, PROMPT, 30, eos=None)
    with pytest.raises(SlidingWindowError, match=r"chunked \(16-token chunks\) and full"):
        generate(model, PROMPT, drafter=OracleDrafter(longer, 4, width=3), max_new_tokens=30,
                 eos_token_ids=())  # fmt: skip
