// gpubudget's memory viewer, part 1 of 6: the data. Decoding the page's columns, formats,
// and a dataset's questions: the budgets and their points, every block's life, the blocks of
// a budget and its descendants in event order, and which of them are live at a moment
// (checkpoints of the live set every K events, so a moment costs at most K steps).
"use strict";
const GB = (window.gpubudgetParts = window.gpubudgetParts || {});
(function () {
  const B64 = typeof Uint8Array.fromBase64 === "function";
  function bytesOf(b64) {
    if (B64) return Uint8Array.fromBase64(b64);
    const text = atob(b64), bytes = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
    return bytes;
  }
  function decode(b64) {
    const stream = new Blob([bytesOf(b64)]).stream().pipeThrough(new DecompressionStream("deflate"));
    return new Response(stream).arrayBuffer();
  }
  const TYPES = { u8: Uint8Array, i8: Int8Array, u16: Uint16Array, i16: Int16Array, u32: Uint32Array,
    i32: Int32Array, f64: Float64Array };
  async function columns(spec, keys) {  // one after the other: in parallel is no faster
    const out = { n: spec.n };
    for (const k of keys) out[k] = new TYPES[spec[k].type](await decode(spec[k].data));
    return out;
  }

  const UNITS = [["TiB", 2 ** 40], ["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 1024]];
  function formatSize(n) {
    for (const [unit, size] of UNITS) if (Math.abs(n) >= size) return (n / size).toFixed(2) + " " + unit;
    return Math.round(n) + " B";
  }
  function shortSize(n) {  // axis labels: "512 MiB", "1.5 GiB"
    for (const [unit, size] of UNITS) if (Math.abs(n) >= size) return +(n / size).toFixed(2) + " " + unit;
    return Math.round(n) + " B";
  }
  function sizeStep(scale, ticks) {  // a power of two of a unit, about scale / ticks
    const raw = Math.max(scale / ticks, 1);
    return Math.pow(2, Math.round(Math.log2(raw)));
  }
  const TIME_UNITS = [["h", 3600], ["min", 60], ["s", 1], ["ms", 1e-3], ["µs", 1e-6]];
  function timeUnit(span) {
    for (const [name, len] of TIME_UNITS) if (span >= 2 * len) return [name, len];
    return TIME_UNITS[TIME_UNITS.length - 1];
  }
  function lowerBound(arr, value, n) {
    let lo = 0, hi = n === undefined ? arr.length : n;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (arr[mid] < value) lo = mid + 1; else hi = mid; }
    return lo;
  }
  function upperBound(arr, value, n) {
    let lo = 0, hi = n === undefined ? arr.length : n;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (arr[mid] <= value) lo = mid + 1; else hi = mid; }
    return lo;
  }
  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }
  // Eleven colours for the keys that hold the most bytes, grey for the others, light grey
  // for blocks without one. Red and orange stay for denials, leaks and the selection.
  const PALETTE = ["#3d7bd9", "#59a14f", "#8e6bbf", "#2a9d8f", "#d4a72c", "#e377c2", "#9c755f",
    "#8fb8ea", "#a3b84a", "#c5a3e0", "#1f6f78", "#98a2b3", "#d0d5dd"];
  const OTHER = 11, NONE = 12, RANKS = 13;
  const RGBA = PALETTE.map(hex => {  // little-endian ABGR words for ImageData
    const v = parseInt(hex.slice(1), 16);
    return (0xff << 24 | (v & 0xff) << 16 | (v >> 8 & 0xff) << 8 | v >> 16) >>> 0;
  });
  Object.assign(GB, { decode, columns, formatSize, shortSize, sizeStep, timeUnit, lowerBound,
    upperBound, el, PALETTE, RGBA, OTHER, NONE, RANKS });

  GB.loadDataset = async function (raw) {
    const ds = { raw, title: raw.title, source: raw.source, timeUnit: raw.timeUnit || "s",
      notes: raw.notes || [], tags: raw.tags, frames: raw.frames, stacks: raw.stacks,
      denials: raw.denials, regions: raw.regions, mappings: raw.mappings || [] };
    let times = (await columns(raw.times, ["t"])).t;
    if (raw.times.t.steps === "ns") {  // nanoseconds from one event to the next: add them up
      const steps = times;
      times = new Float64Array(steps.length);
      for (let i = 0, ns = 0; i < steps.length; i++) { ns += steps[i]; times[i] = ns / 1e9; }
    }
    ds.times = times;
    const points = await columns(raw.points, ["at", "b", "used"]);
    const blocks = await columns(raw.blocks, ["b", "size", "tag", "addr", "from", "to", "stack"].concat(
      raw.blocks.lost ? ["lost"] : [], raw.blocks.stream ? ["stream"] : []));
    blocks.req = new Float64Array(blocks.n).fill(-1);  // the bytes asked for, -1: not known
    if (blocks.lost) for (let k = 0; k < blocks.n; k++) { if (blocks.lost[k] >= 0) blocks.req[k] = blocks.size[k] - blocks.lost[k]; }
    if (!blocks.stream) blocks.stream = new Uint8Array(blocks.n);  // one stream: no column
    ds.blocks = blocks;
    ds.streams = raw.streams && raw.streams.length ? raw.streams : ["stream 0"];
    ds.requested = k => blocks.req[k] >= 0 ? blocks.req[k] : blocks.size[k];  // what was asked for
    ds.rounding = k => blocks.req[k] >= 0 ? blocks.size[k] - blocks.req[k] : 0;  // lost to rounding
    ds.end = raw.end > 0 ? raw.end : 1e-6;
    const budgets = ds.budgets = raw.budgets.map((b, i) => ({ index: i, name: b[0], parent: b[1],
      limit: b[2], reserve: b[3], entered: b[4], exited: b[5], peak: b[6], allocations: b[7],
      frees: b[8], denied: b[9], door: b[10] || null, children: [] }));
    for (const b of budgets) if (b.parent !== null) budgets[b.parent].children.push(b.index);
    ds.parentOf = Int32Array.from(budgets, b => b.parent === null ? -1 : b.parent);
    const order = ds.order = [];  // depth first, parents before children
    const todo = budgets.filter(b => b.parent === null).map(b => b.index).reverse();
    while (todo.length) { const i = todo.pop(); order.push(i); todo.push(...budgets[i].children.slice().reverse()); }
    const pre = ds.pre = new Int32Array(budgets.length), post = ds.post = new Int32Array(budgets.length);
    order.forEach((b, i) => { pre[b] = i; });
    for (let i = order.length - 1; i >= 0; i--) {
      const b = order[i], kids = budgets[b].children;
      post[b] = kids.length ? Math.max(...kids.map(c => post[c])) : pre[b];
    }
    const seen = new Map();
    for (const i of order) {
      const b = budgets[i];
      b.depth = b.parent === null ? 0 : budgets[b.parent].depth + 1;
      b.root = b.parent === null ? i : budgets[b.parent].root;
      const path = (b.parent === null ? "" : budgets[b.parent].path + "/") + b.name;
      const count = seen.get(path) || 0;
      seen.set(path, count + 1);
      b.path = path; b.key = path + "#" + count;
    }
    ds.within = (b, lane) => pre[b] >= pre[lane] && pre[b] <= post[lane];

    // Each budget's points, in time order: t, used.
    const counts = new Int32Array(budgets.length);
    for (let i = 0; i < points.n; i++) counts[points.b[i]]++;
    ds.lanes = budgets.map((b, i) => ({ n: 0, t: new Float64Array(counts[i]), used: new Float64Array(counts[i]) }));
    for (let i = 0, e = 0; i < points.n; i++) {  // each point's event: the steps added up
      e += points.at[i];
      const lane = ds.lanes[points.b[i]], k = lane.n++;
      lane.t[k] = times[e]; lane.used[k] = points.used[i];
    }
    ds.t0 = k => blocks.from[k] >= 0 ? times[blocks.from[k]] : -Infinity;
    ds.t1 = k => blocks.to[k] >= 0 ? times[blocks.to[k]] : Infinity;
    ds.leaks = [];
    for (let k = 0; k < blocks.n; k++) if (blocks.to[k] < 0 && budgets[blocks.b[k]].exited !== null) ds.leaks.push(k);
    ds.leaks.sort((a, b) => blocks.size[b] - blocks.size[a]);
    ds.isLeak = new Uint8Array(blocks.n);
    ds.leaked = new Float64Array(budgets.length);  // bytes each budget's scope leaked
    ds.leakedBelow = new Float64Array(budgets.length);  // ... and its descendants'
    for (const k of ds.leaks) {
      ds.isLeak[k] = 1; ds.leaked[blocks.b[k]] += blocks.size[k];
      for (let a = blocks.b[k]; a >= 0; a = ds.parentOf[a]) ds.leakedBelow[a] += blocks.size[k];
    }
    // Where each budget's memory lived: from its entry to its release (its scope exited and
    // its subtree's last block freed), the record's end while any is live then.
    // (each budget's own blocks first, then children into parents: no walk up per block)
    ds.lived = budgets.map(b => [b.entered, b.exited === null ? ds.end : b.exited]);
    for (let k = 0; k < blocks.n; k++) {
      const t1 = blocks.to[k] >= 0 ? times[blocks.to[k]] : ds.end, t0 = blocks.from[k] >= 0 ? times[blocks.from[k]] : 0;
      const span = ds.lived[blocks.b[k]];
      if (t1 > span[1]) span[1] = t1;
      if (t0 < span[0]) span[0] = t0;
    }
    for (let i = order.length - 1; i >= 0; i--) {
      const b = order[i], parent = budgets[b].parent;
      if (parent === null) continue;
      const span = ds.lived[b], up = ds.lived[parent];
      if (span[1] > up[1]) up[1] = span[1];
      if (span[0] < up[0]) up[0] = span[0];
    }
    ds.events = laneEvents(ds);
    ds.liveAt = (lane, t) => liveAtIndex(ds, ds.events(lane), eventsBefore(ds, lane, t));
    ds.eventsBefore = (lane, t) => eventsBefore(ds, lane, t);
    ds.liveAtIndex = (lane, i) => liveAtIndex(ds, ds.events(lane), i);
    ds.peakOf = b => {  // the first moment of the budget's highest used
      const lane = ds.lanes[b];
      let best = 0;
      for (let i = 1; i < lane.n; i++) if (lane.used[i] > lane.used[best]) best = i;
      return lane.n ? lane.t[best] : 0;
    };
    ds.stackText = k => blocks.stack[k] >= 0 ? ds.stacks[blocks.stack[k]].map(f => ds.frames[f]) : [];
    ds.tagText = k => blocks.tag[k] >= 0 ? ds.tags[blocks.tag[k]] : "";
    ds.formatTime = (t, span) => {
      if (!Number.isFinite(t)) return "—";
      if (ds.timeUnit === "event") return "#" + Math.round(t);
      const [name, len] = timeUnit(span || Math.abs(t) || 1e-6), v = t / len;
      return (Math.abs(v) >= 100 ? v.toFixed(0) : v.toPrecision(3)) + " " + name;
    };
    return ds;
  };

  // The block events of every budget's subtree, in event order: +(k+1) when block k is
  // allocated, -(k+1) when it is freed (ends first where both share an event), with the
  // event index of each; the blocks live from the start (allocated before the record).
  function laneEvents(ds) {
    const blocks = ds.blocks, n = blocks.n, cache = new Map();
    let all = null;
    function everything() {
      if (all) return all;
      const slots = new Int32Array(ds.times.length + 1);
      for (let k = 0; k < n; k++) {
        if (blocks.from[k] >= 0) slots[blocks.from[k] + 1]++;
        if (blocks.to[k] >= 0) slots[blocks.to[k] + 1]++;
      }
      for (let i = 1; i < slots.length; i++) slots[i] += slots[i - 1];
      const total = slots[slots.length - 1], ev = new Int32Array(total), at = new Int32Array(total);
      for (let k = 0; k < n; k++) if (blocks.to[k] >= 0) { const s = slots[blocks.to[k]]++; ev[s] = -(k + 1); at[s] = blocks.to[k]; }
      for (let k = 0; k < n; k++) if (blocks.from[k] >= 0) { const s = slots[blocks.from[k]]++; ev[s] = k + 1; at[s] = blocks.from[k]; }
      const initial = [];
      for (let k = 0; k < n; k++) if (blocks.from[k] < 0) initial.push(k);
      all = { n: total, ev, at, initial: Int32Array.from(initial) };
      return all;
    }
    // Every lane's events, made for many lanes in one pass: every root's from all events,
    // every budget below a root from the root's (each event goes to each of its ancestors).
    function distribute(base, slot, lanes, up) {
      const b = blocks.b, count = new Int32Array(lanes.length);
      for (let i = 0; i < base.n; i++) { const e = base.ev[i]; up(b[e > 0 ? e - 1 : -e - 1], s => { count[s]++; }); }
      const made = lanes.map((lane, s) => ({ n: count[s], ev: new Int32Array(count[s]), at: new Int32Array(count[s]), initial: [] }));
      const fill = new Int32Array(lanes.length);
      for (let i = 0; i < base.n; i++) {
        const e = base.ev[i], t = base.at[i];
        up(b[e > 0 ? e - 1 : -e - 1], s => { const m = made[s], j = fill[s]++; m.ev[j] = e; m.at[j] = t; });
      }
      for (const k of base.initial) up(b[k], s => { made[s].initial.push(k); });
      lanes.forEach((lane, s) => { made[s].initial = Int32Array.from(made[s].initial); cache.set(lane, made[s]); });
    }
    return function events(lane) {
      let found = cache.get(lane);
      if (found) return found;
      const source = everything(), budgets = ds.budgets, parent = ds.parentOf;
      const roots = ds.order.filter(i => budgets[i].parent === null);
      if (budgets[lane].parent === null && roots.length === 1) {
        cache.set(lane, { n: source.n, ev: source.ev, at: source.at, initial: source.initial });
      } else if (budgets[lane].parent === null) {
        const slot = new Int32Array(budgets.length).fill(-1);
        roots.forEach((r, s) => { slot[r] = s; });
        distribute(source, slot, roots, (x, visit) => visit(slot[budgets[x].root]));
      } else {
        const root = budgets[lane].root, base = events(root), lanes = ds.order.filter(i => budgets[i].root === root && i !== root);
        const slot = new Int32Array(budgets.length).fill(-1);
        lanes.forEach((l, s) => { slot[l] = s; });
        distribute(base, slot, lanes, (x, visit) => { for (let a = x; a !== root; a = parent[a]) visit(slot[a]); });
      }
      return cache.get(lane);
    };
  }

  function eventsBefore(ds, lane, t) {  // the lane's events at or before t
    const events = ds.events(lane);
    return lowerBound(events.at, upperBound(ds.times, t), events.n);
  }

  // The live set: a dense array and each block's place in it (-1: not live).
  function LiveSet(ds) {
    if (!ds.pos) { ds.pos = new Int32Array(ds.blocks.n).fill(-1); }
    const pos = ds.pos;
    let items = new Int32Array(64), n = 0;
    return {
      add(k) { if (n === items.length) { const more = new Int32Array(n * 2); more.set(items); items = more; } pos[k] = n; items[n++] = k; },
      remove(k) { const i = pos[k]; if (i < 0) return; const last = items[--n]; items[i] = last; pos[last] = i; pos[k] = -1; },
      apply(e) { if (e > 0) this.add(e - 1); else this.remove(-e - 1); },
      get size() { return n; },
      snapshot() { return items.slice(0, n); },
      clear() { for (let i = 0; i < n; i++) pos[items[i]] = -1; n = 0; },
    };
  }
  GB.LiveSet = LiveSet;

  function checkpoints(ds, events) {
    if (events.cps) return events;
    let live = events.initial.length, most = live;
    for (let i = 0; i < events.n; i++) { live += events.ev[i] > 0 ? 1 : -1; if (live > most) most = live; }
    const K = Math.max(1024, 2 * most), cps = [], set = LiveSet(ds);  // memory: n / 2 per lane
    for (const k of events.initial) set.add(k);
    for (let i = 0; i < events.n; i++) {
      if (i % K === 0) cps.push(set.snapshot());
      set.apply(events.ev[i]);
    }
    if (events.n % K === 0) cps.push(set.snapshot());
    set.clear();
    events.K = K; events.cps = cps; events.most = most;
    return events;
  }
  GB.checkpoints = checkpoints;

  function liveAtIndex(ds, events, i) {  // the blocks live after the lane's first i events
    if (events.last && events.last.i === i) return events.last.live.slice();
    const set = LiveSet(ds);
    if (events.cps || events.asked) {  // asked again: checkpoints pay
      checkpoints(ds, events);
      const c = Math.min(Math.floor(i / events.K), events.cps.length - 1);
      for (const k of events.cps[c]) set.add(k);
      for (let j = c * events.K; j < i; j++) set.apply(events.ev[j]);
    } else {  // the first question: one pass, no checkpoints yet
      for (const k of events.initial) set.add(k);
      for (let j = 0; j < i; j++) set.apply(events.ev[j]);
    }
    events.asked = true;
    const out = set.snapshot();
    set.clear();
    events.last = { i, live: out };
    return out.slice();
  }

  // Colour keys: what a block is coloured by (its tag, its innermost frame, its budget),
  // and each key's rank: the eleven keys with the most bytes allocated first.
  GB.colourKeys = function (ds, mode, focus) {
    const blocks = ds.blocks, n = blocks.n;
    if (mode === "focus") {  // one tag's blocks in the first colour, every other block grey
      const rank = new Uint8Array(n);
      for (let k = 0; k < n; k++) rank[k] = blocks.tag[k] === focus ? 0 : NONE;
      return { mode, focus, rank, legend: [{ rank: 0, label: ds.tags[focus], bytes: 0 }, { rank: NONE, label: "the other blocks", bytes: 0 }] };
    }
    let key;
    if (mode === "tag") key = blocks.tag;
    else if (mode === "budget") key = blocks.b;
    else if (mode === "stream") key = blocks.stream;
    else {
      const innermost = Int32Array.from(ds.stacks, s => s.length ? s[s.length - 1] : -1);
      key = new Int32Array(n);
      for (let k = 0; k < n; k++) key[k] = blocks.stack[k] >= 0 ? innermost[blocks.stack[k]] : -1;
    }
    const keys = mode === "tag" ? ds.tags.length : mode === "budget" ? ds.budgets.length : mode === "stream" ? ds.streams.length : ds.frames.length;
    const bytes = new Float64Array(keys);
    for (let k = 0; k < n; k++) if (key[k] >= 0) bytes[key[k]] += blocks.size[k];
    const used = [];
    for (let k = 0; k < keys; k++) if (bytes[k] > 0) used.push([k, bytes[k]]);
    const top = used.sort((a, b) => b[1] - a[1] || a[0] - b[0]).slice(0, OTHER);
    const rankOf = new Uint8Array(keys).fill(OTHER);
    top.forEach(([k], i) => { rankOf[k] = i; });
    const rank = new Uint8Array(n);
    for (let k = 0; k < n; k++) rank[k] = key[k] < 0 ? NONE : rankOf[key[k]];
    const label = k => mode === "tag" ? ds.tags[k] : mode === "budget" ? ds.budgets[k].name : mode === "stream" ? ds.streams[k] : ds.frames[k];
    const legend = top.map(([k, total], i) => ({ rank: i, label: label(k), bytes: total }));
    if (used.length > OTHER) legend.push({ rank: OTHER, label: "other " + mode + "s", bytes: 0 });
    if (rank.some(r => r === NONE)) legend.push({ rank: NONE, label: mode === "tag" ? "no tag" : mode === "frame" ? "no stack" : "none", bytes: 0 });
    return { mode, rank, legend };
  };
})();
