// lmtrace serve: what a comparison's verdict names, drawn. For one pair of sequences (compare's page) or
// an intervention child's sequence against its parent (the child's page): each per-layer figure of
// `lmtrace compare` (per_layer.parquet: attention JS, norms, lens changes, DLA deltas) as a layer × step
// heatmap, the attention JS of every head as small multiples (one head × step heatmap per layer), and
// the first divergence linked to both runs' token views. Heatmaps are drawn on canvas; each keeps its
// numbers (data-values) and names a cell's under the pointer. Texts from runs are inserted as text.
"use strict";

window.lmtraceCompare = (() => {
  const { el, put, signedColour } = window.lmtraceView;
  const enc = encodeURIComponent;
  // a cell without a value: hatched, as the tables' empty boxes are (a value 0 is white or light grey)
  let hatch = null;
  function noValue(g) {
    if (!hatch) {
      const c = document.createElement("canvas");
      c.width = c.height = 6;
      const h = c.getContext("2d");
      h.fillStyle = "#f6f8fa"; h.fillRect(0, 0, 6, 6);
      h.strokeStyle = "#b8c0c8"; h.lineWidth = 1;
      h.beginPath(); h.moveTo(0, 6); h.lineTo(6, 0); h.stroke();
      hatch = c;
    }
    return g.createPattern(hatch, "repeat");
  }
  const OUTLINE = "#cf222e"; // the first divergence's step

  // unsigned values: white → dark blue by v / max (the attention grid's scale)
  function blue(v, max) {
    const t = Math.min(1, Math.max(0, v / (max || 1)));
    const c = [255 + (8 - 255) * t, 255 + (48 - 255) * t, 255 + (107 - 255) * t].map(Math.round);
    return `rgb(${c[0]},${c[1]},${c[2]})`;
  }

  const finite = (rows) => rows.flat().filter((v) => v !== null && v !== undefined && Number.isFinite(v));

  // A legend: the colour ramp from its low to its high end, with the values at both ends.
  function legend(signed, max) {
    if (max <= 1e-12) return el("span", { class: "legend" }, el("span", { text: "every value is 0" }));
    const c = el("canvas", { class: "legend-ramp", width: "120", height: "10" });
    const g = c.getContext("2d");
    for (let x = 0; x < 120; x++) {
      const v = signed ? (x / 119) * 2 * max - max : (x / 119) * max;
      g.fillStyle = signed ? signedColour(v, max) : blue(v, max);
      g.fillRect(x, 0, 1, 10);
    }
    return el("span", { class: "legend" }, el("span", { text: signed ? fmtNum(-max) : "0" }), c, el("span", { text: fmtNum(max) }));
  }

  const fmtNum = (v) => (v === null || v === undefined ? "no value" : Math.abs(v) >= 0.01 || v === 0 ? Number(v).toFixed(3) : Number(v).toExponential(2));

  // A heatmap of values[row][col] on canvas: rows labelled by rowLabels, columns are steps. opts:
  // signed, max (shared scale), width (px available), mark (a column to outline), onPick(row, col).
  function heatmap(values, rowLabels, opts) {
    const nr = values.length, nc = nr ? values[0].length : 0;
    const labelW = opts.labelW || 46, topH = 14;
    const cw = Math.max(6, Math.min(36, Math.floor(((opts.width || 360) - labelW) / Math.max(1, nc))));
    const ch = Math.max(5, Math.min(18, opts.cellH || 16));
    const W = labelW + cw * nc, H = topH + ch * nr;
    const dpr = window.devicePixelRatio || 1;
    const canvas = el("canvas", { class: "heatmap", width: String(Math.ceil(W * dpr)), height: String(Math.ceil(H * dpr)),
      style: { width: `${W}px`, height: `${H}px` }, data: { values: JSON.stringify(values), rows: nr, cols: nc } });
    const g = canvas.getContext("2d");
    g.scale(dpr, dpr);
    const max = opts.max || Math.max(1e-12, ...finite(values).map(Math.abs));
    g.font = "10px system-ui, sans-serif";
    g.fillStyle = "#424a53";
    g.textBaseline = "middle";
    const every = Math.max(1, Math.ceil(22 / cw));
    for (let j = 0; j < nc; j += every) g.fillText(String(j), labelW + j * cw + 1, topH / 2);
    const rowEvery = Math.max(1, Math.ceil(10 / ch));
    for (let i = 0; i < nr; i++) {
      if (i % rowEvery === 0) { g.fillStyle = "#424a53"; g.fillText(rowLabels[i], 2, topH + i * ch + ch / 2); }
      for (let j = 0; j < nc; j++) {
        const v = values[i][j];
        g.fillStyle = v === null || v === undefined ? noValue(g) : opts.signed ? signedColour(v, max) : blue(v, max);
        g.fillRect(labelW + j * cw, topH + i * ch, cw - (cw > 8 ? 1 : 0), ch - (ch > 8 ? 1 : 0));
      }
    }
    if (opts.mark !== null && opts.mark !== undefined && opts.mark < nc) {
      g.strokeStyle = OUTLINE;
      g.lineWidth = 2;
      g.strokeRect(labelW + opts.mark * cw + 1, topH + 1, cw - 2, ch * nr - 2);
    }
    const cellAt = (e) => {
      const r = canvas.getBoundingClientRect();
      const x = e.clientX - r.left - labelW, y = e.clientY - r.top - topH;
      const i = Math.floor(y / ch), j = Math.floor(x / cw);
      return i >= 0 && i < nr && j >= 0 && j < nc ? [i, j] : null;
    };
    canvas.addEventListener("mousemove", (e) => {
      const c = cellAt(e);
      canvas.title = c ? `${rowLabels[c[0]]}, step ${c[1]}: ${fmtNum(values[c[0]][c[1]])}` : "";
    });
    if (opts.onPick) canvas.addEventListener("click", (e) => { const c = cellAt(e); if (c) opts.onPick(c[0], c[1]); });
    return { canvas, max };
  }

  // The links of a step to both runs' token views.
  function stepLinks(d, step) {
    return el("span", { class: "step-links" },
      el("a", { class: "link-a", href: `#/run/${enc(d.a)}/seq/${d.seq_a}/step/${step}`, text: `${d.a} · sequence ${d.seq_a} · step ${step}` }), " · ",
      el("a", { class: "link-b", href: `#/run/${enc(d.b)}/seq/${d.seq_b}/step/${step}`, text: `${d.b} · sequence ${d.seq_b} · step ${step}` }));
  }

  // The internals of one pair (an answer of /api/compare/pair or /api/runs/RUN/sequences/N/parent/internals) into `box`.
  function internals(box, d, labels) {
    const fd = d.first_divergence;
    const width = Math.max(260, Math.min(560, (box.clientWidth || 900) / 2 - 24));
    const picked = el("p", { class: "note picked-cell", text: "Click a cell for its numbers and links to both token views." });
    const pick = (name, rowLabel) => (i, j) =>
      put(picked, el("b", { text: `${name}, ${rowLabel(i)}, step ${j}: ` }), fmtNum(d.figures[name][i][j]), " — ", stepLinks(d, j));
    const first = fd
      ? el("p", { id: "first-divergence", data: { step: fd.step } }, el("b", { text: `first divergence at step ${fd.step}` }),
        ` (${fd.kind}${fd.explanation ? `: ${fd.explanation}` : ""}) — `, stepLinks(d, fd.step))
      : el("p", { id: "first-divergence", data: { step: "" } }, el("b", { text: "no divergence" }),
        ` over the ${d.steps} paired step${d.steps === 1 ? "" : "s"}: the tokens are the same; the figures below say what changed inside.`);
    const layerLabels = d.layers.map((l) => `L${l}`);
    const shownFigures = Object.keys(d.figures).filter((k) => d.has[k]);
    const figs = shownFigures.map((name) => {
      const signed = !["attn_js_mean", "resid_dist", "lens_changed"].includes(name);
      const h = heatmap(d.figures[name], layerLabels, { signed, width, mark: fd ? fd.step : null, onPick: pick(name, (i) => `layer ${d.layers[i]}`) });
      const panel = el("div", { class: "panel figure", data: { figure: name } },
        el("h4", { text: name }), el("p", { class: "note", text: d.meaning[name] }), h.canvas,
        el("div", {}, legend(signed, h.max), el("span", { class: "note", text: " layer (rows) × step (columns)" })));
      // PNG and CSV like every panel of the token view; the CSV: one row per layer, one column per step
      window.lmtraceGrid.exportBar(panel, `${d.a}-vs-${d.b}-seq${d.seq_a}-${name}`, () => [
        ["layer", ...d.figures[name][0].map((_, j) => `step ${j}`)],
        ...d.figures[name].map((row, i) => [d.layers[i], ...row.map((v) => v ?? "")])]);
      return panel;
    });
    const missing = Object.keys(d.figures).filter((k) => !d.has[k]);
    // every head of every layer: one head × step heatmap per layer, one colour scale for all
    const multiples = (values, cls, title, signed) => {
      const known = finite(values.flat());
      const max = Math.max(1e-12, ...known.map(Math.abs));
      const headLabels = values[0].map((_, h) => `H${h}`);
      const small = Math.max(120, Math.min(260, (box.clientWidth || 900) / Math.min(4, d.layers.length) - 20));
      const panel = el("div", { class: `head-multiples ${cls}` }, el("h4", { text: title }),
        el("div", {}, known.length ? legend(signed, max) : el("span", { class: "legend", text: "no value at any step" })),
        el("div", { class: "multiples" }, ...d.layers.map((layer, li) => {
          const h = heatmap(values[li], headLabels, { signed, max, width: small, cellH: 10, labelW: 30, mark: fd ? fd.step : null,
            onPick: (i, j) => put(picked, el("b", { text: `${title.split(":")[0]}, layer ${layer} head ${i}, step ${j}: ` }), fmtNum(values[li][i][j]), " — ", stepLinks(d, j)) });
          return el("div", { class: "multiple", data: { layer } }, el("div", { class: "note", text: `layer ${layer}` }), h.canvas);
        })));
      // the CSV: one row per layer, head and step
      window.lmtraceGrid.exportBar(panel, `${d.a}-vs-${d.b}-seq${d.seq_a}-${cls}`, () => [["layer", "head", "step", "value"],
        ...d.layers.flatMap((layer, li) => values[li].flatMap((row, h) => row.map((v, j) => [layer, h, j, v ?? ""])))]);
      return panel;
    };
    const heads = d.head_js ? multiples(d.head_js, "head-js", "attention JS per head (nats): one head × step heatmap per layer, one colour scale", false)
      : el("p", { class: "note", text: "no per-head attention figures: a run has no attention captured" });
    const dla = d.head_dla_delta ? multiples(d.head_dla_delta, "head-dla", "head DLA, B − A: each head's direct logit attribution to logit(chosen) − logit(runner-up), at steps where both sides' final top-2 are the same tokens (hatched elsewhere)", true)
      : null;
    put(box, el("h3", { text: labels.title }), first,
      el("p", { class: "note", text: `Over the ${d.steps} paired step${d.steps === 1 ? "" : "s"} (the contexts are identical up to and including the first divergence), B − A where signed (A: ${d.a}, B: ${d.b}); the first divergence's step is outlined.` }),
      picked, el("div", { class: "figures" }, ...figs), heads, dla,
      missing.length ? el("p", { class: "note", text: `no value in this pair (not captured by both runs, or masked): ${missing.join(", ")}` }) : null);
  }

  return { internals, heatmap };
})();
