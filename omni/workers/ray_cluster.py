"""Ray for the worker group: connect (start a local instance, or attach to a running cluster
at `trainer.ray_address`), check that the cluster can hold the workers asked for, reserve
their placement, and disconnect.

A placement group that the cluster cannot satisfy is never placed, and Ray then waits
forever without an error. So the request is first checked against the nodes' resources,
failing with the config keys to change, and the wait for placement is bounded by
`trainer.placement_timeout_s` (resources that exist but that other jobs hold).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from omni.workers.errors import ResourcesUnavailable


@dataclass
class WorkerLayout:
    """Workers per node and what each worker reserves: one CPU, and one GPU on GPU runs."""

    workers_per_node: List[int]
    use_gpu: bool

    @property
    def bundle(self) -> Dict[str, float]:
        return {"CPU": 1.0, "GPU": 1.0} if self.use_gpu else {"CPU": 1.0}

    def request(self) -> str:
        each = "1 CPU and 1 GPU" if self.use_gpu else "1 CPU"
        return f"{len(self.workers_per_node)} node(s) x {self.workers_per_node[0]} workers, each worker {each}"


def worker_layout(trainer: Any) -> WorkerLayout:
    """One worker per GPU on GPU runs (n_gpus_per_node > 0), else n_workers spread over nnodes."""
    if trainer.n_gpus_per_node > 0:
        return WorkerLayout([trainer.n_gpus_per_node] * trainer.nnodes, use_gpu=True)
    return WorkerLayout([trainer.n_workers // trainer.nnodes] * trainer.nnodes, use_gpu=False)


def connect(address: Optional[str]) -> bool:
    """Attach to the cluster at `address` or start a fresh local instance (never a cluster that
    happens to run on this machine). True when this call connected, so must disconnect."""
    import ray

    if ray.is_initialized():
        return False
    if not address:
        ray.init(address="local", include_dashboard=False)
        return True
    try:
        ray.init(address=address)
    except (ConnectionError, RuntimeError) as error:
        raise ConnectionError(
            f"trainer.ray_address={address}: cannot attach to a Ray cluster there ({str(error).splitlines()[0]}). "
            f"A cluster started by `ray start` checks a token: export RAY_AUTH_MODE=token and the cluster's "
            f"token (RAY_AUTH_TOKEN, or ~/.ray/auth_token of the head node) before starting the run"
        ) from error
    return True


def disconnect(connected: bool) -> None:
    import ray

    if connected and ray.is_initialized():
        ray.shutdown()


def _node_summary(nodes: List[dict]) -> str:
    return ", ".join(
        f"{n['NodeManagerAddress']}: {n['Resources'].get('CPU', 0):g} CPU, {n['Resources'].get('GPU', 0):g} GPU"
        for n in nodes
    )


def node_groups_that_fit(layout: WorkerLayout, resources: Dict[str, float]) -> int:
    """How many one-node groups of the layout a node with `resources` can hold."""
    per_node = layout.workers_per_node[0]
    return min(int(resources.get(key, 0) // (amount * per_node)) for key, amount in layout.bundle.items())


def check_resources(trainer: Any, layout: WorkerLayout) -> None:
    """Fail, naming the keys to change, when the cluster's nodes cannot hold the layout."""
    import ray

    nodes = [n for n in ray.nodes() if n["Alive"]]
    fitting = sum(node_groups_that_fit(layout, n["Resources"]) for n in nodes)
    if fitting >= len(layout.workers_per_node):
        return
    raise ResourcesUnavailable(
        f"the Ray cluster cannot hold the workers asked for: trainer.n_workers={trainer.n_workers}, "
        f"trainer.nnodes={trainer.nnodes}, trainer.n_gpus_per_node={trainer.n_gpus_per_node} ask for "
        f"{layout.request()}, but its nodes have {_node_summary(nodes)}. Lower trainer.n_workers or "
        f"trainer.n_gpus_per_node, or add machines to the cluster (ray start --address=...) and "
        f"attach with trainer.ray_address"
    )


def reserve(layout: WorkerLayout, timeout_s: float) -> list:
    """One placement group per node, ready within `timeout_s`, or ResourcesUnavailable;
    ordered by their node's address, as verl orders the groups it makes itself, so that
    ranks map to the nodes in the same order run after run."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    groups = [
        placement_group([dict(layout.bundle) for _ in range(n)], strategy="STRICT_PACK")
        for n in layout.workers_per_node
    ]
    ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout_s)
    if len(ready) == len(groups):
        return by_node_address(groups)
    for group in groups:
        remove_placement_group(group)
    raise ResourcesUnavailable(
        f"Ray did not place {layout.request()} within trainer.placement_timeout_s={timeout_s:g} s: the "
        f"cluster has the resources, but others hold them (available now: {ray.available_resources()}). "
        f"Wait for them, or lower trainer.n_workers / trainer.n_gpus_per_node"
    )


def by_node_address(groups: list) -> list:
    """Placement groups (each on one node: STRICT_PACK) sorted by their node's address."""
    import ray
    from ray.util.placement_group import placement_group_table

    address = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    return sorted(groups, key=lambda group: address[placement_group_table(group)["bundles_to_node_id"][0]])


def release(groups: list) -> None:
    from ray.util.placement_group import remove_placement_group

    for group in groups:
        remove_placement_group(group)
