// lmtrace serve: a run's sequences grouped by a column of sequences.parquet (prompt metadata,
// stop_reason, ...). Per group the numbers `lmtrace stats --by COLUMN` prints and the group's top heads
// as `lmtrace heads --by COLUMN` ranks them: the server reads both through the same analysis code
// (/api/runs/RUN/groups?by=COLUMN). Texts from the run are inserted as text, never as markup.
"use strict";

window.lmtraceGroups = (() => {
  const { el, put, fmt, fmtP, tokenBox, MISSING } = window.lmtraceView;
  const enc = encodeURIComponent;

  // a group's value as the terminal writes it (archive/groups.py group_text): null as -, a bool as true / false
  function groupText(v) {
    if (v === null || v === undefined) return "-";
    if (typeof v === "boolean") return v ? "true" : "false";
    return String(v).replace(/\r/g, "\\r").replace(/\n/g, "\\n").replace(/\t/g, "\\t");
  }

  // where the lens settles: "layer: steps" as the terminal writes it (-1: never)
  function settleText(settle) {
    return Object.entries(settle).map(([k, n]) => [Number(k), n]).sort((a, b) => a[0] - b[0])
      .map(([k, n]) => `${k < 0 ? "never" : k}: ${n}`).join(", ");
  }

  const num = (v, d, cls) => el("td", { class: `num ${cls}`, data: { value: v === null ? "" : String(v) }, text: v === null ? MISSING : fmt(v, d) });

  // The "group by" control: a select of the run's columns (asked of the server once), `by` chosen.
  function control(api, runId, by, onChange) {
    const sel = el("select", { id: "group-by", title: "group the sequences by a column: the numbers of `lmtrace stats --by` and `heads --by`" },
      el("option", { value: "", text: "group by: none" }), by ? el("option", { value: by, text: `group by: ${by}` }) : null);
    sel.value = by || "";
    api(`/api/runs/${enc(runId)}/groups`).then((d) => {
      for (const c of d.columns) if (c !== by) sel.appendChild(el("option", { value: c, text: `group by: ${c}` }));
      sel.value = by || "";
    }).catch(() => { sel.disabled = true; });
    sel.addEventListener("change", () => onChange(sel.value));
    return sel;
  }

  // The groups' table, drawn into `box`.
  async function view(api, runId, by, box, alive) {
    put(box, el("p", { class: "note", text: `grouping by ${by}… (reads every sequence's tokens and attention once)` }));
    let d;
    try {
      d = await api(`/api/runs/${enc(runId)}/groups?${new URLSearchParams({ by })}`);
    } catch (e) {
      put(box, el("p", { class: "error", text: String(e.message || e) }));
      return;
    }
    if (!alive()) return;
    const headers = ["group", "sequences", "tokens", "mean logprob", "mean entropy", "lens settles at layer: steps", "top heads (heads --by)", "lowest-probability tokens"];
    const rows = d.groups.map((g) => el("tr", { class: "group-row", data: { group: JSON.stringify(g.group_value) } },
      el("th", { class: "group-value", text: groupText(g.group_value) }),
      el("td", { class: "num sequences", text: String(g.sequences) }),
      el("td", { class: "num tokens", text: String(g.tokens) }),
      num(g.mean_logprob, 3, "mean-logprob"), num(g.mean_entropy, 3, "mean-entropy"),
      el("td", { class: "settle", text: g.settle === null ? "(lens not computed)" : settleText(g.settle) || MISSING }),
      el("td", { class: "heads" }, ...(g.heads.length ? g.heads.map((h) => el("div", { class: "group-head",
        data: { layer: h.layer, head: h.q_head, label: h.label },
        title: `layer ${h.layer} head ${h.q_head}: ${h.label} · sink ${fmt(h.sink_score, 2)} · prev ${fmt(h.prev_token_score, 2)} · local ${fmt(h.local_score, 2)} · induction ${h.induction_score === null ? "-" : fmt(h.induction_score, 2)} · entropy ${fmt(h.entropy, 2)}` },
        el("b", { text: `L${h.layer}.H${h.q_head}` }), ` ${h.label}`)) : [d.heads_note ? el("span", { class: "note", text: d.heads_note }) : MISSING])),
      el("td", { class: "lowest" }, ...g.lowest.map((t) => el("div", { class: "group-low", data: { seq: t.sequence, step: t.step } },
        el("a", { href: `#/run/${enc(runId)}/seq/${t.sequence}/step/${t.step}`, text: `${t.sequence}:${t.step}` }), " ",
        tokenBox(t.token_text), ` ${fmtP(t.prob, 4)}`)))));
    put(box, el("h2", { text: `Sequences by ${by}` }),
      el("p", { class: "note", text: `Per group: what \`lmtrace stats ${runId} --by ${by}\` prints, and the group's top heads as \`lmtrace heads ${runId} --by ${by}\` ranks them (by label, then the label's score). A lowest-probability token opens its step.` }),
      el("div", { class: "scroll-x" }, el("table", { class: "list", id: "groups", data: { by } },
        el("thead", {}, el("tr", {}, ...headers.map((h) => el("th", { text: h })))), el("tbody", {}, ...rows))));
  }

  return { control, view, groupText };
})();
