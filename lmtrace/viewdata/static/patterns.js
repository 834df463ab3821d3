// lmtrace's token view, its pictures: a head's whole attention pattern (query × key), every head of a
// layer as small multiples, the attention averaged / maximised over heads, the logit lens over the
// steps (layers × steps, top-1 token coloured by its probability) and one head's direct logit
// attribution over the steps. Each is drawn on a canvas from typed arrays (ImageData), never as a
// table of cells: 4,000 keys × 16 steps is one image. The server sends the archive's own float16 /
// float32 bytes (viewdata/patterns.py, "packed"); the report, which inlines only the JSON answers,
// is read through the same functions from those (`rows` lists), so both draw the same numbers.
// A canvas keeps what it draws: `canvas.lmtraceValues` (Float32Array, row-major, NaN = no value) and
// data-rows / data-cols, which a hover card reads (and tests too).
"use strict";

window.lmtracePatterns = (() => {
  const { el, fmt, shownToken, showError, probColour, signedColour } = window.lmtraceView;

  // ---- numbers -------------------------------------------------------------------------------------
  // float16 -> float32 by table: 65,536 entries, built once
  let F16 = null;
  function f16table() {
    if (F16) return F16;
    F16 = new Float32Array(65536);
    for (let h = 0; h < 65536; h++) {
      const s = h & 0x8000 ? -1 : 1, e = (h >> 10) & 0x1f, m = h & 0x3ff;
      F16[h] = e === 0 ? s * m * 2 ** -24 : e === 31 ? (m ? NaN : s * Infinity) : s * (1 + m / 1024) * 2 ** (e - 15);
    }
    return F16;
  }
  // {dtype, shape, data: base64 little-endian} -> Float32Array
  function unpack(p) {
    const bin = atob(p.data), bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    const dv = new DataView(bytes.buffer), n = p.shape.reduce((a, b) => a * b, 1), out = new Float32Array(n);
    if (p.dtype === "float16") { const t = f16table(); for (let i = 0; i < n; i++) out[i] = t[dv.getUint16(2 * i, true)]; }
    else for (let i = 0; i < n; i++) out[i] = dv.getFloat32(4 * i, true);
    return out;
  }
  // a JSON matrix (rows of numbers, null for no value) -> Float32Array, `cols` wide
  function fromRows(rows, cols) {
    const out = new Float32Array(rows.length * cols).fill(NaN);
    rows.forEach((row, r) => row.forEach((w, k) => { if (w !== null && w !== undefined && k < cols) out[r * cols + k] = w; }));
    return out;
  }

  // ---- colours: the token view's attention scale (white → mid blue → dark blue), linear or log ------
  const WHITE = [247, 251, 255], MID = [107, 174, 214], DARK = [8, 48, 107], VOID = [246, 248, 250];
  const logOn = () => { const box = document.querySelector("input[id$='log-scale']"); return !!(box && box.checked); };
  function weightRgb(w, log) {
    if (!Number.isFinite(w)) return VOID;
    const x = log ? (w <= 0 ? 0 : Math.max(0, Math.min(1, 1 + Math.log10(w) / 3))) : Math.max(0, Math.min(1, w));
    const [a, b, t] = x < 0.5 ? [WHITE, MID, x / 0.5] : [MID, DARK, (x - 0.5) / 0.5];
    return a.map((c, i) => Math.round(c + (b[i] - c) * t));
  }

  // values [rows × cols] as a canvas drawn `rowPx` high a row and as wide as its box: one pixel a cell, or
  // for more than MAX_W columns one pixel the maximum of `pool` neighbouring cells (a thin peak stays seen)
  const MAX_W = 1200;
  function heat(values, rows, cols, { rowPx = 6, log = logOn(), cls = "heat", colour = null } = {}) {
    const pool = Math.max(1, Math.ceil(cols / MAX_W)), width = Math.max(1, Math.ceil(cols / pool));
    const canvas = el("canvas", { class: cls, width, height: Math.max(1, rows), data: { rows, cols: width, keys: cols, pool } });
    paint(canvas, values, log, colour);
    canvas.lmtraceValues = values;
    canvas.style.height = `${Math.min(Math.max(rows * rowPx, 24), 640)}px`; // a tall pattern fits the screen
    return canvas;
  }
  function paint(canvas, values, log = logOn(), colour = null) {
    const rows = +canvas.dataset.rows, cols = +canvas.dataset.keys, pool = +canvas.dataset.pool, width = canvas.width;
    // drawn with putImageData, and read back (exports, tests): kept in memory, not on the GPU
    const ctx = canvas.getContext("2d", { willReadFrequently: true }), img = ctx.createImageData(width, Math.max(1, rows));
    for (let r = 0; r < rows; r++) {
      for (let x = 0; x < width; x++) {
        let w = NaN;
        for (let k = x * pool; k < Math.min(cols, (x + 1) * pool); k++) { const y = values[r * cols + k]; if (!(y <= w)) w = Number.isFinite(y) ? y : w; }
        const c = colour ? colour(w) : weightRgb(w, log), i = 4 * (r * width + x);
        img.data[i] = c[0]; img.data[i + 1] = c[1]; img.data[i + 2] = c[2]; img.data[i + 3] = 255;
      }
    }
    ctx.putImageData(img, 0, 0);
  }
  // the cell under a pixel: the key of the largest value of its pool
  function cellAt(canvas, row, x) {
    const cols = +canvas.dataset.keys, pool = +canvas.dataset.pool, values = canvas.lmtraceValues;
    let best = x * pool;
    for (let k = x * pool; k < Math.min(cols, (x + 1) * pool); k++) if (values[row * cols + k] > values[row * cols + best] || !Number.isFinite(values[row * cols + best])) best = k;
    return best;
  }

  // a hover card over a canvas: describe(row, col) -> text, or null for none
  function hover(canvas, describe) {
    const card = el("div", { class: "hover-card", role: "tooltip" });
    card.hidden = true;
    const at = (e) => {
      const r = canvas.getBoundingClientRect();
      return [Math.floor((e.clientY - r.top) / r.height * +canvas.dataset.rows),
        Math.floor((e.clientX - r.left) / r.width * +canvas.dataset.cols)];
    };
    canvas.addEventListener("mousemove", (e) => {
      const [row, x] = at(e);
      const text = row >= 0 && x >= 0 && row < +canvas.dataset.rows && x < +canvas.dataset.cols
        ? describe(row, canvas.dataset.pool ? cellAt(canvas, row, x) : x) : null;
      if (!text) { card.hidden = true; return; }
      card.textContent = text;
      card.hidden = false;
      const box = canvas.parentElement.getBoundingClientRect();
      card.style.left = `${Math.min(e.clientX - box.left + 12, box.width - 260)}px`;
      card.style.top = `${e.clientY - box.top + 14}px`;
    });
    canvas.addEventListener("mouseleave", () => { card.hidden = true; });
    canvas.lmtraceAt = at;
    return card;
  }

  // a row of the picture outlined (the selected step): a box over the canvas, in percentages
  function rowMark(rows, row, cls = "row-mark") {
    if (row < 0 || row >= rows) return null;
    return el("div", { class: cls, style: { top: `${(100 * row) / rows}%`, height: `max(2px, ${100 / rows}%)` } });
  }

  const q = (t) => JSON.stringify(t ?? "");
  const cache = new WeakMap(); // per view: answers already read (patterns, lens) while the sequence is shown
  async function read(v, paths) {
    let c = cache.get(v);
    if (!c) { c = new Map(); cache.set(v, c); }
    if (c.has(paths[0])) return c.get(paths[0]);
    let last;
    for (const path of paths) { // the packed answer (serve), else the JSON one (the report inlines those)
      try { const a = { path, answer: await v.source(path) }; c.set(paths[0], a); return a; } catch (e) { last = e; }
    }
    throw last;
  }

  // ---- one head: its whole pattern -----------------------------------------------------------------
  // -> {values, rows, cols, queryStart, promptLen, steps, keys, chosen, stride, dense, promptRows}
  async function headMatrix(v, layer, head) {
    const { answer: p } = await read(v, [`sequences/${v.seq}/pattern/${layer}/${head}`, `sequences/${v.seq}/attention/${layer}/${head}`]);
    if (p.weights) {
      const [rows, cols] = p.weights.shape;
      return { values: unpack(p.weights), rows, cols, queryStart: p.query_start, promptLen: p.prompt_len, steps: p.steps,
        keys: p.keys, chosen: p.chosen, stride: p.stride, dense: p.dense, promptRows: p.prompt_rows };
    }
    const cols = p.keys.length; // the JSON pattern over steps: a row per step, no prompt rows
    return { values: fromRows(p.rows, cols), rows: p.rows.length, cols, queryStart: cols - p.rows.length + 1,
      promptLen: cols - p.rows.length + 1, steps: p.rows.length, keys: p.keys, chosen: p.chosen, stride: 1,
      dense: p.dense, promptRows: false, embedded: true };
  }

  function describeCell(m, row, col) {
    const i = row * m.cols + col, w = m.values[i];
    if (!(i >= 0 && i < m.values.length) || !Number.isFinite(w)) return null;
    const s = m.stride;
    const query = m.queryStart + row * s, key = col * s;
    const step = query - (m.promptLen - 1);
    const qText = step >= 0 ? `step ${step} (chose ${q(m.chosen[step])})` : `prompt query ${query} ${q(m.keys[query + 1] ?? "")}`;
    const keyText = s > 1 ? `keys ${key}–${key + s - 1}` : `key ${key} ${q(m.keys[key])}`;
    return `${qText}, query position ${query}${s > 1 ? `–${query + s - 1}` : ""} → ${keyText}: ${s > 1 ? "max " : ""}${Number(w).toFixed(4)}`;
  }

  // -> the matrix drawn (headMatrix's), or undefined when it could not be read (the holder says why)
  async function headPattern(v, step, layer, head, holder, onClose) {
    holder.replaceChildren(el("p", { class: "note", text: "loading…" }));
    let m;
    try { m = await headMatrix(v, layer, head); } catch (e) { showError(e, holder); return; }
    const close = el("button", { class: "close", title: "stop showing this head", text: "×", onclick: onClose });
    const canvas = heat(m.values, m.rows, m.cols, { rowPx: m.rows > 200 ? 2 : m.rows > 60 ? 3 : 8, cls: "heat pattern-image" });
    Object.assign(canvas.dataset, { layer, head, queryStart: m.queryStart, promptLen: m.promptLen, stride: m.stride });
    const selectedRow = Math.floor((m.promptLen - 1 + step - m.queryStart) / m.stride);
    const frame = el("div", { class: "heat-frame" }, canvas, rowMark(m.rows, selectedRow), hover(canvas, (r, c) => describeCell(m, r, c)));
    const what = m.promptRows ? `every query: the prompt's rows (prefill attention), then the ${m.steps} generated steps'`
      : m.embedded ? `the ${m.steps} generated steps' queries (lmtrace serve adds the prompt's rows when the run captured them)`
        : `the ${m.steps} generated steps' queries (the prompt's own rows were not captured: capture.prefill_attention)`;
    holder.replaceChildren(
      el("h3", {}, `Layer ${layer}, head ${head}: attention pattern, query × key `, close),
      el("p", { class: "note", text: `Rows: ${what}; columns: the ${m.keys.length} keys. ${m.dense ? "" : "Top-k capture: keys it did not keep are 0. "}`
        + `${m.stride > 1 ? `Each pixel is the maximum of ${m.stride} × ${m.stride} cells. ` : ""}The selected step's row is outlined; hover for a cell's weight.` }),
      frame);
    return m;
  }

  // ---- every head of a layer (small multiples) ----------------------------------------------------
  async function layerHeads(v, step, layer, box, pick) {
    box.replaceChildren(el("p", { class: "note", text: "loading…" }));
    let p, all;
    try {
      ({ answer: p } = await read(v, [`sequences/${v.seq}/pattern/${layer}`]));
      all = unpack(p.weights);
    } catch (e) { // the report: from each head's pattern it embeds
      try {
        const ms = [];
        for (let h = 0; h < (v.heads || 0); h++) ms.push(await headMatrix(v, layer, h));
        if (!ms.length) throw e;
        all = new Float32Array(ms.length * ms[0].values.length);
        ms.forEach((m, h) => all.set(m.values, h * m.values.length));
        p = { weights: { shape: [ms.length, ms[0].rows, ms[0].cols] }, query_start: ms[0].queryStart, prompt_len: ms[0].promptLen,
          stride: 1, steps: ms[0].steps, prompt_rows: ms[0].promptRows };
      } catch (e2) { showError(e2, box); return; }
    }
    const [heads, rows, cols] = p.weights.shape;
    const tiles = [];
    for (let h = 0; h < heads; h++) {
      const values = all.subarray(h * rows * cols, (h + 1) * rows * cols);
      const m = { values, rows, cols, queryStart: p.query_start, promptLen: p.prompt_len, stride: p.stride, keys: [], chosen: [] };
      const canvas = heat(values, rows, cols, { rowPx: Math.min(4, 140 / rows), cls: "heat tile" });
      Object.assign(canvas.dataset, { layer, head: h });
      const selectedRow = Math.floor((p.prompt_len - 1 + step - p.query_start) / p.stride);
      tiles.push(el("figure", { class: "tile", data: { head: h }, title: `layer ${layer}, head ${h}: click for its pattern`,
        onclick: () => pick(layer, h) }, el("figcaption", { text: `H${h}` }),
      el("div", { class: "heat-frame" }, canvas, rowMark(rows, selectedRow), hover(canvas, (r, c) => describeCell(m, r, c)))));
    }
    box.replaceChildren(el("p", { class: "note", text: `Layer ${layer}, every head (${p.prompt_rows ? "prompt rows, then " : ""}`
      + `${p.steps} steps × ${p.stride > 1 ? `keys, each pixel the max of ${p.stride} × ${p.stride}` : "keys"}); click one for its pattern.` }),
    el("div", { class: "tiles", id: v.id(`layer-heads-${layer}`) }, ...tiles));
  }

  // the controls and holders added below the grid: small multiples of a layer, picked heads' patterns
  function layerControls(v, d, pick) {
    const layers = (d.attention && d.attention.layers) || [];
    v.heads = d.attention ? d.attention.heads : 0;
    const box = el("div", { id: v.id("layer-heads") });
    const choose = el("select", { id: v.id("layer-multiples"), title: "every head of one layer, side by side" },
      el("option", { value: "", text: "all heads of a layer: none" }), ...layers.map((l) => el("option", { value: l, text: `all heads of layer ${l}` })));
    if (v.multiplesLayer !== undefined && v.multiplesLayer !== null) choose.value = String(v.multiplesLayer);
    const draw = () => {
      v.multiplesLayer = choose.value === "" ? null : Number(choose.value);
      if (v.multiplesLayer === null) box.replaceChildren(); else layerHeads(v, d.step, v.multiplesLayer, box, pick);
    };
    choose.addEventListener("change", draw);
    if (v.multiplesLayer !== undefined && v.multiplesLayer !== null) draw();
    return el("div", { class: "layer-multiples" }, el("div", { class: "controls" }, choose), box);
  }

  // ---- mean / max over heads: layers × keys -------------------------------------------------------
  async function overHeads(v, step) {
    const { answer: o } = await read(v, [`sequences/${v.seq}/steps/${step}/over_heads/packed`, `sequences/${v.seq}/steps/${step}/over_heads`]);
    if (!o) return null;
    const cols = o.keys.length, rows = o.layers.length;
    const take = (x) => (x && x.data ? unpack(x) : fromRows(x, cols));
    return { layers: o.layers, keys: o.keys, rows, cols, mean: take(o.mean), max: take(o.max) };
  }

  function overHeadsImage(v, o, which) {
    if (!o) return el("p", { class: "note", text: "not available" });
    const values = o[which];
    const canvas = heat(values, o.rows, o.cols, { rowPx: 10, cls: "heat over-heads-image" });
    canvas.id = v.id(`attention-${which}`);
    canvas.dataset.which = which;
    canvas.lmtraceLayers = o.layers;
    const card = hover(canvas, (r, c) => {
      const w = values[r * o.cols + c];  // c: a key (cellAt)
      return Number.isFinite(w) ? `layer ${o.layers[r]}, key ${c} ${q(o.keys[c])}: ${which} over heads ${Number(w).toFixed(4)}` : null;
    });
    return el("div", {}, el("p", { class: "note", text: `Rows: layers ${o.layers[0]}–${o.layers[o.layers.length - 1]}; columns: the ${o.cols} keys; `
      + `each key's weight ${which === "mean" ? "averaged" : "maximised"} over the heads. Hover for a value.` }),
    el("div", { class: "heat-frame" }, canvas, card));
  }

  // ---- the logit lens over the steps: layers × steps ------------------------------------------------
  const LENS_W = 46, LENS_H = 17;
  // a column per step: wide enough for its top-1 token's text, or on a long sequence a thin coloured one (hover for the text)
  const lensWidth = (g) => (g.steps > 160 ? 8 : LENS_W);
  async function lensGrid(v, step) {
    const box = el("div", { class: "panel lens-grid-panel", id: v.id("lens-grid-panel") }, el("h2", { text: "Logit lens over the steps" }));
    let g;
    try { ({ answer: g } = await read(v, [`sequences/${v.seq}/lens`])); } catch (e) {
      box.appendChild(el("p", { class: "note", text: String(e.message || e) }));
      return box;
    }
    if (g.state === "none") { box.appendChild(el("p", { class: "note", text: "not captured in this run" })); return box; }
    if (g.state === "pending") { box.appendChild(el("p", { class: "note", text: g.note })); return box; }
    if (g.state !== "ready" || !Array.isArray(g.layers)) { box.appendChild(el("p", { class: "note", text: "not available" })); return box; }
    const W = lensWidth(g), rows = g.layers.length, cols = g.steps, canvas = el("canvas", { class: "lens-grid", id: v.id("lens-grid"),
      width: LEFT + cols * W, height: LENS_H * (rows + 1), data: { rows, cols } });
    const ctx = canvas.getContext("2d");
    // the cells are drawn once per sequence (text is slow to draw), then copied for each selected step
    if (!g.drawn) { g.drawn = el("canvas", { width: canvas.width, height: canvas.height }); lensCells(g.drawn.getContext("2d"), g, rows, cols); }
    ctx.drawImage(g.drawn, 0, 0);
    if (step >= 0 && step < cols) {
      ctx.strokeStyle = "#1b1f24"; ctx.lineWidth = 2;
      ctx.strokeRect(LEFT + step * W + 1, 1, W - 2, LENS_H * (rows + 1) - 2);
    }
    canvas.lmtraceLens = g;
    canvas.style.width = `${canvas.width}px`;
    canvas.style.height = `${canvas.height}px`;
    const at = (e) => {
      const rect = canvas.getBoundingClientRect();
      const x = e.clientX - rect.left - LEFT, y = e.clientY - rect.top - LENS_H;
      return [rows - 1 - Math.floor(y / LENS_H), Math.floor(x / W)];
    };
    const card = el("div", { class: "hover-card", role: "tooltip" });
    card.hidden = true;
    canvas.addEventListener("mousemove", (e) => {
      const [li, s] = at(e);
      if (li < 0 || li >= rows || s < 0 || s >= cols) { card.hidden = true; return; }
      card.textContent = `layer ${g.layers[li]}, step ${s} (chose ${q(g.chosen[s])}): top-1 ${q(g.top1[li][s])} p ${fmt(g.prob[li][s], 4)}`;
      card.hidden = false;
      const frame = canvas.parentElement.getBoundingClientRect();
      card.style.left = `${e.clientX - frame.left + 12}px`;
      card.style.top = `${e.clientY - frame.top + 14}px`;
    });
    canvas.addEventListener("mouseleave", () => { card.hidden = true; });
    canvas.addEventListener("click", (e) => { const [, s] = at(e); if (v.select && s >= 0 && s < cols) v.select(s); });
    box.append(el("p", { class: "note", text: "Each cell: the lens's top-1 token at that layer (rows, last layer on top) and step (columns), "
      + "coloured by its probability (the strip's scale). Click a column to select its step." }),
    el("div", { class: "scroll" }, el("div", { class: "heat-frame" }, canvas, card)));
    return box;
  }
  const LEFT = 34;
  function lensCells(ctx, g, rows, cols) {
    const W = lensWidth(g), text = W >= 30;
    ctx.font = "11px ui-monospace, SFMono-Regular, Menlo, monospace";
    ctx.textBaseline = "middle";
    ctx.fillStyle = "#57606a";
    for (let s = 0; s < cols && text; s++) ctx.fillText(clip(ctx, `${s}:${shownToken(g.chosen[s])}`, W - 3), LEFT + s * W + 2, LENS_H / 2);
    // the last layer on top, as the model's output sits above its layers
    for (let r = 0; r < rows; r++) {
      const li = rows - 1 - r, y = LENS_H * (r + 1);
      ctx.fillStyle = "#57606a";
      ctx.fillText(`L${g.layers[li]}`, 2, y + LENS_H / 2);
      for (let s = 0; s < cols; s++) {
        const p = g.prob[li][s];
        ctx.fillStyle = probColour(p);
        ctx.fillRect(LEFT + s * W, y, W - 1, LENS_H - 1);
        ctx.fillStyle = p !== null && (p > 0.85 || p < 0.1) ? "#fff" : "#1b1f24";
        if (text) ctx.fillText(clip(ctx, shownToken(g.top1[li][s]), W - 4), LEFT + s * W + 2, y + LENS_H / 2);
      }
    }
  }
  function clip(ctx, text, width) {
    if (ctx.measureText(text).width <= width) return text;
    let t = text;
    while (t.length > 1 && ctx.measureText(t + "…").width > width) t = t.slice(0, -1);
    return t + "…";
  }

  // ---- one head's DLA over the steps -----------------------------------------------------------------
  async function headDla(v, step, layer, head, box) {
    box.replaceChildren(el("p", { class: "note", text: "loading…" }));
    let values, chosen = [];
    try {
      ({ values, chosen } = (await read(v, [`sequences/${v.seq}/head_dla/${layer}/${head}`])).answer);
    } catch (e) { // the report: from the steps it embeds
      const li = (v.layers || []).indexOf(layer);
      values = [];
      for (const s of v.steps || []) {
        try { const d = await v.source(`sequences/${v.seq}/steps/${s}`); values[s] = d.head_dla.values[li >= 0 ? li : layer][head]; } catch (_) { values[s] = null; }
      }
      if (!values.some((x) => x !== null && x !== undefined)) { showError(e, box); return; }
    }
    const n = values.length, max = Math.max(1e-9, ...values.map((x) => Math.abs(x || 0)));
    const W = 14, H = 60, canvas = el("canvas", { class: "dla-steps", id: v.id("dla-over-steps-canvas"), width: n * W, height: H,
      data: { layer, head, rows: 1, cols: n } });
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#d0d7de"; ctx.fillRect(0, H / 2, n * W, 1);
    values.forEach((x, s) => {
      if (x === null || x === undefined) return;
      ctx.fillStyle = signedColour(x, max);
      const h = (Math.abs(x) / max) * (H / 2 - 2);
      ctx.fillRect(s * W + 2, x >= 0 ? H / 2 - h : H / 2 + 1, W - 4, Math.max(1, h));
    });
    if (step >= 0 && step < n) { ctx.strokeStyle = "#1b1f24"; ctx.strokeRect(s0(step, W), 0.5, W - 1, H - 1); }
    canvas.lmtraceValues = Float32Array.from(values, (x) => (x === null || x === undefined ? NaN : x));
    canvas.style.width = `${n * W}px`;
    const card = hover(canvas, (r, s) => (Number.isFinite(canvas.lmtraceValues[s])
      ? `step ${s}${chosen[s] !== undefined ? ` (chose ${q(chosen[s])})` : ""}: DLA ${Number(canvas.lmtraceValues[s]).toFixed(4)}` : null));
    canvas.addEventListener("click", (e) => { const [, s] = canvas.lmtraceAt(e); if (v.select && s >= 0 && s < n) v.select(s); });
    box.replaceChildren(el("h3", { text: `Layer ${layer}, head ${head}: direct logit attribution over the steps` }),
      el("p", { class: "note", text: "Bars: logit(chosen) − logit(runner-up) this head adds at each step (blue positive, orange negative); the selected step is outlined. Click a bar to select its step." }),
      el("div", { class: "scroll" }, el("div", { class: "heat-frame" }, canvas, card)));
  }
  const s0 = (s, W) => s * W + 0.5;

  // the log colour scale switched: the pictures drawn are painted again from the values they keep
  if (typeof document !== "undefined" && document.addEventListener) document.addEventListener("change", (e) => {
    if (!e.target || !/log-scale$/.test(e.target.id || "")) return;
    for (const c of document.querySelectorAll("canvas.heat")) {
      if (!c.lmtraceValues) continue;
      paint(c, c.lmtraceValues, e.target.checked);
    }
  });

  return { unpack, fromRows, weightRgb, heat, headMatrix, headPattern, layerHeads, layerControls, overHeads, overHeadsImage,
    lensGrid, headDla };
})();
