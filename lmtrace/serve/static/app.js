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

  // ---- helpers ---------------------------------------------------------------------------------
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
    for (const c of children) {
      if (c === null || c === undefined || c === false) continue;
      node.appendChild(typeof c === "string" || typeof c === "number" ? document.createTextNode(String(c)) : c);
    }
    return node;
  }

  async function api(path) {
    const r = await fetch(path, { credentials: "same-origin", headers: { Accept: "application/json" } });
    let body;
    try { body = await r.json(); } catch (e) { body = { error: `${r.status} ${r.statusText}` }; }
    if (!r.ok) throw new Error(body.error || `${r.status} ${r.statusText}`);
    return body;
  }

  const enc = encodeURIComponent;
  const runUrl = (id) => `/api/runs/${enc(id)}`;
  const fmt = (x, d = 3) => (x === null || x === undefined ? "–" : Number(x).toFixed(d));
  // a probability: fixed decimals, or 2 significant digits when it would read as 0
  const fmtP = (x, d = 3) => (x === null || x === undefined ? "–"
    : x !== 0 && Math.abs(x) < 0.5 * 10 ** -d ? Number(x).toExponential(1) : Number(x).toFixed(d));
  // newlines and tabs as visible marks, so one token stays on one line
  const shown = (t) => (t === null || t === undefined ? "" : String(t).replace(/\n/g, "↵").replace(/\t/g, "⇥"));

  function mix(a, b, t) { return a.map((x, i) => Math.round(x + (b[i] - x) * t)); }
  const ORANGE = [253, 184, 99], LIGHT = [247, 247, 247], BLUE = [146, 197, 222];
  // probability: orange (0) → light grey (0.5) → blue (1)
  function probColour(p) {
    if (p === null || p === undefined || Number.isNaN(p)) return "rgb(234,238,242)";
    const c = p < 0.5 ? mix(ORANGE, LIGHT, p / 0.5) : mix(LIGHT, BLUE, (p - 0.5) / 0.5);
    return `rgb(${c[0]},${c[1]},${c[2]})`;
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
  // signed values (effects, attributions): orange (negative) → light → blue (positive), by |v| / max
  function signedColour(v, max) {
    const t = Math.min(1, Math.abs(v || 0) / (max || 1));
    const c = (v || 0) >= 0 ? mix(LIGHT, [33, 102, 172], t) : mix(LIGHT, [230, 97, 1], t);
    return `rgb(${c[0]},${c[1]},${c[2]})`;
  }
  const absMax = (values) => Math.max(1e-12, ...values.filter((v) => v !== null && v !== undefined).map((v) => Math.abs(v)));

  // replaceChildren writes null as the text "null": leave absent parts out
  function put(node, ...children) { node.replaceChildren(...children.filter((c) => c !== null && c !== undefined && c !== false)); }

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

  function statusCell(row) {
    const base = String(row.status || "").split(" ")[0];
    let label = String(row.status || "?");
    if (row.live === true) label += " · live";
    else if (row.live === false) label += " · no live writer";
    return el("td", { class: `status-${base}`, text: label, title: row.error || null });
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
        el("td", {}, el("a", { href: `#/run/${enc(r.run_id)}`, text: r.run_id })),
        el("td", { text: r.kind || "–" }), statusCell(r), el("td", { text: r.model || "–" }),
        el("td", { class: "num", text: r.sequences ?? "–" }), el("td", { class: "num", text: r.tokens ?? "–" }),
        el("td", {}, r.parent_id ? el("a", { href: `#/run/${enc(r.parent_id)}`, text: r.parent_id }) : "–"),
        el("td", { text: r.children.length ? r.children.join(", ") : "–" }), el("td", { text: r.created || "–" })));
      body.replaceChildren(el("table", { class: "list", id: "runs" }, el("thead", {}, head), el("tbody", {}, ...rows)),
        el("div", { class: "controls" }, compareBtn));
      if (data.runs.some((r) => String(r.status).startsWith("running"))) {
        refreshTimer = setTimeout(() => { if (gen === generation) load().catch((e) => showError(e, body)); }, 5000);
      }
    };
    await load().catch((e) => showError(e, body));
  }

  // ---- one run: header and its sequences ------------------------------------------------------
  function runHeader(info) {
    const items = [["status", info.status], ["kind", info.kind], ["model", info.model],
      ["sequences", info.sequences], ["layers × heads", info.layers ? `${info.layers.length} × ${info.heads}` : null],
      ["attention", info.attention || "not captured"], ["lens", info.lens], ["created", info.created]];
    const meta = el("div", { class: "meta" }, ...items.filter(([, v]) => v !== null && v !== undefined).map(([k, v]) =>
      el("span", {}, el("b", { text: `${k}: ` }), String(v))));
    if (info.edits) meta.appendChild(el("span", {}, el("b", { text: "edits: " }), el("code", { id: "edits-label", text: info.edits.label || "–" })));
    if (info.parent_id) meta.appendChild(el("span", {}, el("b", { text: "parent: " }), el("a", { href: `#/run/${enc(info.parent_id)}`, text: info.parent_id })));
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
    const q = params.get("q") || "", sort = params.get("sort") || "index", page = Number(params.get("page") || 0);
    const search = el("input", { type: "search", placeholder: "prompt, generated text or metadata", value: q, id: "seq-search" });
    const sortSel = el("select", { id: "seq-sort" }, ...[["index", "in order"], ["lowest_prob", "lowest-probability token"],
      ["highest_entropy", "highest entropy"], ["length", "longest"]].map(([v, t]) => el("option", { value: v, text: `sort: ${t}` })));
    sortSel.value = sort;
    const go = (p) => {
      const ps = new URLSearchParams();
      if (search.value) ps.set("q", search.value);
      if (sortSel.value !== "index") ps.set("sort", sortSel.value);
      if (p) ps.set("page", String(p));
      location.hash = `#/run/${enc(runId)}?${ps}`;
    };
    search.addEventListener("keydown", (e) => { if (e.key === "Enter") go(0); });
    sortSel.addEventListener("change", () => go(0));
    const body = el("div", {}, el("p", { class: "note", text: "loading…" }));
    const running = info.status !== "complete" ? el("p", { class: "note", text: `This run is ${info.status}: it is shown up to its last committed block.` }) : null;
    put(app, title, runHeader(info), running,
      el("div", { class: "controls" }, search, el("button", { onclick: () => go(0), text: "search" }), sortSel), body);

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
      ...metaCols.map((c) => el("td", { text: r.metadata[c] ?? "–" })),
      el("td", { class: "num", text: r.generated_len ?? "–" }), el("td", { class: "num", text: fmtP(r.min_prob) }),
      el("td", { class: "num", text: fmt(r.max_entropy) }), el("td", { text: r.stop_reason || "–" })));
    body.replaceChildren(pager, data.rows.length ? el("table", { class: "list", id: "sequences" }, el("thead", {}, head), el("tbody", {}, ...rows))
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
    const figs = d.metrics.map((m) => {
      const grid = m.dims.length === 1 ? [m.values] : m.values;
      if (m.dims.length > 2) return el("p", { class: "note", text: `${m.metric}: ${m.dims.join(" × ")} cells; see sweep.parquet` });
      const rowDim = m.dims.length === 1 ? null : m.dims[0], colDim = m.dims[m.dims.length - 1];
      const max = absMax(grid.flat());
      const head = el("tr", {}, el("th", { text: rowDim ? `${rowDim} \\ ${colDim}` : colDim }),
        ...m.coords[colDim].map((c) => el("th", { text: String(c) })));
      const rows = grid.map((row, i) => el("tr", {}, el("th", { text: rowDim ? `${rowDim} ${m.coords[rowDim][i]}` : "" }),
        ...row.map((v, j) => {
          const coords = rowDim ? { [rowDim]: m.coords[rowDim][i], [colDim]: m.coords[colDim][j] } : { [colDim]: m.coords[colDim][j] };
          const td = el("td", { class: "cell", data: { value: v === null ? "" : v, ...coords },
            title: `${Object.entries(coords).map(([k, x]) => `${k} ${x}`).join(", ")}: mean effect ${v === null ? "not measured" : v}`,
            style: { background: v === null ? "#eaeef2" : signedColour(v, max), color: Math.abs(v || 0) / max > 0.6 ? "#fff" : "#1b1f24" } },
          v === null ? "–" : Number(v).toPrecision(3));
          if (v !== null) td.addEventListener("click", () => {
            for (const n of box.querySelectorAll("td.cell.picked")) n.classList.remove("picked");
            td.classList.add("picked");
            loadSweepCell(runId, d.id, m.metric, coords, cellBox);
          });
          return td;
        })));
      return el("div", { class: "panel sweep-metric", data: { metric: m.metric } },
        el("h3", { text: `${m.metric}` }), el("table", { class: "grid sweep-grid" }, el("thead", {}, head), el("tbody", {}, ...rows)));
    });
    box.replaceChildren(el("h2", { text: `Sweep ${d.id}: ${d.over || "?"}, edit ${d.edit || "?"}` }),
      el("p", { class: "note", text: `Each cell: its ${d.meaning} (effects.zarr; the terminal's ranking). Click a cell for its rows.` }),
      el("div", { class: "sweep-figs" }, ...figs), cellBox);
  }

  async function loadSweepCell(runId, sweepId, metric, coords, box) {
    box.replaceChildren(el("p", { class: "note", text: "loading…" }));
    let c;
    try {
      c = await api(`${runUrl(runId)}/sweeps/${enc(sweepId)}/cell?${new URLSearchParams({ metric, ...coords })}`);
    } catch (e) { showError(e, box); return; }
    const max = absMax(c.rows.map((r) => r.effect));
    box.replaceChildren(el("h3", { text: `cell (${c.component}) ${Object.entries(coords).map(([k, x]) => `${k} ${x}`).join(", ")} · ${metric}: ${c.n_rows} (sequence, step) rows${c.rows.length < c.n_rows ? `, first ${c.rows.length} shown` : ""}` }),
      el("table", { class: "list sweep-rows", data: { metric, ...coords } },
        el("thead", {}, el("tr", {}, ...["sequence", "step", "token", "value", "baseline", "effect"].map((h) =>
          el("th", { text: h, class: h === "token" ? null : "num" })))),
        el("tbody", {}, ...c.rows.map((r) => el("tr", { data: { seq: r.sequence, step: r.step } },
          el("td", { class: "num" }, el("a", { href: `#/run/${enc(runId)}/seq/${r.sequence}/step/${r.step}`, text: r.sequence })),
          el("td", { class: "num", text: r.step }), el("td", { class: "mono", text: shown(r.token) }),
          el("td", { class: "num", text: fmt(r.value, 4) }), el("td", { class: "num", text: fmt(r.baseline, 4) }),
          el("td", { class: "num eff", text: fmt(r.effect, 4), style: { background: signedColour(r.effect, max) } }))))));
  }

  // ---- two runs compared -----------------------------------------------------------------------------
  async function compareView(a, b, gen) {
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
        el("td", { class: "num first", text: fd ? fd.step : "–" }), el("td", { text: fd ? `${fd.kind}: ${fd.explanation || ""}` : "none" }),
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
  }

  // ---- one sequence: token strip and the selected step ----------------------------------------
  async function sequenceView(runId, seq, step, gen) {
    setCrumbs({ text: "runs", href: "#/" }, { text: runId, href: `#/run/${enc(runId)}` }, { text: `sequence ${seq}` });
    const [info, data] = await Promise.all([api(runUrl(runId)), api(`${runUrl(runId)}/sequences/${seq}`)]);
    if (gen !== generation) return;
    if (info.damaged) {
      app.replaceChildren(el("h1", { text: runId }), el("p", { class: "error", id: "damaged", text: info.damaged }));
      return;
    }
    pickedHeads.length = 0; // another sequence: its own heads
    const steps = data.tokens.filter((t) => t.step !== null).map((t) => t.step);
    const strip = el("div", { class: "strip", id: "strip", tabindex: "0" }, ...data.tokens.map((t) => t.step === null
      ? el("span", { class: "tok prompt", text: shown(t.text), title: `prompt position ${t.position}` })
      : el("span", { class: "tok gen", text: shown(t.text), data: { step: t.step },
        title: `step ${t.step} · p ${fmtP(t.prob)} · rank ${rank1(t.rank)} · entropy ${fmt(t.entropy)}`,
        style: { background: probColour(t.prob) }, onclick: () => select(t.step) })));
    const legend = el("div", { class: "legend" }, "probability of the chosen token: ",
      ...[0, 0.25, 0.5, 0.75, 1].map((p) => el("span", { class: "tok", style: { background: probColour(p) }, text: String(p) })),
      " · click a generated token or use ", el("kbd", { text: "←" }), " ", el("kbd", { text: "→" }));
    const detail = el("div", { id: "detail" });
    put(app, el("h1", { text: `${runId} · sequence ${seq}` }), runHeader(info),
      info.status !== "complete" ? el("p", { class: "note", text: `This run is ${info.status}: ${data.steps} committed step(s) shown.` }) : null,
      el("h2", { text: "Prompt" }), el("p", { class: "mono", id: "prompt", text: data.prompt ?? "" }),
      el("h2", { text: "Tokens" }), legend, strip, detail);
    if (info.edits) {
      const against = el("div", { class: "panel", id: "against-parent" }, el("p", { class: "note", text: "loading…" }));
      app.insertBefore(against, detail);
      api(`${runUrl(runId)}/sequences/${seq}/parent`).then((d) => { if (gen === generation) parentPanel(runId, seq, d, against); })
        .catch((e) => showError(e, against));
    }

    let current = null;
    function select(s, push = true) {
      if (!steps.includes(s)) return;
      current = s;
      for (const node of strip.querySelectorAll(".tok.sel")) node.classList.remove("sel");
      const node = strip.querySelector(`.tok.gen[data-step="${s}"]`);
      if (node) { node.classList.add("sel"); node.scrollIntoView({ block: "nearest" }); }
      if (push) history.replaceState(null, "", `#/run/${enc(runId)}/seq/${seq}/step/${s}`);
      loadStep(runId, seq, s, info, detail, gen);
    }
    keyHandler = (e) => {
      if (current === null || e.target.tagName === "INPUT") return;
      const i = steps.indexOf(current);
      if (e.key === "ArrowRight" && i < steps.length - 1) { e.preventDefault(); select(steps[i + 1]); }
      if (e.key === "ArrowLeft" && i > 0) { e.preventDefault(); select(steps[i - 1]); }
    };
    document.addEventListener("keydown", keyHandler);
    if (!steps.length) detail.replaceChildren(el("p", { class: "note", text: "no committed generated token yet" }));
    else select(step !== null && steps.includes(step) ? step : steps[0], step !== null);
  }

  function parentPanel(runId, seq, d, box) {
    const max = absMax(d.rows.map((r) => r.logprob_shift));
    const parentCell = (r) => d.parent_found && r.parent !== null
      ? el("a", { href: `#/run/${enc(d.parent_id)}/seq/${seq}/step/${r.step}`, text: shown(r.parent) }) : shown(r.parent ?? "–");
    put(box, el("h2", {}, "Against its parent ", el("a", { href: `#/run/${enc(d.parent_id)}/seq/${seq}`, text: d.parent_id })),
      el("p", {}, el("b", { text: "edits: " }), el("code", { text: d.label || "–" }),
        ` · mode ${d.mode}` + (d.first_edited_step !== null && d.first_edited_step !== undefined ? ` · first edited step ${d.first_edited_step}` : "")),
      el("ul", { id: "interventions" }, ...d.interventions.map((e) => el("li", { class: "mono", text: JSON.stringify(e) }))),
      d.parent_found ? null : el("p", { class: "note", text: `the parent ${d.parent_id} is not in this runs directory` }),
      d.has_effects ? null : el("p", { class: "note", text: "this child has no effects.parquet (it was interrupted before finishing)" }),
      el("p", { class: "note", text: "Rows where the tokens differ are marked. The logprob shift is the child's log-probability of the parent's token minus the parent's (effects.parquet), while the contexts are identical." }),
      el("table", { class: "list", id: "parent-steps" },
        el("thead", {}, el("tr", {}, ...["step", "parent", "child", "logprob shift", "KL top-k", "winner changed"].map((h) =>
          el("th", { text: h, class: ["parent", "child"].includes(h) ? null : "num" })))),
        el("tbody", {}, ...d.rows.map((r) => el("tr", { class: r.differs ? "differs" : null, data: { step: r.step } },
          el("td", { class: "num", text: r.step }), el("td", { class: "mono parent" }, parentCell(r)),
          el("td", { class: "mono child", text: shown(r.child ?? "–") }),
          el("td", { class: "num shift", text: fmt(r.logprob_shift, 4), style: { background: r.logprob_shift === null ? null : signedColour(r.logprob_shift, max) } }),
          el("td", { class: "num", text: fmt(r.kl_parent_child_topk, 4) }),
          el("td", { class: "num", text: r.winner_changed === null ? "–" : r.winner_changed ? "yes" : "no" }))))));
  }

  let stepRequest = 0;
  async function loadStep(runId, seq, step, info, detail, gen) {
    const mine = ++stepRequest;
    detail.dataset.loading = "1";
    let d;
    try {
      d = await api(`${runUrl(runId)}/sequences/${seq}/steps/${step}`);
    } catch (e) {
      if (mine === stepRequest && gen === generation) showError(e, detail);
      return;
    }
    if (mine !== stepRequest || gen !== generation) return;
    const left = el("div", {}, tokenPanel(d), lensPanel(d.lens));
    const right = el("div", {}, attentionPanel(runId, d), d.head_dla ? dlaPanel(d.head_dla) : null,
      d.attributions ? attributionPanel(d.attributions) : null);
    detail.replaceChildren(el("div", { class: "panels" }, left, right));
    detail.dataset.step = String(step);
    delete detail.dataset.loading;
  }

  // Ranks are stored 0-based (tokens.parquet, steps.parquet); shown from 1 like the alternatives, as `show` does.
  function rank1(r) { return r == null ? "–" : String(r + 1); }

  function tokenPanel(d) {
    const t = d.token;
    if (!t) return el("div", { class: "panel" }, el("p", { class: "note", text: "no token row for this step" }));
    const facts = el("table", { class: "list" }, el("tbody", {},
      ...[["step", d.step], ["position", t.position], ["probability", fmtP(t.prob, 4)], ["rank (1 = top-1)", rank1(t.rank)],
        ["entropy", fmt(t.entropy)], ["margin (top-1 − top-2)", fmt(t.margin)], ["greedy choice", t.greedy]].map(([k, v]) =>
        el("tr", {}, el("th", { text: k }), el("td", { class: k === "greedy choice" ? "mono" : "num", text: v ?? "–" })))));
    const alts = el("table", { class: "list", id: "alternatives" },
      el("thead", {}, el("tr", {}, el("th", { text: "alternative" }), el("th", { class: "num", text: "p" }))),
      el("tbody", {}, ...t.alternatives.map((a) => el("tr", {}, el("td", { class: "mono", text: shown(a.text) }),
        el("td", { class: "num", text: fmtP(a.prob, 4) })))));
    return el("div", { class: "panel", id: "token-panel" }, el("h2", {}, "Chosen token ", el("span", { class: "tok gen", style: { background: probColour(t.prob) }, text: shown(t.token) })),
      facts, el("h2", { text: "Alternatives" }), t.alternatives.length ? alts : el("p", { class: "note", text: "none archived" }));
  }

  function lensPanel(lens) {
    const box = el("div", { class: "panel", id: "lens-panel" }, el("h2", { text: "Logit lens" }));
    if (lens.state === "none") { box.appendChild(el("p", { class: "note", text: "not captured in this run" })); return box; }
    if (lens.state === "pending") { box.appendChild(el("p", { class: "note", text: lens.note })); return box; }
    box.appendChild(el("table", { class: "list", id: "lens" },
      el("thead", {}, el("tr", {}, ...["layer", "top-1", "p", "chosen rank (1 = top-1)", "chosen p"].map((h) => el("th", { text: h })))),
      el("tbody", {}, ...lens.rows.map((r) => el("tr", { data: { layer: r.layer } }, el("td", { class: "num", text: r.layer }),
        el("td", { class: "mono", text: shown(r.top1) }), el("td", { class: "num", text: fmtP(r.top1_prob) }),
        el("td", { class: "num", text: rank1(r.target_rank) }), el("td", { class: "num", text: fmtP(r.target_prob) }))))));
    return box;
  }

  // heads picked for their pattern over steps ("layer.head"), kept while moving between tokens of a sequence
  const pickedHeads = [];
  let gridView = "heads";

  function attentionPanel(runId, d) {
    const box = el("div", { class: "panel", id: "attention-panel" }, el("h2", { text: "Attention" }));
    const a = d.attention;
    if (!a) { box.appendChild(el("p", { class: "note", text: "not captured in this run" })); return box; }
    const views = el("select", { id: "grid-view" }, ...[["heads", "every head: its most-attended key"], ["mean", "mean over heads, every key"],
      ["max", "max over heads, every key"]].map(([v, t]) => el("option", { value: v, text: t })));
    views.value = gridView;
    const logBox = el("input", { type: "checkbox", id: "log-scale" });
    logBox.checked = logScale;
    const gridBox = el("div", {});
    const patterns = el("div", { id: "head-patterns" });
    // the mean / max over heads (30 layers x every key: the larger answer) is fetched when first shown
    let overHeads; // undefined until fetched (null: the run has no attention)
    const draw = async () => {
      const view = gridView;
      if (view === "heads") { gridBox.replaceChildren(headsGrid(runId, d, box, patterns)); return; }
      if (overHeads === undefined) {
        gridBox.replaceChildren(el("p", { class: "note", text: "loading…" }));
        try {
          overHeads = await api(`${runUrl(runId)}/sequences/${d.sequence}/steps/${d.step}/over_heads`);
        } catch (e) { showError(e, gridBox); return; }
      }
      if (view === gridView) gridBox.replaceChildren(overHeadsGrid(overHeads, view));
    };
    views.addEventListener("change", () => { gridView = views.value; draw(); });
    logBox.addEventListener("change", () => {
      logScale = logBox.checked;
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
    for (const [layer, head] of pickedHeads) loadPattern(runId, d.sequence, d.step, layer, head, patterns, box);
    return box;
  }

  function overHeadsGrid(o, which) {
    if (!o) return el("p", { class: "note", text: "not available" });
    const head = el("tr", {}, el("th", { text: "layer \\ key" }), ...o.keys.map((k, i) => el("th", { class: "key", title: `key ${i}`, text: shown(k) })));
    const rows = o[which].map((row, li) => el("tr", {}, el("th", { text: `L${o.layers[li]}` }),
      ...row.map((w, k) => el("td", { class: "cell", data: { layer: o.layers[li], key: k, w: w ?? "" },
        title: `layer ${o.layers[li]}, key ${k} ${JSON.stringify(o.keys[k])}: ${which} over heads ${fmt(w, 4)}`,
        style: { background: weightColour(w), color: weightText(w) } }, el("span", { class: "w", text: fmt(w, 2) })))));
    return el("div", { class: "scroll" }, el("table", { class: "grid", id: `attention-${which}` }, el("thead", {}, head), el("tbody", {}, ...rows)));
  }

  function headsGrid(runId, d, box, patterns) {
    const a = d.attention;
    const wrap = el("div", {}, el("p", { class: "note", text: `Each cell: the key the query at position ${a.query_position} attended to most in that layer and head — its weight, and its token. Click a cell for the head's whole row and its pattern over every step.` }));
    const rowBox = el("div", { id: "head-row" });
    const head = el("tr", {}, el("th", { text: "layer \\ head" }), ...Array.from({ length: a.heads }, (_, h) => el("th", { text: `H${h}` })));
    const rows = a.cells.map((cells, li) => el("tr", {}, el("th", { text: `L${a.layers[li]}` }),
      ...cells.map((c, h) => {
        const td = el("td", { class: "cell", data: { layer: a.layers[li], head: h, key: c.key, weight: c.weight },
          title: `layer ${a.layers[li]} head ${h}: key ${c.key} ${JSON.stringify(c.text)} weight ${fmt(c.weight, 4)}`,
          style: { background: weightColour(c.weight), color: weightText(c.weight) } },
        el("span", { class: "w", text: fmt(c.weight) }), el("span", { class: "k", text: shown(c.text) }));
        td.addEventListener("click", () => {
          for (const n of box.querySelectorAll("td.cell.picked")) n.classList.remove("picked");
          td.classList.add("picked");
          loadHeadRow(runId, d.sequence, d.step, a.layers[li], h, rowBox);
          if (!pickedHeads.some(([l, x]) => l === a.layers[li] && x === h)) {
            pickedHeads.push([a.layers[li], h]);
            loadPattern(runId, d.sequence, d.step, a.layers[li], h, patterns, box);
          }
        });
        return td;
      })));
    wrap.appendChild(el("table", { class: "grid", id: "attention-grid" }, el("thead", {}, head), el("tbody", {}, ...rows)));
    wrap.appendChild(rowBox);
    return wrap;
  }

  async function loadPattern(runId, seq, step, layer, head, patterns, box) {
    const holder = el("div", { class: "pattern", data: { layer, head } }, el("p", { class: "note", text: "loading…" }));
    patterns.appendChild(holder);
    let p;
    try { p = await api(`${runUrl(runId)}/sequences/${seq}/attention/${layer}/${head}`); } catch (e) { showError(e, holder); return; }
    const close = el("button", { class: "close", title: "stop showing this head", text: "×" });
    close.addEventListener("click", () => {
      const i = pickedHeads.findIndex(([l, x]) => l === layer && x === head);
      if (i >= 0) pickedHeads.splice(i, 1);
      holder.remove();
    });
    const headRow = el("tr", {}, el("th", { text: "step \\ key" }), ...p.keys.map((k, i) => el("th", { class: "key", title: `key ${i}`, text: shown(k) })));
    const rows = p.rows.map((row, s) => el("tr", { class: s === step ? "current" : null, data: { step: s } },
      el("th", { class: "mono", title: `step ${s} chose ${JSON.stringify(p.chosen[s])}`, text: `${s}:${shown(p.chosen[s])}` }),
      ...row.map((w, k) => w === null ? el("td", { class: "cell void" })
        : el("td", { class: "cell", data: { key: k, w }, title: `step ${s}, key ${k} ${JSON.stringify(p.keys[k])}: ${fmt(w, 4)}`,
          style: { background: weightColour(w), color: weightText(w) } }, el("span", { class: "w", text: fmt(w, 2) })))));
    holder.replaceChildren(el("h3", {}, `Layer ${layer}, head ${head}: attention over steps ${p.dense ? "" : "(top-k keys; others 0)"}`, close),
      el("div", { class: "scroll" }, el("table", { class: "grid pattern-grid" }, el("thead", {}, headRow), el("tbody", {}, ...rows))));
  }

  function attributionPanel(groups) {
    const box = el("div", { class: "panel", id: "attribution-panel" }, el("h2", { text: "Attributions (lmtrace explain)" }));
    if (!groups.length) { box.appendChild(el("p", { class: "note", text: "no explain result for this step (`lmtrace explain RUN STEPS --sequence N`)" })); return box; }
    for (const g of groups) {
      const max = absMax(g.scores.map((x) => x.score));
      box.appendChild(el("div", { class: "attribution", data: { method: g.method, explain: g.explain_id } },
        el("h3", { text: `${g.method} · ${g.target || "–"}${g.quantity ? ` (${g.quantity})` : ""} · ${g.explain_id}` }),
        el("div", { class: "row-keys" }, ...g.scores.map((x) => el("span", { class: `tok key${x.is_prompt ? " prompt-key" : ""}`,
          data: { position: x.position, score: x.score ?? "" }, title: `position ${x.position}: ${fmt(x.score, 4)}`,
          style: { background: signedColour(x.score, max), color: Math.abs(x.score || 0) / max > 0.6 ? "#fff" : "#1b1f24" } },
        shown(x.text), el("small", { text: fmt(x.score, 3) }))))));
    }
    return box;
  }

  async function loadHeadRow(runId, seq, step, layer, head, box) {
    box.replaceChildren(el("p", { class: "note", text: "loading…" }));
    let r;
    try { r = await api(`${runUrl(runId)}/sequences/${seq}/steps/${step}/attention/${layer}/${head}`); } catch (e) { showError(e, box); return; }
    box.replaceChildren(el("h2", { text: `Layer ${layer}, head ${head}: attention over ${r.dense ? "every key" : "its top-k keys"}` }),
      el("div", { class: "row-keys", data: { layer, head } }, ...r.keys.map((k) => el("span", {
        class: "tok key", data: { key: k.key, weight: k.weight, w: k.weight ?? "" }, title: `key ${k.key}: ${fmt(k.weight, 4)}`,
        style: { background: weightColour(k.weight), color: weightText(k.weight) } },
      shown(k.text), el("small", { text: fmt(k.weight) })))));
  }

  function dlaPanel(dla) {
    const max = Math.max(1e-9, ...dla.values.flat().map((v) => Math.abs(v || 0)));
    const colour = (v) => {
      const t = Math.min(1, Math.abs(v || 0) / max);
      const c = (v || 0) >= 0 ? mix(LIGHT, [33, 102, 172], t) : mix(LIGHT, [230, 97, 1], t);
      return `rgb(${c[0]},${c[1]},${c[2]})`;
    };
    return el("div", { class: "panel", id: "dla-panel" }, el("h2", { text: `Direct logit attribution per head (${dla.target})` }),
      el("table", { class: "grid", id: "dla-grid" },
        el("thead", {}, el("tr", {}, el("th", { text: "layer \\ head" }), ...dla.values[0].map((_, h) => el("th", { text: `H${h}` })))),
        el("tbody", {}, ...dla.values.map((row, li) => el("tr", {}, el("th", { text: `L${dla.layers[li]}` }),
          ...row.map((v) => el("td", { class: "cell", text: fmt(v), style: { background: colour(v), color: Math.abs(v || 0) / max > 0.6 ? "#fff" : "#1b1f24" } })))))));
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
        await compareView(parts[1], parts[2], gen);
      } else if (parts[0] === "run" && parts.length >= 2) {
        const runId = parts[1];
        if (parts[2] === "seq" && parts.length >= 4) {
          const step = parts[4] === "step" && parts.length >= 6 ? Number(parts[5]) : null;
          await sequenceView(runId, Number(parts[3]), step, gen);
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
