"""The sample order is a pure function of (seed, epoch) and resumable at any batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from visionloop.data.sampler import EvalBatchSampler, ResumableBatchSampler, epoch_order

CHUNKS = [37, 40, 40, 13, 40, 40, 40, 22]  # 272 records in 8 litdata chunks


def flat(batches: list[list[tuple[int, int]]]) -> list[int]:
    return [i for b in batches for i, _ in b]


def test_epoch_order_is_a_seeded_permutation_that_changes_per_epoch() -> None:
    a0 = epoch_order(CHUNKS, seed=3, epoch=0, window=2)
    assert sorted(a0.tolist()) == list(range(sum(CHUNKS)))
    assert torch.equal(a0, epoch_order(CHUNKS, seed=3, epoch=0, window=2))
    assert not torch.equal(a0, epoch_order(CHUNKS, seed=3, epoch=1, window=2))
    assert not torch.equal(a0, epoch_order(CHUNKS, seed=4, epoch=0, window=2))


def test_shuffle_stays_within_a_window_of_chunks() -> None:
    starts = [sum(CHUNKS[:i]) for i in range(len(CHUNKS) + 1)]
    chunk_of = {i: c for c in range(len(CHUNKS)) for i in range(starts[c], starts[c + 1])}
    order = epoch_order(CHUNKS, seed=0, epoch=0, window=2).tolist()
    pos = 0
    while pos < len(order):
        # The next window spans exactly the chunks of its first sample's window: at most 2.
        window_chunks = set()
        end = pos
        while end < len(order) and len(window_chunks | {chunk_of[order[end]]}) <= 2:
            window_chunks.add(chunk_of[order[end]])
            end += 1
        assert len(window_chunks) <= 2
        pos = end


def test_resuming_at_any_batch_yields_exactly_the_rest_of_the_epoch() -> None:
    s = ResumableBatchSampler(CHUNKS, global_batch=32, seed=5, window=3)
    s.set_position(epoch=2, batch=0)
    full = list(s)
    assert len(full) == sum(CHUNKS) // 32 and all(len(b) == 32 for b in full)
    assert all(e == 2 for b in full for _, e in b)
    for start in range(len(full) + 1):
        s.set_position(epoch=2, batch=start)
        assert list(s) == full[start:]
        assert len(s) == len(full) - start


def test_ddp_ranks_partition_each_global_batch_like_one_process() -> None:
    single = ResumableBatchSampler(CHUNKS, global_batch=32, seed=1)
    ranks = [ResumableBatchSampler(CHUNKS, global_batch=32, seed=1, rank=r, world_size=4) for r in range(4)]
    for s in [single, *ranks]:
        s.set_position(epoch=0, batch=0)
    per_rank = [list(r) for r in ranks]
    for step, batch in enumerate(single):
        assert flat([per_rank[r][step] for r in range(4)]) == flat([batch])


def test_eval_sampler_covers_every_record_once_across_ranks() -> None:
    seen = []
    for r in range(3):
        s = EvalBatchSampler(101, batch_size=8, rank=r, world_size=3)
        batches = list(s)
        assert len(batches) == len(s)
        seen += flat(batches)
    assert sorted(seen) == list(range(101))


# tiny chunks on purpose, so that a batch spans several; litdata warns about the overshoot
@pytest.mark.filterwarnings("ignore:An item was larger than the target chunk size")
def test_read_many_returns_records_in_the_asked_order(tmp_path: Path) -> None:
    from visionloop.data.shards import ShardReader, ShardWriter

    w = ShardWriter(tmp_path / "s", chunk_bytes="2KB")  # several chunks
    for i in range(40):
        w.add({"image": bytes([i]) * 100, "label": i % 3, "index": 1000 + i})
    w.close()
    r = ShardReader(tmp_path / "s")
    assert len(r.chunk_sizes) > 1 and len(r) == 40
    asked = [37, 2, 19, 2, 0, 39, 11]
    got = r.read_many(asked)
    assert [g["index"] for g in got] == [1000 + p for p in asked]
    assert [g["image"][0] for g in got] == asked and [g["label"] for g in got] == [p % 3 for p in asked]
