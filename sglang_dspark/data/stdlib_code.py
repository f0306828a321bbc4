"""Code prompts from the CPython standard library on disk.

Every function (and method) of the stdlib, tests excluded, becomes one or more prompts:
explain it, write its docstring, complete it, write it from its docstring, find a planted
bug, write tests for it, review it. Paths differ by machine, so the file list is pinned:
sorted POSIX paths relative to the stdlib root, hashed together with the file contents into
a manifest hash. The same seed and the same manifest hash give the same prompts.
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import random
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

# Directories that hold tests, caches, installed third-party packages or generated tables.
SKIP_DIRS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "__pycache__",
        "site-packages",
        "dist-packages",
        "encodings",
        "pydoc_data",
    }
)
# About 400 tokens of Python with SmolLM2's tokenizer (roughly 3.5 characters a token).
MAX_CODE_CHARS = 1400
MIN_CODE_LINES = 4

KINDS = ("explain", "docstring", "complete", "write", "bug", "tests", "review")

_INSTRUCTIONS = {
    "explain": (
        "Explain what this function does.",
        "What does the following Python function do? Walk me through it.",
        "Can you explain this code step by step?",
        "Describe the purpose and behaviour of this function, including edge cases.",
    ),
    "docstring": (
        "Write a docstring for this function.",
        "Add a clear, PEP 257 style docstring to this function.",
        "Document this function: write a docstring describing its arguments and return value.",
    ),
    "complete": (
        "Complete this function.",
        "Finish the implementation of this Python function.",
        "The body of this function is cut off. Write the rest of it.",
    ),
    "bug": (
        "This function has a bug. Find it and fix it.",
        "Find the bug in this code and explain how to fix it.",
        "Something is wrong with this function. What is the bug?",
    ),
    "tests": (
        "Write unit tests for this function using pytest.",
        "Write a few test cases for this function with unittest.",
    ),
    "review": (
        "Review this code and suggest improvements.",
        "How could this function be made more readable? Rewrite it.",
        "Add type hints to this function.",
    ),
}


@dataclass(frozen=True)
class StdlibManifest:
    """The pinned file list: which files, and a hash of paths + contents."""

    root: str
    python_version: str
    files: tuple[str, ...]  # sorted POSIX paths relative to root
    sha256: str

    def summary(self) -> dict:
        return {
            "python_version": self.python_version,
            "files": len(self.files),
            "sha256": self.sha256,
        }


@dataclass(frozen=True)
class StdlibFunction:
    path: str  # relative POSIX path
    lineno: int
    qualname: str
    source: str  # dedented, decorators excluded
    docstring: str | None
    signature: str  # "def name(args):" line(s), dedented

    @property
    def key(self) -> str:
        return f"{self.path}:{self.lineno}:{self.qualname}"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _skipped(rel: Path) -> bool:
    return bool(set(rel.parts[:-1]) & SKIP_DIRS) or rel.name.startswith("test_")


@functools.lru_cache(maxsize=4)
def stdlib_manifest(root: str | None = None) -> StdlibManifest:
    base = Path(root) if root else stdlib_root()
    if not base.is_dir():
        raise FileNotFoundError(f"Python stdlib not found at {base}")
    files = sorted(
        rel.as_posix()
        for rel in (p.relative_to(base) for p in base.rglob("*.py"))
        if not _skipped(rel)
    )
    digest = hashlib.sha256()
    for rel in files:
        content = hashlib.sha256((base / rel).read_bytes()).hexdigest()
        digest.update(f"{rel}\t{content}\n".encode())
    version = ".".join(map(str, sys.version_info[:3]))
    return StdlibManifest(str(base), version, tuple(files), digest.hexdigest())


def _functions_in(path: str, text: str) -> Iterator[StdlibFunction]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    lines = text.splitlines()

    def visit(body: list[ast.stmt], prefix: str) -> Iterator[StdlibFunction]:
        for node in body:
            if isinstance(node, ast.ClassDef) and not prefix:
                yield from visit(node.body, node.name + ".")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                fn = _function(path, lines, node, prefix + node.name)
                if fn is not None:
                    yield fn

    yield from visit(tree.body, "")


def _function(path: str, lines: list[str], node: ast.FunctionDef, qualname: str):
    if node.name.startswith("test"):
        return None
    source = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
    n_lines = node.end_lineno - node.lineno + 1
    if n_lines < MIN_CODE_LINES or len(source) > MAX_CODE_CHARS:
        return None
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    trivial = len(body) == 1 and isinstance(body[0], (ast.Pass, ast.Raise, ast.Expr))
    if not body or trivial:
        return None
    sig_end = node.body[0].lineno - 1  # lines of the signature (may span several)
    signature = textwrap.dedent("\n".join(lines[node.lineno - 1 : sig_end]))
    if not signature.rstrip().endswith(":"):
        return None  # one-line "def f(): return x" style; skip
    try:  # multi-line strings indented less than the code defeat dedent
        ast.parse(source)
    except SyntaxError:
        return None
    return StdlibFunction(path, node.lineno, qualname, source, ast.get_docstring(node), signature)


@functools.lru_cache(maxsize=4)
def stdlib_functions(root: str | None = None) -> tuple[StdlibFunction, ...]:
    """All candidate functions, in (path, line) order."""
    manifest = stdlib_manifest(root)
    base = Path(manifest.root)
    out: list[StdlibFunction] = []
    for rel in manifest.files:
        text = (base / rel).read_text(encoding="utf-8", errors="replace")
        out.extend(_functions_in(rel, text))
    return tuple(out)


# ---------------------------------------------------------------- prompt kinds
def _fence(code: str) -> str:
    return f"```python\n{code.rstrip()}\n```"


def _without_docstring(fn: StdlibFunction) -> str:
    node = ast.parse(fn.source).body[0]
    if ast.get_docstring(node) is None:
        return fn.source
    lines = fn.source.splitlines()
    doc = node.body[0]
    return "\n".join(lines[: doc.lineno - 1] + lines[doc.end_lineno :])


def _first_sentence(doc: str) -> str:
    para = " ".join(doc.strip().split("\n\n")[0].split())
    sentence = para.split(". ")[0].rstrip(".")
    return sentence[:1].lower() + sentence[1:] if sentence else ""


class _Mutator(ast.NodeTransformer):
    """Plant one bug: flip a comparison, an arithmetic operator, a boolean or a constant."""

    SWAPS: ClassVar[dict[type, type]] = {
        ast.Lt: ast.LtE,
        ast.LtE: ast.Lt,
        ast.Gt: ast.GtE,
        ast.GtE: ast.Gt,
        ast.Eq: ast.NotEq,
        ast.NotEq: ast.Eq,
        ast.Add: ast.Sub,
        ast.Sub: ast.Add,
        ast.And: ast.Or,
        ast.Or: ast.And,
        ast.In: ast.NotIn,
        ast.NotIn: ast.In,
    }

    def __init__(self, target: int):
        self.target, self.seen = target, 0

    def _hit(self) -> bool:
        self.seen += 1
        return self.seen - 1 == self.target

    def visit_Compare(self, node):
        self.generic_visit(node)
        if type(node.ops[0]) in self.SWAPS and self._hit():
            node.ops[0] = self.SWAPS[type(node.ops[0])]()
        return node

    def visit_BinOp(self, node):
        self.generic_visit(node)
        if type(node.op) in self.SWAPS and self._hit():
            node.op = self.SWAPS[type(node.op)]()
        return node

    def visit_BoolOp(self, node):
        self.generic_visit(node)
        if self._hit():
            node.op = self.SWAPS[type(node.op)]()
        return node

    def visit_Constant(self, node):
        if type(node.value) is int and 0 <= node.value < 100 and self._hit():
            return ast.copy_location(ast.Constant(node.value + 1), node)
        return node


def _with_bug(fn: StdlibFunction, rng: random.Random) -> str | None:
    tree = ast.parse(fn.source)
    counter = _Mutator(-1)
    counter.visit(copy.deepcopy(tree))
    if counter.seen == 0:
        return None
    mutated = _Mutator(rng.randrange(counter.seen)).visit(tree)
    try:
        return ast.unparse(ast.fix_missing_locations(mutated))
    except (ValueError, RecursionError):
        return None


def _applicable(fn: StdlibFunction, kind: str) -> bool:
    if kind == "write":
        return bool(fn.docstring and len(_first_sentence(fn.docstring)) >= 15)
    if kind == "complete":
        return fn.source.count("\n") >= 5
    return True


def code_prompt(fn: StdlibFunction, kind: str, rng: random.Random) -> str | None:
    """The user message for one (function, kind), or None when the kind does not apply."""
    if not _applicable(fn, kind):
        return None
    module = fn.path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    if kind == "write":
        sig = " ".join(fn.signature.split()).removeprefix("async ").removeprefix("def ")
        task = _first_sentence(fn.docstring or "")
        framing = rng.choice(
            (
                "Write a Python function `{sig}` that does the following: {task}.",
                "Implement `{sig}` in Python. It should {task}.",
                "I need a Python function `{sig}`. Its job: {task}. Please write it with comments.",
            )
        )
        return framing.format(sig=sig.rstrip(":"), task=task)
    if kind == "bug":
        code = _with_bug(fn, rng)
        if code is None:
            return None
    elif kind == "docstring":
        code = _without_docstring(fn)
    elif kind == "complete":
        lines = fn.source.splitlines()
        keep = max(fn.signature.count("\n") + 2, len(lines) // 2)
        code = "\n".join(lines[:keep])
    else:
        code = fn.source
    instruction = rng.choice(_INSTRUCTIONS[kind])
    if rng.random() < 0.3:
        instruction = f"{instruction} It is from the Python module `{module}`."
    if rng.random() < 0.5:
        return f"{instruction}\n\n{_fence(code)}"
    return f"{_fence(code)}\n\n{instruction}"


def code_prompts(seed: int, root: str | None = None) -> Iterator[dict]:
    """Endless-ish stream of code prompts: every function once (shuffled by seed) with one
    kind, then again with the next kind, and so on. Prefix-stable: N prompts are the first N
    of N + M."""
    functions = list(stdlib_functions(root))
    order = random.Random(f"code:{seed}")
    order.shuffle(functions)
    for rnd in range(len(KINDS)):
        for fn in functions:
            rng = random.Random(f"code:{seed}:{fn.key}:{rnd}")
            start = random.Random(f"code:{seed}:{fn.key}").randrange(len(KINDS))
            kind = KINDS[(start + rnd) % len(KINDS)]
            text = code_prompt(fn, kind, rng)
            if text is None:
                continue
            yield {
                "domain": "code",
                "id": f"code/{fn.key}/{kind}",
                "messages": [{"role": "user", "content": text}],
            }
