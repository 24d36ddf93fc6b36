"""Every gradient-sync strategy trains the same model: from one seed, after a few steps, each
leaves the parameters DistributedDataParallel leaves, at 1, 2 and 3 ranks (real gloo groups)."""

from __future__ import annotations

import pytest
import torch

from tests.train_cases import BATCHNORM_RUN, run_train_case
from tests.world import World, worlds_of

STRATEGIES_MULTI = ("naive", "ring", "bucketed", "ddp")


@pytest.fixture(scope="module")
def train_worlds():
    with worlds_of(run_train_case) as get:
        yield get


def _config(strategies: tuple[str, ...], **extra) -> dict:
    base = dict(
        strategies=strategies,
        model="mlp",
        model_options=(("widths", [64, 48]),),
        samples=512,
        batch_size=16,
        steps_per_epoch=3,
        epochs=2,
        lr=0.05,
        bucket_cap_mb=0.01,  # several buckets even for this small model
        first_bucket_mb=0.004,
        evaluate=True,
    )
    return {**base, **extra}


def _results(world: World, config: dict, **case) -> list[dict]:
    results = world.run({"config": config, **case})
    errors = [r for r in results if isinstance(r, tuple) and r[0] == "error"]
    assert not errors, errors
    return results


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=lambda m, i=i: f"{what}, param {i}: {m}")


@pytest.mark.parametrize(
    "size,transport",
    [*(pytest.param(n, "backend", marks=pytest.mark.slow) for n in (1, 3)), (2, "backend"), (3, "ring")],
)
def test_strategies_leave_ddp_parameters(train_worlds, size: int, transport: str) -> None:
    strategies = STRATEGIES_MULTI + (("none",) if size == 1 else ())
    results = _results(train_worlds(size), _config(strategies, transport=transport))
    for rank, r in enumerate(results):
        ddp = r["params"]["ddp"]
        start = results[0]["params"]["ddp"]
        _assert_same(ddp, start, f"ddp on rank {rank} vs rank 0")  # ranks agree
        for s in strategies:
            _assert_same(r["params"][s], ddp, f"{s} ({transport}) vs ddp on rank {rank} of {size}")
            _assert_trained(r, s)


def _assert_trained(result: dict, strategy: str) -> None:
    """Every parameter moved from where it started and the loss fell, so agreeing with ddp means
    something: a strategy and ddp that skipped the optimizer step would agree too."""
    for i, (end, start) in enumerate(zip(result["params"][strategy], result["initial"], strict=True)):
        assert (end - start).abs().max() > 1e-4, f"{strategy}: parameter {i} did not move"
    epochs = [e for e in result["epochs"] if e["strategy"] == strategy]
    first, last = epochs[0], epochs[-1]
    assert len(epochs) >= 2 and last["loss"] < first["loss"], f"{strategy}: the training loss did not fall"
    # The held-out set is the same every epoch: from 2.29 by 0.02 to 0.03 in these runs.
    assert last["eval_loss"] < first["eval_loss"] - 0.01, f"{strategy}: the held-out loss did not fall"


def test_training_moves_parameters_and_summaries_add_up(train_worlds) -> None:
    results = _results(train_worlds(2), _config(("ring", "ddp")))
    _assert_trained(results[0], "ring")
    summaries = {s["strategy"]: s for s in results[0]["summaries"]}
    ring, ddp = summaries["ring"], summaries["ddp"]
    assert ring["steps_timed"] == 3  # epoch 2's steps
    assert ring["trainable_params"] == 784 * 64 + 64 + 64 * 48 + 48 + 48 * 10 + 10
    assert ring["grad_bytes_per_epoch"] == ring["trainable_params"] * 4 * 3  # min(512 // 2 // 16, 3) syncs
    assert ring["hidden_comm_fraction"] == pytest.approx(0.0, abs=0.05)  # all of it after backward
    assert ring["comm_ms"] > 0 and ddp["comm_ms"] > 0
    assert ring["step_time_ratio_to_ddp"] == pytest.approx(ring["step_time_ms"] / ddp["step_time_ms"])
    assert ddp["buckets"] >= 2
    assert ring["final_accuracy"] is not None and 0 <= ring["final_accuracy"] <= 1
    # ddp's buckets are synced as backward makes them, so some of its communication is hidden
    assert 0 < ddp["hidden_comm_fraction"] <= 1
    for s in (ring, ddp):  # the summary is of epoch 2, the timed one; its figures are that epoch's
        (last,) = [e for e in results[0]["epochs"] if e["strategy"] == s["strategy"] and e["epoch"] == 2]
        assert s["hidden_comm_fraction"] == pytest.approx(last["hidden_comm_fraction"], abs=1e-12)
        assert (s["final_accuracy"], s["final_loss"]) == (last["accuracy"], last["loss"])
    for s in (ring, ddp):
        parts = s["forward_ms"] + s["backward_ms"] + s["exposed_comm_ms"] + s["optimizer_ms"] + s["data_ms"]
        assert parts == pytest.approx(s["step_time_ms"], rel=0.5)  # medians of parts vs median of sums
        # img/s is the global batch (16 a rank, 2 ranks) over the median step, as README says
        assert s["global_batch"] == 16 * 2
        assert s["images_per_s"] == pytest.approx(16 * 2 / (s["step_time_ms"] / 1e3))


def test_bad_strategy_for_world_raises_on_every_rank(train_worlds) -> None:
    results = train_worlds(2).run({"config": _config(("none",))})
    assert all(isinstance(r, tuple) and "one process" in r[1] for r in results)


def test_batchnorm_statistics_and_held_out_loss_are_ddps(train_worlds) -> None:
    """DDP broadcasts rank 0's buffers before each forward; the hand-written strategies do too, so
    every rank ends with ddp's BatchNorm statistics and the same held-out loss (they kept their own:
    rank 1's were 0.02 off after three steps here, 0.54 after an epoch of CIFAR size)."""
    config = _config(("naive", "bucketed", "ddp"), **BATCHNORM_RUN)
    results = _results(train_worlds(2), config, diff_against="ddp")
    for rank, r in enumerate(results):
        assert r["buffer_count"] == 3 * 8  # mean, variance and count of eight BatchNorm2d
        eval_loss = {e["strategy"]: e["eval_loss"] for e in r["epochs"]}
        for s in ("naive", "bucketed"):
            assert r["param_diff"][s] < 1e-6, (s, rank, r["param_diff"])
            assert r["buffer_diff"][s] < 1e-6, (s, rank, r["buffer_diff"])
            assert eval_loss[s] == pytest.approx(eval_loss["ddp"], rel=1e-6), (s, rank, eval_loss)


def test_computed_wire_bytes_price_gloos_own_buffer_broadcast(train_worlds) -> None:
    """ddp's buffer broadcast is gloo's binomial tree: at 3 ranks rank 0 sends both copies, and the
    summary's computed bytes are the cost model's for gloo (priced as a ring, rank 1 sent one)."""
    from commbench.trainers.loop import TrainConfig, computed_wire_bytes
    from commbench.trainers.models import build_model
    from commbench.trainers.sync import trainable

    options = (("input_shape", (3, 8, 8)),)
    config = _config(("ddp",), model="vgg11", model_options=options, samples=48, batch_size=8)
    config.update(steps_per_epoch=1, epochs=1, evaluate=False)
    model = build_model("vgg11", **dict(options))
    numels = [p.numel() for p in trainable(model)]
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    priced = {
        backend: computed_wire_bytes("ddp", 3, numels, 4, TrainConfig(**config), buffers, backend=backend)
        for backend in ("gloo", None)
    }
    assert [a - b for a, b in zip(priced["gloo"], priced[None], strict=True)] == [buffers, -buffers, 0]
    (summary,) = _results(train_worlds(3), config, diff_against="ddp")[0]["summaries"]
    syncs = summary["syncs_per_epoch"]
    assert summary["wire_bytes_per_rank_per_epoch"] == [w * syncs for w in priced["gloo"]]


@pytest.mark.parametrize("strategy", ["naive", "ring", "bucketed", "ddp"])
def test_two_backwards_before_a_sync_sum_their_averages_as_ddp(train_worlds, strategy) -> None:
    """Gradient accumulation through the sync as a library, before_backward before each backward:
    bucketed's second backward packed and divided the buffers of the first while their allreduce
    ran (differences of 0.4 to 53 from DDP, another each run). Each backward's sync is now
    finished before the next, as DDP syncs each one."""
    results = _results(train_worlds(2), {}, sync=strategy, kind="accumulate", each=True)
    for rank, diff in enumerate(results):
        assert isinstance(diff, float) and diff < 1e-5, f"{strategy} on rank {rank}: {diff}"


def test_bucketed_refuses_a_second_backward_without_before_backward(train_worlds) -> None:
    """With before_backward only before the first backward, the second backward's gradients were
    lost: the first's average was unpacked over both."""
    results = _results(train_worlds(2), {}, sync="bucketed", kind="accumulate", each=False)
    for diff in results:
        assert "got a second gradient before after_backward" in str(diff), diff
        assert "call before_backward before each backward" in str(diff), diff


def test_buffers_broadcast_within_a_group_come_from_its_first_rank(train_worlds) -> None:
    """Within the group of ranks 1 and 2, its first rank is global rank 1: rank 2 takes rank 1's
    buffer, and rank 0, outside the group, keeps its own."""
    results = _results(train_worlds(3), {}, buffers_of=[1, 2])
    assert results == [[0.0] * 3, [1.0] * 3, [1.0] * 3]


@pytest.mark.parametrize("strategy", ["naive", "bucketed"])
def test_hand_written_strategies_start_every_rank_from_rank_0s_model(train_worlds, strategy) -> None:
    """As DDP's constructor: ranks whose models came from different seeds kept weights of their own
    and only averaged their gradients. A model that differs in its sizes is refused on every rank,
    and so is one whose parameter is another rank's buffer of the same shape and dtype."""
    (first, *others) = _results(train_worlds(3), {}, sync=strategy, kind="start")
    torch.manual_seed(100)
    built = [
        p.detach()
        for p in torch.nn.Sequential(
            torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)
        ).parameters()
    ]
    _assert_same(first, built, "rank 0 after wrap vs rank 0's own model")
    for rank, params in enumerate(others, start=1):
        _assert_same(params, first, f"rank {rank} vs rank 0")
    for how in ("wider", "transposed", "dtype", "buffer"):  # sizes alone passed the middle two
        for text in _results(train_worlds(3), {}, sync=strategy, kind="mismatch", how=how):
            assert text.startswith("the ranks' models differ"), (how, text)
            assert "the same model on every rank" in text, (how, text)
