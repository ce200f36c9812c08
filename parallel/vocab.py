"""The vocabulary padding rule shared by the model builder and the weight converters.

The embedding and output layer hold ``padded_vocab_size(V, tp)`` rows: V rounded up to a multiple
of tp, so each TP rank holds an equal slice. Rows >= V are zero on load and dropped on export.
A leaf module (imports nothing from the project) so that ``parallel.model`` and
``parallel.convert`` can both use it without importing each other.
"""

from __future__ import annotations


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """`vocab_size` rounded up to a multiple of `tp`."""
    return -(-vocab_size // tp) * tp
