"""The Kubernetes DRA CEL environment for device selectors (spec section E). Pure.

Parsing uses cel-python's Lark grammar, extended with the optional-access syntax (``x.?f``,
``m[?k]``) that cel-python 0.5.0 lacks. Evaluation does not use cel-python's tree-walking
interpreter (about 2,300 evaluations/s): each expression is compiled once into Python closures
(``Program``), which also carry a static type so that mistakes the API server would reject
(unknown functions, ``device.foo``, ``device.driver == 1``, a non-bool result) fail at compile
time with their line and column. Runtime semantics follow cel-go as the scheduler runs it:
heterogeneous ``==``, errors that are not ``false`` (``&&``/``||`` absorb an error only when the
other side decides), unknown attribute domains read as empty maps, unknown attributes are a
"no such key" error.

Libraries: the CEL standard functions and macros, ``cel.bind``, optional types, ext.Strings
v2 (with ``format``), Kubernetes quantity, semver, lists (v0 and ext.Lists v3), sets and regex
(``matches``, ``find``/``findAll``, with RE2 through google-re2 as the API server has it; a
constant pattern RE2 refuses is a compile error),
two-variable comprehensions, and DRA ``includes()``. Not implemented (compile error
"undeclared reference"): timestamps and durations, url/ip/cidr/format libraries, protobuf
message construction. Optional types include ``optMap``/``optFlatMap``, ``optional_type``,
``has()`` through optional chains and optional list/map literal entries (``[?x]``, ``{?k: v}``).

Modules, in the order of the flow: values -> runtime -> one module per library
(conversions, regex, strings, quantity, lists, sets, semver, optionals) -> functions ->
types -> parse -> expr, context (what the compiler's parts share) -> comprehensions (their run
time), cost (the estimate) -> macros, literals -> compiler -> why (explains a false selector) ->
program. The versions (which functions a Kubernetes minor declares, the cost limit) come from
``scheduling.environment``, which knows nothing of this package.
"""

from __future__ import annotations

from dra_driver.scheduling.cel.expr import Activation, Expr, Fn
from dra_driver.scheduling.cel.program import Program, compile_expression, compile_selector
from dra_driver.scheduling.cel.types import (
    BOOL,
    BYTES,
    DEVICE,
    DOUBLE,
    DYN,
    INT,
    LIST_DYN,
    MAP_DYN,
    NULL,
    OPT_DYN,
    QUANTITY,
    SEMVER,
    STRING,
    TYPE,
    UINT,
    T,
    list_of,
    map_of,
    opt_of,
)
from dra_driver.scheduling.cel.values import (
    MAX_EXPRESSION_BYTES,
    NONE,
    CelQuantity,
    CelType,
    DeviceObject,
    DomainIndex,
    DomainMap,
    OptionalValue,
    Semver,
    UInt,
    device_variable,
    show_value,
)
from dra_driver.scheduling.cel.why import attribute_value

__all__ = [
    "BOOL",
    "BYTES",
    "DEVICE",
    "DOUBLE",
    "DYN",
    "INT",
    "LIST_DYN",
    "MAP_DYN",
    "MAX_EXPRESSION_BYTES",
    "NONE",
    "NULL",
    "OPT_DYN",
    "QUANTITY",
    "SEMVER",
    "STRING",
    "TYPE",
    "UINT",
    "Activation",
    "CelQuantity",
    "CelType",
    "DeviceObject",
    "DomainIndex",
    "DomainMap",
    "Expr",
    "Fn",
    "OptionalValue",
    "Program",
    "Semver",
    "T",
    "UInt",
    "attribute_value",
    "compile_expression",
    "compile_selector",
    "device_variable",
    "list_of",
    "map_of",
    "opt_of",
    "show_value",
]
