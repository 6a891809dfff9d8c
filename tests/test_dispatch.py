"""The CPU proxy for GPU decoding cost: ops counted where they run, syncs counted, and nothing
left patched afterwards."""

from __future__ import annotations

import pytest
import torch

from headway.decode.forwards import EagerForward
from headway.decode.gemm import apply_gemm, routed_linears
from headway.decode.generate import Decoder, generate
from headway.decode.options import DecodeOptions
from headway.decode.packed import held_packed, packing_available
from headway.drafters.lookup import PromptLookupDrafter
from headway.drafters.oracle import OracleDrafter
from headway.eval.dispatch import DispatchCounter
from headway.eval.dispatch_decoding import count_decoding, dispatch_table, seeds_of
from tests.tiny import tiny_model

PROMPT = torch.tensor([1, 7, 23, 45, 12, 9, 60, 7, 23, 45, 12])


def test_ops_and_syncs_are_sorted_by_where_the_tensors_live() -> None:
    weight = torch.nn.Parameter(torch.randn(3, 3), requires_grad=False)
    host = torch.arange(3.0)
    with DispatchCounter([weight]) as counter, torch.inference_mode():
        on_device = weight @ host  # a launch: it reads a device tensor
        steps = host * 2 + 1  # two host ops
        assert steps.tolist() == [1.0, 3.0, 5.0]  # a host read of a host tensor: no sync
        with counter.region("captured"):
            summed = on_device.sum()  # replayed from a graph
        with counter.region("prefill"):
            on_device.sum()  # the prompt's: counted apart
        copy = on_device.cpu()  # a sync; on the host a copy of its own, as on a GPU
        assert copy is not on_device and not counter.resident(copy)
        int(summed)  # a sync
        assert bool(summed > -1e9)  # the comparison and the read launch; `if t:` is a sync
        placed = torch.zeros(2, device=on_device.device)  # placed where the weight is
        hosted = torch.zeros(2, device=host.device)  # placed where a host tensor is
        assert counter.resident(placed) and not counter.resident(hosted)
    counts = counter.counts
    assert (counts.launches, counts.replayed, counts.syncs, counts.prefill_ops) == (5, 1, 3, 1)
    assert counts.host_ops == 3  # mul, add, and the zeros placed on the host


def test_plain_decoding_dispatches_little_outside_the_target_and_the_counter_leaves() -> None:
    model = tiny_model("llama")
    plain = Decoder(model, None)
    counts = count_decoding(plain, [PROMPT], max_new_tokens=12, eos_token_ids=())
    assert counts.tokens == 12 and counts.steps == 11  # the prefill commits the first token
    assert counts.target_ops > 10 * counts.steps  # a forward is many ops
    assert counts.launches >= counts.target_ops  # an eager forward launches every op
    # one read a step and the first token's, and transformers' own host check of the mask in
    # every eager forward (masking_utils' _ignore_causal_mask_sdpa: bool() of a device tensor,
    # counted since 2026-11-29)
    assert counts.syncs == 2 * counts.steps + 1
    assert "verify" not in vars(plain.target) and type(plain.target) is EagerForward
    truth = generate(model, PROMPT, drafter=None, max_new_tokens=12, eos_token_ids=()).tokens
    assert plain.generate(PROMPT, max_new_tokens=12, eos_token_ids=()).tokens == truth


def test_a_drafter_adds_ops_outside_the_target_and_the_table_shows_them() -> None:
    model = tiny_model("llama")
    truth = generate(model, PROMPT, drafter=None, max_new_tokens=16, eos_token_ids=()).tokens
    counts = {
        "none": count_decoding(Decoder(model, None), [PROMPT], max_new_tokens=16, eos_token_ids=()),
        "oracle": count_decoding(
            Decoder(model, OracleDrafter(truth, 3, width=2)),
            [PROMPT],
            max_new_tokens=16,
            eos_token_ids=(),
        ),
        "lookup": count_decoding(
            Decoder(model, PromptLookupDrafter(min_ngram=1)),
            [PROMPT],
            max_new_tokens=16,
            eos_token_ids=(),
        ),
    }
    assert counts["oracle"].steps < counts["none"].steps  # drafts were accepted
    for name in ("oracle", "lookup"):
        assert (
            counts[name].per_step()["host_ops_per_step"]
            > counts["none"].per_step()["host_ops_per_step"]
        )
    lines = dispatch_table(counts)
    assert len(lines) == 5 and lines[2].startswith("| none |")


def test_captured_plain_decoding_launches_little_beside_its_graph() -> None:
    """On a GPU the verify forward of ``verify="captured"`` is one graph replay: what is left
    eager each step is the inputs' copies and the argmax, and one host read; chained
    (``DecodeOptions.chain``), one host read for several tokens."""
    model = tiny_model("llama")
    captured = Decoder(model, None, DecodeOptions(verify="captured", chain=1))
    counts = count_decoding(captured, [PROMPT], max_new_tokens=12, eos_token_ids=())
    rates = counts.per_step()
    assert rates["replayed_per_step"] > 10 * rates["launches_per_step"] > 0
    assert counts.syncs == counts.steps + 1  # one read a step, and the first token's
    chained = Decoder(model, None, DecodeOptions(verify="captured", chain=8))
    counts = count_decoding(chained, [PROMPT], max_new_tokens=12, eos_token_ids=())
    assert counts.syncs == 1 + 1 + 3  # the first token; 8 tokens in one run; 3 one by one
    assert counts.graph_faults == {} and counts.tokens == 12


def test_graph_faults_are_what_a_capture_would_break_on() -> None:
    """Inside a replayed region: a host read, a host vector fed to a device op, a copy from the
    host (an indexed assignment of a Python scalar, ``torch.tensor(..., device=)``, ``.to``), a
    host-only op and a random op are faults; device work, Python scalars a kernel takes as
    arguments and the same ops outside are not."""
    weight = torch.nn.Parameter(torch.randn(3), requires_grad=False)
    host = torch.arange(3.0)
    with DispatchCounter([weight]) as counter, torch.inference_mode():
        int(weight.sum())  # outside a region: a sync, no fault
        with counter.region("captured"):
            device = weight * 2 + torch.tensor(1.0)  # device work and a scalar constant
            torch.zeros(3, device=weight.device).add_(device)  # placed on the device
            index = torch.arange(3, device=weight.device)
            device.scatter(0, index, 1.0)  # a scalar a kernel takes as an argument
            device[1:] = 0.0  # a fill: the same
            assert not counter.counts.graph_faults
            device[index] = 1.0  # index_put_ copies its host scalar to the device
            torch.tensor([1, 2], device=weight.device)  # Python values copied to the device
            host.to(weight.device)  # a host tensor copied to the device
            host.to(device=weight.device)  # the same
            device.tolist()  # a host read
            weight + host  # the host's values baked into the graph
            host + 1  # runs at capture, never on replay
            torch.rand(3, device=weight.device)  # a random op
    assert counter.counts.graph_faults == {
        "host copy: aten.index_put_.default": 1,
        "host copy: tensor": 1,
        "host copy: to": 2,
        "sync: tolist": 1,
        "host input: aten.add.Tensor": 1,
        "host op: aten.add.Tensor": 1,
        "random: aten.rand.default": 1,
    }


def test_a_host_tensor_copied_to_the_device_is_resident_there() -> None:
    """``.to(device, copy=True)`` of a host tensor (made once, outside what a GPU captures) is a
    device tensor, as on a GPU: fed to a device op inside a replayed region it is no fault and
    reading it is a sync; the host original stays a host tensor (a CPU's ``.to`` without a copy
    returns it as it is and marks nothing)."""
    weight = torch.nn.Parameter(torch.randn(3), requires_grad=False)
    host = torch.arange(3)
    with DispatchCounter([weight]) as counter, torch.inference_mode():
        index = host.to(weight.device, copy=True)
        same = host.to(weight.device)  # no copy on a CPU: still the host tensor
        with counter.region("captured"):
            weight[index] * 2
            assert not counter.counts.graph_faults
        syncs = counter.counts.syncs
        index.tolist()
        assert counter.counts.syncs == syncs + 1
        same.tolist()
        host.tolist()
        assert counter.counts.syncs == syncs + 1


@pytest.mark.skipif(not packing_available(), reason="this CPU does not pack weights")
def test_a_packed_routes_weights_are_seeded_with_their_layers() -> None:
    """A layer packed for the CPU's oneDNN route before counting: its packed weight is a seed
    (a device tensor, as the weight it stands for), so a routed product is no host input."""
    layer = torch.nn.Linear(16, 16).eval()
    apply_gemm(layer, "packed")  # packs now
    tensors, _ = seeds_of(layer, 0)
    assert held_packed(layer) and all(
        any(seed is packed for seed in tensors) for packed in held_packed(layer)
    )
    counter = DispatchCounter(tensors)
    with counter, torch.inference_mode(), counter.region("captured"), routed_linears(layer):
        layer(layer.weight[:2] * 1)
    assert not counter.counts.graph_faults
