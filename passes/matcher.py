"""An anchored FX subgraph matcher that says why a candidate did not match.

A pattern is a plain torch function (`search`) traced to a functionalised ATen graph with the same
decompositions the backend uses. Matching a candidate anchor (a graph node with the op of the pattern's first
output) runs in two phases, as Inductor's matcher does, but records the first step that failed:

1. structural: walk the pattern backwards from its first output and forwards from matched nodes to its other
   outputs, comparing ops, dtypes and non-numeric arguments; numbers (shapes, eps, ...) are not compared yet;
2. exact: re-trace `search` with fake tensors shaped like the bound inputs and match again, now comparing every
   scalar and shape list. A different eps therefore fails here, named as a scalar mismatch.

A match also fails when an interior node of the pattern has a user outside it ("extra user"), or when the
fusion's own `check` rejects the bound inputs (dtype, shape, token limit).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

ANY_STR = "__dsv41_any__"  # a string argument of a search function that matches any string (a group name)


@dataclass
class Pattern:
    """One formulation of a fusion's subgraph.

    `search(*tensors, **free)` returns a tensor or a tuple of tensors; `inputs()` builds small example tensors for
    the structural trace. `free` names the scalars that are not fixed by the fusion but read from the matched
    graph (e.g. the top-k width): name -> (op, occurrence, argument path) of the pattern node that carries it,
    the path an index or a tuple of indices into the node's args; `free_defaults` are their values for the
    structural trace. `variants` are further example-input builders, each traced as another structural form.
    """

    name: str
    search: Callable
    inputs: Callable[[], Sequence[torch.Tensor]]
    free: dict = field(default_factory=dict)
    free_defaults: dict = field(default_factory=dict)
    variants: tuple = ()  # more example-input builders: shapes (e.g. a dim of 1) at which the ops decompose differently

    def trace(self, args: Sequence, free: dict | None = None) -> fx.GraphModule:
        kwargs = dict(self.free_defaults if free is None else free)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            fn = torch.func.functionalize(lambda *a: self.search(*a, **kwargs), remove="mutations")
            gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="real")(*fake)
        from dsv41.passes.normalize import normalize_graph

        normalize_graph(gm.graph)
        gm.graph.eliminate_dead_code()
        return gm


@dataclass
class MatchResult:
    """A successful match: `inputs[i]` is the graph value bound to the pattern's i-th placeholder (a Node, a
    constant, or None), `outputs[i]` the graph node of the pattern's i-th output, `nodes` every matched node."""

    pattern: Pattern
    inputs: list
    outputs: list[fx.Node]
    nodes: list[fx.Node]
    free: dict


@dataclass
class MatchFailure:
    """How far a candidate got (`progress`, matched pattern nodes out of `total`) and the first step that failed."""

    pattern: str
    anchor: str
    progress: int
    total: int
    kind: str  # wrong op | argument | dtype | scalar | extra user | inconsistent input | check
    reason: str
    blocking: str | None = None


class _Fail(Exception):
    def __init__(self, kind: str, reason: str, blocking: fx.Node | None = None, progress: int = 0):
        super().__init__(reason)
        self.kind, self.reason, self.blocking, self.progress = kind, reason, blocking, progress


@dataclass
class _State:
    p2t: dict = field(default_factory=dict)  # pattern node -> graph node/value
    t2p: dict = field(default_factory=dict)  # graph node -> pattern node

    def copy(self) -> "_State":
        return _State(dict(self.p2t), dict(self.t2p))


def _fmt(n) -> str:
    if isinstance(n, fx.Node):
        target = n.target if n.op == "call_function" else n.op
        return f"%{n.name} = {getattr(target, '__name__', target)}"
    return repr(n)


def _op_name(target) -> str:
    return str(target) if not hasattr(target, "name") else target.name()


class _Matcher:
    def __init__(self, pattern_gm: fx.GraphModule, exact: bool):
        self.pg = pattern_gm.graph
        self.exact = exact
        self.placeholders = [n for n in self.pg.nodes if n.op == "placeholder"]
        out = next(n for n in self.pg.nodes if n.op == "output")
        outs = out.args[0]
        self.outputs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        self.call_nodes = [n for n in self.pg.nodes if n.op == "call_function"]

    # -- value comparison --------------------------------------------------------------------------------------
    def _match_arg(self, p, t, st: _State, where: str):
        if isinstance(p, fx.Node):
            return self._match_node(p, t, st)
        if isinstance(p, (list, tuple)):
            if not isinstance(t, (list, tuple)) or len(p) != len(t):
                if self.exact or not _is_numeric_seq(p):
                    raise _Fail("scalar" if _is_numeric_seq(p) else "argument", f"{where}: expected {p!r}, found {t!r}")
                return
            for i, (pa, ta) in enumerate(zip(p, t)):
                self._match_arg(pa, ta, st, f"{where}[{i}]")
            return
        if isinstance(p, str) and p == ANY_STR:
            return
        if isinstance(p, bool) or not isinstance(p, (int, float)):
            if isinstance(p, torch.device) or isinstance(t, torch.device):
                return  # patterns are traced on one device; the graph may be on another
            if p != t:
                raise _Fail("dtype" if isinstance(p, torch.dtype) else "argument", f"{where}: expected {p!r}, found {t!r}")
            return
        if isinstance(t, fx.Node):
            raise _Fail("argument", f"{where}: expected the constant {p!r}, found a tensor {_fmt(t)}", t)
        if not self.exact:
            return
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not _same_number(p, t):
            raise _Fail("scalar", f"{where}: expected {p!r}, found {t!r}")

    def _match_node(self, p: fx.Node, t, st: _State):
        if p in st.p2t:
            if st.p2t[p] is not t and not (not isinstance(t, fx.Node) and st.p2t[p] == t):
                raise _Fail("inconsistent input", f"pattern input {p.name} would bind both {_fmt(st.p2t[p])} and {_fmt(t)}",
                            t if isinstance(t, fx.Node) else None)
            return
        if p.op == "placeholder":
            if isinstance(t, fx.Node) and t in st.t2p:
                raise _Fail("inconsistent input", f"{_fmt(t)} is both inside the pattern and its input {p.name}", t)
            st.p2t[p] = t
            if isinstance(t, fx.Node):
                st.t2p[t] = p
            return
        if not isinstance(t, fx.Node) or t.op != "call_function":
            raise _Fail("argument", f"expected {_op_name(p.target)}, found {_fmt(t)}", t if isinstance(t, fx.Node) else None)
        if t.target != p.target:
            raise _Fail("wrong op", f"expected {_op_name(p.target)}, found {_fmt(t)}", t)
        if t in st.t2p:
            raise _Fail("inconsistent input", f"{_fmt(t)} matched twice", t)
        st.p2t[p] = t
        st.t2p[t] = p
        if len(p.args) != len(t.args):
            raise _Fail("argument", f"{_fmt(t)}: {len(t.args)} arguments, pattern has {len(p.args)}", t)
        for i, (pa, ta) in enumerate(zip(p.args, t.args)):
            self._match_arg(pa, ta, st, f"{_fmt(t)} argument {i}")
        for k, pa in p.kwargs.items():
            self._match_arg(pa, t.kwargs.get(k), st, f"{_fmt(t)} keyword {k}")

    # -- the whole pattern -------------------------------------------------------------------------------------
    def run(self, anchor: fx.Node, st: _State) -> _State:
        self._match_node(self.outputs[0], anchor, st)
        return self._extend(st)

    def _extend(self, st: _State) -> _State:
        """Match the pattern nodes not reached backwards from the anchor by trying users of matched nodes."""
        todo = [n for n in self.call_nodes if n not in st.p2t]
        if not todo:
            return st
        p = next((n for n in todo if any(isinstance(a, fx.Node) and a in st.p2t for a in n.all_input_nodes)), None)
        if p is None:
            raise _Fail("argument", f"pattern nodes {[n.name for n in todo]} are disconnected from the anchor")
        seed = next(a for a in p.all_input_nodes if a in st.p2t)
        t_seed = st.p2t[seed]
        if not isinstance(t_seed, fx.Node):
            raise _Fail("argument", f"{_op_name(p.target)} consumes a constant input")
        deepest: _Fail | None = None
        for cand in t_seed.users:
            if cand.op != "call_function" or cand.target != p.target or cand in st.t2p:
                continue
            trial = st.copy()
            try:
                self._match_node(p, cand, trial)
                return self._extend(trial)
            except _Fail as e:
                e.progress = max(e.progress, self.progress(trial))
                if deepest is None or e.progress > deepest.progress:
                    deepest = e
        if deepest is None:
            raise _Fail("wrong op", f"no user of {_fmt(t_seed)} is {_op_name(p.target)}", t_seed, self.progress(st))
        raise deepest

    def progress(self, st: _State) -> int:
        return sum(1 for n in self.call_nodes if n in st.p2t)


def _is_numeric_seq(x) -> bool:
    return all(isinstance(v, (int, float, torch.SymInt)) and not isinstance(v, bool) for v in x)


def _same_number(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    a, b = float(a), float(b)
    if math.isinf(a) or math.isnan(a):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b or abs(a - b) <= 1e-9 * max(abs(a), abs(b))


def _fake_like(v):
    val = v.meta.get("val") if isinstance(v, fx.Node) else v
    if isinstance(val, torch.Tensor):
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
    return val


def _meta_key(a):
    if isinstance(a, torch.Tensor):
        return (tuple(a.shape), tuple(a.stride()), a.dtype)
    return a


class PatternSet:
    """The formulations of one fusion, traced once (structural phase) and re-traced per exact check."""

    def __init__(self, patterns: Sequence[Pattern]):
        self.patterns = list(patterns)
        self._structural = {p.name: [p.trace(build()) for build in (p.inputs, *p.variants)] for p in self.patterns}
        self._exact: dict[tuple, fx.GraphModule] = {}  # (pattern, input metadata, free scalars) -> exact trace

    def anchors(self, graph: fx.Graph, index: int) -> list[fx.Node]:
        """Graph nodes with the op of pattern `index`'s first output, in graph order."""
        targets = []
        for gm in self._structural[self.patterns[index].name]:
            out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
            first = out[0] if isinstance(out, (tuple, list)) else out
            if first.target not in targets:
                targets.append(first.target)
        found = {n for t in targets for n in graph.find_nodes(op="call_function", target=t)}
        return [n for n in graph.nodes if n in found]

    def match_one(self, index: int, anchor: fx.Node) -> MatchResult | MatchFailure:
        return self._match_one(self.patterns[index], anchor)

    def _match_one(self, pat: Pattern, anchor: fx.Node) -> MatchResult | MatchFailure:
        failure = None
        for gm in self._structural[pat.name]:
            structural = _Matcher(gm, exact=False)
            st = _State()
            total = len(structural.call_nodes)
            try:
                st = structural.run(anchor, st)
                break
            except _Fail as e:
                progress = max(structural.progress(st), e.progress)
                if failure is None or progress / total > failure.progress / failure.total:
                    failure = MatchFailure(pat.name, anchor.name, progress, total, e.kind, e.reason, e.blocking and e.blocking.name)
        else:
            return failure
        bound = [st.p2t.get(p) for p in structural.placeholders]
        symbolic = next((b for b in bound if isinstance(b, fx.Node) and isinstance(b.meta.get("val"), torch.Tensor)
                         and not all(isinstance(d, int) for d in b.meta["val"].shape)), None)
        if symbolic is not None:
            return MatchFailure(pat.name, anchor.name, total, total, "check",
                                f"input {_fmt(symbolic)} has a symbolic shape {list(symbolic.meta['val'].shape)}: decode "
                                "fusions need static shapes (compile with dynamic=False)", symbolic.name)
        free = {}
        for name, (op, occurrence, path) in pat.free.items():
            carriers = [p for p in structural.call_nodes if p.target == op]
            value = st.p2t[carriers[occurrence]].args
            for i in (path if isinstance(path, tuple) else (path,)):
                value = value[i]
            if not isinstance(value, int):
                return MatchFailure(pat.name, anchor.name, total, total, "check", f"{name} is {value!r}, not a static int")
            free[name] = value
        args = [_fake_like(b) for b in bound]
        key = (pat.name, tuple(_meta_key(a) for a in args), tuple(sorted(free.items())))
        if key not in self._exact:
            try:
                self._exact[key] = pat.trace(args, free)
            except Exception as e:  # the search function rejects these shapes: not this pattern
                return MatchFailure(pat.name, anchor.name, total, total, "check", f"re-trace with the matched shapes failed: {e}")
        exact_gm = self._exact[key]
        exact = _Matcher(exact_gm, exact=True)
        st2 = _State()
        try:
            st2 = exact.run(anchor, st2)
        except _Fail as e:
            return MatchFailure(pat.name, anchor.name, exact.progress(st2), total, e.kind, e.reason, e.blocking and e.blocking.name)
        inside = {t for p, t in st2.p2t.items() if p.op == "call_function"}
        outputs = [st2.p2t[o] for o in exact.outputs]
        for t in inside:
            if t in outputs:
                continue
            for user in t.users:
                if user not in inside:
                    return MatchFailure(pat.name, anchor.name, total, total, "extra user",
                                        f"{_fmt(t)} inside the pattern is also used by {_fmt(user)}", user.name)
        inputs = [st2.p2t.get(p) for p in exact.placeholders]
        nodes = [n for n in anchor.graph.nodes if n in inside]
        return MatchResult(pat, inputs, outputs, nodes, free)
