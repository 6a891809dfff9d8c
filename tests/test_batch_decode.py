"""Speculative decoding of several prompts at once (:mod:`headway.decode.batch_decode`): greedy,
each row's tokens are transformers' greedy output for that prompt alone (fp32), whatever its
drafter (prompt lookup, none, Medusa, EAGLE-3) and wherever it stops (EOS, a stop string,
``max_new_tokens``); sampled, each row follows the target's distribution; the sizer weighs the
drafters' time and pauses drafting that does not pay."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from headway.decode.batch_decode import decode_batch
from headway.drafters.lookup import PromptLookupDrafter
from headway.errors import HeadwayError
from tests.test_generate import hf_greedy
from tests.tiny import TINY_FAMILIES, TINY_VOCAB, tiny_model

NEW_TOKENS = 30


def _prompts() -> list[Tensor]:
    """Four prompts, two of them repeating a phrase (prompt lookup drafts from those)."""
    generator = torch.Generator().manual_seed(5)
    phrase = torch.randint(3, TINY_VOCAB, (5,), generator=generator)
    return [
        torch.cat([phrase, torch.tensor([7]), phrase, phrase[:2]]),
        torch.randint(3, TINY_VOCAB, (4,), generator=generator),
        torch.tensor([9]),
        torch.cat([phrase[:3], phrase[:3], phrase[:3]]),
    ]


@pytest.mark.parametrize("runs", [1, 3])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_row_is_its_prompts_own_greedy_output(
    family: str, runs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompt lookup for two rows, none for the others: every row equals transformers' greedy
    decoding of its prompt alone, and lookup's accepted drafts commit several tokens a step
    (every step sends the trees whole: what the sizer sends follows the machine's timings),
    whether the rows are prefilled in one forward or in runs of like lengths."""
    from headway.decode import batch_prefill, batch_sizer

    if runs > 1:
        monkeypatch.setattr(batch_prefill, "PREFILL_TOKENS", 18)
    sizes = sorted(prompt.numel() for prompt in _prompts())
    assert len(batch_prefill.prefill_runs(sizes)) == runs
    monkeypatch.setattr(batch_sizer.BatchSizer, "nodes", lambda self, parents, drafting=0.0: 7)
    monkeypatch.setattr(batch_sizer, "PLAIN_EVERY", 10**9)  # every step drafts
    model = tiny_model(family)
    prompts = _prompts()
    drafters = [PromptLookupDrafter(), None, PromptLookupDrafter(), PromptLookupDrafter()]
    rows = decode_batch(model, prompts, drafters, max_new_tokens=NEW_TOKENS)
    for index, (row, prompt) in enumerate(zip(rows, prompts, strict=True)):
        assert row.tokens == hf_greedy(model, prompt, NEW_TOKENS, eos=None), index
        assert row.stop_reason == "max_new_tokens" and sum(row.accept_lengths) == NEW_TOKENS
    assert rows[1].accept_lengths == [1] * NEW_TOKENS  # no drafter: one token a forward
    assert max(max(row.accept_lengths) for row in rows) > 1


@pytest.mark.parametrize("max_batch", [1, 2, 3])
def test_prompts_past_max_batch_take_finished_rows_places(max_batch: int) -> None:
    """Eight prompts through a batch of at most ``max_batch`` rows (prompt lookup in each,
    rows stopping at EOS or ``max_new_tokens`` at different steps): the waiting prompts join
    as rows finish, each output transformers' greedy output for its prompt alone; with one
    row, every prompt joins a batch whose rows have all finished."""
    model = tiny_model("llama")
    prompts = [*_prompts(), *(prompt[:2] for prompt in _prompts())]
    truths = [hf_greedy(model, prompt, NEW_TOKENS, eos=None) for prompt in prompts]
    eos = truths[0][5]
    drafters = [PromptLookupDrafter() for _ in range(max_batch)]
    rows = decode_batch(
        model, prompts, drafters, max_new_tokens=NEW_TOKENS, eos_token_ids=[eos],
        max_batch=max_batch,
    )  # fmt: skip
    for index, (row, truth) in enumerate(zip(rows, truths, strict=True)):
        cut = truth.index(eos) + 1 if eos in truth else NEW_TOKENS
        assert row.tokens == truth[:cut], index
    assert {row.stop_reason for row in rows} == {"eos", "max_new_tokens"}
    per_prompt = [PromptLookupDrafter() for _ in prompts]  # or one drafter per prompt
    finished: list[int] = []  # and how many have finished, as they finish
    again = decode_batch(
        model, prompts, per_prompt, max_new_tokens=NEW_TOKENS, eos_token_ids=[eos],
        max_batch=max_batch, on_done=finished.append,
    )  # fmt: skip
    assert [row.tokens for row in again] == [row.tokens for row in rows]
    assert finished == sorted(set(finished)) and finished[-1] == len(prompts) and len(finished) > 1
    with pytest.raises(ValueError, match=r"per row \(\d\) or per prompt \(8\); got 9"):
        decode_batch(model, prompts, [*per_prompt, None], max_new_tokens=2, max_batch=max_batch)


def test_a_row_stopping_at_eos_leaves_the_others_going() -> None:
    """EOS is a token row 0 generates early: row 0 stops right after it, the others decode
    to ``max_new_tokens`` undisturbed (row 0 keeps stepping without committing)."""
    model = tiny_model("llama")
    prompts = _prompts()
    truths = [hf_greedy(model, prompt, NEW_TOKENS, eos=None) for prompt in prompts]
    eos = truths[0][5]
    stop = truths[0].index(eos) + 1
    drafters = [PromptLookupDrafter() for _ in prompts]
    rows = decode_batch(model, prompts, drafters, max_new_tokens=NEW_TOKENS, eos_token_ids=[eos])
    assert rows[0].tokens == truths[0][:stop] and rows[0].stop_reason == "eos"
    for row, truth in zip(rows[1:], truths[1:], strict=True):
        cut = truth.index(eos) + 1 if eos in truth else NEW_TOKENS
        assert row.tokens == truth[:cut]
    assert any(row.stop_reason == "max_new_tokens" for row in rows)


class _LayersDrafter(PromptLookupDrafter):
    """Prompt lookup that says it reads the target's states at ``layers``."""

    def __init__(self, layers: tuple[int, ...]) -> None:
        super().__init__()
        self.hidden_layers = layers


@pytest.mark.parametrize("case, match", [("layers", "one set of layers"), ("long", "positions")])
def test_what_cannot_be_batched_is_refused_in_one_line(case: str, match: str) -> None:
    model = tiny_model("llama")
    prompts = _prompts()
    drafters: list[Any] = [None] * len(prompts)
    new = NEW_TOKENS
    if case == "layers":  # rows whose drafters read the target at different layers
        drafters[1], drafters[2] = _LayersDrafter((1,)), _LayersDrafter((2,))
    else:
        new = 250  # the tiny target holds 256 positions
    with pytest.raises(HeadwayError, match=match) as refused:
        decode_batch(model, prompts, drafters, max_new_tokens=new)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("budget", [None, 8])
@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_drafters_reading_the_target_states_draft_each_row(
    kind: str, budget: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Medusa heads (random) and a fitted EAGLE-3 draft model, one drafter per row over the
    states the batched steps leave for that row: every row is its prompt's own greedy output,
    and EAGLE-3's drafts are accepted (every step sends the whole tree); with a small prefill
    budget each row's prompt goes through a forward of its own, its states kept for drafting."""
    from headway.decode import batch_prefill, batch_sizer

    if budget is not None:
        monkeypatch.setattr(batch_prefill, "PREFILL_TOKENS", budget)
    from headway.decode.generate import generate
    from headway.drafters.eagle3_drafter import Eagle3Drafter
    from headway.drafters.medusa_drafter import MedusaDrafter
    from headway.heads.eagle import TargetHead
    from headway.heads.hidden_states import final_hidden_layer
    from headway.heads.medusa import MedusaConfig, MedusaHeads
    from tests.test_eagle3 import PROMPT, TREE, target_and_truth, trained

    model, truth = target_and_truth("llama")  # the EAGLE-3 draft is fitted on PROMPT + truth
    prompts = [PROMPT, PROMPT[:5], torch.cat([PROMPT, torch.tensor(truth[:3])])]
    runs = batch_prefill.prefill_runs(sorted(prompt.numel() for prompt in prompts))
    assert len(runs) == (1 if budget is None else 3)
    drafters: list[Any] = []
    for _ in prompts:
        if kind == "medusa":
            torch.manual_seed(1)
            heads = MedusaHeads(MedusaConfig(2, 1, 32, TINY_VOCAB), model.lm_head.weight)
            drafters.append(MedusaDrafter(heads.eval(), hidden_layer=final_hidden_layer(model)))
        else:
            drafters.append(Eagle3Drafter(trained("llama"), TargetHead.of(model), **TREE))
    monkeypatch.setattr(batch_sizer.BatchSizer, "nodes", lambda self, parents, drafting=0.0: 15)
    monkeypatch.setattr(batch_sizer, "PLAIN_EVERY", 10**9)  # every step drafts
    rows = decode_batch(model, prompts, drafters, max_new_tokens=NEW_TOKENS)
    for index, (row, prompt, drafter) in enumerate(zip(rows, prompts, drafters, strict=True)):
        assert row.tokens == hf_greedy(model, prompt, NEW_TOKENS, eos=None), index
        alone = generate(
            model, prompt, drafter=drafter, max_new_tokens=NEW_TOKENS, eos_token_ids=()
        )
        assert row.accept_lengths == alone.accept_lengths, index  # the same drafts accepted
    if kind == "eagle3":
        assert max(max(row.accept_lengths) for row in rows) > 2


def test_headway_generate_batch_prints_what_one_prompt_at_a_time_does(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """``headway generate --batch --json``: the same token ids, prompt by prompt, as without
    ``--batch`` (fp32, prompt lookup), with stop strings too; seeded sampling draws the same
    twice."""
    import json

    from headway.cli import main
    from tests.tokenizers_fixture import smollm2_tokenizer

    tokenizer = smollm2_tokenizer()
    config = tiny_model("llama").config
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    type(tiny_model("llama"))(config).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    prompts = ["the cat sat on the mat, the cat sat", "hello", "one two three one two"]
    common = ["generate", "--target", str(tmp_path / "tiny"), "--dtype", "float32", "--json"]
    common += ["--max-new-tokens", "16", "--drafter", "prompt-lookup", *prompts]
    capsys.readouterr()
    assert main([*common, "--batch"]) == 0
    batched = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main(common) == 0
    alone = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["token_ids"] for r in batched] == [r["token_ids"] for r in alone]
    assert [r["prompt"] for r in batched] == prompts
    assert main([*common, "--batch", "--batch-size", "2"]) == 0  # the third joins later
    two = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["token_ids"] for r in two] == [r["token_ids"] for r in alone]
    assert main([*common, "--batch-size", "2"]) == 2  # without --batch: refused
    assert "add --batch" in capsys.readouterr().err
    texts = [r["text"] for r in alone]  # stop strings from inside two rows' own answers
    stop = ["--stop", texts[1][5:7], "--stop", texts[2][6:8]]
    assert main([*common, "--batch", *stop]) == 0
    stopped = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main([*common, *stop]) == 0
    stopped_alone = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["token_ids"] for r in stopped] == [r["token_ids"] for r in stopped_alone]
    assert [r["stop_reason"] for r in stopped] == [r["stop_reason"] for r in stopped_alone]
    assert [r["stop_reason"] for r in stopped].count("stop_sequence") >= 2
    sampled = [*common, "--batch", "--temperature", "0.7", "--seed", "3"]
    runs = []
    for _ in range(2):  # seeded: the same draws twice
        assert main(sampled) == 0
        runs.append(
            [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]
        )
    assert runs[0] == runs[1] and runs[0] != [r["token_ids"] for r in alone]


@pytest.mark.parametrize("max_batch", [None, 70])
def test_sampled_rows_follow_the_target_distribution(
    max_batch: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,500 rows of one prompt, in batches of 300 (or 300 prompts at a time through 70 rows,
    the others joining as rows finish), sampled at temperature 1 with the top-3 of the
    target's own second-token table drafted below the first token (every step sends the whole
    tree, padding included): each row's first two tokens follow the target's exact two-token
    distribution, and drafts are accepted."""
    from headway.decode import batch_sizer
    from headway.decode.sampling import SamplingParams
    from tests.test_eagle3 import tiny4
    from tests.test_generate import PROMPT, TableDrafter, chi_square, exact_two_token_probs

    model = tiny4("gpt2")
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 5.0)
    params = SamplingParams(temperature=1.0)
    first, second = exact_two_token_probs(model, params)
    monkeypatch.setattr(batch_sizer.BatchSizer, "nodes", lambda self, parents, drafting=0.0: 7)
    monkeypatch.setattr(batch_sizer, "PLAIN_EVERY", 10**9)  # every step drafts
    generator = torch.Generator().manual_seed(5)
    counts = torch.zeros(TINY_VOCAB * TINY_VOCAB)
    accepted = 0
    for seed in range(5):
        drafters: list[Any] = []
        for index in range(max_batch or 300):
            drafter = TableDrafter(second, width=3, depth=2, random=False, seed=seed * 300 + index)
            drafter.max_nodes = 6
            drafters.append(drafter)
        rows = decode_batch(
            model,
            [PROMPT] * 300,
            drafters,
            max_new_tokens=3,  # room for a step to commit a drafted token and its bonus
            sampling=params,
            generator=generator,
            max_batch=max_batch,
        )
        for row in rows:
            counts[row.tokens[0] * TINY_VOCAB + row.tokens[1]] += 1
            accepted += row.accept_lengths[1] > 1  # the first step, after the prefill's
    exact = (first[:, None] * second).flatten()
    assert not bool(counts[exact == 0].any())
    statistic, bound = chi_square(counts, exact)
    assert statistic < bound, (statistic, bound)
    assert accepted > 1500 / 3


@pytest.mark.parametrize("method", ["medusa1", "eagle1"])
def test_headway_generate_batch_with_heads_prints_what_one_at_a_time_does(
    method: str, tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--batch --heads RUN`` (Medusa heads or an EAGLE-1 draft model saved for the tiny
    target): the heads, or the EAGLE draft model, drafting every prompt's tree at once; the
    same token ids as without ``--batch``."""
    import json

    from headway.cli import main
    from headway.drafters.batch_eagle import BatchEagle
    from headway.drafters.batch_medusa import BatchMedusa
    from headway.heads.eagle import EagleConfig, EagleModel
    from headway.heads.io import save_heads
    from headway.heads.medusa import MedusaConfig, MedusaHeads
    from headway.target import fingerprint
    from tests.tokenizers_fixture import smollm2_tokenizer

    tokenizer = smollm2_tokenizer()
    model = tiny_model("llama", vocab_size=len(tokenizer))
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    torch.manual_seed(1)
    head: Any = (
        MedusaHeads(MedusaConfig(2, 1, 32, len(tokenizer)), model.lm_head.weight)
        if method == "medusa1"
        else EagleModel(EagleConfig.from_target(model))
    )
    save_heads(
        tmp_path / "run",
        method=method,
        head_config=head.config.to_dict(),
        state_dict=head.state_dict(),
        target_fingerprint=fingerprint(model),
        target_name=str(tmp_path / "tiny"),
    )
    together: list[str] = []  # the drafting that drafted every row at once, each step
    for kind in (BatchEagle, BatchMedusa):
        propose = kind.propose

        def counted(self: Any, *args: Any, propose: Any = propose) -> Any:
            together.append(type(self).__name__)
            return propose(self, *args)

        monkeypatch.setattr(kind, "propose", counted)
    common = ["generate", "--target", str(tmp_path / "tiny"), "--dtype", "float32", "--json"]
    common += ["--max-new-tokens", "12", "--heads", str(tmp_path / "run"), "one two", "three"]
    common += ["--draft-length", "3"]  # prompt lookup's option: ignored for heads, both ways
    capsys.readouterr()
    assert main([*common, "--batch"]) == 0
    batched = [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]
    assert main(common) == 0
    alone = [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]
    assert batched == alone and len(batched) == 2
    assert together and set(together) == {"BatchEagle" if method == "eagle1" else "BatchMedusa"}


def test_the_sizer_weighs_drafting_time_and_pauses_drafting_that_does_not_pay() -> None:
    """A step table where bigger blocks cost little: deep trees win while drafting is cheap;
    drafting that costs more than it brings (the trees drafted are still sent: their cost is
    paid) is skipped for 1, then 2, 4 ... steps, and a step where it wins again ends the
    pauses."""
    from headway.decode.batch_sizer import BatchSizer

    sizer = object.__new__(BatchSizer)
    sizer.seconds = [0.010, 0.011, 0.012, 0.014]  # blocks of 1, 2, 4, 8 entries a row
    sizer.pause, sizer.skipped = 0, 0
    sizer.reached, sizer.passed = [1.0] * 8, [0.75] * 8  # three in four accepted at a depth
    sizer.drafted_steps = 0
    chain = [[-1, 0, 1, 2, 3, 4]] * 4  # four rows, a six-deep chain each
    assert sizer.nodes(chain, drafting=0.001) == 7 and sizer.drafts()
    pauses = []
    for _ in range(3):  # drafting ten times a step's time: never pays
        assert sizer.nodes(chain, drafting=0.1) == 7
        skipped = 0
        while not sizer.drafts():
            skipped += 1
        pauses.append(skipped)
    assert pauses == [1, 2, 4]
    assert sizer.nodes(chain, drafting=0.001) == 7 and sizer.skipped == 0


def test_the_sizer_follows_the_steps_it_times() -> None:
    """A table timed when big blocks were cheap: deep trees go; once steps of 4 and 8 entries
    are seen taking three times a plain step, and the plain step less than timed, the sizer
    sends smaller trees and then pauses drafting; a step over three times the table's figure
    (a capture) is left out; drafting steps in a row are broken by one plain step every
    ``PLAIN_EVERY``, which keeps the plain step's figure timed."""
    from headway.decode import batch_sizer
    from headway.decode.batch_sizer import BatchSizer

    sizer = object.__new__(BatchSizer)
    sizer.seconds = [0.010, 0.011, 0.012, 0.014]  # blocks of 1, 2, 4, 8 entries a row
    sizer.pause, sizer.skipped = 0, 0
    sizer.reached, sizer.passed = [1.0] * 8, [0.5] * 8  # one in two accepted at a depth
    sizer.drafted_steps = 0
    chain = [[-1, 0, 1, 2, 3, 4]] * 4  # four rows, a six-deep chain each
    assert sizer.nodes(chain) == 7
    sizer.timed(8, 1.0)  # a capture: left out
    assert sizer.seconds[3] == 0.014
    for _ in range(30):
        sizer.timed(1, 0.008)
        sizer.timed(4, 0.030)
        sizer.timed(8, 0.040)
    assert sizer.seconds[0] == pytest.approx(0.008, rel=0.01)
    assert sizer.seconds[2] < 3 * 0.012  # each sample at most three times the figure
    assert sizer.nodes(chain) == 1 and sizer.drafts()  # one node a row still pays
    sizer.timed(2, 0.0175)
    for _ in range(30):
        sizer.timed(2, 0.020)
    assert sizer.nodes(chain, drafting=0.001) == 0 and not sizer.drafts()  # paused
    sizer.pause = 0
    plain = [not sizer.drafts() for _ in range(3 * (batch_sizer.PLAIN_EVERY + 1))]
    every = batch_sizer.PLAIN_EVERY  # one step in PLAIN_EVERY + 1 times a plain step
    assert [i for i, skipped in enumerate(plain) if skipped] == [
        every,
        2 * every + 1,
        3 * every + 2,
    ]


@pytest.mark.parametrize("max_batch", [None, 2])
def test_a_drafter_given_per_prompt_drafts_that_prompt(
    max_batch: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows are prefilled shortest first, but a list of one drafter per prompt keeps each with
    its prompt: the longest prompt, repeating a phrase, is given none and commits one token a
    step, the others are drafted (rows joining later too), and every row is its prompt's own
    greedy output."""
    from headway.decode import batch_sizer

    monkeypatch.setattr(batch_sizer.BatchSizer, "nodes", lambda self, parents, drafting=0.0: 7)
    monkeypatch.setattr(batch_sizer, "PLAIN_EVERY", 10**9)  # every step drafts
    model = tiny_model("llama")
    prompts = _prompts()
    drafters = [None, PromptLookupDrafter(), PromptLookupDrafter(), PromptLookupDrafter()]
    rows = decode_batch(model, prompts, drafters, max_new_tokens=NEW_TOKENS, max_batch=max_batch)
    for row, prompt in zip(rows, prompts, strict=True):
        assert row.tokens == hf_greedy(model, prompt, NEW_TOKENS, eos=None)
    assert rows[0].accept_lengths == [1] * NEW_TOKENS
    assert max(rows[3].accept_lengths) > 1  # its repeated phrase, drafted


@pytest.mark.parametrize(
    ("captured", "waiting", "leave_after"),
    [(False, False, 1), (True, False, 2), (False, True, 1), (True, True, 2)],
)
def test_finished_rows_leave_after_a_quarter_or_half_where_captured(
    captured: bool, waiting: bool, leave_after: int
) -> None:
    """Four rows: finished rows leave once a quarter has finished (at once where prompts wait),
    or half where the batch's steps are captured, prompts waiting or not (every change of the
    rows captures the graphs again)."""
    from types import SimpleNamespace

    from headway.decode.batch_decoder import BatchDecoder, Ending

    kept: list[list[int]] = []
    steps = SimpleNamespace(
        target=SimpleNamespace(capture=captured), keep_rows=kept.append, batch=4
    )
    drafting = SimpleNamespace(keep_rows=lambda rows: None, max_nodes=0, hidden_layers=())
    model = tiny_model("llama")
    decoder = BatchDecoder(model, drafting, 4, Ending(frozenset(), 8))
    for _ in range(4):
        decoder.submit(torch.tensor([1]))
    decoder._steps = steps  # type: ignore[assignment]
    decoder.order, decoder.queue = [0, 1, 2, 3], []
    if waiting:  # one more prompt waits for a row; a prompt that joins is prefilled
        decoder.submit(torch.tensor([1]))
        decoder.queue = [4]
        decoder._start = lambda *args, **kwargs: None  # type: ignore[method-assign]
    for finished in range(1, 4):
        decoder.everyone[finished].stop_reason = "eos"
        assert decoder._reshaped()
        if kept:
            break
    assert kept and len(kept[0]) == 4 - leave_after


def test_the_sizer_weighs_each_depth_by_how_often_it_was_accepted() -> None:
    """Chains of six where the first node was accepted 80% of the time and the second 20%,
    never deeper: the sizer sends three nodes (a seventh entry's step costs more than what
    depths 4-6 bring), where one share of all drafted depth would have sent all six."""
    from headway.decode.batch_sizer import BatchSizer

    sizer = object.__new__(BatchSizer)
    sizer.seconds = [0.010, 0.011, 0.012, 0.014]  # blocks of 1, 2, 4, 8 entries a row
    sizer.pause, sizer.skipped, sizer.drafted_steps = 0, 0, 0
    sizer.reached = [1.0] * 8
    sizer.passed = [0.5**depth for depth in range(8)]
    for accepted in [1] * 12 + [2] * 4 + [0] * 4:
        sizer.learn(6, accepted)
    chain = [[-1, 0, 1, 2, 3, 4]] * 4
    assert sizer.nodes(chain) == 3
