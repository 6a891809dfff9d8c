"""How the target answers a shard of prompts: turn by turn, through one of three engines.

- ``batch`` (the default, ``auto``): :class:`~headway.decode.batch_decoder.BatchDecoder`, the
  engine of ``headway generate --batch`` (one static cache, prompt-lookup trees sized by their
  measured cost, finished rows replaced by waiting prompts and next turns, each next turn
  continuing from the keys/values its turn before left, steps captured as CUDA graphs on a
  GPU);
- ``continuous``: :class:`~headway.generation.batched_generation.ContinuousBatcher` (a ragged
  cache, lookahead chains), what ``auto`` takes for a target mixing sliding or chunked layers
  with full ones whose forward takes one mask (which the batched steps refuse);
- ``generate``: HF ``generate`` on left-padded batches of similar length (the reference, and
  ``auto``'s engine for targets with recurrent layers).

Every way, each user turn is answered after the target's own earlier answers (multi-turn
self-distillation), and the answers are the target's: greedy, or sampled from its distribution.
In fp32 the three answer alike, greedy and (batch and continuous) sampled
(``tests/test_regenerate.py``), so a folder may resume on any.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from headway.decode.batch_decoder import BatchDecoder, Ending
from headway.decode.batch_drafting import RowDrafters
from headway.decode.gemm import contiguous_head
from headway.decode.sampling import SamplingParams
from headway.drafters.build import build_drafter
from headway.drafters.specs import PromptLookupSpec
from headway.drafters.target_support import regeneration_engine
from headway.errors import DataError
from headway.generation.batched_generation import ContinuousBatcher
from headway.generation.repetition import ends_in_loop, loop_cut
from headway.target import Target, eos_token_ids
from headway.train.prompts import PromptItem

logger = logging.getLogger(__name__)

ENGINES = ("auto", "continuous", "generate", "batch")
# Options that decide speed only: a resumed run may change them (the answers are the target's).
SPEED_OPTIONS = ("batch_size", "engine", "lookahead", "reuse_history")
GREEDY_LOOKAHEAD = 3  # beat no lookahead in greedy runs of scripts/bench_regenerate.py


@dataclass
class RegenerateOptions:
    """How the target answers. Greedy (temperature 0) matches greedy evaluation best."""

    max_new_tokens: int = 512
    batch_size: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    shard_size: int = 256
    # Self-instruct answers are one request each; a short cap saves most of that stage's time.
    meta_max_new_tokens: int = 96
    # "continuous": rows leave when done and waiting prompts join (batched_generation);
    # "generate": HF generate on padded batches (the reference, kept for benchmarks);
    # "batch": headway.generate_batch's engine, one call per turn (_answer_in_batch_steps);
    # "auto": batch, but for a few targets (:func:`engine_for`).
    engine: str = "auto"
    # tokens each row drafts per step by prompt lookup in its own text, all verified in the
    # same forward (0: one token per step). continuous: a chain (headway.generation.lookahead);
    # None: GREEDY_LOOKAHEAD for greedy answers, 0 when sampling (fewer drafts are kept there,
    # and at temperature 0.7 lookahead ran slower than none: docs/benchmarks.md). batch: a
    # tree of at most that many nodes, None prompt lookup's default, each step's trees cut to
    # the size its measured cost pays for (greedy or sampled).
    lookahead: int | None = None
    # > 0: an answer stops at its first token past this many periods of a repetition loop
    # (headway.generation.repetition), finish_reason "loop". Greedy answers of small targets
    # often loop until max_new_tokens: half of smollm2-sharegpt-2's answer tokens were such tails.
    stop_loops: int = 0
    # batch and continuous: a conversation's next turn prefills only what follows the prefix
    # it shares with the row that answered the turn before;
    # False recomputes the whole history (for benchmarks: scripts/bench_regenerate.py).
    reuse_history: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.shard_size < 1:
            raise DataError("max_new_tokens, batch_size and shard_size must be >= 1")
        if self.stop_loops < 0:
            raise DataError(f"stop_loops must be >= 0, got {self.stop_loops}")
        if self.lookahead is not None and self.lookahead < 0:
            raise DataError(f"lookahead must be >= 0, got {self.lookahead}")
        if self.engine not in ENGINES:
            raise DataError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise DataError("temperature must be >= 0 and top_p in (0, 1]")

    @property
    def resolved_lookahead(self) -> int:
        """The lookahead used: the one set, else the default for greedy or sampled answers."""
        if self.lookahead is not None:
            return self.lookahead
        return GREEDY_LOOKAHEAD if self.temperature == 0 else 0


@dataclass
class Answer:
    text: str
    tokens: int
    finish_reason: str  # "eos", "length" or "loop"


def conversation_messages(
    item: PromptItem, answers: Sequence[str], turn: int
) -> list[dict[str, str]]:
    """Messages up to user turn `turn`, with the target's answers in between: the ones given
    (:attr:`PromptItem.answered`), then the regenerated ones, `answers`."""
    given = [*item.answered, *answers]
    messages = [{"role": "system", "content": item.system}] if item.system else []
    for index in range(turn + 1):
        messages.append({"role": "user", "content": item.user_turns[index]})
        if index < turn:
            messages.append({"role": "assistant", "content": given[index]})
    return messages


def first_turn(item: PromptItem) -> int:
    """The first user turn of `item` to answer: the one after those answered before."""
    return len(item.answered)


def answer_batch(
    target: Target, conversations: Sequence[list[dict[str, str]]], options: RegenerateOptions
) -> list[Answer]:
    """Let the target answer each conversation's last user turn, as one left-padded batch."""
    tokenizer, model = target.tokenizer, target.model
    texts = [
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        for messages in conversations
    ]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    batch = batch.to(model.device)
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    sampling = (
        {"do_sample": True, "temperature": options.temperature, "top_p": options.top_p}
        if options.temperature > 0
        else {"do_sample": False}
    )
    with torch.inference_mode(), contiguous_head(model):
        # PreTrainedModel's stubs lack generate(); every causal LM has it (GenerationMixin).
        output = cast(Any, model).generate(
            **batch,
            max_new_tokens=options.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id or next(iter(eos_ids)),
            **sampling,
        )
    answers = []
    for row in output[:, batch["input_ids"].shape[1] :].tolist():
        ends = [i for i, token in enumerate(row) if token in eos_ids]
        answers.append(
            _answer(tokenizer, row[: ends[0] if ends else len(row)], bool(ends), options)
        )
    return answers


def _answer(tokenizer: Any, tokens: list[int], ended: bool, options: RegenerateOptions) -> Answer:
    """The answer of ``tokens`` (EOS left out; ``ended``: one followed), cut where it loops as
    the continuous engine stops (``stop_loops``)."""
    cut = loop_cut(tokens, repeats=options.stop_loops)
    reason = "loop" if cut < len(tokens) else "eos" if ended else "length"
    text = str(tokenizer.decode(tokens[:cut], skip_special_tokens=True)).strip()
    return Answer(text, cut + (reason == "eos"), reason)


def answer_items(
    target: Target,
    items: Sequence[PromptItem],
    options: RegenerateOptions,
) -> Iterator[tuple[PromptItem, list[Answer]]]:
    """Answer every user turn of every item, turn by turn (each turn after the target's own
    earlier answers), with the engine the options name (the continuous engine's linear layers
    on the route applied to the target, :mod:`headway.decode.gemm`)."""
    engine = engine_for(target, options.engine)
    if engine == "continuous":
        return _answer_continuously(target, items, options)
    if engine == "batch":
        return _answer_in_batch_steps(target, items, options)
    return _answer_in_padded_batches(target, items, options)


def engine_for(target: Target, engine: str) -> str:
    """The engine ``engine`` names for ``target``; ``auto``:
    :func:`~headway.drafters.target_support.regeneration_engine` (the batch one, but for a few
    targets)."""
    return regeneration_engine(target.model) if engine == "auto" else engine


def prompt_token_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The ids of `messages` through ``tokenizer``'s chat template (a target's), ready for the
    assistant to answer."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def request_seed(seed: int, item_id: str, turn: int) -> int:
    """The seed of one sampled request: fixed by ``seed``, the item and the turn, so a resumed
    run asks exactly what an uninterrupted one did, whatever order requests go out in
    (through a server, or the continuous engine, whose answers then do not depend on the batch,
    lookahead or slots either)."""
    return zlib.crc32(f"{seed}/{item_id}/{turn}".encode()) & 0x7FFFFFFF


def _answer_continuously(
    target: Target, items: Sequence[PromptItem], options: RegenerateOptions
) -> Iterator[tuple[PromptItem, list[Answer]]]:
    """All items through one :class:`ContinuousBatcher`, shortest prompts first (in tokens,
    the answered turns of ``--continue-from`` items included: the rows decoding together are
    then of like lengths, and the batch's cache is as wide as its longest); an item's next
    turn is submitted as soon as its previous answer is in."""
    tokenizer = target.tokenizer
    eos_ids = sorted(set(eos_token_ids(target)))
    batcher = ContinuousBatcher(
        target.model,
        slots=options.batch_size,
        max_new_tokens=options.max_new_tokens,
        eos_token_ids=eos_ids,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0],
        rule=SamplingParams(temperature=options.temperature, top_p=options.top_p),
        lookahead=options.resolved_lookahead,
        stop_loops=options.stop_loops,
        reuse_history=options.reuse_history,
    )
    by_id = {item.id: item for item in items}
    answers: dict[str, list[Answer]] = {item.id: [] for item in items}
    first = {
        item.id: prompt_token_ids(tokenizer, conversation_messages(item, [], first_turn(item)))
        for item in items
    }
    for item in sorted(items, key=lambda item: len(first[item.id])):
        batcher.submit(
            item.id, first[item.id], request_seed(options.seed, item.id, first_turn(item))
        )
    for completion in batcher.completions():
        item = by_id[str(completion.key)]
        text = str(tokenizer.decode(completion.tokens, skip_special_tokens=True)).strip()
        ended = completion.finish_reason == "eos"
        answers[item.id].append(
            Answer(text, len(completion.tokens) + ended, completion.finish_reason)
        )
        turn = first_turn(item) + len(answers[item.id])
        if turn < len(item.user_turns):
            texts = [answer.text for answer in answers[item.id]]
            messages = conversation_messages(item, texts, turn)
            seed = request_seed(options.seed, item.id, turn)
            batcher.submit(item.id, prompt_token_ids(tokenizer, messages), seed)
        else:
            yield item, answers[item.id]
    logger.info(
        "%d forwards, %.2f tokens kept per row and forward (lookahead %d); %d prompt tokens "
        "prefilled, %d taken from the turn before",
        batcher.steps,
        batcher.tokens_per_row_step,
        options.resolved_lookahead,
        batcher.prefilled,
        batcher.reused,
    )


def _answer_in_padded_batches(
    target: Target, items: Sequence[PromptItem], options: RegenerateOptions
) -> Iterator[tuple[PromptItem, list[Answer]]]:
    """HF ``generate`` over left-padded batches of similar length, one turn at a time."""
    order = sorted(items, key=lambda item: sum(len(turn) for turn in item.user_turns))
    for start in range(0, len(order), options.batch_size):
        group = order[start : start + options.batch_size]
        answers: dict[str, list[Answer]] = {item.id: [] for item in group}
        for turn in range(max(len(item.user_turns) for item in group)):
            live = [item for item in group if first_turn(item) <= turn < len(item.user_turns)]
            if not live:  # every item answered this turn before (--continue-from)
                continue
            texts = [[a.text for a in answers[item.id]] for item in live]
            conversations = [
                conversation_messages(i, t, turn) for i, t in zip(live, texts, strict=True)
            ]
            for item, answer in zip(
                live, answer_batch(target, conversations, options), strict=True
            ):
                answers[item.id].append(answer)
        for item in group:
            yield item, answers[item.id]


def _answer_in_batch_steps(
    target: Target, items: Sequence[PromptItem], options: RegenerateOptions
) -> Iterator[tuple[PromptItem, list[Answer]]]:
    """All items through one :class:`~headway.decode.batch_decoder.BatchDecoder`, the engine of
    ``headway.generate_batch`` (one static cache, prompt-lookup trees sized by the step's
    measured cost, finished rows replaced by waiting prompts, steps captured as CUDA graphs on
    a GPU): first turns shortest first, an item's next turn submitted as soon as its answer is
    in, continuing from the keys/values its turn before left (``reuse_history``); an item is
    yielded after its last turn."""
    tokenizer, model = target.tokenizer, target.model
    rows = max(1, min(len(items), options.batch_size))
    spec = _lookup_spec(options.lookahead)
    drafting = RowDrafters([build_drafter(spec, target) if spec else None for _ in range(rows)])
    loops = options.stop_loops
    stop = (lambda tokens: ends_in_loop(tokens, repeats=loops)) if loops else None
    decoder = BatchDecoder(
        model,
        drafting,
        rows,
        Ending(frozenset(eos_token_ids(target)), options.max_new_tokens, stop),
        sampling=SamplingParams(temperature=options.temperature, top_p=options.top_p),
        reuse=options.reuse_history,
    )
    answers: dict[str, list[Answer]] = {item.id: [] for item in items}
    asked: dict[int, PromptItem] = {}

    def ask(item: PromptItem, after: int | None = None) -> None:
        turn = first_turn(item) + len(answers[item.id])
        texts = [answer.text for answer in answers[item.id]]
        prompt = prompts.pop(item.id, None) or prompt_token_ids(
            tokenizer, conversation_messages(item, texts, turn)
        )
        seed = request_seed(options.seed, item.id, turn)
        asked[decoder.submit(torch.tensor(prompt), seed, after)] = item

    prompts = {  # the first turns' prompts, asked shortest first
        item.id: prompt_token_ids(tokenizer, conversation_messages(item, [], first_turn(item)))
        for item in items
        if first_turn(item) < len(item.user_turns)
    }
    for item in sorted(items, key=lambda item: len(prompts.get(item.id, ()))):
        if item.id in prompts:
            ask(item)
    for index, result in decoder.completions():
        item = asked.pop(index)
        ended = result.stop_reason == "eos"
        tokens = result.tokens[:-1] if ended else result.tokens
        answers[item.id].append(_answer(tokenizer, tokens, ended, options))
        if first_turn(item) + len(answers[item.id]) < len(item.user_turns):
            ask(item, after=index)
        else:
            yield item, answers[item.id]
    logger.info(
        "%d prompt tokens prefilled, %d taken from the turn before",
        decoder.prefilled,
        decoder.reused,
    )


def _lookup_spec(lookahead: int | None) -> PromptLookupSpec | None:
    """The batch engine's drafting for ``lookahead``: prompt lookup's default tree (None), one
    of at most ``lookahead`` nodes, or none (0); each step's trees are cut to the size whose
    measured cost pays (:class:`~headway.decode.batch_sizer.BatchSizer`), sampled answers
    too."""
    if lookahead == 0:
        return None
    if lookahead is None:
        return PromptLookupSpec()
    return PromptLookupSpec(num_draft_tokens=lookahead, max_nodes=lookahead)
