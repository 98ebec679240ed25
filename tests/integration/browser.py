"""A headless Chromium under chromedriver with a fresh profile: the dashboard's browser tests and
bench/bench_dashboard.py start it the same way (Debian's chromium and chromium-driver, installed
by dev/browser.sh; selenium from the dev extra)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-dev-shm-usage",
    "--window-size=1400,1700",
)


def headless_chromium(profile: Path) -> Any | str:
    """The driver, or why there is none (what to install)."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        return "selenium is not installed: bash dev/setup.sh dev"
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        return "chromium or chromedriver is missing: bash dev/browser.sh installs them"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(executable_path=driver))
