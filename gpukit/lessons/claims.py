"""A lesson's claims, checked where the reader sees them: one sentence when a claim holds, an error that says which
claim failed when it does not; and where a figure comes from, in words.

    from gpukit.lessons.claims import claim, measured_on
    claim(ratio > 3.5, f"activations fell {ratio:.2f}x with 4 micro-batches")
    # prints: ✓ activations fell 3.99x with 4 micro-batches

Every claim is still executed under nbval, so a claim that stops being true fails the notebook; the reader sees the
sentence, not a block of ``assert`` lines. A rehearsal (``python3 kit.py rehearse``) counts each claim as it counts an
``assert``, records a failed one and goes on (``RECORDER``).
"""

from __future__ import annotations

from typing import Any

# Set by a rehearsal (gpukit.lessons.rehearsal): ``check(held, message, where)`` records the claim instead of raising.
RECORDER: Any = None

HELD, FAILED = "✓", "✗"


class ClaimFailed(AssertionError):
    """A lesson's claim did not hold on this run."""


def claim(held: Any, sentence: str) -> None:
    """Check a lesson's claim: print ``✓ sentence`` when ``held`` is true, raise ``ClaimFailed`` when it is not.

    Args:
        held: the claim's test (any value, read as a truth value once).
        sentence: what holds, in the reader's words, with its figures and their units.

    Raises:
        ClaimFailed: when the claim does not hold (outside a rehearsal, which records it and goes on).
        TypeError: when ``sentence`` is not a string.
    """
    if not isinstance(sentence, str):
        raise TypeError(f"claim(held, sentence): the sentence is a str, not {type(sentence).__name__}")
    ok = bool(held)
    if RECORDER is not None:
        RECORDER.check(ok, lambda: sentence, f"claim: {sentence[:160]}")
        print(f"{HELD if ok else FAILED} {sentence}")
        return
    if not ok:
        raise ClaimFailed(f"this lesson's claim did not hold on this run: {sentence}")
    print(f"{HELD} {sentence}")


def measured_on(cuda: Any) -> str:
    """Where the figures a lesson reads from ``cuda`` come from, in words: "measured on this GPU (Tesla T4)", or
    "simulated for an NVIDIA T4 on this CPU (gpukit)".

    Raises:
        TypeError: for anything but ``torch.cuda`` or a ``gpukit.SimulatedCuda``.
    """
    import torch

    from ..simulated import SimulatedCuda

    if cuda is torch.cuda:
        if not torch.cuda.is_available():
            return "nowhere: this machine has no GPU (use gpukit.SimulatedCuda)"
        return f"measured on this GPU ({torch.cuda.get_device_name()})"  # "Tesla T4", "NVIDIA H100 80GB HBM3"
    if isinstance(cuda, SimulatedCuda):
        return f"simulated for an {cuda.card.name} on this CPU (gpukit's model of the CUDA caching allocator)"
    raise TypeError(f"measured_on({cuda!r}): pass torch.cuda or a gpukit.SimulatedCuda")


__all__ = ["claim", "ClaimFailed", "measured_on", "RECORDER"]
