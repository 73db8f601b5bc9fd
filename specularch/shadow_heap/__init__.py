"""Deferred writes: nothing that outlives a call changes before the call is known to succeed."""
from .heap import DELETED, ShadowHeap, Write

__all__ = ["DELETED", "ShadowHeap", "Write"]
