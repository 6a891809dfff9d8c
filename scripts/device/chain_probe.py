"""Why chained device steps ran slower than single ones on an H100 (2026-11-27, evening).

decode_figures.py measured, bf16, MT-bench x8: plain captured decoding 179.9 tok/s with 8 tokens
a graph replay against 283.4 with one; the EAGLE-3 device step 191.2 against 384.9; and plain
chained decoding as fast in fp32 as in bf16 (host-bound). This probe, run after it on the same
H100 with the random target below (prompt of 100 tokens, 128 new, one run), found a run's one
graph launched at a host cost growing as the square of the run (0.55, 2.42, 9.87 ms for runs of
2, 4, 8 plain steps; 2.8, 7.6, 30.9 ms for the EAGLE-3 32-token tree) but no loss in tokens/s
(plain 292.5 one a run, 301.9 eight; EAGLE-3 at tau ~1 154.6 and 163.4), and chained tokens
equal to single steps' and to HF's fp32 greedy: the real run's loss is not explained here.
Runs now replay one step's graph ``steps`` times (``headway/decode/device_chain.py``).
This probe needs nothing staged (a
SmolLM2-135M-shaped Llama with random weights, as step_costs.py) and prints, per chain length:
tokens/s, graphs captured, host milliseconds a run spends replaying its graphs and in the whole
of ``DeviceChain.run`` (the host read and bookkeeping included); then the host operators of one
chained generation by self CPU time, and whether chained and single-step tokens agree in fp32.

    PYTHONPATH=. python3 scripts/device/chain_probe.py --out "$OUT"
    PYTHONPATH=. python3 scripts/device/chain_probe.py --device cpu --new-tokens 16  # smoke
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from headway.decode import captured, device_chain
from headway.decode.bench import median_timed, random_model, timed
from headway.decode.generate import Decoder
from headway.decode.options import DecodeOptions
from headway.drafters.build import build_drafter
from headway.drafters.specs import EagleSpec
from headway.target import Target

CONFIG = Path(__file__).with_name("smollm2-135m.json")
DRAFTER = Path(__file__).resolve().parents[2] / "drafters" / "smollm2-135m-eagle3"
TIMES: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)


class _TimedGraph:
    """A captured graph whose replays' host time adds to ``TIMES["launch"]``."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph

    def replay(self) -> None:
        begun = time.perf_counter()
        self.graph.replay()
        TIMES["launch"] += time.perf_counter() - begun


def instrument() -> None:
    """Count captures and time, on the host, a run's graph replays and whole chained runs."""
    run, record = device_chain.DeviceChain.run, captured.record_graph
    chain_record = device_chain.DeviceChain._record

    def timed_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        begun = time.perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            TIMES["run"] += time.perf_counter() - begun
            COUNTS["runs"] += 1

    def counted(*args: Any, **kwargs: Any) -> Any:
        COUNTS["captures"] += 1
        return record(*args, **kwargs)

    def timed_record(step: Callable[[], None], device: torch.device) -> _TimedGraph:
        COUNTS["captures"] += 1
        return _TimedGraph(chain_record(step, device))

    device_chain.DeviceChain.run = timed_run  # type: ignore[method-assign]
    device_chain.DeviceChain._record = staticmethod(timed_record)  # type: ignore[method-assign]
    captured.record_graph = counted


def decoder(model: Any, chain: int, eagle: bool) -> Decoder:
    options = DecodeOptions(verify="captured", chain=chain)
    if not eagle:
        return Decoder(model, None, options)
    target = Target(model=model, tokenizer=None, source="random smollm2-135m")  # type: ignore[arg-type]
    spec = EagleSpec(
        heads=str(DRAFTER), top_k=8, depth=6, total_tokens=32, drafting="static", force=True
    )
    return Decoder(model, build_drafter(spec, target), options)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per generation")
    parser.add_argument("--prompt-tokens", type=int, default=100, help="random prompt length")
    parser.add_argument("--repeats", type=int, default=3, help="timed generations (median)")
    parser.add_argument("--chains", default="1,2,4,8", help="steps a run, comma-separated")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated")
    parser.add_argument("--out", default=".", help="folder for chain_probe.md and profiles")
    args = parser.parse_args(argv)
    device, new = torch.device(args.device), args.new_tokens
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)
        (out / "chain_probe.md").write_text("\n".join(lines) + "\n", encoding="utf-8")

    instrument()
    chains = [int(c) for c in args.chains.split(",")]
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        model: Any = random_model(CONFIG, device, dtype)
        prompt = torch.randint(3, model.config.vocab_size, (args.prompt_tokens,), device=device)
        say(f"\n### {dtype}, {new} new tokens, prompt {args.prompt_tokens}")
        say("| row | chain | tok/s | steps | captures | runs | launch ms/run | run ms/run |")
        say("|---|---|---|---|---|---|---|---|")
        tokens: dict[tuple[bool, int], list[int]] = {}
        for eagle in (False, True):
            for chain in chains:
                dec = decoder(model, chain, eagle)
                TIMES.clear()
                COUNTS.clear()

                def run(dec: Decoder = dec, prompt: torch.Tensor = prompt) -> Any:
                    return dec.generate(prompt, max_new_tokens=new, eos_token_ids=())

                seconds, result = median_timed(run, device, args.repeats)
                runs = max(COUNTS["runs"], 1)
                tokens[eagle, chain] = list(result.tokens)
                steps = len(result.accept_lengths)
                say(
                    f"| {'eagle3 32' if eagle else 'plain'} | {chain} | {new / seconds:.1f} | "
                    f"{steps} | {COUNTS['captures']} | {COUNTS['runs']} | "
                    f"{TIMES['launch'] * 1000 / runs:.2f} | {TIMES['run'] * 1000 / runs:.2f} |"
                )
        for eagle in (False, True):
            same = [c for c in chains if tokens[eagle, c] == tokens[eagle, chains[0]]]
            say(f"{'eagle3' if eagle else 'plain'}: chains with chain {chains[0]}'s tokens: {same}")
        if dtype == torch.float32:
            hf = model.generate(
                prompt[None], max_new_tokens=new, min_new_tokens=new, do_sample=False
            )
            ref = hf[0, args.prompt_tokens :].tolist()
            for key, got in tokens.items():
                diff = [i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b]
                same = got[: len(ref)] == ref
                say(f"fp32 {key}: equal to HF eager greedy: {same} (first diff {diff[:1]})")
        dec = decoder(model, chains[-1], False)
        dec.generate(prompt, max_new_tokens=new, eos_token_ids=())
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if device.type == "cuda" else []
        )
        with profile(activities=activities) as prof:
            timed(partial(dec.generate, prompt, max_new_tokens=new, eos_token_ids=()), device)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        (out / f"probe-profile-{str(dtype)[6:]}.txt").write_text(table, encoding="utf-8")
        say("```\n" + "\n".join(table.splitlines()[:22]) + "\n```")
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
