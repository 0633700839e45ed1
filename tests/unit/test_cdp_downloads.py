"""The CDP endpoint keeps a client's downloads in the session's download directory."""

from __future__ import annotations

import json

from capsa.control.browser.cdp import DOWNLOADS_DIR, pin_downloads


def test_download_path_is_pinned_and_names_kept() -> None:
    sent = json.dumps({"id": 7, "sessionId": "S", "method": "Browser.setDownloadBehavior",
                       "params": {"behavior": "allowAndName", "browserContextId": "C",
                                  "downloadPath": "/tmp/playwright-artifacts-x", "eventsEnabled": True}})
    out = json.loads(pin_downloads(sent))
    assert out == {"id": 7, "sessionId": "S", "method": "Browser.setDownloadBehavior",
                   "params": {"behavior": "allow", "browserContextId": "C", "downloadPath": DOWNLOADS_DIR,
                              "eventsEnabled": True}}
    page = json.loads(pin_downloads(json.dumps({"id": 1, "method": "Page.setDownloadBehavior",
                                                "params": {"behavior": "allow", "downloadPath": "/etc"}})))
    assert page["params"] == {"behavior": "allow", "downloadPath": DOWNLOADS_DIR}


def test_other_messages_pass_unchanged() -> None:
    deny = json.dumps({"id": 2, "method": "Browser.setDownloadBehavior", "params": {"behavior": "deny"}})
    for message in (deny, '{"id": 3, "method": "Page.navigate", "params": {"url": "https://a.test/"}}',
                    '["setDownloadBehavior"]',
                    '{"method": "Runtime.evaluate", "params": {"expression": "setDownloadBehavior"}}'):
        assert pin_downloads(message) == message
