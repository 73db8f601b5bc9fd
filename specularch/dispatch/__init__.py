"""The dispatcher: for each intercepted call, find a graph whose guards pass, or capture a
new one, or run the original Python — and record why.

* ``cache.py``: the hot path (entries tried in turn, eager entries, the run wrapper);
* ``misses.py``: profiling, relaxing, capturing and compiling, recompiles, ``cache_limit``;
* ``fallback.py``: runs of the original, fallback records, eager entries, strict mode;
* ``exact.py``: what ``optimize(..., exact=True)`` changes for its state;
* ``state.py``: per-object caches (``CodeState``) and the registries that find them;
* ``hooks.py``: the hook points ``specularch.distributed`` fills in (never imported here).

The frame hook calls ``dispatch`` once ``api.py`` wires it in (``frames.set_dispatcher``); the
dispatcher turns the hook on around eager runs through ``eager_run.FRAME_HOOK``, never by
importing frames/ (which sits above it).
"""
from .cache import (dispatch, per_call_site, per_instance, run, run_unwrapped, run_wrapper,
                    set_run_wrapper, start)
from .fallback import VALUE_DEPENDENT_RETRIES, note_generator
from .state import (CodeState, EagerEntry, GraphEntry, Stats, all_states, new_state, reset,
                    state_for, states)

__all__ = ["CodeState", "EagerEntry", "GraphEntry", "Stats", "VALUE_DEPENDENT_RETRIES",
           "all_states", "dispatch", "new_state", "note_generator", "per_call_site",
           "per_instance", "reset", "run", "run_unwrapped", "run_wrapper", "set_run_wrapper",
           "start", "state_for", "states"]
