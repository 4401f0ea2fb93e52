"""rl_runtime.TrainGroup hands each data-parallel shard to the ranks Megatron puts in that
data-parallel position (its default rank order: TP fastest, then DP, then pipeline stages)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from megatron.core.parallel_state import RankGenerator

from rl_runtime.actor_group import data_rank


@pytest.mark.parametrize(("tp", "pp", "world"), [(1, 1, 4), (2, 1, 4), (1, 2, 4), (2, 2, 8)])
def test_data_rank_follows_megatrons_rank_order(tp, pp, world):
    dp = world // (tp * pp)
    order = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    for group in order.get_ranks("dp"):  # ranks that differ only in their data-parallel rank
        assert [data_rank(r, tp, dp) for r in group] == list(range(dp))
    # the ranks TrainGroup reads log-probs from (0, tp, 2 tp, ...) are TP rank 0 of the first
    # pipeline stage, one per shard, in shard order
    first_stage = {g[0] for g in order.get_ranks("pp")}
    tp_rank0 = {g[0] for g in order.get_ranks("tp")}
    speakers = list(range(0, dp * tp, tp))
    assert speakers == sorted(first_stage & tp_rank0)
    assert [data_rank(r, tp, dp) for r in speakers] == list(range(dp))
