"""nbkit.synthetic: deterministic, well-formed, learnable chat datasets."""

from __future__ import annotations

import re

import pytest
from PIL import Image, ImageChops

from nbkit.training.synthetic import NUMBERS, VISION_QUESTIONS, WORDS, text_dataset, vision_dataset


def _answer_for(prompt: str) -> str:
    """Independent oracle for the text tasks, from the prompt wording alone."""
    if m := re.fullmatch(r"Reverse the word '(\w+)'\.", prompt):
        return m[1][::-1]
    if m := re.fullmatch(r"Write '(\w+)' in capital letters\.", prompt):
        return m[1].upper()
    if m := re.fullmatch(r"Spell '(\w+)' with dashes between the letters\.", prompt):
        return "-".join(m[1])
    if m := re.fullmatch(r"What is (\d+) \+ (\d+)\?", prompt):
        return str(int(m[1]) + int(m[2]))
    raise AssertionError(f"unexpected prompt {prompt!r}")


@pytest.mark.version_independent
def test_text_dataset_answers_are_correct_and_deterministic() -> None:
    items = text_dataset(200, seed=0)
    assert len(items) == 200
    assert items == text_dataset(200, seed=0)
    kinds = set()
    for item in items:
        user, assistant = item["messages"]
        assert set(item) == {"messages"}
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        assert isinstance(user["content"], str) and isinstance(assistant["content"], str)
        assert assistant["content"] == _answer_for(user["content"])
        kinds.add(user["content"].split()[0])
    assert kinds == {"Reverse", "Write", "Spell", "What"}  # every task appears


@pytest.mark.version_independent
def test_other_seeds_give_held_out_items() -> None:
    train, held_out = text_dataset(100, seed=0), text_dataset(100, seed=1)
    assert train != held_out
    first, other = vision_dataset(20, seed=0), vision_dataset(20, seed=1)
    assert [i["images"][0].tobytes() for i in first] != [i["images"][0].tobytes() for i in other]


@pytest.mark.version_independent
def test_vision_dataset_answers_are_drawn_in_the_image() -> None:
    items = vision_dataset(40, seed=3, image_size=64)
    again = vision_dataset(40, seed=3, image_size=64)
    vocabulary = set(WORDS) | set(NUMBERS)
    for item, same in zip(items, again):
        assert set(item) == {"messages", "images"}
        user, assistant = item["messages"]
        assert user["content"][0] == {"type": "image"}
        assert user["content"][1]["type"] == "text" and user["content"][1]["text"] in VISION_QUESTIONS
        answer = assistant["content"][0]["text"]
        assert answer in vocabulary
        (image,) = item["images"]
        assert image.size == (64, 64) and image.mode == "RGB"
        assert image.tobytes() == same["images"][0].tobytes()
        # Text is drawn: the background colour dominates, ink is a visible share, glyphs are tall
        # enough to read and inside the image.
        background = max(image.getcolors(64 * 64))[0]
        assert 0.005 < 1 - background / (64 * 64) < 0.6, answer
        left, top, right, bottom = _ink_box(image)
        assert bottom - top >= 8 and right - left >= 4, answer
    # Varied colours and positions across the dataset.
    assert len({item["images"][0].getpixel((0, 0)) for item in items}) >= 4
    assert len({_ink_box(item["images"][0]) for item in items}) > 10


def _ink_box(image: Image.Image) -> tuple[int, int, int, int] | None:
    """Bounding box of the pixels that differ from the corner (background) colour."""
    background = Image.new("RGB", image.size, image.getpixel((0, 0)))
    return ImageChops.difference(image, background).getbbox()


def test_image_size_is_configurable_and_datasets_load_into_datasets() -> None:
    from datasets import Dataset

    (item,) = vision_dataset(1, image_size=224)
    assert item["images"][0].size == (224, 224)
    assert Dataset.from_list(vision_dataset(4)).num_rows == 4
    assert Dataset.from_list(text_dataset(4))[0]["messages"][0]["role"] == "user"


@pytest.mark.version_independent
def test_bad_arguments_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="image_size >= 16"):
        vision_dataset(2, image_size=8)
    with pytest.raises(ValueError, match="n >= 0"):
        text_dataset(-1)
