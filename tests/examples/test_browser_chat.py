"""examples/browser_chat.py in a real headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by selenium; nothing downloaded): the page loads the model's name,
a question typed in it streams its answer into the page (seen growing over several reads, not
only as the final text), and Stop aborts the request: the page says so, the text stops
growing, and the server counts an aborted request with nothing left running and every KV
block free. The page loads nothing from the network."""

from __future__ import annotations

import html.parser
import itertools
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.examples.running import EXAMPLES, RUN_TIMEOUT, example_command, example_env

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
#: set to 1 (CI sets it) and a missing Chromium or chromedriver fails the test: it must run
REQUIRE_BROWSER = "ACTORLINE_REQUIRE_BROWSER"
#: what lets headless Chromium run here as root, with no network beyond the page's server
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
READY_PREFIX = "chat page on "
QUESTION = "What is the capital of France?"
#: a reply long enough to be stopped mid-way (the tiny model's length is 1024 tokens)
PAGE_OPTIONS = "?max_tokens=900&ignore_eos=true&temperature=0"
#: distinct lengths of the growing answer to see before pressing Stop
GROWTH_READS = 4
WAIT = 60.0
POLL = 0.02

Metrics = dict[tuple[str, frozenset[tuple[str, str]]], float]
ABORTED = ("actorline_requests_finished_total", frozenset({("finish_reason", "abort")}))
RUNNING = ("actorline_requests_running", frozenset[tuple[str, str]]())
KV_USED = ("actorline_kv_blocks_used", frozenset[tuple[str, str]]())


def wait_for(condition: Callable[[], object], what: str, timeout: float = WAIT) -> object:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(POLL)
    return value


def metrics(base: str) -> Metrics:
    with urllib.request.urlopen(base + "metrics", timeout=60) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found += [value or "" for name, value in attrs if name in ("src", "href")]


def test_the_page_loads_nothing_from_the_network() -> None:
    links = _Links()
    links.feed((EXAMPLES / "browser_chat.html").read_text())
    assert links.found == []  # no script, style sheet, font or image from anywhere


@pytest.fixture
def chat_app(tiny_model_dir: Path, tmp_path: Path) -> Iterator[str]:
    """examples/browser_chat.py serving the tiny model on a free port: the page's URL."""
    stderr = (tmp_path / "stderr.txt").open("w")
    process = subprocess.Popen(
        example_command("browser_chat", "--model", str(tiny_model_dir), "--port", "0",
                        "--num-blocks", "128"),
        stdout=subprocess.PIPE, stderr=stderr, text=True, env=example_env(),
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    assert process.stdout is not None
    stdout = process.stdout
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=RUN_TIMEOUT).strip()
        assert line.startswith(READY_PREFIX), (tmp_path / "stderr.txt").read_text()[-3000:]
        yield line.removeprefix(READY_PREFIX)
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT) == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        stderr.close()


def require_browser(chromium: Path, chromedriver: Path) -> None:
    """Skip the test unless ``chromium`` and ``chromedriver`` are there; fail it instead
    when the environment sets :data:`REQUIRE_BROWSER` to 1.

    Raises:
        pytest.skip.Exception: one is missing.
        pytest.fail.Exception: one is missing, and the browser test is required.
    """
    missing = [str(path) for path in (chromium, chromedriver) if not path.exists()]
    if not missing:
        return
    reason = (
        f"needs Debian's chromium and chromium-driver ({', '.join(missing)} missing): "
        "'make test' (its 'browser' target; 'make browser' alone) installs them when run as root"
    )
    if os.environ.get(REQUIRE_BROWSER) == "1":
        pytest.fail(f"{reason}; {REQUIRE_BROWSER}=1 requires the browser test to run")
    pytest.skip(reason)


def test_a_missing_browser_skips_or_fails_as_the_environment_requires(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "chromedriver"
    monkeypatch.delenv(REQUIRE_BROWSER, raising=False)
    with pytest.raises(pytest.skip.Exception, match="'make test'") as skipped:
        require_browser(CHROMIUM if CHROMIUM.exists() else missing, missing)
    assert f"{missing} missing" in str(skipped.value)
    monkeypatch.setenv(REQUIRE_BROWSER, "1")
    with pytest.raises(pytest.fail.Exception, match=f"{REQUIRE_BROWSER}=1 requires") as failed:
        require_browser(missing, missing)
    assert "'make browser'" in str(failed.value)
    require_browser(tmp_path, tmp_path)  # both there: neither


@pytest.fixture
def browser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Headless Chromium under chromedriver, both Debian's (never selenium's downloads)."""
    require_browser(CHROMIUM, CHROMEDRIVER)
    from selenium import webdriver

    # NOTE: with both paths given selenium-manager has nothing to find; offline, it could not
    # download anything either
    monkeypatch.setenv("SE_OFFLINE", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(
        options=options, service=webdriver.ChromeService(executable_path=str(CHROMEDRIVER))
    )
    try:
        yield driver
    finally:
        driver.quit()


@pytest.mark.slow
def test_a_question_streams_its_answer_and_stop_aborts_it(
    chat_app: str, browser: object, tiny_model_dir: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.remote.webdriver import WebDriver

    assert isinstance(browser, WebDriver)
    before = metrics(chat_app)
    browser.get(chat_app + PAGE_OPTIONS)
    model = browser.find_element(By.ID, "model")
    wait_for(lambda: model.text == str(tiny_model_dir), "the page to show the model")

    browser.find_element(By.ID, "prompt").send_keys(QUESTION, Keys.ENTER)
    status = browser.find_element(By.ID, "status")
    stop = browser.find_element(By.ID, "stop")
    user = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".message.user"), "the question")
    assert [bubble.text for bubble in user] == [QUESTION]  # type: ignore[attr-defined]
    reply = browser.find_element(By.CSS_SELECTOR, ".message.assistant")
    seen: list[str] = []
    while len(seen) < GROWTH_READS:  # the answer, read while it streams
        text = wait_for(lambda: (now := reply.text) and now != (seen[-1] if seen else "") and now,
                        "the answer to grow")  # fmt: skip
        assert isinstance(text, str)
        seen.append(text)
    assert status.text == "streaming…" and stop.is_enabled()
    for shorter, longer in itertools.pairwise(seen):
        assert longer.startswith(shorter) and len(longer) > len(shorter)

    stop.click()
    wait_for(lambda: status.text == "stopped", "the page to say the reply stopped")
    assert not stop.is_enabled()
    stopped_at = reply.text
    # the server aborted the request: counted once, nothing running, every KV block free
    wait_for(
        lambda: (now := metrics(chat_app))[ABORTED] == before[ABORTED] + 1
        and now[RUNNING] == 0 and now[KV_USED] == 0,
        "the server to abort the request",
    )  # fmt: skip
    assert reply.text == stopped_at  # nothing arrived after Stop
    assert stopped_at.startswith(seen[-1])
