"""Broken torch.distributed adapters for tests/frameworks/test_torch_ranks.py, loaded by the ranks as
``tests/frameworks/torch_rank_zoo.py:NAME``: bugs of issue 33's kill list on the built-in adapters, and ranks
that raise, die or hang (each on one catalog case, so that the next case shows the ranks restarted)."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from mhaspec.adapters.torch_ranks import TorchRing, TorchTensorParallel, merge_lse


class BiasOnEveryRank(TorchTensorParallel):
    """The output bias added on every rank before the all-reduce (text-generation-inference #1036):
    the output is off by (world − 1)·b_o."""

    name = "torch-tp-bias-every-rank"

    def reduce(self, ctx, module, concat):
        out = torch.nn.functional.linear(concat, module.out_proj.weight.to_local(), module.out_proj.bias.to_local())
        dist.all_reduce(out, group=ctx.group)
        return out


class MissingAllReduce(TorchTensorParallel):
    """The rank's W^O product plus b_o, never reduced: no collective issued, the output is one rank's share."""

    name = "torch-tp-no-all-reduce"

    def reduce(self, ctx, module, concat):
        return torch.nn.functional.linear(concat, module.out_proj.weight.to_local(), module.out_proj.bias.to_local())


def added_lse(out, lse, block_out, block_lse):
    """The LSE merged by addition (ring-flash-attention #20) where a log-sum-exp is due."""
    first = torch.isneginf(lse)
    new = torch.where(first, block_lse, torch.where(torch.isneginf(block_lse), lse, lse + block_lse))
    good_out, _ = merge_lse(out, lse, block_out, block_lse)
    return good_out, new


class AddedLse(TorchRing):
    name = "torch-ring-added-lse"
    merge = staticmethod(added_lse)


#: catalog case -> what the rank of :class:`Faulty` does on it
FAULTS = {"long_sequence": "raise", "bloom_alibi": "die", "gpt_oss_sinks_window": "hang"}


class Faulty(TorchRing):
    """``torch-ring`` whose rank 1 raises, is killed by SIGKILL, or hangs, on the cases of :data:`FAULTS`."""

    name = "torch-ring-faulty"

    def run_rank(self, ctx, case):
        fault = FAULTS.get(case.id)
        if ctx.rank == 1 and fault == "raise":
            raise ValueError("rank 1 refuses")
        if ctx.rank == 1 and fault == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if ctx.rank == 1 and fault == "hang":
            time.sleep(3600)
        return super().run_rank(ctx, case)
