// The report's data source for lmtrace's token view (lmtrace/viewdata/static/tokenview.js, inlined in this
// page): the answers of `lmtrace serve`'s routes that the report embedded, by path; one head's row
// over the keys at a step is read from that head's embedded pattern over the steps. Anything else
// was not embedded, and the view says so in one line.
"use strict";

(() => {
  // the features section (report/feature_sections.py): serve's feature pages, drawn by features.js
  const views = {};
  const featureNode = document.getElementById("lmtrace-features");
  const featureIds = new Map();
  if (featureNode) {
    const fa = JSON.parse(featureNode.textContent).answers;
    for (const box of document.querySelectorAll(".feature-snap[data-sae][data-feature]")) {
      const d = fa[`features/${box.dataset.sae}/${box.dataset.feature}`];
      if (!d) continue;
      featureIds.set(`${box.dataset.sae}\n${box.dataset.feature}`, box.id);
      box.appendChild(window.lmtraceFeatures.page(d, { prefix: `${box.id}-`, exampleHref: (seq) => `#tv-${seq}` }));
      // an example's link selects its step in its sequence's token view
      box.addEventListener("click", (e) => {
        const a = e.target.closest && e.target.closest("td.where a");
        const row = a && a.closest("tr[data-sequence]");
        const v = row && views[row.dataset.sequence];
        if (!v) return;
        e.preventDefault();
        v.view.select(Number(row.dataset.step));
        v.box.scrollIntoView({ block: "start" });
      });
    }
  }
  const node = document.getElementById("lmtrace-tokenview");
  if (!node) return;
  const { answers, missing } = JSON.parse(node.textContent);
  const has = (path) => Object.prototype.hasOwnProperty.call(answers, path);

  function headRow(seq, step, layer, head) {
    const p = answers[`sequences/${seq}/attention/${layer}/${head}`];
    const row = p && p.rows[step];
    if (!row) return null;
    const keys = [];
    row.forEach((w, k) => { if (w !== null) keys.push({ key: k, text: p.keys[k], weight: w }); });
    return { sequence: seq, step, layer, head, keys, dense: p.dense };
  }

  async function source(path) {
    if (has(path)) return answers[path];
    let m = /^sequences\/(\d+)\/steps\/(\d+)\/attention\/(\d+)\/(\d+)$/.exec(path);
    if (m) {
      const row = headRow(+m[1], +m[2], +m[3], +m[4]);
      if (row) return row;
      throw new Error(`layer ${m[3]}, head ${m[4]} is not embedded: ${missing.head}`);
    }
    m = /^sequences\/(\d+)\/attention\/(\d+)\/(\d+)$/.exec(path);
    if (m) throw new Error(`layer ${m[2]}, head ${m[3]} is not embedded: ${missing.head}`);
    m = /^sequences\/(\d+)\/steps\/(\d+)(\/over_heads)?$/.exec(path);
    if (m) throw new Error(`step ${m[2]} of sequence ${m[1]} is not embedded: ${missing.step}`);
    throw new Error(`${path} is not embedded in this report`);
  }

  // the keys (← → tokens, Shift + arrows heads) go to the token view last clicked or focused, so they
  // keep working after a click anywhere in it (a grid cell, a panel)
  let active = null;
  for (const box of document.querySelectorAll(".tokenview[data-seq]")) {
    const seq = box.dataset.seq;
    // the layers whose heads' rows and patterns are embedded; the grid hatches the others' rows, and
    // picking one of their heads says so in a note
    const layers = new Set((box.dataset.layers || "").split(",").filter((x) => x !== "").map(Number));
    const view = window.lmtraceView.tokenView(source, answers[`sequences/${seq}`], {
      prefix: `s${seq}-`,
      headAvailable: (layer) => layers.has(layer),
      headMissing: (layer, head) => `layer ${layer}, head ${head} is not embedded (this report embeds the heads of layer${layers.size === 1 ? "" : "s"} `
        + `${[...layers].join(", ") || "none"}): ${missing.head}`,
      featureHref: (sae, f) => (featureIds.has(`${sae}\n${f}`) ? `#${featureIds.get(`${sae}\n${f}`)}` : null),
      featureMissing: (sae, f) => `feature ${f} of ${sae}: this report embeds the pages of the latents most active on the tokens shown; \`lmtrace serve\` has every latent's page`,
    });
    box.append(view.legend, view.strip, view.detail);
    const entry = { view, box };
    box.addEventListener("pointerdown", () => { active = entry; });
    box.addEventListener("focusin", () => { active = entry; });
    if (view.steps.length) view.select(Number(box.dataset.step), false);
    views[seq] = entry;
    if (!active) active = entry;
  }
  document.addEventListener("keydown", (e) => {
    if (!active || (e.target.closest && e.target.closest(".tokenview") && !active.box.contains(e.target))) return;
    active.view.keydown(e);
  });
  // a token of the "Generated text" section opens its step in the token view
  for (const tok of document.querySelectorAll("#sec-text .tok[data-seq][data-step]")) {
    const v = views[tok.dataset.seq];
    if (!v) continue;
    tok.style.cursor = "pointer";
    tok.addEventListener("click", () => {
      active = v;
      v.view.select(Number(tok.dataset.step));
      v.box.scrollIntoView({ block: "start" });
      v.view.strip.focus({ preventScroll: true });
    });
  }
})();
