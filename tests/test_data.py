"""The shipped data sets: read from the package, refused when damaged or missing."""

import hashlib

import pytest

from gpukit.lessons import data


def test_the_digits_are_read_from_the_package_and_match_their_checksum():
    raw = (data.DATASETS / "digits.npz").read_bytes()
    assert hashlib.sha256(raw).hexdigest() == data.DIGITS_SHA256
    images, labels = data.load_digits()
    assert images.shape == (1797, 1, 8, 8) and labels.shape == (1797,)
    assert 0 <= images.min() and images.max() <= 1 and set(labels.tolist()) == set(range(10))


def test_a_damaged_file_is_refused(tmp_path, monkeypatch):
    raw = bytearray((data.DATASETS / "digits.npz").read_bytes())
    raw[-1] ^= 1
    (tmp_path / "digits.npz").write_bytes(bytes(raw))
    monkeypatch.setattr(data, "DATASETS", tmp_path)
    with pytest.raises(ValueError, match="damaged or replaced"):
        data.load_digits()
    with pytest.raises(ValueError, match="damaged or replaced"):
        data.load_digit_tokens()


def test_a_missing_file_says_to_reinstall(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "DATASETS", tmp_path)
    with pytest.raises(FileNotFoundError, match="reinstall"):
        data.load_digits()
