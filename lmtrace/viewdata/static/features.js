// lmtrace's feature views, shared by `lmtrace serve` and `lmtrace report` (from the same answers:
// viewdata/features.py): a feature's page (its top activating examples with their context coloured by
// the feature's activation, the density and a histogram of its activations, its logit effects) and
// the token view's list of each SAE's top latents at the selected token.
// Texts from a run are inserted with textContent, never as markup.
"use strict";

window.lmtraceFeatures = (() => {
  const { el, fmt, shown, shownToken, tokenBox, MISSING, signedColour } = window.lmtraceView;
  // an activation: white (0) → blue (the page's largest), the signed scale's positive half
  const actColour = (a, max) => signedColour(a, max);
  const actText = (a, max) => ((a || 0) / (max || 1) > 0.6 ? "#fff" : "#1b1f24");
  const num = (x) => (x === null || x === undefined ? MISSING : Math.abs(x) >= 1000 || (x !== 0 && Math.abs(x) < 0.001)
    ? Number(x).toExponential(2) : Number(x).toFixed(3));

  // the token view's panel: per SAE its top latents at the token, each linking to its page
  // (opts.featureHref(sae, feature) -> address, or null where the page has none)
  function tokenPanel(id, groups, opts = {}) {
    const box = el("div", { class: "panel features-panel", id }, el("h2", { text: "Features" }));
    for (const g of groups) {
      const max = Math.max(1e-12, ...g.features.map((f) => f.activation));
      const link = (f) => {
        const href = opts.featureHref ? opts.featureHref(g.sae, f.feature) : null;
        return href ? el("a", { href, text: String(f.feature), title: `feature ${f.feature} of ${g.sae}: its page` })
          : el("span", { text: String(f.feature), title: opts.featureMissing ? opts.featureMissing(g.sae, f.feature) : null });
      };
      box.appendChild(el("h3", {}, el("span", { class: "mono", text: g.sae }), ` · ${g.hook} · ${g.active} active`
        + (g.active > g.features.length ? `, top ${g.features.length}` : "")));
      box.appendChild(g.features.length
        ? el("table", { class: "list feature-list", data: { sae: g.sae } },
          el("thead", {}, el("tr", {}, el("th", { text: "feature" }), el("th", { class: "num", text: "activation" }), el("th", { text: "" }))),
          el("tbody", {}, ...g.features.map((f) => el("tr", { data: { feature: f.feature } },
            el("td", { class: "num" }, link(f)), el("td", { class: "num", data: { value: f.activation }, text: num(f.activation) }),
            el("td", { class: "bar-cell" }, el("span", { class: "act-bar", style: { width: `${(100 * f.activation) / max}%`,
              background: actColour(f.activation, max) } }))))))
        : el("p", { class: "note", text: "no latent archived active at this token" }));
    }
    box._csvRows = () => [["sae", "feature", "activation"], ...groups.flatMap((g) => g.features.map((f) => [g.sae, f.feature, f.activation]))];
    return box;
  }

  // a feature's page: d is the answer of features/SAE/F; opts.exampleHref(seq, step) -> address of an
  // example's token view (or null)
  function page(d, opts = {}) {
    const max = d.max_activation || 1e-12;
    const head = el("div", { class: "feature-head" },
      el("p", { class: "meta" }, el("span", {}, el("b", { text: "SAE " }), el("span", { class: "mono", text: d.sae })),
        el("span", { text: d.hook }), el("span", { text: `${d.d_sae} latents` }),
        el("span", { id: "feature-density", text: `active on ${d.active_tokens.toLocaleString("en")} of ${d.tokens.toLocaleString("en")} tokens`
          + ` (density ${Number(d.density).toPrecision(3)})` + (d.sequences ? ` of the ${d.sequences.length} sequences shown` : "") }),
        opts.positionsHref && d.has_prompt_positions
          ? el("a", { id: "feature-positions", href: opts.positionsHref(d.positions === "prompt" ? "generated" : "prompt"),
            text: d.positions === "prompt" ? "over prompt positions · show generated tokens" : "over generated tokens · show prompt positions" })
          : el("span", { text: d.positions === "prompt" ? "over prompt positions" : "over generated tokens" })));
    const hist = el("div", { class: "panel", id: `${opts.prefix || ""}feature-histogram` }, el("h2", { text: "Activation density" }), histogram(d));
    hist._csvRows = () => [["bin_low", "bin_high", "tokens"], ...d.histogram.counts.map((c, i) => [d.histogram.edges[i], d.histogram.edges[i + 1], c])];
    const effects = el("div", { class: "panel", id: `${opts.prefix || ""}feature-logits` }, el("h2", { text: "Logit effects" }), logitEffects(d));
    const examples = el("div", { class: "panel", id: `${opts.prefix || ""}feature-examples` },
      el("h2", { text: `Top activating examples (${d.examples.length})` }),
      window.lmtraceGrid.legend("activation", (v) => actColour(v, max), 0, max, [[0, "0"], [max, num(max)]]),
      d.examples.length ? exampleTable(d, max, opts) : el("p", { class: "note", text: "no token has it among its archived top-k latents" }));
    examples._csvRows = () => [["sequence", "step", "position", "activation", "token"],
      ...d.examples.map((e) => [e.sequence, e.step, e.position, e.activation, e.context.find((c) => c.position === e.position)?.text ?? ""])];
    const node = el("div", { class: "feature-page" }, head, el("div", { class: "feature-panels" }, el("div", {}, hist, effects), examples));
    for (const p of [hist, effects, examples]) {
      window.lmtraceGrid.exportBar(p, `${d.run_id}-${d.sae}-feature${d.feature}-${p.id.replace(/^.*feature-/, "")}`, p._csvRows);
    }
    return node;
  }

  function exampleTable(d, max, opts) {
    return el("table", { class: "list feature-examples" },
      el("thead", {}, el("tr", {}, ...["activation", "token", "context"].map((h, i) => el("th", { class: i < 1 ? "num" : null, text: h })))),
      el("tbody", {}, ...d.examples.map((e) => {
        const href = opts.exampleHref ? opts.exampleHref(e.sequence, e.step) : null;
        const where = e.step === null ? `seq ${e.sequence} · pos ${e.position}` : `seq ${e.sequence} · step ${e.step}`;
        return el("tr", { data: { sequence: e.sequence, step: e.step } },
          el("td", { class: "num", data: { value: e.activation }, text: num(e.activation) }),
          el("td", { class: "where" }, href ? el("a", { href, text: where, title: "this token in the token view" }) : where),
          el("td", { class: "context" }, ...e.context.map((c) => el("span", {
            // coloured where the arrays read hold an activation (generated tokens, or prompt positions)
            class: `tok ${c.activation === null ? "prompt" : "ctx"}${c.position === e.position ? " hit" : ""}`,
            text: shown(c.text), data: { activation: c.activation ?? "" },
            title: (c.step === null ? `prompt position ${c.position}` : `step ${c.step}`) + (c.activation === null ? "" : ` · activation ${num(c.activation)}`),
            style: c.activation === null ? null : { background: actColour(c.activation, max), color: actText(c.activation, max) } }))));
      })));
  }

  // the activations where the latent is active, in equal bins from the smallest to the largest
  function histogram(d) {
    const h = d.histogram;
    if (!h.counts.length) return el("p", { class: "note", text: "never active" });
    const top = Math.max(...h.counts, 1);
    const bars = el("div", { class: "hist-bars", role: "img", "aria-label": "histogram of the activations where active" },
      ...h.counts.map((c, i) => el("span", { class: "hist-bar", data: { count: c },
        title: `${num(h.edges[i])} – ${num(h.edges[i + 1])}: ${c} token${c === 1 ? "" : "s"}`,
        style: { height: `${(100 * c) / top}%` } })));
    return el("div", {}, el("p", { class: "hist-y", text: "tokens per bin" }), el("div", { class: "hist" }, el("div", { class: "hist-axis" }, el("span", { text: String(top) }), el("span", { text: "0" })), bars,
      el("div", { class: "hist-x" }, el("span", { text: num(h.edges[0]) }), el("span", { text: "activation (where active)" }),
        el("span", { text: num(h.edges[h.edges.length - 1]) }))));
  }

  function logitEffects(d) {
    const e = d.logit_effects;
    if (!e || !e.promoted) return el("p", { class: "note", id: "logit-note", text: (e && e.note) || d.logit_note });
    const table = (title, rows, cls) => el("table", { class: `list logit-table ${cls}` },
      el("thead", {}, el("tr", {}, el("th", { text: title }), el("th", { class: "num", text: "effect" }))),
      el("tbody", {}, ...rows.map((t) => el("tr", { data: { id: t.id } }, el("td", { class: "mono" }, tokenBox(t.text)),
        el("td", { class: "num", data: { value: t.effect }, text: num(t.effect) })))));
    return el("div", {}, el("div", { class: "logit-tables" }, table("promotes", e.promoted, "promoted"), table("suppresses", e.suppressed, "suppressed")),
      el("p", { class: "note", text: e.method || "" }));
  }

  return { page, tokenPanel, shownToken };
})();
