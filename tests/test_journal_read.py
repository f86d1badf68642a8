"""Journals are read line by line (store/journal.py read_journal) with the rules of the whole-text
parse: blank lines skipped, a torn last line ignored, a torn middle line an error naming it."""

import pytest

from dflash_cache.errors import DFlashCacheError
from dflash_cache.store.journal import cut_torn_line, parse_journal, read_journal

CASES = [
    ('{"a": 1}\n{"b": 2}\n', [{"a": 1}, {"b": 2}]),
    ('{"a": 1}\n\n{"b": 2}', [{"a": 1}, {"b": 2}]),  # no final newline
    ('{"a": 1}\n{"b": ', [{"a": 1}]),  # torn last line
    ('{"a": 1}\n{"b": \n', [{"a": 1}]),  # torn last line, newline written
    ("", []),
    ("\n\n", []),
]


@pytest.mark.parametrize("text,entries", CASES)
def test_read_journal_line_by_line(tmp_path, text, entries):
    path = tmp_path / "r0.jsonl"
    path.write_text(text)
    assert list(read_journal(path)) == entries == parse_journal(text, "r0")


def test_a_torn_middle_line_is_an_error(tmp_path):
    path = tmp_path / "r0.jsonl"
    path.write_text('{"a": 1}\n{"b": \n{"c": 3}\n')
    with pytest.raises(DFlashCacheError, match=r"r0.jsonl:2: corrupt journal line"):
        list(read_journal(path))
    path.write_bytes(b'{"a": 1}\n\xff\n')
    with pytest.raises(DFlashCacheError, match="not UTF-8 text"):
        list(read_journal(path))


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n",
        '{"a": 1}\n',
        '{"a": 1}\n{"b": ',
        '{"a": 1}',
        "x" * 300,
        "a\n" + "y" * 250,
        "a\nb\n" + "z" * 64 + "\n" + "w" * 129,
    ],
)
def test_a_torn_line_is_found_from_the_end_a_block_at_a_time(tmp_path, text):
    """cut_torn_line reads blocks from the end (here of 16 bytes, so a torn line spans several):
    what is left is the text up to its last newline, as a whole read finds it."""
    path = tmp_path / "r0.jsonl"
    path.write_text(text)
    whole = text[: text.rfind("\n") + 1]
    assert cut_torn_line(path, block=16) == len(text) - len(whole)
    assert path.read_text() == whole
