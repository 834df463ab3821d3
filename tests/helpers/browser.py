"""A real headless Chromium (Debian's `chromium`) opening a page as a person would, offline.

`open_page` loads a file with every proxy pointed at a closed port (no request can succeed),
records the net log, the console and the DOM after the page's scripts have run, and takes a
screenshot. `page_requests` lists the requests the page itself made (the browser's own
background traffic has no origin and is left out).
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--hide-scrollbars",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--proxy-server=127.0.0.1:9",
    "--enable-logging=stderr",
    "--v=0",
    "--virtual-time-budget=30000",
]


@dataclass
class PageVisit:
    dom: str
    console: list[str]
    requests: list[str]
    screenshot: Path


def _run(args: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, *FLAGS, *args], capture_output=True, text=True, timeout=timeout)


def page_requests(netlog: Path) -> list[str]:
    """URLs the page requested (initiator: the page's origin, `null` for a file), not the browser's own."""
    try:
        events = json.loads(netlog.read_text()).get("events", [])
    except json.JSONDecodeError:  # chromium may leave the closing bracket out when killed
        text = netlog.read_text().rstrip().rstrip(",")
        events = json.loads(text + "]}").get("events", [])
    urls = []
    for e in events:
        p = e.get("params") or {}
        if "url" in p and "initiator" in p and p["initiator"] != "not an origin":
            urls.append(p["url"])
    return sorted(set(urls))


def open_page(
    page: Path, workdir: Path, *, width: int = 1400, height: int = 2400, shot_name: str = "page.png"
) -> PageVisit:
    workdir.mkdir(parents=True, exist_ok=True)
    path, _, anchor = str(page).partition("#")
    url = Path(path).resolve().as_uri() + (f"#{anchor}" if anchor else "")
    netlog = workdir / "netlog.json"
    dom = _run([f"--log-net-log={netlog}", "--dump-dom", url])
    console = [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]
    shot = workdir / shot_name
    _run([f"--window-size={width},{height}", f"--screenshot={shot}", url])
    return PageVisit(dom.stdout, console, page_requests(netlog), shot)


def distinct_colours(png: Path) -> int:
    import numpy as np
    from PIL import Image

    with Image.open(png) as im:
        pixels = np.asarray(im.convert("RGB").resize((200, 200))).reshape(-1, 3)
    return len(np.unique(pixels, axis=0))


def section_shots(
    page: Path, workdir: Path, sections: dict[str, str], *, width: int = 1400, height: int = 1500
) -> dict[str, Path]:
    """Screenshots of parts of a page: {name: section id} -> {name: PNG}, each `height` pixels from the
    section's top (offsets from the page's own `data-sections`, after its figures are drawn)."""
    from PIL import Image

    workdir.mkdir(parents=True, exist_ok=True)
    dom = _run([f"--window-size={width},{height}", "--dump-dom", page.resolve().as_uri()]).stdout  # same layout
    body = re.search(r"<body[^>]*>", dom).group(0)
    tops = json.loads(html.unescape(re.search(r'data-sections="([^"]*)"', body).group(1)))
    total = int(re.search(r'data-height="(\d+)"', body).group(1))
    full = workdir / "full.png"
    _run([f"--window-size={width},{total}", f"--screenshot={full}", page.resolve().as_uri()])
    out = {}
    with Image.open(full) as im:
        for name, sid in sections.items():
            top = tops[sid]
            out[name] = workdir / name
            im.crop((0, top, width, min(total, top + height))).save(out[name])
    return out


def external_urls(text: str) -> list[str]:
    """http(s) addresses in a page, XML namespace names (not fetched by anything) left out."""
    urls = re.findall(r"https?://[^\s\"'<>)\\]+", text)
    return sorted({u for u in urls if not u.startswith(("http://www.w3.org/", "https://www.w3.org/"))})


def cell_point(page, canvas: str, i: int, j: int) -> tuple[float, float]:
    """The window coordinates of the centre of cell (row i, column j) of a heatmap canvas, scrolled into view
    (34 and 18 px: the canvas's row and column label margins, headgrid.js's LABEL_W and TOP_H)."""
    return page.evaluate(
        """([sel, i, j]) => {
      const c = document.querySelector(sel), cw = +c.dataset.cellWidth, ch = +c.dataset.cellHeight;
      window.scrollBy(0, c.getBoundingClientRect().top + 18 + ch * (i + 0.5) - innerHeight / 2);
      const r = c.getBoundingClientRect();
      return [r.left + 34 + cw * (j + 0.5), r.top + 18 + ch * (i + 0.5)];
    }""",
        [canvas, i, j],
    )
