"""Headless Chromium for the web page's tests, driven by Selenium through the system's own driver, kept on this
machine: Selenium's driver manager (which downloads drivers and sends usage statistics) never runs, and Chromium
resolves no host name but the loopback addresses, so a page that tried to load anything from elsewhere would fail."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest

INSTALL = "apt-get install -y chromium chromium-driver && pip install selenium"


def chromium(width: int = 1100, height: int = 1450) -> Any:
    """A headless Chromium WebDriver, or a skip that says how to install what is missing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip(f"selenium is not installed: {INSTALL}")
    driver = shutil.which("chromedriver")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if driver is None or browser is None:
        pytest.skip(f"Chromium or its driver is not installed: {INSTALL}")
    os.environ["SE_AVOID_STATS"] = "true"  # Selenium sends usage statistics to an outside host unless told not to
    os.environ["SE_OFFLINE"] = "true"  # and its driver manager may download; the driver's path is given anyway
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in (
        "--headless=new",
        "--no-sandbox",  # root in a container has no user namespace for Chromium's sandbox
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-default-apps",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1",  # nothing else resolves
    ):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)
