"""The report helpers: byte sizes to and from text, and Markdown tables."""

from __future__ import annotations

import pytest

from dejavu_sdk.errors import ConfigError
from dejavu_sdk.report import format_size, markdown_table, parse_size


@pytest.mark.parametrize(("text", "nbytes"), [
    ("64MiB", 64 << 20),
    ("1 MiB", 1 << 20),
    ("512KiB", 512 << 10),
    ("2gib", 2 << 30),
    ("1.5MiB", 3 << 19),
    ("4096", 4096),
    ("100B", 100),
    (" 8 KiB ", 8 << 10),
])
def test_parse_size_reads_binary_units(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "lots", "MiB", "64MB", "1,024"])
def test_parse_size_refuses_anything_else(text: str) -> None:
    with pytest.raises(ConfigError, match="is not a size"):  # a ValueError too
        parse_size(text)


@pytest.mark.parametrize(("nbytes", "text"), [
    (0, "0 B"),
    (1000, "1000 B"),
    (1 << 10, "1 KiB"),
    (1536, "1536 B"),
    (64 << 20, "64 MiB"),
    (3 << 30, "3 GiB"),
    (1 << 40, "1024 GiB"),
])
def test_format_size_uses_the_largest_whole_unit(nbytes: int, text: str) -> None:
    assert format_size(nbytes) == text


@pytest.mark.parametrize("nbytes", [1, 4096, 512 << 10, 1 << 20, 3 << 30])
def test_format_size_reads_back(nbytes: int) -> None:
    assert parse_size(format_size(nbytes)) == nbytes


def test_markdown_table_has_a_header_a_separator_and_a_line_per_row() -> None:
    table = markdown_table(["block", "GB/s"], [["1 MiB", 2.5], ["64 MiB", None]])
    assert table.splitlines() == ["| block | GB/s |", "|---|---|", "| 1 MiB | 2.5 |", "| 64 MiB | None |"]


def test_markdown_table_without_rows_is_just_the_header() -> None:
    assert markdown_table(["a", "b", "c"], []) == "| a | b | c |\n|---|---|---|"
