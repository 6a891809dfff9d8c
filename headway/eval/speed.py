"""Speed evaluation: a drafter against plain decoding on the same prompts, in one run.

Method (so that runs are comparable and drift hits both sides alike):

- prompts are encoded once (the chat template for chat prompts), batch 1;
- one short warm-up generation of each mode runs first and is not counted;
- then, prompt by prompt, the drafter's decoding and plain decoding run back to back, their order
  alternating from one prompt to the next;
- each generation is timed from the call to its last token (prefill included) with
  :func:`headway.decode.bench.timed`; tokens/s is generated tokens over that time.

Plain decoding is the stock ``model.generate`` (``baseline="hf"``, the default: what a user of
transformers gets) or headway's own loop with no drafter (``baseline="headway"``: isolates the
drafter's effect from the loop's). Both use a fresh :class:`transformers.GenerationConfig`, so
model-specific defaults (repetition penalties and the like) never creep in. At temperature 0 the
drafter's output must equal plain decoding token for token (fp32); sampled runs use the same seed
on both sides but are not expected to match.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import GenerationConfig

from headway.api import prompt_ids
from headway.decode.bench import timed
from headway.decode.generate import Decoder, Drafter, GenerationResult, generate
from headway.decode.keyed_noise import Coupling
from headway.decode.options import DecodeOptions
from headway.decode.sampling import SamplingParams
from headway.decode.tree import DraftTree
from headway.errors import HeadwayError
from headway.eval.turns import asked_turns
from headway.evalsets import EvalPrompt
from headway.target import Target, eos_token_ids

__all__ = ["EvalSettings", "PromptRecord", "RecordingDrafter", "SpeedRun", "run_speed_eval"]

Baseline = Literal["hf", "headway"]


@dataclass(frozen=True)
class EvalSettings:
    """How every prompt is decoded (both modes alike).

    Attributes:
        max_new_tokens: generated tokens per prompt at most.
        temperature: 0 = greedy (outputs must then be identical); > 0 samples.
        top_p: nucleus threshold when sampling (1 = off).
        top_k: sample among the k best when sampling (0 = off).
        seed: seed of prompt i's sampling is ``seed + i`` on both sides.
        baseline: ``"hf"`` (``model.generate``) or ``"headway"`` (the loop with no drafter).
        warmup_tokens: length of the uncounted warm-up generations.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    baseline: Baseline = "hf"
    warmup_tokens: int = 16

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.warmup_tokens < 1:
            raise HeadwayError("--max-new-tokens and the warm-up length must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise HeadwayError("need --temperature >= 0, --top-p in (0, 1] and --top-k >= 0")
        if self.baseline not in ("hf", "headway"):
            raise HeadwayError(f"unknown baseline {self.baseline!r}; use hf or headway")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class PromptRecord:
    """Both decodings of one prompt.

    Attributes:
        tokens / plain_tokens: generated ids of the drafter's run and of plain decoding.
        seconds / plain_seconds: their wall times (prefill included).
        accept_lengths: the drafter run's committed tokens per target forward, prefill first.
        proposed_depths: depth of the tree proposed at each draft step (0 = empty draft).
    """

    id: str
    category: str
    prompt_tokens: int
    tokens: list[int]
    seconds: float
    accept_lengths: list[int]
    proposed_depths: list[int]
    stop_reason: str
    plain_tokens: list[int]
    plain_seconds: float
    turn: int = 1  # which user turn of its conversation the prompt is

    @property
    def identical(self) -> bool:
        return self.tokens == self.plain_tokens


@dataclass
class SpeedRun:
    """Every prompt's records, the settings, and the time spent warming up and decoding."""

    settings: EvalSettings
    records: list[PromptRecord] = field(default_factory=list)
    warmup_seconds: float = 0.0
    verify_seconds: list[float] | None = None
    """Seconds of one verify forward over 1, 2, ... block tokens, as the cost sizer timed them
    (``DecodeOptions(sizing="cost")``); ``None`` when the drafter sizes its own trees."""

    @property
    def decode_seconds(self) -> float:
        """Time inside the timed generations plus the warm-up: the run's useful work."""
        timed_seconds = sum(r.seconds + r.plain_seconds for r in self.records)
        return self.warmup_seconds + timed_seconds


class RecordingDrafter:
    """A :class:`~headway.decode.generate.Drafter` that forwards to another one and keeps every
    proposed tree, so the depth of each proposal is known after the run (computing it is left to
    :meth:`proposed_depths`, outside the timed generation)."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.hidden_layers: tuple[int, ...] = tuple(inner.hidden_layers)
        self.max_nodes = inner.max_nodes
        self.trees: list[DraftTree] = []

    def begin(self, prompt_ids: Tensor) -> None:
        self.trees = []
        self.inner.begin(prompt_ids)

    def couple(self, coupling: Coupling | None) -> None:
        """Hand a sampled sequence's noise to the inner drafter where it drafts with it
        (coupled drafting: an EAGLE drafter evaluated sampled is evaluated as it decodes)."""
        couple = getattr(self.inner, "couple", None)
        if couple is not None:
            couple(coupling)

    def propose(self, sequence: Tensor, floor: float | None = None) -> DraftTree:
        tree = self.inner.propose(sequence, floor)
        self.trees.append(tree)
        return tree

    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        self.inner.observe(new_tokens, hidden)

    def proposed_depths(self) -> list[int]:
        """Depth of every tree proposed since :meth:`begin` (0 for an empty one)."""
        return [int(tree.depths.max()) if tree.size else 0 for tree in self.trees]


def _sampling(settings: EvalSettings) -> SamplingParams:
    return SamplingParams(
        temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p
    )


def _hf_config(target: Target, settings: EvalSettings, max_new_tokens: int) -> GenerationConfig:
    eos = eos_token_ids(target)
    pad = target.tokenizer.pad_token_id
    options: dict[str, Any] = {"do_sample": False}
    if not settings.greedy:
        options = {
            "do_sample": True,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "top_k": settings.top_k,
        }
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        eos_token_id=eos or None,
        pad_token_id=pad if pad is not None else (eos[0] if eos else 0),
        **options,
    )


def plain_runner(
    target: Target, ids: Tensor, settings: EvalSettings, seed: int, max_new_tokens: int
) -> Callable[[], list[int]]:
    """A call that decodes ``ids [P]`` plainly and returns the generated ids."""
    model = target.model
    if settings.baseline == "headway":

        def run_headway() -> list[int]:
            generator = torch.Generator(device=model.device).manual_seed(seed)
            result = generate(
                model,
                ids,
                drafter=None,
                max_new_tokens=max_new_tokens,
                sampling=_sampling(settings),
                eos_token_ids=eos_token_ids(target),
                generator=generator,
            )
            return list(result.tokens)

        return run_headway
    config = _hf_config(target, settings, max_new_tokens)
    batch = ids.to(model.device)[None]

    def run_hf() -> list[int]:
        torch.manual_seed(seed)
        with torch.inference_mode():
            # PreTrainedModel's stubs lack generate(); every causal LM has it (GenerationMixin).
            output = model.generate(  # type: ignore[operator]
                batch, attention_mask=torch.ones_like(batch), generation_config=config
            )
        return [int(token) for token in output[0, batch.shape[1] :]]

    return run_hf


def drafter_runner(
    target: Target,
    ids: Tensor,
    decoder: Decoder,
    settings: EvalSettings,
    seed: int,
    max_new_tokens: int,
) -> tuple[Callable[[], list[int]], list[GenerationResult]]:
    """A call that decodes ``ids [P]`` with ``decoder``, and the list its result lands in."""
    results: list[GenerationResult] = []
    model = target.model

    def run() -> list[int]:
        generator = torch.Generator(device=model.device).manual_seed(seed)
        result = decoder.generate(
            ids,
            max_new_tokens=max_new_tokens,
            sampling=_sampling(settings),
            eos_token_ids=eos_token_ids(target),
            generator=generator,
        )
        results.append(result)
        return list(result.tokens)

    return run, results


def _warm_up(target: Target, ids: Tensor, decoder: Decoder, settings: EvalSettings) -> float:
    """One short uncounted generation of each mode; returns the time it took."""
    started = time.perf_counter()
    drafter_runner(target, ids, decoder, settings, settings.seed, settings.warmup_tokens)[0]()
    plain_runner(target, ids, settings, settings.seed, settings.warmup_tokens)()
    return time.perf_counter() - started


def _decode_prompt(
    target: Target,
    prompt: EvalPrompt,
    ids: Tensor,
    decoder: Decoder,
    drafter: RecordingDrafter,
    settings: EvalSettings,
    index: int,
) -> PromptRecord:
    """Both decodings of one prompt, drafter first on even prompts and plain first on odd."""
    device = target.model.device
    seed = settings.seed + index
    run_drafter, results = drafter_runner(
        target, ids, decoder, settings, seed, settings.max_new_tokens
    )
    run_plain = plain_runner(target, ids, settings, seed, settings.max_new_tokens)
    if index % 2 == 0:
        tokens, seconds = timed(run_drafter, device)
        plain_tokens, plain_seconds = timed(run_plain, device)
    else:
        plain_tokens, plain_seconds = timed(run_plain, device)
        tokens, seconds = timed(run_drafter, device)
    result = results[0]
    return PromptRecord(
        id=prompt.id,
        category=prompt.category,
        prompt_tokens=int(ids.numel()),
        tokens=tokens,
        seconds=seconds,
        accept_lengths=list(result.accept_lengths),
        proposed_depths=drafter.proposed_depths(),
        stop_reason=result.stop_reason,
        plain_tokens=plain_tokens,
        plain_seconds=plain_seconds,
        turn=prompt.turn,
    )


def run_speed_eval(
    target: Target,
    drafter: Drafter,
    prompts: Sequence[EvalPrompt],
    settings: EvalSettings,
    *,
    options: DecodeOptions | None = None,
    progress: bool = True,
) -> SpeedRun:
    """Decode every prompt with ``drafter`` (under ``options``, through one
    :class:`~headway.decode.generate.Decoder`) and plainly, interleaved (see the module
    docstring); a prompt's later turns (``mt-bench-turns``) are prompts of their own, each
    asked after the target's greedy answer (:func:`~headway.eval.turns.asked_turns`).

    Raises:
        HeadwayError: for an empty prompt list.
    """
    if not prompts:
        raise HeadwayError("no prompts to evaluate")
    prompts = asked_turns(target, prompts, settings.max_new_tokens)  # later turns: after answers
    encoded = [prompt_ids(target, prompt.chat_input(), chat=prompt.chat) for prompt in prompts]
    recording = RecordingDrafter(drafter)
    decoder = Decoder(target.model, recording, options or DecodeOptions())
    run = SpeedRun(settings)
    run.warmup_seconds = _warm_up(target, encoded[0], decoder, settings)
    bar = tqdm(total=len(prompts), desc="eval", unit="prompt", disable=not progress)
    with bar:
        for index, (prompt, ids) in enumerate(zip(prompts, encoded, strict=True)):
            record = _decode_prompt(target, prompt, ids, decoder, recording, settings, index)
            run.records.append(record)
            bar.update(1)
            bar.set_postfix(_running_figures(run.records))
    run.verify_seconds = None if decoder.sizer is None else list(decoder.sizer.costs)
    return run


def _running_figures(records: Sequence[PromptRecord]) -> dict[str, str]:
    """tau and speedup so far, for the progress bar."""
    steps = [length for r in records for length in r.accept_lengths[1:]]
    tau = sum(steps) / len(steps) if steps else float("nan")
    drafter_rate = sum(len(r.tokens) for r in records) / max(sum(r.seconds for r in records), 1e-9)
    plain_rate = sum(len(r.plain_tokens) for r in records) / max(
        sum(r.plain_seconds for r in records), 1e-9
    )
    return {"tau": f"{tau:.2f}", "speedup": f"{drafter_rate / max(plain_rate, 1e-9):.2f}x"}
