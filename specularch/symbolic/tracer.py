"""The capture context: one FX graph, its guards and its inputs, built while frames run.

``Tracer`` owns what a whole capture shares across inlined frames: the ``torch.fx.Graph``,
the ``GuardSet``, the graph inputs (each with the source it is read from at run time), and
the rules that turn real Python objects into values (``wrap``) and real torch calls into
graph nodes (``call_op``). Frames (``frame.py``) only interpret bytecode.
"""
from __future__ import annotations

import builtins
import collections
import functools
import operator
import re
import types
from typing import Any, Callable

import torch
import torch.fx
import torch.nn as nn

from ..guards import (AliasGuard, AttrSource, DictKeysGuard, ExprGuard, GlobalStateGuard, GuardSet,
                      IdGuard, ItemSource, LenGuard, TypeGuard, ValueGuard)
from ..guards.sources import Source, plain_key
from ..records import Unsupported
from ..fx_lower.op_kinds import METADATA_WRITES
from ..shadow_heap import ShadowHeap
from ._torch_dispatch import OPERATOR_TYPES, ExternalMutation, MutationCheck, storage_key
from . import budget
from .speculation import item_args, view_writes
from .speculation import exit_tests
from .rolled import rows as rolled_rows
from . import inputs
from .assumptions import Assumptions
from .speculation.leaf_writes import connect_reads
from .library_files import is_library_file
from .speculation.merge_aliases import MergedAliases
from .op_args import concrete, fx_arg, holds_tensor, is_dynamic, mark_dynamic, specialize_all
from .static_sizes import StaticSizes
from .values.symint import SymV
from .values import (AppendOnlyListV, ConstV, DictV, KeyedDictV, ListV, MethodV, ObjV, SetV, TensorV,
                     TupleV, Value, contains_tensor, leaves)
from .values import symint
from .values.symint import arithmetic

CONST_TYPES = (int, float, bool, str, bytes, complex, type(None), type(Ellipsis),
               type(NotImplemented), torch.dtype, torch.device, torch.layout, torch.memory_format,
               torch.Size, range, slice)

# operator.iadd -> operator.add, ...: what an in-place operator does to a Python number.
_PLAIN_OF_INPLACE = {getattr(__import__("operator"), "i" + name.rstrip("_")):
                     getattr(__import__("operator"), name)
                     for name in ("add", "and_", "floordiv", "lshift", "matmul", "mod", "mul",
                                  "or_", "pow", "rshift", "sub", "truediv", "xor")}

# ops whose results' sizes are made from the values of their inputs (``_data_shaped``)
_DATA_SHAPED = frozenset({"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive",
                          "_unique", "_unique2", "bincount", "repeat_interleave"})


def _data_shaped(target, label: str, args: list, kwargs: dict) -> bool:
    """Whether an op's results have sizes made from tensor data (``x[mask]``, ``nonzero``,
    ``unique``, one-argument ``torch.where``): they are sizes to read when the graph runs,
    as a dynamic input's are, never the capture's values."""
    if label in _DATA_SHAPED:
        return label != "repeat_interleave" or any(isinstance(a, TensorV) for a in args[1:2]) \
            or isinstance(kwargs.get("repeats"), TensorV) or len(args) == 1
    if label == "where":
        return len(args) + len(kwargs) == 1
    if target is operator.getitem and len(args) == 2:
        return any(isinstance(leaf, TensorV) and leaf.example.dtype in (torch.bool, torch.uint8)
                   for leaf in leaves(args[1]))
    return False


# metadata whose answer depends on the sizes of a tensor with dynamic sizes (``_assume_layout``)
_LAYOUT_QUERIES = frozenset({"is_contiguous", "stride", "is_same_size", "storage_offset",
                             "is_non_overlapping_and_dense"})
# metadata of a tensor from outside the call that its tensor guard does not check
# (``_guard_metadata``)
_UNGUARDED_METADATA = frozenset({"storage_offset", "_is_view", "is_shared", "is_pinned", "is_leaf"})
# Tensor methods/functions that return Python values derived from metadata only (shape,
# dtype, ...) — safe to bake in because those are guarded. Anything else returning a Python
# scalar from a tensor reads its data.
METADATA_NAMES = {"_has_torch_function", "_has_torch_function_unary",
                  "_has_torch_function_variadic", "size", "dim", "ndimension", "numel", "nelement", "stride", "is_contiguous",
                  "is_floating_point", "is_complex", "element_size", "get_device",
                  "is_tensor", "is_storage", "storage_offset", "is_nonzero_shape", "__len__",
                  "is_grad_enabled", "is_autocast_enabled", "get_default_dtype", "is_inference",
                  "is_signed", "has_names", "is_sparse", "is_quantized", "is_meta", "is_leaf",
                  "requires_grad", "type", "is_inference_mode_enabled",
                  "has_torch_function", "has_torch_function_unary", "has_torch_function_variadic",
                  "_has_compatible_shallow_copy_type", "is_same_size", "is_pinned", "is_shared",
                  "dim_order", "is_conj", "is_neg", "_is_view", "_parse_to", "__hash__"}

# Calls that would change state outside the graph during capture and at run time.
FORBIDDEN_TENSOR_METHODS = {"backward", "register_hook", "retain_grad", "requires_grad_",
                            "share_memory_", "record_stream", "tolist", "item", "numpy",
                            "__bool__", "__int__", "__float__", "__index__", "data_ptr"}


class Tracer:
    """State shared by every frame of one capture."""

    def __init__(self, code: types.CodeType, globals_: dict, assumptions: Assumptions, *,
                 max_instructions: int, inline_depth: int):
        self.code = code
        self.globals = globals_
        self.builtins = globals_.get("__builtins__", builtins)
        if isinstance(self.builtins, types.ModuleType):
            self.builtins = self.builtins.__dict__
        self.graph = torch.fx.Graph()
        self.guards = GuardSet()
        self.input_sources: list[Source] = []
        self.constants: dict[str, torch.Tensor] = {}
        self.frames: list = []  # the running Frame stack (for user file:line)
        self.instructions_left = max_instructions
        self.budget = budget.for_capture(max_instructions)  # gives up on long loops
        self.inline_depth = inline_depth
        self.fresh: set[int] = set()
        self._by_source: dict[Source, Value] = {}
        self._by_tensor_id: dict[int, TensorV] = {}
        self._by_container_id: dict[int, Value] = {}
        self.heap = ShadowHeap(self.graph)
        # (predicate node, expected truth, where, site) checked after the graph runs
        self.assertions: list[tuple] = []
        self.assumptions = assumptions  # what not to specialise on (see assumptions.py)
        # the one assumption a capture revises: a branch one side of which only raises is
        # speculated again (raising_branch.py)
        self.unstable_sites: set = set(assumptions.unstable_sites)
        self.merging = 0  # > 0 while branch_merge runs both sides of a branch
        # (id(code), index) of the exit jumps of the rolled loops being captured, and the
        # assertion the test deciding one just made (rolled/exits.py)
        self.exit_jumps: set = set()
        self.exit_test: tuple | None = None
        self.merged_aliases = MergedAliases()  # what merged branches must not let be seen
        self._external: dict[int, TensorV] = {}  # storage key -> tensor that outlives the call
        self.viewed: set[int] = set()            # external storages two inputs share
        self.view_writes: list = []              # deferred writes, see view_writes.py
        self._sizes: dict = {}                   # (node, dim) -> SymV of a dynamic size
        self._static: StaticSizes | None = None  # fixed sizes of dynamic intermediates
        self.opt_state: dict = {}                # (id(optimizer), id(param)) -> new state entry
        self.distributed_leaves: list = []       # parameters a distributed step averages
        self.generators: dict = {}               # id -> (torch.Generator, state before capture)
        self._mutable: dict = {}                 # source -> (id, type) of lists, dicts, objects
        self._last_placeholder: torch.fx.Node | None = None  # inputs.placeholder
        self.inference_regions: list = []        # inference_mode blocks capture is in (grad_mode.py)
        self.handled_exception: Value | None = None  # sys.exc_info() in a handler (exceptions.py)
        self.clock_reads: list = []              # clock reads in program order (deferred.py)
        self.draws: list = []                    # random.random() draws, SymV each (python_random.py)
        self.loops: list = []                    # rolled / unrolled loops (rolled/loops.py)
        self.loop_notes: dict = {}               # site -> unrolled loop's report (unrolled.py)
        self.rolling = 0                         # > 0 while a rolled loop's body is captured
        self.walks: list = []                    # ObjectListV of rolled linked walks (walk.py)
        # recursion templates (specularch/templates): the path being captured, if any;
        # recursive functions left unrolled (code -> why); families called; object inputs
        self.template = None
        self.unrolled: dict = {}
        self.template_calls: list = []
        self.object_inputs: dict = {}
        self.guards.add(GlobalStateGuard.now())

    # ---- where are we -------------------------------------------------------------------
    def where(self) -> str:
        filename, lineno, _ = self.user_position()
        return f"{filename}:{lineno}"

    def user_position(self) -> tuple[str, int, str]:
        """The innermost frame that is user code (not torch's own Python)."""
        for frame in reversed(self.frames):
            if not is_library_file(frame.code.co_filename):
                return frame.code.co_filename, frame.lineno, frame.code.co_qualname
        if self.frames:
            f = self.frames[0]
            return f.code.co_filename, f.lineno, f.code.co_qualname
        return self.code.co_filename, self.code.co_firstlineno, self.code.co_qualname

    def add_guard(self, guard_cls, source: Source, *args, **kw) -> None:
        self.guards.add(guard_cls(source, *args, where=self.where(), **kw))

    # ---- turning real objects into values -----------------------------------------------
    def wrap(self, obj: Any, source: Source | None) -> Value:
        """The value for ``obj`` read from ``source``; installs the guards the read implies.

        With ``source=None`` the object is trusted (it came from a trusted module, or was
        computed from constants) and no guard is installed.
        """
        if source is not None:
            seen = self._by_source.get(source)
            if seen is not None:
                return seen
        value = self._wrap_new(obj, source)
        if source is not None:
            self._by_source[source] = value
        return value

    def _wrap_new(self, obj: Any, source: Source | None) -> Value:
        t = type(obj)
        if isinstance(obj, torch.Tensor):
            dims = self.assumptions.dynamic_sources.get(source, ()) if source is not None else ()
            return inputs.wrap_tensor(self, obj, source, frozenset(d for d in dims if d < obj.dim()))
        if t in CONST_TYPES:
            if source is not None and t in (int, float) and source in self.assumptions.symbolic_sources:
                return inputs.wrap_argument(self, obj, source, frozenset(), True)
            if source is not None:
                self.add_guard(ValueGuard, source, obj)
            return ConstV(obj, source)
        if t is tuple or (isinstance(obj, tuple) and hasattr(t, "_fields")):
            if source is not None:
                self.add_guard(LenGuard, source, t, len(obj))
            items = [self.wrap(x, _item(source, i)) for i, x in enumerate(obj)]
            if all(isinstance(i, ConstV) for i in items) and t is tuple:
                return ConstV(obj, source)
            return TupleV(items, t, source)
        # an OrderedDict read from outside (nn.Module's tables) is rebuilt as itself
        is_dict = t is dict or (t is collections.OrderedDict and source is not None)
        if source is not None and (t is list or is_dict or not isinstance(
                obj, (nn.Module, types.FunctionType, types.BuiltinFunctionType, type, types.ModuleType))):
            self._mutable.setdefault(source, (id(obj), t))
        if t is list or is_dict:
            seen = self._by_container_id.get(id(obj))
            if seen is not None:  # one object reached by two paths: one value, aliasing guarded
                if source is not None and seen.source is not None:
                    self.add_guard(AliasGuard, source, other=seen.source)
                return seen
        if t is list and source is not None and source in self.assumptions.append_only:
            self.add_guard(TypeGuard, source, list)
            value = AppendOnlyListV(source)
            self._by_container_id[id(obj)] = value
            return value
        if is_dict and source is not None and source in self.assumptions.keyed_dicts:
            self.add_guard(TypeGuard, source, t)
            value = KeyedDictV(source, real=obj)
            self._by_container_id[id(obj)] = value
            return value
        if t is list and source is not None and any(s == source for s, _, _ in self.assumptions.rolled_lists):
            where = next(w for s, _, w in self.assumptions.rolled_lists if s == source)
            value = inputs.wrap_tensor_list(self, obj, source, where)
            if value is not None:
                self._by_container_id[id(obj)] = value
                return value
        if t is list:
            if source is not None:
                self.add_guard(LenGuard, source, list, len(obj))
            value = ListV([], source)
            self._by_container_id[id(obj)] = value
            value.items.extend(self.wrap(x, _item(source, i)) for i, x in enumerate(obj))
            return value
        if is_dict:
            if not all(plain_key(k) for k in obj):
                raise Unsupported("unsupported_call", "a dict argument with keys other than str, int or tuples of constants")
            if source is not None:
                self.add_guard(DictKeysGuard, source, t, tuple(obj), relaxable=True)
            value = DictV({}, source, cls=t)
            self._by_container_id[id(obj)] = value
            value.items.update((k, self.wrap(v, _item(source, k))) for k, v in obj.items())
            return value
        if isinstance(obj, types.MethodType):
            self_src = _attr(source, "__self__")
            func_src = _attr(source, "__func__")
            return MethodV(self.wrap(obj.__self__, self_src), self.wrap(obj.__func__, func_src),
                           obj.__name__)
        if isinstance(obj, nn.Module):
            if source is not None:
                self.add_guard(IdGuard, source, obj)
            return ObjV(obj, source)
        if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, type, types.ModuleType,
                            functools.partial, types.MethodWrapperType, types.WrapperDescriptorType,
                            types.MethodDescriptorType, types.ClassMethodDescriptorType,
                            *OPERATOR_TYPES)):
            if source is not None:
                self.add_guard(IdGuard, source, obj)
            return ObjV(obj, source)
        if isinstance(obj, torch.Generator):
            return inputs.wrap_generator(self, obj, source)
        if source is not None:
            guard, expected = _object_guard(obj)
            self.add_guard(guard, source, expected)
        return ObjV(obj, source)

    def graph_inputs(self) -> list[TensorV]:
        """Tensors read from outside the frame (placeholders), in the order first read."""
        return [v for v in self._by_tensor_id.values() if v.source is not None]

    def wrap_walk(self, source, link: str, nodes: list, where: str) -> Value:
        """The nodes of a linked walk from ``source``, walked when the graph runs
        (``rolled/walk.py``; ``inputs.wrap_walk``)."""
        return inputs.wrap_walk(self, source, link, nodes, where)

    def sym_size(self, t: TensorV, dim: int) -> Value:
        """``t.shape[dim]``: a constant unless the tensor's shape may vary between calls."""
        size = t.example.shape[dim]
        if not t.dynamic or (t.source is not None and dim % t.example.dim() not in t.dyn_dims):
            return ConstV(size)
        if t.source is None and self.assumptions.fold_fixed_sizes:
            fixed = self._static_sizes().fixed(t.node, dim, size)
            self._guard_folding_sizes()
            if fixed:
                return ConstV(size)  # the same for every size of the inputs (static_sizes.py)
        key = (t.node, dim)
        cached = self._sizes.get(key)
        if cached is None:
            node = self.graph.call_method("size", (t.node, dim))
            expr = label = None
            if t.source is not None and not t.updated:
                expr, label = f"{t.source.expr()}.shape[{dim}]", f"{t.source}.shape[{dim}]"
            cached = self._sizes[key] = SymV(size, node, expr, self, label or "")
        return cached

    def always_equal(self, a: Value, b: Value) -> bool:
        """Whether two numbers, at least one a size computed in the graph, are equal for every
        size of the dynamic inputs (no check needed when Python compares them)."""
        if not self.assumptions.fold_fixed_sizes:
            return False
        args = [x.node if isinstance(x, SymV) else x.value for x in (a, b)]
        equal = self._static_sizes().always_equal(*args)
        self._guard_folding_sizes()
        return equal

    def guarded_below_two(self) -> bool:
        """Whether this graph is guarded to a dynamic size below 2 (``_guard_folding_sizes``)."""
        return self._static is not None and bool(self._static.below_two())

    def _guard_folding_sizes(self) -> None:
        """What ``static_sizes`` decides holds for dynamic sizes of at least 2: a graph that
        folded is guarded to them, and one whose inputs had a size of 0 or 1 where it would
        have decided (nothing folded) to sizes below 2, so that each size finds its graph."""
        for pairs, expected in ((self._static.needs_two(), True), (self._static.below_two(), False)):
            for node, dims in pairs:
                source = node.meta["value"].source
                for d in dims:
                    self.guards.add(ExprGuard(None, expr=f"({source.expr()}.shape[{d}] >= 2)",
                                              expected=expected, label=f"({source}.shape[{d}] >= 2)",
                                              where=self.where()))

    def _static_sizes(self) -> StaticSizes:
        if self._static is None:
            self._static = StaticSizes(self.constants)
        return self._static

    def specialize_shape(self, t: TensorV) -> None:
        """Guard (or assert in the graph) every dynamic size of ``t`` at its current value."""
        for d in range(t.example.dim()):
            self.specialize_size(t, d)

    def specialize_size(self, t: TensorV, dim: int) -> None:
        """Guard (or assert in the graph) ``t.shape[dim]`` at its current value, if dynamic."""
        size = self.sym_size(t, dim)
        if isinstance(size, SymV):
            size.concrete()

    def sym_shape(self, t: TensorV) -> Value:
        dims = [self.sym_size(t, d) for d in range(t.example.dim())]
        if all(isinstance(d, ConstV) for d in dims):
            return ConstV(t.example.shape)
        return TupleV(dims, torch.Size)

    # ---- turning real calls into graph nodes --------------------------------------------
    def call_op(self, kind: str, target: Any, args: list, kwargs: dict, *,
                fn: Callable | None = None, name: str = "", keep_node: bool = False,
                by_user: bool = True) -> Value:
        """Run ``target`` on the concrete values and record it as one FX node.

        ``kind`` is ``call_function`` or ``call_method``. Tensor results become graph values;
        Python results are kept only when they come from metadata (shape, dtype, ...)."""
        label = name or getattr(target, "__name__", str(target))
        # `for x_t in x.unbind(1)` (not the unbind a builtin iterating `x` makes: `zip(x, y)`)
        rows = rolled_rows.unbound(self, label, args, kwargs) if by_user else None
        if rows is not None:
            return rows
        args, kwargs = item_args.substitute(self, target, label, args, kwargs)  # `t - v.item()`
        if torch.is_grad_enabled():
            args, kwargs = connect_reads(self, args, kwargs)
        cargs = [concrete(a) for a in args]
        ckwargs = {k: concrete(v) for k, v in kwargs.items()}
        plain = _PLAIN_OF_INPLACE.get(target) if type(target) is types.BuiltinFunctionType else None
        if plain is not None and cargs and isinstance(cargs[0], (int, float, complex)):
            # `loss = 0.; loss += t`: a number has no in-place form, Python computes `loss + t`
            # (recorded as `iadd`, FX would print `0.0 += t`, which does not compile)
            target = fn = plain
        if fn is None:
            fn = (lambda *a, **k: getattr(a[0], target)(*a[1:], **k)) if kind == "call_method" else target
        has_tensor_input = any(contains_tensor(a) for a in args) or any(
            contains_tensor(v) for v in kwargs.values())
        # (an in-place metadata write, run during capture on a tensor of the caller's, would
        # change it there: the mutation check sees no data written)
        if label in METADATA_WRITES and args and isinstance(args[0], TensorV) \
                and args[0].source is not None:
            raise Unsupported("input_mutation", f"`{label}` changes in place what a tensor that "
                              f"existed before the call is (its requires_grad, sizes or strides)")
        check = MutationCheck(self.fresh)
        try:
            with check:
                result = fn(*cargs, **ckwargs)
        except ExternalMutation as e:
            return self._functionalize(kind, target, args, kwargs, fn, label, e, keep_node)
        except Unsupported:
            raise
        except Exception as e:
            error = Unsupported("exception_handling",
                                f"`{label}` raised {type(e).__name__} during capture: {e}")
            error.value_dependent = has_tensor_input  # the tensors' values may be why
            raise error from None
        if label in _UNGUARDED_METADATA and args and isinstance(args[0], TensorV):
            self._guard_metadata(label, args[0], result)
        dynamic = any(is_dynamic(a) for a in [*args, *kwargs.values()])
        if dynamic and target in _VALUE_FACTORIES and not any(
                isinstance(leaf, TensorV) and leaf.dynamic for a in args for leaf in leaves(a)):
            dynamic = False  # `torch.tensor([n])`: symbolic numbers are values, not sizes
        if not dynamic and holds_tensor(result) and _data_shaped(target, label, args, kwargs):
            dynamic = True  # `x[x > 0]`, `nonzero`: sizes made from data, read when it runs
        if not holds_tensor(result) and dynamic and label in ("size", "numel", "nelement", "__len__"):
            return self._symbolic_metadata(label, args)
        # a Python value a kernel computed (`torch.equal(a, b)`): no guard can keep it.
        # (Python functions run as one op are torch's type predicates, `is_tensor_like`.)
        from_data = has_tensor_input and result is not None and not holds_tensor(result) \
            and not isinstance(target, types.FunctionType) \
            and label not in METADATA_NAMES and not isinstance(result, _METADATA_TYPES) \
            and not (type(result) in (tuple, list) and _COUNT_FROM_SIZES.search(label))  # `()`
        if from_data and not check.wrote:
            raise Unsupported("data_dependent_value",
                              f"`{label}` turns tensor data into a Python {type(result).__name__}")
        if not holds_tensor(result) and dynamic and not check.wrote:
            if label in _LAYOUT_QUERIES and any(isinstance(leaf, TensorV) and leaf.dynamic
                                                for a in args for leaf in leaves(a)):
                self._assume_layout(kind, target, args, kwargs, result)
            if type(result) in (tuple, list) and _COUNT_FROM_SIZES.search(label):
                self._fix_split_sizes(label, args, kwargs)  # no parts: the size was 0
            for a in [*args, *kwargs.values()]:
                specialize_all(a)
            return self.wrap_python(result)
        if dynamic and type(result) in (tuple, list) and _COUNT_FROM_SIZES.search(label):
            # how many tensors split/chunk/unbind return depends on the split dimension's
            # size: fix it (other ops return as many as they always do: lstm_cell's (h, c))
            self._fix_split_sizes(label, args, kwargs)
        if dynamic and label in ("squeeze", "squeeze_"):
            self._squeezed_sizes(args, kwargs)
        node = self.graph.create_node(kind, target, tuple(fx_arg(a) for a in args),
                                      {k: fx_arg(v) for k, v in kwargs.items()})
        node.meta["where"] = self.where()
        node.meta["mutates"] = check.wrote
        node.meta["writes"] = frozenset(check.written)  # storages; none recorded: any argument
        # (what it wrote that existed before it: not a composite op's own temporaries)
        node.meta["writes_input"] = check.wrote and (not check.written or bool(check.written & {
            storage_key(leaf.example) for a in [*args, *kwargs.values()] for leaf in leaves(a)
            if isinstance(leaf, TensorV)}))
        if not holds_tensor(result):
            return self.wrap_python(result)
        out = self.wrap_output(node, result)
        if dynamic:
            mark_dynamic(out)
        return out

    def _guard_metadata(self, label: str, t: TensorV, result) -> None:
        """``x.storage_offset()``, ``x._is_view()``, ``x.is_shared()``, ``x.is_pinned()``,
        ``x.is_leaf``: facts of the tensor's memory or history that the tensor guard does not
        check. Of a tensor from outside the call (or a view of one: its memory's owner), the
        answer is guarded to stay the one capture saw."""
        outside = t if t.source is not None and not t.updated and t.real is not None else \
            self._external.get(storage_key(t.example))
        if outside is None or outside.source is None or (outside is not t and label in (
                "_is_view", "is_leaf")):
            return  # (a tensor the call made: the answer is the same every call)
        if outside is not t:  # a view of it: its offset is the outside tensor's plus the view's
            result = getattr(outside.real if outside.real is not None else outside.example, label)()
        expr = f"{outside.source.expr()}.{label}" + ("" if label == "is_leaf" else "()")
        self.guards.add(ExprGuard(None, expr=expr, expected=result, where=self.where(),
                                  label=f"{outside.source}.{label}"))

    def _fix_split_sizes(self, label: str, args: list, kwargs: dict) -> None:
        """Specialise the size a split's count of parts depends on: the split dimension's
        (``qkv.split(c, dim=2)`` keeps the batch and length dynamic); every size of each
        dynamic tensor argument where the dimension is not known."""
        t = args[0] if args else None
        dim = _split_dim(label, args, kwargs, t)
        for a in [*args, *kwargs.values()]:
            for leaf in leaves(a):
                if not isinstance(leaf, TensorV) or not leaf.dynamic:
                    continue
                if leaf is t and dim is not None and t.example.dim():
                    self.specialize_size(t, dim % t.example.dim())
                else:
                    self.specialize_shape(leaf)

    def _squeezed_sizes(self, args: list, kwargs: dict) -> None:
        """``squeeze`` drops a dimension only where its size is 1, so the result's rank (and
        every size read from it) holds while each squeezed dynamic size stays on the side of
        1 it was at capture: guarded, or checked in the graph."""
        t = args[0] if args else kwargs.get("input")
        if not isinstance(t, TensorV) or not t.dynamic or not t.example.dim():
            return
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        dims = None if dims is None else dims.concrete()
        rank = t.example.dim()
        squeezed = range(rank) if dims is None else (dims if isinstance(dims, (tuple, list)) else [dims])
        for d in squeezed:
            size = self.sym_size(t, d % rank)
            if isinstance(size, SymV):
                symint.compare(self, operator.eq, size, ConstV(1))

    def _symbolic_metadata(self, label: str, args: list) -> Value:
        t = args[0]
        if label == "size" and len(args) == 1:
            return self.sym_shape(t)
        if label in ("size",):
            d = args[1].concrete()
            return self.sym_size(t, d)
        if label == "__len__":
            return self.sym_size(t, 0)
        total: Value = ConstV(1)
        for d in range(t.example.dim()):
            total = arithmetic(self, __import__("operator").mul, total, self.sym_size(t, d))
        return total

    def _functionalize(self, kind, target, args, kwargs, fn, label, error: ExternalMutation,
                       keep_node: bool) -> Value:
        """An op writes into a tensor that outlives the call: run it on a fresh copy in the
        graph instead; the shadow heap makes the copy what later reads see and commits its
        final value (``ShadowHeap.update_tensor``). The refusals are the writes that cannot
        be deferred that way."""
        def refuse(why: str, unguarded: bool = False):
            error_ = Unsupported("input_mutation",
                                 f"`{label}` writes in place into a tensor that existed before "
                                 f"the call ({error.op_name}): {why}")
            error_.value_dependent = unguarded  # the guards do not tell this case apart
            raise error_
        external = self._external.get(error.key)
        if external is None:
            refuse("the tensor is not an input the graph can read")
        if error.key in self.viewed:
            refuse("another input of the call shares its memory")
        alias = view_writes.data_alias(external, args, kwargs)  # `p.data.add_(...)`
        if alias is None and not any(a is external for a in [*args, *kwargs.values()]):
            refuse("it writes through a view; write to the tensor itself")
        if alias is None and external.example.requires_grad and torch.is_grad_enabled():
            refuse("the tensor requires grad (do the update under torch.no_grad())")
        if external.source is None:
            refuse("the tensor cannot be addressed after the call")
        if (external.real if external.real is not None else external.example).is_inference() \
                and not torch.is_inference_mode_enabled():
            refuse("it is an inference tensor (made under torch.inference_mode()), which torch "
                   "does not update in place outside inference mode", unguarded=True)
        written = external if alias is None else alias
        copy = self.call_op("call_method", "clone", [written], {}, name="clone")
        into = copy if alias is None else view_writes.data_target(self, copy)
        swap = lambda v: into if v is written else v  # noqa: E731
        result = self.call_op(kind, target, [swap(a) for a in args],
                              {k: swap(v) for k, v in kwargs.items()}, fn=fn, name=label,
                              keep_node=True)
        if into.example.shape != written.example.shape:  # `torch.add(a, b, out=c)` resized c
            refuse("it resizes the tensor (an `out=` of another shape)")
        view_writes.note_write(self, error.key, copy.node, external, label, alias is not None)
        if external.example.requires_grad and external.stale_leaf is None:
            external.stale_leaf = (external.node, external.example)  # see leaf_writes.py
        self.heap.update_tensor(external, copy, self.where())  # later reads see the copy
        if alias is not None:
            view_writes.rebind_data(alias, into, external)
        if isinstance(result, TensorV) and result.example is into.example:
            return written  # `y = x.add_(1)`: y is x
        return result

    def _assume_layout(self, kind: str, target, args: list, kwargs: dict, result) -> None:
        """``t.is_contiguous()``, ``t.stride()``, ``a.is_same_size(b)`` of a tensor with dynamic
        sizes: the answer may differ at another size (a size of 0 or 1 makes a transposed
        tensor contiguous), so the graph computes it and the entry checks it is the one
        capture saw; where it is not, the function's sizes become static (as for a size
        that steers Python: ``dispatch/fallback.py``)."""
        node = self.graph.create_node(kind, target, tuple(fx_arg(a) for a in args),
                                      {k: fx_arg(v) for k, v in kwargs.items()})
        node.meta.update(example=result, where=self.where(), mutates=False, writes=frozenset())
        check = self.graph.call_function(operator.eq, (node, result))
        check.meta.update(example=True, where=self.where(), mutates=False, writes=frozenset())
        self.assertions.append((check, True, self.where(), ("specialize", id(node))))

    def speculation_stopped(self, frame) -> bool:
        """Whether the branch the frame is at has gone both ways (no more speculation)."""
        return (id(frame.code), frame.ip) in self.unstable_sites

    def assume_truth(self, v: TensorV) -> bool:
        """Speculate a branch on a tensor's value in the direction it takes now; the graph
        computes the predicate and the entry checks it before committing anything. At a
        rolled loop's exit jump it is the loop's exit test (``rolled/exits.py``), speculated
        whether or not the site has gone both ways."""
        frame = self.frames[-1]
        site = (id(frame.code), frame.ip)
        exit_ = exit_tests.is_exit(self, frame, frame.ip - 1)
        if site in self.unstable_sites and not exit_:
            raise Unsupported("data_dependent_branch",
                              "both directions of this branch on a tensor value have been seen; "
                              "it is no longer speculated")
        if v.example.numel() != 1:
            raise Unsupported("data_dependent_branch", "truth value of a tensor with more than one element")
        try:
            with MutationCheck(self.fresh):
                outcome = bool(v.example)
        except Exception as e:
            raise Unsupported("data_dependent_branch", f"bool() of a tensor raised {e}") from None
        if exit_:
            outcome = exit_tests.no_break(frame, frame.ip - 1)
        self.assertions.append((v.node, outcome, self.where(), site))
        if exit_:
            exit_tests.record(self, frame.ip - 1, self.assertions[-1])
        return outcome

    def wrap_output(self, node: torch.fx.Node, result: Any) -> Value:
        if isinstance(result, torch.Tensor):
            node.meta["example"] = result
            return TensorV(node, result)
        if isinstance(result, (tuple, list)):
            items = []
            for i, x in enumerate(result):
                if isinstance(x, torch.Tensor):
                    sub = self.graph.call_function(_getitem, (node, i))
                    sub.meta["example"] = x
                    items.append(TensorV(sub, x))
                else:
                    items.append(self.wrap_python(x))
            if isinstance(result, list):
                return ListV(items)
            return TupleV(items, type(result))
        raise Unsupported("unsupported_call", f"an op returned {type(result).__name__} holding tensors")

    def wrap_python(self, value: Any) -> Value:
        """A Python value computed during capture from constants (no source, no guard)."""
        t = type(value)
        if t in CONST_TYPES:
            return ConstV(value)
        if t is tuple:
            items = [self.wrap_python(x) for x in value]
            return ConstV(value) if all(isinstance(i, ConstV) for i in items) else TupleV(items)
        if t is list:
            return ListV([self.wrap_python(x) for x in value])
        if t in (dict, collections.OrderedDict, collections.defaultdict):
            factory = value.default_factory if t is collections.defaultdict else None
            return DictV({k: self.wrap_python(v) for k, v in value.items()}, cls=t,
                         factory=None if factory is None else self.wrap_python(factory))
        if t is set:
            return SetV(set(value))
        if isinstance(value, torch.Tensor):
            return inputs.wrap_tensor(self, value, None)
        return ObjV(value)

    def tick(self) -> None:
        self.instructions_left -= 1
        if self.instructions_left < 0:
            raise Unsupported("recursion_limit", "capture ran more bytecode instructions than "
                              "config.max_instructions (a very long unrolled loop?)")
        if not self.instructions_left & (budget.CHECK_EVERY - 1):
            self.budget.check()




_getitem = __import__("operator").getitem


def _object_guard(obj) -> tuple:
    """The guard (class, expected) for a plain object read during capture: its type, except
    for an instance of a subclass of a builtin value type (``class Key(str)``, an ``IntEnum``
    member), whose value decides dict lookups, comparisons and formatting: its value, or its
    identity when the class defines its own equality."""
    base = next((b for b in (int, float, str, bytes, complex) if isinstance(obj, b)), None)
    if base is None:
        return TypeGuard, type(obj)
    if type(obj).__eq__ is not base.__eq__ or type(obj).__hash__ is not base.__hash__:
        return IdGuard, obj
    return ValueGuard, obj


# Ops whose number of results depends on the sizes of their input (``split``, ``chunk``,
# ``unbind``, ``tensor_split``, ``hsplit``, ``split_with_sizes``, ...), by name.
_COUNT_FROM_SIZES = re.compile("split|chunk|unbind")
_DIM_AT = {"split": 2, "split_with_sizes": 2, "unsafe_split": 2, "unsafe_split_with_sizes": 2,
           "chunk": 2, "unsafe_chunk": 2, "tensor_split": 2, "unbind": 1}  # dim's position


def _split_dim(label: str, args: list, kwargs: dict, t) -> int | None:
    """The dimension a split along which ``label`` (split, chunk, unbind, ...) cuts ``t``;
    None where not known (every size is then fixed)."""
    if not isinstance(t, TensorV):
        return None
    if label in ("vsplit", "hsplit", "dsplit"):
        return {"vsplit": 0, "hsplit": 1 if t.example.dim() > 1 else 0, "dsplit": 2}[label]
    if label not in _DIM_AT:
        return None
    at = _DIM_AT[label]
    dim = args[at] if len(args) > at else kwargs.get("dim", ConstV(0))
    dim = dim.concrete() if isinstance(dim, ConstV) else None
    return dim if type(dim) is int else None


# Python results of tensor ops that describe tensors, never their values (`torch.result_type`)
_METADATA_TYPES = (torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size)
_VALUE_FACTORIES = (torch.tensor, torch.as_tensor, torch.scalar_tensor)


def _item(source: Source | None, key) -> Source | None:
    return None if source is None else ItemSource(source, key)


def _attr(source: Source | None, name: str) -> Source | None:
    return None if source is None else AttrSource(source, name)


