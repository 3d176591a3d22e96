"""The sample order is a pure function of (seed, epoch) and resumable at any batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from visionloop.data.sampler import EvalBatchSampler, ResumableBatchSampler, epoch_order, holdout_positions

CHUNKS = [37, 40, 40, 13, 40, 40, 40, 22]  # 272 records in 8 litdata chunks


def flat(batches: list[list[tuple[int, int]]]) -> list[int]:
    return [i for b in batches for i, _ in b]


SEEDS, EPOCHS = range(4), range(3)
WINDOWS = [1, 2, 3, len(CHUNKS), 20]  # 20: more than there are chunks


def chunk_of_records(sizes: list[int]) -> list[int]:
    return [c for c, size in enumerate(sizes) for _ in range(size)]


def open_chunks_peak(order: list[int], sizes: list[int]) -> int:
    """The most chunks a reader of `order` holds open at once: a chunk opens at its first record
    and closes after its last one (the sampler's promise is that this never exceeds `window`)."""
    chunk_of = chunk_of_records(sizes)
    left = list(sizes)
    open_now: set[int] = set()
    peak = 0
    for i in order:
        c = chunk_of[i]
        open_now.add(c)
        peak = max(peak, len(open_now))
        left[c] -= 1
        if left[c] == 0:
            open_now.discard(c)
    return peak


def chunk_loads(order: list[int], sizes: list[int], cache: int) -> int:
    """Chunk reads of a reader that keeps the `cache` most recently used chunks in memory."""
    chunk_of = chunk_of_records(sizes)
    held: list[int] = []  # least recently used first
    loads = 0
    for i in order:
        c = chunk_of[i]
        if c in held:
            held.remove(c)
        else:
            loads += 1
            if len(held) == cache:
                held.pop(0)
        held.append(c)
    return loads


def test_every_record_exactly_once_per_epoch() -> None:
    for window in WINDOWS:
        for seed in SEEDS:
            for epoch in EPOCHS:
                order = epoch_order(CHUNKS, seed=seed, epoch=epoch, window=window)
                assert order.dtype == torch.int64
                assert sorted(order.tolist()) == list(range(sum(CHUNKS))), (window, seed, epoch)


def test_each_seed_and_epoch_has_its_own_order_and_the_same_pair_always_the_same() -> None:
    for window in WINDOWS:
        orders = {
            (seed, epoch): tuple(epoch_order(CHUNKS, seed=seed, epoch=epoch, window=window).tolist())
            for seed in SEEDS
            for epoch in EPOCHS
        }
        assert len(set(orders.values())) == len(orders), window  # all pairwise different
        for (seed, epoch), order in orders.items():  # a resumed run recomputes the same order
            assert tuple(epoch_order(CHUNKS, seed=seed, epoch=epoch, window=window).tolist()) == order


def test_at_most_window_chunks_are_open_at_a_time_and_each_chunk_is_read_once() -> None:
    for window in WINDOWS:
        for seed in SEEDS:
            for epoch in EPOCHS:
                order = epoch_order(CHUNKS, seed=seed, epoch=epoch, window=window).tolist()
                # Shuffled *within* a window: its chunks are interleaved, all open together ...
                assert open_chunks_peak(order, CHUNKS) == min(window, len(CHUNKS)), (window, seed, epoch)
                # ... and a reader holding `window` chunks reads every chunk exactly once.
                assert chunk_loads(order, CHUNKS, cache=window) == len(CHUNKS), (window, seed, epoch)


def test_the_batch_samplers_order_keeps_the_window_and_is_the_epoch_order() -> None:
    for window in (1, 2, 3):
        s = ResumableBatchSampler(CHUNKS, global_batch=32, seed=9, window=window)
        for epoch in EPOCHS:
            s.set_position(epoch=epoch, batch=0)
            order = flat(list(s))
            expected = epoch_order(CHUNKS, seed=9, epoch=epoch, window=window).tolist()
            assert order == expected[: len(order)] and len(order) == sum(CHUNKS) // 32 * 32
            assert len(set(order)) == len(order)  # the dropped tail is the only thing missing
            assert open_chunks_peak(order, CHUNKS) <= window
            assert chunk_loads(order, CHUNKS, cache=window) <= len(CHUNKS)


def test_a_plain_random_permutation_would_break_the_window() -> None:
    """The checks above can fail: an unwindowed shuffle opens every chunk at once."""
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(sum(CHUNKS), generator=g).tolist()
    assert open_chunks_peak(order, CHUNKS) == len(CHUNKS)
    assert chunk_loads(order, CHUNKS, cache=2) > 10 * len(CHUNKS)


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


def test_folds_partition_the_records_and_depend_on_their_own_seed_only() -> None:
    n = sum(CHUNKS)
    for folds in (2, 3, 5):
        parts = [holdout_positions(n, folds, k, seed=3) for k in range(folds)]
        assert sorted(p for part in parts for p in part) == list(range(n))  # each in exactly one fold
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
        assert all(part == sorted(part) for part in parts)
    assert holdout_positions(n, 3, 1, seed=3) == holdout_positions(n, 3, 1, seed=3)
    assert holdout_positions(n, 3, 1, seed=3) != holdout_positions(n, 3, 1, seed=4)
    assert holdout_positions(n, 3, 0, seed=3) != list(range(0, n, 3))  # shuffled, not strided
    with pytest.raises(ValueError, match="outside"):
        holdout_positions(n, 3, 3, seed=0)


def test_a_held_out_fold_never_reaches_a_batch_and_the_rest_keep_their_order() -> None:
    held = holdout_positions(sum(CHUNKS), 4, 2, seed=0)
    s = ResumableBatchSampler(CHUNKS, global_batch=16, seed=5, window=3, exclude=held)
    full = ResumableBatchSampler(CHUNKS, global_batch=16, seed=5, window=3)
    assert s.num_samples == sum(CHUNKS) - len(held) and s.steps_per_epoch == s.num_samples // 16
    for epoch in range(3):
        s.set_position(epoch=epoch, batch=0)
        seen = flat(list(s))
        assert not set(seen) & set(held) and len(seen) == s.steps_per_epoch * 16
        # The kept records in the order the whole split would give them.
        order = [p for p in epoch_order(CHUNKS, 5, epoch, 3).tolist() if p not in set(held)]
        assert seen == order[: len(seen)]
    s.set_position(epoch=1, batch=3)  # resumable at any batch, as without a fold held out
    rest = list(s)
    s.set_position(epoch=1, batch=0)
    assert list(s)[3:] == rest
    full.set_position(epoch=0, batch=0)
    assert set(flat(list(full))) & set(held)  # without the fold, its records are trained on


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
