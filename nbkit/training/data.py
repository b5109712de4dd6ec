"""The datasets the notebooks train on: a hub dataset, or nbkit's synthetic set.

    dataset = nbkit.data.image_text_dataset("unsloth/LaTeX_OCR", 1000)   # columns "image" and "text"
    dataset = nbkit.data.image_text_dataset("synthetic", 64)             # no hub: words drawn on images
    chats = nbkit.data.chat_dataset("trl-lib/Capybara", 1000)            # [{"messages": [user, assistant]}]

Only the name "synthetic" gives the synthetic set. A hub dataset that cannot be loaded is a DatasetError that
names it and what to check, never a quiet switch to other data: a run that trained on the wrong data looks
like a run that worked.
"""

from __future__ import annotations

import os
from typing import Any

from nbkit.platform.errors import DatasetArgumentError, DatasetError

__all__ = ["SYNTHETIC", "chat_dataset", "image_text_dataset"]

SYNTHETIC = "synthetic"


def image_text_dataset(
    name: str,
    n: int,
    *,
    split: str = "train",
    image_size: int = 448,
    seed: int = 0,
    columns: tuple[str, str] = ("image", "text"),
) -> Any:
    """The first `n` rows of an image-and-text dataset as a `datasets.Dataset` with columns "image" and "text".

    Args:
        name: a dataset on the Hugging Face hub (or a local path `datasets.load_dataset` reads), or "synthetic":
            nbkit's offline set, a word or number drawn on an image with that word as the text.
        n: how many rows.
        split: the split of a hub dataset.
        image_size: the side in pixels of the synthetic images (hub datasets have their own).
        seed: which synthetic rows (another seed, other rows).
        columns: the hub dataset's image and text columns, renamed to "image" and "text".

    Returns:
        A `datasets.Dataset` (PIL images in "image", strings in "text"). Runs in the calling process.

    Raises:
        DatasetArgumentError: `n` is not a whole number of at least 1, or `split` is not a split's name.
        DatasetError: the hub dataset could not be loaded (the message names it and what to check: the name,
            the connection, HF_HUB_OFFLINE, a token), has no split `split`, or lacks the columns.
    """
    import datasets

    _check(n, split)
    if name == SYNTHETIC:
        from nbkit.training.synthetic import vision_dataset

        rows = vision_dataset(n, seed=seed, image_size=image_size)
        return datasets.Dataset.from_list(
            [{"image": row["images"][0], "text": row["messages"][1]["content"][0]["text"]} for row in rows]
        )
    loaded = _load(name, split, n)
    image, text = columns
    missing = [column for column in columns if column not in loaded.column_names]
    if missing:
        raise DatasetError(
            f"The dataset {name!r} has no column {', '.join(map(repr, missing))} (it has {loaded.column_names}); "
            f"pass columns=(image_column, text_column)."
        )
    if (image, text) != ("image", "text"):
        loaded = loaded.select_columns([image, text]).rename_columns({image: "image", text: "text"})
    return loaded


def chat_dataset(name: str, n: int, *, split: str = "train", seed: int = 0) -> list[dict[str, Any]]:
    """The first `n` conversations of a chat dataset, each cut to its first user turn and answer.

    Args:
        name: a dataset on the hub (or a local path) with a "messages" column of chat turns, or "synthetic":
            nbkit's offline instructions (nbkit.synthetic.text_dataset).
        n: how many conversations.
        split: the split of a hub dataset.
        seed: which synthetic conversations.

    Returns:
        `[{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}, ...]`, in the calling process.

    Raises:
        DatasetArgumentError, DatasetError: as image_text_dataset, or for a dataset without a "messages" column.
    """
    _check(n, split)
    if name == SYNTHETIC:
        from nbkit.training.synthetic import text_dataset

        return [{"messages": row["messages"][:2]} for row in text_dataset(n, seed=seed)]
    loaded = _load(name, split, n)
    if "messages" not in loaded.column_names:
        raise DatasetError(f"The dataset {name!r} has no column 'messages' (it has {loaded.column_names}).")
    return [{"messages": messages[:2]} for messages in loaded["messages"]]


def _check(n: Any, split: Any) -> None:
    """Refuse, before anything loads, what `datasets` would read as other rows (`n=-3` is `train[:-3]`) or
    blame on the hub (`n=0`, `n=2.5`).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DatasetArgumentError(
            f"n={n!r}: nbkit.data takes how many rows to load, a whole number of at least 1 (e.g. n=1000)."
        )
    if not isinstance(split, str) or not split or any(c in split for c in "[]:%"):
        raise DatasetArgumentError(
            f"split={split!r}: pass the name of a split, e.g. split='train' or split='test'; n says how many "
            "of its rows (nbkit.data takes the first n)."
        )


def _load(name: str, split: str, n: int) -> Any:
    import datasets

    try:
        return datasets.load_dataset(name, split=f"{split}[:{n}]")
    except ValueError as error:
        if "Unknown split" not in str(error):  # datasets' words for a split the dataset does not have
            raise DatasetError(_unreachable(name, error)) from error
        raise DatasetError(
            f"The dataset {name!r} has no split {split!r} ({str(error).strip()[:300]}): pass split= one of those."
        ) from error
    except Exception as error:  # the hub's, fsspec's and datasets' own errors: any of them means "not loaded"
        raise DatasetError(_unreachable(name, error)) from error


def _unreachable(name: str, error: BaseException) -> str:
    offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE")
    return (
        f"Could not load the dataset {name!r} ({type(error).__name__}: {str(error).strip()[:300]}). Check: the name "
        "as it is spelled on the hub; that the hub is reachable (Kaggle: Settings > Internet on, which needs a "
        "phone-verified account; behind a proxy: HTTPS_PROXY)"
        + (f"; HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set ({offline}), which forbids downloads" if offline else "")
        + "; for a private or gated dataset, a token (HF_TOKEN in the environment or the platform's secrets) and "
        'the dataset\'s terms accepted on its page. To train without the hub, use dataset_name = "synthetic".'
    )
