"""What ``headway quickstart`` does at each stage: one plan for the embedded SmolLM2 on a CPU, one
for ``--tiny``.

Sizing of :data:`SMOLLM2_PLAN`, chosen so that the whole run takes minutes on 2 CPU cores (the
stage times and figures measured with it are in docs/benchmarks.md):

- *data*: the target answers 112 prompts (80 templated instructions, 16 code, 16 chitchat) in
  bfloat16, 32 at a time. Drafts never change what is committed, so training data need not be
  float32.
- *train*: two Medusa-1 heads over the 4,096 most frequent trained tokens (a ``[4096, H]`` LM
  head each instead of ``[49152, H]``: a step of the quickstart's training took 17.5 s instead
  of 47.1 on one core of a 2-core AVX2 EPYC, 2026-11-28), features from the target (bf16 where
  the CPU computes it natively), 20 steps of 8 samples x 320 tokens. The heads come out weak
  (DESIGN.md: tiny data gives weak heads).
- *eval*: 4 MT-bench questions x 256 new tokens against ``model.generate``. Where a float32
  verify forward over a few tokens costs well over a one-token forward (MKL's small-M sgemm on
  some CPUs), a drafted token pays only if it is accepted most of the time, and weak heads
  drafting every step are slower than plain decoding. So the drafter drafts only what is likely:
  prompt lookup on 2-4-gram matches (a 2-gram minimum: 1-gram matches paid less), merged with
  the heads' top-1 chain, gated by a confidence threshold calibrated on held-out data
  (:mod:`headway.quickstart.calibrate`). Where no threshold
  reaches break-even after 20 steps of training, the gate turns the heads off and says so, and
  the speedup is prompt lookup's. Longer training is what lets the heads in.

Where verify forwards of 2-8 tokens take a faster GEMM route (:mod:`headway.decode.gemm`) they
can cost less than a one-token forward; the measured break-even is then 0 and the gate lets the
heads' confident guesses in.
"""

from __future__ import annotations

from dataclasses import dataclass

from headway.hardware import native_dtype

__all__ = ["SMOLLM2_PLAN", "TINY_PLAN", "QuickstartPlan"]


@dataclass(frozen=True)
class QuickstartPlan:
    """Every knob of the quickstart.

    Attributes:
        tiny: build the tiny random target instead of loading ``target``.
        mix: ``headway data regenerate --mix``; ``TINY_CHAT`` stands for the tiny chat file.
        train_overrides: ``section.key=value`` settings of the training run.
        export_format: ``medusa-vllm`` or ``medusa``; the eval reads the heads back from it.
        eval_prompts: ``mt-bench`` (or any prompt set); None = the tiny prompts file.
        draft_dtype: dtype the heads draft in (the target always verifies in float32).
        regen_dtype: dtype the target regenerates the data and computes training features in;
            ``auto`` (:meth:`data_dtype`): bfloat16 where this machine computes it natively,
            float32 elsewhere (emulated bf16 is slower than fp32 on an AVX2-only CPU).
        prompt_lookup: merge prompt lookup's drafts (first) with the heads'.
        confidence: the heads draft a token only while their cumulative probability >= this;
            None calibrates it on held-out data (:mod:`headway.quickstart.calibrate`).
        draft_vocab_size: the heads train and propose over the most frequent trained tokens of
            the data only (``medusa.draft_vocab_size``; 0 = all).
    """

    tiny: bool
    target: str
    mix: str
    regen_max_new_tokens: int
    regen_batch_size: int
    regen_shard_size: int
    train_overrides: tuple[str, ...]
    eval_num_prompts: int
    eval_max_new_tokens: int
    eval_prompts: str | None = "mt-bench"
    device: str = "cpu"
    regen_dtype: str = "auto"
    export_format: str = "medusa-vllm"
    draft_dtype: str = "float32"
    prompt_lookup: bool = True
    lookup_min_ngram: int = 2
    lookup_max_ngram: int = 4
    lookup_tokens: int = 8
    confidence: float | None = None
    draft_vocab_size: int = 4096

    def data_dtype(self) -> str:
        """``regen_dtype`` resolved here (:func:`headway.hardware.native_dtype`)."""
        if self.regen_dtype != "auto":
            return self.regen_dtype
        return native_dtype(self.device)


SMOLLM2_PLAN = QuickstartPlan(
    tiny=False,
    target="smollm2-135m",
    mix="instruct:80,code:16,chitchat:16",
    regen_max_new_tokens=160,
    regen_batch_size=32,
    regen_shard_size=32,
    train_overrides=(
        "train.method=medusa1",
        "medusa.num_heads=2",
        "medusa.num_layers=1",
        "data.max_length=320",
        "data.eval_fraction=0.05",
        "train.max_steps=20",
        "train.warmup_steps=2",
        "train.batch_size=8",
        "train.lr=3e-3",
        "train.mixed_precision=auto",
        "train.eval_every=20",
        "train.save_every=5",
    ),
    eval_num_prompts=4,
    eval_max_new_tokens=256,
)

TINY_PLAN = QuickstartPlan(
    tiny=True,
    target="tiny",
    mix="TINY_CHAT:12",
    regen_max_new_tokens=16,
    regen_batch_size=6,
    regen_shard_size=6,
    regen_dtype="float32",
    train_overrides=(
        "train.method=medusa1",
        "medusa.num_heads=2",
        "data.max_length=64",
        "data.eval_fraction=0.25",
        "train.max_steps=3",
        "train.warmup_steps=1",
        "train.batch_size=4",
        "train.eval_every=3",
        "train.save_every=3",
    ),
    eval_prompts=None,
    eval_num_prompts=3,
    eval_max_new_tokens=24,
    draft_vocab_size=128,  # of ~300 tokens: the tiny run trains heads over a draft vocabulary too
    # random heads are never confident: a low bar makes the tiny run exercise the heads' drafts
    confidence=0.001,
)
