"""The public API: compile an expression or a device selector once, evaluate it many times."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from lark.exceptions import LarkError, UnexpectedInput

from dra_driver.errors import CelCompileError, CelRuntimeError
from dra_driver.scheduling import environment as env
from dra_driver.scheduling.cel.compiler import _Compiler
from dra_driver.scheduling.cel.comprehensions import _CostCounter
from dra_driver.scheduling.cel.context import _compile_error, _syntax_error
from dra_driver.scheduling.cel.cost import estimate_cost
from dra_driver.scheduling.cel.expr import Activation, Expr
from dra_driver.scheduling.cel.parse import _parser
from dra_driver.scheduling.cel.types import DEVICE, T
from dra_driver.scheduling.cel.values import _COST, MAX_EXPRESSION_BYTES, DeviceObject, _tname
from dra_driver.scheduling.cel.why import _Why


@dataclass(frozen=True, eq=False)
class Program:
    """A compiled expression: evaluate many times, compile once (``compile_selector`` caches)."""

    expression: str
    root: Expr
    # Whether evaluation needs a runtime cost counter (it has a comprehension); spec E.2.
    counts_cost: bool = False
    estimated_cost: int = 0  # compile_selector's estimate (cost.estimate_cost)

    def evaluate(self, activation: Activation) -> Any:
        """Evaluate; raise CelRuntimeError (never a Python exception) on a CEL error, including
        "operation cancelled: actual cost limit exceeded" past the runtime cost limit."""
        if self.counts_cost:
            activation = {**activation, _COST: _CostCounter()}
        try:
            return self.root.fn(activation)
        except RecursionError:
            raise CelRuntimeError("expression too deeply nested") from None
        except (ArithmeticError, ValueError, TypeError) as exc:  # a gap in our type checks
            raise CelRuntimeError(f"evaluation failed: {exc}") from exc

    def matches(self, device: DeviceObject) -> bool:
        """Evaluate as a device selector: the result must be a bool."""
        result = self.evaluate({"device": device})
        if result is True or result is False:
            return bool(result)
        raise CelRuntimeError(f"expression evaluated to {_tname(result)}, not bool")

    def why_false(self, device: DeviceObject) -> list[str]:
        """Human reasons why the selector is false (or fails) for ``device``; [] if it is true."""
        return _Why(self.expression, {"device": device}).reasons(self.root, {"device": device})


def compile_expression(
    expression: str, variables: Mapping[str, T], *, withheld: frozenset[str] = frozenset()
) -> Program:
    """Compile ``expression`` with the given variable types; raise CelCompileError with position.

    ``withheld``: function and macro names the target environment does not declare (every
    library the engine implements is available by default)."""
    size = len(expression.encode("utf-8"))
    if size > MAX_EXPRESSION_BYTES:
        raise CelCompileError(
            f"expression is {size} bytes long, more than the limit of {MAX_EXPRESSION_BYTES}"
        )
    if not expression.strip():
        raise CelCompileError("line 1, column 1: empty expression")
    try:
        tree = _parser().parse(expression)
    except UnexpectedInput as exc:
        raise _syntax_error(expression, exc) from None
    except LarkError as exc:
        raise CelCompileError(f"syntax error: {exc}") from None
    try:
        root = _Compiler(expression, variables, withheld).visit(tree)
    except RecursionError:
        raise CelCompileError("expression is nested too deeply") from None
    return Program(expression, root, counts_cost=_has_comprehension(root))


def _has_comprehension(e: Expr) -> bool:
    return e.kind == "comprehension" or any(
        _has_comprehension(p) for p in (*e.parts, *((e.target,) if e.target else ()))
    )


@lru_cache(maxsize=4096)
def compile_selector(
    expression: str,
    k8s_version: str = env.NEWEST_VERSION,
    feature_gates: frozenset[str] = frozenset(),
) -> Program:
    """Compile a device selector (variable ``device``) as an API server of ``k8s_version``
    compiles a new expression (``environment.py``): the result must be a bool, functions that
    version lacks are undeclared, and the estimated cost must be within the limit. Raise
    CelCompileError (ValueError for an unsupported version). Cached per version and gates."""
    environment = env.environment(k8s_version, feature_gates=feature_gates)
    program = compile_expression(expression, {"device": DEVICE}, withheld=environment.withheld)
    if program.root.type.name not in ("bool", "dyn"):
        raise _compile_error(
            expression,
            f"expression must evaluate to bool, not {program.root.type}",
            program.root.line,
            program.root.column,
        )
    cost = estimate_cost(program.root)
    if cost > env.COST_LIMIT:
        raise CelCompileError(
            f"too complex, exceeds cost limit: estimated cost {cost} exceeds the limit of "
            f"{env.COST_LIMIT}"
        )
    return Program(expression, program.root, program.counts_cost, cost)
