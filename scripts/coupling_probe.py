"""How often a sampled step's first drafted level would be accepted, today and with coupled drafts.

Today a sampled step sends the draft's top-k children of the root (deterministic candidates):
one is accepted with the target's summed probability of them, ``sum_{c in topk(q)} p(c)``.
With sampling noise keyed by position (headway/decode/keyed_noise.py) the drafter can know the
noise the target will draw with: if the target's token is ``argmax(log p + g)`` (Gumbel-max,
``g`` keyed by seed, position and token), a drafter proposing ``topk(log q + g)`` (the same
``g``) is accepted with ``P(argmax(log p + g) in topk(log q + g))``, which tends to 1 as q
tends to p, where top-k of q saturates at the top-k mass of p. This script measures both on
real steps: plain sampled decoding of MT-bench prompts (SmolLM2, fp32, the shipped EAGLE-3
drafter observing every step), at each step the target's p at the root and the draft's q for
its first level, then the two acceptance figures (Monte Carlo over ``--draws`` Gumbel draws
per step) for k = 1, 2, 4, 8.

Then it decodes the same prompts both ways, coupled and not (``--sizing``: cost-sized or the
default tree),
and prints tau and tokens/s: the texts are the same (the target's draws do not depend on the
drafts), so the two rows differ only in how much of each text the drafts covered.

    python scripts/coupling_probe.py --num-prompts 8 --max-new-tokens 64 --temperature 1.0
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Literal

import torch

from headway.api import prompt_ids
from headway.decode import generate as loop
from headway.decode.generate import Decoder
from headway.decode.options import DecodeOptions
from headway.decode.sampling import SamplingParams, probs_from_logits
from headway.drafters.build import build_drafter
from headway.drafters.shipped import shipped_heads
from headway.drafters.specs import EagleSpec
from headway.eval.turns import asked_turns
from headway.evalsets import load_prompts
from headway.target import eos_token_ids, load_target

KS = (1, 2, 4, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=8, help="MT-bench prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--draws", type=int, default=400, help="Gumbel draws per step")
    parser.add_argument(
        "--sizing",
        choices=("cost", "drafter"),
        default="cost",
        help="how the decoded trees are sized: by cost (a CPU's default) or by the drafter "
        "(the default 16-token tree, as a GPU drafts it)",
    )
    parser.add_argument(
        "--prompts",
        default="mt-bench",
        help="mt-bench (default), mt-bench-turns, humaneval or a .jsonl file",
    )
    parser.add_argument(
        "--flatten",
        type=float,
        nargs="+",
        default=[1.0, 1.5, 2.0, 3.0],
        help="the draft's log-probabilities divided by each before coupling (a drafter sharper "
        "than the target couples better flattened)",
    )
    args = parser.parse_args()
    target = load_target("smollm2-135m", dtype="float32", device="cpu")
    heads = shipped_heads(target.model)[0]
    drafter: Any = build_drafter(EagleSpec(heads=str(heads), dtype="target"), target)
    sampling = SamplingParams(temperature=args.temperature)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (p [V], q over the target's ids [V])
    original = loop.verify

    def recording(tree: Any, logits: torch.Tensor, *rest: Any, **kwargs: Any) -> Any:
        feature = drafter._root_feature
        if feature is not None:  # the EAGLE-3 draft head, over its draft vocabulary
            draft = drafter.draft3
            log_q = torch.log_softmax(draft.logits(feature[None]).float(), -1)[0]
            ids = draft.vocab.to_target(torch.arange(log_q.numel(), device=log_q.device))
            q = torch.zeros(logits.shape[-1])
            q[ids.cpu()] = torch.softmax(log_q / args.temperature, -1).cpu()
            pairs.append((probs_from_logits(logits[0], sampling).cpu(), q))
        return original(tree, logits, *rest, **kwargs)

    loop.verify = recording
    decoder = Decoder(target.model, drafter)
    prompts = [
        prompt_ids(target, prompt.chat_input(), chat=True)
        for prompt in asked_turns(
            target, load_prompts(args.prompts, limit=args.num_prompts), args.max_new_tokens
        )
    ]
    drafter.couple = lambda coupling: None  # the first table compares q's top-k to coupling
    for index, prompt in enumerate(prompts):
        decoder.generate(
            prompt,
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            eos_token_ids=eos_token_ids(target),
            generator=torch.Generator().manual_seed(index),
        )
    loop.verify = original
    print(f"{len(pairs)} steps, temperature {args.temperature}, {args.draws} draws a step")
    today = dict.fromkeys(KS, 0.0)
    coupled = {(k, f): 0.0 for k in KS for f in args.flatten}
    inverse = dict.fromkeys(KS, 0.0)
    entropy_p = entropy_q = 0.0
    generator = torch.Generator().manual_seed(0)
    for p, q in pairs:
        ranked = q.argsort(descending=True)
        for k in KS:
            today[k] += float(p[ranked[:k]].sum())
        entropy_p -= float((p * p.clamp_min(1e-30).log()).sum())
        entropy_q -= float((q * q.clamp_min(1e-30).log()).sum())
        gumbel = -torch.log(-torch.log(torch.rand(args.draws, p.numel(), generator=generator)))
        drawn = (p.log() + gumbel).argmax(-1)  # [draws]
        uniforms = torch.rand(args.draws, generator=generator, dtype=torch.float64)
        target_cdf = p.double().cumsum(-1)
        draft_cdf = q.double().cumsum(-1)
        at = torch.searchsorted(target_cdf, (uniforms * target_cdf[-1])[:, None]).squeeze(-1)
        mine = torch.searchsorted(draft_cdf, (uniforms * draft_cdf[-1])[:, None]).squeeze(-1)
        for k in KS:  # the draft's own draw with the target's uniform, then its top k - 1
            others = (ranked[: k - 1][None, :] == at[:, None]).any(-1)
            inverse[k] += float(((mine == at) | others).double().mean())
        for flatten in args.flatten:
            proposed = (q.log() / flatten + gumbel).topk(max(KS), dim=-1).indices  # [draws, 8]
            for k in KS:
                hit = (proposed[:, :k] == drawn[:, None]).any(-1).double().mean()
                coupled[(k, flatten)] += float(hit)
    steps = len(pairs)
    print(f"mean entropy: target {entropy_p / steps:.2f} nats, draft {entropy_q / steps:.2f}")
    columns = " | ".join(f"Gumbel, q^(1/{f})" for f in args.flatten)
    print(f"k | top-k of q (today) | inverse CDF, id order | {columns}")
    for k in KS:
        cells = " | ".join(f"{coupled[(k, f)] / steps:.3f}" for f in args.flatten)
        print(f"{k} | {today[k] / steps:.3f} | {inverse[k] / steps:.3f} | {cells}")

    decode_both_ways(target, heads, prompts, sampling, args.max_new_tokens, args.sizing)


def decode_both_ways(
    target: Any,
    heads: Any,
    prompts: list[Any],
    sampling: SamplingParams,
    new: int,
    sizing: Literal["cost", "drafter"],
) -> None:
    """The prompts decoded coupled and uncoupled (trees sized by ``sizing``), each prompt with
    the same seed both ways: one text, two acceptance figures."""
    print("drafting | tau | tokens/s | same text")
    texts = []
    for coupled in (False, True, False, True):  # each twice, alternating
        drafter: Any = build_drafter(EagleSpec(heads=str(heads)), target)
        if not coupled:
            drafter.couple = lambda coupling: None
        decoder = Decoder(target.model, drafter, DecodeOptions(sizing=sizing))
        accepted = steps = tokens = 0
        seconds = 0.0
        found = []
        for index, prompt in enumerate(prompts):
            started = time.perf_counter()
            result = decoder.generate(
                prompt,
                max_new_tokens=new,
                sampling=sampling,
                eos_token_ids=eos_token_ids(target),
                generator=torch.Generator().manual_seed(index),
            )
            seconds += time.perf_counter() - started
            accepted += sum(result.accept_lengths[1:])
            steps += len(result.accept_lengths) - 1
            tokens += len(result.tokens)
            found.append(result.tokens)
        texts.append(found)
        name = "coupled" if coupled else "top-k"
        print(f"{name} | {accepted / steps:.2f} | {tokens / seconds:.1f} | {found == texts[0]}")


if __name__ == "__main__":
    main()
