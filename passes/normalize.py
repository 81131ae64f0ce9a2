"""Normalisation run before the fusions, on the graph and on every traced pattern alike.

- reshape forms: `aten._unsafe_view` becomes `aten.view` (the same op on a functional graph);
- a view of a `full` is a `full` of the view's shape;
- no-op views: `view`/`expand` to the input's own shape, a full-range `slice`, a `convert_element_type` to the
  input's own dtype, and `alias` are replaced by their input;
- static sizes: `view`/`reshape`/`expand` take the output's static shape (so `reshape(t, -1)` and
  `reshape(t, 64)` are one form);
- dims: negative dimension arguments become non-negative (`unsqueeze(-2)` on a 2-d input is `unsqueeze(1)`), and
  so do slice bounds (`x[:, :-1]` is `x[:, :n - 1]`; an end at or past the size is "to the end");
- defaults: trailing positional defaults of reductions, top-k and sort are written out (`topk(x, k)` is
  `topk(x, k, -1, True, True)`);
- layout chains: a chain of views, unsqueezes, squeezes and permutes is at most one permute and one view of its
  root (one-step and two-step reshapes, `x[:, None]` and `x.unsqueeze(1)` are one form);
- broadcasting: an operand viewed only to add leading size-1 dims is the operand itself, an operand `expand`ed to
  what the op's broadcasting gives anyway is its input (export-style `w[None].expand(T, N)`; a cast of an expand is
  the expand of the cast), and a `full` operand the others already broadcast to the output's shape is a 0-d
  `scalar_tensor`;
- a lookup along one dim by `arange(start, stop, step)` in range (`index_select(x, -1, arange(0, rd, 2))`) is the
  strided slice of the same elements (`x[..., 0::2]`);
- split dims: `select(x.view(..., n, k, ...), d, i)` is a slice of x: the stride-k slice `x[..., i::k]` on the k
  factor (interleaved elements), the run `x[..., i*k:(i+1)*k]` on the n factor (`view(-1, 2, I).unbind(1)` halves);
  where the view also drops size-1 dims (`[S, 1, 2I] -> [S, 2, I]`, a bmm's column-vector output split) or
  reshapes the dims on one side of the split one (`[T k, 1, 2I] -> [T, k, 2, I]`), the slice is of x viewed to the
  split dim merged (`x.view(S, 2I)`, `x.view(T, k, 2I)`), the view the traced form reads (a view that adds unit
  dims is left to the unit-dim sinking);
  a cast moves below a strided slice, and a widening cast that only slices read below them
  (`torch.chunk(y.float(), 2, -1)` is the casts of y's halves);
- routing maps: the column sums of a map scattered from top-k ids, `zeros(T, E).scatter(1, ids, 1).sum(0)`
  (Megatron's `tokens_per_expert`), are the counts of the flat ids, `zeros(E).scatter_add(0, ids.view(-1), ones)`;
  a 1-D `gather(x, 0, i)` is the lookup `x[i]`; `histc(float(ids), bins=n, min=0, max=n)` of indices known to lie in
  [0, n) (TorchTitan's `num_tokens_per_expert`) is the float of their counts by an int32 scatter_add, and a cumsum
  with an integer dtype of such a float cast of exact integer counts is the cumsum of the counts;
  `searchsorted(sort(ids).values, arange(n), right=True)` of such ids (a library user's expert offsets; or
  `bucketize` with the operands swapped) is the cumsum of their counts (int32 where every user casts it to int32);
  counts accumulated (scatter_add, or index_add_ as an accumulating index_put) in another integer dtype than the
  cumsum of them sums in are the counts accumulated in that dtype; integers known to lie in [0, U) (top-k or sort
  indices, ...) cast to a narrower integer dtype that holds them and back (`ids.to(int32)` in an engine's buffer,
  `.long()` for an index) are the values themselves, and a sort of such a narrowing cast is the sort of the wide
  values, its sorted values cast (the same permutation), so the sort and the counts read one value; a lookup
  `x[token_idx]` by HF's pair tokens `arange(T).unsqueeze(1).expand(T, k).reshape(T * k)` is x's rows repeated k
  times (`x.repeat_interleave(k, 0)`'s form), where something other than a lookup reads it;
- an add of a where of two constants is the where of two adds (`s + where(c, 0, -inf)`, an additive mask, is
  `where(c, s + 0, s - inf)`);
- `where(~m, a, b)` (or `logical_not`) is `where(m, b, a)`, and on integers `where(a >= b, x, y)` is
  `where(a < b, y, x)` (`>` as `<=`, `!=` as `==`); a negation of a view is the view of the negation;
- fused arithmetic: fp32 `addcmul(a, b, c)` / `addcdiv(a, b, c)` are `a + b * c` / `a + b / c` (addcmul up to the
  FMA contraction eager's CPU kernel makes; with `value=-1`, `a - b * c` / `a - b / c`), `baddbmm(a, b, c)`
  / `addmm(a, b, c)` are `bmm(b, c) + a` / `mm(b, c) + a`, and `scatter_reduce(..., "sum")` is `scatter_add`;
- overloads: add/sub/mul/div `.Scalar` (`F.rms_norm`'s decomposition adds its eps so) are the `.Tensor` ones;
- one-element slices: a broadcasting op's operand `x[i:i+1]` of a 1-D x is `x[i]` where the operands share a dtype
  (`scale.tensor_split(3)` pieces are `scale[0]`, ...);
- arithmetic spellings: `a + (-b)` is `a - b`, `x * x` is `x ** 2`, `x * -1` is `-x`, `max(x, d).values` is
  `amax(x, [d])`, a reduction over one dim followed by an unsqueeze of that dim is the reduction with keepdim,
  and a keepdim reduction over the leading dim viewed without it is the reduction without keepdim;
- pieces: `split(x, s, d)[i]` / `split_with_sizes` (`torch.split`, `chunk`) are the slices of x they cover, and
  `unbind(x, d)[i]` is `select(x, d, i)`;
- DeepGEMM's FP8 cast: a widening float cast (bf16 / fp16 to fp32) of abs(x) is abs of the cast of x, and of a
  block view `x.view(..., n, k)` of a computed x [..., n k] that a reduction over the blocks reads (the amax; not
  a split into heads; not a graph input's or GEMM output's layout view nor a reshape's copy: a pattern's input or
  output may be there) the block view of the cast of x, a new cast node (`x_view.abs().float()` is `x.float().view(..., n, k).abs()`); abs of a value with a positive lower bound
  (`_lower_bound`) is the value (`2 ** ceil(log2(u.abs()))` of the floored amax over 448);
- FP8 spellings: a cast to float8_e4m3fn of an unclamped x / s is the cast of it clamped to +-448 (the conversion
  saturates, or s is the ue8m0 scale of x's own block amax), `x * reciprocal(s)` is `x / s` for a scale that is a normal power of two (exponent bits, or an exp2
  scale of a floored amax), `x * 1.0` is `x`, and a bf16/fp16 product of two casts that lose nothing (e4m3 values,
  a normal power of two scale to bf16) is the cast of their fp32 product (`y.to(bf16) * s.to(bf16)`: torch rounds a
  narrow product once from fp32);
- implicit promotion: an fp32 add/sub/mul/div/maximum/minimum with a bf16/fp16 tensor operand takes it cast to fp32
  (`xf * w` for a bf16 RMSNorm weight is `xf * w.float()`);
- block rows: pointwise ops and keepdim last-dim reductions on `x.reshape(-1, k)` rows of blocks of x's last dim
  (one block a row too: a [..., k] x's rows merge its leading dims) run at `x.unflatten(-1, (-1, k))`
  (`_split_rows`), and the cast where they end moves below the view merging the
  blocks back, so the reference's `view(-1, block)` quantisation and the model's unflatten form are one form; so
  does the cast of blocks computed pointwise from an unflatten view (`(q * s).to(bf16).reshape(x.shape)`);
- a cast of blocked rows merged back by one view that also inserts size-1 dims (`reshape(x.shape).to(bf16)` of a
  [B, 1, d] x) is the cast of the merged value, then the view (the unflatten form's order);
- view round trips: pointwise ops between a view and the view back to the value's own shape run at that shape
  (`act_quant`'s flat e4m3 values viewed into blocks again around the cast are the cast of the blocks), broadcast
  operands only where they vary along the dims both shapes keep; not where the first view gives a graph input or
  a GEMM output its layout or is a reshape's copy (`z.transpose(0, 1).flatten(1)`), where a pattern may end;
- GPT-J's interleaved RoPE: `x * cos2 + rotate_every_two(x) * sin2`, cos2/sin2 each of cos/sin repeated twice
  (`repeat_interleave(2, -1)`) and `rotate_every_two(x)` = `stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)`,
  is the pairwise form `stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), -1).flatten(-2)` (the same products and
  adds; a half-split `rotate_half` or a tiled cos is another rotation and stays);
- contractions: a batched matrix times a vector, `bmm(a, v)` with v [B, K, 1], is the vector times the matrix
  transposed, `bmm(v^T, a^T)^T`; a bmm of batch 1 against a 2-D value viewed with a unit batch dim
  (`einsum('bld,dq->blq', h, w)` with a Flax-style [in, out] kernel) is an mm;
- tensor literals: a 0-d `torch.tensor(v)` in the program (`lift_fresh_copy` of a held constant) is
  `scalar_tensor(v)`, its negation `scalar_tensor(-v)`, its cast that holds v the literal in that dtype, and a clamp
  by such bounds, exact in x's dtype, is the
  clamp by the numbers (`torch.clamp(u, -limit, limit)` of a `limit = torch.tensor(10.0)`);
- JAX-port spellings: `ldexp(x, e)` is `x * pow(2, e)` (`ldexp(1, e)` the power alone); maximum / minimum with a
  nonzero constant are clamp_min / clamp_max (and a clamp with one bound is clamp_min / clamp_max); an int64 sum of a lossless integer cast (`one_hot.to(int32).sum(0)`)
  is the sum of the int64 cast; a slice_scatter of a value computed from that slice (`x.at[..., -r:].set(...)`)
  is the cat of the rest and the value; take_along_dim's wrap (`remainder`) of indices known to lie in range (a
  sort's or top-k's indices, their floor division) is dropped, and its gather of an index vector broadcast along
  the other dims is `x[idx]`;
- unit dims: a non-leading size-1 dim that a graph input or a view of a GEMM output adds (HF's `[B, S=1, ...]`
  decode layout) sinks below the ops that do not touch it (`_sink_units`: pointwise ops, lookups, reductions,
  slices, softmax, top-k, sort, gather, scatter, cat), so they run at `[B, ...]`; a bmm output's unit dims (an
  einsum at S = 1) count as such, and a permute whose input has unit dims right after its leading dim and whose
  users are views permutes the input without them (an einsum's layout chain at `[B, 1, G, D]` and at `[T, G, D]`);
  a view of a pointwise result computed from sunk values adds the unit dims its input lacks, so they sink again
  (`m[..., 8:].reshape(B, 1, 4, 4) * s` at L = 1); in a sequence-first graph (`_seq_first_batches`: a linear layer on `[1, B, K]` activations, viewed to `[B, K]`
  for the mm and back to `[1, B, N]`) the leading S = 1 of a `[1, B, ...]` graph input, GEMM output or value viewed
  so counts as such a dim too (Megatron's `[S, B, ...]` layout); elsewhere a leading 1 is the token dim;
- repeats: a cat of copies of one value with size 1 along the cat dim is its `clone(expand(...))` (Megatron's
  `stack((f.view(-1, 1), f.view(-1, 1)), -1)`, as `repeat_interleave` traces), and cos, sin or neg of a repeat is
  the repeat of cos, sin or neg (the GPT-J rule then reads cos of repeated angles as a repeated cos);
- SGLang-native spellings: `copy(dst, src)` of a src of dst's shape (an in-place write-back by `copy_`) is src in
  dst's dtype; a sum over the columns of elementwise ops of a bmm is the sum over the rows of those ops of the
  transposed product (`bmm(keys, q^T)` [T, N, H] index scores summed over the heads last); the first k of a descending sort, `sort(x, descending=True)[i][..., :k]`, is
  `topk(x, k)[i]` (the same up to the order of tied values, which topk leaves unspecified); a clone of a computed
  value that is already contiguous is the value (`ids.reshape(-1)` of a slice that a rewrite made a topk's
  output); an index_put by a permutation over all rows, `new_x[order] = rows` with `order` a sort's indices, is the
  gather `rows[argsort(order)]` by the inverse permutation.

Shapes come from `meta["val"]`; a node without it is left alone.
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

aten, prims = torch.ops.aten, torch.ops.prims


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _is_noop(node: fx.Node) -> bool:
    out, inp = _val(node), _val(node.args[0]) if node.args else None
    if not isinstance(out, torch.Tensor) or not isinstance(inp, torch.Tensor):
        return False
    t = node.target
    if t in (aten.view.default, aten.expand.default, aten.reshape.default):
        return out.shape == inp.shape
    if t is aten.alias.default:
        return True
    if t is prims.convert_element_type.default:
        return out.dtype == inp.dtype
    if t is aten.slice.Tensor:
        dim = node.args[1] if len(node.args) > 1 else 0
        step = node.args[4] if len(node.args) > 4 else 1
        return out.shape == inp.shape and step == 1 and (node.args[2] if len(node.args) > 2 else 0) in (0, None) and dim is not None
    return False


# op -> (argument index of the dim or dim list, whose rank it counts against: the input's or the output's)
_DIM_ARGS = {
    aten.unsqueeze.default: (1, "out"), aten.cat.default: (1, "out"),
    aten.sum.dim_IntList: (1, "in"), aten.mean.dim: (1, "in"), aten.amax.default: (1, "in"), aten.amin.default: (1, "in"),
    aten._softmax.default: (1, "in"), aten._log_softmax.default: (1, "in"), aten.slice.Tensor: (1, "in"),
    aten.select.int: (1, "in"), aten.topk.default: (2, "in"), aten.sort.default: (1, "in"), aten.sort.stable: (1, "in"),
    aten.gather.default: (1, "in"), aten.scatter.src: (1, "in"), aten.scatter.value: (1, "in"),
    aten.scatter_add.default: (1, "in"), aten.index_add.default: (1, "in"), aten.squeeze.dim: (1, "in"),
    aten.squeeze.dims: (1, "in"), aten.cumsum.default: (1, "in"), aten.split.Tensor: (2, "in"),
    aten.split_with_sizes.default: (2, "in"), aten.index_select.default: (1, "in"), aten.argmax.default: (1, "in"),
}
_SIZE_OPS = (aten.view.default, aten.reshape.default, aten.expand.default)


def _canonical_args(node: fx.Node) -> bool:
    """Static sizes and non-negative dims in place; True when an argument changed."""
    out = _val(node)
    args = list(node.args)
    if node.target in _SIZE_OPS and isinstance(out, torch.Tensor) and all(isinstance(d, int) for d in out.shape):
        if list(args[1]) != list(out.shape):
            args[1] = list(out.shape)
            node.args = tuple(args)
            return True
        return False
    if node.target is aten.slice.Tensor and _slice_bounds(node, args):
        node.args = tuple(args)
        return True
    spec = _DIM_ARGS.get(node.target)
    if spec is None or len(args) <= spec[0]:
        return False
    pos, which = spec
    ref = out if which == "out" else _val(args[0][0] if node.target is aten.cat.default else args[0])
    if isinstance(ref, (tuple, list)):
        ref = ref[0]
    if not isinstance(ref, torch.Tensor):
        return False
    rank = max(ref.dim(), 1)
    dim = args[pos]
    fixed = [d + rank if isinstance(d, int) and d < 0 else d for d in dim] if isinstance(dim, (list, tuple)) else (
        dim + rank if isinstance(dim, int) and not isinstance(dim, bool) and dim < 0 else dim)
    if fixed == dim or (isinstance(dim, (list, tuple)) and list(fixed) == list(dim)):
        return False
    args[pos] = fixed
    node.args = tuple(args)
    return True


_END = 2**63 - 1  # a slice to the end, as traces write `x[..., k:]`


def _slice_bounds(node: fx.Node, args: list) -> bool:
    """slice(x, dim, start, end) with start in [0, size] and end in [0, size) or _END (`x[:, :-1]` and
    `x[:, :n - 1]` are one form); True when an argument changed (args is updated in place)."""
    x = _val(args[0])
    if len(args) < 4 or not _static(x) or not all(isinstance(a, int) for a in args[1:4]):
        return False
    size = x.shape[args[1] % x.dim()]
    start, end = (min(max(b + size if b < 0 else b, 0), size) for b in args[2:4])
    end = _END if end >= size else end
    if (start, end) == tuple(args[2:4]):
        return False
    args[2], args[3] = start, end
    return True


# ops whose trailing defaults callers often spell out (topk(x, k) vs topk(x, k, -1)): written out here
_DEFAULTS_FILLED = (aten.topk.default, aten.sort.default, aten.sort.stable, aten.sum.dim_IntList, aten.mean.dim,
                    aten.amax.default, aten.amin.default, aten.argmax.default, aten.cumsum.default)


def _fill_defaults(node: fx.Node) -> bool:
    """The positional arguments a caller left at their schema defaults, written out."""
    if node.target not in _DEFAULTS_FILLED:
        return False
    params = [a for a in node.target._schema.arguments if not a.kwarg_only]
    args = list(node.args)
    for a in params[len(args):]:
        if a.name in node.kwargs or not a.has_default_value():
            break
        args.append(a.default_value)
    if len(args) == len(node.args):
        return False
    node.args = tuple(args)
    return True


def _view_of_full(node: fx.Node) -> bool:
    """view(full(shape, v)) is full(the view's shape, v) (a filled buffer in any layout is one form)."""
    src = node.args[0] if node.target is aten.view.default and node.args else None
    if not (isinstance(src, fx.Node) and src.op == "call_function" and src.target is aten.full.default
            and _static(_val(node))):
        return False
    node.target, node.args, node.kwargs = aten.full.default, (list(_val(node).shape), *src.args[1:]), dict(src.kwargs)
    return True


def _add_of_neg(node: fx.Node) -> bool:
    """a + (-b) and (-b) + a are a - b (IEEE defines subtraction so: exact, signed zeros and NaNs included)."""
    if node.target is not aten.add.Tensor or node.kwargs or len(node.args) != 2:
        return False
    for i, arg in enumerate(node.args):
        other = node.args[1 - i]
        if isinstance(arg, fx.Node) and arg.op == "call_function" and arg.target is aten.neg.default \
                and isinstance(other, fx.Node):
            node.target, node.args = aten.sub.Tensor, (other, arg.args[0])
            return True
    return False


def _square(node: fx.Node) -> bool:
    """x * x is x ** 2 (pow by 2 computes x * x: exact)."""
    if node.target is aten.mul.Tensor and len(node.args) == 2 and not node.kwargs and node.args[0] is node.args[1] \
            and isinstance(node.args[0], fx.Node):
        node.target, node.args = aten.pow.Tensor_Scalar, (node.args[0], 2)
        return True
    return False


def _negation(node: fx.Node) -> bool:
    """x * -1 is -x (exact)."""
    if node.target is aten.mul.Tensor and len(node.args) == 2 and not node.kwargs and node.args[1] == -1 \
            and isinstance(node.args[0], fx.Node):
        node.target, node.args = aten.neg.default, (node.args[0],)
        return True
    return False


def _max_values(graph: fx.Graph, node: fx.Node) -> bool:
    """max(x, d, keepdim).values, the indices unused, is amax(x, [d], keepdim) (the same values, NaN included)."""
    src = node.args[0] if node.target is operator.getitem and node.args[1] == 0 else None
    if not (isinstance(src, fx.Node) and src.op == "call_function" and src.target is aten.max.dim
            and all(u.target is operator.getitem and u.args[1] == 0 for u in src.users)):
        return False
    x, dim, *keep = src.args
    node.target, node.args = aten.amax.default, (x, [dim], *keep)
    if not src.users:
        graph.erase_node(src)
    return True


def _keepdim(graph: fx.Graph, node: fx.Node) -> bool:
    """unsqueeze(r(x, [d]), d) is r(x, [d], keepdim=True) for a reduction r over the one dim d."""
    src = node.args[0] if node.target is aten.unsqueeze.default else None
    if not (isinstance(src, fx.Node) and src.op == "call_function" and src.target in _REDUCTIONS
            and not src.kwargs and len(src.args) >= 2 and len(src.args[1]) == 1 and not (src.args[2:] and src.args[2])):
        return False
    x, dims = src.args[:2]
    rank = _val(x).dim() if isinstance(_val(x), torch.Tensor) else None
    if not rank or dims[0] % rank != node.args[1] % rank:
        return False
    node.target, node.args = src.target, (x, [dims[0] % rank], True)
    if not src.users:
        graph.erase_node(src)
    return True


def _constant_value(a):
    """The number a 0-d `scalar_tensor(v)` or a `full(shape, v)` node holds, or None."""
    if isinstance(a, fx.Node) and a.op == "call_function" and a.target in (aten.scalar_tensor.default, aten.full.default):
        v = a.args[0] if a.target is aten.scalar_tensor.default else a.args[1]
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    return None


def _ldexp(graph: fx.Graph, node: fx.Node) -> bool:
    """ldexp(x, e) is x * pow(2.0, e), torch's definition of it (`at::ldexp`), and ldexp(ones, e) (`jnp.ldexp(1.0,
    e)`: a power-of-two scale) is pow(2.0, e) where that has the output's dtype and shape: exact."""
    if node.target is not aten.ldexp.Tensor or len(node.args) != 2 or node.kwargs:
        return False
    x, e = node.args
    power = _insert(graph, node, aten.pow.Scalar, (2.0, e), source=node)
    vp, out = _val(power), _val(node)
    if _constant_value(x) == 1 and vp.dtype == out.dtype and list(vp.shape) == list(out.shape):
        node.replace_all_uses_with(power)
        graph.erase_node(node)
        if not x.users:
            graph.erase_node(x)
        return True
    node.target, node.args = aten.mul.Tensor, (x, power)
    return True


def _one_sided_clamp(node: fx.Node) -> bool:
    """clamp(x, lo) / clamp(x, None, hi) with one bound given is clamp_min(x, lo) / clamp_max(x, hi): the same op."""
    if node.target is not aten.clamp.default:
        return False
    x, *bounds = node.args
    bounds += [None] * (2 - len(bounds))
    lo, hi = node.kwargs.get("min", bounds[0]), node.kwargs.get("max", bounds[1])
    if (lo is None) == (hi is None):
        return False
    node.target, node.args = (aten.clamp_min.default, (x, lo)) if hi is None else (aten.clamp_max.default, (x, hi))
    node.kwargs = {}
    return True


def _tensor_literal(graph: fx.Graph, node: fx.Node) -> bool:
    """A 0-d tensor literal, `lift_fresh_copy` of a constant the graph module holds (what `torch.tensor(10.0)`
    written in the program traces to), is `scalar_tensor(v)` of its dtype and device: the same value, a fresh copy
    either way; the negation of a `scalar_tensor(v)` is `scalar_tensor(-v)` (exact), and its cast to a dtype that
    holds v exactly is `scalar_tensor(v)` of that dtype. (The pass cache keys such constants by value,
    `dsv41.pass_cache.graph_key`.)"""
    if node.target is aten.neg.default and len(node.args) == 1 and _is_scalar_tensor(node.args[0]):
        c = node.args[0]
        value = -c.args[0]
    elif node.target is prims.convert_element_type.default and _is_scalar_tensor(node.args[0]) \
            and _exact_in(node.args[0].args[0], node.args[1]):
        c = node.args[0]
        value = c.args[0]
    elif node.target is aten.lift_fresh_copy.default and len(node.args) == 1 and node.args[0].op == "get_attr":
        c = node.args[0]
        value = held_scalar(graph.owning_module, c)
        if value is None:
            return False
    else:
        return False
    out = _val(node)
    kw = {"dtype": out.dtype, "layout": torch.strided, "device": out.device, "pin_memory": False}
    node.replace_all_uses_with(_insert(graph, node, aten.scalar_tensor.default, (value,), kw, source=node))
    graph.erase_node(node)
    if not c.users:
        graph.erase_node(c)
    return True


# the dtypes of the 0-d constants read as numbers (`held_scalar`)
_LITERAL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64)


def held_scalar(module: fx.GraphModule | None, attr: fx.Node) -> int | float | None:
    """The number that get_attr `attr` reads where the module holds a real 0-d tensor of a float or int32 / int64
    dtype there (a `torch.tensor(v)` literal of the program), else None. Read outside any fake mode: the passes may
    run under the graph's."""
    held = getattr(module, attr.target, None) if module is not None and isinstance(attr.target, str) else None
    if not (isinstance(held, torch.Tensor) and not isinstance(held, FakeTensor) and held.dim() == 0
            and held.dtype in _LITERAL_DTYPES):
        return None
    with unset_fake_temporarily():
        return held.item()


def _is_scalar_tensor(n) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target is aten.scalar_tensor.default \
        and len(n.args) == 1 and isinstance(n.args[0], (int, float)) and not isinstance(n.args[0], bool)


def _exact_in(value, dtype: torch.dtype) -> bool:
    """Whether the number converts to `dtype` without rounding."""
    with unset_fake_temporarily():
        return float(torch.tensor(value, dtype=dtype)) == value


# clamps with tensor bounds -> the same clamps with number bounds
_TENSOR_CLAMPS = {aten.clamp_min.Tensor: aten.clamp_min.default, aten.clamp_max.Tensor: aten.clamp_max.default,
                  aten.clamp.Tensor: aten.clamp.default}


def _clamp_by_constants(graph: fx.Graph, node: fx.Node) -> bool:
    """clamp(x, lo, hi) / clamp_min / clamp_max with 0-d constant tensor bounds (`scalar_tensor(v)`, a tensor
    literal's form: `torch.clamp(u, -limit, limit)` with `limit = torch.tensor(10.0)`) is the clamp with the numbers,
    where the result has x's float dtype and each number is exact in it: torch compares in the result dtype, to
    which a number bound converts to the same value then. Bounds of another kind, or that x's dtype would round,
    stay."""
    scalar = _TENSOR_CLAMPS.get(node.target)
    if scalar is None or node.kwargs:
        return False
    x, *bounds = node.args
    vx, out = _val(x), _val(node)
    if not (isinstance(vx, torch.Tensor) and vx.dtype.is_floating_point and out.dtype == vx.dtype
            and list(out.shape) == list(vx.shape)):
        return False
    if not all(b is None or _is_scalar_tensor(b) and _exact_in(b.args[0], vx.dtype) for b in bounds):
        return False
    node.target, node.args = scalar, (x, *(None if b is None else float(b.args[0]) for b in bounds))
    for b in dict.fromkeys(b for b in bounds if b is not None):
        if not b.users:
            graph.erase_node(b)
    return True


# maximum / minimum with a constant -> the clamp that bounds by it
_EXTREMUM_CLAMPS = {aten.maximum.default: aten.clamp_min.default, aten.minimum.default: aten.clamp_max.default}


def _extremum_with_constant(graph: fx.Graph, node: fx.Node) -> bool:
    """maximum(x, c) / minimum(x, c) (either order) of a float x and a nonzero constant c (a 0-d `scalar_tensor` or a
    `full`, `torch.maximum(amax, torch.full_like(amax, 1e-4))`: `jnp.maximum(amax, 1e-4)`) whose result has x's
    dtype and shape is clamp_min(x, c) / clamp_max(x, c): the same value, NaN propagated by both (c = 0 stays: the
    sign of a zero result may differ)."""
    clamp = _EXTREMUM_CLAMPS.get(node.target)
    if clamp is None or len(node.args) != 2 or node.kwargs:
        return False
    for x, c in (node.args, node.args[::-1]):
        value, vx, out = _constant_value(c), _val(x), _val(node)
        if value is None or value == 0 or not isinstance(x, fx.Node) or not isinstance(vx, torch.Tensor) \
                or not vx.dtype.is_floating_point or vx.dtype != out.dtype or list(vx.shape) != list(out.shape):
            continue
        node.target, node.args = clamp, (x, float(value))
        if not c.users:
            graph.erase_node(c)
        return True
    return False


# integer types an integer sum promotes to int64, and those a cast to one of them loses nothing from
_LOSSLESS_INT = {torch.int32: (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32),
                 torch.int16: (torch.bool, torch.uint8, torch.int8, torch.int16),
                 torch.int8: (torch.bool, torch.int8), torch.uint8: (torch.bool, torch.uint8)}


def _sum_of_widening_cast(graph: fx.Graph, node: fx.Node) -> bool:
    """An int64 sum of x cast losslessly to a narrower integer type (`one_hot.astype(int32).sum(0)`: bool -> int32,
    which the sum promotes to int64) is the sum of x cast to int64: every value of x is held by both integer types,
    and the sum adds in int64 either way (exact)."""
    if node.target is not aten.sum.dim_IntList or node.kwargs or not isinstance(node.args[0], fx.Node):
        return False
    cast, out = node.args[0], _val(node)
    if not (cast.op == "call_function" and cast.target is prims.convert_element_type.default and not cast.kwargs
            and isinstance(out, torch.Tensor) and out.dtype is torch.int64):
        return False
    src = cast.args[0]
    if not isinstance(_val(src), torch.Tensor) or _val(src).dtype not in _LOSSLESS_INT.get(cast.args[1], ()):
        return False
    node.args = (_insert(graph, node, prims.convert_element_type.default, (src, torch.int64), source=cast),
                 *node.args[1:])
    if not cast.users:
        graph.erase_node(cast)
    return True


def _slice_update_as_cat(graph: fx.Graph, node: fx.Node) -> bool:
    """slice_scatter(x, v, d, start, end) of a v computed from that slice of x (`x.at[..., -rd:].set(rope(x[...,
    -rd:]))`, `torch.slice_scatter`, or the functionalised `x[..., -rd:] = ...`) is cat(x[.., :start], v,
    x[.., end:]) along d (exact: the same elements). A write of other values (a cache row) stays as it is."""
    if node.target is not aten.slice_scatter.default or node.kwargs:
        return False
    base, src, dim, start, end, step = list(node.args) + [0, None, None, 1][len(node.args) - 2:]
    vb, vs = _val(base), _val(src)
    if step != 1 or not (_static(vb) and _static(vs)) or vb.dtype != vs.dtype:
        return False
    dim %= vb.dim()
    size = vb.shape[dim]
    start = 0 if start is None else (start + size if start < 0 else min(start, size))
    end = size if end is None else (end + size if end < 0 else min(end, size))
    if end - start != vs.shape[dim] or not _reads_slice(src, base, dim, start, end):
        return False
    pieces = [_insert(graph, node, aten.slice.Tensor, (base, dim, 0, start), source=node)] if start > 0 else []
    pieces.append(src)
    if end < size:
        pieces.append(_insert(graph, node, aten.slice.Tensor, (base, dim, end, size), source=node))
    cat = _insert(graph, node, aten.cat.default, (pieces, dim), source=node)
    node.replace_all_uses_with(cat)
    graph.erase_node(node)
    return True


def _reads_slice(v: fx.Node, base: fx.Node, dim: int, start: int, end: int, limit: int = 64) -> bool:
    """v depends on base[.., start:end] along dim (a slice of base with those bounds among its nearest `limit`
    ancestors)."""
    seen, stack = set(), [v]
    while stack and len(seen) < limit:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        if n.target is aten.slice.Tensor and n.args[0] is base and len(n.args) >= 4 \
                and n.args[1] % _val(base).dim() == dim and (n.args[2] or 0) == start \
                and min(n.args[3], _val(base).shape[dim]) == end and (n.args[4:] or [1])[0] == 1:
            return True
        stack.extend(n.all_input_nodes)
    return False


# ops whose output holds only values of their first input (so an index bound carries through them)
_VALUE_PRESERVING = (aten.view.default, aten.expand.default, aten.clone.default, aten.unsqueeze.default,
                     aten.squeeze.dim, aten.permute.default, aten.slice.Tensor, aten.select.int)


def _index_bound(n, depth: int = 16) -> int | None:
    """U when every value of the integer tensor n lies in [0, U), read from its ops: the indices of a sort or top-k
    along a dim of size U, an `arange(U)`, a floor division by a positive k of values below V (U = ceil(V / k)),
    the values of a sort of such a tensor, and views, expands and slices of one; else None."""
    if depth == 0 or not (isinstance(n, fx.Node) and n.op == "call_function"):
        return None
    if n.target is operator.getitem:
        src, item = n.args
        if isinstance(src, fx.Node) and src.target in (aten.sort.default, aten.sort.stable, aten.topk.default):
            if item == 0:
                return _index_bound(src.args[0], depth - 1) if src.target is not aten.topk.default else None
            x = _val(src.args[0])
            dim = (src.args[2] if len(src.args) > 2 else -1) if src.target is aten.topk.default else \
                src.kwargs.get("dim", src.args[1] if len(src.args) > 1 and isinstance(src.args[1], int) else -1)
            return x.shape[dim] if _static(x) and x.dim() else None
        return None
    if n.target is prims.iota.default:
        return n.args[0] if n.kwargs.get("start", 0) == 0 and n.kwargs.get("step", 1) == 1 else None
    if n.target is aten.div.Tensor_mode and n.kwargs.get("rounding_mode") == "floor" and isinstance(n.args[1], int) \
            and n.args[1] > 0:
        v = _index_bound(n.args[0], depth - 1)
        return None if v is None else -(-v // n.args[1])
    if n.target in _VALUE_PRESERVING or _lookup_index(n) is not None:
        return _index_bound(n.args[0], depth - 1)
    return None


def _lossless_narrowing(v) -> tuple[fx.Node, torch.dtype, list[fx.Node]] | None:
    """(y, narrow, views) when v is `views(cast(y, narrow))`, a chain of views (maybe none) of an integer-to-integer
    cast of y that loses nothing: y's values are known to lie in [0, U) (`_index_bound`: a top-k's or sort's
    indices, ...) and narrow holds U - 1; else None."""
    views = []
    while isinstance(v, fx.Node) and v.op == "call_function" and v.target is aten.view.default:
        views.append(v)
        v = v.args[0]
    if not (isinstance(v, fx.Node) and v.op == "call_function" and v.target is prims.convert_element_type.default):
        return None
    y, narrow = v.args[0], v.args[1]
    yv = _val(y)
    integers = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
    if not (isinstance(yv, torch.Tensor) and yv.dtype in integers and narrow in integers):
        return None
    bound = _index_bound(y)
    return (y, narrow, views[::-1]) if bound is not None and bound - 1 <= torch.iinfo(narrow).max else None


def _viewed_as(graph: fx.Graph, before: fx.Node, y: fx.Node, views: list[fx.Node]) -> fx.Node:
    """y through views of the shapes of `views` (each one reused where y already has it: `_view_once`)."""
    for v in views:
        y = _view_once(graph, before, y, list(_val(v).shape))
    return y


def _integer_round_trip(graph: fx.Graph, node: fx.Node) -> bool:
    """cast(views(cast(y, narrow)), y.dtype) of integers that the narrow dtype holds (`_lossless_narrowing`: top-k
    indices put in an int32 buffer, read back as int64 for an index) is views(y): the same values. Exact."""
    if not (node.target is prims.convert_element_type.default and isinstance(node.args[0], fx.Node)):
        return False
    found = _lossless_narrowing(node.args[0])
    if found is None or _val(found[0]).dtype != node.args[1]:
        return False
    y, _, views = found
    narrowed = node.args[0]
    node.replace_all_uses_with(_viewed_as(graph, node, y, views))
    graph.erase_node(node)
    _erase_unused(graph, [narrowed])
    return True


def _sort_of_lossless_narrowing(graph: fx.Graph, node: fx.Node) -> bool:
    """sort(views(cast(y, narrow))) of integers that narrow holds (`_lossless_narrowing`) is the sort of views(y),
    its sorted values cast to narrow: the cast is increasing and one-to-one on those values, so the same
    permutation sorts both (equal keys are the same keys, so a stable sort's order is the same too). Exact. The
    sort then reads the value the graph's other readers of the ids read (the counts of `ids.long()`)."""
    if _sort_dim_descending(node) is None or not isinstance(node.args[0], fx.Node):
        return False
    found = _lossless_narrowing(node.args[0])
    if found is None:
        return False
    y, narrow, views = found
    narrowed = node.args[0]
    node.args = (_viewed_as(graph, node, y, views), *node.args[1:])
    _erase_unused(graph, [narrowed])
    node.meta["val"] = _fake_call(node.target, *node.args, **node.kwargs)
    for part in list(node.users):
        if part.target is operator.getitem and part.args[1] == 0:
            part.meta["val"] = node.meta["val"][0]
            with graph.inserting_after(part):
                cast = graph.call_function(prims.convert_element_type.default, (part, narrow))
            cast.meta["val"] = _fake_call(prims.convert_element_type.default, part, narrow)
            _copy_source(part, cast)
            part.replace_all_uses_with(cast, delete_user_cb=lambda u: u is not cast)
        elif part.target is operator.getitem:
            part.meta["val"] = node.meta["val"][part.args[1]]
    return True


def _lookup_index(n) -> fx.Node | None:
    """i when n is the lookup x[i] along dim 0 by one integer index tensor (`index.Tensor(x, [i])`), else None."""
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target is aten.index.Tensor and len(n.args) == 2
            and isinstance(n.args[1], (list, tuple)) and len(n.args[1]) == 1 and isinstance(n.args[1][0], fx.Node)):
        return None
    i = _val(n.args[1][0])
    return n.args[1][0] if isinstance(i, torch.Tensor) and not i.dtype.is_floating_point and i.dtype is not torch.bool \
        else None


def _lookup_by_iota_as_slice(graph: fx.Graph, node: fx.Node) -> bool:
    """x indexed along dim d alone by `iota(n, start, step)` (`index_select(x, d, arange(start, stop, step))`, as
    `x[..., arange(...)]` traces) with 0 <= start and start + (n - 1) * step < x.size(d), step >= 1, is the strided
    slice `x[..., start:end:step]` of the same n elements in the same order (exact): end is "to the end" where
    that slice holds exactly n elements (`x[..., 1::2]`'s form), else one past the last index."""
    if not (len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) and node.args[1]
            and all(i is None for i in node.args[1][:-1])):
        return False
    iota, x, d = node.args[1][-1], _val(node.args[0]), len(node.args[1]) - 1
    if not (isinstance(iota, fx.Node) and iota.op == "call_function" and iota.target is prims.iota.default
            and _static(x) and isinstance(iota.args[0], int)):
        return False
    n, start, step = iota.args[0], iota.kwargs.get("start", 0), iota.kwargs.get("step", 1)
    if not (isinstance(start, int) and isinstance(step, int) and n >= 1 and start >= 0 and step >= 1
            and start + (n - 1) * step < x.shape[d]):
        return False
    end = _END if -(-(x.shape[d] - start) // step) == n else start + (n - 1) * step + 1
    sliced = _insert(graph, node, aten.slice.Tensor, (node.args[0], d, start, end, step), source=node)
    node.replace_all_uses_with(sliced)
    graph.erase_node(node)
    if not iota.users:
        graph.erase_node(iota)
    return True


def _lookup_of_lookup(graph: fx.Graph, node: fx.Node) -> bool:
    """x[i][j] (two lookups along dim 0 by integer indices) is x[i[j]]: the lookup by j takes rows of x[i], whose
    row r is x[i[r]] (HF's `current_hidden_states[perm]` of `hidden_states[token_idx]`); exact, rows are copied."""
    j, inner = _lookup_index(node), node.args[0]
    i = _lookup_index(inner)
    if j is None or i is None:
        return False
    composed = _insert(graph, node, aten.index.Tensor, (i, [j]), source=node)
    node.args = (inner.args[0], [composed])
    _erase_unused(graph, [inner])
    return True


def _pair_tokens_view(n) -> int | None:
    """k when n is arange(T) broadcast along a new last dim of size k and flattened, `arange(T).unsqueeze(1)
    .expand(T, k).reshape(T * k)` (HF's `token_idx`; the expand's copy and the unit-dim view in any spelling): the
    value at position p is p // k. Else None."""
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target in (aten.view.default, aten.reshape.default)
            and _val(n).dim() == 1):
        return None
    e = n.args[0]
    if isinstance(e, fx.Node) and e.target is aten.clone.default:
        e = e.args[0]
    if not (isinstance(e, fx.Node) and e.target is aten.expand.default and _val(e).dim() == 2):
        return None
    t, k = _val(e).shape
    col = e.args[0]
    if not (isinstance(col, fx.Node) and list(_val(col).shape) == [t, 1]
            and col.target in (aten.unsqueeze.default, aten.view.default, aten.reshape.default)):
        return None
    iota = col.args[0]
    if not (isinstance(iota, fx.Node) and iota.target is prims.iota.default and iota.args[0] == t
            and iota.kwargs.get("start", 0) == 0 and iota.kwargs.get("step", 1) == 1):
        return None
    return k


def _lookup_of_pair_tokens(graph: fx.Graph, node: fx.Node) -> bool:
    """R[j] with R = arange(T).unsqueeze(1).expand(T, k).reshape(T * k) (`_pair_tokens_view`: R[p] = p // k) is
    j // k when every value of j lies in [0, T * k) (`_index_bound`: a sort's indices of T * k pairs) and j has R's
    dtype: HF's `token_idx[perm]`, the token of each expert-sorted pair, is `perm // k`. Exact."""
    j = _lookup_index(node)
    k = _pair_tokens_view(node.args[0]) if j is not None else None
    bound = _index_bound(j) if k is not None else None
    if bound is None or bound > _val(node.args[0]).numel() or _val(j).dtype != _val(node).dtype:
        return False
    node.target, node.args, node.kwargs = aten.div.Tensor_mode, (j, k), {"rounding_mode": "floor"}
    return True


def _lookup_by_pair_tokens(graph: fx.Graph, node: fx.Node) -> bool:
    """x[R] with R = arange(T).unsqueeze(1).expand(T, k).reshape(T * k) (`_pair_tokens_view`: R[p] = p // k) and x
    [T, ...] is each row of x repeated k times, `x.unsqueeze(1).expand(T, k, ...).reshape(T * k, ...)` (HF's
    `hidden_states[token_idx]`; the form `x.repeat_interleave(k, 0)` traces to). Exact: row p of both is x[p // k].
    Not where only lookups read it: those compose with it first (`_lookup_of_lookup`, then `_lookup_of_pair_tokens`)."""
    i = _lookup_index(node)
    k = _pair_tokens_view(i) if i is not None else None
    x = node.args[0]
    if k is None or _val(x).shape[0] * k != _val(i).numel() or all(
            _lookup_index(u) is not None and u.args[0] is node for u in node.users):
        return False
    t, rest = _val(x).shape[0], list(_val(x).shape[1:])
    unsqueezed = _insert(graph, node, aten.unsqueeze.default, (x, 1), source=node)
    expanded = _insert(graph, node, aten.expand.default, (unsqueezed, [t, k, *rest]), source=node)
    copied = _insert(graph, node, aten.clone.default, (expanded,), {"memory_format": torch.contiguous_format},
                     source=node)
    node.target, node.args, node.kwargs = aten.view.default, (copied, [t * k, *rest]), {}
    return True


def _remainder_in_range(node: fx.Node) -> bool:
    """remainder(i, n) of an integer index whose values all lie in [0, n) (`_index_bound`) is i: `take_along_dim`
    wraps its indices so, and on indices in range that is the identity (exact)."""
    if node.target is not aten.remainder.Scalar or not isinstance(node.args[1], int) or node.kwargs:
        return False
    i = node.args[0]
    bound = _index_bound(i)
    if bound is None or bound > node.args[1] or _val(i).dtype != _val(node).dtype:
        return False
    node.replace_all_uses_with(i)
    return True


def _gather_of_broadcast_rows(graph: fx.Graph, node: fx.Node) -> bool:
    """gather(x, d, v.view(.., M, ..).expand(x's shape with M at d)), a vector of indices broadcast along every other
    dim (`torch.take_along_dim(x, token[:, None], dim=0)`: `jnp.take(x, token, axis=0)`), is x indexed by v along d,
    `x[token]` (the same elements; both read only indices in range)."""
    if node.target is not aten.gather.default or node.kwargs or len(node.args) != 3:
        return False
    x, d, idx = node.args
    vx, vi = _val(x), _val(idx)
    if not (_static(vx) and _static(vi) and isinstance(idx, fx.Node) and idx.target is aten.expand.default):
        return False
    d %= vx.dim()
    v = idx.args[0]
    while isinstance(v, fx.Node) and v.op == "call_function" and v.target in (aten.view.default, aten.unsqueeze.default):
        v = v.args[0]
    vv, src = _val(v), _val(idx.args[0])
    if not (_static(vv) and vv.dim() == 1 and _static(src) and src.dim() == vx.dim()
            and [s for j, s in enumerate(src.shape) if j != d] == [1] * (vx.dim() - 1) and src.shape[d] == vv.shape[0]
            and [s for j, s in enumerate(vi.shape) if j != d] == [s for j, s in enumerate(vx.shape) if j != d]):
        return False
    node.target, node.args = aten.index.Tensor, (x, [None] * d + [v])
    return True


_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int)


def _piece_of_split(graph: fx.Graph, node: fx.Node) -> bool:
    """split(x, size, d)[i], split_with_sizes(x, sizes, d)[i] (`torch.split`, `chunk`) are the slice of x along d
    that the piece covers, and unbind(x, d)[i] is select(x, d, i): the same values (exact)."""
    src = node.args[0] if node.target is operator.getitem else None
    if not (isinstance(src, fx.Node) and src.op == "call_function" and src.target in _SPLITS and not src.kwargs
            and isinstance(node.args[1], int) and _static(_val(src.args[0]))):
        return False
    x, i = src.args[0], node.args[1]
    if src.target is aten.unbind.int:
        dim = src.args[1] if len(src.args) > 1 else 0
        node.target, node.args = aten.select.int, (x, dim, i)
    else:
        dim = src.args[2] if len(src.args) > 2 else 0
        size = _val(x).shape[dim]
        if src.target is aten.split.Tensor:
            start = i * src.args[1]
            end = min(start + src.args[1], size)
        else:
            start = sum(src.args[1][:i])
            end = start + src.args[1][i]
        node.target, node.args = aten.slice.Tensor, (x, dim, start, end)
    if not src.users:
        graph.erase_node(src)
    return True


def _keepdim_dropped(graph: fx.Graph, node: fx.Node) -> bool:
    """view(r(x, [0], keepdim=True), s), s the reduction's shape without its kept leading dim, is r(x, [0]) (only
    the leading dim: a view that drops a kept inner dim may be the first step of a reshape back to it)."""
    src = node.args[0] if node.target is aten.view.default else None
    if not (isinstance(src, fx.Node) and src.op == "call_function" and src.target in _REDUCTIONS and not src.kwargs
            and len(src.args) == 3 and len(src.args[1]) == 1 and src.args[2] is True
            and isinstance(_val(src), torch.Tensor)):
        return False
    shape, d = list(_val(src).shape), src.args[1][0] % _val(src).dim()
    if d != 0 or list(node.args[1]) != shape[1:]:
        return False
    node.target, node.args = src.target, (src.args[0], src.args[1], False)
    if not src.users:
        graph.erase_node(src)
    return True


_PROMOTING = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.maximum.default,
              aten.minimum.default)
_NARROW_FLOATS = (torch.bfloat16, torch.float16)


def _implicit_promotion(graph: fx.Graph, node: fx.Node) -> bool:
    """An fp32 pointwise op with a bf16/fp16 tensor operand (`xf * w` for a bf16 w) is the op of that operand cast
    to fp32 (`xf * w.float()`): type promotion casts it so, and the cast is exact."""
    out = _val(node)
    if node.target not in _PROMOTING or not isinstance(out, torch.Tensor) or out.dtype is not torch.float32:
        return False
    changed = False
    args = list(node.args)
    for i, a in enumerate(args[:2]):
        v = _val(a)
        if isinstance(v, torch.Tensor) and v.dtype in _NARROW_FLOATS:
            cast = next((u for u in a.users if u.target is prims.convert_element_type.default and u.args[1:] == (torch.float32,)
                         and not u.kwargs and position(u) < position(node)), None)  # one cast of a value for all its uses
            args[i] = cast or _insert(graph, node, prims.convert_element_type.default, (a, torch.float32), source=node)
            changed = True
    node.args = tuple(args)
    return changed


# an arithmetic op's Scalar overload -> its Tensor overload (the same op on a number: `F.rms_norm`'s decomposition
# writes `mean + eps` as add.Scalar, a traced `x + eps` is add.Tensor)
_SCALAR_OVERLOADS = {aten.add.Scalar: aten.add.Tensor, aten.sub.Scalar: aten.sub.Tensor,
                     aten.mul.Scalar: aten.mul.Tensor, aten.div.Scalar: aten.div.Tensor}


def _scalar_overload(node: fx.Node) -> bool:
    """add/sub/mul/div.Scalar(x, s) is add/sub/mul/div.Tensor(x, s): one computation (a number operand promotes as
    a wrapped number in both overloads)."""
    tensor_form = _SCALAR_OVERLOADS.get(node.target)
    if tensor_form is None:
        return False
    node.target = tensor_form
    return True


def _times_one(node: fx.Node) -> bool:
    """x * 1 (either side) is x for a float x of the product's dtype and shape (`1.0 / s` traces as
    `reciprocal(s) * 1.0`): exact, signed zeros and NaNs included."""
    if node.target is not aten.mul.Tensor or len(node.args) != 2 or node.kwargs:
        return False
    for x, one in (node.args, node.args[::-1]):
        v, out = _val(x), _val(node)
        if isinstance(one, (int, float)) and not isinstance(one, bool) and one == 1 and isinstance(v, torch.Tensor) \
                and isinstance(out, torch.Tensor) and v.dtype == out.dtype and v.dtype.is_floating_point \
                and list(v.shape) == list(out.shape):
            node.replace_all_uses_with(x)
            return True
    return False


_E4M3 = torch.float8_e4m3fn
_E4M3_MAX = torch.finfo(_E4M3).max


def _saturating_e4m3_cast() -> bool:
    """Whether this torch converts to float8_e4m3fn saturating (finite overflow and inf to +-448, NaN to NaN), as
    c10's `fp8e4m3fn_from_fp32_value` does from 2.x on and the PTX cvt to e4m3 (`.satfinite`, the only form) does."""
    x = torch.tensor([float("inf"), -float("inf"), 1e30, -500.0, 480.0, 464.0, float("nan")])
    return torch.equal(x.to(_E4M3).float().nan_to_num(1.0), x.clamp(-_E4M3_MAX, _E4M3_MAX).to(_E4M3).float().nan_to_num(1.0))


_SATURATES = _saturating_e4m3_cast()


def _exact_widening_root(n):
    """n with its exact widening casts (`_widening`) stripped."""
    while (isinstance(n, fx.Node) and n.op == "call_function" and n.target is prims.convert_element_type.default
           and isinstance(n.args[0], fx.Node) and _widening(n)):
        n = n.args[0]
    return n


def _ue8m0_scale_of_block_amax(x: fx.Node, s: fx.Node) -> bool:
    """Whether every |x / s| < 464, so that its e4m3 cast rounds to at most 448 as the clamped value's does, on any
    torch: s is 2^ceil(log2(m / c)) (`exp2` or `torch.pow(2, ...)`), c <= 448 (`m / c` or `m * (1 / c)`),
    m = amax(|x|, D) maybe raised by `clamp_min`, viewed to x's shape with unit dims at the reduced dims D, x and
    abs's input one value up to exact widening casts. Then |x| <= m <= c s (1 + 2^-20) (log2's error) per block, so
    |x / s| <= 448 (1 + 2^-10)(1 + 2^-20); a NaN or inf block gives NaN quotients with or without the clamp."""
    if not isinstance(x, fx.Node):
        return False
    xv, sv = _val(x), _val(s)
    root = view_root(s)
    if not (isinstance(root, fx.Node) and root.op == "call_function" and sv.dim() == xv.dim()):
        return False
    u = _ceil_log2_operand(root)
    if not (isinstance(u, fx.Node) and len(u.args) == 2 and isinstance(u.args[1], (int, float))):
        return False
    c = u.args[1] if u.target is aten.div.Tensor else 1 / u.args[1] if u.target is aten.mul.Tensor and u.args[1] else 0
    if not 0 < c <= 448.0 * (1 + 2**-10):
        return False
    m = u.args[0]
    if isinstance(m, fx.Node) and m.target is aten.clamp_min.default:
        m = m.args[0]
    if not (isinstance(m, fx.Node) and m.target is aten.amax.default and isinstance(a := m.args[0], fx.Node)
            and a.target is aten.abs.default and _exact_widening_root(a.args[0]) is _exact_widening_root(x)
            and tuple(_val(a).shape) == tuple(xv.shape)):
        return False
    dims = {d % xv.dim() for d in (m.args[1] if len(m.args) > 1 else range(xv.dim()))}
    return all(sv.shape[d] == (1 if d in dims else xv.shape[d]) for d in range(xv.dim()))


def _clamp_before_e4m3(graph: fx.Graph, node: fx.Node) -> bool:
    """A float -> float8_e4m3fn cast of an unclamped quotient x / s (s a tensor: a quantisation step, not a scale
    cast such as FP4's `(amax / 6).to(e4m3)`, which stays as it is) is the cast of it clamped to +-448 (the
    reference's `clamp(x/s, +-448)` before the cast): exact where the conversion saturates (`_SATURATES`), and on
    any torch where s is the ue8m0 scale of x's block amax (`_ue8m0_scale_of_block_amax`: then |x / s| < 464, which
    rounds to at most 448; torch before 2.13 turns a larger value into NaN, where the clamp gives 448)."""
    if not (node.target is prims.convert_element_type.default and node.args[1:] == (_E4M3,)
            and not node.kwargs and isinstance(node.args[0], fx.Node)):
        return False
    x = node.args[0]
    v = _val(x)
    if not (isinstance(v, torch.Tensor) and v.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and x.op == "call_function" and x.target is aten.div.Tensor and isinstance(x.args[1], fx.Node)):
        return False
    if not (_SATURATES or _ue8m0_scale_of_block_amax(x.args[0], x.args[1])):
        return False
    low = _insert(graph, node, aten.clamp_min.default, (x, -_E4M3_MAX), source=node)
    node.args = (_insert(graph, node, aten.clamp_max.default, (low, _E4M3_MAX), source=node), *node.args[1:])
    return True


def view_root(n):
    """The value n is a chain of `aten.view`s of (n itself when it is not a view)."""
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target is aten.view.default:
        n = n.args[0]
    return n


def _lower_bound(n) -> float | None:
    """A positive lower bound of every value of n read from its ops (`clamp_min(a, lo)`, then divisions and
    multiplications by positive numbers, views), or None."""
    n = view_root(n)
    if not (isinstance(n, fx.Node) and n.op == "call_function" and len(n.args) == 2):
        return None
    a, c = n.args
    if n.target is aten.clamp_min.default and isinstance(c, (int, float)) and c > 0:
        return float(c)
    if n.target in (aten.div.Tensor, aten.mul.Tensor) and isinstance(c, (int, float)) and c > 0:
        low = _lower_bound(a)
        return None if low is None else low / c if n.target is aten.div.Tensor else low * c
    return None


def _normal_power_of_two(s) -> bool:
    """Every value of s is a power of two at least 2^-126 (so 1/s is exact), +-0, +-inf or NaN: a float32 built from
    exponent bits (`(e << 23).view(float32)`: no mantissa bits), or exp2(ceil(log2(u))) (or `torch.pow(2, ...)` of
    it, the same integer powers of two) of a u bounded below by 2^-120 or more (`_lower_bound`: the reference's amax
    floor over 448)."""
    s = view_root(s)
    if not (isinstance(s, fx.Node) and s.op == "call_function"):
        return False
    if s.target is aten.view.dtype and s.args[1] == torch.float32:
        bits = s.args[0]
        return isinstance(bits, fx.Node) and bits.target is aten.__lshift__.Scalar and bits.args[1] == 23
    u = _ceil_log2_operand(s)
    low = None if u is None else _lower_bound(u)
    return low is not None and low >= 2.0**-120


def _ceil_log2_operand(s: fx.Node):
    """u where s is 2^ceil(log2(u)), `exp2(...)` or `torch.pow(2, ...)` (the ue8m0 scale's spellings), else None."""
    exponent = s.args[0] if s.target is aten.exp2.default else \
        s.args[1] if s.target is aten.pow.Scalar and s.args[0] == 2 else None
    if isinstance(exponent, fx.Node) and exponent.target is aten.ceil.default:
        log = exponent.args[0]
        if isinstance(log, fx.Node) and log.target is aten.log2.default:
            return log.args[0]
    return None


def _times_reciprocal(graph: fx.Graph, node: fx.Node) -> bool:
    """x * reciprocal(s) is x / s for a scale s that is a normal power of two (`_normal_power_of_two`): its reciprocal
    is exact, so the product rounds as the quotient does (0, inf and NaN scales give the quotient's inf, 0 and NaN)."""
    if node.target is not aten.mul.Tensor or len(node.args) != 2 or node.kwargs:
        return False
    for x, r in (node.args, node.args[::-1]):
        if isinstance(r, fx.Node) and r.op == "call_function" and r.target is aten.reciprocal.default \
                and isinstance(x, fx.Node) and _normal_power_of_two(r.args[0]):
            vx, vr, out = _val(x), _val(r), _val(node)
            if not all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in (vx, vr, out)):
                return False
            node.target, node.args = aten.div.Tensor, (x, r.args[0])
            if not r.users:
                graph.erase_node(r)
            return True
    return False


# narrow float type -> the float types each of whose values it holds exactly (range and precision)
_HOLDS = {torch.bfloat16: (torch.float8_e4m3fn, torch.float8_e5m2),
          torch.float16: (torch.float8_e4m3fn, torch.float8_e5m2)}


def _held_exactly(a: fx.Node, narrow: torch.dtype) -> fx.Node | None:
    """src, for a = convert(src, narrow) that loses nothing (a holds every value of src exactly): a src of a
    narrower float type (`_HOLDS`: e4m3 in bf16), or an fp32 src each of whose values is a normal power of two
    (`_normal_power_of_two`; bf16 has fp32's exponent range, so each is a bf16 value); else None."""
    if not (isinstance(a, fx.Node) and a.op == "call_function" and a.target is prims.convert_element_type.default
            and a.args[1:] == (narrow,) and not a.kwargs and isinstance(_val(a.args[0]), torch.Tensor)):
        return None
    src = a.args[0]
    if _val(src).dtype in _HOLDS[narrow]:
        return src
    if narrow is torch.bfloat16 and _val(src).dtype is torch.float32 and _normal_power_of_two(src):
        return src
    return None


def _narrow_product_of_casts(graph: fx.Graph, node: fx.Node) -> bool:
    """a.to(N) * b.to(N) with N bf16 or fp16 and both casts exact (`_held_exactly`: an e4m3 value, a normal power
    of two scale cast to bf16; either may be viewed after its cast) is (a.float() * b.float()).to(N): torch computes
    an N product in fp32 and rounds it once to N (its opmath on CPU and CUDA), and the fp32 operands are the N ones
    exactly, so both forms are bit for bit one (the FP8 dequantisation `y.to(bf16) * s.to(bf16)` is the reference's
    `(y.float() * s).to(bf16)`). The fp32 product of two fp8 values, or of one and such a scale, is itself exact (at
    most 8 significant bits on a multiple of 2^-142 or coarser, inf where it overflows), so the form also equals a
    correctly rounded N product. Casts that round (a bf16 cast of an arbitrary fp32 value, any fp32 value to fp16)
    keep the product in N."""
    out = _val(node)
    if not (node.target is aten.mul.Tensor and len(node.args) == 2 and not node.kwargs
            and isinstance(out, torch.Tensor) and out.dtype in _HOLDS):
        return False
    held = [_held_exactly(view_root(a), out.dtype) for a in node.args]
    if None in held:
        return False
    wide = []
    for a, w in zip(node.args, held):
        if _val(w).dtype is not torch.float32:
            w = _insert(graph, node, prims.convert_element_type.default, (w, torch.float32), source=node)
        if a is not view_root(a):  # a view of the cast (`s.to(bf16).view(-1, 1)`) is the cast of the view
            w = _insert(graph, node, aten.view.default, (w, list(_val(a).shape)), source=node)
        wide.append(w)
    product = _insert(graph, node, aten.mul.Tensor, tuple(wide), source=node)
    cast = _insert(graph, node, prims.convert_element_type.default, (product, out.dtype), source=node)
    narrow = list(node.args)
    node.replace_all_uses_with(cast)
    graph.erase_node(node)
    for a in dict.fromkeys(narrow):
        while isinstance(a, fx.Node) and not a.users and a.op == "call_function":
            a, dead = (a.args[0] if a.target is aten.view.default else None), a
            graph.erase_node(dead)
    return True


# addcmul / addcdiv -> the op that joins the product or quotient to the input
_FUSED_ARITH = {aten.addcmul.default: aten.mul.Tensor, aten.addcdiv.default: aten.div.Tensor}


def _fused_arith(graph: fx.Graph, node: fx.Node) -> bool:
    """addcmul(a, b, c) is a + b * c and addcdiv(a, b, c) is a + b / c (value 1) where every operand is fp32; with
    value -1 they are a - b * c and a - b / c (torch computes a + value * (b op c), and a negation is exact, so
    a + (-1)(b c) and a - b c round alike: `torch.addcmul(a * cos, b, sin, value=-1)`, a RoPE's first output).
    addcdiv: the same two roundings, bit for bit. addcmul: CPU eager contracts it into one fused multiply-add (one
    rounding, at most one fp32 ulp of the sum from the two-rounding form) and Inductor chooses either, so its value
    is the backend's choice as a + b * c's is: the one form takes the op's rounding. (bf16/fp16 compute in fp32
    and round once: left as they are; another value multiplies by a rounding factor: left.)"""
    inner, value = _FUSED_ARITH.get(node.target), node.kwargs.get("value", 1)
    if inner is None or len(node.args) != 3 or set(node.kwargs) - {"value"} or value not in (1, -1):
        return False
    if not all(isinstance(_val(a), torch.Tensor) and _val(a).dtype == torch.float32 for a in (*node.args, node)):
        return False
    a, b, c = node.args
    joined = aten.add.Tensor if value == 1 else aten.sub.Tensor
    node.target, node.args, node.kwargs = joined, (a, _insert(graph, node, inner, (b, c), source=node)), {}
    return True


# a GEMM that adds its input -> the GEMM (`baddbmm(a, b, c)` is a + bmm(b, c), `addmm(a, b, c)` a + mm(b, c))
_GEMM_PLUS = {aten.baddbmm.default: aten.bmm.default, aten.addmm.default: aten.mm.default}


def _gemm_plus_input(graph: fx.Graph, node: fx.Node) -> bool:
    """baddbmm(a, b, c) is bmm(b, c) + a, addmm(a, b, c) is mm(b, c) + a (beta = alpha = 1), the sum in the output's
    dtype: one value (the product rounded once, then the add), up to where the GEMM library adds a (after the
    K-sum, or into its first K block), as one product's K order is the library's choice anyway."""
    gemm = _GEMM_PLUS.get(node.target)
    if gemm is None or len(node.args) != 3 or any(node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")):
        return False
    if set(node.kwargs) - {"beta", "alpha"}:
        return False
    a, b, c = node.args
    out, va = _val(node), _val(a)
    if not (isinstance(out, torch.Tensor) and isinstance(va, torch.Tensor) and va.dtype == out.dtype):
        return False
    node.target, node.args, node.kwargs = aten.add.Tensor, (_insert(graph, node, gemm, (b, c), source=node), a), {}
    return True


def _scatter_reduce_sum(node: fx.Node) -> bool:
    """scatter_reduce(x, d, idx, src, "sum") with include_self is scatter_add(x, d, idx, src): the same sums in the
    same order (`scatter_reduce_(..., "sum")` counts and combines)."""
    if node.target is not aten.scatter_reduce.two or len(node.args) != 5 or node.args[4] != "sum":
        return False
    if not node.kwargs.get("include_self", True) or set(node.kwargs) - {"include_self"}:
        return False
    node.target, node.args, node.kwargs = aten.scatter_add.default, node.args[:4], {}
    return True


def _pair_repeat(v):
    """c' when v is c' repeated twice along its last dim and viewed, as `c.repeat_interleave(2, -1)` traces
    (`clone(expand(c[..., None], [..., n, 2]))` then views; also Megatron's `stack((f.view(-1, 1), f.view(-1, 1)),
    -1).view(S, rd)`, `_copies_as_repeat`): c' = c viewed to v's shape with the last dim halved; else None."""
    root, _ = _layout_root(v) if v.op == "call_function" and v.target in _LAYOUT_OPS else (v, [])
    if not (isinstance(root, fx.Node) and root.op == "call_function" and root.target is aten.clone.default):
        return None
    ex = root.args[0]
    if not (isinstance(ex, fx.Node) and ex.op == "call_function" and ex.target is aten.expand.default):
        return None
    src, vv = _val(ex.args[0]), _val(v)
    if not (_static(src) and _static(vv) and src.dim() >= 2 and src.shape[-1] == 1 and src.is_contiguous()
            and list(_val(ex).shape) == [*src.shape[:-1], 2] and vv.shape[-1] % 2 == 0
            and vv.numel() == 2 * src.numel()):
        return None
    return ex.args[0], [*vv.shape[:-1], vv.shape[-1] // 2]  # each element twice: pairs stay in rows of even length


def _same_copy(a, b) -> bool:
    """a and b are one value: one node, or two chains of views (no permute) of one node to one shape."""
    if a is b:
        return True
    if not all(isinstance(n, fx.Node) and n.op == "call_function" and n.target in _LAYOUT_OPS for n in (a, b)):
        return False
    (ra, ca), (rb, cb) = _layout_root(a), _layout_root(b)
    return (ra is rb and list(_val(a).shape) == list(_val(b).shape)
            and not any(n.target is aten.permute.default for n in (*ca, *cb)))


def _copies_as_repeat(graph: fx.Graph, node: fx.Node) -> bool:
    """cat([u, u, ...], d) of copies of one value u with size 1 at d is u expanded along d and materialised,
    `clone(expand(u, ...))`, as `repeat_interleave` traces (Megatron's interleaved rotary angles,
    `torch.stack((f.view(-1, 1), f.view(-1, 1)), dim=-1)`); exact."""
    if node.target is not aten.cat.default or len(node.args) < 2 or len(node.args[0]) < 2 or node.kwargs:
        return False
    xs, out = node.args[0], _val(node)
    u, d = xs[0], node.args[1]
    if not (_static(out) and isinstance(u, fx.Node) and _static(_val(u)) and isinstance(d, int)
            and -out.dim() <= d < out.dim() and _val(u).shape[d] == 1 and all(_same_copy(u, x) for x in xs[1:])):
        return False
    expanded = _insert(graph, node, aten.expand.default, (u, list(out.shape)), source=node)
    copy = _insert(graph, node, aten.clone.default, (expanded,), source=node)
    node.replace_all_uses_with(copy)
    graph.erase_node(node)
    _erase_unused(graph, xs[1:])
    return True


_ABOVE_REPEAT = (aten.cos.default, aten.sin.default, aten.neg.default)


def _pointwise_above_repeat(graph: fx.Graph, node: fx.Node) -> bool:
    """op(views of clone(expand(u))) = views of clone(expand(op(u))) for a unary elementwise op (cos, sin, neg):
    the op of repeated values is the repetition of its values (`torch.cos(emb)` of rotary angles repeated per pair
    is the pair repeat of cos, which the GPT-J rule reads); exact."""
    if node.target not in _ABOVE_REPEAT or len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
        return False
    v = node.args[0]
    root, chain = _layout_root(v) if v.op == "call_function" and v.target in _LAYOUT_OPS else (v, [])
    if not (isinstance(root, fx.Node) and root.op == "call_function" and root.target is aten.clone.default
            and not root.kwargs and isinstance(root.args[0], fx.Node) and root.args[0].target is aten.expand.default):
        return False
    ex = root.args[0]
    if any(isinstance(c, fx.Node) and c.target is aten.permute.default for c in chain) or not _static(_val(v)):
        return False
    low = _insert(graph, node, node.target, (ex.args[0],), source=node)
    expanded = _insert(graph, node, aten.expand.default, (low, list(_val(ex).shape)), source=node)
    copy = _insert(graph, node, aten.clone.default, (expanded,), source=node)
    out = _insert(graph, node, aten.view.default, (copy, list(_val(node).shape)), source=node)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    _erase_unused(graph, [v])
    return True


def _rotate_pieces(r):
    """(x, True) when r is GPT-J's `rotate_every_two(x)`, `stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)` (a
    cat of the two unsqueezed strided slices viewed back to x's shape); else None."""
    root, _ = _layout_root(r) if r.op == "call_function" and r.target in _LAYOUT_OPS else (r, [])
    if not (isinstance(root, fx.Node) and root.op == "call_function" and root.target is aten.cat.default
            and len(root.args[0]) == 2 and _static(_val(root)) and root.args[1] == _val(root).dim() - 1):
        return None
    pieces = []
    for piece in root.args[0]:
        inner, _ = _layout_root(piece) if piece.op == "call_function" and piece.target in _LAYOUT_OPS else (piece, [])
        neg = isinstance(inner, fx.Node) and inner.op == "call_function" and inner.target is aten.neg.default
        sl = inner.args[0] if neg else inner
        if not (isinstance(sl, fx.Node) and sl.op == "call_function" and sl.target is aten.slice.Tensor
                and len(sl.args) == 5 and sl.args[3] == _END and sl.args[4] == 2
                and sl.args[1] == _val(sl.args[0]).dim() - 1 and list(_val(piece).shape) == [*_val(sl).shape, 1]):
            return None
        pieces.append((neg, sl.args[0], sl.args[2]))
    (neg0, x0, start0), (neg1, x1, start1) = pieces
    if not (neg0 and not neg1 and x0 is x1 and (start0, start1) == (1, 0) and _val(x0).shape == _val(r).shape):
        return None
    return x0


def _rotate_every_two(graph: fx.Graph, node: fx.Node) -> bool:
    """GPT-J's interleaved RoPE `x * cos2 + rotate_every_two(x) * sin2`, where cos2/sin2 repeat each of cos/sin
    [..., n] twice (`repeat_interleave(2, -1)`), is the pairwise form the spec writes,
    `stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), -1).flatten(-2)` with x0, x1 = x[..., ::2], x[..., 1::2]:
    element 2i is x0 * cos + (-x1) * sin = x0 * cos - x1 * sin and element 2i+1 is x1 * cos + x0 * sin, the same
    products and the same add (exact). One dtype throughout."""
    if node.target is not aten.add.Tensor or len(node.args) != 2 or node.kwargs or not _static(_val(node)):
        return False
    products = node.args
    if not all(isinstance(p, fx.Node) and p.op == "call_function" and p.target is aten.mul.Tensor
               and len(p.args) == 2 and all(isinstance(a, fx.Node) for a in p.args) for p in products):
        return False
    for cos_mul, sin_mul in (products, products[::-1]):
        for x, cos2 in (cos_mul.args, cos_mul.args[::-1]):
            for r, sin2 in (sin_mul.args, sin_mul.args[::-1]):
                cos, sin = _pair_repeat(cos2), _pair_repeat(sin2)
                if cos is None or sin is None or _rotate_pieces(r) is not x:
                    continue
                if len({_val(v).dtype for v in (x, cos2, sin2, node)}) != 1 \
                        or list(_val(node).shape) != list(_val(x).shape) or cos[1] != sin[1]:
                    continue
                cos = _insert(graph, node, aten.view.default, cos, source=node)
                sin = _insert(graph, node, aten.view.default, sin, source=node)
                last = _val(x).dim() - 1
                even = _insert(graph, node, aten.slice.Tensor, (x, last, 0, _END, 2), source=node)
                odd = _insert(graph, node, aten.slice.Tensor, (x, last, 1, _END, 2), source=node)

                def mul(a, b):
                    return _insert(graph, node, aten.mul.Tensor, (a, b), source=node)

                first = _insert(graph, node, aten.sub.Tensor, (mul(even, cos), mul(odd, sin)), source=node)
                second = _insert(graph, node, aten.add.Tensor, (mul(odd, cos), mul(even, sin)), source=node)
                pair = _insert(graph, node, aten.cat.default,
                               ([_insert(graph, node, aten.unsqueeze.default, (v, last + 1), source=node)
                                 for v in (first, second)], last + 1), source=node)
                out = _insert(graph, node, aten.view.default, (pair, list(_val(node).shape)), source=node)
                node.replace_all_uses_with(out)
                graph.erase_node(node)
                _erase_unused(graph, products)
                return True
    return False


def _gather_1d(node: fx.Node) -> bool:
    """gather(x, 0, i) of a 1-D x is the lookup x[i] (`torch.gather(probs.view(-1), 0, order)` and
    `probs.view(-1)[order]` are one form); exact."""
    if node.target is not aten.gather.default or len(node.args) != 3 or node.kwargs.get("sparse_grad"):
        return False
    x, i = _val(node.args[0]), _val(node.args[2])
    if not (isinstance(x, torch.Tensor) and isinstance(i, torch.Tensor) and x.dim() == 1 and i.dim() == 1):
        return False
    node.target, node.args, node.kwargs = aten.index.Tensor, (node.args[0], [node.args[2]]), {}
    return True


STABLE_SORT_PREFIX = "dsv41_stable_sort_prefix"  # node meta: a topk that computes a stable sort's first k


def _sort_dim_descending(sort: fx.Node) -> tuple[int, bool] | None:
    """(dim, descending) of a `sort.default` / `sort.stable` node (defaults filled), or None for another node."""
    if not (isinstance(sort, fx.Node) and sort.op == "call_function"):
        return None
    if sort.target is aten.sort.default:
        args = list(sort.args) + [-1, False][len(sort.args) - 1:]
        return args[1], bool(args[2])
    if sort.target is aten.sort.stable:
        return sort.kwargs.get("dim", -1), bool(sort.kwargs.get("descending", False))
    return None


def _copy_as_value(graph: fx.Graph, node: fx.Node) -> bool:
    """copy(dst, src) of a src of dst's shape and device is src, cast to dst's dtype where it differs: the functional
    form of `dst.copy_(src)` (an in-place write-back, `x[..., -r:].copy_(rope(x[..., -r:]))`) holds src's values in
    dst's dtype and reads nothing of dst's. Exact; a src broadcast to dst's shape stays."""
    if node.target is not aten.copy.default or len(node.args) < 2:
        return False
    dst, src = node.args[:2]
    d, v = _val(dst), _val(src)
    if not (isinstance(d, torch.Tensor) and isinstance(v, torch.Tensor) and isinstance(src, fx.Node)
            and d.shape == v.shape and d.device == v.device):
        return False
    value = src if d.dtype == v.dtype else _insert(graph, node, prims.convert_element_type.default, (src, d.dtype),
                                                     source=node)
    node.replace_all_uses_with(value)
    graph.erase_node(node)
    return True


def _sorted_prefix_as_topk(graph: fx.Graph, node: fx.Node) -> bool:
    """The first k of a descending sort, `sort(x, d, descending=True)[i][..., :k]` along d (`torch.sort(s,
    descending=True).indices[:, :k]`, stable or not), is `topk(x, k, d, largest=True, sorted=True)[i]`: both are
    the k largest values of each row in descending order (NaN largest in both) and their indices. Exact for the
    values; for the indices wherever no two values tie across the k-th place or inside the first k: among tied
    values a stable sort takes the lower index first, and topk's order among ties is unspecified (as the
    fusions' ops state: a tie at the k-th may be taken in any order). A topk made from a stable sort carries
    STABLE_SORT_PREFIX, so that `restore_stable_sorts` gives any such topk no fusion took back its sort: the rewrite
    changes no tie of the user's program outside a fused op. One topk per (x, k, d) serves every such prefix; the
    sort stays while anything else reads it."""
    if not (node.target is aten.slice.Tensor and len(node.args) >= 4 and (len(node.args) < 5 or node.args[4] == 1)
            and node.args[2] == 0 and isinstance(node.args[3], int)):
        return False
    piece = node.args[0]
    if not (isinstance(piece, fx.Node) and piece.op == "call_function" and piece.target is operator.getitem):
        return False
    sort, i = piece.args
    spec, x = _sort_dim_descending(sort), _val(sort.args[0]) if isinstance(sort, fx.Node) and sort.args else None
    if spec is None or not spec[1] or not _static(x) or x.dim() == 0:
        return False
    dim, k = spec[0] % x.dim(), node.args[3]
    if node.args[1] % x.dim() != dim or not 0 < k < x.shape[dim]:
        return False
    src = sort.args[0]
    here = position(node)
    topk = next((u for u in src.users if u.target is aten.topk.default and tuple(u.args) == (src, k, dim, True, True)
                 and position(u) < here), None)
    if topk is None:
        topk = _insert(graph, node, aten.topk.default, (src, k, dim, True, True), source=sort)
    if sort.target is aten.sort.stable and sort.kwargs.get("stable"):
        topk.meta[STABLE_SORT_PREFIX] = True
    part = next((u for u in topk.users if u.target is operator.getitem and u.args[1] == i and position(u) < position(node)),
                None)
    if part is None:
        part = _insert(graph, node, operator.getitem, (topk, i), source=node)
    node.replace_all_uses_with(part)
    graph.erase_node(node)
    _erase_unused(graph, [piece])
    return True


def restore_stable_sorts(graph: fx.Graph) -> int:
    """Every topk(x, k, d) made from a stable descending sort's first k (``_sorted_prefix_as_topk``) still in the
    graph after the fusions, i.e. read by no fused op, is computed as that sort again: each of its outputs becomes
    `sort(x, stable=True, dim=d, descending=True)[i][..., :k]` along d, made contiguous as topk's outputs are (a view
    of it may follow). Returns the number of topk nodes restored."""
    restored = 0
    for topk in [n for n in graph.find_nodes(op="call_function", target=aten.topk.default)
                 if n.meta.get(STABLE_SORT_PREFIX)]:
        src, k, dim = topk.args[:3]
        sort = _insert(graph, topk, aten.sort.stable, (src,), {"stable": True, "dim": dim, "descending": True},
                       source=topk)
        for part in list(topk.users):
            piece = _insert(graph, part, operator.getitem, (sort, part.args[1]), source=part)
            prefix = _insert(graph, part, aten.slice.Tensor, (piece, dim, 0, k), source=part)
            dense = _insert(graph, part, aten.clone.default, (prefix,), {"memory_format": torch.contiguous_format},
                            source=part)
            part.replace_all_uses_with(dense)
            graph.erase_node(part)
        graph.erase_node(topk)
        restored += 1
    return restored


def _clone_of_contiguous(node: fx.Node) -> bool:
    """clone(x) of a computed x that is already contiguous, read only inside the graph, is x: the same values in
    the same layout (a functional graph never writes either). `x.reshape(-1)` traces so where x was a strided
    slice when Dynamo ran (`sort(...).indices[:, :k]`) and is contiguous after a rewrite (topk's indices), so its
    flat view and other views of x share one root again. A clone of a graph input or read by the graph's output
    stays (it may be there to keep an output from aliasing)."""
    if node.target is not aten.clone.default or node.kwargs.get("memory_format") not in (
            None, torch.contiguous_format, torch.preserve_format):
        return False
    x = node.args[0]
    out, inp = _val(node), _val(x)
    if not (isinstance(x, fx.Node) and x.op == "call_function" and isinstance(inp, torch.Tensor)
            and isinstance(out, torch.Tensor) and _static(inp) and inp.is_contiguous()
            and out.stride() == inp.stride() and all(u.op != "output" for u in node.users)):
        return False
    node.replace_all_uses_with(x)
    return True


def sort_permutation(order) -> bool:
    """order is the indices of a sort of a 1-D tensor of its length: a permutation of [0, M)."""
    src = order.args[0] if isinstance(order, fx.Node) and order.target is operator.getitem and order.args[1] == 1 else None
    if not (isinstance(src, fx.Node) and src.target in (aten.sort.default, aten.sort.stable)):
        return False
    v = _val(src.args[0])
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape == _val(order).shape


def _scatter_by_permutation(graph: fx.Graph, node: fx.Node) -> bool:
    """index_put(base, [p], v) with p a permutation of [0, M) (a sort's indices, `sorting_output[order] = rows`,
    SGLang's unpermute) and base and v both [M, ...] writes every row of base once, out[p[i]] = v[i], so base's
    values are never read: the result is the gather v[inv] by the inverse permutation inv = argsort(p) (sorting the
    distinct values of p: out[j] = v[inv[j]] since p[inv[j]] = j). Exact (rows are copied, not computed); not an
    accumulating index_put, nor one whose values broadcast."""
    if not (node.target in (aten.index_put.default, aten.index_put_.default) and len(node.args) >= 3
            and not (node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False))):
        return False
    base, indices, v = node.args[:3]
    if not (isinstance(indices, (list, tuple)) and len(indices) == 1 and sort_permutation(indices[0])):
        return False
    bv, vv = _val(base), _val(v)
    if not (isinstance(bv, torch.Tensor) and isinstance(vv, torch.Tensor) and bv.shape == vv.shape
            and bv.dtype == vv.dtype and bv.shape[0] == _val(indices[0]).shape[0]):
        return False
    inverse = _insert(graph, node, aten.sort.default, (indices[0], 0, False), source=node)
    inv = _insert(graph, node, operator.getitem, (inverse, 1), source=node)
    rows = _insert(graph, node, aten.index.Tensor, (v, [inv]), source=node)
    node.replace_all_uses_with(rows)
    graph.erase_node(node)
    _erase_unused(graph, [base])
    return True


def _erase_unused(graph: fx.Graph, nodes) -> None:
    """Erase the pure call nodes among `nodes` left without users, and so on up their inputs."""
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n.graph is graph and n.op == "call_function" and not n.users and not n.is_impure():
            stack.extend(n.all_input_nodes)
            graph.erase_node(n)


def normalize_graph(graph: fx.Graph, phases: Sequence[Sequence["Rule"]] | None = None) -> int:
    """Rewrite `graph` in place by the rules of `PHASES` (or `phases`): per sweep each phase's rules on every node in
    graph order, sweep after sweep until none applies (at most `_SWEEPS`); returns the rewrites made. The local
    rewrites run before the canonical ones: some local rules (the GPT-J RoPE) read the spelling the canonical layout
    rules would change (`docs/matching.md`: the rules are not yet confluent)."""
    setattr(graph, _SEQ_FIRST, _seq_first_batches(graph))
    total = 0
    for _ in range(_SWEEPS):
        changed = 0
        for rules in PHASES if phases is None else phases:
            applicable = _by_op(rules)
            changed += sum(_rewrite_node(graph, node, applicable) for node in list(graph.nodes))
        _erase_dead_layout(graph)
        total += changed
        if not changed:
            break
    return total


_SWEEPS = 8  # sweeps until no rule applies: the model and the foreign blocks need at most 4


def _by_op(rules: Sequence["Rule"]) -> Callable:
    """op -> the rules that may apply at it, in table order (cached)."""
    cache: dict = {}

    def applicable(target) -> tuple:
        if target not in cache:
            cache[target] = tuple(r for r in rules if (not r.roots or target in r.roots) and target not in r.skip)
        return cache[target]
    return applicable


def _rewrite_node(graph: fx.Graph, node: fx.Node, applicable: Callable) -> int:
    """The rules that may apply at node's op, in order, each that applies: until one says the node is done (`last`),
    or the node is erased or becomes another op (the rules for that op run in the next sweep). A layout op without
    users is left to be erased."""
    if node._erased or node.op != "call_function" or not node.users and node.target in _LAYOUT_OPS:
        return 0
    target, changed = node.target, 0
    for rule in applicable(target):
        done = rule.rewrite(graph, node)
        changed += int(done)
        if done and rule.last or node._erased or node.target is not target:
            break
    return changed


def _erase_dead_layout(graph: fx.Graph) -> None:
    """Layout ops and negations the rules left without users."""
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and node.target in (*_LAYOUT_OPS, *_NOTS, aten.neg.default):
            graph.erase_node(node)


@dataclass(frozen=True)
class Rule:
    """One rewrite, declared once: at a node whose op is in `roots` (any op where `roots` is empty, but those in
    `skip`), `rewrite(graph, node)` rewrites the graph and returns True (or how many operands it rewrote), or returns
    False and changes nothing. The rule's function states in its docstring the equality it uses and why it is exact;
    its unit tests are in tests/passes/test_normalize.py."""

    name: str
    rewrite: Callable[[fx.Graph, fx.Node], bool | int]
    roots: tuple = ()
    skip: tuple = ()
    last: bool = False  # where it applies, no later rule of its phase runs at the node in that sweep


def _at(test: Callable[[fx.Node], bool | int]) -> Callable[[fx.Graph, fx.Node], bool | int]:
    """A rule of a function of the node alone."""
    return lambda graph, node: test(node)


def _erasing(test: Callable[[fx.Node], bool]) -> Callable[[fx.Graph, fx.Node], bool]:
    """A rule of a test that a node equals its input (its users already moved there): the node erased."""
    def rewrite(graph: fx.Graph, node: fx.Node) -> bool:
        if not test(node):
            return False
        graph.erase_node(node)
        return True
    return rewrite


def _noop(graph: fx.Graph, node: fx.Node) -> bool:
    """A view or expand to the input's own shape, a full-range slice, a cast to the input's own dtype, an alias: the
    input itself."""
    if not _is_noop(node):
        return False
    node.replace_all_uses_with(node.args[0])
    graph.erase_node(node)
    return True


def _reshape_form(graph: fx.Graph, node: fx.Node) -> bool:
    """`_unsafe_view` is `view` (the same op on a functional graph)."""
    node.target = aten.view.default
    return True


# ---- exact canonical rewrites: layout chains, broadcast-only unsqueezes, negated where ---------------
_LAYOUT_OPS = (aten.view.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
               aten.permute.default)
_BROADCASTING = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.maximum.default,
                 aten.minimum.default, aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor,
                 aten.ge.Tensor, aten.where.self)


def _static(t) -> bool:
    return isinstance(t, torch.Tensor) and all(isinstance(d, int) for d in t.shape)


def _contiguous_strides(shape) -> list[int]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return strides[::-1]


def _layout_root(node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """The first non-layout producer above `node` and the chain of layout ops from it down to `node`."""
    chain = [node]
    while isinstance(chain[-1].args[0], fx.Node) and chain[-1].args[0].op == "call_function" and chain[-1].args[0].target in _LAYOUT_OPS:
        chain.append(chain[-1].args[0])
    return chain[-1].args[0], chain[::-1]


def _canonical_layout(root_shape, chain) -> tuple | None:
    """The chain's effect on a contiguous [root_shape] tensor as () (nothing), ("view", shape),
    ("permute", perm) or ("permute", perm, "view", shape); None when it is none of these."""
    t = torch.empty(root_shape, device="meta")
    try:
        for n in chain:
            t = n.target(t, *n.args[1:])
    except Exception:
        return None
    sizes, strides = list(t.shape), list(t.stride())
    if all(s == c for d, s, c in zip(sizes, strides, _contiguous_strides(sizes)) if d != 1):
        return () if sizes == list(root_shape) else ("view", sizes)
    root_strides = _contiguous_strides(root_shape)
    free = {i for i, d in enumerate(root_shape) if d != 1}
    perm = []
    for d, s in zip(sizes, strides):
        if d == 1:
            continue
        match = next((i for i in sorted(free) if root_shape[i] == d and root_strides[i] == s), None)
        if match is None:
            return None
        perm.append(match)
        free.discard(match)
    if free:
        return None
    perm += [i for i in range(len(root_shape)) if i not in perm]
    permuted = [root_shape[i] for i in perm]
    return ("permute", perm) if permuted == sizes else ("permute", perm, "view", sizes)


def _describe(root, chain) -> tuple:
    out = []
    for n in chain:
        if n.target not in (aten.view.default, aten.permute.default):
            return (n.target,)
        out += ["view" if n.target is aten.view.default else "permute", list(n.args[1])]
    return tuple(out)


def position(n: fx.Node) -> int:
    """n's index in its graph (cached per graph version)."""
    g = n.graph
    cache = getattr(g, "_dsv41_positions", None)
    if cache is None or cache[0] != len(g.nodes) or n not in cache[1]:
        cache = (len(g.nodes), {m: i for i, m in enumerate(g.nodes)})
        g._dsv41_positions = cache
    return cache[1][n]


def _fake_call(target, *args, **kwargs):
    def val(a):
        if isinstance(a, (list, tuple)):
            return type(a)(val(b) for b in a)
        return a.meta["val"] if isinstance(a, fx.Node) else a

    vals = val(list(args))
    mode = next((v.fake_mode for v in _leaves(vals) if isinstance(v, FakeTensor)), None)
    if mode is None:
        return target(*vals, **kwargs)
    with mode:
        return target(*vals, **kwargs)


def _insert(graph: fx.Graph, before: fx.Node, target, args, kwargs=None, source: fx.Node | None = None) -> fx.Node:
    """A new node target(*args, **kwargs) before `before`, with its fake value (and `source`'s stack metadata)."""
    kwargs = dict(kwargs or {})
    with graph.inserting_before(before):
        new = graph.call_function(target, tuple(args), kwargs)
    new.meta["val"] = _fake_call(target, *args, **kwargs)
    if source is not None:
        _copy_source(source, new)
    return new


def _leaves(vals):
    """The values inside nested lists and tuples."""
    for v in vals:
        if isinstance(v, (list, tuple)):
            yield from _leaves(v)
        else:
            yield v


def _emit(graph: fx.Graph, before: fx.Node, root: fx.Node, steps: tuple) -> fx.Node:
    value = root
    for op, arg in zip(steps[::2], steps[1::2]):
        target = aten.view.default if op == "view" else aten.permute.default
        with graph.inserting_before(before):
            new = graph.call_function(target, (value, arg))
        new.meta["val"] = _fake_call(target, value, arg)
        for key in ("stack_trace", "nn_module_stack"):
            if key in before.meta:
                new.meta[key] = before.meta[key]
        value = new
    return value


def _canonicalise_layout(graph: fx.Graph, node: fx.Node) -> bool:
    """Rewrite a chain of views/unsqueezes/squeezes/permutes ending at `node` as at most one permute and one view of
    its root (the same elements in the same order: an exact identity)."""
    root, chain = _layout_root(node)
    rv = _val(root)
    if not isinstance(root, fx.Node) or not _static(rv) or not _static(_val(node)):
        return False
    steps = _canonical_layout(list(rv.shape), chain)
    if steps is None or tuple(steps) == _describe(root, chain):
        return False
    node.replace_all_uses_with(_emit(graph, node, root, steps) if steps else root)
    graph.erase_node(node)
    return True


def _unit_slice_as_select(graph: fx.Graph, node: fx.Node) -> bool:
    """A broadcasting op's operand `x[i:i+1]` of a 1-D x is `x[i]` (a 0-d tensor): the output of rank >= 1 and its
    values are the same, and so is its dtype where every tensor operand has x's dtype (a 0-d tensor promotes
    like any other then). `scale.tensor_split(3)` pieces and `scale[0]` are one form: an exact identity."""
    out = _val(node)
    tensors = [a for a in node.args if isinstance(_val(a), torch.Tensor)]
    if not isinstance(out, torch.Tensor) or out.dim() < 1 or len({_val(a).dtype for a in tensors}) != 1:
        return False
    args, changed = list(node.args), False
    for i, a in enumerate(args):
        if not (isinstance(a, fx.Node) and a.target is aten.slice.Tensor and len(a.args) >= 4 and list(_val(a).shape) == [1]
                and _val(a.args[0]).dim() == 1 and (len(a.args) < 5 or a.args[4] == 1) and isinstance(a.args[2], int)):
            continue
        if not any(b is not a and _val(b).dim() >= 1 for b in tensors):
            continue
        args[i] = _insert(graph, node, aten.select.int, (a.args[0], 0, a.args[2]), source=node)
        changed = True
    if changed:
        node.args = tuple(args)
        for a in set(node.all_input_nodes) | {b for b in tensors if isinstance(b, fx.Node)}:
            if a.target is aten.slice.Tensor and not a.users:
                graph.erase_node(a)
    return changed


def _permute_without_units(graph: fx.Graph, node: fx.Node) -> bool:
    """view(permute(x, P), C) where x has size-1 dims right after its leading dim is view(permute(x without them,
    P without them), C): a size-1 dim does not change the row-major order of the elements, and the views restate
    the shape (an einsum's layout chain of a `[B, S=1, ...]` operand and of a `[T, ...]` one are one form): an
    exact identity. Applies when every user of the permute is a view; other size-1 dims (an einsum's own) stay."""
    if node.target is not aten.permute.default or not node.users or any(u.target is not aten.view.default for u in node.users):
        return False
    x = node.args[0]
    xv = _val(x)
    if not isinstance(x, fx.Node) or not _static(xv) or xv.dim() < 3 or xv.shape[1] != 1:
        return False
    run = 1  # the size-1 dims right after the leading one (the S of [B, S=1, ...]); a pattern's own stay
    while run < xv.dim() - 1 and xv.shape[run + 1] == 1:
        run += 1
    keep = [i for i in range(xv.dim()) if not 1 <= i <= run]
    src = x.args[0] if x.op == "call_function" and x.target is aten.view.default else x
    shape = [xv.shape[i] for i in keep]
    low = src if list(_val(src).shape) == shape else _view_once(graph, node, src, shape)
    rank = {old: new for new, old in enumerate(keep)}
    perm = [rank[d % xv.dim()] for d in node.args[1] if d % xv.dim() in rank]
    permuted = _insert(graph, node, aten.permute.default, (low, perm), source=node)
    for user in list(node.users):
        user.replace_input_with(node, permuted)
    graph.erase_node(node)
    return True


def _drop_broadcast_views(node: fx.Node) -> bool:
    """An operand of a broadcasting op viewed only to add leading size-1 dims is the operand itself."""
    args = _without_broadcast_views(node)
    if args is None:
        return False
    node.args = args
    return True


def _without_broadcast_views(node: fx.Node) -> tuple | None:
    """node's args with each operand viewed only to add leading size-1 dims (that the others' broadcasting adds
    anyway) replaced by the view's input; None where there is none."""
    out = _val(node)
    if not _static(out):
        return None
    args, changed = list(node.args), False
    for i, a in enumerate(args):
        if not (isinstance(a, fx.Node) and a.op == "call_function" and a.target is aten.view.default):
            continue
        src, av = a.args[0], _val(a)
        sv = _val(src)
        if not (_static(sv) and _static(av)) or av.dim() <= sv.dim():
            continue
        lead = av.dim() - sv.dim()
        if list(av.shape) != [1] * lead + list(sv.shape):
            continue
        others = [_val(b).shape for j, b in enumerate(args) if j != i and isinstance(b, fx.Node) and _static(_val(b))]
        if list(torch.broadcast_shapes(*others, sv.shape)) != list(out.shape):
            continue
        args[i], changed = src, True
    return tuple(args) if changed else None


def _swap_operand(graph: fx.Graph, node: fx.Node, i: int, new: fx.Node) -> bool:
    """node's operand i replaced by `new` where node's op on the new operands (fake values) gives a tensor of its
    own dtype and shape; the old operand erased if nothing else reads it. False (nothing changed) otherwise."""
    args = list(node.args)
    old, args[i] = args[i], new
    try:
        same = _fake_call(node.target, *args, **node.kwargs)
    except Exception:
        return False
    out = _val(node)
    if not (isinstance(same, torch.Tensor) and same.dtype == out.dtype and list(same.shape) == list(out.shape)):
        return False
    node.args = tuple(args)
    if not old.users:
        graph.erase_node(old)
    return True


def _drop_broadcast_expands(graph: fx.Graph, node: fx.Node) -> bool:
    """An operand `expand(a, shape)` of a broadcasting op is `a` where the op's broadcasting of `a` with the other
    operands gives the same output: expand is broadcasting made explicit, so each output element reads the same
    element of `a` either way (exact). Checked: the output's shape (which other operands must give) and dtype stay
    (an expanded 0-d tensor counts as dimensioned in type promotion, a 0-d one not)."""
    out = _val(node)
    if not _static(out):
        return False
    changed = False
    for i, a in enumerate(node.args):
        if (isinstance(a, fx.Node) and a.op == "call_function" and a.target is aten.expand.default
                and isinstance(a.args[0], fx.Node) and _static(_val(a.args[0]))):
            changed |= _swap_operand(graph, node, i, a.args[0])
    return changed


def _cast_above_expand(graph: fx.Graph, node: fx.Node) -> bool:
    """`convert_element_type(expand(a, shape), d)` is `expand(convert_element_type(a, d), shape)`: a cast is
    elementwise and expand repeats elements, so the two commute (exact); the cast then reads the unexpanded value,
    whose expand a broadcasting user may drop (`_drop_broadcast_expands`). Only where the cast has such a user:
    otherwise the cast keeps reading the expanded value, as a pattern's cast of an input reads it (the residual
    streams of a model's first layer are its embedding expanded over the streams)."""
    ex = node.args[0]
    if not (isinstance(ex, fx.Node) and ex.op == "call_function" and ex.target is aten.expand.default
            and isinstance(ex.args[0], fx.Node) and _static(_val(ex.args[0])) and _static(_val(node))
            and any(u.target in _BROADCASTING for u in node.users)):
        return False
    cast = _insert(graph, node, node.target, (ex.args[0], *node.args[1:]), node.kwargs, source=node)
    expanded = _insert(graph, node, aten.expand.default, (cast, list(_val(node).shape)), source=node)
    node.replace_all_uses_with(expanded)
    graph.erase_node(node)
    if not ex.users:
        graph.erase_node(ex)
    return True


def _full_as_scalar(graph: fx.Graph, node: fx.Node) -> bool:
    """An operand `full(shape, v)` of a broadcasting op that the other operands already broadcast to the output's
    shape, in the output's dtype, is the 0-d `scalar_tensor(v)` (`where(m, i, full_like(i, n))` and
    `where(m, i, n)` are one form; the output's dtype and shape are checked to stay the same)."""
    out = _val(node)
    if not _static(out):
        return False
    changed = False
    for i, a in enumerate(node.args):
        if not (isinstance(a, fx.Node) and a.op == "call_function" and a.target is aten.full.default
                and isinstance(a.args[1], (int, float)) and _val(a).dim() > 0 and _val(a).dtype == out.dtype):
            continue
        others = [_val(b).shape for j, b in enumerate(node.args) if j != i and isinstance(b, fx.Node) and _static(_val(b))]
        if not others or list(torch.broadcast_shapes(*others)) != list(out.shape):
            continue
        kwargs = {"dtype": out.dtype, "layout": torch.strided, "device": a.kwargs.get("device", out.device)}
        scalar = _insert(graph, node, aten.scalar_tensor.default, (a.args[1],), kwargs)
        if _swap_operand(graph, node, i, scalar):
            changed = True
        else:
            graph.erase_node(scalar)
    return changed


def _select_as_strided_slice(graph: fx.Graph, node: fx.Node) -> bool:
    """A select of one factor of a dim that a view splits in two, x.view(..., n, k, ...), is a slice of x along that
    dim: the i-th of each k adjacent elements (select on the k factor) is the stride-k slice `x[..., i::k]`
    (unflatten + select and stride-2 slicing of interleaved pairs are one form), the i-th run of k (select on the n
    factor) is `x[..., i*k:(i+1)*k]` (`gu.view(-1, 2, I).unbind(1)` and `gu[:, :I]`, `gu[:, I:]` are one form);
    exact."""
    src = node.args[0]
    if not (isinstance(src, fx.Node) and src.op == "call_function" and src.target is aten.view.default
            and len(node.args) == 3 and isinstance(node.args[2], int)):
        return False
    x, v = _val(src.args[0]), _val(src)
    if not (_static(x) and _static(v)):
        return False
    xs, vs, dim, i = list(x.shape), list(v.shape), node.args[1], node.args[2]
    d = next((j for j in range(x.dim()) if v.dim() == x.dim() + 1 and xs[:j] == vs[:j] and xs[j + 1:] == vs[j + 2:]
              and vs[j] * vs[j + 1] == xs[j]), None)
    base = src.args[0]
    if d is None:
        d = _split_pair_of_an_input_dim(xs, vs, dim)
        if d is None:
            return False
        base = _view_once(graph, node, base, vs[:d] + [vs[d] * vs[d + 1]] + vs[d + 2:])
    if dim not in (d, d + 1) or not 0 <= i < vs[dim]:
        return False
    n, k = vs[d], vs[d + 1]
    if dim == d + 1:  # the inner factor: every k-th element
        if k < 2:
            return False
        args = (base, d, i, _END, k)
    else:             # the outer factor: one run of k
        if n < 2:
            return False
        args = (base, d, i * k, _END if i == n - 1 else (i + 1) * k)
    piece = _insert(graph, node, aten.slice.Tensor, args, source=node)
    node.replace_all_uses_with(piece)
    graph.erase_node(node)
    return True


def _split_pair_of_an_input_dim(xs: list[int], vs: list[int], dim: int) -> int | None:
    """The d of the one pair of adjacent dims (d, d + 1) of a view's shape vs, one of them `dim`, both above 1, whose
    merge m = vs[:d] + [vs[d] * vs[d + 1]] + vs[d + 2:] is a split of one dim of the view's input shape xs: m is xs up
    to size-1 dims (a view that splits one dim and drops unit dims: [S, 1, 2I] -> [S, 2, I], a bmm's column-vector
    output split in halves), or the merged dim is a dim j of xs with the dims on one side of it unchanged, vs[d + 2:]
    = xs[j + 1:] or vs[:d] = xs[:j] (the dims on the other side reshaped in the same view: [T k, 1, 2I] -> [T, k, 2,
    I]); None where no pair or both pairs are, and where the view adds size-1 dims (vs holds more than xs): that is
    `_sink_units`' form, the unit dims sink and the split stays a plain one (RoPE pairs at one request: [1, H, rd] ->
    [1, 1, H, rd/2, 2]). A view is a row-major reshape, so x.view(vs) = x.view(m).view(vs) for any m that vs refines:
    the select is then the split-dim select of x.view(m), whose view into vs only splits d. The conditions only
    choose m: the view in which the split dim is one of x's own."""
    if vs.count(1) > xs.count(1):
        return None
    nonunit = [s for s in xs if s != 1]

    def splits_a_dim_of_x(d):
        merged, before, after = vs[d] * vs[d + 1], vs[:d], vs[d + 2:]
        j = len(xs) - len(after) - 1
        return ([s for s in before + [merged] + after if s != 1] == nonunit
                or 0 <= j and xs[j] == merged and xs[j + 1:] == after
                or d < len(xs) and xs[d] == merged and xs[:d] == before)

    pairs = [d for d in (dim - 1, dim) if 0 <= d and d + 1 < len(vs) and vs[d] > 1 and vs[d + 1] > 1
             and splits_a_dim_of_x(d)]
    return pairs[0] if len(pairs) == 1 else None


def _widening(cast: fx.Node) -> bool:
    """cast converts a float to a wider float (every value held exactly: bf16 or fp16 to fp32)."""
    a, b = _val(cast.args[0]), _val(cast)
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype.is_floating_point
            and b.dtype.is_floating_point and torch.finfo(b.dtype).bits > torch.finfo(a.dtype).bits
            and a.dtype in _NARROW_FLOATS)


def _cast_after_slice(graph: fx.Graph, node: fx.Node) -> bool:
    """convert(x)[..., i::k] = convert(x[..., i::k]) for a stride k > 1: the cast moves below the strided slice
    (`x.float()[..., 0::2]` and `x[..., 0::2].float()` are one form); so does a widening float cast that only slices
    read (the halves of a value cast up, `torch.chunk(y.float(), 2, -1)`, are the casts of y's halves,
    `y[..., :I].float()`), where the cast then goes. A run slice of a rounding cast (a norm's bf16 output, which a
    pattern may end at) or of a cast that other ops read too stays. Exact: a cast is elementwise."""
    src = node.args[0]
    if not (isinstance(src, fx.Node) and src.op == "call_function" and src.target is prims.convert_element_type.default
            and len(node.args) in (4, 5) and all(isinstance(a, int) for a in node.args[1:])):
        return False
    strided = len(node.args) == 5 and node.args[4] > 1
    if not strided and not (_widening(src) and all(u.target is aten.slice.Tensor for u in src.users)):
        return False
    strided = _insert(graph, node, aten.slice.Tensor, (src.args[0], *node.args[1:]), source=node)
    cast = _insert(graph, node, src.target, (strided, *src.args[1:]), src.kwargs, source=node)
    node.replace_all_uses_with(cast)
    graph.erase_node(node)
    if not src.users:
        graph.erase_node(src)
    return True


def _neg_before_view(graph: fx.Graph, node: fx.Node) -> bool:
    """neg(view(x)) = view(neg(x)): the negation moves above a view chain (`-sin.view(...)` and `(-sin).view(...)`
    are one form)."""
    src = node.args[0]
    if not (isinstance(src, fx.Node) and src.op == "call_function" and src.target is aten.view.default
            and len(src.users) == 1 and _static(_val(src.args[0]))):
        return False
    neg = _insert(graph, src, aten.neg.default, (src.args[0],))
    src.args = (neg, *src.args[1:])
    src.meta["val"] = _fake_call(aten.view.default, neg, *src.args[1:])
    node.replace_all_uses_with(src)
    graph.erase_node(node)
    return True


_NOTS = (aten.bitwise_not.default, aten.logical_not.default)  # the two spellings of ~m on a bool mask
# a comparison -> its complement, the form a `where` condition takes (`where(a >= b, x, y)` is `where(a < b, y, x)`)
_COMPLEMENTS = {aten.ge.Tensor: aten.lt.Tensor, aten.gt.Tensor: aten.le.Tensor, aten.ne.Tensor: aten.eq.Tensor,
                aten.ge.Scalar: aten.lt.Scalar, aten.gt.Scalar: aten.le.Scalar, aten.ne.Scalar: aten.eq.Scalar}


def _where_not(graph: fx.Graph, node: fx.Node) -> bool:
    """where(~m, a, b) = where(m, b, a) (m bool: `~m` and `logical_not(m)`); and where(a >= b, x, y) =
    where(a < b, y, x) (likewise > as <=, != as ==) when a and b are integers or booleans: without NaN the
    comparison is the negation of its complement."""
    cond = node.args[0]
    if not (isinstance(cond, fx.Node) and cond.op == "call_function"):
        return False
    if cond.target in _NOTS and isinstance(_val(cond.args[0]), torch.Tensor) and _val(cond.args[0]).dtype == torch.bool:
        node.args = (cond.args[0], node.args[2], node.args[1])
        return True
    complement = _COMPLEMENTS.get(cond.target)
    operands = [_val(a) if isinstance(a, fx.Node) else a for a in cond.args]
    if complement is None or not all(
            (isinstance(v, torch.Tensor) and not v.dtype.is_floating_point and not v.dtype.is_complex)
            or isinstance(v, (int, bool)) for v in operands):
        return False
    flipped = _insert(graph, node, complement, cond.args, cond.kwargs, source=cond)
    node.args = (flipped, node.args[2], node.args[1])
    if not cond.users:
        graph.erase_node(cond)
    return True


# ---- unit dims: a size-1 dim that a view or a graph input adds sinks below the ops it does not take part in -----
_REDUCTIONS = (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default)


def _units(shape, lead: bool = False) -> list[int]:
    """The non-leading size-1 dims of shape (the leading dim is the token or batch dim, which patterns keep), and
    with `lead` the leading dim first (a sequence-first [S=1, B, ...] value, `_lead`)."""
    return [i for i, d in enumerate(shape) if (i > 0 or lead) and d == 1]


_SEQ_FIRST = "_dsv41_seq_first"  # graph attribute: the batch sizes of its sequence-first [1, B, ...] linear layers


def _seq_first_batches(graph: fx.Graph) -> frozenset:
    """The sizes B > 1 at which the graph runs a linear layer on sequence-first activations: an mm whose input is a
    view of a [1, B, K] value to [B, K] and whose output is viewed to [1, B, N] (`F.linear` of Megatron's
    [S=1, B, ...] activations traces so). Only such evidence tells a leading unit dim from the token dim: [1, hc, D]
    at T = 1 is batch-first with one token."""
    batches = set()
    for n in graph.nodes:
        if n.op != "call_function" or n.target is not aten.mm.default:
            continue
        a, out = n.args[0], _val(n)
        if not (isinstance(a, fx.Node) and a.op == "call_function" and a.target is aten.view.default and _static(out)):
            continue
        b, src = out.shape[0], _val(a.args[0])
        if b > 1 and _static(src) and list(src.shape) == [1, b, _val(a).shape[1]] and any(
                u.target is aten.view.default and list(_val(u).shape) == [1, b, out.shape[1]] for u in n.users):
            batches.add(b)
    return frozenset(batches)


def _lead(shape, graph: fx.Graph) -> bool:
    """shape is [1, B, ...] with B a batch size of the graph's sequence-first layout (`_seq_first_batches`)."""
    return len(shape) >= 2 and shape[0] == 1 and shape[1] in getattr(graph, _SEQ_FIRST, ())


_GEMMS = (aten.mm.default, aten.addmm.default, aten.bmm.default)
_SUNK = "dsv41_units_sunk"  # meta key of a value computed at the lower rank by `_sink_units`


def _added_units(n) -> int:
    """How many non-leading size-1 dims n adds to the activation layout: a graph input, all of them; a view of a
    graph input or of a GEMM output (or of a permute of one), all of them (`_squeezed` views the input at the lower
    rank directly: a decode GEMM's M = 1 is such a dim); a view of a value `_sink_units` lowered, those its input
    lacks. A view inside a computation (a [M, 1, 32] block view
    when one block fits) adds none: its unit dim is the computation's, which a pattern traces as it is. In a
    sequence-first graph (`_lead`) the leading S = 1 of a [1, B, ...] value counts too."""
    v = _val(n)
    if not _static(v):
        return 0
    units = _units(v.shape, _lead(v.shape, n.graph))
    if n.op == "placeholder" or n.op == "call_function" and n.target is aten.bmm.default:
        return len(units)  # a graph input; a batched GEMM whose M or N is 1 (an einsum's [B, S=1, ...])
    if n.op != "call_function" or n.target is not aten.view.default or not _static(_val(n.args[0])):
        return 0
    src = n.args[0]
    if src.op == "placeholder":
        return len(units)
    root = src
    while root.op == "call_function" and root.target is aten.permute.default:
        root = root.args[0]
    if root.op == "call_function" and root.target in _GEMMS:
        return len(units)
    if root.op == "call_function" and root.meta.get(_SUNK):
        below = _val(src).shape
        return max(0, len(units) - len(_units(below, _lead(below, n.graph))))
    if _lead(v.shape, n.graph) and _val(src).dim() >= 1 and _val(src).shape[0] == v.shape[1]:
        return 1  # a [B, ...] value viewed sequence-first, [1, B, ...] (the MoE output `.view(s, b, d)`, the comb
        # logits `m.view(1, b, hc, hc)`)
    return 0


def _without(shape, drop) -> list[int]:
    return [d for i, d in enumerate(shape) if i not in drop]


def _view_once(graph: fx.Graph, before: fx.Node, a: fx.Node, shape: list[int]) -> fx.Node:
    """a viewed to shape: a view of a to it that comes before `before`, or a new one."""
    same = next((u for u in a.users if u.target is aten.view.default and list(_val(u).shape) == shape
                 and position(u) < position(before)), None)
    return same if same is not None else _insert(graph, before, aten.view.default, (a, shape))


def _squeezed(graph: fx.Graph, before: fx.Node, a: fx.Node, drop: set) -> fx.Node:
    """a without its size-1 dims `drop`: a view's input viewed once (the chain collapses), or a new view of a."""
    shape = _without(_val(a).shape, drop)
    src = a.args[0] if a.op == "call_function" and a.target is aten.view.default else a
    if list(_val(src).shape) == shape:
        return src
    return _view_once(graph, before, src, shape)


def _shift(dim: int, drop: set) -> int:
    return dim - sum(1 for s in drop if s < dim)


# op -> (positions of its same-rank tensor operands, position of its dim argument) for `_sink_units`
_DIM_OPERANDS = {aten.slice.Tensor: ((0,), 1), aten.select.int: ((0,), 1), aten._softmax.default: ((0,), 1),
                 aten.topk.default: ((0,), 2), aten.sort.default: ((0,), 1), aten.gather.default: ((0, 2), 1),
                 aten.scatter.value: ((0, 2), 1), aten.scatter.src: ((0, 2, 3), 1),
                 aten.expand.default: ((0,), None), **{r: ((0,), 1) for r in _REDUCTIONS}}


def _sink_units(graph: fx.Graph, node: fx.Node) -> bool:
    """op(x with size-1 dims S) = op(x without them) with the dims put back, for an op that does not touch S (a
    pointwise op whose output has size 1 there, a 1-D table's lookup `table[idx]`; a reduction, slice, select,
    softmax, top-k, sort, gather, scatter, expand or cat over other dims): an exact identity. S are the first non-leading unit
    dims of the output, as many as an operand's view or graph input added (`_added_units`); the ops of a [B, 1, ...] region then run at [B, ...] as a
    pattern traced at [T, ...] does, and one view restores each value's shape where the region ends."""
    out = _val(node)
    t = node.target
    pair = t in (aten.topk.default, aten.sort.default)  # (values, indices)
    if not node.users or not (_static(out) or pair):
        return False
    if pair and any(u.target is not operator.getitem for u in node.users):
        return False
    if isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags:
        operands = [i for i, a in enumerate(node.args) if isinstance(a, fx.Node) and _static(_val(a))]
        if any(isinstance(v, fx.Node) for v in node.kwargs.values()):
            return False
        ranked = [i for i in operands if _val(node.args[i]).dim() == out.dim()]
        added = max((_added_units(node.args[i]) for i in ranked), default=0)
        drop = set(_units(out.shape, _lead(out.shape, graph))[:added])
        if not drop:
            return False
        args = list(node.args)
        for i in operands:
            k = out.dim() - _val(args[i]).dim()  # right-aligned broadcasting: operand dim j is output dim j + k
            mine = {s - k for s in drop if s - k >= 0}
            if mine:
                args[i] = _squeezed(graph, node, args[i], mine)
    elif _is_lookup(node):  # table[idx]: pointwise in idx
        idx = node.args[1][0]
        drop = set(_units(out.shape, _lead(out.shape, graph))[:_added_units(idx)])
        if not drop:
            return False
        args = [node.args[0], [_squeezed(graph, node, idx, drop)]]
    elif t in _DIM_OPERANDS or t is aten.cat.default:
        positions, dim_at = _DIM_OPERANDS.get(t, ((), 1))
        xs = list(node.args[0]) if t is aten.cat.default else [node.args[i] for i in positions if i < len(node.args)]
        if not all(isinstance(x, fx.Node) and _static(_val(x)) and _val(x).dim() == _val(xs[0]).dim() for x in xs):
            return False
        if dim_at is not None and len(node.args) <= dim_at and t is not aten.cat.default:
            return False
        dim = node.args[dim_at] if dim_at is not None and len(node.args) > dim_at else 0
        dims = list(dim) if isinstance(dim, (list, tuple)) else [] if dim_at is None else [dim]
        if any(not isinstance(d, int) for d in dims):
            return False
        shape0 = _val(xs[0]).shape
        drop = sorted(s for s in _units(shape0, _lead(shape0, graph)) if s not in dims)
        drop = set(drop[:max(_added_units(x) for x in xs)])
        if t is aten.expand.default:
            drop = {s for s in drop if node.args[1][s] == 1}
        if not drop or any(_val(x).shape[s] != 1 for x in xs for s in drop):
            return False
        squeezed = iter([_squeezed(graph, node, x, drop) for x in xs])
        args = [list(squeezed) if t is aten.cat.default else a for a in node.args[:1]] + list(node.args[1:])
        for i in positions:
            if i < len(args):
                args[i] = next(squeezed)
        if t is aten.expand.default:
            args[1] = _without(node.args[1], drop)
        elif dim_at is not None and len(args) > dim_at:
            args[dim_at] = [_shift(d, drop) for d in dim] if isinstance(dim, (list, tuple)) else _shift(dim, drop)
    else:
        return False
    low = _insert(graph, node, t, args, node.kwargs, source=node)
    low.meta[_SUNK] = True
    if pair:  # (values, indices): each getitem lowered and lifted back
        for user in list(node.users):
            with graph.inserting_before(user):
                item = graph.call_function(operator.getitem, (low, user.args[1]))
            item.meta["val"] = low.meta["val"][user.args[1]]
            item.meta[_SUNK] = True
            _replace_lifted(graph, user, item)
        graph.erase_node(node)
        return True
    _replace_lifted(graph, node, low)
    return True


def _is_lookup(node: fx.Node) -> bool:
    """node is `table[idx]`: aten.index of a 1-D table by one integer index tensor (a lookup table's values at each
    index, e.g. the FP4 code values), pointwise in idx."""
    if node.target is not aten.index.Tensor or len(node.args) != 2 or len(node.args[1]) != 1:
        return False
    table, idx = _val(node.args[0]), _val(node.args[1][0])
    return (_static(table) and table.dim() == 1 and isinstance(node.args[1][0], fx.Node) and _static(idx)
            and not idx.dtype.is_floating_point and idx.dtype is not torch.bool)


def _copy_source(node: fx.Node, new: fx.Node) -> None:
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in node.meta:
            new.meta[key] = node.meta[key]


def _replace_lifted(graph: fx.Graph, node: fx.Node, low: fx.Node) -> None:
    """node's users read low viewed back to node's shape; node is erased."""
    shape = list(_val(node).shape)
    lifted = _insert(graph, node, aten.view.default, (low, shape), source=node)
    node.replace_all_uses_with(lifted)
    graph.erase_node(node)


def _tails(a, b) -> tuple[list[int], list[int]] | None:
    """The shapes a view of [a] to [b] reshapes: a and b without their longest common leading dims (None: none)."""
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return (list(a[k:]), list(b[k:])) if k < len(a) or k < len(b) else None


def _boundary_view(v: fx.Node) -> bool:
    """v gives a graph input or a GEMM output (or a permute of one) its layout: a pattern's input may be such a
    view's output, so the view stays where it is."""
    root = v.args[0]
    while isinstance(root, fx.Node) and root.op == "call_function" and root.target is aten.permute.default:
        root = root.args[0]
    return not isinstance(root, fx.Node) or root.op != "call_function" or root.target in _GEMMS


def _view_below_pointwise(graph: fx.Graph, node: fx.Node) -> bool:
    """op(view(x), view(y), s, c) = view(op(x, y, s, c)) for a pointwise op whose tensor operands are views that
    reshape the same trailing dims the same way ([T, 16] -> [T, 4, 4] and [16] -> [4, 4]) or 0-d tensors s, c
    numbers: an
    exact identity (`(m * s + b).view(T, 4, 4)` and `m.view(T, 4, 4) * s + b.view(4, 4)` are one form). The op
    takes two such operands or more: a view with numbers only (a cast, a square) stays, as such a view may be where
    a pattern's input enters it, and a pattern does not see what its input is a view of; views of graph inputs and
    GEMM outputs stay for that reason too (`_boundary_view`), and views that only add or drop size-1 dims are
    `_sink_units`'."""
    t, out = node.target, _val(node)
    if not (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags and _static(out)) or node.kwargs:
        return False
    views, tails, scalars = [], None, 0
    for a in node.args:
        v = _val(a)
        if not isinstance(a, fx.Node):
            continue
        if not _static(v):
            return False
        if v.dim() == 0:
            scalars += 1
            continue
        if a.op != "call_function" or a.target is not aten.view.default or _boundary_view(a):
            return False
        src = _val(a.args[0])
        if not _static(src) or _nonunit(src.shape) == _nonunit(v.shape):
            return False
        mine = _tails(list(src.shape), list(v.shape))
        if mine is None or tails not in (None, mine) or not mine[1] or list(out.shape[out.dim() - len(mine[1]):]) != mine[1]:
            return False
        tails = mine
        views.append(a)
    if not views or len(views) + scalars < 2:
        return False
    args = [a.args[0] if a in views else a for a in node.args]
    lead = out.dim() - len(tails[1])
    try:
        low_val = _fake_call(t, *args)
        with getattr(low_val, "fake_mode", None) or contextlib.nullcontext():
            low_val.view(out.shape)  # the op's output at the lower shape must be viewable back
    except Exception:
        return False
    if list(low_val.shape) != list(out.shape[:lead]) + tails[0]:
        return False
    with graph.inserting_before(node):
        low = graph.call_function(t, tuple(args))
    low.meta["val"] = low_val
    if any(isinstance(a, fx.Node) and a.meta.get(_SUNK) for a in args):
        low.meta[_SUNK] = True  # computed from values at the lower rank: its views may add their unit dims back
    _copy_source(node, low)
    lifted = _insert(graph, node, aten.view.default, (low, list(out.shape)), source=node)
    node.replace_all_uses_with(lifted)
    graph.erase_node(node)
    return True


# ---- block rows: a blocked computation over the last dim is one form however its rows are grouped ---------------
_ROWS = "dsv41_block_rows"  # meta key of a value `_split_rows` computes at [*A, n, k] instead of [prod(A) n, k]


def _row_split(a) -> tuple[fx.Node, list[int]] | None:
    """(source, its [*A, n, k] shape) when `a` is [M, k] rows of blocks of the last dim of a value: a view of a
    computed (not a graph input's or GEMM output's, `_boundary_view`) value [*A, n k] with k > 1 to
    [prod(A) n, k] (`x.reshape(-1, k)`), or a view of a value `_split_rows` computed at [*A, n, k]; else None.
    With one block a row (n = 1) the view only merges the leading dims A, and the block view [*A, 1, k] is the same
    elements in the same order, as `x.unflatten(-1, (-1, k))` writes it; taken where it merges two dims or more that
    patterns keep (a `[T, k, 32]` activation's rows, also at T = 1): a view that only drops the size-1 dims
    `_sink_units` sinks (`_units`: a `[T, 1, 32]` value's rows) is that rule's form, which runs the ops without
    them."""
    v = _val(a)
    if not (isinstance(a, fx.Node) and a.op == "call_function" and a.target is aten.view.default and _static(v)
            and v.dim() == 2 and isinstance(a.args[0], fx.Node) and _static(_val(a.args[0]))):
        return None
    src, shape = a.args[0], list(_val(a.args[0]).shape)
    if src.meta.get(_ROWS):
        return (src, shape) if shape[-1] == v.shape[1] and math.prod(shape[:-1]) == v.shape[0] else None
    k = v.shape[1]
    if _boundary_view(a) or len(shape) < 2 or k < 2 or shape[-1] % k \
            or shape[-1] == k and len(shape) - 1 - len(_units(shape[:-1], _lead(shape, a.graph))) < 2 \
            or math.prod(shape[:-1]) * (shape[-1] // k) != v.shape[0]:
        return None
    return src, shape[:-1] + [shape[-1] // k, k]


def _split_rows(graph: fx.Graph, node: fx.Node) -> bool:
    """op(x.reshape(-1, k), ...) = op(x.unflatten(-1, (-1, k)), ...).reshape(-1, ...) for a pointwise op, or a
    reduction over the last dim with keepdim, on [M, k] rows that are blocks of the last dim of x [*A, n k]: the op
    runs at [*A, n, k] (its [M, j] operands viewed so, its [j] and [1, j] ones broadcast as they were) and one view
    gives the users its [M, j] value: an exact identity, so the reference's `x.view(-1, block)` and
    `x.unflatten(-1, (-1, block))` quantisations are one form."""
    t, out = node.target, _val(node)
    if not (isinstance(t, torch._ops.OpOverload) and _static(out) and out.dim() == 2) or node.kwargs:
        return False
    reduction = t in _REDUCTIONS
    if reduction and not (len(node.args) == 3 and list(node.args[1]) == [1] and node.args[2] is True):
        return False
    if not reduction and torch.Tag.pointwise not in t.tags:
        return False
    tensors = [i for i, a in enumerate(node.args) if isinstance(a, fx.Node)]
    splits = {i: _row_split(node.args[i]) for i in tensors}
    lead = {tuple(sp[1][:-1]) for sp in splits.values() if sp is not None}
    if len(lead) != 1:
        return False
    lead = list(lead.pop())
    args = list(node.args)
    for i in tensors:
        v = _val(args[i])
        if not _static(v):
            return False
        if splits[i] is not None:
            src, shape = splits[i]
            args[i] = src if list(_val(src).shape) == shape else _view_once(graph, node, src, shape)
        elif v.dim() == 2 and v.shape[0] == out.shape[0]:
            args[i] = _view_once(graph, node, args[i], lead + [v.shape[1]])
        elif not (v.dim() == 0 or v.dim() == 1 or (v.dim() == 2 and v.shape[0] == 1)):
            return False
    if reduction:
        args[1] = [len(lead)]
    low = _insert(graph, node, t, args, source=node)
    low.meta[_ROWS] = True
    _replace_lifted(graph, node, low)
    return True


def _split_from(x: fx.Node, merged: list[int]) -> bool:
    """x [*A, n, k] is computed from a view of a value [*A, n k] (`merged`) into its blocks: a value `_split_rows`
    computed, or a chain of pointwise ops each with one operand of its own shape, back to a view of a [merged] value
    to that shape (`x.float().unflatten(-1, (-1, k))` and the quantisation's ops on it)."""
    shape = list(_val(x).shape)
    while isinstance(x, fx.Node) and x.op == "call_function" and _static(_val(x)) and list(_val(x).shape) == shape:
        if x.meta.get(_ROWS):
            return True
        if x.target is aten.view.default:
            return _static(_val(x.args[0])) and list(_val(x.args[0]).shape) == merged
        if not (isinstance(x.target, torch._ops.OpOverload) and torch.Tag.pointwise in x.target.tags) or x.kwargs:
            return False
        full = [a for a in x.args if isinstance(a, fx.Node) and _static(_val(a)) and list(_val(a).shape) == shape]
        if len(full) != 1:
            return False
        x = full[0]
    return False


def _cast_below_merge(graph: fx.Graph, node: fx.Node) -> bool:
    """convert(x).flatten(-2) = convert(x.flatten(-2)) for an x [*A, n, k] computed from blocks of a [*A, n k] value
    (`_split_from`: by `_split_rows`, or by pointwise ops on its unflatten view): where blocks end, a cast moves below
    the view that merges them back (`(q * s).to(bf16).reshape(shape)` of rows or of `x.unflatten(-1, (-1, k))`
    blocks and `(q * s).flatten(-2).to(bf16)` are one form); exact, as a cast works element by element and a view
    renames the elements. A view to the merged shape with size-1 dims inserted (a layout chain
    `y.reshape(shape)[:, None]` collapsed to one view) is the cast's merged value viewed so. Other casts stay: a
    cast's output may be a pattern's input, which the pattern then views (a bmm output cast, then flattened)."""
    src = node.args[0]
    if not (node.target is aten.view.default and isinstance(src, fx.Node) and src.op == "call_function"
            and src.target is prims.convert_element_type.default and len(src.users) == 1 and not src.kwargs
            and isinstance(src.args[0], fx.Node) and _static(_val(node)) and _static(_val(src))):
        return False
    x, v = list(_val(src).shape), list(_val(node).shape)
    merged = x[:-2] + [x[-2] * x[-1]] if len(x) >= 2 else None
    if merged is None or _nonunit(v) != _nonunit(merged) \
            or not _split_from(src.args[0], merged):
        return False
    if v != merged and any(u.target in _LAYOUT_OPS for u in node.users):
        return False  # (a view that a layout chain continues: the chain is one view first)
    view = _insert(graph, node, aten.view.default, (src.args[0], merged), source=node)
    cast = _insert(graph, node, src.target, (view, *src.args[1:]), source=src)
    # a view with unit dims more (`kv[:, None]` of the merged blocks) views the merged value: views compose
    out = cast if v == merged else _insert(graph, node, aten.view.default, (cast, v), source=node)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    graph.erase_node(src)
    return True


def _cast_of_merge_with_units(graph: fx.Graph, node: fx.Node) -> bool:
    """convert(view(x, v)) = view(convert(view(x, merged)), v) for an x that `_split_rows` computed, merged its
    blocks merged back and v that shape with size-1 dims inserted (`(q * s).reshape(x.shape).to(bf16)` of rows of a
    [B, 1, d] value): the unit dims come after the cast, as where the cast comes first (`_cast_below_merge`); exact."""
    view = node.args[0]
    if not (node.target is prims.convert_element_type.default and isinstance(view, fx.Node)
            and view.op == "call_function" and view.target is aten.view.default and len(view.users) == 1
            and isinstance(view.args[0], fx.Node) and view.args[0].meta.get(_ROWS) and not node.kwargs
            and _static(_val(view)) and _static(_val(view.args[0]))):
        return False
    x, v = list(_val(view.args[0]).shape), list(_val(view).shape)
    merged = x[:-2] + [x[-2] * x[-1]] if len(x) >= 2 else None
    if merged is None or v == merged or _nonunit(v) != _nonunit(merged):
        return False
    flat = _insert(graph, node, aten.view.default, (view.args[0], merged), source=view)
    cast = _insert(graph, node, node.target, (flat, *node.args[1:]), source=node)
    out = _insert(graph, node, aten.view.default, (cast, v), source=view)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    graph.erase_node(view)
    return True


def _nonunit(shape) -> list[int]:
    """The sizes of `shape` other than 1, in order."""
    return [d for d in shape if d != 1]


def _at_layout(o: fx.Node, viewed: list[int], own: list[int]) -> list[int] | None:
    """The shape at which an operand o that broadcasts against [viewed] pairs with the same elements of a value at
    [own], for a row-major view between [own] and [viewed]: o may vary only along the leading dims the two shapes
    share (a view keeps them) and must be 1 on the rest; None when it varies along a reshaped dim."""
    tail, _ = _tails(viewed, own) or ([], [])
    lead = len(viewed) - len(tail)
    full = [1] * (len(viewed) - _val(o).dim()) + list(_val(o).shape)
    if any(d != 1 for d in full[lead:]):
        return None
    return full[:lead] + [1] * (len(own) - lead)


def _reshape_copy(v: fx.Node) -> bool:
    """v is the view half of a reshape that copies a non-contiguous value first (a contiguous clone and a view:
    `z.transpose(0, 1).flatten(1)`, an einsum's `.flatten(1)`, an expanded mask flattened): a value the user wrote,
    where a pattern may end (the grouped wo_a's output, the indexer's candidate rows)."""
    src = v.args[0]
    return isinstance(src, fx.Node) and src.op == "call_function" and src.target is aten.clone.default \
        and src.kwargs.get("memory_format") is torch.contiguous_format


def keeps_first_view(v: fx.Node) -> bool:
    """Whether `_pointwise_between_views` leaves a round trip whose first view is v: a view that gives a graph input
    or a GEMM output its layout (`_boundary_view`) or the view of a reshape's copy (`_reshape_copy`), either of which
    may be where a pattern's input or output is."""
    return _boundary_view(v) or _reshape_copy(v)


def _pointwise_between_views(graph: fx.Graph, node: fx.Node) -> bool:
    """view(f(view(x, S1)), S0) with S0 x's own shape is f(x), for a chain f of pointwise ops each with one operand
    of its full shape (the chain) and otherwise numbers, 0-d tensors or operands that vary only along the leading
    dims S0 and S1 share (taken at S0: a per-row scale [T, 1, 1] as [T, 1]): the reference's dequantisation of
    `act_quant`'s flat values, `y.view(T, n * k).float().view(T, n, k)` of an e4m3 y [T, n, k], is `y.float()`. A
    view renames the elements and each op works element by element on the same pairs of elements, so values, dtype
    and shape are the same (checked): an exact identity. Not where an operand varies along a reshaped dim (a
    per-block scale [T, n, 1] against a flat value: `x.view(T, n, k).float() * s` viewed back), where a value of the
    chain has another user (it is read at the viewed layout), where the views only add or drop size-1 dims
    (`_sink_units`' form), nor where a pattern's input or output may be the first view (`keeps_first_view`: the model's
    FP8 step views the grouped wo_a's output `einsum(...).flatten(1)` back into its groups where o_lora_rank is the
    block, and wo_a's formulations end at that `.flatten(1)`)."""
    out = _val(node)
    if not (node.target is aten.view.default and _static(out)):
        return False
    ops, chained, cur = [], [], node.args[0]  # the chain from the view back up, and each op's chain operand
    while isinstance(cur, fx.Node) and cur.op == "call_function" and cur.target is not aten.view.default \
            and len(cur.users) == 1 and _static(_val(cur)):
        t, shape = cur.target, list(_val(cur).shape)
        if not (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags) or cur.kwargs \
                or torch.Tag.nondeterministic_seeded in t.tags or any(isinstance(a, (list, tuple)) for a in cur.args):
            return False
        full = [i for i, a in enumerate(cur.args) if isinstance(a, fx.Node) and list(_val(a).shape) == shape]
        if len(full) != 1:
            return False
        ops.append(cur)
        chained.append(full[0])
        cur = cur.args[full[0]]
    first = cur
    if not (ops and isinstance(first, fx.Node) and first.op == "call_function" and first.target is aten.view.default
            and len(first.users) == 1 and not keeps_first_view(first)):
        return False
    x, own, viewed = first.args[0], list(out.shape), list(_val(first).shape)
    if not (isinstance(x, fx.Node) and _static(_val(x)) and list(_val(x).shape) == own
            and _nonunit(own) != _nonunit(viewed)):
        return False
    shapes = {}  # each broadcast operand -> its shape against [own]
    for op, c in zip(ops, chained):
        for i, a in enumerate(op.args):
            if i != c and isinstance(a, fx.Node) and isinstance(_val(a), torch.Tensor) and _val(a).dim() > 0:
                shapes[a] = _at_layout(a, viewed, own) if _static(_val(a)) else None
                if shapes[a] is None:
                    return False
    value, made, same_dtypes = x, [], True
    for op, c in zip(reversed(ops), reversed(chained)):
        args = list(op.args)
        for i, a in enumerate(args):
            if i == c:
                args[i] = value
            elif a in shapes and shapes[a] != list(_val(a).shape):
                args[i] = _insert(graph, node, aten.view.default, (a, shapes[a]), source=op)
                made.append(args[i])
        value = _insert(graph, node, op.target, args, source=op)
        made.append(value)
        same_dtypes = same_dtypes and _val(value).dtype == _val(op).dtype
    if not same_dtypes or list(_val(value).shape) != own or _val(value).dtype != out.dtype:
        for n in reversed(made):
            graph.erase_node(n)
        return False
    node.replace_all_uses_with(value)
    for n in (node, *ops, first):
        graph.erase_node(n)
    return True


def _constant(n) -> bool:
    """n is a 0-d constant tensor node (`scalar_tensor`, the form a number operand of a where takes)."""
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target is aten.scalar_tensor.default


def _add_of_constant_where(graph: fx.Graph, node: fx.Node) -> bool:
    """x + where(c, a, b) with constants a and b is where(c, x + a, x + b) (elementwise, the same sums): an additive
    mask `s + where(visible, 0, -inf)` takes the where form the patterns use, `where(visible, s + 0, s - inf)`,
    whose branches the match then compares with `s` and `-inf` as parts computed another way; exact."""
    if node.target is not aten.add.Tensor or node.kwargs or len(node.args) != 2:
        return False
    for x, w in (node.args, node.args[::-1]):
        if isinstance(w, fx.Node) and w.op == "call_function" and w.target is aten.where.self and len(w.users) == 1 \
                and all(_constant(v) for v in w.args[1:]) and isinstance(_val(x), torch.Tensor):
            a = _insert(graph, node, aten.add.Tensor, (x, w.args[1]), source=node)
            b = _insert(graph, node, aten.add.Tensor, (x, w.args[2]), source=node)
            out = _insert(graph, node, aten.where.self, (w.args[0], a, b), source=node)
            if _val(out).shape != _val(node).shape or _val(out).dtype != _val(node).dtype:
                for n in (out, b, a):
                    graph.erase_node(n)
                return False
            node.replace_all_uses_with(out)
            graph.erase_node(node)
            graph.erase_node(w)
            return True
    return False


def _vector_on_the_left(graph: fx.Graph, node: fx.Node) -> bool:
    """A matrix times a vector, bmm(a [B, M, K], v [B, K, 1]) with M > 1, is the transpose of the vector times the
    matrix, bmm(v^T [B, 1, K], a^T [B, K, M]) [B, 1, M] (the same dot products; `einsum('tjd,tj->td', x, pre)` and
    `einsum('tj,tjd->td', pre, x)` are one form): the transposes are permutes, which the layout chains absorb."""
    a, v = node.args
    va, vv, out = _val(a), _val(v), _val(node)
    if not (_static(va) and _static(vv) and _static(out)) or out.shape[2] != 1 or out.shape[1] < 2:
        return False
    swap = [0, 2, 1]
    vt = _insert(graph, node, aten.permute.default, (v, swap), source=node)
    at = _insert(graph, node, aten.permute.default, (a, swap), source=node)
    row = _insert(graph, node, aten.bmm.default, (vt, at), source=node)
    col = _insert(graph, node, aten.permute.default, (row, swap), source=node)
    node.replace_all_uses_with(col)
    graph.erase_node(node)
    return True


_ELEMENTWISE = (aten.relu.default, aten.neg.default, aten.abs.default, aten.clamp_min.default, aten.clamp_max.default,
                aten.clamp.default, prims.convert_element_type.default, aten.add.Tensor, aten.sub.Tensor,
                aten.mul.Tensor, aten.div.Tensor)


def _chain_from_bmm(v: fx.Node) -> tuple[fx.Node, list[tuple[fx.Node, int]]] | None:
    """(bmm, [(op, index of the argument the chain enters by)], bmm first) where v is computed from one bmm's
    [B, M, N] output by elementwise ops, each read once, whose other tensor operands broadcast against it
    (rank 3, each dim of size 1 or the output's) or are 0-d; else None."""
    chain = []
    while isinstance(v, fx.Node) and v.op == "call_function" and len(v.users) == 1:
        if v.target is aten.bmm.default:
            return (v, chain[::-1]) if _static(_val(v)) else None
        out = _val(v)
        if v.target not in _ELEMENTWISE or any(isinstance(a, fx.Node) for a in v.kwargs.values()) \
                or not isinstance(out, torch.Tensor) or out.dim() != 3:
            return None
        full = [i for i, a in enumerate(v.args) if isinstance(a, fx.Node) and _val(a).shape == out.shape]
        others = [a for i, a in enumerate(v.args) if isinstance(a, fx.Node) and i not in full]
        if len(full) != 1 or not all(_val(a).dim() == 0 or (_val(a).dim() == 3 and all(
                s in (1, o) for s, o in zip(_val(a).shape, out.shape))) for a in others):
            return None
        chain.append((v, full[0]))
        v = v.args[full[0]]
    return None


def _reduced_over_columns(graph: fx.Graph, node: fx.Node) -> bool:
    """A sum over the columns of elementwise ops of a bmm, sum(f(bmm(a, b)), dim=2) with bmm(a, b) [B, M, N], is
    the sum over the rows of the same ops of the transposed product, sum(f^T(bmm(b^T, a^T)), dim=1), f^T taking
    each broadcast operand transposed (token-major index scores `bmm(keys, q^T)` [T, N, H] weighted and summed over
    the heads last are the head-major einsum('thd,tnd->thn') form summed over dim 1). The same dot products, the
    same elementwise ops on them and the same terms summed: exact up to the order of the fp32 sums (the GEMM's and
    the reduction's, as a GEMM in another layout). Only keepdim=False sums of rank-3 values."""
    if not (len(node.args) >= 2 and isinstance(node.args[1], (list, tuple)) and len(node.args[1]) == 1
            and (len(node.args) < 3 or node.args[2] is False)):
        return False
    x = _val(node.args[0])
    if not (isinstance(x, torch.Tensor) and x.dim() == 3 and node.args[1][0] % 3 == 2):
        return False
    found = _chain_from_bmm(node.args[0])
    if found is None:
        return False
    bmm, chain = found
    swap = [0, 2, 1]

    def transposed(a):
        return _insert(graph, node, aten.permute.default, (a, swap), source=node) if _val(a).dim() == 3 else a

    a, b = bmm.args
    value = _insert(graph, node, aten.bmm.default, (transposed(b), transposed(a)), source=bmm)
    for op, entry in chain:
        args = [value if i == entry else transposed(a) if isinstance(a, fx.Node) else a for i, a in enumerate(op.args)]
        value = _insert(graph, node, op.target, args, op.kwargs, source=op)
    total = _insert(graph, node, aten.sum.dim_IntList, (value, [1]), node.kwargs, source=node)
    last = node.args[0]
    node.replace_all_uses_with(total)
    graph.erase_node(node)
    _erase_unused(graph, [last])
    return True


def _single_batch_bmm(graph: fx.Graph, node: fx.Node) -> bool:
    """bmm(a [1, M, K], b [1, K, N]) where b is a 2-D [K, N] value viewed with a unit batch dim in front is mm(a[0],
    w) viewed to [1, M, N]: one GEMM against w (`einsum('bld,dq->blq', h, w)` with a Flax-style [in, out] kernel
    traces as such a bmm); the views join the operands' layout chains. A batch of 1 that is a dim of the operands
    (an einsum over T = 1 tokens) stays a bmm, as the patterns trace it, and so does one against a permuted value
    (a grouped einsum of one group, `einsum('tgd,grd->tgr')` at G = 1, which wo_a's patterns trace as a bmm)."""
    a, b = node.args
    va, vb, out = _val(a), _val(b), _val(node)
    if not (_static(va) and _static(vb) and _static(out)) or va.shape[0] != 1:
        return False
    w = b.args[0] if isinstance(b, fx.Node) and b.target is aten.view.default else None
    if not (isinstance(w, fx.Node) and w.target is not aten.permute.default and _static(_val(w))
            and list(_val(w).shape) == list(vb.shape[1:])):
        return False
    rows = _insert(graph, node, aten.view.default, (a, list(va.shape[1:])), source=node)
    product = _insert(graph, node, aten.mm.default, (rows, w), source=node)
    node.replace_all_uses_with(_insert(graph, node, aten.view.default, (product, list(out.shape)), source=node))
    graph.erase_node(node)
    return True


def _distinct_rows(idx) -> bool:
    """idx holds distinct values along its last dim: the indices of a top-k over the last dim of a 2-D value."""
    if not (isinstance(idx, fx.Node) and idx.op == "call_function" and idx.target is operator.getitem
            and idx.args[1] == 1):
        return False
    topk = idx.args[0]
    return (isinstance(topk, fx.Node) and topk.op == "call_function" and topk.target is aten.topk.default
            and _static(_val(topk.args[0])) and _val(topk.args[0]).dim() == 2 and len(topk.args) > 2
            and topk.args[2] == 1)


def _zeros(n) -> bool:
    """n is a `full` of 0 (through casts: `zeros_like(logits).int()`)."""
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target is prims.convert_element_type.default:
        n = n.args[0]
    return (isinstance(n, fx.Node) and n.op == "call_function" and n.target is aten.full.default
            and n.args[1] == 0)


def _insert_counts(graph: fx.Graph, before: fx.Node, ids: fx.Node, bins: int, dtype: torch.dtype,
                   accumulate=aten.scatter_add.default) -> fx.Node:
    """The counts of each value in [0, bins) among the 1-D integer ids, in dtype, inserted before `before`: ones
    accumulated into zeros, `zeros(bins).scatter_add(0, ids, ones)` (the model's form), or with `accumulate =
    index_put` `zeros.index_put([ids], ones, True)` (`index_add_`'s decomposition)."""
    vi = _val(ids)
    kw = {"dtype": dtype, "layout": torch.strided, "device": vi.device, "pin_memory": False}
    zeros = _insert(graph, before, aten.full.default, ([bins], 0), kw, source=before)
    ones = _insert(graph, before, aten.full.default, ([vi.numel()], 1), kw, source=before)
    args = (zeros, 0, ids, ones) if accumulate is aten.scatter_add.default else (zeros, [ids], ones, True)
    return _insert(graph, before, accumulate, args, source=before)


def _flat_view(graph: fx.Graph, ids: fx.Node, before: fx.Node) -> fx.Node:
    """ids viewed 1-D, available before `before`: the ids' own flat view where the graph has one (the sort's, moved
    up: its only input is ids; other flat views of ids, the same value, read as it), so the counts and the sort read
    one node; else a new view."""
    n = _val(ids).numel()
    flat, *copies = sorted((u for u in ids.users if u.target is aten.view.default and list(_val(u).shape) == [n]),
                           key=position) or [None]
    if flat is None:
        return _insert(graph, before, aten.view.default, (ids, [n]), source=before)
    for copy in copies:
        copy.replace_all_uses_with(flat)
        graph.erase_node(copy)
    if position(flat) > position(before):
        before.prepend(flat)
        graph._dsv41_positions = None
    return flat


def _routing_map_counts(graph: fx.Graph, node: fx.Node) -> bool:
    """The column sums of a routing map, `zeros(T, E).scatter(1, ids, 1).sum(0)` (Megatron's `tokens_per_expert =
    routing_map.sum(dim=0)`, the map maybe cast to int or bool), are the counts of each expert among the flat ids,
    `zeros(E).scatter_add(0, ids.view(-1), ones)`: exact where each row of ids [T, k] holds k distinct experts, as
    the indices of a top-k over the experts do (a row then sets k different ones of its E entries). Integer counts
    (int64) only: the sum of an integer or bool map."""
    out = _val(node)
    if not (node.target is aten.sum.dim_IntList and len(node.args) >= 2 and list(node.args[1]) == [0]
            and (len(node.args) < 3 or node.args[2] is False) and not node.kwargs
            and _static(out) and out.dtype is torch.int64):
        return False
    m = node.args[0]
    while isinstance(m, fx.Node) and m.op == "call_function" and m.target is prims.convert_element_type.default \
            and not _val(m).dtype.is_floating_point:
        m = m.args[0]
    if not (isinstance(m, fx.Node) and m.op == "call_function" and m.target is aten.scatter.value
            and m.args[1] == 1 and isinstance(m.args[3], (int, bool)) and m.args[3] != 0
            and not _val(m).dtype.is_floating_point and _zeros(m.args[0]) and _distinct_rows(m.args[2])):
        return False
    ids = m.args[2]
    (t, k), e = _val(ids).shape, _val(m).shape[1]
    flat = _flat_view(graph, ids, node)
    counts = _insert_counts(graph, node, flat, e, torch.int64)
    src = node.args[0]
    node.replace_all_uses_with(counts)
    graph.erase_node(node)
    _erase_unused(graph, [src])
    return True


# the largest integer n such that every integer in [0, n] is exact in the float dtype (2^(mantissa bits + 1))
_EXACT_INTEGERS = {torch.float32: 2 ** 24, torch.float64: 2 ** 53}


def _histc_exact_max(bins: int, hi, limit: int) -> bool:
    """Whether histc(float(ids), bins=n, min=0, max=b) puts every integer id in [0, n) into bin id. torch computes an
    element's bin as floor(x * n / b) in the input's float type (CPU and CUDA alike), with x = b in the last bin, n - 1.
    With b = n that is x exactly (x * n / n is exact). With n - 1 <= b < n (HF's `max=num_experts - 1`): for i <= n - 2,
    i <= i * n / b <= i + 1 - 1 / b (since (i + 1) b - i n >= n - 1 - i >= 1), so the floor is i once the quotient's
    rounding error, at most half an ulp of a value below n <= 2^c, 2^(c - p - 1) for a p-bit significand, stays
    below 1 / b >= 2^-c: 2c <= p suffices (and keeps i * n exact; fp32: n <= 2^12); and i = n - 1 lands in
    [n - 1, n], bin n - 1 (n clamps to it). A
    b outside [n - 1, n] misplaces ids (b > n: some i * n / b < i) or drops n - 1 (b < n - 1: above max)."""
    if hi == bins:
        return True
    significand = limit.bit_length() - 1  # limit = 2^p
    return isinstance(hi, (int, float)) and bins - 1 <= hi < bins and 2 * (bins - 1).bit_length() <= significand


def _histc_of_indices(graph: fx.Graph, node: fx.Node) -> bool:
    """histc(float(ids), bins=n, min=0, max=b) of integer ids whose values all lie in [0, U), U <= n (`_index_bound`:
    TorchTitan's `num_tokens_per_expert = torch.histc(top_k_ids.view(-1), bins=E, min=0, max=E)`, HF's `max=E - 1`),
    with b where every id lands in its own bin (`_histc_exact_max`), is the float of the counts of each value among
    the ids, `float(zeros(n, int32).scatter_add(0, ids.view(-1), ones))`. Exact where the float dtype holds every
    integer up to the number of ids (a count) and up to n (an id): fp32 up to 2^24."""
    x = node.args[0]
    if not (len(node.args) == 4 and not node.kwargs and isinstance(x, fx.Node) and x.op == "call_function"
            and x.target is prims.convert_element_type.default and _static(_val(x))):
        return False
    bins, lo, hi = node.args[1:]
    ids, limit = x.args[0], _EXACT_INTEGERS.get(_val(x).dtype)
    vi = _val(ids)
    bound = _index_bound(ids)
    if not (isinstance(bins, int) and lo == 0 and limit is not None and _histc_exact_max(bins, hi, limit)
            and isinstance(vi, torch.Tensor) and not vi.dtype.is_floating_point and vi.dtype is not torch.bool
            and bound is not None and bound <= bins and max(vi.numel(), bins) <= limit):
        return False
    while ids.op == "call_function" and ids.target is aten.view.default and _val(ids.args[0]).dim() > 1:
        ids = ids.args[0]  # the flat view's root, whose flat views the sort also reads
    flat = _flat_view(graph, ids, node) if _val(ids).dim() > 1 else ids
    counts = _insert_counts(graph, node, flat, bins, torch.int32)
    node.replace_all_uses_with(_insert(graph, node, prims.convert_element_type.default, (counts, _val(x).dtype),
                                       source=node))
    graph.erase_node(node)
    _erase_unused(graph, [x])
    return True


# sorted-sequence searches: searchsorted(sorted_sequence, values), bucketize(values, boundaries)
_SEARCHES = (aten.searchsorted.Tensor, aten.bucketize.Tensor)


def _searchsorted_as_counts(graph: fx.Graph, node: fx.Node) -> bool:
    """searchsorted(sort(x).values, arange(n), right=True) of 1-D integer x whose values all lie in [0, U), U <= n
    (`_index_bound`: top-k ids; a library user's expert offsets `torch.searchsorted(sorted_ids, torch.arange(E),
    right=True)`), is the cumsum of x's counts, `cumsum(zeros(n).scatter_add(0, x, ones), 0)`: entry v is the number
    of sorted values <= v, which for values in [0, n) is the sum of the counts of 0..v. Exact (integer sums); in the
    result's dtype (int64, or int32 with out_int32), and where every user casts it to int32, which holds every
    entry (at most x.numel() < 2^31), the counts and their cumsum are int32 and replace those casts (the model's
    `cumsum(counts, 0, dtype=torch.int32)`). `bucketize(arange(n), sort(x).values, right=True)` is the same search
    (boundaries[i - 1] <= v < boundaries[i]: i = the number of boundaries <= v)."""
    if not (node.target in _SEARCHES and len(node.args) == 2
            and set(node.kwargs) <= {"out_int32", "right", "side", "sorter"} and node.kwargs.get("sorter") is None
            and (node.kwargs.get("side") == "right" or node.kwargs.get("side") is None and node.kwargs.get("right"))):
        return False
    values, needles = node.args if node.target is aten.searchsorted.Tensor else node.args[::-1]
    sort = values.args[0] if isinstance(values, fx.Node) and values.target is operator.getitem \
        and values.args[1] == 0 else None
    x = sort.args[0] if _sort_dim_descending(sort) is not None and not _sort_dim_descending(sort)[1] else None
    vx, vn = _val(x), _val(needles)
    if not (isinstance(vx, torch.Tensor) and vx.dim() == 1 and not vx.dtype.is_floating_point
            and vx.dtype is not torch.bool and vx.numel() < 2**31 and isinstance(needles, fx.Node)
            and needles.target is prims.iota.default and _index_bound(needles) == vn.numel()):
        return False
    n, bound = vn.numel(), _index_bound(x)
    if bound is None or bound > n:
        return False
    casts = list(node.users)
    int32 = node.kwargs.get("out_int32", False) or all(
        c.target is prims.convert_element_type.default and c.args[1] is torch.int32 for c in casts)
    dtype = torch.int32 if int32 else torch.int64
    counts = _insert_counts(graph, node, x, n, dtype)
    offsets = _insert(graph, node, aten.cumsum.default, (counts, 0), {"dtype": dtype}, source=node)
    for c in casts if int32 and _val(node).dtype is not torch.int32 else ():
        c.replace_all_uses_with(offsets)
        graph.erase_node(c)
    node.replace_all_uses_with(offsets)
    graph.erase_node(node)
    _erase_unused(graph, [values, needles])
    return True


def _counts_of_permuted(graph: fx.Graph, node: fx.Node) -> bool:
    """The counts of x[p], `zeros.scatter_add(0, x[p], ones)` with p a permutation of x's M positions (a sort's
    indices, `sort_permutation`) and x 1-D, are the counts of x: a count is a sum of ones over the positions holding
    a value, and p only reorders the positions (HF's histc of `expert_ids[perm]`). Exact (integer sums)."""
    if _count_bound(node) is None:
        return False
    p = _lookup_index(node.args[2])
    x = node.args[2].args[0] if p is not None else None
    if not (p is not None and sort_permutation(p) and _val(x).dim() == 1 and _val(x).shape == _val(p).shape):
        return False
    looked_up = node.args[2]
    node.args = (node.args[0], node.args[1], x, node.args[3])
    _erase_unused(graph, [looked_up])
    return True


def _count_bound(c) -> int | None:
    """M when c counts M indices, `zeros.scatter_add(0, idx, ones)` with M = idx.numel(): every value in [0, M]."""
    if not (isinstance(c, fx.Node) and c.op == "call_function" and c.target is aten.scatter_add.default
            and _zeros(c.args[0]) and isinstance(c.args[3], fx.Node) and c.args[3].target is aten.full.default
            and c.args[3].args[1] == 1 and _static(_val(c.args[2]))):
        return None
    return _val(c.args[2]).numel()


def _cumsum_of_exact_cast(graph: fx.Graph, node: fx.Node) -> bool:
    """cumsum(float(c), d, dtype=D) of integer counts c of dtype D (`_count_bound`) that the float holds exactly is
    cumsum(c, d, dtype=D): cumsum casts its input to D first, and the round trip D -> float -> D of an exact integer
    is that integer (titan's `torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)` of histc's counts)."""
    x, dtype = node.args[0], node.kwargs.get("dtype")
    if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target is prims.convert_element_type.default
            and set(node.kwargs) == {"dtype"} and len(node.args) == 2):
        return False
    c, limit = x.args[0], _EXACT_INTEGERS.get(_val(x).dtype)
    bound = _count_bound(c)
    if not (limit is not None and bound is not None and bound <= limit and _val(c).dtype is dtype):
        return False
    node.args = (c, node.args[1])
    _erase_unused(graph, [x])
    return True


def _counts_parts(c) -> tuple[fx.Node, int] | None:
    """(the ids, their number M) when c counts them by accumulating ones into zeros: `zeros.scatter_add(0, ids,
    ones)` (`_count_bound`) or `zeros.index_put([ids], ones, accumulate=True)` (`zeros.index_add_(0, ids, ones)` of
    1-D ids as it decomposes); else None."""
    bound = _count_bound(c)
    if bound is not None:
        return c.args[2], bound
    if not (isinstance(c, fx.Node) and c.op == "call_function" and c.target is aten.index_put.default
            and len(c.args) == 4 and c.args[3] is True and _zeros(c.args[0]) and len(c.args[1]) == 1
            and isinstance(c.args[2], fx.Node) and c.args[2].target is aten.full.default and c.args[2].args[1] == 1
            and _static(_val(c.args[1][0])) and _val(c.args[1][0]).dim() == 1 and _val(c.args[0]).dim() == 1):
        return None
    return c.args[1][0], _val(c.args[1][0]).numel()


def _counts_in_cumsum_dtype(graph: fx.Graph, node: fx.Node) -> bool:
    """cumsum(c, d, dtype=D) of integer counts c (`_counts_parts`: M ids counted by accumulating ones into zeros) in
    another integer dtype is the cumsum of the counts accumulated in D, and so is cumsum(c, d) with D = int64 (torch
    sums an integer input in int64): cumsum casts its input to D first, and a count, at most M, is exact in both
    dtypes, so the cast of the counts is the counts computed in D (`torch.zeros(E, dtype=torch.long).index_add_(0,
    ids, ones)` under `torch.cumsum(..., dtype=torch.int32)` is the model's int32 counts). Where c has other users it
    stays."""
    c = node.args[0]
    parts = _counts_parts(c)
    vc = _val(c)
    if parts is None or len(node.args) != 2 or set(node.kwargs) - {"dtype"} or len(c.users) != 1:
        return False
    ids, m = parts
    dtype = node.kwargs.get("dtype") or torch.int64
    integer = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
    if not (vc.dtype in integer and dtype in integer and vc.dtype is not dtype and vc.dim() == 1
            and m <= min(torch.iinfo(vc.dtype).max, torch.iinfo(dtype).max)):
        return False
    node.args = (_insert_counts(graph, c, ids, vc.shape[0], dtype, c.target), node.args[1])
    _erase_unused(graph, [c])
    return True




def _block_split(v: fx.Node) -> bool:
    """v views a computed value [*A, n k] into its blocks [*A, n, k] (k > 1; `x.view(*x.shape[:-1], -1, k)`, the
    unflatten of the last dim) that a reduction over the block dim reads (`_reduced_per_block`), not a view that
    gives a graph input or a GEMM output its layout, nor a reshape's copy (`keeps_first_view`: a pattern's input
    or output may be that view)."""
    if not (isinstance(v, fx.Node) and v.op == "call_function" and v.target is aten.view.default
            and isinstance(v.args[0], fx.Node) and _static(_val(v)) and _static(_val(v.args[0]))):
        return False
    src, out = list(_val(v.args[0]).shape), list(_val(v).shape)
    return (len(out) == len(src) + 1 and out[:-2] == src[:-1] and out[-1] > 1 and out[-2] * out[-1] == src[-1]
            and not keeps_first_view(v) and _reduced_per_block(v, len(out) - 1))


def _reduced_per_block(v: fx.Node, dim: int) -> bool:
    """A reduction over the block dim `dim` reads v's blocks, through widening casts and abs (the blockwise
    quantisation's amax: `x.view(T, -1, k).abs().float().amax(-1)`): v is a quantisation's block view, not a split
    into heads that other code (a RoPE, a norm's rounding just above it, where a pattern may end) reads as values."""
    stack, seen = [v], set()
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in seen or u.op != "call_function":
                continue
            seen.add(u)
            if u.target in _REDUCTIONS and len(u.args) > 1 and isinstance(u.args[1], (list, tuple)) \
                    and [d % (dim + 1) for d in u.args[1]] == [dim]:
                return True
            if u.target is aten.abs.default or u.target is prims.convert_element_type.default and _widening(u):
                stack.append(u)
    return False


def _widening_cast_above_block_view(graph: fx.Graph, node: fx.Node) -> bool:
    """convert(view(x, [*A, n, k]), wide) = view(convert(x, wide), [*A, n, k]) for a widening float cast (bf16 or
    fp16 to fp32: every value held exactly) of a block view of x (`_block_split`): a cast works element by element
    and a view renames the elements, so both are the same values bit for bit. The blocks' cast comes first, as the
    reference's `x.float().unflatten(-1, (-1, k))` writes it (DeepGEMM's per-token-group cast views the bf16 value
    into blocks first: `x.view(T, -1, k).abs().float()`). A cast of another view stays (a pattern's input may be the
    view), as does a narrowing cast (the e4m3 values, whose merge view `_cast_below_merge` moves)."""
    view = node.args[0]
    if not (node.target is prims.convert_element_type.default and _widening(node) and _block_split(view)):
        return False
    cast = _insert(graph, node, node.target, (view.args[0], *node.args[1:]), node.kwargs, source=node)
    node.replace_all_uses_with(_insert(graph, node, aten.view.default, (cast, list(_val(view).shape)), source=view))
    graph.erase_node(node)
    if not view.users:
        graph.erase_node(view)
    return True


def _widening_cast_above_abs(graph: fx.Graph, node: fx.Node) -> bool:
    """convert(abs(x), wide) = abs(convert(x, wide)) for a widening float cast (bf16 or fp16 to fp32): the cast is
    exact and abs only clears the sign bit, in either type, so the two are the same values bit for bit (NaN stays
    NaN). The cast comes first, as the reference's amax of `x.float()`'s blocks writes it (DeepGEMM's
    `x_view.abs().float().amax(...)`); then a cast of a block view moves above the view
    (`_widening_cast_above_block_view`)."""
    a = node.args[0]
    if not (node.target is prims.convert_element_type.default and _widening(node) and isinstance(a, fx.Node)
            and a.op == "call_function" and a.target is aten.abs.default and isinstance(a.args[0], fx.Node)):
        return False
    cast = _insert(graph, node, node.target, (a.args[0], *node.args[1:]), node.kwargs, source=node)
    node.replace_all_uses_with(_insert(graph, node, aten.abs.default, (cast,), source=a))
    graph.erase_node(node)
    if not a.users:
        graph.erase_node(a)
    return True


def _abs_of_nonnegative(node: fx.Node) -> bool:
    """abs(u) = u where every value of u is at least a positive bound (`_lower_bound`: a floored amax divided by
    448, as DeepGEMM's `ceil_to_ue8m0(u) = 2 ** ceil(log2(u.abs()))` takes it): abs leaves a positive value as it
    is (a NaN stays NaN), so the scale reads `u` itself, which `_normal_power_of_two` then sees through."""
    if not (node.target is aten.abs.default and len(node.args) == 1 and not node.kwargs
            and isinstance(node.args[0], fx.Node) and _val(node.args[0]) is not None
            and _val(node.args[0]).dtype == _val(node).dtype and _lower_bound(node.args[0]) is not None):
        return False
    node.replace_all_uses_with(node.args[0])
    return True


# ---- the rules, by the op they rewrite at ----------------------------------------------------------------------
# first, per sweep: spellings of single ops and small local forms
LOCAL_RULES: tuple[Rule, ...] = (
    Rule("rotate_every_two", _rotate_every_two, (aten.add.Tensor,), last=True),
    Rule("copies_as_repeat", _copies_as_repeat, (aten.cat.default,), last=True),
    Rule("pointwise_above_repeat", _pointwise_above_repeat, _ABOVE_REPEAT, last=True),
    Rule("scalar_overload", _at(_scalar_overload)),
    Rule("fused_arith", _fused_arith),
    Rule("gemm_plus_input", _gemm_plus_input),
    Rule("scatter_reduce_sum", _at(_scatter_reduce_sum), (aten.scatter_reduce.two,)),
    Rule("gather_1d", _at(_gather_1d), (aten.gather.default,)),
    Rule("ldexp", _ldexp, (aten.ldexp.Tensor,)),
    Rule("tensor_literal", _tensor_literal, last=True),
    Rule("clamp_by_constants", _clamp_by_constants),
    Rule("extremum_with_constant", _extremum_with_constant),
    Rule("one_sided_clamp", _at(_one_sided_clamp), (aten.clamp.default,)),
    Rule("sum_of_widening_cast", _sum_of_widening_cast, (aten.sum.dim_IntList,)),
    Rule("gather_of_broadcast_rows", _gather_of_broadcast_rows, (aten.gather.default,)),
    Rule("remainder_in_range", _erasing(_remainder_in_range), (aten.remainder.Scalar,)),
    Rule("clone_of_contiguous", _erasing(_clone_of_contiguous), (aten.clone.default,)),
    Rule("integer_round_trip", _integer_round_trip, (prims.convert_element_type.default,), last=True),
    Rule("sort_of_lossless_narrowing", _sort_of_lossless_narrowing),
    Rule("slice_update_as_cat", _slice_update_as_cat, (aten.slice_scatter.default,), last=True),
    Rule("sorted_prefix_as_topk", _sorted_prefix_as_topk, (aten.slice.Tensor,), last=True),
    Rule("scatter_by_permutation", 
         _scatter_by_permutation, (aten.index_put.default, aten.index_put_.default), last=True),
    Rule("copy_as_value", _copy_as_value, (aten.copy.default,), last=True),
    Rule("piece_of_split", _piece_of_split),
    Rule("implicit_promotion", _implicit_promotion, _PROMOTING),
    Rule("fill_defaults", _at(_fill_defaults), _DEFAULTS_FILLED),
    Rule("reshape_form", _reshape_form, (aten._unsafe_view.default,)),
    Rule("canonical_args", _at(_canonical_args)),
    Rule("view_of_full", _at(_view_of_full), (aten.view.default,)),
    Rule("add_of_neg", _at(_add_of_neg), (aten.add.Tensor,)),
    Rule("square", _at(_square), (aten.mul.Tensor,)),
    Rule("negation", _at(_negation)),
    Rule("max_values", _max_values),
    Rule("keepdim", _keepdim, (aten.unsqueeze.default,)),
    Rule("keepdim_dropped", _keepdim_dropped, (aten.view.default,)),
    Rule("clamp_before_e4m3", _clamp_before_e4m3),
    Rule("times_reciprocal", _times_reciprocal, (aten.mul.Tensor,)),
    Rule("narrow_product_of_casts", _narrow_product_of_casts, (aten.mul.Tensor,), last=True),
    Rule("times_one", _erasing(_times_one), (aten.mul.Tensor,)),
    Rule("abs_of_nonnegative", _erasing(_abs_of_nonnegative), (aten.abs.default,)),
    Rule("noop", _noop),
)
# then, per sweep: layout chains, broadcast-only views, casts and counts in canonical form
CANONICAL_RULES: tuple[Rule, ...] = (
    Rule("canonical_layout", _canonicalise_layout, _LAYOUT_OPS, last=True),
    Rule("cast_below_merge", _cast_below_merge, _LAYOUT_OPS, last=True),
    Rule("permute_without_units", _permute_without_units, _LAYOUT_OPS, last=True),
    Rule("pointwise_between_views", _pointwise_between_views, _LAYOUT_OPS, last=True),
    Rule("neg_before_view", _neg_before_view, (aten.neg.default,), last=True),
    Rule("cast_of_merge_with_units", _cast_of_merge_with_units, (prims.convert_element_type.default,), last=True),
    Rule("cast_above_expand", _cast_above_expand, (prims.convert_element_type.default,), last=True),
    Rule("widening_cast_above_abs", _widening_cast_above_abs, (prims.convert_element_type.default,), last=True),
    Rule("widening_cast_above_block_view", _widening_cast_above_block_view, (prims.convert_element_type.default,),
         last=True),
    Rule("view_below_pointwise", _view_below_pointwise, skip=_LAYOUT_OPS, last=True),
    Rule("split_rows", _split_rows, skip=_LAYOUT_OPS, last=True),
    Rule("select_as_strided_slice", _select_as_strided_slice, (aten.select.int,), last=True),
    Rule("cast_after_slice", _cast_after_slice, (aten.slice.Tensor,), last=True),
    Rule("sink_units", _sink_units, skip=_LAYOUT_OPS, last=True),
    Rule("single_batch_bmm", _single_batch_bmm, (aten.bmm.default,), last=True),
    Rule("vector_on_the_left", _vector_on_the_left, (aten.bmm.default,), last=True),
    Rule("add_of_constant_where", _add_of_constant_where, (aten.add.Tensor,), last=True),
    Rule("routing_map_counts", _routing_map_counts, (aten.sum.dim_IntList,), last=True),
    Rule("reduced_over_columns", _reduced_over_columns, (aten.sum.dim_IntList,), last=True),
    Rule("histc_of_indices", _histc_of_indices, (aten.histc.default,), last=True),
    Rule("cumsum_of_exact_cast", _cumsum_of_exact_cast, (aten.cumsum.default,), last=True),
    Rule("counts_in_cumsum_dtype", _counts_in_cumsum_dtype, (aten.cumsum.default,), last=True),
    Rule("searchsorted_as_counts", _searchsorted_as_counts, _SEARCHES, last=True),
    Rule("counts_of_permuted", _counts_of_permuted, (aten.scatter_add.default,), last=True),
    Rule("lookup_by_iota_as_slice", _lookup_by_iota_as_slice, (aten.index.Tensor,), last=True),
    Rule("lookup_of_lookup", _lookup_of_lookup, (aten.index.Tensor,), last=True),
    Rule("lookup_of_pair_tokens", _lookup_of_pair_tokens, (aten.index.Tensor,), last=True),
    Rule("lookup_by_pair_tokens", _lookup_by_pair_tokens, (aten.index.Tensor,), last=True),
    Rule("drop_broadcast_views", _at(_drop_broadcast_views), _BROADCASTING),
    Rule("full_as_scalar", _full_as_scalar, _BROADCASTING),
    Rule("unit_slice_as_select", _unit_slice_as_select, _BROADCASTING),
    Rule("drop_broadcast_expands", _drop_broadcast_expands, _BROADCASTING),
    Rule("where_not", _where_not, (aten.where.self,)),
)
PHASES = (LOCAL_RULES, CANONICAL_RULES)
