// lmtrace's heatmap, legends and exports, used by the token view (tokenview.js) in `lmtrace serve` and
// `lmtrace report`:
//   heatmap(opts)      a rows × columns grid drawn on a <canvas> that fits its box (a 64 × 64 model's
//                      layers × heads included), with a hover card, a keyboard cursor and clicks;
//   legend(...)        a colour scale's legend (a gradient with its end and middle values);
//   exportBar(...)     PNG and CSV buttons for a panel: the CSV from the panel's own numbers, the PNG
//                      a drawing of the panel as shown (its canvases, boxes and texts).
// Texts from a run are drawn on the canvas or set with textContent, never inserted as markup.
"use strict";

window.lmtraceGrid = (() => {
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === undefined || v === null) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else if (k === "data") Object.assign(node.dataset, v);
      else if (k === "style") Object.assign(node.style, v);
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v);
    }
    for (const c of children) if (c !== null && c !== undefined && c !== false) node.append(c);
    return node;
  }

  // ---- the heatmap ---------------------------------------------------------------------------------
  // opts: rows, cols (labels), value(i, j) -> number | null, colour(v) -> css colour,
  //   card(i, j) -> [[name, value], ...] (the hover card's lines), mark(i, j) -> css colour | null (a
  //   corner mark, e.g. a head's label), inert(i) -> true for a row that cannot be picked (drawn hatched),
  //   onPick(i, j), onMove(i, j) (the cursor moved), cursor [i, j] | null, picked: [[i, j], ...],
  //   numbers(v) -> text drawn in a cell where cells are large enough, id, label (aria-label).
  // Returns { node, canvas, move(di, dj), pick(), setCursor(i, j), redraw(), cellAt(x, y) }.
  const LABEL_W = 34, TOP_H = 18, MAX_CELL = 44, MIN_CELL = 4;
  function heatmap(opts) {
    const nr = opts.rows.length, nc = opts.cols.length;
    const canvas = el("canvas", { class: "heatmap", id: opts.id || null, tabindex: "0", role: "img",
      "aria-label": opts.label || "heatmap", data: { rows: nr, cols: nc } });
    const card = el("div", { class: "hovercard", role: "tooltip", hidden: "" });
    const node = el("div", { class: "heatmap-box" }, canvas, card);
    const state = { cursor: opts.cursor || null, cw: 20, ch: 18, width: 0 };
    canvas.dataset.cursor = state.cursor ? state.cursor.join(",") : "";

    function layout() {
      const avail = Math.max(120, node.clientWidth || (node.parentElement && node.parentElement.clientWidth) || 600);
      const cw = Math.max(MIN_CELL, Math.min(MAX_CELL, Math.floor((avail - LABEL_W - 2) / nc)));
      state.cw = cw;
      state.ch = Math.max(MIN_CELL, Math.min(22, cw));
      state.width = LABEL_W + cw * nc;
      state.height = TOP_H + state.ch * nr;
    }
    function draw() {
      layout();
      const dpr = window.devicePixelRatio || 1;
      canvas.width = Math.round(state.width * dpr);
      canvas.height = Math.round(state.height * dpr);
      canvas.style.width = `${state.width}px`;
      canvas.style.height = `${state.height}px`;
      canvas.dataset.cellWidth = String(state.cw);
      canvas.dataset.cellHeight = String(state.ch);
      const g = canvas.getContext("2d");
      g.setTransform(dpr, 0, 0, dpr, 0, 0);
      g.clearRect(0, 0, state.width, state.height);
      g.font = "10px system-ui, sans-serif";
      g.textBaseline = "middle";
      g.fillStyle = "#424a53";
      // labels: every row's when they fit, else every n-th (the card always names the cell)
      const widest = Math.max(...opts.cols.map((t) => g.measureText(t).width));
      const rowEvery = Math.ceil(11 / state.ch), colEvery = Math.ceil((widest + 5) / state.cw);
      g.textAlign = "right";
      for (let i = 0; i < nr; i += rowEvery) g.fillText(opts.rows[i], LABEL_W - 4, TOP_H + state.ch * (i + 0.5));
      g.textAlign = "center";
      for (let j = 0; j < nc; j += colEvery) g.fillText(opts.cols[j], LABEL_W + state.cw * (j + 0.5), TOP_H / 2);
      const gap = state.cw >= 10 ? 1 : 0;
      const showNumbers = opts.numbers && state.cw >= 30 && state.ch >= 14;
      for (let i = 0; i < nr; i++) {
        for (let j = 0; j < nc; j++) {
          const x = LABEL_W + state.cw * j, y = TOP_H + state.ch * i, v = opts.value(i, j);
          g.fillStyle = v === null || v === undefined ? "#eaeef2" : opts.colour(v);
          g.fillRect(x, y, state.cw - gap, state.ch - gap);
          if (showNumbers && v !== null && v !== undefined) {
            const t = opts.numbers(v);
            g.fillStyle = opts.textColour ? opts.textColour(v) : "#1b1f24";
            g.fillText(t, x + state.cw / 2, y + state.ch / 2);
          }
          const mark = opts.mark ? opts.mark(i, j) : null;
          if (mark) {
            const s = Math.max(3, Math.min(9, Math.floor(state.cw / 3)));
            g.fillStyle = mark;
            g.beginPath(); g.moveTo(x, y); g.lineTo(x + s, y); g.lineTo(x, y + s); g.closePath(); g.fill();
          }
        }
        if (opts.inert && opts.inert(i)) {  // a row that cannot be picked: hatched
          const y = TOP_H + state.ch * i;
          g.save();
          g.beginPath(); g.rect(LABEL_W, y, state.cw * nc, state.ch); g.clip();
          g.strokeStyle = "rgba(87,96,106,.45)"; g.lineWidth = 1;
          for (let x = LABEL_W - state.ch; x < state.width; x += 6) { g.beginPath(); g.moveTo(x, y + state.ch); g.lineTo(x + state.ch, y); g.stroke(); }
          g.restore();
        }
      }
      g.lineWidth = 2;
      for (const [i, j] of (typeof opts.picked === "function" ? opts.picked() : opts.picked) || []) {
        g.strokeStyle = "#ff7f0e";
        g.strokeRect(LABEL_W + state.cw * j + 1, TOP_H + state.ch * i + 1, state.cw - 2, state.ch - 2);
      }
      if (state.cursor) {
        const [i, j] = state.cursor;
        g.strokeStyle = "#1b1f24";
        g.strokeRect(LABEL_W + state.cw * j, TOP_H + state.ch * i, state.cw, state.ch);
      }
    }
    function cellAt(x, y) {
      const j = Math.floor((x - LABEL_W) / state.cw), i = Math.floor((y - TOP_H) / state.ch);
      return i >= 0 && i < nr && j >= 0 && j < nc ? [i, j] : null;
    }
    function showCard(i, j) {
      const lines = opts.card(i, j);
      card.replaceChildren(...lines.map(([k, v]) => el("div", {}, el("b", { text: `${k} ` }), typeof v === "string" ? v : v)));
      card.dataset.row = String(i);
      card.dataset.col = String(j);
      card.hidden = false;
      const x = LABEL_W + state.cw * (j + 1) + 6, y = TOP_H + state.ch * i;
      const right = x + card.offsetWidth > node.clientWidth && LABEL_W + state.cw * j - card.offsetWidth - 6 >= 0;
      card.style.left = `${right ? LABEL_W + state.cw * j - card.offsetWidth - 6 : Math.min(x, Math.max(0, node.clientWidth - card.offsetWidth))}px`;
      card.style.top = `${y}px`;
    }
    function setCursor(i, j, withCard = true) {
      state.cursor = [Math.max(0, Math.min(nr - 1, i)), Math.max(0, Math.min(nc - 1, j))];
      canvas.dataset.cursor = state.cursor.join(",");
      draw();
      if (withCard) showCard(...state.cursor);
      if (opts.onMove) opts.onMove(...state.cursor);
    }
    function move(di, dj) {
      const [i, j] = state.cursor || [0, 0];
      setCursor(state.cursor ? i + di : 0, state.cursor ? j + dj : 0);
    }
    function pick() { if (state.cursor && opts.onPick) opts.onPick(...state.cursor); }
    canvas.addEventListener("mousemove", (e) => {
      const r = canvas.getBoundingClientRect(), c = cellAt(e.clientX - r.left, e.clientY - r.top);
      if (c) showCard(...c); else card.hidden = true;
    });
    canvas.addEventListener("mouseleave", () => { card.hidden = true; });
    canvas.addEventListener("click", (e) => {
      const r = canvas.getBoundingClientRect(), c = cellAt(e.clientX - r.left, e.clientY - r.top);
      if (!c) return;
      state.cursor = c;
      canvas.dataset.cursor = c.join(",");
      if (opts.onMove) opts.onMove(...c);
      if (opts.onPick) opts.onPick(...c);
      draw();
      showCard(...c);
    });
    canvas.addEventListener("blur", () => { card.hidden = true; });
    // redrawn to the box's width when it is attached and whenever it changes
    let lastWidth = -1;
    if (typeof ResizeObserver === "function") {
      new ResizeObserver(() => { if (node.clientWidth !== lastWidth) { lastWidth = node.clientWidth; draw(); } }).observe(node);
    }
    draw();
    return { node, canvas, card, move, pick, setCursor, redraw: draw, cellAt, showCard, get cursor() { return state.cursor; } };
  }

  // ---- legends -------------------------------------------------------------------------------------
  // a colour scale's legend: `colour(x)` over [lo, hi], with `ticks` ([value, text]) under it
  function legend(title, colour, lo, hi, ticks, cls = "") {
    const bar = el("canvas", { class: "scale-bar", width: "160", height: "10" });
    const g = bar.getContext("2d");
    for (let x = 0; x < 160; x++) { g.fillStyle = colour(lo + (hi - lo) * (x / 159)); g.fillRect(x, 0, 1, 10); }
    const marks = el("span", { class: "scale-ticks" }, ...ticks.map(([v, t]) => el("span", { text: t,
      style: { left: `${((v - lo) / (hi - lo)) * 160}px` } })));
    return el("div", { class: `scale-legend ${cls}`.trim(), data: { lo, hi } }, el("span", { class: "scale-title", text: title }),
      el("span", { class: "scale-wrap" }, bar, marks));
  }
  // a signed scale (orange negative, blue positive, by |v| / max): -max, 0, +max
  function signedLegend(title, signedColour, max) {
    const m = Number(max);
    const t = (v) => (Math.abs(v) >= 100 || (Math.abs(v) < 0.01 && v !== 0) ? v.toExponential(1) : v.toFixed(2));
    return legend(title, (v) => signedColour(v, m), -m, m, [[-m, t(-m)], [0, "0"], [m, t(m)]], "signed");
  }

  // ---- exports -------------------------------------------------------------------------------------
  const csvField = (x) => {
    const s = x === null || x === undefined ? "" : String(x);
    return /[",\n\r]/.test(s) ? `"${s.replace(/"/g, '""')}"` : s;
  };
  const csvText = (rows) => rows.map((r) => r.map(csvField).join(",")).join("\r\n") + "\r\n";

  // the numbers of a panel's tables as rows: a cell's exact value where it carries one (data-value,
  // data-w, data-weight), else its text
  function tableRows(panel) {
    const out = [];
    for (const table of panel.querySelectorAll("table")) {
      if (out.length) out.push([]);
      for (const tr of table.querySelectorAll("tr")) {
        out.push([...tr.children].map((c) => {
          const d = c.dataset || {};
          for (const k of ["value", "w", "weight"]) if (k in d && d[k] !== "") return d[k];
          // a boxed token (tokenview's tokenBox): its text as the run has it, from its title `token "..."`
          const box = c.querySelector(".t[title^='token ']");
          if (box && c.textContent === box.textContent) { try { return JSON.parse(box.title.slice(6)); } catch (e) { /* its text */ } }
          return c.querySelector(".none") && !c.textContent ? "" : c.textContent;
        }));
      }
    }
    for (const row of panel.querySelectorAll(".row-keys")) {
      if (out.length) out.push([]);
      out.push(["key", "text", "value"]);
      for (const k of row.querySelectorAll(".tok.key")) {
        const small = k.querySelector("small");
        const text = small ? k.textContent.slice(0, k.textContent.length - small.textContent.length) : k.textContent;
        out.push([k.dataset.key ?? k.dataset.position ?? "", text, k.dataset.w ?? k.dataset.score ?? k.dataset.weight ?? ""]);
      }
    }
    return out;
  }

  function download(name, blobOrUrl) {
    const url = typeof blobOrUrl === "string" ? blobOrUrl : URL.createObjectURL(blobOrUrl);
    const a = el("a", { href: url, download: name });
    document.body.append(a);
    a.click();
    a.remove();
    if (typeof blobOrUrl !== "string") setTimeout(() => URL.revokeObjectURL(url), 1000);
  }

  // a drawing of `panel` as shown: each element's background and border box, its canvases, its texts
  function panelCanvas(panel) {
    const box = panel.getBoundingClientRect();
    const dpr = Math.max(1, window.devicePixelRatio || 1);
    const out = document.createElement("canvas");
    out.width = Math.ceil(box.width * dpr);
    out.height = Math.ceil(box.height * dpr);
    const g = out.getContext("2d");
    g.scale(dpr, dpr);
    g.fillStyle = "#fff";
    g.fillRect(0, 0, box.width, box.height);
    const skip = (n) => n.closest && (n.closest(".export-bar") || n.closest(".hovercard"));
    for (const n of [panel, ...panel.querySelectorAll("*")]) {
      if (skip(n)) continue;
      const cs = getComputedStyle(n);
      if (cs.visibility === "hidden" || cs.display === "none") continue;
      const r = n.getBoundingClientRect();
      const x = r.left - box.left, y = r.top - box.top;
      if (cs.backgroundColor && cs.backgroundColor !== "rgba(0, 0, 0, 0)" && cs.backgroundColor !== "transparent") {
        g.fillStyle = cs.backgroundColor;
        g.fillRect(x, y, r.width, r.height);
      }
      if (n.tagName === "CANVAS") g.drawImage(n, x, y, r.width, r.height);
      const bw = parseFloat(cs.borderTopWidth);
      if (n !== panel && bw > 0 && cs.borderTopStyle !== "none") {
        g.strokeStyle = cs.borderTopColor; g.lineWidth = bw;
        g.strokeRect(x + bw / 2, y + bw / 2, r.width - bw, r.height - bw);
      }
    }
    const walker = document.createTreeWalker(panel, NodeFilter.SHOW_TEXT);
    g.textBaseline = "alphabetic";
    for (let t = walker.nextNode(); t; t = walker.nextNode()) {
      const parent = t.parentElement;
      if (!parent || skip(parent) || !t.textContent.trim() && !/ /.test(t.textContent)) continue;
      const cs = getComputedStyle(parent);
      if (cs.visibility === "hidden" || cs.display === "none" || parent.closest("select,option")) continue;
      const range = document.createRange();
      range.selectNodeContents(t);
      const rects = range.getClientRects();
      if (!rects.length) continue;
      g.font = `${cs.fontStyle} ${cs.fontWeight} ${cs.fontSize} ${cs.fontFamily}`;
      g.fillStyle = cs.color;
      const r = rects[0];
      g.save();
      g.beginPath(); g.rect(r.left - box.left, r.top - box.top, box.width, r.height); g.clip();
      g.fillText(t.textContent.replace(/\s+/g, " "), r.left - box.left, r.bottom - box.top - (r.height - parseFloat(cs.fontSize)) / 2 - 2);
      g.restore();
    }
    return out;
  }

  // PNG and CSV buttons for `panel`; csv() -> rows (default: the panel's tables); name: the files' stem
  function exportBar(panel, name, csv) {
    const stem = String(name).replace(/[^A-Za-z0-9_.-]+/g, "_");
    const png = el("button", { class: "export png", title: "save this panel as a PNG image", text: "PNG" });
    const csvBtn = el("button", { class: "export csv", title: "save this panel's numbers as CSV", text: "CSV" });
    png.addEventListener("click", () => download(`${stem}.png`, panelCanvas(panel).toDataURL("image/png")));
    csvBtn.addEventListener("click", () => download(`${stem}.csv`, new Blob([csvText(csv ? csv() : tableRows(panel))], { type: "text/csv" })));
    const bar = el("span", { class: "export-bar" }, png, csvBtn);
    panel._csv = () => csvText(csv ? csv() : tableRows(panel));
    panel._png = () => panelCanvas(panel);
    panel.classList.add("exportable");
    panel.prepend(bar);
    return bar;
  }

  return { heatmap, legend, signedLegend, exportBar, csvText, tableRows, panelCanvas };
})();
