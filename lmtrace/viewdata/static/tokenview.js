// lmtrace's token view: one sequence's token strip and, for the selected token, the layer × head
// attention grid, alternatives, logit-lens column, head DLA and attributions. Shared by `lmtrace serve`
// (its data source fetches the server's JSON) and `lmtrace report` (its data source reads the JSON the
// report inlined). A data source is a function path -> Promise of the answer of /api/runs/RUN/<path>.
// Every text that comes from a run (token texts, prompts, metadata, ids) is inserted with
// textContent / createTextNode, never as markup.
"use strict";

window.lmtraceView = (() => {
  // ---- helpers ---------------------------------------------------------------------------------
  // A value the run does not have. As an element's text or child it is drawn as `none()`: an empty,
  // hatched box titled "no value", never a character a token could also be ("-", "–"); inside a
  // string (a tooltip) it reads "no value".
  const MISSING = Object.freeze({ toString: () => "no value" });
  function none() {
    const node = document.createElement("span");
    node.className = "none";
    node.title = "no value";
    node.setAttribute("role", "img");
    node.setAttribute("aria-label", "no value");
    return node;
  }

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === undefined || v === null) continue;
      if (k === "class") node.className = v;
      else if (k === "text" && v === MISSING) node.appendChild(none());
      else if (k === "text") node.textContent = v;
      else if (k === "data") Object.assign(node.dataset, v);
      else if (k === "style") Object.assign(node.style, v);
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v);
    }
    for (const c of children) {
      if (c === null || c === undefined || c === false) continue;
      if (c === MISSING) { node.appendChild(none()); continue; }
      node.appendChild(typeof c === "string" || typeof c === "number" ? document.createTextNode(String(c)) : c);
    }
    return node;
  }

  const fmt = (x, d = 3) => (x === null || x === undefined ? MISSING : Number(x).toFixed(d));
  // a probability: fixed decimals, or 2 significant digits when it would read as 0
  const fmtP = (x, d = 3) => (x === null || x === undefined ? MISSING
    : x !== 0 && Math.abs(x) < 0.5 * 10 ** -d ? Number(x).toExponential(1) : Number(x).toFixed(d));
  // running text (the strip, prompts): newlines and tabs as visible marks, so one token stays on one line
  const shown = (t) => (t === null || t === undefined ? "" : String(t).replace(/\n/g, "↵").replace(/\t/g, "⇥"));
  // one token on its own (a table cell, a key label): its leading spaces as ␣ as well, which in
  // running text are the gaps between words but alone would read as indentation or nothing
  const shownToken = (t) => shown(t).replace(/^ +/, (s) => "␣".repeat(s.length));
  // one token in a table cell: boxed, so that a token "-" or "." reads as a token and never as the
  // page's own punctuation; a token the run does not have is none()
  const tokenBox = (t) => (t === null || t === undefined ? none()
    : el("span", { class: "t", title: `token ${JSON.stringify(t)}`, text: shownToken(t) }));

  function mix(a, b, t) { return a.map((x, i) => Math.round(x + (b[i] - x) * t)); }
  // probability: orange (0) → light grey (0.5) → blue (1). The scale is lmtrace/output/prob_colours.py's
  // (the report's text and `lmtrace show` use it too), written in here when the script is served
  // (viewdata/page_code.py): {"stops": [[p, [r, g, b]], ...], "missing": colour of a missing value}
  const PROB_SCALE = null /* PROB_SCALE */;
  const hex2 = (x) => x.toString(16).padStart(2, "0");
  // Python's round(): halves to the even neighbour (Math.round takes them up)
  function roundEven(x) { const r = Math.round(x); return Math.abs(x % 1) === 0.5 && r % 2 !== 0 ? r - 1 : r; }
  // page_colour of prob_colours.py, the same arithmetic: linear between the stops, p clamped to 0..1
  function probColour(p) {
    if (typeof p !== "number" || !Number.isFinite(p)) return PROB_SCALE.missing;
    const q = Math.max(0, Math.min(1, p)), stops = PROB_SCALE.stops;
    for (let i = 0; i + 1 < stops.length; i++) {
      const [p0, c0] = stops[i], [p1, c1] = stops[i + 1];
      if (q <= p1) {
        const t = (q - p0) / (p1 - p0);
        return "#" + c0.map((a, j) => hex2(roundEven(a + (c1[j] - a) * t))).join("");
      }
    }
    return "#" + stops[stops.length - 1][1].map(hex2).join("");
  }
  const WHITE = [247, 251, 255], MID = [107, 174, 214], DARK = [8, 48, 107];
  // attention weight: white (0) → dark blue (1); on the log scale 0.001 (and below) → 1
  let logScale = false;
  const LOG_DECADES = 3;
  function weightColour(w) {
    const v = w || 0;
    const x = logScale ? (v <= 0 ? 0 : Math.max(0, Math.min(1, 1 + Math.log10(v) / LOG_DECADES)))
      : Math.max(0, Math.min(1, v));
    const c = x < 0.5 ? mix(WHITE, MID, x / 0.5) : mix(MID, DARK, (x - 0.5) / 0.5);
    return `rgb(${c[0]},${c[1]},${c[2]})`;
  }
  function weightText(w) {
    const v = w || 0;
    const x = logScale ? (v <= 0 ? 0 : 1 + Math.log10(v) / LOG_DECADES) : v;
    return x > 0.55 ? "#fff" : "#1b1f24";
  }
  // signed values (effects, attributions, DLA): orange (negative) → light → blue (positive), by |v| / max
  const LIGHT = [247, 247, 247];
  function signedColour(v, max) {
    const t = Math.min(1, Math.abs(v || 0) / (max || 1));
    const c = (v || 0) >= 0 ? mix(LIGHT, [33, 102, 172], t) : mix(LIGHT, [230, 97, 1], t);
    return `rgb(${c[0]},${c[1]},${c[2]})`;
  }
  const absMax = (values) => Math.max(1e-12, ...values.filter((v) => v !== null && v !== undefined).map((v) => Math.abs(v)));

  // replaceChildren writes null as the text "null": leave absent parts out
  function put(node, ...children) { node.replaceChildren(...children.filter((c) => c !== null && c !== undefined && c !== false)); }

  function showError(err, where) {
    where.replaceChildren(el("p", { class: "error", text: String(err.message || err) }));
  }

  // Ranks are stored 0-based (tokens.parquet, steps.parquet); shown from 1 like the alternatives, as `show` does.
  function rank1(r) { return r == null ? MISSING : String(r + 1); }

  // heads' pattern and grid views kept while moving between tokens (and pages)
  let gridView = "heads";
  // the grid's numbers (a table of the cells under the heatmap): null = shown when the grid has at
  // most NUMBERS_AUTO_CELLS cells
  let showNumbers = null;
  const NUMBERS_AUTO_CELLS = 64;
  const GRID_VIEWS = ["heads", "mean", "max"];
  // what `lmtrace heads` called a head: the corner mark's colour on the grid (diffuse: none)
  const LABEL_COLOURS = { induction: "#d62728", "previous-token": "#9467bd", sink: "#2ca02c", local: "#e6a100",
    focused: "#17becf" };

  // The view's state as an address's query: {step, heads: "L.H,L.H", view, log, nums, cell: "L.H"}
  function parseHeads(text) {
    return String(text || "").split(",").map((x) => x.split(".").map(Number))
      .filter((x) => x.length === 2 && x.every((n) => Number.isInteger(n) && n >= 0));
  }

  // ---- one sequence ------------------------------------------------------------------------------
  // tokenView(source, data, opts) -> { legend, strip, detail, select(step, push), keydown(event), steps }
  //   data: the answer of sequences/SEQ; opts.prefix: prepended to every element id (several views on
  //   one page); opts.alive(): false once the view is gone (answers for it are dropped);
  //   opts.onSelect(step, push): told of every selection (serve puts it in the address);
  //   opts.state: the view's state to open with ({heads, cell, view, log, nums}, strings as in an address's
  //   query), opts.onState(state): told of every change of it; opts.headAvailable(layer): false for a
  //   layer whose heads' rows the data source lacks (the report: its grid rows hatched, a click gives
  //   opts.headMissing(layer, head), a note); opts.featureHref(sae, feature): the address of a feature's
  //   page (null: none), opts.featureMissing(sae, feature): the title of a feature without one.
  function tokenView(source, data, opts = {}) {
    const v = { source, seq: data.sequence, id: (n) => (opts.prefix || "") + n, alive: opts.alive || (() => true),
      pickedHeads: [], stepRequest: 0, cursor: null, grid: null, opts };
    const st = opts.state || {};
    if (GRID_VIEWS.includes(st.view)) gridView = st.view;
    if (st.log === "1" || st.log === "0") logScale = st.log === "1";
    if (st.nums === "1" || st.nums === "0") showNumbers = st.nums === "1";
    if (st.heads) v.pickedHeads = parseHeads(st.heads);
    if (st.cell) v.cursor = parseHeads(st.cell)[0] || null;
    // the state a link reopens: told to opts.onState (serve writes it in the address)
    v.state = () => {
      const out = { view: gridView === "heads" ? null : gridView, log: logScale ? "1" : null,
        nums: showNumbers === null ? null : showNumbers ? "1" : "0",
        heads: v.pickedHeads.length ? v.pickedHeads.map(([l, h]) => `${l}.${h}`).join(",") : null,
        cell: v.cursor ? v.cursor.join(".") : null };
      return Object.fromEntries(Object.entries(out).filter(([, x]) => x !== null));
    };
    v.emit = () => { if (opts.onState) opts.onState(v.state()); };
    const steps = data.tokens.filter((t) => t.step !== null).map((t) => t.step);
    const strip = el("div", { class: "strip", id: v.id("strip"), tabindex: "0" }, ...data.tokens.map((t) => t.step === null
      ? el("span", { class: "tok prompt", text: shown(t.text), title: `prompt position ${t.position}` })
      : el("span", { class: "tok gen", text: shown(t.text), data: { step: t.step },
        title: `step ${t.step} · p ${fmtP(t.prob)} · rank ${rank1(t.token_rank)} · entropy ${fmt(t.entropy)}`,
        style: { background: probColour(t.prob) }, onclick: () => { strip.focus({ preventScroll: true }); select(t.step); } })));
    const legend = el("div", { class: "legend" }, "probability of the chosen token: ",
      ...[0, 0.25, 0.5, 0.75, 1].map((p) => el("span", { class: "tok", style: { background: probColour(p) }, text: String(p) })),
      " · click a generated token or use ", el("kbd", { text: "←" }), " ", el("kbd", { text: "→" }));
    const detail = el("div", { id: v.id("detail"), class: "detail" });
    let current = null;
    function select(s, push = true) {
      if (!steps.includes(s)) return;
      current = s;
      for (const node of strip.querySelectorAll(".tok.sel")) node.classList.remove("sel");
      const node = strip.querySelector(`.tok.gen[data-step="${s}"]`);
      if (node) {
        node.classList.add("sel");
        // scroll the strip only, not the page: the strip is the box that holds the token
        const top = node.offsetTop - strip.offsetTop;
        if (top < strip.scrollTop || top > strip.scrollTop + strip.clientHeight - node.offsetHeight) strip.scrollTop = top - strip.clientHeight / 2;
      }
      if (opts.onSelect) opts.onSelect(s, push);
      loadStep(v, s, detail);
    }
    function keydown(e) {
      if (current === null || (e.target.tagName === "INPUT" && e.target.type !== "checkbox") || e.target.tagName === "SELECT") return;
      // the heads: Shift + arrows move the grid's cursor (its card shows the cell), Enter on the grid
      // (or Shift + Enter) picks the head under it, as a click does
      const arrows = { ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [-1, 0], ArrowDown: [1, 0] };
      if (v.grid && e.shiftKey && arrows[e.key]) { e.preventDefault(); v.grid.move(...arrows[e.key]); return; }
      if (v.grid && e.key === "Enter" && (e.shiftKey || e.target === v.grid.canvas)) { e.preventDefault(); v.grid.pick(); return; }
      if (e.altKey || e.ctrlKey || e.metaKey || e.shiftKey) return;
      const i = steps.indexOf(current);
      if (e.key === "ArrowRight" && i < steps.length - 1) { e.preventDefault(); select(steps[i + 1]); }
      if (e.key === "ArrowLeft" && i > 0) { e.preventDefault(); select(steps[i - 1]); }
    }
    if (!steps.length) detail.replaceChildren(el("p", { class: "note", text: "no committed generated token yet" }));
    Object.assign(v, { select, steps });
    return { legend, strip, detail, select, keydown, steps, state: v.state, view: v };
  }

  async function loadStep(v, step, detail) {
    const mine = ++v.stepRequest;
    detail.dataset.loading = "1";
    let d;
    try {
      d = await v.source(`sequences/${v.seq}/steps/${step}`);
    } catch (e) {
      if (mine === v.stepRequest && v.alive()) { showError(e, detail); detail.dataset.step = String(step); delete detail.dataset.loading; }
      return;
    }
    if (mine !== v.stepRequest || !v.alive()) return;
    const left = el("div", {}, tokenPanel(v, d), d.features ? window.lmtraceFeatures.tokenPanel(v.id("features-panel"), d.features, v.opts) : null,
      lensPanel(v, d.lens));
    const right = el("div", {}, attentionPanel(v, d), d.head_dla ? dlaPanel(v, d.head_dla, d.step) : null,
      d.attributions ? attributionPanel(v, d.attributions) : null);
    // every panel: PNG and CSV (files named sequence-step-panel)
    for (const panel of [...left.children, ...right.children]) {
      if (panel.classList.contains("panel") && !panel.querySelector(".export-bar")) {
        window.lmtraceGrid.exportBar(panel, `seq${v.seq}-step${step}-${(panel.id || "panel").slice((idPrefix(v)).length).replace(/-panel$/, "")}`, panel._csvRows);
      }
    }
    // the logit lens over every step (layers x steps), below the panels: patterns.js
    const lensOverSteps = el("div", { id: v.id("lens-over-steps") });
    window.lmtracePatterns.lensGrid(v, step).then((panel) => {
      if (mine !== v.stepRequest || !v.alive()) return;
      const canvas = panel.querySelector("canvas.lens-grid");
      window.lmtraceGrid.exportBar(panel, `seq${v.seq}-lens-over-steps`, canvas ? () => lensCsv(canvas.lmtraceLens) : null);
      lensOverSteps.replaceChildren(panel);
    });
    detail.replaceChildren(el("div", { class: "panels" }, left, right), lensOverSteps);
    detail.dataset.step = String(step);
    delete detail.dataset.loading;
  }

  const idPrefix = (v) => v.id("");

  function tokenPanel(v, d) {
    const t = d.token;
    if (!t) return el("div", { class: "panel" }, el("p", { class: "note", text: "no token row for this step" }));
    const facts = el("table", { class: "list" }, el("tbody", {},
      ...[["step", d.step], ["position", t.position], ["probability", fmtP(t.prob, 4)], ["rank (1 = top-1)", rank1(t.token_rank)],
        ["entropy", fmt(t.entropy)], ["margin (top-1 − top-2)", fmt(t.margin)], ["greedy choice", tokenBox(t.greedy)]].map(([k, x]) =>
        el("tr", {}, el("th", { text: k }), el("td", { class: k === "greedy choice" ? "mono" : "num" }, x ?? MISSING)))));
    const alts = el("table", { class: "list", id: v.id("alternatives") },
      el("thead", {}, el("tr", {}, el("th", { text: "alternative" }), el("th", { class: "num", text: "p" }))),
      el("tbody", {}, ...t.alternatives.map((a) => el("tr", {}, el("td", { class: "mono" }, tokenBox(a.text)),
        el("td", { class: "num", data: { value: a.prob ?? "" }, text: fmtP(a.prob, 4) })))));
    return el("div", { class: "panel", id: v.id("token-panel") }, el("h2", {}, "Chosen token ", el("span", { class: "tok gen", style: { background: probColour(t.prob) }, text: shownToken(t.token) })),
      facts, el("h2", { text: "Alternatives" }), t.alternatives.length ? alts : el("p", { class: "note", text: "none archived" }));
  }

  function lensPanel(v, lens) {
    const box = el("div", { class: "panel", id: v.id("lens-panel") }, el("h2", { text: "Logit lens" }));
    if (lens.state === "none") { box.appendChild(el("p", { class: "note", text: "not captured in this run" })); return box; }
    if (lens.state === "pending") { box.appendChild(el("p", { class: "note", text: lens.note })); return box; }
    box.appendChild(el("table", { class: "list", id: v.id("lens") },
      el("thead", {}, el("tr", {}, ...["layer", "top-1", "p", "chosen rank (1 = top-1)", "chosen p"].map((h) => el("th", { text: h })))),
      el("tbody", {}, ...lens.rows.map((r) => el("tr", { data: { layer: r.layer } }, el("td", { class: "num", text: r.layer }),
        el("td", { class: "mono" }, tokenBox(r.top1)), el("td", { class: "num", text: fmtP(r.top1_prob) }),
        el("td", { class: "num", text: rank1(r.target_rank) }), el("td", { class: "num", text: fmtP(r.target_prob) }))))));
    return box;
  }

  function attentionPanel(v, d) {
    const box = el("div", { class: "panel", id: v.id("attention-panel") }, el("h2", { text: "Attention" }));
    const a = d.attention;
    if (!a) { box.appendChild(el("p", { class: "note", text: "not captured in this run" })); return box; }
    const views = el("select", { id: v.id("grid-view") }, ...[["heads", "every head: its most-attended key"], ["mean", "mean over heads, every key"],
      ["max", "max over heads, every key"]].map(([x, t]) => el("option", { value: x, text: t })));
    views.value = gridView;
    const logBox = el("input", { type: "checkbox", id: v.id("log-scale") });
    logBox.checked = logScale;
    const gridBox = el("div", {});
    const patterns = el("div", { id: v.id("head-patterns") });
    // the mean / max over heads (layers x every key: the larger answer, its own route) is asked of the
    // data source when first shown
    let overHeads; // undefined until answered (null: the run has no attention)
    const draw = async () => {
      const view = gridView;
      if (view === "heads") { gridBox.replaceChildren(headsGrid(v, d, box, patterns)); return; }
      if (overHeads === undefined) {
        gridBox.replaceChildren(el("p", { class: "note", text: "loading…" }));
        try {
          overHeads = await window.lmtracePatterns.overHeads(v, d.step);
        } catch (e) { if (view === gridView) showError(e, gridBox); return; }
      }
      if (view === gridView) put(gridBox, window.lmtracePatterns.overHeadsImage(v, overHeads, view), overHeads ? weightLegend() : null);
    };
    views.addEventListener("change", () => { gridView = views.value; draw(); v.emit(); });
    logBox.addEventListener("change", () => {
      logScale = logBox.checked;
      v.emit();
      draw();
      for (const n of box.querySelectorAll("[data-w]")) {
        const w = n.dataset.w === "" ? null : Number(n.dataset.w);
        if (w !== null) { n.style.background = weightColour(w); n.style.color = weightText(w); }
      }
    });
    box.appendChild(el("div", { class: "controls" }, views, el("label", {}, logBox, " log colour scale (0.001 – 1)")));
    box.appendChild(gridBox);
    draw();
    box.appendChild(patterns);
    for (const [layer, head] of v.pickedHeads) if (headAvailable(v, layer)) loadPattern(v, d.step, layer, head, patterns);
    // every head of a layer as small multiples (patterns.js), of the layers whose heads the data source
    // has; clicking one picks that head
    const withHeads = { ...d, attention: { ...a, layers: a.layers.filter((l) => headAvailable(v, l)) } };
    box.appendChild(window.lmtracePatterns.layerControls(v, withHeads, (layer, head) => {
      if (!v.pickedHeads.some(([l, x]) => l === layer && x === head)) {
        v.pickedHeads.push([layer, head]);
        loadPattern(v, d.step, layer, head, patterns);
      }
      v.emit();
      if (v.grid) v.grid.redraw();
    }));
    // its CSV: the view shown (every head's most-attended key, or the mean / max over heads per key)
    box._csvRows = () => {
      if (gridView === "heads") {
        const labels = a.head_labels ? a.head_labels.labels : null;
        return [["layer", "head", "key_position", "key_text", "weight", ...(labels ? ["label"] : [])],
          ...a.cells.flatMap((cells, li) => cells.map((c, h) => [a.layers[li], h, c.key, c.text, c.weight ?? "",
            ...(labels ? [labels[li][h] ?? ""] : [])]))];
      }
      if (!overHeads) return [["not loaded"]];
      // patterns.js keeps them packed: a Float32Array per view, layers x keys, NaN for no value
      const o = overHeads, values = o[gridView];
      return [["layer", ...o.keys.map((k, i) => `${i}:${k}`)], ...o.layers.map((layer, li) =>
        [layer, ...Array.from(values.subarray(li * o.cols, (li + 1) * o.cols), (w) => (Number.isFinite(w) ? w : ""))])];
    };
    return box;
  }

  // the logit lens over the steps' CSV: a row per layer and step (patterns.js's answer, kept on its canvas)
  function lensCsv(g) {
    const rows = [["layer", "step", "chosen", "top1_id", "top1", "top1_prob"]];
    g.layers.forEach((layer, li) => {
      for (let s = 0; s < g.steps; s++) {
        rows.push([layer, s, g.chosen[s] ?? "", g.top1_id ? g.top1_id[li][s] ?? "" : "", g.top1[li][s] ?? "", g.prob[li][s] ?? ""]);
      }
    });
    return rows;
  }

  // the attention weight's legend, on the scale in use (linear 0 – 1, or log 0.001 – 1)
  function weightLegend() {
    const G = window.lmtraceGrid;
    return logScale
      ? G.legend("attention weight (log)", (x) => weightColour(10 ** x), -LOG_DECADES, 0, [[-3, "0.001"], [-2, "0.01"], [-1, "0.1"], [0, "1"]], "weight")
      : G.legend("attention weight", weightColour, 0, 1, [[0, "0"], [0.5, "0.5"], [1, "1"]], "weight");
  }

  // a layer's heads can be picked (their rows and patterns read) unless the data source lacks them:
  // the report embeds the heads of some layers only (opts.headAvailable)
  const headAvailable = (v, layer) => !v.opts.headAvailable || v.opts.headAvailable(layer);

  // Every head of every layer: a heatmap on a canvas (headgrid.js) of the weight of the key each head's
  // query attended to most, with a hover card (layer, head, the key's text and position, the weight, the
  // head's `lmtrace heads` label), a keyboard cursor, and under it on demand the same cells as numbers.
  function headsGrid(v, d, box, patterns) {
    const a = d.attention, G = window.lmtraceGrid;
    const labels = a.head_labels ? a.head_labels.labels : null;
    const inert = a.layers.filter((l) => !headAvailable(v, l));
    const wrap = el("div", {}, el("p", { class: "note", text: `Each cell: the weight of the key the query at position ${a.query_position} attended to most in that layer (row) and head (column). `
      + `Hover a cell for its key's text and position${labels ? " and the head's label (lmtrace heads)" : ""}; click it for the head's whole row and its pattern over every step. `
      + "Shift + arrows walk the heads, Enter picks one." }));
    if (inert.length) {
      wrap.appendChild(el("p", { class: "note embedded-layers", id: v.id("embedded-layers"),
        text: `This page embeds the heads' rows and patterns of layer${a.layers.length - inert.length === 1 ? "" : "s"} ${a.layers.filter((l) => headAvailable(v, l)).join(", ") || "none"}; `
          + `the hatched rows (layer${inert.length === 1 ? "" : "s"} ${inert.join(", ")}) show their grid cells only.` }));
    }
    const rowBox = el("div", { id: v.id("head-row") });
    const numbersBox = el("input", { type: "checkbox", id: v.id("grid-numbers") });
    const numbersOn = () => (showNumbers === null ? a.layers.length * a.heads <= NUMBERS_AUTO_CELLS : showNumbers);
    numbersBox.checked = numbersOn();
    const tableBox = el("div", { class: "scroll" });
    const li0 = (layer) => a.layers.indexOf(layer);
    const pick = (li, h) => {
      const layer = a.layers[li];
      v.cursor = [layer, h];
      for (const n of box.querySelectorAll("td.cell.picked")) n.classList.remove("picked");
      const td = tableBox.querySelector(`td.cell[data-layer="${layer}"][data-head="${h}"]`);
      if (td) td.classList.add("picked");
      if (!headAvailable(v, layer)) {
        rowBox.replaceChildren(el("p", { class: "note not-embedded", text: v.opts.headMissing ? v.opts.headMissing(layer, h)
          : `layer ${layer}, head ${h} is not embedded here` }));
        v.emit();
        return;
      }
      loadHeadRow(v, d.step, layer, h, rowBox);
      if (!v.pickedHeads.some(([l, x]) => l === layer && x === h)) {
        v.pickedHeads.push([layer, h]);
        loadPattern(v, d.step, layer, h, patterns);
      }
      v.emit();
      if (v.grid) v.grid.redraw();
    };
    const card = (li, h) => {
      const c = a.cells[li][h], layer = a.layers[li];
      const lines = [["layer", String(layer)], ["head", String(h)], ["key", `${shownToken(c.text)} (position ${c.key})`],
        ["weight", fmt(c.weight, 4)]];
      if (labels) lines.push(["label", labels[li][h] ?? "no value"]);
      else lines.push(["label", "run `lmtrace heads` for the heads' labels"]);
      if (!headAvailable(v, layer)) lines.push(["", "its row is not embedded here"]);
      return lines;
    };
    const cursor = v.cursor && li0(v.cursor[0]) >= 0 && v.cursor[1] < a.heads ? [li0(v.cursor[0]), v.cursor[1]] : null;
    v.grid = G.heatmap({ id: v.id("attention-heatmap"), label: "attention: layers × heads", rows: a.layers.map((l) => `L${l}`),
      cols: Array.from({ length: a.heads }, (_, h) => `H${h}`), value: (i, j) => a.cells[i][j].weight, colour: weightColour,
      textColour: weightText, numbers: (w) => fmt(w, 2), card, cursor,
      mark: labels ? (i, j) => LABEL_COLOURS[labels[i][j]] || null : null,
      inert: inert.length ? (i) => !headAvailable(v, a.layers[i]) : null,
      picked: () => v.pickedHeads.filter(([l]) => li0(l) >= 0).map(([l, h]) => [li0(l), h]),
      onPick: pick, onMove: (i, j) => { v.cursor = [a.layers[i], j]; v.emit(); } });
    v.grid.canvas.dataset.step = String(d.step);
    const legends = el("div", { class: "legends" }, weightLegend(), labels ? el("span", { class: "label-legend" }, "label (lmtrace heads): ",
      ...Object.entries(LABEL_COLOURS).map(([name, colour]) => el("span", { class: "label-key" }, el("i", { style: { borderTopColor: colour, borderLeftColor: colour } }), name))) : null);
    const drawTable = () => {
      if (!numbersBox.checked) { tableBox.replaceChildren(); return; }
      const head = el("tr", {}, el("th", { text: "layer \\ head" }), ...Array.from({ length: a.heads }, (_, h) => el("th", { text: `H${h}` })));
      const rows = a.cells.map((cells, li) => el("tr", {}, el("th", { text: `L${a.layers[li]}` }),
        ...cells.map((c, h) => {
          const td = el("td", { class: "cell", data: { layer: a.layers[li], head: h, key: c.key, weight: c.weight, ...(labels ? { label: labels[li][h] ?? "" } : {}) },
            title: `layer ${a.layers[li]} head ${h}: key ${c.key} ${JSON.stringify(c.text)} weight ${fmt(c.weight, 4)}${labels ? ` · ${labels[li][h] ?? "no label"}` : ""}`,
            style: { background: weightColour(c.weight), color: weightText(c.weight) } },
          el("span", { class: "w", text: fmt(c.weight) }), el("span", { class: "k", text: shownToken(c.text) }));
          td.addEventListener("click", () => { v.grid.setCursor(li, h, false); pick(li, h); });
          return td;
        })));
      tableBox.replaceChildren(el("table", { class: "grid", id: v.id("attention-grid") }, el("thead", {}, head), el("tbody", {}, ...rows)));
    };
    numbersBox.addEventListener("change", () => { showNumbers = numbersBox.checked; drawTable(); v.emit(); });
    wrap.append(v.grid.node, legends, el("label", { class: "numbers-toggle" }, numbersBox, " numbers (a table of the cells)"), tableBox);
    drawTable();
    wrap.appendChild(rowBox);
    if (v.cursor && cursor && v.pickedHeads.some(([l, h]) => l === v.cursor[0] && h === v.cursor[1]) && headAvailable(v, v.cursor[0])) {
      loadHeadRow(v, d.step, v.cursor[0], v.cursor[1], rowBox);
    }
    return wrap;
  }

  // a picked head's whole pattern (query × key), drawn by patterns.js
  function loadPattern(v, step, layer, head, patterns) {
    const holder = el("div", { class: "pattern", data: { layer, head } });
    patterns.appendChild(holder);
    window.lmtracePatterns.headPattern(v, step, layer, head, holder, () => {
      const i = v.pickedHeads.findIndex(([l, x]) => l === layer && x === head);
      if (i >= 0) v.pickedHeads.splice(i, 1);
      holder.remove();
      v.emit();
      if (v.grid) v.grid.redraw();
    }).then((m) => {
      // its CSV: the matrix drawn, a row per query (or per block of `stride` queries), a column per key
      if (!m || !holder.parentElement) return;
      window.lmtraceGrid.exportBar(holder, `seq${v.seq}-pattern-L${layer}-H${head}`, () => patternCsv(m));
    });
  }

  function patternCsv(m) {
    const s = m.stride;
    const keyName = (k) => (s > 1 ? `${k * s}-${Math.min(m.keys.length, (k + 1) * s) - 1}` : `${k}:${m.keys[k] ?? ""}`);
    const out = [["query_position", "step", ...Array.from({ length: m.cols }, (_, k) => keyName(k))]];
    for (let r = 0; r < m.rows; r++) {
      const query = m.queryStart + r * s, step = query - (m.promptLen - 1);
      out.push([query, step >= 0 ? step : "", ...Array.from(m.values.subarray(r * m.cols, (r + 1) * m.cols), (w) => (Number.isFinite(w) ? w : ""))]);
    }
    return out;
  }

  function attributionPanel(v, groups) {
    const box = el("div", { class: "panel", id: v.id("attribution-panel") }, el("h2", { text: "Attributions (lmtrace explain)" }));
    if (!groups.length) { box.appendChild(el("p", { class: "note", text: "no explain result for this step (`lmtrace explain RUN STEPS --sequence N`)" })); return box; }
    for (const g of groups) {
      const max = absMax(g.scores.map((x) => x.score));
      box.appendChild(el("div", { class: "attribution", data: { method: g.method, explain: g.explain_id } },
        el("h3", { text: `${g.method} · ${g.target || "no target"}${g.quantity ? ` (${g.quantity})` : ""} · ${g.explain_id}` }),
        window.lmtraceGrid.signedLegend("score", signedColour, max),
        el("div", { class: "row-keys" }, ...g.scores.map((x) => el("span", { class: `tok key${x.is_prompt ? " prompt-key" : ""}`,
          data: { position: x.position, score: x.score ?? "" }, title: `position ${x.position}: ${fmt(x.score, 4)}`,
          style: { background: signedColour(x.score, max), color: Math.abs(x.score || 0) / max > 0.6 ? "#fff" : "#1b1f24" } },
        shownToken(x.text), el("small", { text: fmt(x.score, 3) })))),
        g.components ? componentsBlock(g.components) : null));
    }
    return box;
  }

  // a signed number's cell: its value in data-value (as sent), its colour by |value| / max
  function signedCell(x, max, data) {
    return el("td", { class: "cell num", data: { ...data, value: x ?? "" }, text: fmt(x, 4),
      style: { background: signedColour(x, max), color: Math.abs(x || 0) / max > 0.6 ? "#fff" : "#1b1f24" } });
  }

  // A method's relevance per component (lrp): per layer (attention, MLP, ...), per layer and head, and
  // how well the token relevance conserves the explained quantity.
  function componentsBlock(c) {
    const names = Object.keys(c.per_layer || {});
    const box = el("div", { class: "components" });
    const k = c.conservation || {};
    if ("conservation_error" in k) {
      box.appendChild(el("p", { class: "note conservation", data: { error: k.conservation_error ?? "", relative: k.conservation_error_relative ?? "" },
        text: `conservation: f = ${fmt(k.f_x, 4)}, Σ scores + bias = ${fmt((k.sum_scores ?? NaN) + (k.bias_relevance ?? NaN), 4)}, `
          + `error ${k.conservation_error === null ? "not recorded" : Number(k.conservation_error).toExponential(2)} `
          + `(relative ${k.conservation_error_relative === null || k.conservation_error_relative === undefined ? "not recorded" : Number(k.conservation_error_relative).toExponential(2)})` }));
    }
    if (names.length) {
      const max = absMax(names.flatMap((n) => c.per_layer[n]));
      box.appendChild(window.lmtraceGrid.signedLegend("relevance per layer", signedColour, max));
      box.appendChild(el("table", { class: "grid per-layer" },
        el("thead", {}, el("tr", {}, el("th", { text: "layer" }), ...names.map((n) => el("th", { text: n.replace(/_/g, " ") })))),
        el("tbody", {}, ...c.layers.map((layer, li) => el("tr", { data: { layer } }, el("th", { text: `L${layer}` }),
          ...names.map((n) => signedCell(c.per_layer[n][li], max, { component: n })))))));
    }
    if (c.heads) {
      const max = absMax(c.heads.flat());
      box.appendChild(el("h3", { text: "Relevance per head (rows = layers)" }));
      box.appendChild(window.lmtraceGrid.signedLegend("relevance per head", signedColour, max));
      box.appendChild(el("table", { class: "grid head-relevance" },
        el("thead", {}, el("tr", {}, el("th", { text: "layer \\ head" }), ...c.heads[0].map((_, h) => el("th", { text: `H${h}` })))),
        el("tbody", {}, ...c.heads.map((row, li) => el("tr", {}, el("th", { text: `L${c.layers[li]}` }),
          ...row.map((x, h) => signedCell(x, max, { layer: c.layers[li], head: h })))))));
    }
    return box;
  }

  const LONG_ROW = 512; // keys of a head's row drawn as tokens at most
  async function loadHeadRow(v, step, layer, head, box) {
    box.replaceChildren(el("p", { class: "note", text: "loading…" }));
    let r;
    try { r = await v.source(`sequences/${v.seq}/steps/${step}/attention/${layer}/${head}`); } catch (e) { showError(e, box); return; }
    // a long context: its LONG_ROW heaviest keys as tokens (in key order); the head's pattern image shows every key
    const keys = r.keys.length <= LONG_ROW ? r.keys
      : r.keys.slice().sort((x, y) => (y.weight ?? -1) - (x.weight ?? -1)).slice(0, LONG_ROW).sort((x, y) => x.key - y.key);
    put(box, el("h2", { text: `Layer ${layer}, head ${head}: attention over ${r.dense ? "every key" : "its top-k keys"}` }),
      keys.length < r.keys.length ? el("p", { class: "note", text: `the ${keys.length} keys with the largest weights of ${r.keys.length}, in order; the pattern below draws every key` }) : null,
      el("div", { class: "row-keys", data: { layer, head } }, ...keys.map((k) => el("span", {
        class: "tok key", data: { key: k.key, weight: k.weight, w: k.weight ?? "" }, title: `key ${k.key}: ${fmt(k.weight, 4)}`,
        style: { background: weightColour(k.weight), color: weightText(k.weight) } },
      shownToken(k.text), el("small", { text: fmt(k.weight) })))));
  }

  // Per-head direct logit attribution: a signed heatmap on a canvas (headgrid.js) with its legend and
  // hover card, and under it on demand the same values as a table of numbers. A cell (of either) opens
  // that head's DLA over every step below them (patterns.js).
  function dlaPanel(v, dla, step) {
    const max = Math.max(1e-9, ...dla.values.flat().map((x) => Math.abs(x || 0)));
    const heads = dla.values[0].length;
    const overSteps = el("div", { id: v.id("dla-over-steps") });
    v.layers = dla.layers;
    const open = (layer, head) => { v.dlaHead = [layer, head]; window.lmtracePatterns.headDla(v, step, layer, head, overSteps); };
    const li0 = v.dlaHead ? dla.layers.indexOf(v.dlaHead[0]) : -1;
    const hm = window.lmtraceGrid.heatmap({ id: v.id("dla-heatmap"), label: "direct logit attribution: layers × heads",
      rows: dla.layers.map((l) => `L${l}`), cols: Array.from({ length: heads }, (_, h) => `H${h}`),
      value: (i, j) => dla.values[i][j], colour: (x) => signedColour(x, max),
      textColour: (x) => (Math.abs(x || 0) / max > 0.6 ? "#fff" : "#1b1f24"), numbers: (x) => fmt(x, 2),
      card: (i, j) => [["layer", String(dla.layers[i])], ["head", String(j)], ["DLA", fmt(dla.values[i][j], 4)], ["", "click: its DLA over the steps"]],
      cursor: li0 >= 0 && v.dlaHead[1] < heads ? [li0, v.dlaHead[1]] : null, onPick: (i, j) => open(dla.layers[i], j) });
    const numbersBox = el("input", { type: "checkbox", id: v.id("dla-numbers") });
    numbersBox.checked = showNumbers === null ? dla.layers.length * heads <= NUMBERS_AUTO_CELLS : showNumbers;
    const tableBox = el("div", { class: "scroll" });
    const drawTable = () => tableBox.replaceChildren(...(!numbersBox.checked ? [] : [el("table", { class: "grid", id: v.id("dla-grid") },
      el("thead", {}, el("tr", {}, el("th", { text: "layer \\ head" }), ...dla.values[0].map((_, h) => el("th", { text: `H${h}` })))),
      el("tbody", {}, ...dla.values.map((row, li) => el("tr", {}, el("th", { text: `L${dla.layers[li]}` }),
        ...row.map((x, h) => el("td", { class: "cell", data: { layer: dla.layers[li], head: h, value: x ?? "" }, text: fmt(x),
          title: `layer ${dla.layers[li]} head ${h}: ${fmt(x, 4)}; click for its DLA over the steps`,
          onclick: () => { hm.setCursor(li, h, false); open(dla.layers[li], h); },
          style: { background: signedColour(x, max), color: Math.abs(x || 0) / max > 0.6 ? "#fff" : "#1b1f24" } }))))))]));
    numbersBox.addEventListener("change", () => { showNumbers = numbersBox.checked; drawTable(); v.emit(); });
    drawTable();
    if (v.dlaHead) open(...v.dlaHead);
    const box = el("div", { class: "panel", id: v.id("dla-panel") }, el("h2", { text: `Direct logit attribution per head (${dla.target})` }),
      el("p", { class: "note", text: "Click a cell for that head's DLA over every step." }),
      hm.node, window.lmtraceGrid.signedLegend("logit difference", signedColour, max),
      el("label", { class: "numbers-toggle" }, numbersBox, " numbers (a table of the cells)"), tableBox, overSteps);
    box._csvRows = () => [["layer", "head", "dla"], ...dla.values.flatMap((row, li) => row.map((x, h) => [dla.layers[li], h, x ?? ""]))];
    return box;
  }

  return { el, put, fmt, fmtP, shown, shownToken, tokenBox, none, MISSING, probColour, signedColour, absMax, showError, rank1,
    tokenView, parseHeads };
})();
