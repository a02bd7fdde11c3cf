"""The allocator's entry point: ``allocate`` claims together on one node as the kube-scheduler's
DRA plugin would (``dra:structured/internal/{stable,incubating,experimental}``, spec D, E). Pure.

Only the highest generation of a pool counts; incomplete or invalid pools are skipped (an
``allocationMode: All`` request fails on them); pools in (driver, pool) order, slices in name
order, devices in slice order (``candidates``); first fit with backtracking (``search``). A claim
that is already allocated keeps its allocation: the scheduler only checks that its node can use
it (spec D.3, ``status.allocation``). A found allocation becomes ``ClaimAllocation``s here (with
the configs of class and claim, and the node selector of the devices); a failed one is explained
per request by ``reasons``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dra_driver.errors import CelCompileError, ExplainError
from dra_driver.quantity import format_quantity
from dra_driver.scheduling import cel
from dra_driver.scheduling.allocator.candidates import (
    Candidate,
    Pool,
    RequestData,
    device_on_node,
    gather_pools,
    node_selector_matches,
)
from dra_driver.scheduling.allocator.capacity import capacity_problem
from dra_driver.scheduling.allocator.model import (
    JSON,
    MAX_RESULTS_PER_CLAIM,
    Abort,
    AllocatedState,
    AllocationResult,
    Claim,
    ClaimAllocation,
    DeviceClass,
    DeviceResult,
    Node,
    Slice,
    TooMany,
)
from dra_driver.scheduling.allocator.reasons import diagnose as diagnose_requests
from dra_driver.scheduling.allocator.search import Search
from dra_driver.scheduling.environment import NEWEST_VERSION


def compile_selectors(
    claims: Sequence[Claim],
    classes: Mapping[str, DeviceClass],
    *,
    k8s_version: str = NEWEST_VERSION,
) -> None:
    """Compile every selector the claims use as new expressions of an API server of
    ``k8s_version`` (``environment.py``); raise CelCompileError/ExplainError naming it."""
    for claim in claims:
        for request in claim.requests:
            for exact in (request.exactly,) if request.exactly else request.first_available:
                name = f"{request.name}/{exact.name}" if request.exactly is None else request.name
                cls = classes.get(exact.device_class_name)
                if cls is None:
                    raise ExplainError(
                        f"claim {claim.key}: request {name}: device class "
                        f"{exact.device_class_name!r} not found "
                        f"(known: {', '.join(sorted(classes)) or 'none'})"
                    )
                for i, expr in enumerate(cls.selectors):
                    _compile(expr, f"DeviceClass {cls.name}: spec.selectors[{i}]", k8s_version)
                for i, expr in enumerate(exact.selectors):
                    where = f"claim {claim.key}: request {name}: selectors[{i}]"
                    _compile(expr, where, k8s_version)


def _compile(expr: str, where: str, k8s_version: str) -> None:
    # Evaluation elsewhere uses the newest environment's program: it declares everything an
    # older version does, so a selector that compiled here compiles there too.
    try:
        cel.compile_selector(expr, k8s_version)
    except CelCompileError as exc:
        raise CelCompileError(f"{where}: CEL compile error: {exc}") from None


def allocate(
    claims: Sequence[Claim],
    *,
    classes: Mapping[str, DeviceClass],
    slices: Sequence[Slice],
    node: Node,
    allocated: AllocatedState | None = None,
    diagnose: bool = True,
    binding_conditions: bool = True,
) -> AllocationResult:
    """Allocate all ``claims`` together on ``node`` as the scheduler would.

    A claim that ``allocated`` already holds an allocation for (same UID, else same
    namespace/name) keeps it, as the scheduler keeps ``status.allocation``: the node only has to
    be one its ``nodeSelector`` admits, and its devices stay in use. Raise ExplainError (or
    CelCompileError) for input errors: an unknown class, a selector that does not compile. A CEL
    runtime error is not an input error: like the scheduler, the attempt is aborted and the
    result carries the error. With ``diagnose``, an unsatisfiable result explains per request
    why each device was unusable. ``binding_conditions``: the scheduler's
    DRADeviceBindingConditions (KEP-5007). On, pools holding devices with binding conditions
    are tried last, results carry those conditions and a ``bindsToNode`` device pins the
    allocation to ``node``; off, such devices are never selected.
    """
    allocated = allocated or AllocatedState()
    compile_selectors(claims, classes)
    pools = gather_pools(slices, node, binding_conditions=binding_conditions)
    notes = tuple(
        f"pool {p.driver}/{p.name} is "
        + (
            f"invalid ({p.invalid})"
            if p.invalid
            else "incomplete (not all of its slices are published)"
        )
        + "; its devices are not used"
        for p in pools
        if p.incomplete or p.invalid
    )
    existing = [allocated.existing(c) for c in claims]
    for claim, done in zip(claims, existing, strict=True):
        if done is None:
            continue
        notes += (
            f"claim {claim.key} is already allocated (status.allocation of {done.claim}): "
            "shown as it is, not allocated again",
        )
        if done.node_selector and not node_selector_matches(done.node_selector, node):
            return AllocationResult(
                node=node.name,
                satisfiable=False,
                error=f"claim {claim.key} is already allocated, for {_nodes_of(done)}",
                notes=notes,
            )
    if all(done is not None for done in existing):
        return AllocationResult(
            node=node.name,
            satisfiable=True,
            allocations=tuple(done for done in existing if done is not None),
            notes=notes,
        )
    claims = [c for c, done in zip(claims, existing, strict=True) if done is None]
    datas = _request_data(claims, classes)
    search = Search(claims, datas, pools, allocated, binding_conditions=binding_conditions)
    for cand in search.candidates:
        if cand.slice.per_device_node_selection:
            cand.on_node = device_on_node(cand.slice, cand.device, node)
    error = None
    ok = False
    try:
        _fill_all_devices(search, datas, pools)
        ok = search.run()
    except Abort as exc:
        error = str(exc)
    except TooMany:
        error = f"more than {MAX_RESULTS_PER_CLAIM} devices requested by one claim"
    if ok and error is None:
        new = iter(_results(search, node))
        return AllocationResult(
            node=node.name,
            satisfiable=True,
            allocations=tuple(next(new) if done is None else done for done in existing),
            notes=notes,
        )
    search.aborted = error
    diagnoses = diagnose_requests(search, node) if diagnose else ()
    return AllocationResult(
        node=node.name, satisfiable=False, error=error, diagnoses=diagnoses, notes=notes
    )


def _nodes_of(allocation: ClaimAllocation) -> str:
    """The nodes an existing allocation's nodeSelector names, in words."""
    names = [
        str(v)
        for term in (allocation.node_selector or {}).get("nodeSelectorTerms") or []
        for r in term.get("matchFields") or []
        if r.get("key") == "metadata.name" and r.get("operator") == "In"
        for v in r.get("values") or []
    ]
    if names:
        return f"node {', '.join(names)}" if len(names) == 1 else f"nodes {', '.join(names)}"
    return "other nodes (its nodeSelector does not match this one)"


def _request_data(
    claims: Sequence[Claim], classes: Mapping[str, DeviceClass]
) -> dict[tuple[int, int, int], RequestData]:
    datas = {}
    for ci, claim in enumerate(claims):
        for ri, request in enumerate(claim.requests):
            if request.exactly is not None:
                ex = request.exactly
                datas[(ci, ri, 0)] = RequestData(
                    ci, ex, None, classes[ex.device_class_name], ex.count
                )
            else:
                for si, sub in enumerate(request.first_available):
                    datas[(ci, ri, si)] = RequestData(
                        ci, sub, request.name, classes[sub.device_class_name], sub.count
                    )
    return datas


def _fill_all_devices(
    search: Search, datas: dict[tuple[int, int, int], RequestData], pools: list[Pool]
) -> None:
    """Every device an 'All' request selects; Abort when one reaches an incomplete or invalid
    pool."""
    for key, data in datas.items():
        if data.request.allocation_mode != "All":
            continue
        bad = [p for p in pools if p.incomplete or p.invalid]
        if bad:
            p = bad[0]
            data.all_error = (
                f"request {data.full_name}: asks for all devices, but resource pool "
                f"{p.driver}/{p.name} is currently {'invalid' if p.invalid else 'being updated'}"
            )
            # The scheduler checks this while it sets the requests up, before its search
            # (validateDeviceRequest): the whole attempt fails, whatever the other requests.
            raise Abort(data.all_error)
        # Like validateDeviceRequest: a device whose capacity cannot hold the request even
        # unshared is not one of "all"; one short only of what others hold stays (and fails).
        data.all_devices = [
            c
            for c in search.candidates
            if search.selector_verdict(key, c)
            and capacity_problem(data.request, c.device, {}) is None
        ]
        data.num_devices = len(data.all_devices)


def _results(search: Search, node: Node) -> tuple[ClaimAllocation, ...]:
    out = []
    bc = search.binding_conditions
    for ci, claim in enumerate(search.claims):
        placed = search.placed[ci]
        results = tuple(
            DeviceResult(
                request=p.data.full_name,
                driver=p.cand.pool.driver,
                pool=p.cand.pool.name,
                device=p.cand.device.name,
                admin_access=p.data.request.admin_access,
                tolerations=p.data.request.tolerations,
                share_id=p.share_id,
                consumed_capacity={
                    n: format_quantity(v, p.cand.device.capacity_formats.get(n, "DecimalSI"))
                    for n, v in p.consumed.items()
                },
                binding_conditions=p.cand.device.binding_conditions if bc else (),
                binding_failure_conditions=(p.cand.device.binding_failure_conditions if bc else ()),
            )
            for p in placed
        )
        out.append(
            ClaimAllocation(
                claim=claim.key,
                results=results,
                config=_configs(search, ci, claim),
                node_selector=_node_selector([p.cand for p in placed], node, binds=bc),
            )
        )
    return tuple(out)


def _configs(search: Search, ci: int, claim: Claim) -> tuple[JSON, ...]:
    chosen: list[RequestData] = []
    for ri, request in enumerate(claim.requests):
        si = search.selected_sub.get((ci, ri), 0) if request.exactly is None else 0
        chosen.append(search.datas[(ci, ri, si)])
    configs: list[JSON] = []
    class_entries: dict[str, list[JSON]] = {}
    for data in chosen:
        cls = data.device_class
        if cls.name in class_entries:
            for entry in class_entries[cls.name]:
                entry["requests"].append(data.full_name)
            continue
        entries = [
            {
                "source": "FromClass",
                "requests": [data.full_name],
                **{k: v for k, v in c.items() if k != "requests"},
            }
            for c in cls.config
        ]
        class_entries[cls.name] = entries
        configs.extend(entries)
    for c in claim.config:
        wanted = [str(x) for x in c.get("requests") or []]
        body = {k: v for k, v in c.items() if k != "requests"}
        if not wanted:
            configs.append({"source": "FromClaim", "requests": [], **body})
            continue
        for data in chosen:
            if (data.parent or data.request.name) in wanted or data.full_name in wanted:
                configs.append({"source": "FromClaim", "requests": wanted, **body})
    # A config that names every request of the claim (or the sub-request each one got) names
    # none: "empty means all", as the scheduler writes it (1.37, incubating allocator).
    for config in configs:
        names = config["requests"]
        if names and all(
            (data.parent or data.request.name) in names or data.full_name in names
            for data in chosen
        ):
            config["requests"] = []
    return tuple(configs)


def _node_selector(cands: list[Candidate], node: Node, *, binds: bool) -> JSON | None:
    """The allocation's nodeSelector (``createNodeSelector``): ``node`` itself as soon as one
    device is local to a node or (``binds``: DRADeviceBindingConditions on) has ``bindsToNode``,
    else the union of the slices' (or devices') node selector requirements, else none."""
    exprs: list[JSON] = []
    fields: list[JSON] = []
    for cand in cands:
        s, d = cand.slice, cand.device
        node_name = d.node_name if s.per_device_node_selection else s.node_name
        selector = d.node_selector if s.per_device_node_selection else s.node_selector
        if node_name or (binds and d.binds_to_node and node.name):
            node_name = node.name or node_name
            return {
                "nodeSelectorTerms": [
                    {
                        "matchFields": [
                            {"key": "metadata.name", "operator": "In", "values": [node_name]}
                        ]
                    }
                ]
            }
        if selector:
            term = (selector.get("nodeSelectorTerms") or [{}])[0]
            for r in term.get("matchFields") or []:
                if r not in fields:
                    fields.append(r)
            for r in term.get("matchExpressions") or []:
                if r not in exprs:
                    exprs.append(r)
    if not exprs and not fields:
        return None
    term_out: JSON = {}
    if exprs:
        term_out["matchExpressions"] = exprs
    if fields:
        term_out["matchFields"] = fields
    return {"nodeSelectorTerms": [term_out]}
