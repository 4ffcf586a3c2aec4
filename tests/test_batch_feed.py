"""batch_feed.prefetch: the training loop's host batches made ahead in a thread, in order, with errors at their
turn and nothing left running when the loop stops early; and the trainer's copy to the device widens bf16
features exactly."""
import threading
import time

import pytest
import torch

from eagle3_core.training.batch_feed import prefetch, to_device


def test_prefetch_yields_every_item_in_order_made_in_another_thread():
    made_in = []

    def make(i):
        made_in.append(threading.current_thread().name)
        return {"x": torch.full((3,), i)}

    for ahead in (0, 1, 2, 5):
        made_in.clear()
        got = [int(b["x"][0]) for b in prefetch(make, range(7), ahead=ahead)]
        assert got == list(range(7))
        assert all(n.startswith("batch-feed") for n in made_in) == (ahead > 0)


def test_prefetch_makes_ahead_while_the_caller_works():
    """With ahead 2, after the caller receives item 0 the thread goes on to items 1 and 2 (not more)."""
    started = []

    def make(i):
        started.append(i)
        return i

    feed = prefetch(make, range(10), ahead=2)
    assert next(feed) == 0
    deadline = time.monotonic() + 5
    while len(started) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert started == [0, 1, 2]
    feed.close()


def test_an_error_is_raised_at_its_items_turn_and_early_close_stops_the_thread():
    def make(i):
        if i == 3:
            raise ValueError("bad sample 3")
        return i

    feed = prefetch(make, range(10), ahead=2)
    assert [next(feed) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="bad sample 3"):
        next(feed)
    made = []
    feed = prefetch(lambda i: made.append(i) or i, range(1000), ahead=2)
    next(feed)
    feed.close()                                  # cancels what is queued, waits for the one being made
    assert len(made) <= 4
    assert not any(t.name.startswith("batch-feed") for t in threading.enumerate())


def test_to_device_widens_half_precision_features_exactly_and_keeps_the_rest():
    g = torch.Generator().manual_seed(0)
    batch = {"aux": torch.randn(1, 5, 6, generator=g).bfloat16(), "final": torch.randn(1, 5, 2, generator=g),
             "input_ids": torch.arange(5)[None], "loss_mask": torch.ones(1, 5, dtype=torch.bool),
             "exact": torch.randn(3, dtype=torch.float64, generator=g)}
    out = to_device(batch, torch.device("cpu"))
    assert {k: v.dtype for k, v in out.items()} == {"aux": torch.float32, "final": torch.float32,
                                                    "input_ids": torch.int64, "loss_mask": torch.bool,
                                                    "exact": torch.float64}
    for k in batch:
        assert torch.equal(out[k], batch[k].to(out[k].dtype))
