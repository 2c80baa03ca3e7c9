"""Built-in chat-style prompts for drafting data: task templates crossed with subjects.

``builtin_prompts(n, seed)`` returns ``n`` distinct user messages (up to
``len(TEMPLATES) * len(SUBJECTS)``), a seeded shuffle of the cross product, so a small ``n``
still covers many kinds of task (explanations, lists, stories, code, advice, comparisons).
"""

from __future__ import annotations

import random

TEMPLATES = (
    "Explain {s} to a ten-year-old.",
    "Write a short story about {s}.",
    "Give me five interesting facts about {s}.",
    "What are the pros and cons of {s}?",
    "Write a haiku about {s}.",
    "Summarize the history of {s} in a few sentences.",
    "How would you teach a beginner about {s}? Give a step-by-step plan.",
    "Write a short blog post introduction about {s}.",
    "What are common misconceptions about {s}?",
    "Describe {s} in the style of a news report.",
    "Write a Python function related to {s}, with a docstring and comments.",
    "Compare {s} with something from everyday life.",
    "List three questions a student might ask about {s}, and answer them.",
    "Write a friendly email to a colleague about {s}.",
    "What is the most important thing to know about {s}?",
    "Give practical tips for someone interested in {s}.",
    "Write a short poem about {s}.",
    "Describe a typical day of a person who works with {s}.",
    "Why does {s} matter? Answer in one paragraph.",
    "Write a dialogue between two friends discussing {s}.",
)

SUBJECTS = (
    "the water cycle", "black holes", "photosynthesis", "the Roman Empire", "volcanoes",
    "machine learning", "the human heart", "electric cars", "coffee", "honey bees",
    "the internet", "climate change", "chess", "the moon landing", "recycling",
    "the stock market", "dinosaurs", "vaccines", "renewable energy", "sleep",
    "the Great Wall of China", "smartphones", "gardening", "the ocean", "music theory",
    "healthy eating", "earthquakes", "the printing press", "rainforests", "learning a language",
    "cooking pasta", "space travel",
)


def builtin_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct prompts (at most len(TEMPLATES) * len(SUBJECTS)), seeded order."""
    combos = [t.format(s=s) for t in TEMPLATES for s in SUBJECTS]
    if n > len(combos):
        raise ValueError(f"at most {len(combos)} built-in prompts, asked for {n}")
    random.Random(seed).shuffle(combos)
    return combos[:n]
