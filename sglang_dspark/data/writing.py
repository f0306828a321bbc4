"""General chat prompts: writing, advice, explanation, role-play and reasoning requests.

The `chat` domain (Python docs / FAQ) teaches a drafter how the target answers technical
questions; open-ended chat traffic (emails, stories, plans, persuasive or reflective text) reads
differently, and a drafter that never saw the target write it drafts poorly there. This domain
builds such requests from task templates crossed with subjects, all written for this project.
The stream is deterministic given a seed and prefix-stable; the eval guard filters it like the
other domains.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator

# (kind, template); {s} is a subject phrase, {a} an audience, {n} a small number.
TASKS: tuple[tuple[str, str], ...] = (
    ("email", "Write a short, polite email to {a} about {s}."),
    ("email", "Draft a message to {a} proposing a meeting to discuss {s}. Keep it brief."),
    ("story", "Write a short story (about 200 words) in which {s} plays a central role."),
    ("story", "Tell a bedtime story for a seven-year-old that involves {s}."),
    ("blog", "Write an introduction for a blog post about {s}."),
    ("blog", "Write a blog post with {n} tips about {s}."),
    ("explain", "Explain {s} to {a} in simple terms."),
    ("explain", "What are the main ideas behind {s}? Answer in a few paragraphs."),
    ("advice", "I want to get better at {s}. Give me a practical plan for the next month."),
    ("advice", "What are {n} common mistakes people make with {s}, and how can they avoid them?"),
    ("compare", "Compare two different approaches to {s} and say when each one fits best."),
    ("persuade", "Write a persuasive paragraph convincing {a} to care about {s}."),
    ("persuade", "Give {n} arguments for and {n} arguments against investing time in {s}."),
    ("roleplay", "Pretend you are a tour guide. Describe {s} to a group of visitors."),
    ("roleplay", "Act as a coach and give {a} a short pep talk about {s}."),
    ("roleplay", "You are a museum curator. Write the label text for an exhibit on {s}."),
    ("poem", "Write a short poem about {s}."),
    ("poem", "Write a haiku sequence of {n} haikus about {s}."),
    ("summary", "Summarise what a beginner should know about {s} in {n} bullet points."),
    (
        "reason",
        (
            "Someone claims that {s} is a waste of time. Reason step by step about whether "
            "that is true."
        ),
    ),
    ("reason", "List {n} questions a curious student might ask about {s}, then answer the first."),
    ("plan", "Plan a one-day workshop on {s} for {a}: schedule, activities and goals."),
    ("rewrite", "Write a formal paragraph about {s}, then rewrite it in a casual tone."),
    ("dialogue", "Write a short dialogue between two friends who disagree about {s}."),
)

SUBJECTS: tuple[str, ...] = (
    "learning a second language",
    "urban gardening",
    "saving money on groceries",
    "the history of the printing press",
    "public libraries",
    "remote work",
    "volunteering at an animal shelter",
    "a rainy afternoon in a small town",
    "composting",
    "the water cycle",
    "training for a first marathon",
    "old family recipes",
    "night-time photography",
    "the invention of the bicycle",
    "keeping bees",
    "a lighthouse keeper's daily routine",
    "recycling electronics",
    "learning to play the piano",
    "a community street festival",
    "sleep and memory",
    "planning a camping trip",
    "the life of honeybees",
    "starting a small bakery",
    "birdwatching",
    "the importance of clean drinking water",
    "building a habit of journaling",
    "a train journey across the mountains",
    "board games with family",
    "solar energy at home",
    "the first day at a new job",
    "time management for students",
    "coral reefs",
    "a lost umbrella that changes hands",
    "the moon landing",
    "making friends in a new city",
    "public speaking",
    "reducing food waste",
    "the history of tea",
    "winter in the Arctic",
    "a robot that learns to cook",
    "caring for houseplants",
    "online privacy",
    "the Renaissance painters",
    "a neighbourhood book club",
    "cycling to work",
    "volcanoes",
    "a surprise birthday party",
    "learning to code as an adult",
    "healthy breakfast ideas",
    "the night sky in autumn",
    "moving to the countryside",
    "a small island without cars",
    "team sports for children",
    "writing a first novel",
    "the invention of paper money",
    "mindful walking",
    "a forgotten attic full of letters",
    "electric cars",
    "a rescue dog adjusting to a new home",
    "the ancient Silk Road",
    "fixing a leaky tap",
    "a city at dawn",
    "local farmers' markets",
    "chess strategy",
    "the deep ocean",
    "negotiating a salary",
    "homemade bread",
    "a long-distance friendship",
    "the science of rainbows",
    "organising a charity run",
    "minimalist living",
    "a village that paints its houses every spring",
    "renewable energy jobs",
    "learning from failure",
    "the life cycle of a butterfly",
    "a clockmaker's workshop",
)

AUDIENCES: tuple[str, ...] = (
    "a colleague",
    "a ten-year-old",
    "a new neighbour",
    "a team of volunteers",
    "a group of retirees",
    "a high-school class",
    "a busy manager",
    "a close friend",
    "first-year university students",
    "a local council",
)


def templates_sha256() -> str:
    """Hash of the templates, subjects and audiences: a dataset build records it, so resuming
    a build after any of them changed is refused instead of mixing two prompt sets."""
    text = json.dumps([TASKS, SUBJECTS, AUDIENCES])
    return hashlib.sha256(text.encode()).hexdigest()


def writing_prompts(seed: int) -> Iterator[dict]:
    """Every (task, subject) pair once, shuffled by seed; audience and number drawn per pair."""
    pairs = [(t, s) for t in range(len(TASKS)) for s in range(len(SUBJECTS))]
    random.Random(f"writing:{seed}").shuffle(pairs)
    for t, s in pairs:
        kind, template = TASKS[t]
        rng = random.Random(f"writing:{seed}:{t}:{s}")
        text = template.format(s=SUBJECTS[s], a=rng.choice(AUDIENCES), n=rng.choice((3, 4, 5)))
        yield {
            "domain": "writing",
            "id": f"writing/{kind}{t}/{s}",
            "messages": [{"role": "user", "content": text}],
        }
