"""The reference policy inside the learner (``rlmesh.reference.colocated``): every rank loads it once,
as the reference service does, frozen, and scores its own share of each batch.
docs/design.md#the-reference-a-service-or-colocated"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from rlmesh.learner.dist import all_reduce_sum, rank
from rlmesh.learner.ppo.forward import actor_forward, pad_to_width, slice_micro_batch
from rlmesh.learner.ppo.parallel import micro_batch_plan

if TYPE_CHECKING:
    from rlmesh.config import RLMeshConfig
    from rlmesh.learner.ppo.batch import PPOBatch
    from rlmesh.reference.compute import ReferenceModel

__all__ = ["ColocatedReference", "colocated_reference"]

log = logging.getLogger("rlmesh.learner")


def colocated_reference(cfg: RLMeshConfig, device: torch.device | str) -> ColocatedReference | None:
    """The learner's own reference when ``rlmesh.reference.colocated`` is set and the run's KL
    needs one; else None (the trajectories' ``ref_log_probs``, from the reference service, count).
    Raises ``ReferenceLoadError`` when the model does not load."""
    if not (cfg.rlmesh.reference.colocated and cfg.uses_reference()):
        return None
    return ColocatedReference.load(cfg, device)


class ColocatedReference:
    """A :class:`rlmesh.reference.ReferenceModel` on this rank: eval mode, no grad, frozen.

    :meth:`log_probs` runs the learner's own log-prob forward (:func:`actor_forward`, which the old
    log-probs use too, as verl's reference worker runs its actor's ``compute_log_prob``) over this
    rank's micro-batches of the batch (``micro_batch_plan``: the ranks' shares (even in tokens with ``trainer.balance_batch``), in
    micro-batches of ``ref.log_prob_micro_batch_size_per_gpu``, or packed by
    ``ref.log_prob_max_token_len_per_gpu`` with ``ref.log_prob_use_dynamic_bsz``) and sums the
    shares over the ranks, so every rank ends with the whole batch's reference log-probs.
    Padding-free when ``actor_rollout_ref.model.use_remove_padding`` (``ReferenceModel.pack``).
    """

    def __init__(
        self,
        model: ReferenceModel,
        micro_batch_size: int | None = None,
        use_dynamic_bsz: bool | None = False,
        max_token_len: int | None = None,
        balance_batch: bool = True,
    ) -> None:
        self.model = model
        self.balance_batch = balance_batch
        self.micro_batch_size = micro_batch_size
        self.use_dynamic_bsz = use_dynamic_bsz
        self.max_token_len = max_token_len

    @classmethod
    def load(cls, cfg: RLMeshConfig, device: torch.device | str) -> ColocatedReference:
        """The reference model of ``cfg`` (``rlmesh.reference.model_path``, else the actor's
        initial path) on ``device``, loaded as the service loads it: its dtype rule
        (``rlmesh.reference.dtype``, else bf16 on GPU and fp32 on CPU) and temperature."""
        from rlmesh.reference.loading import ReferenceLoadError, load_reference_model

        here = cfg.model_copy(deep=True)
        here.rlmesh.reference.device = str(device)  # this rank's device, not the service's
        model = load_reference_model(here)
        if model is None:  # only when no KL needs it, which colocated_reference rules out
            raise ReferenceLoadError("no reference model to colocate: this config uses no KL to it")
        log.info(
            "colocated reference on rank %d: %s (%s on %s)",
            rank(),
            model.model_path,
            model.dtype_name,
            device,
        )
        ref = cfg.actor_rollout_ref.ref
        return cls(
            model,
            ref.log_prob_micro_batch_size_per_gpu,
            ref.log_prob_use_dynamic_bsz,
            ref.log_prob_max_token_len_per_gpu,
            cfg.trainer.balance_batch,
        )

    @torch.no_grad()
    def log_probs(self, batch: PPOBatch) -> torch.Tensor:
        """Reference log-probs ``(bs, R)`` fp32 on CPU, zero past each response. Collective: every
        rank calls it with the same batch (one all-reduce; the forwards are this rank's own)."""
        ref = self.model
        plan = micro_batch_plan(
            batch,
            range(len(batch)),
            self.micro_batch_size,
            self.use_dynamic_bsz,
            self.max_token_len,
            self.balance_batch,
        )
        out = torch.zeros(len(batch), batch.response_length, dtype=torch.float32)
        for rows in plan:
            if rows:  # an empty one pads a short share; a plain module needs no dummy forward
                log_probs, _ = actor_forward(
                    ref.model, slice_micro_batch(batch, rows, ref.device), ref.temperature, pack=ref.pack
                )
                out[rows] = pad_to_width(log_probs.float().cpu(), batch.response_length)
        return all_reduce_sum(out * batch.response_mask)
