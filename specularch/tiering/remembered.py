"""What earlier runs decided: a candidate rejected in a graph's trial is remembered in the
compile cache, so that the next runs of the same program do not compile (or load) and time
it again, only to reject it again (issue 14: "a slower one is dropped and remembered").

One small JSON file per graph, ``<cache dir>/tier-decisions/<key>.json``, keyed like a
compiled entry (``compile_cache.entry_key``: the graph's code, its inputs' metadata, the
versions of torch and specularch) and, since a trial's verdict is a timing, the machine and
the program's torch thread count. A rejection is skipped for ``policy.REMEMBER_RUNS`` later
runs, then the candidate is tried again (a trial decided on one run's noise, or the
machine's load that day, is not kept for good); a kept candidate clears its rejection. A file
that cannot be read is ignored with one log line and replaced. Read and written on the
background thread only; with the compile cache off (``SPECULARCH_CACHE_DIR=off``) nothing is
remembered.
"""
from __future__ import annotations

import json
import logging
import os
import platform

import torch

from ..fx_lower import compile_cache
from ..fx_lower.passes import example_inputs

FOLDER = "tier-decisions"
FORMAT = 1
_LOG = logging.getLogger("specularch")


def graph_key(gm: torch.fx.GraphModule, threads: int) -> str | None:
    """The key of ``gm``'s decisions on this machine with ``threads`` torch threads (the
    program's, read on its thread: torch's count is per thread); None with the cache off."""
    if compile_cache.directory(FOLDER) is None:
        return None
    device = torch.cuda.get_device_name() if torch.cuda.is_initialized() else "no GPU in use"
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {threads} threads, {device}"
    return compile_cache.entry_key(gm, example_inputs(gm), "tier-decisions", machine)


def _path(key: str | None) -> str | None:
    folder = None if key is None else compile_cache.directory(FOLDER)
    return None if folder is None else os.path.join(folder, f"{key}.json")


def _valid(entry) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("against"), str) \
        and all(isinstance(entry.get(k), (int, float)) for k in ("candidate_us", "current_us")) \
        and type(entry.get("runs_left")) is int and entry["runs_left"] > 0


def rejections(key: str | None, quiet: bool = False) -> dict[str, dict]:
    """``{candidate: what its trial measured (candidate_us, current_us, against), and
    runs_left}`` remembered for ``key`` (an unreadable file: none, logged unless ``quiet``)."""
    path = _path(key)
    if path is None:
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("format") != FORMAT \
                or not isinstance(data.get("rejected"), dict) \
                or not all(map(_valid, data["rejected"].values())):
            raise ValueError("not a tier-decisions file of this version")
        return data["rejected"]
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        if not quiet:
            _LOG.warning(f"tiering: ignoring unreadable decisions {path} "
                         f"({compile_cache.error_line(e)}); every candidate is tried")
        return {}


def _write(key: str | None, rejected: dict[str, dict]) -> None:
    path = _path(key)
    if path is None:
        return
    try:
        compile_cache.write_atomically(
            path, json.dumps({"format": FORMAT, "rejected": rejected}, sort_keys=True).encode())
    except OSError as e:
        _LOG.warning(f"tiering: could not save decisions to {path} ({e})")


def remember(key: str | None, candidate: str, rejected: dict | None) -> None:
    """Record ``candidate``'s rejection (what it measured, and ``runs_left``), or clear it
    (``rejected`` None: kept, or its remembered runs are used up)."""
    entries = rejections(key, quiet=True)  # (read, and said so, before this run's trials)
    if rejected is None and candidate not in entries:
        return
    if rejected is None:
        entries.pop(candidate)
    else:
        entries[candidate] = rejected
    _write(key, entries)
