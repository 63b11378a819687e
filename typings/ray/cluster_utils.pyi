# ray.cluster_utils: a multi-node cluster started on one host, as the tests use it.
from typing import Any

class _Node:
    node_id: str

class Cluster:
    head_node: _Node
    address: str
    def __init__(self, initialize_head: bool = False, connect: bool = False,
                 head_node_args: dict[str, Any] | None = None,
                 shutdown_at_exit: bool = True) -> None: ...
    def add_node(self, wait: bool = True, **node_args: Any) -> _Node: ...
    def remove_node(self, node: _Node, allow_graceful: bool = True) -> None: ...
    def shutdown(self) -> None: ...
