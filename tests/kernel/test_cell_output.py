"""A cell's own fds 1 and 2 (``nbos.kernel.replica._output``) on ipykernel's real streams."""

from __future__ import annotations

from pathlib import Path

from nbos.kernel.replica._output import STREAM_MESSAGE_CHARS
from tests.kernel.conftest import run_json

CHILD = Path(__file__).with_name("_cell_output_child.py")
STREAM_CHILD = Path(__file__).with_name("_stream_chunks_child.py")


def test_cells_output_on_their_fds_is_theirs_and_quiet_cells_cost_the_reader_nothing() -> None:
    report = run_json([str(CHILD)])
    # What a cell writes on fd 1 is its output; a child's later output stays its cell's.
    assert sorted(report["streams"]) == [
        ["first", "on fd 1\n"],
        ["later", "later cell\n"],
        ["parent", "late from the child\n"],
    ]
    # A cell's pipes are closed as it ends when no child holds them, not later by the
    # reader thread, which is not woken for them at all (it was twice per cell).
    assert report["fds_grew_by"] == 0
    assert report["woke"] < 5
    # The child's pipe went once the child exited.
    assert report["watched_at_end"] == 0


def test_a_flood_goes_out_in_stream_messages_of_at_most_a_mebi_character() -> None:
    report = run_json([str(STREAM_CHILD)])
    # ipykernel sent all 2.5 Mi characters (written within its 0.2 s) as one message.
    assert report["whole"]
    assert report["lengths"] == [STREAM_MESSAGE_CHARS, STREAM_MESSAGE_CHARS, 512 * 1024]
