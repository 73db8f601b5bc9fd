"""The rewrite rules that turn a single-process PyTorch training script into a distributed one
(after "Code Transformation for Distributed Python ML Code", adapted to PyTorch idioms).

Each rule is one function ``rule(tree, ctx)`` registered by name in ``RULES`` (applied in that
order); it edits the AST and reports each rewrite with ``ctx.report(line, rule, what)``, or
refuses with ``ctx.refuse(line, rule, why)`` when the script breaks a documented restriction.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Callable


class Refused(Exception):
    def __init__(self, line: int, rule: str, why: str):
        super().__init__(f"{line}: cannot convert: {rule}: {why}")
        self.line, self.rule, self.why = line, rule, why


@dataclass
class Context:
    scale_lr: bool = True
    wrap_ddp: bool = True
    reports: list = field(default_factory=list)
    model_name: str | None = None
    model_at_top_level: bool = True
    optimized_steps: bool = False  # steps were given to specularch.optimize (--no-ddp)

    def report(self, line: int, rule: str, what: str) -> None:
        self.reports.append((line, rule, what))

    def refuse(self, line: int, rule: str, why: str):
        raise Refused(line, rule, why)


RULES: dict[str, Callable] = {}


def rule(name: str):
    def register(fn):
        if name in RULES:
            raise ValueError(f"rule {name!r} registered twice")
        RULES[name] = fn
        return fn
    return register


def _parse(src: str) -> list[ast.stmt]:
    return ast.parse(src).body


def _is_call(node, dotted: str) -> bool:
    return isinstance(node, ast.Call) and ast.unparse(node.func) in (dotted, dotted.split(".")[-1])


@rule("not-already-distributed")
def not_already_distributed(tree: ast.Module, ctx: Context) -> None:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", "") or ""]
            if any(n.startswith("torch.distributed") for n in names):
                ctx.refuse(node.lineno, "not-already-distributed",
                           "the script already uses torch.distributed")


@rule("init-process-group")
def init_process_group(tree: ast.Module, ctx: Context) -> None:
    last_import = max((i for i, s in enumerate(tree.body) if isinstance(s, (ast.Import, ast.ImportFrom))),
                      default=-1)
    setup = _parse(
        "import os as _os\n"
        "import torch.distributed as dist\n"
        "from torch.utils.data.distributed import DistributedSampler\n"
        "dist.init_process_group(backend='nccl' if torch.cuda.is_available() else 'gloo')\n"
        "RANK = dist.get_rank()\n"
        "WORLD_SIZE = dist.get_world_size()\n"
        "LOCAL_RANK = int(_os.environ.get('LOCAL_RANK', 0))\n"
        "DEVICE = torch.device(f'cuda:{LOCAL_RANK}') if torch.cuda.is_available() else torch.device('cpu')\n")
    line = tree.body[last_import].lineno if last_import >= 0 else 1
    tree.body[last_import + 1:last_import + 1] = setup
    ctx.report(line, "init-process-group", "process group initialised after the imports; RANK, "
               "WORLD_SIZE, LOCAL_RANK and the per-rank DEVICE defined")
    for node in ast.walk(tree):
        if _is_call(node, "torch.device") and node.args and isinstance(node.args[0], ast.Constant) \
                and str(node.args[0].value).startswith("cuda"):
            node.func, node.args = ast.Name("_per_rank_device", ast.Load()), []
            ctx.report(node.lineno, "init-process-group", "torch.device('cuda…') -> the rank's DEVICE")
    tree.body.insert(last_import + 1 + len(setup), ast.parse("def _per_rank_device():\n    return DEVICE").body[0])


@rule("distributed-sampler")
def distributed_sampler(tree: ast.Module, ctx: Context) -> None:
    loaders = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_call(node.value, "torch.utils.data.DataLoader"):
            call = node.value
            if not call.args:
                ctx.refuse(node.lineno, "distributed-sampler", "DataLoader without a positional dataset")
            shuffle = next((k.value for k in call.keywords if k.arg == "shuffle"), ast.Constant(False))
            call.keywords = [k for k in call.keywords if k.arg != "shuffle"]
            call.keywords.append(ast.keyword("sampler", ast.Call(ast.Name("DistributedSampler", ast.Load()),
                                                                  [call.args[0]],
                                                                  [ast.keyword("shuffle", shuffle)])))
            if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
                ctx.refuse(node.lineno, "distributed-sampler", "the DataLoader is not assigned to a name")
            loaders[node.targets[0].id] = node.lineno
            ctx.report(node.lineno, "distributed-sampler", f"{node.targets[0].id}: DistributedSampler "
                       "instead of shuffle=")
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
            used = {n.iter.id for n in ast.walk(node) if isinstance(n, ast.For) and n is not node
                    and isinstance(n.iter, ast.Name) and n.iter.id in loaders}
            for name in sorted(used):
                node.body.insert(0, ast.parse(f"{name}.sampler.set_epoch({node.target.id})").body[0])
                ctx.report(node.lineno, "distributed-sampler", f"{name}.sampler.set_epoch({node.target.id}) "
                           "at the top of the epoch loop")


def _optimizer_calls(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func).startswith(("torch.optim.", "optim.")) \
                and ast.unparse(node.func).count(".") >= 1 and "lr_scheduler" not in ast.unparse(node.func):
            yield node


def _scaled(value: ast.expr) -> ast.expr:
    return ast.BinOp(value, ast.Mult(), ast.Name("WORLD_SIZE", ast.Load()))


@rule("scale-learning-rate")
def scale_learning_rate(tree: ast.Module, ctx: Context) -> None:
    if not ctx.scale_lr:
        return
    for call in _optimizer_calls(tree):
        for kw in call.keywords:
            if kw.arg == "lr":
                kw.value = _scaled(kw.value)
                ctx.report(call.lineno, "scale-learning-rate", "lr multiplied by WORLD_SIZE")
        if len(call.args) >= 2 and not any(kw.arg == "lr" for kw in call.keywords):
            call.args[1] = _scaled(call.args[1])  # every torch.optim optimizer: (params, lr, ...)
            ctx.report(call.lineno, "scale-learning-rate", "lr (second positional argument) "
                       "multiplied by WORLD_SIZE")


@rule("data-parallel-model")
def data_parallel_model(tree: ast.Module, ctx: Context) -> None:
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    models = set()
    for call in _optimizer_calls(tree):
        node = call
        while node in parents:
            node = parents[node]
            if isinstance(node, (ast.If, ast.For, ast.While, ast.With, ast.Try)):
                ctx.refuse(call.lineno, "data-parallel-model", "the optimizer is created conditionally "
                           "or in a loop; create it once at top level")
        if call.args and isinstance(call.args[0], ast.Call) and isinstance(call.args[0].func, ast.Attribute) \
                and call.args[0].func.attr == "parameters" and isinstance(call.args[0].func.value, ast.Name):
            models.add(call.args[0].func.value.id)
    first = min((c.lineno for c in _optimizer_calls(tree)), default=1)
    if len(models) != 1:
        ctx.refuse(first, "data-parallel-model", f"expected one model passed to an optimizer as "
                   f"`model.parameters()`, found {sorted(models) or 'none'}")
    name = models.pop()
    ctx.model_name = name
    if not ctx.wrap_ddp:
        _optimize_steps(tree, ctx)
    # the model's assignment: at top level or directly in a function's body (e.g. main())
    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))]:
        for i, stmt in enumerate(scope.body):
            if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                    for t in stmt.targets):
                if ctx.wrap_ddp:
                    wrap = ast.parse(f"{name} = torch.nn.parallel.DistributedDataParallel("
                                     f"{name}.to(DEVICE), device_ids=[LOCAL_RANK] if "
                                     f"torch.cuda.is_available() else None)").body[0]
                    what = f"{name} wrapped in DistributedDataParallel"
                else:
                    wrap = ast.parse(f"for _t in [*{name}.parameters(), *{name}.buffers()]:\n"
                                     f"    dist.broadcast(_t.data, 0)").body[0]
                    what = f"{name}'s parameters and buffers broadcast from rank 0"
                scope.body.insert(i + 1, wrap)
                ctx.model_at_top_level = scope is tree
                ctx.report(stmt.lineno, "data-parallel-model", what)
                return
    ctx.refuse(first, "data-parallel-model", f"the model {name!r} passed to the optimizer is not "
               f"assigned (`{name} = ...`) at top level or directly in a function's body")


def _optimize_steps(tree: ast.Module, ctx: Context) -> None:
    """``--no-ddp``: gradients are averaged by specularch inside optimized training steps, so
    every ``backward()`` must be in a top-level step function (not in a loop there), which
    gets ``@specularch.optimize``."""
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    steps = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "backward"):
            continue
        scope = node
        while scope in parents and not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                          ast.Lambda, ast.ClassDef)):
            scope = parents[scope]
            if isinstance(scope, (ast.For, ast.While, ast.AsyncFor)):
                ctx.refuse(node.lineno, "data-parallel-model", "--no-ddp: backward() runs in a "
                           "loop; specularch averages gradients only inside a step function "
                           "that it optimizes: move one step (zero_grad, forward, backward, "
                           "step) into a top-level function called per batch, or convert "
                           "without --no-ddp (DistributedDataParallel)")
        if not (isinstance(scope, ast.FunctionDef) and scope in tree.body):
            ctx.refuse(node.lineno, "data-parallel-model", "--no-ddp: backward() is not inside "
                       "a top-level step function that specularch can optimize; convert "
                       "without --no-ddp (DistributedDataParallel)")
        steps[scope.name] = scope
    for step in steps.values():
        if any(ast.unparse(d).endswith("optimize") for d in step.decorator_list):
            continue
        step.decorator_list.insert(0, ast.parse("specularch.optimize", mode="eval").body)
        ctx.report(step.lineno, "data-parallel-model", f"{step.name} optimized with specularch: "
                   "its captured backward() averages gradients over ranks")
    if steps:
        first_import = next((i for i, stmt in enumerate(tree.body)
                             if isinstance(stmt, (ast.Import, ast.ImportFrom))), 0)
        tree.body.insert(first_import, ast.parse("import specularch").body[0])
        ctx.optimized_steps = True


@rule("unwrapped-state-dict")
def unwrapped_state_dict(tree: ast.Module, ctx: Context) -> None:
    """DDP's own state_dict() prefixes every key with ``module.``: read and load the model's."""
    if not (ctx.wrap_ddp and ctx.model_name):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("state_dict", "load_state_dict") \
                and isinstance(node.value, ast.Name) and node.value.id == ctx.model_name:
            node.value = ast.Attribute(node.value, "module", ast.Load())
            ctx.report(node.lineno, "unwrapped-state-dict",
                       f"{ctx.model_name}.{node.attr} -> {ctx.model_name}.module.{node.attr}")


class _RankZero(ast.NodeTransformer):
    def __init__(self, ctx: Context):
        self.ctx = ctx

    def visit_Expr(self, node):
        if isinstance(node.value, ast.Call):
            fn = ast.unparse(node.value.func)
            if fn in ("print", "torch.save") or fn.startswith(("logging.", "logger.")):
                self.ctx.report(node.lineno, "rank-zero-io", f"{fn}(...) only on rank 0")
                return ast.If(ast.parse("RANK == 0", mode="eval").body, [node], [])
        return node


@rule("rank-zero-io")
def rank_zero_io(tree: ast.Module, ctx: Context) -> None:
    _RankZero(ctx).visit(tree)


@rule("shutdown")
def shutdown(tree: ast.Module, ctx: Context) -> None:
    last = max((getattr(n, "end_lineno", 0) or 0) for n in ast.walk(tree))
    end = "dist.destroy_process_group()\n"
    what = "dist.destroy_process_group() at the end of the script"
    if ctx.wrap_ddp and ctx.model_name:
        # DDP holds the process group: unless it is freed first, gloo's threads outlive
        # destroy_process_group and may release a finished collective while the interpreter
        # is shutting down, which aborts the process (about one run in ten on CPU).
        free = f"del {ctx.model_name}\n" if ctx.model_at_top_level else ""
        end = f"{free}__import__('gc').collect()\n" + end
        what = f"{ctx.model_name} released, then " + what
    elif ctx.optimized_steps:
        # The same for specularch's cached graphs of the distributed step (one run in about
        # a dozen aborted at exit with "terminate called without an active exception").
        end = "specularch.reset()\n__import__('gc').collect()\n" + end
        what = "specularch's graphs released, then " + what
    tree.body.extend(ast.parse(end).body)
    ctx.report(last, "shutdown", what)
