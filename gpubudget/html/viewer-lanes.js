// gpubudget's memory viewer, part 2 of 6: the active-memory timeline. A lane per budget: its
// live blocks stacked as bands (coloured by the legend's key, ordered by key then by
// allocation), its used bytes as a line, its limit dashed, denials in red, the bytes its
// exited scope leaked. Each pixel column shows the moment of its highest total. Few events in
// view (and blocks a few pixels high): every block is its own band; many: bands per colour, from the events, or from a
// summary of the whole run in NB buckets when a column spans two of them or more.
(function () {
  const { formatSize, shortSize, sizeStep, lowerBound, upperBound, RGBA, RANKS } = GB;
  const GUTTER = 190, AXIS = 26, NB = 8192, FEW = 4000, SUMMARY_MIN = 20000;
  const LEAK = (0xff << 24 | 0x20 << 16 | 0x2d << 8 | 0xd9) >>> 0;
  const LIGHT = RGBA.map(c => {  // each colour mixed with white, for a band's top edge
    const mix = s => Math.round(((c >>> s) & 0xff) * 0.55 + 255 * 0.45) << s;
    return (0xff << 24 | mix(16) | mix(8) | mix(0)) >>> 0;
  });
  GB.GUTTER = GUTTER; GB.AXIS = AXIS;

  // The bytes a lane's height stands for: its limit, or its peak with room above where the
  // peak stays under a quarter of the limit (the limit is then named, not drawn).
  function laneScale(budget) {
    return budget.peak * 4 >= budget.limit || budget.peak <= 0 ? Math.max(budget.limit, budget.peak, 1) : budget.peak * 1.15;
  }
  GB.laneScale = laneScale;

  function laneHeight(count) { return count <= 3 ? 160 : count <= 6 ? 120 : count <= 12 ? 90 : 64; }

  function drawTimeAxis(ctx, app, height) {
    const s = app.state, span = s.v1 - s.v0, ds = app.ds;
    const [unit, len] = ds.timeUnit === "event" ? ["", 1] : GB.timeUnit(span);
    let step = Math.pow(10, Math.floor(Math.log10(span / len / 6))) * len;
    for (const m of [1, 2, 5, 10]) if (span / (step * m) <= 8) { step *= m; break; }
    ctx.fillStyle = "#667085"; ctx.strokeStyle = "#eaecf0"; ctx.font = "11px system-ui"; ctx.textAlign = "center";
    for (let t = Math.ceil(s.v0 / step) * step; t <= s.v1; t += step) {
      const x = app.xOf(t);
      ctx.beginPath(); ctx.moveTo(x, AXIS - 6); ctx.lineTo(x, height); ctx.stroke();
      ctx.fillText(ds.timeUnit === "event" ? "#" + Math.round(t) : +(t / len).toPrecision(6) + " " + unit, x, 12);
    }
    ctx.textAlign = "left";
  }
  GB.drawTimeAxis = drawTimeAxis;

  // The bands of one lane as an image: columns x rows device pixels, row 0 at the base.
  function Bands(columns, rows) {
    const image = new ImageData(Math.max(columns, 1), Math.max(rows, 1)), px = new Uint32Array(image.data.buffer);
    return {
      image,
      fill(c, from, to, colour, hatch) {  // rows [from, to) of column c, from the base up
        const a = Math.max(0, Math.round(from)), b = Math.min(rows, Math.round(to));
        for (let q = a; q < b; q++) px[(rows - 1 - q) * columns + c] = hatch && (c + q) % 8 < 3 ? LEAK : colour;
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
  // line's highest and lowest there: built once per lane and colouring.
  function summary(app, b) {
    const ds = app.ds, cache = app.summaries;
    if (cache.has(b)) return cache.get(b);
    const events = ds.events(b), blocks = ds.blocks, rank = app.keys.rank, times = ds.times;
    const sums = new Float64Array(RANKS), peak = new Float64Array(NB), keys = new Float64Array(NB * RANKS);
    let total = 0;
    for (const k of events.initial) { sums[rank[k]] += blocks.size[k]; total += blocks.size[k]; }
    const bucketOf = t => Math.min(NB - 1, Math.max(0, Math.floor(t / ds.end * NB)));
    let cur = 0;
    peak[0] = total; keys.set(sums, 0);
    for (let i = 0; i < events.n; i++) {
      const j = bucketOf(times[events.at[i]]);
      while (cur < j) { cur++; peak[cur] = total; keys.set(sums, cur * RANKS); }
      const e = events.ev[i], k = e > 0 ? e - 1 : -e - 1, size = e > 0 ? blocks.size[k] : -blocks.size[k];
      sums[rank[k]] += size; total += size;
      if (total > peak[cur]) { peak[cur] = total; keys.set(sums, cur * RANKS); }
    }
    while (cur < NB - 1) { cur++; peak[cur] = total; keys.set(sums, cur * RANKS); }
    const lane = ds.lanes[b], hi = new Float64Array(NB), lo = new Float64Array(NB);
    let used = 0, p = 0;
    for (let j = 0; j < NB; j++) {
      const until = (j + 1) / NB * ds.end;
      let h = used, l = used;
      while (p < lane.n && (lane.t[p] < until || j === NB - 1)) { used = lane.used[p++]; if (used > h) h = used; if (used < l) l = used; }
      hi[j] = h; lo[j] = l;
    }
    const made = { peak, keys, hi, lo };
    cache.set(b, made);
    return made;
  }

  function drawLane(app, ctx, b, top, height, ratio) {
    const ds = app.ds, s = app.state, budget = ds.budgets[b], w = app.plotWidth();
    const plotH = height - 14, base = top + height - 4, scale = laneScale(budget);
    const y = v => base - v / scale * plotH;
    // gutter: name, limit and peak, the size axis
    ctx.fillStyle = "#1d2330"; ctx.font = "12px system-ui";
    const name = "  ".repeat(Math.min(budget.depth, 6)) + budget.name;
    ctx.fillText(name.length > 22 ? name.slice(0, 21) + "…" : name, 4, top + 16);
    ctx.fillStyle = "#667085"; ctx.font = "11px system-ui";
    ctx.fillText(budget.limit ? "limit " + formatSize(budget.limit) + (budget.limit > scale ? " (above)" : "") : "no limit", 4, top + 30);
    ctx.fillText((ds.source === "torch" ? "reserved " : "peak ") + formatSize(budget.peak), 4, top + 43);
    ctx.strokeStyle = "#eaecf0"; ctx.beginPath(); ctx.moveTo(0, top + height); ctx.lineTo(GUTTER + w, top + height); ctx.stroke();
    ctx.textAlign = "right";
    const step = sizeStep(scale, plotH >= 100 ? 4 : 2);
    for (let v = 0; v <= scale * 1.0001; v += step) {
      ctx.fillStyle = "#98a2b3"; ctx.fillText(shortSize(v), GUTTER - 6, y(v) + 4);
      ctx.strokeStyle = "#f2f4f7"; ctx.beginPath(); ctx.moveTo(GUTTER, y(v)); ctx.lineTo(GUTTER + w, y(v)); ctx.stroke();
    }
    ctx.textAlign = "left";
    // the bands, at device resolution
    const cols = Math.round(w * ratio), rows = Math.round(plotH * ratio), bands = Bands(cols, rows);
    const pxPerByte = rows / scale, span = s.v1 - s.v0, events = ds.events(b);
    const lastCol = Math.min(cols, Math.ceil((ds.end - s.v0) / span * cols));
    const colEnd = c => upperBound(ds.times, s.v0 + (c + 1) / cols * span);  // event bound
    const first = ds.eventsBefore(b, s.v0), last = ds.eventsBefore(b, s.v1);
    let mode;
    const hi = new Float64Array(cols).fill(-1), lo = new Float64Array(cols);
    if (events.n >= SUMMARY_MIN && NB * span / ds.end >= 2 * cols && last - first > FEW) {
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
        const bound = colEnd(c), tCol = s.v0 + (c + 1) / cols * span;
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
            const leaked = ds.isLeak[k] && tCol > ds.budgets[ds.blocks.b[k]].exited;
            const filled = bands.fill(c, cum, cum + h, RGBA[r], leaked);
            if (filled >= 4) bands.fill(c, cum + h - 1, cum + h, leaked ? LEAK : LIGHT[r]);
            cum += h;
          }
          for (let j = at; j < i; j++) apply(events.ev[j]);
        } else {
          let cum = 0;
          for (let r = 0; r < RANKS; r++) if (best[r] > 0) { bands.fill(c, cum * pxPerByte, (cum + best[r]) * pxPerByte, RGBA[r]); cum += best[r]; }
        }
      }
    }
    ctx.putImageData(bands.image, Math.round(GUTTER * ratio), Math.round((base - plotH) * ratio));
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
    // what its scope leaked, where it exited
    if (budget.exited !== null && budget.exited >= s.v0 && budget.exited <= s.v1) {
      const leaked = ds.leaked[b];
      if (leaked > 0) {
        const x = app.xOf(budget.exited);
        ctx.fillStyle = "#d92d20"; ctx.fillRect(x - 1, base - plotH, 2, plotH);
        ctx.font = "11px system-ui"; ctx.fillText("leaked " + formatSize(leaked), Math.min(x + 4, GUTTER + w - 90), base - plotH + 12);
      }
    }
    const chosen = s.block;
    if (chosen !== null && ds.blocks.b[chosen] === b) {  // the chosen block's life
      const x0 = Math.max(GUTTER, app.xOf(Math.max(ds.t0(chosen), 0))), x1 = Math.min(GUTTER + w, app.xOf(Math.min(ds.t1(chosen), ds.end)));
      ctx.strokeStyle = "#f79009"; ctx.lineWidth = 2; ctx.strokeRect(x0, top + 2, Math.max(2, x1 - x0), height - 4); ctx.lineWidth = 1;
    }
    return mode;
  }

  GB.drawLanes = function (app) {
    const canvas = app.canvas, ctx = canvas.getContext("2d"), ds = app.ds, s = app.state;
    const ratio = window.devicePixelRatio || 1, width = canvas.clientWidth, lanes = app.drawnLanes;
    const height = app.laneHeight = laneHeight(lanes.length);
    const total = AXIS + lanes.length * height;
    canvas.style.height = total + "px";
    canvas.width = Math.round(width * ratio); canvas.height = Math.round(total * ratio);
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, total);
    drawTimeAxis(ctx, app, total);
    const modes = {};
    lanes.forEach((b, row) => { modes[b] = drawLane(app, ctx, b, AXIS + row * height, height, ratio); });
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

  // What is under (x, y) of the lanes: the lane, the moment, the block whose band it is.
  GB.laneHit = function (app, x, y) {
    const ds = app.ds, s = app.state, height = app.laneHeight, row = Math.floor((y - AXIS) / height);
    if (row < 0 || row >= app.drawnLanes.length || x < GUTTER) return null;
    const b = app.drawnLanes[row], budget = ds.budgets[b], w = app.plotWidth();
    const span = s.v1 - s.v0, c = Math.floor((x - GUTTER) / w * w), tA = s.v0 + c / w * span, tB = s.v0 + (c + 1) / w * span;
    const t = Math.min(Math.max(app.tOf(x), 0), ds.end);
    const events = ds.events(b), first = ds.eventsBefore(b, tA), bound = upperBound(ds.times, tB);
    let i = first, total = 0, peak, at = first;
    const live = ds.liveAtIndex(b, first), size = ds.blocks.size;
    for (const k of live) total += size[k];
    peak = total;
    while (i < events.n && events.at[i] < bound) {
      const e = events.ev[i++], k = e > 0 ? e - 1 : -e - 1;
      total += e > 0 ? size[k] : -size[k];
      if (total > peak) { peak = total; at = i; }
    }
    const state = at === first ? live : ds.liveAtIndex(b, at), rank = app.keys.rank;
    const sorted = Array.from(state).sort((p, q) => rank[p] - rank[q] || p - q);
    const plotH = height - 14, base = AXIS + row * height + height - 4;
    const bytes = (base - y) / plotH * laneScale(budget);
    let cum = 0, block = null;
    for (const k of sorted) { if (bytes >= cum && bytes < cum + size[k]) { block = k; break; } cum += size[k]; }
    return { lane: b, t, block, live: sorted, total: peak };
  };
})();
