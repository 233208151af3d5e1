"""The dashboard in a real browser: headless Chromium (Debian's `chromium` and
`chromium-driver`, driven by Selenium) watches a real training job (two gloo ranks on the
session's Ray) while rank 1 is SIGKILLed and healed, on a dashboard with a token (taken from
the URL's fragment, then kept by the tab: its live stream and later pages carry it).

Skips, naming what to install, where Chromium or its driver is missing (`.ci/run` installs
both). With RAYMESH_SCREENSHOTS=<folder>, the pages' screenshots are saved there too
(docs/images/ holds the ones docs/dashboard.md shows).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ..waiting import wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="the browser test needs Debian's chromium and chromium-driver: "
    "apt-get install chromium chromium-driver (.ci/run installs them)",
)

KILL_STEP = 150
TOKEN = "s3cret-t0ken-0123"


@pytest.fixture
def browser():
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,2200")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # The driver from Debian's package: Selenium must not look for (download) one of its own.
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(what: str, check: Any, timeout: float = 60.0) -> Any:
    return wait_for(check, timeout, what=f"the page showing {what}", interval=0.1)


def _screenshot(driver: Any, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    driver.save_screenshot(str(path))
    if folder := os.environ.get("RAYMESH_SCREENSHOTS"):
        Path(folder).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(folder) / name)
    return path


def _errors(driver: Any) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


@pytest.mark.timeout(240)
def test_the_job_page_shows_the_live_curves_a_kill_and_its_healing(fit, tmp_path, browser):
    from PIL import Image

    from raymesh import dashboard, testing, train

    run = tmp_path / "job"
    config = train.TrainConfig(
        build="tests.dashboard.jobs:slow_mlp",
        workers=2,
        spares=1,
        steps=300,
        global_batch_size=16,
        report_every=2,
        run_dir=str(run),
        params={"sleep_s": 0.02},
        faults=(testing.kill(rank=1, at_step=KILL_STEP),),
    )
    result: list[Any] = []
    job = threading.Thread(target=lambda: result.append(fit(None, config)), daemon=True)
    with dashboard.start(tmp_path, port=0, token=TOKEN) as board:
        job.start()
        _wait("the run folder", lambda: (run / "metrics.jsonl").exists(), timeout=120)
        browser.get(board.login_url("/run/job"))
        _wait("its first data", lambda: browser.execute_script("return window.dashboard.ready"))
        assert browser.current_url == board.run_url("job")  # the token left the address bar
        # The curves advance while the job runs: more rows, and more points in the chart.
        first = browser.execute_script("return window.dashboard.rows.length")
        assert browser.find_element("id", "status").text == "running"
        _wait(
            "new rows streamed in",
            lambda: browser.execute_script("return window.dashboard.rows.length") > first + 10,
        )
        _wait("the step advance", lambda: int(browser.find_element("id", "step").text) > first)
        plotted = browser.execute_script(
            "return document.querySelectorAll('#loss-chart canvas').length"
        )
        assert plotted >= 1
        # The kill appears, then how it was healed (the row is drawn again as news comes).
        selector = 'tr.failure[data-rank="1"]'

        def failure_row() -> dict[str, str] | None:
            # Read in one script: the page redraws the row as news comes, so an element
            # found by one WebDriver call may be gone by the next.
            return browser.execute_script(
                "const r = document.querySelector(arguments[0]);"
                "return r ? {text: r.innerText, step: r.dataset.step} : null;",
                selector,
            )

        def failure_text() -> str:
            row = failure_row()
            return row["text"] if row else ""

        _wait("the failure", failure_text)
        assert failure_row()["step"] == str(KILL_STEP)  # type: ignore[index]
        _wait("its recovery", lambda: "healed in" in failure_text())
        text = failure_text()
        assert "died" in text and "SIGKILL" in text and "replace" in text, text
        _wait("the Healing state", lambda: browser.find_elements("css selector", ".state-Healing"))
        _wait("the end", lambda: browser.find_element("id", "status").text == "finished", 120)
        job.join(timeout=60)
        [res] = result
        rows = browser.execute_script("return window.dashboard.rows")
        assert [r["step"] for r in rows] == list(range(1, 301))
        assert rows[-1]["loss"] == pytest.approx(res.history[-1]["loss"])
        time.sleep(0.5)  # the charts' last frame
        shot = _screenshot(browser, tmp_path, "dashboard-job.png")
        # The mesh page: each rank's proc on its host, with the pid the job reported.
        browser.get(board.page("/mesh/job"))
        pids = _wait(
            "the procs",
            lambda: [
                e.get_attribute("data-pid") for e in browser.find_elements("css selector", ".proc")
            ],
        )
        [failure_event] = [e for e in _events(run) if e["event"] == "healed"]
        newest_mesh = [e for e in _events(run) if e["event"] == "mesh"][-1]
        assert {str(p["pid"]) for p in newest_mesh["ranks"]} <= set(pids)
        assert failure_event["replaced_by"] in browser.find_element("tag name", "body").text
        _screenshot(browser, tmp_path, "dashboard-mesh.png")
        # The runs page lists it, finished.
        browser.get(board.url)
        row = _wait(
            "the run", lambda: browser.find_elements("css selector", 'tr.run[data-id="job"]')
        )
        assert "finished" in row[0].text
        row[0].find_element("css selector", "input[type=checkbox]").click()  # compare its curve
        _wait(
            "the compared curve",
            lambda: browser.find_elements("css selector", "#compare-chart canvas"),
        )
        _screenshot(browser, tmp_path, "dashboard-runs.png")
        assert _errors(browser) == []
    with Image.open(shot) as image:
        assert image.format == "PNG" and image.size[0] >= 1000


@pytest.mark.timeout(60)
def test_a_page_without_the_token_asks_for_it_and_a_wrong_one_is_asked_again(tmp_path, browser):
    from selenium.webdriver.common.keys import Keys

    from raymesh import dashboard

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    with dashboard.start(tmp_path, port=0, token=TOKEN) as board:
        browser.get(board.url)
        form = _wait("the token's form", lambda: browser.find_elements("id", "login"))
        assert "needs its token" in form[0].text
        browser.find_element("id", "token-input").send_keys("wrong", Keys.ENTER)
        _wait("it again", lambda: "not accepted" in browser.find_element("id", "login").text)
        browser.find_element("id", "token-input").send_keys(TOKEN, Keys.ENTER)
        _wait("the run", lambda: browser.find_elements("css selector", 'tr.run[data-id="a"]'))
        assert not browser.find_elements("id", "login")
        browser.get(board.run_url("a"))  # the tab keeps it: no form on the next page
        _wait("its data", lambda: browser.execute_script("return window.dashboard.ready"))
        assert TOKEN not in browser.current_url
        browser.get(board.login_url("/mesh/a"))  # from the fragment, out of the address bar
        _wait("its procs' page", lambda: browser.execute_script("return window.dashboard.ready"))
        assert browser.current_url == board.page("/mesh/a")
        assert _errors(browser) == [] or all("401" in e for e in _errors(browser))


@pytest.mark.timeout(60)
def test_a_missing_run_and_a_corrupt_line_are_messages_on_the_page(tmp_path, browser):
    from raymesh import dashboard

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 2.0, "samples_per_s": 1.0, "end": 1.0}\n{"step": 2, "lo\n'
    )
    with dashboard.start(tmp_path, port=0) as board:
        browser.get(board.page("/run/nope"))
        error = _wait("the error", lambda: browser.find_element("id", "error").text)
        assert "no run folder 'nope'" in error
        browser.get(board.run_url("bad"))
        _wait("its data", lambda: browser.execute_script("return window.dashboard.ready"))
        body = browser.find_element("tag name", "body").text
        assert "metrics.jsonl line 2 is not a JSON object" in body
        assert browser.execute_script("return window.dashboard.rows.length") == 1


def _events(run: Path) -> list[dict[str, Any]]:
    import json

    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


XSS = '<img src=x onerror="window.pwned=1">'


def test_an_rl_runs_page_charts_its_reward_and_tokens_per_second(tmp_path, browser):
    import json
    import time

    from raymesh import dashboard

    # What rl.run's learner job writes (a train job's run folder), abridged.
    run = tmp_path / "grpo"
    run.mkdir()
    t = time.time()
    events = [
        {"t": t, "event": "job", "name": "grpo", "steps": 3, "kind": "rl", "algorithm": "GRPO"},
        {"t": t, "event": "state", "state": "Running", "reason": "1 ranks", "step": 0},
        {"t": t, "event": "role", "role": "generators", "count": 2, "pids": [4101, 4102]},
        {"t": t, "event": "role", "role": "reward actors", "count": 4},
        {"t": t, "event": "role", "role": "learner", "count": 1},
        {
            "t": t + 0.5,
            "event": "replaced",
            "role": "generators",
            "index": 1,
            "cause": "SIGKILL",
            "keys": [4, 5],
            "pid": 4103,
        },
        # Another party's lines in the folder: markup and the wrong types, shown as text.
        {"t": t, "event": "role", "role": XSS, "count": {"n": 1}, "pids": [XSS, None]},
        {"t": t + 0.6, "event": "replaced", "role": [XSS], "index": XSS, "pid": "x", "keys": 7,
         "cause": XSS * 50},
        {"t": t + 1, "event": "state", "state": "Finished", "reason": "closed", "step": 3},
        {"t": t + 1, "event": "end", "state": "Finished", "reason": "closed", "step": 3},
    ]  # fmt: skip
    rows = [
        {"step": step, "loss": 0.5 / step, "samples_per_s": 200.0, "end": t + step / 4,
         "world_size": 1, "spares": 0, "reward_mean": 0.25 * step, "staleness_mean": 1.0,
         "samples": 32.0, "tokens": 192.0, "tokens_per_s": 6400.0, "version": float(step)}
        for step in (1, 2, 3)
    ]  # fmt: skip
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with dashboard.start(tmp_path, port=0) as board:
        browser.get(board.run_url("grpo"))
        _wait("its data", lambda: browser.execute_script("return window.dashboard.ready"))
        card = _wait("the reward card", lambda: browser.find_element("id", "reward-card"))
        _wait("the reward chart", lambda: card.is_displayed() and "reward" in card.text)
        throughput = browser.find_element("id", "throughput-chart").text
        assert "tokens/s" in throughput, throughput
        # It leads with the reward (the newest row's), then shows its roles and replacements.
        assert browser.find_element("id", "reward-stat").is_displayed()
        assert browser.find_element("id", "reward").text == "0.750"
        roles = browser.find_element("id", "roles-card")
        _wait("the roles", lambda: roles.is_displayed() and "reward actors" in roles.text)
        rows = [r.text for r in roles.find_elements("css selector", "#roles tbody tr")]
        assert rows[:3] == ["generators 2 4101, 4102 1", "reward actors 4 0", "learner 1 0"]
        assert rows[3] == f'{XSS} {{"n":1}} {XSS}, 0', rows[3]
        replaced, hostile = roles.find_elements("css selector", "#replacements tbody tr")
        assert "SIGKILL" in replaced.text and "4103" in replaced.text, replaced.text
        assert XSS in hostile.text
        assert browser.execute_script("return window.pwned") is None  # no markup ran
        assert "finished" in browser.find_element("tag name", "body").text.lower()
        assert _errors(browser) == []
        _screenshot(browser, tmp_path, "rl-job.png")
