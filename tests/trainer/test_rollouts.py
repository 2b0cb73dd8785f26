"""The GRPO stage's rollout side: tickets drawn from the prompt stream (numbered by stream batch, from
a resumed cursor too, each rank its strided share) and the MoE routers idle for the old policy's
forward."""

from __future__ import annotations

import numpy as np
import torch

from osvl.config.recipe import MoEConfig
from osvl.data.packing import pack_microbatch, text_sequence
from osvl.rollout.replay import Ticket
from osvl.trainer.index_stream import IndexStream
from osvl.trainer.rollouts import ticket_source
from osvl.trainer.router_losses import RouterLosses
from tests.rollout.helpers import IMAGE_CONFIG, tiny_model, tokenizer


def test_tickets_follow_the_stream_batch_by_batch_and_rank_by_rank():
    stream = IndexStream(6, 4, seed=3)
    order = [stream.next_batch() for _ in range(3)]  # 6 prompts, batches of 4: one per epoch
    stream = IndexStream(6, 4, seed=3)
    rank0, rank1 = ticket_source(stream, 2, 0), ticket_source(IndexStream(6, 4, seed=3), 2, 1)
    assert rank0() == [Ticket(0, 0, order[0][0]), Ticket(0, 2, order[0][2])]
    assert rank1() == [Ticket(0, 1, order[0][1]), Ticket(0, 3, order[0][3])]
    assert [t.batch for t in rank0()] == [1, 1]
    resumed = IndexStream(6, 4, seed=3)
    resumed.load_state_dict(stream.state_dict())  # a checkpoint after two draws
    assert ticket_source(resumed, 2, 0)() == [Ticket(2, 0, order[2][0]), Ticket(2, 2, order[2][2])]


def test_idle_routers_attach_no_loss_and_keep_no_statistics():
    model = tiny_model(0, moe=True)
    losses = RouterLosses(model, MoEConfig(aux_loss_coef=0.01, z_loss_coef=1e-3))
    ids = np.array(tokenizer().encode("Which bridge is shown in the image?"))
    batch = pack_microbatch([text_sequence(ids, 0)], IMAGE_CONFIG, tokenizer().special)

    def forward():
        with torch.no_grad():
            model(batch.input_ids, cu_seqlens=batch.cu_seqlens, position_ids=batch.position_ids)

    losses.start([batch])
    losses.prepare(batch)
    forward()
    assert all(r.stats is not None for r in losses.routers)
    losses.idle()  # collects the pending micro-batch, then detaches the routers
    forward()
    assert all(r.loss_inputs is None for r in losses.routers)
    assert losses.metrics()["moe_load_cv"] >= 0  # the statistics are the trained micro-batch's alone
