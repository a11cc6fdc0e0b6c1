"""The dashboard's static files: package data (static/), read once, served as they are.

They hold no data and no secret (the same bytes for every installation), so they are public like
/health: a browser cannot send an Authorization header when it opens a URL, and the page must load
to ask for the API key. Everything the page shows comes from /dashboard/state and the chat route,
which need the key like every other route (http_guards.py).
"""

from __future__ import annotations

import functools
from importlib import resources

# URL path -> (file in static/, Content-Type)
ASSETS: dict[str, tuple[str, str]] = {
    "/dashboard": ("index.html", "text/html; charset=utf-8"),
    "/dashboard/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/dashboard/charts.js": ("charts.js", "text/javascript; charset=utf-8"),
    "/dashboard/app.css": ("app.css", "text/css; charset=utf-8"),
}
PUBLIC_ASSET_PATHS = tuple(ASSETS)

# The page loads only its own files and talks only to this server; nothing inline runs, and no
# other site may frame it (the API key is typed into it).
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@functools.cache
def read_asset(name: str) -> bytes:
    return (resources.files(__package__) / "static" / name).read_bytes()
