"""A small web site for the browser tests, served from the outside world's namespace
(:func:`tests.support.outside.outside_world` ``site=``).

- ``/`` a login form: an API key field (``#key``), a name field (``#name``) and a button (``#go``); the
  page's script posts the name to ``/api/login`` with ``Authorization: Bearer <key>`` and shows the answer
  in ``#result``. The agent types the session's *placeholder*; the egress broker swaps in the real secret,
  so the site answers ``welcome <name>`` only when the real value arrived (and never echoes it).
- ``/report.csv`` a download (``Content-Disposition: attachment``) of :data:`REPORT`, linked from ``/``
  as ``#report``.
- ``/big`` a page with a large button (``#big``) that turns the whole page black when clicked, and a text
  field (``#field``) at the top left: pixels a screenshot can compare. The page counts the button's clicks:
  ``window.clicks`` lists each one's ``clientX`` (read over CDP), so a test can tell which click landed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import h11

__all__ = ["BIG_PAGE", "LOGIN_PAGE", "REPORT", "site_handler"]

REPORT = b"month,orders\n2026-11,42\n"

LOGIN_PAGE = """<!doctype html><html><head><title>capsa shop</title></head><body>
<h1>Sign in</h1>
<input id="key" placeholder="api key"> <input id="name" placeholder="name">
<button id="go" onclick="go()">Sign in</button>
<p id="result">not signed in</p>
<a id="report" href="/report.csv">monthly report</a>
<script>
async function go() {
  const key = document.getElementById("key").value;
  const r = await fetch("/api/login", {method: "POST", headers: {"Authorization": "Bearer " + key},
                                       body: document.getElementById("name").value});
  document.getElementById("result").textContent = r.status + " " + await r.text();
}
</script></body></html>"""

BIG_PAGE = """<!doctype html><html><head><title>big</title><style>
body { margin: 0; background: white; }
#field { position: absolute; left: 10px; top: 10px; width: 400px; height: 60px; font-size: 40px; }
#big { position: absolute; left: 100px; top: 200px; width: 600px; height: 300px; font-size: 40px; }
body.done { background: black; }
</style></head><body>
<input id="field" autocomplete="off">
<button id="big" onclick="pressed(event)">press</button>
<script>
window.clicks = [];
function pressed(event) { window.clicks.push(Math.round(event.clientX)); document.body.className = "done"; }
</script>
</body></html>"""


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def site_handler(secret: str) -> Handler:
    """The site's stream handler; ``/api/login`` accepts exactly ``Bearer <secret>``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await reader.read(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                    continue
                if not isinstance(event, h11.Request):
                    return
                body = b""
                while True:
                    ev = conn.next_event()
                    if ev is h11.NEED_DATA:
                        conn.receive_data(await reader.read(65536))
                    elif isinstance(ev, h11.Data):
                        body += ev.data
                    elif isinstance(ev, h11.EndOfMessage):
                        break
                headers = {k.decode().lower(): v.decode() for k, v in event.headers}
                path = event.target.decode().split("?")[0]
                kind = "text/plain"
                if path == "/":
                    status, text, kind = 200, LOGIN_PAGE, "text/html"
                elif path == "/big":
                    status, text, kind = 200, BIG_PAGE, "text/html"
                elif path == "/report.csv":
                    status, text, kind = 200, REPORT.decode(), "text/csv"
                elif path == "/api/login" and event.method == b"POST":
                    if headers.get("authorization") == f"Bearer {secret}":
                        status, text = 200, "welcome " + body.decode(errors="replace")
                    else:
                        status, text = 401, "denied"
                else:
                    status, text = 404, "not found"
                payload = text.encode()
                extra = [("Content-Disposition", 'attachment; filename="report.csv"')] * (kind == "text/csv")
                writer.write(conn.send(h11.Response(status_code=status, headers=[
                    ("Content-Type", f"{kind}; charset=utf-8"), ("Content-Length", str(len(payload))),
                    ("Cache-Control", "no-store"), *extra])))
                writer.write(conn.send(h11.Data(data=payload)))
                writer.write(conn.send(h11.EndOfMessage()))
                await writer.drain()
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (h11.ProtocolError, ConnectionError, OSError):
            return
        finally:
            writer.close()

    return handle
