"""The persistent compile cache: compiled graphs saved on disk, so that a second run of the
same program starts with the first run's compiled code instead of compiling again.

* TorchScript: a flattened graph's frozen scripted module is saved with ``torch.jit.save``
  under a key hashing everything the compiled code depends on (``entry_key``), with its
  graph's IR text, and loaded on a later run as a function made from that text (or with
  ``torch.jit.load`` where the text would not give the same graph back). Graphs compiled
  through AOT autograd (a forward and a backward function, glued by an autograd.Function)
  are not cached: that glue is Python, not a serializable artefact.
* Inductor keeps its own on-disk caches (FX graph cache, AOT autograd cache); they are
  pointed into ``<cache dir>/inductor`` by ``_torch_compilers``. A flattened graph compiled
  by a tiering worker process is also kept whole, as its AOTInductor package (or, where
  that failed, its ``standalone_compile`` artefact; ``save_artifact``, under
  ``<cache dir>/inductor-artifacts``): a later run loads it in milliseconds, with no worker
  and no tracing (and, for a package, without importing Inductor).

The tiering's decisions live beside them (``tiering/remembered.py``, ``tier-decisions/``):
a candidate rejected in one run is skipped in the next ones.

``config.compile_cache_dir`` chooses the directory (``off``: no cache). An entry that cannot
be read (corrupt, truncated, written by another torch) is ignored with one log line and
compiled again; the fresh artefact replaces it. Writes go to a temporary file renamed into
place, so a reader never sees half an entry.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import io
import json
import logging
import os
import tempfile
import warnings
import zipfile
from typing import Any, Callable

import torch
import torch.fx

from . import _torch_script_ir
from .dynamic_sizes import dynamic_inputs

# Set by specularch/__init__.py (``configure``): config sits above fx_lower (it imports the
# backend registry to check a backend name), so fx_lower does not import it.
_SETTINGS = {"directory": lambda: None, "inductor_dir_chosen": False}
_LOG = logging.getLogger("specularch")


def configure(directory: Callable[[], str | None], inductor_dir_chosen: bool) -> None:
    """``directory()``: the cache directory now (None: off); ``inductor_dir_chosen``: the
    program set ``TORCHINDUCTOR_CACHE_DIR`` itself (Inductor's caches stay there)."""
    _SETTINGS.update(directory=directory, inductor_dir_chosen=inductor_dir_chosen)


def inductor_dir_chosen() -> bool:
    return _SETTINGS["inductor_dir_chosen"]

FORMAT = 2  # bumped when what an entry holds changes (2: AOTInductor packages)


def directory(kind: str) -> str | None:
    """``<cache dir>/<kind>``, created; None when the cache is off or cannot be created."""
    root = _SETTINGS["directory"]()
    if root is None:
        return None
    path = os.path.join(root, kind)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        _LOG.warning(f"compile cache disabled: cannot create {path} ({e})")
        return None
    return path


def _placeholder_facts(value: Any, dynamic: list[int] = ()) -> list:
    """What the compiled code may have specialised on, of one graph input (``dynamic``: its
    dimensions compiled for every size)."""
    if isinstance(value, torch.Tensor):
        shape = ["?" if d in dynamic else n for d, n in enumerate(value.shape)]
        return [type(value).__name__, str(value.dtype), shape,
                value.is_contiguous() if dynamic else list(value.stride()), str(value.device),
                value.requires_grad]
    return [type(value).__name__]


def _constants(gm: torch.fx.GraphModule) -> dict:
    """The values the graph reads with ``get_attr`` (capture-time constants), hashed: the
    code text names them only."""
    out = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = gm
        for part in node.target.split("."):
            value = getattr(value, part)
        if isinstance(value, torch.Tensor):
            data = value.detach().cpu().contiguous()
            digest = hashlib.sha256(data.reshape(-1).view(torch.uint8).numpy().tobytes()
                                    if data.numel() else b"").hexdigest()
            out[node.target] = _placeholder_facts(value) + [digest]
        else:
            out[node.target] = repr(value)
    return out


@functools.cache
def _specularch_version() -> str:
    """specularch's version, and a hash of the modules that make the saved artefacts and
    their metadata (a checkout whose flattening or split changed must not load what an older
    one saved: a split forward's glue metadata from before saved outputs were recorded would
    save a copy of an output the program may change in place)."""
    try:
        version = importlib.metadata.version("specularch")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    here = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256(version.encode())
    for name in ("_torch_compilers.py", "_torch_aoti.py", "passes.py", "compile_cache.py",
                 "_torch_joint.py", "split.py"):
        with open(os.path.join(here, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def entry_key(gm: torch.fx.GraphModule, example_inputs: list, backend: str, path: str) -> str:
    """The key of ``gm`` compiled by ``backend`` along ``path`` (e.g. ``flattened``): its code
    text, every input's metadata (not the sizes of dynamic dimensions, and of those inputs'
    strides only whether they are contiguous: compiled for every size), and the versions of
    torch and specularch."""
    dynamic = dynamic_inputs(gm)
    facts = {"format": FORMAT, "code": gm.code, "backend": backend, "path": path,
             "constants": _constants(gm),
             "inputs": [_placeholder_facts(v, dynamic.get(i, ())) for i, v in enumerate(example_inputs)],
             "torch": torch.__version__, "specularch": _specularch_version()}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def load_script(key: str, quiet: bool = True) -> tuple[Callable, dict] | None:
    """The scripted graph saved under ``key`` (``read_script``) and its metadata, or None
    (none saved, or an entry that cannot be read: logged, and left for ``save_script`` to
    replace). ``quiet``: see ``read_script``."""
    folder = directory("torchscript")
    if folder is None:
        return None
    path = os.path.join(folder, f"{key}.pt")
    if not os.path.exists(path):
        return None
    try:
        return read_script(path, quiet)
    except Exception as e:
        ignore(path, e)
        return None


def has_script(key: str) -> bool:
    """A scripted module is saved under ``key`` (not read: ``load_script`` checks it)."""
    folder = directory("torchscript")
    return folder is not None and os.path.exists(os.path.join(folder, f"{key}.pt"))


@contextlib.contextmanager
def quiet_warnings(quiet: bool = True):
    """TorchScript's deprecation (and annotation) warnings silenced while ``quiet``, by
    swapping the process-wide warning filters: only on the program's own thread. On a thread
    beside the program (``quiet=False``) the swap would drop a warning the program's thread
    raised meanwhile, or a filter it set."""
    if not quiet:
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


_META, _IR = "specularch.json", "specularch.ir"  # files of ours inside the archive


def read_script(path: str, quiet: bool = True) -> tuple[Callable, dict]:
    """What ``write_script`` saved (in this process or another), callable as the module, and
    its metadata: the function made from the graph's IR text where the archive holds one
    (``_torch_script_ir``: a fraction of ``torch.jit.load``'s time holding the GIL), else
    the module ``torch.jit.load`` reads. ``quiet``: ``quiet_warnings``."""
    with zipfile.ZipFile(path) as archive:
        ours = {name.rsplit("/", 1)[-1]: name for name in archive.namelist()
                if name.endswith((f"/extra/{_META}", f"/extra/{_IR}"))}
        meta = json.loads(archive.read(ours[_META]))
        if _IR in ours:
            return _torch_script_ir.function_from_text(archive.read(ours[_IR]).decode()), meta
    with quiet_warnings(quiet):
        return torch.jit.load(path), meta


def write_script(path: str, module: torch.jit.ScriptModule, meta: dict, quiet: bool = True) -> None:
    """``module`` and ``meta`` saved to ``path`` atomically (a reader never sees half), with
    its graph's IR text where that gives the same graph back. ``quiet``: ``quiet_warnings``
    (``torch.jit.save``'s deprecation: it still works)."""
    extra = {_META: json.dumps(meta)}
    text = _torch_script_ir.function_text(module)
    if text is not None:
        extra[_IR] = text
    buffer = io.BytesIO()
    with quiet_warnings(quiet):
        torch.jit.save(module, buffer, _extra_files=extra)
    write_atomically(path, buffer.getvalue())


def save_script(key: str, module: torch.jit.ScriptModule, meta: dict, quiet: bool = True) -> None:
    """Save ``module`` under ``key`` (atomically); a failure only costs the next run a compile."""
    folder = directory("torchscript")
    if folder is None:
        return
    try:
        write_script(os.path.join(folder, f"{key}.pt"), module, meta, quiet)
    except Exception as e:
        _LOG.warning(f"compile cache: could not save a TorchScript entry ({type(e).__name__}: {e})")


# An Inductor entry's file, by ``meta["format"]``: an AOTInductor package, a
# ``standalone_compile`` artefact in its binary format.
_SUFFIX = {"aoti": ".pt2", "standalone": ".bin"}


def _artifact_path(folder: str, key: str, meta: dict) -> str:
    return os.path.join(folder, key + _SUFFIX.get(meta.get("format"), ".bin"))


def save_artifact(key: str, path: str, meta: dict) -> None:
    """Keep the Inductor artefact saved at ``path`` (its kind in ``meta["format"]``) and
    ``meta`` under ``key``, so that the next run loads it without compiling."""
    folder = directory("inductor-artifacts")
    if folder is None:
        return
    try:
        with open(path, "rb") as f:
            data = f.read()
        write_atomically(_artifact_path(folder, key, meta), data)
        # The metadata last (an entry is complete once its .json exists), with the file's
        # checksum: the package loader does not check its zip's CRCs, and loads a damaged
        # library as it is (a flipped byte: loaded, no error).
        meta = {**meta, "sha256": hashlib.sha256(data).hexdigest()}
        write_atomically(os.path.join(folder, f"{key}.json"), json.dumps(meta).encode())
    except Exception as e:
        _LOG.warning(f"compile cache: could not save an Inductor entry ({type(e).__name__}: {e})")


def artifact(key: str) -> tuple[str, dict] | None:
    """The path and metadata of the Inductor artefact saved under ``key``, or None (none
    saved; or unreadable, damaged: logged, and left for ``save_artifact`` to replace)."""
    folder = directory("inductor-artifacts")
    if folder is None:
        return None
    try:
        with open(os.path.join(folder, f"{key}.json")) as f:
            meta = json.load(f)
        if not isinstance(meta, dict):
            raise ValueError(f"metadata is a {type(meta).__name__}")
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        ignore(os.path.join(folder, f"{key}.json"), e)
        return None
    path = _artifact_path(folder, key, meta)
    try:
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return None
    except OSError as e:
        ignore(path, e)
        return None
    if digest != meta.get("sha256"):
        ignore(path, ValueError("its contents do not match the checksum saved with it"))
        return None
    return path, meta


def ignore(path: str, error: Exception) -> None:
    """One log line for an unreadable entry (it is compiled again and replaced)."""
    _LOG.warning(f"compile cache: ignoring unreadable entry {path} ({error_line(error)}); "
                 f"compiling again")


def error_line(error: BaseException) -> str:
    """``Type: first line of the message``: a compiler's error in one line of a report."""
    message = str(error)
    return f"{type(error).__name__}: {message.splitlines()[0] if message else ''}"


def write_atomically(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def mark_cached(fn: Callable) -> Callable:
    """Tag a compiled graph loaded from the cache (``explain()`` shows ``(cached)``)."""
    return with_attributes(fn, from_compile_cache=True)


def with_attributes(fn: Callable, **values) -> Callable:
    """``fn`` with these attributes set, or a wrapper of it carrying them (an object that
    takes no attributes)."""
    try:
        for name, value in values.items():
            setattr(fn, name, value)
        return fn
    except (AttributeError, TypeError):
        def wrapped(*args):
            return fn(*args)
        for name, value in values.items():
            setattr(wrapped, name, value)
        return wrapped


def from_cache(fn: Callable | None) -> bool:
    return bool(getattr(fn, "from_compile_cache", False))
