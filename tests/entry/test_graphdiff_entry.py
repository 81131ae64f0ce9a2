"""graph-diff `compare` matches nodes by structure, not by name; `show` rejects filters outside the recording.

Recordings of a small MoE-tail function (one moe_finalize match, fx mode, ~2 s) instead of a model: B is a copy
of A whose node names are all renumbered (what a different compile order gives), C renumbers them and changes
one op.
"""

from __future__ import annotations

import io
import re
import shutil
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch

from dsv41.backend import make_backend
from dsv41.tools import graphdiff
from dsv41.tools.graphdiff import record
from dsv41.tools.graphdiff_view import structural_keys

NODE = re.compile(r"%([A-Za-z_]+?)(_\d+)?\b")


def run(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = graphdiff.main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def moe_tail(out, token, shared):
    y = torch.zeros(shared.shape, dtype=torch.float32).index_add_(0, token, out.float())
    return (y + shared.float()).to(shared.dtype) * 2


def renumber(path, change_op: bool = False) -> None:
    """Every node %name_K of every graph file under path becomes %name_{K+100} (a plain %name gets _7), so no
    line keeps its text; change_op also turns the first mul.Tensor into a div.Tensor."""
    for f in path.rglob("*.txt"):
        text = NODE.sub(lambda m: f"%{m.group(1)}_{int(m.group(2)[1:]) + 100 if m.group(2) else 7}", f.read_text())
        if change_op and "after" in f.name:
            text = text.replace("mul.Tensor", "div.Tensor", 1)
        f.write_text(text)


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    root = tmp_path_factory.mktemp("gd")
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(12, 16, generator=g).bfloat16(), torch.randperm(12, generator=g) // 6,
            torch.randn(2, 16, generator=g).bfloat16())
    torch._dynamo.reset()
    with record(root / "a"), torch.no_grad():
        torch.compile(moe_tail, backend=make_backend(mode="fx"), fullgraph=True)(*args)
    torch._dynamo.reset()
    shutil.copytree(root / "a", root / "b")
    renumber(root / "b")
    shutil.copytree(root / "a", root / "c")
    renumber(root / "c", change_op=True)
    return root


def test_renamed_nodes_are_not_changes(recordings):
    a, b = recordings / "a", recordings / "b"
    files = sorted(p.relative_to(a) for p in a.rglob("*.after.txt"))
    assert files and all((a / f).read_text() != (b / f).read_text() for f in files)  # every after-graph renamed
    rc, out, _ = run("compare", a, b, "--pass", "moe_finalize")
    assert rc == 0 and out.rstrip().endswith("the recordings agree") and "graph after moe_finalize, A -> B: identical" in out, out


def test_a_changed_op_is_the_only_diff_line(recordings):
    rc, out, _ = run("compare", recordings / "a", recordings / "c", "--pass", "moe_finalize")
    assert rc == 1 and "graph after differs" in out and out.rstrip().endswith("the recordings differ")
    changed = [line.strip() for line in out.splitlines() if re.match(r"\s+[-+]%", line)]
    assert len(changed) == 2 and "mul.Tensor" in changed[0] and "div.Tensor" in changed[1], out
    assert changed[0].startswith("-%mul:") and changed[1].startswith("+%mul_7:")  # each side with its own names


def test_structural_keys():
    a = ["%x = input", "%y = input", "%m = aten.mul.Tensor(%x, %y)", "return (%m,)"]
    b = ["%p = input", "%q = input", "%z = aten.mul.Tensor(%p, %q)", "return (%z,)"]
    swapped = ["%p = input", "%q = input", "%z = aten.mul.Tensor(%q, %p)", "return (%z,)"]
    assert structural_keys(a) == structural_keys(b) != structural_keys(swapped)


@pytest.mark.parametrize("argv, message", [
    (("--layer", "99"), "--layer 99: no such layer in"),
    (("--layer", "-1"), "--layer -1: no such layer in"),
    (("--pass", "moe_finalize", "--layer", "3"), "(recorded layers: none)"),
    (("--graph", "5"), "no graph 5"),
])
def test_show_rejects_filters_outside_the_recording(recordings, argv, message):
    rc, _, err = run("show", recordings / "a", *argv)
    assert rc == 2 and message in err and "Traceback" not in err, err
