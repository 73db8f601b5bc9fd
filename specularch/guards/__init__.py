"""Guards: what a captured graph assumed about its inputs, checked before every reuse."""
from .codegen import GuardSet, SourceNamer, guard_lines
from .lists import ListDistinctGuard, TensorListGuard
from .aliasing import AliasGuard, DistinctGuard
from .guard import (ContainsGuard, DictKeysGuard, ExprGuard, GlobalStateGuard, Guard, HasAttrGuard, IdGuard, InferenceGuard, LenGuard,
                    NoGlobalHooksGuard, NoHooksGuard, NoRegistrationHooksGuard, NoStepHooksGuard, NoTensorHooksGuard, NotNoneGuard, NotShadowedGuard, TensorGuard, TypeGuard, ValueGuard)
from .sources import (PINNED, AttrSource, BuiltinSource, CellSource, ClosureSource, GlobalSource,
                      ItemSource, KeyedSource, LocalSource, ModuleDictSource, ObjectSource,
                      ScalarOfSource, Source, pin)

__all__ = [
    "GuardSet", "SourceNamer", "guard_lines", "AliasGuard", "ContainsGuard", "DictKeysGuard",
    "DistinctGuard", "ExprGuard", "GlobalStateGuard", "Guard", "HasAttrGuard", "IdGuard",
    "InferenceGuard", "LenGuard", "NoGlobalHooksGuard", "NoHooksGuard", "NoRegistrationHooksGuard", "NoStepHooksGuard",
    "NoTensorHooksGuard", "NotNoneGuard",
    "NotShadowedGuard", "TensorGuard", "TensorListGuard", "ListDistinctGuard", "TypeGuard", "ValueGuard", "PINNED", "AttrSource",
    "BuiltinSource", "CellSource", "ClosureSource", "GlobalSource", "ItemSource", "KeyedSource",
    "LocalSource", "ModuleDictSource", "ObjectSource", "ScalarOfSource", "Source", "pin",
]
