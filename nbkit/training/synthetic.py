"""Small, learnable, offline datasets in the chat format TRL's SFTTrainer expects.

Both builders return plain lists of dicts (so `datasets.Dataset.from_list` works on them), are
deterministic for a seed, and draw from a space large enough that another seed gives other items:
use seed=0 for training and seed=1 for a held-out split.

- `vision_dataset`: a word or number is drawn on a small image; the assistant answers with it.
- `text_dataset`: short instructions (reverse, upper-case, spell, add) with exact answers.

The vocabulary below also seeds the tokenizer of nbkit's offline models (`nbkit.offline`), so the
words a task needs are single tokens or a few, and the tiny models learn these tasks quickly.
"""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Any

from PIL import Image, ImageDraw, ImageFont

__all__ = ["NUMBERS", "TEXT_TASKS", "VISION_QUESTIONS", "WORDS", "corpus", "text_dataset", "vision_dataset"]

# Short, distinct words: readable at 64x64 and easy to check.
WORDS: tuple[str, ...] = (
    "cat",
    "dog",
    "sun",
    "moon",
    "star",
    "tree",
    "fish",
    "bird",
    "book",
    "ship",
    "rain",
    "leaf",
    "king",
    "lamp",
    "door",
    "milk",
    "rose",
    "frog",
    "cake",
    "bell",
    "fire",
    "snow",
    "wind",
    "gold",
    "blue",
    "red",
    "green",
    "apple",
    "house",
    "river",
    "cloud",
    "stone",
    "bread",
    "chair",
    "table",
    "horse",
    "mouse",
    "light",
    "water",
    "plant",
    "smile",
    "train",
    "music",
    "heart",
    "sand",
    "wolf",
    "bear",
    "duck",
    "kite",
    "ring",
)

# Numbers are drawn as text too, so the answers mix words and digits.
NUMBERS: tuple[str, ...] = tuple(str(n) for n in range(100))

VISION_QUESTIONS: tuple[str, ...] = (
    "What word is written in the image?",
    "Read the text in this picture.",
    "What does the image say?",
    "Which word or number do you see?",
    "Transcribe the text shown in the image.",
    "What is written here?",
)

TEXT_TASKS: tuple[str, ...] = ("reverse", "upper", "spell", "add")

# (background, text) colour pairs with strong contrast, light-on-dark and dark-on-light.
_PALETTE: tuple[tuple[tuple[int, int, int], tuple[int, int, int]], ...] = (
    ((255, 255, 255), (0, 0, 0)),
    ((250, 240, 210), (120, 20, 20)),
    ((210, 230, 255), (10, 30, 120)),
    ((215, 245, 215), (0, 90, 30)),
    ((255, 220, 235), (90, 0, 90)),
    ((255, 250, 180), (60, 40, 0)),
    ((0, 0, 0), (255, 255, 255)),
    ((20, 30, 90), (255, 230, 120)),
    ((90, 10, 10), (255, 240, 240)),
    ((0, 70, 40), (220, 255, 220)),
)


@lru_cache(maxsize=256)
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    # Pillow's built-in font scales where FreeType is available; elsewhere it is a small bitmap
    # font, still readable, and the image stays valid.
    return ImageFont.load_default(size=size)


def _largest_font(draw: ImageDraw.ImageDraw, text: str, width: float, height: float) -> int:
    """Largest font size (binary search) at which `text` fits in width x height pixels."""
    low, high = 6, max(7, int(height * 2))
    while low < high:
        size = (low + high + 1) // 2
        left, top, right, bottom = draw.textbbox((0, 0), text, font=_font(size))
        if right - left <= width and bottom - top <= height:
            low = size
        else:
            high = size - 1
    return low


def _render(text: str, image_size: int, rng: random.Random) -> Image.Image:
    background, ink = rng.choice(_PALETTE)
    image = Image.new("RGB", (image_size, image_size), background)
    draw = ImageDraw.Draw(image)
    # Between 60% and 100% of the largest size that fits, so short and long answers stay readable.
    largest = _largest_font(draw, text, image_size * 0.9, image_size * 0.6)
    font = _font(max(6, round(largest * rng.uniform(0.6, 1.0))))
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    x = rng.randint(0, max(0, int(image_size - (right - left)))) - left
    y = rng.randint(0, max(0, int(image_size - (bottom - top)))) - top
    draw.text((x, y), text, fill=ink, font=font)
    return image


def vision_dataset(n: int = 256, *, seed: int = 0, image_size: int = 64) -> list[dict[str, Any]]:
    """`n` image question/answer conversations: read the word or number drawn in the image.

    Args:
        n: the number of items.
        seed: same seed, same items; another seed, another sample.
        image_size: the side of the square RGB images in pixels (64 keeps the tiny VL model fast
            on CPU; use 224-448 for GPU work).

    Returns:
        A list of `{"messages": [user: [{"type": "image"}, {"type": "text", "text": question}],
        assistant: [{"type": "text", "text": answer}]], "images": [PIL.Image]}` where the answer
        is the text drawn in the image (a word from `WORDS` or a number 0-99) in one of several
        colour schemes, sizes and positions.

    Raises:
        ValueError: for n < 0 or image_size < 16.
    """
    if n < 0:
        raise ValueError(f"vision_dataset needs n >= 0, got {n}.")
    if image_size < 16:
        raise ValueError(f"vision_dataset needs image_size >= 16 pixels to draw readable text, got {image_size}.")
    rng = random.Random(f"nbkit-vision-{seed}")
    items = []
    for _ in range(n):
        answer = rng.choice(WORDS) if rng.random() < 0.7 else rng.choice(NUMBERS)
        question = rng.choice(VISION_QUESTIONS)
        items.append(
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
                    {"role": "assistant", "content": [{"type": "text", "text": answer}]},
                ],
                "images": [_render(answer, image_size, rng)],
            }
        )
    return items


def _text_item(task: str, rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    if task == "reverse":
        return f"Reverse the word '{word}'.", word[::-1]
    if task == "upper":
        return f"Write '{word}' in capital letters.", word.upper()
    if task == "spell":
        return f"Spell '{word}' with dashes between the letters.", "-".join(word)
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    return f"What is {a} + {b}?", str(a + b)


def text_dataset(n: int = 256, *, seed: int = 0) -> list[dict[str, Any]]:
    """`n` instruction/answer conversations with exact answers.

    Tasks (mixed evenly at random): reverse a word, write it in capitals, spell it with dashes, add
    two numbers up to 50.

    Args:
        n: the number of items.
        seed: same seed, same items.

    Returns:
        A list of `{"messages": [{"role": "user", "content": str}, {"role": "assistant",
        "content": str}]}`.

    Raises:
        ValueError: for n < 0.
    """
    if n < 0:
        raise ValueError(f"text_dataset needs n >= 0, got {n}.")
    rng = random.Random(f"nbkit-text-{seed}")
    items = []
    for _ in range(n):
        prompt, answer = _text_item(rng.choice(TEXT_TASKS), rng)
        items.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]})
    return items


def corpus() -> list[str]:
    """Every string the datasets can produce, as tokenizer training text (deterministic)."""
    lines = list(VISION_QUESTIONS) + list(WORDS) + list(NUMBERS)
    rng = random.Random("nbkit-corpus")
    for task in TEXT_TASKS:
        for _ in range(200):
            prompt, answer = _text_item(task, rng)
            lines += [prompt, answer]
    return lines
