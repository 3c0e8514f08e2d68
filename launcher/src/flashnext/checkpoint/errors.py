"""The one error the checkpoint tools raise."""

from __future__ import annotations


class CheckpointError(Exception):
    """The checkpoint cannot be checked or fixed as asked; the message says why and how."""
