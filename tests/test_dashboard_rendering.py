"""nbkit.dashboard.rendering: the words and numbers the text line shows."""

from __future__ import annotations

import pytest
from dashboard_events import step_event

from nbkit.notebook.dashboard.board import Board
from nbkit.notebook.dashboard.rendering import peak_memory_text, text_line


@pytest.mark.version_independent
def test_peak_memory_names_each_rank():
    assert peak_memory_text({0: (0.51, "cpu"), 1: (0.5, "cpu")}) == "peak memory rank 0: 0.51 GiB, rank 1: 0.50 GiB"
    eight = {rank: (1.0 + rank / 10, f"cuda:{rank}") for rank in range(8)}
    assert peak_memory_text(eight) == "peak memory 1.70 GiB (highest, rank 7 of 8)"
    board = Board(2)
    board.record(0, step_event(1, 1.0, memory=0.51))
    board.record(1, step_event(1, 1.0, memory=0.5))
    assert "| peak memory rank 0: 0.51 GiB, rank 1: 0.50 GiB |" in text_line(board.snapshot())
