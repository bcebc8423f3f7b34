"""Headless Chromium through selenium (Debian's `chromium` and `chromium-driver`, installed by infra/setup.sh), and
a reader for the MLflow UI's Models tab."""

from __future__ import annotations

import contextlib
import html
import json
import shutil
import time
from collections.abc import Iterator

BROWSER_PATHS = ("chromium", "chromedriver")


@contextlib.contextmanager
def chromium(width: int = 2200, height: int = 1000) -> Iterator:
    """A headless Chromium, closed on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options

    missing = [name for name in BROWSER_PATHS if shutil.which(name) is None]
    if missing:
        raise RuntimeError(
            f"{', '.join(missing)} not found: install Debian's chromium and chromium-driver (infra/setup.sh does, "
            "as root), or put them on PATH"
        )
    options = Options()
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}"):
        options.add_argument(argument)
    options.binary_location = shutil.which("chromium")
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(shutil.which("chromedriver")))
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver, condition, timeout: float = 60, what: str = "the page"):
    """`condition(driver)` once it is truthy; an error naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if value := condition(driver):
                return value
        time.sleep(0.5)
    raise AssertionError(f"{what} did not appear within {timeout:.0f} s at {driver.current_url}")


def close_assistant(driver) -> None:
    """Close MLflow's assistant side panel (it opens on a first visit and takes a third of the width)."""
    from selenium.webdriver.common.by import By

    for button in driver.find_elements(By.CSS_SELECTOR, "button[aria-label='Close']"):
        with contextlib.suppress(Exception):
            button.click()


def read_grid(driver) -> tuple[dict[str, str], dict[int, dict[str, str]]]:
    """The table on screen (an ag-grid, as the Models and Runs tabs draw theirs): header text by column id, and
    every row's cell text by column id. The grid draws only the columns in view, so this scrolls it sideways
    from the left edge to the right one, reading as it goes."""
    from selenium.webdriver.common.by import By

    scroller = driver.find_element(By.CSS_SELECTOR, ".ag-body-horizontal-scroll-viewport")
    headers: dict[str, str] = {}
    rows: dict[int, dict[str, str]] = {}
    position, last = 0, -1
    driver.execute_script("arguments[0].scrollLeft = 0", scroller)
    while position != last:
        time.sleep(0.5)
        for cell in driver.find_elements(By.CSS_SELECTOR, ".ag-header-cell[col-id]"):
            headers[cell.get_attribute("col-id")] = cell.text.strip()
        for row in driver.find_elements(By.CSS_SELECTOR, "[role=row][row-index]"):
            cells = rows.setdefault(int(row.get_attribute("row-index")), {})
            for cell in row.find_elements(By.CSS_SELECTOR, "[col-id]"):
                cells[cell.get_attribute("col-id")] = cell.text.strip()
        last = position
        driver.execute_script("arguments[0].scrollLeft += arguments[0].clientWidth * 0.8", scroller)
        position = driver.execute_script("return arguments[0].scrollLeft", scroller)
    return headers, rows


def models_table(driver) -> dict[str, dict[str, str]]:
    """The Models tab as {model name: {column: cell text}}, a metric's column named by its key."""
    _, rows = read_grid(driver)
    table = {}
    for cells in rows.values():
        named = {_column_name(column): text for column, text in cells.items()}
        if named.get("name"):
            table[named["name"].splitlines()[-1]] = named  # the text after the row's colour chip
    return table


def _column_name(column_id: str) -> str:
    """A metric column's id holds its key as (HTML-escaped) JSON: metrics.{"metricKey": ..., "datasetName": ...}."""
    if not column_id.startswith("metrics.{"):
        return column_id
    return json.loads(html.unescape(html.unescape(column_id.removeprefix("metrics."))))["metricKey"]
