"""The UI path in a real browser: Debian's chromium, driven by Playwright, on a live `dagster dev`.

What a person does: open the asset graph, add a `data_snapshot` partition, materialize the
graph, watch the run finish, open the `training_attempt` materialization to read the explain
page and see the loss curve, then land drifted data and read the failed `schema_contract`
check's column and rule, and the evaluation's tables. A screenshot of each step is saved once
the page has settled (`make screenshots` keeps them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import sync_playwright

from pipeline.data.landing import Drift, write_digits_landing
from pipeline.data.snapshot import snapshot_id_for
from tests.dagster_dev import DagsterDev, launch_graph

pytestmark = pytest.mark.slow
CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = os.environ.get("TRACKS_SCREENSHOTS")
DIAGNOSTICS = Path(os.environ.get("TRACKS_UI_DIAGNOSTICS", "/tmp"))
# Settled: no finite CSS animation or transition running (a dialog fading in shows two pages
# through each other), fonts loaded and images decoded, for 3 frames in a row, so one about to
# start is seen. Spinners loop forever: they never settle, and are no half-drawn page.
SETTLED = """() => {
  const still = document.fonts.status === "loaded"
    && [...document.images].every(image => image.complete)
    && document.getAnimations().every(animation => animation.playState !== "running"
      || animation.effect?.getComputedTiming().iterations === Infinity);
  window.__tracksSettledFrames = still ? (window.__tracksSettledFrames || 0) + 1 : 0;
  return window.__tracksSettledFrames >= 3;
}"""


@pytest.fixture
def browser_page():
    if not CHROMIUM.exists():
        pytest.fail("chromium is not installed: `make browser` installs Debian's chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-dev-shm-usage"]
        )
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.set_default_timeout(60_000)
        yield page
        browser.close()


def _materialize_all(page, url: str, snapshot_id: str) -> None:
    """Add partition ``snapshot_id`` in the launch dialog and materialize the graph for it."""
    page.goto(f"{url}/asset-groups", wait_until="networkidle")
    skip = page.get_by_role("button", name="Skip")  # Dagster's community prompt, first visit
    with contextlib.suppress(PlaywrightTimeout):  # it shows once per browser profile
        skip.click(timeout=5_000)
    page.get_by_role("button", name="Materialize all…").click()
    page.get_by_text("Add a partition").click()
    adding = page.get_by_role("dialog").filter(has_text="Add a partition for snapshots")
    adding.get_by_role("textbox").fill(snapshot_id)  # not typed blind: wait for the field
    adding.get_by_role("button", name="Save", exact=True).click()
    adding.wait_for(state="detached")
    launch = page.get_by_role("dialog").get_by_role("button", name="Launch 1 run")
    try:
        launch.wait_for(timeout=20_000)
    except PlaywrightTimeout:
        # On a loaded machine Dagster's dialog sometimes adds the partition without selecting
        # it ("0 partitions", "Launch backfill"): pick it in the partition picker, as a person
        # would on seeing that.
        _pick_partition(page, snapshot_id)
    try:
        launch.wait_for()
    except PlaywrightTimeout:
        page.screenshot(path=DIAGNOSTICS / f"launch-{snapshot_id}.png", full_page=True)
        body = page.inner_text("body")[:4000]
        raise AssertionError(f"no 'Launch 1 run' for partition {snapshot_id}:\n{body}") from None
    launch.click()


def _pick_partition(page, snapshot_id: str) -> None:
    """Select ``snapshot_id`` in the launch dialog's partition picker (Custom selection)."""
    dialog = page.get_by_role("dialog").filter(has_text="Partition selection")
    dialog.get_by_text("Select a partition or create one").click()
    page.get_by_placeholder("Filter partitions").fill(snapshot_id)
    page.get_by_text(snapshot_id, exact=True).filter(visible=True).first.click()
    dialog.get_by_text("Launch runs to materialize").click()  # closes the picker


def _screenshot(page, path: Path, *, full_page: bool = False) -> None:
    """``path`` once the page has settled: loaded to network idle, and nothing moving."""
    page.wait_for_load_state("networkidle")
    page.evaluate("window.__tracksSettledFrames = 0")
    page.wait_for_function(SETTLED, timeout=30_000)  # polled every animation frame
    page.screenshot(path=path, full_page=full_page, animations="disabled")


def _show_markdown(page, key: str) -> None:
    row = page.locator("tr").filter(has=page.get_by_text(key, exact=True))
    row.get_by_text("[Show Markdown]").first.click()


def _wait_for_run(server: DagsterDev, snapshot_id: str, timeout: float = 420) -> str:
    query = """query($tag: String!) { runsOrError(filter: {tags: [{key: "dagster/partition",
      value: $tag}]}) { ... on Runs { results { runId status } } } }"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = server.graphql(query, {"tag": snapshot_id})["runsOrError"]["results"]
        if runs and runs[0]["status"] in ("SUCCESS", "FAILURE", "CANCELED"):
            return runs[0]["status"]
        time.sleep(2)
    raise TimeoutError(f"no finished run for {snapshot_id}:\n{server.log_tail()}")


def test_the_ui_path_in_a_real_browser(browser_page, tracks_home: Path, tmp_path: Path) -> None:
    page = browser_page
    shots = Path(SCREENSHOTS) if SCREENSHOTS else tmp_path / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    write_digits_landing(tracks_home / "landing")
    good = snapshot_id_for(tracks_home / "landing")
    (tracks_home / "dagster" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    server = DagsterDev(
        env={
            "TRACKS_HOME": str(tracks_home),
            "DAGSTER_HOME": str(tracks_home / "dagster"),
            "TRACKS_AUTOMATION": "off",  # a person presses the button in this test
        },
        log_path=tracks_home / "dagster-dev.log",
    )
    try:
        server.wait_until_loaded()
        # 1. The asset graph, 2. a new partition and the whole graph materialized.
        _materialize_all(page, server.url, good)
        _screenshot(page, shots / "1-launch.png")
        assert _wait_for_run(server, good) == "SUCCESS", server.log_tail()
        page.goto(f"{server.url}/runs", wait_until="networkidle")
        page.get_by_text("Success").first.wait_for()
        _screenshot(page, shots / "2-run-finished.png")

        # 3. The training_attempt materialization: the explain page and the loss curve.
        page.goto(f"{server.url}/assets/training_attempt", wait_until="networkidle")
        page.get_by_text("explain", exact=True).first.wait_for()
        page.get_by_text("loss_curve", exact=True).first.wait_for()
        body = page.inner_text("body")
        assert "checkpoint_lineage" in body and "termination_reason" in body
        _screenshot(page, shots / "3-training-attempt.png", full_page=True)
        # Markdown values open in a dialog: the explain page, then the loss curve.
        _show_markdown(page, "explain")
        page.get_by_role("dialog").get_by_text("Attempts and retries").first.wait_for()
        _screenshot(page, shots / "4-explain.png")
        page.keyboard.press("Escape")
        _show_markdown(page, "loss_curve")
        image = page.get_by_role("dialog").locator('img[src^="data:image/png"]').first
        image.wait_for()
        assert image.bounding_box()["width"] > 100
        _screenshot(page, shots / "5-loss-curve.png")
        page.keyboard.press("Escape")

        # 4. Drifted data: the schema_contract check fails, naming the column and the rule.
        shutil.rmtree(tracks_home / "landing")
        write_digits_landing(tracks_home / "landing", drift=Drift.LABEL_OUT_OF_RANGE)
        drifted = snapshot_id_for(tracks_home / "landing")
        # Launched with the mutation the dialog sends: the dialog itself was driven in step 2,
        # and with a partition already present it once failed to select the new one on a
        # loaded CI machine ("Launch backfill"). What this step checks is the page below.
        launch_graph(server, drifted)
        assert _wait_for_run(server, drifted) == "FAILURE"
        page.goto(f"{server.url}/assets/data_snapshot?view=checks", wait_until="networkidle")
        page.get_by_text("schema_contract").first.click()
        page.get_by_text("Latest execution").first.wait_for()
        text = page.inner_text("body")
        assert "column 'label': rule 'in_range(0, 9)' failed" in text, text[:3000]
        _screenshot(page, shots / "6-schema-contract-failed.png", full_page=True)

        # 5. The evaluation's results and slices: tables, one row per evaluator and per slice.
        page.goto(f"{server.url}/assets/evaluation", wait_until="networkidle")
        results = page.locator("table").filter(has_text="evaluation_id").first
        results.get_by_text("noise_robustness", exact=True).wait_for()
        page.get_by_text("class=9", exact=True).first.wait_for()
        _screenshot(page, shots / "7-evaluation-tables.png", full_page=True)
    finally:
        server.stop()
