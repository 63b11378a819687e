// gpubudget's memory viewer: lanes of used bytes per budget, zoom and pan, live blocks at a
// moment, a block's life, search by tag, the budget tree. No network, no library: the data
// sits in the page (columns inflated with DecompressionStream).
"use strict";
(function () {
  const GUTTER = 170, LANE = 58, AXIS = 26, MAX_LANES = 200, MAX_ROWS = 500;
  const viewer = { ready: false, errors: [] };
  window.gpubudgetViewer = viewer;

  function decode(b64) {
    const text = atob(b64), bytes = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
    return new Response(stream).arrayBuffer();
  }
  async function columns(spec, kinds) {
    const out = { n: spec.n };
    for (const [key, Type] of Object.entries(kinds)) out[key] = new Type(await decode(spec[key]));
    return out;
  }

  function formatSize(n) {
    const units = [["TiB", 2 ** 40], ["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 1024]];
    for (const [unit, size] of units) if (Math.abs(n) >= size) return (n / size).toFixed(2) + " " + unit;
    return n + " B";
  }
  const TIME_UNITS = [["h", 3600], ["min", 60], ["s", 1], ["ms", 1e-3], ["µs", 1e-6]];
  function timeUnit(span) {
    for (const [name, len] of TIME_UNITS) if (span >= 2 * len) return [name, len];
    return TIME_UNITS[TIME_UNITS.length - 1];
  }
  function formatTime(t, span) {
    if (!Number.isFinite(t)) return "—";
    const [name, len] = timeUnit(span || Math.abs(t) || 1e-6);
    const v = t / len;
    return (Math.abs(v) >= 100 ? v.toFixed(0) : v.toPrecision(3)) + " " + name;
  }
  function lowerBound(arr, value, n) {
    let lo = 0, hi = n;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (arr[mid] < value) lo = mid + 1; else hi = mid; }
    return lo;
  }
  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  async function main() {
    const raw = JSON.parse(document.getElementById("gpubudget-data").textContent);
    const budgets = raw.budgets.map((b, i) => ({ index: i, name: b[0], parent: b[1], limit: b[2],
      reserve: b[3], entered: b[4], exited: b[5], peak: b[6], allocations: b[7], frees: b[8],
      denied: b[9], children: [] }));
    for (const b of budgets) if (b.parent !== null) budgets[b.parent].children.push(b.index);
    const points = await columns(raw.points, { t: Float64Array, b: Int32Array, used: Float64Array, own: Float64Array });
    const blocks = await columns(raw.blocks, { b: Int32Array, size: Float64Array, tag: Int32Array,
      addr: Float64Array, t0: Float64Array, t1: Float64Array, stack: Int32Array });
    const end = raw.end > 0 ? raw.end : 1e-6;

    // Each budget's points, in time order: t, used, own.
    const counts = new Int32Array(budgets.length);
    for (let i = 0; i < points.n; i++) counts[points.b[i]]++;
    const lanes = budgets.map((b, i) => ({ n: 0, t: new Float64Array(counts[i]),
      used: new Float64Array(counts[i]), own: new Float64Array(counts[i]) }));
    for (let i = 0; i < points.n; i++) {
      const lane = lanes[points.b[i]], k = lane.n++;
      lane.t[k] = points.t[i]; lane.used[k] = points.used[i]; lane.own[k] = points.own[i];
    }
    const order = [];  // depth first, parents before children
    const stack = budgets.filter(b => b.parent === null).map(b => b.index).reverse();
    while (stack.length) { const i = stack.pop(); order.push(i); stack.push(...budgets[i].children.slice().reverse()); }
    const depth = budgets.map(() => 0);
    for (const i of order) if (budgets[i].parent !== null) depth[i] = depth[budgets[i].parent] + 1;
    // The lanes drawn: the first MAX_LANES budgets; a budget picked in the tree beyond them
    // brings its part of the order (from its root on) into view.
    const drawnLanes = order.slice(0, MAX_LANES);
    const laneRow = new Map(drawnLanes.map((b, row) => [b, row]));
    function showLane(i) {
      if (!laneRow.has(i)) {
        let root = i; while (budgets[root].parent !== null) root = budgets[root].parent;
        const from = order.indexOf(root);
        drawnLanes.splice(0, drawnLanes.length, ...order.slice(from, from + MAX_LANES));
        if (!drawnLanes.includes(i)) drawnLanes.splice(0, drawnLanes.length, ...order.slice(order.indexOf(i), order.indexOf(i) + MAX_LANES));
        laneRow.clear(); drawnLanes.forEach((b, row) => laneRow.set(b, row));
        draw();
      }
      document.getElementById("lanes-box").scrollTop = laneRow.get(i) * LANE;
    }

    const state = { v0: 0, v1: end, moment: null, lane: null, block: null, query: "" };
    const canvas = document.getElementById("lanes");
    const ctx = canvas.getContext("2d");
    const plotWidth = () => canvas.clientWidth - GUTTER - 12;
    const xOf = t => GUTTER + (t - state.v0) / (state.v1 - state.v0) * plotWidth();
    const tOf = x => state.v0 + (x - GUTTER) / plotWidth() * (state.v1 - state.v0);
    const within = (b, lane) => { for (let i = b; i !== null; i = budgets[i].parent) if (i === lane) return true; return false; };

    document.getElementById("note").textContent = (raw.source === "report"
      ? "from a report: blocks as they were when it was taken; "
      : "") + budgets.length + " budgets, " + points.n.toLocaleString() + " changes, " +
      blocks.n.toLocaleString() + " blocks, " + raw.denials.length + " denials" +
      (order.length > MAX_LANES ? "; " + MAX_LANES + " budgets drawn at once (pick one in the tree)" : "");

    function drawAxis(width) {
      const span = state.v1 - state.v0, [unit, len] = timeUnit(span);
      let step = Math.pow(10, Math.floor(Math.log10(span / len / 6))) * len;
      for (const m of [1, 2, 5, 10]) if (span / (step * m) <= 8) { step *= m; break; }
      ctx.fillStyle = "#667085"; ctx.strokeStyle = "#eaecf0"; ctx.font = "11px system-ui";
      ctx.textAlign = "center";
      for (let t = Math.ceil(state.v0 / step) * step; t <= state.v1; t += step) {
        const x = xOf(t);
        ctx.beginPath(); ctx.moveTo(x, AXIS - 6); ctx.lineTo(x, canvas.height); ctx.stroke();
        ctx.fillText(+(t / len).toPrecision(6) + " " + unit, x, 12);
      }
      ctx.textAlign = "left";
    }

    function drawLane(b, top) {
      const budget = budgets[b], lane = lanes[b], h = LANE - 14, base = top + LANE - 4;
      const scale = Math.max(budget.limit, budget.peak, 1), w = plotWidth();
      const y = v => base - v / scale * h;
      ctx.fillStyle = "#1d2330"; ctx.font = "12px system-ui";
      const name = "  ".repeat(Math.min(depth[b], 6)) + budget.name;
      ctx.fillText(name.length > 24 ? name.slice(0, 23) + "…" : name, 4, top + 16);
      ctx.fillStyle = "#667085"; ctx.font = "11px system-ui";
      ctx.fillText("limit " + formatSize(budget.limit), 4, top + 30);
      ctx.fillText("peak " + formatSize(budget.peak), 4, top + 43);
      ctx.strokeStyle = "#eaecf0"; ctx.beginPath(); ctx.moveTo(0, top + LANE); ctx.lineTo(canvas.width, top + LANE); ctx.stroke();
      if (state.block !== null && blocks.b[state.block] === b) {  // the chosen block's life
        const x0 = Math.max(GUTTER, xOf(Number.isNaN(blocks.t0[state.block]) ? 0 : blocks.t0[state.block]));
        const x1 = Math.min(GUTTER + w, xOf(Number.isNaN(blocks.t1[state.block]) ? end : blocks.t1[state.block]));
        ctx.fillStyle = "rgba(247,144,9,0.25)"; ctx.fillRect(x0, top + 2, Math.max(2, x1 - x0), LANE - 4);
      }
      // One column per pixel: the highest used and own bytes in it (the lowest too, as a line).
      const span = state.v1 - state.v0, t = lane.t, n = lane.n;
      let i = lowerBound(t, state.v0, n);
      let used = i > 0 ? lane.used[i - 1] : 0, own = i > 0 ? lane.own[i - 1] : 0;
      for (let c = 0; c < w; c++) {
        const tEnd = state.v0 + (c + 1) / w * span;
        if (state.v0 + c / w * span > end) break;
        let lo = used, hi = used, ownHi = own;
        while (i < n && t[i] < tEnd) {
          used = lane.used[i]; own = lane.own[i]; i++;
          if (used < lo) lo = used; if (used > hi) hi = used; if (own > ownHi) ownHi = own;
        }
        const x = GUTTER + c;
        if (hi > 0) { ctx.fillStyle = "#9ec5fe"; ctx.fillRect(x, y(hi), 1, base - y(hi)); }
        if (ownHi > 0) { ctx.fillStyle = "#3d7bd9"; ctx.fillRect(x, y(ownHi), 1, base - y(ownHi)); }
        if (hi > lo) { ctx.fillStyle = "#1849a9"; ctx.fillRect(x, y(hi), 1, Math.max(1, y(lo) - y(hi))); }
      }
      ctx.strokeStyle = "#475467"; ctx.setLineDash([5, 4]); ctx.beginPath();
      ctx.moveTo(GUTTER, y(budget.limit)); ctx.lineTo(GUTTER + w, y(budget.limit)); ctx.stroke();
      ctx.setLineDash([]);
    }

    function draw() {
      const ratio = window.devicePixelRatio || 1, width = canvas.clientWidth;
      const height = AXIS + drawnLanes.length * LANE;
      canvas.style.height = height + "px";
      canvas.width = Math.round(width * ratio); canvas.height = Math.round(height * ratio);
      ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
      ctx.clearRect(0, 0, width, height);
      drawAxis(width);
      drawnLanes.forEach((b, row) => drawLane(b, AXIS + row * LANE));
      let denials = 0;
      ctx.fillStyle = "#d92d20";
      for (const [t, b] of raw.denials) {
        const row = laneRow.get(b);
        if (row === undefined || t < state.v0 || t > state.v1) continue;
        const x = xOf(t), top = AXIS + row * LANE + 3;
        ctx.beginPath(); ctx.moveTo(x - 5, top); ctx.lineTo(x + 5, top); ctx.lineTo(x, top + 9); ctx.fill();
        ctx.fillRect(x - 0.5, top, 1, LANE - 8);
        denials++;
      }
      if (state.moment !== null && state.moment >= state.v0 && state.moment <= state.v1) {
        ctx.fillStyle = "#f79009"; ctx.fillRect(xOf(state.moment) - 1, AXIS - 6, 2, height);
      }
      viewer.drawn = { lanes: drawnLanes.length, denials: denials };
      document.getElementById("range").textContent = "showing " + formatTime(state.v0, state.v1 - state.v0) +
        " to " + formatTime(state.v1, state.v1 - state.v0) + " of " + formatTime(end, end);
    }

    function zoom(factor, at) {
      const center = at === undefined ? (state.v0 + state.v1) / 2 : at;
      let span = Math.min(Math.max((state.v1 - state.v0) * factor, 1e-9), end * 1.02);
      let v0 = center - (center - state.v0) * span / (state.v1 - state.v0);
      v0 = Math.min(Math.max(v0, -end * 0.01), end * 1.01 - span);
      state.v0 = v0; state.v1 = v0 + span; draw();
    }

    function blockRow(k) {
      const tr = el("tr", { "data-block": k });
      const st = blocks.stack[k] >= 0 ? raw.stacks[blocks.stack[k]] : [];
      const cells = [formatSize(blocks.size[k]), blocks.tag[k] >= 0 ? raw.tags[blocks.tag[k]] : "",
        budgets[blocks.b[k]].name, "0x" + blocks.addr[k].toString(16), formatTime(blocks.t0[k], end),
        Number.isNaN(blocks.t1[k]) ? "live at end" : formatTime(blocks.t1[k], end),
        st.length ? raw.frames[st[st.length - 1]] : ""];
      cells.forEach((text, i) => tr.appendChild(el("td", i === 0 ? { class: "num" } : {}, text)));
      if (k === state.block) tr.className = "selected";
      tr.addEventListener("click", () => showLife(k));
      return tr;
    }

    function listBlocks() {
      const q = state.query.toLowerCase(), found = [];
      const tagOk = k => !q || (blocks.tag[k] >= 0 && raw.tags[blocks.tag[k]].toLowerCase().includes(q));
      for (let k = 0; k < blocks.n; k++) {
        if (!tagOk(k)) continue;
        if (state.lane !== null && !within(blocks.b[k], state.lane)) continue;
        if (state.moment !== null) {
          const t0 = blocks.t0[k], t1 = blocks.t1[k];
          if (!Number.isNaN(t0) && t0 > state.moment) continue;
          if (!Number.isNaN(t1) && t1 <= state.moment) continue;
        }
        found.push(k);
      }
      found.sort((a, b) => blocks.size[b] - blocks.size[a]);
      let total = 0; for (const k of found) total += blocks.size[k];
      const where = state.lane !== null ? " in " + budgets[state.lane].name + (budgets[state.lane].children.length ? " and below" : "") : "";
      const when = state.moment !== null ? " live at " + formatTime(state.moment, end) : " (all)";
      document.getElementById("blocks-title").textContent = found.length + " blocks" +
        (q ? " tagged *" + state.query + "*" : "") + where + when + ", " + formatSize(total);
      const body = document.querySelector("#blocks tbody");
      body.replaceChildren(...found.slice(0, MAX_ROWS).map(blockRow));
      document.getElementById("blocks-more").textContent = found.length > MAX_ROWS ? "… " + (found.length - MAX_ROWS) + " more (largest shown)" : "";
      viewer.listed = found.slice();
    }

    function showLife(k) {
      state.block = k; draw(); listBlocks();
      const life = document.getElementById("life"), t0 = blocks.t0[k], t1 = blocks.t1[k];
      const st = blocks.stack[k] >= 0 ? raw.stacks[blocks.stack[k]].map(f => raw.frames[f]) : [];
      life.replaceChildren(
        el("div", {}, formatSize(blocks.size[k]) + " at 0x" + blocks.addr[k].toString(16) + " in " + budgets[blocks.b[k]].name +
          (blocks.tag[k] >= 0 ? ", tag " + raw.tags[blocks.tag[k]] : ", no tag")),
        el("div", {}, (Number.isNaN(t0) ? "allocation time not kept (a report's block)" : "allocated at " + formatTime(t0, end)) +
          ", " + (Number.isNaN(t1) ? "still live at the end" : "freed at " + formatTime(t1, end) +
          (Number.isNaN(t0) ? "" : " (lived " + formatTime(t1 - t0) + ")"))),
        el("pre", {}, st.length ? st.join("\n") : "no stack (track_stacks=True keeps them)"));
      viewer.life = k;
    }

    function buildTree() {
      const root = el("ul"), nodes = new Map();
      for (const i of order) {
        const b = budgets[i], li = el("li"), row = el("div", { "data-budget": i });
        row.appendChild(el("span", {}, b.name + " "));
        row.appendChild(el("span", { class: "num" }, formatSize(b.peak) + " / " + formatSize(b.limit) +
          " · " + b.allocations + " allocs"));
        if (b.denied) row.appendChild(el("span", { class: "num denied" }, " · " + b.denied + " denied"));
        row.addEventListener("click", () => {
          state.lane = i; document.querySelectorAll("#tree .selected").forEach(n => n.classList.remove("selected"));
          row.classList.add("selected"); listBlocks();
          showLane(i);
        });
        row.addEventListener("dblclick", () => {  // zoom to its life
          const until = b.exited === null ? end : b.exited, margin = Math.max((until - b.entered) * 0.05, 1e-6);
          state.v0 = Math.max(b.entered - margin, 0); state.v1 = Math.min(until + margin, end * 1.01); draw();
        });
        li.appendChild(row); li.appendChild(el("ul"));
        (b.parent === null ? root : nodes.get(b.parent).lastChild).appendChild(li);
        nodes.set(i, li);
      }
      document.getElementById("tree").replaceChildren(root);
    }

    let drag = null;
    canvas.addEventListener("mousedown", e => { drag = { x: e.offsetX, v0: state.v0, v1: state.v1, moved: false }; });
    window.addEventListener("mouseup", e => {
      if (drag && !drag.moved && e.target === canvas && e.offsetX >= GUTTER) {
        state.moment = Math.min(Math.max(tOf(e.offsetX), 0), end);
        const row = Math.floor((e.offsetY - AXIS) / LANE);
        state.lane = row >= 0 && row < drawnLanes.length ? drawnLanes[row] : null;
        draw(); listBlocks();
      }
      drag = null;
    });
    canvas.addEventListener("mousemove", e => {
      if (!drag) return;
      const dx = e.offsetX - drag.x;
      if (Math.abs(dx) > 3) drag.moved = true;
      if (!drag.moved) return;
      const dt = dx / plotWidth() * (drag.v1 - drag.v0);
      state.v0 = drag.v0 - dt; state.v1 = drag.v1 - dt; draw();
    });
    canvas.addEventListener("wheel", e => { e.preventDefault(); zoom(Math.pow(1.0015, e.deltaY), tOf(e.offsetX)); }, { passive: false });
    canvas.addEventListener("dblclick", () => { state.v0 = 0; state.v1 = end; draw(); });
    document.getElementById("zoom-in").addEventListener("click", () => zoom(0.5));
    document.getElementById("zoom-out").addEventListener("click", () => zoom(2));
    document.getElementById("zoom-reset").addEventListener("click", () => { state.v0 = 0; state.v1 = end; draw(); });
    document.getElementById("search").addEventListener("input", e => { state.query = e.target.value; listBlocks(); });
    window.addEventListener("keydown", e => {
      if (e.target.tagName === "INPUT") return;
      if (e.key === "+" || e.key === "=") zoom(0.5); else if (e.key === "-") zoom(2);
    });
    window.addEventListener("resize", draw);

    Object.assign(viewer, { budgets, end, state, GUTTER, AXIS, LANE, laneRow, drawnLanes, xOf, tOf, draw, zoom, listBlocks, showLife, showLane,
      select(t, lane) { state.moment = t; state.lane = lane; draw(); listBlocks(); } });
    buildTree(); draw();
    viewer.ready = true; document.body.dataset.ready = "1";
  }
  window.addEventListener("error", e => viewer.errors.push(String(e.message)));
  main().catch(err => {
    viewer.errors.push(String(err)); document.body.dataset.ready = "error";
    document.getElementById("note").textContent = "cannot show the data: " + err;
    console.error(err);
  });
})();
