"""What of the plan's recomputations (``rewriter.edit.recompute_clones``) survived Grappler: the clones that still
run, the far reads they still serve, their trigger edges. Grappler's common-subgraph elimination would
merge a clone back into its original, saving nothing; ``rewriter.check.verification`` reports this beside the swaps.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from rewriter.check.collected import grappler_renames, pick_function_graph
from rewriter.edit.graph_refs import Ancestry, parse_ref
from rewriter.edit.recompute_clones import CLONE_ATTR, AppliedRecompute
from simulator.recompute.actions import CLONE_MARK, original_name


@dataclass
class RecomputeVerification:
    """What of the recomputations ran, read from the collected graphs of the step's first call.

    A clone is *lost* when it is gone while its original still runs (Grappler merged it back: the
    original's buffer stays alive for the far readers); one gone together with its original was
    fused or folded like it (a remapper fusion is named after its chain's last op, a multiplication
    by one is removed, a value known statically becomes a constant), which changes nothing. A far
    read is *lost* when the reader no longer reads a clone of its recomputation and no other node
    does in its place. An original is lost when its node is gone while its clone runs (merged into
    the clone: the near readers would wait for the recomputation). A clone still in Grappler's output
    but not among the nodes that run was merged into the clone reading it by a pass after Grappler
    (oneDNN's layout pass merges a Conv2D into its BiasAdd when the two have the same control inputs,
    which a clone pair has and its original, chained, may not): neither lost nor merged back.
    """

    planned_clones: int
    planned_reads: int
    planned_controls: int
    clones: int = 0  # listed ops' clones running under their own or a Grappler name
    clones_renamed: list[str] = field(default_factory=list)  # "clone -> new name"
    clones_gone_with_original: list[str] = field(default_factory=list)  # fused or folded like the original
    # kept by Grappler, then merged into the clone reading it by a pass after Grappler (oneDNN's layout pass:
    # Conv2D+BiasAdd); the merged node computes it, as the original's merged node or unmerged pair does
    clones_merged_forward: list[str] = field(default_factory=list)
    clones_lost: list[str] = field(default_factory=list)
    originals_lost: list[str] = field(default_factory=list)
    reads: int = 0  # far reads served by a clone
    reads_renamed: list[str] = field(default_factory=list)  # another node reads the clone in the reader's place
    # (the reader merged with another far reader that computes the same, fused, or its product rewritten)
    reads_folded: list[str] = field(default_factory=list)  # the reader became a constant: it reads nothing
    reads_lost: list[str] = field(default_factory=list)  # "reader:slot (reads x)"
    controls_kept: int = 0  # control inputs still direct inputs of the clones that start a recomputation
    controls_implied: int = 0  # removed as redundant: the clone still runs after the source
    controls_lost: list[str] = field(default_factory=list)  # "clone <- source": it need not wait any more
    controls_folded: list[str] = field(default_factory=list)  # "clone <- source": Grappler removed the source
    collected: bool = True

    @property
    def ok(self) -> bool:
        return self.collected and not (self.clones_lost or self.originals_lost or self.reads_lost
                                       or self.controls_lost or self.controls_folded)

    def problem_items(self) -> list[tuple[str, list[str]]]:
        """(what went wrong, the names it happened to)."""
        items = [] if self.collected else [("no optimized graph of the step was collected (it had run before "
                                            "verification)", [])]
        for label, names in (("clone(s) merged back into their original", self.clones_lost),
                             ("original(s) merged into their clone", self.originals_lost),
                             ("far read(s) no longer served by a clone", self.reads_lost),
                             ("trigger edge(s) of clones dropped", self.controls_lost),
                             ("trigger op(s) of clones folded away", self.controls_folded)):
            if names:
                items.append((f"{len(names)} {label}", list(names)))
        return items

    def problems(self) -> list[str]:
        """Each problem with up to ten of its names (for the report)."""
        return [label + (f": {', '.join(names[:10])}" if names else "") for label, names in self.problem_items()]

    def counts(self) -> str:
        return (f"clones {self.clones}/{self.planned_clones} ({len(self.clones_gone_with_original)} fused or folded "
                f"with their original, {len(self.clones_merged_forward)} merged into the clone reading them), "
                f"far reads served {self.reads}/{self.planned_reads} "
                f"({len(self.reads_folded)} readers folded), trigger edges "
                f"{self.controls_kept}+{self.controls_implied} implied/{self.planned_controls}")

    def summary(self) -> str:
        problems = self.problems()
        return self.counts() + ("" if not problems else "; " + "; ".join(problems))

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__) | {"ok": self.ok}


def recompute_names(applied: Sequence[AppliedRecompute]) -> set[str]:
    """Nodes that tell the step's function graph apart: clones, far readers, originals."""
    return {name for item in applied for name in (*item.nodes, *(c for c, _ in item.rewired), parse_ref(item.tensor)[0])}


def check_recomputes(function_graphs, applied: Sequence[AppliedRecompute]) -> RecomputeVerification:
    """Compare the collected graphs of one step (``rewriter.check.collected.collect_first_call``) with the
    recomputations ``apply_recomputes`` built: on the partition graphs (what runs), with the
    post-optimization graph for Grappler's renames and the control edges' ancestry. A clone is found
    by name, by Grappler's rename of it, or by the ``CLONE_ATTR`` it carries."""
    result = RecomputeVerification(planned_clones=sum(len(item.ops) for item in applied),
                                   planned_reads=sum(len(item.rewired) for item in applied),
                                   planned_controls=sum(len(item.controls) * len(item.starts) for item in applied))
    fg = pick_function_graph(function_graphs, recompute_names(applied))
    if fg is None:
        result.collected = False
        return result
    post = {node.name: node for node in fg.post_optimization_graph.node}
    running = {node.name: node for partition in fg.partition_graphs for node in partition.node} or post
    renamed = grappler_renames(running)
    renamed.update({node.attr[CLONE_ATTR].s.decode(): name for name, node in running.items()
                    if CLONE_ATTR in node.attr and node.attr[CLONE_ATTR].s.decode() != name})
    ancestry = Ancestry(fg.post_optimization_graph)

    def runs(name: str) -> str | None:
        """The name it runs under, if it still computes something (a node made a constant does not)."""
        now = name if name in running else renamed.get(name)
        return None if now is None or running[now].op == "Const" else now

    def folded(name: str) -> bool:
        now = name if name in running else renamed.get(name)
        return now is not None and running[now].op == "Const"

    recv_source = {node.name: node.attr["tensor_name"].s.decode().split(":")[0]
                   for node in running.values() if node.op == "_Recv" and "tensor_name" in node.attr}
    readers_of: dict[str, list[str]] = {}  # node -> running nodes reading it, once per input (through a _Recv)
    for node in running.values():
        for ref in node.input:
            if not ref.startswith("^"):
                source = parse_ref(ref)[0]
                readers_of.setdefault(recv_source.get(source, source), []).append(node.name)
    post_readers: dict[str, set[str]] = {}  # node -> nodes reading it in Grappler's output
    for node in post.values():
        for ref in node.input:
            if not ref.startswith("^"):
                post_readers.setdefault(parse_ref(ref)[0], set()).add(node.name)
    for item in applied:
        clones = set(item.nodes)
        for clone in item.ops:
            now = runs(clone)
            if now is not None:
                result.clones += 1
                if now != clone:
                    result.clones_renamed.append(f"{clone} -> {now}")
            elif runs(original_name(clone)) is None:
                result.clones_gone_with_original.append(clone)
            elif clone in post and post_readers.get(clone) and all(
                    reader in clones and runs(reader) is not None for reader in post_readers[clone]):
                result.clones_merged_forward.append(clone)
            else:
                result.clones_lost.append(clone)
        producer = parse_ref(item.tensor)[0]
        if runs(producer) is None and not folded(producer) and runs(parse_ref(item.clone)[0]) is not None:
            result.originals_lost.append(producer)
        mark = f"{CLONE_MARK}{item.index}"
        serving = [name for name, node in running.items()
                   if name.endswith(mark) or (CLONE_ATTR in node.attr and node.attr[CLONE_ATTR].s.decode().endswith(mark))]
        found = Counter(reader for name in serving for reader in readers_of.get(name, ()) if reader not in serving)
        planned = {runs(consumer) for consumer, _ in item.rewired}
        unplanned = sum(count for name, count in found.items() if name not in planned)
        for consumer, slot in item.rewired:
            now = runs(consumer)
            if now is not None and found[now] > 0:
                found[now] -= 1
                result.reads += 1
            elif folded(consumer):
                result.reads_folded.append(f"{consumer}:{slot}")
            elif (now is None and found) or unplanned > 0:
                # the reader is gone (merged with another far reader computing the same, or fused) while the
                # clone is read, or Grappler rewrote the product and another node reads the clone in its place
                unplanned -= now is not None
                result.reads += 1
                others = sorted(name for name in found if name not in planned) or sorted(found)
                result.reads_renamed.append(f"{consumer}:{slot} -> {', '.join(others[:2])}")
            else:
                reads = [ref for ref in (running[now].input if now is not None else ()) if not ref.startswith("^")]
                result.reads_lost.append(f"{consumer}:{slot} (reads {', '.join(reads[:3]) or 'nothing: gone'})")
        for clone in item.starts:
            now = runs(clone)
            if now is None:
                continue  # fused or folded: counted above
            direct = {recv_source.get(ref[1:], ref[1:]) for ref in running[now].input if ref.startswith("^")}
            for source in item.controls:
                source_now = source if source in running or source in post else renamed.get(source)
                if source_now is None:
                    result.controls_folded.append(f"{clone} <- {source}")
                elif source_now in direct:
                    result.controls_kept += 1
                elif ancestry.depends(now, source_now):
                    result.controls_implied += 1
                else:
                    result.controls_lost.append(f"{clone} <- {source}")
    return result
