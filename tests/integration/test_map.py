"""The web map in a real headless browser (Debian's chromium + chromium-driver, selenium).

A 3-broker federation (event-geofence) with the HTTP bridge on every broker;
the browser opens eu's map. Waiting is on the page's state (the DOM, through
WebDriverWait): areas drawn, the event stream open, an event listed, an
answer shown. The test also takes the screenshot README shows: into its own
temporary folder, or, with GEOFED_UPDATE_SCREENSHOTS=1, over docs/map.png (so
that running the tests leaves the checkout as it was).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import TokenSigner
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

import geofed
from geofed.bench import LocalFederation
from geofed.routing import GeofenceCache

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
THREE = ROOT / "deploy" / "federations" / "three.geojson"
SCREENSHOT = ROOT / "docs" / "map.png"
UPDATE_SCREENSHOTS = os.environ.get("GEOFED_UPDATE_SCREENSHOTS") == "1"
HANG_S = 120.0  # the page has not reached a state by then: hung, not slow
ATLANTIC = [(-80.0, 25.0), (10.0, 25.0), (10.0, 60.0), (-80.0, 60.0)]  # (lon, lat)
PARIS_BOX = [(0.0, 46.0), (5.0, 46.0), (5.0, 51.0), (0.0, 51.0)]


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    workdir = tmp_path_factory.mktemp("map-fed")
    with LocalFederation(THREE, "event-geofence", workdir) as running:
        yield running


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[webdriver.Chrome]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "chromium and chromium-driver are installed by .ci/run"
    options = Options()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1000",
        # The token test's federation serves HTTPS with a CA made for the test.
        "--ignore-certificate-errors",
        # Its profile in the test's folder: chromedriver's own temporary one
        # leaves a folder behind in /tmp when chromium recreates it on exit.
        f"--user-data-dir={tmp_path_factory.mktemp('chromium')}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    chrome.set_page_load_timeout(HANG_S)
    try:
        yield chrome
    finally:
        chrome.quit()


def wait(browser: webdriver.Chrome, script: str, what: str) -> Any:
    """Wait until `script` (a JS expression) is truthy; its value."""
    return WebDriverWait(browser, HANG_S, poll_frequency=0.1).until(
        lambda b: b.execute_script(f"return {script};"), message=f"map never showed {what}"
    )


def draw(browser: webdriver.Chrome, ring: list[tuple[float, float]]) -> None:
    """Draw a polygon as the drawing tool does: a layer on the map and its pm:create event."""
    latlngs = [[lat, lon] for lon, lat in ring]
    browser.execute_script(
        "var m = geofedMap.map; var layer = L.polygon(arguments[0]).addTo(m);"
        " m.fire('pm:create', {layer: layer, shape: 'Polygon'});",
        latlngs,
    )


def wkt(ring: list[tuple[float, float]]) -> str:
    closed = [*ring, ring[0]]
    return "POLYGON((" + ", ".join(f"{lon} {lat}" for lon, lat in closed) + "))"


def test_map_shows_areas_live_events_routes_and_history(
    fed: LocalFederation, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    eu = fed.nodes["eu"].http

    async def publish_over_http(where: str, topic: str, payload: bytes) -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as http,
            http.put(
                f"http://{eu}/geopublish/{topic}", params={"location": where}, data=payload
            ) as resp,
        ):
            assert resp.status == 200, await resp.text()
            answer: dict[str, Any] = await resp.json()
            return answer

    before = asyncio.run(publish_over_http("48.85,2.35", "map/paris/temp", b"19.0"))

    browser.get(f"http://{eu}/")
    wait(browser, "document.querySelectorAll('path.broker-area').length", "the broker areas")
    areas = browser.find_elements(By.CSS_SELECTOR, "path.broker-area")
    assert len(areas) == len(fed.federation) == 3  # one polygon per broker
    for bid in fed.federation.ids:
        assert browser.find_elements(By.CSS_SELECTOR, f"path.broker-area-{bid}")
    wait(browser, "document.getElementById('live-state').dataset.state === 'ready'", "live")

    async def publish_over_grpc(n: int) -> str:
        async with await geofed.connect(
            client_id="map-nyc",
            location=geofed.LatLon(40.71, -74.0),
            federation=str(fed.federation_path),
        ) as client:
            for i in range(n):
                await client.publish("map/nyc/count", str(i).encode())
            return await client.publish("map/nyc/temp", b"23.5")

    after = asyncio.run(publish_over_grpc(30))
    wait(browser, f"document.querySelector('#events li[data-id=\"{after}\"]')", "the event")
    item = browser.find_element(By.CSS_SELECTOR, f'#events li[data-id="{after}"]')
    assert "map/nyc/temp = 23.5 (us)" in item.text
    assert browser.find_elements(By.CSS_SELECTOR, "path.live-event")

    wait(
        browser,
        "document.querySelectorAll('#links tbody tr[data-link]').length === 6"
        " && !document.querySelector('#links td.down')",
        "every link up",
    )

    # The events crossed us -> eu: a later status poll shows a rate on that link.
    wait(
        browser,
        "Array.from(document.querySelectorAll('#links tr[data-link=\"us>eu\"] td'))"
        ".slice(2).some(td => parseFloat(td.textContent) > 0)",
        "a message rate on the link us -> eu",
    )

    cache = GeofenceCache()
    draw(browser, ATLANTIC)
    shown = wait(
        browser,
        "document.getElementById('route-result').dataset.state === 'done'"
        " && document.getElementById('route-result').dataset.brokers",
        "the brokers the geofence reaches",
    )
    expected = sorted(fed.federation.brokers_meeting(cache.get(wkt(ATLANTIC), "geofence")))
    assert shown.split(",") == expected and len(expected) >= 2
    listed = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#route-result li")]
    assert listed == expected
    shot = SCREENSHOT if UPDATE_SCREENSHOTS else tmp_path / SCREENSHOT.name
    assert browser.save_screenshot(str(shot))

    # A publisher's text is shown as text, also in the markers' tooltips (HTML in Leaflet).
    html = '<img class="injected" src="x">'
    hostile = asyncio.run(publish_over_http("52.52,13.40", "map/html", html.encode()))["id"]
    wait(browser, f"document.querySelector('#events li[data-id=\"{hostile}\"]')", "the event")
    browser.execute_script("geofedMap.eventLayer.eachLayer(l => l.openTooltip());")
    tips = browser.find_elements(By.CSS_SELECTOR, ".leaflet-tooltip")
    assert any(html in t.get_attribute("textContent") for t in tips)
    assert browser.find_elements(By.CSS_SELECTOR, "img.injected") == []
    browser.execute_script("geofedMap.eventLayer.eachLayer(l => l.closeTooltip());")

    browser.find_element(By.CSS_SELECTOR, "input[name=mode][value=history]").click()
    draw(browser, PARIS_BOX)
    wait(browser, "document.getElementById('history-result').dataset.state === 'done'", "history")
    ids = [
        e.get_attribute("data-id")
        for e in browser.find_elements(By.CSS_SELECTOR, "#history-result li")
    ]
    assert ids == [before["id"]]  # the Paris event, not New York's

    # A time range that starts after it: nothing.
    browser.execute_script(
        "var d = new Date(arguments[0] * 1000), p = n => String(n).padStart(2, '0');"
        " document.getElementById('from').value = d.getFullYear() + '-' + p(d.getMonth() + 1)"
        " + '-' + p(d.getDate()) + 'T' + p(d.getHours()) + ':' + p(d.getMinutes()) + ':'"
        " + p(d.getSeconds());"
        " document.getElementById('history-result').dataset.state = 'asking';",
        before["time"] + 1,
    )
    draw(browser, PARIS_BOX)
    wait(browser, "document.getElementById('history-result').dataset.state === 'done'", "history")
    assert browser.find_elements(By.CSS_SELECTOR, "#history-result li") == []

    assert browser.find_elements(By.CSS_SELECTOR, "path.world")  # the bundled outline
    assert browser.execute_script("return geofedMap.errors;") == []
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == []


def test_the_map_sends_the_token_of_its_url_fragment_with_every_request(
    browser: webdriver.Chrome, tmp_path: Path, token_signer: TokenSigner
) -> None:
    """client_auth token: opened as ``/#access_token=<JWT>`` the map streams live events
    (the token goes as the access_token parameter, the one way EventSource can carry it);
    opened without it, the page loads but the broker refuses its event stream."""
    env = {"GEOFED_TOKEN_KEY": str(token_signer.public)}
    with LocalFederation(
        THREE, "event-geofence", tmp_path / "fed", tls=True, client_auth="token", extra_env=env
    ) as sec:
        eu = sec.nodes["eu"].http
        tls = sec.client_tls()
        assert tls is not None and tls.ca_file

        browser.get(f"https://{eu}/")
        wait(browser, "document.querySelectorAll('path.broker-area').length", "the broker areas")
        wait(
            browser,
            "document.getElementById('live-state').dataset.state === 'reconnecting'",
            "the refused event stream",
        )
        assert browser.execute_script("return geofedMap.live;") is False

        browser.get("about:blank")  # a new document: a changed fragment alone would not load it
        browser.get(f"https://{eu}/#access_token={token_signer.token('dave')}")
        wait(browser, "document.getElementById('live-state').dataset.state === 'ready'", "live")

        async def publish() -> str:
            ctx = ssl.create_default_context(cafile=tls.ca_file)
            bearer = {"Authorization": f"Bearer {token_signer.token('erin')}"}
            async with (
                aiohttp.ClientSession() as http,
                http.put(
                    f"https://{eu}/geopublish/map/token",
                    params={"location": "48.85,2.35"},
                    data=b"sealed",
                    headers=bearer,
                    ssl=ctx,
                ) as resp,
            ):
                assert resp.status == 200, await resp.text()
                answer: dict[str, Any] = await resp.json()
                return str(answer["id"])

        event_id = asyncio.run(publish())
        wait(browser, f"document.querySelector('#events li[data-id=\"{event_id}\"]')", "it")
        assert browser.execute_script("return geofedMap.errors;") == []
