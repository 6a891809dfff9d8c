"""An EAGLE-3 drafter narrowed to its most frequent tokens (FR-Spec, ``EagleSpec.draft_vocab``):
its LM head keeps the rows of the kept tokens and nothing else changes; decoding stays exact."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from headway.decode.generate import generate
from headway.drafters.draft_vocab import narrow_eagle3
from headway.drafters.eagle3_drafter import Eagle3Drafter
from headway.errors import HeadwayError
from headway.heads.eagle import TargetHead
from headway.heads.eagle3 import Eagle3Model
from headway.heads.vocab import DraftVocab
from tests.test_eagle3 import NEW_TOKENS, PROMPT, TREE, random_draft, target_and_truth, trained
from tests.tiny import TINY_VOCAB


def narrowed(draft: Eagle3Model, keep: torch.Tensor) -> Eagle3Model:
    config, state = narrow_eagle3(draft.config, draft.state_dict(), keep)
    model = Eagle3Model(config)
    model.load_state_dict(state)
    return model.eval()


def test_the_narrowed_head_scores_the_kept_tokens_as_the_whole_one_did() -> None:
    """Vocabulary 20..83; keep every third target id (and ids outside it, which are ignored):
    the narrowed drafter's logits are the whole one's columns of the kept tokens, mapped to the
    same target ids, and the rest of the model is untouched."""
    model, _ = target_and_truth("llama")
    draft = random_draft(model, DraftVocab.from_target_ids(range(20, 84), TINY_VOCAB)).eval()
    keep = torch.tensor([*range(20, 84, 3), 0, 1, 2, 90])
    small = narrowed(draft, keep)
    kept = torch.arange(0, 64, 3)  # draft ids of target ids 20, 23, ..., 83
    assert small.config.draft_vocab_size == kept.numel()
    assert small.vocab.target_ids.tolist() == list(range(20, 84, 3))
    assert int(small.t2d.sum()) == kept.numel() and bool(small.t2d[23]) and not small.t2d[21]
    states = torch.randn(5, draft.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(small.logits(states), draft.logits(states)[:, kept])
    whole = draft.state_dict()
    for name, tensor in small.state_dict().items():
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(tensor, whole[name]), name


@pytest.mark.parametrize("share", [2, 4])
def test_a_narrowed_drafter_decodes_exactly(share: int) -> None:
    """A trained drafter narrowed to a share of the tokens of the answer it learned: the output
    is still the target's greedy one (drafts of the dropped tokens are simply never made)."""
    model, truth = target_and_truth("llama")
    draft = trained("llama")
    answer = torch.tensor(truth).unique()
    small = narrowed(draft, answer[: max(1, answer.numel() // share)])
    drafter = Eagle3Drafter(small, TargetHead.of(model), **TREE)
    result = generate(model, PROMPT, drafter=drafter, max_new_tokens=NEW_TOKENS, eos_token_ids=())
    assert result.tokens == truth
    assert all(int(small.t2d[token]) for token in drafter_tokens(drafter, truth))


def drafter_tokens(drafter: Eagle3Drafter, truth: list[int]) -> list[int]:
    """Tokens of one tree proposed after the prompt and half the answer."""
    from tests.test_eagle3_decode import fed

    sequence = torch.cat([PROMPT, torch.tensor(truth[: NEW_TOKENS // 2])])
    model, _ = target_and_truth("llama")
    tree = fed(drafter, model, sequence).propose(sequence)
    return [int(token) for token in tree.tokens]


def test_a_list_with_none_of_the_drafters_tokens_is_refused() -> None:
    model, _ = target_and_truth("llama")
    draft = random_draft(model, DraftVocab.from_target_ids(range(20, 84), TINY_VOCAB))
    with pytest.raises(HeadwayError, match="another tokenizer"):
        narrow_eagle3(draft.config, draft.state_dict(), torch.tensor([0, 1, 90]))


def test_headway_data_vocab_ranks_answer_tokens_with_one_eos_per_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command writes the answers' tokens most frequent first, the EOS counted once per
    answer and the user's turns not at all, and prints the coverage table; a missing folder is
    a one-line error."""
    from headway.cli import main
    from headway.drafters.draft_vocab import draft_vocabulary
    from headway.target import load_target

    tokenizer = load_target("smollm2-135m").tokenizer
    data = tmp_path / "data"
    data.mkdir()
    turns = [("the the the cat", "dog"), ("zebra zebra zebra zebra", "the end")]
    rows = [
        {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": said}]}
        for said, user in turns
    ]
    with gzip.open(data / "part-00000.jsonl.gz", "wt") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    out = tmp_path / "draft_vocab.json"
    assert main(["data", "vocab", str(data), "--out", str(out), "--size", "3"]) == 0
    ids = json.loads(out.read_text())["token_ids"]
    zebra, the = (
        tokenizer(word, add_special_tokens=False)["input_ids"][-1] for word in (" zebra", " the")
    )
    # " zebra" 3 times, " the" twice, the EOS once per answer (a tie goes to the one seen first)
    assert ids == [zebra, the, tokenizer.eos_token_id]
    assert tokenizer("dog", add_special_tokens=False)["input_ids"][0] not in ids
    assert draft_vocabulary(out, tokenizer, 2).tolist() == sorted(ids[:2])
    assert "| most frequent | share of answer tokens |" in capsys.readouterr().out
    assert main(["data", "vocab", str(tmp_path / "nowhere"), "--out", str(out)]) != 0
    assert "not a folder of regenerated data" in capsys.readouterr().err


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_an_eagle1_drafter_over_a_narrowed_head_drafts_only_its_tokens(
    family: str, static: bool
) -> None:
    """EAGLE-1 drafts with the target's whole LM head; narrowed, it scores only the listed
    tokens (a copy of their rows, the target's head untouched) and maps its choices back to
    target ids: every proposal is a listed token, and decoding is still exact."""
    from headway.drafters.draft_vocab import narrow_head
    from headway.drafters.eagle_drafter import EagleDrafter
    from headway.drafters.static_eagle import StaticEagleDrafter
    from tests.test_eagle_drafter import LAST, Recorder
    from tests.test_eagle_drafter import target_and_truth as eagle1_target
    from tests.test_eagle_drafter import trained as eagle1_trained

    model, truth = eagle1_target(family)
    answer = torch.tensor(truth).unique()
    keep = answer[: max(1, answer.numel() // 2)].sort().values
    whole = TargetHead.of(model)
    head = narrow_head(whole, keep)
    states = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        # The listed rows' logits, to rounding: a product over 5 rows and one over 96 may take
        # different fp32 kernels (bit-different on a 2-core AVX2-only EPYC, equal on a Xeon).
        torch.testing.assert_close(
            head.logits(states), whole.logits(states)[:, keep], rtol=1e-5, atol=1e-6
        )
    kind = StaticEagleDrafter if static else EagleDrafter
    drafter = kind(eagle1_trained(family), head, hidden_layer=LAST, vocab=keep, **TREE)
    recorder = Recorder(drafter)
    result = generate(model, PROMPT, drafter=recorder, max_new_tokens=NEW_TOKENS, eos_token_ids=())
    assert result.tokens == truth
    drafted = {int(token) for _, tree in recorder.proposals for token in tree.tokens}
    assert drafted and drafted <= set(keep.tolist())
    assert model.get_output_embeddings().weight.shape[0] == TINY_VOCAB  # the target's own head


@pytest.mark.parametrize("sized", [False, True], ids=["tree", "cost-sized"])
def test_narrowed_medusa_heads_propose_their_top_k_among_the_listed_tokens(sized: bool) -> None:
    """Every head's LM head cut to the listed rows: the static tree holds, rank for rank, the
    whole heads' best tokens among the listed ones (scores as the narrowed softmax gives them),
    and decoding with the narrowed heads is still exact."""
    from headway.drafters.draft_vocab import narrow_medusa
    from headway.drafters.medusa_drafter import MedusaDrafter
    from headway.heads.medusa import MedusaConfig, MedusaHeads

    torch.manual_seed(0)
    whole = MedusaHeads(MedusaConfig(2, 1, 8, 40), torch.randn(40, 8)).eval()
    keep = torch.arange(3, 40, 2)  # 19 odd ids
    config, state, vocab = narrow_medusa(whole.config, whole.state_dict(), keep)
    assert vocab is not None and torch.equal(vocab, keep)
    narrow = MedusaHeads(config)
    narrow.load_state_dict(state)
    choices = [[0], [1], [0, 0], [0, 1], [1, 0]]
    drafter = MedusaDrafter(narrow.eval(), hidden_layer=2, choices=choices, vocab=keep)
    hidden = torch.randn(3, 8)
    drafter.begin(PROMPT)
    drafter.observe(torch.tensor([4, 5, 6]), (hidden,))
    tree = drafter.propose(PROMPT, 0.0 if sized else None)
    with torch.no_grad():
        ranked = whole(hidden[-1])[:, keep].argsort(dim=-1, descending=True)  # [2, 19]
    best = keep[ranked]
    assert tree.tokens.tolist() == [
        int(t) for t in (best[0, 0], best[0, 1], best[1, 0], best[1, 1], best[1, 0])
    ]
    assert (tree.scores is not None) == sized
    with pytest.raises(HeadwayError, match="another tokenizer"):
        narrow_medusa(whole.config, whole.state_dict(), torch.tensor([1, 40]))


def test_narrowed_medusa_heads_decode_exactly() -> None:
    from headway.drafters.draft_vocab import narrow_medusa
    from headway.drafters.medusa_drafter import MedusaDrafter
    from headway.heads.hidden_states import final_hidden_layer
    from headway.heads.medusa import MedusaConfig, MedusaHeads
    from tests.test_medusa import train_heads

    model, truth = target_and_truth("llama")
    torch.manual_seed(0)
    lm_head = model.get_output_embeddings().weight.detach()
    heads = MedusaHeads(MedusaConfig(3, 1, model.config.hidden_size, TINY_VOCAB), lm_head)
    train_heads(model, heads, torch.cat([PROMPT, torch.tensor(truth)]), steps=60)
    keep = torch.arange(0, TINY_VOCAB, 2)  # the even ids: some of the answer's tokens
    config, state, _ = narrow_medusa(heads.config, heads.state_dict(), keep)
    narrow = MedusaHeads(config)
    narrow.load_state_dict(state)
    layer = final_hidden_layer(model)
    drafter = MedusaDrafter(narrow.eval(), hidden_layer=layer, vocab=keep)
    result = generate(model, PROMPT, drafter=drafter, max_new_tokens=NEW_TOKENS, eos_token_ids=())
    assert result.tokens == truth
