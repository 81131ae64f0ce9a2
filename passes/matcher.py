"""An anchored FX subgraph matcher that finds a fusion by what it computes and says why a candidate did not match.

A pattern is a plain torch function (`search`) traced to a functionalised ATen graph with the same
decompositions and normalisation (`dsv41.passes.normalize`) the backend applies to the graph. A candidate is a
graph node with the pattern's distinctive op (`Pattern.anchor`: top-k, sort, rsqrt, index_add, ...). From it the
matcher looks downstream for the pattern output that depends on the anchor and walks the pattern backwards from
there, in two phases as Inductor's matcher does:

1. structural: compare ops, dtypes and non-numeric arguments; numbers (shapes, eps, ...) are not compared yet;
2. exact: re-trace `search` with fake tensors shaped like the bound inputs and match again, now comparing every
   scalar and shape list (but for the shape of a view that is a pattern output, which the graph may view to any
   shape of its elements: the op's output is then viewed to the graph's shape; and the number operand of an fp32 add/sub/mul/div compares as the fp32 value it enters
   the arithmetic as). A different eps therefore fails here, named as a scalar mismatch.

Both phases treat commutative ops (`COMMUTATIVE`) as unordered; a match that chose an order where the other could
also fit is retried in the other order, one op at a time (`PatternSet._match_one`). Where the graph computes a
pattern value with other ops (`exp2(ceil(log2(a)))` for a bit-manipulated power of two, stride-2 slices for
unflatten + select, ...), the walk does not stop: the graph node is recorded as an *island* whose value stands for
the pattern node's, closed by walking its graph ancestors back to values the match has bound (or to a graph value
whose dtype and rank fit an input the pattern has not bound yet). A match with islands is accepted only after the
fusion's semantic check (`dsv41.passes.fusion`): the matched region and the fused op's reference run on fresh
random inputs and agree. The island's first differing op is what a decline names.

Inputs bind through layout: a pattern input the pattern views (only adding or dropping size-1 dims, maybe after
a negation or cast) may bind a graph value that has that layout already (`_input_in_layout`), and an input read
through a graph view of another shape binds that view's source; the op then takes it reshaped to its declared
shape (`_layout_derived`), and a narrower float input that the pattern only promotes in pointwise ops takes it
cast to the declared dtype (`_promoted`, exact: the ops promote it so). An input the pattern reads only through
views binds a graph value of higher rank without its non-leading size-1 dims (a `[B, 1, hc, D]` input read as
`[T, hc, D]`), a weight the pattern transposes binds a graph input stored in that layout, or a view of one (a
flat parameter viewed `[E, D, 2I]`; the op takes it back through views, in place: `_input_in_inverse_layout`), and a
pattern view of a bound input matches a graph view of that input's view root (`view(ids, [M])` and `view(ids,
[M, 1])` of one `[T, k]` ids: `_views_of_one_root`; the other outputs are also searched from the root). An input
the pattern reads only in pointwise ops that broadcast it (maybe through casts) against an operand of the result's
rank binds a graph value with more leading size-1 dims without them (`_without_broadcast_units`: at one token a
`[1, 1, D]` value times `[1, hc, 1]` weights is the product of the pattern's `[1, D]`). A
pattern output that the graph views to another shape (with more size-1 dims, or leading dims merged: `[T, k, D]`
read as `[T k, D]` rows) is viewed so after the op (`_same_elements`).

A pattern value read twice may be two graph nodes that repeat one op on the same operands (`_repeats`: a scale
viewed once for the quotient and again for the product); both lie in the region.

A match also fails when an interior node of the pattern has a user outside it ("extra user"; but for a value the
pattern declares an optional output, which the op then also returns, and for a layout op of bound inputs, which the
replacement leaves in place for its other readers: `MatchResult.kept`), or when the fusion's own `check` rejects
the bound inputs (dtype, shape, token limit).

A failure (`MatchFailure`) names the first op where the site differs from the pattern, inside the site's own
region: the graph op compared there (`blocking`, `found`), the pattern's op (`expected`) and the matched graph
node next to it (`beside`). A walk back from an output candidate downstream of the anchor may start in another
sublayer (the site writes its own output another way, and the nearest op of that kind is the next sublayer's); its
failure counts only where it lies in the anchor's site (`_Matcher.in_site`). One that failed on a branch away from
the anchor first is walked again toward it (`run_toward`); where no walk from an output fails in the site, the walk
from the anchor itself (`diverge`: backwards, then forwards over the readers of matched ops) names the op where
the graph goes on another way.

Costs: an island's closure tests are shared by the patterns of a pass until a replacement changes the graph, the
nearest bindings skip those already tried farthest first, and the shape trace of a binding creates its fake
inputs inside the fake mode rather than converting meta tensors.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from dsv41.passes.normalize import _LAYOUT_OPS, normalize_graph, position as _position, view_root

ANY_STR = "__dsv41_any__"  # a string argument of a search function that matches any string (a group name)


aten = torch.ops.aten
# Ops whose two tensor operands the matcher pairs in either order (with no keyword argument, so no `alpha`): those
# whose result is the same bit for bit either way. IEEE add and mul round the exact sum or product, which does not
# depend on the order, and a sum of zeros of opposite sign is +0 either way; a NaN operand gives a NaN either way
# (which NaN's payload is not fixed). Comparisons for equality and the bitwise and logical and / or / xor are symmetric.
# Not maximum / minimum: where the operands are zeros of opposite sign torch returns the first (maximum(-0., 0.) is
# -0., maximum(0., -0.) is 0.), so a swapped one is a part computed another way, which the semantic check decides.
COMMUTATIVE = frozenset({aten.add.Tensor, aten.mul.Tensor, aten.eq.Tensor, aten.ne.Tensor, aten.bitwise_and.Tensor,
                         aten.bitwise_or.Tensor, aten.bitwise_xor.Tensor, aten.logical_and.default,
                         aten.logical_or.default, aten.logical_xor.default})
# Layout ops that only reshape (normalize's layout ops but the permute): one the graph or the pattern lacks is skipped
_RESHAPES = frozenset(_LAYOUT_OPS) - {aten.permute.default}
_CONE = 2000         # graph nodes searched downstream of an anchor for the pattern's output
_ISLAND_NODES = 160  # graph nodes one island may hold
_STEPS = 20_000      # node comparisons one match attempt may make
_SEPARATE = 48       # candidates (nearest in graph order) for an output that shares no input with the rest
_OUTPUTS = 12        # graph nodes (nearest downstream of the anchor) tried as the pattern's first output
_NEAR_TRIES = 16     # bindings nearest to an island tried when none farthest from it fits
_ALTERNATIVES = 12   # other bindings of an island's unbound inputs kept for the semantic check to choose among
_TRIES = 64          # bindings (farthest from an island first) tried for its unbound inputs
_FLIPS = 8           # whole-match retries, each taking the other operand order at one commutative op (`_Matcher.flip`)


@dataclass
class Pattern:
    """One formulation of a fusion's subgraph.

    `search(*tensors, **free)` returns a tensor or a tuple of tensors; `inputs()` builds small example tensors for
    the structural trace. `anchor` is the distinctive op (or ops) candidates are found by; None: the op of the
    first output. `guard` rejects bindings that fit the ops but not the fusion (two unrelated norms as q and kv).
    `free` names the scalars that are not fixed by the fusion but read from the matched graph (the top-k width, a
    scale: an int or a float, as its default is): name -> (op, occurrence, argument path) of the pattern node that
    carries it, the path an index or a tuple of indices into the node's args; `free_defaults` are their values for
    the structural trace. `variants` are further example-input builders, each traced as another structural form.
    `form` says which formulation of its fusion this is, as a frozen dataclass of the pass's own
    (`FusionPass.form_type`, one field per axis in which its formulations differ): what the pass's replacement,
    check, token count and draws read. `name` only names the formulation in reports; nothing depends on its spelling.
    """

    name: str
    search: Callable
    inputs: Callable[[], Sequence[torch.Tensor]]
    free: dict = field(default_factory=dict)
    free_defaults: dict = field(default_factory=dict)
    variants: tuple = ()  # more example-input builders: shapes (e.g. a dim of 1) at which the ops decompose differently
    anchor: object = None
    guard: Callable | None = None  # bound graph inputs -> None, or why they are not this pattern's (not a decline)
    # the last `optional_outputs` outputs of `search` are values inside the region that the op can also return:
    # where the graph reads one outside the region it is an output of the match (`MatchResult.exposed`), else
    # not, and any other interior value read outside is an extra user
    optional_outputs: int = 0
    form: object = None  # an instance of the fusion pass's `form_type` (None for a pattern outside a fusion pass)

    def trace(self, args: Sequence, free: dict | None = None) -> fx.GraphModule:
        kwargs = dict(self.free_defaults if free is None else free)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = [_to_fake(mode, a) for a in args]
            fn = torch.func.functionalize(lambda *a: self.search(*a, **kwargs), remove="mutations")
            gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="real")(*fake)
        normalize_graph(gm.graph)
        gm.graph.eliminate_dead_code()
        return gm

    def input_names(self) -> list[str]:
        """The search function's tensor parameter names, in placeholder order."""
        return [n for n, p in inspect.signature(self.search).parameters.items()
                if n not in self.free_defaults and p.kind is not p.VAR_KEYWORD]


@dataclass
class MatchResult:
    """A successful match: `inputs[i]` is the graph value bound to the pattern's i-th placeholder (a Node, a
    constant, or None), `outputs[i]` the graph node of the pattern's i-th output, `nodes` every graph node of the
    region (matched ones and island interiors), `islands` (pattern op, graph node, the structural failure there)
    where the graph computes a pattern value with other ops: such a match needs the semantic check."""

    pattern: Pattern
    inputs: list
    outputs: list[fx.Node]
    nodes: list[fx.Node]
    free: dict
    islands: list = field(default_factory=list)
    # () -> further MatchResults of the same site, an island's unbound inputs bound to other graph values that fit
    # (nearest to the island first); the semantic check tries them in order when this binding disagrees
    alternatives: Callable | None = None
    # per optional output of the pattern: whether the graph reads it outside the region (then it is in `outputs`)
    exposed: tuple = ()
    # the region's graph nodes inside islands (computed another way than the pattern writes them)
    another_way: frozenset = frozenset()
    # the region's layout ops of bound inputs that the graph also reads outside it: left in place, not erased
    kept: frozenset = frozenset()
    # where this match takes the other operand order at a commutative op after the walk in the preferred orders
    # failed (`PatternSet._match_one`): that failure, which a decline of this match reports in its place
    instead: MatchFailure | None = None


@dataclass
class MatchFailure:
    """How far a candidate got (`progress`, matched pattern nodes out of `total`) and the first step that failed."""

    pattern: str
    anchor: str
    progress: int
    total: int
    # wrong op | argument | dtype | scalar | extra user | inconsistent input | check | semantic | graph input (a graph
    # input where the pattern has an op; "graph break" where Dynamo has recorded breaks: `dsv41.passes.fusion`)
    kind: str
    reason: str
    blocking: str | None = None
    # the first differing op: the pattern's op and the graph's there (an op name, "placeholder", a constant's repr,
    # or None: nothing, e.g. no node downstream), where the failure is a comparison of the two
    expected: str | None = None
    found: str | None = None
    module: str | None = None  # the anchor's module path (`layers.3.attn`), where the graph records it
    # the matched graph node next to the first differing op: the one that reads it (the walk backwards from an
    # output) or that it reads (the walk forwards from the anchor, `_Matcher.diverge`); None where there is none
    beside: str | None = None


def _failure(pattern: str, anchor: fx.Node, progress: int, total: int, e: "_Fail") -> MatchFailure:
    """The MatchFailure of pattern at anchor that the matcher's failure `e` ends."""
    return MatchFailure(pattern, anchor.name, progress, total, e.kind, e.reason, e.blocking and e.blocking.name,
                        e.expected, e.found, beside=e.beside and e.beside.name)


class _Fail(Exception):
    def __init__(self, kind: str, reason: str, blocking: fx.Node | None = None, progress: int = 0,
                 expected: str | None = None, found: str | None = None):
        super().__init__(reason)
        self.kind, self.reason, self.blocking, self.progress = kind, reason, blocking, progress
        self.expected, self.found = expected, found  # set by the innermost node comparison that failed (`_match_node`)
        # where it failed, set with expected / found: the pattern node and the graph node compared there (None: a
        # constant, or nothing), the matched graph node whose operand that is, and the walk's partial match then
        # (graph node -> pattern node; the walk's own dict, which nothing changes after the failure: each walk that
        # fails is dropped)
        self.pattern_node: fx.Node | None = None
        self.node: fx.Node | None = None
        self.beside: fx.Node | None = None
        self.matched: dict | None = None

    def at(self, pattern_node: fx.Node | None, node, beside: fx.Node | None, matched: dict) -> "_Fail":
        """Set where the failure is (see __init__); returns self."""
        self.pattern_node, self.node = pattern_node, node if isinstance(node, fx.Node) else None
        self.beside, self.matched = beside, matched
        return self


def _site_nodes(anchor: fx.Node, matched: dict) -> set[fx.Node]:
    """`anchor` and the graph ops of the partial match `matched` (graph node -> pattern node) connected to it through
    matched ops (each reads or is read by the next): a bound input of the pattern joins nothing (two sublayers read
    one hidden state)."""
    def interior(n) -> bool:
        p = matched.get(n)
        return n.op == "call_function" and p is not None and p.op == "call_function"

    site, stack = {anchor}, [anchor]
    while stack:
        n = stack.pop()
        for m in (*n.all_input_nodes, *n.users):
            if m not in site and interior(m):
                site.add(m)
                stack.append(m)
    return site


@dataclass
class _State:
    p2t: dict = field(default_factory=dict)  # pattern node -> graph node/value
    t2p: dict = field(default_factory=dict)  # graph node -> pattern node
    islands: list = field(default_factory=list)  # (pattern node, graph node, the failure that opened it)
    rebindings: list = field(default_factory=list)  # per island with unbound inputs: (inputs, island, bound, choices)
    # pattern input -> (the shape of the pattern's view of it, the graph's shape there) where the graph has that
    # layout without the view (`_input_in_layout`)
    layouts: dict = field(default_factory=dict)

    def copy(self) -> "_State":
        return _State(dict(self.p2t), dict(self.t2p), list(self.islands), list(self.rebindings), dict(self.layouts))

    def assign(self, other: "_State") -> None:
        self.p2t, self.t2p, self.islands, self.rebindings = other.p2t, other.t2p, other.islands, other.rebindings
        self.layouts = other.layouts


def _fmt(n) -> str:
    if isinstance(n, fx.Node):
        target = n.target if n.op == "call_function" else n.op
        return f"%{n.name} = {getattr(target, '__name__', target)}"
    return repr(n)


def _op_name(target) -> str:
    return str(target) if not hasattr(target, "name") else target.name()


def _what(n) -> str:
    """What a pattern or graph value is, for a failure's first differing op: an op's name, a graph input
    ("placeholder"), a constant's repr."""
    if isinstance(n, fx.Node):
        return _op_name(n.target) if n.op == "call_function" else n.op
    return repr(n)


def _dtype(n: fx.Node):
    """The dtype of n's value (None when it is not a tensor)."""
    v = n.meta.get("val")
    return v.dtype if isinstance(v, torch.Tensor) else None


def _is_input(n) -> bool:
    return isinstance(n, fx.Node) and n.op in ("placeholder", "get_attr")


def _view_of_input(n) -> bool:
    """n is a view of a graph input (a weight stored flat and viewed where it is used)."""
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target is aten.view.default and _is_input(n.args[0])


class _Matcher:
    def __init__(self, pattern_gm: fx.GraphModule, exact: bool, islands: bool = True, traces=None, optional: int = 0,
                 closure_cache: dict | None = None, flip: frozenset = frozenset()):
        self.pg = pattern_gm.graph
        self.closure_cache = closure_cache  # (island node, bound nodes) -> closes(combo); None: not kept
        self.optional = optional  # the last outputs are interior values, matched where the rest binds them
        self.exact = exact
        self.traces = traces  # bound inputs -> whether the pattern traces at their shapes (None: not checked)
        self.placeholders = [n for n in self.pg.nodes if n.op == "placeholder"]
        out = next(n for n in self.pg.nodes if n.op == "output")
        outs = out.args[0]
        self.outputs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        self.call_nodes = [n for n in self.pg.nodes if n.op == "call_function"]
        # a commutative pattern op by (op, occurrence among the pattern's ops of that op): one op of the structural
        # trace and of the exact trace alike
        occurrences = collections.Counter()
        self.keys = {}
        for n in self.call_nodes:
            self.keys[n] = (n.target, occurrences[n.target])
            occurrences[n.target] += 1
        self.flip = flip  # keys of the commutative ops at which the walk takes the order it would not take
        self.choices: list = []  # keys of the commutative ops where the other order could also have matched
        # the same keys, gathered since the caller last emptied it, from every walk (`run_toward`'s too, whose choice
        # points `choices` drops): a walk that met none of `flip` here with another order that fits walks the same
        # way under that flip (`PatternSet._structural_match` replays it)
        self.touched: set = set()
        self.islands_on = islands
        self.steps = 0
        self.fp32_scalars = False  # the node being compared computes in fp32: its numbers compare as fp32 values
        self.path: list = []  # the graph values being compared, outermost first (`_match_node`)
        # pattern nodes whose operands the walk compares first: those that reach the anchor's op (`toward`)
        self.first: frozenset = frozenset()
        self.relations: dict = {}  # ("toward" | "upward", anchor op) -> pattern nodes (`toward`, `upward`)

    def _ordered(self, ps, ts) -> list:
        """(index, pattern argument, graph argument) pairs in the order the walk compares them: as written, but for
        those that reach a node of `self.first`, which come first (a list argument reaches one if an item does)."""
        pairs = list(zip(range(len(ps)), ps, ts))
        if self.first:
            pairs.sort(key=lambda x: not any(a in self.first for a in leaves(x[1])))
        return pairs

    def toward(self, target) -> frozenset:
        """The pattern nodes whose value depends on a pattern op with `target` (those ops included); cached."""
        if ("toward", target) not in self.relations:
            reach: set = set()
            for n in self.pg.nodes:  # operands before users
                if n.op == "call_function" and (n.target == target or any(a in reach for a in n.all_input_nodes)):
                    reach.add(n)
            self.relations["toward", target] = frozenset(reach)
        return self.relations["toward", target]

    def upward(self, target) -> frozenset:
        """The pattern nodes that a pattern op with `target` depends on (its operands, theirs, ...); cached."""
        if ("upward", target) not in self.relations:
            self.relations["upward", target] = frozenset(
                a for n in self.call_nodes if n.target == target for a in _ancestors(n, stop=lambda _: False)[1:])
        return self.relations["upward", target]

    def in_site(self, e: "_Fail", anchor: fx.Node) -> bool:
        """Whether failure e lies in the region of `anchor`'s site. Where it names a graph op: that op is the anchor,
        or one of the matched ops connected to the anchor through matched ops (`_site_nodes`), or reads or is read by
        one of those; or, where the pattern op expected there neither depends on the anchor's op nor is depended on
        by it (a second branch from the pattern's inputs: the counts of the ids that the anchor sorts), the graph op
        is so too, and reads a value the match has bound to a pattern input, or the root that value views (a
        sibling of the site from its own inputs; an op of the sublayer before or after is the anchor's ancestor or
        descendant). Where it names none (no op found downstream), the partial match must hold the anchor. A walk
        back from an output found downstream of the anchor in another sublayer (the router's where, where the
        site's own output is written another way) fails there: not this site's difference."""
        if e.matched is None:
            return False
        t = e.node
        if t is None:
            return anchor in e.matched
        site = _site_nodes(anchor, e.matched)
        if t in site or any(n in site for n in (*t.all_input_nodes, *t.users)):
            return True
        p = e.pattern_node
        if p is None or p in self.toward(anchor.target) or p in self.upward(anchor.target):
            return False
        bound = {m for n, q in e.matched.items() if q.op == "placeholder" for m in (n, view_root(n))}
        return bool(bound) and not _reaches(t, {anchor}) and not _reaches(anchor, {t}) and _reaches(t, bound)

    def run_toward(self, first: int, node: fx.Node, anchor: fx.Node) -> "_Fail | None":
        """The failure of `run(first, node)` walking first toward the pattern ops with the anchor's op (so where
        `node` is the site's output, the walk reaches the anchor before it fails off the path there), or None where
        that walk matches; on a budget of its own, and leaving the choice points and step count as they were."""
        saved = self.first, self.steps, list(self.choices)
        self.first, self.steps = self.toward(anchor.target), 0
        st = _State()
        try:
            self.run(first, node, st)
        except _Fail as e:
            e.progress = max(e.progress, self.progress(st))
            return e
        finally:
            self.first, self.steps, self.choices = saved[0], saved[1], saved[2]
        return None

    # -- value comparison --------------------------------------------------------------------------------------
    def _match_arg(self, p, t, st: _State, where: str):
        if isinstance(p, fx.Node):
            if not self.islands_on or p.op == "placeholder" or p in st.p2t:
                return self._match_node(p, t, st)
            trial = st.copy()
            try:
                self._match_node(p, t, trial)
            except _Fail as e:
                if e.kind not in ("wrong op", "argument") or not isinstance(t, fx.Node) or t in st.t2p or t.op != "call_function":
                    raise
                # t computes p's value another way: an island, closed later; its inputs bind structurally where
                # the graph lacks one pattern op here or has a few more (a where, a clone, index arithmetic)
                skipped = self._skip_match(p, t, st)
                if skipped is not None:
                    st.assign(skipped)
                if p not in st.p2t:
                    st.p2t[p] = t
                st.t2p[t] = p
                st.islands.append((p, t, e))
                return
            st.assign(trial)
            return
        if isinstance(p, (list, tuple)):
            if not isinstance(t, (list, tuple)) or len(p) != len(t):
                if self.exact or not _is_numeric_seq(p):
                    raise _Fail("scalar" if _is_numeric_seq(p) else "argument", f"{where}: expected {p!r}, found {t!r}")
                return
            for i, pa, ta in self._ordered(p, t):
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
        if isinstance(t, fx.Node) and isinstance(t.meta.get("val"), (torch.SymInt, torch.SymFloat)):
            raise _Fail("symbolic shape", f"{where}: expected {p!r}, found the symbolic {t.meta['val']} ({_fmt(t)}); "
                        "the decode fusions need static shapes: torch.compile(..., dynamic=False)", t)
        if isinstance(t, fx.Node):
            raise _Fail("argument", f"{where}: expected the constant {p!r}, found a tensor {_fmt(t)}", t)
        if not self.exact:
            return
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (
                _same_number(p, t) or self.fp32_scalars and _same_fp32(p, t)):
            raise _Fail("scalar", f"{where}: expected {p!r}, found {t!r}")

    def _match_node(self, p: fx.Node, t, st: _State):
        """Match pattern node p at graph value t (and p's inputs at t's), binding them in st; a failure names the
        innermost pair of nodes compared (`_Fail.expected` / `.found`), the graph node whose operand t is, and the
        partial match then (`_Fail.at`)."""
        beside = self.path[-1] if self.path else None
        self.path.append(t)
        try:
            self._compare_node(p, t, st)
        except _Fail as e:
            if e.expected is None and e.kind != "budget":
                e.expected, e.found = _what(p), _what(t)
                e.at(p, t, beside, st.t2p)
            raise
        finally:
            self.path.pop()

    def _compare_node(self, p: fx.Node, t, st: _State):
        self.steps += 1
        if self.steps > _STEPS:
            raise _Fail("budget", f"gave up after {_STEPS} comparisons")
        if p in st.p2t:  # matched before: at t, or at an op below t that t's island stands for p with
            if st.p2t[p] is not t and not (not isinstance(t, fx.Node) and st.p2t[p] == t) and st.t2p.get(t) is not p:
                if p.op == "call_function" and t not in st.t2p and _repeats(st.p2t[p], t):
                    st.t2p[t] = p  # a second node of the same op on the same operands: one value, in the region
                    return
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
        if self._input_in_layout(p, t, st) or self._input_in_inverse_layout(p, t, st):
            return
        if not isinstance(t, fx.Node) or t.op != "call_function":
            kind = "graph input" if _is_input(t) and t.op == "placeholder" else "argument"
            raise _Fail(kind, f"expected {_op_name(p.target)}, found {_fmt(t)}" + (
                " (an input of this graph)" if kind == "graph input" else ""), t if isinstance(t, fx.Node) else None)
        if t.target != p.target:
            raise _Fail("wrong op", f"expected {_op_name(p.target)}, found {_fmt(t)}", t)
        if t in st.t2p:
            raise _Fail("inconsistent input", f"{_fmt(t)} matched twice", t)
        st.p2t[p] = t
        st.t2p[t] = p
        if len(p.args) != len(t.args):
            raise _Fail("argument", f"{_fmt(t)}: {len(t.args)} arguments, pattern has {len(p.args)}", t)
        if self.exact and p.target is aten.view.default and p in self.outputs and _same_elements(p, t):
            self._match_arg(p.args[0], t.args[0], st, f"{_fmt(t)} argument 0")  # the op's output is viewed so
            return
        if p.target is aten.view.default and _views_of_one_root(st.p2t.get(p.args[0]), t.args[0]):
            # view(x, s) where the graph views x's own root: view(view(r), s) is view(r, s), one value
            self._match_arg(p.args[1], t.args[1], st, f"{_fmt(t)} argument 1")
            return
        fp32 = _fp32_opmath(t)
        if _commutes(p) and _commutes(t):
            self._match_unordered(p, t, st)
        elif p.target is aten.where.self and self.islands_on:
            self._match_where(p, t, st)
        else:
            for i, pa, ta in self._ordered(p.args, t.args):
                self.fp32_scalars = fp32  # (a node argument compared before resets it)
                self._match_arg(pa, ta, st, f"{_fmt(t)} argument {i}")
        self.fp32_scalars = False
        for k, pa in p.kwargs.items():
            self._match_arg(pa, t.kwargs.get(k), st, f"{_fmt(t)} keyword {k}")

    def _input_in_layout(self, p: fx.Node, t, st: _State) -> bool:
        """Whether p, a view that only adds or drops size-1 dims of a pattern input (or of unary pointwise ops of
        one, `(-sin).view(T, 1, -1)`), matches a graph value t that is not a view but has p's layout already
        (sin as [T, 1, rd/2], negated there, where the pattern views a [T, rd/2] input): then the ops below the view
        match t's, the input binds the graph value at their bottom, and the replacement reshapes that value to the
        input's shape (`_layout_derived`, from `st.layouts`)."""
        if p.target is not aten.view.default or not isinstance(t, fx.Node) or t.target is aten.view.default:
            return False
        pv, tv = p.meta.get("val"), t.meta.get("val")
        if not isinstance(tv, torch.Tensor) or not all(isinstance(d, int) for d in tv.shape):
            return False  # a symbolic size is no layout of a pattern's (and comparing it would guard on it)
        if tv.dim() != pv.dim() or (self.exact and list(tv.shape) != list(pv.shape)):
            return False
        if [d == 1 for d in tv.shape] != [d == 1 for d in pv.shape]:  # the unit dims are the layout (any phase)
            return False
        chain, below = [], p.args[0]
        while below.op == "call_function" and _unary_pointwise(below):
            chain.append(below)
            below = next(a for a in below.args if isinstance(a, fx.Node))
        if below.op != "placeholder" or [d for d in below.meta["val"].shape if d != 1] != [d for d in pv.shape if d != 1]:
            return False
        g = _below_chain(t, chain)
        if not isinstance(g, fx.Node) or st.p2t.get(below, g) is not g or (g in st.t2p and st.t2p[g] is not below):
            return False
        trial = st.copy()
        trial.p2t[below], trial.t2p[g] = g, below
        trial.layouts[below] = (list(pv.shape), list(tv.shape))
        if chain:
            try:
                self._match_node(chain[0], t, trial)
            except _Fail:
                return False
        trial.p2t[p] = t
        st.assign(trial)
        return True

    def _input_in_inverse_layout(self, p: fx.Node, t, st: _State) -> bool:
        """Whether p, a chain of permutes and views (each view only splitting dims) of unary pointwise ops of a
        pattern input read nowhere else, matches a graph input t (or unary pointwise ops of one) in p's layout: a
        weight the graph stores transposed (`x @ W` for the pattern's `F.linear(x, w)`, a per-group [G, in, out]
        wo_a, `_grouped_mm(x, W13)` for `w13.transpose(1, 2)`). Then the pointwise ops below the chain match t's,
        the input binds the graph value at their bottom, and the op takes that value through the inverse chain
        (`_InverseLayout`: permutes back, then reshapes merging the split dims), so the pattern's chain of it is t
        again: exact. t may also be a view of a graph input where p's outer step is another op (Megatron's flat
        GroupedMLP weight viewed `[E, D, 2I]` for `w13.transpose(1, 2)`): then that view is the weight as stored."""
        if p.target not in _LAYOUT_STEPS or not isinstance(t, fx.Node) \
                or t.target in _LAYOUT_STEPS and (t.target is p.target or not _view_of_input(t)):
            return False
        pv, tv = p.meta.get("val"), t.meta.get("val")
        if not isinstance(tv, torch.Tensor) or tv.dim() != pv.dim() or (self.exact and list(tv.shape) != list(pv.shape)):
            return False
        steps, below = [], p
        while below.op == "call_function" and below.target in _LAYOUT_STEPS and (below is p or len(below.users) == 1):
            steps.append(below)
            below = below.args[0]
        chain = []
        while below.op == "call_function" and _unary_pointwise(below) and len(below.users) == 1:
            chain.append(below)
            below = next(a for a in below.args if isinstance(a, fx.Node))
        if below.op != "placeholder" or len(below.users) != 1:
            return False
        g = _below_chain(t, chain)
        if not (_is_input(g) or _view_of_input(g)) or st.p2t.get(below, g) is not g \
                or (g in st.t2p and st.t2p[g] is not below):
            return False  # (a graph input: the weight as stored; a computed value in that layout matches op for op)
        inverse, shape = [], list(tv.shape)
        for step in steps:
            if step.target is aten.permute.default:
                back = sorted(range(len(step.args[1])), key=list(step.args[1]).__getitem__)
                shape = [shape[i] for i in back]
                inverse.append((aten.permute.default, back))
                continue
            groups = _split_groups(list(step.args[0].meta["val"].shape), list(step.meta["val"].shape))
            if groups is None:
                return False
            shape = [math.prod(shape[lo:hi]) for lo, hi in groups]
            inverse.append((aten.reshape.default, shape))
        if not _views_only(tv, inverse):
            raise _Fail("check", f"{_fmt(g)} is stored in the layout of the pattern's {_op_name(p.target)} chain, and "
                                 "taking it back to the op's layout would copy it on every call", t)
        trial = st.copy()
        trial.p2t[below], trial.t2p[g] = g, below
        trial.layouts[below] = _InverseLayout(tuple(inverse))
        if chain:
            try:
                self._match_node(chain[0], t, trial)
            except _Fail:
                return False
        for step in steps:
            trial.p2t[step] = t
        st.assign(trial)
        return True

    def _match_where(self, p: fx.Node, t: fx.Node, st: _State):
        """where(c, a, b) as written, or as where(c', b, a) with the graph's condition c' an island standing for
        the pattern's c (`x > -inf` written for `x == -inf`, the branches swapped; the semantic check decides):
        the form that matches with the fewest islands, the written one first."""
        saved, best, first = self.islands_on, None, None
        cond = t.args[0]
        for islands in (False, True):
            for swap in (False, True):
                if swap and (not isinstance(cond, fx.Node) or cond.op != "call_function" or cond in st.t2p
                             or p.args[0] in st.p2t):
                    continue
                trial = st.copy()
                self.islands_on = islands
                try:
                    if swap:
                        self._match_arg(p.args[1], t.args[2], trial, f"{_fmt(t)} argument 2")
                        self._match_arg(p.args[2], t.args[1], trial, f"{_fmt(t)} argument 1")
                        if cond in trial.t2p or p.args[0] in trial.p2t:
                            continue
                        trial.p2t[p.args[0]], trial.t2p[cond] = cond, p.args[0]
                        trial.islands.append((p.args[0], cond, _Fail(
                            "wrong op", f"{_fmt(t)}: the branches swapped, the condition written as {_fmt(cond)}", cond)))
                    else:
                        for i, pa, ta in self._ordered(p.args, t.args):
                            self._match_arg(pa, ta, trial, f"{_fmt(t)} argument {i}")
                except _Fail as e:
                    first = first or e
                    continue
                finally:
                    self.islands_on = saved
                if best is None or len(trial.islands) < len(best.islands):
                    best = trial
            if best is not None or not saved:
                break
        if best is None:
            raise first
        st.assign(best)

    def _skip_match(self, p: fx.Node, t: fx.Node, st: _State) -> _State | None:
        """The state after matching, op for op, one of p's operands at t (the graph lacks p's op) or p at one of
        t's operands down to three levels (the graph has extra ops), else `_skip_around`; None when none fits."""
        saved, self.islands_on = self.islands_on, False
        try:
            found = self._first_fit([(pc, t) for pc in p.all_input_nodes if pc.op == "call_function" and pc not in st.p2t], st)
            frontier = [t]
            for _ in range(3):
                if found is not None:
                    break
                frontier = [a for n in frontier for a in n.all_input_nodes if a.op == "call_function" and a not in st.t2p]
                # p at tc: the ops between t and tc are the island
                found = self._first_fit([(p, tc) for tc in frontier if tc.target == p.target], st)
        finally:
            self.islands_on = saved
        return self._skip_around(p, t, st) if found is None and saved else found

    def _skip_around(self, p: fx.Node, t: fx.Node, st: _State) -> _State | None:
        """Where the graph differs from the pattern by one op, the state after matching the ops around it, with
        parts computed another way allowed below: p's operand at t where p is a reshape (a view, unsqueeze or
        squeeze) the graph lacks; p at t's operand where t is a reshape the pattern lacks; p's one tensor operand at
        t's where both have one and the same result dtype (`clamp(x, lo)` for `clamp_min(x, lo)`); None when none
        fits. The island is then that one op, and the walk goes on through the region above it, rather than one
        island around all of it that binds the pattern inputs it meets by dtype and rank (cos and sin inside a
        RoPE, either way round)."""
        pairs = [(p.args[0], t)] if p.target in _RESHAPES else []
        pairs += [(p, t.args[0])] if t.target in _RESHAPES else []
        p_in, t_in = ([a for a in n.args if isinstance(a, fx.Node)] for n in (p, t))
        if len(p_in) == len(t_in) == 1 and _dtype(p) == _dtype(t) is not None:
            pairs.append((p_in[0], t_in[0]))
        return self._first_fit([(pc, tc) for pc, tc in pairs
                                if isinstance(pc, fx.Node) and (pc.op == "placeholder" or pc not in st.p2t)
                                and isinstance(tc, fx.Node) and tc not in st.t2p], st)

    def _first_fit(self, pairs: list, st: _State) -> _State | None:
        """The state after matching the first (pattern node, graph value) of `pairs` that matches, or None."""
        for pc, tc in pairs:
            trial = st.copy()
            try:
                self._match_node(pc, tc, trial)
            except _Fail:
                continue
            return trial
        return None

    def _match_unordered(self, p: fx.Node, t: fx.Node, st: _State):
        """The two operands of a commutative op in either order: an order that matches without islands if there is
        one, else the order with the fewest islands (`_pick_order`). At an op in `self.flip` the other order is taken
        where it matches; where the other order could also have matched (it matched too, or was not tried and is
        plausible), the op is a choice point (`self.choices`) that a retry of the whole match may flip: a pairing
        that fits here can fail later (an input bound twice) or be declined by the semantic check."""
        orders = [tuple(t.args), tuple(reversed(t.args))]
        orders.sort(key=lambda ta: -sum(_plausible(pa, x) for pa, x in zip(p.args, ta)))
        if t.args[0] is t.args[1]:
            orders = orders[:1]
        chosen, trial, other_fits = self._pick_order(p, t, st, orders)
        if other_fits:
            self.touched.add(self.keys[p])
        if self.keys[p] in self.flip and other_fits:
            with contextlib.suppress(_Fail):  # (the inputs bound before may fix the order: the exact phase's)
                _, trial, _ = self._pick_order(p, t, st, [ta for ta in orders if ta is not chosen])
        elif other_fits and self.keys[p] not in self.choices:
            self.choices.append(self.keys[p])
        st.assign(trial)

    def _pick_order(self, p: fx.Node, t: fx.Node, st: _State, orders: list) -> tuple:
        """(the order of t's operands taken for p's, the state after matching them so, whether another of `orders`
        could also match): the first that matches without islands, else the one with the fewest islands; raises the
        deepest failure when none matches. Another order could match when it matched too (with islands), or was not
        tried (the first matched without islands) and each of its operands is plausible for p's."""
        deepest, best = None, None
        saved = self.islands_on
        for islands in ((False, True) if saved else (False,)):
            failed = set()
            for ta in orders:
                trial = st.copy()
                self.islands_on = islands
                try:
                    for i, pa, x in self._ordered(p.args, ta):
                        self._match_arg(pa, x, trial, f"{_fmt(t)} argument {i}")
                except _Fail as e:
                    e.progress = max(e.progress, self.progress(trial))
                    if e.kind in ("scalar", "dtype") and not islands:
                        raise  # the structure fits in this order; its numbers or dtypes do not
                    if deepest is None or e.progress > deepest.progress:
                        deepest = e
                    failed.add(ta)
                    continue
                finally:
                    self.islands_on = saved
                if not islands:
                    rest = [o for o in orders if o is not ta and o not in failed]
                    return ta, trial, any(all(_plausible(pa, x) for pa, x in zip(p.args, o)) for o in rest)
                if best is None or len(trial.islands) < len(best[1].islands):
                    best = (ta, trial)
            if best is not None:
                return best[0], best[1], len(failed) < len(orders) - 1
        raise deepest

    # -- the whole pattern -------------------------------------------------------------------------------------
    def run(self, first: int, node: fx.Node, st: _State) -> _State:
        """Match output `first` at graph `node` backwards, then the other outputs downstream of the match, then
        close the islands."""
        found = self.best_candidate(self.outputs[first], [node], st)
        if isinstance(found, _Fail):
            raise found
        st.assign(found)
        for out in self.outputs[:len(self.outputs) - self.optional]:
            if out not in st.p2t:
                self._match_downstream(out, st)
        self._close_islands(st)
        return st

    def diverge(self, anchor: fx.Node) -> "_Fail | None":
        """Where the graph around `anchor` first differs from the pattern, op for op: for each pattern op with the
        anchor's op, match it at the anchor (backwards: the pattern ops it reads), then the pattern ops that read
        matched ones among the graph readers of their images (`_follow_readers`); the failure that matched the
        most pattern ops, or None where one matches every pattern op. Every op it compares is next to the ops
        matched from the anchor, so its failure lies in the site's region (`in_site`), where a walk back from
        an output found downstream of the anchor may start in another sublayer."""
        deepest, saved = None, self.islands_on
        self.islands_on, self.steps = False, 0
        try:
            for pa in (n for n in self.call_nodes if n.target == anchor.target):
                st = _State()
                try:
                    self._match_node(pa, anchor, st)
                    self._follow_readers(st, self.toward(anchor.target))
                except _Fail as e:
                    deepest = self.deeper(deepest, e, st)
                    continue
                return None
        finally:
            self.islands_on = saved
        return deepest

    def _follow_readers(self, st: _State, frontier: frozenset):
        """Extend the match st forwards until every pattern op is matched: the first pattern op (in pattern order)
        that reads a matched op is matched at a graph reader of that op's image with its op (those whose other
        arguments equal the pattern's first: `getitem(sort, 0)` before `getitem(sort, 1)`), walking its other
        operands backwards; raises the deepest failure of those readers, or, where the graph has no reader with
        that op, a failure naming a reader it has (the op where the graph goes on another way; readers of an
        operand in `frontier`, the pattern ops past the anchor's, first), or none. Then the pattern ops that read
        only bound inputs (counts of the ids the anchor sorted): a graph reader of the input with the op that
        matches, else a failure that names no graph op (the input's other readers may be anywhere: a hidden state
        read by every sublayer). Raises a failure for pattern ops that read neither."""
        while True:
            u, operands = next(((u, ops) for u in self.call_nodes if u not in st.p2t
                                if (ops := [a for a in u.all_input_nodes if _matched_op(a, st)])), (None, None))
            inputs = False
            if u is None:
                u, operands = next(((u, ops) for u in self.call_nodes if u not in st.p2t
                                    if (ops := [a for a in u.all_input_nodes
                                                if a.op == "placeholder" and isinstance(st.p2t.get(a), fx.Node)])),
                                   (None, None))
                inputs = True
            if u is None:
                left = [n for n in self.call_nodes if n not in st.p2t]
                if not left:
                    return
                raise _Fail("wrong op", f"expected {_op_name(left[0].target)}, found nothing: it reads no value the "
                            "match around the anchor binds", None, self.progress(st), _op_name(left[0].target),
                            None).at(left[0], None, None, st.t2p)
            images = [st.p2t[a] for a in operands]
            readers = [c for c in dict.fromkeys(r for g in images for r in g.users)
                       if c.op == "call_function" and c.target == u.target and c not in st.t2p]
            readers.sort(key=lambda c: -_same_constants(u, c))
            deepest = None
            for c in readers:
                trial = st.copy()
                try:
                    self._match_node(u, c, trial)
                except _Fail as e:
                    e.progress = max(e.progress, self.progress(trial))
                    if deepest is None or e.progress > deepest.progress:
                        deepest = e
                    continue
                st.assign(trial)
                break
            else:
                if inputs:
                    raise _Fail("wrong op", f"expected {_op_name(u.target)} reading {_fmt(images[0])} (an input of the "
                                "pattern), found none that matches", None, self.progress(st),
                                _op_name(u.target), None).at(u, None, images[0], st.t2p)
                if deepest is not None:
                    raise deepest
                # the first operand whose graph image is read by an op outside the match (those past the anchor's
                # op first): the graph goes on there
                ordered = [st.p2t[a] for a in sorted(operands, key=lambda a: a not in frontier)]
                g = next((g for g in ordered if _readers_outside(g, st)), ordered[0])
                other = (_readers_outside(g, st) or [None])[0]
                found = _fmt(other) if other is not None else "no other op reading it"
                raise _Fail("wrong op", f"expected {_op_name(u.target)} reading {_fmt(g)}, found {found}", other,
                            self.progress(st),
                            _op_name(u.target), _what(other) if other is not None else None).at(u, other, g, st.t2p)

    def _match_downstream(self, out: fx.Node, st: _State):
        # start from the graph images of the output's matched pattern ancestors, then from the bound inputs
        ancestors = _ancestors(out, stop=lambda n: False)
        matched = [st.p2t[a] for a in ancestors if a.op == "call_function" and isinstance(st.p2t.get(a), fx.Node)]
        bound_inputs = [st.p2t[a] for a in ancestors if a.op == "placeholder" and isinstance(st.p2t.get(a), fx.Node)]
        if not matched and not bound_inputs:  # a separate part of the pattern (two GEMM outputs): the nearest nodes
            bound = [t for t in st.t2p if isinstance(t, fx.Node) and t.op == "call_function"]
            graph = bound[0].graph
            order = {n: i for i, n in enumerate(graph.nodes)}
            centre = sum(order[t] for t in bound) / len(bound)
            near = sorted(graph.find_nodes(op="call_function", target=out.target), key=lambda n: abs(order[n] - centre))
            found = self.best_candidate(out, near[:_SEPARATE], st)
            if isinstance(found, _Fail):
                raise found
            st.assign(found)
            return
        found = self.best_candidate(out, _cone(matched or bound_inputs, out.target), st)
        if isinstance(found, _Fail) and matched and bound_inputs:
            found = self.best_candidate(out, _cone(bound_inputs, out.target), st)
        roots = [r for r in (view_root(b) for b in bound_inputs) if r not in bound_inputs]
        if isinstance(found, _Fail) and roots:
            # from the roots the bound inputs view: a sibling view of one root reads the same value
            found = self.best_candidate(out, _cone(bound_inputs + roots, out.target), st)
        if isinstance(found, _Fail):
            raise found
        st.assign(found)

    def best_candidate(self, out: fx.Node, candidates, st: _State):
        """The state after matching `out` at the best of `candidates` (islands closed): the first one matched
        without islands, else the one of least `cost`; or the deepest _Fail."""
        deepest, best = None, None
        for cand in candidates:
            if cand in st.t2p:
                continue
            trial = st.copy()
            try:
                self._match_node(out, cand, trial)
                self._close_islands(trial)
            except _Fail as e:
                deepest = self.deeper(deepest, e, trial)
                continue
            if not trial.islands:
                return trial
            if best is None or self.cost(trial) < self.cost(best):
                best = trial
        if best is not None:
            return best
        return deepest or _Fail("wrong op", f"no {_op_name(out.target)} downstream of the match for output {out.name}",
                                None, self.progress(st), expected=_op_name(out.target)).at(out, None, None, st.t2p)

    def _close_islands(self, st: _State):
        """Each island's graph ancestors down to bound values become part of the region; a pattern input reached
        only through an island binds to the nearest-to-the-inputs graph value of its dtype and rank (the other
        values that fit are kept in `st.rebindings`, for `rebindings` to offer the semantic check)."""
        for p, t, why in st.islands:
            p_inside = _ancestors(p, stop=lambda n: n is not p and n in st.p2t)
            unbound = [n for n in p_inside if n.op == "placeholder" and n not in st.p2t]
            bound = {n for n in st.t2p if isinstance(n, fx.Node)}
            if unbound:
                cone = _ancestors(t, stop=lambda n: n is not t and n in bound, limit=_ISLAND_NODES)
                kind_of = _kinds(t.graph)
                kinds = [(n, kind_of(n)) for n in cone if n is not t and n not in bound]
                near = [[n for n, kind in kinds if kind is not None and kind == want] for want in map(_kind, unbound)]
                far = [c[::-1] for c in near]

                def fits(far=far, near=near, unbound=unbound, t=t, bound=bound):
                    yield from self.fitting(st, unbound, t, bound, far)
                    tried = set(itertools.islice(itertools.product(*far), _TRIES))  # none of them fit
                    yield from self.fitting(st, unbound, t, bound, near, tries=_NEAR_TRIES, skip=tried)
                chosen = next(fits(), None)
                if chosen is None:
                    raise _Fail(why.kind, f"{why.reason}; the graph's part there reaches inputs the pattern does not bind",
                                why.blocking, self.progress(st), why.expected,
                                why.found).at(why.pattern_node, why.node, why.beside, st.t2p)
                for ph, n in zip(unbound, chosen):
                    st.p2t[ph], st.t2p[n] = n, ph
                st.rebindings.append((unbound, t, frozenset(bound), near))
                bound.update(chosen)
            if not _closed(t, bound):
                raise _Fail(why.kind, f"{why.reason}; the graph's part there reaches values outside the pattern",
                            why.blocking, self.progress(st), why.expected,
                            why.found).at(why.pattern_node, why.node, why.beside, st.t2p)

    def fitting(self, st: _State, unbound: list, t: fx.Node, bound, choices, tries: int = _TRIES, skip=frozenset()):
        """The bindings of `unbound` (one graph node each from `choices`, in product order, the first `tries`
        tried, but for those in `skip`, known not to fit) that close island `t` and at whose shapes the pattern
        runs."""
        closes = self.closures(t, bound)
        for combo in itertools.islice(itertools.product(*choices), tries):
            if combo not in skip and len(set(combo)) == len(combo) and closes(combo) and self._traces_with(st, unbound, combo):
                yield combo

    def closures(self, t: fx.Node, bound):
        """`_closure(t, bound)`, shared by every pattern of the pass through `self.closure_cache` (graph node ids
        are stable until a replacement, which empties it), each combo's answer kept."""
        if self.closure_cache is None:
            return _closure(t, bound)
        key = (t, frozenset(bound))
        if key not in self.closure_cache:
            closes, answers = _closure(t, key[1]), {}  # a frozen copy: the caller's set grows later

            def cached(combo):
                k = frozenset(combo)
                if k not in answers:
                    answers[k] = closes(combo)
                return answers[k]
            self.closure_cache[key] = cached
        return self.closure_cache[key]

    def rebindings(self, st: _State):
        """Other states of the match `st`: one island's unbound inputs bound to other values that fit (nearest to
        the island first, at most _ALTERNATIVES per island)."""
        for unbound, t, bound, near in st.rebindings:
            current = tuple(st.p2t[ph] for ph in unbound)
            for combo in itertools.islice((c for c in self.fitting(st, unbound, t, set(bound), near) if c != current),
                                          _ALTERNATIVES):
                alt = st.copy()
                for ph, n in zip(unbound, combo):
                    alt.t2p.pop(alt.p2t[ph], None)
                    alt.p2t[ph], alt.t2p[n] = n, ph
                yield alt

    def _traces_with(self, st: _State, unbound, combo) -> bool:
        """The pattern traces at the shapes of its inputs bound so and by combo (when all are then bound)."""
        binding = {**{p: st.p2t.get(p) for p in self.placeholders}, **dict(zip(unbound, combo))}
        if self.traces is None or any(v is None for v in binding.values()):
            return True
        return self.traces([binding[p] for p in self.placeholders])

    def island_nodes(self, st: _State) -> set[fx.Node]:
        bound = {n for n in st.t2p if isinstance(n, fx.Node)}
        inside: set[fx.Node] = set()
        for _, t, _ in st.islands:
            inside |= set(_ancestors(t, stop=lambda n: n is not t and n in bound))
        return inside

    def cost(self, st: _State) -> tuple:
        """How much of a match with closed islands is computed another way, to choose among candidates (least
        first): the share of the pattern's ops not matched op for op (those an island stands for), then the graph
        nodes inside its islands. An island that stands for most of the pattern (opened next to an output, binding
        the pattern inputs it meets inside: cos and sin in the RoPE) loses to a match of the same output that has
        only a scale computed another way."""
        return -self.progress(st) / max(len(self.call_nodes), 1), len(self.island_nodes(st))

    def deeper(self, deepest: "_Fail | None", e: "_Fail", st: _State) -> "_Fail":
        """The deeper of two failures, e (its walk state st) counted by the ops st matched, a budget failure placed
        at st's bindings."""
        e.progress = max(e.progress, self.progress(st))
        if e.matched is None:  # (a budget failure)
            e.at(None, None, None, st.t2p)
        return e if deepest is None or e.progress > deepest.progress else deepest

    def progress(self, st: _State) -> int:
        """Pattern ops matched op for op (island roots not counted)."""
        roots = {p for p, t, _ in st.islands if st.p2t.get(p) is t}
        return sum(1 for n in self.call_nodes if n in st.p2t and n not in roots)


@contextlib.contextmanager
def quiet_fake_tensor():
    """Fake-tensor dispatch does not log the errors raised inside (a rejected trace is a decline, not a fault)."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        fake_log.setLevel(level)


def _reaches(node: fx.Node, region: set) -> bool:
    """Some ancestor of node lies in region (so node cannot be an input of region's replacement)."""
    first = min((n for n in region), key=lambda n: _position(n), default=None)
    if first is None or _position(node) < _position(first):
        return False
    seen, stack = {node}, list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in region:
            return True
        if n in seen or _position(n) < _position(first):
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def _matched_op(p: fx.Node, st: _State) -> bool:
    """Pattern op p is matched at a graph op (not at a graph input: a weight in the pattern's layout)."""
    t = st.p2t.get(p)
    return p.op == "call_function" and isinstance(t, fx.Node) and t.op == "call_function"


def _readers_outside(g: fx.Node, st: _State) -> list[fx.Node]:
    """The graph ops that read g and are not matched in st (the graph's output is no op)."""
    return [r for r in g.users if r.op == "call_function" and r not in st.t2p]


def _same_constants(p: fx.Node, t: fx.Node) -> int:
    """How many of pattern node p's arguments that are no nodes t has equal at the same position."""
    return sum(1 for a, b in zip(p.args, t.args) if not isinstance(a, fx.Node) and type(a) is type(b) and a == b)


def _commutes(n: fx.Node) -> bool:
    """n is a commutative op (`COMMUTATIVE`) of two tensor operands, without keyword arguments."""
    return n.target in COMMUTATIVE and len(n.args) == 2 and not n.kwargs and all(isinstance(a, fx.Node) for a in n.args)


def _plausible(p, t) -> bool:
    if not isinstance(p, fx.Node) or p.op == "placeholder":
        return True
    return isinstance(t, fx.Node) and t.op == "call_function" and t.target == p.target


def _ancestors(node: fx.Node, stop, limit: int | None = None) -> list[fx.Node]:
    """node and its ancestors, not walking past nodes where stop(n) (those are left out), breadth first."""
    seen, order = {node}, [node]
    i = 0
    while i < len(order):  # `order` is the queue too: nodes are appended once, read once
        for a in order[i]._input_nodes:
            if a in seen or stop(a):
                continue
            seen.add(a)
            order.append(a)
            if limit is not None and len(order) > limit:
                return order
        i += 1
    return order


def _closed(t: fx.Node, bound: set) -> bool:
    """t's ancestors reach no graph input before a bound value, within the island size limit (the walk of
    `_ancestors(t, stop=bound, limit=_ISLAND_NODES)`, ending at the first input or past the limit)."""
    return _closes(t, lambda n: [a for a in n._input_nodes if a not in bound], ())


def _closes(t: fx.Node, inputs_of, stops) -> bool:
    """The walk of `_closed` over inputs_of(n) (a node's inputs outside the bound values), not entering stops."""
    if _is_input(t):
        return False
    seen, order = {t}, [t]
    i = 0
    while i < len(order):
        for a in inputs_of(order[i]):
            if a in seen or a in stops:
                continue
            if a.op in ("placeholder", "get_attr") or len(order) >= _ISLAND_NODES:
                return False
            seen.add(a)
            order.append(a)
        i += 1
    return True


def _closure(t: fx.Node, bound: set):
    """combo -> whether `_closed(t, bound | set(combo))`, for many combos of one island: each node's inputs outside
    bound are looked up once, and when t is closed by bound alone every combo closes it (stopping at more values
    reaches fewer nodes)."""
    if _closed(t, bound):
        return lambda combo: True
    inputs: dict = {}

    def inputs_of(n):
        if n not in inputs:
            inputs[n] = [a for a in n._input_nodes if a not in bound]
        return inputs[n]

    return lambda combo: _closes(t, inputs_of, set(combo))


def _kinds(graph: fx.Graph):
    """`_kind` for the nodes of graph, cached on the graph (a node's dtype and rank do not change)."""
    cache = graph.__dict__.setdefault("_dsv41_kinds", {})

    def kind(n: fx.Node):
        if n not in cache:
            cache[n] = _kind(n)
        return cache[n]
    return kind


def _kind(n: fx.Node) -> tuple | None:
    """(dtype, rank) of a tensor value: what a graph value must share with the pattern input it may bind to."""
    v = n.meta.get("val")
    return (v.dtype, v.dim()) if isinstance(v, torch.Tensor) else None


def _cone(starts: list[fx.Node], target, limit: int | None = None) -> list[fx.Node]:
    """Graph nodes with `target` among the users of `starts` and their users, breadth first, nearest first (the
    first `limit` of them when given: the walk stops there)."""
    targets = target if isinstance(target, (tuple, list, set, frozenset)) else (target,)
    seen, queue = set(starts), collections.deque(starts)
    found = [n for n in starts if n.target in targets]
    while queue and len(seen) < _CONE and (limit is None or len(found) < limit):
        n = queue.popleft()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            queue.append(u)
            if u.op == "call_function" and u.target in targets:
                found.append(u)
    return found if limit is None else found[:limit]


def _is_numeric_seq(x) -> bool:
    return all(isinstance(v, (int, float, torch.SymInt)) and not isinstance(v, bool) for v in x)


_ARITHMETIC = frozenset({aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor})


def _fp32_opmath(t: fx.Node) -> bool:
    """t is an add/sub/mul/div whose result is fp32: a number operand enters its arithmetic as an fp32 value (a
    wrapped number takes the tensor's dtype), so two numbers with one fp32 value are one operand (`F.rms_norm`'s decomposition adds eps = fp32(1e-20) where a hand-written norm adds 1e-20)."""
    v = t.meta.get("val")
    return t.target in _ARITHMETIC and isinstance(v, torch.Tensor) and v.dtype is torch.float32


def _same_fp32(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, float) and not isinstance(b, float):
        return False
    fa, fb = torch.tensor(float(a), dtype=torch.float32).item(), torch.tensor(float(b), dtype=torch.float32).item()
    return fa == fb or math.isnan(fa) and math.isnan(fb)


def _same_number(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    a, b = float(a), float(b)
    if math.isinf(a) or math.isnan(a):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b or abs(a - b) <= 1e-9 * max(abs(a), abs(b))


def _fake_like(v):
    val = v.meta.get("val") if isinstance(v, (fx.Node, Derived)) else v
    if isinstance(val, torch.Tensor):
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
    return val


def _to_fake(mode: FakeTensorMode, a):
    """a as a fake tensor of mode (a meta tensor, as `_fake_like` makes, is created anew inside the mode: an order of
    magnitude cheaper than converting it); a non-tensor as is."""
    if not isinstance(a, torch.Tensor):
        return a
    if a.device.type != "meta":
        return mode.from_tensor(a)
    with mode:
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")


def _meta_key(v):
    """What a trace at v's fake value depends on: shape, strides and dtype (v itself when not a tensor)."""
    val = v.meta.get("val") if isinstance(v, (fx.Node, Derived)) else v
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), tuple(val.stride()), val.dtype)
    return val


def _has_symbols(key) -> bool:
    """Whether a `_meta_key` (nested tuples) holds a symbolic size."""
    if isinstance(key, tuple):
        return any(_has_symbols(k) for k in key)
    return isinstance(key, (torch.SymInt, torch.SymFloat))


def _anchor_targets(pat: Pattern, gm: fx.GraphModule) -> tuple:
    """The pattern's distinctive ops that its trace holds (an op may decompose: index_add into index_put)."""
    if pat.anchor is None:
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        return ((out[0] if isinstance(out, (tuple, list)) else out).target,)
    wanted = tuple(pat.anchor) if isinstance(pat.anchor, (tuple, list)) else (pat.anchor,)
    present = tuple(t for t in wanted if gm.graph.find_nodes(op="call_function", target=t))
    if not present:
        raise ValueError(f"pattern {pat.name}: none of its anchor ops {[_op_name(t) for t in wanted]} is in its trace")
    return present


class PatternSet:
    """The formulations of one fusion, traced once (structural phase) and re-traced per exact check."""

    def __init__(self, patterns: Sequence[Pattern], library_key: str | None = None):
        """`library_key`: the entry of the traced-pattern library (`dsv41.passes.pattern_library`) the structural
        traces are read from and written to; None: traced here, nothing stored."""
        from dsv41.passes.pattern_library import structural_traces

        self.patterns = list(patterns)
        self._structural = structural_traces(self.patterns, library_key)
        self._exact: dict[tuple, fx.GraphModule] = {}  # (pattern, input metadata, free scalars) -> exact trace
        self._shape_ok: dict[tuple, bool] = {}  # (pattern, input metadata) -> whether it traces at those shapes
        self._firsts: dict[tuple, int] = {}  # (structural trace id, anchor op) -> its first output on the anchor
        # island closure tests of the graph being matched, shared by the patterns; `forget_graph` empties it (the
        # fusion pass does so when it starts and after each replacement)
        self.closure_cache: dict = {}

    def forget_graph(self) -> None:
        self.closure_cache = {}

    def anchor_ops(self, index: int) -> list:
        pat = self.patterns[index]
        ops = []
        for gm in self._structural[pat.name]:
            ops += [t for t in _anchor_targets(pat, gm) if t not in ops]
        return ops

    def anchors(self, graph: fx.Graph, index: int) -> list[fx.Node]:
        """Graph nodes with the distinctive op of pattern `index`, in graph order."""
        found = {n for t in self.anchor_ops(index) for n in graph.find_nodes(op="call_function", target=t)}
        return [n for n in graph.nodes if n in found]

    def _traces(self, pat: Pattern, bound: list) -> bool:
        """pat's search runs on meta tensors shaped like `bound` (default free scalars; no graph is built); cached.
        Never at a symbolic size: the patterns trace at static shapes. Meta tensors, not fake ones: the same meta
        kernels decide, without a fake mode's set-up and dispatch cache (most bindings tried do not fit, and a
        fake mode made each failure several times dearer); a pattern's search names its tensors' device."""
        keys = tuple(_meta_key(b) for b in bound)
        if _has_symbols(keys):
            return False
        key = (pat.name, keys)
        if key not in self._shape_ok:
            try:
                with quiet_fake_tensor():  # (the compile's fake mode is active: it would log each refused op)
                    pat.search(*[_fake_like(b) for b in bound], **pat.free_defaults)
                self._shape_ok[key] = True
            except Exception:
                self._shape_ok[key] = False
        return self._shape_ok[key]

    def match_one(self, index: int, anchor: fx.Node, islands: bool = True) -> MatchResult | MatchFailure:
        """Match pattern `index` at `anchor`; with `islands` False, only op for op (no part computed another way)."""
        return self._match_one(self.patterns[index], anchor, islands)

    def _first_output(self, gm: fx.GraphModule, structural: "_Matcher", target) -> int:
        """The first output of the structural trace gm that depends on an anchor op `target` (cached)."""
        key = (id(gm), target)
        if key not in self._firsts:
            anchor_ps = {n for n in structural.call_nodes if n.target == target}
            self._firsts[key] = next((i for i, o in enumerate(structural.outputs)
                                      if anchor_ps & set(_ancestors(o, stop=lambda n: False))), 0)
        return self._firsts[key]

    def _structural_match(self, pat: Pattern, anchor: fx.Node, islands: bool, flip: frozenset, choices: list,
                          walks: dict | None = None):
        """(structural matcher, state, output index, graph output node) of the first structural match whose region
        holds the anchor, or the deepest failure in the anchor's site (`_Matcher.in_site`); where no walk from an
        output failed there (each started downstream in another computation, or none found an output), the deepest
        failure of the walk from the anchor (`_Matcher.diverge`). The walks' choice points are added to `choices`.

        `walks` (one `_match_one`'s): without `flip`, each walk's outcome is kept there, per structural trace and
        output candidate, with the commutative ops it met where another order also fits (`_Matcher.touched`) and
        the comparisons it made; with `flip`, a kept walk that met none of the flipped ops so is replayed rather than
        walked, where the comparison budget left covers it: the walk is deterministic and takes its first
        different step only at such an op, so it would make the same comparisons to the same outcome. (A walk that
        ran out of budget is not kept: its outcome depends on the comparisons made before it. Nor is a walk that
        matched: its state binds the graph's values, and `walks` lives on in the retries a match's `alternatives`
        keep, which would hold the compiled graph, and through it the model's parameters, past the compile.)"""
        failure, best, wanted, elsewhere, total, matchers = None, None, [], None, 1, []
        for index, gm in enumerate(self._structural[pat.name]):
            structural = _Matcher(gm, exact=False, islands=islands, traces=lambda bound: self._traces(pat, bound),
                                  optional=pat.optional_outputs, closure_cache=self.closure_cache, flip=flip)
            total = len(structural.call_nodes)
            anchor_ps = [n for n in structural.call_nodes if n.target == anchor.target]
            if not anchor_ps:
                continue
            matchers.append(structural)
            first = self._first_output(gm, structural, anchor.target)
            wanted.append(_op_name(structural.outputs[first].target))
            for cand in _cone([anchor], structural.outputs[first].target, _OUTPUTS):
                kept = walks.get((index, cand)) if walks is not None and flip else None
                if kept is not None and not kept.touched & flip and structural.steps + kept.steps <= _STEPS:
                    structural.steps += kept.steps
                    kind, value = kept.outcome
                    if kind == "failure" and value is not None:
                        value = dataclasses.replace(value)
                else:
                    start, structural.touched = structural.steps, set()
                    kind, value = self._walk(structural, pat, anchor, first, cand, total)
                    _extend(choices, structural.choices)
                    if walks is not None and not flip and structural.steps <= _STEPS and kind != "match":
                        walks[index, cand] = _Walk(frozenset(structural.touched), structural.steps - start,
                                                   (kind, value))
                if kind == "failure":
                    if value is not None and (failure is None or value.progress / value.total > failure.progress / failure.total):
                        failure = value
                    continue
                if kind == "elsewhere":
                    elsewhere = elsewhere or cand
                    continue
                st = value
                if not st.islands:
                    return structural, st, first, cand
                # (each match costed by its own trace's matcher: another trace's counts none of its pattern ops)
                if best is None or structural.cost(st) < best[0].cost(best[1]):
                    best = (structural, st, first, cand)
        if best is not None:
            return best
        if failure is not None:
            return failure
        for structural in matchers:
            e = structural.diverge(anchor)
            total = len(structural.call_nodes)
            if e is not None and (failure is None or e.progress / total > failure.progress / failure.total):
                failure = _failure(pat.name, anchor, e.progress, total, e)
        if failure is not None:
            return failure
        wanted = " or ".join(dict.fromkeys(wanted)) or "output"
        if elsewhere is not None:
            return MatchFailure(pat.name, anchor.name, 0, total, "wrong op", f"the pattern matches at {_fmt(elsewhere)} "
                                "without this anchor", elsewhere.name, _op_name(anchor.target), None)
        return MatchFailure(pat.name, anchor.name, 0, total, "wrong op", f"no {wanted} (the pattern's output) downstream "
                            "of the anchor", None, wanted, None)

    def _walk(self, structural: _Matcher, pat: Pattern, anchor: fx.Node, first: int, cand: fx.Node, total: int):
        """One structural walk of `_structural_match`, from output candidate `cand`: ("match", state) where it
        matches with the anchor in its region, ("elsewhere", None) where it matches without it, ("failure", the
        MatchFailure to weigh, or None where it failed outside the anchor's site)."""
        st = _State()
        try:
            st = structural.run(first, cand, st)
        except _Fail as e:
            progress = max(structural.progress(st), e.progress)
            if not structural.in_site(e, anchor):
                if e.pattern_node in structural.toward(anchor.target):
                    return "failure", None  # it failed on the way to the anchor's pattern op: not the site's output
                # it failed on another branch first: walked toward the anchor, where does it fail?
                e = structural.run_toward(first, cand, anchor)
                if e is None or not structural.in_site(e, anchor):
                    return "failure", None  # (it matches that way, or fails outside the site again: nothing of it)
                progress = e.progress
            return "failure", _failure(pat.name, anchor, progress, total, e)
        if anchor not in st.t2p and anchor not in structural.island_nodes(st):
            return "elsewhere", None
        return "match", st

    def _match_one(self, pat: Pattern, anchor: fx.Node, islands: bool) -> MatchResult | MatchFailure:
        """The match of pat at anchor, or its failure. Where the walk chose the order of a commutative op's operands
        and the other order could also have matched (a choice point), the match is retried with the other order at
        one such op (`_Matcher.flip`), the first `_FLIPS` of them in walk order: when the first match fails, the
        first retry that matches is the match (the first failure is still the one reported when none does, or when the
        fusion declines that match: `MatchResult.instead`); when it
        matches, the retries' matches follow its own other bindings among its `alternatives`, for the semantic check
        to choose among. So a match costs at most 1 + _FLIPS walks, not one per combination of orders; a site that
        needs the other order at two ops at once is not found."""
        choices: list = []
        walks: dict = {}  # the first match's walks, which a retry replays where they did not meet its flip
        result = self._match_flipped(pat, anchor, islands, frozenset(), choices, walks)
        retries = (self._match_flipped(pat, anchor, islands, frozenset({key}), [], walks) for key in choices[:_FLIPS])
        if isinstance(result, MatchFailure):
            retry = next((r for r in retries if isinstance(r, MatchResult)), None)
            return result if retry is None else dataclasses.replace(retry, instead=result)
        if choices:
            rebound = result.alternatives

            def alternatives():
                yield from rebound() if rebound is not None else ()
                for retry in retries:
                    if isinstance(retry, MatchResult):
                        yield retry
                        yield from retry.alternatives() if retry.alternatives is not None else ()
            result.alternatives = alternatives
        return result

    def _match_flipped(self, pat: Pattern, anchor: fx.Node, islands: bool, flip: frozenset,
                       choices: list, walks: dict | None = None) -> MatchResult | MatchFailure:
        """The match of pat at anchor with the other operand order at the commutative ops `flip`; the walks' choice
        points are added to `choices` (`walks`: see `_structural_match`)."""
        found = self._structural_match(pat, anchor, islands, flip, choices, walks)
        if isinstance(found, MatchFailure):
            return found
        structural, st, first, out_node = found
        total = len(structural.call_nodes)
        bound = [st.p2t.get(p) for p in structural.placeholders]
        if pat.guard is not None and (why := pat.guard(bound)) is not None:
            return MatchFailure(pat.name, anchor.name, structural.progress(st), total, "argument", why)
        symbolic = next((b for b in bound if isinstance(b, fx.Node) and isinstance(b.meta.get("val"), torch.Tensor)
                         and not all(isinstance(d, int) for d in b.meta["val"].shape)), None)
        if symbolic is not None:
            return MatchFailure(pat.name, anchor.name, total, total, "symbolic shape",
                                f"input {_fmt(symbolic)} has a symbolic shape {list(symbolic.meta['val'].shape)}; the "
                                "decode fusions need static shapes: torch.compile(..., dynamic=False)", symbolic.name)
        free = {}
        for name, (op, occurrence, path) in pat.free.items():
            carriers = [p for p in structural.call_nodes if p.target == op]
            carrier = st.p2t.get(carriers[occurrence])
            if not isinstance(carrier, fx.Node) or carrier.target != op:
                return MatchFailure(pat.name, anchor.name, total, total, "check",
                                    f"{name} is read from a {_op_name(op)} that the graph computes another way")
            value = carrier.args
            for i in (path if isinstance(path, tuple) else (path,)):
                value = value[i]
            kind = type(pat.free_defaults[name])  # int, or float (which an int also is)
            if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
                return MatchFailure(pat.name, anchor.name, total, total, "check", f"{name} is {value!r}, not a static {kind.__name__}")
            value = kind(value)
            free[name] = value
        result = self._exact_match(pat, anchor, structural, st, first, out_node, islands, free, flip)
        if isinstance(result, MatchResult) and st.rebindings:
            def alternatives():
                for alt in structural.rebindings(st):
                    m = self._exact_match(pat, anchor, structural, alt, first, out_node, islands, free, flip)
                    if isinstance(m, MatchResult):
                        yield m
            result.alternatives = alternatives
        return result

    def _exact_match(self, pat: Pattern, anchor: fx.Node, structural: _Matcher, st: _State, first: int,
                     out_node: fx.Node, islands: bool, free: dict, flip: frozenset) -> MatchResult | MatchFailure:
        """The exact phase on the structural match `st`: re-trace at the bound shapes (an input bound through a
        layout chain at the shape the pattern declares, see `_layout_derived`), match comparing every number (with
        the other operand order at the commutative ops `flip`, as the structural walk took), check the region's
        boundary."""
        total = len(structural.call_nodes)
        bound = [_promoted(p, _layout_derived(p, st) or st.p2t.get(p)) for p in structural.placeholders]
        key = (pat.name, tuple(_meta_key(b) for b in bound), tuple(sorted(free.items())))
        if key not in self._exact:
            try:
                with quiet_fake_tensor():
                    self._exact[key] = pat.trace([_fake_like(b) for b in bound], free)
            except Exception as e:  # the search function rejects these shapes: not this pattern
                self._exact[key] = e
        if isinstance(self._exact[key], Exception):
            return MatchFailure(pat.name, anchor.name, structural.progress(st), total, "inconsistent input",
                                f"re-trace with the matched shapes failed: {self._exact[key]}")
        exact = _Matcher(self._exact[key], exact=True, islands=islands, optional=pat.optional_outputs, flip=flip)
        st2 = _State()
        for p_struct, p_exact in zip(structural.placeholders, exact.placeholders):  # the same inputs as before
            if isinstance(st.p2t.get(p_struct), fx.Node):
                st2.p2t[p_exact], st2.t2p[st.p2t[p_struct]] = st.p2t[p_struct], p_exact
        try:
            st2 = exact.run(first, out_node, st2)
        except _Fail as e:
            return _failure(pat.name, anchor, exact.progress(st2), total, e)
        inputs_bound = {t for p, t in st2.p2t.items() if p.op == "placeholder"}  # never inside (`_input_in_layout`)
        another_way = frozenset(exact.island_nodes(st2))
        inside = {t for p, t in st2.p2t.items() if p.op == "call_function" and t not in inputs_bound} | another_way
        inside |= {t for t, p in st2.t2p.items() if p.op == "call_function" and st2.p2t.get(p) is not t}  # `_repeats`
        required = len(exact.outputs) - pat.optional_outputs
        outputs = [st2.p2t[o] for o in exact.outputs[:required]]
        optional = [st2.p2t.get(o) for o in exact.outputs[required:]]
        exposed = tuple(isinstance(t, fx.Node) and t in inside and any(u not in inside for u in t.users) for t in optional)
        outputs += [t for t, e in zip(optional, exposed) if e]
        kept = _input_layouts_read_outside(inside, inputs_bound)
        for t in inside:
            if t in outputs or t in kept:
                continue
            for user in t.users:
                if user not in inside:
                    return MatchFailure(pat.name, anchor.name, total, total, "extra user",
                                        f"{_fmt(t)} inside the pattern is also used by {_fmt(user)}", user.name)
        inputs = [d if isinstance(d, Derived) else st2.p2t.get(p) for p, d in zip(exact.placeholders, bound)]
        cyclic = next((v for v in leaves(inputs) if _reaches(v, inside - kept)), None)
        if cyclic is not None:
            return MatchFailure(pat.name, anchor.name, total, total, "inconsistent input",
                                f"input {_fmt(cyclic)} depends on the matched region", cyclic.name)
        nodes = [n for n in anchor.graph.nodes if n in inside]
        found_islands = [(_op_name(p.target), t, why) for p, t, why in st2.islands]
        return MatchResult(pat, inputs, outputs, nodes, free, found_islands, exposed=exposed, another_way=another_way,
                           kept=kept)


def _input_layouts_read_outside(inside: set, inputs_bound: set) -> frozenset:
    """The region's layout ops (views, unsqueezes, permutes) of bound inputs, through such ops only, that the graph
    also reads outside the region (a `[T, 1, rd/2]` view of cos that the model's q RoPE reads too): each is a view of
    graph values the op takes anyway, so the region may leave it in place for those readers rather than fail on an
    extra user. The rest of the region does not depend on them being erased."""
    layouts: set = set()
    for t in sorted(inside, key=_position):  # operands before users
        if t.target in _LAYOUT_OPS and all(a in inputs_bound or a in layouts for a in t.all_input_nodes):
            layouts.add(t)
    return frozenset(t for t in layouts if any(u not in inside for u in t.users))


@dataclass(frozen=True)
class _Walk:
    """A structural walk kept for retries to replay (`PatternSet._structural_match`): the commutative ops (keys)
    it met where another order also fits, the comparisons it made, and its outcome (`PatternSet._walk`)."""

    touched: frozenset
    steps: int
    outcome: tuple


def _extend(keys: list, more: list) -> None:
    """Append to keys those of more it lacks, in order."""
    keys.extend(k for k in more if k not in keys)


def _repeats(a, b) -> bool:
    """b applies a's pure ATen op to the very same operands (`s.view(T, 1, 1)` written once for a quotient and again
    for a product): where the pattern reads one value twice, the graph may read these two nodes."""
    t = a.target if isinstance(a, fx.Node) else None
    return (isinstance(b, fx.Node) and a.op == b.op == "call_function" and t == b.target
            and isinstance(t, torch._ops.OpOverload) and t.namespace in ("aten", "prims")
            and torch.Tag.nondeterministic_seeded not in t.tags and a.args == b.args and a.kwargs == b.kwargs)


def same_value(a, b, budget: int = 400) -> bool:
    """a and b are one value: the same node, equal constants, or the same pure ATen op (not random) on arguments
    that are one value each, recursively up to `budget` comparisons (the reference's `linear` rounds x to FP8 once
    per call, so two GEMMs of one activation read two equal chains)."""
    left = [budget]

    def same(x, y) -> bool:
        left[0] -= 1
        if x is y:
            return True
        if left[0] < 0:
            return False
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            return len(x) == len(y) and all(same(p, q) for p, q in zip(x, y))
        if not (isinstance(x, fx.Node) and isinstance(y, fx.Node)):
            return type(x) is type(y) and not isinstance(x, fx.Node) and x == y
        t = x.target
        return (x.op == y.op == "call_function" and t == y.target and isinstance(t, torch._ops.OpOverload)
                and t.namespace in ("aten", "prims") and torch.Tag.nondeterministic_seeded not in t.tags
                and not x.is_impure() and x.kwargs.keys() == y.kwargs.keys()
                and same(list(x.args), list(y.args)) and all(same(x.kwargs[k], y.kwargs[k]) for k in x.kwargs))

    return same(a, b)


def _views_of_one_root(x, y) -> bool:
    """x and y are different graph values, contiguous views (`aten.view`, maybe none) of one root: a view of either
    is the same view of the other."""
    return isinstance(x, fx.Node) and isinstance(y, fx.Node) and x is not y and view_root(x) is view_root(y)


def _same_elements(p: fx.Node, t: fx.Node) -> bool:
    """p's and t's values have the same dtype and number of elements: for a pattern output p = view(x, s) and a
    graph view t = view(x', s') of the value x' matched at x, t is view(p, s') (row-major views compose), so the
    op's output viewed to t's shape is t: a pattern output [T, N] read as [B, 1, N], or [T, k, D] read as the
    [T k, D] rows a combine takes."""
    pv, tv = p.meta.get("val"), t.meta.get("val")
    return (isinstance(pv, torch.Tensor) and isinstance(tv, torch.Tensor) and pv.dtype == tv.dtype
            and pv.numel() == tv.numel())


def _promoted(ph: fx.Node, b):
    """b, or b cast to the dtype of pattern input ph where the pattern only uses ph in pointwise ops with another
    operand of that dtype (through views and negations) and b is a narrower float: those ops promote b to ph's
    dtype exactly, so the op may take it cast (a bf16 cos multiplying fp32 values, for an op declared fp32)."""
    want, val = ph.meta["val"].dtype, b.meta.get("val") if isinstance(b, (fx.Node, Derived)) else None
    if not (isinstance(val, torch.Tensor) and val.dtype != want and val.dtype.is_floating_point and want.is_floating_point
            and torch.finfo(val.dtype).bits < torch.finfo(want).bits):
        return b
    uses, seen = list(ph.users), set()
    while uses:
        u = uses.pop()
        if u in seen:
            continue
        seen.add(u)
        if u.target in (aten.view.default, aten.neg.default):
            uses.extend(u.users)
            continue
        operands = [a.meta["val"] for a in u.args if isinstance(a, fx.Node) and a not in seen and a is not ph]
        if not (isinstance(u.target, torch._ops.OpOverload) and torch.Tag.pointwise in u.target.tags
                and u.meta["val"].dtype == want and any(v.dtype == want for v in operands if isinstance(v, torch.Tensor))):
            return b
    return Derived(torch.ops.prims.convert_element_type.default, (b, want))


def _below_chain(t, chain: list):
    """The graph value below t's unary pointwise ops that repeat the pattern's `chain` (top first), or None."""
    g = t
    for c in chain:
        if not (isinstance(g, fx.Node) and g.op == "call_function" and g.target == c.target and _unary_pointwise(g)):
            return None
        g = next(a for a in g.args if isinstance(a, fx.Node))
    return g


def _unary_pointwise(n: fx.Node) -> bool:
    """n is a pointwise op of one tensor (a negation, a cast), its other arguments not tensors."""
    return (isinstance(n.target, torch._ops.OpOverload) and torch.Tag.pointwise in n.target.tags and not n.kwargs
            and sum(isinstance(a, fx.Node) for a in n.args) == 1 and isinstance(n.args[0], fx.Node))


_LAYOUT_STEPS = (aten.view.default, aten.permute.default)


def _split_groups(before: list, after: list) -> list | None:
    """Per dim of `before`, the run [lo, hi) of `after`'s dims it becomes in a view that only splits dims (size-1
    dims of `after` join the run before them); None when the view merges dims."""
    groups, j = [], 0
    for size in before:
        lo, prod = j, 1
        while j < len(after) and prod * after[j] <= size and (prod < size or after[j] == 1):
            prod *= after[j]
            j += 1
        if prod != size:
            return None
        groups.append([lo, j])
    if not groups or any(d != 1 for d in after[j:]):
        return None
    groups[-1][1] = len(after)
    return [tuple(g) for g in groups]


def _views_only(value: torch.Tensor, steps) -> bool:
    """Whether the (permute, reshape) `steps` of `_InverseLayout` take a tensor of `value`'s shape and strides to
    their result as views (no copy): a weight stored transposed is then read in place by the op or its reference."""
    probe = torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device="meta")
    try:
        for op, arg in steps:
            probe = probe.permute(arg) if op is aten.permute.default else probe.view(arg)
    except (RuntimeError, ValueError):  # torch: "view size is not compatible ..." / "Cannot view a tensor ..."
        return False
    return True


@dataclass(frozen=True)
class _InverseLayout:
    """The steps (op, argument) that take a graph value in a pattern chain's output layout back to the pattern
    input's layout (`_input_in_inverse_layout`)."""

    steps: tuple

    def derive(self, b: fx.Node) -> "Derived":
        value = b
        for op, arg in self.steps:
            value = Derived(op, (value, list(arg)))
        return value


def _layout_derived(ph: fx.Node, st: _State) -> "Derived | None":
    """The op input that pattern placeholder `ph` stands for when the graph reaches it through a layout chain from
    a value of another shape: `ph` is read only by views in the pattern, each matched to a graph view of the bound
    value `b`, and those views only insert or drop size-1 dims; then the input is `b` reshaped to the pattern's
    shape as seen from the graph's view output (`weights.flatten()[:, None]` of a [T, k] tensor: [T*k]). None
    when the bound value already has that shape or no such shape exists."""
    b = st.p2t.get(ph)
    val = b.meta.get("val") if isinstance(b, fx.Node) else None
    if isinstance(st.layouts.get(ph), _InverseLayout) and isinstance(b, fx.Node):
        return st.layouts[ph].derive(b)
    if ph in st.layouts and isinstance(val, torch.Tensor):  # the graph has the pattern view's layout without the view
        p_out, g_out = st.layouts[ph]
        kept = iter(d for d, p in zip(g_out, p_out) if p != 1)
        shape = tuple(1 if d == 1 else next(kept) for d in ph.meta["val"].shape)
        return None if shape == tuple(val.shape) or math.prod(shape) != val.numel() else Derived(aten.reshape.default, (b, list(shape)))
    users = list(ph.users)
    if not isinstance(val, torch.Tensor) or not users:
        return None
    if any(u.target is not aten.view.default for u in users):
        return _without_broadcast_units(ph, b, val, st)
    shapes = set()
    for u in users:
        g = st.p2t.get(u)
        g_out = g.meta.get("val") if isinstance(g, fx.Node) and g.target is aten.view.default else None
        p_in, p_out = ph.meta["val"].shape, u.meta["val"].shape
        if not isinstance(g_out, torch.Tensor) or g_out.dim() != len(p_out) or [d for d in p_in if d != 1] != [d for d in p_out if d != 1]:
            return _without_units(ph, b, val)
        kept = iter(d for d, p in zip(g_out.shape, p_out) if p != 1)  # the graph's sizes at the pattern's non-1 dims
        shapes.add(tuple(1 if d == 1 else next(kept) for d in p_in))
    if len(shapes) != 1 or (shape := shapes.pop()) == tuple(val.shape) or math.prod(shape) != val.numel():
        return None
    return Derived(aten.reshape.default, (b, list(shape)))


def _without_units(ph: fx.Node, b: fx.Node, val) -> "Derived | None":
    """b (read only through views in the pattern, of higher rank than `ph`) without its non-leading size-1 dims
    where that leaves ph's rank: a `[B, S=1, hc, D]` graph input the pattern reads as `[T, hc, D]` (the views
    restate the shape, so the exact phase, re-traced at the derived shape, compares them)."""
    shape = [d for i, d in enumerate(val.shape) if i == 0 or d != 1]
    if len(shape) == ph.meta["val"].dim() + 1 and shape[0] == 1:
        shape = shape[1:]  # a sequence-first [S=1, B, hc, D] input read as [T, hc, D]
    if not all(isinstance(d, int) for d in shape) or len(shape) != ph.meta["val"].dim() or len(shape) == val.dim():
        return None
    return Derived(aten.reshape.default, (b, shape))


def _without_broadcast_units(ph: fx.Node, b: fx.Node, val, st: _State) -> "Derived | None":
    """b without the leading size-1 dims it has beyond ph's rank, where the pattern reads ph only in pointwise ops
    that broadcast it against another operand of the graph result's rank (maybe through unary pointwise ops: casts,
    negations) and the graph repeats those ops: broadcasting prepends size-1 dims to an operand of lower rank, so
    each result is the same tensor with or without them, and everything the region computes from it too (cos bound
    as the graph's `[B=1, S=1, rd/2]` input beside `[1, H, rd/2]` heads, where the pattern at T = 1 reads `[1, rd/2]`;
    a `[1, 1, D]` sublayer output cast beside `[1, hc, 1]` weights)."""
    extra = val.dim() - ph.meta["val"].dim()
    if extra <= 0 or any(d != 1 for d in val.shape[:extra]) or not all(isinstance(d, int) for d in val.shape):
        return None
    chain, broadcasts, uses = {ph}, set(), list(ph.users)  # values of b's shape; the ops reading them
    while uses:
        u = uses.pop()
        t = st.p2t.get(u)
        if not (isinstance(t, fx.Node) and t.op == "call_function" and t.target == u.target
                and isinstance(u.target, torch._ops.OpOverload) and torch.Tag.pointwise in u.target.tags):
            return None
        if _unary_pointwise(u):
            chain.add(u)
            uses.extend(u.users)
        else:
            broadcasts.add(u)
    shaped = {st.p2t.get(c) for c in chain}
    for u in broadcasts:
        t = st.p2t[u]
        others = [a.meta.get("val") for a in t.args if isinstance(a, fx.Node) and a not in shaped]
        if not any(isinstance(o, torch.Tensor) and o.dim() == t.meta["val"].dim() for o in others):
            return None
    return Derived(aten.reshape.default, (b, list(val.shape[extra:])))


@dataclass(frozen=True)
class Derived:
    """A value the replacement computes from matched values just before the op: `op(*args, **dict(kwargs))` (the cat
    that joins two GEMM outputs into the op's one input, an input reshaped to the op's declared shape); args may
    hold Nodes and other Derived values. `meta["val"]` is its fake value, as for a node."""

    op: torch._ops.OpOverload
    args: tuple
    kwargs: tuple = ()  # (name, value) pairs

    @property
    def meta(self) -> dict:
        return {"val": fake_value(self)}


def leaves(args) -> list[fx.Node]:
    """The graph nodes inside args (through Derived values)."""
    out: list[fx.Node] = []

    def walk(a):
        if isinstance(a, Derived):
            walk(a.args)
        elif isinstance(a, (tuple, list)):
            for b in a:
                walk(b)
        elif isinstance(a, fx.Node):
            out.append(a)
    walk(args)
    return out


def evaluate(args, leaf):
    """args with every Node replaced by leaf(node) and every Derived by its op applied to its evaluated args."""
    if isinstance(args, Derived):
        return args.op(*evaluate(args.args, leaf), **dict(args.kwargs))
    if isinstance(args, tuple):
        return tuple(evaluate(a, leaf) for a in args)
    if isinstance(args, list):
        return [evaluate(a, leaf) for a in args]
    return leaf(args) if isinstance(args, fx.Node) else args


def fake_value(d: Derived):
    """d evaluated on the fake values of its graph nodes."""
    with detect_fake_mode([n.meta["val"] for n in leaves(d.args)]):
        return evaluate(d, lambda n: n.meta["val"])
