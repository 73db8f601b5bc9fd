"""Code objects generated from a target's signature: trampoline, shadow, binder, unbinder.

Everything is built from generated source and compiled, never by bytecode splicing, so it
works unchanged across CPython minor versions; the layout rules it must satisfy (checked by
``_torch_hook.layout_mismatch``) are those of torch's hook on CPython 3.11.

Slots: the argument values of one call, as a tuple in ``co_varnames[:n]`` order, which is
the order CPython stores them in the frame: positional arguments, then keyword-only
arguments, then the ``*args`` tuple, then the ``**kwargs`` dict (note: ``*args`` comes
after the keyword-only arguments).
"""
from __future__ import annotations

import builtins
import functools
import keyword
from dataclasses import dataclass
from types import CodeType, FunctionType
from typing import Any, Callable, Optional

from . import _torch_hook as _th

#: Builtins name through which every trampoline calls the interceptor.
GLUE_NAME = "__specularch_dispatch__"
#: Builtins names of the type whose instances a trampoline runs in its own frame
#: (``interceptor.set_run_here``) and of ``type`` itself (a parameter may be named ``type``).
RUN_HERE_NAME = "__specularch_run_here__"
TYPE_NAME = "__specularch_type__"
_RESULT = "__specularch_r__"
_FACTORY = "__specularch_make__"
_INNER = "__specularch_inner__"


class NotInterceptable(TypeError):
    """This callable cannot be intercepted by specularch's frame hook.

    Example: ``frames.register(len)`` raises it, because builtins have no Python frame.
    Fix: register the plain Python function (``type(obj).method`` or ``module.forward``).
    """


@dataclass(frozen=True)
class Layout:
    """Argument layout of a code object, as the generated sources need it."""

    argnames: tuple[str, ...]   # co_varnames[:n], i.e. the slot names
    posonly: int                # how many leading positional args are positional-only
    npos: int                   # co_argcount
    kwonly: tuple[str, ...]
    varargs: Optional[str]
    varkw: Optional[str]

    @classmethod
    def of(cls, code: CodeType) -> "Layout":
        """Read the layout of ``code``; raise ``NotInterceptable`` for unusual names."""
        n = _th.total_argcount(code)
        names = code.co_varnames[:n]
        for name in names + code.co_cellvars + code.co_freevars:
            # comprehension codes use ".0"; generated source needs real identifiers
            if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("__specularch"):
                raise NotInterceptable(f"{code.co_qualname}: variable name {name!r} cannot be "
                                       "reproduced in generated source")
        npos, nkw = code.co_argcount, code.co_kwonlyargcount
        varargs = names[npos + nkw] if code.co_flags & _th.CO_VARARGS else None
        varkw = names[-1] if code.co_flags & _th.CO_VARKEYWORDS else None
        return cls(names, code.co_posonlyargcount, npos, names[npos:npos + nkw], varargs, varkw)

    def parameters(self) -> str:
        """The parameter list as source, without defaults: ``a, /, b, *args, k, **kw``."""
        pos = list(self.argnames[:self.npos])
        parts = pos[:self.posonly] + (["/"] if self.posonly else []) + pos[self.posonly:]
        if self.varargs:
            parts.append("*" + self.varargs)
        elif self.kwonly:
            parts.append("*")
        parts += self.kwonly
        if self.varkw:
            parts.append("**" + self.varkw)
        return ", ".join(parts)

    def call_arguments(self) -> str:
        """The arguments of a call rebuilding these slots: ``a, b, *args, k=k, **kw``."""
        parts = list(self.argnames[:self.npos])
        if self.varargs:
            parts.append("*" + self.varargs)
        parts += [f"{name}={name}" for name in self.kwonly]
        if self.varkw:
            parts.append("**" + self.varkw)
        return ", ".join(parts)

    def slot_tuple(self) -> str:
        """Source of the slot tuple expression, e.g. ``(a, k, args, kw,)``."""
        return "(" + "".join(name + ", " for name in self.argnames) + ")"


def _compile_function(src: str, filename: str, name: str) -> FunctionType:
    namespace: dict[str, Any] = {}
    exec(compile(src, filename, "exec"), namespace)
    return namespace[name]


def build_trampoline(code: CodeType, key: int, glue: str = GLUE_NAME) -> CodeType:
    """A code object with ``code``'s exact frame layout whose body returns
    ``<glue>(key, <slot tuple>, <closure cells or None>)``, or, when that is a run-here
    token, runs the original in this frame (``_run_here_lines``).

    Torch runs it in a copy of the original function (same globals, defaults and closure),
    so the free variables it reads are the user's real cells: ``nonlocal`` writes made by
    the dispatcher through them reach the user. Raises ``NotInterceptable`` for
    generator/coroutine codes (the hook fires on every resume) and unusual names.
    """
    if code.co_flags & _th.CO_RESUMABLE:
        raise NotInterceptable(f"{code.co_qualname} is a generator/coroutine; not intercepted")
    if type(key) is not int or not glue.isidentifier():
        raise TypeError("build_trampoline needs an int key and an identifier glue name")
    layout = Layout.of(code)
    frees, cells = code.co_freevars, code.co_cellvars
    closure = f"(lambda: ({', '.join(frees)},)).__closure__" if frees else "None"
    body = []
    if cells:
        # Dead code whose only effect is to make the same names cell variables, so that
        # the cell slots line up with the original frame's (torch copies them by index).
        local_cells = [c for c in cells if c not in layout.argnames]
        body.append("if False:")
        if local_cells:
            body.append(f"    {' = '.join(local_cells)} = None")
        body.append(f"    (lambda: ({', '.join(cells)},))")
    body.append(f"{_RESULT} = {glue}({key}, {layout.slot_tuple()}, {closure})")
    body += _run_here_lines(layout)
    src = (f"def {_FACTORY}():\n"
           + "".join(f"    {free} = None\n" for free in frees)   # makes them free below
           + f"    def {_INNER}({layout.parameters()}):\n"
           + "".join(f"        {line}\n" for line in body)
           + f"    return {_INNER}.__code__\n")
    filename = f"<specularch trampoline for {code.co_qualname}>"
    trampoline = _compile_function(src, filename, _FACTORY)()
    trampoline = trampoline.replace(co_name=code.co_name, co_qualname=code.co_qualname)
    problem = _th.layout_mismatch(trampoline, code)
    if problem is not None:  # a CPython change in how it orders cells would land here
        raise NotInterceptable(f"trampoline layout for {code.co_qualname} differs: {problem}")
    return trampoline


def _run_here_lines(layout: Layout) -> list[str]:
    """The trampoline's tail: a result that is not a run-here token is the call's result;
    for a token ``r`` (an eager run, see ``interceptor.set_run_here``) run the original
    bytecode here, one frame below the trampoline, with the token's bookkeeping:

        with r:                 # e.g. the hook on
            r.extra[0] += 1     # pay for this frame: the recursion limit is raised by one
            try:
                r.sync()
                return r.done(r.original(<the arguments>))
            finally:
                r.extra[0] -= 1

    So a recursive target that runs eagerly nests two frames per level (trampoline,
    original), not eight (trampoline, glue, dispatcher..., unbinder, original). The count
    is changed in this frame without a call: a call can itself hit the recursion limit,
    and a count missed while unwinding would keep the limit raised for good."""
    r = _RESULT
    return [f"if {TYPE_NAME}({r}) is not {RUN_HERE_NAME}:",
            f"    return {r}",
            f"with {r}:",
            f"    {r}.extra[0] += 1",
            "    try:",
            f"        {r}.sync()",
            f"        return {r}.done({r}.original({layout.call_arguments()}))",
            "    finally:",
            f"        {r}.extra[0] -= 1"]


def build_shadow(code: CodeType) -> CodeType:
    """A copy of ``code`` with a distinct identity, hence no torch cache state: running it
    runs the original bytecode without being intercepted again (its callees still are).

    Note: code objects compare and hash by value, so ``shadow == code``; use ``is``.
    """
    shadow = code.replace(co_name=code.co_name)
    if shadow is code:  # replace() always copies today; the invariant is what matters
        raise RuntimeError("code.replace() returned the same object; cannot build a shadow")
    return shadow


def build_binder_code(code: CodeType) -> CodeType:
    """Code of a function with ``code``'s signature (no defaults) returning its slot tuple.

    Attach defaults per function with ``make_binder``. Named like the user's code so that
    CPython's binding errors read ``f() missing 1 required positional argument: 'x'``.
    """
    layout = Layout.of(code)
    src = f"def {_INNER}({layout.parameters()}):\n    return {layout.slot_tuple()}\n"
    filename = f"<specularch binder for {code.co_qualname}>"
    binder = _compile_function(src, filename, _INNER).__code__
    return binder.replace(co_name=code.co_name, co_qualname=code.co_qualname)


def make_binder(binder_code: CodeType, fn: FunctionType) -> FunctionType:
    """``binder(*args, **kwargs) -> slots`` with ``fn``'s defaults, name and qualname.

    Binding happens in CPython's own argument parser, so bad calls raise exactly the
    ``TypeError`` that calling ``fn`` would.
    """
    # Real builtins: tools that inspect frames (torch.compile tracing through an optimized
    # function, debuggers) look up ``__builtins__`` in a function's globals.
    binder = FunctionType(binder_code, {"__builtins__": builtins}, fn.__name__, fn.__defaults__,
                          None)
    binder.__kwdefaults__ = fn.__kwdefaults__
    binder.__qualname__ = fn.__qualname__
    return binder


@functools.lru_cache(maxsize=512)
def _unbinder(npos: int, varargs: bool, kwonly: tuple[str, ...], varkw: bool) -> Callable:
    if not all(name.isidentifier() and not keyword.iskeyword(name) for name in kwonly):
        raise NotInterceptable(f"keyword-only argument names {kwonly} are unusual")
    # Slot order is co_varnames order: positional, keyword-only, *args, **kwargs.
    args = [f"s[{i}]" for i in range(npos)]
    i = npos + len(kwonly)
    if varargs:
        args.append(f"*s[{i}]")
        i += 1
    args += [f"{name}=s[{npos + j}]" for j, name in enumerate(kwonly)]
    if varkw:
        args.append(f"**s[{i}]")
    src = f"def _call_with_slots(func, s):\n    return func({', '.join(args)})\n"
    return _compile_function(src, "<specularch unbinder>", "_call_with_slots")


def unbinder_for(code: CodeType) -> Callable[[Callable, tuple], Any]:
    """``unbind(func, slots)`` that calls ``func`` with slots laid out like ``code``'s."""
    npos, flags = code.co_argcount, code.co_flags
    kwonly = code.co_varnames[npos:npos + code.co_kwonlyargcount]
    return _unbinder(npos, bool(flags & _th.CO_VARARGS), kwonly, bool(flags & _th.CO_VARKEYWORDS))


def call_with_slots(func: FunctionType, slots: tuple) -> Any:
    """Call ``func`` with a slot tuple of its own layout and return the result.

    Positional slots are passed positionally, the ``*args`` slot is splatted, keyword-only
    slots are passed by name and the ``**kwargs`` slot is splatted, which makes CPython
    rebuild the same slots in ``func``'s frame (``f(a, *args, k, **kw)`` has slots
    ``(a, k, args, kw)``).
    """
    code = func.__code__
    if type(slots) is not tuple or len(slots) != _th.total_argcount(code):
        raise TypeError(f"{func.__qualname__}: expected a tuple of "
                        f"{_th.total_argcount(code)} slots, got {slots!r:.80}")
    return unbinder_for(code)(func, slots)
