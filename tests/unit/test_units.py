import pytest

from hf_memkit._errors import HfMemkitError
from hf_memkit._units import GiB, MiB, format_bytes, parse_bytes


@pytest.mark.parametrize("text,expected", [
    ("20GiB", 20 * GiB), ("20 gib", 20 * GiB), ("512MiB", 512 * MiB), ("1.5GiB", int(1.5 * GiB)),
    ("16GB", 16 * 10**9), (1234, 1234), ("100", 100),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["20 gigs", "GiB", "-1GiB", -5, True])
def test_parse_bytes_rejects_with_allowed_units(bad):
    with pytest.raises(HfMemkitError):
        parse_bytes(bad)


def test_format_bytes_uses_binary_units():
    assert format_bytes(1536 * MiB) == "1.50 GiB"
    assert format_bytes(3 * MiB) == "3.00 MiB"
    assert format_bytes(12) == "12 B"
    assert format_bytes(None) == "unknown"
