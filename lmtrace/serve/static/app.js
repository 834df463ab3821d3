// lmtrace serve: the frontend. Plain DOM, no framework, nothing from the network.
// Every text that comes from a run (token texts, prompts, metadata, ids) is inserted with
// textContent / createTextNode, never as markup; the server's content security policy forbids
// inline scripts as a second line of defence.
"use strict";

(() => {
  const app = document.getElementById("app");
  const crumbs = document.getElementById("crumbs");
  let generation = 0; // bumped on every navigation: answers for an older view are dropped
  let refreshTimer = null;
  let keyHandler = null;

  // ---- helpers (the token view's, shared with the report: tokenview.js) ---------------------------
  const { el, put, fmt, fmtP, shown, tokenBox, MISSING, signedColour, absMax, tokenView } = window.lmtraceView;
  const REFRESH_MS = 5000; // a running run's list and sequence pages ask again this often

  async function api(path) {
    const r = await fetch(path, { credentials: "same-origin", headers: { Accept: "application/json" } });
    let body;
    try { body = await r.json(); } catch (e) { body = { error: `${r.status} ${r.statusText}` }; }
    if (!r.ok) throw new Error(body.error || `${r.status} ${r.statusText}`);
    return body;
  }

  const enc = encodeURIComponent;
  const runUrl = (id) => `/api/runs/${enc(id)}`;

  function setCrumbs(...items) {
    crumbs.replaceChildren(...items.map((it) => (it.href ? el("a", { href: it.href, text: it.text }) : el("span", { text: it.text }))));
  }

  function showError(err, where) {
    (where || app).replaceChildren(el("p", { class: "error", text: String(err.message || err) }));
  }

  function parseHash() {
    const raw = location.hash.replace(/^#/, "") || "/";
    const [path, query] = raw.split("?");
    const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
    return { parts, params: new URLSearchParams(query || "") };
  }

  // A run's status as the runs list and its own pages show it (the server's one status, with `live`)
  function statusLabel(row) {
    let label = String(row.status || "?");
    if (row.live === true) label += " · live";
    else if (row.live === false) label += " · no live writer";
    return label;
  }
  const statusBase = (row) => String(row.status || "").split(" ")[0];
  const isRunning = (row) => statusBase(row) === "running";

  function statusCell(row) {
    return el("td", { class: `status-${statusBase(row)}`, text: statusLabel(row), title: row.error || null });
  }

  // ---- runs list -------------------------------------------------------------------------------
  async function runsView(params, gen) {
    setCrumbs({ text: "runs" });
    const q = params.get("q") || "", kind = params.get("kind") || "", status = params.get("status") || "",
      model = params.get("model") || "";
    const search = el("input", { type: "search", placeholder: "run id or prompt text", value: q, id: "run-search" });
    const kindSel = el("select", { id: "kind-filter" }, ...["", "generate", "intervene"].map((k) =>
      el("option", { value: k, text: k || "any kind" })));
    const statusSel = el("select", { id: "status-filter" }, ...["", "complete", "running", "killed", "interrupted", "failed", "damaged"].map((s) =>
      el("option", { value: s, text: s || "any status" })));
    const modelSel = el("select", { id: "model-filter" }, el("option", { value: "", text: "any model" }));
    kindSel.value = kind; statusSel.value = status;
    const apply = () => {
      const p = new URLSearchParams();
      if (search.value) p.set("q", search.value);
      if (kindSel.value) p.set("kind", kindSel.value);
      if (statusSel.value) p.set("status", statusSel.value);
      if (modelSel.value) p.set("model", modelSel.value);
      location.hash = `#/?${p}`;
    };
    search.addEventListener("keydown", (e) => { if (e.key === "Enter") apply(); });
    for (const s of [kindSel, statusSel, modelSel]) s.addEventListener("change", apply);
    const body = el("div", {}, el("p", { class: "note", text: "loading…" }));
    app.replaceChildren(el("h1", { text: "Runs" }),
      el("div", { class: "controls" }, search, el("button", { onclick: apply, text: "search" }), kindSel, statusSel, modelSel), body);

    const load = async () => {
      const p = new URLSearchParams({ q, kind, status, model });
      const [all, data] = await Promise.all([api("/api/runs"), api(`/api/runs?${p}`)]);
      if (gen !== generation) return;
      const models = [...new Set(all.runs.map((r) => r.model).filter(Boolean))].sort();
      modelSel.replaceChildren(el("option", { value: "", text: "any model" }), ...models.map((m) => el("option", { value: m, text: m })));
      modelSel.value = model;
      if (!data.runs.length) {
        body.replaceChildren(el("p", { class: "note", text: all.runs.length ? "no run matches" : `no runs in ${data.runs_dir}` }));
        return;
      }
      const head = el("tr", {}, el("th", { text: "" }), ...["run id", "kind", "status", "model", "sequences", "tokens", "parent", "children", "created"].map((h) =>
        el("th", { text: h, class: ["sequences", "tokens"].includes(h) ? "num" : null })));
      const picked = [];
      const compareBtn = el("button", { id: "compare-runs", disabled: "", text: "compare the two ticked runs" });
      compareBtn.addEventListener("click", () => { location.hash = `#/compare/${enc(picked[0])}/${enc(picked[1])}`; });
      const tick = (id, box) => {
        const i = picked.indexOf(id);
        if (box.checked && i < 0) picked.push(id);
        if (!box.checked && i >= 0) picked.splice(i, 1);
        while (picked.length > 2) {
          const old = picked.shift();
          const other = body.querySelector(`input.pick[data-run="${CSS.escape(old)}"]`);
          if (other) other.checked = false;
        }
        compareBtn.disabled = picked.length !== 2;
      };
      const rows = data.runs.map((r) => el("tr", { class: "run-row", data: { run: r.run_id } },
        el("td", {}, el("input", { type: "checkbox", class: "pick", data: { run: r.run_id }, title: "tick two runs to compare them",
          onchange: (e) => tick(r.run_id, e.target) })),
        el("td", {}, el("a", { href: `#/run/${enc(r.run_id)}`, text: r.run_id }), runAliases(r)),
        el("td", { text: r.kind || MISSING }), statusCell(r), el("td", { text: r.model || MISSING }),
        el("td", { class: "num", text: r.sequences ?? MISSING }), el("td", { class: "num", text: r.tokens ?? MISSING }),
        el("td", {}, r.parent_id ? el("a", { href: `#/run/${enc(r.parent_id)}`, text: r.parent_id }) : MISSING),
        el("td", { text: r.children.length ? r.children.join(", ") : MISSING }), el("td", { class: "created", text: r.created || MISSING })));
      body.replaceChildren(el("div", { class: "table-scroll" }, el("table", { class: "list", id: "runs" }, el("thead", {}, head), el("tbody", {}, ...rows))),
        el("div", { class: "controls" }, compareBtn));
      if (data.runs.some(isRunning)) {
        refreshTimer = setTimeout(() => { if (gen === generation) load().catch((e) => showError(e, body)); }, REFRESH_MS);
      }
    };
    await load().catch((e) => showError(e, body));
  }

  // Other names of a run: the symlinks to it (listed once, on its row), the id its manifest gives a copy
  function runAliases(r) {
    const notes = [];
    if (r.links && r.links.length) notes.push(`also linked as ${r.links.join(", ")}`);
    if (r.manifest_run_id) notes.push(`its manifest names it ${r.manifest_run_id}`);
    return notes.length ? el("div", { class: "note aliases", text: notes.join(" · ") }) : null;
  }

  // ---- one run: header and its sequences ------------------------------------------------------
  function runHeader(info) {
    const items = [["status", statusLabel(info)], ["kind", info.kind], ["model", info.model],
      ["sequences", info.sequences], ["layers × heads", info.layers ? `${info.layers.length} × ${info.heads}` : null],
      ["attention", info.attention || "not captured"], ["lens", info.lens], ["created", info.created]];
    const meta = el("div", { class: "meta" }, ...items.filter(([, v]) => v !== null && v !== undefined).map(([k, v]) =>
      el("span", {}, el("b", { text: `${k}: ` }), String(v))));
    if (info.edits) meta.appendChild(el("span", {}, el("b", { text: "edits: " }), el("code", { id: "edits-label", text: info.edits.label || MISSING })));
    if (info.parent_id) meta.appendChild(el("span", {}, el("b", { text: "parent: " }), el("a", { href: `#/run/${enc(info.parent_id)}`, text: info.parent_id })));
    if (info.manifest_run_id) meta.appendChild(el("span", { class: "aliases" }, el("b", { text: "manifest id: " }), info.manifest_run_id));
    meta.id = "run-meta";
    meta.dataset.status = info.status || "";
    return meta;
  }

  async function runView(runId, params, gen) {
    setCrumbs({ text: "runs", href: "#/" }, { text: runId });
    const info = await api(runUrl(runId));
    if (gen !== generation) return;
    const title = el("h1", { text: runId });
    if (info.damaged) {
      app.replaceChildren(title, el("p", { class: "error", id: "damaged", text: info.damaged }));
      return;
    }
    const q = params.get("q") || "", sort = params.get("sort") || "index", page = Number(params.get("page") || 0),
      by = params.get("by") || "";
    const search = el("input", { type: "search", placeholder: "prompt, generated text or metadata", value: q, id: "seq-search" });
    const sortSel = el("select", { id: "seq-sort" }, ...[["index", "in order"], ["lowest_prob", "lowest-probability token"],
      ["highest_entropy", "highest entropy"], ["length", "longest"]].map(([v, t]) => el("option", { value: v, text: `sort: ${t}` })));
    sortSel.value = sort;
    const go = (p) => {
      const ps = new URLSearchParams();
      if (search.value) ps.set("q", search.value);
      if (sortSel.value !== "index") ps.set("sort", sortSel.value);
      if (p) ps.set("page", String(p));
      if (groupBy.value) ps.set("by", groupBy.value);
      location.hash = `#/run/${enc(runId)}?${ps}`;
    };
    const groupBy = window.lmtraceGroups.control(api, runId, by, () => go(page));
    const groupsBox = by ? el("div", { id: "groups-box" }) : null;
    search.addEventListener("keydown", (e) => { if (e.key === "Enter") go(0); });
    sortSel.addEventListener("change", () => go(0));
    const body = el("div", {}, el("p", { class: "note", text: "loading…" }));
    const running = info.status !== "complete" ? el("p", { class: "note", text: `This run is ${info.status}: it is shown up to its last committed block.` }) : null;
    put(app, title, runHeader(info), running,
      el("div", { class: "controls" }, search, el("button", { onclick: () => go(0), text: "search" }), sortSel, groupBy), groupsBox, body);
    if (by) window.lmtraceGroups.view(api, runId, by, groupsBox, () => gen === generation);

    const data = await api(`${runUrl(runId)}/sequences?${new URLSearchParams({ page, q, sort })}`);
    if (gen !== generation) return;
    const pager = el("div", { class: "pager" },
      el("button", { disabled: data.page <= 0 ? "" : null, onclick: () => go(data.page - 1), text: "‹ previous" }),
      el("span", { id: "page-label", text: `page ${data.page + 1} of ${data.pages} · ${data.total} sequence${data.total === 1 ? "" : "s"}` }),
      el("button", { disabled: data.page >= data.pages - 1 ? "" : null, onclick: () => go(data.page + 1), text: "next ›" }));
    const metaCols = data.rows.length ? Object.keys(data.rows[0].metadata) : [];
    const head = el("tr", {}, ...["#", "prompt", "generated", ...metaCols, "tokens", "lowest p", "highest entropy", "stop"].map((h) =>
      el("th", { text: h, class: ["#", "tokens", "lowest p", "highest entropy"].includes(h) ? "num" : null })));
    const rows = data.rows.map((r) => el("tr", { class: "clickable seq-row", data: { seq: r.sequence },
      onclick: () => { location.hash = `#/run/${enc(runId)}/seq/${r.sequence}`; } },
      el("td", { class: "num" }, el("a", { href: `#/run/${enc(runId)}/seq/${r.sequence}`, text: r.sequence })),
      el("td", { class: "clip prompt", text: shown(r.prompt), title: r.prompt }),
      el("td", { class: "clip", text: shown(r.generated_text), title: r.generated_text }),
      ...metaCols.map((c) => el("td", { text: r.metadata[c] ?? MISSING })),
      el("td", { class: "num", text: r.generated_len ?? MISSING }), el("td", { class: "num", text: fmtP(r.min_prob) }),
      el("td", { class: "num", text: fmt(r.max_entropy) }), el("td", { text: r.stop_reason || MISSING })));
    body.replaceChildren(pager, data.rows.length ? el("div", { class: "table-scroll" },
      el("table", { class: "list", id: "sequences" }, el("thead", {}, head), el("tbody", {}, ...rows)))
      : el("p", { class: "note", text: "no sequence matches" }));
    for (const sw of info.sweeps || []) {
      const box = el("div", { class: "sweep", data: { sweep: sw.id } }, el("p", { class: "note", text: "loading…" }));
      app.appendChild(box);
      api(`${runUrl(runId)}/sweeps/${enc(sw.id)}`).then((d) => { if (gen === generation) sweepView(runId, d, box); })
        .catch((e) => showError(e, box));
    }
  }

  // ---- a sweep: one heatmap per metric, a cell's rows ----------------------------------------------
  function sweepView(runId, d, box) {
    const cellBox = el("div", { class: "sweep-cell" });
    const figs = d.metrics.map((m) => sweepMetric(runId, d, m, box, cellBox));
    box.replaceChildren(el("h2", { text: `Sweep ${d.id}: ${d.over || "?"}${d.sae ? ` of ${d.sae}` : ""}, edit ${d.edit || "?"}` }),
      el("p", { class: "note", text: `Each cell: its ${d.meaning} (effects.zarr; the terminal's ranking). Click a cell for its rows.` }),
      el("div", { class: "sweep-figs" }, ...figs), cellBox);
  }

  // the value of a nested array at one index per dimension
  const at = (values, idx) => idx.reduce((v, i) => (v === null || v === undefined ? null : v[i]), values);

  // One metric's heatmap. Over more than two coordinates (e.g. layer × head × position) the heatmap
  // is one pair of them, chosen above it, at the chosen value of each other coordinate.
  function sweepMetric(runId, d, m, box, cellBox) {
    const dims = m.dims;
    const state = { row: dims.length === 1 ? null : dims[0], col: dims[dims.length === 1 ? 0 : 1], fixed: {} };
    for (const dim of dims) state.fixed[dim] = 0; // index into m.coords[dim]
    const gridBox = el("div", {});
    const controls = el("div", { class: "controls sweep-axes" });
    function drawControls() {
      if (dims.length <= 2) return;
      const axis = (which) => {
        const sel = el("select", { class: `axis-${which}`, data: { axis: which } }, ...dims.map((x) => el("option", { value: x, text: x })));
        sel.value = state[which];
        sel.addEventListener("change", () => {
          const other = which === "row" ? "col" : "row";
          if (sel.value === state[other]) state[other] = state[which]; // swap rather than draw one axis twice
          state[which] = sel.value;
          drawControls(); draw();
        });
        return sel;
      };
      const fixedSels = dims.filter((x) => x !== state.row && x !== state.col).map((x) => {
        const sel = el("select", { class: "axis-fixed", data: { dim: x } }, ...m.coords[x].map((c, i) => el("option", { value: String(i), text: `${x} ${c}` })));
        sel.value = String(state.fixed[x]);
        sel.addEventListener("change", () => { state.fixed[x] = Number(sel.value); draw(); });
        return sel;
      });
      controls.replaceChildren("rows ", axis("row"), " columns ", axis("col"), " at ", ...fixedSels);
    }
    function draw() {
      const rowDim = state.row, colDim = state.col;
      const rowIdx = rowDim ? m.coords[rowDim].map((_, i) => i) : [null];
      const index = (i, j) => dims.map((x) => (x === rowDim ? i : x === colDim ? j : state.fixed[x]));
      const grid = rowIdx.map((i) => m.coords[colDim].map((_, j) => at(m.values, dims.length === 1 ? [j] : index(i, j))));
      const fixedCoords = Object.fromEntries(dims.filter((x) => x !== rowDim && x !== colDim).map((x) => [x, m.coords[x][state.fixed[x]]]));
      const max = absMax(grid.flat());
      const label = (dim, i) => (m.labels && m.labels[dim] ? m.labels[dim][i] : null); // "feature 12 (sae-l2)"
      const head = el("tr", {}, el("th", { text: rowDim ? `${rowDim} \\ ${colDim}` : colDim }),
        ...m.coords[colDim].map((c, j) => el("th", { text: label(colDim, j) || String(c) })));
      const rows = grid.map((row, i) => el("tr", {}, el("th", { text: rowDim ? label(rowDim, i) || `${rowDim} ${m.coords[rowDim][i]}` : "" }),
        ...row.map((v, j) => {
          const coords = { ...fixedCoords, [colDim]: m.coords[colDim][j] };
          if (rowDim) coords[rowDim] = m.coords[rowDim][i];
          const td = el("td", { class: "cell", data: { value: v === null ? "" : v, ...coords },
            title: `${Object.entries(coords).map(([k, x]) => (k === colDim && label(k, j)) || (k === rowDim && label(k, i)) || `${k} ${x}`).join(", ")}: mean effect ${v === null ? "not measured" : v}`,
            style: { background: v === null ? "#eaeef2" : signedColour(v, max), color: Math.abs(v || 0) / max > 0.6 ? "#fff" : "#1b1f24" } },
          v === null ? MISSING : Number(v).toPrecision(3));
          if (v !== null) td.addEventListener("click", () => {
            for (const n of box.querySelectorAll("td.cell.picked")) n.classList.remove("picked");
            td.classList.add("picked");
            loadSweepCell(runId, d.id, m.metric, coords, cellBox);
          });
          return td;
        })));
      gridBox.replaceChildren(window.lmtraceGrid.signedLegend("mean effect", signedColour, max),
        el("div", { class: "scroll" }, el("table", { class: "grid sweep-grid" }, el("thead", {}, head), el("tbody", {}, ...rows))));
    }
    drawControls();
    draw();
    const panel = el("div", { class: "panel sweep-metric", data: { metric: m.metric } },
      el("h3", { text: `${m.metric}${dims.length > 2 ? ` (${dims.join(" × ")})` : ""}` }), controls, gridBox);
    window.lmtraceGrid.exportBar(panel, `sweep-${d.id}-${m.metric}`);
    return panel;
  }

  async function loadSweepCell(runId, sweepId, metric, coords, box) {
    box.replaceChildren(el("p", { class: "note", text: "loading…" }));
    let c;
    try {
      c = await api(`${runUrl(runId)}/sweeps/${enc(sweepId)}/cell?${new URLSearchParams({ metric, ...coords })}`);
    } catch (e) { showError(e, box); return; }
    const max = absMax(c.rows.map((r) => r.effect));
    box.replaceChildren(el("h3", { text: `cell ${c.label || `(${c.component}) ${Object.entries(coords).map(([k, x]) => `${k} ${x}`).join(", ")}`} · ${metric}: ${c.n_rows} (sequence, step) rows${c.rows.length < c.n_rows ? `, first ${c.rows.length} shown` : ""}` }),
      el("table", { class: "list sweep-rows", data: { metric, ...coords } },
        el("thead", {}, el("tr", {}, ...["sequence", "step", "token", "value", "baseline", "effect"].map((h) =>
          el("th", { text: h, class: h === "token" ? null : "num" })))),
        el("tbody", {}, ...c.rows.map((r) => el("tr", { data: { seq: r.sequence, step: r.step } },
          el("td", { class: "num" }, el("a", { href: `#/run/${enc(runId)}/seq/${r.sequence}/step/${r.step}`, text: r.sequence })),
          el("td", { class: "num", text: r.step }), el("td", { class: "mono" }, tokenBox(r.token)),
          el("td", { class: "num", text: fmt(r.value, 4) }), el("td", { class: "num", text: fmt(r.baseline, 4) }),
          el("td", { class: "num eff", text: fmt(r.effect, 4), style: { background: signedColour(r.effect, max) } }))))));
  }

  // ---- two runs compared -----------------------------------------------------------------------------
  async function compareView(a, b, params, gen) {
    setCrumbs({ text: "runs", href: "#/" }, { text: `compare ${a} · ${b}` });
    app.replaceChildren(el("h1", { text: `${a} vs ${b}` }), el("p", { class: "note", text: "comparing… (reads both archives)" }));
    const d = await api(`/api/compare?${new URLSearchParams({ a, b })}`);
    if (gen !== generation) return;
    const pairs = d.pairs.map((p) => {
      const fd = p.first_divergence;
      return el("tr", { class: "pair-row", data: { pair: p.pair, first: fd ? fd.step : "" } },
        el("td", { class: "num", text: p.pair }),
        el("td", { class: "num" }, el("a", { href: `#/run/${enc(a)}/seq/${p.seq_a}`, text: p.seq_a })),
        el("td", { class: "num" }, el("a", { href: `#/run/${enc(b)}/seq/${p.seq_b}`, text: p.seq_b })),
        el("td", { class: "num first" }, fd ? el("a", { href: `#/compare/${enc(a)}/${enc(b)}?pair=${p.pair}`, text: fd.step, title: "this pair's internals, with links to both token views" }) : MISSING),
        el("td", { text: fd ? `${fd.kind}: ${fd.explanation || ""}` : "none" }),
        el("td", { class: "texts" }, el("span", { class: "common", text: shown(p.text.common) }),
          el("div", { class: "side a" }, el("b", { text: "A: " }), el("span", { class: "rest", text: shown(p.text.a) })),
          el("div", { class: "side b" }, el("b", { text: "B: " }), el("span", { class: "rest", text: shown(p.text.b) }))));
    });
    put(app, el("h1", { text: `${a} vs ${b}` }),
      el("p", { class: d.identical ? "verdict same" : "verdict", id: "verdict", text: d.verdict }),
      d.notes.length ? el("ul", { class: "note" }, ...d.notes.map((n) => el("li", { text: n }))) : null,
      el("h2", { text: `Pairs (${d.n_pairs}, ${d.pairing.method})` }),
      el("p", { class: "note", text: "The text both generated until the first divergence, then each run's own continuation." }),
      el("table", { class: "list", id: "pairs" }, el("thead", {}, el("tr", {}, ...["pair", "A seq", "B seq", "first divergence", "why", "texts"].map((h) =>
        el("th", { text: h })))), el("tbody", {}, ...pairs)));
    // one pair's internals: the one in the address, else the first that diverges, else the first
    const shownPair = params.has("pair") ? Number(params.get("pair")) : (d.pairs.find((p) => p.first_divergence) || d.pairs[0] || {}).pair;
    if (shownPair === undefined) return;
    const pairSel = el("select", { id: "pair-pick" }, ...d.pairs.map((p) => el("option", { value: String(p.pair),
      text: `pair ${p.pair}: A ${p.seq_a} · B ${p.seq_b}${p.first_divergence ? ` · diverges at step ${p.first_divergence.step}` : ""}` })));
    pairSel.value = String(shownPair);
    pairSel.addEventListener("change", () => { location.hash = `#/compare/${enc(a)}/${enc(b)}?pair=${pairSel.value}`; });
    const box = el("div", { class: "panel", id: "pair-internals" }, el("p", { class: "note", text: "loading…" }));
    app.append(el("h2", { text: "Inside the models" }), el("p", { class: "note", text: d.first_changed_layer === null ? "No internal figure changes in the paired steps."
      : `Internal figures change from layer ${d.first_changed_layer} on (per-layer rankings over every pair: \`lmtrace compare --json\`'s layers and heads).` }),
    el("div", { class: "controls" }, pairSel), box);
    api(`/api/compare/pair?${new URLSearchParams({ a, b, pair: shownPair })}`)
      .then((x) => { if (gen === generation) window.lmtraceCompare.internals(box, x, { title: `Pair ${x.pair}: A sequence ${x.seq_a}, B sequence ${x.seq_b}` }); })
      .catch((e) => showError(e, box));
  }

  // ---- one sequence: token strip and the selected step ----------------------------------------
  // A running run's page asks again every REFRESH_MS and redraws when more steps are committed or
  // its status changes (complete, killed, ...), keeping the selected token; it stops once the run
  // is no longer running.
  async function sequenceView(runId, seq, step, gen, params = new URLSearchParams()) {
    setCrumbs({ text: "runs", href: "#/" }, { text: runId, href: `#/run/${enc(runId)}` }, { text: `sequence ${seq}` });
    const load = () => Promise.all([api(runUrl(runId)), api(`${runUrl(runId)}/sequences/${seq}`)]);
    let [info, data] = await load();
    if (gen !== generation) return;
    let selected = step;
    // the view's state (picked heads, grid view, colour scale, numbers, grid cursor: tokenview.js's
    // v.state) lives in the address's query, so a link or a reload reopens it
    let viewState = Object.fromEntries(params);
    const address = () => {
      const q = new URLSearchParams(viewState).toString();
      return `#/run/${enc(runId)}/seq/${seq}/step/${selected}${q ? `?${q}` : ""}`;
    };
    const draw = () => {
      if (info.damaged) {
        app.replaceChildren(el("h1", { text: runId }), el("p", { class: "error", id: "damaged", text: info.damaged }));
        return;
      }
      const view = tokenView((path) => api(`${runUrl(runId)}/${path}`), data, {
        alive: () => gen === generation,
        onSelect: (s, push) => {
          selected = s;
          if (push) history.replaceState(null, "", address());
        },
        state: viewState,
        featureHref: (sae, f) => `#/run/${enc(runId)}/feature/${enc(sae)}/${f}`,
        onState: (st) => {
          viewState = st;
          if (selected !== null) history.replaceState(null, "", address());
        },
      });
      put(app, el("h1", { text: `${runId} · sequence ${seq}` }), runHeader(info),
        info.status !== "complete" ? el("p", { class: "note", id: "run-note", text: `This run is ${statusLabel(info)}: ${data.steps} committed step(s) shown`
          + (isRunning(info) ? "; the page adds new ones as they are committed." : ".") }) : null,
        el("h2", { text: "Prompt" }),
        data.prompt === null ? el("p", { id: "prompt" }, MISSING)
          : el("p", { class: "mono", id: "prompt", data: { source: data.prompt_source || "" }, text: data.prompt }),
        data.prompt_source === "tokens" ? el("p", { class: "note", text: "(its prompt tokens as the model read them: the prompt's own text is written when its batch finishes)" }) : null,
        el("h2", { text: "Tokens" }), view.legend, view.strip, view.detail);
      if (info.edits) {
        const against = el("div", { class: "panel", id: "against-parent" }, el("p", { class: "note", text: "loading…" }));
        app.insertBefore(against, view.detail);
        api(`${runUrl(runId)}/sequences/${seq}/parent`).then((d) => { if (gen === generation) parentPanel(runId, seq, d, against); })
          .catch((e) => showError(e, against));
      }
      if (keyHandler) document.removeEventListener("keydown", keyHandler);
      keyHandler = view.keydown;
      document.addEventListener("keydown", keyHandler);
      if (view.steps.length) view.select(selected !== null && view.steps.includes(selected) ? selected : view.steps[0], selected !== null);
    };
    draw();
    const poll = async () => {
      if (gen !== generation) return;
      let next;
      try { next = await load(); } catch (e) { next = null; } // a failed poll: try again at the next one
      if (gen !== generation) return;
      if (next) {
        const [i, d] = next;
        const changed = d.steps !== data.steps || d.tokens.length !== data.tokens.length || statusLabel(i) !== statusLabel(info)
          || d.prompt !== data.prompt;
        [info, data] = [i, d];
        if (changed) draw();
      }
      if (isRunning(info)) refreshTimer = setTimeout(poll, REFRESH_MS);
    };
    if (isRunning(info)) refreshTimer = setTimeout(poll, REFRESH_MS);
  }

  function parentPanel(runId, seq, d, box) {
    const max = absMax(d.rows.map((r) => r.logprob_shift));
    const parentCell = (r) => d.parent_found && r.parent !== null
      ? el("a", { href: `#/run/${enc(d.parent_id)}/seq/${seq}/step/${r.step}` }, tokenBox(r.parent)) : tokenBox(r.parent);
    put(box, el("h2", {}, "Against its parent ", el("a", { href: `#/run/${enc(d.parent_id)}/seq/${seq}`, text: d.parent_id })),
      el("p", {}, el("b", { text: "edits: " }), el("code", { text: d.label || MISSING }),
        ` · mode ${d.mode}` + (d.first_edited_step !== null && d.first_edited_step !== undefined ? ` · first edited step ${d.first_edited_step}` : "")),
      el("ul", { id: "interventions" }, ...d.interventions.map((e) => el("li", { class: "mono", text: JSON.stringify(e) }))),
      d.parent_found ? null : el("p", { class: "note", text: `the parent ${d.parent_id} is not in this runs directory` }),
      d.has_effects ? null : el("p", { class: "note", text: "this child has no effects.parquet (it was interrupted before finishing)" }),
      d.has_effects ? window.lmtraceGrid.signedLegend("logprob shift", signedColour, max) : null,
      el("p", { class: "note", text: "Rows where the tokens differ are marked. The logprob shift is the child's log-probability of the parent's token minus the parent's (effects.parquet), while the contexts are identical." }),
      el("table", { class: "list", id: "parent-steps" },
        el("thead", {}, el("tr", {}, ...["step", "parent", "child", "logprob shift", "KL top-k", "winner changed"].map((h) =>
          el("th", { text: h, class: ["parent", "child"].includes(h) ? null : "num" })))),
        el("tbody", {}, ...d.rows.map((r) => el("tr", { class: r.differs ? "differs" : null, data: { step: r.step } },
          el("td", { class: "num", text: r.step }), el("td", { class: "mono parent" }, parentCell(r)),
          el("td", { class: "mono child" }, tokenBox(r.child)),
          el("td", { class: "num shift", text: fmt(r.logprob_shift, 4), style: { background: r.logprob_shift === null ? null : signedColour(r.logprob_shift, max) } }),
          el("td", { class: "num", text: fmt(r.kl_parent_child_topk, 4) }),
          el("td", { class: "num", text: r.winner_changed === null ? MISSING : r.winner_changed ? "yes" : "no" }))))));
    window.lmtraceGrid.exportBar(box, `${runId}-seq${seq}-against-parent`);
    if (!d.parent_found) return;
    const inside = el("div", { id: "child-internals" }, el("p", { class: "note", text: "loading the internals… (compares both archives)" }));
    box.appendChild(inside);
    api(`${runUrl(runId)}/sequences/${seq}/parent/internals`)
      .then((x) => window.lmtraceCompare.internals(inside, x, { title: `Inside the models: ${x.b} against its parent ${x.a}` }))
      .catch((e) => showError(e, inside));
  }

  // ---- a feature of an SAE (features.js draws it, as the report does) ------------------------------
  async function featureView(runId, sae, feature, params, gen) {
    setCrumbs({ text: "runs", href: "#/" }, { text: runId, href: `#/run/${enc(runId)}` }, { text: `${sae} · feature ${feature}` });
    const q = new URLSearchParams();
    for (const k of ["top", "window", "positions"]) if (params.get(k)) q.set(k, params.get(k));
    const d = await api(`${runUrl(runId)}/features/${enc(sae)}/${enc(feature)}${q.toString() ? `?${q}` : ""}`);
    if (gen !== generation) return;
    const here = `#/run/${enc(runId)}/feature/${enc(sae)}/${enc(feature)}`;
    put(app, el("h1", { text: `${runId} · ${sae} · feature ${d.feature}` }),
      window.lmtraceFeatures.page(d, {
        // a prompt position's example opens its sequence (the token view selects generated steps)
        exampleHref: (s, step) => (step === null ? `#/run/${enc(runId)}/seq/${s}` : `#/run/${enc(runId)}/seq/${s}/step/${step}`),
        positionsHref: (positions) => `${here}?positions=${positions}`,
      }));
  }

  // ---- routing ---------------------------------------------------------------------------------
  async function route() {
    generation += 1;
    const gen = generation;
    clearTimeout(refreshTimer);
    if (keyHandler) { document.removeEventListener("keydown", keyHandler); keyHandler = null; }
    const { parts, params } = parseHash();
    try {
      if (parts[0] === "compare" && parts.length >= 3) {
        await compareView(parts[1], parts[2], params, gen);
      } else if (parts[0] === "run" && parts.length >= 2) {
        const runId = parts[1];
        if (parts[2] === "feature" && parts.length >= 5) {
          await featureView(runId, parts[3], parts[4], params, gen);
        } else if (parts[2] === "seq" && parts.length >= 4) {
          const step = parts[4] === "step" && parts.length >= 6 ? Number(parts[5]) : null;
          await sequenceView(runId, Number(parts[3]), step, gen, params);
        } else {
          await runView(runId, params, gen);
        }
      } else {
        await runsView(params, gen);
      }
    } catch (e) {
      if (gen === generation) showError(e);
    }
  }

  window.addEventListener("hashchange", route);
  route();
})();
