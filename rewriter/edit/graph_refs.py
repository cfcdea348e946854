"""Names in a GraphDef: tensor references ("node:index", "node" for output 0) and which nodes depend on
which (``Ancestry``), shared by the edit (``rewriter.edit.graph_edit``, ``rewriter.edit.chain_order``) and the
checks of what ran (``rewriter.check.verification``, ``rewriter.check.recompute_check``)."""

from __future__ import annotations

from collections import defaultdict, deque


def parse_ref(name: str) -> tuple[str, int]:
    """A reference "node:index" (or "node") as (node, index); a control input keeps its "^"."""
    node, _, index = name.partition(":")
    return node, int(index) if index else 0


def tensor_ref(node: str, index: int) -> str:
    return node if index == 0 else f"{node}:{index}"


class Ancestry:
    """Which nodes of a GraphDef each node depends on (data or control), as Python-int bitsets."""

    def __init__(self, graph_def):
        nodes = list(graph_def.node)
        self.index = {node.name: i for i, node in enumerate(nodes)}
        parents = [[self.index[p] for p in (parse_ref(ref.lstrip("^"))[0] for ref in node.input) if p in self.index]
                   for node in nodes]
        children: list[list[int]] = [[] for _ in nodes]
        indegree = [len(p) for p in parents]
        for child, plist in enumerate(parents):
            for parent in plist:
                children[parent].append(child)
        queue = deque(i for i, count in enumerate(indegree) if count == 0)
        self.bits = [0] * len(nodes)
        while queue:
            i = queue.popleft()
            acc = 0
            for parent in parents[i]:
                acc |= self.bits[parent] | (1 << parent)
            self.bits[i] = acc
            for child in children[i]:
                indegree[child] -= 1
                if indegree[child] == 0:
                    queue.append(child)

    def depends(self, node: str, on: str) -> bool:
        """True when ``node`` runs after ``on`` (a path of data/control edges from ``on`` to ``node``)."""
        i, j = self.index.get(node), self.index.get(on)
        return i is not None and j is not None and bool(self.bits[i] >> j & 1)

    def latest(self, names: list[str]) -> list[str]:
        """Drop the names another name of the list already depends on (their edges would be redundant)."""
        return [a for a in names if not any(b != a and self.depends(b, a) for b in names)]


def cyclic_nodes(graph_def, merged: dict[str, str]) -> list[str] | None:
    """The nodes on or after a cycle of ``graph_def`` (sorted), with each node of ``merged`` taken as the one it
    maps to (Kahn's algorithm); None when it has none."""
    names = {node.name for node in graph_def.node}
    indegree = {merged.get(name, name): 0 for name in names}
    children: dict[str, list[str]] = defaultdict(list)
    for node in graph_def.node:
        target = merged.get(node.name, node.name)
        for ref in node.input:
            source = parse_ref(ref.lstrip("^"))[0]
            if source in names and merged.get(source, source) != target:
                children[merged.get(source, source)].append(target)
                indegree[target] += 1
    queue = deque(name for name, count in indegree.items() if count == 0)
    seen = 0
    while queue:
        name = queue.popleft()
        seen += 1
        for child in children[name]:
            indegree[child] -= 1
            if indegree[child] == 0:
                queue.append(child)
    return None if seen == len(indegree) else sorted(name for name, count in indegree.items() if count > 0)
