// gpubudget's memory viewer, part 2 of 6: the active-memory timeline. A lane per budget: its
// live blocks stacked as bands (coloured by the legend's key, ordered by key then by
// allocation), its used bytes as a line, its limit dashed, denials in red, and at the
// record's end what its subtree leaked there (a leak by BudgetReport.leaks' rule: still live
// when the record ends, its budget's scope exited; before the end it is serving, drawn as
// any block). Each pixel column shows the moment of its highest total. Few events in
// view (and blocks a few pixels high): every block is its own band; many: bands per colour, from the events, or from a
// summary of the whole run in NB buckets when a column spans two of them or more.
(function () {
  const { formatSize, shortSize, sizeStep, lowerBound, upperBound, RGBA, RANKS } = GB;
  const GUTTER = 190, AXIS = 26, NB = 8192, FEW = 4000, SUMMARY_MIN = 20000;
  const LIGHT = RGBA.map(c => {  // each colour mixed with white, for a band's top edge
    const mix = s => Math.round(((c >>> s) & 0xff) * 0.55 + 255 * 0.45) << s;
    return (0xff << 24 | mix(16) | mix(8) | mix(0)) >>> 0;
  });
  GB.GUTTER = GUTTER; GB.AXIS = AXIS; GB.NB = NB; GB.summary = (app, b) => summary(app, b);

  // The bytes a lane's height stands for: its limit, or its peak with room above where the
  // peak stays under a quarter of the limit (the limit is then named, not drawn).
  function laneScale(budget) {
    return budget.peak * 4 >= budget.limit || budget.peak <= 0 ? Math.max(budget.limit, budget.peak, 1) : budget.peak * 1.15;
  }
  GB.laneScale = laneScale;

  function laneHeight(count) { return count <= 3 ? 160 : count <= 6 ? 120 : count <= 12 ? 90 : 64; }

  function drawTimeAxis(ctx, app, height, beneath, labels = true) {  // beneath: under what is drawn
    const s = app.state, span = s.v1 - s.v0, ds = app.ds;
    const [unit, len] = ds.timeUnit === "event" ? ["", 1] : GB.timeUnit(span);
    let step = Math.pow(10, Math.floor(Math.log10(span / len / 6))) * len;
    for (const m of [1, 2, 5, 10]) if (span / (step * m) <= 8) { step *= m; break; }
    ctx.fillStyle = "#667085"; ctx.strokeStyle = "#eaecf0"; ctx.font = "11px system-ui"; ctx.textAlign = "center";
    const ticks = [];
    for (let t = Math.ceil(s.v0 / step) * step; t <= s.v1; t += step) ticks.push(t);
    if (beneath) ctx.globalCompositeOperation = "destination-over";
    ctx.beginPath();
    for (const t of ticks) { const x = app.xOf(t); ctx.moveTo(x, AXIS - 6); ctx.lineTo(x, height); }
    ctx.stroke();
    ctx.globalCompositeOperation = "source-over";
    if (labels) for (const t of ticks) ctx.fillText(ds.timeUnit === "event" ? "#" + Math.round(t) : +(t / len).toPrecision(6) + " " + unit, app.xOf(t), 12);
    ctx.textAlign = "left";
  }
  GB.drawTimeAxis = drawTimeAxis;

  // The bands of one lane, written into the picture of every lane's plot (little-endian
  // RGBA words, top row first): row 0 of a lane at its base, rows going up.
  function Bands(px, columns, baseRow, rows) {
    return {
      fill(c, from, to, colour) {  // rows [from, to) of column c, from the base up
        const a = Math.max(0, Math.round(from)), b = Math.min(rows, Math.round(to));
        for (let q = a; q < b; q++) px[(baseRow - 1 - q) * columns + c] = colour;
        return b - a;
      },
    };
  }

  // A sorted live set for few events: keys rank * 2^32 + block, ascending.
  function Ordered(rank) {
    const keys = [];
    const keyOf = k => rank[k] * 4294967296 + k;
    return {
      keys,
      add(k) { const v = keyOf(k); keys.splice(lowerBound(keys, v), 0, v); },
      remove(k) { const v = keyOf(k), i = lowerBound(keys, v); if (keys[i] === v) keys.splice(i, 1); },
    };
  }

  // Per-colour bytes of a lane at the peak of every one of NB buckets of the run, and its used
  // line's highest and lowest there: built over its root's events for every lane of the root
  // with SUMMARY_MIN points or more, once per colouring. Pass one finds each bucket's peak
  // (the event after which it held the most); pass two copies the bytes per colour there,
  // once per bucket.
  function summary(app, b) {
    const ds = app.ds, cache = app.summaries;
    if (cache.has(b)) return cache.get(b);
    const root = ds.budgets[b].root, events = ds.events(root), blocks = ds.blocks, rank = app.keys.rank;
    const times = ds.times, size = blocks.size, owner = blocks.b, parent = ds.parentOf;
    const slot = new Int32Array(ds.budgets.length).fill(-1), states = [];
    for (const lane of ds.order) {
      if (ds.budgets[lane].root !== root || (ds.lanes[lane].n < SUMMARY_MIN && lane !== b) || cache.has(lane)) continue;
      slot[lane] = states.length;
      states.push({ lane, sums: new Float64Array(RANKS), total: 0, cur: 0, next: 0, peak: new Float64Array(NB),
        at: new Int32Array(NB), keys: new Float64Array(NB * RANKS) });
    }
    for (const k of events.initial) for (let a = owner[k]; a >= 0; a = parent[a]) if (slot[a] >= 0) { const st = states[slot[a]]; st.sums[rank[k]] += size[k]; st.total += size[k]; }
    const scale = NB / ds.end, ev = events.ev, when = events.at, n = events.n;
    for (const st of states) { st.peak[0] = st.total; st.at[0] = -1; }
    for (let i = 0; i < n; i++) {  // pass one
      const j = Math.min(NB - 1, Math.floor(times[when[i]] * scale));
      const e = ev[i], k = e > 0 ? e - 1 : -e - 1, delta = e > 0 ? size[k] : -size[k];
      for (let a = owner[k]; a >= 0; a = parent[a]) {
        if (slot[a] < 0) continue;
        const st = states[slot[a]];
        while (st.cur < j) { st.cur++; st.peak[st.cur] = st.total; st.at[st.cur] = i - 1; }  // carried in
        st.total += delta;
        if (st.total > st.peak[j]) { st.peak[j] = st.total; st.at[j] = i; }
      }
    }
    for (const st of states) while (st.cur < NB - 1) { st.cur++; st.peak[st.cur] = st.total; st.at[st.cur] = n - 1; }
    const copy = (st, until) => { while (st.next < NB && st.at[st.next] <= until) st.keys.set(st.sums, RANKS * st.next++); };
    for (const st of states) copy(st, -1);
    for (let i = 0; i < n; i++) {  // pass two: a lane's bytes change only at its own events
      const e = ev[i], k = e > 0 ? e - 1 : -e - 1, delta = e > 0 ? size[k] : -size[k], r = rank[k];
      for (let a = owner[k]; a >= 0; a = parent[a]) {
        if (slot[a] < 0) continue;
        const st = states[slot[a]];
        copy(st, i - 1);
        st.sums[r] += delta;
        copy(st, i);
      }
    }
    for (const st of states) {
      copy(st, n);
      const lane = ds.lanes[st.lane], hi = new Float64Array(NB), lo = new Float64Array(NB);
      let used = 0, p = 0;
      for (let j = 0; j < NB; j++) {
        const until = (j + 1) / NB * ds.end;
        let h = used, l = used;
        while (p < lane.n && (lane.t[p] < until || j === NB - 1)) { used = lane.used[p++]; if (used > h) h = used; if (used < l) l = used; }
        hi[j] = h; lo[j] = l;
      }
      cache.set(st.lane, { peak: st.peak, keys: st.keys, hi, lo });
    }
    return cache.get(b);
  }

  // Phase one: the lane's bands into the shared picture; what phase two needs to draw over it.
  function paintLane(app, b, top, height, ratio, px, columns) {
    const ds = app.ds, s = app.state, budget = ds.budgets[b], w = app.plotWidth();
    const plotH = height - 14, base = top + height - 4, scale = laneScale(budget);
    // the bands, at device resolution
    const cols = columns, rows = Math.round(plotH * ratio), bands = Bands(px, columns, Math.round(base * ratio), rows);
    const pxPerByte = rows / scale, span = s.v1 - s.v0, points = ds.lanes[b];
    const lastCol = Math.min(cols, Math.ceil((ds.end - s.v0) / span * cols));
    const colEnd = c => upperBound(ds.times, s.v0 + (c + 1) / cols * span);  // event bound
    let mode;
    const hi = new Float64Array(cols).fill(-1), lo = new Float64Array(cols);
    const inView = lowerBound(points.t, s.v1, points.n) - lowerBound(points.t, s.v0, points.n);
    if (points.n >= SUMMARY_MIN && NB * span / ds.end >= 2 * cols && inView > FEW) {
      mode = "summary";
      const sum = summary(app, b);
      for (let c = 0; c < lastCol; c++) {
        const j0 = Math.max(0, Math.floor((s.v0 + c / cols * span) / ds.end * NB));
        const j1 = Math.min(NB, Math.floor((s.v0 + (c + 1) / cols * span) / ds.end * NB));
        let best = j0, h = -1, l = Infinity;
        for (let j = j0; j < j1; j++) { if (sum.peak[j] > sum.peak[best]) best = j; if (sum.hi[j] > h) h = sum.hi[j]; if (sum.lo[j] < l) l = sum.lo[j]; }
        hi[c] = h; lo[c] = l;
        let cum = 0;
        for (let r = 0; r < RANKS; r++) { const v = sum.keys[best * RANKS + r]; if (v > 0) { bands.fill(c, cum * pxPerByte, (cum + v) * pxPerByte, RGBA[r]); cum += v; } }
      }
    } else {
      const events = ds.events(b), first = ds.eventsBefore(b, s.v0), last = ds.eventsBefore(b, s.v1);
      const live = ds.liveAtIndex(b, first), rank = app.keys.rank, size = ds.blocks.size;
      let total = 0;
      for (const k of live) total += size[k];
      const few = last - first <= FEW && live.length <= rows / 3;  // bands of a few pixels each
      mode = few ? "blocks" : "sweep";
      const sums = new Float64Array(RANKS), best = new Float64Array(RANKS);
      const order = few ? Ordered(rank) : null;
      for (const k of live) { if (few) order.add(k); else sums[rank[k]] += size[k]; }
      const apply = (e, undo) => {
        const add = (e > 0) !== !!undo, k = e > 0 ? e - 1 : -e - 1;
        total += add ? size[k] : -size[k];
        if (few) { if (add) order.add(k); else order.remove(k); } else sums[rank[k]] += add ? size[k] : -size[k];
      };
      let i = first;
      for (let c = 0; c < lastCol; c++) {
        const bound = colEnd(c);
        let peak = total, at = i;
        if (!few) best.set(sums);
        while (i < events.n && events.at[i] < bound) {
          apply(events.ev[i++]);
          if (total > peak) { peak = total; at = i; if (!few) best.set(sums); }
        }
        if (few) {
          for (let j = i - 1; j >= at; j--) apply(events.ev[j], true);
          let cum = 0;
          for (const key of order.keys) {
            const k = key % 4294967296, h = size[k] * pxPerByte, r = rank[k];
            const filled = bands.fill(c, cum, cum + h, RGBA[r]);
            if (filled >= 4) bands.fill(c, cum + h - 1, cum + h, LIGHT[r]);
            cum += h;
          }
          for (let j = at; j < i; j++) apply(events.ev[j]);
        } else {
          let cum = 0;
          for (let r = 0; r < RANKS; r++) if (best[r] > 0) { bands.fill(c, cum * pxPerByte, (cum + best[r]) * pxPerByte, RGBA[r]); cum += best[r]; }
        }
      }
    }
    // the used line: highest and lowest per column
    if (mode !== "summary") {
      const lane = ds.lanes[b];
      let p = lowerBound(lane.t, s.v0, lane.n), used = p > 0 ? lane.used[p - 1] : 0;
      for (let c = 0; c < lastCol; c++) {
        const until = s.v0 + (c + 1) / cols * span;
        let h = used, l = used;
        while (p < lane.n && lane.t[p] < until) { used = lane.used[p++]; if (used > h) h = used; if (used < l) l = used; }
        hi[c] = h; lo[c] = l;
      }
    }
    return { mode, hi, lo, lastCol };
  }

  // Phase two: over the picture, the lane's gutter, grid (beneath the bands), used line,
  // limit, leaks and the chosen block.
  function drawLane(app, ctx, b, top, height, ratio, painted) {
    const ds = app.ds, s = app.state, budget = ds.budgets[b], w = app.plotWidth();
    const plotH = height - 14, base = top + height - 4, scale = laneScale(budget);
    const y = v => base - v / scale * plotH, { hi, lo, lastCol } = painted;
    ctx.fillStyle = "#1d2330"; ctx.font = "12px system-ui";
    const name = "  ".repeat(Math.min(budget.depth, 6)) + budget.name;
    ctx.fillText(name.length > 22 ? name.slice(0, 21) + "…" : name, 4, top + 16);
    ctx.fillStyle = "#667085"; ctx.font = "11px system-ui";
    ctx.fillText(budget.limit ? "limit " + formatSize(budget.limit) + (budget.limit > scale ? " (above)" : "") : "no limit", 4, top + 30);
    ctx.fillText((ds.source === "torch" ? "reserved " : "peak ") + formatSize(budget.peak), 4, top + 43);
    ctx.strokeStyle = "#eaecf0"; ctx.beginPath(); ctx.moveTo(0, top + height); ctx.lineTo(GUTTER + w, top + height); ctx.stroke();
    const step = sizeStep(scale, plotH >= 100 ? 4 : 2);
    ctx.globalCompositeOperation = "destination-over";  // the grid beneath the bands
    ctx.strokeStyle = "#f2f4f7"; ctx.beginPath();
    for (let v = 0; v <= scale * 1.0001; v += step) { ctx.moveTo(GUTTER, y(v)); ctx.lineTo(GUTTER + w, y(v)); }
    ctx.stroke();
    ctx.globalCompositeOperation = "source-over";
    ctx.fillStyle = "#98a2b3"; ctx.textAlign = "right";
    for (let v = 0; v <= scale * 1.0001; v += step) ctx.fillText(shortSize(v), GUTTER - 6, y(v) + 4);
    ctx.textAlign = "left";
    ctx.strokeStyle = "#1d2330"; ctx.lineWidth = 1.2; ctx.beginPath();
    for (let c = 0; c < lastCol; c++) {
      const x = GUTTER + c / ratio;
      if (c === 0) ctx.moveTo(x, y(hi[c])); else ctx.lineTo(x, y(hi[c]));
      if (lo[c] < hi[c]) { ctx.lineTo(x, y(lo[c])); ctx.lineTo(x, y(hi[c])); }
    }
    ctx.stroke(); ctx.lineWidth = 1;
    if (budget.limit && budget.limit <= scale) {
      ctx.strokeStyle = "#475467"; ctx.setLineDash([5, 4]); ctx.beginPath();
      ctx.moveTo(GUTTER, y(budget.limit)); ctx.lineTo(GUTTER + w, y(budget.limit)); ctx.stroke(); ctx.setLineDash([]);
    }
    // what its subtree leaked: at the record's end, where report()'s rule says so
    const leaked = ds.leakedBelow[b];
    if (leaked > 0 && ds.end >= s.v0 && ds.end <= s.v1) {
      const x = app.xOf(ds.end), text = "leaked at the end: " + formatSize(leaked);
      ctx.fillStyle = "#d92d20"; ctx.fillRect(x - 2, base - plotH, 3, plotH);
      ctx.font = "11px system-ui";
      ctx.fillText(text, Math.max(GUTTER + 4, x - 8 - ctx.measureText(text).width), base - plotH + 12);
    }
    const chosen = s.block;
    if (chosen !== null && ds.blocks.b[chosen] === b) {  // the chosen block's life
      const x0 = Math.max(GUTTER, app.xOf(Math.max(ds.t0(chosen), 0))), x1 = Math.min(GUTTER + w, app.xOf(Math.min(ds.t1(chosen), ds.end)));
      ctx.strokeStyle = "#f79009"; ctx.lineWidth = 2; ctx.strokeRect(x0, top + 2, Math.max(2, x1 - x0), height - 4); ctx.lineWidth = 1;
    }
  }

  GB.drawLanes = function (app) {
    const canvas = app.canvas, ctx = canvas.getContext("2d"), ds = app.ds, s = app.state;
    const ratio = window.devicePixelRatio || 1, width = app.sizes.lanes, lanes = app.drawnLanes;
    const height = app.laneHeight = laneHeight(lanes.length);
    const total = AXIS + lanes.length * height;
    canvas.style.height = total + "px";
    canvas.width = Math.round(width * ratio); canvas.height = Math.round(total * ratio);
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, total);
    // every lane's bands in one picture, put first (before any other drawing: cheap then)
    const columns = Math.max(Math.round(app.plotWidth() * ratio), 1), rows = Math.max(Math.round(total * ratio), 1);
    const image = new ImageData(columns, rows), px = new Uint32Array(image.data.buffer);
    const painted = lanes.map((b, row) => paintLane(app, b, AXIS + row * height, height, ratio, px, columns));
    ctx.putImageData(image, Math.round(GUTTER * ratio), 0);
    drawTimeAxis(ctx, app, total, true);
    const modes = {};
    lanes.forEach((b, row) => { modes[b] = painted[row].mode; drawLane(app, ctx, b, AXIS + row * height, height, ratio, painted[row]); });
    let denials = 0;
    ctx.fillStyle = "#d92d20";
    for (const [t, b] of ds.denials) {
      const row = app.laneRow.get(b);
      if (row === undefined || t < s.v0 || t > s.v1) continue;
      const x = app.xOf(t), top = AXIS + row * height + 3;
      ctx.beginPath(); ctx.moveTo(x - 5, top); ctx.lineTo(x + 5, top); ctx.lineTo(x, top + 9); ctx.fill();
      ctx.fillRect(x - 0.5, top, 1, height - 8);
      denials++;
    }
    if (s.moment !== null && s.moment >= s.v0 && s.moment <= s.v1) {
      ctx.fillStyle = "#f79009"; ctx.fillRect(app.xOf(s.moment) - 1, AXIS - 6, 2, total);
    }
    return { lanes: lanes.length, denials, modes };
  };

  // What is under (x, y) of the lanes: the lane, the block whose band it is, and the moment
  // the column shows (its highest total, as drawn): a time, whose live blocks are what the
  // tooltip counts and what a click lists, so both say one number.
  GB.laneHit = function (app, x, y) {
    const ds = app.ds, s = app.state, height = app.laneHeight, row = Math.floor((y - AXIS) / height);
    if (row < 0 || row >= app.drawnLanes.length || x < GUTTER) return null;
    const b = app.drawnLanes[row], budget = ds.budgets[b], w = app.plotWidth();
    const span = s.v1 - s.v0, c = Math.floor((x - GUTTER) / w * w), tA = s.v0 + c / w * span, tB = s.v0 + (c + 1) / w * span;
    const times = ds.times, events = ds.events(b), first = ds.eventsBefore(b, tA), bound = upperBound(times, tB);
    let i = first, total = 0, peak, at = first, t = Math.min(Math.max(tA, 0), ds.end);
    const live = ds.liveAtIndex(b, first), size = ds.blocks.size;
    for (const k of live) total += size[k];
    peak = total;
    while (i < events.n && events.at[i] < bound) {
      const e = events.ev[i++], k = e > 0 ? e - 1 : -e - 1;
      total += e > 0 ? size[k] : -size[k];
      // a state is a moment's only once every event of its time is in
      if ((i === events.n || times[events.at[i]] !== times[events.at[i - 1]]) && total > peak) {
        peak = total; at = i; t = times[events.at[i - 1]];
      }
    }
    if (at === first && i === first) t = Math.min(Math.max(app.tOf(x), 0), ds.end);  // nothing happens in the column
    const state = at === first ? live : ds.liveAtIndex(b, at), rank = app.keys.rank;
    const sorted = Array.from(state).sort((p, q) => rank[p] - rank[q] || p - q);
    const plotH = height - 14, base = AXIS + row * height + height - 4;
    const bytes = (base - y) / plotH * laneScale(budget);
    let cum = 0, block = null;
    for (const k of sorted) { if (bytes >= cum && bytes < cum + size[k]) { block = k; break; } cum += size[k]; }
    return { lane: b, t, block, live: sorted, total: peak };
  };
})();
