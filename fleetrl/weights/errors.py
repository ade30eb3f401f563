"""The one error type of the weight stream, raised by both ends."""

from __future__ import annotations


class WeightTransferError(RuntimeError):
    """A weight transfer that cannot be trusted or did not finish.

    Raised for an incomplete transfer, an unknown version, a checksum mismatch, a timeout, a refused
    auth token, a malformed manifest and a publisher whose serving loop failed. ``reason`` is a
    short machine-readable tag for callers that react differently (``"unknown_version"``,
    ``"checksum"``, ``"timeout"``, ``"auth"``, ``"incomplete"``, ``"protocol"``, ``"connect"``,
    ``"unknown_session"``, ``"busy"``, ``"publisher"``); the message is for people and names what
    is wrong.
    """

    def __init__(self, message: str, *, reason: str = "transfer") -> None:
        super().__init__(message)
        self.reason = reason
