"""Target loading (offline), the GGUF conversion cache and fingerprints."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from headway.errors import TargetError
from headway.gguf_target import convert_gguf, converted_folder
from headway.locks import exclusive_output
from headway.target import (
    Target,
    check_fingerprint,
    fingerprint,
    load_target,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)
from tests.tiny import tiny_model
from tests.tokenizers_fixture import smollm2_tokenizer


@pytest.fixture
def saved_target(tmp_path: Path) -> Path:
    """A tiny Llama target saved as a normal HF folder with a tokenizer."""
    folder = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(folder)
    smollm2_tokenizer().save_pretrained(folder)
    return folder


def test_load_folder_is_frozen_eval_and_typed(saved_target: Path) -> None:
    target = load_target(saved_target, dtype="bfloat16", device="cpu")
    assert target.model.dtype == torch.bfloat16
    assert not target.model.training
    assert not any(p.requires_grad for p in target.model.parameters())
    assert target.tokenizer.chat_template


def test_the_tokenizer_loads_without_the_weights(
    saved_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``headway data vocab`` needs only the tokenizer: ``load_tokenizer`` reads no weights and
    gives the tokenizer ``load_target`` gives; an unknown model id is the same one-line error."""
    whole = load_target(saved_target, device="cpu").tokenizer

    def no_weights(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    alone = load_tokenizer(saved_target)
    assert alone.get_vocab() == whole.get_vocab() and alone.chat_template == whole.chat_template
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TargetError, match="never downloads"):
        load_tokenizer("no-such-org/no-such-model-xyz")


def test_fingerprint_is_dtype_independent_but_weight_sensitive(saved_target: Path) -> None:
    fp32 = fingerprint(load_target(saved_target, dtype="float32", device="cpu").model)
    bf16 = fingerprint(load_target(saved_target, dtype="bfloat16", device="cpu").model)
    assert fp32 == bf16
    assert fp32.architecture == "LlamaForCausalLM"
    assert (fp32.hidden_size, fp32.vocab_size, fp32.num_layers) == (32, 96, 2)
    other = fingerprint(tiny_model("llama", seed=1))
    assert other.differences(fp32) == ["output_embedding_sha256"]


def test_a_kept_fingerprint_follows_changes_of_the_head_weight() -> None:
    """The hash is kept per LM head (the default drafter asks twice per build) and taken again
    when the weight changes in place or is replaced."""
    model = tiny_model("llama")
    first = fingerprint(model)
    assert fingerprint(model) == first
    head = model.get_output_embeddings()
    with torch.no_grad():
        head.weight.mul_(2.0)  # tracked in place: a new version
    doubled = fingerprint(model)
    assert doubled.differences(first) == ["output_embedding_sha256"]
    head.weight = torch.nn.Parameter(head.weight.detach() / 2.0)  # a new tensor
    assert fingerprint(model) == first


def test_forgotten_digests_are_hashed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    import headway.target as target_module

    hashed: list[int] = []
    digest = target_module._embedding_digest

    def counted(weight: torch.Tensor) -> str:
        hashed.append(1)
        return digest(weight)

    monkeypatch.setattr(target_module, "_embedding_digest", counted)
    model = tiny_model("llama")
    first = fingerprint(model)
    assert fingerprint(model) == first and len(hashed) == 1
    target_module.forget_digests()
    assert fingerprint(model) == first and len(hashed) == 2


def test_check_fingerprint_refuses_other_target_unless_forced() -> None:
    llama, qwen = fingerprint(tiny_model("llama")), fingerprint(tiny_model("qwen2"))
    check_fingerprint(llama, llama)
    with pytest.raises(TargetError) as caught:
        check_fingerprint(llama, qwen)
    message = str(caught.value)
    assert "architecture" in message and "LlamaForCausalLM" in message
    assert "Qwen2ForCausalLM" in message and "--force" in message
    check_fingerprint(llama, qwen, force=True)  # warns, does not raise


def test_unknown_model_id_fails_offline_with_advice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TargetError, match="never downloads"):
        load_target("no-such-org/no-such-model-xyz", device="cpu")


def test_bad_paths_give_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TargetError, match="does not exist"):
        load_target(tmp_path / "missing.gguf")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TargetError, match=r"no config\.json"):
        load_target(tmp_path / "empty")
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(TargetError, match=r"not a \.gguf"):
        load_target(tmp_path / "weights.bin")


def test_interrupted_conversion_leaves_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")

    def crash(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # a kill in the middle of the conversion

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", crash)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(gguf)
    targets = tmp_path / "cache" / "targets"
    assert list(targets.iterdir()) == []  # neither a final folder nor a staging leftover


def test_conversion_is_reused_once_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    calls: list[str] = []

    def fake_load(folder: Path, gguf_file: str, **kwargs: object) -> Any:
        calls.append(gguf_file)
        return tiny_model("llama")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake_load)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: smollm2_tokenizer())
    first = convert_gguf(gguf)
    second = convert_gguf(gguf)
    assert first == second and (first / "config.json").is_file()
    assert calls == ["model.gguf"]


def test_a_conversion_under_way_is_waited_for_not_repeated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second process asking for a target another one is converting waits for it and takes
    its folder (two test workers, or the ranks of a launch, convert the embedded model once)."""
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    final = converted_folder(gguf)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    holding, release = threading.Event(), threading.Event()

    def other_converter() -> None:  # holds the conversion lock, then publishes the folder
        with exclusive_output(final, what="target conversion"):
            holding.set()
            release.wait(10)
            final.mkdir(parents=True)
            (final / "config.json").write_text("{}")

    other = threading.Thread(target=other_converter)
    other.start()
    assert holding.wait(10)
    threading.Timer(0.3, release.set).start()
    assert convert_gguf(gguf) == final  # returned only once the other one had finished
    other.join()
    assert sorted(path.name for path in final.parent.iterdir()) == [final.name]  # no lock left


def test_dtype_and_device_resolution() -> None:
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(TargetError, match="unknown dtype"):
        resolve_dtype("float8")
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type in {"cpu", "cuda"}


@pytest.mark.slow
def test_embedded_smollm2_loads_and_answers(smollm2: Target) -> None:
    target = smollm2
    fp = fingerprint(target.model)
    assert (fp.hidden_size, fp.vocab_size, fp.num_layers) == (576, 49152, 30)
    encoded: Any = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    ids = encoded["input_ids"]
    model: Any = target.model  # generate() comes from transformers' GenerationMixin
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in target.tokenizer.decode(out[0, ids.shape[1] :])


@pytest.mark.parametrize("spec", ["/no/such/folder", "./nope", "../nope", "~/nope", "a/b/c"])
def test_a_missing_folder_is_named_as_such(spec: str) -> None:
    with pytest.raises(TargetError, match=f"^{re.escape(spec)}: no such folder"):
        load_target(spec)


@pytest.mark.parametrize(
    ("device", "message"),
    [("gpu", "use auto, cpu or cuda:N"), ("cuda:x", "use auto, cpu or cuda:N")],
)
def test_a_bad_device_is_a_one_line_error(device: str, message: str) -> None:
    from headway.target import resolve_device

    with pytest.raises(TargetError, match=message) as caught:
        resolve_device(device)
    assert "\n" not in str(caught.value)


def test_cuda_without_a_device_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from headway.target import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(TargetError, match="no CUDA device here"):
        resolve_device("cuda:7")
    assert resolve_device("cpu") == torch.device("cpu")


def test_engines_load_the_embedded_target_by_its_hub_id() -> None:
    """A drafter trained on the embedded alias names the model vLLM loads (speculators'
    verifier); any other name is kept as recorded."""
    from headway.target import DEFAULT_TARGET, DEFAULT_TARGET_HUB_ID, hub_id

    assert hub_id(DEFAULT_TARGET) == DEFAULT_TARGET_HUB_ID == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub_id("org/model") == "org/model" and hub_id(None) is None
