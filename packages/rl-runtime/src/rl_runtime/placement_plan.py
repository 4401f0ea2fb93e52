"""Where a run's actors go on a Ray cluster, shown before and after they start.

`check_fits` refuses, before the placement group is asked for, a set of bundles that the
cluster's nodes cannot hold even when idle (Ray would otherwise wait for them forever, or for
`create_placement`'s time-out), naming what is missing. `plan_rows` reads which node Ray gave
each bundle (`placement_group_table`), and so which node each trainer rank and engine will run
on; `actor_nodes` asks the actors themselves where they run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rl_runtime.preflight import PreflightError


def nodes() -> dict[str, dict[str, Any]]:
    """The cluster's live nodes by id: ``{"ip", "resources"}`` (the totals each offers)."""
    import ray

    return {
        n["NodeID"]: {"ip": n["NodeManagerAddress"], "resources": dict(n["Resources"])}
        for n in ray.nodes()
        if n.get("Alive")
    }


def check_fits(bundles: Sequence[dict[str, float]], capacity: dict[str, dict[str, Any]]) -> None:
    """Refuse `bundles` that the nodes in `capacity` (`nodes()`) cannot hold at all: each
    bundle must fit inside one node, and Ray packs them, largest first, the same way."""
    free = {nid: dict(n["resources"]) for nid, n in capacity.items()}
    order = sorted(range(len(bundles)), key=lambda i: -sum(bundles[i].values()))
    for i in order:
        need = bundles[i]
        home = next(
            (
                nid
                for nid, have in free.items()
                if all(have.get(k, 0.0) >= v for k, v in need.items())
            ),
            None,
        )
        if home is None:
            raise PreflightError(_refusal(bundles, capacity))
        for k, v in need.items():
            free[home][k] -= v


def _refusal(bundles: Sequence[dict[str, float]], capacity: dict[str, dict[str, Any]]) -> str:
    shapes: dict[str, int] = {}
    for b in bundles:
        key = _fmt(b)
        shapes[key] = shapes.get(key, 0) + 1
    wanted = " + ".join(f"{n} bundle(s) of {shape}" for shape, n in shapes.items())
    totals: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            totals[k] = totals.get(k, 0.0) + v
    have = {k: sum(n["resources"].get(k, 0.0) for n in capacity.values()) for k in totals}
    short = [f"{k} {have[k]:g} of {totals[k]:g}" for k in totals if have[k] < totals[k]]
    where = "; ".join(
        f"{n['ip']} {_fmt(_relevant(n['resources'], totals))}" for n in capacity.values()
    )
    return (
        f"the placement needs {wanted}; the cluster cannot hold it "
        f"({'has ' + ', '.join(short) if short else 'no node holds a whole bundle'}; "
        f"nodes: {where or 'none'})"
    )


def _relevant(resources: dict[str, float], keys: dict[str, float]) -> dict[str, float]:
    return {k: resources.get(k, 0.0) for k in keys}


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def plan_rows(placement: Any, *, trainer_cpus: float, engine_cpus: float) -> list[dict[str, Any]]:
    """One row per actor of `placement` (a `Placement`): its role, bundle and the node Ray
    reserved that bundle on (id, address, custom resources), with the GPUs and CPUs it asks."""
    from ray.util import placement_group_table

    table = placement_group_table(placement.pg)["bundles_to_node_id"]
    known = nodes()
    rows = []
    for role, bundles, gpus, cpus in (
        ("trainer", placement.trainer_bundles, placement.trainer_gpus, trainer_cpus),
        ("engine", placement.engine_bundles, placement.engine_gpus, engine_cpus),
    ):
        for i, b in enumerate(bundles):
            node = table.get(b, "")
            info = known.get(node, {"ip": "?", "resources": {}})
            labels = sorted(k for k in info["resources"] if k not in _BUILTIN and ":" not in k)
            rows.append(
                dict(
                    role=role,
                    index=i,
                    bundle=b,
                    node_id=node,
                    node_ip=info["ip"],
                    node_resources=labels,
                    gpus=gpus,
                    cpus=cpus,
                )
            )
    return rows


_BUILTIN = {"CPU", "GPU", "memory", "object_store_memory", "accelerator_type"}


def format_plan(rows: Sequence[dict[str, Any]]) -> str:
    """The plan as lines a user reads: ``trainer rank 0 -> node 10.0.0.2 (a1b2c3d4) [bundle 0]``."""
    lines = []
    for r in rows:
        name = f"{'trainer rank' if r['role'] == 'trainer' else 'engine'} {r['index']}"
        labels = f" {{{', '.join(r['node_resources'])}}}" if r["node_resources"] else ""
        lines.append(
            f"{name} -> node {r['node_ip']} ({r['node_id'][:8]}){labels} "
            f"[bundle {r['bundle']}: {r['gpus']:g} GPU, {r['cpus']:g} CPU]"
        )
    return "\n".join(lines)


def bundle_node(pg: Any, bundle: int) -> str:
    """The node id holding `bundle` of placement group `pg` now ("" when none does)."""
    from ray.util import placement_group_table

    return placement_group_table(pg)["bundles_to_node_id"].get(bundle, "")


def actor_nodes(workers: Sequence[Any]) -> list[str]:
    """The node id each actor in `workers` runs on, as the actor itself reports it."""
    import ray

    def where(_self: Any) -> str:
        return ray.get_runtime_context().get_node_id()

    return ray.get([w.__ray_call__.remote(where) for w in workers])
