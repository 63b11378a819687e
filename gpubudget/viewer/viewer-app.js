// gpubudget's memory viewer, part 6 of 6: the page. Loads the records, keeps the state (the
// time in view, the chosen moment, budget, block and event, the colouring), answers the
// mouse, the keyboard and the search, draws the minimap, and opens on the first root's peak
// so every view shows something at once.
// window.gpubudgetViewer is what tests and scripts read.
(function () {
  const { el, formatSize } = GB;
  const MAX_LANES = 200;
  const viewer = { ready: false, warm: false, errors: [] };
  window.gpubudgetViewer = viewer;

  function tip(text, x, y) {
    const box = document.getElementById("tip");
    if (!text) { box.hidden = true; return; }
    box.textContent = text; box.hidden = false;
    const left = Math.min(x + 14, window.innerWidth - box.offsetWidth - 8), top = Math.min(y + 14, window.innerHeight - box.offsetHeight - 8);
    box.style.left = Math.max(left, 0) + "px"; box.style.top = Math.max(top, 0) + "px";
    viewer.tip = text;
  }

  function blockText(ds, k, extra) {
    const blocks = ds.blocks, st = ds.stackText(k);
    return [formatSize(blocks.size[k]) + " · " + (ds.tagText(k) ? "tag " + ds.tagText(k) : "no tag") + " · " + ds.budgets[blocks.b[k]].name +
      (ds.isLeak[k] ? " · leaked at the end" : "") + (ds.blocks.req[k] >= 0 ? " · requested " + GB.exactSize(ds.blocks.req[k]) : "") +
      (ds.streams.length > 1 ? " · " + ds.streams[ds.blocks.stream[k]] : ""), (Number.isFinite(ds.t0(k)) ? "allocated " + ds.formatTime(ds.t0(k), ds.end) : "allocated before the record") +
      (Number.isFinite(ds.t1(k)) ? ", freed " + ds.formatTime(ds.t1(k), ds.end) : ", live at the end"), ...(extra || []),
      ...(st.length ? st.slice(-8).reverse() : ["(no stack)"])].join("\n");
  }

  async function main() {
    const timings = viewer.timings = { script: performance.now() };  // ms since navigation
    const raw = JSON.parse(document.getElementById("gpubudget-data").textContent);
    timings.parsed = performance.now();
    const [ds, other] = await Promise.all([GB.loadDataset(raw.main), raw.other ? GB.loadDataset(raw.other) : null]);
    timings.loaded = performance.now();
    const roots = ds.order.filter(i => ds.budgets[i].parent === null);
    const state = { v0: 0, v1: ds.end, moment: null, lane: null, block: null, query: "", colour: "tag", flameByTag: false, focus: null, bySegment: false, eventAt: null, eventLane: null };
    const app = { ds, other, state, summaries: new Map(), canvas: document.getElementById("lanes"),
      addressCanvas: document.getElementById("addresses"), flameCanvas: document.getElementById("flame"),
      drawnLanes: ds.order.slice(0, MAX_LANES), laneRow: new Map(), laneHeight: 64, flame: {}, layouts: new Map(), grids: new Map() };
    app.drawnLanes.forEach((b, row) => app.laneRow.set(b, row));
    // the canvases' widths, read when the window changes (reading them after the tables
    // change would lay the whole page out again, every time)
    app.measure = () => { app.sizes = { lanes: app.canvas.clientWidth, addresses: app.addressCanvas.clientWidth,
      addressHeight: app.addressCanvas.clientHeight || 200, flame: app.flameCanvas.clientWidth }; };
    document.getElementById("overview").hidden = true;
    app.measure();
    app.plotWidth = () => app.sizes.lanes - GB.GUTTER - 12;
    app.xOf = t => GB.GUTTER + (t - state.v0) / (state.v1 - state.v0) * app.plotWidth();
    app.tOf = x => state.v0 + (x - GB.GUTTER) / app.plotWidth() * (state.v1 - state.v0);
    app.addressRoot = () => state.lane !== null ? ds.budgets[state.lane].root : roots[0];
    const blocksUsed = ds.blocks.n > 0;
    state.colour = ds.tags.length ? "tag" : ds.frames.length ? "frame" : "budget";
    document.getElementById("colour-by").value = state.colour;
    state.flameByTag = !ds.frames.length && ds.tags.length > 0;  // no stacks: the tags at least
    document.getElementById("flame-by-tag").checked = state.flameByTag;

    document.getElementById("note").textContent = (ds.source === "report" ? "from a report: its timeline's last events; " : "") +
      ds.budgets.length + " budgets, " +
      ds.times.length.toLocaleString() + " events, " + ds.blocks.n.toLocaleString() + " blocks, " + ds.denials.length + (ds.denials.length === 1 ? " denial" : " denials") +
      (other ? "; compared with " + other.title : "") + (ds.order.length > MAX_LANES ? "; " + MAX_LANES + " budgets drawn at once (pick one in the tree)" : "") +
      ds.notes.map(note => "; " + note).join("");

    function recolour() {
      app.keys = state.focus !== null ? GB.colourKeys(ds, "focus", state.focus) : GB.colourKeys(ds, state.colour);
      app.summaries.clear(); app.grids.clear();
      document.getElementById("legend").replaceChildren(...app.keys.legend.map(entry => {
        const item = el("span", { title: entry.label + (entry.bytes ? ": " + formatSize(entry.bytes) + " allocated in all" : "") });
        const swatch = el("i"); swatch.style.background = GB.PALETTE[entry.rank];
        item.appendChild(swatch); item.appendChild(document.createTextNode(entry.label));
        return item;
      }));
      if (ds.source !== "torch") {  // what red means, by the rule BudgetReport.leaks uses
        const rule = el("span", { id: "leak-rule", class: "rule", title: "BudgetReport.leaks: blocks still live after their budget's scope exited, when the report is taken" });
        const swatch = el("i"); swatch.style.background = "#d92d20";
        rule.appendChild(swatch);
        rule.appendChild(document.createTextNode("leak: still live when the record ends, its budget's with block exited (as report().leaks); serving after the block is not one"));
        document.getElementById("legend").appendChild(rule);
      }
    }

    // The minimap: the whole run, the first root's used bytes (or the chosen budget's), the
    // view as a window over it; a click or a drag there moves the view, keeping its span.
    const minimap = document.getElementById("minimap");
    function drawMinimap() {
      const ctx = minimap.getContext("2d"), ratio = window.devicePixelRatio || 1, width = app.sizes.lanes, height = 36;
      minimap.width = Math.round(width * ratio); minimap.height = Math.round(height * ratio);
      ctx.setTransform(ratio, 0, 0, ratio, 0, 0); ctx.clearRect(0, 0, width, height);
      const b = state.lane !== null ? state.lane : roots[0], w = app.plotWidth(), x = t => GB.GUTTER + t / ds.end * w;
      ctx.fillStyle = "#667085"; ctx.font = "11px system-ui"; ctx.fillText("whole run", 4, 14);
      if (b === undefined) return null;
      ctx.fillText(ds.budgets[b].name, 4, 28);
      const top = Math.max(ds.budgets[b].peak, 1), cols = Math.max(Math.ceil(w), 1), key = b + "/" + cols;
      if (!app.minimapCache || app.minimapCache.key !== key) {  // the run's picture: once per budget and width
        const lane = ds.lanes[b], hi = new Float64Array(cols);
        let used = 0, p = 0;
        for (let c = 0; c < cols; c++) {
          const until = (c + 1) / cols * ds.end;
          let h = used;
          while (p < lane.n && (lane.t[p] < until || c === cols - 1)) { used = lane.used[p++]; if (used > h) h = used; }
          hi[c] = h;
        }
        app.minimapCache = { key, hi };
      }
      const hi = app.minimapCache.hi;
      ctx.fillStyle = "#eaecf0"; ctx.fillRect(GB.GUTTER, 2, w, height - 4);
      ctx.fillStyle = "#98a2b3";
      for (let c = 0; c < cols; c++) { const h = hi[c] / top * (height - 6); ctx.fillRect(GB.GUTTER + c, height - 3 - h, 1, h); }
      const x0 = Math.max(x(state.v0), GB.GUTTER), x1 = Math.min(x(state.v1), GB.GUTTER + w);
      ctx.fillStyle = "rgba(247, 144, 9, 0.18)"; ctx.fillRect(x0, 1, Math.max(x1 - x0, 2), height - 2);
      ctx.strokeStyle = "#f79009"; ctx.lineWidth = 2; ctx.strokeRect(x0, 1, Math.max(x1 - x0, 2), height - 2); ctx.lineWidth = 1;
      return { lane: b, x0, x1 };
    }
    function minimapTo(offsetX) {
      const span = state.v1 - state.v0, t = (offsetX - GB.GUTTER) / app.plotWidth() * ds.end;
      state.v0 = Math.min(Math.max(t - span / 2, -ds.end * 0.01), ds.end * 1.01 - span); state.v1 = state.v0 + span; draw();
    }
    let sliding = false;
    minimap.addEventListener("mousedown", e => { if (e.offsetX >= GB.GUTTER) { sliding = true; minimapTo(e.offsetX); } });
    minimap.addEventListener("mousemove", e => { if (sliding && e.buttons) minimapTo(e.offsetX); });
    window.addEventListener("mouseup", () => { sliding = false; });

    function draw() {
      viewer.minimap = drawMinimap();
      viewer.drawn = GB.drawLanes(app);
      viewer.addresses = GB.drawAddresses(app);
      document.getElementById("range").textContent = "showing " + ds.formatTime(state.v0, state.v1 - state.v0) +
        " to " + ds.formatTime(state.v1, state.v1 - state.v0) + " of " + ds.formatTime(ds.end, ds.end);
    }
    let pending = false;
    function requestDraw() { if (!pending) { pending = true; requestAnimationFrame(() => { pending = false; draw(); }); } }

    function flame() {
      const blocks = state.moment === null ? [] : GB.liveBlocks(ds, state.lane, state.moment);
      app.flame.tree = state.bySegment && state.moment !== null ? GB.segmentTree(ds, blocks, state.moment, state.lane) : GB.flameTree(ds, blocks, state.flameByTag);
      app.flame.focus = GB.flameStart(app.flame.tree);
      const what = state.bySegment ? "Segments held" : "Live bytes by stack";
      document.getElementById("flame-title").textContent = state.moment === null ? what :
        what + (state.lane !== null ? " in " + ds.budgets[state.lane].name : "") + " at " + ds.formatTime(state.moment, ds.end) +
        ": " + formatSize(app.flame.tree.bytes);
      viewer.flame = GB.drawFlame(app);
    }
    function listBlocks() { viewer.listed = GB.listBlocks(app); if (!document.getElementById("tab-events").hidden) viewer.events = GB.fillEvents(app); }
    // The event list's chosen event: its moment (after it), its budget kept, its block's life.
    app.stepTo = i => {
      const rows = GB.eventList(app, state.lane);
      if (!rows.n) return;
      i = Math.min(Math.max(i, 0), rows.n - 1);
      const t = rows.t[i], kind = rows.kind[i] <= 1 ? "block" : "other", x = rows.x[i], lane = state.lane;
      select(t, lane, true);
      state.eventAt = i; state.eventLane = lane;
      if (kind === "block") showLife(x); else listBlocks();
      viewer.events = GB.fillEvents(app);
      const row = document.querySelector("#events tr.now");
      if (row) row.scrollIntoView({ block: "nearest", inline: "start" });
    };
    app.refreshCompare = () => { if (!document.getElementById("tab-compare").hidden) viewer.compared = GB.compare(app); else app.compareDirty = true; };

    function showLane(i) {
      if (!app.laneRow.has(i)) {
        const from = ds.order.indexOf(ds.budgets[i].root);
        let lanes = ds.order.slice(from, from + MAX_LANES);
        if (!lanes.includes(i)) lanes = ds.order.slice(ds.order.indexOf(i), ds.order.indexOf(i) + MAX_LANES);
        app.drawnLanes.splice(0, app.drawnLanes.length, ...lanes);
        app.laneRow.clear(); app.drawnLanes.forEach((b, row) => app.laneRow.set(b, row));
        draw();
      }
      document.getElementById("lanes-box").scrollTop = app.laneRow.get(i) * app.laneHeight;
    }
    function markTree() {
      document.querySelectorAll("#tree .selected").forEach(n => n.classList.remove("selected"));
      if (state.lane !== null) { const row = document.querySelector("#tree [data-budget='" + state.lane + "']"); if (row) row.classList.add("selected"); }
    }
    function select(t, lane, reveal) {  // the chosen moment (and budget): every view follows
      state.moment = t === null ? null : Math.min(Math.max(t, 0), ds.end);
      state.lane = lane;
      if (reveal && t !== null && (t < state.v0 || t > state.v1)) {
        const span = state.v1 - state.v0;
        state.v0 = Math.max(t - span / 2, 0); state.v1 = state.v0 + span;
      }
      if (reveal && lane !== null) showLane(lane);
      state.eventAt = null;  // the event list follows the moment
      markTree(); draw(); flame(); listBlocks(); app.refreshCompare();  // the canvases before the table
    }
    function showLife(k) { state.block = k; draw(); listBlocks(); GB.showLife(app, k); viewer.life = k; }
    app.select = select; app.showLife = showLife;

    function zoom(factor, at) {
      const center = at === undefined ? (state.v0 + state.v1) / 2 : at, end = ds.end;
      const span = Math.min(Math.max((state.v1 - state.v0) * factor, 1e-9), end * 1.02);
      let v0 = center - (center - state.v0) * span / (state.v1 - state.v0);
      v0 = Math.min(Math.max(v0, -end * 0.01), end * 1.01 - span);
      state.v0 = v0; state.v1 = v0 + span; draw();
    }
    function whole() { state.v0 = 0; state.v1 = ds.end; draw(); }
    function zoomTo(i) {  // where budget i's memory lived: entry to release, blocks after its scope too
      const [from, until] = ds.lived[i], margin = Math.max((until - from) * 0.05, 1e-6);
      state.v0 = Math.max(from - margin, 0); state.v1 = Math.min(until + margin, ds.end * 1.01); draw();
    }

    function buildTree() {
      const top = el("ul"), nodes = new Map();
      for (const i of ds.order) {
        const b = ds.budgets[i], li = el("li"), row = el("div", { "data-budget": i });
        row.appendChild(el("span", {}, b.name + " "));
        row.appendChild(el("span", { class: "num" }, formatSize(b.peak) + " / " + (b.limit ? formatSize(b.limit) : "no limit") + " · " + b.allocations + " allocs"));
        if (b.denied) row.appendChild(el("span", { class: "num denied" }, " · " + b.denied + " denied"));
        if (ds.leaked[i]) row.appendChild(el("span", { class: "num denied" }, " · leaked " + formatSize(ds.leaked[i])));
        if (b.door) {  // under the driver door: what libraries took through it, and who was refused
          const [held, refusals, lastSize, lastBy, libs] = b.door, holding = libs.filter(l => l[1] > 0);
          row.appendChild(el("span", { class: "num door" }, " · driver door " + formatSize(held) +
            (holding.length ? " (" + holding.map(l => l[0] + " " + formatSize(l[1])).join(", ") + ")" : "")));
          if (refusals) row.appendChild(el("span", { class: "num denied door-refused" }, " · " + refusals +
            " refused at the door, the last " + formatSize(lastSize) + " asked by " + (lastBy || "an unknown library")));
        }
        row.addEventListener("click", () => select(state.moment, i, true));
        row.addEventListener("dblclick", () => zoomTo(i));
        li.appendChild(row); li.appendChild(el("ul"));
        (b.parent === null ? top : nodes.get(b.parent).lastChild).appendChild(li);
        nodes.set(i, li);
      }
      document.getElementById("tree").replaceChildren(top);
    }

    // Pointer: drag to pan, click for a moment, wheel to zoom, hover for what is there.
    function pointer(canvas, hit, clicked) {
      let drag = null;
      canvas.addEventListener("mousedown", e => { drag = { x: e.offsetX, v0: state.v0, v1: state.v1, moved: false }; });
      canvas.addEventListener("mouseup", e => {
        if (drag && !drag.moved && e.offsetX >= GB.GUTTER) clicked(e.offsetX, e.offsetY);
        drag = null;
      });
      canvas.addEventListener("mousemove", e => {
        if (drag) {
          const dx = e.offsetX - drag.x;
          if (Math.abs(dx) > 3) drag.moved = true;
          if (drag.moved) {
            const dt = dx / app.plotWidth() * (drag.v1 - drag.v0);
            state.v0 = drag.v0 - dt; state.v1 = drag.v1 - dt; requestDraw(); return;
          }
        }
        tip(hit(e.offsetX, e.offsetY), e.clientX, e.clientY);
      });
      canvas.addEventListener("mouseleave", () => { drag = null; tip(null); });
      canvas.addEventListener("wheel", e => { e.preventDefault(); const at = app.tOf(e.offsetX); const f = Math.pow(1.0015, e.deltaY);
        const center = at, end = ds.end, span = Math.min(Math.max((state.v1 - state.v0) * f, 1e-9), end * 1.02);
        let v0 = center - (center - state.v0) * span / (state.v1 - state.v0);
        v0 = Math.min(Math.max(v0, -end * 0.01), end * 1.01 - span); state.v0 = v0; state.v1 = v0 + span; requestDraw(); }, { passive: false });
      canvas.addEventListener("dblclick", whole);
    }
    pointer(app.canvas, (x, y) => {
      const found = GB.laneHit(app, x, y);
      if (!found) return null;
      const head = ds.budgets[found.lane].name + " at " + ds.formatTime(found.t, ds.end) + ": " + formatSize(found.total) + " live in " + found.live.length + " blocks";
      viewer.hovered = { t: found.t, bytes: found.total, count: found.live.length, lane: found.lane, x };
      if (found.block === null) return head;
      let tagged = 0, count = 0;
      for (const k of found.live) if (ds.blocks.tag[k] === ds.blocks.tag[found.block]) { tagged += ds.blocks.size[k]; count++; }
      return blockText(ds, found.block, [head, (ds.tagText(found.block) ? "tag " + ds.tagText(found.block) : "untagged") + ": " + formatSize(tagged) + " in " + count + " blocks"]);
    }, (x, y) => {
      const found = GB.laneHit(app, x, y), row = Math.floor((y - GB.AXIS) / app.laneHeight);
      select(found ? found.t : app.tOf(x), found ? found.lane : (row >= 0 && row < app.drawnLanes.length ? app.drawnLanes[row] : null));
    });
    pointer(app.addressCanvas, (x, y) => {
      const found = GB.addressHit(app, x, y);
      return found && found.block !== null ? blockText(ds, found.block) : null;
    }, (x, y) => {
      const found = GB.addressHit(app, x, y);
      if (!found) return;
      select(found.t, state.lane === null ? found.root : state.lane);
      if (found.block !== null) showLife(found.block);
    });
    app.flameCanvas.addEventListener("mousemove", e => {
      const n = GB.flameHit(app, e.offsetX, e.offsetY);
      tip(n ? n.name + "\n" + formatSize(n.bytes) + " in " + n.count + " blocks (" + (100 * n.bytes / Math.max(app.flame.tree.bytes, 1)).toFixed(1) + "%)" : null, e.clientX, e.clientY);
    });
    app.flameCanvas.addEventListener("mouseleave", () => tip(null));
    app.flameCanvas.addEventListener("click", e => {
      const n = GB.flameHit(app, e.offsetX, e.offsetY);
      if (!n) return;
      app.flame.focus = n === app.flame.focus ? (n.parent ? app.flame.tree : n) : n;  // the top row: all
      viewer.flame = GB.drawFlame(app);
      viewer.flameFocus = GB.flamePath(app.flame.focus);
    });
    document.getElementById("flame-by-tag").addEventListener("change", e => { state.flameByTag = e.target.checked; flame(); });
    document.getElementById("flame-by-segment").addEventListener("change", e => { state.bySegment = e.target.checked; flame(); });
    document.getElementById("zoom-in").addEventListener("click", () => zoom(0.5));
    document.getElementById("zoom-out").addEventListener("click", () => zoom(2));
    document.getElementById("zoom-reset").addEventListener("click", whole);
    // The search: budgets, tags and addresses, answered in a list under the box; a choice
    // shows it where the eye is (the lane, the tag's blocks coloured, the block's life).
    const search = document.getElementById("search"), results = document.getElementById("search-results");
    function lookFor(text) {
      state.query = text; viewer.matches = GB.searchMatches(ds, text, state.moment);
      results.replaceChildren(...viewer.matches.map((m, i) => {
        const row = el("div", { "data-kind": m.kind, class: i === 0 ? "first" : "" });
        row.appendChild(el("span", { class: "kind" }, m.kind)); row.appendChild(document.createTextNode(m.label));
        row.addEventListener("mousedown", e => { e.preventDefault(); take(m); });
        return row;
      }));
      results.hidden = !viewer.matches.length;
      if (!text && state.focus !== null) { state.focus = null; recolour(); draw(); }
      listBlocks();
    }
    function take(m) {
      results.hidden = true; viewer.taken = m;
      if (m.kind === "budget") select(state.moment, m.index, true);
      else if (m.kind === "tag") { state.focus = m.index; recolour(); draw(); }
      else {
        const k = m.index, t0 = Math.max(ds.t0(k), 0), t1 = Math.min(ds.t1(k), ds.end);
        const t = state.moment !== null && state.moment >= t0 && state.moment < t1 ? state.moment : t0;
        select(t, ds.blocks.b[k], true); showLife(k);
      }
      document.getElementById("timeline").scrollIntoView({ block: "nearest" });
    }
    search.addEventListener("input", e => lookFor(e.target.value));
    search.addEventListener("keydown", e => {
      if (e.key === "Enter" && viewer.matches && viewer.matches.length) take(viewer.matches[0]);
      else if (e.key === "Escape") { search.value = ""; lookFor(""); results.hidden = true; }
    });
    search.addEventListener("blur", () => { results.hidden = true; });
    search.addEventListener("focus", () => { results.hidden = !(viewer.matches && viewer.matches.length); });
    document.getElementById("colour-by").addEventListener("change", e => { state.colour = e.target.value; state.focus = null; recolour(); draw(); });
    document.querySelectorAll(".tabs button").forEach(button => button.addEventListener("click", () => {
      document.querySelectorAll(".tabs button").forEach(b => b.classList.toggle("active", b === button));
      document.querySelectorAll(".tab").forEach(tab => { tab.hidden = tab.id !== "tab-" + button.dataset.tab; });
      if (button.dataset.tab === "compare" && app.compareDirty) { app.compareDirty = false; viewer.compared = GB.compare(app); }
      if (button.dataset.tab === "events") viewer.events = GB.fillEvents(app);
    }));
    window.addEventListener("keydown", e => {
      if (e.target.tagName === "INPUT" || e.target.tagName === "SELECT") return;
      if (e.key === "+" || e.key === "=") zoom(0.5); else if (e.key === "-") zoom(2);
      else if (!document.getElementById("tab-events").hidden && ["ArrowDown", "ArrowUp", "j", "k"].includes(e.key)) {
        e.preventDefault();
        const now = viewer.events ? viewer.events.at : 0;
        app.stepTo(now + (e.key === "ArrowDown" || e.key === "j" ? 1 : -1));
      }
    });
    window.addEventListener("resize", () => { app.measure(); draw(); flame(); });

    const first = roots[0];
    app.compareSpec = other ? { a: { source: "other", when: "peak" }, b: { source: "main", when: "peak" } }
      : { a: { source: "main", when: "peak" }, b: { source: "main", when: "end" } };
    Object.assign(viewer, { app, ds, budgets: ds.budgets, end: ds.end, state, GUTTER: GB.GUTTER, AXIS: GB.AXIS,
      laneRow: app.laneRow, drawnLanes: app.drawnLanes, xOf: app.xOf, tOf: app.tOf, draw, zoom, showLife, showLane, select,
      listBlocks, laneHit: (x, y) => GB.laneHit(app, x, y), addressHit: (x, y) => GB.addressHit(app, x, y),
      freeAt: (root, t) => GB.freeAt(ds, root, t), compare: () => (viewer.compared = GB.compare(app)) });
    Object.defineProperty(viewer, "LANE", { get: () => app.laneHeight });
    recolour(); buildTree(); GB.fillLeaks(app); GB.fillDenials(app); GB.compareControls(app);
    app.compareDirty = true;
    select(first === undefined || !blocksUsed && !ds.lanes[first].n ? null : ds.peakOf(first), first === undefined ? null : first);
    timings.drawn = performance.now();
    viewer.ready = true; document.body.dataset.ready = "1";
    setTimeout(() => {  // once shown: what zooming in will need, for the lanes drawn
      for (const b of app.drawnLanes.slice(0, 24)) GB.checkpoints(ds, ds.events(b));
      viewer.warm = true; document.body.dataset.warm = "1";
    }, 0);
  }
  window.addEventListener("error", e => viewer.errors.push(String(e.message)));
  main().catch(err => {
    viewer.errors.push(String(err && err.stack || err)); document.body.dataset.ready = "error";
    document.getElementById("note").textContent = "cannot show the data: " + err;
    console.error(err);
  });
})();
