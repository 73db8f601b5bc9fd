"""specularch: imperative PyTorch run as speculative, guarded graphs.

    import specularch
    model = specularch.optimize(model)     # or a function / @specularch.optimize
    out = model(x)                          # same results as eager
    print(specularch.explain(model))        # graphs, guards, fallbacks and why

See docs/architecture.md for the design and README.md for the list of fallback kinds.
"""
from . import records
from .api import explain, optimize, reset
# Imported for its effect: it installs the dispatcher's hooks for distributed training steps.
from . import distributed  # noqa: F401
from . import templates  # noqa: F401  (registers recursion templates with capture)
from . import tiering  # noqa: F401  (specularch.tiering.wait: background compiles)
from .config import ConfigError, config
from .explain import Explanation
from .fx_lower import list_backends, register_backend
from .records import FALLBACK_KINDS, FallbackRecord, SpecularchStrictError
from .symbolic.ops.registry import fallback_opcodes, unhandled_opcodes
from .config import INDUCTOR_DIR_CHOSEN as _INDUCTOR_DIR_CHOSEN, cache_directory as _cache_directory
from .fx_lower import compile_cache as _compile_cache

_compile_cache.configure(_cache_directory, _INDUCTOR_DIR_CHOSEN)

__version__ = "0.1.0"

__all__ = ["optimize", "explain", "reset", "config", "ConfigError", "Explanation",
           "list_backends", "register_backend", "FALLBACK_KINDS", "FallbackRecord",
           "SpecularchStrictError", "unhandled_opcodes", "fallback_opcodes", "records"]
