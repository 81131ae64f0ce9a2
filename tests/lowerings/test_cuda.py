"""Every op on CUDA (skipped without a GPU): opcheck passes, the CUDA reference is close to the CPU one (index
outputs equal as sets), and without a kernel module 'auto' is the reference while 'cute' says the kernel is
unavailable. allreduce_mhc runs in the 1-process gloo group (gloo reduces CUDA tensors too)."""

import pytest
import torch

from dsv41.lowerings import ALL_OPS, _kernels

pytestmark = pytest.mark.gpu

KERNEL = {"allreduce_mhc": "mhc_post_pre"}  # allreduce_mhc's kernel path is mhc_post_pre's after the all-reduce
VARIANT = {"allreduce_mhc": dict(moe=True), "indexer_topk": dict(candidates=True, cand_topk_blocks=2)}
TOL = {torch.float32: dict(rtol=1e-3, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("name", sorted(ALL_OPS))
def test_op_on_cuda(name, samples, gloo_group):
    op = ALL_OPS[name]
    options = dict(VARIANT.get(name, {}), **({"group_name": gloo_group} if name == "allreduce_mhc" else {}))
    kw = samples(name, **options)
    kc = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    torch.library.opcheck(op.default, (), kc)
    ref = _outputs(op(**kc, impl="reference"))
    for got, want in zip(ref, _outputs(op(**kw, impl="reference")), strict=True):
        assert got.is_cuda and got.dtype == want.dtype and got.shape == want.shape
        if want.is_floating_point():
            torch.testing.assert_close(got.cpu(), want, **TOL[want.dtype])
        else:
            assert torch.equal(got.cpu().sort(-1).values, want.sort(-1).values)
    if _kernels.load(KERNEL.get(name, name))[0] is None:
        for got, want in zip(_outputs(op(**kc)), ref, strict=True):
            assert torch.equal(got, want)
        with pytest.raises(RuntimeError, match=rf"dsv41::{name}: impl='cute' but the kernel module .* is unavailable"):
            op(**kc, impl="cute")
