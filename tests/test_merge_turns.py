"""One conversation trained once: rows sharing an ``id`` whose messages open alike (a
``--continue-from`` folder's row beside the row it went on from) merge into the deepest row,
which trains every answer some row of the conversation trained."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from headway.corpus.merge_turns import merge_turns
from headway.corpus.samples import Sample, is_trained_turn
from headway.corpus.sources import load_conversations, row_to_sample
from headway.train.data import build_datasets
from tests.test_data import trained_runs
from tests.tokenizers_fixture import CHATML_CHAT_TEMPLATE, byte_bpe_tokenizer

REGENERATED = Path(__file__).resolve().parents[1] / "data" / "regenerated"


def turns(depth: int, context: int = 0, answer: str = "answer") -> list[dict[str, Any]]:
    """``depth`` user/assistant pairs; the first ``context`` answers are ``weight`` 0."""
    messages: list[dict[str, Any]] = []
    for turn in range(depth):
        messages.append({"role": "user", "content": f"question {turn}"})
        reply: dict[str, Any] = {"role": "assistant", "content": f"{answer} {turn}."}
        if turn < context:
            reply["weight"] = 0
        messages.append(reply)
    return messages


def sample(key: str | None, messages: list[dict[str, Any]]) -> Sample:
    row: dict[str, Any] = {"messages": messages} | ({"id": key} if key is not None else {})
    return row_to_sample(row, f"row {key}")


def trained_answers(item: Sample) -> list[str]:
    assert item.messages is not None
    return [m["content"] for i, m in enumerate(item.messages) if is_trained_turn(m, i)]


def test_the_deepest_row_trains_every_answer_its_conversation_trained() -> None:
    first = [sample("a", turns(2)), sample("b", turns(1)), sample(None, turns(2))]
    later = [sample("a", turns(3, context=2)), sample("c", turns(2))]
    before = copy.deepcopy([first, later])
    out = merge_turns([first, later])
    assert [len(s.samples) for s in out] == [2, 2] and [s.merged for s in out] == [1, 0]
    assert [x.key for x in out[0].samples] == ["b", None]  # order kept, "a" gone
    merged = out[1].samples[0]
    assert merged.key == "a" and trained_answers(merged) == ["answer 0.", "answer 1.", "answer 2."]
    assert [first, later] == before  # the inputs are not edited


def test_rows_of_another_text_or_without_an_id_stay_as_they_are() -> None:
    original = sample("a", turns(2, answer="the original reply"))
    regenerated = sample("a", turns(3, context=2))
    plain = Sample(text="some text", key="a")
    out = merge_turns([[original, plain], [regenerated]])
    assert [s.merged for s in out] == [0, 0]
    assert out[0].samples == [original, plain] and out[1].samples == [regenerated]
    assert trained_answers(out[1].samples[0]) == ["answer 2."]  # its context stays context


def test_repeated_rows_stay_and_context_answers_stay_context() -> None:
    """A row repeated whole is trained again, as a data set repeating it means; a shorter row
    goes into the first of them; an answer no row trains stays context."""
    once = sample("a", turns(3, context=1))
    twice = sample("a", turns(3, context=1))
    shorter = sample("a", turns(1, context=1))
    out = merge_turns([[once, shorter], [twice]])
    assert out[0].samples == [once] and out[1].samples == [twice]
    assert [s.merged for s in out] == [1, 0]
    assert trained_answers(out[0].samples[0]) == ["answer 1.", "answer 2."]


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_built_data_trains_a_continued_conversation_once(tmp_path: Path) -> None:
    """Through build_datasets: the merged conversation's loss mask is the one of the same
    conversation with every answer trained, the tokens of the shorter row are gone, and a
    source whose every row went deeper is reported, not refused."""
    tokenizer = byte_bpe_tokenizer(CHATML_CHAT_TEMPLATE)
    early = write_rows(tmp_path / "early.jsonl", [{"id": "a", "messages": turns(2)}])
    later = write_rows(tmp_path / "later.jsonl", [{"id": "a", "messages": turns(4, context=2)}])
    whole = write_rows(tmp_path / "whole.jsonl", [{"messages": turns(4)}])
    dataset, reports = build_datasets(tokenizer, [early, later], max_length=512)
    alone, _ = build_datasets(tokenizer, [whole], max_length=512)
    assert len(dataset) == 1 and dataset[0] == alone[0]
    runs = trained_runs(tokenizer, dataset[0]["input_ids"], dataset[0]["loss_mask"])
    assert len(runs) == 4 and runs[0].startswith("answer 0.")
    assert [r.samples for r in reports] == [0, 1] and [r.merged for r in reports] == [1, 0]
    assert "1 merged into a deeper row of their conversation" in reports[0].summary()


def test_the_committed_fourth_turns_open_with_the_turns_they_went_on_from() -> None:
    """The regenerated data as committed: every row of the fourth-turn folder merges into a
    row of the folders it continued (its earlier answers copied word for word), and the
    conversations' trained answers are all kept."""
    folders = [
        "smollm2-sharegpt-turns",
        "smollm2-sharegpt-turns-2",
        "smollm2-sharegpt-turns-3",
        "smollm2-sharegpt-turns-4",
        "smollm2-sharegpt-turn4",
    ]
    loaded = [load_conversations(REGENERATED / name / "data")[0] for name in folders]
    out = merge_turns(loaded)
    fourth = loaded[-1]
    assert sum(s.merged for s in out[:-1]) == len(fourth) and out[-1].merged == 0
    assert all(len(trained_answers(row)) == 4 for row in out[-1].samples)

    def answers(groups: list[list[Sample]]) -> int:
        return sum(len(trained_answers(row)) for group in groups for row in group)

    assert answers([s.samples for s in out]) == answers(loaded)


def test_a_draft_vocabulary_counts_each_trained_answer_once(tmp_path: Path) -> None:
    """``headway data vocab`` counts answers as training reads them: a conversation's answers
    once across the folders holding it, a context answer no row trains not at all."""
    from headway.drafters.draft_vocab import answer_token_counts
    from tests.tokenizers_fixture import smollm2_tokenizer

    tokenizer = smollm2_tokenizer()
    rows = [{"id": "a", "messages": turns(2, answer="zebra")}]
    write_rows(tmp_path / "early" / "part-00000.jsonl", rows)
    later = [
        {"id": "a", "messages": turns(3, context=2, answer="zebra")},
        {"id": "b", "messages": turns(2, context=1, answer="zebra")},  # its first: context only
    ]
    write_rows(tmp_path / "later" / "part-00000.jsonl", later)
    counts = answer_token_counts([tmp_path / "early", tmp_path / "later"], tokenizer)
    assert counts[tokenizer.eos_token_id] == 4  # a: 3 answers, b: 1

    def digit(n: int) -> int:
        return int(tokenizer(str(n), add_special_tokens=False)["input_ids"][0])

    # answers end "zebra N.": a's 0, 1, 2 and b's 1 (each row read alone would count 3, 3, 1)
    assert [counts[digit(n)] for n in range(3)] == [1, 2, 1]
