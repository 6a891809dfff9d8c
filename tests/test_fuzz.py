"""Fuzzing the data loader and the config parser (issue #7, point 6): whatever the input, a
failure is one of headway's own one-line errors naming where it is, never a bare KeyError,
TypeError, UnicodeError or RecursionError from deep inside.

Examples run per test are set by ``max_examples`` below (the whole file takes well under 30 s).
Every input that once broke the code is kept as an ``@example`` so it is replayed on every run.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from headway.config import load_config
from headway.corpus.sources import load_conversations
from headway.errors import ConfigError, DataError, HeadwayError
from headway.run_config import RunConfig
from headway.train.chat_format import tokenize_sample
from headway.train.data import build_dataset
from tests.tokenizers_fixture import (
    CHATML_GENERATION_TEMPLATE,
    byte_bpe_tokenizer,
    llama3_tokenizer,
    smollm2_tokenizer,
)

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
"""No deadline: the first example pays for imports and tokenizer training."""

# --- random rows -------------------------------------------------------------------------------

# Text with the characters that break naive code: lone surrogates (valid in JSON as escapes, not
# encodable as UTF-8), NUL, line separators, the special tokens of the chat template.
ODD_TEXT = st.sampled_from(
    ["\ud800", "a\udfffb", "\x00", "\u2028", "\x85", "<|im_end|>", "<|im_start|>user\n", "", " "]
)
TEXT = st.one_of(st.text(max_size=30), ODD_TEXT)
SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    TEXT,
)
JSON_VALUE = st.recursive(
    SCALAR,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=12,
)
ROLE = st.one_of(st.sampled_from(["tool", "User", "function", ""]), JSON_VALUE)


ROLES = {"messages": ("role", "content"), "conversations": ("from", "value")}


@st.composite
def messages(draw: st.DrawFn, key: str) -> list[Any]:
    """A message list for row key `key` (OpenAI ``role``/``content`` or ShareGPT
    ``from``/``value``): mostly well-formed messages, so the chat template and the loss mask are
    reached, and some with random roles, contents, shapes or the other format's keys."""
    role_key, content_key = ROLES[key]
    roles = ["user", "assistant", "system"] + (["human", "gpt"] if key == "conversations" else [])
    usable = st.fixed_dictionaries(
        {role_key: st.sampled_from(roles), content_key: TEXT},
        optional={"weight": st.one_of(st.sampled_from([0, 1, None]), JSON_VALUE)},  # 0: context
    )
    other_role, other_content = ROLES["conversations" if key == "messages" else "messages"]
    junk = st.one_of(
        st.fixed_dictionaries(
            {role_key: ROLE, content_key: st.one_of(TEXT, JSON_VALUE)},
            optional={"name": JSON_VALUE},
        ),
        st.fixed_dictionaries({other_role: ROLE, other_content: TEXT}),
        JSON_VALUE,
    )
    kinds = draw(st.lists(st.sampled_from(["usable", "usable", "usable", "junk"]), max_size=6))
    return [draw(usable if kind == "usable" else junk) for kind in kinds]


ROW = st.one_of(
    st.fixed_dictionaries({"messages": messages("messages")}),
    st.fixed_dictionaries({"conversations": messages("conversations")}),
    st.fixed_dictionaries({}, optional={"messages": JSON_VALUE, "conversations": JSON_VALUE}),
    st.fixed_dictionaries({"text": st.one_of(TEXT, JSON_VALUE)}),
    st.dictionaries(st.sampled_from(["messages", "conversations", "text", "id"]), JSON_VALUE),
)
LINE = st.one_of(
    ROW.map(lambda row: json.dumps(row).encode()),
    JSON_VALUE.map(lambda value: json.dumps(value).encode()),
    st.binary(max_size=40),
    st.text(max_size=40).map(lambda text: text.encode("utf-8", "surrogatepass")),
)
GOOD_LINE = json.dumps(
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}]}
).encode()
# Inputs that broke the loader before it was fixed (kept as regression examples).
HUGE_INTEGER = b'{"text": ' + b"7" * 5000 + b"}"  # json.loads: ValueError, int digit limit
DEEP_NESTING = b"[" * 100_000  # json.loads: RecursionError
LONE_SURROGATE = b'{"text": "\\ud800 hello"}'  # not encodable: the tokenizer raised TypeError
SURROGATE_MESSAGE = (
    b'{"messages": [{"role": "user", "content": "hi"}, '
    b'{"role": "assistant", "content": "a\\udfffb"}]}'
)


TEMPLATES = ("smollm2", "llama3", "generation markers")


@lru_cache(maxsize=len(TEMPLATES))
def tokenizer(template: str = "smollm2") -> PreTrainedTokenizerFast:
    """The test tokenizer with one of three real chat templates (prefix rendering with a default
    system prompt; Llama-3's trimming one with a BOS; ``{% generation %}`` markers)."""
    if template == "llama3":
        return llama3_tokenizer()
    if template == "generation markers":
        return byte_bpe_tokenizer(CHATML_GENERATION_TEMPLATE)
    return smollm2_tokenizer()


@contextmanager
def jsonl_file(lines: list[bytes]) -> Iterator[Path]:
    """A temporary ``data.jsonl`` holding `lines` (hypothesis reruns need a fresh file each)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "data.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        yield path


def assert_clear(error: HeadwayError, where: str) -> None:
    """One line that names `where` (the file, or the file and row)."""
    message = str(error)
    assert "\n" not in message, message
    assert where in message, message


@settings(FUZZ, max_examples=300)
@given(st.lists(LINE, min_size=1, max_size=6), st.sampled_from(TEMPLATES))
@example([GOOD_LINE, HUGE_INTEGER], "smollm2")
@example([GOOD_LINE, DEEP_NESTING], "smollm2")
@example([LONE_SURROGATE], "smollm2")
def test_loader_fails_only_with_clear_data_errors(lines: list[bytes], template: str) -> None:
    with jsonl_file(lines) as path:
        try:
            samples, report = load_conversations(path)
        except DataError as error:
            assert_clear(error, str(path))
        else:
            assert report.rows_read == len(samples) and not report.skipped
        try:
            samples, report = load_conversations(path, skip_bad_rows=True)
        except DataError as error:  # nothing usable at all
            assert_clear(error, str(path))
            assert "no rows" in str(error) or "no usable samples" in str(error)
            return
    assert report.rows_read == len(samples) + sum(report.skipped.values())
    assert len({sample.origin for sample in samples}) == len(samples)
    for sample in samples:  # what the loader accepts, the chat format can take or name
        try:
            tokenized = tokenize_sample(tokenizer(template), sample, max_length=32)
        except DataError as error:
            assert_clear(error, sample.origin)
        else:
            assert len(tokenized.input_ids) == len(tokenized.loss_mask) <= 32


@settings(FUZZ, max_examples=40)
@given(st.lists(LINE, min_size=1, max_size=4), st.booleans(), st.sampled_from(TEMPLATES))
@example([GOOD_LINE, LONE_SURROGATE], False, "smollm2")
@example([GOOD_LINE, LONE_SURROGATE], True, "smollm2")
@example([SURROGATE_MESSAGE, GOOD_LINE], True, "smollm2")
def test_build_dataset_fails_only_with_clear_errors_and_counts_add_up(
    lines: list[bytes], skip: bool, template: str
) -> None:
    with jsonl_file(lines) as path:
        try:
            dataset, report = build_dataset(
                tokenizer(template), path, max_length=24, skip_bad_rows=skip
            )
        except DataError as error:
            assert_clear(error, str(path))
            return
    assert len(dataset) == report.samples > 0
    assert report.rows_read == report.samples + sum(report.skipped.values())
    assert skip or set(report.skipped) <= {"no trained token within max_length"}


# --- random configs ----------------------------------------------------------------------------

SECTIONS = {
    "target": ("name", "dtype", "device", "attn_implementation", "trust_remote_code"),
    "data": ("sources", "max_length", "limit", "skip_bad_rows", "eval_fraction", "features"),
    "train": ("method", "lr", "warmup_steps", "max_steps", "batch_size", "seed", "log_with"),
    "medusa": ("num_heads", "num_layers", "loss_decay", "lora_r", "heads_loss_weight"),
    "eagle": ("fc_bias", "ce_loss_weight", "feature_noise"),
    "eagle3": ("draft_vocab_size", "feature_layers", "ttt_steps", "loss_decay"),
}
NAME = st.text(st.characters(exclude_characters="=\n"), max_size=12)
SECTION = st.one_of(st.sampled_from(sorted(SECTIONS)), NAME)
VALUE_TEXT = st.one_of(
    st.sampled_from(["0", "-1", "1", "3", "1e-3", "nan", "inf", "-inf", "1e400", "null", "true"]),
    st.sampled_from(["medusa1", "fp8", "offline", "1,2,3", ",", "--", "-h", "--lr", "a b"]),
    st.integers().map(str),
    st.floats().map(str),
    st.text(max_size=12),
)


@st.composite
def override(draw: st.DrawFn) -> tuple[str, str, str]:
    """``(section, key, value)``: a real or random section, a key of it or a random one."""
    section = draw(SECTION)
    keys = SECTIONS.get(section, ())
    key = draw(st.one_of(st.sampled_from(keys), NAME) if keys else NAME)
    return section, key, draw(VALUE_TEXT)


def assert_finite(config: RunConfig) -> None:
    """An accepted config holds no NaN or infinite number (it would only fail hours later)."""
    for section in vars(config).values():
        for key, value in vars(section).items():
            if isinstance(value, float):
                assert math.isfinite(value), f"accepted {key}={value}"


@settings(FUZZ, max_examples=400)
@given(override())
@example(("train", "lr", "nan"))
@example(("train", "lr", "1e400"))
@example(("data", "skip_bad_rows", "--"))
@example(("data", "max_length", "--"))
@example(("eagle", "fc_bias", "-inf"))
def test_override_fails_only_with_a_config_error_naming_the_key(
    setting: tuple[str, str, str],
) -> None:
    section, key, value = setting
    text = f"{section}.{key}={value}"
    try:
        config = load_config(RunConfig, None, [text])
    except ConfigError as error:
        message = str(error)
        assert "\n" not in message, message
        parsed_section, _, parsed_key = f"{section}.{key}".strip().partition(".")
        if not parsed_section or not parsed_key:
            assert repr(text) in message, message  # not of the form section.key=value
        elif parsed_section not in SECTIONS:
            assert repr(parsed_section) in message, message
        else:  # the dotted key (escaped if need be), or both parts in a cross-field message
            named = f"{parsed_section}.{parsed_key}"
            both = parsed_section in message and parsed_key in message
            assert named in message or repr(named) in message or both, message
    else:
        assert_finite(config)


YAML_SCALAR = st.one_of(SCALAR, VALUE_TEXT, st.dates())
YAML_VALUE = st.one_of(
    YAML_SCALAR,
    st.lists(YAML_SCALAR, max_size=3),
    st.dictionaries(NAME, YAML_SCALAR, max_size=2),
)


@st.composite
def recipe(draw: st.DrawFn) -> dict[Any, Any]:
    """A YAML mapping of real or random sections to real or random keys and values."""
    sections = draw(st.lists(SECTION, min_size=1, max_size=3, unique=True))
    built: dict[Any, Any] = {}
    for section in sections:
        keys = SECTIONS.get(section, ())
        key = st.one_of(st.sampled_from(keys), NAME) if keys else NAME
        built[section] = draw(st.one_of(st.dictionaries(key, YAML_VALUE, max_size=3), YAML_SCALAR))
    return built


def yaml_text(data: dict[Any, Any]) -> bytes:
    try:
        return yaml.safe_dump(data, allow_unicode=True).encode("utf-8", "surrogatepass")
    except yaml.representer.RepresenterError:
        return b"{}"


YAML_FILE = st.one_of(
    recipe().map(yaml_text),
    st.text(max_size=60).map(lambda text: text.encode("utf-8", "surrogatepass")),
    st.binary(max_size=60),
)


@settings(FUZZ, max_examples=300)
@given(YAML_FILE)
@example(b"train:\n  lr: {a: 1}\n")
@example(b"train:\n  seed: 2001-13-01\n")
@example(b"\xff\xfe train: 1")
@example(b"train:\n  lr: 1\x00\n")
def test_recipe_fails_only_with_a_config_error_naming_the_file(text: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "recipe.yaml"
        path.write_bytes(text)
        try:
            config = load_config(RunConfig, path)
        except ConfigError as error:
            message = str(error)
            assert "\n" not in message, message
            assert str(path) in message, message
        else:
            assert_finite(config)
