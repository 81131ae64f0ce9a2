"""Defunctionalisation, the last pass: `auto_functionalized(op, **kw)` becomes the in-place call `op(**kw)`.

Functionalisation wraps every mutating custom op in the `auto_functionalized` higher-order op, which clones the
mutated inputs. In `fx` mode nothing else removes those clones, so this pass turns each wrapper back into the
in-place call: `getitem(wrapper, 0)` (the op's own result) becomes the call, `getitem(wrapper, 1 + i)` (the new
value of the i-th mutated argument) becomes that argument. The call has no users of its own when the op returns
nothing, so no dead-code elimination may run after this pass. Inductor mode leaves the wrappers to Inductor's own
`decompose_auto_functionalized`. The backend pins `enable_auto_functionalized_v2=False` so the wrappers are v1.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dsv41.passes.fusion import GraphPass, PassResult


class DefunctionalizePass(GraphPass):
    name = "defunctionalize"

    def __call__(self, graph: fx.Graph) -> PassResult:
        result = PassResult(self.name)
        if self.config.mode != "fx":
            return result
        af = torch.ops.higher_order.auto_functionalized
        for node in list(graph.find_nodes(op="call_function", target=af)):
            op, kwargs = node.args[0], dict(node.kwargs)
            mutated = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
            with graph.inserting_before(node):
                call = graph.call_function(op, (), kwargs)
            n_returns = len(op._schema.returns)
            wrapped = node.meta.get("val")
            call.meta = {**node.meta, "val": (wrapped[0] if n_returns == 1 else tuple(wrapped[:n_returns]) if n_returns else None)
                         if wrapped is not None else None}
            first_mutated = max(1, n_returns)  # the wrapper returns (result or None, *mutated) or (*results, *mutated)
            for user in list(node.users):
                assert user.target is operator.getitem, f"unexpected user {user} of {node}"
                i = user.args[1]
                if i >= first_mutated:
                    user.replace_all_uses_with(kwargs[mutated[i - first_mutated]])
                    graph.erase_node(user)
                elif n_returns == 1:
                    user.replace_all_uses_with(call)
                    graph.erase_node(user)
                else:  # one of several results: index the call itself
                    user.args = (call, i)
            graph.erase_node(node)
            result.matches += 1
        return result
