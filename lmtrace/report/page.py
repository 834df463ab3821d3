"""One self-contained HTML page: styles, the vendored plotly.js, the figures and their numbers inline.

Nothing on the page is fetched: no CDN, no web font (the system's sans-serif and monospace), no
image. The numbers live in one `<script type="application/json" id="lmtrace-blobs">` element and
the figures in `lmtrace-figures`, so a script (or a test) can read them back from the page.
The page's script records every JavaScript error in `document.body.dataset.errors` and sets
`data-rendered` to the number of figures drawn once it has finished (with `data-sections`, each
section's offset from the top, and `data-height`, for scripts that screenshot part of a page).
"""

from __future__ import annotations

import json
from importlib import resources

from ..viewdata.page_code import token_view_css, token_view_js
from .blobs import Blobs
from .sections import Section, esc

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; margin: 0;
       color: #222; background: #fafafa; }
header { background: #1f3a5f; color: white; padding: 14px 24px; }
header h1 { margin: 0; font-size: 20px; } header p { margin: 4px 0 0; opacity: .85; font-size: 13px; }
nav { padding: 8px 24px; background: #e8eef5; font-size: 13px; position: sticky; top: 0; z-index: 10; }
nav a { margin-right: 14px; color: #1f3a5f; }
main { padding: 8px 24px 40px; }
section { background: white; border: 1px solid #ddd; border-radius: 6px; padding: 10px 16px; margin: 14px 0; }
section h2 { font-size: 17px; margin: 6px 0 10px; } h3 { font-size: 14px; margin: 14px 0 6px; }
h3 small { font-weight: normal; color: #666; }
.note { color: #555; font-size: 13px; margin: 4px 0; } .note::before { content: "note: "; color: #1f77b4; font-weight: 600; }
.banner { background: #fff3cd; border: 1px solid #e0c060; padding: 8px 12px; border-radius: 4px; margin: 10px 0; }
.strip { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 13px; line-height: 1.9;
         white-space: pre-wrap; word-break: break-word; }
.ptok { color: #888; } .tok { border-radius: 3px; padding: 1px 0; cursor: default; }
.tok:hover { outline: 2px solid #1f3a5f; }
.tokinfo { background: #f4f4f4; border: 1px solid #ddd; padding: 6px 10px; font-size: 12px; min-height: 5.5em;
           white-space: pre-wrap; position: sticky; bottom: 0; }
.legend { font-size: 13px; color: #444; }
table.kv th { text-align: left; padding-right: 16px; color: #555; font-weight: normal; vertical-align: top; }
table.kv td, table.grid td, table.grid th { font-size: 13px; padding: 2px 8px; }
table.grid { border-collapse: collapse; } table.grid td, table.grid th { border: 1px solid #ddd; }
.fig { overflow-x: auto; margin: 8px 0 18px; } .fig select { margin: 4px 0; font-size: 13px; }
pre { font-size: 12px; background: #f6f6f6; padding: 6px; overflow-x: auto; }
"""

# the report's own rules that the token view should not take
TOKEN_VIEW_CSS = """
.tokenview .note::before { content: none; }
.tokenview .tok:hover { outline: none; }
.tokenview .tok.gen:hover { outline: 1px solid #1f3a5f; }
.tokenview h2 { font-size: 15px; margin: 4px 0 8px; }
"""

SCRIPT = r"""
(function () {
  const errors = [];
  window.addEventListener("error", e => { errors.push(String(e.message)); document.body.dataset.errors = JSON.stringify(errors); });
  const BLOBS = JSON.parse(document.getElementById("lmtrace-blobs").textContent);
  const FIGS = JSON.parse(document.getElementById("lmtrace-figures").textContent);
  const cache = {};
  function half(h) {
    const s = (h & 0x8000) ? -1 : 1, e = (h >> 10) & 0x1f, f = h & 0x3ff;
    if (e === 0) return s * Math.pow(2, -14) * (f / 1024);
    if (e === 31) return f ? NaN : s * Infinity;
    return s * Math.pow(2, e - 15) * (1 + f / 1024);
  }
  function decode(name) {
    if (name in cache) return cache[name];
    const b = BLOBS[name];
    let flat;
    if (b.kind === "text") flat = b.values;
    else {
      const bin = atob(b.b64), bytes = new Uint8Array(bin.length);
      for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
      const view = new DataView(bytes.buffer), n = b.kind === "f2" ? bytes.length / 2 : bytes.length / 4;
      flat = new Array(n);
      for (let i = 0; i < n; i++) {
        const v = b.kind === "f2" ? half(view.getUint16(2 * i, true))
                : b.kind === "f4" ? view.getFloat32(4 * i, true) : view.getInt32(4 * i, true);
        flat[i] = Number.isNaN(v) ? null : v;
      }
    }
    let out = flat;
    if (b.shape.length === 2) {
      const [r, c] = b.shape; out = new Array(r);
      for (let i = 0; i < r; i++) out[i] = flat.slice(i * c, (i + 1) * c);
    }
    return (cache[name] = out);
  }
  function resolve(o) {
    if (Array.isArray(o)) return o.map(resolve);
    if (o && typeof o === "object") {
      const keys = Object.keys(o);
      if (keys.length === 1 && keys[0] === "$blob") return decode(o.$blob);
      const r = {}; for (const k of keys) r[k] = resolve(o[k]); return r;
    }
    return o;
  }
  window.lmtraceBlob = decode;
  const config = {displaylogo: false, responsive: true, showLink: false, showEditInChartStudio: false,
                  toImageButtonOptions: {format: "png", scale: 2}};
  function draw(fig, variant) {
    const data = resolve(fig.data), layout = resolve(fig.layout);
    if (variant) {
      for (const [k, v] of Object.entries(variant)) if (k !== "label" && k !== "height") data[0][k] = resolve(v);
      if (variant.height) layout.height = variant.height;
    }
    return Plotly.react(fig.id, data, layout, config);
  }
  async function render() {
    let drawn = 0;
    for (const fig of FIGS) {
      const div = document.getElementById(fig.id);
      if (!div) continue;
      if (fig.variants && fig.variants.length > 1) {
        const sel = document.getElementById(fig.id + "-variant");
        sel.addEventListener("change", () => draw(fig, fig.variants[sel.selectedIndex]));
      }
      try { await draw(fig, fig.variants && fig.variants.length ? fig.variants[0] : null); drawn++; }
      catch (e) { errors.push(String(e)); document.body.dataset.errors = JSON.stringify(errors); }
    }
    // where each section starts, for scripts that screenshot a part of the page (tests/test_report.py)
    const tops = {};
    document.querySelectorAll("section[id]").forEach(s => { tops[s.id] = Math.round(s.getBoundingClientRect().top + window.scrollY); });
    document.body.dataset.sections = JSON.stringify(tops);
    document.body.dataset.height = String(document.documentElement.scrollHeight);
    document.body.dataset.renderMs = String(Math.round(performance.now()));  // since navigation start
    document.body.dataset.rendered = String(drawn);
  }
  const info = document.getElementById("tokinfo");
  document.querySelectorAll(".tok[title]").forEach(t => t.addEventListener("mouseenter", () => {
    if (info) info.textContent = t.getAttribute("title");
  }));
  render();
})();
"""


def plotly_js() -> str:
    return resources.files("lmtrace.report").joinpath("vendor/plotly-cartesian.min.js").read_text(encoding="utf-8")


def token_view_code() -> tuple[str, str]:
    """(style, script) of the token view: `lmtrace serve`'s own tokenview.css / tokenview.js (read through
    viewdata/page_code.py, the colour scale written in), and the report's data source that reads the answers the page inlined (inlined_source.js)."""
    css = token_view_css() + TOKEN_VIEW_CSS
    js = (
        token_view_js()
        + "\n"
        + resources.files("lmtrace.report").joinpath("inlined_source.js").read_text(encoding="utf-8")
    )
    return css, js


def figure_html(fig: dict) -> str:
    select = ""
    if len(fig.get("variants") or []) > 1:
        opts = "".join(f"<option>{esc(v['label'])}</option>" for v in fig["variants"])
        select = f"<label>view: <select id='{esc(fig['id'])}-variant'>{opts}</select></label>"
    # the figure's height is reserved before Plotly draws it, so the page does not jump (and #anchors hold)
    height = int(fig["layout"].get("height", 300))
    return f"<div class='fig'>{select}<div id='{esc(fig['id'])}' style='min-height:{height}px'></div></div>"


def section_html(sec: Section) -> str:
    notes = "".join(f"<p class='note'>{esc(n)}</p>" for n in sec.notes)
    figs = "".join(figure_html(f) for f in sec.figures)
    return f"<section id='sec-{esc(sec.id)}'><h2>{esc(sec.title)}</h2>{notes}{sec.html}{figs}</section>"


def render_page(
    title: str, subtitle: str, sections: list[Section], blobs: Blobs, *, banner: str = "", notes: list[str] = ()
) -> str:
    figures = [f for s in sections for f in s.figures]
    nav = "".join(f"<a href='#sec-{esc(s.id)}'>{esc(s.title)}</a>" for s in sections)
    top_notes = "".join(f"<p class='note'>{esc(n)}</p>" for n in notes)
    figs_json = json.dumps(figures, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    view_css, view_js = token_view_code()
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>{esc(title)}</title><style>{CSS}{view_css}</style></head><body>"
        f"<header><h1>{esc(title)}</h1><p>{esc(subtitle)}</p></header><nav>{nav}</nav><main>{banner}{top_notes}"
        + "".join(section_html(s) for s in sections)
        + "</main>"
        f"<script type='application/json' id='lmtrace-blobs'>{blobs.to_json()}</script>"
        f"<script type='application/json' id='lmtrace-figures'>{figs_json}</script>"
        f"<script>{plotly_js()}</script><script>{SCRIPT}</script><script>{view_js}</script></body></html>"
    )
