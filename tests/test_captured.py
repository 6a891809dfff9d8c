"""The static-cache verify path (``DecodeOptions(verify="captured")``, headway.decode.captured):
on CPU it runs uncaptured through the same buffers, masks, padding and compaction a CUDA graph
replays, and its greedy output is transformers' own (fp32). The CUDA-graph replay itself is
checked against the eager path in tests/test_gpu.py."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch

from headway.decode.captured import COMPILED_CAPACITY, MIN_CAPACITY, StaticForward, block_bucket
from headway.decode.forwards import EagerForward, TargetForward
from headway.decode.generate import Decoder
from headway.decode.options import DecodeOptions
from headway.decode.sampling import SamplingParams
from headway.decode.static_cache import StaticCache
from headway.drafters.eagle3_drafter import Eagle3Drafter
from headway.drafters.lookup import PromptLookupDrafter
from headway.drafters.oracle import OracleDrafter
from headway.hardware import has_cxx_compiler
from headway.heads.eagle import TargetHead
from headway.heads.eagle3 import Eagle3Config, Eagle3Model
from headway.heads.vocab import DraftVocab
from tests.families import family_config, family_model
from tests.test_eagle3 import TREE as EAGLE3_TREE
from tests.test_eagle3 import tiny4
from tests.test_generate import PROMPT, hf_greedy
from tests.tiny import TINY_FAMILIES, TINY_VOCAB, tiny_model

CAPTURED = DecodeOptions(verify="captured")


def test_blocks_are_padded_to_powers_of_two() -> None:
    assert [block_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 4, 4, 8, 8, 16, 64]


def test_compiling_without_a_compiler_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="needs a C\\+\\+ compiler"):
        StaticForward(tiny_model("llama"), compile=True)


def test_capture_off_cuda_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device; the target is on cpu"):
        StaticForward(tiny_model("llama"), capture=True)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tree_logits_equal_the_eager_path(family: str) -> None:
    """Prefill then two verify forwards with compaction in between: the static path's logits
    and hidden states equal the eager path's (padding, stale columns and the wide mask add
    nothing)."""
    model = tiny_model(family)
    paths: dict[str, TargetForward] = {
        "eager": EagerForward(model),
        "static": StaticForward(model),
    }
    parents = torch.tensor([-1, 0, 0, 1, -1])  # 5 nodes: padded to 8 block entries
    block = torch.tensor([[7, 11, 12, 13, 14, 15]])
    results: dict[str, list[Any]] = {}
    with torch.inference_mode():
        for name, path in paths.items():
            path.begin(64)
            logits, hidden = path.prefill(PROMPT[None], (0, 2))
            out = [logits, *hidden]
            prefix = PROMPT.numel()
            logits, hidden = path.verify(block, parents, prefix, (1,))
            out += [logits.clone(), hidden[0].clone()]
            path.compact(prefix, torch.tensor([0, 2]))  # a non-contiguous accepted path
            logits, hidden = path.verify(block[:, :3], parents[:2], prefix + 2, (1,))
            out += [logits, hidden[0]]
            results[name] = out
    for eager, static in zip(results["eager"], results["static"], strict=True):
        assert eager.shape == static.shape
        torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_greedy_output_equals_transformers(family: str) -> None:
    """Chains (prompt lookup) and trees (an oracle of width 3): the output is transformers'
    greedy output, and one Decoder serves several prompts from the same static cache."""
    model = tiny_model(family)
    truth = hf_greedy(model, PROMPT, 40, eos=None)
    for drafter in (PromptLookupDrafter(num_draft_tokens=5, max_nodes=12),
                    OracleDrafter(truth, 4, width=3), None):  # fmt: skip
        decoder = Decoder(model, drafter, CAPTURED)
        assert isinstance(decoder.target, StaticForward)
        for _ in range(2):
            result = decoder.generate(PROMPT, max_new_tokens=40, eos_token_ids=())
            assert result.tokens == truth
        if drafter is not None:
            assert max(result.accept_lengths) > 1


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.skipif(not has_cxx_compiler(), reason="torch.compile needs a C++ compiler")
def test_the_compiled_verify_forward_keeps_the_output() -> None:
    """verify="compiled": the verify forwards through torch.compile (inductor, here on the
    CPU), trees and the device step included; transformers' greedy output, and no recompile
    when a second, longer prompt decodes (static shapes over a cache that starts at
    COMPILED_CAPACITY columns, positions given: nothing specialises on the length)."""
    from torch._dynamo.utils import counters

    model = tiny_model("llama")
    truth = hf_greedy(model, PROMPT, 24, eos=None)
    for drafter in (OracleDrafter(truth, 3, width=2), None):
        decoder = Decoder(model, drafter, DecodeOptions(verify="compiled"))
        assert decoder.generate(PROMPT, max_new_tokens=24, eos_token_ids=()).tokens == truth
    graphs = counters["stats"]["unique_graphs"]
    longer = torch.arange(3, 90) % TINY_VOCAB
    result = decoder.generate(longer, max_new_tokens=30, eos_token_ids=())
    assert result.tokens == hf_greedy(model, longer, 30, eos=None)
    assert counters["stats"]["unique_graphs"] == graphs
    assert isinstance(decoder.target, StaticForward)
    assert decoder.target.cache.capacity == COMPILED_CAPACITY


def test_the_cache_grows_past_its_first_capacity_and_stays_exact() -> None:
    """Verify forwards that run past the smallest static cache: the committed columns are
    copied into a larger one mid-way and the logits still equal the eager path's."""
    model = tiny_model("llama")
    prompt = torch.arange(3, 3 + MIN_CAPACITY - 20) % TINY_VOCAB
    parents = torch.tensor([-1, 0, 1, 0, 3])
    block = torch.tensor([[5, 6, 7, 8, 9, 10]])
    paths: dict[str, TargetForward] = {
        "eager": EagerForward(model),
        "static": StaticForward(model),
    }
    logits: dict[str, list[torch.Tensor]] = {name: [] for name in paths}
    with torch.inference_mode():
        for name, path in paths.items():
            path.begin(16)  # a hint, not a limit
            path.prefill(prompt[None], ())
            length = prompt.numel()
            for _ in range(8):
                out, _ = path.verify(block, parents, length, ())
                logits[name].append(out.clone())
                path.compact(length, torch.tensor([0, 3, 4]))
                length += 3
    static = paths["static"]
    assert isinstance(static, StaticForward) and static.cache.capacity == 2 * MIN_CAPACITY
    for eager, captured in zip(logits["eager"], logits["static"], strict=True):
        torch.testing.assert_close(captured, eager, rtol=1e-5, atol=1e-5)


def test_eagle3_drafter_and_cost_sizing_are_exact() -> None:
    """A drafter that reads the target's hidden states, with trees sized by the static path's own
    timing: still transformers' output."""
    model = tiny4("llama")
    truth = hf_greedy(model, PROMPT, 30, eos=None)
    torch.manual_seed(1)
    vocab = DraftVocab.identity(64, TINY_VOCAB)
    draft = Eagle3Model(Eagle3Config.from_target(model, draft_vocab_size=vocab.size))
    draft.set_vocab(vocab)
    drafter = Eagle3Drafter(draft.eval(), TargetHead.of(model), **EAGLE3_TREE)
    decoder = Decoder(model, drafter, DecodeOptions(verify="captured", sizing="cost"))
    result = decoder.generate(PROMPT, max_new_tokens=30, eos_token_ids=())
    assert result.tokens == truth
    assert decoder.sizer is not None


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_decoding_past_a_sliding_window_is_exact(family: str) -> None:
    """An 8-token window: every verify forward reaches past it (Mistral slides on every layer,
    Gemma 2 alternates sliding and full layers and gets one mask per layer type)."""
    config = family_config(family, layers=4)
    config.sliding_window = 8
    torch.manual_seed(0)
    model = type(family_model(family))(config).eval()
    truth = hf_greedy(model, PROMPT, 30, eos=None)
    drafter = PromptLookupDrafter(num_draft_tokens=5, max_nodes=12)
    result = Decoder(model, drafter, CAPTURED).generate(PROMPT, max_new_tokens=30, eos_token_ids=())
    assert result.tokens == truth


def test_sampling_through_the_static_path_matches_the_eager_path() -> None:
    """Same seed, same sampled tokens: the static path feeds the sampling rule the same
    probabilities."""
    model = tiny_model("qwen2")
    sampling = SamplingParams(temperature=0.8)
    outputs = []
    for options in (DecodeOptions(), CAPTURED):
        drafter = PromptLookupDrafter(num_draft_tokens=4, max_nodes=8)
        generator = torch.Generator().manual_seed(3)
        result = Decoder(model, drafter, options).generate(
            PROMPT, max_new_tokens=40, sampling=sampling, eos_token_ids=(), generator=generator
        )
        outputs.append(result.tokens)
    assert outputs[0] == outputs[1]


def test_growing_the_cache_drops_the_graphs_and_their_memory_pool() -> None:
    """A longer prompt grows the static cache: every graph of the smaller cache and the handle
    of their private pool go (a stale handle crashed the next CUDA capture)."""
    forward = StaticForward(tiny_model("llama"))
    forward.begin(16)
    forward._pool = object()  # as after a capture on CUDA
    forward._shapes[(1, ())] = forward.shape_for(1, ())
    forward.reserve(forward.cache.capacity + 1)
    assert forward._shapes == {} and forward._pool is None


@pytest.mark.parametrize("head_dims", [(4, 4, 4), (4, 8, 4)], ids=["fused", "per-layer"])
def test_compaction_moves_every_layers_columns(head_dims: tuple[int, ...]) -> None:
    """Layers of one shape share one buffer (one gather moves them all); a layer of another
    shape gets buffers of its own, and columns move the same either way."""
    cache = StaticCache(len(head_dims), 8, torch.device("cpu"))
    cache.columns[:, :8] = torch.arange(8)
    written = []
    for layer, dim in zip(cache.layers, head_dims, strict=True):
        keys = torch.randn(1, 2, 8, dim)
        layer.update(keys, keys + 1)
        written.append(keys)
    assert (cache.fused is not None) == (len(set(head_dims)) == 1)
    cache.move_columns(torch.tensor([5, 2, 7]), torch.tensor([1, 2, 3]))
    for layer, keys in zip(cache.layers, written, strict=True):
        expected = keys.clone()
        expected[:, :, 1:4] = keys[:, :, [5, 2, 7]]
        torch.testing.assert_close(layer.keys, expected, rtol=0, atol=0)
        torch.testing.assert_close(layer.values, expected + 1, rtol=0, atol=0)
