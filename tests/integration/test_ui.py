"""The Dagster UI in a real browser: `dagster dev` on loopback with the demo project on a tiny generated
warehouse, opened in headless Debian Chromium through Selenium.

The instance is the repository's dagster.yaml, as `make ui` uses it. It checks that no onboarding
pop-up covers the first page, that the asset graph shows every stage, that realized/churn's Metadata
plots (five realized days recorded in the instance) draw each series' points on its days, materializes a small asset by
clicking its Materialize button and sees the run succeed, launches a backfill of the events source
(the days since October: a run per 31 days under its backfill policy), then switches on the new-data
sensor, appends a day of purchases to the warehouse and sees the sensor's run extract exactly that
day; last, two training runs requested at once run one after the other (the run queue's limit of one
`habitus/kind: training` run). Screenshots are saved in the test's tmp dir and, with
HABITUS_UI_SCREENSHOTS=<folder>, copied there (the README's UI tour: docs/images).
Runs in `make test` (marker `ui`); skipped, with the reason, where chromium is not installed
(.ci/run installs Debian's chromium and chromium-driver).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import date, timedelta
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from habitus.pipelines.config.project import load_project
from habitus.pipelines.demo.data import append_demo_day, generate_demo_warehouse
from habitus.pipelines.orchestration.partitions import events_partitions

pytestmark = pytest.mark.ui
ROOT = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
STAGES = {"source/purchases", "source/customers", "source/products", "source/stores", "cache", "foundation_model",
          *(f"{stage}/{name}" for stage in ("scenario", "predictions")
            for name in ("churn", "brand_propensity", "spend", "next_products", "next_category")),
          "embeddings", "explanations/churn",
          *(f"realized/{name}" for name in ("churn", "brand_propensity", "spend", "next_products", "next_category"))}
DATA_START, DATA_END = "2026-09-01", "2026-10-31"  # two months of data: the backfill is two runs of 31 days
# dagster dev ignores SIGTERM when started from a script; restoring SIGINT's default lets SIGTERM stop it
UNIGNORE = "import os,signal,sys;signal.signal(signal.SIGINT,signal.SIG_DFL);os.execvp(sys.argv[1],sys.argv[1:])"


def _need_browser():
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.path.exists(p)]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed: the UI test needs Debian's chromium and chromium-driver "
                    f"(`apt-get install chromium chromium-driver`, as .ci/run does)")
    pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[dev]')")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DagsterDev:
    def __init__(self, root: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / "dagster_dev.log"
        env = {**os.environ, "DAGSTER_HOME": str(root / "dagster_home"), "HABITUS_CONFIG": str(ROOT / "examples" / "demo.yaml"),
               "HABITUS_WORKSPACE": str(root / "ws"), "HABITUS_DEMO_WAREHOUSE": str(root / "warehouse.duckdb"),
               "HABITUS_SENSOR_INTERVAL": "5", "DAGSTER_GRPC_TIMEOUT_SECONDS": "300"}  # (what `make ui` sets)
        Path(env["DAGSTER_HOME"]).mkdir()
        shutil.copy(ROOT / "dagster.yaml", Path(env["DAGSTER_HOME"]) / "dagster.yaml")  # what `make ui` copies
        dagster = str(Path(sys.executable).parent / "dagster")
        with open(self.log, "wb") as out:  # (the child keeps its own descriptor)
            self.proc = subprocess.Popen(
                [sys.executable, "-c", UNIGNORE, dagster, "dev", "-w", "workspace.yaml", "-h", "127.0.0.1",
                 "-p", str(self.port)], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)

    def graphql(self, query: str, variables: dict | None = None) -> dict:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        req = urllib.request.Request(f"{self.url}/graphql", data=body, headers={"Content-Type": "application/json"})
        data = json.loads(urllib.request.urlopen(req, timeout=30).read())
        assert "errors" not in data, data["errors"]
        return data["data"]

    def wait_loaded(self, timeout: float = 180) -> list[str]:
        """Wait for the code location; returns its asset keys."""
        deadline = time.time() + timeout
        query = """{ workspaceOrError { ... on Workspace { locationEntries { loadStatus locationOrLoadError {
                     __typename ... on PythonError { message }
                     ... on RepositoryLocation { repositories { assetNodes { assetKey { path } } } } } } } } }"""
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dagster dev exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                entries = self.graphql(query)["workspaceOrError"]["locationEntries"]
            except OSError:
                time.sleep(0.5)
                continue
            if entries and entries[0]["loadStatus"] == "LOADED":
                location = entries[0]["locationOrLoadError"]
                assert location["__typename"] == "RepositoryLocation", location
                return ["/".join(n["assetKey"]["path"]) for n in location["repositories"][0]["assetNodes"]]
            time.sleep(0.5)
        raise RuntimeError(f"the code location did not load in {timeout}s:\n{self.log.read_text()[-3000:]}")

    def log_size(self) -> int:
        """Bytes dagster dev has logged: its runs' events go there, so it grows while they progress."""
        return self.log.stat().st_size

    def runs(self, backfill_id: str | None = None) -> list[dict]:
        flt = f'(filter: {{tags: [{{key: "dagster/backfill", value: "{backfill_id}"}}]}})' if backfill_id else ""
        return self.graphql(f"{{ runsOrError{flt} {{ ... on Runs {{ results {{ runId status tags {{ key value }} "
                            f"assetSelection {{ path }} jobName startTime endTime }} }} }} }}")["runsOrError"]["results"]

    def sensor_selector(self, name: str) -> dict:
        entry = self.graphql("""{ workspaceOrError { ... on Workspace { locationEntries { name
                 locationOrLoadError { ... on RepositoryLocation { repositories { name } } } } } } }""")[
            "workspaceOrError"]["locationEntries"][0]
        return {"repositoryLocationName": entry["name"],
                "repositoryName": entry["locationOrLoadError"]["repositories"][0]["name"], "sensorName": name}

    def launch(self, job: str, assets: list[list[str]]) -> str:
        """Launch a run of `job` for `assets` (as the UI's launchpad does); returns its run id."""
        sel = self.sensor_selector("")
        selector = {"repositoryLocationName": sel["repositoryLocationName"], "repositoryName": sel["repositoryName"],
                    "jobName": job, "assetSelection": [{"path": a} for a in assets]}
        out = self.graphql("""mutation($p: ExecutionParams!) { launchRun(executionParams: $p) { __typename
                 ... on LaunchRunSuccess { run { runId } } ... on PythonError { message } } }""",
                           {"p": {"selector": selector}})["launchRun"]
        assert out["__typename"] == "LaunchRunSuccess", out
        return out["run"]["runId"]

    def sensor_ticks(self, selector: dict) -> list[dict]:
        data = self.graphql("""query($s: SensorSelector!) { sensorOrError(sensorSelector: $s) { __typename
                 ... on Sensor { sensorState { ticks(limit: 5) { status skipReason runIds } } } } }""", {"s": selector})
        return data["sensorOrError"]["sensorState"]["ticks"]


# the line charts of the page (Chart.js canvases): each one's series label, x labels and y values, read from the
# props React gave the chart component (the canvas holds only pixels)
PLOTS_JS = """
const out = {};
for (const canvas of document.querySelectorAll('canvas')) {
  const key = Object.keys(canvas).find((k) => k.startsWith('__reactFiber$'));
  for (let f = key && canvas[key]; f; f = f.return) {
    const data = f.memoizedProps && f.memoizedProps.data;
    if (data && data.datasets) {
      const d = data.datasets[0];
      out[d.label] = {x: data.labels, y: d.data.map((p) => p.y)};
      break;
    }
  }
}
return out;
"""
# the realized days of tests/assets/test_realized.py's run of 2026-12-03 (a one-epoch churn model, 7-day window, 600
# simulated customers): AUROC of the served scores and of the baselines as of each day, and the serving version's
# hold-out; the scores of 2026-10-27 and -28 were shuffled across customers there (the drop). The entity count
# and the fingerprint stand in for the run's (it printed the floats only)
REALIZED_DAYS = {"2026-10-24": {"model": 0.7690, "recency": 0.7244, "frequency": 0.7141},
                 "2026-10-25": {"model": 0.7689, "recency": 0.7410, "frequency": 0.7112},
                 "2026-10-26": {"model": 0.7712, "recency": 0.7522, "frequency": 0.7171},
                 "2026-10-27": {"model": 0.4679, "recency": 0.7382, "frequency": 0.7184},
                 "2026-10-28": {"model": 0.4920, "recency": 0.7215, "frequency": 0.7098}}
HOLDOUT, WINDOW = 0.7296, 7


def _report_realized_days(dagster_home: Path, workspace: Path) -> dict[str, dict[str, float]]:
    """Record REALIZED_DAYS as materializations of realized/churn in the server's instance (its SQLite storage),
    each with the metadata the asset writes and its JSON under the workspace; returns the plotted series:
    {metadata key: {day: value}}."""
    import dagster as dg

    from habitus.assets.realized import realized_key, realized_metadata
    from habitus.models.evaluate.realized import best_baseline
    from habitus.models.storage.files import write_json

    instance, series = dg.DagsterInstance.from_config(str(dagster_home)), {}
    for day, values in REALIZED_DAYS.items():
        cutoff = date.fromisoformat(day) + timedelta(days=1)
        report = {"metric": "auroc", "lower_is_better": False, "model": {"auroc": values["model"]},
                  "baselines": {b: {"auroc": v} for b, v in values.items() if b != "model"},
                  "entities": 412, "not_scored": 0, "day": day, "model_fingerprint": "3f92c41f31e7ede3",
                  "holdout": HOLDOUT, "window": [f"{cutoff} 00:00", f"{cutoff + timedelta(days=WINDOW)} 00:00"]}
        report["best_baseline"], report["best_baseline_value"] = best_baseline(report)
        out = workspace / "realized" / "churn" / f"{day}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(out, report)
        metadata = realized_metadata(report, out)
        instance.report_runless_asset_event(dg.AssetMaterialization(realized_key("churn"), partition=day,
                                                                    metadata=metadata))
        for key, value in metadata.items():
            if isinstance(value, dg.FloatMetadataValue):
                series.setdefault(key, {})[day] = value.value
    assert set(series) == {"realized_auroc", "baseline_recency", "baseline_frequency", "holdout_auroc"}
    return series


def _append_day(warehouse: Path):
    """The next day of purchases, or None while the sensor holds the DuckDB file (one writer at a time)."""
    import duckdb

    try:
        return append_demo_day(warehouse, seed=2)
    except duckdb.IOException:
        return None


def _wait(what: str, probe, timeout: float = 180, every: float = 1.0, progress=None):
    """Poll `probe` until it returns something true. With `progress` (e.g. the size of dagster dev's
    log), `timeout` counts from its last change: a run that is still writing events on a loaded
    machine is slow, not stuck, and only `timeout` seconds without any progress fail the test (or ten
    times `timeout` in all: the daemon's own lines also count as progress)."""
    deadline = time.time() + timeout
    cap = time.time() + 10 * timeout
    last = progress() if progress else None
    while time.time() < min(deadline, cap):
        value = probe()
        if value:
            return value
        time.sleep(every)
        if progress and (now := progress()) != last:
            last, deadline = now, time.time() + timeout
    limit = f"{timeout}s without progress or {10 * timeout}s in all" if progress else f"{timeout}s"
    raise AssertionError(f"timed out waiting for {what} ({limit})")


def _click(browser, xpath: str, timeout: float = 60) -> None:
    """Click the element once it is there and enabled; React may re-render it between finding and
    clicking, so find it again until the click lands."""
    from selenium.common.exceptions import (ElementClickInterceptedException, NoSuchElementException,
                                            StaleElementReferenceException)
    from selenium.webdriver.common.by import By

    def attempt():
        try:
            element = browser.find_element(By.XPATH, xpath)
            if not (element.is_displayed() and element.is_enabled()):
                return False
            element.click()
            return True
        except (StaleElementReferenceException, NoSuchElementException, ElementClickInterceptedException):
            return False

    _wait(f"a clickable {xpath}", attempt, timeout=timeout, every=0.3)


@pytest.fixture
def browser():
    _need_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--window-size=1920,1400"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    yield driver
    driver.quit()


@pytest.fixture
def dagster_dev(tmp_path, browser, stop_process_group):  # the browser first: without it nothing is started
    generate_demo_warehouse(tmp_path / "warehouse.duckdb", customers=300, products=60, stores=4, seed=2,
                            start=DATA_START, end=DATA_END)
    server = DagsterDev(tmp_path)
    try:
        yield server
    finally:
        stop_process_group(server.proc, grace=30)


def test_the_ui_shows_every_stage_and_runs_a_materialization_and_a_backfill(dagster_dev, browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    assert set(dagster_dev.wait_loaded()) == STAGES

    # the asset graph, every group expanded (Alt+E), shows every stage
    # no onboarding pop-up (dagster.yaml: nux disabled): the server says so, and after the second the
    # webapp waits before opening it, no "Join the Dagster community" dialog covers the first page
    assert dagster_dev.graphql("{ shouldShowNux }")["shouldShowNux"] is False
    browser.get(f"{dagster_dev.url}/asset-groups")
    WebDriverWait(browser, 60, ignored_exceptions=(StaleElementReferenceException,)).until(
        EC.presence_of_element_located((By.XPATH, "//*[text()='training']")))
    ActionChains(browser).key_down(Keys.ALT).send_keys("e").key_up(Keys.ALT).perform()
    labels = {"customers", "products", "purchases", "stores", "cache", "foundation_model", "churn",
              "brand_propensity", "spend", "next_products", "embeddings", "sources", "training", "scenarios",
              "predictions"}
    try:
        _wait("every asset in the graph", lambda: labels <= set(browser.execute_script(
            "return document.body.innerText").split()), timeout=60, every=0.5)
    except AssertionError as e:  # say which are missing
        seen = set(browser.execute_script("return document.body.innerText").split())
        browser.save_screenshot(str(tmp_path / "asset_graph_missing.png"))
        raise AssertionError(f"{e}: missing {sorted(labels - seen)}; page: {sorted(seen)[:80]}") from None
    assert "expanded=" in browser.current_url
    # the graph has been up for seconds (the webapp opens its pop-up one second after the page): none came
    assert not browser.find_elements(By.XPATH, "//*[contains(text(), 'Join the Dagster community')]")
    assert not browser.find_elements(By.CSS_SELECTOR, ".bp5-dialog, .bp4-dialog, [role='dialog']")
    browser.save_screenshot(str(tmp_path / "asset_graph.png"))

    # realized/churn's plots: five realized days recorded in the server's instance with the metadata the asset
    # writes (realized_metadata); the asset's Metadata section, switched to Plots, draws each number over the
    # partitions (the x axis holds every partition; a day without a materialization has no point)
    plotted = _report_realized_days(tmp_path / "dagster_home", tmp_path / "ws")
    browser.get(f"{dagster_dev.url}/assets/realized/churn")
    _click(browser, "//button[normalize-space()='Plots']")
    plots = _wait("the realized plots", lambda: (lambda p: p if set(plotted) <= set(p) else None)(
        browser.execute_script(PLOTS_JS)), timeout=60, every=0.5)
    for label, points in plotted.items():  # each series: a point on each realized day (the x axis holds every
        drawn = {x: y for x, y in zip(plots[label]["x"], plots[label]["y"]) if y is not None}  # partition)
        assert drawn == pytest.approx(points), (label, drawn)
    grid = browser.find_element(By.XPATH, "//*[normalize-space()='realized_auroc']/ancestor::div[contains("
                                          "@style, 'grid')][1]")
    browser.execute_script("arguments[0].scrollIntoView()", grid)
    grid.screenshot(str(tmp_path / "realized_plots.png"))

    # materialize an attribute source with its Materialize button; the run succeeds with its checks
    browser.get(f"{dagster_dev.url}/assets/source/customers")
    _click(browser, "//button[normalize-space()='Materialize']")
    WebDriverWait(browser, 60, ignored_exceptions=(StaleElementReferenceException,)).until(
        EC.presence_of_element_located((By.XPATH, "//*[contains(text(), 'Launched run')]")))
    run = _wait("the run to finish", lambda: next((r for r in dagster_dev.runs()
                                                   if r["status"] in ("SUCCESS", "FAILURE", "CANCELED")), None))
    assert run["status"] == "SUCCESS", dagster_dev.log.read_text()[-3000:]
    assert run["assetSelection"] == [{"path": ["source", "customers"]}]
    assert (tmp_path / "ws" / "sources" / "customers" / "all.parquet").exists()
    browser.get(f"{dagster_dev.url}/assets/source/customers")
    WebDriverWait(browser, 60, ignored_exceptions=(StaleElementReferenceException,)).until(
        EC.presence_of_element_located((By.XPATH, "//*[text()='rows']")))
    browser.save_screenshot(str(tmp_path / "materialized.png"))

    # a backfill of the warehouse's days of the events source, a run per 31 days: the days of its data, not
    # every day up to today (the demo source is live, so its partitions grow with the clock)
    keys = [k for k in events_partitions(load_project(ROOT / "examples" / "demo.yaml").source("purchases"))
            .get_partition_keys() if DATA_START <= k <= DATA_END]
    launched = dagster_dev.graphql(
        """mutation($p: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $p) {
             __typename ... on LaunchBackfillSuccess { backfillId } ... on PythonError { message } } }""",
        {"p": {"assetSelection": [{"path": ["source", "purchases"]}], "partitionNames": keys}}
    )["launchPartitionBackfill"]
    assert launched["__typename"] == "LaunchBackfillSuccess", launched
    backfill = launched["backfillId"]
    # its runs, not the backfill's status: the backfill daemon marks it complete on a later iteration (30 s)
    expected = -(-len(keys) // 31)
    done = ("SUCCESS", "FAILURE", "CANCELED")
    try:
        runs = _wait("the backfill's runs", lambda: (lambda rs: rs if len(rs) == expected and all(
            r["status"] in done for r in rs) else None)(dagster_dev.runs(backfill)), timeout=240, every=2,
            progress=dagster_dev.log_size)
    except AssertionError as e:  # say what the backfill did instead
        raise AssertionError(f"{e}; its runs: {[(r['status'], r['tags']) for r in dagster_dev.runs(backfill)]}; "
                             f"log: {dagster_dev.log.read_text()[-3000:]}") from None
    assert [r["status"] for r in runs] == ["SUCCESS"] * expected
    tags = {t["key"]: t["value"] for t in runs[-1]["tags"]}
    assert tags["dagster/asset_partition_range_start"] == keys[0]
    days = sorted(p.stem for p in (tmp_path / "ws" / "sources" / "purchases").glob("*.parquet"))
    assert days == keys and len(keys) == 61 and expected == 2

    # switch the new-data sensor on; once it has ticked (the extracted days count as done), a day lands
    sensor = dagster_dev.sensor_selector("purchases_new_data")
    started = dagster_dev.graphql("""mutation($s: SensorSelector!) { startSensor(sensorSelector: $s) { __typename
                                     ... on PythonError { message } } }""", {"s": sensor})["startSensor"]
    assert started["__typename"] == "Sensor", started
    # a finished tick: one still evaluating can read the day appended below, and on its first tick the sensor
    # counts what is already materialized (every day of the data) as done; the days after hold no rows yet
    _wait("the sensor's first tick", lambda: [t for t in dagster_dev.sensor_ticks(sensor) if t["status"] != "STARTED"],
          timeout=120)
    day, rows = _wait("the warehouse free for writing", lambda: _append_day(tmp_path / "warehouse.duckdb"), timeout=60)
    new_run = _wait("the sensor's run", lambda: next((r for r in dagster_dev.runs() if any(
        t["key"] == "dagster/sensor_name" and t["value"] == "purchases_new_data" for t in r["tags"])
        and r["status"] in done), None), timeout=180, every=2, progress=dagster_dev.log_size)
    assert new_run["status"] == "SUCCESS", dagster_dev.log.read_text()[-3000:]
    assert {t["key"]: t["value"] for t in new_run["tags"]}["dagster/partition"] == day
    assert pq.read_metadata(tmp_path / "ws" / "sources" / "purchases" / f"{day}.parquet").num_rows == rows
    browser.get(f"{dagster_dev.url}/runs/{new_run['runId']}")
    WebDriverWait(browser, 60).until(EC.presence_of_element_located((By.XPATH, "//*[contains(text(), 'Success')]")))
    browser.save_screenshot(str(tmp_path / "sensor_run.png"))

    # two training runs requested at once (the `train` job, its cache step: tagged habitus/kind training): the
    # queue starts one; the other waits, QUEUED, until the first has finished
    first, second = (dagster_dev.launch("train", [["cache"]]) for _ in range(2))
    by_id = lambda: {r["runId"]: r for r in dagster_dev.runs() if r["runId"] in (first, second)}  # noqa: E731
    started = _wait("one training run started", lambda: (lambda rs: rs if any(
        r["status"] not in ("QUEUED", "NOT_STARTED") for r in rs.values()) else None)(by_id()), timeout=120, every=0.3)
    running = [i for i, r in started.items() if r["status"] not in ("QUEUED", "NOT_STARTED")]
    assert len(running) == 1, started
    waiting = second if running == [first] else first
    if started[running[0]]["status"] not in done:  # the other one waits in the queue meanwhile
        assert started[waiting]["status"] == "QUEUED", started
        browser.get(f"{dagster_dev.url}/runs")
        _wait("the queued run in the runs list", lambda: "Queued" in browser.execute_script(
            "return document.body.innerText"), timeout=30, every=0.5)
        browser.save_screenshot(str(tmp_path / "run_queue.png"))
    runs = _wait("both training runs to finish", lambda: (lambda rs: rs if len(rs) == 2 and all(
        r["status"] in done for r in rs.values()) else None)(by_id()), timeout=300, every=1,
        progress=dagster_dev.log_size)
    assert all(r["tags"] and {"key": "habitus/kind", "value": "training"} in r["tags"] for r in runs.values())
    one, other = runs[running[0]], runs[waiting]
    assert other["startTime"] >= one["endTime"], (one, other)  # one after the other, never both at once

    shots = ["asset_graph.png", "realized_plots.png", "materialized.png", "sensor_run.png"] + (
        ["run_queue.png"] if (tmp_path / "run_queue.png").exists() else [])
    for shot in shots:
        assert (tmp_path / shot).stat().st_size > 20_000
    if os.environ.get("HABITUS_UI_SCREENSHOTS"):  # keep them where a person can look
        for shot in shots:
            shutil.copy(tmp_path / shot, Path(os.environ["HABITUS_UI_SCREENSHOTS"]) / shot)
