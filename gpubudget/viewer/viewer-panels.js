// gpubudget's memory viewer, part 5 of 6: the panels below the timeline. The blocks live at
// the chosen moment (largest first, with what rounding added and their stream), the leaks
// (blocks live at the end whose scope had exited), the denials (a click goes to the moment),
// the event list (every allocation, free, denial and segment event, stepped through), what
// the header's search finds (budgets, tags, addresses), a block's life, and the comparison of
// two moments, of this record or of another one, by tag and by stack (its functions: the
// lines they were called from may move between two versions of the code).
(function () {
  const { formatSize, el } = GB;
  const MAX_ROWS = 200, MAX_LISTED = 1000, MAX_DIFF_ROWS = 100;

  function innermost(ds, k) { const st = ds.stackText(k); return st.length ? st[st.length - 1] : ""; }

  GB.blockRow = function (app, k, last) {
    const ds = app.ds, blocks = ds.blocks, end = ds.end;
    const tr = el("tr", { "data-block": k });
    const cells = [formatSize(blocks.size[k]), ds.tagText(k), ds.budgets[blocks.b[k]].name,
      blocks.addr[k] >= 0 ? "0x" + blocks.addr[k].toString(16) : "—", ds.formatTime(ds.t0(k), end), last(k),
      blocks.req[k] >= 0 ? GB.exactSize(blocks.req[k]) : "—", ds.streams[blocks.stream[k]], innermost(ds, k)];
    cells.forEach((text, i) => tr.appendChild(el("td", i === 0 ? { class: "num" } : {}, text)));
    if (ds.isLeak[k]) tr.classList.add("leak");
    if (k === app.state.block) tr.classList.add("selected");
    tr.addEventListener("click", () => app.showLife(k));
    return tr;
  };

  // The blocks live at t in budget b's subtree (every root's with b null).
  GB.liveBlocks = function (ds, b, t) {
    if (b !== null) return Array.from(ds.liveAt(b, t));
    const out = [];
    for (const r of ds.order) if (ds.budgets[r].parent === null) for (const k of ds.liveAt(r, t)) out.push(k);
    return out;
  };

  GB.listBlocks = function (app) {
    const ds = app.ds, s = app.state, blocks = ds.blocks, q = s.query.toLowerCase().trim(), end = ds.end;
    const address = GB.parseAddress(q);
    const tagOk = k => !q || ds.tagText(k).toLowerCase().includes(q) || ds.budgets[blocks.b[k]].name.toLowerCase().includes(q) ||
      address !== null && blocks.addr[k] >= 0 && blocks.addr[k] <= address && address < blocks.addr[k] + blocks.size[k];
    let found;
    if (s.moment !== null) found = GB.liveBlocks(ds, s.lane, s.moment).filter(tagOk);
    else {
      found = [];
      for (let k = 0; k < blocks.n; k++) if (tagOk(k) && (s.lane === null || ds.within(blocks.b[k], s.lane))) found.push(k);
    }
    found.sort((a, b) => blocks.size[b] - blocks.size[a] || a - b);
    let total = 0, asked = 0, known = 0;
    for (const k of found) { total += blocks.size[k]; if (blocks.req[k] >= 0) { asked += blocks.req[k]; known += blocks.size[k]; } }
    const lane = s.lane;
    const where = lane !== null ? " in " + ds.budgets[lane].name + (ds.budgets[lane].children.length ? " and below" : "") : "";
    const when = s.moment !== null ? " live at " + ds.formatTime(s.moment, end) : " (all)";
    document.getElementById("blocks-title").textContent = found.length + " blocks" +
      (q ? " matching *" + s.query.trim() + "*" : "") + where + when + ", " + formatSize(total) +
      (!known ? "" : known === total ? " (" + GB.exactSize(known - asked) + " of it lost to rounding: " + formatSize(asked) + " requested)"
        : " (" + GB.exactSize(known - asked) + " lost to rounding in the " + formatSize(known) + " of blocks whose request is recorded)");
    const last = k => Number.isFinite(ds.t1(k)) ? ds.formatTime(ds.t1(k), end) : ds.isLeak[k] ? "never (leaked)" : "live at end";
    document.querySelector("#blocks tbody").replaceChildren(...found.slice(0, MAX_ROWS).map(k => GB.blockRow(app, k, last)));
    document.getElementById("blocks-more").textContent = found.length > MAX_ROWS ? "… " + (found.length - MAX_ROWS) + " more (largest shown)" : "";
    return found;
  };

  // An address typed: 0x and hex digits, or hex digits alone when there are six or more.
  GB.parseAddress = function (text) {
    const q = text.trim().toLowerCase(), m = /^(0x)?([0-9a-f]+)$/.exec(q);
    if (!m || !m[1] && m[2].length < 6 || m[2].length > 13) return null;
    return parseInt(m[2], 16);
  };

  // What the search finds: budgets by name or path, tags, and the blocks holding an address
  // (those live at the chosen moment first, then the latest); twelve at most of each.
  GB.searchMatches = function (ds, text, moment) {
    const q = text.trim().toLowerCase(), out = [], MAX = 12;
    if (!q) return out;
    const blocks = ds.blocks, address = GB.parseAddress(q);
    if (address !== null) {
      const found = [];
      for (let k = 0; k < blocks.n; k++) if (blocks.addr[k] >= 0 && blocks.addr[k] <= address && address < blocks.addr[k] + blocks.size[k]) found.push(k);
      const liveThen = k => moment !== null && ds.t0(k) <= moment && moment < ds.t1(k);
      found.sort((a, b) => liveThen(b) - liveThen(a) || b - a);
      for (const k of found.slice(0, MAX)) out.push({ kind: "block", index: k, label: formatSize(blocks.size[k]) + " at 0x" + blocks.addr[k].toString(16) +
        " in " + ds.budgets[blocks.b[k]].name + (ds.tagText(k) ? ", " + ds.tagText(k) : "") + ", " + ds.formatTime(ds.t0(k), ds.end) + " to " +
        (Number.isFinite(ds.t1(k)) ? ds.formatTime(ds.t1(k), ds.end) : "the end") });
    }
    for (const b of ds.order) {
      if (out.length >= 2 * MAX) break;
      const budget = ds.budgets[b];
      if (budget.path.toLowerCase().includes(q)) out.push({ kind: "budget", index: b, label: budget.path });
    }
    const counts = new Float64Array(ds.tags.length), bytes = new Float64Array(ds.tags.length);
    for (let k = 0; k < blocks.n; k++) if (blocks.tag[k] >= 0) { counts[blocks.tag[k]]++; bytes[blocks.tag[k]] += blocks.size[k]; }
    let tags = 0;
    ds.tags.forEach((tag, i) => {
      if (tags < MAX && tag.toLowerCase().includes(q)) { tags++; out.push({ kind: "tag", index: i, label: tag + " (" + counts[i] + " blocks, " + formatSize(bytes[i]) + " allocated)" }); }
    });
    return out;
  };

  GB.showLife = function (app, k) {
    const ds = app.ds, blocks = ds.blocks, end = ds.end, t0 = ds.t0(k), t1 = ds.t1(k), budget = ds.budgets[blocks.b[k]];
    const st = ds.stackText(k);
    const lines = [
      formatSize(blocks.size[k]) + (blocks.addr[k] >= 0 ? " at 0x" + blocks.addr[k].toString(16) : "") + " in " + budget.name +
        (ds.tagText(k) ? ", tag " + ds.tagText(k) : ", no tag"),
      (Number.isFinite(t0) ? "allocated at " + ds.formatTime(t0, end) : "allocated before the record began") + ", " +
        (Number.isFinite(t1) ? "freed at " + ds.formatTime(t1, end) + (Number.isFinite(t0) ? " (lived " + ds.formatTime(t1 - t0) + ")" : "")
          : "still live at the end"),
      "requested " + (blocks.req[k] >= 0 ? GB.exactSize(blocks.req[k]) + ", rounded to " + GB.exactSize(blocks.size[k]) +
        ": " + GB.exactSize(ds.rounding(k)) + " lost to rounding" : "size not recorded: " + GB.exactSize(blocks.size[k]) + " charged") +
        " · " + ds.streams[blocks.stream[k]]];
    if (ds.isLeak[k]) lines.push("leaked: still live when the record ends, and its budget's scope had exited (at " + ds.formatTime(budget.exited, end) + ")");
    document.getElementById("life").replaceChildren(...lines.map(text => el("div", ds.isLeak[k] && text.startsWith("leaked") ? { class: "denied" } : {}, text)),
      el("pre", {}, st.length ? st.join("\n") : ds.source === "torch" ? "no stack (record with torch.cuda.memory._record_memory_history())" : "no stack (track_stacks=True keeps them)"));
  };

  GB.fillLeaks = function (app) {
    const ds = app.ds, tab = document.getElementById("leaks-tab");
    const total = ds.leaks.reduce((n, k) => n + ds.blocks.size[k], 0);
    tab.textContent = "Leaks (" + ds.leaks.length + ")";
    tab.classList.toggle("alert", ds.leaks.length > 0);
    document.getElementById("leaks-title").textContent = ds.leaks.length ? ds.leaks.length +
      " blocks live at the end whose budget's scope had exited, " + formatSize(total) +
      (ds.leaks.length > MAX_LISTED ? ", the largest " + MAX_LISTED + " listed" : "") + " (click one: the moment its scope exited)"
      : ds.source === "torch" ? "A PyTorch snapshot has no scopes: nothing is a leak by this rule" : "No leaks: every block of an exited scope was freed";
    const last = k => ds.formatTime(ds.budgets[ds.blocks.b[k]].exited, ds.end);
    document.querySelector("#leaks tbody").replaceChildren(...ds.leaks.slice(0, MAX_LISTED).map(k => {
      const tr = GB.blockRow(app, k, last);
      tr.addEventListener("click", () => app.select(ds.budgets[ds.blocks.b[k]].exited, ds.blocks.b[k], true));
      return tr;
    }));
  };

  GB.exactSize = n => n < 1024 ? n + " B" : formatSize(n) + " (" + n.toLocaleString("en") + " B)";

  // The event list: every allocation, free and denial of the chosen budget and below (every
  // root's without one), in order; segments mapped and unmapped for the roots. Built once
  // per budget; the page lists the rows around the chosen event, which the arrow keys move.
  // Rows as columns (a million events: megabytes, not an object each): t, kind, x (the
  // block, denial or region). The blocks' events come in event order; the few others are
  // sorted and merged in (a denial after the events of its time).
  const KINDS = ["alloc", "free", "denied", "segment map", "segment unmap"];
  GB.eventList = function (app, lane) {
    const ds = app.ds, cache = app.eventLists || (app.eventLists = new Map()), key = lane === null ? -1 : lane;
    if (cache.has(key)) return cache.get(key);
    const roots = ds.order.filter(i => ds.budgets[i].parent === null);
    let ev, at, n;
    if (lane !== null || roots.length === 1) { const e = ds.events(lane !== null ? lane : roots[0]); ev = e.ev; at = e.at; n = e.n; }
    else {  // every root's, in event order (a counting sort by event)
      const parts = roots.map(r => ds.events(r)), slots = new Int32Array(ds.times.length + 1);
      for (const p of parts) for (let i = 0; i < p.n; i++) slots[p.at[i] + 1]++;
      for (let i = 1; i < slots.length; i++) slots[i] += slots[i - 1];
      n = slots[slots.length - 1]; ev = new Int32Array(n); at = new Int32Array(n);
      for (const p of parts) for (let i = 0; i < p.n; i++) { const s = slots[p.at[i]]++; ev[s] = p.ev[i]; at[s] = p.at[i]; }
    }
    const extra = [];  // [t, order, kind, x]
    ds.denials.forEach((d, i) => { if (lane === null || ds.within(d[1], lane)) extra.push([d[0], Infinity, 2, i]); });
    ds.regions.forEach((g, i) => {
      if (lane !== null && g[0] !== lane) return;
      if (g[3] >= 0) extra.push([ds.times[g[3]], g[3], 3, i]);
      if (g[4] >= 0) extra.push([ds.times[g[4]], g[4], 4, i]);
    });
    extra.sort((a, b) => a[0] - b[0] || a[1] - b[1]);
    const total = n + extra.length, rows = { n: total, t: new Float64Array(total), kind: new Uint8Array(total), x: new Int32Array(total) };
    for (let i = 0, j = 0, r = 0; r < total; r++) {
      const fromBlocks = j >= extra.length || i < n && (ds.times[at[i]] < extra[j][0] || ds.times[at[i]] === extra[j][0] && at[i] <= extra[j][1]);
      if (fromBlocks) { const e = ev[i]; rows.t[r] = ds.times[at[i]]; rows.kind[r] = e > 0 ? 0 : 1; rows.x[r] = e > 0 ? e - 1 : -e - 1; i++; }
      else { const [t, , kind, x] = extra[j++]; rows.t[r] = t; rows.kind[r] = kind; rows.x[r] = x; }
    }
    cache.set(key, rows);
    return rows;
  };

  GB.fillEvents = function (app) {
    const ds = app.ds, s = app.state, rows = GB.eventList(app, s.lane), blocks = ds.blocks, end = ds.end;
    if (s.eventAt === null || s.eventAt >= rows.n || s.eventLane !== s.lane) {  // the last event at or before the moment
      const i = s.moment === null ? 0 : Math.max(GB.upperBound(rows.t, s.moment) - 1, 0);
      s.eventAt = rows.n ? i : null; s.eventLane = s.lane;
    }
    const at = s.eventAt === null ? 0 : s.eventAt, from = Math.max(0, at - 50), to = Math.min(rows.n, at + 150);
    document.getElementById("events-title").textContent = rows.n ? "Event " + (at + 1) + " of " + rows.n.toLocaleString("en") +
      (s.lane !== null ? " in " + ds.budgets[s.lane].name + " and below" : "") + " (↑/↓ or k/j: the previous or next event; a click: that one)" : "No events";
    const shown = [];
    for (let i = from; i < to; i++) shown.push(i);
    document.querySelector("#events tbody").replaceChildren(...shown.map(i => {
      const t = rows.t[i], kind = KINDS[rows.kind[i]], x = rows.x[i], tr = el("tr", { "data-event": i });
      let cells;
      if (kind === "alloc" || kind === "free") cells = [formatSize(blocks.size[x]), ds.budgets[blocks.b[x]].name, ds.tagText(x),
        blocks.addr[x] >= 0 ? "0x" + blocks.addr[x].toString(16) : "—", ds.streams[blocks.stream[x]], innermost(ds, x)];
      else if (kind === "denied") { const d = ds.denials[x]; cells = [formatSize(d[2]), ds.budgets[d[1]].name, d[4] >= 0 ? ds.tags[d[4]] : "", "—", "", d[3].replace(/_/g, " ")]; }
      else { const g = ds.regions[x]; cells = [formatSize(g[2]), ds.budgets[g[0]].name, "", "0x" + g[1].toString(16), "", ""]; }
      [String(i + 1), ds.formatTime(t, end), kind, ...cells].forEach((text, c) => tr.appendChild(el("td", c === 0 || c === 3 ? { class: "num" } : {}, text)));
      if (i === at) tr.classList.add("now");
      tr.addEventListener("click", () => app.stepTo(i));
      return tr;
    }));
    return { at, n: rows.n, kind: rows.n ? KINDS[rows.kind[at]] : null };
  };

  GB.fillDenials = function (app) {
    const ds = app.ds, tab = document.getElementById("denials-tab");
    tab.textContent = "Denials (" + ds.denials.length + ")";
    tab.classList.toggle("alert", ds.denials.length > 0);
    document.getElementById("denials-title").textContent = ds.denials.length ? ds.denials.length +
      " requests refused" + (ds.denials.length > MAX_LISTED ? ", the first " + MAX_LISTED + " listed" : "") +
      " (click one: the moment, its budget's blocks then, the largest free block)" : "No request was refused";
    document.querySelector("#denials tbody").replaceChildren(...ds.denials.slice(0, MAX_LISTED).map(([t, b, bytes, reason, tag], i) => {
      const tr = el("tr", { "data-denial": i });
      [ds.formatTime(t, ds.end), ds.budgets[b].name, formatSize(bytes), reason.replace(/_/g, " "), tag >= 0 ? ds.tags[tag] : ""]
        .forEach((text, j) => tr.appendChild(el("td", j === 2 ? { class: "num" } : {}, text)));
      tr.addEventListener("click", () => {
        document.querySelectorAll("#denials tr.selected").forEach(n => n.classList.remove("selected"));
        tr.classList.add("selected");
        app.select(t, b, true);
      });
      return tr;
    }));
  };

  // -- compare ---------------------------------------------------------------------------

  function budgetIn(ds, key, path) {  // the same budget in another record, by its path
    let found = ds.budgets.find(b => b.key === key);
    if (!found) found = ds.budgets.find(b => b.path === path);
    return found ? found.index : undefined;
  }

  function side(app, spec) {
    const ds = spec.source === "other" && app.other ? app.other : app.ds;
    const chosen = app.state.lane === null ? null : app.ds.budgets[app.state.lane];
    let scope = chosen === null ? null : ds === app.ds ? chosen.index : budgetIn(ds, chosen.key, chosen.path);
    if (scope === undefined) return { ds, missing: true, name: chosen.path };
    const peakOf = scope === null ? ds.order.find(i => ds.budgets[i].parent === null) : scope;
    const t = spec.when === "peak" ? ds.peakOf(peakOf) : spec.when === "end" ? ds.end : spec.t;
    const blocks = GB.liveBlocks(ds, scope, t);
    const tags = new Map(), stacks = new Map();
    let bytes = 0;
    for (const k of blocks) {
      const size = ds.blocks.size[k], tag = ds.tagText(k) || "(no tag)", st = ds.stackText(k);
      const key = st.length ? st.map(frame => frame.replace(/:\d+ in /, " in ")).join("\n") : "(no stack)";
      bytes += size;
      tags.set(tag, (tags.get(tag) || 0) + size);
      stacks.set(key, (stacks.get(key) || 0) + size);
    }
    const what = (ds === app.ds ? "this record" : "the other record") + (scope === null ? "" : ", " + ds.budgets[scope].name);
    const when = spec.when === "peak" ? "at its peak (" + ds.formatTime(t, ds.end) + ")" : spec.when === "end" ? "at the end" : "at " + ds.formatTime(t, ds.end);
    return { ds, t, bytes, count: blocks.length, tags, stacks, label: what + " " + when };
  }

  function diffRows(a, b) {
    const keys = new Set([...a.keys(), ...b.keys()]);
    return [...keys].map(k => [k, a.get(k) || 0, b.get(k) || 0])
      .sort((p, q) => Math.abs(q[2] - q[1]) - Math.abs(p[2] - p[1]) || (p[0] < q[0] ? -1 : 1));
  }

  function signed(n) { return (n > 0 ? "+" : n < 0 ? "−" : "±") + formatSize(Math.abs(n)); }

  function fillDiff(body, rows, name) {
    body.replaceChildren(...rows.slice(0, MAX_DIFF_ROWS).map(([key, a, b]) => {
      const tr = el("tr", { title: key });
      tr.appendChild(el("td", {}, name(key)));
      tr.appendChild(el("td", { class: "num" }, formatSize(a)));
      tr.appendChild(el("td", { class: "num" }, formatSize(b)));
      tr.appendChild(el("td", { class: "num " + (b > a ? "grew" : b < a ? "shrank" : "") }, signed(b - a)));
      return tr;
    }));
  }

  GB.compare = function (app) {
    const spec = app.compareSpec, a = side(app, spec.a), b = side(app, spec.b);
    const title = document.getElementById("compare-title");
    if (a.missing || b.missing) {
      title.textContent = "The other record has no budget " + (a.missing ? a.name : b.name);
      return (app.compared = { missing: true });
    }
    title.textContent = "A: " + a.label + ": " + formatSize(a.bytes) + " in " + a.count + " blocks. B: " + b.label + ": " +
      formatSize(b.bytes) + " in " + b.count + " blocks. B − A: " + signed(b.bytes - a.bytes) + ".";
    const tags = diffRows(a.tags, b.tags), stacks = diffRows(a.stacks, b.stacks);
    fillDiff(document.querySelector("#compare-tags tbody"), tags, key => key);
    fillDiff(document.querySelector("#compare-stacks tbody"), stacks, key => {  // "function (file)"
      const frame = key.split("\n").pop(), at = frame.lastIndexOf(" in ");
      return at < 0 ? frame : frame.slice(at + 4) + " (" + frame.slice(0, at).split("/").pop() + ")";
    });
    return (app.compared = { a: { t: a.t, bytes: a.bytes, count: a.count }, b: { t: b.t, bytes: b.bytes, count: b.count }, tags, stacks });
  };

  GB.compareControls = function (app) {
    const box = document.getElementById("compare-controls"), parts = [];
    for (const name of ["a", "b"]) {
      const spec = app.compareSpec[name], label = el("span", {}, name.toUpperCase() + ": ");
      if (app.other) {
        const which = el("select", { id: "compare-" + name + "-source" });
        for (const [value, text] of [["main", "this record"], ["other", "the other record"]]) {
          const option = el("option", { value }, text); if (spec.source === value) option.selected = true; which.appendChild(option);
        }
        which.addEventListener("change", () => { spec.source = which.value; app.refreshCompare(); });
        label.appendChild(which);
      }
      const when = el("select", { id: "compare-" + name + "-when" });
      const options = [["peak", "at its peak"], ["end", "at the end"]];
      if (spec.when === "at") options.push(["at", "at " + GB.describeMoment(app, spec)]);
      for (const [value, text] of options) { const option = el("option", { value }, text); if (spec.when === value) option.selected = true; when.appendChild(option); }
      when.addEventListener("change", () => { spec.when = when.value; app.refreshCompare(); });
      const pin = el("button", { id: "compare-" + name + "-pin", title: "compare the moment chosen on the timeline" }, "the chosen moment");
      pin.addEventListener("click", () => {
        if (app.state.moment === null) return;
        Object.assign(spec, { when: "at", t: app.state.moment, source: "main" });
        GB.compareControls(app); app.refreshCompare();
      });
      label.appendChild(when); label.appendChild(pin);
      parts.push(label);
    }
    box.replaceChildren(...parts);
  };
  GB.describeMoment = (app, spec) => app.ds.formatTime(spec.t, app.ds.end);
})();
