"""Loaders for the small data sets that ship inside the package, in gpukit/lessons/datasets/ (provenance in
data/README.md). They are package data, so an installed gpukit finds them wherever it runs."""

from __future__ import annotations

import hashlib
import io
from importlib.resources import files

import numpy as np
import torch

from .._torch import _disable_current_modes

DATASETS = files("gpukit.lessons") / "datasets"
DIGITS_SHA256 = "b2dab7b501728c22e9119ad76740b2e17c77a231e42d1e592380d90886f1a05e"


def _checked(resource, sha256: str) -> io.BytesIO:
    """The bytes of a shipped data file, after checking them against their recorded SHA-256."""
    try:
        data = resource.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{resource} is missing: gpukit was installed without its data files; "
                                "reinstall it (pip install of the repository includes gpukit/lessons/datasets/)") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise ValueError(f"{resource} is damaged or replaced: SHA-256 {digest}, expected {sha256}")
    return io.BytesIO(data)


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1797 8x8 handwritten digits: images (N, 1, 8, 8) float32 in [0, 1], labels (N,) int64.

    Raises:
        FileNotFoundError: if gpukit/lessons/datasets/digits.npz is not installed.
        ValueError: if it does not match its recorded checksum.
    """
    with np.load(_checked(DATASETS / "digits.npz", DIGITS_SHA256)) as f:
        images = torch.from_numpy(f["images"].astype(np.float32) / 16.0).unsqueeze(1)
        labels = torch.from_numpy(f["labels"].astype(np.int64))
    return images, labels


def load_digit_tokens() -> torch.Tensor:
    """The digits as token sequences for a language model: (1797, 64) int64, pixel values 0..16 row by row."""
    with np.load(_checked(DATASETS / "digits.npz", DIGITS_SHA256)) as f:
        return torch.from_numpy(f["images"].reshape(len(f["images"]), 64).astype(np.int64))


def digits_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of any size from the digits (cycling through the 1797 images): images, labels."""
    images, labels = _cached("digits", load_digits)
    idx = torch.arange(batch_size) % len(images)
    return images[idx], labels[idx]


def digit_tokens_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A language-model batch of any size from the digit token sequences: inputs, next-token targets."""
    tokens = _cached("tokens", load_digit_tokens)
    idx = torch.arange(batch_size) % len(tokens)
    return tokens[idx, :-1], tokens[idx, 1:]


_CACHE: dict = {}


def _cached(key, load):
    if key not in _CACHE:
        with _disable_current_modes():  # loaded first under fake tensors (predict, a rehearsal), it stays real
            _CACHE[key] = load()
    return _CACHE[key]
