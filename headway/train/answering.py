"""How the target answers a shard of prompts: turn by turn, through one of two engines.

- ``batch`` (the default, ``auto``): :class:`~headway.decode.batch_decoder.BatchDecoder`, the
  engine of ``headway generate --batch`` (one static cache, prompt-lookup trees sized by their
  measured cost, finished rows replaced by waiting prompts and next turns, each next turn
  continuing from the keys/values its turn before left, steps captured as CUDA graphs on a
  GPU);
- ``generate``: HF ``generate`` on left-padded batches of similar length (the reference, and
  ``auto``'s engine for the targets the batched steps refuse: recurrent layers, or local and
  full layers under one mask).

Either way, each user turn is answered after the target's own earlier answers (multi-turn
self-distillation), and the answers are the target's: greedy, or sampled from its distribution.
In fp32 both answer alike (``tests/test_regenerate.py``), so a folder may resume on either.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch

from headway.decode.batch_decoder import BatchDecoder, Ending
from headway.decode.batch_drafting import RowDrafters
from headway.decode.batch_step import BatchVerify
from headway.decode.captured import StaticForward
from headway.decode.gemm import contiguous_head
from headway.decode.kv import context_limit
from headway.decode.sampling import SamplingParams
from headway.drafters.build import build_drafter
from headway.drafters.specs import PromptLookupSpec
from headway.drafters.target_support import regeneration_engine
from headway.errors import DataError, TargetError
from headway.generation.repetition import ends_in_loop, loop_cut
from headway.target import Target, eos_token_ids
from headway.train.prompts import PromptItem

logger = logging.getLogger(__name__)

ENGINES = ("auto", "generate", "batch")
# Options that decide speed only: a resumed run may change them (the answers are the target's).
SPEED_OPTIONS = ("batch_size", "engine", "lookahead", "reuse_history")


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
    # "batch": headway.generate_batch's engine (_answer_in_batch_steps); "generate": HF
    # generate on padded batches (the reference); "auto": batch, but for a few targets
    # (:func:`engine_for`).
    engine: str = "auto"
    # batch: the most nodes of the tree each row drafts per step by prompt lookup in its own
    # text, all verified in the same forward (0: one token per step; None: prompt lookup's
    # default tree), each step's trees cut to the size its measured cost pays for.
    lookahead: int | None = None
    # > 0: an answer stops at its first token past this many periods of a repetition loop
    # (headway.generation.repetition), finish_reason "loop". Greedy answers of small targets
    # often loop until max_new_tokens: half of smollm2-sharegpt-2's answer tokens were such tails.
    stop_loops: int = 0
    # batch: a conversation's next turn prefills only what follows the prefix it shares with
    # the row that answered the turn before; False recomputes the whole history (for
    # benchmarks: scripts/bench_regenerate.py).
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
    """The answer of ``tokens`` (EOS left out; ``ended``: one followed), cut where it loops
    (``stop_loops``)."""
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
    earlier answers), with the engine the options name.

    Raises:
        TargetError: ``batch`` for a target the batched steps refuse (their reason, and the
            engine to take instead).
    """
    if engine_for(target, options.engine) == "generate":
        return _answer_in_padded_batches(target, items, options)
    if regeneration_engine(target.model) != "batch":
        try:
            BatchVerify(StaticForward(target.model, capture=False, batch=1), max_depth=1)
        except TargetError as error:
            raise TargetError(f"{error} (regeneration: --engine auto or generate)") from None
    return _answer_in_batch_steps(target, items, options)


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
    (through a server, or the batch engine, whose answers then do not depend on the batch or
    the rows beside them either)."""
    return zlib.crc32(f"{seed}/{item_id}/{turn}".encode()) & 0x7FFFFFFF


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
    yielded after its last turn, or with its turns cut after the last one answered where the
    next one's prompt would not fit the target's context.

    Raises:
        DataError: an item whose first turn to answer does not fit the target's context.
    """
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
    longest = context_limit(model) - options.max_new_tokens - decoder.depth - 1  # a prompt's

    def ask(item: PromptItem, after: int | None = None) -> bool:
        """Submit the item's next turn; False where it would not fit the target's context."""
        turn = first_turn(item) + len(answers[item.id])
        texts = [answer.text for answer in answers[item.id]]
        prompt = prompts.pop(item.id, None) or prompt_token_ids(
            tokenizer, conversation_messages(item, texts, turn)
        )
        if len(prompt) > longest and not answers[item.id]:
            raise DataError(
                f"{item.id}: user turn {turn + 1} makes a prompt of {len(prompt)} tokens, and "
                f"with --max-new-tokens {options.max_new_tokens} the target holds prompts of "
                f"{longest}: lower --max-new-tokens, or answer fewer earlier turns"
            )
        if len(prompt) > longest:
            return False
        seed = request_seed(options.seed, item.id, turn)
        asked[decoder.submit(torch.tensor(prompt), seed, after)] = item
        return True

    prompts = {  # the first turns' prompts, asked shortest first
        item.id: prompt_token_ids(tokenizer, conversation_messages(item, [], first_turn(item)))
        for item in items
        if first_turn(item) < len(item.user_turns)
    }
    for item in sorted(items, key=lambda item: len(prompts.get(item.id, ()))):
        if item.id in prompts:
            ask(item)
    cut = 0
    for index, result in decoder.completions():
        item = asked.pop(index)
        ended = result.stop_reason == "eos"
        tokens = result.tokens[:-1] if ended else result.tokens
        answers[item.id].append(_answer(tokenizer, tokens, ended, options))
        done = first_turn(item) + len(answers[item.id])
        if done < len(item.user_turns) and ask(item, after=index):
            continue
        if done < len(item.user_turns):  # the next turn's history outgrew the context
            cut += 1
            item = replace(item, user_turns=item.user_turns[:done])
        yield item, answers[item.id]
    logger.info(
        "%d prompt tokens prefilled, %d taken from the turn before; %d conversations ended "
        "where their next turn would not fit the target's context",
        decoder.prefilled,
        decoder.reused,
        cut,
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
