"""The interleaved 1F1B schedule (issue 42: virtual stages for the pipelined Dual-GPU Split), a pure function: each
stage's ops, their dependency order, the makespan against the closed form, and what a stage holds."""
import pytest

from lowvram_lora.engine.parallel.one_f_one_b import (
    ScheduleError, bound, chunk_of, dependencies, held_blocks, in_flight, makespan, runnable_schedule, schedule,
)


def _replay(plan, stages, chunks):
    """Run the stages' ops serially, each when its dependencies have run: every op runs (no deadlock) and each runs
    after what it depends on. Returns the global order."""
    done, order, positions = set(), [], [0] * stages
    while any(p < len(ops) for p, ops in zip(positions, plan)):
        moved = False
        for s, ops in enumerate(plan):
            if positions[s] < len(ops):
                op = ops[positions[s]]
                if all(d in done for d in dependencies(op, s, stages, chunks)):
                    done.add((s, op))
                    order.append((s, op))
                    positions[s] += 1
                    moved = True
        assert moved, "deadlock"
    return order


def test_v2_m4_is_megatrons_order():
    """Two GPUs, two chunks each, four micro-batches: written out from Megatron-LM's formulas (the i-th forward of a
    stage is micro-batch (i // 4) * 2 + i % 2 through its (i % 4) // 2-th chunk), warm-ups of 4 and 2 forwards."""
    assert schedule(4, 2, 2) == (
        (("F", 0, 0), ("F", 1, 0), ("F", 0, 2), ("F", 1, 2),
         ("F", 2, 0), ("B", 0, 2), ("F", 3, 0), ("B", 1, 2), ("F", 2, 2), ("B", 0, 0), ("F", 3, 2), ("B", 1, 0),
         ("B", 2, 2), ("B", 3, 2), ("B", 2, 0), ("B", 3, 0)),
        (("F", 0, 1), ("F", 1, 1),
         ("F", 0, 3), ("B", 0, 3), ("F", 1, 3), ("B", 1, 3), ("F", 2, 1), ("B", 0, 1), ("F", 3, 1), ("B", 1, 1),
         ("F", 2, 3), ("B", 2, 3), ("F", 3, 3), ("B", 3, 3),
         ("B", 2, 1), ("B", 3, 1)),
    )


@pytest.mark.parametrize("chunks", [2, 3, 4])
@pytest.mark.parametrize("stages", [2, 3])
def test_every_op_once_in_dependency_order(stages, chunks):
    for m in range(stages, 5 * stages, stages):
        plan = schedule(m, stages, chunks)
        for s, ops in enumerate(plan):
            mine = [c for c in range(stages * chunks) if c % stages == s]
            assert sorted(ops) == sorted((kind, k, c) for kind in "FB" for k in range(m) for c in mine)
            for c in mine:  # each chunk sees its micro-batches in order, forward and backward (gradients add in order)
                assert [op[1] for op in ops if op[0] == "F" and op[2] == c] == list(range(m))
                assert [op[1] for op in ops if op[0] == "B" and op[2] == c] == list(range(m))
            assert all(chunk_of(op, s) % stages == s for op in ops)
        order = _replay(plan, stages, chunks)
        position = {x: i for i, x in enumerate(order)}
        last = stages * chunks - 1
        for (s, (kind, k, c)), i in position.items():  # the forward goes up the chunks, the backward down
            if kind == "F" and c > 0:
                assert position[((c - 1) % stages, ("F", k, c - 1))] < i
            if kind == "B":
                assert position[((c + 1) % stages, ("B", k, c + 1))] < i if c < last else \
                    position[(s, ("F", k, c))] < i


@pytest.mark.parametrize("f, b", [(1.0, 3.0), (1.0, 1.0), (0.25, 0.75)])
def test_makespan_matches_the_closed_form(f, b):
    """Equal stages, each op 1/v of a stage's forward f or backward b: (M + (S - 1)/v)(f + b); v = 1 is today's."""
    for stages in (2, 3):
        for chunks in (1, 2, 3, 4):
            for m in range(stages, 5 * stages, stages):
                t = makespan(schedule(m, stages, chunks), lambda s, op: (f if op[0] == "F" else b) / chunks)
                assert abs(t - (m + (stages - 1) / chunks) * (f + b)) < 1e-9, (stages, chunks, m)
                assert stages * m * (f + b) / t == pytest.approx(bound(m, chunks, stages), rel=1e-12)
    assert bound(4, 1) == pytest.approx(1.6) and bound(4, 2) == pytest.approx(1.7778, abs=1e-4)
    assert bound(4, 3) == pytest.approx(1.8462, abs=1e-4)


def test_v1_is_todays_schedule():
    """chunks=1 keeps the plain 1F1B ops (kind, micro-batch): what the runner and the planner ran before."""
    assert schedule(4, 2, 1) == schedule(4) == schedule(4, 2)
    assert all(len(op) == 2 for ops in schedule(4) for op in ops)
    assert dependencies(("F", 2), 1, 2) == [(0, ("F", 2))] and dependencies(("B", 2), 1, 2) == [(1, ("F", 2))]
    assert dependencies(("B", 2, 1), 1, 2, 2) == [(0, ("B", 2, 2))]  # the gradient comes back from chunk 2 (stage 0)
    assert dependencies(("B", 2, 3), 1, 2, 2) == [(1, ("F", 2, 3))]  # the last chunk: after its own forward (loss)
    assert dependencies(("F", 2, 2), 0, 2, 2) == [(1, ("F", 2, 1))]


def test_what_a_stage_holds():
    """The first GPU holds more chunk passes under interleaving (Megatron's warm-up of 2 (S - 1) + (v - 1) S
    forwards): at v = 2, M = 4, five half-size chunk passes (2.5 micro-batches' block inputs) against two today."""
    assert [in_flight(ops) for ops in schedule(4)] == [2, 1]
    assert [in_flight(ops) for ops in schedule(4, 2, 2)] == [5, 3]
    assert [in_flight(ops) for ops in schedule(8, 2, 2)] == [5, 3]  # bounded by the warm-up, not by M
    # blocks: chunks 0 and 2 of 3 and 5 blocks on the first GPU; at the peak it holds F(0..2, 0) and F(0..1, 2)
    plan = schedule(4, 2, 2)
    assert held_blocks(plan[0], {0: 3, 2: 5}) == 3 * 3 + 2 * 5
    assert held_blocks(plan[1], {1: 4, 3: 4}, 1) == 3 * 4
    assert held_blocks(schedule(4)[0], {0: 7}) == 2 * 7  # today: two micro-batches' inputs


def test_refusals_name_the_fix():
    with pytest.raises(ScheduleError, match="multiple of the 2 stages.*use 6, or virtual_stages 1"):
        schedule(5, 2, 2)
    with pytest.raises(ScheduleError, match="must be >= 1"):
        schedule(4, 2, 0)
    assert schedule(2, 2, 2)[0][:4] == (("F", 0, 0), ("F", 1, 0), ("F", 0, 2), ("F", 1, 2))  # M == S: forwards first


def test_a_smaller_batch_runs_its_odd_pieces_too():
    """A batch in fewer pieces than planned (an odd count): the even part interleaved, the rest one at a time after
    it; every op once, in dependency order, one more chunk pass at most in flight."""
    for chunks in (2, 3):
        for m in range(1, 10):
            plan = runnable_schedule(m, 2, chunks)
            if m % 2 == 0:
                assert plan == schedule(m, 2, chunks)
            for s, ops in enumerate(plan):
                mine = [c for c in range(2 * chunks) if c % 2 == s]
                assert sorted(ops) == sorted((kind, k, c) for kind in "FB" for k in range(m) for c in mine)
                even = m - m % 2
                assert in_flight(ops) <= (in_flight(schedule(even, 2, chunks)[s]) if even else 0) + chunks
            _replay(plan, 2, chunks)
            # unit ops: the interleaved part's closed form (M + 1/v) 2v, then the odd piece alone after it drains
            # (its 2v chunk forwards and 2v backwards one after another)
            head = (even + 1 / chunks) * 2 * chunks if even else 0.0
            assert makespan(plan, lambda s, op: 1.0) == pytest.approx(head + 4 * chunks * (m % 2), abs=1e-9)
    assert runnable_schedule(3, 2, 1) == schedule(3)  # not interleaved: any count, as before
    assert runnable_schedule(3, 2, 2)[0][-4:] == (("F", 2, 0), ("F", 2, 2), ("B", 2, 2), ("B", 2, 0))
