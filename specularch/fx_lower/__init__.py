"""Lowering captured FX graphs: graph passes, the backend registry, and the default backend
per device (``default_backend``)."""
from .backends import (BACKENDS, Backend, UnknownBackendError, get_backend, list_backends,
                       register_backend)
from .defaults import default_backend

__all__ = ["BACKENDS", "Backend", "UnknownBackendError", "default_backend", "get_backend",
           "list_backends", "register_backend"]
