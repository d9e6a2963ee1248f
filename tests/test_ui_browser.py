"""The UI path in a real browser: Debian's chromium, driven by Playwright, on a live `dagster dev`
and a live `mlflow server` over the same store.

What a person does: open the asset graph (every asset visible, the landing files upstream of
the snapshot), add a `data_snapshot` partition, materialize the graph, watch the training run's
progress lines arrive on the run page while the trainer runs, then read what the run left: the
`training_attempt` metadata (tables, the loss curve without a click), the evaluation's tables,
the explain page on `promoted_model` naming the promotion, and in MLflow's UI the training runs
table and the champion's model version (its source is the training run; it has a signature).
Last, drifted data: the failed `schema_contract` check's column and rule. A screenshot of each
step is saved once the page has settled (`make screenshots` keeps them in docs/screenshots).

One `dagster dev`, one `mlflow server` and one training run serve every check.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import requests
from playwright.sync_api import Page, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from pipeline.data.landing import Drift, write_digits_landing
from pipeline.data.snapshot import snapshot_id_for
from tests.dagster_dev import FAST_RUN_QUEUE, DagsterDev, launch_graph
from tests.mlflow_server import MlflowServer

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
LOADED = """() => document.fonts.status === "loaded"
  && [...document.images].every(image => image.complete)"""
GRAPH = [
    "landing_files",
    "data_snapshot",
    "training_attempt",
    "committed_checkpoint",
    "evaluation",
    "promoted_model",
]
# The trainer's progress line on the run page: `step 120/300 (40%) · loss 0.53 · … · ETA …`.
PROGRESS = re.compile(r"^step (\d+)/(\d+) \(\d+%\)")
# A pause after every step, so that the default 300 steps take ~20 s even on an idle machine
# (9 s of pauses plus the steps): long enough to watch a few progress lines arrive (one per 2 s
# at most), short enough for the suite. The attempt's receipt names the hook (explain shows it).
SLOW_STEPS = {"TRACKS_FAULT_SLEEP_AFTER_STEP": "0.03"}
MODEL_NAME = "digits-classifier"
MLFLOW_LINKS = ("mlflow_training_run", "mlflow_model_version")  # on promoted_model
MESSAGES = '[class*="messageColumn"]'  # one message cell per row of the run page's event log


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


def _asset_graph(page: Page, url: str, shot: Path) -> None:
    """The global asset graph with every asset of the lineage drawn as its own node (no group
    collapsed into a box), left to right in lineage order: landing_files first."""
    # Wide enough that the graph, fitted to the window, is drawn at a scale where Dagster writes
    # whole names in the nodes (below 0.6 it shortens them: "commit…_checkpoint").
    page.set_viewport_size({"width": 2400, "height": 700})
    page.goto(f"{url}/asset-groups", wait_until="networkidle")
    # Asset nodes are the graph's foreignObjects; a group (collapsed or not) is class "group".
    nodes = page.locator('svg[class*="svgContainer"] foreignObject:not(.group)')
    lefts = []
    for name in GRAPH:
        node = nodes.filter(has=page.get_by_text(name, exact=True)).first
        node.wait_for()
        lefts.append(node.bounding_box()["x"])
    assert lefts == sorted(lefts), f"graph not drawn in lineage order {GRAPH}: x {lefts}"
    _screenshot(page, shot)
    page.set_viewport_size({"width": 1400, "height": 900})


def _materialize_all(page: Page, snapshot_id: str, shot: Path) -> None:
    """On the asset graph: add partition ``snapshot_id`` in the launch dialog, screenshot it,
    launch the graph."""
    # "Materialize all (5)…": the count leaves out landing_files, which Dagster does not build.
    page.get_by_role("button", name="Materialize all").click()  # a substring
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
    _screenshot(page, shot)
    launch.click()


def _pick_partition(page: Page, snapshot_id: str) -> None:
    """Select ``snapshot_id`` in the launch dialog's partition picker (Custom selection)."""
    dialog = page.get_by_role("dialog").filter(has_text="Partition selection")
    dialog.get_by_text("Select a partition or create one").click()
    page.get_by_placeholder("Filter partitions").fill(snapshot_id)
    page.get_by_text(snapshot_id, exact=True).filter(visible=True).first.click()
    dialog.get_by_text("Launch runs to materialize").click()  # closes the picker


def _screenshot(
    page: Page, path: Path, *, full_page: bool = False, idle: bool = True, live: bool = False
) -> None:
    """``path`` once the page has settled: loaded to network idle, and nothing moving.

    ``idle=False``: a page that polls its server (MLflow's runs table) is never idle on the
    network; only its animations are waited for. ``live``: a running run's page never settles
    (its events keep arriving, and its Gantt chart keeps moving): its fonts and images are
    waited for, and the screenshot itself finishes the transitions under way.
    """
    if live:
        page.wait_for_function(LOADED, timeout=30_000)
    else:
        if idle:
            page.wait_for_load_state("networkidle")
        page.evaluate("window.__tracksSettledFrames = 0")
        page.wait_for_function(SETTLED, timeout=30_000)  # polled every animation frame
    page.screenshot(path=path, full_page=full_page, animations="disabled")


def _screenshot_at(
    page: Page, path: Path, *, width: int = 2000, height: int = 2200, idle: bool = True
) -> None:
    """:func:`_screenshot` in a window of ``width`` x ``height``. Dagster's pages scroll inside
    their own panel, so a full-page screenshot is one window: a wider and taller one shows whole
    metadata tables beside the definition panel."""
    page.set_viewport_size({"width": width, "height": height})
    try:
        _screenshot(page, path, idle=idle)
    finally:
        page.set_viewport_size({"width": 1400, "height": 900})


def _show_markdown(page: Page, key: str) -> None:
    row = page.locator("tr").filter(has=page.get_by_text(key, exact=True))
    row.get_by_text("[Show Markdown]").first.click()


RUNS_FOR_PARTITION = """query($tag: String!) { runsOrError(filter: {tags: [{key:
  "dagster/partition", value: $tag}]}) { ... on Runs { results { runId status } } } }"""


def _run_of(server: DagsterDev, snapshot_id: str, timeout: float = 60) -> str:
    """The id of the Dagster run launched for partition ``snapshot_id``, once it exists."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = server.graphql(RUNS_FOR_PARTITION, {"tag": snapshot_id})["runsOrError"]["results"]
        if runs:
            return runs[0]["runId"]
        time.sleep(0.5)
    raise TimeoutError(f"no run launched for {snapshot_id}:\n{server.log_tail()}")


def _wait_for_run(server: DagsterDev, snapshot_id: str, timeout: float = 420) -> str:
    return server.wait_for_run(_run_of(server, snapshot_id), timeout=timeout)


def _trainers_under(home: Path) -> list[int]:
    """Live trainer processes (``python -m pipeline.trainer``) whose arguments name ``home``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pipeline.trainer" in argv and any(str(home).encode() in arg for arg in argv):
            pids.append(int(entry.name))
    return pids


def _watch_progress(
    page: Page, server: DagsterDev, run_id: str, home: Path, timeout: float = 300
) -> list[int]:
    """Reads the run page's event log as rows arrive until three progress lines with distinct
    steps have shown; returns their steps in the order they appeared.

    At that moment it records that the trainer has not exited: the Dagster run is STARTED, a
    trainer process under ``home`` is alive, the steps are short of ``max_steps`` and the log
    holds no commit of the final step.
    """
    page.goto(f"{server.url}/runs/{run_id}", wait_until="domcontentloaded")
    cells = page.locator(MESSAGES)
    seen: list[int] = []
    max_steps = 0
    deadline = time.monotonic() + timeout
    while len(seen) < 3:
        status = server.run_status(run_id)
        if time.monotonic() > deadline or status in ("SUCCESS", "FAILURE", "CANCELED"):
            raise AssertionError(
                f"run {run_id} ({status}): progress lines seen for steps "
                f"{seen} on its run page, three wanted while it trains:\n"
                + "\n".join(cells.all_inner_texts()[-20:])
            )
        # The log is a virtualized list that follows its newest row: read it often enough
        # that no line scrolls past unread (the trainer logs one per 2 s at most).
        for text in cells.all_inner_texts():
            found = PROGRESS.match(text.strip())
            if found and int(found[1]) not in seen:
                seen.append(int(found[1]))
                max_steps = int(found[2])
        time.sleep(0.5)
    messages = cells.all_inner_texts()
    status, trainers = server.run_status(run_id), _trainers_under(home)
    final_commit = f"checkpoint committed at step {max_steps}"
    assert status == "STARTED", f"run {run_id} is {status} with progress for steps {seen}"
    assert trainers, f"no trainer process under {home} alive at steps {seen}"
    assert max(seen) < max_steps, f"steps {seen} reached max_steps {max_steps}"
    assert not any(m.startswith(final_commit) for m in messages), messages
    assert seen == sorted(seen), f"progress lines out of order on the run page: {seen}"
    return seen


def _mlflow_json(mlflow: MlflowServer, path: str, **params: str) -> dict:
    response = requests.get(f"{mlflow.url}/api/2.0/mlflow/{path}", params=params, timeout=30)
    response.raise_for_status()
    return response.json()


def _metadata_link(page: Page, key: str) -> str:
    """The address of the URL metadata value ``key`` on the asset page shown."""
    row = page.locator("tr").filter(has=page.get_by_text(key, exact=True)).first
    return row.locator("a[href^='http']").first.get_attribute("href") or ""


def _mlflow_pages(page: Page, mlflow: MlflowServer, links: dict[str, str], shots: Path) -> None:
    """MLflow's UI, reached by Dagster's links (``links``, from promoted_model's metadata): the
    training run, the experiment's runs table, and the champion's model version naming the
    training run as its source, with its signature."""
    experiment = _mlflow_json(mlflow, "experiments/get-by-name", experiment_name="tracks-training")
    experiment_id = experiment["experiment"]["experiment_id"]
    champion = _mlflow_json(mlflow, "registered-models/alias", name=MODEL_NAME, alias="champion")
    version = champion["model_version"]
    source_run = _mlflow_json(mlflow, "runs/get", run_id=version["run_id"])["run"]["info"]
    assert source_run["experiment_id"] == experiment_id, (
        f"model version {version['version']}'s source run {version['run_id']} is not in "
        f"tracks-training (experiment {experiment_id}): {source_run}"
    )
    run_name = source_run["run_name"]

    # Dagster's link to the training run: MLflow's page of that run.
    assert links["mlflow_training_run"].startswith(mlflow.url), links
    page.goto(links["mlflow_training_run"], wait_until="domcontentloaded")
    page.get_by_text(f"{version['run_id']}", exact=True).first.wait_for()  # "Run ID"
    close = page.locator('[data-component-id="mlflow.assistant.chat_panel.close"]')
    with contextlib.suppress(PlaywrightTimeout):  # MLflow's assistant panel, when it opens
        close.click(timeout=5_000)

    # The experiment in the "Model training" view Tracks' links open: its runs table, not
    # GenAI's overview or traces (MLflow 3.17 opens those for a browser that chose nothing).
    page.goto(
        f"{mlflow.url}/#/experiments/{experiment_id}?workflowType=machine_learning",
        wait_until="domcontentloaded",
    )
    page.get_by_role("heading", name="Runs", exact=True).wait_for()
    page.get_by_role("link", name=run_name).first.wait_for()  # a row of the runs table
    _screenshot(page, shots / "8-mlflow-runs.png", idle=False)

    # Dagster's link to the model version: its source is the training run; it has a signature.
    assert links["mlflow_model_version"].startswith(mlflow.url), links
    page.goto(links["mlflow_model_version"], wait_until="domcontentloaded")
    source = page.get_by_role("link", name=run_name)  # "Source Run"
    source.wait_for()
    href = source.get_attribute("href") or ""
    assert f"/experiments/{experiment_id}/runs/{version['run_id']}" in href, href
    page.get_by_text(re.compile(r"^Inputs \(\d+\)$")).wait_for()  # the signature's schema
    page.get_by_text(re.compile(r"^Outputs \(\d+\)$")).wait_for()
    assert "No schema" not in page.inner_text("body")
    # Tall enough for the schema below the source run.
    _screenshot_at(page, shots / "9-mlflow-model-version.png", width=1400, height=1050, idle=False)


def _keep_failed_page(page: Page, path: Path) -> Callable[..., bool]:
    """An exit callback that saves what the browser showed when the test failed."""

    def keep(exc_type: type[BaseException] | None, *_: object) -> bool:
        if exc_type is not None:
            with contextlib.suppress(Exception):  # the failure itself is what to report
                page.screenshot(path=path)
                print(f"the page at the failure: {path} ({page.url})")
        return False

    return keep


def test_the_ui_path_in_a_real_browser(browser_page, tracks_home: Path, tmp_path: Path) -> None:
    page = browser_page
    shots = Path(SCREENSHOTS) if SCREENSHOTS else tmp_path / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    write_digits_landing(tracks_home / "landing")
    good = snapshot_id_for(tracks_home / "landing")
    # nux off: Dagster's "Join the community" prompt would cover the page at a random moment.
    (tracks_home / "dagster" / "dagster.yaml").write_text(
        "telemetry:\n  enabled: false\nnux:\n  enabled: false\n" + FAST_RUN_QUEUE
    )
    with contextlib.ExitStack() as stack:
        # MLflow's server first: it creates and migrates the store the run will write to.
        mlflow = MlflowServer(
            f"sqlite:///{tracks_home / 'mlflow.db'}",
            tracks_home / "mlartifacts",
            log_path=tracks_home / "mlflow-server.log",
        )
        stack.callback(mlflow.stop)
        server = DagsterDev(
            env={
                "TRACKS_HOME": str(tracks_home),
                "DAGSTER_HOME": str(tracks_home / "dagster"),
                "TRACKS_AUTOMATION": "off",  # a person presses the button in this test
                "TRACKS_MLFLOW_UI_URL": mlflow.url,  # Dagster's links lead to this server
                **SLOW_STEPS,
            },
            log_path=tracks_home / "dagster-dev.log",
        )
        stack.callback(server.stop)
        stack.push(_keep_failed_page(page, DIAGNOSTICS / "ui-browser-failed.png"))
        mlflow.wait_until_ready()
        server.wait_until_loaded()
        # 1. The asset graph, every asset visible; a new partition, the whole graph launched.
        _asset_graph(page, server.url, shots / "0-asset-graph.png")
        _materialize_all(page, good, shots / "1-launch.png")

        # 2. The run page while the trainer trains: progress lines arrive, steps increasing.
        run_id = _run_of(server, good)
        steps = _watch_progress(page, server, run_id, tracks_home)
        # The event log over the whole page: the "expand" button beside the log's filters (the
        # other one, above the Gantt chart, expands the chart).
        page.get_by_role("button").filter(has=page.get_by_label("expand_arrows")).last.click()
        page.mouse.move(0, 0)  # no hover card over a row
        _screenshot(page, shots / "2-run-live.png", live=True)
        assert server.wait_for_run(run_id, timeout=420) == "SUCCESS", server.log_tail()
        print(f"progress lines seen while training, steps {steps}")

        # Drifted data, launched now so that its run fails while the pages below are read.
        shutil.rmtree(tracks_home / "landing")
        write_digits_landing(tracks_home / "landing", drift=Drift.LABEL_OUT_OF_RANGE)
        drifted = snapshot_id_for(tracks_home / "landing")
        # Launched with the mutation the dialog sends: the dialog itself was driven above, and
        # with a partition already present it once failed to select the new one on a loaded
        # CI machine ("Launch backfill"). What this step checks is the check's page below.
        launch_graph(server, drifted)

        # 3. training_attempt: its metadata as tables, the loss curve without a click.
        page.goto(f"{server.url}/assets/training_attempt", wait_until="networkidle")
        curve = page.locator('td img[src^="data:image/svg+xml"]').first
        curve.wait_for()
        assert curve.bounding_box()["width"] > 100
        page.locator("td table").first.wait_for()  # a table inside the metadata table
        body = page.inner_text("body")
        assert "checkpoint_lineage" in body and "termination_reason" in body
        assert "[Show Markdown]" not in page.locator("tr").filter(has=curve).inner_text()
        _screenshot_at(page, shots / "3-training-attempt.png")
        _screenshot_at(page, shots / "5-loss-curve.png", height=1000)

        # 4. evaluation: one row per evaluator and per slice.
        page.goto(f"{server.url}/assets/evaluation", wait_until="networkidle")
        page.get_by_text("noise_robustness", exact=True).first.wait_for()
        page.get_by_text("class=9", exact=True).first.wait_for()
        _screenshot_at(page, shots / "7-evaluation-tables.png")

        # 5. promoted_model: the run's explain page names the promotion.
        page.goto(f"{server.url}/assets/promoted_model", wait_until="networkidle")
        _show_markdown(page, "explain")
        dialog = page.get_by_role("dialog")
        promotion = dialog.get_by_role("heading", name="Promotion", exact=True)
        promotion.wait_for()
        text = dialog.inner_text()
        assert f"promoted as {MODEL_NAME} version" in text, text[:3000]
        assert "No promotion decision yet" not in text, text[:3000]
        promotion.scroll_into_view_if_needed()
        _screenshot(page, shots / "4-promoted-model-explain.png")
        page.keyboard.press("Escape")
        links = {key: _metadata_link(page, key) for key in MLFLOW_LINKS}

        # 6. MLflow's UI over the same store, by Dagster's links: runs table, model version.
        _mlflow_pages(page, mlflow, links, shots)

        # 7. The drifted snapshot's schema_contract check fails, naming the column and rule.
        assert _wait_for_run(server, drifted) == "FAILURE", server.log_tail()
        page.goto(f"{server.url}/assets/data_snapshot?view=checks", wait_until="networkidle")
        page.get_by_text("schema_contract").first.click()
        page.get_by_text("Latest execution").first.wait_for()
        text = page.inner_text("body")
        assert "column 'label': rule 'in_range(0, 9)' failed" in text, text[:3000]
        _screenshot(page, shots / "6-schema-contract-failed.png", full_page=True)
