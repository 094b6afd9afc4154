"""Screenshot every admin page of a running gateway into docs/screenshots/ (PNG).

    PYTHONPATH=. .venv/bin/python admin_ui/scripts/screenshots.py --base-url http://127.0.0.1:8000 \
        --token "$SPARKGATE_ADMIN_TOKEN" --out docs/screenshots

Uses the system Chromium (Debian ``chromium``) through Playwright; never downloads a browser.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from playwright.sync_api import sync_playwright

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--token", default=os.environ.get("SPARKGATE_ADMIN_TOKEN"))
    ap.add_argument("--out", default="docs/screenshots")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=a.chromium, args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000}, locale="en-GB")
        page.goto(a.base_url + "/admin/")
        page.get_by_label("Admin token").wait_for()
        page.screenshot(path=out / "login.png")
        page.get_by_label("Admin token").fill(a.token)
        page.keyboard.press("Enter")
        page.wait_for_selector("[data-chart-name=tokens-per-s][data-chart]")
        page.wait_for_timeout(9000)  # a few live engine samples
        page.screenshot(path=out / "overview.png", full_page=True)
        for route, title in (("users", "Users"), ("acceptance", "Acceptance"), ("tiers", "SLA tiers"),
                             ("tenants", "Tenants & keys")):
            page.goto(f"{a.base_url}/admin/#/{route}")
            page.wait_for_selector(f"h1:text-is('{title}')")
            page.wait_for_load_state("networkidle")
            page.wait_for_timeout(500)
            page.screenshot(path=out / f"{route}.png", full_page=True)
        page.goto(f"{a.base_url}/admin/#/users")
        page.wait_for_selector("h1:text-is('Users')")
        link = page.locator("table.users tbody th a").first
        if link.count():
            link.click()
            page.wait_for_selector("table.requests")
            page.wait_for_timeout(500)
            page.screenshot(path=out / "user.png", full_page=True)
        page.goto(f"{a.base_url}/admin/#/tiers")
        page.wait_for_selector("h1:text-is('SLA tiers')")
        page.locator("table.tiers tbody button").first.click()
        form = page.locator(".editor form.tier-form")
        form.locator("[data-field=rpm] input").fill("0")
        form.locator("button[type=submit]").click()
        form.locator(".message.error").wait_for()
        page.screenshot(path=out / "tier-edit-error.png", full_page=True)
        browser.close()
    print(f"screenshots in {out}/")


if __name__ == "__main__":
    main()
