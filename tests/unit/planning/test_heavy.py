"""Heavy nodes: which the planner chunks and into how many pieces, the merged cost table, and a
plan whose LM head outweighs a stage's share coming out with a lower slowest stage.

The pure parts run on cost tables with set costs (one ms per unit, a head of many), so their
assertions do not depend on timing; one test plans a real model whose head is ~20x a block.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jsonschema
import pytest
import torch

import pipecut
from examples import gpt
from pipecut.capture import as_planned, capture
from pipecut.capture.modes import describe_graph
from pipecut.core.kinds import NodeOp, ScheduleKind
from pipecut.ir import ChunkedNode, NodeCost, Plan
from pipecut.passes.partition.chain import is_unit
from pipecut.passes.partition.solve import partition_costs
from pipecut.passes.rewrite.chunk_rows import piece_names
from pipecut.passes.rewrite.split import split, verify
from pipecut.planning.heavy import MAX_PIECES, heavy_chunks, merge_costs, new_names
from pipecut.schema import schema

K = 4
HEAD_MS = 40.0


def _gpt(vocab: int = 512, seq: int = 16):  # type: ignore[no-untyped-def]
    model, (idx,), loss_fn, target = gpt.build(batch_size=4, vocab=vocab, dim=32, layers=2, seq=seq)
    return model, idx[:2], loss_fn, target


def _costed(rows: tuple[NodeCost, ...], head: float, pieces: int = 1) -> tuple[NodeCost, ...]:
    """Every unit 1 ms forward + 1 ms backward (the head ``head`` in all, split evenly over its
    pieces; the row chunks and the concatenation nearly free)."""
    out = []
    for n in rows:
        if not is_unit(n):
            out.append(n)
            continue
        ms = 1.0
        if n.name == "lm_head":
            ms = head if pieces == 1 else 0.01
        elif n.name.startswith("lm_head_piece"):
            ms = head / pieces
        elif n.name.startswith("lm_head_rows"):
            ms = 0.01
        out.append(dataclasses.replace(n, forward_ms=ms / 2, backward_ms=ms / 2))
    return tuple(out)


def _table(chunks: tuple[ChunkedNode, ...] = ()):  # type: ignore[no-untyped-def]
    model, idx, _, _ = _gpt()
    captured = as_planned(capture(model, (idx,)), chunks)
    pieces = chunks[0].pieces if chunks else 1
    return captured, _costed(describe_graph(captured, [idx]), HEAD_MS, pieces)


def test_a_head_above_the_share_is_chunked_into_shares() -> None:
    captured, nodes = _table()
    total = sum(n.forward_ms + n.backward_ms for n in nodes if is_unit(n))
    chunks = heavy_chunks(nodes, K, captured.gm)
    share = total / K
    assert share < HEAD_MS
    assert chunks == (ChunkedNode(node="lm_head", pieces=math.ceil(HEAD_MS / share)),)
    assert HEAD_MS / chunks[0].pieces <= share < HEAD_MS / (chunks[0].pieces - 1)  # the fewest
    assert heavy_chunks(nodes, 1, captured.gm) == ()  # one stage: nothing to balance
    light = _costed(describe_graph(captured, [torch.zeros(2, 16, dtype=torch.long)]), 1.0)
    assert heavy_chunks(light, K, captured.gm) == ()  # nothing above the share


def test_pieces_are_capped_by_rows_and_max_pieces_and_only_chunkable_nodes_count() -> None:
    captured, nodes = _table()
    huge = tuple(dataclasses.replace(n, forward_ms=1e4) if n.name == "lm_head" else n for n in nodes)
    assert heavy_chunks(huge, K, captured.gm)[0].pieces == K  # the head is nearly all: K shares
    many_rows = tuple(dataclasses.replace(n, shape=(2, 64, 32)) if n.name == "ln_f" else n for n in huge)
    assert heavy_chunks(many_rows, 16 * K, captured.gm)[0].pieces == MAX_PIECES  # not 16K
    few_rows = tuple(dataclasses.replace(n, shape=(2, 3, 32)) if n.name == "ln_f" else n for n in huge)
    assert heavy_chunks(few_rows, K, captured.gm)[0].pieces == 3
    # a heavy node that is not linear-like (the final LayerNorm), and the loss: never chunked
    odd = tuple(dataclasses.replace(n, forward_ms=1e4) if n.name in ("ln_f", "output") else n
                for n in _costed(nodes, 1.0))
    assert heavy_chunks(odd, K, captured.gm) == ()


def test_merge_keeps_the_original_costs_of_untouched_nodes() -> None:
    chunks = (ChunkedNode(node="lm_head", pieces=3),)
    _, original = _table()
    _, rewritten = _table(chunks)
    remeasured = tuple(dataclasses.replace(n, forward_ms=n.forward_ms + 7) for n in rewritten)
    merged = merge_costs(original, remeasured, chunks)
    assert [n.name for n in merged] == [n.name for n in rewritten]
    before = {n.name: n for n in original}
    rows, pieces = piece_names("lm_head", 3)
    assert new_names(chunks) == {*rows, *pieces, "lm_head"}
    for n in merged:
        if n.name in (*rows, *pieces, "lm_head"):
            assert n.forward_ms == pytest.approx(dict((m.name, m) for m in remeasured)[n.name].forward_ms)
        else:
            assert n == before[n.name]


def test_the_chunked_table_partitions_with_a_lower_slowest_stage() -> None:
    chunks = (ChunkedNode(node="lm_head", pieces=8),)
    _, whole = _table()
    _, pieces = _table(chunks)
    kwargs = dict(devices=K, microbatches=8, batch_size=16, schedule=ScheduleKind.ONE_F_ONE_B)
    before = partition_costs(whole, **kwargs)
    after = partition_costs(pieces, **kwargs)
    total = sum(n.forward_ms + n.backward_ms for n in whole if is_unit(n))
    assert max(before.predicted.stage_ms) >= HEAD_MS  # capped by the head
    assert max(after.predicted.stage_ms) < 0.8 * max(before.predicted.stage_ms)
    assert max(after.predicted.stage_ms) >= total / K - 1e-9
    holding = {s.index for s in after.stages for n in s.nodes if n.startswith("lm_head_piece")}
    assert len(holding) >= 2  # the head's pieces run on several stages


def _fake_profile(piece_ms: float | None):  # type: ignore[no-untyped-def]
    """A stand-in for ``pipecut.profile.nodes.profile`` giving :func:`_costed` costs: the
    planner's choice then depends on no timing. ``piece_ms``: a piece's cost (None: an even
    share of the head)."""
    def profile(captured, inputs, **_):  # type: ignore[no-untyped-def]
        rows = describe_graph(captured, inputs)
        pieces = sum(n.name.startswith("lm_head_piece") for n in rows) or 1
        costed = _costed(rows, HEAD_MS if piece_ms is None else piece_ms * pieces, pieces)
        return costed
    return profile


def _plan(**kwargs):  # type: ignore[no-untyped-def]
    model, (idx,), loss_fn, target = gpt.build(batch_size=8, vocab=512, dim=32, layers=2, seq=16)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plan = pipecut.plan(
        model, (idx,), K, loss_fn=loss_fn, target=target, microbatches=4, schedule="1f1b",
        measure=pipecut.MeasureOptions(calibrate=False), **kwargs,
    )
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # model unchanged
    return plan


def test_the_planner_chunks_a_heavy_head_and_round_trips(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pipecut.planning.request.profile", _fake_profile(None))
    plan = _plan()
    assert [c.node for c in plan.chunked] == ["lm_head"]
    found = re.search(r"predicted step ([\d.]+) ms, ([\d.]+) ms whole; chunked", plan.solver.detail)
    assert found is not None, plan.solver.detail
    assert float(found[1]) < float(found[2])
    assert plan.predicted.step_ms == pytest.approx(float(found[1]), abs=1e-3)
    assert max(plan.predicted.stage_ms) < HEAD_MS  # below the head alone: the cap is gone
    pieces = piece_names("lm_head", plan.chunked[0].pieces)[1]
    assert len({s.index for s in plan.stages for n in s.nodes if n in pieces}) >= 2
    model, (idx,), _, _ = gpt.build(batch_size=8, vocab=512, dim=32, layers=2, seq=16)
    planned = as_planned(capture(model, (idx[:2],)), plan.chunked)  # what compile splits
    verify(planned.gm, split(planned.gm, plan), plan)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.chunked == plan.chunked
    jsonschema.Draft202012Validator(schema()).validate(plan.to_dict())
    plain = _plan(partition=pipecut.PartitionOptions(heavy_pieces=False))
    assert plain.chunked == () and "heavy" not in plain.solver.detail
    assert plain.fingerprint == plan.fingerprint  # both checked against the captured graph
    assert max(plain.predicted.stage_ms) >= HEAD_MS
    assert any(n.op is NodeOp.CALL_MODULE and n.name == "lm_head" for n in plain.nodes)


def test_the_planner_keeps_the_head_whole_when_pieces_cost_more(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pipecut.planning.request.profile", _fake_profile(HEAD_MS))  # each piece a whole head
    plan = _plan()
    assert plan.chunked == ()
    assert re.search(r"heavy node\(s\) lm_head in \d row pieces: .* ms whole; kept whole", plan.solver.detail)
    assert not any(n.name.startswith("lm_head_piece") for n in plan.nodes)
