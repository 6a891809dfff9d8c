"""The Python API: load a target and a drafter, generate text losslessly.

    import headway
    target = headway.load_target("smollm2-135m")
    out = headway.generate(target, "Name three rivers.", max_new_tokens=64)  # the default drafter
    print(out.text, out.tau)
    drafter = headway.load_drafter("runs/medusa1-smollm2", target)   # or "prompt-lookup"
    # or a typed spec: headway.load_drafter(EagleSpec(heads="runs/eagle3", depth=5), target)
    out = headway.generate(target, "Name three rivers.", drafter=drafter, max_new_tokens=64)

``drafter="default"`` (the default of :func:`generate`) is what ``headway generate`` runs when no
drafter is named: the drafter shipped for the target, cost-sized, else retrieval over a corpus
the target regenerated, else prompt lookup (:func:`headway.drafters.resolve.resolve_drafter`
decides for both).

Token-level work happens in :mod:`headway.decode`; this module adds text in and text out (chat
template, EOS ids from the target's generation config, stop strings) and timing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from headway.decode.batch_decode import decode_batch
from headway.decode.batch_rows import rows_that_fit
from headway.decode.generate import Decoder, Drafter, GenerationResult
from headway.decode.options import DecodeOptions, verify_path
from headway.decode.probe import check_tree_mask
from headway.decode.sampling import SamplingParams
from headway.drafters.batch_eagle import BatchEagle
from headway.drafters.batch_medusa import BatchMedusa
from headway.drafters.build import build_drafter
from headway.drafters.eagle_drafter import EagleDrafter
from headway.drafters.medusa_drafter import MedusaDrafter
from headway.drafters.resolve import resolve_drafter
from headway.drafters.specs import SPEC_TYPES, DrafterSpec
from headway.errors import HeadwayError
from headway.named_drafters import DEFAULT_DRAFTER, borrow, borrow_drafter, choice_for
from headway.target import Target, eos_token_ids


@dataclass
class Generation:
    """One generation: the text, the generated ids and how the drafter did."""

    text: str
    token_ids: list[int]
    accept_lengths: list[int]
    tau: float
    tokens_per_s: float
    stop_reason: str
    acceptance: str = "lossless"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``tau`` is ``None`` when no draft step ran (one generated token)."""
        return {
            "acceptance": self.acceptance,
            "text": self.text,
            "token_ids": self.token_ids,
            "accept_lengths": self.accept_lengths,
            "tau": self.tau if math.isfinite(self.tau) else None,
            "tokens_per_s": self.tokens_per_s,
            "stop_reason": self.stop_reason,
        }


def load_drafter(
    source: str | Path | DrafterSpec,
    target: Target,
    *,
    options: Mapping[str, object] | None = None,
) -> Drafter:
    """A drafter for ``target``: a spec (:mod:`headway.drafters.specs`), a drafter name
    (``"prompt-lookup"``, ``"retrieval"``, ..., or ``"default"``) or a heads folder, with
    ``options`` checked against that drafter's spec exactly as ``--draft-option`` values are (an
    unknown key gets the nearest valid name), e.g. ``load_drafter("runs/eagle3", target,
    options={"depth": 5})``. The default drafter's sizing is :func:`generate`'s business: pass
    ``"default"`` there to run it as the command line does.

    A Medusa-2 run merges its LoRA adapter into ``target.model`` in place (logged): the output is
    then the merged model's, so compare it with plain decoding of this same ``target``."""
    if isinstance(source, SPEC_TYPES):
        if options:
            raise HeadwayError("give options inside the spec, not beside it")
        return build_drafter(source, target)
    choice = choice_for(str(source), target, options)
    if choice.spec is None:
        raise HeadwayError("'none' is no drafter: pass drafter=None to generate instead")
    return build_drafter(choice.spec, target)


def prompt_ids(
    target: Target, prompt: str | Sequence[dict[str, str]], *, chat: bool
) -> torch.Tensor:
    """Token ids ``[P]`` of a prompt: a string (wrapped as one user message when `chat`) or a
    list of chat messages, rendered with ``add_generation_prompt=True``."""
    tokenizer = target.tokenizer
    if isinstance(prompt, str) and not chat:
        return tokenizer(prompt, return_tensors="pt")["input_ids"][0]
    if not getattr(tokenizer, "chat_template", None):
        raise HeadwayError(
            f"chat prompts need a tokenizer with a chat template; {target.source}'s has none (a "
            "base model?): pass a string with chat=False (headway.generate), or leave out --chat"
        )
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    encoded: Any = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    return torch.as_tensor(encoded["input_ids"][0])


def generate(
    target: Target,
    prompt: str | Sequence[dict[str, str]],
    *,
    drafter: Drafter | Decoder | str | None = DEFAULT_DRAFTER,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    chat: bool = True,
    stop: Sequence[str] = (),
    on_text: Callable[[str], None] | None = None,
    options: DecodeOptions | None = None,
) -> Generation:
    """Generate from `prompt` with speculative decoding.

    At temperature 0 the output equals the target's own greedy decoding (exactly, in fp32); with
    sampling it follows the target's distribution, and one ``seed`` samples one text with any
    drafter, tree and device (up to the rounding of the forward; each token is drawn with a
    noise keyed by the seed and its position, :mod:`headway.decode.keyed_noise`). Generation
    stops right after the token that
    completes one of the `stop` strings in the decoded text (the match stays in the output).
    `on_text` receives each newly committed piece of text. ``options`` are the
    :class:`DecodeOptions` (cost sizing, GEMM order, acceptance rule: ``acceptance="typical"``
    is Medusa's typical acceptance, LOSSY when sampling; at temperature 0 both rules are greedy).
    Pass a :class:`~headway.decode.generate.Decoder` as ``drafter`` (it carries its own options)
    to keep one cost calibration over many prompts. ``drafter`` as a string is resolved as
    the command line resolves ``--drafter``/``--heads`` (``"default"``: the shipped drafter,
    cost-sized, unless ``options`` say otherwise), and what a name (or a heads folder, while its
    files are unchanged) resolved to is kept for the next call with this ``target``
    (:mod:`headway.named_drafters`: the drafter, and its decoder where that holds nothing of
    earlier calls, e.g. CUDA graphs);
    ``None`` decodes without a drafter. Without
    ``options`` the verify path is the command line's ``--verify auto``
    (:func:`~headway.decode.options.verify_path`: captured on CUDA, where the default drafter
    drafts in fixed shapes over a 32-token tree, eager elsewhere).
    """
    model = target.model
    verify = options.verify if options is not None else verify_path("auto", model)
    give_back: Callable[[], None] | None = None
    if isinstance(drafter, str):
        decoder, give_back = borrow(drafter, target, verify, options)
    elif isinstance(drafter, Decoder):
        if options is not None:
            raise HeadwayError("a Decoder carries its own DecodeOptions; pass options to it")
        decoder = drafter
    else:
        decoder = Decoder(model, drafter, options or DecodeOptions(verify=verify))
    check_tree_mask(model)  # once per model: refuses one that ignores the 4-D tree mask
    ids = prompt_ids(target, prompt, chat=chat).to(model.device)
    generator = torch.Generator().manual_seed(seed)  # on the host: one text per seed anywhere
    streamer = _TextStreamer(target, on_text) if on_text else None
    start = time.perf_counter()
    result = decoder.generate(
        ids,
        max_new_tokens=max_new_tokens,
        sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
        eos_token_ids=eos_token_ids(target),
        stop_check=_stop_strings(target, stop) if stop else None,
        generator=generator,
        on_tokens=streamer,
    )
    seconds = time.perf_counter() - start
    if give_back is not None:
        give_back()
    if streamer is not None:
        streamer.flush()
    return _generation(target, result, seconds, decoder.options.acceptance)


BATCH_DRAFTER = "prompt-lookup"
"""What :func:`generate_batch` drafts with unless told otherwise (a trained drafter in a batch
pays less on a CPU, whose batched steps are bound by arithmetic: docs/usage.md)."""


def generate_batch(
    target: Target,
    prompts: Sequence[str],
    *,
    drafter: str | None = BATCH_DRAFTER,
    heads: str | Path | None = None,
    draft_options: Mapping[str, object] | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    chat: bool = True,
    stop: Sequence[str] = (),
    batch_size: int | None = None,
    on_done: Callable[[int], None] | None = None,
) -> list[Generation]:
    """Decode ``prompts`` together, at most ``batch_size`` at once (default: as many as a
    quarter of the memory free now holds for their keys and values, at most all of them,
    :func:`~headway.decode.batch_rows.rows_that_fit`; the others take finished prompts' places
    as they finish): every step verifies one draft tree per prompt in one forward over one
    static cache and reads the device once for all of them
    (:mod:`headway.decode.batch_decode`); at temperature 0 each output is the target's greedy
    output for its prompt alone (exactly, in fp32), sampled each follows the target's
    distribution, and the first prompt's tokens are what :func:`generate` samples for it with
    the same ``seed`` (each prompt has its own seed from ``seed``, whatever the drafter, the
    batch size and the rows beside it: :mod:`headway.decode.keyed_noise`); a row stops right
    after the token that completes one of the ``stop`` strings, as in :func:`generate`.
    ``drafter``: a
    name (``"prompt-lookup"``, the default here, ``"retrieval"``, ``"lookup-medusa"``),
    ``"default"`` (what :func:`generate` takes: the drafter shipped for the target, ...) or
    None; ``heads``: a trained drafter's folder, which drafts instead of prompt lookup when
    ``drafter`` is left at its default; ``draft_options`` as ``--draft-option``'s.
    An EAGLE drafter drafts every prompt's tree at once, one draft forward per tree level for
    all of them (:class:`~headway.drafters.batch_eagle.BatchEagle`), and Medusa heads run once
    on every prompt's state (:class:`~headway.drafters.batch_medusa.BatchMedusa`); other
    drafters one per prompt, from that prompt's own tokens. Without ``draft_options``
    the drafter is kept for the next call with this ``target``, as :func:`generate` keeps
    it (:mod:`headway.named_drafters`). ``on_done(n)`` hears how many prompts have finished
    as they finish. Each generation's ``tokens_per_s``
    is its own tokens over the whole batch's time (the batch's throughput is their sum).

    Raises:
        HeadwayError: a drafter that cannot be built for the target, or prompts and
            ``max_new_tokens`` past the target's context.
    """
    model = target.model
    check_tree_mask(model)
    ids = [prompt_ids(target, prompt, chat=chat) for prompt in prompts]
    rows = min(len(prompts), batch_size or rows_that_fit(model, ids, max_new_tokens))
    if heads is not None and drafter == BATCH_DRAFTER:  # heads given: they draft
        drafter = DEFAULT_DRAFTER
    drafters, give_back = _batch_drafting(target, drafter, heads, draft_options, rows)
    start = time.perf_counter()
    results = decode_batch(
        model,
        ids,
        drafters,
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos_token_ids(target),
        stop_check=_stop_strings(target, stop) if stop else None,
        sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
        generator=torch.Generator().manual_seed(seed),
        max_batch=rows,
        on_done=on_done,
    )
    seconds = time.perf_counter() - start  # every row's tokens/s over the batch's time
    give_back()
    return [_generation(target, result, seconds, "lossless") for result in results]


def _batch_drafting(
    target: Target,
    drafter: str | None,
    heads: str | Path | None,
    options: Mapping[str, object] | None,
    batch: int,
) -> tuple[list[Drafter | None] | BatchEagle | BatchMedusa, Callable[[], None]]:
    """The drafting of a batch of ``batch`` prompts: one EAGLE draft model or one set of
    Medusa heads drafting every row's tree at once (:class:`~headway.drafters.batch_eagle.
    BatchEagle`, :class:`~headway.drafters.batch_medusa.BatchMedusa`), or one drafter per row
    (the others draft from a row's own tokens); and
    the call that gives back what was borrowed. Without ``options`` the first drafter is the
    one :func:`~headway.named_drafters.borrow_drafter` keeps between calls (a trained drafter's
    weights are read once), with them it is built for this call."""
    if drafter is None and heads is None:
        return [None] * batch, lambda: None
    name = str(heads) if heads is not None and drafter in (None, DEFAULT_DRAFTER) else drafter
    if not options and name is not None and (heads is None or name == str(heads)):
        first, give_back = borrow_drafter(name, target)
        spec = lambda: choice_for(name, target).spec  # noqa: E731  (rows past the first)
    else:
        asked = None if drafter == DEFAULT_DRAFTER else drafter
        folder = None if heads is None else str(heads)
        made = resolve_drafter(target.model, drafter=asked, heads=folder, options=options).spec
        first = None if made is None else build_drafter(made, target)
        give_back, spec = (lambda: None), (lambda: made)
    if first is None:
        return [None] * batch, give_back
    if isinstance(first, EagleDrafter):
        return BatchEagle(first, batch), give_back
    if isinstance(first, MedusaDrafter):
        return BatchMedusa(first, batch), give_back
    rows = spec()
    assert rows is not None  # it gave the first drafter
    return [first, *(build_drafter(rows, target) for _ in range(batch - 1))], give_back


def _generation(
    target: Target, result: GenerationResult, seconds: float, acceptance: str
) -> Generation:
    """``result`` as text and figures, its tokens over ``seconds`` of generation."""
    tokens = [int(token) for token in result.tokens]
    return Generation(
        text=str(target.tokenizer.decode(tokens, skip_special_tokens=True)),
        token_ids=tokens,
        accept_lengths=list(result.accept_lengths),
        tau=result.tau,
        tokens_per_s=len(tokens) / seconds if seconds > 0 else 0.0,
        stop_reason=result.stop_reason,
        acceptance=acceptance,
    )


def _stop_strings(target: Target, stops: Sequence[str]) -> Callable[[list[int]], bool]:
    """A check, run after every committed token, for a stop string in the decoded tail. A stop
    string first appears at the end of the text, so only the last few tokens are decoded."""
    window = max(len(text) for text in stops) + 4

    def check(generated: list[int]) -> bool:
        tail = str(target.tokenizer.decode(generated[-window:], skip_special_tokens=True))
        return any(text in tail for text in stops)

    return check


class _TextStreamer:
    """Turns committed token ids into committed text pieces. The whole output is decoded each
    time, so a character split over several tokens comes out whole; an incomplete UTF-8 tail is
    held back until its rest arrives or :meth:`flush` is called."""

    def __init__(self, target: Target, on_text: Callable[[str], None]) -> None:
        self.tokenizer = target.tokenizer
        self.on_text = on_text
        self.generated: list[int] = []
        self.emitted = 0

    def __call__(self, tokens: list[int]) -> None:
        self.generated.extend(tokens)
        self._emit(final=False)

    def flush(self) -> None:
        self._emit(final=True)

    def _emit(self, *, final: bool) -> None:
        text = str(self.tokenizer.decode(self.generated, skip_special_tokens=True))
        if text.endswith("\ufffd") and not final:
            return
        if len(text) > self.emitted:
            self.on_text(text[self.emitted :])
            self.emitted = len(text)
