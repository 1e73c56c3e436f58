"""global_loss_scale turns each rank's micro-batch losses (aggregated over the micro-batch alone)
into shares of the global mini-batch loss: summed over every micro-batch of every rank and divided
by dp (DeepSpeed averages gradients over ranks), they must equal verl's agg_loss of the whole
mini-batch with its global counts, for every aggregation mode."""

import pytest
import torch

from rlmesh.algo.losses import agg_loss
from rlmesh.learner.ppo.parallel import global_loss_scale

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dp", [1, 2])
def test_micro_batch_shares_sum_to_the_global_loss(mode, dp):
    g = torch.Generator().manual_seed(7)
    rows, width, norm_len = 12, 9, 16
    loss = torch.randn(rows, width, generator=g)
    lengths = torch.randint(0, width + 1, (rows,), generator=g)
    lengths[3] = 0  # an empty sequence counts in no mode
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    n_tokens, n_seqs = int(mask.sum()), int((mask.sum(-1) > 0).sum())
    expected = agg_loss(loss, mask, mode, loss_scale_factor=norm_len)

    total = torch.tensor(0.0)
    for rank in range(dp):
        mine = list(range(rank, rows, dp))
        for micro in (mine[:2], mine[2:5], mine[5:]):  # uneven micro-batches, padded to their own width
            width_here = max(int(lengths[micro].max()), 1)
            part = agg_loss(
                loss[micro, :width_here], mask[micro, :width_here], mode, loss_scale_factor=width_here
            )
            total += part * global_loss_scale(mask[micro, :width_here], mode, n_tokens, n_seqs, dp, norm_len)
    torch.testing.assert_close(total / dp, expected)
