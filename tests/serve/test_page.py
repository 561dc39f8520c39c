"""The playground page in a real headless Chromium (Debian's chromium and chromium-driver,
through selenium): type a prompt, press the button, see streamed text arrive."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers.serve import TIMEOUT

DRIVER = shutil.which("chromedriver")
BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")


def test_the_page_is_served_without_anything_from_elsewhere(http):
    page = http.get("/")
    assert page.status_code == 200 and "txlm playground" in page.text
    script = http.get("/static/playground.js")
    assert script.headers["content-type"].startswith("text/javascript")
    for text in (page.text, script.text, http.get("/static/playground.css").text):
        assert "http://" not in text and "https://" not in text  # nothing fetched from elsewhere
    assert http.get("/static/../config.py").status_code == 404


@pytest.mark.skipif(DRIVER is None or BROWSER is None,
                    reason="no chromium and chromedriver on this machine (apt-get install "
                    "chromium chromium-driver; .ci/run does)")  # fmt: skip
def test_a_prompt_streams_text_into_the_page(server):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=webdriver.ChromeService(DRIVER), options=options)
    try:
        driver.set_page_load_timeout(TIMEOUT)
        driver.get(server.url + "/")
        wait = WebDriverWait(driver, TIMEOUT)
        wait.until(ec.text_to_be_present_in_element((By.ID, "model"), "vocabulary 36"))
        box = driver.find_element(By.ID, "prompt")
        box.send_keys("ROMEO:")
        driver.find_element(By.ID, "seed").send_keys("3")
        driver.find_element(By.ID, "max_tokens").clear()
        driver.find_element(By.ID, "max_tokens").send_keys("12")
        driver.find_element(By.ID, "go").click()
        wait.until(ec.text_to_be_present_in_element((By.ID, "status"), "done"))
        text = driver.find_element(By.ID, "output").text
        assert text.startswith("ROMEO:") and len(text) > len("ROMEO:")
    finally:
        driver.quit()
