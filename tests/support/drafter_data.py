"""Tiny drafter-training data shared by the training and feature-cache tests."""

from __future__ import annotations

TINY_TEXTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower and fine food.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5",
    "Natalia sold 48 clips in April and half as many in May, so 48 + 24 = 72 clips.",
    "Water boils at 100 degrees Celsius at sea level, and freezes at 0 degrees.",
    "To sort a list in Python, call sorted(xs) or xs.sort() for an in-place sort.",
    "The sun rises in the east and sets in the west because the Earth rotates.",
    "A triangle has three sides; the sum of its interior angles is 180 degrees.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
]


def tiny_sequences(tokenizer) -> list[tuple[list[int], int]]:
    """(prompt + response ids, prompt length) for each of :data:`TINY_TEXTS`, chat-templated."""
    p = tokenizer.encode("<|im_start|>user\nTell me something.<|im_end|>\n<|im_start|>assistant\n")
    return [(p + tokenizer.encode(t), len(p)) for t in TINY_TEXTS]
