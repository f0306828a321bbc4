"""Chat prompts from the Python documentation (Debian's `python3.11-doc`).

The reStructuredText sources of the docs are fetched once into the cache with
`apt-get download` + `dpkg-deb -x` (never into git) and turned into user turns:

* ``faq``      - the FAQ's questions (and question-shaped headings elsewhere), as asked;
* ``topic``    - section titles of the tutorial, HOWTOs, library and language reference,
                 turned into "What is ... / How do I ... / Explain ..." questions;
* ``glossary`` - glossary terms ("What does 'decorator' mean in Python?");
* ``passage``  - prose paragraphs with an instruction (explain simply, summarise, example).
"""

from __future__ import annotations

import functools
import logging
import os
import random
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sglang_dspark.serving.cache import cache_dir

logger = logging.getLogger(__name__)

PACKAGE = "python3.11-doc"
_SOURCES_IN_DEB = "usr/share/doc/python3.11/html/_sources"
_COPYRIGHT_IN_DEB = "usr/share/doc/python3.11-doc/copyright"
_MARKER = ".dspark-extracted"
# Parts of the docs written for users (not the C API, packaging or changelogs).
DOC_DIRS = ("faq", "tutorial", "howto", "library", "reference", "using")


class PythonDocsUnavailable(RuntimeError):
    pass


def ensure_python_docs(dest: str | os.PathLike | None = None) -> Path:
    """Fetch and extract the docs' sources once; return the `_sources` directory.

    Idempotent: a finished extraction carries a marker file and is reused.
    `DSPARK_PYTHON_DOCS` may point at an already extracted `html/_sources` directory.
    """
    override = os.environ.get("DSPARK_PYTHON_DOCS")
    if override:
        path = Path(override)
        if not (path / "faq").is_dir():
            raise PythonDocsUnavailable(
                f"DSPARK_PYTHON_DOCS={override} has no faq/ directory; point it at the "
                f"html/_sources directory of an extracted {PACKAGE} package."
            )
        return path
    out = Path(dest) if dest else cache_dir() / PACKAGE
    if (out / _MARKER).exists():
        return out / "_sources"
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise PythonDocsUnavailable(
                f"Chat prompts need the Debian package {PACKAGE}, but `{tool}` is not "
                "installed (not a Debian/Ubuntu system?). Extract the package elsewhere and "
                "set DSPARK_PYTHON_DOCS to its usr/share/doc/python3.11/html/_sources."
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".python-doc-") as tmp:
        res = subprocess.run(
            ["apt-get", "download", PACKAGE], cwd=tmp, capture_output=True, text=True, check=False
        )
        debs = sorted(Path(tmp).glob(f"{PACKAGE}_*.deb"))
        if res.returncode != 0 or not debs:
            raise PythonDocsUnavailable(
                f"`apt-get download {PACKAGE}` failed (exit {res.returncode}): "
                f"{res.stderr.strip()[-500:]}\nChat prompts need this package. It needs "
                "network access to a Debian mirror; if the package is unknown, run "
                "`apt-get update` first. Or set DSPARK_PYTHON_DOCS to an extracted "
                "html/_sources directory."
            )
        extracted = Path(tmp) / "x"
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(extracted)], check=True)
        staged = Path(tmp) / "out"
        staged.mkdir()
        os.replace(extracted / _SOURCES_IN_DEB, staged / "_sources")
        if (extracted / _COPYRIGHT_IN_DEB).exists():
            shutil.copy(extracted / _COPYRIGHT_IN_DEB, staged / "copyright")
        (staged / _MARKER).write_text(debs[0].name + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(staged, out)
    logger.info("Extracted %s into %s", debs[0].name, out)
    return out / "_sources"


# ---------------------------------------------------------------- reST to plain text
_ROLE = re.compile(r":[\w.+-]+(?::[\w.+-]+)?:`([^`]*)`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]*>`_{1,2}")
_UNDERLINE = re.compile(r"""^([=\-~^"*#+'`.:_])\1{2,}\s*$""")


def _role_text(match: re.Match) -> str:
    text = match.group(1)
    if "<" in text and text.endswith(">"):
        text = text[: text.index("<")].strip()
    text = text.lstrip("!")
    if text.startswith("~"):
        text = text[1:].rsplit(".", 1)[-1]
    return f"`{text}`"


def clean_rst(text: str) -> str:
    """Inline reST markup to plain text with `code` spans."""
    text = _ROLE.sub(_role_text, text)
    text = _LINK.sub(r"\1", text)
    text = text.replace("``", "`")
    text = re.sub(r"\*\*([^*]+)\*\*", r"\1", text)
    text = re.sub(r"(?<![\w*])\*([^*\s][^*]*)\*", r"\1", text)
    text = re.sub(r"`([^`]+)`_\b", r"\1", text)
    text = re.sub(r"\s+", " ", text).strip()
    return text.replace(" --- ", " - ").replace("\\", "")


@dataclass(frozen=True)
class DocItem:
    kind: str  # faq | topic | glossary | passage
    path: str
    lineno: int
    text: str  # the question, title, term or paragraph (cleaned)
    context: str  # the document's topic ("the `argparse` module", "the Python tutorial")


_GENERIC_TITLES = frozenset(
    [
        "examples",
        "example",
        "notes",
        "note",
        "functions",
        "classes",
        "constants",
        "exceptions",
        "introduction",
        "overview",
        "usage",
        "reference",
        "footnotes",
        "index",
        "contents",
        "see",
        "also",
        "summary",
        "other",
        "details",
        "background",
        "module",
        "contents",
        "attributes",
        "methods",
        "api",
        "miscellaneous",
        "changelog",
        "glossary",
    ]
)


def _headings(lines: list[str]) -> Iterator[tuple[int, str]]:
    for i in range(len(lines) - 1):
        line, under = lines[i].rstrip(), lines[i + 1].rstrip()
        if (
            line.strip()
            and not line.startswith(" ")
            and not _UNDERLINE.match(line)
            and _UNDERLINE.match(under)
            and len(under) >= len(line)
        ):
            yield i, clean_rst(line)


def _doc_context(path: str, title: str) -> str:
    top = path.split("/")[0]
    mod = re.match(r"^`([\w.]+)`\s+-+\s+(.*)$", title)
    if mod:
        return f"the `{mod.group(1)}` module"
    if top == "tutorial":
        return f"the Python tutorial ({title})"
    if top == "reference":
        return f"the Python language reference ({title})"
    return f"Python ({title})"


def _paragraphs(lines: list[str]) -> Iterator[tuple[int, str]]:
    block: list[str] = []
    start = 0
    for i, line in enumerate(lines + [""]):
        if line.strip():
            if not block:
                start = i
            block.append(line)
            continue
        if block and _is_prose(block, lines, start):
            yield start, clean_rst(" ".join(block))
        block = []


def _is_prose(block: list[str], lines: list[str], start: int) -> bool:
    first = block[0]
    if first.startswith((" ", "..", "*", "-", "#", "+", "|", "=", ">>>")) or re.match(
        r"^\d+\.", first
    ):
        return False
    if any(_UNDERLINE.match(b.rstrip()) for b in block):
        return False
    if block[-1].rstrip().endswith("::"):
        return False  # introduces a code block that the prompt would not show
    text = " ".join(block)
    return 300 <= len(text) <= 1200 and len(text.split()) >= 40


def _glossary(lines: list[str]) -> Iterator[tuple[int, str]]:
    inside = False
    for i, line in enumerate(lines[:-1]):
        if line.startswith(".. glossary::"):
            inside = True
            continue
        if inside and re.match(r"^   \S", line) and lines[i + 1].startswith("      "):
            term = clean_rst(line).strip("`")
            if len(term) > 2:
                yield i, term


@functools.lru_cache(maxsize=4)
def doc_items(sources: str) -> tuple[DocItem, ...]:
    """Every usable item of the docs, in (path, line) order."""
    root = Path(sources)
    files = sorted(
        p.relative_to(root).as_posix() for d in DOC_DIRS for p in (root / d).rglob("*.rst.txt")
    ) + ["glossary.rst.txt"]
    items: list[DocItem] = []
    for rel in files:
        if rel.endswith(("index.rst.txt", "license.rst.txt")):
            continue
        lines = (root / rel).read_text(encoding="utf-8", errors="replace").splitlines()
        heads = list(_headings(lines))
        title = heads[0][1] if heads else rel
        context = _doc_context(rel, title)
        for lineno, head in heads:
            if head.endswith("?"):
                items.append(DocItem("faq", rel, lineno + 1, head, context))
            elif (
                not rel.startswith("faq/")
                and head.lower().strip("`") not in _GENERIC_TITLES
                and len(head) >= 4
                and not head.lower().startswith(("what's new", "changes"))
            ):
                items.append(DocItem("topic", rel, lineno + 1, head, context))
        for lineno, term in _glossary(lines):
            items.append(DocItem("glossary", rel, lineno + 1, term, context))
        for lineno, para in _paragraphs(lines):
            items.append(DocItem("passage", rel, lineno + 1, para, context))
    return tuple(items)


# ---------------------------------------------------------------- prompts
_FRAMINGS = {
    "faq": (
        "{text}",
        "{text} Please explain with a short example.",
        "I'm learning Python. {text}",
        "Quick Python question: {text}",
    ),
    "topic": (
        'Explain "{text}" in {context}.',
        'How do I work with "{text}"? This is about {context}.',
        'What should I know about "{text}" in {context}? Give a short example.',
        'I\'m reading about {context}. Can you give me an overview of "{text}"?',
    ),
    "glossary": (
        'What does "{text}" mean in Python?',
        'Explain the Python term "{text}" to a beginner.',
        "In Python, what is meant by {text}? Give an example.",
    ),
    "passage": (
        "Explain this passage from the Python documentation in simpler words:\n\n{text}",
        "Summarise the following in two or three sentences:\n\n{text}",
        (
            "Here is part of the Python docs:\n\n{text}\n\n"
            "Can you give a code example that illustrates it?"
        ),
        "Turn this into a short list of key points:\n\n{text}",
    ),
}
_TOPIC_MODULE_FRAMINGS = (
    "What is the Python `{mod}` module for? ({desc})",
    "How do I use Python's `{mod}` module? Show a short example.",
    "Give me an overview of the `{mod}` module: {desc}.",
)
# Share of each kind in the stream (until a kind runs out).
WEIGHTS = {"faq": 0.25, "topic": 0.35, "glossary": 0.1, "passage": 0.3}


def _prompt_text(item: DocItem, framing: int) -> str:
    mod = re.match(r"^`([\w.]+)`\s+-+\s+(.*)$", item.text)
    if item.kind == "topic" and mod:
        template = _TOPIC_MODULE_FRAMINGS[framing % len(_TOPIC_MODULE_FRAMINGS)]
        return template.format(mod=mod.group(1), desc=mod.group(2))
    framings = _FRAMINGS[item.kind]
    return framings[framing % len(framings)].format(text=item.text, context=item.context)


def _stream(items: list[DocItem], seed: int, kind: str) -> Iterator[tuple[DocItem, int]]:
    """Each item once (shuffled), then each again with the next framing, and so on."""
    items = list(items)
    random.Random(f"chat:{seed}:{kind}").shuffle(items)
    n_framings = len(_FRAMINGS[kind])
    for rnd in range(n_framings):
        for item in items:
            start = random.Random(f"chat:{seed}:{item.path}:{item.lineno}").randrange(n_framings)
            yield item, (start + rnd) % n_framings


def chat_prompts(seed: int, sources: str | os.PathLike | None = None) -> Iterator[dict]:
    """Stream of chat prompts; prefix-stable for a given seed and docs version."""
    root = str(sources or ensure_python_docs())
    by_kind: dict[str, list[DocItem]] = {k: [] for k in WEIGHTS}
    for item in doc_items(root):
        by_kind[item.kind].append(item)
    streams = {k: _stream(v, seed, k) for k, v in by_kind.items() if v}
    pick = random.Random(f"chat:{seed}:mix")
    seen: set[str] = set()
    while streams:
        kinds = sorted(streams)
        kind = pick.choices(kinds, weights=[WEIGHTS[k] for k in kinds])[0]
        try:
            item, framing = next(streams[kind])
        except StopIteration:
            del streams[kind]
            continue
        pid = f"chat/{item.path}:{item.lineno}/{item.kind}{framing}"
        if pid in seen:
            continue
        seen.add(pid)
        yield {
            "domain": "chat",
            "id": pid,
            "messages": [{"role": "user", "content": _prompt_text(item, framing)}],
        }
