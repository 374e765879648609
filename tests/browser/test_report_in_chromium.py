"""The HTML report in a real browser: headless Debian Chromium, no console errors, every stage shown.

Needs ``chromium`` (``scripts/install-chromium.sh`` installs it; ``make test`` runs that first).
Without it these tests skip on a developer machine and FAIL under CI (``CI`` set), so a broken
install cannot pass silently. The screenshot of the example plan is saved in the test's
temporary directory; to refresh the README picture::

    PIPECUT_SCREENSHOT=docs/plan.png .venv/bin/pytest tests/browser -k example
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import pipecut
from tests.browser.chromium import Browser, find_chromium, launch
from tests.browser.plans import example_plan, synthetic_plan

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def browser():
    binary = find_chromium()
    if binary is None:
        message = "chromium is not installed; run scripts/install-chromium.sh"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI must run the browser test)")
        pytest.skip(message)
    with launch(binary) as b:
        yield b


def open_report(browser: Browser, path: Path, width: int = 1280, height: int = 900) -> None:
    browser.events.clear()
    browser.open(path.resolve().as_uri(), width=width, height=height)


def stages_shown(browser: Browser, selector: str) -> list[int]:
    return browser.evaluate(
        f"Array.from(document.querySelectorAll('{selector}'), e => +e.dataset.stage)"
        ".filter((v, i, a) => a.indexOf(v) === i).sort((a, b) => a - b)"
    )


def test_example_plan_report_renders_every_stage_without_errors(browser, tmp_path):
    plan = example_plan(stages=3, microbatches=4)
    page = pipecut.render(plan, tmp_path / "plan.html", title="pipecut plan of examples.gpt:build")
    open_report(browser, page, width=1400, height=1200)  # the README picture's size
    assert browser.console_errors() == []
    stages = list(range(plan.num_stages))
    assert stages_shown(browser, "#graph .col-title") == stages  # graph columns
    assert stages_shown(browser, "#graph .item") == stages  # nodes drawn in each column
    assert stages_shown(browser, ".legend [data-stage]") == stages
    assert stages_shown(browser, "#stages tr[data-stage]") == stages
    boxes = browser.evaluate("document.querySelectorAll('#gantt-predicted .box').length")
    assert boxes == 2 * plan.num_stages * plan.microbatches
    cuts = browser.evaluate("document.querySelectorAll('#graph path.cut').length")
    assert cuts >= plan.num_stages - 1
    labels = browser.evaluate("Array.from(document.querySelectorAll('#graph .cut-label'), e => e.textContent)")
    assert labels and all("·" in label for label in labels)  # shape · bytes

    shot = browser.screenshot(tmp_path / "plan.png")
    assert shot.read_bytes().startswith(PNG_MAGIC)
    target = os.environ.get("PIPECUT_SCREENSHOT")
    if target:
        shutil.copyfile(shot, target)


def test_a_thousand_node_graph_stays_readable_and_unfolds(browser, tmp_path):
    plan = synthetic_plan(layers=90, stages=4)
    assert len(plan.nodes) > 990
    page = pipecut.render(plan, tmp_path / "big.html")
    open_report(browser, page)
    assert browser.console_errors() == []
    folded = browser.evaluate("document.querySelectorAll('#graph .item').length")
    assert folded <= 40 * plan.num_stages  # folded by module: tens of boxes, not a thousand
    browser.evaluate("document.getElementById('expand-all').click()")
    unfolded = browser.evaluate("document.querySelectorAll('#graph .item').length")
    partitioned = sum(len(s.nodes) for s in plan.stages)
    assert unfolded >= partitioned
    browser.evaluate("document.getElementById('collapse-all').click()")
    collapsed = browser.evaluate("document.querySelectorAll('#graph .item').length")
    assert collapsed < folded
    # clicking a folded group opens it
    browser.evaluate("document.querySelector('#graph .item.group').dispatchEvent(new MouseEvent('click'))")
    assert browser.evaluate("document.querySelectorAll('#graph .item').length") > collapsed
    assert stages_shown(browser, "#graph .col-title") == list(range(plan.num_stages))
    assert browser.console_errors() == []


def test_measured_timeline_is_drawn(browser, tmp_path):
    from pipecut.report.gantt import predicted_spans

    plan = synthetic_plan(layers=3, stages=2)
    spans = predicted_spans(plan)
    page = pipecut.render(plan, tmp_path / "t.html", timeline=list(spans))
    open_report(browser, page)
    assert browser.console_errors() == []
    assert browser.evaluate("document.querySelectorAll('#gantt-measured .box').length") == len(spans)


def test_cluster_grid_shows_every_gpu_with_its_replica_and_stage(browser, tmp_path):
    import dataclasses

    from pipecut.cluster import ClusterPlacement, Layout, RunPrediction
    from pipecut.planning.cluster.figures import parse_cluster

    plan = synthetic_plan(layers=6, stages=2)
    placement = ClusterPlacement(layout=Layout.STAGES_INSIDE_NODES, replicas=4, stages=2)
    run = RunPrediction(step_ms=100.0, bubble_fraction=0.1, tokens_per_s_per_gpu=1000.0, mfu=0.4,
                        peak_memory_bytes=2**30, notes=("tensor parallelism is not planned",))
    plan = dataclasses.replace(plan, cluster=parse_cluster("2x4xH100-SXM"), placement=placement, run=run)
    page = pipecut.render(plan, tmp_path / "cluster.html")
    open_report(browser, page)
    assert browser.console_errors() == []
    assert browser.evaluate("document.querySelectorAll('.gpu-node').length") == 2
    cells = browser.evaluate("Array.from(document.querySelectorAll('.gpu'), e => e.textContent.trim())")
    assert cells == [f"r{r}·s{s}" for r, s in placement.grid()]
