"""The prompt mix for self-distillation: what the target is asked before it answers itself.

A drafter learns the target's own distribution and its acceptance collapses off-domain, so the
mix covers what users ask (DESIGN.md, "Training-data recipe"):

- ``sharegpt``: user turns of the embedded ShareGPT V3 corpus (what people ask assistants; the
  primary source, MT-bench and HumanEval prompts removed);
- ``chitchat``: user turns of the embedded chitchat corpus (casual small talk);
- ``chatterbot`` (and any other name in :data:`headway.corpus.sources.EXTRA_SOURCES`): user
  turns of that packaged corpus (chatterbot: short multilingual dialogues);
- ``code``: prompts made from Python standard-library functions (signature + docstring →
  implement / explain / write tests);
- ``instruct``: instructions from templates over task types and topics (writing, roleplay,
  reasoning, math, coding, extraction, STEM, humanities);
- ``self-instruct``: *meta* prompts asking the target to write one user request for a task type
  and topic; :mod:`headway.train.regenerate` turns the target's answers into prompts;
- any chat data file: its user turns.

MT-bench and HumanEval are evaluation sets and are never used here.
"""

from __future__ import annotations

import ast
import itertools
import logging
import random
import sysconfig
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from headway.corpus.embedded import EVAL_OVERLAP
from headway.corpus.sources import CHITCHAT, EXTRA_SOURCES, SHAREGPT, load_conversations
from headway.errors import DataError

logger = logging.getLogger(__name__)

BUILTIN_SOURCES = (CHITCHAT, SHAREGPT, *EXTRA_SOURCES, "code", "instruct", "self-instruct")
# ~1,000 tokens: ShareGPT's first turns have a median of 144 characters, a long tail of pastes.
DEFAULT_MAX_PROMPT_CHARS = 4000

TASK_TYPES: dict[str, tuple[str, ...]] = {
    "writing": (
        "Write a short blog post about {topic}.",
        "Write a persuasive paragraph arguing why people should care about {topic}.",
        "Compose a short poem about {topic}.",
        "Draft a friendly email inviting a colleague to a talk on {topic}.",
    ),
    "roleplay": (
        "Pretend you are a tour guide and introduce {topic} to a group of visitors.",
        "Act as a teacher and answer a student who asks why {topic} matters.",
        "You are a journalist interviewing an expert on {topic}. Write your first three questions.",
    ),
    "reasoning": (
        "What are the main pros and cons of {topic}? Think step by step.",
        "Give three arguments for and three against {topic}, then conclude.",
        "What is a common misconception about {topic}, and why is it wrong?",
    ),
    "math": (
        "A store sells {a} items for {b} dollars each and gives a {c}% discount. "
        "What is the total price? Explain each step.",
        "Solve for x: {a}x + {b} = {c}. Show your work.",
        "What is the sum of all integers from 1 to {a}? Explain the method.",
        "A train travels {a} km in {b} hours. What is its average speed, and how far "
        "does it go in {c} hours at that speed?",
    ),
    "coding": (
        "Write a Python function that sorts a list of records about {topic} by a given field.",
        "Explain how you would design a small program to keep track of {topic}.",
        "Write a Python class that models {topic}, with two useful methods.",
        "Write a SQL table definition and two example queries for data about {topic}.",
    ),
    "extraction": (
        "Summarise the key facts about {topic} as a bullet list.",
        "List five important terms related to {topic} with one-line definitions.",
        "Extract the main idea from this sentence: '{topic} has changed the way people live "
        "and work in the last decades.'",
    ),
    "stem": (
        "Explain {topic} to a ten-year-old.",
        "How does {topic} work? Give a clear technical explanation.",
        "What are the most important scientific discoveries related to {topic}?",
    ),
    "humanities": (
        "Describe the history of {topic} in a few paragraphs.",
        "How has {topic} influenced culture and society?",
        "Compare two different philosophical views on {topic}.",
    ),
}

TOPICS = (
    "renewable energy", "the printing press", "machine learning", "climate change",
    "the Roman Empire", "photosynthesis", "black holes", "social media", "coffee",
    "electric cars", "the human immune system", "volcanoes", "jazz music", "the stock market",
    "honeybees", "the internet", "ancient Egypt", "vaccines", "chess", "recycling",
    "the French Revolution", "quantum computing", "sleep", "urban gardening", "the Moon landing",
    "democracy", "plate tectonics", "remote work", "the Renaissance", "public libraries",
    "antibiotics", "space exploration", "the water cycle", "cryptography", "minimalism",
    "marathon running", "the Silk Road", "nuclear power", "bird migration", "video games",
    "the human brain", "inflation", "coral reefs", "Shakespeare", "3D printing", "tea",
    "the Industrial Revolution", "friendship", "volunteering", "weather forecasting",
    "artificial sweeteners", "solar panels", "the Olympic Games", "languages", "bridges",
    "time management", "the periodic table", "museums", "rainforests", "smartphones",
)  # fmt: skip

SELF_INSTRUCT_TEMPLATE = (
    "Write one {task} request that a user might send to an AI assistant about {topic}. "
    "Reply with the request only, as the user would type it."
)

CODE_TEMPLATES = (
    "Implement the following Python function.\n\n```python\n{stub}\n```",
    "Explain what this Python function does, step by step.\n\n```python\n{source}\n```",
    "Write pytest unit tests for this function.\n\n```python\n{stub}\n```",
)


@dataclass
class PromptItem:
    """One conversation to regenerate: the user turns, in order, and an optional system prompt.

    ``meta`` marks a self-instruct item: the target's answer becomes a new prompt, not data.
    ``answered`` holds the target's answers to the first user turns when another folder wrote
    them (``--continue-from``): the later turns are answered after them, and they stay context.
    """

    id: str
    source: str
    user_turns: list[str]
    system: str | None = None
    meta: bool = False
    extra: dict[str, str] = field(default_factory=dict)
    answered: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class EarlierTurns:
    """What a regeneration folder holds of one conversation: its user turns and the target's
    answers to them, in order (``--continue-from``)."""

    user_turns: tuple[str, ...]
    answers: tuple[str, ...]


def parse_mix(spec: str) -> dict[str, int]:
    """``"chitchat:3000,code:1500"`` -> ``{"chitchat": 3000, "code": 1500}``."""
    mix: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, count = part.rpartition(":")
        if not sep or not name or not count.isdigit() or int(count) < 1:
            raise DataError(
                f"--mix entry {part!r} is not NAME:COUNT with COUNT >= 1 "
                "(e.g. chitchat:3000,code:1500,instruct:1000,self-instruct:1000)"
            )
        if name not in BUILTIN_SOURCES and not Path(name).is_file():
            raise DataError(
                f"--mix source {name!r} is neither one of {', '.join(BUILTIN_SOURCES)} "
                "nor an existing chat data file"
            )
        mix[name] = int(count)
    if not mix:
        raise DataError("--mix is empty; name at least one source, e.g. chitchat:1000")
    return mix


def chat_prompts(
    source: str,
    count: int,
    *,
    rng: random.Random,
    max_turns: int,
    min_turns: int = 1,
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
    exclude: frozenset[str] = frozenset(),
    earlier: Mapping[str, EarlierTurns] | None = None,
) -> list[PromptItem]:
    """Up to `count` conversations' user turns (at most `max_turns` each) from a chat source,
    none whose id is in `exclude` (the shuffle is the same with or without it) and none with
    fewer than `min_turns` usable user turns (e.g. 2: only conversations that go on, for a
    turn-by-turn run beside a folder that answered the first turns).

    With `earlier` (id -> the turns another folder answered), only those conversations whose
    usable user turns go on past the ones answered there, and begin with them, are kept, each
    with those answers as :attr:`PromptItem.answered`.

    Conversations whose first user turn is longer than `max_prompt_chars` (pasted documents;
    a long prefill costs more than its answer teaches) or empty are left out; later turns stop
    at the first one that is too long. The source's data report is logged.
    """
    samples, report = load_conversations(source, skip_bad_rows=True)
    overlap = report.skipped[EVAL_OVERLAP]
    logger.info("%s; %d held an evaluation prompt and were removed", report.summary(), overlap)
    items = []
    for index, sample in enumerate(samples):
        if sample.messages is None:
            continue
        users = list(
            itertools.takewhile(
                lambda text: len(text.strip()) > 0 and len(text) <= max_prompt_chars,
                (m["content"] for m in sample.messages if m["role"] == "user"),
            )
        )[:max_turns]
        system = next((m["content"] for m in sample.messages if m["role"] == "system"), None)
        if users and len(users) >= min_turns:
            items.append(PromptItem(f"{Path(source).name}/{index}", source, users, system))
    if earlier is not None:
        items = _continued(items, earlier, source)
    rng.shuffle(items)
    if exclude:
        kept = [item for item in items if item.id not in exclude]
        logger.info("%s: %d conversations left out (--exclude)", source, len(items) - len(kept))
        items = kept
    return items[:count]


def _continued(
    items: Sequence[PromptItem], earlier: Mapping[str, EarlierTurns], source: str
) -> list[PromptItem]:
    """The items that go on past the turns `earlier` answered, those answers attached."""
    kept, changed = [], 0
    for item in items:
        turns = earlier.get(item.id)
        if turns is None or len(item.user_turns) <= len(turns.answers):
            continue
        if tuple(item.user_turns[: len(turns.user_turns)]) != turns.user_turns:
            changed += 1  # the corpus differs from the one the folder answered
            continue
        kept.append(replace(item, answered=list(turns.answers)))
    logger.info(
        "%s: %d conversations go on past the turns answered before (--continue-from)%s",
        source,
        len(kept),
        f"; {changed} left out whose earlier user turns differ" if changed else "",
    )
    return kept


def instruct_prompts(count: int, *, rng: random.Random) -> list[PromptItem]:
    """`count` distinct templated instructions, spread evenly over the task types."""
    pool = [
        (task, template, topic)
        for task, templates in TASK_TYPES.items()
        for template in templates
        for topic in TOPICS
    ]
    rng.shuffle(pool)
    items: list[PromptItem] = []
    seen: set[str] = set()
    for task, template, topic in pool:
        numbers = {"a": rng.randint(2, 90), "b": rng.randint(2, 40), "c": rng.randint(5, 60)}
        text = template.format(topic=topic, **numbers)
        if text in seen:  # templates without {topic} can repeat
            continue
        seen.add(text)
        items.append(PromptItem(f"instruct/{len(items)}", "instruct", [text], extra={"task": task}))
        if len(items) == count:
            break
    return items


def self_instruct_meta_prompts(count: int, *, rng: random.Random) -> list[PromptItem]:
    """`count` meta prompts; the target's answers become user requests (see regenerate)."""
    pairs = [(task, topic) for task in TASK_TYPES for topic in TOPICS]
    rng.shuffle(pairs)
    items = []
    for index in range(count):
        task, topic = pairs[index % len(pairs)]
        text = SELF_INSTRUCT_TEMPLATE.format(task=task, topic=topic)
        item = PromptItem(f"self-instruct/{index}", "self-instruct", [text], meta=True)
        item.extra = {"task": task, "topic": topic}
        items.append(item)
    return items


_PER_MODULE = 6
_SKIPPED_STDLIB_PARTS = {"test", "tests", "idlelib", "site-packages", "turtledemo", "lib2to3"}


def _documented_functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef]]:
    """Public module-level functions and public methods of public classes, by dotted name."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            yield node.name, node
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for member in node.body:
                if isinstance(member, ast.FunctionDef) and not member.name.startswith("_"):
                    yield f"{node.name}.{member.name}", member


def _module_functions(path: Path, module: str, max_lines: int) -> Iterator[tuple[str, str, str]]:
    """(qualified name, stub, source) of the documented functions of one module file."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for name, node in _documented_functions(tree):
        docstring = ast.get_docstring(node)
        source = ast.get_source_segment(text, node)
        if not docstring or not source or source.count("\n") >= max_lines:
            continue
        source = textwrap.dedent(" " * node.col_offset + source)
        signature = source.split(":\n", 1)[0]
        body = textwrap.indent(docstring.strip(), "    ").lstrip()
        yield f"{module}.{name}", f'{signature}:\n    """{body}\n    """', source


def _stdlib_functions(max_lines: int, rng: random.Random) -> Iterator[tuple[str, str, str]]:
    """Documented stdlib functions of <= max_lines lines, a few per module, modules in an order
    shuffled by `rng` (parsing is the cost, so callers stop early)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        path
        for path in root.rglob("*.py")
        if not _SKIPPED_STDLIB_PARTS & set(path.relative_to(root).parts)
    )
    rng.shuffle(paths)
    for path in paths:
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        yield from itertools.islice(_module_functions(path, module, max_lines), _PER_MODULE)


def code_prompts(count: int, *, rng: random.Random, max_lines: int = 40) -> list[PromptItem]:
    """`count` prompts over standard-library functions, cycling implement / explain / test."""
    functions = list(itertools.islice(_stdlib_functions(max_lines, rng), count))
    items = []
    for index, (name, stub, source) in enumerate(functions):
        template = CODE_TEMPLATES[index % len(CODE_TEMPLATES)]
        text = template.format(stub=stub, source=source)
        items.append(PromptItem(f"code/{name}", "code", [text], extra={"function": name}))
    return items


def build_mix(
    mix: dict[str, int],
    *,
    seed: int,
    max_turns: int = 1,
    min_turns: int = 1,
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
    exclude: frozenset[str] = frozenset(),
    earlier: Mapping[str, EarlierTurns] | None = None,
) -> list[PromptItem]:
    """The prompt items of `mix` (source -> count), deterministic in `seed`; chat conversations
    whose id is in `exclude` are skipped (e.g. those another folder answered), and so are those
    with fewer than `min_turns` usable user turns; with `earlier`, only the chat conversations
    that go on past those turns (:func:`chat_prompts`).

    Raises:
        DataError: when a source yields fewer items than asked and none at all.
    """
    rng = random.Random(seed)
    items: list[PromptItem] = []
    for source, count in mix.items():
        if source == "code":
            chunk = code_prompts(count, rng=rng)
        elif source == "instruct":
            chunk = instruct_prompts(count, rng=rng)
        elif source == "self-instruct":
            chunk = self_instruct_meta_prompts(count, rng=rng)
        else:
            chunk = chat_prompts(
                source,
                count,
                rng=rng,
                max_turns=max_turns,
                min_turns=min_turns,
                max_prompt_chars=max_prompt_chars,
                exclude=exclude,
                earlier=earlier,
            )
        if not chunk:
            raise DataError(f"prompt source {source!r} produced no prompts")
        items += chunk
    return items


def describe_mix(items: Sequence[PromptItem]) -> dict[str, int]:
    """Counts per source, for manifests and reports."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item.source] = counts.get(item.source, 0) + 1
    return counts
