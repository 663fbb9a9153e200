"""Headless Chromium (Debian's ``chromium`` and ``chromium-driver``) driven by Selenium,
for the chat page's tests. ``make install`` installs both with apt when they are
missing; where apt-get does not exist the tests skip, saying so. Nothing is downloaded:
Selenium is given both binaries and told to stay offline."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import HANG_S, ROOT

ARTIFACTS = ROOT / "test-artifacts"  # screenshots (kept for people to look at, never compared)


def find_chromium() -> tuple[str, str]:
    """The browser and its driver; skips without apt-get, fails if apt could have
    installed them."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser and driver:
        return browser, driver
    if shutil.which("apt-get") is None:
        pytest.skip("chromium and chromium-driver are not installed and apt-get is unavailable")
    pytest.fail(
        "chromium and chromium-driver are missing: `make install` installs them "
        "(apt-get install chromium chromium-driver)"
    )


@contextmanager
def chromium(width: int = 1400, height: int = 900) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    browser, driver = find_chromium()
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not look for downloads
    options = Options()
    options.binary_location = browser
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        f"--window-size={width},{height}",
    ):
        options.add_argument(arg)
    d = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield d
    finally:
        d.quit()


def wait_until(d: Any, condition: Callable[[Any], Any], message: str) -> Any:
    """Until ``condition(driver)`` is truthy; the limit only guards against a hang."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(d, HANG_S, poll_frequency=0.05).until(condition, message)


def screenshot(d: Any, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    d.save_screenshot(str(path))
    return path
